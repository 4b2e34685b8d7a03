"""Types the HTTP front doors hand to your callables (``principal=``, ``require_key=``),
and :data:`ANONYMOUS`, what a ``principal=`` callable returns for an unauthenticated caller."""

from __future__ import annotations

from retrysafe._core.principal import ANONYMOUS, NoPrincipal
from retrysafe._http.request import (
    MAX_KEY_HEADER,
    Headers,
    HttpRequest,
    parse_key,
    request_fingerprint,
)

__all__ = [
    "ANONYMOUS",
    "MAX_KEY_HEADER",
    "Headers",
    "HttpRequest",
    "NoPrincipal",
    "parse_key",
    "request_fingerprint",
]
