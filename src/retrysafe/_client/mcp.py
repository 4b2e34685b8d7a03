"""MCP tool calls with an idempotency key, retried safely (the caller's side).

:class:`IdempotentTools` wraps an official ``mcp`` SDK client (``mcp.Client`` or
``mcp.ClientSession``) and gives each side-effecting ``tools/call`` a fresh key in
``params._meta["dev.retrysafe/idempotencyKey"]``. An in-flight answer and an
unreachable store are retried with the same key, after the server's
``data.retryAfter`` or a jittered backoff (:class:`~retrysafe.client.RetryPolicy`),
within the policy's attempts and total time. A lost call (a timeout, a dropped
connection, reconnected through ``connect``) is resent only to a server that
advertises deduplication (``capabilities.extensions["dev.retrysafe/idempotency"]``
or SEP-3182's ``capabilities.tools.idempotency``) and never for a tool it lists in
``unrecordedTools``: elsewhere it may run twice, so the lost error is raised. A
read-only tool's lost call is sent again (without a key). A conflict or an
invalid key is raised at once as a retrysafe error whose ``__cause__`` is the
server's ``MCPError`` (its ``data``).
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
from retrysafe._protocols.mcp import EXTENSION_ID, META_KEY, REPLAY_META, read_only
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
#: The refusals raised as themselves, with no more than their message.
_PLAIN: dict[object, type[IdempotencyError]] = {
    InvalidKeyError.code: InvalidKeyError,
    PrincipalRequiredError.code: PrincipalRequiredError,
    AmbiguousCredentialsError.code: AmbiguousCredentialsError,
}
#: ``data.code`` of every refusal raised typed: never retried whatever ``data.retryable`` says.
_TYPED = frozenset({*_PLAIN, FingerprintMismatchError.code})
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


def _retryable(outcome: object, *, resend: bool) -> bool:
    """Whether a failed attempt may be sent again with the same key: a refusal
    that says nothing ran (in flight, store unavailable) always; a lost call, or
    an error the server marks ``data.retryable``, only if ``resend``."""
    if isinstance(outcome, MCPError):
        code = _code(outcome)
        if code in _RETRIED_CODES:
            return True
        if _lost(outcome):
            return resend
        return resend and code not in _TYPED and _data(outcome).get("retryable") is True
    return resend and isinstance(outcome, BaseException) and _lost(outcome)


def _asked(exc: BaseException) -> float | None:
    """The server's ``data.retryAfter`` (seconds), if it gave one."""
    value = _data(exc).get("retryAfter") if isinstance(exc, MCPError) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


def _capabilities(session: Any) -> Mapping[str, Any]:
    """The server's capabilities as JSON (empty before ``initialize``)."""
    try:
        caps = session.server_capabilities
    except Exception:  # mcp.Client before it is connected
        return {}
    if hasattr(caps, "model_dump"):
        caps = caps.model_dump(by_alias=True, exclude_none=True)
    return caps if isinstance(caps, Mapping) else {}


def advertised(session: Any) -> Mapping[str, Any] | None:
    """The deduplication the server advertises: the settings at
    ``capabilities.extensions[EXTENSION_ID]``, ``{}`` for SEP-3182's
    ``capabilities.tools.idempotency``, or None if it advertises neither."""
    caps = _capabilities(session)
    extensions, tools = caps.get("extensions"), caps.get("tools")
    settings = extensions.get(EXTENSION_ID) if isinstance(extensions, Mapping) else None
    if isinstance(settings, Mapping):
        return settings
    if isinstance(tools, Mapping) and isinstance(tools.get("idempotency"), Mapping):
        return {}
    return None


