"""``retry_after_ms``: when a refused caller should try again, steered from the refusals.

The refusal rate is steered towards a quarter of the admission rate (at least five a
second), so that callers who honour the pause (with jitter) spend little of the process
on being refused: callers in back-off are about ``refused x retry_after``, so once a
second the pause is scaled by the square root of refused over aimed at, and halved
when nothing was refused. It stays between 20 ms (or the typical latency, if longer)
and 10 s. Critical and sheddable calls are steered apart: a flood of sheddable callers
refused must not send critical ones away for seconds. Every refusal a caller is told of
counts, whoever decided it: admission, or the brownout dimmer. The window rolls when a
pause is asked for (every refusal asks for one), never on an admitted call, whose only
cost here is a counter (:attr:`RetryAfter.admissions`): a warm call runs none of this
module.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lookups.clock import Clock
from service.overload.brownout import Criticality

__all__ = ["RetryAfter"]

_WINDOW_S = 1.0  # how often the pause is re-steered
_REFUSAL_SHARE = 0.25  # refusals aimed at, as a share of admissions
_AIM_MIN = 5.0  # ...and at least this many a second
_MIN_S, _MAX_S = 0.02, 10.0


class RetryAfter:
    """The pause to tell refused callers, per class of criticality. ``clock`` is monotonic
    seconds; ``floor_s`` the shortest pause worth telling (admission's typical latency)."""

    def __init__(self, clock: Clock, floor_s: Callable[[], float]) -> None:
        self._clock = clock
        self._floor_s = floor_s
        # Per class: [CRITICAL_PLUS and CRITICAL, SHEDDABLE_PLUS and SHEDDABLE].
        self._pause_s = [0.1, 0.1]
        self._started = clock.monotonic()
        #: Calls admitted in the window, per class; admission counts them itself.
        self.admissions = [0, 0]
        self._refused = [0, 0]

    def ms(self, criticality: Criticality) -> int:
        """The pause for a refused caller of ``criticality``, in milliseconds (it adds jitter)."""
        self._roll()
        return int(self._pause_s[_class(criticality)] * 1000.0)

    def least_ms(self) -> int:
        """The shortest pause worth telling, in milliseconds: for a caller refused while
        under its fair share, whose calls admission serves first."""
        return int(max(_MIN_S, self._floor_s()) * 1000.0)

    def refused(self, criticality: int) -> None:
        """A call of ``criticality`` was refused, by admission or by the dimmer (its caller
        is then told :meth:`ms`, which rolls the window)."""
        self._refused[_class(criticality)] += 1

    def _roll(self) -> None:
        now = self._clock.monotonic()
        elapsed = now - self._started
        if elapsed < _WINDOW_S:
            return
        floor_s = max(_MIN_S, self._floor_s())
        for klass in (0, 1):
            refused = self._refused[klass] / elapsed
            aim = max(_REFUSAL_SHARE * self.admissions[klass] / elapsed, _AIM_MIN)
            pause_s = self._pause_s[klass]
            pause_s = pause_s * math.sqrt(refused / aim) if refused > 0 else pause_s / 2.0
            self._pause_s[klass] = min(_MAX_S, max(floor_s, pause_s))
        self._started, self.admissions, self._refused = now, [0, 0], [0, 0]


def _class(criticality: int) -> int:
    """0 for the critical calls (CRITICAL_PLUS, CRITICAL), 1 for the sheddable ones (the
    index of :attr:`RetryAfter.admissions`)."""
    return int(criticality > Criticality.CRITICAL)
