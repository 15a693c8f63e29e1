"""The request context: what every part of one call may need to know about it.

The handler makes one :class:`RequestContext` per call and hands it to
:meth:`FanOut.run <service.engine.fanout.FanOut.run>` explicitly. Lookups get
no context object: each receives its budget (``min(task timeout, time left)``)
as an argument, which is all a lookup needs and cannot go stale.
"""

from __future__ import annotations

import contextvars
import uuid
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional

from lookups.deadline import Deadline

__all__ = ["RequestContext", "new_request_id", "current_request_id"]

#: The request id of the call being served, for its log lines (service.operations.logs):
#: each call runs in a context of its own, and its tasks in copies of it.
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "fanout_request_id", default="")


def new_request_id() -> str:
    """A short random id for a call that brought none."""
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class RequestContext:
    """One RPC: its id, method, :class:`Deadline` and the caller's propagation headers.

    ``headers`` are the caller's W3C ``traceparent``, ``tracestate`` and ``baggage``;
    ``deadline`` bounds all work done for the call.
    """

    request_id: str
    method: str
    deadline: Deadline
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def start(cls, method: str, deadline_ms: float, request_id: Optional[str] = None,
              headers: Optional[Mapping[str, str]] = None) -> "RequestContext":
        """A context for a call starting now, due ``deadline_ms`` from now."""
        return cls(request_id or new_request_id(), method, Deadline.after_ms(deadline_ms),
                   MappingProxyType(dict(headers or {})))

    def __repr__(self) -> str:
        return (f"<RequestContext {self.method} id={self.request_id} "
                f"remaining={self.deadline.remaining_ms():.0f}ms>")
