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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from retrysafe._core.metrics import METRICS
from retrysafe._model.hashing import canonical_json, fingerprint, protocol_key
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
    "CARD_METHODS",
    "CARD_PATH",
    "EXTENSION_URI",
    "SEND_METHODS",
    "STREAM_METHODS",
    "V03",
    "V10",
    "A2AErrorInfo",
    "ErrorCode",
    "Send",
    "advertised",
    "agent_extension",
    "error_info",
    "error_metadata",
    "error_reply",
    "failed_finally",
    "invalid_request",
    "parse_send",
    "refusal",
    "replayed",
    "result_as",
    "retry_after",
    "settlement",
]

V03 = "0.3"
V10 = "1.0"

#: The send methods, each with the protocol version that spells it so.
SEND_METHODS: dict[str, str] = {"message/send": V03, "SendMessage": V10}
#: Streaming sends: passed through, not deduplicated.
STREAM_METHODS = frozenset({"message/stream", "SendStreamingMessage"})
#: The JSON-RPC methods that answer the extended agent card (v1.0, v0.3).
CARD_METHODS = frozenset({"GetExtendedAgentCard", "agent/getAuthenticatedExtendedCard"})
#: Where an A2A server serves its public agent card.
CARD_PATH = "/.well-known/agent-card.json"
#: The URI of retrysafe's AgentCard extension: sends deduplicated by messageId.
EXTENSION_URI = "urn:retrysafe:a2a:ext:idempotency:v1"


class ErrorCode(enum.IntEnum):
    """JSON-RPC error codes of retrysafe's answers.

    They are JSON-RPC's standard codes, as the a2a-sdk server gives them, so
    that an A2A client maps each to its error class and keeps ``error.data``.
    The server-error range is taken: JSON-RPC reserves -32000 to -32099 for
    the implementation and A2A uses -32001 to -32099 for its own errors. The
    situation is in ``data``'s ``code`` (``idempotency_in_flight``, ...); the
    names below are aliases of the three codes, kept for compatibility.
    """

    INVALID_REQUEST = -32600
    INVALID_PARAMS = -32602
    INTERNAL_ERROR = -32603
    IN_FLIGHT = -32603
    CONFLICT = -32602
    STORE_UNAVAILABLE = -32603
    FAILED = -32603
    PRINCIPAL_REQUIRED = -32600


# -- the two spellings ---------------------------------------------------------------

_CAMEL = re.compile(r"_([a-z0-9])")


def _camel(name: str) -> str:
    """ProtoJSON accepts a field's proto name too (``message_id``): use the JSON name."""
    return _CAMEL.sub(lambda m: m.group(1).upper(), name) if "_" in name else name


def _snake(name: str) -> str:
    """A JSON name's proto spelling (``contextId`` is ``context_id``)."""
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)


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
        value = obj.get(_snake(name))
    return value


class _InvalidMessageError(InvalidKeyError):
    """A send's message has no usable messageId, or cannot be fingerprinted.

    ``field`` is the field at fault, as A2A's ``google.rpc.BadRequest`` names it.
    """

    def __init__(self, message: str, field: str = "message.messageId") -> None:
        super().__init__(message)
        self.field = field


def parse_send(request: Any, principal: str) -> Send | None:
    """The send in ``request`` (one JSON-RPC request object), or None for any
    other request. :class:`InvalidKeyError` if a send has no usable messageId
    (with ``field``, the field at fault).

    The messageId is any non-empty string of up to 1024 characters (A2A defines
    it as a string); one that is not an engine key is stored as its SHA-256.
    """
    if not isinstance(request, dict):
        return None
    method = request.get("method")
    version = SEND_METHODS.get(method) if isinstance(method, str) else None
    if version is None:
        return None
    params = request.get("params")
    message = params.get("message") if isinstance(params, dict) else None
    if not isinstance(params, dict) or not isinstance(message, dict):
        raise _InvalidMessageError("a send needs params.message with a messageId", "message")
    key = _field(message, "messageId")
    if key is None:
        raise _InvalidMessageError("params.message.messageId is required")
    try:
        key = protocol_key(key)  # any string A2A allows, up to 1024 characters
    except InvalidKeyError as exc:
        raise _InvalidMessageError(f"messageId: {exc}") from None
    tenant = _field(params, "tenant")  # v1.0 only
    context = _field(message, "contextId")
    metadata = params.get("metadata")
    try:
        # JSON, so that no choice of parts can run into another.
        scope = canonical_json([principal, tenant or "", context or ""]).decode()
        fp = fingerprint(normal_message(message), _numbers(metadata) or None)
    except (TypeError, ValueError, RecursionError) as exc:
        raise _InvalidMessageError(
            f"the message cannot be fingerprinted: {exc}", "message"
        ) from None
    return Send(str(method), version, request.get("id"), key, scope, fp)


