"""Keeping secrets out of logs, spans and error messages.

Secrets are the credentials in ``mongo.uri`` (``user:password@``, and options such as
``authMechanismProperties``) and ``http.auth_token``. Nothing Fanout writes quotes
them: error messages and outcomes are composed from the failure's kind, never from a
library's message. :func:`redact_uri` is for the places that want to say *which*
server they mean (tests/test_secrets.py checks logs, spans and answers at DEBUG level).

    >>> redact_uri("mongodb://fanout:s3cr3t@mongo-1:27017,mongo-2/?replicaSet=rs0")
    'mongodb://***@mongo-1:27017,mongo-2/?replicaSet=rs0'
"""

from __future__ import annotations

import re

__all__ = ["REDACTED", "redact_uri"]

REDACTED = "***"

# scheme://userinfo@ : the userinfo runs to the last "@" before the first "/", "?" or "#".
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")
# Query options that carry credentials in MongoDB connection strings.
_SECRET_OPTIONS = re.compile(
    r"(?i)(?P<key>[?&](?:password|authMechanismProperties|"
    r"tlsCertificateKeyFilePassword)=)[^&#]*"
)


def redact_uri(uri: str) -> str:
    """``uri`` with its user and password (and credential-bearing options) replaced by ``***``.

    Works for any ``scheme://`` URI, including MongoDB's several-host form; a string that
    is not a URI comes back unchanged. Never raises.
    """
    redacted = _USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", uri, count=1)
    return _SECRET_OPTIONS.sub(lambda m: f"{m.group('key')}{REDACTED}", redacted)
