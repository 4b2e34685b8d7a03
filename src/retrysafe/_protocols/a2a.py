"""A2A JSON-RPC sends: both spellings, the message's normal form, the answers.

Plain code with no I/O, shared by the function wrapper and the ASGI middleware
of :mod:`retrysafe.a2a`:

- A2A v0.3 spells a send ``message/send`` with ``{"kind": "message", "role":
  "user", "parts": [{"kind": "text", ...}]}`` and answers a Task
  (``"kind": "task"``, states like ``"completed"``) or a Message;
- A2A v1.0 (the ProtoJSON form of ``lf.a2a.v1``) spells it ``SendMessage`` with
  ``{"role": "ROLE_USER", "parts": [{"text": ...}]}`` and answers
  ``{"task": {...}}`` (states like ``"TASK_STATE_COMPLETED"``) or
  ``{"message": {...}}``.

A message is fingerprinted in one normal form (the v1.0 one, defaults left
out), so a retry in the other spelling is the same message, and a replay is
converted to the shape of the spelling that asks for it.
"""

from __future__ import annotations

import base64
import binascii
import enum
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

from retrysafe._core.engine import Engine, Plan, engine_for
from retrysafe._core.metrics import METRICS
from retrysafe._model.hashing import canonical_json, fingerprint, validate_key
from retrysafe._model.record import Outcome
from retrysafe.errors import (
    AmbiguousCredentialsError,
    FingerprintMismatchError,
    IdempotencyError,
    InProgressError,
    InvalidKeyError,
    PrincipalRequiredError,
    StoreUnavailableError,
)

__all__ = [
    "SEND_METHODS",
    "STREAM_METHODS",
    "ErrorCode",
    "Send",
    "SendOptions",
    "error_reply",
    "parse_send",
    "refusal",
    "replayed",
    "result_as",
    "send_engine",
    "settlement",
]

V03 = "0.3"
V10 = "1.0"

#: The send methods, each with the protocol version that spells it so.
SEND_METHODS: dict[str, str] = {"message/send": V03, "SendMessage": V10}
#: Streaming sends: passed through, not deduplicated.
STREAM_METHODS = frozenset({"message/stream", "SendStreamingMessage"})


class ErrorCode(enum.IntEnum):
    """JSON-RPC error codes of retrysafe's answers.

    The server-error range (-32000 to -32099) is the implementation's; A2A
    itself uses -32001 to -32009, so these stay clear of it.
    """

    INVALID_REQUEST = -32600
    INVALID_PARAMS = -32602
    IN_FLIGHT = -32090
    CONFLICT = -32091
    STORE_UNAVAILABLE = -32092
    FAILED = -32093
    PRINCIPAL_REQUIRED = -32094


# -- the two spellings ---------------------------------------------------------------

_CAMEL = re.compile(r"_([a-z0-9])")


def _camel(name: str) -> str:
    """ProtoJSON accepts a field's proto name too (``message_id``): use the JSON name."""
    return _CAMEL.sub(lambda m: m.group(1).upper(), name) if "_" in name else name


_ROLE_V10: dict[Any, str] = {
    "user": "ROLE_USER",
    "agent": "ROLE_AGENT",
    0: "ROLE_UNSPECIFIED",
    1: "ROLE_USER",
    2: "ROLE_AGENT",
}
_ROLE_V03: dict[Any, str] = {"ROLE_USER": "user", "ROLE_AGENT": "agent", 1: "user", 2: "agent"}
_STATES_V03 = (
    "submitted",
    "working",
    "completed",
    "failed",
    "canceled",
    "input-required",
    "rejected",
    "auth-required",
)
_STATE_V10: dict[Any, str] = {s: "TASK_STATE_" + s.upper().replace("-", "_") for s in _STATES_V03}
_STATE_V10["unknown"] = "TASK_STATE_UNSPECIFIED"
_STATE_V03: dict[Any, str] = {v: k for k, v in _STATE_V10.items()}


def _mapped(table: dict[Any, str], value: Any) -> Any:
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return table.get(value, value)
    return value


