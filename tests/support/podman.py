"""Podman as ``deploy/image/build`` configures it, and a pod's container run by it.

Commands go through ``deploy/image/podman-env``, so they see the storage that
``make image`` built into (``~/.cache/fanout/podman``) and the ulimits this machine needs.
:func:`run_options` turns the Deployment's container into ``podman run`` flags:
its ``command`` becomes the entrypoint and its ``args`` the arguments, as
Kubernetes does, and the security context and ``emptyDir`` mounts become their
podman equivalents, so the image is tested under the manifest's restrictions.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support.deployment import ContainerRun
from tests.support.toolchains import require

__all__ = ["IMAGE_TOOLS", "podman", "run_options"]

IMAGE_TOOLS = Path(__file__).resolve().parents[2] / "deploy" / "image"


def podman(
    args: Sequence[str], timeout_s: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``podman ARGS`` with this project's podman environment."""
    require("image")
    script = f'source "{IMAGE_TOOLS / "podman-env"}" && exec podman "$@"'
    done = subprocess.run(
        ["bash", "-c", script, "podman", *args], capture_output=True, text=True, timeout=timeout_s
    )
    if check:
        assert done.returncode == 0, f"podman {' '.join(args)}:\n{done.stderr[-3000:]}"
    return done


def _security_flags(pod: Mapping[str, Any], container: Mapping[str, Any]) -> list[str]:
    security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    flags = []
    if "runAsUser" in security:
        flags.append(f"--user={security['runAsUser']}:{security.get('runAsGroup', 0)}")
    if security.get("readOnlyRootFilesystem"):
        flags += ["--read-only", "--read-only-tmpfs=false"]
    flags += [f"--cap-drop={cap}" for cap in security.get("capabilities", {}).get("drop", [])]
    if security.get("allowPrivilegeEscalation") is False:
        flags.append("--security-opt=no-new-privileges")
    return flags


def _volume_flags(pod: Mapping[str, Any], container: Mapping[str, Any]) -> list[str]:
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    flags = []
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        assert "emptyDir" in volume, f"only emptyDir volumes can be run here: {volume}"
        flags.append(f"--tmpfs={mount['mountPath']}:rw,mode=1777")
    return flags


def run_options(
    pod: Mapping[str, Any], container: Mapping[str, Any], run: ContainerRun, name: str
) -> list[str]:
    """``podman run`` flags for the pod's container, on the host's network (see deployment)."""
    flags = [
        "--detach",
        f"--name={name}",
        "--pull=never",
        "--network=host",
        *_security_flags(pod, container),
        *_volume_flags(pod, container),
    ]
    if run.entrypoint:
        flags.append(f"--entrypoint={json.dumps(run.entrypoint)}")
    for key, value in run.env.items():
        flags.append(f"--env={key}={value}")
    return flags
