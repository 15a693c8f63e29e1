"""Security defaults over real sockets: TLS on the Thrift listener, loopback by default,
no stack trace ever reaching a caller.

Certificates are made in the test with ``trustme`` (:mod:`tests.support.pki`): a CA,
and a server certificate for ``localhost`` and ``127.0.0.1`` signed by it. Mutual TLS
and rotation: ``test_mutual_tls.py``; TLS to the backends: ``test_backend_tls.py``.
"""

from __future__ import annotations

import logging
import os
import re
import select
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
from thrift.transport.TSSLSocket import TSSLSocket
from thriftpy2.thrift import TApplicationException, TProcessor
from thriftpy2.transport import TTransportException

from lookups.base import Lookup
from lookups.deadline import Deadline
from lookups.panels import Window
from lookups.registry import default_registry
from service.app import FanOutService
from service.client import AppStatsClient
from service.idl import appstats
from service.listener.server import ThriftServer
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS
from service.settings.config import ServerSettings, Settings, load_settings
from service.wire.tls import MINIMUM_VERSION, TlsConfigError, server_context
from tests.support.pki import Pki, make_pki
from tests.support.samples import GENEROUS_BUDGETS, backend_overrides
from tests.support.server import SECRET, RecordingHandler, read_until_closed, sample_response
from tests.support.thrift_calls import apache_thrift_ping

