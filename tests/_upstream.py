"""The upstream the gateway tests proxy to: a plain ASGI app run as its own process.

:class:`UpstreamProcess` binds a loopback port, then runs ``python
tests/_upstream.py FD`` to serve on that socket: the port is known before the
process starts, nothing else can take it, and until the process listens a
connection is refused (an upstream that is down). Routes:

- ``/health``: 200 ``ok``.
- ``/echo...`` (any method): the request as JSON (method, raw path, query,
  headers, body), with a repeated ``x-multi`` and two ``set-cookie`` headers.
- ``/hop``: an answer carrying hop-by-hop headers a proxy must drop.
- ``POST /orders``: a side effect; ``GET /count``: how many ran.
- ``/stream?chunks=N&size=S[&hold=1]``: ``N`` chunks of ``S`` bytes of
  :func:`pattern`; with ``hold`` it waits after the first chunk until ``/release``.
- ``/slow?s=SECONDS``, ``/gzip``, ``/status/CODE``.

:class:`RawUpstream` is a plain TCP server in a thread instead: it answers each
request with the bytes a test gives, for answers no ASGI app can send (chunk
extensions, trailers, bodies that run to the close, malformed heads).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, Self

import httpx

GZIP_TEXT = b"retrysafe passes compressed bytes through unchanged\n" * 50


def pattern(index: int, size: int) -> bytes:
    """Chunk ``index`` of a stream: deterministic bytes, different in every chunk."""
    seed = hashlib.sha256(b"%d" % index).digest()
    return (seed * (size // len(seed) + 1))[:size]


class Upstream:
    def __init__(self) -> None:
        self.orders = 0
        self.released: asyncio.Event | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        path, method = scope["path"], scope["method"]
        query = dict(urllib.parse.parse_qsl(scope["query_string"].decode("latin-1")))
        if self.released is None:
            self.released = asyncio.Event()
        if path == "/health":
            await answer(send, 200, b"ok")
        elif path.startswith("/echo"):
            doc = {
                "method": method,
                "raw_path": scope["raw_path"].decode("latin-1"),
                "query": scope["query_string"].decode("latin-1"),
                "headers": [
                    [k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]
                ],
                "body": body.decode("latin-1"),
            }
            extra = [
                (b"x-multi", b"a"),
                (b"x-multi", b"b"),
                (b"set-cookie", b"a=1; Path=/"),
                (b"set-cookie", b"b=2; Path=/"),
            ]
            await answer(send, 200, json.dumps(doc).encode(), "application/json", extra)
        elif path == "/hop":
            extra = [
                (b"connection", b"x-secret"),
                (b"x-secret", b"s"),
                (b"keep-alive", b"timeout=5"),
                (b"proxy-authenticate", b"Basic"),
                (b"proxy-connection", b"keep-alive"),
                (b"trailer", b"x-sum"),
                (b"upgrade", b"h2c"),
                (b"x-kept", b"yes"),
            ]
            await answer(send, 200, b"hop", extra=extra)
        elif path == "/orders" and method == "POST":
            self.orders += 1
            await answer(send, 201, json.dumps({"order": self.orders}).encode(), "application/json")
        elif path == "/count":
            await answer(
                send, 200, json.dumps({"orders": self.orders}).encode(), "application/json"
            )
        elif path == "/release":
            self.released.set()
            await answer(send, 200, b"released")
        elif path == "/stream":
            chunks, size = int(query.get("chunks", 4)), int(query.get("size", 1024))
            headers = [(b"content-type", b"application/octet-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            for i in range(chunks):
                await send(
                    {"type": "http.response.body", "body": pattern(i, size), "more_body": True}
                )
                if i == 0 and query.get("hold"):
                    await self.released.wait()
                    self.released.clear()
            await send({"type": "http.response.body", "body": b""})
        elif path == "/slow":
            await asyncio.sleep(float(query.get("s", 5)))
            await answer(send, 200, b"slow")
        elif path == "/gzip":
            await answer(
                send,
                200,
                gzip.compress(GZIP_TEXT, mtime=0),
                "text/plain",
                [(b"content-encoding", b"gzip")],
            )
        elif path.startswith("/status/"):
            status = int(path.rsplit("/", 1)[1])
            if status in (204, 304):  # no body; a 304 may tell the representation's length
                headers = [(b"content-length", b"6")] if status == 304 else []
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": b""})
            else:
                await answer(send, status, b"status")
        else:
            await answer(send, 404, b"not found")


async def answer(
    send: Any,
    status: int,
    body: bytes,
    ctype: str = "text/plain",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", ctype.encode()), (b"content-length", b"%d" % len(body))]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": body})


app = Upstream()


class UpstreamProcess:
    """The upstream in a process of its own on a loopback port bound up front."""

    def __init__(self, script: str = __file__) -> None:
        """``script`` serves on the socket whose descriptor it is given (this module's app)."""
        self.script = script
        self._sock: socket.socket | None = socket.socket()
        self._sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> Self:
        """Serve on the port (once: the process takes the socket); wait until it answers."""
        assert self._sock is not None, "an upstream process starts once"
        fd = self._sock.fileno()
        self.proc = subprocess.Popen([sys.executable, self.script, str(fd)], pass_fds=[fd])
        self._sock.close()  # the child's copy is the only one: when it exits, the port closes
        self._sock = None
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the upstream on {self.url} did not start")
            time.sleep(0.02)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: What a :class:`RawUpstream` does with a request: the bytes to send back, and
#: whether to close the connection after them; None closes it without answering.
Reply = Callable[[bytes], tuple[bytes, bool] | None]


class RawUpstream:
    """A TCP server on a loopback port that answers every request with ``reply(request)``.

    ``requests`` holds each request as it came (head and body); ``connections``
    counts the connections accepted and ``closed_by_peer`` those the gateway closed.
    """

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed_by_peer = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        data = b""
        with conn:
            while not self._stop.is_set():
                request, data = _read_request(conn, data)
                if request is None:
                    self.closed_by_peer += 1
                    return
                self.requests.append(request)
                answer = self.reply(request)
                if answer is None:
                    return
                conn.sendall(answer[0])
                if answer[1]:
                    return


def _read_request(conn: socket.socket, data: bytes) -> tuple[bytes | None, bytes]:
    """The next request on ``conn`` (its body framed by Content-Length or chunked)."""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None, data
        data += chunk
    end = data.index(b"\r\n\r\n") + 4
    head = data[:end].lower()
    if b"transfer-encoding: chunked" in head:
        while b"\r\n0\r\n\r\n" not in data[end - 2 :]:
            data += conn.recv(65536)
        end = data.index(b"\r\n0\r\n\r\n", end - 2) + 7
    elif b"content-length:" in head:
        length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        while len(data) < end + length:
            data += conn.recv(65536)
        end += length
    return data[:end], data[end:]


if __name__ == "__main__":
    import uvicorn

    sock = socket.socket(fileno=int(sys.argv[1]))
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", proxy_headers=False
    )
    uvicorn.Server(config).run(sockets=[sock])
