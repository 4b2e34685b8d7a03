"""The Mesh idempotency extension (``urn:mesh:ext:idempotency``) as plain code, no I/O.

:func:`parse` validates a request envelope into a :class:`MeshCall` (or an
error envelope); the call's methods build every answer: the handler's
(:meth:`MeshCall.finish`), a replay, a refusal by the engine. The sync and
async shells in :mod:`retrysafe.mesh` only add the engine calls and ``await``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from retrysafe._core.engine import Claim, Replay
from retrysafe._core.metrics import METRICS
from retrysafe._model.hashing import canonical_json, protocol_key
from retrysafe._model.record import Outcome
from retrysafe.errors import (
    AmbiguousCredentialsError,
    FingerprintMismatchError,
    IdempotencyError,
    InProgressError,
    InvalidKeyError,
    MeshError,
    PrincipalRequiredError,
    StoreUnavailableError,
)

__all__ = [
    "FUNCTION_NOT_FOUND",
    "INVALID_ARGUMENTS",
    "MAX_TTL",
    "RETRYABLE_CODES",
    "URN",
    "MeshCall",
    "Step",
    "envelope",
    "error_envelope",
    "error_object",
    "loads",
    "operation",
    "parse",
    "retry_after_of",
    "status_of",
    "transport_error",
]

URN = "urn:mesh:ext:idempotency"
PROTOCOL = {"name": "mesh", "version": "0.1.0"}

# The protocol's standard codes (errors.md), then the Mesh idempotency extension's own
# two. A missing or invalid key is INVALID_ARGUMENTS, as the reference implementation
# answers it; an unreachable store is UNAVAILABLE.
PARSE_ERROR = "PARSE_ERROR"
INVALID_REQUEST = "INVALID_REQUEST"
INVALID_ARGUMENTS = "INVALID_ARGUMENTS"
FUNCTION_NOT_FOUND = "FUNCTION_NOT_FOUND"
INTERNAL_ERROR = "INTERNAL_ERROR"
UNAVAILABLE = "UNAVAILABLE"
#: A keyed call without credentials, where anonymous calls are refused.
UNAUTHORIZED = "UNAUTHORIZED"
IDEMPOTENCY_PROCESSING = "IDEMPOTENCY_PROCESSING"
IDEMPOTENCY_CONFLICT = "IDEMPOTENCY_CONFLICT"

#: The longest ``ttl`` a request may ask for by default: the reference implementation's
#: ``MAX_TTL_SECONDS`` (30 days), which refuses longer ones.
MAX_TTL = 30 * 86400.0

_SECONDS = {"millisecond": 0.001, "second": 1.0, "minute": 60.0, "hour": 3600.0, "day": 86400.0}
#: Seconds per ``ttl`` unit: the protocol's duration units, singular or plural.
UNITS = {**_SECONDS, **{unit + "s": seconds for unit, seconds in _SECONDS.items()}}

_PROTOCOL_TEXT = re.compile(r"mesh/[0-9]+\.[0-9]+")

#: The HTTP status of each standard code: errors.md ("Standard Error Codes", its HTTP
#: column), which transport.md ("Status Codes") and protocol.md ("Transport
#: Conventions") make binding: "HTTP status codes MUST reflect the Forrst error".
STATUSES = {
    PARSE_ERROR: 400,
    INVALID_REQUEST: 400,
    "INVALID_PROTOCOL_VERSION": 400,
    FUNCTION_NOT_FOUND: 404,
    "VERSION_NOT_FOUND": 404,
    "FUNCTION_DISABLED": 503,
    INVALID_ARGUMENTS: 400,
    "SCHEMA_VALIDATION_FAILED": 422,
    "EXTENSION_NOT_SUPPORTED": 400,
    "EXTENSION_NOT_APPLICABLE": 400,
    UNAUTHORIZED: 401,
    "FORBIDDEN": 403,
    "NOT_FOUND": 404,
    "CONFLICT": 409,
    "GONE": 410,
    "DEADLINE_EXCEEDED": 408,
    "RATE_LIMITED": 429,
    INTERNAL_ERROR: 500,
    UNAVAILABLE: 503,
    "DEPENDENCY_ERROR": 502,
    IDEMPOTENCY_CONFLICT: 409,
    IDEMPOTENCY_PROCESSING: 409,
    "ASYNC_OPERATION_NOT_FOUND": 404,
    "ASYNC_OPERATION_FAILED": 500,
    "ASYNC_CANNOT_CANCEL": 400,
    "BATCH_FAILED": 400,
    "BATCH_TOO_LARGE": 400,
    "BATCH_TIMEOUT": 504,
    "SERVER_MAINTENANCE": 503,
    "FUNCTION_MAINTENANCE": 503,
    "REPLAY_NOT_FOUND": 404,
    "REPLAY_EXPIRED": 410,
    "REPLAY_ALREADY_COMPLETE": 409,
    "REPLAY_CANCELLED": 410,
}


#: The codes a client retries (the "Retryable: Yes" rows of errors.md, and of the
#: atomic-lock extension's table): ``IDEMPOTENCY_PROCESSING`` among them.
RETRYABLE_CODES = frozenset(
    {
        "FUNCTION_DISABLED",
        "DEADLINE_EXCEEDED",
        "RATE_LIMITED",
        INTERNAL_ERROR,
        UNAVAILABLE,
        "DEPENDENCY_ERROR",
        IDEMPOTENCY_PROCESSING,
        "BATCH_TIMEOUT",
        "SERVER_MAINTENANCE",
        "FUNCTION_MAINTENANCE",
        "LOCK_ACQUISITION_FAILED",
        "LOCK_TIMEOUT",
    }
)


def status_of(response: dict[str, Any]) -> int:
    """The HTTP status of a response envelope, as transport.md binds it.

    200 without errors; 400 for several (transport.md, "Multiple Errors"); for
    one, its code's status in :data:`STATUSES`. A code of the application's own
    is 400, or 500 when the error says ``"retryable": true`` (the caller did
    nothing wrong).
    """
    errors = response.get("errors")
    if not errors:
        return 200
    if not isinstance(errors, list) or len(errors) != 1 or not isinstance(errors[0], dict):
        return 400
    error = errors[0]
    code = error.get("code")
    status = STATUSES.get(code) if type(code) is str else None
    if status is not None:
        return status
    return 500 if error.get("retryable") is True else 400


def retry_after_of(response: dict[str, Any]) -> int | None:
    """Whole seconds of the ``details.retry_after`` of a response's one error (for a
    ``Retry-After`` header), or None."""
    errors = response.get("errors")
    if not isinstance(errors, list) or len(errors) != 1 or not isinstance(errors[0], dict):
        return None
    details = errors[0].get("details")
    after = details.get("retry_after") if isinstance(details, dict) else None
    if not isinstance(after, dict):
        return None
    value, unit = after.get("value"), after.get("unit")
    per = UNITS.get(unit) if type(unit) is str else None
    if per is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    seconds = value * per
    return max(0, math.ceil(seconds)) if math.isfinite(seconds) else None


def error_object(
    code: str,
    message: str,
    retryable: bool,
    details: dict[str, Any] | None = None,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Mesh error object (errors.md): ``source`` and ``details`` when given."""
    error: dict[str, Any] = {"code": code, "message": message, "retryable": retryable}
    if source is not None:
        error["source"] = source
    if details is not None:
        error["details"] = details
    return error


