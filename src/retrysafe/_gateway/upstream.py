"""A small asyncio HTTP/1.1 client with a keep-alive pool, for the gateway's upstream.

:class:`Pool` holds one event loop's connections to one upstream address and
sends a request on one of them: the request head is framed for its body (bytes,
or a stream sent with its Content-Length or chunked), the answer comes back once
its head is in (interim 1xx answers skipped), and its body is read as it arrives
(Content-Length, chunked or up to the close), with reading paused while too many
bytes wait. A connection goes back to the pool when its answer is read whole,
and an idempotent request is sent once more if a kept-alive connection turns out
closed. A failure to talk to the upstream raises :class:`UpstreamError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import select
import socket
import ssl
from collections import deque
from collections.abc import AsyncGenerator
from typing import cast

from retrysafe.errors import UpstreamError

__all__ = ["HOP_BY_HOP", "Pool", "connection_tokens", "end_to_end"]

log = logging.getLogger("retrysafe.gateway")

# The pool of one event loop: connections open at once, kept idle, and for how long
# (less than the 5 s that uvicorn, Node and Apache keep one, so that they seldom
# close a connection just as a request goes out on it).
_MAX_CONNECTIONS = 1000
_MAX_IDLE = 100
_KEEP_ALIVE = 4.0
# An answer's head (status line and headers), and a chunk-size or trailer line, at most.
_MAX_HEAD = 64 << 10
_MAX_LINE = 8 << 10
# Bytes read from the upstream and not yet sent on: reading pauses above, resumes below.
_HIGH_WATER = 256 << 10
_LOW_WATER = 64 << 10
# Requests sent again, once, when a kept-alive connection turns out closed (RFC 9112 9.3.1).
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
# Requests that carry a body: an empty one is sent with Content-Length: 0 (RFC 9110 8.6).
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
#: RFC 9110 7.6.1: headers of one connection, never forwarded (names listed in
#: Connection too). Expect is answered by the gateway's own server.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"expect",
    }
)
_HOP_OR_EMPTY = HOP_BY_HOP | {b""}  # Connection tokens that name no other header
_NO_BODY = frozenset({b"content-length"})
# Interim (1xx) answers skipped before the answer, at most.
_MAX_INTERIM = 16
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [\t\x20-\x7e\x80-\xff]*)?\Z")
_FIELD = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*([\t\x20-\x7e\x80-\xff]*?)[ \t]*\Z")
_FOLDED = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\Z")
# A whole answer head of the common form (final status, CRLF line ends, no folded
# line), for the fast path. Possessive: matched in one walk, never backtracking.
_PLAIN_HEAD = re.compile(
    rb"HTTP/1\.([01]) ([0-9]{3})(?: [\t\x20-\x7e\x80-\xff]*+)?\r\n"
    rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]++:[\t\x20-\x7e\x80-\xff]*+\r\n)*+\r\n"
)
# How the fast path treats an answer's header: passed on, dropped (hop-by-hop), or
# read for the framing; with the names seen (as sent, lower-cased), a bounded few.
_PASS, _DROP, _CONTENT_LENGTH, _CONNECTION, _CODING = range(5)
_ANSWER_FIELDS = dict.fromkeys(HOP_BY_HOP, _DROP) | {
    b"content-length": _CONTENT_LENGTH,
    b"connection": _CONNECTION,
    b"transfer-encoding": _CODING,
}
_ANSWER_NAMES: dict[bytes, tuple[bytes, int]] = {}
_MAX_NAMES, _MAX_NAME = 1024, 64
_CHUNK_SIZE = re.compile(rb"[ \t]*([0-9A-Fa-f]{1,15})[ \t]*(?:;.*)?\Z", re.DOTALL)
# poll() where there is one: select() takes no descriptor over FD_SETSIZE (1024).
_POLL = getattr(select, "poll", None)
# How an answer's body is framed (RFC 9112 6.3).
_NONE, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(4)


class _NoAnswer(UpstreamError):
    """The connection closed before a byte of the answer came (a kept-alive one may be stale)."""


def connection_tokens(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The header names a ``Connection`` header lists (hop-by-hop as well)."""
    values = [v for k, v in headers if k.lower() == b"connection"]
    return frozenset(t.strip().lower() for v in values for t in v.split(b",") if t.strip())


