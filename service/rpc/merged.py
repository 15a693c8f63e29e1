"""Panels answered by one backend command (``fanout.merge_commands``).

The urls and controllers panels group the same ``requests`` of the same window: with
``fanout.merge_commands`` on, a call that plans both answers them with one MongoDB
command (:class:`~lookups.mongo.RequestTopsCommand`, a ``$facet``) instead of two. The
first of the two tasks to run sends it; the other waits for it as a follower of the
request coalescer (:mod:`service.engine.coalescing`), within its own deadline, and a
call for the same window in flight at the same moment shares it too. The two panels
succeed or fail together, each outcome naming its panel. Only the panels' own lookups
merge: a cached panel (the results cache) or a lookup of a plugin is planned as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lookups.base import Lookup
from lookups.deadline import Deadline
from lookups.mongo import ControllersLookup, RequestTopsCommand, UrlsLookup
from lookups.panels import PanelValue, Window
from service.engine.coalescing import Coalescer
from tracing.spans import mark_coalesced

__all__ = ["merged_calls"]

TaskCall = Callable[[Deadline], Any]


def merged_calls(
    planned: Mapping[str, Lookup],
    window: Window,
    coalescer: Coalescer | None,
    to_panel_data: Callable[[PanelValue], Any],
) -> dict[str, TaskCall]:
    """The task bodies of the planned panels one command answers, by panel name (none
    when fewer than two of them are planned, or they are not the panels' own lookups on
    one backend). ``coalescer``: the service's, else one for this call alone."""
    urls, controllers = planned.get(UrlsLookup.name), planned.get(ControllersLookup.name)
    if not (
        type(urls) is UrlsLookup
        and type(controllers) is ControllersLookup
        and urls.backend is controllers.backend
    ):
        return {}
    command = RequestTopsCommand(urls.backend)
    sharing = coalescer if coalescer is not None else Coalescer()
    key = (command.name, window)

    def part(name: str) -> TaskCall:
        def call(deadline: Deadline) -> Any:
            tops = sharing.call(
                key, deadline, lambda: command.fetch(window, deadline), joined=mark_coalesced
            )
            value: PanelValue = getattr(tops, name)
            return to_panel_data(value)

        return call

    return {name: part(name) for name in RequestTopsCommand.PANELS}
