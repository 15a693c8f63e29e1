"""Fanout as users install it: the sdist and wheel that ``python -m build`` makes, the
wheel installed into a fresh venv and run from outside the checkout, and the
Deployment's own command line run against that installed package."""

from __future__ import annotations

import re
import signal
import subprocess
import tarfile
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

from service.samples import MongoWireServer, SampleHttpServices
from service.samples.mongo_server import free_port
from service.samples.seed import SAMPLE_END_MS, SAMPLE_START_MS
from tests.support.deployment import (
    check_drain,
    check_serving,
    container_run,
    deployment,
    fanout_container,
)
from tests.support.dist import ROOT, Dist, Installed
from tests.support.samples import backend_overrides


def _packages_in_tree() -> set[str]:
    return {
        str(init.parent.relative_to(ROOT))
        for top in ("service", "lookups", "tracing")
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


def test_the_wheel_holds_every_package_of_the_tree_and_the_idl(dist: Dist) -> None:
    names = set(zipfile.ZipFile(dist.wheel).namelist())
    packages = {str(Path(name).parent) for name in names if name.endswith("/__init__.py")}
    assert packages == _packages_in_tree()
    assert "lookups/resilience/guard.py" in names
    packaged_idl = zipfile.ZipFile(dist.wheel).read("service/appstats.thrift")
    assert packaged_idl == (ROOT / "thrift" / "appstats.thrift").read_bytes()
    assert not any(name.startswith(("tests/", "bench/", "thrift/")) for name in names)
    # Pure Python: one wheel for every platform, no extension module in it.
    assert dist.wheel.name.endswith("-py3-none-any.whl"), dist.wheel.name
    assert not any(name.endswith((".so", ".pyd", ".c")) for name in names)


def test_the_sdist_holds_the_idl_the_tests_and_the_readme(dist: Dist) -> None:
    with tarfile.open(dist.sdist) as sdist:
        top = sdist.getnames()[0].split("/")[0]
        names = {name.removeprefix(top + "/") for name in sdist.getnames()}
    assert {
        "thrift/appstats.thrift",
        "README.md",
        "pyproject.toml",
        "setup.py",
        "tests/conftest.py",
        "tests/test_packaging.py",
        "deploy/kubernetes/deployment.yaml",
    } <= names
    assert not any("__pycache__" in name for name in names)


def test_the_installed_package_is_the_wheel_not_the_checkout(installed: Installed) -> None:
    done = installed.run(
        ["python", "-c", "import service, lookups.resilience, tracing; print(service.__file__)"]
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(installed.venv), done.stdout
    done = installed.run(["python", "-c", "from service.idl import idl_file; print(idl_file())"])
    assert done.returncode == 0 and Path(done.stdout.strip()).is_relative_to(installed.venv)


def test_fanout_version_is_the_projects(installed: Installed) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    done = installed.run(["fanout", "--version"])
    assert (done.returncode, done.stdout.strip()) == (0, f"fanout {version}"), done.stderr


def test_fanout_demo_gathers_every_panel_from_the_installed_wheel(installed: Installed) -> None:
    # What is tested is the installed wheel, not speed: budgets a stressed run keeps (with
    # the defaults, one saw a panel cut at its 1000 ms).
    patient = {
        "FANOUT_FANOUT_TASK_TIMEOUT_MS": "10000",
        "FANOUT_FANOUT_REQUEST_DEADLINE_MS": "12000",
    }
    done = installed.run(["fanout", "demo"], timeout_s=180, env=patient)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "panels not gathered" not in done.stdout
    assert "fanout.task errors" in done.stdout  # the trace's waterfall


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)


def _serve_and_call(
    installed: Installed,
    tmp_path: Path,
    mongo_server: MongoWireServer,
    http_services: SampleHttpServices,
) -> str:
    """``fanout serve`` from ``installed`` answers ``fanout call`` and stops on SIGTERM; its
    log (at info) is returned."""
    config = tmp_path / "fanout.toml"
    keys = backend_overrides(mongo_server, http_services)
    config.write_text(
        f'[mongo]\nuri = "{keys["mongo.uri"]}"\ndatabase = "{keys["mongo.database"]}"\n'
        f'[http]\nalerts_url = "{keys["http.alerts_url"]}"\n'
        f'metrics_url = "{keys["http.metrics_url"]}"\n'
    )
    # Port 0, read back from its line: a port found free a moment before may be taken by
    # then, by another test's process.
    server = installed.popen(
        ["fanout", "serve", "--config", str(config), "--port", "0", "--log-level", "info"],
        env={"OTEL_TRACES_EXPORTER": "none"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert server.stdout is not None and server.stderr is not None
        found = re.search(r"serving on [\d.]+:(\d+)", server.stdout.readline())
        assert found, server.stderr.read()
        port = int(found.group(1))
        done = installed.run(
            [
                "fanout",
                "call",
                "get_app_stats",
                "--app",
                "shop",
                "--port",
                str(port),
                "--start-ms",
                str(SAMPLE_START_MS),
                "--end-ms",
                str(SAMPLE_END_MS),
                "--json",
            ]
        )
        assert done.returncode == 0, done.stderr
        assert '"status": "OK"' in done.stdout and '"status": "ERROR"' not in done.stdout
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        assert server.stderr is not None
        return server.stderr.read()
    finally:
        _stop(server)


def test_an_installed_fanout_serve_answers_fanout_call(
    installed: Installed,
    tmp_path: Path,
    mongo_server: MongoWireServer,
    http_services: SampleHttpServices,
) -> None:
    log = _serve_and_call(installed, tmp_path, mongo_server, http_services)
    assert "Traceback" not in log, log


@pytest.fixture
def deployment_run(mongo_server: MongoWireServer, http_services: SampleHttpServices) -> Any:
    return container_run(
        fanout_container(),
        backend_overrides(mongo_server, http_services),
        otlp_endpoint=f"http://127.0.0.1:{free_port()}",
    )


def test_the_deployments_command_and_env_serve_and_drain(
    installed: Installed, deployment_run: Any, tmp_path: Path
) -> None:
    """What a pod runs, against the installed wheel: probes, a scrape, a call, SIGTERM."""
    assert deployment_run.substituted == {
        "FANOUT_BACKENDS_MONGO_URI",
        "FANOUT_BACKENDS_ALERTS_URL",
        "FANOUT_BACKENDS_METRICS_URL",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "FANOUT_SERVER_PORT",
        "FANOUT_METRICS_PORT",
        "FANOUT_SERVER_PROBE_PORT",
    }
    log = (tmp_path / "pod.log").open("w")
    pod = installed.popen(
        deployment_run.command, env=deployment_run.env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        check_serving(deployment_run.ports)
        grace_s = deployment()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        check_drain(
            deployment_run.ports,
            lambda: pod.send_signal(signal.SIGTERM),
            lambda timeout_s: pod.wait(timeout=timeout_s),
            grace_s,
        )
    finally:
        _stop(pod)
        log.close()
    text = (tmp_path / "pod.log").read_text()
    assert "lame duck" in text and "Traceback" not in text, text[-3000:]
    assert "deprecated" not in text, text[-3000:]  # the manifest writes the current settings


def test_a_wrong_flag_in_the_deployments_command_fails(
    installed: Installed, deployment_run: Any
) -> None:
    """The check above can fail: the manifest's command with a flag fanout does not take."""
    done = installed.run([*deployment_run.command, "--no-such-flag"], env=deployment_run.env)
    assert done.returncode == 2 and "unrecognized arguments" in done.stderr
