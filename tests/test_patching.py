"""gevent's patching as the programs start with it (service/patching.py): the same
patching, the same plug-ins, one read of the installed distributions' metadata."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Run in a fresh interpreter: the test process was patched before it started.
_PROBE = textwrap.dedent(
    """
    import importlib.metadata as metadata
    import sys

    reads = []
    every_distribution = metadata.distributions

    def counted(**params):
        reads.append(params)
        return every_distribution(**params)

    metadata.distributions = counted
    lookup = metadata.entry_points
    if sys.argv[1] == "ours":
        from service.patching import patch_all
    else:
        from gevent.monkey import patch_all
    patch_all()

    import socket, threading
    import gevent.socket, gevent.threading
    from gevent import monkey

    assert socket.socket is gevent.socket.socket and monkey.is_module_patched("threading")
    assert metadata.entry_points is lookup
    import told  # the plug-in's module, which recorded what it was told
    print(len(reads), ",".join(told.events))
    """
)

_PLUGIN = textwrap.dedent(
    """
    events = []

    def will_patch_all(event):
        events.append("will_patch_all")

    def did_patch_all(event):
        events.append("did_patch_all")
    """
)


def _patched(how: str, plugin_dir: Path) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, how],
        env={"PYTHONPATH": f"{plugin_dir}:{Path(__file__).resolve().parents[1]}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reads, told = done.stdout.split()
    return int(reads), told


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    """A distribution with a gevent plug-in for two of the patching's events."""
    (tmp_path / "told.py").write_text(_PLUGIN)
    info = tmp_path / "told-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: told\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[gevent.plugins.monkey.will_patch_all]\ntold = told:will_patch_all\n"
        "[gevent.plugins.monkey.did_patch_all]\ntold = told:did_patch_all\n"
    )
    return tmp_path


def test_the_programs_patch_as_gevent_does_reading_the_metadata_once(plugin_dir: Path) -> None:
    gevents_reads, gevents_plugin = _patched("gevent", plugin_dir)
    our_reads, our_plugin = _patched("ours", plugin_dir)
    assert our_plugin == gevents_plugin == "will_patch_all,did_patch_all"
    assert our_reads == 1 and gevents_reads > 1, (our_reads, gevents_reads)
