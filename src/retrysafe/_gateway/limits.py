"""What one client may hold of the gateway's server: its request head's size and
time, an idle body's time, and connections.

:class:`ServerLimits` names the bounds; the protocol classes (thin subclasses of
uvicorn's httptools and h11 ones) enforce the head and connection bounds, and
:class:`BodyTimeout` the idle-body one. The answers each bound gives:
docs/gateway.md, "Limits on clients".
"""

from __future__ import annotations

import asyncio
import http
import math
from collections.abc import Awaitable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from retrysafe._http.problems import Response, problem

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed (the "speed" extra)
    HttpToolsProtocol = None  # type: ignore[assignment,misc]  # optional class: None

__all__ = [
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_HEAD_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_HEAD_SIZE",
    "PROTOCOLS",
    "BodyTimeout",
    "LimitedH11Protocol",
    "LimitedHttpToolsProtocol",
    "ServerLimits",
    "limits_of",
    "protocol_class",
]

#: Bytes of request line and headers together (nginx reads up to 4 x 8 KiB
#: header lines, Node 16 KiB, Go 1 MiB): room for large cookies and tokens.
DEFAULT_MAX_HEAD_SIZE = 64 << 10
#: Seconds for a whole request head to arrive (nginx and Node: 60).
DEFAULT_HEAD_TIMEOUT = 30.0
#: Seconds without a byte of a request body being awaited (nginx: 60).
DEFAULT_BODY_TIMEOUT = 60.0
#: Open client connections per worker process (nginx's worker_connections: 512).
DEFAULT_MAX_CONNECTIONS = 512
#: The protocol names :func:`protocol_class` knows.
PROTOCOLS = ("auto", "httptools", "h11")

# How long a refused connection's further bytes are read and dropped before it
# is closed (a client that reads the answer closes it sooner).
_LINGER = 2.0


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive whole number, not {value!r}")
    return value


def _positive_seconds(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (value > 0 and math.isfinite(value))
    ):
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """The bounds on one client: head size and time, idle-body time, connections.

    ValueError (naming the option) if one is not a positive number.
    """

    max_head_size: int = DEFAULT_MAX_HEAD_SIZE
    head_timeout: float = DEFAULT_HEAD_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        _positive_int("max_head_size", self.max_head_size)
        _positive_int("max_connections", self.max_connections)
        object.__setattr__(
            self, "head_timeout", _positive_seconds("head_timeout", self.head_timeout)
        )
        object.__setattr__(
            self, "body_timeout", _positive_seconds("body_timeout", self.body_timeout)
        )


def limits_of(app: Any) -> ServerLimits:
    """The ``server_limits`` of ``app`` or of an app it wraps (uvicorn's own
    middlewares keep the app as ``.app``), else the defaults."""
    for _ in range(8):
        limits = getattr(app, "server_limits", None)
        if isinstance(limits, ServerLimits):
            return limits
        app = getattr(app, "app", None)
        if app is None:
            break
    return ServerLimits()


