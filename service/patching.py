"""gevent's patching of the standard library, for the programs that start with it.

``gevent.monkey.patch_all`` tells plug-ins of five entry-point groups
(``gevent.plugins.monkey.*``) about each module it patches, and looks them up again each
time: 25 lookups, each reading the metadata of every installed distribution. In a
virtualenv of a few dozen distributions that is most of ``patch_all``'s time, paid at
the start of every worker and every ``fanout`` command. :func:`patch_all` reads the
entry points once and answers gevent's lookups from them while it patches; gevent and
its plug-ins find the same entry points.

Import this module first, before anything that imports ``socket``, ``ssl`` or
``threading``: it imports only the standard library's metadata and gevent.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from gevent import monkey

__all__ = ["patch_all"]


def patch_all() -> None:
    """``gevent.monkey.patch_all()`` with its plug-ins found in one read of the metadata."""
    lookup = importlib.metadata.entry_points
    every = lookup()

    def select(**params: Any) -> Any:
        return every.select(**params) if params else every

    importlib.metadata.entry_points = select
    try:
        monkey.patch_all()
    finally:
        importlib.metadata.entry_points = lookup
