"""Panels compared as the cache's answers must equal the panels' own queries'."""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["close_panels"]


def close_panels(mine: Any, theirs: Any) -> bool:
    """Equal panels, sums of durations within 1e-9 relative (they are added in another
    order); everything else, counts and order included, exactly."""
    if isinstance(theirs, float):
        return mine == pytest.approx(theirs, rel=1e-9, abs=1e-9)
    if isinstance(theirs, (list, tuple)):
        return len(mine) == len(theirs) and all(close_panels(a, b) for a, b in zip(mine, theirs))
    if hasattr(theirs, "__dict__") or hasattr(theirs, "__dataclass_fields__"):
        fields = (
            vars(theirs)
            if hasattr(theirs, "__dict__")
            else {name: getattr(theirs, name) for name in theirs.__dataclass_fields__}
        )
        return type(mine) is type(theirs) and all(
            close_panels(getattr(mine, k), v) for k, v in fields.items()
        )
    return mine == theirs
