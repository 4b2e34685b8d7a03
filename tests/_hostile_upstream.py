"""An upstream that breaks HTTP/1.1 on purpose, as its own process: the answers no
ASGI app can send, byte for byte.

Run by :class:`_upstream.UpstreamProcess` (``script=__file__``) on a loopback
socket bound up front. Routes (any method):

- ``/health``: 200 ``ok``.
- ``/cut`` and ``/cut10``: ``run N: the first half`` with no length and not
  chunked, then a clean close (HTTP/1.1 and HTTP/1.0): nothing tells whether it
  ended there. ``N`` counts the calls of each path.
- ``/badchunk``: a chunked answer whose first chunk size is ``zz``.
- ``/late``: ``hello`` (``Content-Length: 5``), kept alive; once ``/go`` is
  called, the bytes of a whole second answer (``evil``) follow on the same
  connection, which then serves requests as usual.
- ``/go``: sends ``/late``'s late bytes, then answers ``sent``.
- ``/closed``: waits (30 s at most) for the peer to close ``/late``'s connection;
  ``closed`` or ``open``.
- anything else: 200 ``real``, kept alive.
"""

from __future__ import annotations

import asyncio
import socket
import sys

LATE = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil"


class State:
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.late: asyncio.StreamWriter | None = None
        self.closed = asyncio.Event()


STATE = State()


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    late = False
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
            path = head.split(b" ", 2)[1].decode("latin-1").partition("?")[0]
            calls = STATE.calls[path] = STATE.calls.get(path, 0) + 1
            if path in ("/cut", "/cut10"):
                version = b"1.0" if path == "/cut10" else b"1.1"
                writer.write(b"HTTP/%s 200 OK\r\nContent-Type: text/plain\r\n\r\n" % version)
                writer.write(b"run %d: the first half" % calls)
                await writer.drain()
                return
            if path == "/badchunk":
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
                await writer.drain()
                return
            if path == "/late":
                late = True
                STATE.late, STATE.closed = writer, asyncio.Event()
                writer.write(ok(b"hello"))
            elif path == "/go":
                if STATE.late is not None:
                    STATE.late.write(LATE)
                    await STATE.late.drain()
                writer.write(ok(b"sent"))
            elif path == "/closed":
                try:
                    await asyncio.wait_for(STATE.closed.wait(), 30)
                    writer.write(ok(b"closed"))
                except TimeoutError:
                    writer.write(ok(b"open"))
            else:
                writer.write(ok(b"real"))
            await writer.drain()
    finally:
        if late:
            STATE.closed.set()
        writer.close()


async def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    sock.listen(128)
    server = await asyncio.start_server(serve, sock=sock)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
