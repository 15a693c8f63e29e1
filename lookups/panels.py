"""Typed panel values that lookups return. Plain data; the handler maps them to Thrift."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Window",
    "MessageCount",
    "ErrorSummary",
    "TopEntry",
    "TopList",
    "Point",
    "Series",
    "Alert",
    "AlertList",
    "PanelValue",
    "TOP_N",
]

TOP_N = 10  # top lists hold the 10 largest entries, ties broken by key


@dataclass(frozen=True)
class Window:
    """One application over the half-open window ``[start_ms, end_ms)`` (epoch ms)."""

    app: str
    start_ms: int
    end_ms: int


@dataclass(frozen=True)
class MessageCount:
    message: str
    count: int


@dataclass(frozen=True)
class ErrorSummary:
    total: int
    top: tuple[MessageCount, ...]


@dataclass(frozen=True)
class TopEntry:
    key: str
    count: int
    mean_ms: float
    total_ms: float


@dataclass(frozen=True)
class TopList:
    entries: tuple[TopEntry, ...]


@dataclass(frozen=True)
class Point:
    ts_ms: int
    value: float


@dataclass(frozen=True)
class Series:
    points: tuple[Point, ...]
    step_ms: int


@dataclass(frozen=True)
class Alert:
    id: str
    severity: str
    title: str
    triggered_ms: int


@dataclass(frozen=True)
class AlertList:
    alerts: tuple[Alert, ...]


PanelValue = ErrorSummary | TopList | Series | AlertList