def _deduplicated(session: Any, name: str) -> bool:
    """Whether the server records ``name``'s keyed calls, so a lost one may be resent."""
    settings = advertised(session)
    if settings is None:
        return False
    unrecorded = settings.get("unrecordedTools")
    return not (isinstance(unrecorded, list) and name in unrecorded)


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
    asked = _asked(exc)
    retry_after = asked if asked is not None else 1.0
    if code == InProgressError.code:
        return InProgressError(
            exc.message, key=key, retry_after=retry_after, original_request_id=original
        )
    if code == StoreUnavailableError.code:
        return StoreUnavailableError(exc.message, retry_after=retry_after)
    kind = _PLAIN.get(code)
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
    ``timeout`` is each attempt's read timeout, and bounds each reconnection and
    the tool listing; ``read_only`` names tools that get no key, besides those
    that ``list_tools`` shows annotated ``readOnlyHint`` (listed once, before the
    first call, unless ``discover=False``); ``key_factory`` makes a call's key (a
    UUID by default). A lost call is resent only to a server that advertises
    deduplication of its tool, unless ``assume_idempotent=True`` (the caller
    knows the server deduplicates, or the tool may run twice).
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
        assume_idempotent: bool = False,
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
        self.assume_idempotent = assume_idempotent
        self._discover = discover
        self._listing = anyio.Lock()
        self._key_factory = key_factory or (lambda: new_key(self.retry.key_version))
        self._connect = connect
        self._link = _Link(session, anyio.Event()) if session is not None else None
        self._tasks: anyio.abc.TaskGroup | None = None
        self._lock = anyio.Lock()
        self._stack = contextlib.AsyncExitStack()

    # -- the connection ---------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._connect is not None:
            try:
                self._tasks = await self._stack.enter_async_context(anyio.create_task_group())
                self._stack.callback(self._close)
                await self._reconnect(None, self._bound(self.retry.max_time))
            except BaseException:
                await self._stack.aclose()  # leave the task group: the helper is unusable
                raise
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
        return self._current().session

    def _bound(self, remaining: float) -> float:
        """Seconds that one exchange (a reconnection, the tool listing) may take."""
        return max(0.0, min(remaining, self.timeout if self.timeout is not None else remaining))

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

    async def _reconnect(self, failed: _Link | None, seconds: float) -> None:
        """Replace ``failed`` by a new connection within ``seconds`` (once, whoever
        asks first); ``TimeoutError`` if it takes longer."""
        async with self._lock:
            if self._link is not failed:
                return
            if failed is not None:
                failed.done.set()
            assert self._tasks is not None
            with anyio.fail_after(seconds):
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

    async def _learn(self, seconds: float) -> None:
        """List the tools once, within ``seconds``, before the first call; a
        failure is not tried again (the calls go on with keys)."""
        async with self._listing:
            if not self._discover:
                return
            self._discover = False
            with anyio.move_on_after(seconds) as scope:
                try:
                    await self.list_tools()
                except Exception:
                    log.debug("retrysafe: tools/list failed; calls carry keys", exc_info=True)
            if scope.cancelled_caught:
                log.debug("retrysafe: tools/list took over %.2fs; calls carry keys", seconds)

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
        one from ``key_factory`` by default), sent as given. A read-only tool is
        called without a key, and sent again after a lost answer. Raises
        :class:`~retrysafe.FingerprintMismatchError` (the key was used with other
        arguments), :class:`~retrysafe.InvalidKeyError` and
        :class:`~retrysafe.PrincipalRequiredError` at once,
        :class:`~retrysafe.InProgressError` or
        :class:`~retrysafe.StoreUnavailableError` when the policy is spent; a
        lost answer raises the SDK's error when the policy is spent, or at once
        if the server does not advertise deduplication of ``name``.
        """
        if arguments is not None and not isinstance(arguments, dict):
            raise TypeError(f"arguments must be a dict, not {type(arguments).__name__}")
        started = self.retry.clock()
        if self._discover and name not in self.read_only:
            await self._learn(self._bound(self.retry.max_time))
        timeout = read_timeout_seconds if read_timeout_seconds is not None else self.timeout
        if name in self.read_only:
            if key is not None:
                raise ValueError(f"{name!r} is read-only: it is called without a key")
            sent = dict(meta) if meta else None
        else:
            key = key if key is not None else self._key_factory()
            protocol_key(key)  # InvalidKeyError before anything is sent; sent as it is
            sent = {**(meta or {}), META_KEY: key}
        attempt, dropped = 0, None
        while True:
            attempt += 1
            link = dropped
            try:
                if dropped is not None:
                    remaining = self.retry.max_time - (self.retry.clock() - started)
                    await self._reconnect(dropped, self._bound(remaining))
                link = self._current()
                result: CallToolResult = await link.session.call_tool(
                    name, arguments, read_timeout_seconds=timeout, meta=sent
                )
                return result
            except Exception as exc:
                elapsed = self.retry.clock() - started
                dropped = await self._settle(exc, name, key, link, attempt, elapsed)

    def _current(self) -> _Link:
        if self._link is None:
            raise RuntimeError("IdempotentTools(connect=...) is used inside 'async with'")
        return self._link

    def _resend(self, name: str, link: _Link | None) -> bool:
        """Whether a lost call to ``name`` may be sent again: read-only, or
        recorded by the server (or so the caller says)."""
        if name in self.read_only or self.assume_idempotent:
            return True
        return link is not None and _deduplicated(link.session, name)

    async def _settle(
        self,
        exc: Exception,
        name: str,
        key: str | None,
        link: _Link | None,
        attempt: int,
        elapsed: float,
    ) -> _Link | None:
        """Wait before the next attempt and answer the link to replace (None: keep
        it), or raise: the typed error of a refusal, else ``exc``."""
        resend = self._resend(name, link)
        wait = decide(
            attempt,
            exc,
            self.retry,
            elapsed,
            retryable=lambda outcome: _retryable(outcome, resend=resend),
            asked=_asked(exc),
        )
        dropped = _lost(exc) and not (isinstance(exc, MCPError) and exc.code == REQUEST_TIMEOUT)
        if wait is None or (dropped and self._connect is None):
            typed = _typed(exc, key or "") if isinstance(exc, MCPError) else None
            if typed is not None:
                raise typed from exc
            raise exc
        log.info("retrysafe: tools/call %s (key %s): %s; retrying in %.2fs", name, key, exc, wait)
        await (self.retry.asleep or anyio.sleep)(wait)
        return link if dropped else None
