"""Embedded sample backends for ``fanout demo``, ``fanout backends`` and the tests.

:class:`DemoBackends` starts a seeded in-memory MongoDB-wire server and the sample
alerts and metrics HTTP services, all on free ports of 127.0.0.1, and says how to point
a Fanout server at them.
"""

from __future__ import annotations

import json

from service.samples.http_services import SampleHttpServices
from service.samples.mongo_server import MongoWireServer, MongoWireServerError
from service.samples.seed import (
    APPS,
    DEFAULT_SEED,
    SAMPLE_END_MS,
    SAMPLE_START_MS,
    SampleData,
    generate_sample_data,
    seed_mongo,
    seed_mongo_at,
)

__all__ = [
    "DemoBackends",
    "MongoWireServer",
    "MongoWireServerError",
    "SampleHttpServices",
    "SampleData",
    "generate_sample_data",
    "seed_mongo",
    "seed_mongo_at",
    "APPS",
    "DEFAULT_SEED",
    "SAMPLE_START_MS",
    "SAMPLE_END_MS",
]


class DemoBackends:
    """The three sample backends, seeded from ``seed``; a context manager.

    :meth:`start` raises :class:`MongoWireServerError` when the MongoDB-wire server
    cannot start, and pymongo's errors when seeding fails; whatever had started is
    stopped first.
    """

    def __init__(
        self,
        *,
        seed: int = DEFAULT_SEED,
        database: str = "apm",
        alerts_delay_ms: int = 0,
        metrics_delay_ms: int = 0,
        mongo_port: int = 0,
        alerts_port: int = 0,
        metrics_port: int = 0,
    ) -> None:
        self.data: SampleData = generate_sample_data(seed)
        self.database = database
        self.mongo = MongoWireServer(port=mongo_port)
        self.http = SampleHttpServices(
            self.data,
            alerts_delay_ms=alerts_delay_ms,
            metrics_delay_ms=metrics_delay_ms,
            alerts_port=alerts_port,
            metrics_port=metrics_port,
        )
        self._started = False

    def start(self) -> DemoBackends:
        if self._started:
            return self
        try:
            self.mongo.start()
            seed_mongo_at(self.mongo.uri, self.database, self.data)
            self.http.start()
        except Exception:
            self.stop()
            raise
        self._started = True
        return self

    def stop(self) -> None:
        """Stop the HTTP services and the MongoDB-wire server; idempotent."""
        self._started = False
        self.http.stop()
        self.mongo.stop()

    def settings_overrides(self) -> dict[str, str]:
        """Dotted settings keys pointing a server at these backends (for ``load_settings``):
        one ``[backends.<name>]`` table each."""
        return {
            "backends.mongo.kind": "mongo",
            "backends.mongo.uri": self.mongo.uri,
            "backends.mongo.database": self.database,
            "backends.alerts.kind": "http",
            "backends.alerts.url": self.http.alerts_url,
            "backends.metrics.kind": "http",
            "backends.metrics.url": self.http.metrics_url,
        }

    def config_snippet(self) -> str:
        """The same as TOML, for ``fanout serve --config FILE``.

        Spans go nowhere (``exporter = "none"``): with no collector beside the sample
        backends, the default OTLP exporter would log a warning at every export.
        """
        tables: dict[str, list[str]] = {}
        for key, value in self.settings_overrides().items():
            _, name, field = key.split(".")
            # A JSON string is a valid TOML basic string.
            tables.setdefault(name, []).append(f"{field} = {json.dumps(value)}")
        return "".join(
            f"[backends.{name}]\n" + "\n".join(lines) + "\n\n" for name, lines in tables.items()
        ) + ('[tracing]\nexporter = "none"   # or "otlp" / "zipkin" with a collector\n')

    def __enter__(self) -> DemoBackends:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
