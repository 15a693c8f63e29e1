"""The errors Fanout raises at start-up, before any call is served.

    ConfigError (ValueError)   a setting is unknown, mistyped, out of range or unusable
     +-- TlsConfigError         a certificate, key or CA file cannot be read or does not fit
                                (service.wire.tls)

Kept apart from :mod:`service.settings.config` so that the web-tier client, which raises
``TlsConfigError`` for its own files, loads no server settings.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """Raised at start-up when a setting is unknown, mistyped or out of range."""
