"""The client's retry decision: plain functions shared by the sync and async clients."""

from __future__ import annotations

import email.utils
import json
import random as _random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from retrysafe._protocols.mesh import IDEMPOTENCY_CONFLICT, IDEMPOTENCY_PROCESSING, RETRYABLE_CODES
from retrysafe._protocols.mesh import UNITS as MESH_UNITS

RETRY_STATUSES = frozenset({500, 502, 503, 504})
#: Seconds per ``retry_after`` unit: Mesh's (singular or plural), or short.
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, **MESH_UNITS}


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long to wait before a call is sent again.

    ``max_attempts`` bounds the attempts (the first included), ``max_time`` the
    seconds from the first attempt to the last wait's end. The wait before
    attempt ``n + 1`` is ``random.uniform(0, min(cap, base * 2**n))`` (full
    jitter), or the server's ``Retry-After`` when ``honour_retry_after`` (never
    past the remaining time). ``random``, ``sleep``, ``asleep`` (async; default
    ``asyncio.sleep``), ``clock`` (monotonic, for ``max_time``) and ``wall``
    (Unix time, for ``Retry-After`` dates) are seams for tests.
    """

    max_attempts: int = 5
    max_time: float = 30.0
    base: float = 0.1
    cap: float = 10.0
    retry_methods: frozenset[str] = frozenset({"POST", "PATCH"})
    key_version: int = 4
    honour_retry_after: bool = True
    random: _random.Random = field(default_factory=_random.Random, compare=False, repr=False)
    sleep: Callable[[float], object] = field(default=time.sleep, compare=False, repr=False)
    asleep: Callable[[float], Awaitable[object]] | None = field(
        default=None, compare=False, repr=False
    )
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)
    wall: Callable[[], float] = field(default=time.time, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, not {self.max_attempts!r}")
        if self.max_time < 0 or self.base < 0 or self.cap < 0:
            raise ValueError("max_time, base and cap must not be negative")
        if self.key_version not in (4, 7):
            raise ValueError(f"key_version must be 4 or 7, not {self.key_version!r}")
        methods = frozenset(m.upper() for m in self.retry_methods)
        object.__setattr__(self, "retry_methods", methods)


def retry_after(response: httpx.Response, now: float | None = None) -> float | None:
    """Seconds the server asks to wait: ``Retry-After`` (seconds or HTTP date), else a
    ``retry_after`` ``{value, unit}`` (or a number of seconds) in a JSON error body: at
    its top, in its ``error``, or in a Mesh envelope's ``errors[i]`` or their
    ``details`` (the longest, if several ask)."""
    value = response.headers.get("retry-after")
    if value is not None:
        value = value.strip()
        try:
            return max(0.0, float(value))
        except ValueError:
            pass
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            when = None
        if when is not None:
            wall = time.time() if now is None else now
            return max(0.0, when.timestamp() - wall)
    doc = _json(response)
    if not isinstance(doc, dict):
        return None
    errors = [e for e in _mesh_errors(doc) or () if isinstance(e, dict)]
    candidates = [doc, doc.get("error"), *errors, *(e.get("details") for e in errors)]
    asked = [
        _seconds(item["retry_after"])
        for item in candidates
        if isinstance(item, dict) and "retry_after" in item
    ]
    return max((s for s in asked if s is not None), default=None)


def _seconds(ra: object) -> float | None:
    """Seconds in a ``retry_after``: a number of seconds or ``{value, unit}`` (default ``s``)."""
    if isinstance(ra, (int, float)) and not isinstance(ra, bool):
        return max(0.0, float(ra))
    if isinstance(ra, dict):
        value = ra.get("value")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return max(0.0, float(value) * UNITS.get(str(ra.get("unit", "s")).lower(), 1.0))
    return None


def _mesh_errors(doc: object) -> list[object] | None:
    """A Mesh envelope's ``errors`` list (None if ``doc`` has none)."""
    errors = doc.get("errors") if isinstance(doc, dict) else None
    return errors if isinstance(errors, list) else None


