"""Refusing a call unread: the cheapest answer for a caller that ignores ``retry_after_ms``.

Pacing (:mod:`service.overload.pacing`) holds such a caller's refusals, so each of its
connections is refused about once per deadline whatever it does. What is left is
the cost of each refusal, and most of that is reading the call: decoding its
arguments, validating them, opening its span and planning its tasks, all for an
answer decided in advance.

So while admission is saturated (the limit is reached), a ``get_app_stats`` from
a connection whose caller came back before the pause it was told is answered
``Overloaded`` from the message header alone: the method name and seqid are read
(:func:`service.wire.header.call_header`), the rest is skipped. It is held as
pacing holds any such refusal, within the deadline that caller's last call
carried (:mod:`service.overload.held_connections` holds it where the connection allows, off
its greenlet, and then reads that caller's next call there too), and counted as every
refusal is (``fanout.calls.overloaded``,
``fanout.calls.held``, ``rpc.server.call.duration`` with ``error.type``
``Overloaded``). It makes no span. Only the frame limit has bounded the message:
its header is read with every length checked again, and the rest is never decoded,
so the wire scan is left for the calls that are; a malformed call from such a caller
is refused, not rejected, until it is read.

Callers that honour ``retry_after_ms`` and every other method are read as usual.
"""

from __future__ import annotations

from typing import Any, Optional

from service.overload.gate import CallGate
from service.overload.pacing import CallerPacing
from service.idl import appstats
from service.wire.header import call_header

__all__ = ["UnreadRefusals"]

_METHOD = "get_app_stats"
_MESSAGE = ("overloaded: this connection called again before the retry_after_ms it was "
            "told; refused without being read")


class UnreadRefusals:
    """Decides, from a checked message and its connection's caller, whether to refuse it unread.

    Call it with each message before decoding: it returns ``(method, seqid,
    result)`` to answer with, or None to serve the message as usual. How long to
    hold the answer is the caller's :meth:`~service.overload.pacing.CallerPacing.take_hold`.
    It never blocks, so the hub's callbacks may call it.
    """

    def __init__(self, gate: CallGate, protocol: str) -> None:
        self._gate = gate
        self._admission = gate.admission
        self._protocol = protocol

    def __call__(self, caller: CallerPacing, message: Any) -> Optional[tuple[str, int, Any]]:
        if not caller.back_early() or not self._admission.saturated:
            return None
        header = call_header(message, self._protocol)
        if header is None or header[0] != _METHOD:
            return None
        retry_after_ms = self._gate.refused_unread(caller)
        result = appstats.AppStats.get_app_stats_result()
        result.overloaded = appstats.Overloaded(message=_MESSAGE, retry_after_ms=retry_after_ms)
        return _METHOD, header[1], result
