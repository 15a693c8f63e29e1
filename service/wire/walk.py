"""What the per-protocol message walkers share with :class:`service.wire.scan.MessageScan`.

A walker moves through a message's values with an explicit stack instead of
recursion, so a walk can stop where the received bytes end and resume when
more arrive. Each stack entry is a small list::

    [STRUCT]                                  expecting a field header or STOP
    [LIST, element type, items left]          a list or set
    [MAP, key type, value type, values left]  a map; keys when values left is even

Walkers return the offset where they stopped: the message's end once the
stack is empty, otherwise the start of the first value not wholly received
(the stack then as it was before that value).
"""

from __future__ import annotations

from typing import NoReturn, Protocol

from service.wire.errors import MalformedMessage

__all__ = ["STRUCT", "LIST", "MAP", "CALL", "ONEWAY", "Checks", "bad_type", "bad_message_type"]

STRUCT, LIST, MAP = 0, 1, 2
#: The message types a server accepts.
CALL, ONEWAY = 1, 4


class Checks(Protocol):
    """The limit checks a walker calls; each raises unless the value is acceptable."""

    max_string_bytes: int

    def overrun(self, token: int, limit: int) -> NoReturn:
        """The value at ``token`` needs bytes past ``limit``."""

    def check_string(self, size: int, left: int) -> None: ...

    def check_items(self, count: int, smallest: int, left: int) -> None: ...

    def check_depth(self, depth: int) -> None: ...


def bad_type(ttype: int) -> MalformedMessage:
    return MalformedMessage(f"unknown value type {ttype}")


def bad_message_type(mtype: int) -> MalformedMessage:
    return MalformedMessage(f"message type {mtype} is not CALL or ONEWAY")
