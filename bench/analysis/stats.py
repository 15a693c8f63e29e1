"""The statistics of the benchmark: means with Student-t intervals, percentiles, ratios.

The t quantile is scipy's (``scipy.stats.t``). Ratios between two configurations get a
percentile-bootstrap interval with a fixed seed, so the same raw figures always give
the same interval. That resampling is our own, not ``scipy.stats.bootstrap``, for one
gap: a configuration that completed nothing in some repetitions makes some resampled
ratios 0/0, and scipy's interval is then NaN (``numpy.percentile`` propagates it),
where dropping those draws still gives the interval of the ratios that exist.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scipy.stats import t as student_t

__all__ = [
    "Estimate",
    "mean_ci",
    "mean_or_nan",
    "percentile",
    "bootstrap_ratio",
    "ratio_of_means",
]

_BOOTSTRAP_SEED = 20260101
_BOOTSTRAP_SAMPLES = 2000


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its 95% interval ``[low, high]`` (equal to the value when
    there is too little data for an interval) and the number of repetitions behind it."""

    value: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2.0

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high, "n": self.n}


def mean_ci(values: Sequence[float], level: float = 0.95) -> Estimate:
    """The mean of ``values`` with its Student-t interval at ``level``.

    One value gives a zero-width interval; no values raise ValueError.
    """
    n = len(values)
    if n == 0:
        raise ValueError("mean_ci needs at least one value")
    mean = math.fsum(values) / n
    if n == 1:
        return Estimate(mean, mean, mean, 1)
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    half = float(student_t.ppf(0.5 + level / 2.0, n - 1)) * math.sqrt(variance / n)
    return Estimate(mean, mean - half, mean + half, n)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, linear interpolation
    between closest ranks (numpy's default). ValueError on no values or q outside 0..100."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be within 0..100, got {q}")
    rank = (len(sorted_values) - 1) * q / 100.0
    below = math.floor(rank)
    above = min(below + 1, len(sorted_values) - 1)
    fraction = rank - below
    low, high = sorted_values[below], sorted_values[above]
    if fraction == 0 or low == high:  # also keeps inf from becoming inf - inf = nan
        return low
    return low + (high - low) * fraction


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def mean_or_nan(values: Sequence[float]) -> float:
    """The mean of ``values``; NaN when there are none (a configuration that did not run)."""
    return _mean(values) if values else math.nan


def ratio_of_means(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """mean(numerator) / mean(denominator); inf when the denominator mean is 0."""
    bottom = _mean(denominator)
    return math.inf if bottom == 0 else _mean(numerator) / bottom


def bootstrap_ratio(
    numerator: Sequence[float],
    denominator: Sequence[float],
    *,
    statistic: Callable[[Sequence[float]], float] = _mean,
    level: float = 0.95,
    samples: int = _BOOTSTRAP_SAMPLES,
    seed: int = _BOOTSTRAP_SEED,
) -> Estimate:
    """statistic(numerator) / statistic(denominator) with a percentile-bootstrap interval.

    The two samples are independent repetitions of two configurations, so each is
    resampled on its own. The seed is fixed: equal inputs give equal intervals.
    Raises ValueError when either sample is empty.
    """
    if not numerator or not denominator:
        raise ValueError("bootstrap_ratio needs repetitions on both sides")

    def ratio(top: Sequence[float], bottom: Sequence[float]) -> float:
        over, under = statistic(top), statistic(bottom)
        if under == 0:
            return math.nan if over == 0 else math.inf
        return over / under

    point = ratio(numerator, denominator)
    rng = random.Random(seed)
    draws = [
        ratio(
            rng.choices(numerator, k=len(numerator)), rng.choices(denominator, k=len(denominator))
        )
        for _ in range(samples)
    ]
    draws = sorted(d for d in draws if not math.isnan(d))  # 0/0: no ratio at all
    n = min(len(numerator), len(denominator))
    if not draws:
        return Estimate(point, math.nan, math.nan, n)
    tail = (1.0 - level) / 2.0 * 100.0
    return Estimate(point, percentile(draws, tail), percentile(draws, 100.0 - tail), n)