def _json(response: httpx.Response) -> object:
    ctype = response.headers.get("content-type", "")
    if "json" not in ctype:
        return None
    try:
        response.read()
        return json.loads(response.content)
    except (ValueError, httpx.StreamError):
        return None


def problem_code(response: httpx.Response) -> str | None:
    doc = _json(response)
    if isinstance(doc, dict):
        code = doc.get("code")
        if isinstance(code, str):
            return code
        error = doc.get("error")
        if isinstance(error, dict) and isinstance(error.get("code"), str):
            return error["code"]
    return None


def retryable(outcome: httpx.Response | BaseException) -> bool:
    """Whether an answer (or an error) may be retried at all."""
    if isinstance(outcome, BaseException):
        # Connection errors, timeouts, dropped connections; not a URL no transport can send.
        return isinstance(outcome, httpx.TransportError) and not isinstance(
            outcome, httpx.UnsupportedProtocol
        )
    status = outcome.status_code
    if status in RETRY_STATUSES:
        return True
    if status == 409:
        code = problem_code(outcome)
        if code == "idempotency_in_flight":
            return True
        return code != "idempotency_conflict" and "retry-after" in outcome.headers
    if status == 429:
        return "retry-after" in outcome.headers
    return False


def mesh_retryable(outcome: httpx.Response | BaseException) -> bool:
    """Whether a Mesh call's answer may be retried: by the envelope's error codes.

    An answer that is a Mesh envelope is judged by its ``errors`` alone, whatever
    its HTTP status (a server may answer 409, 503 or 200): it is retried when
    every error is retryable. ``IDEMPOTENCY_PROCESSING`` always is and
    ``IDEMPOTENCY_CONFLICT`` never is (the extension's error table); any other
    error is as its ``"retryable"`` says, or, without one (the protocol's error
    object has no such field), as its code's row in errors.md says
    (:data:`~retrysafe._protocols.mesh.RETRYABLE_CODES`). An answer that is no
    envelope (a proxy's 502 page) and a transport error: :func:`retryable`.
    """
    if isinstance(outcome, BaseException):
        return retryable(outcome)
    doc = _json(outcome)
    if not (isinstance(doc, dict) and ("result" in doc or "errors" in doc)):
        return retryable(outcome)
    errors = _mesh_errors(doc)
    return bool(errors) and all(_retryable_error(e) for e in errors or ())


def _retryable_error(error: object) -> bool:
    """Whether one Mesh error object is retryable (see :func:`mesh_retryable`)."""
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    if code == IDEMPOTENCY_PROCESSING:
        return True
    if code == IDEMPOTENCY_CONFLICT:
        return False
    flag = error.get("retryable")
    if isinstance(flag, bool):
        return flag
    return type(code) is str and code in RETRYABLE_CODES


def decide(
    attempt: int,
    outcome: httpx.Response | BaseException,
    policy: RetryPolicy,
    elapsed: float,
    now: float | None = None,
    *,
    retryable: Callable[[httpx.Response | BaseException], bool] = retryable,
    asked: float | None = None,
) -> float | None:
    """Seconds to wait before attempt ``attempt + 1``, or None to stop.

    ``attempt`` counts from 1; ``elapsed`` is the seconds since the first
    attempt began; ``now`` the wall-clock time for ``Retry-After`` dates;
    ``retryable`` whether an answer may be retried at all (:func:`mesh_retryable`
    for Mesh calls); ``asked`` the seconds the server asked to wait outside an HTTP
    response (an MCP error's ``data.retryAfter``).
    """
    if attempt >= policy.max_attempts or not retryable(outcome):
        return None
    remaining = policy.max_time - elapsed
    if remaining <= 0:
        return None
    wait = policy.random.uniform(0, min(policy.cap, policy.base * 2 ** (attempt - 1)))
    if policy.honour_retry_after:
        if isinstance(outcome, httpx.Response):
            asked = retry_after(outcome, now)
        if asked is not None:
            wait = asked
    return min(wait, remaining)


def is_replayable(request: httpx.Request) -> bool:
    """Whether the request's body can be sent again (bytes, not a one-shot stream)."""
    stream = request.stream
    return isinstance(stream, httpx.ByteStream)
