"""The one small interface every lookup implements."""

from __future__ import annotations

import abc
from typing import ClassVar

from lookups.deadline import Deadline
from lookups.panels import PanelValue, Window

__all__ = ["Lookup"]


class Lookup(abc.ABC):
    """Fetches one dashboard panel from one backend.

    Subclasses set ``name`` (the panel name on the wire) and ``source`` (``"mongo"``,
    ``"http"``, ...). :meth:`fetch` runs in a fan-out greenlet in a copy of the
    request's context, so the request's span is current inside it. Its only view of
    the request is its arguments: the window, and the deadline it must push into its I/O.
    A greenlet it starts itself must start through :func:`tracing.context.spawn_in_context`.

    A lookup that calls a backend takes it as its constructor's argument and calls it
    through :meth:`lookups.backends.base.Backend.call` (or ``MongoBackend.run``,
    ``HttpBackend.get_json``), which bring the backend's slots, retries and breaker.
    """

    name: ClassVar[str]
    source: ClassVar[str]

    @abc.abstractmethod
    def fetch(self, window: Window, deadline: Deadline) -> PanelValue:
        """Return the panel for ``window``, giving up by ``deadline``.

        ``deadline`` is already the sooner of the task's timeout and the request's
        deadline; push it into the library call (pymongo ``timeout()``, requests
        ``timeout=``, as ``deadline.remaining_s()``) so the library gives up cleanly
        instead of being killed. A backend's ``call`` takes the deadline as it is.

        Raises :class:`lookups.errors.LookupFailed` (or a subclass) on failure;
        any other exception is reported as an internal ``ERROR`` outcome.
        """

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ({self.source})>"
