"""TLS to the backends: HTTPS services behind a private CA (``http.ca_file``, a client
certificate) and MongoDB over TLS (``tls=true&tlsCAFile=`` in ``mongo.uri``).

Real servers: the sample HTTP services over HTTPS, and nx-27017 fronted by a TLS proxy
(:class:`~service.samples.fault_proxy.TcpFaultProxy` with a server context), as a
sidecar would front it. Certificates from ``trustme`` (:mod:`tests.support.pki`).
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.idl import appstats
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleHttpServices
from service.samples.fault_proxy import TcpFaultProxy
from service.settings.config import ConfigError
from tests.support.pki import Pki, make_pki, write_leaf
from tests.support.sockets import wait_for

HTTP_PANELS = ["alerts", "latency", "volume"]
MONGO_PANELS = ["errors", "queries", "urls", "controllers"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("backend-pki"))


def _server_context(pki: Pki, client_ca: str = "") -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.cert_file, pki.key_file)
    if client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=client_ca)
    return context


@pytest.fixture(scope="module")
def https_services(sample_data: Any, pki: Pki) -> Iterator[SampleHttpServices]:
    with SampleHttpServices(sample_data, ssl_context=_server_context(pki)) as services:
        yield services


def _statuses(client: Any, panels: list[str]) -> dict[str, Any]:
    response = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, panels)
    return {o.name: o for o in response.outcomes}


def test_https_services_behind_a_private_ca_work_with_http_ca_file(
    start_service: Any, https_services: SampleHttpServices, pki: Pki
) -> None:
    assert https_services.alerts_url.startswith("https://")
    # Patient budgets, as its siblings': under stress the first handshakes (the CA loaded,
    # the loop blocked) took a panel past the default 1000 ms.
    service, client = start_service(
        http=https_services,
        http__ca_file=pki.ca_file,
        fanout__task_timeout_ms=4000,
        fanout__request_deadline_ms=4500,
    )
    outcomes = _statuses(client, HTTP_PANELS)
    assert {name: o.status for name, o in outcomes.items()} == {
        name: appstats.TaskStatus.OK for name in HTTP_PANELS
    }, outcomes
    # Health answers from its last checks, and one still running after 200 ms is reported
    # down: on a starved host the first TLS handshakes took longer. Up once they are done.
    wait_for(
        lambda: all(b.up for b in client.health().backends if b.name in ("alerts", "metrics")),
        timeout_s=20,
        what="the HTTPS backends reported up",
        poll_s=0.5,
    )


def test_without_http_ca_file_they_fail_typed(
    start_service: Any, https_services: SampleHttpServices
) -> None:
    # The handshake fails at once, but loading the system's CAs took a stressed run
    # 942 ms of a blocked loop: budgets that outlast that, within the client's 5 s.
    service, client = start_service(
        http=https_services, fanout__task_timeout_ms=4000, fanout__request_deadline_ms=4500
    )
    outcomes = _statuses(client, HTTP_PANELS)
    for name in HTTP_PANELS:
        outcome = outcomes[name]
        assert (outcome.status, outcome.error_type) == (
            appstats.TaskStatus.ERROR,
            "BackendUnavailable",
        )
        assert (
            "TLS with the service failed" in outcome.message and "http.ca_file" in outcome.message
        )
    assert not {b.name: b.up for b in client.health().backends}["alerts"]


def test_a_service_that_asks_for_a_client_certificate_gets_http_client_cert_file(
    start_service: Any, sample_data: Any, pki: Pki, tmp_path: Path
) -> None:
    cert_file, key_file = write_leaf(pki.ca, tmp_path, "fanout-client", "fanout.internal")
    with SampleHttpServices(
        sample_data, ssl_context=_server_context(pki, client_ca=pki.ca_file)
    ) as strict:
        _, without = start_service(http=strict, http__ca_file=pki.ca_file)
        assert _statuses(without, ["alerts"])["alerts"].status == appstats.TaskStatus.ERROR
        _, client = start_service(
            http=strict,
            http__ca_file=pki.ca_file,
            http__client_cert_file=cert_file,
            http__client_key_file=key_file,
        )
        assert _statuses(client, HTTP_PANELS)["alerts"].status == appstats.TaskStatus.OK


def test_unreadable_https_files_are_config_errors_naming_the_key(
    start_service: Any, https_services: SampleHttpServices, tmp_path: Path
) -> None:
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match="http.ca_file: cannot load"):
        start_service(http=https_services, http__ca_file=missing)
    with pytest.raises(ConfigError, match="http.client_cert_file: cannot load"):
        start_service(http=https_services, http__client_cert_file=missing)
    with pytest.raises(ConfigError, match="http.client_key_file: needs client_cert_file"):
        start_service(http=https_services, http__client_key_file=missing)


def test_mongodb_over_tls_with_the_ca_in_the_uri(
    start_service: Any, mongo_server: Any, pki: Pki
) -> None:
    with TcpFaultProxy(
        ("127.0.0.1", mongo_server.port), ssl_context=_server_context(pki)
    ) as fronted:
        host, port = fronted.address
        uri = f"mongodb://{host}:{port}/?tls=true&tlsCAFile={pki.ca_file}&directConnection=true"
        # Budgets a stressed run keeps: each connection's TLS handshake through the proxy
        # once took the panels past the default second.
        _, client = start_service(
            mongo__uri=uri, fanout__task_timeout_ms=4000, fanout__request_deadline_ms=4500
        )
        outcomes = _statuses(client, MONGO_PANELS)
        assert {name: o.status for name, o in outcomes.items()} == {
            name: appstats.TaskStatus.OK for name in MONGO_PANELS
        }, outcomes
        # A check has 300 ms: on a busy machine a TLS handshake alone can take longer, and
        # the next check (every 2 s) passes.
        wait_for(
            lambda: {b.name: b.up for b in client.health().backends}["mongo"],
            20,
            "a health check of MongoDB over TLS passing",
            poll_s=0.5,
        )

        untrusted = f"mongodb://{host}:{port}/?tls=true&directConnection=true"  # the system's CAs
        _, refused = start_service(mongo__uri=untrusted, mongo__server_selection_timeout_ms=300)
        errors = _statuses(refused, ["errors"])["errors"]
        assert errors.status != appstats.TaskStatus.OK and errors.error_type in (
            "BackendUnavailable",
            "BackendTimeout",
        ), errors


@pytest.mark.parametrize(
    "env, key",
    [
        (
            {
                "FANOUT_BACKENDS_JOBS_KIND": "http",
                "FANOUT_BACKENDS_JOBS_URL": "https://jobs.internal",
                "FANOUT_BACKENDS_JOBS_CA_FILE": "{missing}",
            },
            "backends.jobs.ca_file: cannot load",
        ),
        (
            {
                "FANOUT_BACKENDS_ALERTS_KIND": "http",
                "FANOUT_BACKENDS_ALERTS_CLIENT_CERT_FILE": "{missing}",
            },
            "backends.alerts.client_cert_file: cannot load",
        ),
        ({"FANOUT_HTTP_CLIENT_CERT_FILE": "{missing}"}, "http.client_cert_file: cannot load"),
        ({"FANOUT_MONGO_URI": "mongodb://db:port/"}, "mongo.uri: not a valid MongoDB URI"),
        (
            {
                "FANOUT_BACKENDS_REPORTS_KIND": "mongo",
                "FANOUT_BACKENDS_REPORTS_URI": "mongodb://db:port/",
            },
            "backends.reports.uri: not a valid MongoDB URI",
        ),
    ],
)
def test_a_backend_that_cannot_start_names_the_key_as_the_user_wrote_it(
    tmp_path: Path, env: dict[str, str], key: str
) -> None:
    """A [backends.<name>] table's key, or its [mongo] / [http] alias's, never another's."""
    from service.app import FanOutService
    from service.settings.config import load_settings

    settings = load_settings(
        env={name: value.format(missing=tmp_path / "missing.pem") for name, value in env.items()}
    )
    with pytest.raises(ConfigError) as caught:
        FanOutService(settings)
    assert str(caught.value).startswith(key), caught.value
