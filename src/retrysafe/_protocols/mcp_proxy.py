"""``retrysafe mcp-proxy`` over stdio: a relay in front of any MCP server's process.

The proxy spawns the server and relays newline-delimited JSON-RPC between its
own stdin/stdout and the child's (the child's stderr is the proxy's). A
client-to-server ``tools/call`` request that carries a key (see
:func:`retrysafe._protocols.mcp.parse_call`) goes through
:func:`~retrysafe._protocols.mcp.run_call`: the first one is forwarded and its
answer recorded; a replay or a refusal is answered by the proxy and never
reaches the child. Everything else passes through untouched, in order.

:class:`ToolBook` is the message-level logic that the stdio relay and the
Streamable HTTP middleware share: which tools are read-only (learnt from the
``tools/list`` answers that pass through), and the extension added to the
``initialize`` / ``server/discover`` answers (SEP-2133).

Over stdio there is one local client per proxy process: every call has the one
principal the proxy was given (``--principal``; default
:func:`~retrysafe._protocols.mcp.local_principal`).

A keyed call that was forwarded runs to its end: the client's
``notifications/cancelled`` for it is not forwarded, the server's answer is
recorded and dropped (the client ignores a late answer), and the retry gets "in
flight", then the replay. A cancel of any other request passes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, BinaryIO

from retrysafe._core.engine import Engine, Plan
from retrysafe._protocols.mcp import (
    CALL_METHOD,
    EXTENSION_ID,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    REPLAY_META,
    ToolCall,
    extension_settings,
    parse_call,
    read_only,
    refusal,
    run_call,
)
from retrysafe.errors import InvalidKeyError

__all__ = [
    "DEFAULT_MAX_LINE",
    "LISTENED",
    "StdioRelay",
    "ToolBook",
    "answer_line",
    "fit_replay",
    "json_id",
    "protocol_version",
    "request_method",
]

log = logging.getLogger("retrysafe.mcp")

#: The longest client line the relay parses (the HTTP doors' default body limit).
DEFAULT_MAX_LINE = 1 << 20
#: The child's lines are read whole up to this (the server is the one the proxy fronts).
_MAX_CHILD_LINE = 1 << 28
#: The requests whose answers the proxy reads on their way back.
LISTENED = frozenset({"initialize", "server/discover", "tools/list"})
#: The largest integer a JSON number keeps exactly in every language (a double's).
_EXACT = 2**53
#: How long a server has to exit once its input is closed, then once terminated.
_GRACE = 10.0

Reply = dict[str, Any]

#: The per-request ``_meta`` field of a 2026-07-28 request that names its protocol version.
VERSION_META = "io.modelcontextprotocol/protocolVersion"
#: The first protocol version whose results carry ``resultType``.
_RESULT_TYPE_SINCE = "2026-07-28"


def protocol_version(params: Any, header: str | None = None) -> str | None:
    """The protocol version a ``tools/call`` request names (its ``_meta``, else the
    ``MCP-Protocol-Version`` header); None for a request of an older session."""
    meta = params.get("_meta") if isinstance(params, Mapping) else None
    version = meta.get(VERSION_META) if isinstance(meta, Mapping) else None
    return version if isinstance(version, str) else header


def fit_replay(reply: Reply, version: str | None) -> Reply:
    """A replayed ``reply`` as a client of protocol ``version`` validates it: a result
    recorded for an older client gains ``resultType: "complete"`` (2026-07-28
    requires it), one recorded for a newer client loses it. Others are as they are."""
    result = reply.get("result")
    if not isinstance(result, dict):
        return reply
    meta = result.get("_meta")
    marker = meta.get(REPLAY_META) if isinstance(meta, dict) else None
    if not (isinstance(marker, dict) and marker.get("replayed") is True):
        return reply
    if version is not None and version >= _RESULT_TYPE_SINCE:
        if "resultType" not in result:
            return {**reply, "result": {**result, "resultType": "complete"}}
    elif "resultType" in result:
        return {**reply, "result": {k: v for k, v in result.items() if k != "resultType"}}
    return reply


def json_id(value: Any) -> str:
    """A JSON-RPC id as a dict key: ``1`` and ``"1"`` stay apart."""
    return json.dumps(value, sort_keys=True)


def request_method(message: Mapping[str, Any]) -> str | None:
    """The ``method`` of a JSON-RPC message; None for a response or a malformed
    method (not a string), which the proxy passes through for the server to judge."""
    method = message.get("method")
    return method if isinstance(method, str) else None


def _call_id(value: Any) -> str | None:
    """A keyed call's id as a dict key; None for an id an answer may not match: null,
    a bool, a number with a fraction or an exponent (``1.0`` comes back as ``1`` or
    not at all), an integer beyond 2**53 (rounded by a JavaScript server)."""
    if isinstance(value, str):
        return json_id(value)
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > _EXACT:
        return None
    return json_id(value)


def answer_line(request_id: Any, reply: Reply) -> bytes:
    """The JSON-RPC response (one line, with its newline) carrying ``reply``."""
    doc = {"jsonrpc": "2.0", "id": request_id, **reply}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


class ToolBook:
    """What a proxy learns from the answers that pass through it.

    ``tools`` maps a tool's name to whether it is read-only (``readOnlyHint``);
    a tool not yet listed is side-effecting.
    """

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.tools: dict[str, bool] = {}

    def read_only(self, name: str) -> bool:
        """Whether ``name`` was listed read-only: its calls pass through unrecorded."""
        return self.tools.get(name, False)

    def answered(self, method: str, message: dict[str, Any]) -> bool:
        """Read the answer to a ``method`` request (one of :data:`LISTENED`); True if
        ``message`` was changed (the extension added to the capabilities)."""
        result = message.get("result")
        if not isinstance(result, dict):
            return False
        if method == "tools/list":
            for tool in result.get("tools") or ():
                if isinstance(tool, Mapping) and isinstance(tool.get("name"), str):
                    self.tools[tool["name"]] = read_only(tool)
            return False
        capabilities = result.get("capabilities")
        if not isinstance(capabilities, dict):
            return False
        extensions = capabilities.setdefault("extensions", {})
        if not isinstance(extensions, dict):
            return False
        extensions[EXTENSION_ID] = extension_settings(self.ttl)
        return True


#: The notification by which a client cancels one of its requests.
CANCELLED = "notifications/cancelled"


#: The refusal of a request whose id is that of a request still unanswered.
_IN_USE = "the id of a request still unanswered cannot be reused"
#: What a write to the server raises once its input is closed (its status says why).
_SERVER_INPUT_CLOSED = (BrokenPipeError, ConnectionResetError)


def _error(code: int, message: str) -> Reply:
    return {"error": {"code": code, "message": message}}


class StdioRelay:
    """The relay between a client (``stdin``/``stdout``) and a spawned server.

    ``command`` is the server's command line; ``principal`` the one caller's
    name; ``max_line`` the longest client line parsed (a longer one is answered
    with an invalid-request error and dropped).
    """

    def __init__(
        self,
        engine: Engine,
        plan: Plan,
        command: list[str],
        *,
        principal: str,
        max_line: int = DEFAULT_MAX_LINE,
        final_failures: bool | None = None,
    ) -> None:
        if not command:
            raise ValueError("mcp-proxy needs the server's command after --")
        self.engine, self.plan, self.command = engine, plan, command
        self.principal = principal
        self.max_line = max_line
        self.final_failures = final_failures
        self.book = ToolBook(engine.ttl)
        self._pending: dict[str, asyncio.Future[Reply]] = {}
        self._listened: dict[str, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: dict[str, asyncio.Task[None]] = {}
        self._dropped: set[str] = set()
        self._out_lock = asyncio.Lock()
        self._out: BinaryIO = sys.stdout.buffer
        self._writer: asyncio.StreamWriter | None = None
        self._client_gone = asyncio.Event()
        self._child: asyncio.subprocess.Process | None = None

    async def _open_out(self) -> None:
        """Write to stdout through the loop: a non-blocking stdout (one file shared
        with stdin, a tty, a socket) gets back-pressure, never a cut line. A regular
        file (never full) is written directly."""
        loop = asyncio.get_running_loop()
        pipe = open(os.dup(self._out.fileno()), "wb", buffering=0)  # noqa: SIM115 (the writer closes it)
        try:
            transport, protocol = await loop.connect_write_pipe(
                lambda: asyncio.streams.FlowControlMixin(loop=loop), pipe
            )
        except ValueError:
            pipe.close()
            return  # not a pipe, socket or character device
        transport.set_write_buffer_limits(high=0)  # drain() waits until all is written
        self._writer = asyncio.StreamWriter(transport, protocol, None, loop)

    async def _write_out(self, data: bytes) -> None:
        """Write to the client; once it stopped reading, drop the output (the answers
        are still recorded) and let :meth:`run` wind down."""
        async with self._out_lock:
            if self._client_gone.is_set():
                return
            try:
                if self._writer is None:
                    self._out.write(data)
                    self._out.flush()
                else:
                    self._writer.write(data)
                    await self._writer.drain()
            except (BrokenPipeError, ConnectionResetError):
                self._client_gone.set()

    async def _write_child(self, data: bytes) -> None:
        child = self._child
        assert child is not None and child.stdin is not None
        child.stdin.write(data)
        await child.stdin.drain()

    async def run(self) -> int:
        """Relay until the client or the server closes; the server's exit status."""
        self._child = child = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=_MAX_CHILD_LINE,
        )
        try:
            return await self._relay(child)
        finally:
            if self._writer is not None:
                self._writer.close()

    async def _relay(self, child: asyncio.subprocess.Process) -> int:
        """Relay both ways; once either side is gone, wind down: the server's status."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=self.max_line, loop=loop)
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=loop), sys.stdin
        )
        await self._open_out()
        from_child = asyncio.create_task(self._from_child())
        from_client = asyncio.create_task(self._from_client(reader))
        gone = asyncio.create_task(self._client_gone.wait())
        await asyncio.wait({from_child, from_client, gone}, return_when=asyncio.FIRST_COMPLETED)
        from_client.cancel()
        gone.cancel()
        if not from_child.done() and self._tasks:
            # The client is gone (its input closed, or it stopped reading). The calls it
            # sent are answered and recorded first (a server may stop at EOF without
            # answering: its side effect would then run again on the retry), for a
            # lease at most; then the server gets EOF.
            await asyncio.wait(set(self._tasks), timeout=self.engine.lease)
        status = await self._stop(child)
        # The server's last lines are relayed; each keyed call has its answer, or its
        # failure (the server closed): recorded and written before the proxy exits.
        await asyncio.wait({from_child}, timeout=_GRACE)
        from_child.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for task in (from_client, from_child):
            failed = None if task.cancelled() else task.exception()
            if failed is not None and not isinstance(failed, _SERVER_INPUT_CLOSED):
                raise failed  # (the server's input closed: its status says why)
        return status

    async def _stop(self, child: asyncio.subprocess.Process) -> int:
        """Close the server's input; terminate it if it does not exit within a grace
        period, kill it if it still does not. Its exit status."""
        assert child.stdin is not None
        child.stdin.close()
        for end in (child.terminate, child.kill):
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(child.wait(), _GRACE)
            with contextlib.suppress(ProcessLookupError):
                end()
        return await child.wait()

    # -- client to server ------------------------------------------------------------

    async def _from_client(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial:  # the last line, ended as the server expects
                    await self._from_client_line(exc.partial + b"\n")
                return
            except asyncio.LimitOverrunError as exc:
                await self._long_line(reader, await reader.readexactly(exc.consumed))
                continue
            await self._from_client_line(line)

    async def _long_line(self, reader: asyncio.StreamReader, head: bytes) -> None:
        """A line over ``max_line`` (``head`` its first bytes) is never parsed. If it
        may be a ``tools/call`` it is dropped and refused; anything else (the client's
        answer to a server's sampling or elicitation request) is relayed as it comes."""
        relay = b"tools/call" not in head and b"tools\\/call" not in head
        while True:
            if relay:
                await self._write_child(head)
            try:
                head = await reader.readuntil(b"\n")
                break
            except asyncio.LimitOverrunError as exc:
                head = await reader.readexactly(exc.consumed)
            except asyncio.IncompleteReadError as exc:
                head = exc.partial + b"\n"
                break
        if relay:
            await self._write_child(head)
            return
        message = f"a tools/call over {self.max_line} bytes is not relayed"
        await self._write_out(answer_line(None, _error(INVALID_REQUEST, message)))

    async def _from_client_line(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            message = None  # not JSON: the server answers it as it would
        if not isinstance(message, dict) or "id" not in message:
            cancel = isinstance(message, dict) and message.get("method") == CANCELLED
            if not (cancel and self._cancelled(message.get("params"))):
                await self._write_child(line)
            return
        request_id = message["id"]
        method = request_method(message)
        if method is not None and (_call_id(request_id) or "") in self._running:
            # Its answer would be taken for the keyed call's, or the other way round.
            await self._write_out(answer_line(request_id, _error(INVALID_REQUEST, _IN_USE)))
            return
        if method in LISTENED:
            self._listened[json_id(request_id)] = method
        if method != CALL_METHOD:
            await self._write_child(line)
            return
        try:
            call = parse_call(
                message.get("params"), principal=self.principal, request_id=request_id
            )
        except InvalidKeyError as exc:
            await self._write_out(answer_line(request_id, {"error": refusal(exc)}))
            return
        if call is None or self.book.read_only(call.name):
            await self._write_child(line)
            return
        if _call_id(request_id) is None:
            odd = "a keyed call's id must be a string or an integer within ±2**53"
            await self._write_out(answer_line(request_id, _error(INVALID_REQUEST, odd)))
            return
        if json_id(request_id) in self._listened:
            await self._write_out(answer_line(request_id, _error(INVALID_REQUEST, _IN_USE)))
            return
        version = protocol_version(message.get("params"))
        await self._keyed(call, request_id, line, version)

    async def _keyed(
        self, call: ToolCall, request_id: Any, line: bytes, version: str | None
    ) -> None:
        """Run a keyed call; return once it is forwarded or answered, so that the
        messages after it reach the server after it."""
        forwarded = asyncio.Event()
        rid = _call_id(request_id)
        assert rid is not None and rid not in self._running

        async def call_next() -> Reply:
            future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
            self._pending[rid] = future
            try:
                await self._write_child(line)
            finally:
                forwarded.set()
            try:
                return await future
            finally:
                self._pending.pop(rid, None)

        task = asyncio.create_task(self._answer(call, request_id, call_next, version))
        self._tasks.add(task)
        self._running[rid] = task

        def forget(done: asyncio.Task[None]) -> None:
            self._tasks.discard(done)
            if self._running.get(rid) is done:
                del self._running[rid]
                self._dropped.discard(rid)

        task.add_done_callback(forget)
        done = asyncio.create_task(forwarded.wait())
        await asyncio.wait({task, done}, return_when=asyncio.FIRST_COMPLETED)
        done.cancel()

    async def _answer(
        self,
        call: ToolCall,
        request_id: Any,
        call_next: Callable[[], Awaitable[Reply]],
        version: str | None,
    ) -> None:
        try:
            reply = await run_call(
                self.engine, self.plan, call, call_next, final_failures=self.final_failures
            )
        except (ConnectionError, EOFError) as exc:
            reply = _error(INTERNAL_ERROR, f"the server did not answer: {exc}")
            reply["error"]["data"] = {"code": "server_unavailable", "retryable": True}
        except Exception as exc:  # never lost in a task nobody awaits
            log.error("mcp-proxy: the keyed call %r failed: %r", call.name, exc)
            reply = _error(INTERNAL_ERROR, "the proxy failed to run the call")
        if json_id(request_id) not in self._dropped:
            await self._write_out(answer_line(request_id, fit_replay(reply, version)))

    def _cancelled(self, params: Any) -> bool:
        """The client cancelled a request; True if it is a keyed call of the proxy's.

        That call runs to its end and is recorded (a cancel that failed it would
        let the retry run a side effect that may have happened); the server is not
        told, and the answer is dropped: the client ignores a late one.
        """
        if not isinstance(params, Mapping) or "requestId" not in params:
            return False
        rid = json_id(params["requestId"])
        if rid not in self._running:
            return False
        self._dropped.add(rid)
        return True

    # -- server to client ------------------------------------------------------------

    async def _from_child(self) -> None:
        child = self._child
        assert child is not None and child.stdout is not None
        try:
            while line := await child.stdout.readline():
                await self._from_child_line(line)
        finally:
            gone = EOFError("the server closed its output")
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(gone)

    async def _from_child_line(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            message = None
        if not isinstance(message, dict) or "method" in message or "id" not in message:
            await self._write_out(line)  # a request or notification of the server's
            return
        future = self._pending.get(_call_id(message["id"]) or "")
        if future is not None and not future.done():
            reply = {k: v for k, v in message.items() if k in ("result", "error")}
            future.set_result(reply)
            return
        method = self._listened.pop(json_id(message["id"]), None)
        if method is not None and self.book.answered(method, message):
            line = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()
            line += b"\n"
        await self._write_out(line)