def envelope(
    protocol: Any,
    request_id: str | None,
    result: Any = None,
    errors: list[dict[str, Any]] | None = None,
    entry: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A response envelope: ``result`` on success; ``result: null`` and ``errors``
    on failure (never both: protocol.md, "Error Fields"); ``extensions`` when an
    extension has something to say."""
    answer: dict[str, Any] = {"protocol": protocol, "id": request_id, "result": result}
    if errors:
        answer["result"] = None
        answer["errors"] = errors
    if entry is not None:
        answer["extensions"] = [entry]
    return answer


def _iso(seconds: float) -> str:
    """``2024-03-16T10:30:00Z`` (UTC, whole seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _whole_seconds(seconds: float) -> dict[str, Any]:
    return {"value": max(1, math.ceil(seconds)), "unit": "second"}


# -- parsing --------------------------------------------------------------------------


class _Invalid(Exception):
    """A request that is not one: its Mesh error, and where in the request it is.

    ``key_error``: the idempotency key is missing or invalid (counted as ``invalid_key``).
    """

    def __init__(
        self,
        code: str,
        message: str,
        pointer: str = "",
        position: int | None = None,
        key_error: bool = False,
        details: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.key_error = key_error
        self.error = error_object(
            code,
            message,
            False,
            details,
            {"pointer": pointer} if position is None else {"position": position},
        )


def _protocol_of(request: Any) -> Any:
    """The request's protocol if it is a valid one (echoed), else Mesh 0.1.0."""
    protocol = request.get("protocol") if isinstance(request, dict) else None
    if isinstance(protocol, dict):
        version = protocol.get("version")
        if protocol.get("name") == "mesh" and type(version) is str and version:
            return {"name": "mesh", "version": version}
    elif type(protocol) is str and _PROTOCOL_TEXT.fullmatch(protocol):
        return protocol
    return PROTOCOL


def _id_of(request: Any) -> str | None:
    rid = request.get("id") if isinstance(request, dict) else None
    return rid if type(rid) is str and rid else None


def error_envelope(request: Any, error: dict[str, Any]) -> dict[str, Any]:
    """An error envelope answering ``request`` (whatever it is)."""
    return envelope(_protocol_of(request), _id_of(request), errors=[error])


def transport_error(message: str) -> dict[str, Any]:
    """The ``INVALID_REQUEST`` envelope for a request refused before it is read (405, 413)."""
    return envelope(PROTOCOL, None, errors=[error_object(INVALID_REQUEST, message, False)])


def loads(body: bytes) -> tuple[Any, dict[str, Any] | None]:
    """``(value, None)`` for a JSON request body, else ``(None, a PARSE_ERROR envelope)``."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, _parse_error(f"the request body is not UTF-8: {exc.reason}", exc.start)
    try:
        return json.loads(text, parse_constant=_no_constant), None
    except json.JSONDecodeError as exc:
        where = len(text[: exc.pos].encode())
        return None, _parse_error(f"the request body is not JSON: {exc.msg}", where)
    except ValueError as exc:  # NaN or Infinity
        return None, _parse_error(f"the request body is not JSON: {exc}", 0)
    except RecursionError:
        return None, _parse_error("the request body is nested too deeply", 0)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse_error(message: str, position: int) -> dict[str, Any]:
    error = _Invalid(PARSE_ERROR, message, position=position).error
    return envelope(PROTOCOL, None, errors=[error])


def operation(function: str, version: str | None) -> str:
    """The record's operation: ``function@version``, unambiguous for every pair.

    ``@`` and ``\\`` in the function name are escaped, so the first bare ``@``
    ends it; a call without a version has no bare ``@`` at all.
    """
    name = function.replace("\\", "\\\\").replace("@", "\\@")
    return name if version is None else f"{name}@{version}"


def parse(request: Any, max_ttl: float = MAX_TTL) -> MeshCall | dict[str, Any]:
    """The call in a request envelope, or the error envelope that answers it.

    Checks the envelope (protocol, id, call, extensions) and the idempotency
    extension's options; a ``ttl`` over ``max_ttl`` seconds is refused with
    ``INVALID_ARGUMENTS``. A request without the extension parses with
    ``key=None``. Nothing here touches a store.
    """
    try:
        return _parse(request, max_ttl)
    except _Invalid as bad:
        if bad.key_error:
            METRICS.count("invalid_key", "")
        return error_envelope(request, bad.error)


def _parse(request: Any, max_ttl: float) -> MeshCall:
    if not isinstance(request, dict):
        raise _Invalid(INVALID_REQUEST, "a Mesh request must be a JSON object")
    protocol = _protocol_of(request)
    if protocol is PROTOCOL:  # a valid protocol is echoed as a new object
        raise _Invalid(
            INVALID_REQUEST,
            'protocol must be {"name": "mesh", "version": "<version>"}',
            "/protocol",
        )
    rid = _id_of(request)
    if rid is None:
        raise _Invalid(INVALID_REQUEST, "id must be a non-empty string", "/id")
    call = request.get("call")
    if not isinstance(call, dict):
        raise _Invalid(INVALID_REQUEST, "call must be an object", "/call")
    function = call.get("function")
    if type(function) is not str or not function:
        raise _Invalid(
            INVALID_REQUEST, "call.function must be a non-empty string", "/call/function"
        )
    version = call.get("version")
    if version is not None and (type(version) is not str or not version):
        raise _Invalid(INVALID_REQUEST, "call.version must be a non-empty string", "/call/version")
    arguments = call.get("arguments")
    if arguments is None:
        arguments = {}
    elif not isinstance(arguments, dict):
        raise _Invalid(INVALID_REQUEST, "call.arguments must be an object", "/call/arguments")
    context = request.get("context")
    if context is not None and not isinstance(context, dict):
        raise _Invalid(INVALID_REQUEST, "context must be an object", "/context")
    extensions = request.get("extensions")
    key, engine_key, ttl = _options(extensions, max_ttl)
    fp = "" if key is None else _fingerprint(arguments)
    urns = tuple(dict.fromkeys(ext["urn"] for ext in extensions or ()))  # checked by _options
    return MeshCall(protocol, rid, call, function, version, engine_key, ttl, fp, key, urns)


def _options(extensions: Any, max_ttl: float) -> tuple[str | None, str | None, float | None]:
    """(the key as sent, the engine's key, ttl in seconds or None) of the idempotency
    extension; (None, None, None) without it."""
    if extensions is None:
        return None, None, None
    if not isinstance(extensions, list):
        raise _Invalid(INVALID_REQUEST, "extensions must be an array", "/extensions")
    found = None
    for i, ext in enumerate(extensions):
        urn = ext.get("urn") if isinstance(ext, dict) else None
        if type(urn) is not str or not urn:
            raise _Invalid(
                INVALID_REQUEST, "an extension must be an object with a urn", f"/extensions/{i}"
            )
        if urn == URN:
            if found is not None:
                raise _Invalid(INVALID_REQUEST, f"{URN} is declared twice", f"/extensions/{i}")
            found = i
    if found is None:
        return None, None, None
    at = f"/extensions/{found}/options"
    options = extensions[found].get("options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        raise _Invalid(INVALID_REQUEST, "the idempotency options must be an object", at)
    key = options.get("key")
    if key is None:
        raise _Invalid(
            INVALID_ARGUMENTS, "the idempotency extension needs a key", at + "/key", key_error=True
        )
    try:
        if type(key) is not str:
            raise InvalidKeyError(f"idempotency key must be a string, not {_json_type(key)}")
        engine_key = protocol_key(key)
    except InvalidKeyError as exc:
        raise _Invalid(INVALID_ARGUMENTS, str(exc), at + "/key", key_error=True) from None
    ttl = options.get("ttl")
    return key, engine_key, None if ttl is None else _ttl(ttl, at + "/ttl", max_ttl)


def _ttl(ttl: Any, at: str, max_ttl: float) -> float:
    """Seconds in a ``{"value": n, "unit": "hour"}`` duration of at most ``max_ttl``;
    any other value is ``INVALID_ARGUMENTS``, as a bad key is."""
    if not isinstance(ttl, dict):
        raise _Invalid(INVALID_ARGUMENTS, 'ttl must be {"value": <number>, "unit": "<unit>"}', at)
    value, unit = ttl.get("value"), ttl.get("unit")
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not math.isfinite(value))
        or not value > 0
    ):
        raise _Invalid(INVALID_ARGUMENTS, "ttl.value must be a positive number", at + "/value")
    per = UNITS.get(unit) if type(unit) is str else None
    if per is None:
        units = ", ".join(_SECONDS)
        raise _Invalid(INVALID_ARGUMENTS, f"ttl.unit must be one of {units}", at + "/unit")
    try:
        seconds = float(value) * per
    except OverflowError:  # an integer past float range: longer than any maximum
        seconds = math.inf
    if not seconds > 0:
        raise _Invalid(INVALID_ARGUMENTS, "ttl is shorter than a millisecond", at + "/value")
    if seconds > max_ttl:
        longest = int(max_ttl) if max_ttl == int(max_ttl) else max_ttl
        raise _Invalid(
            INVALID_ARGUMENTS,
            f"ttl cannot exceed {longest} seconds",
            at,
            details={"max_ttl": {"value": longest, "unit": "second"}},
        )
    return seconds


def _fingerprint(arguments: dict[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of the arguments: a client can recompute it."""
    try:
        return hashlib.sha256(canonical_json(arguments)).hexdigest()
    except (TypeError, ValueError, RecursionError) as exc:
        raise _Invalid(
            INVALID_REQUEST, f"call.arguments is not JSON: {exc}", "/call/arguments"
        ) from None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


# -- answers --------------------------------------------------------------------------


def _storable(result: Any, max_body: float) -> tuple[Outcome | None, str]:
    """(the outcome that stores ``result``, "") or (None, why it cannot be stored)."""
    try:
        outcome = Outcome.json(result)
    except (TypeError, ValueError, RecursionError) as exc:
        return None, f"its result is not a JSON value ({exc})"
    if len(outcome.body) > max_body:
        return None, f"its result of {len(outcome.body)} bytes is over the {max_body:.0f} kept"
    return outcome, ""


@dataclass(slots=True)
class Step:
    """The handler's answer, and how to record it: complete, or fail (final or not)."""

    response: dict[str, Any]
    outcome: Outcome | None = None
    failed: bool = False
    final: bool = False


@dataclass(slots=True)
class MeshCall:
    """A valid request envelope: the call, and the idempotency options (``key`` None: none).

    ``key`` is the engine's key (:func:`~retrysafe._model.hashing.protocol_key`: the key
    as sent, or its ``sha256:`` hash); ``sent_key`` the key as the request gave it, which
    every answer echoes. ``urns``: the request's extensions, in its order, each once.
    """

    protocol: Any
    id: str
    call: dict[str, Any]
    function: str
    version: str | None
    key: str | None
    ttl: float | None
    fingerprint: str
    sent_key: str | None = None
    urns: tuple[str, ...] = ()

    @property
    def operation(self) -> str:
        return operation(self.function, self.version)

    def _entry(self, status: str, original: str | None, **times: float) -> dict[str, Any] | None:
        if self.key is None:
            return None
        data: dict[str, Any] = {
            "key": self.sent_key,
            "status": status,
            "original_request_id": original,
        }
        for name, seconds in times.items():
            data[name] = _iso(seconds)
        return {"urn": URN, "data": data}

    def _envelope(
        self,
        result: Any,
        errors: list[dict[str, Any]] | None = None,
        entry: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """An envelope answering this call: every extension of the request is echoed by
        its URN, in the request's order (extensions/index.md, "Server Handling": "Return
        response with same extensions"); the idempotency one as ``entry``, and only
        when there is one."""
        answer = envelope(self.protocol, self.id, result, errors)
        echoed = [
            entry if urn == URN else {"urn": urn}
            for urn in self.urns
            if urn != URN or entry is not None
        ]
        if echoed:
            answer["extensions"] = echoed
        return answer

    def error(self, error: dict[str, Any]) -> dict[str, Any]:
        """An error envelope answering this call, without idempotency data."""
        return self._envelope(None, [error])

    def not_found(self) -> dict[str, Any]:
        where = {"pointer": "/call/function"}
        return self.error(
            error_object(FUNCTION_NOT_FOUND, f"no function {self.function!r}", False, None, where)
        )

    def crashed(self) -> dict[str, Any]:
        """The answer when the handler raised (the exception text stays in the log)."""
        return self.error(
            error_object(INTERNAL_ERROR, "the function failed; the request may be retried", True)
        )

    def _processed(
        self, result: Any, errors: list[dict[str, Any]] | None, claim: Claim | None, kept: bool
    ) -> dict[str, Any]:
        times = {"expires_at": claim.expires_at} if kept and claim is not None else {}
        entry = self._entry("processed", self.id, **times)
        return self._envelope(result, errors, entry)

    def finish(self, result: Any, claim: Claim | None, max_body: float = math.inf) -> Step:
        """The answer to the handler's ``result`` (or the :class:`MeshError` it raised).

        ``claim`` None: the request has no idempotency extension (nothing to record).
        """
        if isinstance(result, MeshError):
            errors = [result.to_dict()]
            if result.retryable:
                return Step(self._processed(None, errors, claim, False), failed=True)
        else:
            outcome, problem = _storable(result, max_body)
            if outcome is not None:
                return Step(self._processed(result, None, claim, True), outcome)
            errors = [error_object(INTERNAL_ERROR, f"the function ran but {problem}", False)]
        return Step(self._processed(None, errors, claim, True), Outcome.json(errors), True, True)

    def stored(self, response: dict[str, Any], claim: Claim | None) -> dict[str, Any]:
        """``response`` (from :meth:`finish`) once its answer is recorded: its
        ``expires_at`` is the record's, counted from when the answer was stored."""
        if claim is not None:
            for entry in response.get("extensions") or ():
                data = entry.get("data") if entry.get("urn") == URN else None
                if data is not None and "expires_at" in data:
                    data["expires_at"] = _iso(claim.expires_at)
        return response

    def replayed(self, replay: Replay) -> dict[str, Any]:
        """The stored answer of the first request, with ``status: cached``."""
        record = replay.record
        cached_at = record.completed_at if record.completed_at is not None else record.updated_at
        entry = self._entry(
            "cached", record.request_id, cached_at=cached_at, expires_at=record.expires_at
        )
        value = None if record.outcome is None else record.outcome.value
        if not replay.failed:
            return self._envelope(value, None, entry)
        if not isinstance(value, list):  # a final failure with no stored errors
            value = [
                error_object(
                    INTERNAL_ERROR,
                    "an earlier attempt with this idempotency key failed finally; "
                    "it is not run again",
                    False,
                )
            ]
        return self._envelope(None, value, entry)

    def refused(self, exc: IdempotencyError) -> dict[str, Any]:
        """The answer when the engine would not start the call."""
        if isinstance(exc, InProgressError):
            error = error_object(
                IDEMPOTENCY_PROCESSING,
                "Previous request with this key is still processing",
                True,
                {"key": self.sent_key, "retry_after": _whole_seconds(exc.retry_after)},
            )
            entry = self._entry("processing", exc.original_request_id)
        elif isinstance(exc, FingerprintMismatchError):
            original = f"sha256:{exc.original_fingerprint}"
            error = error_object(
                IDEMPOTENCY_CONFLICT,
                "Idempotency key already used with different arguments",
                False,
                {"key": self.sent_key, "original_arguments_hash": original},
            )
            entry = self._entry("conflict", exc.original_request_id)
        elif isinstance(exc, PrincipalRequiredError):
            error = error_object(UNAUTHORIZED, str(exc), False)
            entry = None
        elif isinstance(exc, AmbiguousCredentialsError):
            error = error_object(INVALID_REQUEST, str(exc), False)
            entry = None
        elif isinstance(exc, StoreUnavailableError):
            error = error_object(
                UNAVAILABLE,
                "the idempotency store cannot be reached; retry with the same key",
                True,
                {"key": self.sent_key, "retry_after": _whole_seconds(exc.retry_after)},
            )
            entry = None
        else:
            raise exc
        return self._envelope(None, [error], entry)
