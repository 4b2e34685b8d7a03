"""MCP ``tools/call``: where the key is, what is fingerprinted, the answers.

Plain code with no MCP SDK import, shared by every MCP door: the extension for
the official SDK's servers, the ASGI middleware, and ``retrysafe mcp-proxy``
(stdio and Streamable HTTP). They all speak JSON-RPC dicts here:

- :func:`parse_call` reads a ``tools/call`` request's params (and the
  ``Idempotency-Key`` header, over HTTP) into a :class:`ToolCall`, or None when
  the call carries no key and passes through;
- :func:`run_call` is the one async shell around the engine: claim, replay or
  run, record; it answers a JSON-RPC reply body (``{"result": ...}`` or
  ``{"error": ...}``) and never raises an :class:`IdempotencyError`;
- :func:`refusal` describes every refusal as a JSON-RPC error.

Where a key is read, in this order (two different keys are an invalid request):

1. ``params._meta["dev.retrysafe/idempotencyKey"]`` (:data:`META_KEY`);
2. ``params.idempotencyKey``, the field that SEP-3182 proposed (:data:`PARAM_KEY`);
3. the ``Idempotency-Key`` header of a Streamable HTTP request;
4. a tool argument the door names (``key_argument``), left out of the fingerprint.
"""

from __future__ import annotations

import dataclasses
import getpass
import math
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

from retrysafe._core.engine import Attempt, DoorOptions, Engine, Plan, door_engine
from retrysafe._core.heartbeat import renewing
from retrysafe._core.metrics import METRICS
from retrysafe._core.recording import arecord
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
    "CALL_METHOD",
    "EXTENSION_ID",
    "META_KEY",
    "PARAM_KEY",
    "REPLAY_META",
    "CallOptions",
    "McpError",
    "NotAnAnswer",
    "OutcomeUnknown",
    "Reply",
    "ToolCall",
    "call_engine",
    "extension_settings",
    "failed_finally",
    "local_principal",
    "parse_call",
    "read_only",
    "refusal",
    "replayed",
    "run_call",
    "settlement",
]

CALL_METHOD = "tools/call"
#: The SEP-2133 identifier under which servers advertise retrysafe's deduplication.
EXTENSION_ID = "dev.retrysafe/idempotency"
#: The ``_meta`` field of a ``tools/call`` request that carries its key.
META_KEY = "dev.retrysafe/idempotencyKey"
#: The ``tools/call`` param that SEP-3182 (closed, not merged) proposed for the key.
PARAM_KEY = "idempotencyKey"
#: The ``_meta`` field of a replayed result: ``{"replayed": true, ...}``.
REPLAY_META = "dev.retrysafe/idempotency"

# JSON-RPC's standard codes: every MCP client maps them, and ``data.code`` says
# which refusal it is (``idempotency_in_flight``, ...).
INVALID_REQUEST = -32600
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603


