"""A light OTLP/HTTP trace receiver, so traced benchmark runs export over the wire as in production.

``POST /v1/traces`` reads the body, counts requests and bytes, and answers ``200`` with
an empty ``ExportTraceServiceResponse`` (an empty protobuf message is zero bytes); the
spans are not decoded. ``GET /stats`` answers ``{"requests": n, "bytes": m}``.
Anything else is ``404``.

    python -m bench.servers.otlp_sink

prints ``READY {"endpoint": "http://127.0.0.1:PORT", ...}`` (the collector base URL:
the exporter appends ``/v1/traces``) and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from typing import Any

from gevent.pywsgi import WSGIServer

from bench.servers.ready import announce_ready, wait_for_stop_signal

__all__ = ["OtlpSink", "TRACES_PATH", "main"]

TRACES_PATH = "/v1/traces"
_READ_BYTES = 64 * 1024


class OtlpSink:
    """Counts OTLP/HTTP trace exports; a WSGI app on gevent's server. ``with`` or start/stop."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = WSGIServer((host, port), self._app, log=None)
        self.requests = 0
        self.bytes = 0

    @property
    def endpoint(self) -> str:
        """The collector base URL, as ``tracing.endpoint`` wants it."""
        host, port = self._server.address[:2]
        return f"http://{host}:{port}"

    def start(self) -> OtlpSink:
        self._server.start()
        return self

    def stop(self, timeout_s: float = 1.0) -> None:
        self._server.stop(timeout=timeout_s)

    def __enter__(self) -> OtlpSink:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        method, path = environ.get("REQUEST_METHOD"), environ.get("PATH_INFO")
        if method == "POST" and path == TRACES_PATH:
            size = _drain(environ["wsgi.input"])
            self.requests += 1
            self.bytes += size
            start_response(
                "200 OK", [("Content-Type", "application/x-protobuf"), ("Content-Length", "0")]
            )
            return [b""]
        if method == "GET" and path == "/stats":
            body = json.dumps({"requests": self.requests, "bytes": self.bytes}).encode()
            start_response(
                "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            )
            return [body]
        start_response("404 Not Found", [("Content-Length", "0")])
        return [b""]


def _drain(stream: Any) -> int:
    size = 0
    while True:
        chunk = stream.read(_READ_BYTES)
        if not chunk:
            return size
        size += len(chunk)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.servers.otlp_sink",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING")
    with OtlpSink(args.host, args.port) as sink:
        announce_ready(endpoint=sink.endpoint, stats_url=sink.endpoint + "/stats")
        wait_for_stop_signal()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
