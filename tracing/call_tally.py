"""The calls' histogram kept in a file too, so that a worker's calls outlive it.

A worker's counts reach the group's scrape through the master: as of the master's last
scrape of it, or, once it has drained, in its last word (``service.workers.counts``). A
worker killed without a word (SIGKILL, the OOM killer, a stuck loop) would take with it
what it answered since that scrape. So a worker also adds each call that
:class:`~tracing.spans.CallDurations` records to a file of its own, mapped into memory,
which the master reads once the worker has gone: pages the kernel keeps whatever becomes
of the process, as prometheus_client's multiprocess mode keeps its values.

It holds the ``rpc.server.call.duration`` histogram and nothing else: by ``rpc.method``
and ``error.type`` (the histogram's own attributes; an answer's is empty), the calls in
each bucket of :data:`~tracing.metrics.SECONDS_BUCKETS` and the sum of their seconds. A
call costs a dictionary lookup, a bisection and two stores, on the event loop's thread,
the only one that records calls. A call is in the file before it is in the histogram,
so the file never holds fewer.

Layout, in the machine's byte order (the master reads it on the machine that wrote it)::

    header   magic, version, bucket bounds, slots                   4 x uint32
    slot     "rpc.method NUL error.type" in UTF-8, NUL-padded        KEY_BYTES
             sum of seconds                                         float64
             calls per bucket, the last one above every bound       (bounds + 1) x uint64

A slot is taken in the order its key is first seen; its key is written before its counts.
"""

from __future__ import annotations

import mmap
import os
import struct
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from tracing.metrics import SECONDS_BUCKETS

__all__ = ["CallTally", "TalliedCalls", "keep_calls_in", "kept", "read_call_tally"]

_MAGIC, _VERSION = 0x54434E46, 1  # "FNCT"
_HEADER = struct.Struct("=4I")
#: Methods the IDL declares (or ``_OTHER``) by exception names: a few dozen at most; a key
#: beyond the last slot is not kept (its calls count as of the worker's last scrape).
SLOTS = 256
KEY_BYTES = 120
_BUCKETS = len(SECONDS_BUCKETS) + 1
_SLOT_BYTES = KEY_BYTES + 8 + 8 * _BUCKETS
_FILE_BYTES = _HEADER.size + SLOTS * _SLOT_BYTES
# A slot's calls per bucket, and its sum (memoryview is generic to mypy, not at run time).
_Slot: TypeAlias = "tuple[memoryview[int], memoryview[float]]"


@dataclass(frozen=True)
class TalliedCalls:
    """The calls of one ``rpc.method`` and ``error.type`` as the file holds them."""

    method: str
    error_type: str
    #: Calls per bucket of ``SECONDS_BUCKETS``, not cumulative; the last above every bound.
    buckets: tuple[int, ...]
    seconds: float

    @property
    def count(self) -> int:
        return sum(self.buckets)


class CallTally:
    """The file at ``path``, made anew and mapped; :meth:`add` one call."""

    def __init__(self, path: str | Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _FILE_BYTES)
            self._map = mmap.mmap(fd, _FILE_BYTES)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._map, 0, _MAGIC, _VERSION, len(SECONDS_BUCKETS), SLOTS)
        self._view = memoryview(self._map)
        self._slots: dict[tuple[str, str], _Slot] = {}

    def add(self, method: str, error_type: str, seconds: float) -> None:
        """One call to ``method`` (``rpc.method``) answered in ``seconds``, with
        ``error_type`` (empty for an answer)."""
        slot = self._slots.get((method, error_type)) or self._claim(method, error_type)
        if slot is not None:
            counts, total = slot
            counts[bisect_left(SECONDS_BUCKETS, seconds)] += 1
            total[0] += seconds

    def _claim(self, method: str, error_type: str) -> _Slot | None:
        key = f"{method}\0{error_type}".encode()
        if len(self._slots) >= SLOTS or len(key) > KEY_BYTES:
            return None
        start = _HEADER.size + len(self._slots) * _SLOT_BYTES
        self._map[start : start + len(key)] = key
        sums = start + KEY_BYTES
        total = self._view[sums : sums + 8].cast("d")
        counts = self._view[sums + 8 : start + _SLOT_BYTES].cast("Q")
        slot = self._slots[(method, error_type)] = (counts, total)
        return slot


def read_call_tally(path: str | Path) -> list[TalliedCalls]:
    """What the file at ``path`` holds, in the order its keys were first seen; empty if there
    is no file, or it is not one this version writes with these bounds."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    if len(data) != _FILE_BYTES or _HEADER.unpack_from(data) != (
        _MAGIC,
        _VERSION,
        len(SECONDS_BUCKETS),
        SLOTS,
    ):
        return []
    tallied = []
    for start in range(_HEADER.size, _FILE_BYTES, _SLOT_BYTES):
        key = data[start : start + KEY_BYTES].rstrip(b"\0")
        if not key:
            break  # slots are taken in order: the rest are free
        method, _, error_type = key.decode(errors="replace").partition("\0")
        (seconds,) = struct.unpack_from("=d", data, start + KEY_BYTES)
        buckets = struct.unpack_from(f"={_BUCKETS}Q", data, start + KEY_BYTES + 8)
        if any(buckets):
            tallied.append(TalliedCalls(method, error_type, buckets, seconds))
    return tallied


_kept: CallTally | None = None


def keep_calls_in(path: str | Path) -> CallTally:
    """From now on, this process keeps its calls in the file at ``path`` too."""
    global _kept
    _kept = CallTally(path)
    return _kept


def kept() -> CallTally | None:
    """The file this process keeps its calls in, if any."""
    return _kept