class McpError(TypedDict):
    """A JSON-RPC error object (``{"code", "message", "data"}``)."""

    code: int
    message: str
    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A keyed ``tools/call``, ready for the engine.

    ``key`` is the engine's key (``sha256:…`` for a key that is not one);
    ``sent_key`` the key as the client sent it, which refusals echo.
    """

    name: str
    key: str
    scope: str
    fingerprint: str
    request_id: str | None
    sent_key: str

    def of(self, principal: str) -> ToolCall:
        """This call, made by ``principal`` (its scope)."""
        return dataclasses.replace(self, scope=_scope(principal))


def _scope(principal: str) -> str:
    # JSON, so that no choice of principal can run into another scope.
    return canonical_json([principal]).decode()


def _meta_key(params: Mapping[str, Any]) -> Any:
    meta = params.get("_meta")
    return meta.get(META_KEY) if isinstance(meta, Mapping) else None


def _key_of(value: Any, where: str) -> str:
    try:
        return protocol_key(value)
    except InvalidKeyError as exc:
        raise InvalidKeyError(f"{where}: {exc}") from None


def parse_call(
    params: Any,
    *,
    principal: str = "",
    header_keys: Iterable[str] = (),
    key_argument: str | None = None,
    request_id: Any = None,
) -> ToolCall | None:
    """The keyed call in a ``tools/call`` request's ``params``, or None if it has no key.

    ``header_keys`` are the request's ``Idempotency-Key`` header values (HTTP
    only); ``principal`` is the caller, as the door found it (or give it later
    with :meth:`ToolCall.of`). A call without a key is None whatever its shape:
    it is the server's to answer. Raises :class:`InvalidKeyError` for a keyed
    call whose params are not a tool call, a malformed key, or two different
    keys in one request.
    """
    if not isinstance(params, Mapping):
        if not header_keys:
            return None
        raise InvalidKeyError("tools/call needs params with a tool name")
    arguments = params.get("arguments")
    sent: list[tuple[Any, str]] = []
    value = _meta_key(params)
    if value is not None:
        sent.append((value, f"params._meta[{META_KEY!r}]"))
    value = params.get(PARAM_KEY)
    if value is not None:
        sent.append((value, f"params.{PARAM_KEY}"))
    sent.extend((v, "the Idempotency-Key header") for v in header_keys)
    if key_argument is not None and isinstance(arguments, Mapping) and key_argument in arguments:
        sent.append((arguments[key_argument], f"the argument {key_argument!r}"))
        arguments = {k: v for k, v in arguments.items() if k != key_argument}
    if not sent:
        return None
    found = [_key_of(value, where) for value, where in sent]
    if any(k != found[0] for k in found[1:]):
        raise InvalidKeyError("the call carries two different idempotency keys")
    name = params.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidKeyError("tools/call needs params.name, a non-empty string")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        raise InvalidKeyError("tools/call params.arguments must be an object")
    try:
        fp = fingerprint("tools/call", name, dict(arguments))
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidKeyError(f"the call cannot be fingerprinted: {exc}") from None
    rid = None if request_id is None else str(request_id)
    return ToolCall(name, found[0], _scope(principal), fp, rid, str(sent[0][0]))


def read_only(tool: Mapping[str, Any] | None) -> bool:
    """True for a tool (as ``tools/list`` gives it) annotated ``readOnlyHint: true``."""
    if not isinstance(tool, Mapping):
        return False
    annotations = tool.get("annotations")
    return isinstance(annotations, Mapping) and annotations.get("readOnlyHint") is True


def extension_settings(
    ttl: float, *, unrecorded: Iterable[str] = (), key_argument: str | None = None
) -> dict[str, Any]:
    """The settings advertised at ``capabilities.extensions[EXTENSION_ID]``.

    ``unrecordedTools`` names the tools whose keyed calls run without a record
    (opted out): a client must not resend a lost call to them. ``keyArgument``
    is the tool argument that may carry the key, if the server takes one.
    """
    settings: dict[str, Any] = {
        "keyIn": ["_meta", PARAM_KEY, "Idempotency-Key"],
        "metaKey": META_KEY,
        "retentionSeconds": int(ttl),
    }
    if key_argument is not None:
        settings["keyIn"].append("argument")
        settings["keyArgument"] = key_argument
    names = sorted(set(unrecorded))
    if names:
        settings["unrecordedTools"] = names
    return settings


def local_principal() -> str:
    """The principal of a stdio connection's one client: the local user who runs
    the server (or the proxy). Two users sharing one store keep apart."""
    try:
        return f"local user {getpass.getuser()}"
    except Exception:  # no user name (a container without one): the uid
        return f"local user uid {os.getuid()}" if hasattr(os, "getuid") else "local user"


# -- answers ------------------------------------------------------------------------


def _seconds(value: float) -> int:
    return max(1, math.ceil(value))


#: ``data.type`` of the two refusals that SEP-3182 names.
_SEP_TYPES = {
    "idempotency_in_flight": "idempotency_key_in_progress",
    "idempotency_conflict": "idempotency_key_conflict",
}


def refusal(exc: IdempotencyError, key: str | None = None) -> McpError:
    """The JSON-RPC error answering ``exc``, an error of the key, the caller or the
    engine; raises ``exc`` if MCP has no answer for it (a deployment error).

    ``data`` holds ``code`` (retrysafe's machine code), ``retryable`` and, where
    they apply, ``retryAfter`` (seconds), ``originalRequestId`` and
    ``originalFingerprint``; an in-flight call and a conflict also carry
    SEP-3182's ``type`` and ``idempotencyKey`` (``key``, as the client sent it).
    """
    data: dict[str, Any] = {"code": exc.code, "retryable": False}
    sep_type = _SEP_TYPES.get(exc.code)
    if sep_type is not None:
        data["type"] = sep_type
        if key is not None:
            data["idempotencyKey"] = key
    original = getattr(exc, "original_request_id", None)
    if original is not None:
        data["originalRequestId"] = str(original)
    if isinstance(exc, (InProgressError, StoreUnavailableError)):
        data.update(retryable=True, retryAfter=_seconds(exc.retry_after))
    if isinstance(exc, InvalidKeyError):
        return McpError(code=INVALID_PARAMS, message=f"Invalid params: {exc}", data=data)
    if isinstance(exc, (AmbiguousCredentialsError, PrincipalRequiredError)):
        return McpError(code=INVALID_REQUEST, message=str(exc), data=data)
    if isinstance(exc, InProgressError):
        message = "a call with this idempotency key is still running; retry later"
        return McpError(code=INTERNAL_ERROR, message=message, data=data)
    if isinstance(exc, FingerprintMismatchError):
        data["originalFingerprint"] = exc.original_fingerprint
        message = "this idempotency key was already used with another tool call"
        return McpError(code=INVALID_PARAMS, message=message, data=data)
    if isinstance(exc, StoreUnavailableError):
        message = "the idempotency store cannot be reached; retry with the same key"
        return McpError(code=INTERNAL_ERROR, message=message, data=data)
    raise exc


def failed_finally() -> McpError:
    """The answer to a repeat of a call that failed finally and left no answer."""
    message = "an earlier call with this idempotency key failed finally; it is not run again"
    data: dict[str, Any] = {"code": "idempotency_failed", "retryable": False}
    return McpError(code=INTERNAL_ERROR, message=message, data=data)


def replayed(outcome: Outcome | None, request_id: str | None) -> dict[str, Any]:
    """The reply body (``{"result": ...}`` or ``{"error": ...}``) of a stored answer.

    A replayed result carries ``_meta[REPLAY_META] = {"replayed": true,
    "originalRequestId": ...}``.
    """
    stored = outcome.value if outcome is not None else None
    if isinstance(stored, dict) and isinstance(stored.get("result"), dict):
        result = dict(stored["result"])
        meta = result.get("_meta")
        meta = dict(meta) if isinstance(meta, dict) else {}
        marker: dict[str, Any] = {"replayed": True}
        if request_id is not None:
            marker["originalRequestId"] = request_id
        meta[REPLAY_META] = marker
        result["_meta"] = meta
        return {"result": result}
    if isinstance(stored, dict) and isinstance(stored.get("error"), dict):
        return {"error": stored["error"]}
    return {"error": failed_finally()}


def settlement(reply: Any) -> tuple[bool, Outcome | None]:
    """``(succeeded, outcome)`` for a tool call's reply body.

    A result is the answer, a tool error (``isError``) included: the tool ran and
    answered, and SEP-3182 replays errors too. A JSON-RPC error (the handler
    raised) is kept with the failure, replayed only if failures are final;
    anything else fails without an outcome. Raises ``TypeError``/``ValueError``
    for a value that is not JSON.
    """
    if not isinstance(reply, dict):
        return False, None
    result = reply.get("result")
    if isinstance(result, dict) and "error" not in reply:
        return True, Outcome.json({"result": result})
    if isinstance(reply.get("error"), dict):
        return False, Outcome.json({"error": reply["error"]})
    return False, None


# -- the engine of a door -----------------------------------------------------------

#: The engine options of an MCP door (see :class:`retrysafe.mcp.McpIdempotency`).
CallOptions = DoorOptions


def call_engine(store: Any, **options: Unpack[DoorOptions]) -> tuple[Engine, Plan]:
    """The engine of an MCP door over ``store`` and the plan every call derives from
    (``operation`` defaults to ``mcp.tools_call``); see :func:`door_engine`."""
    return door_engine(store, "mcp.tools_call", **options)


#: A JSON-RPC reply body: ``{"result": ...}`` or ``{"error": ...}``.
Reply = dict[str, Any]


class NotAnAnswer(dict[str, Any]):
    """A reply that is not the call's answer (an MRTR ask, the dispatcher's refusal
    before the tool ran): :func:`run_call` passes it on and frees the key
    (retryable, whatever the failure policy), so the next call with it runs."""


class OutcomeUnknown(dict[str, Any]):
    """The reply of a call that may still be running but whose answer will not come
    this way (a Streamable HTTP stream closed before the response): :func:`run_call`
    writes nothing and leaves the claim to run out its lease, so a repeat meanwhile
    is "in flight" rather than a second run."""


def _asks(reply: Reply) -> bool:
    """Whether ``reply`` asks the client for input (MRTR, ``resultType:
    "input_required"``) rather than answering: the leg that brings the input is
    the one whose answer is kept."""
    if isinstance(reply, NotAnAnswer):
        return True
    result = reply.get("result") if isinstance(reply, dict) else None
    return isinstance(result, dict) and result.get("resultType") == "input_required"


async def run_call(
    engine: Engine,
    plan: Plan,
    call: ToolCall,
    call_next: Callable[[], Awaitable[Reply]],
    *,
    final_failures: bool | None = None,
) -> Reply:
    """Run ``call_next`` once for ``call``; answer its repeats from the store.

    ``call_next`` answers the reply body of the real call (``{"result": ...}``
    or ``{"error": ...}``). Returns that body, a replayed one, or a refusal
    (``{"error": ...}``). An exception of ``call_next`` fails the attempt
    (retryable) and propagates; an :class:`OutcomeUnknown` leaves the claim to its
    lease; a :class:`NotAnAnswer` or an MRTR ask is passed on unrecorded.
    """
    entered = False
    try:
        async with Attempt(
            engine, plan.derive(call.key, call.scope, call.fingerprint, call.request_id)
        ) as att:
            entered = True
            if att.replay is not None:
                return replayed(att.replay.outcome, att.replay.record.request_id)
            with renewing(att):
                reply = await call_next()
            if isinstance(reply, OutcomeUnknown):
                att.finished = True  # nothing written: the claim runs out its lease
                return reply
            if _asks(reply):
                await arecord(att, None, failed=True, final=False, answer="a call's non-answer")
                return reply
            try:
                ok, outcome = settlement(reply)
                final = final_failures
            except (TypeError, ValueError):
                ok, outcome, final = False, None, True  # it ran: never again
            await arecord(
                att, outcome, failed=not ok, final=final, answer=f"the answer to {call.name!r}"
            )
            return reply
    except IdempotencyError as exc:
        if entered:
            raise
        METRICS.refused(plan.operation, exc)
        return {"error": refusal(exc, call.sent_key)}
