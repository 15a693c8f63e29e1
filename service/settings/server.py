"""The ``[server]`` section: the Thrift listener's address, wire format, limits and drain.

Its owner is the listener (``service/listener/server.py``) and the process around it
(workers, probes); ``service/settings/config.py`` composes it with the other sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.settings.cores import usable_cores
from service.wire.formats import PROTOCOLS, TRANSPORTS
from service.wire.scan import WireLimits

__all__ = ["ServerSettings"]


@dataclass(frozen=True)
class ServerSettings:
    """The Thrift listener: address, wire format, connection and message limits, drain."""

    host: str = field(default="127.0.0.1", metadata={"help": "listen address"})
    port: int = field(
        default=9090, metadata={"help": "listen port (`0`: any free port)", "min": 0, "max": 65535}
    )
    transport: str = field(
        default="framed", metadata={"help": "Thrift transport", "choices": TRANSPORTS}
    )
    protocol: str = field(
        default="binary", metadata={"help": "Thrift protocol", "choices": PROTOCOLS}
    )
    strict_binary: bool = field(
        default=False,
        metadata={
            "help": "`true`: refuse old-style binary messages, those without a version header "
            "(see [Interoperability](../reference/interoperability.md))"
        },
    )
    max_connections: int = field(
        default=1000,
        metadata={
            "help": "connections served at once; past it the server stops accepting",
            "min": 1,
        },
    )
    max_frame_bytes: int = field(
        default=1024 * 1024,
        metadata={
            "help": "largest message accepted; a larger one closes that connection",
            "min": 64,
            "max": 64 * 1024 * 1024,
        },
    )
    idle_timeout_ms: int = field(
        default=60_000,
        metadata={"help": "a connection silent this long between calls is closed", "min": 1},
    )
    frame_timeout_ms: int = field(
        default=5_000,
        metadata={
            "help": "once a message's first byte arrives, all of it must arrive within this; "
            "also bounds writing a reply and the TLS handshake",
            "min": 1,
        },
    )
    max_string_bytes: int = field(
        default=64 * 1024,
        metadata={
            "help": "longest string or binary field inside a message (at most "
            "`server.max_frame_bytes`)",
            "min": 16,
        },
    )
    max_container_items: int = field(
        default=10_000,
        metadata={"help": "most items in one list, set or map inside a message", "min": 1},
    )
    max_nesting_depth: int = field(
        default=32,
        metadata={
            "help": "deepest nesting of structs and containers (the argument struct is 1)",
            "min": 1,
        },
    )
    drain_timeout_ms: int = field(
        default=10_000,
        metadata={
            "help": "on SIGTERM/SIGINT, how long calls in flight may take to finish",
            "min": 0,
        },
    )
    tls_cert_file: str = field(
        default="",
        metadata={
            "help": "with `server.tls_key_file`: the listener speaks TLS 1.2+ "
            "(see [TLS](../how-to/tls.md))"
        },
    )
    tls_key_file: str = field(
        default="", metadata={"help": "the key of `server.tls_cert_file` (set both or neither)"}
    )
    tls_client_ca_file: str = field(
        default="",
        metadata={
            "help": "set: mutual TLS, clients must present a certificate signed by a CA in this "
            "file (see [TLS](../how-to/tls.md))"
        },
    )
    tls_client_names: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "set: the client certificate must also name one of these, as a DNS or URI "
            "subject alternative name (a SPIFFE ID)"
        },
    )
    workers: int = field(
        default=1,
        metadata={
            "help": 'more than 1: that many pre-forked worker processes share the port; `"auto"`: '
            "one per core this process may use, within its CPU affinity and cgroup CPU "
            "quota (see [Multi-core](../explanation/workers.md))",
            "min": 1,
            "max": 64,
            "auto": usable_cores,
        },
    )
    hub_block_threshold_ms: int = field(
        default=100,
        metadata={
            "help": "report event-loop runs longer than this "
            "(see [Overload](../reference/limits.md#overload)); `0` turns it off",
            "min": 0,
        },
    )
    lame_duck_ms: int = field(
        default=0,
        metadata={
            "help": "on SIGTERM/SIGINT, report `DRAINING` while still serving for this long "
            "before the drain (see "
            "[Shutdown and health](../how-to/reload-upgrade.md))",
            "min": 0,
        },
    )
    max_connection_age_ms: int = field(
        default=0,
        metadata={
            "help": "above 0: a connection this old is closed after its current call, so load "
            "rebalances across instances (clients reconnect transparently); `0` never",
            "min": 0,
        },
    )
    probe_port: int = field(
        default=-1,
        metadata={
            "help": "`0` or a port: plain HTTP `/healthz` and `/readyz` on `server.probe_host`, "
            "one endpoint for all workers (see "
            "[Shutdown and health](../how-to/reload-upgrade.md)); "
            "`-1` off",
            "min": -1,
            "max": 65535,
        },
    )
    probe_host: str = field(
        default="",
        metadata={
            "help": "where the probes listen; empty: `server.host` "
            "(see [TLS](../how-to/tls.md) for what the "
            "probes and metrics expose)"
        },
    )
    worker_heartbeat_timeout_ms: int = field(
        default=3_000,
        metadata={
            "help": "with `server.workers` > 1: a worker whose event loop has not beaten for this "
            "long is killed and restarted; alone, `/healthz` answers 503 after this long "
            "without a beat; `0` never",
            "min": 0,
        },
    )

    def wire_limits(self) -> WireLimits:
        """What the wire scanner enforces on this listener's messages."""
        return WireLimits(
            self.max_frame_bytes,
            self.max_string_bytes,
            self.max_container_items,
            self.max_nesting_depth,
            self.idle_timeout_ms,
            self.frame_timeout_ms,
            self.strict_binary,
        )

    @property
    def probe_bind_host(self) -> str:
        """Where the probes listen: ``probe_host``, else ``host``."""
        return self.probe_host or self.host

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file: set both or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError(
                "tls_client_ca_file: needs tls_cert_file and tls_key_file (mutual TLS is TLS first)"
            )
        if self.tls_client_names and not self.tls_client_ca_file:
            raise ValueError(
                "tls_client_names: needs tls_client_ca_file (names are checked "
                "on verified client certificates only)"
            )
        if self.max_string_bytes > self.max_frame_bytes:
            raise ValueError(
                f"max_string_bytes: must be at most server.max_frame_bytes "
                f"({self.max_frame_bytes}), got {self.max_string_bytes}"
            )