def end_to_end(
    headers: list[tuple[bytes, bytes]], skip: frozenset[bytes] = frozenset()
) -> list[tuple[bytes, bytes]]:
    """``headers`` (names lower-cased, repeats kept) without hop-by-hop ones and ``skip``."""
    drop = HOP_BY_HOP | connection_tokens(headers) | skip
    out = []
    for name, value in headers:
        name = name.lower()
        if name not in drop and not name.startswith(b"proxy-"):
            out.append((name, value))
    return out


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to the upstream: its bytes wait here until read.

    Reading pauses while more than ``_HIGH_WATER`` bytes wait, so an answer
    streams through in constant memory. Each wait for the upstream (bytes to
    read, room to write) lasts the pool's timeout at most.
    """

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False  # the upstream closed its side (or the connection is gone)
        self.error: Exception | None = None
        self.busy = True  # a request is using it (False while idle in the pool)
        self.reusable = True  # False once a request on it was cut short
        self.discarded = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[bool] | None = None
        self._deadline = 0.0  # of the wait under way
        self._timer: asyncio.TimerHandle | None = None
        self._reading_paused = False
        self._writing_paused = False
        self._poll: select.poll | None = None  # the socket, registered once
        self._fd: int | None = None  # None: no socket to poll (-1: its descriptor is gone)

    # -- the event loop's side --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection (loop.create_connection) is handed a Transport.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is None:
            return
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # a request leaves at once, not after an ACK
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._fd = -1
        with contextlib.suppress(OSError, ValueError):
            self._fd = sock.fileno()
            if _POLL is not None and self._fd >= 0:
                self._poll = _POLL()
                self._poll.register(self._fd, select.POLLIN | select.POLLPRI)

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # after its answer ended: never another request's answer
            if not self.discarded:
                log.warning(
                    "retrysafe gateway: the upstream sent %d bytes after an answer's "
                    "end; its connection is closed",
                    len(data),
                )
            self.reusable = False
            self.pool.forget(self)
            return
        self.buffer += data
        if len(self.buffer) > _HIGH_WATER and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]  # data: connected
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()
        if not self.busy:
            self.pool.forget(self)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    # -- the request's side --

    def usable(self) -> bool:
        """Open, with nothing unread: ready for another request."""
        transport = self.transport
        if transport is None or not self.reusable:
            return False
        return not (self.eof or self.buffer or transport.is_closing())

    def quiet(self) -> bool:
        """Nothing waits in the socket that the event loop has not read yet: no bytes
        (an upstream's late ones would become the next answer) and no close."""
        try:
            if self._poll is not None:
                return not self._poll.poll(0)
            if self._fd is None:
                return True
            if self._fd < 0:
                return False
            readable, _, broken = select.select([self._fd], [], [self._fd], 0)
        except (OSError, ValueError):
            return False
        return not (readable or broken)

    def sent(self) -> bool:
        """Whether every byte written has left for the upstream."""
        return self.transport is not None and self.transport.get_write_buffer_size() == 0

    async def wait(self, kind: str) -> None:
        """Wait for the next event (bytes, the end, room to write), the pool's timeout at most."""
        loop = self.pool.loop
        waiter = self._waiter = loop.create_future()
        self._deadline = loop.time() + self.pool.timeout
        if self._timer is None:  # else the armed one moves itself on to this deadline
            self._timer = loop.call_at(self._deadline, self._late)
        try:
            woke = await waiter
        finally:
            self._waiter = None
        if not woke:
            raise UpstreamError(kind, f"nothing for {self.pool.timeout:g} s", timeout=True)

    def _late(self) -> None:
        """The connection's one timer: ends a wait past its deadline, or moves on to it.

        One timer serves the waits of many requests (a kept-alive connection's next
        waits begin before the last one's deadline): a wait costs no timer of its own.
        """
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        loop = self.pool.loop
        if loop.time() >= self._deadline:
            waiter.set_result(False)
        else:
            self._timer = loop.call_at(self._deadline, self._late)

    def stop_timer(self) -> None:
        """Cancel the connection's timer (it is closed)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def drain(self) -> bool:
        """Wait for room to write; False if the upstream answered or left instead."""
        while self._writing_paused:
            if self.eof or self.buffer:
                return False
            await self.wait("WriteTimeout")
        return not self.eof

    def _broken(self, what: str, kind: type[UpstreamError] = UpstreamError) -> UpstreamError:
        if self.error is not None:
            return kind("ReadError", f"the connection broke {what}: {self.error!r}")
        return kind("RemoteProtocolError", f"the upstream closed the connection {what}")

    def _resume(self) -> None:
        if self._reading_paused and len(self.buffer) <= _LOW_WATER:
            self._reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]  # data: connected

    async def head(self) -> bytes:
        """The next answer's head, up to and with its empty line (CRLF or LF)."""
        start = 0
        while True:
            buf = self.buffer
            end = buf.find(b"\n\r\n", start)
            end = end + 3 if end >= 0 else -1
            lf = buf.find(b"\n\n", start, end if end >= 0 else len(buf))
            if lf >= 0:
                end = lf + 2
            if end > _MAX_HEAD or (end < 0 and len(buf) > _MAX_HEAD):
                raise UpstreamError("RemoteProtocolError", "the answer's head is too large")
            if end >= 0:
                head = bytes(buf[:end])
                del buf[:end]
                self._resume()
                return head
            start = max(0, len(buf) - 2)
            if self.eof:
                if buf:
                    raise self._broken("in the middle of an answer's head")
                raise self._broken("without answering", _NoAnswer)
            await self.wait("ReadTimeout")

    async def line(self) -> bytes:
        """The next line of a chunked body, without its CRLF (or LF)."""
        start = 0
        while (end := self.buffer.find(b"\n", start)) < 0:
            if len(self.buffer) > _MAX_LINE:
                raise UpstreamError("RemoteProtocolError", "a chunked body's line is too long")
            start = len(self.buffer)
            if self.eof:
                raise self._broken("in the middle of a chunked body")
            await self.wait("ReadTimeout")
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 1]
        self._resume()
        return line[:-1] if line.endswith(b"\r") else line

    def take_now(self, limit: int) -> bytes:
        """At most ``limit`` bytes (-1: all) of those here, without waiting: b"" if none."""
        buf = self.buffer
        if not buf:
            return b""
        if limit < 0 or limit >= len(buf):
            data = bytes(buf)
            buf.clear()
        else:
            data = bytes(buf[:limit])
            del buf[:limit]
        if self._reading_paused:
            self._resume()
        return data

    async def take(self, limit: int) -> bytes:
        """At most ``limit`` bytes, at least one: those here, else the next to come.

        At the end of the connection: b"" if ``limit`` is -1 (a body that runs to
        the close), else an error.
        """
        while not self.buffer:
            if self.eof:
                if limit < 0 and self.error is None:
                    return b""
                raise self._broken("in the middle of an answer")
            await self.wait("ReadTimeout")
        return self.take_now(limit)


