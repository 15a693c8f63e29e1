"""What the bench's callers ask the server: the sample call, and the dashboards that
many viewers watch (a Zipf spread over twenty windows)."""

from __future__ import annotations

from service.samples.seed import SAMPLE_END_MS, SAMPLE_START_MS

__all__ = ["panel_names", "sample_call", "zipf_views", "ZIPF_DASHBOARDS", "ZIPF_EXPONENT"]


def sample_call() -> tuple[str, int, int]:
    """``(app, start_ms, end_ms)``: app ``shop`` over the sample day; data for all 7 panels."""
    return "shop", SAMPLE_START_MS, SAMPLE_END_MS


#: Dashboards of the Zipf scenario, and the exponent of their popularity.
ZIPF_DASHBOARDS = 20
ZIPF_EXPONENT = 1.0


def zipf_views(viewers: int) -> list[tuple[str, int, int]]:
    """What each of ``viewers`` connections watches: one of ZIPF_DASHBOARDS (app, window)
    questions, the k-th most popular watched by a share proportional to 1 / k^s.

    The sample data holds three apps, so the dashboards are app ``shop``'s day shifted by
    k minutes: twenty distinct questions, as twenty apps would be to the server.
    """
    app, start_ms, end_ms = sample_call()
    weights = [1.0 / (k + 1) ** ZIPF_EXPONENT for k in range(ZIPF_DASHBOARDS)]
    shares = [viewers * w / sum(weights) for w in weights]
    counts = [max(1, int(share)) for share in shares]
    # Hand the viewers left by rounding down to the largest remainders, most popular first.
    left = max(0, viewers - sum(counts))
    for k in sorted(range(ZIPF_DASHBOARDS), key=lambda k: counts[k] - shares[k])[:left]:
        counts[k] += 1
    views = [
        (app, start_ms + k * 60_000, end_ms + k * 60_000)
        for k, count in enumerate(counts)
        for _ in range(count)
    ]
    return views[:viewers]


def panel_names() -> tuple[str, ...]:
    """The panels every server of the stack offers (the default registry's, in its order)."""
    from lookups.registry import default_registry

    return tuple(default_registry().names())
