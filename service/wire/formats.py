"""The wire formats Fanout speaks, named once: the server, the client, the settings and
the command line all take their choices from here."""

from __future__ import annotations

__all__ = ["TRANSPORTS", "PROTOCOLS"]

#: Thrift transports: four-byte length frames, or the message bytes as they come.
TRANSPORTS = ("framed", "buffered")
#: Thrift protocols.
PROTOCOLS = ("binary", "compact")