class _Answer:
    """The upstream's answer: status, the headers to pass on (no hop-by-hop ones, no
    Content-Length on a 204 or 304), and its body as :meth:`read` gives it.

    The connection goes back to the pool once the body is read whole (if it can
    carry another request), and is closed if the answer is dropped before that.
    """

    __slots__ = (
        "_chunk",
        "_conn",
        "_keep",
        "_left",
        "_mode",
        "done",
        "headers",
        "length",
        "status",
        "until_close",
    )

    def __init__(
        self,
        conn: _Connection,
        status: int,
        headers: list[tuple[bytes, bytes]],
        mode: int,
        length: int | None,
        keep: bool,
    ) -> None:
        self._conn, self._mode, self._keep = conn, mode, keep
        self.status, self.headers = status, headers
        #: The body's Content-Length, if that is how the body is framed.
        self.length = length
        #: Whether the body runs to the close: nothing then proves that it is whole.
        self.until_close = mode == _UNTIL_CLOSE
        self._left = length or 0  # of the body (_LENGTH) or of the chunk being read (_CHUNKED)
        self._chunk = False  # in a chunk's data (_CHUNKED)
        self.done = False
        if mode == _NONE or (mode == _LENGTH and not length):
            self._finish()

    def _finish(self) -> None:
        self.done = True
        conn = self._conn
        conn.pool.release(conn, self._keep and not conn.buffer and conn.sent())

    def close(self) -> None:
        """Drop the answer: an unfinished one closes its connection."""
        if not self.done:
            self.done = True
            self._conn.pool.discard(self._conn)

    async def read(self) -> bytes:
        """The next bytes of the body as they come (never decoded); b"" at its end."""
        if self.done:
            return b""
        conn = self._conn
        if self._mode == _LENGTH:
            data = conn.take_now(self._left) or await conn.take(self._left)
            self._left -= len(data)
            if not self._left:
                self._finish()
            return data
        if self._mode == _UNTIL_CLOSE:
            data = await conn.take(-1)
            if not data:
                self._finish()
            return data
        while True:  # chunked
            if self._left:
                data = await conn.take(self._left)
                self._left -= len(data)
                return data
            if self._chunk:
                if await conn.line():
                    raise UpstreamError("RemoteProtocolError", "a chunk is longer than its size")
                self._chunk = False
            line = await conn.line()
            match = _CHUNK_SIZE.match(line)
            if match is None:
                raise UpstreamError("RemoteProtocolError", f"bad chunk size line {line[:40]!r}")
            self._left = int(match[1], 16)
            if self._left:
                self._chunk = True
                continue
            trailer = 0  # the last chunk: trailers (not passed on) up to an empty line
            while line := await conn.line():
                trailer += len(line)
                if trailer > _MAX_HEAD:
                    raise UpstreamError("RemoteProtocolError", "the trailers are too large")
            self._finish()
            return b""


