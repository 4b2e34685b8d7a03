"""The MCP door on the official ``mcp`` SDK (2.x): a ``ServerMiddleware``.

The middleware runs before the SDK validates a ``tools/call``'s params, so it
reads the raw params (SEP-3182's ``idempotencyKey`` included) and answers a
repeat before any handler runs. It works on the low-level ``Server`` and on
the one an ``MCPServer`` or a FastMCP server serves the wire with; it learns
which tools are read-only from the server's own tool list.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol

from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken, principal_components
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp_types import InputRequiredResult
from pydantic import BaseModel

from retrysafe._model.hashing import canonical_json
from retrysafe._protocols.mcp import CALL_METHOD, EXTENSION_ID, read_only

__all__ = ["STDIO_PRINCIPAL", "IdempotencyMiddleware"]

#: The principal of a stdio server's one local client.
STDIO_PRINCIPAL = "stdio"

Reply = dict[str, Any]


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
        call_next: Any,
        *,
        principal: Any,
        header_keys: Any,
        request_id: Any,
    ) -> Reply: ...


def _lowlevel(server: Any) -> Server[Any]:
    """The SDK ``Server`` that serves ``server``'s wire: itself, or the one an
    ``MCPServer`` or a FastMCP server keeps (neither exposes it, nor an
    extension map once built)."""
    if isinstance(server, Server):
        return server
    for name in ("_lowlevel_server", "_mcp_server"):  # MCPServer's, FastMCP's
        inner = getattr(server, name, None)
        if isinstance(inner, Server):
            return inner
    raise TypeError(f"expected an mcp MCPServer, low-level Server or FastMCP, not {server!r}")


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


class _Asked(Exception):
    """A multi-round-trip ask (``InputRequiredResult``): not the call's answer. It
    fails the attempt (retryable), so the key is free for the leg that carries
    the client's input, whose answer is the one kept."""

    def __init__(self, result: HandlerResult) -> None:
        super().__init__("input required")
        self.result = result


class IdempotencyMiddleware:
    """A ``ServerMiddleware`` that deduplicates keyed ``tools/call`` requests of
    ``server`` through ``door`` (see :meth:`retrysafe.mcp.McpIdempotency.install`)."""

    def __init__(self, door: Door, server: Any) -> None:
        self.door = door
        self.server = _lowlevel(server)
        self._list_tools = (
            getattr(server, "list_tools", None) if server is not self.server else None
        )
        self._read_only: dict[str, bool] = {}

    def install(self) -> None:
        """Add this middleware to the server and advertise :data:`EXTENSION_ID`.

        Raises :class:`ValueError` if the server has one already: a second would
        claim each key the first holds, and refuse every keyed call as in flight.
        """
        if any(isinstance(m, IdempotencyMiddleware) for m in self.server.middleware):
            raise ValueError("this server already deduplicates its tool calls")
        self.server.middleware.append(self)
        self.server.extensions[EXTENSION_ID] = dict(self.door.settings)

    async def __call__(
        self, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        if ctx.method != CALL_METHOD or ctx.request_id is None:
            return await call_next(ctx)
        params = ctx.params
        name = params.get("name") if isinstance(params, Mapping) else None
        if isinstance(name, str) and await self.passes(name, ctx):
            return await call_next(ctx)

        async def run() -> Reply:
            try:
                result = await call_next(ctx)
            except MCPError as exc:
                return {"error": exc.error.model_dump(mode="json", exclude_none=True)}
            if _input_required(result):
                raise _Asked(result)
            return as_reply(result)

        try:
            reply = await self.door.handle(
                params,
                run,
                principal=lambda: self.principal_of(ctx),
                header_keys=_header_keys(ctx.request),
                request_id=ctx.request_id,
            )
        except _Asked as asked:
            return asked.result
        return answer(reply)

    async def passes(self, name: str, ctx: ServerRequestContext[Any, Any]) -> bool:
        """True for a tool never deduplicated: skipped, or read-only."""
        if name in self.door.skip or name in self.door.read_only:
            return True
        if name not in self._read_only:
            for tool in await self._tools(ctx):
                self._read_only[str(tool.get("name"))] = read_only(tool)
            self._read_only.setdefault(name, False)  # not listed: not looked up again
        return self._read_only.get(name, False)

    async def _tools(self, ctx: ServerRequestContext[Any, Any]) -> list[Mapping[str, Any]]:
        if self._list_tools is not None:
            listed: Any = await self._list_tools()
        else:
            entry = self.server.get_request_handler("tools/list")
            if entry is None:
                return []
            listed = getattr(await entry.handler(ctx, None), "tools", [])
        return [_tool_form(t) for t in listed]

    async def principal_of(self, ctx: ServerRequestContext[Any, Any]) -> str | None:
        """The caller: ``principal=``, else the OAuth token's (client_id, issuer,
        subject), else the HTTP request's credentials, else the stdio client."""
        if self.door.principal is not None:
            named = self.door.principal(ctx)
            if named is not None and not isinstance(named, str):
                raise TypeError(f"principal= must return a str or None, not {type(named).__name__}")
            if named is not None and named.strip():
                return named
        scope = getattr(ctx.request, "scope", None)
        token = get_access_token()
        if token is None and isinstance(scope, Mapping):  # FastMCP's, per request
            token = getattr(scope.get("user"), "access_token", None)
        if isinstance(token, AccessToken):
            return canonical_json(list(principal_components(token))).decode()
        if isinstance(scope, MutableMapping) and scope.get("type") == "http":
            return await self.door.http_principal(scope)
        return STDIO_PRINCIPAL


def _input_required(result: HandlerResult) -> bool:
    """True for an MRTR ask (``InputRequiredResult``), in any of its forms."""
    if isinstance(result, InputRequiredResult):
        return True
    kind = result.get("resultType") if isinstance(result, Mapping) else None
    return kind == "input_required" or getattr(result, "result_type", None) == "input_required"


def _tool_form(tool: Any) -> Mapping[str, Any]:
    """The name and annotations of a listed tool (a wire model, a dict, or a
    FastMCP tool), as ``tools/list`` spells them."""
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
