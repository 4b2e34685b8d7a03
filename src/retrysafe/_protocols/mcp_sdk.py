"""The MCP door on the official ``mcp`` SDK (2.x): a ``ServerMiddleware``.

The middleware runs before the SDK validates a ``tools/call``'s params, so it
reads the raw params (SEP-3182's ``idempotencyKey`` included) and answers a
repeat before any handler runs. It works on the low-level ``Server`` and on
the one an ``MCPServer`` or a FastMCP server serves the wire with. For a keyed
call only, it asks the server whether the tool is read-only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Protocol

from mcp.server import MCPServer
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken, principal_components
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    InputRequiredResult,
)
from pydantic import BaseModel, ValidationError

from retrysafe._model.hashing import canonical_json
from retrysafe._protocols.mcp import (
    CALL_METHOD,
    EXTENSION_ID,
    NotAnAnswer,
    Reply,
    local_principal,
    read_only,
)

__all__ = ["IdempotencyMiddleware"]

log = logging.getLogger("retrysafe.mcp")

#: The dispatcher's own refusals, raised before a tool runs (no handler, the
#: init gate, params that fail validation): never a call's answer.
_NOT_RUN = frozenset({METHOD_NOT_FOUND, INVALID_PARAMS, INVALID_REQUEST})
#: Seconds a low-level server's tool list is trusted for read-only lookups.
LIST_TTL = 5.0
#: The most tool names a listed snapshot keeps.
MAX_LISTED = 10_000


class Door(Protocol):
    """What the middleware needs of :class:`retrysafe.mcp.McpIdempotency`."""

    principal: Any
    skip: frozenset[str]
    read_only: frozenset[str]
    settings: dict[str, Any]

    async def http_principal(self, scope: MutableMapping[str, Any]) -> str | None: ...

    async def handle(
        self,
        params: Any,
        call_next: Callable[[], Awaitable[Reply]],
        *,
        principal: Any,
        header_keys: Any,
        request_id: Any,
        passes: Callable[[str], Awaitable[bool]] | None = None,
    ) -> Reply: ...


def _lowlevel(server: Any) -> Server[Any]:
    """The SDK ``Server`` that serves ``server``'s wire: itself, or the one a
    FastMCP server keeps (FastMCP exposes neither it nor its middleware)."""
    if isinstance(server, Server):
        return server
    inner = getattr(server, "_mcp_server", None)  # FastMCP's
    if isinstance(inner, Server):
        return inner
    if _is_mcpserver(server):
        inner = getattr(server, "_lowlevel_server", None)
        if isinstance(inner, Server):
            return inner
    if _is_mcpserver(server) or type(server).__module__.startswith("fastmcp"):
        raise TypeError(
            f"cannot reach the SDK server inside {type(server).__name__}: the mcp/fastmcp "
            "internals retrysafe uses have moved; check for a newer retrysafe"
        )
    raise TypeError(f"expected an mcp MCPServer, low-level Server or FastMCP, not {server!r}")


def _is_mcpserver(server: Any) -> bool:
    return isinstance(server, MCPServer)


def as_reply(result: HandlerResult) -> Reply:
    """The JSON reply body of a handler's result."""
    if isinstance(result, BaseModel):
        return {"result": result.model_dump(mode="json", by_alias=True, exclude_none=True)}
    return {"result": dict(result) if result is not None else {}}


def answer(reply: Reply) -> HandlerResult:
    """What the middleware returns for ``reply``: its result, or its error raised."""
    error = reply.get("error")
    if isinstance(error, Mapping):
        raise MCPError(
            int(error.get("code", -32603)), str(error.get("message", "")), error.get("data")
        )
    result = reply.get("result")
    return dict(result) if isinstance(result, Mapping) else {}


