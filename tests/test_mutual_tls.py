"""Mutual TLS on the Thrift listener, and certificates that rotate without a restart.

Real sockets and real clients (ours, Apache Thrift's ``TSSLSocket``, ``fanout call``,
``fanout serve``); certificates from ``trustme`` (:mod:`tests.support.pki`).
"""

from __future__ import annotations

import datetime
import logging
import re
import socket
import ssl
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent
import pytest
import requests
import trustme
from gevent.monkey import get_original
from thrift.transport.TSSLSocket import TSSLSocket
from thriftpy2.transport import TTransportException

from service.client import AppStatsClient
from service.listener.handshakes import TlsHandshakes
from service.listener.server import ThriftServer
from service.listener.stats import ServerStats
from service.settings.config import ConfigError, ServerSettings, load_settings
from service.testing import FakeClock
from service.wire.certificates import RotatingContext
from service.wire.tls import TlsConfigError, server_context
from tests.support.pki import Pki, make_pki, swap_secret, write_leaf, write_uri_leaf
from tests.support.processes import FANOUT
from tests.support.sockets import wait_for
from tests.support.thrift_calls import apache_thrift_ping
from tests.support.toolchains import require

WEB_TIER = "web.internal"
WEB_TIER_ID = "spiffe://cluster.local/ns/shop/sa/web"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("mtls"))