# -- the agent card ---------------------------------------------------------------------


def agent_extension(
    *, ttl: float = 86400, streaming: bool = False, bindings: Iterable[str] = ("JSONRPC",)
) -> dict[str, Any]:
    """The AgentCard extension (A2A ``AgentExtension``, as JSON) that says sends
    are deduplicated: ``required`` is false, since a client needs nothing to
    use it. ``ttl`` is how long a send is remembered, in seconds; ``streaming``
    whether streaming sends are covered; ``bindings`` the protocol bindings
    that are."""
    return {
        "uri": EXTENSION_URI,
        "description": (
            "Sends are deduplicated by messageId: a resend of a message gets the "
            "stored Task or Message and starts nothing."
        ),
        "required": False,
        "params": {
            "key": "message.messageId",
            "scope": ["principal", "tenant", "contextId"],
            "ttlSeconds": math.ceil(ttl),
            "streaming": streaming,
            "bindings": list(bindings),
        },
    }


def advertised(card: Any, extension: dict[str, Any]) -> dict[str, Any] | None:
    """``card`` (an AgentCard as JSON) with ``extension`` added to its
    ``capabilities.extensions``; None to leave it as it is: not a card, signed
    (a change would break its signatures), or declaring the extension already."""
    if not isinstance(card, dict) or card.get("signatures"):
        return None
    capabilities = card.get("capabilities", {})
    extensions = capabilities.get("extensions", []) if isinstance(capabilities, dict) else None
    if not isinstance(extensions, list) or any(
        isinstance(e, dict) and e.get("uri") == extension["uri"] for e in extensions
    ):
        return None
    return {**card, "capabilities": {**capabilities, "extensions": [*extensions, extension]}}


# -- errors: one description, each binding's shape -------------------------------------

#: The ``@type`` of the google.rpc details an A2A error carries (ProtoJSON ``Any``).
ERROR_INFO_TYPE = "type.googleapis.com/google.rpc.ErrorInfo"
RETRY_INFO_TYPE = "type.googleapis.com/google.rpc.RetryInfo"
BAD_REQUEST_TYPE = "type.googleapis.com/google.rpc.BadRequest"
#: The ErrorInfo domain of A2A's reasons, as the a2a-sdk gives it.
A2A_DOMAIN = "a2a-protocol.org"


@dataclass(frozen=True, slots=True)
class A2AErrorInfo:
    """How A2A answers one of retrysafe's refusals, in every binding.

    ``code`` is the JSON-RPC code and ``reason`` the ``google.rpc.ErrorInfo``
    reason of one a2a-sdk error class (-32603 ``INTERNAL_ERROR``, -32602
    ``INVALID_PARAMS``, -32600 ``INVALID_REQUEST``), so that the SDK's client
    raises that class with ``metadata`` as its ``data`` (and, over HTTP+JSON, the
    SDK gives the class's own status). ``metadata`` holds strings (ErrorInfo's map
    does): ``code`` (retrysafe's machine code), ``retryable`` (``"true"`` or
    ``"false"``) and, where they apply, ``retryAfter`` (seconds),
    ``originalRequestId`` and ``originalFingerprint``. The SDK's error class
    raised with ``data=metadata`` answers with the same ErrorInfo.
    ``violations`` are the ``(field, description)`` pairs of a
    ``google.rpc.BadRequest``.
    """

    code: int
    reason: str
    message: str
    metadata: dict[str, str]
    retry_after: int | None = None
    violations: tuple[tuple[str, str], ...] = ()

    def details(self) -> list[dict[str, Any]]:
        """A2A v1.0's ``error.data`` (HTTP+JSON: ``error.details``): the ErrorInfo
        first, as clients read the first one, then RetryInfo and BadRequest."""
        details: list[dict[str, Any]] = [
            {
                "@type": ERROR_INFO_TYPE,
                "reason": self.reason,
                "domain": A2A_DOMAIN,
                "metadata": dict(self.metadata),
            }
        ]
        if self.retry_after is not None:
            details.append({"@type": RETRY_INFO_TYPE, "retryDelay": f"{self.retry_after}s"})
        if self.violations:
            violations = [{"field": f, "description": d} for f, d in self.violations]
            details.append({"@type": BAD_REQUEST_TYPE, "fieldViolations": violations})
        return details

    def legacy_data(self) -> dict[str, Any]:
        """A2A v0.3's ``error.data``: one object, with the keys retrysafe gave
        before (``code``, ``retryable`` a bool, ``retry_after`` an int,
        ``original_request_id``, ``original_fingerprint``)."""
        data: dict[str, Any] = {}
        for name, value in self.metadata.items():
            if name == "retryable":
                data[name] = value == "true"
            elif name == "retryAfter":
                data["retry_after"] = int(value)
            else:
                data[_snake(name)] = value
        return data

    def reply(self, request_id: Any, version: str = V10) -> dict[str, Any]:
        """The JSON-RPC error response, its ``data`` in the shape of ``version``."""
        data = self.legacy_data() if version == V03 else self.details()
        return error_reply(request_id, self.code, self.message, data)


