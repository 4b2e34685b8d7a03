"""Types the HTTP front doors hand to your callables (``scope=``, ``require_key=``)."""

from __future__ import annotations

from retrysafe._http.request import (
    MAX_KEY_HEADER,
    Headers,
    HttpRequest,
    parse_key,
    request_fingerprint,
)

__all__ = ["MAX_KEY_HEADER", "Headers", "HttpRequest", "parse_key", "request_fingerprint"]