class IdempotencyMiddleware:
    """A ``ServerMiddleware`` that deduplicates keyed ``tools/call`` requests of
    ``server`` through ``door`` (see :meth:`retrysafe.mcp.McpIdempotency.install`)."""

    def __init__(self, door: Door, server: Any) -> None:
        self.door = door
        self.server = _lowlevel(server)
        self.outer = server
        #: The low-level server's last tool list: read-only per name, and when.
        self._listed: dict[str, bool] = {}
        self._listed_at = -LIST_TTL
        self._lookup_failed = False

    def install(self) -> None:
        """Add this middleware to the server and advertise :data:`EXTENSION_ID`.

        Raises :class:`ValueError` if the server has one already: a second would
        claim each key the first holds, and refuse every keyed call as in flight.
        """
        middleware = self.outer.middleware if _is_mcpserver(self.outer) else self.server.middleware
        if any(isinstance(m, IdempotencyMiddleware) for m in middleware):
            raise ValueError("this server already deduplicates its tool calls")
        middleware.append(self)
        self.server.extensions[EXTENSION_ID] = dict(self.door.settings)

    async def __call__(
        self, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        if ctx.method != CALL_METHOD or ctx.request_id is None:
            return await call_next(ctx)
        params = ctx.params
        name = params.get("name") if isinstance(params, Mapping) else None
        if name in self.door.skip or name in self.door.read_only:
            return await call_next(ctx)
        passed: list[Any] = []  # what goes back as it is: an ask, or a raised refusal

        async def run() -> Reply:
            try:
                result = await call_next(ctx)
            except MCPError as exc:
                if exc.error.code in _NOT_RUN:
                    passed.append(exc)
                    return NotAnAnswer()
                return {"error": exc.error.model_dump(mode="json", exclude_none=True)}
            except ValidationError as exc:  # the params failed the SDK's model
                passed.append(exc)
                return NotAnAnswer()
            except Exception:  # the SDK's own answer to it, kept like any error
                log.exception("retrysafe: the handler of tool %r raised", name)
                return {"error": {"code": INTERNAL_ERROR, "message": "Internal server error"}}
            if _input_required(result):
                passed.append(result)
                return NotAnAnswer()
            return as_reply(result)

        reply = await self.door.handle(
            params,
            run,
            principal=lambda: self.principal_of(ctx),
            header_keys=_header_keys(ctx.request),
            request_id=ctx.request_id,
            passes=lambda tool: self.is_read_only(tool, ctx),
        )
        if isinstance(reply, NotAnAnswer) and passed:
            if isinstance(passed[0], Exception):
                raise passed[0]
            return passed[0]
        return answer(reply)

    async def is_read_only(self, name: str, ctx: ServerRequestContext[Any, Any]) -> bool:
        """True for a tool the server annotates ``readOnlyHint: true`` (asked for keyed
        calls only). A lookup that fails is False: the call is deduplicated."""
        try:
            return await self._read_only(name, ctx)
        except Exception as exc:
            if not self._lookup_failed:
                self._lookup_failed = True
                log.warning(
                    "retrysafe: cannot learn whether tool %r is read-only (%s); "
                    "keyed calls are deduplicated",
                    name,
                    exc,
                )
            return False

    async def _read_only(self, name: str, ctx: ServerRequestContext[Any, Any]) -> bool:
        outer = self.outer
        if outer is not self.server and not _is_mcpserver(outer):  # FastMCP: one tool
            return read_only(_tool_form(await outer.get_tool(name)))
        if outer is not self.server:  # MCPServer: its tools, in process
            return any(
                t.get("name") == name and read_only(t)
                for t in map(_tool_form, await outer.list_tools())
            )
        now = time.monotonic()
        if now - self._listed_at >= LIST_TTL:
            entry = self.server.get_request_handler("tools/list")
            listed = [] if entry is None else getattr(await entry.handler(ctx, None), "tools", [])
            forms = [_tool_form(t) for t in listed[:MAX_LISTED]]
            self._listed = {str(t.get("name")): read_only(t) for t in forms}
            self._listed_at = now
        return self._listed.get(name, False)

    async def principal_of(self, ctx: ServerRequestContext[Any, Any]) -> str | None:
        """The caller, as ``[kind, ...]`` JSON so that no two kinds meet:
        ``principal=``, else the OAuth token's (client_id, issuer, subject), else
        the HTTP request's credentials, else the local user (stdio).

        Raises :class:`~retrysafe.PrincipalRequiredError` for an anonymous HTTP
        caller under ``anonymous="refuse"``; returns None for ``"run"``."""
        if self.door.principal is not None:
            named = self.door.principal(ctx)
            if named is not None and not isinstance(named, str):
                raise TypeError(f"principal= must return a str or None, not {type(named).__name__}")
            if named is not None and named.strip():
                return _kind("principal", named)
        scope = getattr(ctx.request, "scope", None)
        token = None
        if isinstance(scope, Mapping):  # this request's own (FastMCP sets it per request)
            token = getattr(scope.get("user"), "access_token", None)
        if not isinstance(token, AccessToken):
            token = get_access_token()
        if isinstance(token, AccessToken):
            return _kind("oauth", *principal_components(token))
        if isinstance(scope, MutableMapping) and scope.get("type") == "http":
            found = await self.door.http_principal(scope)
            return None if found is None else _kind("http", found)
        return _kind("local", local_principal())


def _kind(kind: str, *parts: Any) -> str:
    return canonical_json([kind, *parts]).decode()


def _input_required(result: HandlerResult) -> bool:
    """True for an MRTR ask (``InputRequiredResult``), in any of its forms."""
    if isinstance(result, InputRequiredResult):
        return True
    kind = result.get("resultType") if isinstance(result, Mapping) else None
    return kind == "input_required" or getattr(result, "result_type", None) == "input_required"


def _tool_form(tool: Any) -> Mapping[str, Any]:
    """The name and annotations of a listed tool (a wire model, a dict, or a
    FastMCP tool), as ``tools/list`` spells them; ``{}`` for None."""
    if tool is None:
        return {}
    if isinstance(tool, Mapping):
        return tool
    annotations = getattr(tool, "annotations", None)
    if isinstance(annotations, BaseModel):
        annotations = annotations.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {"name": getattr(tool, "name", None), "annotations": annotations}


def _header_keys(request: Any) -> list[str]:
    headers = getattr(request, "headers", None)
    if headers is None or not hasattr(headers, "getlist"):
        return []
    return [str(v) for v in headers.getlist("idempotency-key")]