def _raw(response: Response) -> bytes:
    """``response`` as HTTP/1.1 bytes that end the connection."""
    phrase = http.HTTPStatus(response.status).phrase
    lines = [f"HTTP/1.1 {response.status} {phrase}"]
    lines += [f"{name}: {value}" for name, value in response.headers]
    lines += ["connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + response.body


if TYPE_CHECKING:
    # What the mixin's super() calls reach: uvicorn's protocol (asyncio.Protocol's API).
    _Protocol = asyncio.Protocol
else:
    _Protocol = object


class _Limited(_Protocol):
    """The head and connection bounds, over a uvicorn HTTP/1.1 protocol.

    Bytes are handed to the parser in pieces no longer than the room the head
    has left, so a head is never parsed or buffered past ``max_head_size``.
    """

    #: The protocol's own data_received, called without a super() per call.
    _feed: Any
    # Set by uvicorn's __init__, which runs first.
    app: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    connections: set[Any]
    cycle: Any

    def _setup_limits(self) -> None:
        self.limits = limits_of(self.app)
        self._head_used = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._refused = False
        self._heads = 0  # heads completed, where the parser says so (httptools)

    def _reading_head(self) -> bool:
        """True while a request head is awaited or partly received."""
        raise NotImplementedError

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        limit = self.limits.max_connections
        if len(self.connections) > limit:
            self._refuse(
                problem(
                    503,
                    "too_many_connections",
                    f"this server holds {limit} connections, its limit; retry shortly",
                    headers=[("retry-after", "1")],
                )
            )
        else:
            self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering: read and dropped
        feed = self._feed
        limit = self.limits.max_head_size
        while data:
            if not self._reading_head():
                feed(data)
                break
            room = limit - self._head_used
            piece, data = (data, b"") if len(data) <= room else (data[:room], data[room:])
            self._head_used += len(piece)
            heads = self._heads
            feed(piece)
            if self.transport.is_closing():
                return
            if heads != self._heads or not self._reading_head():
                # The head ended in this piece; a pipelined one begun after it in
                # the same piece is counted from the next piece on.
                self._head_used = 0
                if self._head_timer is not None:
                    self._cancel_head_timer()
            elif self._head_used >= limit:
                self._refuse(
                    problem(
                        431,
                        "request_header_too_large",
                        f"the request line and headers are over {limit} bytes, "
                        "the most this server reads",
                    )
                )
                return
        # A head partly here: its time runs (until then, uvicorn's keep-alive one does).
        if self._head_used and not self.transport.is_closing() and self._reading_head():
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_late)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._reading_head():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a pipelined head waits for the answer before it
            return
        seconds = f"{self.limits.head_timeout:g}"
        self._refuse(
            problem(
                408,
                "request_header_timeout",
                f"the request line and headers did not arrive within {seconds} s",
            )
        )

    def _refuse(self, response: Response) -> None:
        """Answer ``response`` and close (only close while an earlier answer is under way)."""
        self._refused = True
        self._cancel_head_timer()
        self.connections.discard(self)  # a refused connection takes no one's place
        transport = self.transport
        if self.cycle is not None and not self.cycle.response_complete:
            transport.close()  # a pipelined head: the answer under way cannot be interrupted
            return
        transport.write(_raw(response))
        if transport.can_write_eof():
            transport.write_eof()
            self._linger = self.loop.call_later(_LINGER, transport.close)
        else:
            transport.close()


class LimitedH11Protocol(_Limited, H11Protocol):
    """uvicorn's h11 protocol with :class:`ServerLimits` enforced."""

    _feed = H11Protocol.data_received

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._setup_limits()
        # h11 refuses (as a 400) what is still buffered unparsed past this size.
        self.conn = h11.Connection(h11.SERVER, self.limits.max_head_size)

    def _reading_head(self) -> bool:
        return self.conn.their_state is h11.IDLE


if HttpToolsProtocol is not None:

    class LimitedHttpToolsProtocol(_Limited, HttpToolsProtocol):
        """uvicorn's httptools protocol with :class:`ServerLimits` enforced."""

        _feed = HttpToolsProtocol.data_received

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._setup_limits()
            self._in_head = True

        def _reading_head(self) -> bool:
            return self._in_head

        # The parser's callbacks, once per request each: the base class's called
        # directly (its own, there is no other in between), without a super() object.
        def on_message_begin(self) -> None:
            self._in_head = True
            HttpToolsProtocol.on_message_begin(self)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._heads += 1
            HttpToolsProtocol.on_headers_complete(self)

        def on_message_complete(self) -> None:
            # The next head is awaited: a kept-alive connection's bytes are bounded
            # from their first one, as a new connection's are.
            self._in_head = True
            HttpToolsProtocol.on_message_complete(self)

else:  # pragma: no cover - without httptools
    LimitedHttpToolsProtocol = None  # type: ignore[assignment,misc]  # optional class: None