def _parse_head(head: bytes) -> tuple[bool, int, list[tuple[bytes, bytes]]]:
    """An answer's head: whether it is HTTP/1.1, its status and its headers (names lower-cased).

    Strict: anything that is not HTTP/1.0 or 1.1 is a RemoteProtocolError.
    """
    lines = head.split(b"\n")
    first = lines[0].removesuffix(b"\r")
    match = _STATUS_LINE.match(first)
    if match is None:
        raise UpstreamError("RemoteProtocolError", f"not an HTTP/1.1 status line: {first[:60]!r}")
    headers: list[tuple[bytes, bytes]] = []
    for raw in lines[1:]:
        line = raw.removesuffix(b"\r")
        if not line:
            break
        if line[0] in b" \t":  # obs-fold: a continuation, joined with a space (RFC 9112 5.2)
            if not headers or _FOLDED.match(line) is None:
                raise UpstreamError("RemoteProtocolError", f"bad header line {line[:60]!r}")
            name, value = headers.pop()
            headers.append((name, (value + b" " + line.strip(b" \t")).strip(b" ")))
            continue
        field = _FIELD.match(line)
        if field is None:
            raise UpstreamError("RemoteProtocolError", f"bad header line {line[:60]!r}")
        headers.append((field[1].lower(), field[2]))
    return match[1] == b"1", int(match[2]), headers


def _answer_name(raw: bytes) -> tuple[bytes, int]:
    """An answer header's name lower-cased, and what the fast path does with it."""
    name = raw.lower()
    kind = _ANSWER_FIELDS.get(name, _DROP if name.startswith(b"proxy-") else _PASS)
    if len(raw) <= _MAX_NAME and len(_ANSWER_NAMES) < _MAX_NAMES:
        _ANSWER_NAMES[raw] = (name, kind)
    return name, kind