def _seconds(value: float) -> int:
    return max(1, math.ceil(value))


def error_info(exc: IdempotencyError) -> A2AErrorInfo:
    """How A2A answers ``exc``, an error of the key, the caller or the engine.

    Raises ``exc`` itself if A2A has no answer for it (a deployment error).
    """
    meta = {"code": exc.code, "retryable": "false"}
    retry: int | None = None
    if isinstance(exc, (InProgressError, StoreUnavailableError)):
        retry = _seconds(exc.retry_after)
        meta.update(retryable="true", retryAfter=str(retry))
    original = getattr(exc, "original_request_id", None)
    if original is not None:
        meta["originalRequestId"] = str(original)
    if isinstance(exc, InvalidKeyError):
        field = exc.field if isinstance(exc, _InvalidMessageError) else "message.messageId"
        return A2AErrorInfo(
            -32602,
            "INVALID_PARAMS",
            f"Invalid params: {exc}",
            meta,
            violations=((field, str(exc)),),
        )
    if isinstance(exc, AmbiguousCredentialsError):
        return A2AErrorInfo(-32600, "INVALID_REQUEST", str(exc), meta)
    if isinstance(exc, PrincipalRequiredError):
        return A2AErrorInfo(-32600, "INVALID_REQUEST", str(exc), meta)
    if isinstance(exc, InProgressError):
        message = "a message with this messageId is still being processed; retry later"
        return A2AErrorInfo(-32603, "INTERNAL_ERROR", message, meta, retry)
    if isinstance(exc, FingerprintMismatchError):
        meta["originalFingerprint"] = exc.original_fingerprint
        message = "this messageId was already used with a different message"
        return A2AErrorInfo(-32602, "INVALID_PARAMS", message, meta)
    if isinstance(exc, StoreUnavailableError):
        message = "the idempotency store cannot be reached; retry with the same messageId"
        return A2AErrorInfo(-32603, "INTERNAL_ERROR", message, meta, retry)
    raise exc


def failed_finally() -> A2AErrorInfo:
    """The answer to a repeat of a send that failed finally (and left no error to replay)."""
    message = "an earlier attempt with this messageId failed finally; it is not run again"
    meta = {"code": "idempotency_failed", "retryable": "false"}
    return A2AErrorInfo(-32603, "INTERNAL_ERROR", message, meta)


def invalid_request(code: str, message: str) -> A2AErrorInfo:
    """A request refused before it is read as a send (a batch, a body too large)."""
    meta = {"code": code, "retryable": "false"}
    return A2AErrorInfo(-32600, "INVALID_REQUEST", message, meta)


# -- answers ------------------------------------------------------------------------


def error_reply(request_id: Any, code: int, message: str, data: Any) -> dict[str, Any]:
    """A JSON-RPC error response."""
    error = {"code": int(code), "message": message, "data": data}
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def refusal(
    request_id: Any, exc: IdempotencyError, operation: str = "a2a.send", version: str = V10
) -> dict[str, Any]:
    """The JSON-RPC error answering an error of the key, the caller or the engine,
    in the shape of ``version``; raises ``exc`` if A2A has no answer for it."""
    METRICS.refused(operation, exc)  # once: the engine's errors are counted there
    return error_info(exc).reply(request_id, version)


def error_metadata(error: Any) -> dict[str, Any] | None:
    """What a JSON-RPC error object says of itself: v1.0's ``google.rpc.ErrorInfo``
    metadata (the first in the ``data`` list), or v0.3's ``data`` object; None
    without either."""
    data = error.get("data") if isinstance(error, dict) else None
    if isinstance(data, dict):
        return data
    if isinstance(data, list):
        info = next(
            (d for d in data if isinstance(d, dict) and d.get("@type") == ERROR_INFO_TYPE), None
        )
        meta = info.get("metadata") if info is not None else None
        return meta if isinstance(meta, dict) else None
    return None


def retry_after(reply: dict[str, Any]) -> str | None:
    """The ``Retry-After`` header of a JSON-RPC error answer: its delay, in
    either shape of ``data``; None without one."""
    error = reply.get("error")
    data = error.get("data") if isinstance(error, dict) else None
    meta = error_metadata(error)
    value: Any = None
    if meta is not None:
        value = meta.get("retry_after" if isinstance(data, dict) else "retryAfter")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    text = str(value)
    return text if text.isascii() and text.isdigit() else None


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
    return failed_finally().reply(send.id, send.version)


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