def part_v10(part: Any) -> Any:
    """A part in v1.0 form (``text``, ``raw``, ``url`` or ``data`` at the top)."""
    if not isinstance(part, dict):
        return part
    out: dict[str, Any] = {}
    for name, value in part.items():
        name = _camel(name)
        if name == "kind":
            continue
        if name == "file" and isinstance(value, dict):
            file = {_camel(k): v for k, v in value.items()}
            for old, new in (
                ("bytes", "raw"),
                ("uri", "url"),
                ("mimeType", "mediaType"),
                ("name", "filename"),
            ):
                if old in file:
                    file[new] = file.pop(old)
            out.update(file)
            continue
        out[name] = value
    # v0.3 data parts hold objects only: other values travel as {"value": x}, flagged.
    meta, data = out.get("metadata"), out.get("data")
    if (
        part.get("kind") == "data"
        and isinstance(meta, dict)
        and meta.get("data_part_compat")
        and isinstance(data, dict)
        and "value" in data
    ):
        out["data"] = data["value"]
        rest = {k: v for k, v in meta.items() if k != "data_part_compat"}
        if rest:
            out["metadata"] = rest
        else:
            del out["metadata"]
    return out


def part_v03(part: Any) -> Any:
    """A part in v0.3 form (``kind`` text, file or data).

    v0.3 has no media type or file name on a text part: those are left out.
    """
    if not isinstance(part, dict) or "kind" in part or "file" in part:
        return part
    rest = {_camel(k): v for k, v in part.items()}
    media, name = rest.pop("mediaType", None), rest.pop("filename", None)
    out: dict[str, Any]
    if "text" in rest:
        out = {"kind": "text", "text": rest.pop("text")}
    elif "raw" in rest or "url" in rest:
        file = {"bytes": rest.pop("raw")} if "raw" in rest else {"uri": rest.pop("url")}
        if media:
            file["mimeType"] = media
        if name:
            file["name"] = name
        out = {"kind": "file", "file": file}
    elif "data" in rest:
        data = rest.pop("data")
        if isinstance(data, dict):
            out = {"kind": "data", "data": data}
        else:
            out = {"kind": "data", "data": {"value": data}}
            meta = rest.get("metadata")
            meta = dict(meta) if isinstance(meta, dict) else {}
            rest["metadata"] = {**meta, "data_part_compat": True}
    else:
        return part
    out.update(rest)
    return out


def _convert(obj: Any, kind: str | None, fields: dict[str, Callable[[Any], Any]]) -> Any:
    """``obj`` with JSON field names, ``kind`` set (v0.3) or left out (v1.0), and
    the values of ``fields`` converted; other fields as they are."""
    if not isinstance(obj, dict):
        return obj
    out: dict[str, Any] = {} if kind is None else {"kind": kind}
    for name, value in obj.items():
        name = _camel(name)
        if name != "kind":
            convert = fields.get(name)
            out[name] = value if convert is None else convert(value)
    return out


