"""Types the HTTP front doors hand to your callables (``scope=``, ``require_key=``)."""

from __future__ import annotations

from ._http import Headers, HttpRequest, parse_key, request_fingerprint

__all__ = ["Headers", "HttpRequest", "parse_key", "request_fingerprint"]