FANOUT = [sys.executable, "-m", "service.cli"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_server(start_server, pki: Pki):
    def start(**settings: Any) -> ThriftServer:
        return start_server(tls_cert_file=pki.cert_file, tls_key_file=pki.key_file, **settings)

    return start


def request(app: str) -> Any:
    return appstats.StatsRequest(app=app, start_ms=1_000, end_ms=2_000)


# --- TLS --------------------------------------------------------------------------------


def test_our_client_over_tls(tls_server, pki: Pki) -> None:
    server = tls_server()
    with AppStatsClient(*server.address, tls_ca_file=pki.ca_file, timeout_ms=5000) as client:
        assert client.ping() == "pong"
        assert client.get_app_stats("shop", 1_000, 2_000) == sample_response("shop")
        assert client.ping() == "pong"  # the pooled TLS connection is reused
    assert server.stats.connections_total == 1


def test_apache_thrift_client_over_tls(tls_server, pki: Pki) -> None:
    server = tls_server()
    host, port = server.address
    apache_thrift_ping(TSSLSocket(host, port, ca_certs=pki.ca_file, server_hostname="localhost"))


def test_plain_tcp_client_fails_cleanly_and_others_are_served(tls_server, pki: Pki, caplog) -> None:
    server = tls_server()
    with AppStatsClient(*server.address, timeout_ms=5000) as plain:  # no TLS
        with pytest.raises(TTransportException):
            plain.ping()
    with AppStatsClient(*server.address, tls_ca_file=pki.ca_file) as client:
        assert client.ping() == "pong"
    with caplog.at_level(logging.WARNING, logger="service.listener.handshakes"):
        server.stop(timeout_s=5.0)
    assert server.stats.internal_errors == 0 and server.stats.tls_refused >= 1
    assert any(
        "TLS handshakes refused" in record.getMessage()
        and "handshake_failed" in record.getMessage()
        for record in caplog.records
    )


def test_client_that_does_not_trust_the_ca_fails(tls_server, tmp_path: Path) -> None:
    server = tls_server()
    stranger = make_pki(tmp_path)  # another CA, same host names
    with AppStatsClient(*server.address, tls_ca_file=stranger.ca_file) as client:
        with pytest.raises(TTransportException) as caught:
            client.ping()
    assert caught.value.type == TTransportException.NOT_OPEN
    assert "CERTIFICATE_VERIFY_FAILED" in caught.value.message


def test_certificate_must_name_the_server(tls_server, pki: Pki) -> None:
    server = tls_server()
    with AppStatsClient(
        *server.address, tls_ca_file=pki.ca_file, tls_server_hostname="fanout.example.com"
    ) as client:
        with pytest.raises(TTransportException) as caught:
            client.ping()
    assert "CERTIFICATE_VERIFY_FAILED" in caught.value.message
    with AppStatsClient(
        *server.address, tls_ca_file=pki.ca_file, tls_server_hostname="localhost"
    ) as client:
        assert client.ping() == "pong"


def test_silent_client_is_closed_after_the_handshake_timeout(tls_server, pki: Pki) -> None:
    server = tls_server(frame_timeout_ms=300, idle_timeout_ms=60_000)
    started = time.monotonic()
    with socket.create_connection(server.address, timeout=10) as silent:
        assert read_until_closed(silent) == b""
    assert time.monotonic() - started < 5.0  # the 300 ms handshake bound, not the idle timeout
    with AppStatsClient(*server.address, tls_ca_file=pki.ca_file) as client:
        assert client.ping() == "pong"


def _client_hello() -> bytes:
    """A real TLS ClientHello, as the first flight of a client would send it."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    with pytest.raises(ssl.SSLWantReadError):
        context.wrap_bio(incoming, outgoing, server_hostname="localhost").do_handshake()
    return outgoing.read()


def test_a_client_hello_sent_byte_by_byte_is_closed_at_the_handshake_deadline(
    tls_server, pki: Pki
) -> None:
    # Each byte comes well within frame_timeout_ms of the last: only a deadline on the
    # whole handshake ends it before the hello is complete.
    server = tls_server(frame_timeout_ms=400, idle_timeout_ms=60_000)
    hello = _client_hello()
    sent, closed = 0, False
    started = time.monotonic()
    with socket.create_connection(server.address, timeout=10) as slow:
        for byte in hello:
            try:
                slow.sendall(bytes([byte]))
                sent += 1
                time.sleep(0.1)
                readable, _, _ = select.select([slow], [], [], 0)
                closed = bool(readable) and slow.recv(1, socket.MSG_PEEK) == b""
            except OSError:  # reset by the server
                closed = True
            if closed:
                break
    assert closed and 2 < sent < len(hello) // 2, (closed, sent, len(hello))
    # Cut at its 400 ms deadline, with room for a machine twice as slow: not once the
    # hello is whole, and not at the idle timeout.
    assert time.monotonic() - started < 3.0
    server.stop(timeout_s=5.0)
    assert server.stats.tls_refused == 1


def test_a_tcp_check_that_connects_and_closes_is_no_refused_handshake(
    tls_server, pki: Pki, caplog
) -> None:
    server = tls_server()
    for _ in range(3):
        socket.create_connection(server.address, timeout=5).close()  # a tcpSocket probe
    with AppStatsClient(*server.address, tls_ca_file=pki.ca_file) as client:
        assert client.ping() == "pong"
    with caplog.at_level(logging.INFO, logger="service.listener.handshakes"):
        server.stop(timeout_s=5.0)
    assert server.stats.tls_refused == 0
    assert not any("TLS handshakes refused" in record.getMessage() for record in caplog.records)


def test_idle_tls_connections_close_at_once_on_stop(tls_server, pki: Pki, handler) -> None:
    server = tls_server()
    clients = [AppStatsClient(*server.address, tls_ca_file=pki.ca_file) for _ in range(3)]
    assert [client.ping() for client in clients] == ["pong"] * 3

    report = server.stop(timeout_s=30.0)
    assert (report.idle_closed, report.calls_in_flight, report.killed) == (3, 0, 0)
    assert report.elapsed_ms < 5000
    assert server.stats.connections_open == 0 and server.stats.internal_errors == 0
    for client in clients:
        client.close()


def test_unreadable_certificate_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(TlsConfigError, match="server.tls_cert_file"):
        ThriftServer(
            TProcessor(appstats.AppStats, RecordingHandler()),
            ServerSettings(port=0, tls_cert_file=missing, tls_key_file=missing),
        )


def test_server_requires_tls_1_2_or_later(pki: Pki) -> None:
    context = server_context(pki.cert_file, pki.key_file)
    assert context is not None and context.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert ssl.TLSVersion.TLSv1_2 == MINIMUM_VERSION
    assert server_context(ServerSettings().tls_cert_file, ServerSettings().tls_key_file) is None


def test_cli_call_over_tls(tls_server, pki: Pki, tmp_path: Path) -> None:
    server = tls_server()
    port = str(server.address[1])
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none"}
    ok = subprocess.run(
        [*FANOUT, "call", "ping", "--port", port, "--tls-ca", pki.ca_file],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert (ok.returncode, ok.stdout.strip()) == (0, "pong"), ok.stderr
    untrusted = make_pki(tmp_path)
    refused = subprocess.run(
        [*FANOUT, "call", "ping", "--port", port, "--tls-ca", untrusted.ca_file],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert refused.returncode == 1
    assert "CERTIFICATE_VERIFY_FAILED" in refused.stderr and "Traceback" not in refused.stderr


# --- listen on loopback unless told otherwise -------------------------------------------------


def test_default_settings_bind_loopback_only() -> None:
    assert ServerSettings().host == "127.0.0.1"
    assert load_settings(env={}).server.host == "127.0.0.1"
    server = ThriftServer(TProcessor(appstats.AppStats, RecordingHandler()), ServerSettings(port=0))
    server.start()
    try:
        assert server.address[0] == "127.0.0.1"  # the listening socket's own address, not 0.0.0.0
        with socket.create_connection(server.address, timeout=5) as sock:
            assert sock.getpeername()[0] == "127.0.0.1"
    finally:
        server.stop(timeout_s=1.0)


def test_cli_and_demo_default_to_loopback() -> None:
    from service.cli.demo import _demo_settings
    from service.cli.main import _parser, _settings

    args = _parser().parse_args(["serve", "--port", "0"])
    assert _settings(args).server.host == "127.0.0.1"
    assert _demo_settings({}, None, {}).server.host == "127.0.0.1"


# --- no stack trace reaches a caller ---------------------------------------------------------


class _BrokenLookup(Lookup):
    """A lookup plugin with a bug: an unexpected exception carrying internal details."""

    name: ClassVar[str] = "broken"
    source: ClassVar[str] = "mongo"

    def fetch(self, window: Window, deadline: Deadline) -> Any:
        raise KeyError("internal state")


class _MisdeclaredLookup(Lookup):
    """A lookup plugin whose ``source`` cannot be encoded: the reply itself fails."""

    name: ClassVar[str] = "misdeclared"
    source: ClassVar[Any] = object()

    def fetch(self, window: Window, deadline: Deadline) -> Any:
        raise KeyError("never reached by the caller")


def _service_with(lookup: type[Lookup], mongo_server: Any, http_services: Any) -> FanOutService:
    registry = default_registry()
    registry.register(lookup.name, lambda backends: lookup())
    settings: Settings = load_settings(
        env={},
        overrides={
            **backend_overrides(mongo_server, http_services),
            **GENEROUS_BUDGETS,  # the errors panel must answer OK on a starved machine
            "server.port": 0,
        },
    )
    return FanOutService(settings, registry=registry).start()


def test_unexpected_lookup_error_is_that_panels_error_without_traceback(
    mongo_server, http_services, caplog
) -> None:
    service = _service_with(_BrokenLookup, mongo_server, http_services)
    try:
        with (
            AppStatsClient(*service.address, timeout_ms=5000) as client,
            caplog.at_level(logging.ERROR, logger="service.engine.fanout"),
        ):
            response = client.get_app_stats(
                "shop", SAMPLE_START_MS, SAMPLE_END_MS, ["broken", "errors"]
            )
    finally:
        service.stop()
    by_name = {o.name: o for o in response.outcomes}
    assert by_name["errors"].status == appstats.TaskStatus.OK
    broken = by_name["broken"]
    assert (broken.status, broken.error_type, broken.retryable) == (
        appstats.TaskStatus.ERROR,
        "KeyError",
        False,
    )
    assert "Traceback" not in (broken.message or "") and 'File "' not in (broken.message or "")
    assert any(record.exc_info is not None for record in caplog.records)  # the trace is logged


def test_handler_bug_is_internal_error_with_a_request_id_in_the_logs(
    mongo_server, http_services, caplog
) -> None:
    service = _service_with(_MisdeclaredLookup, mongo_server, http_services)
    try:
        with (
            AppStatsClient(*service.address, timeout_ms=5000) as client,
            caplog.at_level(logging.ERROR, logger="service.listener.server"),
        ):
            with pytest.raises(TApplicationException) as caught:
                client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, ["misdeclared"])
            assert client.ping() == "pong"  # the same pooled connection still works
    finally:
        service.stop()
    error = caught.value
    assert error.type == TApplicationException.INTERNAL_ERROR
    match = re.fullmatch(r"internal error \(request id ([0-9a-f]+)\)", error.message)
    assert match, error.message
    logged = [r for r in caplog.records if match.group(1) in r.getMessage()]
    assert logged and logged[0].exc_info is not None
    assert SECRET not in error.message and "Traceback" not in error.message


def test_internal_error_over_tls_carries_no_trace(tls_server, pki: Pki) -> None:
    server = tls_server()
    with AppStatsClient(*server.address, tls_ca_file=pki.ca_file) as client:
        with pytest.raises(TApplicationException) as caught:
            client.get_app_stats("internal", 1_000, 2_000)
    assert caught.value.type == TApplicationException.INTERNAL_ERROR
    assert SECRET not in caught.value.message and "Traceback" not in caught.value.message
