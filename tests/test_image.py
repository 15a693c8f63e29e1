"""The container image (``Containerfile``) run as the Deployment runs it.

The image is built from the wheel that ``python -m build`` makes, unless
``FANOUT_IMAGE`` names one already built (``make image-smoke`` passes the one
``make image`` just made). It then runs with exactly the Deployment's command,
args, env, security context and volumes; only the backends and the ports are
substituted (see tests/support/deployment.py), and it shares the host's network
because the sample backends listen on loopback.
"""

from __future__ import annotations

import os
import subprocess
from typing import Iterator

import pytest

from service.samples import MongoWireServer, SampleHttpServices
from service.samples.mongo_server import free_port
from tests.support.deployment import (ContainerRun, check_drain, check_serving, container_run,
                                      deployment, fanout_container)
from tests.support.podman import IMAGE_TOOLS, podman, run_options
from tests.support.samples import backend_overrides
from tests.support.toolchains import needs

pytestmark = needs("image")

_TEST_TAG = "localhost/fanout:test"
_BUILD_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def image(request: pytest.FixtureRequest) -> str:
    if named := os.environ.get("FANOUT_IMAGE"):
        assert podman(["image", "exists", named], check=False).returncode == 0, \
            f"FANOUT_IMAGE={named} is not an image in build/image (make image makes it)"
        return named
    dist = request.getfixturevalue("dist")
    done = subprocess.run([str(IMAGE_TOOLS / "build"), str(dist.wheel), _TEST_TAG],
                          capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return _TEST_TAG


@pytest.fixture
def pod_run(mongo_server: MongoWireServer, http_services: SampleHttpServices) -> ContainerRun:
    return container_run(fanout_container(), backend_overrides(mongo_server, http_services),
                         otlp_endpoint=f"http://127.0.0.1:{free_port()}")


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


def test_the_image_serves_and_drains_as_the_deployment_runs_it(container: str,
                                                               pod_run: ContainerRun) -> None:
    check_serving(pod_run.ports)
    user = podman(["exec", container, "id", "-u"]).stdout.strip()
    assert user == str(deployment()["spec"]["template"]["spec"]["securityContext"]["runAsUser"])
    assert user != "0"
    pid1 = podman(["exec", container, "cat", "/proc/1/cmdline"]).stdout.split("\0")
    assert pid1[1:3] == ["/opt/fanout/bin/fanout", "serve"], pid1
    grace_s = deployment()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    check_drain(pod_run.ports, lambda: podman(["kill", "--signal=TERM", container]),
                lambda timeout_s: _exit_code(container, timeout_s), grace_s)
    log = podman(["logs", container]).stderr + podman(["logs", container]).stdout
    assert "lame duck" in log and "Traceback" not in log, log[-3000:]


def test_the_image_holds_the_wheel_not_a_checkout(image: str) -> None:
    done = podman(["run", "--rm", "--pull=never", "--network=none", "--entrypoint=python3", image,
                   "-c", "import service; print(service.__file__)"])
    where = done.stdout.strip()
    assert where.startswith("/opt/fanout/lib/") and "/site-packages/service/" in where, where
