"""What a configuration that loads may still get wrong: pool sizes that will queue or drop
work, and sections that go after this release. Each is a line the server logs at start."""

from __future__ import annotations

from service.settings.config import Settings

__all__ = ["pool_warnings", "alias_warnings"]


def pool_warnings(settings: Settings) -> list[str]:
    """Mismatched pool sizes that will queue or drop work, as human-readable warnings."""
    fan = settings.fanout
    warnings = []
    short: dict[str, tuple[int, list[str]]] = {}  # key -> (size, backends): [http] is two
    for name, backend in settings.backends.items():
        if backend.pool_size < fan.pool_size:
            short.setdefault(_pool_key(settings, name), (backend.pool_size, []))[1].append(name)
    for key, (size, names) in short.items():
        warnings.append(
            f"{key} ({size}) < fanout.pool_size ({fan.pool_size}): parallel lookups "
            f"of {' and '.join(names)} will wait for a connection"
        )
    if fan.max_inflight_tasks < fan.pool_size:
        warnings.append(
            f"fanout.max_inflight_tasks ({fan.max_inflight_tasks}) < fanout.pool_size "
            f"({fan.pool_size}): a single request can never use its whole pool"
        )
    if fan.task_timeout_ms > fan.request_deadline_ms:
        warnings.append(
            f"fanout.task_timeout_ms ({fan.task_timeout_ms}) > "
            f"fanout.request_deadline_ms ({fan.request_deadline_ms}): "
            "the request deadline always cuts tasks first"
        )
    if fan.queue_timeout_ms >= fan.request_deadline_ms:
        warnings.append(
            f"fanout.queue_timeout_ms ({fan.queue_timeout_ms}) >= "
            f"fanout.request_deadline_ms ({fan.request_deadline_ms}): "
            "queued tasks would time out before they are rejected"
        )
    return warnings + alias_warnings(settings)


def alias_warnings(settings: Settings) -> list[str]:
    """One warning per older section the configuration still writes: they go after this release."""
    tables = {
        "mongo": '[backends.mongo] (kind = "mongo")',
        "http": '[backends.alerts] and [backends.metrics] (kind = "http", url = ...)',
    }
    return [
        f"[{section}] (or FANOUT_{section.upper()}_*) is deprecated and goes after this "
        f"release: write {tables[section]} instead (FANOUT_BACKENDS_<NAME>_<KEY>)"
        for section in settings.alias_sections
    ]


def _pool_key(settings: Settings, name: str) -> str:
    """The key a user wrote for backend ``name``'s pool: its table's, or its alias's."""
    section = settings.backend_section(name)
    return {"mongo": "mongo.max_pool_size", "http": "http.pool_maxsize"}.get(
        section, f"{section}.pool_size"
    )
