"""A light MongoDB-wire server for the benchmark: recorded answers after a set delay.

nx-27017, the sample backend of the tests, spends 2-11 ms of CPU per aggregation and
saturates at a few hundred operations a second on a small machine: in a throughput
scenario it would measure itself. This server costs tens of microseconds per operation
and waits ``delay_ms`` with ``gevent.sleep`` (no CPU), so a benchmark measures the
service, not the backend.

It speaks OP_MSG (opcode 2013), which pymongo 4.20 uses for everything, the handshake
included (legacy OP_QUERY is not sent, and a connection sending it is closed)::

    hello, isMaster, ismaster    a standalone writable primary, wire versions 0..21,
                                 sessions supported (no topologyVersion: pymongo polls)
    ping, buildInfo, endSessions, killCursors    ok
    aggregate                    the documents recorded for (collection, stages after
                                 the leading $match), see bench.servers.mongo_answers; one batch,
                                 cursor id 0. No recording: ok 0, code 2 (BadValue)
    benchStats                   the bench's own: {aggregations: answered so far}, at once
    anything else                ok 0, code 59 (CommandNotFound)

Every command but the handshake ones (hello, isMaster, ping, buildInfo, endSessions) is
answered ``delay_ms`` after it arrived. When the command's ``maxTimeMS`` is shorter than
the delay, the answer is MongoDB's ``MaxTimeMSExpired`` (code 50) after ``maxTimeMS``.

    python -m bench.servers.mongo_responder --port 0 --delay-ms 20 --answers bench/fixtures/mongo_answers.json

prints ``READY {"host": ..., "port": ...}`` once it accepts connections, and stops on
SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import logging
import socket
import struct
from typing import Any

import bson
import gevent
from bson.int64 import Int64
from gevent.server import StreamServer

from bench.servers.mongo_answers import DEFAULT_ANSWERS_PATH, RecordedAnswers, stages_after_match
from bench.servers.ready import announce_ready, wait_for_stop_signal

__all__ = [
    "OP_MSG",
    "MAX_WIRE_VERSION",
    "WireProtocolError",
    "MongoResponder",
    "STATS_COMMAND",
    "decode_op_msg",
    "encode_op_msg",
    "main",
]

log = logging.getLogger(__name__)

OP_MSG = 2013
#: The command the bench asks how many aggregations were answered (no MongoDB has it).
STATS_COMMAND = "benchStats"
MAX_WIRE_VERSION = 21  # MongoDB 7.0; pymongo 4.20 needs at least 9
MAX_MESSAGE_BYTES = 48_000_000
_HEADER = struct.Struct("<iiii")  # messageLength, requestID, responseTo, opCode
_CHECKSUM_PRESENT = 1
_MORE_TO_COME = 2
_UNDELAYED = frozenset({"hello", "ismaster", "ping", "buildinfo", "endsessions"})
_REPLY_CACHE_LIMIT = 1024
_OK = bson.encode({"ok": 1.0})


class WireProtocolError(Exception):
    """A message that is not a well-formed OP_MSG; its connection is closed."""


def decode_op_msg(payload: bytes) -> dict[str, Any]:
    """The command in an OP_MSG payload (after the 16-byte header), document sequences merged in.

    Raises :class:`WireProtocolError` for an unknown section kind or a missing body.
    """
    flags = int.from_bytes(payload[:4], "little")
    end = len(payload) - (4 if flags & _CHECKSUM_PRESENT else 0)
    command: dict[str, Any] | None = None
    sequences: dict[str, list[Any]] = {}
    position = 4
    while position < end:
        kind, size = (
            payload[position],
            int.from_bytes(payload[position + 1 : position + 5], "little"),
        )
        section = payload[position + 1 : position + 1 + size]
        position += 1 + size
        if kind == 0:
            command = bson.decode(section)
        elif kind == 1:
            name_end = section.index(b"\x00", 4)
            sequences[section[4:name_end].decode()] = bson.decode_all(section[name_end + 1 :])
        else:
            raise WireProtocolError(f"unknown OP_MSG section kind {kind}")
    if command is None or not command:
        raise WireProtocolError("OP_MSG without a command body")
    command.update(sequences)
    return command


def encode_op_msg(body: bytes, request_id: int, response_to: int) -> bytes:
    """One OP_MSG reply: header, no flags, one body section holding the BSON ``body``."""
    return _HEADER.pack(21 + len(body), request_id, response_to, OP_MSG) + b"\x00" * 5 + body


def _error(code: int, code_name: str, message: str) -> bytes:
    return bson.encode({"ok": 0.0, "errmsg": message, "code": code, "codeName": code_name})


class MongoResponder:
    """Serves recorded aggregation answers over the MongoDB wire protocol; ``with`` or start/stop."""

    def __init__(
        self,
        answers: RecordedAnswers,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        delay_ms: float = 0,
    ) -> None:
        self._answers = answers
        self._delay_s = max(0.0, delay_ms / 1000.0)
        self._server = StreamServer((host, port), self._serve_connection)
        self._replies: dict[tuple[Any, ...], bytes] = {}
        self._request_ids = itertools.count(1)
        self._connection_ids = itertools.count(1)
        self.operations = 0  # commands answered, handshakes included
        self.aggregations = 0

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.address[:2]
        return host, port

    @property
    def uri(self) -> str:
        host, port = self.address
        return f"mongodb://{host}:{port}"

    def start(self) -> MongoResponder:
        """Bind and accept in the background. Raises ``OSError`` if the address is taken."""
        self._server.start()
        return self

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop accepting and end every connection after ``timeout_s``; idempotent."""
        self._server.stop(timeout=timeout_s)

    def __enter__(self) -> MongoResponder:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _serve_connection(self, sock: socket.socket, peer: Any) -> None:
        connection_id = next(self._connection_ids)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = sock.makefile("rb")
        try:
            while True:
                header = reader.read(16)
                if len(header) < 16:
                    return
                length, request_id, _, opcode = _HEADER.unpack(header)
                if opcode != OP_MSG or not 21 <= length <= MAX_MESSAGE_BYTES:
                    log.warning(
                        "closing %s: opcode %d, length %d is not an OP_MSG we serve",
                        peer,
                        opcode,
                        length,
                    )
                    return
                payload = reader.read(length - 16)
                if len(payload) < length - 16:
                    return
                body = self._answer(decode_op_msg(payload), connection_id)
                if not int.from_bytes(payload[:4], "little") & _MORE_TO_COME:
                    sock.sendall(encode_op_msg(body, next(self._request_ids), request_id))
        except WireProtocolError as exc:
            log.warning("closing %s: %s", peer, exc)
        except OSError as exc:
            log.debug("connection from %s ended: %s", peer, exc)
        finally:
            reader.close()
            sock.close()

    def _answer(self, command: dict[str, Any], connection_id: int) -> bytes:
        name = next(iter(command))
        lowered = name.lower()
        self.operations += 1
        if lowered in ("hello", "ismaster"):
            return self._hello(connection_id)
        if lowered == "buildinfo":
            return bson.encode({"version": "7.0.0", "versionArray": [7, 0, 0, 0], "ok": 1.0})
        if lowered == STATS_COMMAND.lower():  # the bench's own question, at once
            return bson.encode({"aggregations": self.aggregations, "ok": 1.0})
        if lowered in _UNDELAYED:
            return _OK
        if not self._wait(command):
            return _error(50, "MaxTimeMSExpired", "operation exceeded time limit")
        if lowered == "aggregate":
            self.aggregations += 1
            return self._aggregate(command)
        if lowered == "killcursors":
            return bson.encode(
                {
                    "cursorsKilled": [],
                    "cursorsNotFound": command.get("cursors", []),
                    "cursorsAlive": [],
                    "cursorsUnknown": [],
                    "ok": 1.0,
                }
            )
        return _error(59, "CommandNotFound", f"no such command: '{name}'")

    def _wait(self, command: dict[str, Any]) -> bool:
        """Sleep the delay; ``False`` if the command's ``maxTimeMS`` ran out first."""
        if self._delay_s <= 0:
            return True
        limit_ms = command.get("maxTimeMS")
        if isinstance(limit_ms, int) and 0 < limit_ms < self._delay_s * 1000.0:
            gevent.sleep(limit_ms / 1000.0)
            return False
        gevent.sleep(self._delay_s)
        return True

    def _hello(self, connection_id: int) -> bytes:
        return bson.encode(
            {
                "helloOk": True,
                "isWritablePrimary": True,
                "ismaster": True,
                "maxBsonObjectSize": 16 * 1024 * 1024,
                "maxMessageSizeBytes": MAX_MESSAGE_BYTES,
                "maxWriteBatchSize": 100_000,
                "localTime": datetime.datetime.now(datetime.UTC),
                "logicalSessionTimeoutMinutes": 30,
                "connectionId": connection_id,
                "minWireVersion": 0,
                "maxWireVersion": MAX_WIRE_VERSION,
                "readOnly": False,
                "ok": 1.0,
            }
        )

    def _aggregate(self, command: dict[str, Any]) -> bytes:
        collection, database = command.get("aggregate"), command.get("$db", "test")
        pipeline = command.get("pipeline")
        if not isinstance(collection, str) or not isinstance(pipeline, list):
            return _error(2, "BadValue", "aggregate needs a collection name and a pipeline")
        stages = stages_after_match(pipeline)
        # The stages after $match are the same bytes on every call of one lookup; their
        # repr is a cheap cache key, the Extended JSON key is computed only on a miss.
        cache_key = (database, collection, repr(stages))
        reply = self._replies.get(cache_key)
        if reply is None:
            reply = self._encode_aggregate(database, collection, stages)
            if len(self._replies) >= _REPLY_CACHE_LIMIT:
                self._replies.clear()
            self._replies[cache_key] = reply
        return reply

    def _encode_aggregate(self, database: str, collection: str, stages: list[Any]) -> bytes:
        documents = self._answers.documents_for(collection, stages)
        if documents is None:
            return _error(
                2,
                "BadValue",
                f"bench responder: no recorded answer for {collection} with these stages",
            )
        return bson.encode(
            {
                "cursor": {
                    "firstBatch": documents,
                    "id": Int64(0),
                    "ns": f"{database}.{collection}",
                },
                "ok": 1.0,
            }
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.servers.mongo_responder",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--answers", default=str(DEFAULT_ANSWERS_PATH))
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    responder = MongoResponder(
        RecordedAnswers.load(args.answers), host=args.host, port=args.port, delay_ms=args.delay_ms
    ).start()
    host, port = responder.address
    announce_ready(host=host, port=port, uri=responder.uri)
    wait_for_stop_signal()
    responder.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