def _each(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: [convert(v) for v in value] if isinstance(value, list) else value


def _rfc3339(stamp: Any) -> Any:
    """A UTC timestamp as ProtoJSON writes it (``Z``, not ``+00:00``)."""
    if isinstance(stamp, str) and stamp.endswith("+00:00"):
        return stamp[:-6] + "Z"
    return stamp


def message_v10(message: Any) -> Any:
    """A message in v1.0 form."""
    return _convert(message, None, _MESSAGE_V10)


def message_v03(message: Any) -> Any:
    """A message in v0.3 form."""
    return _convert(message, "message", _MESSAGE_V03)


_MESSAGE_V10 = {"role": lambda r: _mapped(_ROLE_V10, r), "parts": _each(part_v10)}
_MESSAGE_V03 = {"role": lambda r: _mapped(_ROLE_V03, r), "parts": _each(part_v03)}
_STATUS_V10 = {
    "state": lambda s: _mapped(_STATE_V10, s),
    "message": message_v10,
    "timestamp": _rfc3339,
}
_STATUS_V03 = {"state": lambda s: _mapped(_STATE_V03, s), "message": message_v03}
_TASK_V10 = {
    "status": lambda s: _convert(s, None, _STATUS_V10),
    "history": _each(message_v10),
    "artifacts": _each(lambda a: _convert(a, None, {"parts": _each(part_v10)})),
}
_TASK_V03 = {
    "status": lambda s: _convert(s, None, _STATUS_V03),
    "history": _each(message_v03),
    "artifacts": _each(lambda a: _convert(a, None, {"parts": _each(part_v03)})),
}


def task_v10(task: Any) -> Any:
    """A task in v1.0 form."""
    return _convert(task, None, _TASK_V10)


def task_v03(task: Any) -> Any:
    """A task in v0.3 form (a task without a status gets state ``unknown``)."""
    out = _convert(task, "task", _TASK_V03)
    if isinstance(out, dict):
        out.setdefault("status", {"state": "unknown"})
    return out


def result_as(result: Any, version: str) -> Any:
    """A send's result (a Task or a Message) in the shape of ``version``.

    A result of neither shape is returned as it is.
    """
    if not isinstance(result, dict):
        return result
    if version == V10:
        kind = result.get("kind")
        if kind == "task":
            return {"task": task_v10(result)}
        if kind == "message":
            return {"message": message_v10(result)}
        return result
    if "kind" not in result and len(result) == 1:
        if isinstance(result.get("task"), dict):
            return task_v03(result["task"])
        if isinstance(result.get("message"), dict):
            return message_v03(result["message"])
    return result


# -- the normal form ------------------------------------------------------------------

_EMPTY: tuple[Any, ...] = (None, "", [], {}, "ROLE_UNSPECIFIED")
#: A part's content is kept even when empty (an empty text is still a text part).
_CONTENT = frozenset({"text", "raw", "url", "data"})


def _numbers(value: Any) -> Any:
    """Integral floats as ints: ``1`` and ``1.0`` are one JSON number (protobuf
    Structs give every number as a double)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    return value


def _raw(value: Any) -> Any:
    """Base64 in one alphabet and padding (ProtoJSON accepts URL-safe and unpadded)."""
    if not isinstance(value, str):
        return value
    text = value.replace("-", "+").replace("_", "/")
    try:
        return base64.b64encode(base64.b64decode(text + "=" * (-len(text) % 4))).decode()
    except (binascii.Error, ValueError):
        return value


def _pruned_part(part: Any) -> Any:
    if not isinstance(part, dict):
        return part
    out = {k: v for k, v in part.items() if k in _CONTENT or v not in _EMPTY}
    if "raw" in out:
        out["raw"] = _raw(out["raw"])
    return out


def normal_message(message: dict[str, Any]) -> dict[str, Any]:
    """The message in v1.0 form, without its id, defaults left out."""
    out = {}
    for name, value in message_v10(message).items():
        if name == "messageId" or value in _EMPTY:
            continue
        if name == "parts":
            value = _each(_pruned_part)(value)
        out[name] = value
    return _numbers(out)


# -- one send -----------------------------------------------------------------------


@dataclass(slots=True)
class Send:
    """A send request, ready for the engine."""

    method: str
    version: str
    id: Any
    key: str
    scope: str
    fingerprint: str

    @property
    def request_id(self) -> str | None:
        return None if self.id is None else str(self.id)


def _field(obj: dict[str, Any], name: str) -> Any:
    """``obj[name]``, or its proto spelling (``contextId`` or ``context_id``)."""
    value = obj.get(name)
    if value is None:
        value = obj.get(re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name))
    return value


def parse_send(request: Any, principal: str) -> Send | None:
    """The send in ``request`` (one JSON-RPC request object), or None for any
    other request. :class:`InvalidKeyError` if a send has no usable messageId."""
    if not isinstance(request, dict):
        return None
    method = request.get("method")
    version = SEND_METHODS.get(method) if isinstance(method, str) else None
    if version is None:
        return None
    params = request.get("params")
    message = params.get("message") if isinstance(params, dict) else None
    if not isinstance(params, dict) or not isinstance(message, dict):
        raise InvalidKeyError("a send needs params.message with a messageId")
    key = _field(message, "messageId")
    if key is None:
        raise InvalidKeyError("params.message.messageId is required")
    validate_key(key)
    tenant = _field(params, "tenant")  # v1.0 only
    context = _field(message, "contextId")
    metadata = params.get("metadata")
    try:
        # JSON, so that no choice of parts can run into another.
        scope = canonical_json([principal, tenant or "", context or ""]).decode()
        fp = fingerprint(normal_message(message), _numbers(metadata) or None)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidKeyError(f"the message cannot be fingerprinted: {exc}") from None
    return Send(str(method), version, request.get("id"), key, scope, fp)


# -- answers ------------------------------------------------------------------------


def error_reply(request_id: Any, code: int, message: str, data: dict[str, Any]) -> dict[str, Any]:
    """A JSON-RPC error response."""
    error = {"code": int(code), "message": message, "data": data}
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def _seconds(value: float) -> int:
    return max(1, math.ceil(value))


def refusal(request_id: Any, exc: IdempotencyError, operation: str = "a2a.send") -> dict[str, Any]:
    """The JSON-RPC error answering an error of the key or the engine."""
    METRICS.refused(operation, exc)  # once: the engine's errors are counted there
    original = getattr(exc, "original_request_id", None)
    extra = {} if original is None else {"original_request_id": original}
    if isinstance(exc, InvalidKeyError):
        return error_reply(
            request_id, ErrorCode.INVALID_PARAMS, f"Invalid params: {exc}", {"code": exc.code}
        )
    if isinstance(exc, AmbiguousCredentialsError):
        return error_reply(
            request_id, ErrorCode.INVALID_REQUEST, str(exc), {"code": exc.code, "retryable": False}
        )
    if isinstance(exc, PrincipalRequiredError):
        return error_reply(
            request_id,
            ErrorCode.PRINCIPAL_REQUIRED,
            str(exc),
            {"code": exc.code, "retryable": False},
        )
    if isinstance(exc, InProgressError):
        return error_reply(
            request_id,
            ErrorCode.IN_FLIGHT,
            "a message with this messageId is still being processed; retry later",
            {
                "code": exc.code,
                "retryable": True,
                "retry_after": _seconds(exc.retry_after),
                **extra,
            },
        )
    if isinstance(exc, FingerprintMismatchError):
        return error_reply(
            request_id,
            ErrorCode.CONFLICT,
            "this messageId was already used with a different message",
            {
                "code": exc.code,
                "retryable": False,
                "original_fingerprint": exc.original_fingerprint,
                **extra,
            },
        )
    if isinstance(exc, StoreUnavailableError):
        return error_reply(
            request_id,
            ErrorCode.STORE_UNAVAILABLE,
            "the idempotency store cannot be reached; retry with the same messageId",
            {"code": exc.code, "retryable": True, "retry_after": _seconds(exc.retry_after)},
        )
    raise exc


def replayed(send: Send, outcome: Outcome | None) -> dict[str, Any]:
    """The stored answer of ``send``'s message, for this request's id and spelling."""
    stored = outcome.value if outcome is not None else None
    if isinstance(stored, dict) and "result" in stored:
        result = stored["result"]
        if SEND_METHODS.get(stored.get("method", "")) != send.version:
            result = result_as(result, send.version)
        return {"jsonrpc": "2.0", "id": send.id, "result": result}
    if isinstance(stored, dict) and isinstance(stored.get("error"), dict):
        return {"jsonrpc": "2.0", "id": send.id, "error": stored["error"]}
    return error_reply(
        send.id,
        ErrorCode.FAILED,
        "an earlier attempt with this messageId failed finally; it is not run again",
        {"code": "idempotency_failed", "retryable": False},
    )


def settlement(send: Send, response: Any) -> tuple[bool, Outcome | None]:
    """``(succeeded, outcome)`` for the handler's response to ``send``.

    Only a JSON-RPC success is stored as the answer; a JSON-RPC error is kept
    with the failure (replayed only if failures are final); anything else fails
    without an outcome. Raises ``TypeError``/``ValueError`` if the response
    holds a value that is not JSON.
    """
    if not isinstance(response, dict):
        return False, None
    if "result" in response and "error" not in response:
        return True, Outcome.json({"method": send.method, "result": response["result"]})
    error = response.get("error")
    if isinstance(error, dict):
        return False, Outcome.json({"method": send.method, "error": error})
    return False, None


# -- the engine of a door -----------------------------------------------------------


class SendOptions(TypedDict, total=False):
    """The engine options of an A2A door (see :class:`retrysafe.a2a.A2AIdempotency`)."""

    ttl: float | None
    lease: float | None
    wait: float | None
    operation: str
    retention: str | None
    max_body: int | None


def send_engine(store: Any, **options: Unpack[SendOptions]) -> tuple[Engine, Plan]:
    """The engine of an A2A door over ``store`` (a store, URL or engine; URLs shared
    with ``@idempotent``), and the plan every send derives from: the options
    validated once (``operation`` defaults to ``a2a.send``). :class:`TypeError` for
    an option it does not know."""
    unknown = sorted(set(options) - set(SendOptions.__annotations__))
    if unknown:
        raise TypeError(f"unexpected option {unknown[0]!r}")
    ttl, lease, retention = options.get("ttl"), options.get("lease"), options.get("retention")
    engine = engine_for(
        store,
        share=True,
        ttl=ttl,
        lease=lease,
        retention=retention,
        max_body=options.get("max_body"),
    )
    plan = Plan(
        engine,
        "-",
        operation=options.get("operation", "a2a.send"),
        ttl=ttl,
        lease=lease,
        wait=options.get("wait"),
        retention=retention,
    )
    return engine, plan