def _plain_answer(
    method: str, head: bytes
) -> tuple[int, int, list[tuple[bytes, bytes]], bool] | None:
    """The common answer head in one pass: a final status but 204 and 304, to a request
    but HEAD, one Content-Length, no Transfer-Encoding, no folded line. Its status,
    Content-Length, end-to-end headers and whether the connection may carry another
    request; None for any other head, which the general path reads."""
    match = _PLAIN_HEAD.fullmatch(head)
    if match is None or method == "HEAD":
        return None
    status = int(match[2])
    if status < 200 or status in (204, 304):
        return None
    out = []
    length = connection = None
    names = _ANSWER_NAMES
    lines = head.split(b"\r\n")  # the status line, the fields, and two empty ones
    del lines[0], lines[-2:]
    for line in lines:
        raw, _, value = line.partition(b":")
        name, kind = names.get(raw) or _answer_name(raw)
        if kind == _PASS:
            out.append((name, value.strip(b" \t")))
        elif kind == _DROP:
            continue
        elif kind == _CONTENT_LENGTH:
            value = value.strip(b" \t")
            if length is not None:
                return None
            length = value
            out.append((name, value))
        elif kind == _CONNECTION:
            value = value.strip(b" \t")
            connection = value if connection is None else connection + b"," + value
        else:  # Transfer-Encoding
            return None
    if length is None or not length.isdigit() or len(length) >= 19:
        return None
    keep = match[1] == b"1"
    if connection is not None:
        tokens = {t.strip().lower() for t in connection.split(b",")}
        keep = keep and b"close" not in tokens
        if not tokens <= _HOP_OR_EMPTY:
            out = [field for field in out if field[0] not in tokens]
    return status, int(length), out, keep


def _framing(
    method: str, status: int, headers: list[tuple[bytes, bytes]]
) -> tuple[int, int | None, bool, list[tuple[bytes, bytes]]]:
    """How an answer's body is framed (RFC 9112 6.3): mode, Content-Length, whether the
    connection may carry another request after it, and the headers to pass on."""
    codings = [v for k, v in headers if k == b"transfer-encoding"]
    lengths = [v for k, v in headers if k == b"content-length"]
    if method == "HEAD" or status in (204, 304):
        return _NONE, None, True, headers
    if codings:  # Transfer-Encoding wins over Content-Length, which then is not passed on
        last = b",".join(codings).rsplit(b",", 1)[-1].strip().lower()
        if lengths:
            headers = [(k, v) for k, v in headers if k != b"content-length"]
        if last == b"chunked":
            return _CHUNKED, None, not lengths, headers
        return _UNTIL_CLOSE, None, False, headers
    if not lengths:
        return _UNTIL_CLOSE, None, False, headers
    if len(lengths) == 1 and lengths[0].isdigit() and len(lengths[0]) < 19:
        return _LENGTH, int(lengths[0]), True, headers
    values = {v.strip() for value in lengths for v in value.split(b",")}
    if len(values) != 1 or not (value := values.pop()).isdigit() or len(value) >= 19:
        raise UpstreamError("RemoteProtocolError", f"bad Content-Length {lengths!r}")
    # The same length several times: passed on once (RFC 9110 8.6).
    first = next(i for i, (k, _) in enumerate(headers) if k == b"content-length")
    rest = [(k, v) for k, v in headers[first + 1 :] if k != b"content-length"]
    return _LENGTH, int(value), True, [*headers[:first], (b"content-length", value), *rest]


def _final(
    method: str, http11: bool, status: int, headers: list[tuple[bytes, bytes]]
) -> tuple[int, int | None, bool, list[tuple[bytes, bytes]]]:
    """A final answer's framing (mode, Content-Length), whether its connection may carry
    another request, and the headers to pass on, from its parsed head."""
    mode, length, keep, headers = _framing(method, status, headers)
    keep = keep and http11 and b"close" not in connection_tokens(headers)
    # A 204 or 304 has no body, whatever its Content-Length says (RFC 9110 8.6).
    skip = _NO_BODY if status in (204, 304) else frozenset()
    return mode, length, keep, end_to_end(headers, skip)


