"""MCP tool calls with an idempotency key, retried safely (the caller's side).

:class:`IdempotentTools` wraps an official ``mcp`` SDK client (``mcp.Client`` or
``mcp.ClientSession``) and gives each side-effecting ``tools/call`` a fresh key in
``params._meta["dev.retrysafe/idempotencyKey"]``. A timeout, a dropped connection
(reconnected through ``connect``), an in-flight answer and an unreachable store
are retried with the same key, after the server's ``data.retryAfter`` or a
jittered backoff (:class:`~retrysafe.client.RetryPolicy`), within the policy's
attempts and total time. A conflict or an invalid key is raised at once as a
retrysafe error whose ``__cause__`` is the server's ``MCPError`` (its ``data``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, Self

import anyio
import anyio.abc

from retrysafe._client.keys import new_key
from retrysafe._client.retry import RetryPolicy, decide
from retrysafe._model.hashing import protocol_key
from retrysafe._protocols.mcp import META_KEY, REPLAY_META, read_only
from retrysafe.errors import (
    AmbiguousCredentialsError,
    FingerprintMismatchError,
    IdempotencyError,
    InProgressError,
    InvalidKeyError,
    MissingExtraError,
    PrincipalRequiredError,
    StoreUnavailableError,
)

try:
    import httpx2
    from mcp.shared.exceptions import MCPError
    from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT, CallToolResult, ListToolsResult
except ImportError as exc:  # pragma: no cover - the mcp extra is missing
    raise MissingExtraError("mcp", "retrysafe.mcp", name=exc.name) from None

__all__ = ["IdempotentTools", "ToolSession", "was_replayed"]

log = logging.getLogger("retrysafe.mcp")

#: ``data.code`` of the answers that are retried with the same key.
_RETRIED_CODES = frozenset({InProgressError.code, StoreUnavailableError.code})
#: JSON-RPC codes the SDK raises for a lost answer: the call may have run.
_LOST_CODES = frozenset({CONNECTION_CLOSED, REQUEST_TIMEOUT})
#: SEP-3182's ``data.type`` of its two refusals, for a server that sends no ``data.code``.
_SEP_3182_TYPES = {
    "idempotency_key_in_progress": InProgressError.code,
    "idempotency_key_conflict": FingerprintMismatchError.code,
}
#: What connecting or sending raises when the server cannot be reached.
_TRANSPORT_ERRORS = (OSError, anyio.BrokenResourceError, httpx2.TransportError)


class ToolSession(Protocol):
    """What :class:`IdempotentTools` needs of a session: ``mcp.Client`` and
    ``mcp.ClientSession`` both have it."""

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        read_timeout_seconds: float | None = None,
        *,
        meta: Any = None,
    ) -> CallToolResult: ...

    async def list_tools(self) -> ListToolsResult: ...


Connect = Callable[[], AbstractAsyncContextManager[Any]]


def was_replayed(result: CallToolResult) -> bool:
    """Whether the server answered ``result`` from its store (``_meta``'s replay marker)."""
    marker = (result.meta or {}).get(REPLAY_META)
    return isinstance(marker, Mapping) and marker.get("replayed") is True


def _data(exc: MCPError) -> Mapping[str, Any]:
    data = exc.data
    return data if isinstance(data, Mapping) else {}


def _code(exc: MCPError) -> object:
    """retrysafe's ``data.code`` of a refusal, or the one SEP-3182's ``data.type`` names."""
    data = _data(exc)
    code, kind = data.get("code"), data.get("type")
    if code is None and isinstance(kind, str):
        return _SEP_3182_TYPES.get(kind)
    return code


def _lost(exc: BaseException) -> bool:
    """A timeout or a dropped connection: the call may or may not have run."""
    if isinstance(exc, BaseExceptionGroup):  # from the SDK's task groups, when connecting
        return all(_lost(e) for e in exc.exceptions)
    if isinstance(exc, MCPError):
        return exc.code in _LOST_CODES and exc.data is None
    return isinstance(exc, _TRANSPORT_ERRORS)


def _retryable(outcome: object) -> bool:
    """Whether a failed attempt may be sent again with the same key."""
    if isinstance(outcome, MCPError) and _code(outcome) in _RETRIED_CODES:
        return True
    return isinstance(outcome, BaseException) and _lost(outcome)


def _asked(exc: BaseException) -> float | None:
    """The server's ``data.retryAfter`` (seconds), if it gave one."""
    value = _data(exc).get("retryAfter") if isinstance(exc, MCPError) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


def _typed(exc: MCPError, key: str) -> IdempotencyError | None:
    """The retrysafe error that an ``MCPError`` refusal stands for, or None."""
    data = _data(exc)
    code = _code(exc)
    original = data.get("originalRequestId")
    original = original if isinstance(original, str) else None
    if code == FingerprintMismatchError.code:
        return FingerprintMismatchError(
            exc.message,
            key=key,
            original_fingerprint=str(data.get("originalFingerprint", "")),
            original_request_id=original,
        )
    retry_after = _asked(exc) or 1.0
    if code == InProgressError.code:
        return InProgressError(
            exc.message, key=key, retry_after=retry_after, original_request_id=original
        )
    if code == StoreUnavailableError.code:
        return StoreUnavailableError(exc.message, retry_after=retry_after)
    kinds: dict[object, type[IdempotencyError]] = {
        InvalidKeyError.code: InvalidKeyError,
        PrincipalRequiredError.code: PrincipalRequiredError,
        AmbiguousCredentialsError.code: AmbiguousCredentialsError,
    }
    kind = kinds.get(code)
    return kind(exc.message) if kind is not None else None


@dataclass(slots=True)
class _Link:
    """One connection: its session, and the event that ends the task holding it."""

    session: Any
    done: anyio.Event


class IdempotentTools:
    """An MCP client's ``call_tool`` that runs each side-effecting tool call once.

    Give it a connected ``session`` (``mcp.Client`` or ``mcp.ClientSession``) or
    ``connect``, a callable returning an async context manager that yields a new
    one (``lambda: Client(url)``); only with ``connect`` is a dropped connection
    reconnected, and then the helper is used as ``async with``. ``retry`` bounds
    the attempts and total seconds (:class:`~retrysafe.client.RetryPolicy`);
    ``timeout`` is each attempt's read timeout; ``read_only`` names tools that get
    no key, besides those that ``list_tools`` shows annotated ``readOnlyHint``
    (listed once, before the first call, unless ``discover=False``);
    ``key_factory`` makes a call's key (a UUID by default).
    """

    def __init__(
        self,
        session: ToolSession | None = None,
        *,
        connect: Connect | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        read_only: Collection[str] = (),
        discover: bool = True,
        key_factory: Callable[[], str] | None = None,
    ) -> None:
        if (session is None) == (connect is None):
            raise TypeError("pass a session or connect=, not both or neither")
        if isinstance(read_only, str):
            raise TypeError("read_only is a collection of tool names, not a str")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, not {timeout!r}")
        self.retry = retry if retry is not None else RetryPolicy()
        self.timeout = timeout
        self.read_only = set(read_only)
        self._discover = discover
        self._key_factory = key_factory or (lambda: new_key(self.retry.key_version))
        self._connect = connect
        self._link = _Link(session, anyio.Event()) if session is not None else None
        self._tasks: anyio.abc.TaskGroup | None = None
        self._lock = anyio.Lock()
        self._stack = contextlib.AsyncExitStack()

    # -- the connection ---------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._connect is not None:
            self._tasks = await self._stack.enter_async_context(anyio.create_task_group())
            self._stack.callback(self._close)
            await self._reconnect(None)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.aclose()

    def _close(self) -> None:
        if self._link is not None and self._connect is not None:
            self._link.done.set()

    @property
    def session(self) -> Any:
        """The session in use (a new one after each reconnection)."""
        if self._link is None:
            raise RuntimeError("IdempotentTools(connect=...) is used inside 'async with'")
        return self._link.session

    async def _hold(self, *, task_status: anyio.abc.TaskStatus[_Link]) -> None:
        """Enter one connection in a task of its own (anyio's scopes are left in
        the task that entered them), and leave it when told to."""
        assert self._connect is not None
        done, started = anyio.Event(), False
        try:
            async with self._connect() as session:
                task_status.started(_Link(session, done))
                started = True
                await done.wait()
        except Exception:
            if not started:
                raise  # to _reconnect's caller: a failed attempt
            # A dropped connection may fail to close: it is gone either way.
            log.debug("retrysafe: closing a dropped MCP connection failed", exc_info=True)

    async def _reconnect(self, failed: _Link | None) -> None:
        """Replace ``failed`` by a new connection (once, whoever asks first)."""
        async with self._lock:
            if self._link is not failed:
                return
            if failed is not None:
                failed.done.set()
            assert self._tasks is not None
            self._link = await self._tasks.start(self._hold)

    # -- tools ----------------------------------------------------------------------

    async def list_tools(self) -> ListToolsResult:
        """The server's tools (the first page); learns which are read-only."""
        result: ListToolsResult = await self.session.list_tools()
        for tool in result.tools:
            if read_only(tool.model_dump(by_alias=True, exclude_none=True)):
                self.read_only.add(tool.name)
        self._discover = False
        return result

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        read_timeout_seconds: float | None = None,
        *,
        meta: Mapping[str, Any] | None = None,
        key: str | None = None,
    ) -> CallToolResult:
        """Call ``name`` with ``arguments``; a side-effecting call runs once.

        ``key`` is the call's idempotency key (the same on every attempt; a new
        one from ``key_factory`` by default). A read-only tool is called once,
        without a key, and not retried. Raises
        :class:`~retrysafe.FingerprintMismatchError` (the key was used with other
        arguments) and :class:`~retrysafe.InvalidKeyError` at once,
        :class:`~retrysafe.InProgressError` or
        :class:`~retrysafe.StoreUnavailableError` when the policy is spent; a
        lost answer still lost then raises the SDK's last error.
        """
        if arguments is not None and not isinstance(arguments, dict):
            raise TypeError(f"arguments must be a dict, not {type(arguments).__name__}")
        if self._discover and name not in self.read_only:
            try:
                await self.list_tools()
            except Exception:  # the call goes on with a key, and is retried if need be
                log.debug(
                    "retrysafe: tools/list failed; %r is called with a key", name, exc_info=True
                )
        timeout = read_timeout_seconds if read_timeout_seconds is not None else self.timeout
        if name in self.read_only:
            if key is not None:
                raise ValueError(f"{name!r} is read-only: it is called without a key")
            return await self._send(name, arguments, timeout, meta)
        key = protocol_key(key) if key is not None else self._key_factory()
        keyed = {**(meta or {}), META_KEY: key}
        started, attempt, dropped = self.retry.clock(), 0, None
        while True:
            attempt += 1
            link = dropped
            try:
                if dropped is not None:
                    await self._reconnect(dropped)
                link = self._current()
                return await self._send(name, arguments, timeout, keyed, link)
            except Exception as exc:
                dropped = await self._settle(exc, key, link, attempt, self.retry.clock() - started)

    def _current(self) -> _Link:
        if self._link is None:
            raise RuntimeError("IdempotentTools(connect=...) is used inside 'async with'")
        return self._link

    async def _send(
        self,
        name: str,
        arguments: dict[str, Any] | None,
        timeout: float | None,
        meta: Mapping[str, Any] | None,
        link: _Link | None = None,
    ) -> CallToolResult:
        session = (link or self._current()).session
        result: CallToolResult = await session.call_tool(
            name, arguments, read_timeout_seconds=timeout, meta=dict(meta) if meta else None
        )
        return result

    async def _settle(
        self, exc: Exception, key: str, link: _Link | None, attempt: int, elapsed: float
    ) -> _Link | None:
        """Wait before the next attempt and answer the link to replace (None: keep
        it), or raise: the typed error of a refusal, else ``exc``."""
        wait = decide(attempt, exc, self.retry, elapsed, retryable=_retryable)
        asked = _asked(exc)
        if wait is not None and asked is not None and self.retry.honour_retry_after:
            wait = min(asked, self.retry.max_time - elapsed)
        dropped = _lost(exc) and not (isinstance(exc, MCPError) and exc.code == REQUEST_TIMEOUT)
        if wait is None or (dropped and self._connect is None):
            typed = _typed(exc, key) if isinstance(exc, MCPError) else None
            if typed is not None:
                raise typed from exc
            raise exc
        log.info("retrysafe: tools/call with key %s: %s; retrying in %.2fs", key, exc, wait)
        await (self.retry.asleep or anyio.sleep)(wait)
        return link if dropped else None
