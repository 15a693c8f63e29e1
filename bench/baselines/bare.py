"""Bare baseline: a gevent ``StreamServer`` and a thriftpy2 processor loop, ``ping`` and ``panels`` only.

The floor for raw RPC cost, with none of Fanout's server: no bounded message reader,
no idle timeout, no per-call context, no error mapping. Each accepted socket gets a
Cython framed transport and binary protocol, and ``processor.process(iprot, oprot)``
runs in a loop until the peer closes. Connections are bounded by
``server.max_connections`` (a gevent pool), as in Fanout.

    python -m bench.baselines.bare --config bench.toml

prints ``READY {"host": ..., "port": ...}`` once listening; stops on SIGTERM or SIGINT.
"""

from gevent import monkey

monkey.patch_all()

import socket
from collections.abc import Callable, Sequence
from typing import Any

from gevent.pool import Pool
from gevent.server import StreamServer
from thriftpy2.protocol import TCyBinaryProtocol
from thriftpy2.thrift import TProcessor
from thriftpy2.transport import TCyFramedTransport, TSocket, TTransportException

from bench.baselines.common import settings_from_argv
from bench.servers.ready import announce_ready, wait_for_stop_signal
from lookups.registry import default_registry
from service.idl import appstats

__all__ = ["BareHandler", "serve_with", "serve_until_stopped", "main"]


class BareHandler:
    """``ping`` and ``panels``; the other methods are not served."""

    def __init__(self) -> None:
        self._panels = list(default_registry().names())

    def ping(self) -> str:
        return "pong"

    def panels(self) -> list[str]:
        return self._panels


_PROCESSOR = TProcessor(appstats.AppStats, BareHandler())


def serve_with(processor: TProcessor) -> Callable[[socket.socket, Any], None]:
    """A ``StreamServer`` handler running ``processor`` on each connection until it ends."""

    def serve(sock: socket.socket, peer: Any) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport = TCyFramedTransport(TSocket(sock=sock))
        protocol = TCyBinaryProtocol(transport)
        try:
            while True:
                processor.process(protocol, protocol)
        except TTransportException:
            pass
        finally:
            transport.close()

    return serve


def serve_until_stopped(settings: Any, processor: TProcessor, name: str) -> int:
    """Serve ``processor`` on the configured address, ``server.max_connections`` at once;
    announce READY as ``name``, and stop on SIGTERM or SIGINT."""
    server = StreamServer(
        (settings.server.host, settings.server.port),
        serve_with(processor),
        spawn=Pool(settings.server.max_connections),
    )
    server.start()
    host, port = server.address[:2]
    announce_ready(host=host, port=port, server=name)
    wait_for_stop_signal()
    server.stop(timeout=1.0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from_argv("python -m bench.baselines.bare", argv)
    return serve_until_stopped(settings, _PROCESSOR, "bare")


if __name__ == "__main__":
    raise SystemExit(main())
