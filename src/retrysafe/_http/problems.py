"""RFC 9457 problem answers: the answers the HTTP core gives instead of the handler's."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["PROBLEM_TYPE", "Response", "problem", "retry_after_header"]

PROBLEM_TYPE = "application/problem+json"


@dataclass(slots=True)
class Response:
    """An answer the core gives instead of running the handler."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes

    @classmethod
    def sized(cls, status: int, headers: Iterable[tuple[str, str]], body: bytes) -> Response:
        """The answer ``body`` with ``headers`` and then its ``Content-Length``."""
        return cls(status, [*headers, ("content-length", str(len(body)))], body)


_TITLES = {
    "idempotency_key_required": "Idempotency key required",
    "idempotency_key_invalid": "Invalid idempotency key",
    "idempotency_in_flight": "Request in progress",
    "idempotency_conflict": "Idempotency key reused",
    "idempotency_store_unavailable": "Idempotency store unavailable",
    "idempotency_body_invalid": "Request body cannot be fingerprinted",
    "idempotency_body_too_large": "Request body too large",
    "idempotency_credentials_ambiguous": "Ambiguous credentials",
    "idempotency_principal_required": "Credentials required",
    "idempotency_failed": "Request failed",
    "idempotency_rolled_back": "Nothing committed",
    "upstream_unavailable": "Upstream unavailable",
    "upstream_timeout": "Upstream timed out",
    "not_found": "Not found",
    "method_not_allowed": "Method not allowed",
    "request_header_too_large": "Request header too large",
    "request_header_timeout": "Request header timeout",
    "request_body_timeout": "Request body timeout",
    "too_many_connections": "Too many connections",
}


def problem(
    status: int,
    code: str,
    detail: str,
    *,
    headers: Iterable[tuple[str, str]] = (),
    **extra: Any,
) -> Response:
    """An RFC 9457 ``application/problem+json`` answer with a machine ``code``."""
    doc = {
        "type": f"urn:retrysafe:problem:{code}",
        "title": _TITLES.get(code, code),
        "status": status,
        "detail": detail,
        "code": code,
    }
    doc.update(extra)
    body = json.dumps(doc, separators=(",", ":")).encode()
    out = [("content-type", PROBLEM_TYPE), ("content-length", str(len(body)))]
    out.extend(headers)
    return Response(status, out, body)


def retry_after_header(seconds: float) -> tuple[str, str]:
    return ("retry-after", str(max(1, math.ceil(seconds))))
