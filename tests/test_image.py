"""The container image (``Containerfile``) run as the Deployment runs it.

The image is built from the wheel that ``python -m build`` makes, unless
``FANOUT_IMAGE`` names one already built (``make image-smoke`` passes the one
``make image`` just made). It then runs with exactly the Deployment's command,
args, env, security context and volumes; only the backends and the ports are
substituted (see tests/support/deployment.py), and it shares the host's network
because the sample backends listen on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from service.client import AppStatsClient
from service.samples import MongoWireServer, SampleHttpServices
from service.samples.mongo_server import free_port
from tests.support.deployment import (
    ContainerRun,
    check_drain,
    check_serving,
    container_run,
    deployment,
    fanout_container,
    http_get,
)
from tests.support.podman import IMAGE_TOOLS, podman, run_options
from tests.support.samples import backend_overrides
from tests.support.sockets import wait_for
from tests.support.toolchains import needs

#: This run's tag: podman's storage is shared by every checkout on the machine (podman-env).
_TEST_TAG = f"localhost/fanout:test-{os.getpid()}"
_BUILD_TIMEOUT_S = 900
# The first build on a machine (a Debian root fetched and unpacked) ran past the suite's
# 120 s a test on a slow host: the test that waits on a build gets the build's bound, and
# its own steps beside it.
pytestmark = [needs("image"), pytest.mark.timeout(_BUILD_TIMEOUT_S + 300)]


@pytest.fixture(scope="module")
def image(request: pytest.FixtureRequest) -> Iterator[str]:
    if named := os.environ.get("FANOUT_IMAGE"):
        assert podman(["image", "exists", named], check=False).returncode == 0, (
            f"FANOUT_IMAGE={named} is not an image in podman's storage (make image makes it)"
        )
        yield named
        return
    dist = request.getfixturevalue("dist")
    done = subprocess.run(
        [str(IMAGE_TOOLS / "build"), str(dist.wheel), _TEST_TAG],
        capture_output=True,
        text=True,
        timeout=_BUILD_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    yield _TEST_TAG
    podman(["rmi", "--force", _TEST_TAG], check=False)


@pytest.fixture
def pod_run(mongo_server: MongoWireServer, http_services: SampleHttpServices) -> ContainerRun:
    return container_run(
        fanout_container(),
        backend_overrides(mongo_server, http_services),
        otlp_endpoint=f"http://127.0.0.1:{free_port()}",
    )


@pytest.fixture
def container(image: str, pod_run: ContainerRun) -> Iterator[str]:
    name = f"fanout-test-{os.getpid()}-{free_port()}"
    pod = deployment()["spec"]["template"]["spec"]
    podman(["run", *run_options(pod, fanout_container(), pod_run, name), image, *pod_run.args])
    try:
        yield name
    finally:
        podman(["rm", "--force", "--time=0", name], check=False)


def _exit_code(name: str, timeout_s: float) -> int:
    return int(podman(["wait", name], timeout_s=timeout_s).stdout.strip())


def test_the_image_serves_and_drains_as_the_deployment_runs_it(
    container: str, pod_run: ContainerRun
) -> None:
    check_serving(pod_run.ports)
    user = podman(["exec", container, "id", "-u"]).stdout.strip()
    assert user == str(deployment()["spec"]["template"]["spec"]["securityContext"]["runAsUser"])
    assert user != "0"
    pid1 = podman(["exec", container, "cat", "/proc/1/cmdline"]).stdout.split("\0")
    assert pid1[1:3] == ["/opt/fanout/bin/fanout", "serve"], pid1
    grace_s = deployment()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    check_drain(
        pod_run.ports,
        lambda: podman(["kill", "--signal=TERM", container]),
        lambda timeout_s: _exit_code(container, timeout_s),
        grace_s,
    )
    log = podman(["logs", container]).stderr + podman(["logs", container]).stdout
    assert "lame duck" in log and "Traceback" not in log, log[-3000:]


def test_the_image_holds_the_wheel_not_a_checkout(image: str) -> None:
    done = podman(
        [
            "run",
            "--rm",
            "--pull=never",
            "--network=none",
            "--entrypoint=python3",
            image,
            "-c",
            "import service; print(service.__file__)",
        ]
    )
    where = done.stdout.strip()
    assert where.startswith("/opt/fanout/lib/") and "/site-packages/service/" in where, where


def _played_manifest(image: str, pod_run: ContainerRun) -> str:
    """deploy/kubernetes as ``podman kube play`` runs it here: the Deployment with one
    replica of ``image`` on the host's network, with :func:`container_run`'s substitutions
    (the backends, and the ports, since the host has one network namespace). On the host's
    network podman maps no ports, so the container's port list goes and the probes name
    their port by number."""
    manifest = deployment()
    manifest["spec"]["replicas"] = 1
    pod = manifest["spec"]["template"]["spec"]
    pod["hostNetwork"] = True
    container = next(c for c in pod["containers"] if c["name"] == "fanout")
    container["image"] = image
    container["imagePullPolicy"] = "Never"
    container["env"] = [{"name": name, "value": value} for name, value in pod_run.env.items()]
    for probe in ("readinessProbe", "livenessProbe"):
        container[probe]["httpGet"]["port"] = pod_run.ports[container[probe]["httpGet"]["port"]]
    del container["ports"]
    return yaml.safe_dump(manifest)


def test_kube_play_runs_the_manifest_serves_and_stops_cleanly(
    image: str, pod_run: ContainerRun, tmp_path: Path
) -> None:
    played = tmp_path / "deployment.yaml"
    played.write_text(_played_manifest(image, pod_run))
    podman(["kube", "play", str(played)], timeout_s=300)
    pod = f"{deployment()['metadata']['name']}-pod-0"
    try:
        check_serving(pod_run.ports)
        # /readyz answers once one worker serves; the second may still be starting then.
        assert wait_for(
            lambda: _workers(pod_run.ports) == ["serving", "serving"],
            60,
            "both workers serving",
            poll_s=0.2,
        )
        container = podman(
            ["pod", "inspect", "--format", "{{range .Containers}}{{.Name}} {{end}}", pod]
        ).stdout.split()
        fanout = next(name for name in container if name.endswith("-fanout"))
        grace_s = deployment()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        podman(["pod", "stop", f"--time={grace_s}", pod], timeout_s=grace_s + 30)
        state = podman(["inspect", "--format", "{{.State.ExitCode}}", fanout]).stdout.strip()
        log = podman(["logs", fanout]).stderr
        assert state == "0", log[-3000:]
        assert "all workers stopped; exiting 0" in log and "Traceback" not in log, log[-3000:]
    finally:
        podman(["kube", "down", str(played)], check=False)


def test_the_image_alone_answers_on_a_published_port(image: str) -> None:
    # No environment at all: the image's own defaults, as `podman run -p` users run it.
    port = free_port()
    name = f"fanout-published-{os.getpid()}-{port}"
    podman(
        [
            "run",
            "--detach",
            "--pull=never",
            f"--name={name}",
            f"--publish=127.0.0.1:{port}:9090",
            image,
        ]
    )
    try:
        with AppStatsClient("127.0.0.1", port, timeout_ms=5_000) as client:
            assert wait_for(lambda: _pings(client), 30, "ping through the published port")
    finally:
        podman(["rm", "--force", "--time=0", name], check=False)


def _workers(ports: dict[str, int]) -> list[str]:
    """The workers' states as /healthz reports them, sorted."""
    body = http_get(f"http://127.0.0.1:{ports['probes']}/healthz")[1]
    return sorted(json.loads(body)["workers"].values())


def _pings(client: AppStatsClient) -> bool:
    try:
        return client.ping() == "pong"
    except Exception:
        return False
