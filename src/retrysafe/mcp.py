"""Exactly-once MCP tool calls: a keyed ``tools/call`` runs its tool once.

::

    from mcp.server import MCPServer
    from retrysafe.mcp import McpIdempotency

    server = MCPServer("shop")
    McpIdempotency("sqlite:///idempotency.db").install(server)

A ``tools/call`` that carries an idempotency key (``params._meta
["dev.retrysafe/idempotencyKey"]``, SEP-3182's ``params.idempotencyKey``, the
``Idempotency-Key`` header over Streamable HTTP, or a tool argument named by
``key_argument``) is deduplicated before its params are validated and before
the tool runs: the first call runs, a retry gets the stored result (marked in
``_meta["dev.retrysafe/idempotency"]``), the same key with other arguments is a
conflict, and a retry while the first still runs is "in flight" with a
``retryAfter`` hint; the refusals are JSON-RPC errors (see docs/mcp.md).
:meth:`McpIdempotency.install` works on the official SDK's ``MCPServer``, its
low-level ``Server`` and a FastMCP server (it needs the ``mcp`` extra) and
advertises the SEP-2133 extension :data:`EXTENSION_ID`.

On the client side, :class:`IdempotentTools` wraps the SDK's client: each
side-effecting call carries a key and is retried with it after a timeout, a
dropped connection or an in-flight answer; a conflict is raised::

    async with IdempotentTools(connect=lambda: Client("http://127.0.0.1:8000/mcp")) as tools:
        result = await tools.call_tool("charge", {"amount": 5})
        was_replayed(result)  # True if the server answered from its store
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Collection, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

from retrysafe._core.engine import Engine
from retrysafe._core.principal import Anonymous, Principals
from retrysafe._core.secret import check_secret
from retrysafe._http.asgi import caller_scope, to_the_end
from retrysafe._protocols.mcp import (
    EXTENSION_ID,
    META_KEY,
    PARAM_KEY,
    REPLAY_META,
    Reply,
    call_engine,
    extension_settings,
    parse_call,
    refusal,
    run_call,
)
from retrysafe._protocols.mcp_asgi import McpProxyMiddleware
from retrysafe.errors import IdempotencyError, MissingExtraError
from retrysafe.stores import Store

if TYPE_CHECKING:
    from retrysafe._client.mcp import IdempotentTools, ToolSession, was_replayed
    from retrysafe._protocols.mcp_sdk import IdempotencyMiddleware

__all__ = [
    "EXTENSION_ID",
    "META_KEY",
    "PARAM_KEY",
    "REPLAY_META",
    "IdempotencyMiddleware",
    "IdempotentTools",
    "McpIdempotency",
    "McpProxyMiddleware",
    "ToolSession",
    "was_replayed",
]


class McpIdempotency:
    """Run each keyed MCP ``tools/call`` once; answer its repeats from the store.

    ``store`` is a :class:`~retrysafe.Store`, a store URL or an
    :class:`~retrysafe.Engine` (default ``$RETRYSAFE_STORE``, else SQLite); URLs
    are shared with ``@idempotent``. ``ttl``, ``lease`` and ``wait`` are the
    seconds a record is kept, a call owns its key, a duplicate waits for the
    call in flight (default 0: an in-flight error at once). ``final_failures``
    makes a call whose handler raised final (its JSON-RPC error is replayed)
    instead of retryable. ``operation`` names the calls in the key hash;
    ``retention`` is the records' class; ``max_body`` the largest result kept.

    - ``key_argument``: a tool argument that may carry the key (left out of the
      fingerprint); read after ``_meta``, ``idempotencyKey`` and the header.
    - ``principal``: a callable over the SDK's request context that names the
      caller (a str; None lets the rules below decide). Otherwise an OAuth
      bearer token's (client_id, issuer, subject); over HTTP without OAuth, the
      request's credentials as on every HTTP door (``principal_headers``);
      over stdio, the local user (:func:`local_principal`). ``anonymous``: a
      keyed HTTP call with no credentials is refused (``"refuse"``, the
      default), scoped with every other such call (``"share"``) or run
      unrecorded (``"run"``: unsafe if the client retries).
    - ``skip``: tool names never deduplicated (an explicit opt-out); tools
      annotated ``readOnlyHint: true`` are never deduplicated either, and
      ``read_only`` names more of them for a server whose tools are not listed.
    """

    def __init__(
        self,
        store: Store[Any] | Engine | str | None = None,
        *,
        final_failures: bool | None = None,
        key_argument: str | None = None,
        principal: Callable[[Any], str | None] | None = None,
        principal_headers: Collection[str] | None = None,
        anonymous: Anonymous = "refuse",
        skip: Iterable[str] = (),
        read_only: Iterable[str] = (),
        **options: Any,
    ) -> None:
        if key_argument is not None and (not isinstance(key_argument, str) or not key_argument):
            raise TypeError("key_argument must be a non-empty str")
        if principal is not None and not callable(principal):
            raise TypeError("principal must be a callable over the request context")
        self.engine, self.plan = call_engine(store, **options)
        self.principals = Principals(principal_headers=principal_headers, anonymous=anonymous)
        check_secret(self.engine.store)
        self.final_failures = final_failures
        self.key_argument = key_argument
        self.principal = principal
        self.skip = frozenset(_names(skip, "skip"))
        self.read_only = frozenset(_names(read_only, "read_only"))
        #: What the server advertises at ``capabilities.extensions[EXTENSION_ID]``.
        self.settings = extension_settings(
            self.plan.ttl, unrecorded=self.skip, key_argument=key_argument
        )

    async def http_principal(self, scope: MutableMapping[str, Any]) -> str | None:
        """The principal of a Streamable HTTP request without OAuth, from its ASGI
        ``scope`` (a keyed hash of its credentials); None: anonymous, run unrecorded
        (``anonymous="run"``)."""
        return await caller_scope(scope, self.principals, self.engine.store, self.plan.operation)

    async def handle(
        self,
        params: Any,
        call_next: Callable[[], Awaitable[Reply]],
        *,
        principal: str | Callable[[], Awaitable[str | None]] | None,
        header_keys: Iterable[str] = (),
        request_id: Any = None,
        passes: Callable[[str], Awaitable[bool]] | None = None,
    ) -> Reply:
        """Answer a ``tools/call``'s reply body (``{"result": ...}`` or ``{"error": ...}``).

        ``call_next`` runs the real call; ``principal`` is the caller, or an async
        callable that finds it; ``passes`` tells a read-only tool by its name.
        Both are called only for a keyed call. A call without a key, to a
        read-only tool, or of an anonymous caller (None) runs unrecorded. A bad
        key, two different credentials or a missing one (``anonymous="refuse"``)
        are refused, and nothing runs or is written.
        """
        try:
            call = parse_call(
                params,
                header_keys=header_keys,
                key_argument=self.key_argument,
                request_id=request_id,
            )
            unrecorded = call is None or (passes is not None and await passes(call.name))
            who = None if unrecorded else await principal() if callable(principal) else principal
        except IdempotencyError as exc:
            return {"error": refusal(exc)}
        if call is None or who is None:
            return await call_next()
        call = call.of(who)  # the scope is the caller's
        # A keyed call that started runs to its end and records its answer even if
        # the client leaves or cancels: its retry gets that answer (in flight
        # meanwhile), never a second run.
        return await to_the_end(
            run_call(self.engine, self.plan, call, call_next, final_failures=self.final_failures)
        )

    def install(self, server: Any) -> IdempotencyMiddleware:
        """Deduplicate ``server``'s tool calls (an ``mcp`` SDK ``MCPServer``, a
        low-level ``Server`` or a FastMCP server) and advertise
        :data:`EXTENSION_ID`; returns the middleware added to the SDK server's
        ``middleware``."""
        middleware: IdempotencyMiddleware = __getattr__("IdempotencyMiddleware")(self, server)
        middleware.install()
        return middleware


def _names(value: Iterable[str], option: str) -> list[str]:
    names = [value] if isinstance(value, str) else list(value)
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{option} must be tool names, not {value!r}")
    return names


#: The names imported on first use, by their module: they need the ``mcp`` extra.
_LAZY = {
    "IdempotencyMiddleware": "retrysafe._protocols.mcp_sdk",
    "IdempotentTools": "retrysafe._client.mcp",
    "ToolSession": "retrysafe._client.mcp",
    "was_replayed": "retrysafe._client.mcp",
}


def __getattr__(name: str) -> Any:
    """The server middleware and the client helper, imported on first use (they
    need the ``mcp`` extra)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        found = importlib.import_module(module)
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith(("mcp", "pydantic", "anyio", "httpx")):
            raise
        raise MissingExtraError("mcp", f"retrysafe.mcp.{name}", name=exc.name) from exc
    return getattr(found, name)