def protocol_class(name: str = "auto") -> type[asyncio.Protocol]:
    """The limited protocol called ``name``: ``httptools``, ``h11``, or ``auto``
    (httptools when installed, else h11). ValueError for another name or a
    missing httptools."""
    if name not in PROTOCOLS:
        raise ValueError(f"the HTTP protocol must be one of {', '.join(PROTOCOLS)}, not {name!r}")
    if name == "h11" or (name == "auto" and LimitedHttpToolsProtocol is None):
        return LimitedH11Protocol
    if LimitedHttpToolsProtocol is None:
        raise ValueError("httptools is not installed: pip install 'retrysafe[speed]'")
    return LimitedHttpToolsProtocol


class _Waits:
    """One event loop's requests waiting for body bytes, swept every ``tick`` seconds.

    A wait costs a dictionary entry, not a timer: one timer per tick serves them all.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        self.loop = loop
        self.seconds = seconds
        self.tick = min(1.0, seconds / 4)
        self.deadlines: dict[asyncio.Task[Any], float] = {}
        self.expired: set[asyncio.Task[Any]] = set()
        self.sweeping: asyncio.TimerHandle | None = None

    def start(self, task: asyncio.Task[Any]) -> None:
        self.deadlines[task] = self.loop.time() + self.seconds
        if self.sweeping is None:
            self.sweeping = self.loop.call_later(self.tick, self.sweep)

    def sweep(self) -> None:
        now = self.loop.time()
        late = [task for task, deadline in self.deadlines.items() if deadline <= now]
        for task in late:
            del self.deadlines[task]
            self.expired.add(task)
            task.cancel()
        self.sweeping = self.loop.call_later(self.tick, self.sweep) if self.deadlines else None


class BodyTimeout:
    """Runs an ASGI app with each wait for a request body message bounded by ``seconds``.

    When a wait runs out the app gets ``http.disconnect`` (a keyed request then
    claims nothing: its body is read before its claim) and, if it had not
    started an answer, the client gets 408 ``request_body_timeout`` and the
    connection is closed. Waits are checked a few times per ``seconds`` (at
    least once a second), so one may run up to a quarter longer.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = _positive_seconds("body_timeout", seconds)
        self._waits: dict[asyncio.AbstractEventLoop, _Waits] = {}
        self._last: _Waits | None = None  # the last loop's: most often the only one

    def _of(self, loop: asyncio.AbstractEventLoop) -> _Waits:
        waits = self._waits.get(loop)
        if waits is None:
            for old in [lp for lp in self._waits if lp.is_closed()]:
                del self._waits[old]
            waits = self._waits[loop] = _Waits(loop, self.seconds)
        self._last = waits
        return waits

    async def __call__(
        self, app: Any, scope: MutableMapping[str, Any], receive: Any, send: Any
    ) -> None:
        loop = asyncio.get_running_loop()
        waits = self._last
        if waits is None or waits.loop is not loop:
            waits = self._of(loop)
        body_open = True
        late = False
        started = False

        async def timed_receive() -> dict[str, Any]:
            nonlocal body_open, late
            if not body_open:
                return await receive()
            task = asyncio.current_task()
            assert task is not None
            waits.start(task)
            try:
                message = await receive()
            except asyncio.CancelledError:
                if task not in waits.expired:
                    raise
                waits.expired.discard(task)
                task.uncancel()
                body_open, late = False, True
                return {"type": "http.disconnect"}
            finally:
                waits.deadlines.pop(task, None)
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_open = False
            return message

        def watched_send(message: dict[str, Any]) -> Awaitable[None]:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            return send(message)  # awaited by the app: no frame of its own

        await app(scope, timed_receive, watched_send)
        if late and not started:
            answer = problem(
                408,
                "request_body_timeout",
                f"no byte of the request body came for {self.seconds:g} s",
                headers=[("connection", "close")],
            )
            headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers]
            await send({"type": "http.response.start", "status": 408, "headers": headers})
            await send({"type": "http.response.body", "body": answer.body})