@pytest.fixture(scope="module")
def clients(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Client certificates: by our CA for the web tier (DNS and SPIFFE), another name, and
    the web tier's name by a CA the server does not trust."""
    directory = tmp_path_factory.mktemp("mtls-clients")
    return {
        "web": write_leaf(pki.ca, directory, "web", WEB_TIER),
        "spiffe": write_uri_leaf(pki.ca, directory, "spiffe", WEB_TIER_ID),
        "batch": write_leaf(pki.ca, directory, "batch", "batch.internal"),
        "stranger": write_leaf(trustme.CA(), directory, "stranger", WEB_TIER),
    }


@pytest.fixture
def mtls_server(start_server: Callable[..., ThriftServer], pki: Pki) -> Callable[..., ThriftServer]:
    def start(**settings: Any) -> ThriftServer:
        return start_server(
            tls_cert_file=pki.cert_file,
            tls_key_file=pki.key_file,
            tls_client_ca_file=pki.ca_file,
            **settings,
        )

    return start


def ping_as(server: ThriftServer, pki: Pki, certificate: tuple[str, str] | None) -> str:
    cert_file, key_file = certificate or (None, None)
    with AppStatsClient(
        *server.address,
        tls_ca_file=pki.ca_file,
        tls_cert_file=cert_file,
        tls_key_file=key_file,
        timeout_ms=5000,
    ) as client:
        return client.ping()


def refusals(server: ThriftServer, caplog: pytest.LogCaptureFixture) -> str:
    """The refusal summary the server logs, written at its stop."""
    with caplog.at_level(logging.WARNING, logger="service.listener.handshakes"):
        server.stop(timeout_s=5.0)
    lines = [r.getMessage() for r in caplog.records if "TLS handshakes refused" in r.getMessage()]
    assert len(lines) == 1, lines  # one summary, never a line per connection
    return lines[0]


# --- who gets in --------------------------------------------------------------------------------


def test_a_client_without_a_certificate_is_refused(mtls_server, pki: Pki, clients, caplog) -> None:
    server = mtls_server()
    for _ in range(3):
        with pytest.raises(TTransportException):
            ping_as(server, pki, None)
    assert ping_as(server, pki, clients["web"]) == "pong"  # others are served meanwhile
    stats = server.stats  # the client tries a new connection once more per call
    assert stats.tls_refused >= 3 and stats.tls_refused == stats.connections_total - 1
    assert re.search(rf"no_certificate x{stats.tls_refused} ", refusals(server, caplog))


def test_a_certificate_from_another_ca_is_refused(mtls_server, pki: Pki, clients, caplog) -> None:
    server = mtls_server()
    with pytest.raises(TTransportException):
        ping_as(server, pki, clients["stranger"])
    assert server.stats.tls_refused == server.stats.connections_total >= 1
    assert f"untrusted_certificate x{server.stats.tls_refused} " in refusals(server, caplog)


def test_a_name_not_on_the_allow_list_is_refused(mtls_server, pki: Pki, clients, caplog) -> None:
    server = mtls_server(tls_client_names=(WEB_TIER, WEB_TIER_ID))
    with pytest.raises(TTransportException):
        ping_as(server, pki, clients["batch"])
    assert server.stats.tls_refused == server.stats.connections_total >= 1
    assert (
        f"name_not_allowed x{server.stats.tls_refused} (e.g. 127.0.0.1: batch.internal)"
        in refusals(server, caplog)
    )


def test_allowed_clients_are_served_by_dns_or_spiffe_id(mtls_server, pki: Pki, clients) -> None:
    server = mtls_server(tls_client_names=(WEB_TIER, WEB_TIER_ID))
    assert ping_as(server, pki, clients["web"]) == "pong"
    assert ping_as(server, pki, clients["spiffe"]) == "pong"
    assert server.stats.tls_refused == 0


def stats_as(server: ThriftServer, pki: Pki, certificate: tuple[str, str]) -> None:
    with AppStatsClient(
        *server.address,
        tls_ca_file=pki.ca_file,
        tls_cert_file=certificate[0],
        tls_key_file=certificate[1],
        timeout_ms=5000,
        caller="claimed-name",  # a certificate's name comes first
    ) as client:
        client.get_app_stats("shop", 0, 1000)


def test_a_client_certificate_names_the_caller_for_fair_share(
    mtls_server, pki: Pki, clients, handler
) -> None:
    server = mtls_server(tls_client_names=(WEB_TIER, WEB_TIER_ID))
    stats_as(server, pki, clients["web"])
    stats_as(server, pki, clients["spiffe"])
    anyone = mtls_server()  # no allow list: the certificate's first name
    stats_as(anyone, pki, clients["batch"])
    assert handler.identities == [WEB_TIER, WEB_TIER_ID, "batch.internal"]


def test_any_certificate_of_the_ca_gets_in_without_an_allow_list(
    mtls_server, pki: Pki, clients
) -> None:
    server = mtls_server()
    assert ping_as(server, pki, clients["batch"]) == "pong"


def test_apache_thrift_client_with_a_client_certificate(mtls_server, pki: Pki, clients) -> None:
    server = mtls_server(tls_client_names=(WEB_TIER,))
    cert_file, key_file = clients["web"]
    apache_thrift_ping(
        TSSLSocket(
            *server.address,
            ca_certs=pki.ca_file,
            server_hostname="localhost",
            certfile=cert_file,
            keyfile=key_file,
        ),
        seqid=7,
    )


# --- rotation ----------------------------------------------------------------------------------


def _server_pem(pki: Pki, directory: Path, stem: str) -> dict[str, bytes]:
    cert_file, key_file = write_leaf(pki.ca, directory, stem, "localhost", "127.0.0.1")
    return {"tls.crt": Path(cert_file).read_bytes(), "tls.key": Path(key_file).read_bytes()}


def _serial_seen(server: ThriftServer, pki: Pki, client: tuple[str, str]) -> int:
    """The serial number of the certificate a new connection is shown."""
    context = ssl.create_default_context(cafile=pki.ca_file)
    context.load_cert_chain(*client)
    with (
        socket.create_connection(server.address, timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as secured,
    ):
        certificate = secured.getpeercert()
        assert certificate is not None
        return int(str(certificate["serialNumber"]), 16)


def _serial_of(pem: bytes) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(pem).serial_number


def test_certificates_swapped_by_symlink_reach_new_connections_without_a_failed_call(
    start_server: Callable[..., ThriftServer], pki: Pki, clients, tmp_path: Path
) -> None:
    volume = tmp_path / "secret"
    volume.mkdir()
    generations = [_server_pem(pki, tmp_path, f"gen{n}") for n in range(4)]
    swap_secret(volume, generations[0], 0)
    server = start_server(
        tls_cert_file=str(volume / "tls.crt"),
        tls_key_file=str(volume / "tls.key"),
        tls_client_ca_file=pki.ca_file,
    )
    results: Counter[str] = Counter()
    running = True

    def caller(fresh_connections: bool) -> None:
        client = None
        while running:
            client = client or AppStatsClient(
                *server.address,
                tls_ca_file=pki.ca_file,
                timeout_ms=5000,
                tls_cert_file=clients["web"][0],
                tls_key_file=clients["web"][1],
            )
            try:
                results["ok" if client.ping() == "pong" else "wrong"] += 1
            except Exception as exc:  # every failure counts: the assertion names them
                results[type(exc).__name__] += 1
            if fresh_connections:  # half the callers open a new connection for every call
                client.close()
                client = None
            gevent.sleep(0.01)
        if client is not None:
            client.close()

    callers = [gevent.spawn(caller, index % 2 == 0) for index in range(16)]
    try:
        assert _serial_seen(server, pki, clients["web"]) == _serial_of(generations[0]["tls.crt"])
        for generation in (1, 2, 3):
            swap_secret(volume, generations[generation], generation)
            expected = _serial_of(generations[generation]["tls.crt"])
            wait_for(
                lambda: _serial_seen(server, pki, clients["web"]) == expected,
                10,
                f"generation {generation} on new connections",
            )
    finally:
        running = False
        gevent.joinall(callers, timeout=20, raise_error=True)
    assert set(results) == {"ok"} and results["ok"] > 16, results
    assert server.stats.tls_refused == 0


def test_a_bad_new_key_keeps_the_previous_certificate_and_logs_an_error(
    start_server: Callable[..., ThriftServer],
    pki: Pki,
    clients,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    volume = tmp_path / "secret"
    volume.mkdir()
    first = _server_pem(pki, tmp_path, "first")
    swap_secret(volume, first, 0)
    server = start_server(
        tls_cert_file=str(volume / "tls.crt"),
        tls_key_file=str(volume / "tls.key"),
        tls_client_ca_file=pki.ca_file,
    )
    mismatched = {
        "tls.crt": _server_pem(pki, tmp_path, "second")["tls.crt"],
        "tls.key": first["tls.key"],
    }
    with caplog.at_level(logging.ERROR, logger="service.wire.certificates"):
        swap_secret(volume, mismatched, 1)
        time.sleep(1.2)  # past the once-a-second look at the files
        for _ in range(3):
            assert _serial_seen(server, pki, clients["web"]) == _serial_of(first["tls.crt"])
            time.sleep(0.4)
    errors = [r for r in caplog.records if "do not load" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]  # once per change
    assert ping_as(server, pki, clients["web"]) == "pong"


def test_rotating_context_looks_at_the_files_at_most_once_per_interval(
    pki: Pki, tmp_path: Path
) -> None:
    clock = FakeClock(0.0)
    cert = tmp_path / "tls.crt"
    cert.write_bytes(Path(pki.cert_file).read_bytes())
    settings = ServerSettings(tls_cert_file=str(cert), tls_key_file=pki.key_file)
    built: list[ssl.SSLContext] = []

    def build() -> ssl.SSLContext:
        context = server_context(settings.tls_cert_file, settings.tls_key_file)
        assert context is not None
        built.append(context)
        return context

    rotating = RotatingContext(build, [str(cert), pki.key_file], check_every_s=1.0, clock=clock)
    first = rotating.current()
    cert.write_bytes(Path(pki.cert_file).read_bytes() + b"\n")  # changed: size and mtime
    clock.now = 0.5
    assert rotating.current() is first and len(built) == 1  # not looked at yet
    clock.now = 1.0
    assert rotating.current() is not first and (len(built), rotating.reloads) == (2, 1)
    clock.now = 2.0
    assert rotating.current() is built[-1] and len(built) == 2  # unchanged: not rebuilt


# --- configuration, the CLI, the metric --------------------------------------------------------


def test_client_names_come_from_a_toml_list_or_a_comma_separated_variable(
    pki: Pki, tmp_path: Path
) -> None:
    config = tmp_path / "fanout.toml"
    config.write_text(
        f'[server]\ntls_cert_file = "{pki.cert_file}"\ntls_key_file = "{pki.key_file}"\n'
        f'tls_client_ca_file = "{pki.ca_file}"\n'
        f'tls_client_names = ["{WEB_TIER}", "{WEB_TIER_ID}"]\n'
    )
    assert load_settings(config, env={}).server.tls_client_names == (WEB_TIER, WEB_TIER_ID)
    env = {"FANOUT_SERVER_TLS_CLIENT_NAMES": f"{WEB_TIER}, {WEB_TIER_ID}"}
    assert load_settings(config, env=env).server.tls_client_names == (WEB_TIER, WEB_TIER_ID)
    with pytest.raises(ConfigError, match="server.tls_client_names: must be a list of strings"):
        load_settings(env={}, overrides={"server.tls_client_names": 3})


def test_client_names_without_a_client_ca_is_a_config_error(pki: Pki) -> None:
    with pytest.raises(ConfigError, match="server.tls_client_names: needs tls_client_ca_file"):
        load_settings(
            env={},
            overrides={
                "server.tls_cert_file": pki.cert_file,
                "server.tls_key_file": pki.key_file,
                "server.tls_client_names": WEB_TIER,
            },
        )
    with pytest.raises(ConfigError, match="server.tls_client_ca_file: needs tls_cert_file"):
        load_settings(env={}, overrides={"server.tls_client_ca_file": pki.ca_file})


def test_an_unreadable_client_ca_stops_start_up_naming_the_key(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(TlsConfigError, match="server.tls_client_ca_file"):
        server_context(pki.cert_file, pki.key_file, str(tmp_path / "missing.pem"))


def _openssl_end_date(pem_file: str) -> float:
    """The first certificate's notAfter in ``pem_file``, as openssl reads it (Unix time)."""
    require("openssl")
    shown = subprocess.run(
        ["openssl", "x509", "-noout", "-enddate", "-in", pem_file],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    ends = datetime.datetime.strptime(
        shown.strip().removeprefix("notAfter="), "%b %d %H:%M:%S %Y %Z"
    )
    return ends.replace(tzinfo=datetime.UTC).timestamp()


def test_the_soonest_expiry_of_the_certificates_in_use_is_known_and_follows_a_rotation(
    pki: Pki, tmp_path: Path
) -> None:
    settings = ServerSettings(
        tls_cert_file=str(tmp_path / "server.pem"),
        tls_key_file=str(tmp_path / "server.key"),
        tls_client_ca_file=pki.ca_file,
    )
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=20)
    _write_server_leaf(pki, tmp_path, not_after=soon)
    handshakes = TlsHandshakes(settings, ServerStats())
    assert handshakes.expirations() == {
        "server": _openssl_end_date(settings.tls_cert_file),  # the leaf: sooner than its chain
        "client_ca": _openssl_end_date(pki.ca_file),
    }
    assert abs(handshakes.expirations()["server"] - soon.timestamp()) < 2
    later = soon + datetime.timedelta(days=60)
    _write_server_leaf(pki, tmp_path, not_after=later)  # renewed: new files, once in use
    wait_for(
        lambda: abs(handshakes.expirations()["server"] - later.timestamp()) < 2,
        10,
        "the renewed certificate's expiry",
    )


def test_an_export_thread_reads_the_expiries_and_leaves_looking_at_the_files_to_the_loop(
    pki: Pki, tmp_path: Path
) -> None:
    settings = ServerSettings(
        tls_cert_file=str(tmp_path / "server.pem"), tls_key_file=str(tmp_path / "server.key")
    )
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=20)
    _write_server_leaf(pki, tmp_path, not_after=soon)
    handshakes = TlsHandshakes(settings, ServerStats())
    assert abs(handshakes.expirations()["server"] - soon.timestamp()) < 2
    later = soon + datetime.timedelta(days=60)
    _write_server_leaf(pki, tmp_path, not_after=later)
    time.sleep(1.1)  # past the files' look-again period

    def off_the_loop() -> dict[str, float]:
        """``expirations()`` on a thread of its own, as an OTLP export collects."""
        done, seen = get_original("_thread", "allocate_lock")(), {}
        done.acquire()

        def collect() -> None:
            try:
                seen.update(handshakes.expirations())
            finally:
                done.release()

        get_original("_thread", "start_new_thread")(collect, ())
        done.acquire()  # blocks this thread, and with it the event loop, until it is over
        return seen

    assert abs(off_the_loop()["server"] - soon.timestamp()) < 2  # the files not read there
    gevent.sleep(0.05)  # the loop runs the look that thread asked for
    assert abs(off_the_loop()["server"] - later.timestamp()) < 2


def _write_server_leaf(pki: Pki, directory: Path, not_after: datetime.datetime) -> None:
    """A chain: a leaf ending at ``not_after`` and the intermediate CA that signed it."""
    leaf = pki.ca.create_child_ca().issue_cert("localhost", not_after=not_after)
    assert len(leaf.cert_chain_pems) == 2
    leaf.private_key_pem.write_to_path(str(directory / "server.key"))
    for index, blob in enumerate(leaf.cert_chain_pems):
        blob.write_to_path(str(directory / "server.pem"), append=index > 0)


def test_fanout_serve_with_mutual_tls_counts_refusals_and_fanout_call_presents_a_certificate(
    serve: Any, http_services: Any, pki: Pki, clients
) -> None:
    server = serve(
        http_services,
        **{
            "server.tls_cert_file": pki.cert_file,
            "server.tls_key_file": pki.key_file,
            "server.tls_client_ca_file": pki.ca_file,
            "server.tls_client_names": WEB_TIER,
            "metrics.exporter": "prometheus",
            "metrics.port": 0,
        },
    )
    call = [*FANOUT, "call", "ping", "--port", str(server.port), "--tls-ca", pki.ca_file]
    web_cert, web_key = clients["web"]
    served = subprocess.run(
        [*call, "--tls-cert", web_cert, "--tls-key", web_key],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (served.returncode, served.stdout.strip()) == (0, "pong"), served.stderr
    refused = subprocess.run(call, capture_output=True, text=True, timeout=60)  # no certificate
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    batch = subprocess.run(
        [*call, "--tls-cert", clients["batch"][0], "--tls-key", clients["batch"][1]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert batch.returncode == 1, batch.stdout
    scrape_at = wait_for(
        lambda: re.search(r"Prometheus scrape at (http://\S+/metrics)", server.log()),
        10,
        "the scrape address in the log",
    ).group(1)

    def refused_series() -> dict[str, float]:
        text = requests.get(scrape_at, timeout=5).text
        return {
            m.group(1): float(m.group(2))
            for m in re.finditer(
                r'^fanout_tls_handshakes_refused_total\{.*fanout_tls_reason="(\w+)".*\} (\S+)$',
                text,
                re.M,
            )
        }

    # Each refused call is counted once per connection it tried (the client tries a new one again).
    counted = wait_for(
        lambda: (
            lambda series: series if set(series) == {"no_certificate", "name_not_allowed"} else None
        )(refused_series()),
        10,
        "the refusals",
    )
    assert all(1 <= count <= 2 for count in counted.values()), counted
    expirations = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'^fanout_tls_certificate_expiration_timestamp_seconds\{.*fanout_tls_certificate="(\w+)"'
            r".*\} (\S+)$",
            requests.get(scrape_at, timeout=5).text,
            re.M,
        )
    }
    assert expirations == {
        "server": _openssl_end_date(pki.cert_file),
        "client_ca": _openssl_end_date(pki.ca_file),
    }
