"""The hot path, compiled or pure: which modules one call runs through, and how they loaded.

The modules in :data:`HOT_PATH` are compiled with mypyc when the wheel is built where a C
compiler is present (``setup.py`` reads this list; it is declared nowhere else). Each then
loads as a C extension, and runs the same code with less interpreter overhead. A build
without a compiler, or with ``FANOUT_PURE=1``, ships the same modules as plain Python: the
behaviour is the same, only the CPU per call differs. :func:`describe` says which one a
process runs, for its one log line at start (``fanout serve``).

``FANOUT_PURE=1`` in a compiled install's environment runs the sources instead
(:func:`run_sources`, from ``service/__init__.py``): for a profiler, which sees no frame
of compiled code, and for comparing the two in one benchmark run.

This module imports nothing of ours, so that ``setup.py`` can read it without importing
the packages (and their dependencies) it is building.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence

__all__ = [
    "HOT_PATH",
    "PURE_ENV",
    "compiled_modules",
    "describe",
    "pure_requested",
    "run_sources",
    "stale_extensions",
]

#: Set (to anything but "" or "0") at build time, builds the hot path pure; at run time,
#: runs it from its sources.
PURE_ENV = "FANOUT_PURE"

#: The modules of ours that one call runs through, from the wire to the lookups' parsing,
#: in the order a call meets them.
HOT_PATH = (
    "service.listener.connection",
    "service.rpc.handler",
    "service.engine.fanout",
    "service.engine.tasks",
    "lookups.deadline",
    "lookups.panels",
    "lookups.mongo",
    "lookups.http",
    "tracing.context",
    "tracing.spans",
)


_EXTENSION_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def compiled_modules() -> list[str]:
    """The modules of :data:`HOT_PATH` that this process loaded from a C extension."""
    return [
        name
        for name in HOT_PATH
        if (getattr(importlib.import_module(name), "__file__", None) or "").endswith(
            _EXTENSION_SUFFIXES
        )
    ]


def stale_extensions(names: tuple[str, ...] = HOT_PATH) -> list[str]:
    """The modules of ``names`` whose compiled extension is older than the source
    beside it: in a checkout compiled in place (``make compiled``) and edited since, the
    extension would run instead of the edit. Only the packages are imported to find out
    (a module loaded through its package's compiled library may carry a made-up
    ``__file__``, so the files are looked for where the package is)."""
    stale = []
    for name in names:
        package, leaf = name.rsplit(".", 1)
        spec = importlib.util.find_spec(package)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            source = os.path.join(folder, leaf + ".py")
            built = [os.path.join(folder, leaf + end) for end in _EXTENSION_SUFFIXES]
            if any(
                os.path.exists(path) and os.path.getmtime(source) > os.path.getmtime(path)
                for path in built
            ):
                stale.append(name)
    return stale


class _SourcesFirst:
    """A finder that loads the hot path's modules from their ``.py`` files, where the
    extension beside them would be taken otherwise."""

    loaders = ((importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES),)

    @classmethod
    def find_spec(
        cls, name: str, path: Sequence[str] | None = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in HOT_PATH:
            return None
        for folder in path or ():
            spec = importlib.machinery.FileFinder(folder, *cls.loaders).find_spec(name)
            if spec is not None:
                return spec
        return None


def run_sources() -> None:
    """From now on in this process, import the hot path from its sources (a module already
    imported stays as it is). Idempotent."""
    if _SourcesFirst not in sys.meta_path:
        sys.meta_path.insert(0, _SourcesFirst)


def pure_requested() -> bool:
    """Whether ``FANOUT_PURE`` asks for the sources."""
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def describe(compiled: list[str] | None = None) -> str:
    """One line: whether the hot path runs compiled, and if only in part, which modules
    (``compiled``: :func:`compiled_modules`, when already known)."""
    compiled = compiled_modules() if compiled is None else compiled
    if len(compiled) == len(HOT_PATH):
        return f"compiled with mypyc ({len(HOT_PATH)} modules)"
    if not compiled:
        why = (
            f"{PURE_ENV} is set"
            if pure_requested()
            else f"not compiled: built without a C compiler or with {PURE_ENV}=1"
        )
        return f"pure Python ({why}): same behaviour, more CPU per call"
    pure = ", ".join(name for name in HOT_PATH if name not in compiled)
    return f"compiled with mypyc except {pure}"