def _request_head(
    method: str,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes | AsyncGenerator[bytes, None],
) -> tuple[bytes, int | None]:
    """The request line and headers, framed for ``body``; and the length a streamed body
    declares (None: it goes chunked)."""
    lengths = [v for k, v in headers if k == b"content-length"]
    declared: int | None = None
    if isinstance(body, bytes):
        size = b"%d" % len(body)
        if lengths != [size] and (lengths or body or method in _BODY_METHODS):
            headers = [(k, v) for k, v in headers if k != b"content-length"]
            headers.append((b"content-length", size))
    elif len(lengths) == 1 and lengths[0].isdigit():
        declared = int(lengths[0])
    else:
        headers = [(k, v) for k, v in headers if k != b"content-length"]
        headers.append((b"transfer-encoding", b"chunked"))
    # One join in C, no Python frame per header.
    fields = b"\r\n".join(map(b": ".join, headers))
    line = b"%s %s HTTP/1.1\r\n" % (method.encode("latin-1"), target)
    return (line + fields + b"\r\n\r\n" if headers else line + b"\r\n"), declared


class Pool:
    """One event loop's HTTP/1.1 connections to the upstream, kept alive between requests."""

    def __init__(
        self,
        address: tuple[str, int, str | None],
        ssl_context: ssl.SSLContext | None,
        timeout: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """``address`` is (host, port, TLS server name or None), ``ssl_context`` None for http."""
        self.loop = loop
        self.timeout = timeout
        self._address = address
        self._ssl = ssl_context
        self._idle: deque[_Connection] = deque()  # the most recently used last
        self._open = 0
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self._closed = False

    async def send(
        self,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | AsyncGenerator[bytes, None],
    ) -> _Answer:
        """Send one request; the answer once its head is in (its body is read from it)."""
        head, declared = _request_head(method, target, headers, body)
        again = isinstance(body, bytes) and method in _IDEMPOTENT
        while True:
            conn = self._kept()
            reused = conn is not None
            if conn is None:
                conn, reused = await self._acquire()
            try:
                if isinstance(body, bytes):
                    _write_bytes(conn, head, body)
                else:
                    await _write(conn, head, body, declared)
                return await self._answer(conn, method)
            except _NoAnswer:
                self.discard(conn)
                if not (reused and again):
                    raise
                again = False  # a kept-alive connection the upstream had closed: once more
            except BaseException:
                self.discard(conn)
                raise

    async def _answer(self, conn: _Connection, method: str) -> _Answer:
        buf = conn.buffer
        if not buf and not conn.eof:
            await conn.wait("ReadTimeout")  # the usual: the answer is not in yet
        # The common head, whole and CRLF-ended, read where it lies; any other
        # (partial, LF-ended, interim, chunked, ...) goes the general way below.
        end = buf.find(b"\r\n\r\n", 0, _MAX_HEAD)
        if end >= 0:
            head = bytes(buf[: end + 4])
            plain = _plain_answer(method, head)
            if plain is not None:
                del buf[: end + 4]
                if conn._reading_paused:
                    conn._resume()
                return _Answer(conn, plain[0], plain[2], _LENGTH, plain[1], plain[3])
        head = await conn.head()
        plain = _plain_answer(method, head)
        if plain is not None:
            return _Answer(conn, plain[0], plain[2], _LENGTH, plain[1], plain[3])
        for interim in range(_MAX_INTERIM + 1):
            if interim:
                head = await conn.head()
            http11, status, headers = _parse_head(head)
            if status >= 200:
                break
            if status == 101:  # the gateway never asks to switch protocols
                raise UpstreamError("RemoteProtocolError", "101 Switching Protocols")
            # 100 Continue, 103 Early Hints: interim answers, not passed on
        else:
            raise UpstreamError("RemoteProtocolError", "too many interim (1xx) answers")
        mode, length, keep, headers = _final(method, http11, status, headers)
        return _Answer(conn, status, headers, mode, length, keep)

    def _kept(self) -> _Connection | None:
        """The most recently used kept-alive connection still fit for a request, if any."""
        now = self.loop.time()
        while self._idle:
            conn = self._idle.pop()
            if conn.usable() and now - conn.idle_since < _KEEP_ALIVE and conn.quiet():
                conn.busy = True
                return conn
            self.discard(conn)
        return None

    async def _acquire(self) -> tuple[_Connection, bool]:
        """A kept-alive connection (True), else a new one (False) once there is room."""
        deadline = None
        while True:
            now = self.loop.time()
            if (conn := self._kept()) is not None:
                return conn, True
            if self._open < _MAX_CONNECTIONS:
                break
            if deadline is None:
                deadline = now + self.timeout
            elif now >= deadline:
                raise UpstreamError(
                    "PoolTimeout", f"all {_MAX_CONNECTIONS} connections busy", timeout=True
                )
            waiter = self.loop.create_future()
            self._waiters.append(waiter)
            timer = self.loop.call_later(deadline - now, _expire, waiter)
            woken = False
            try:
                woken = await waiter
            except BaseException:  # cancelled
                woken = waiter.done() and not waiter.cancelled() and waiter.result()
                if woken:
                    self._notify()  # pass the wake-up on to the next one
                raise
            finally:
                timer.cancel()
                if not woken:  # still in the queue: no longer waiting
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(waiter)
        self._open += 1
        try:
            return await self._connect(), False
        except BaseException:
            self._open -= 1
            self._notify()
            raise

    async def _connect(self) -> _Connection:
        host, port, server_hostname = self._address
        try:
            async with asyncio.timeout(self.timeout):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self),
                    host,
                    port,
                    ssl=self._ssl,
                    server_hostname=server_hostname,
                )
        except TimeoutError:
            raise UpstreamError(
                "ConnectTimeout", f"no connection within {self.timeout:g} s", timeout=True
            ) from None
        except OSError as exc:
            raise UpstreamError("ConnectError", repr(exc)) from None
        return conn

    def release(self, conn: _Connection, reuse: bool) -> None:
        """Take ``conn`` back: kept for the next request if ``reuse`` (and there is room)."""
        if reuse and not self._closed and conn.usable():
            conn.busy = False
            now = conn.idle_since = self.loop.time()
            idle = self._idle
            while idle and (len(idle) >= _MAX_IDLE or now - idle[0].idle_since >= _KEEP_ALIVE):
                self.discard(idle.popleft())  # the least recently used, or expired
            idle.append(conn)
            self._notify()
        else:
            self.discard(conn)

    def discard(self, conn: _Connection) -> None:
        """Close ``conn`` and free its place."""
        conn.busy = False
        conn.stop_timer()
        if not conn.discarded:
            conn.discarded = True
            self._open -= 1
            if conn.transport is not None:
                conn.transport.close()
            self._notify()

    def forget(self, conn: _Connection) -> None:
        """An idle connection the upstream closed."""
        if conn in self._idle:
            self._idle.remove(conn)
        self.discard(conn)

    def _notify(self) -> None:
        """Wake the oldest request waiting for a connection."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return

    async def aclose(self) -> None:
        """Close the idle connections; those in use close when their answer is done."""
        self._closed = True
        idle, self._idle = self._idle, deque()
        for conn in idle:
            self.discard(conn)
        await asyncio.sleep(0)  # the transports' connection_lost runs


def _write_bytes(conn: _Connection, head: bytes, body: bytes) -> None:
    """Send a request's head and a body held whole."""
    transport = conn.transport
    assert transport is not None
    if len(body) < 65536:
        transport.write(head + body)  # one segment
    else:
        transport.write(head)
        transport.write(body)


async def _write(
    conn: _Connection, head: bytes, body: AsyncGenerator[bytes, None], declared: int | None
) -> None:
    """Send a request's head and a streamed body.

    A streamed body stops early if the upstream leaves, or answers while the
    gateway waits to write: the answer is then read, and the connection not kept.
    """
    transport = conn.transport
    assert transport is not None
    transport.write(head)
    sent = 0
    try:
        async for chunk in body:
            if conn.eof:
                conn.reusable = False
                return
            sent += len(chunk)
            if declared is None:
                transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            elif sent <= declared:
                transport.write(chunk)
            else:
                raise UpstreamError("LocalProtocolError", "the body is over its Content-Length")
            if not await conn.drain():
                conn.reusable = False
                return
        if declared is None and not conn.eof:
            transport.write(b"0\r\n\r\n")
    finally:
        await body.aclose()
