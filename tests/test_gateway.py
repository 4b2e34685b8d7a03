"""The gateway over real sockets: a real upstream process, the gateway on uvicorn, httpx.

The upstream (tests/_upstream.py) runs as its own process; each gateway is a
uvicorn server in a thread of this process, so a test can read its store. For
answers no ASGI app sends (other framings, malformed heads, a kept-alive
connection closed unanswered), a RawUpstream answers with the bytes a test gives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import gzip
import hashlib
import json
import socket
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _hangup import CALLER, caller_scope
from _upstream import GZIP_TEXT, RawUpstream, Reply, UpstreamProcess, pattern

from retrysafe import Status, key_hash
from retrysafe._ops.serve import ServerThread, bind
from retrysafe.gateway import Gateway, HTTPProtocol, create_app
from retrysafe.stores.memory import MemoryStore

MiB = 1 << 20


@pytest.fixture(scope="module")
def origin() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as up:
        yield up.start()


class Running:
    """A gateway served on a free loopback port, and its app (for its store)."""

    def __init__(self, app: Gateway, server: ServerThread) -> None:
        self.app, self.server, self.url = app, server, server.url
        self.port = int(server.url.rsplit(":", 1)[1])

    def record(self, key: str) -> Any:
        return self.app.store.get(key_hash(caller_scope(self.app.store), "http", key))


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Callable[..., Running]]:
    """``gateway(upstream_url, **options)`` starts one; all stop after the test."""
    servers: list[ServerThread] = []

    def start(upstream_url: str, **options: Any) -> Running:
        options.setdefault("store", f"sqlite:///{tmp_path}/gateway-{len(servers)}.db")
        app = create_app(upstream_url, **options)
        server = ServerThread(app, bind("127.0.0.1", 0), http=HTTPProtocol)
        servers.append(server)
        server.start()
        ready(server.url)
        return Running(app, server)

    yield start
    for server in servers:
        server.stop()


def ready(url: str) -> None:
    """Poll the health page until the gateway answers (never a blind sleep)."""
    with httpx.Client(timeout=5) as client:
        for _ in range(500):
            try:
                if client.get(url + "/_retrysafe/health").status_code in (200, 503):
                    return
            except httpx.TransportError:
                pass
    raise AssertionError(f"{url} never answered")


@pytest.fixture
def gw(origin: UpstreamProcess, gateway: Callable[..., Running]) -> Running:
    return gateway(origin.url)


def orders(url: str) -> int:
    return int(httpx.get(url + "/count").json()["orders"])


def raw_get(
    port: int, target: bytes, headers: bytes = b"", host: bytes = b"gw.test"
) -> tuple[int, bytes, bytes]:
    """One request with a request target sent byte for byte (httpx would normalise it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"GET "
            + target
            + b" HTTP/1.1\r\nHost: "
            + host
            + b"\r\n"
            + headers
            + b"Connection: close\r\n\r\n"
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, body


# -- pass-through --------------------------------------------------------------------


def test_status_body_headers_and_query_pass_through(gw: Running, origin: UpstreamProcess) -> None:
    body = bytes(range(256)) * 4
    r = httpx.post(
        gw.url + "/echo/a?q=1&q=2&empty=&x=%2F",
        content=body,
        headers=[("X-Multi", "1"), ("X-Multi", "2"), ("Content-Type", "application/octet-stream")],
    )
    assert r.status_code == 200
    seen = r.json()
    assert seen["method"] == "POST" and seen["raw_path"] == "/echo/a"
    assert seen["query"] == "q=1&q=2&empty=&x=%2F"
    assert seen["body"].encode("latin-1") == body
    assert [v for k, v in seen["headers"] if k == "x-multi"] == ["1", "2"]
    assert r.headers.get_list("x-multi") == ["a", "b"]  # repeated answer headers kept
    assert r.headers.get_list("set-cookie") == ["a=1; Path=/", "b=2; Path=/"]
    for status in (201, 204, 304, 404, 418, 503):
        assert httpx.get(f"{gw.url}/status/{status}").status_code == status


def test_request_target_is_forwarded_byte_for_byte(gw: Running) -> None:
    path = b"/echo/%FF%FE/caf%C3%A9/a%2Fb/{x}/../y;p=1,2//z"
    query = b"q=%zz&q=2&a=[1]&b=|&c=%2B+"
    status, _, body = raw_get(gw.port, path + b"?" + query)
    assert status == 200
    seen = json.loads(body)
    assert seen["raw_path"].encode("latin-1") == path  # not decoded, not normalised
    assert seen["query"].encode("latin-1") == query


def test_upstream_base_path_is_prefixed(
    origin: UpstreamProcess, gateway: Callable[..., Running]
) -> None:
    gw = gateway(origin.url + "/echo/base/")
    assert httpx.get(gw.url + "/x/y?z=1").json()["raw_path"] == "/echo/base/x/y"


def test_streamed_request_body_reaches_the_upstream(gw: Running) -> None:
    chunks = [pattern(i, 10_000) for i in range(20)]
    r = httpx.post(gw.url + "/echo/upload", content=iter(chunks))  # chunked, unkeyed
    assert r.json()["body"].encode("latin-1") == b"".join(chunks)


def test_hop_by_hop_headers_dropped_and_forwarded_headers_set(
    gw: Running, origin: UpstreamProcess
) -> None:
    sent = {
        "Connection": "keep-alive, X-Secret",
        "X-Secret": "s",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Trailer": "X-Sum",
        "Proxy-Authorization": "Basic eDp5",
        "Proxy-Connection": "keep-alive",
        "X-Kept": "yes",
        "X-Forwarded-For": "10.0.0.1",
        "X-Forwarded-Host": "evil.test",
        "X-Forwarded-Proto": "gopher",
    }
    seen: dict[str, list[str]] = {}
    for k, v in httpx.get(gw.url + "/echo/hop", headers=sent).json()["headers"]:
        seen.setdefault(k, []).append(v)
    assert seen["x-kept"] == ["yes"]
    dropped = "connection x-secret keep-alive te trailer proxy-authorization proxy-connection"
    assert not set(seen) & set(dropped.split())
    assert seen["host"] == [f"127.0.0.1:{origin.port}"]
    assert seen["x-forwarded-for"] == ["127.0.0.1"]  # the client's, its own chain dropped
    assert seen["x-forwarded-host"] == [f"127.0.0.1:{gw.port}"]  # what the client asked for
    assert seen["x-forwarded-proto"] == ["http"]

    answer = httpx.get(gw.url + "/hop")
    assert answer.headers["x-kept"] == "yes" and answer.text == "hop"
    dropped = "x-secret keep-alive proxy-authenticate proxy-connection trailer upgrade"
    assert not set(answer.headers) & set(dropped.split())


def test_compressed_bytes_pass_through_unchanged(gw: Running) -> None:
    with httpx.stream("GET", gw.url + "/gzip") as r:
        raw = b"".join(r.iter_raw())
    assert r.headers["content-encoding"] == "gzip"
    assert raw == gzip.compress(GZIP_TEXT, mtime=0)


# -- streaming -------------------------------------------------------------------------


def test_answer_streams_before_the_upstream_finishes(gw: Running, origin: UpstreamProcess) -> None:
    chunks, size = 64, 64 << 10
    digest, total = hashlib.sha256(), 0
    with httpx.stream("GET", f"{gw.url}/stream?chunks={chunks}&size={size}&hold=1") as r:
        parts = r.iter_raw()
        first = next(parts)  # arrives while the upstream holds the rest back
        assert first and pattern(0, size).startswith(first)
        assert httpx.get(origin.url + "/release").status_code == 200
        for part in (first, *parts):
            digest.update(part)
            total += len(part)
    expected = hashlib.sha256(b"".join(pattern(i, size) for i in range(chunks)))
    assert total == chunks * size and digest.hexdigest() == expected.hexdigest()


def test_keyed_answer_over_max_body_streams_then_replays_without_body(gw: Running) -> None:
    url = f"{gw.url}/stream?chunks=32&size=65536"  # 2 MiB, over the 1 MiB max_body
    key = {"Idempotency-Key": "big-1", **CALLER}
    first = httpx.post(url, headers=key)
    assert first.status_code == 200 and len(first.content) == 2 * MiB
    assert first.content == b"".join(pattern(i, 65536) for i in range(32))
    again = httpx.post(url, headers=key)
    assert again.status_code == 200 and again.content == b""
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["idempotent-body-omitted"] == "true"
    assert again.headers["content-length"] == "0"


def test_memory_stays_flat_while_streaming(gw: Running) -> None:
    """64 MiB through the gateway, unkeyed and keyed: the peak stays a fraction of it.

    (The event loop reads ahead a few MiB with uvloop; buffering the answer would
    cost all 64.)
    """
    url = f"{gw.url}/stream?chunks=1024&size=65536"
    tracemalloc.start()
    try:
        for method, headers in (("GET", {}), ("POST", {"Idempotency-Key": "flat-1", **CALLER})):
            with httpx.stream(method, url, headers=headers) as r:
                total = sum(len(part) for part in r.iter_raw())
            assert r.status_code == 200 and total == 64 * MiB
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MiB, f"peak {peak / MiB:.1f} MiB: the gateway buffered the answer"


def test_memory_stays_flat_while_uploading(gw: Running) -> None:
    """16 MiB of unkeyed request body, chunked and with a Content-Length: streamed upstream."""
    tracemalloc.start()
    try:
        for headers in ({}, {"Content-Length": str(16 * MiB)}):
            body = (pattern(i, 65536) for i in range(256))
            r = httpx.post(gw.url + "/orders", content=body, headers=headers, timeout=60)
            assert r.status_code == 201
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * MiB, f"peak {peak / MiB:.1f} MiB: the gateway buffered the request"


# -- idempotency through the gateway ------------------------------------------------------


def test_keyed_post_runs_once_and_is_replayed(gw: Running, origin: UpstreamProcess) -> None:
    before = orders(gw.url)  # an unkeyed GET, proxied
    key = {"Idempotency-Key": "order-1", **CALLER}
    first = httpx.post(gw.url + "/orders", json={"item": "book"}, headers=key)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    for _ in range(3):
        again = httpx.post(gw.url + "/orders", json={"item": "book"}, headers=key)
        assert again.status_code == 201 and again.content == first.content
        assert again.headers["idempotent-replayed"] == "true"
    assert orders(gw.url) == before + 1
    other = httpx.post(gw.url + "/orders", json={"item": "pen"}, headers=key)
    assert other.status_code == 422 and other.json()["code"] == "idempotency_conflict"
    unkeyed = [httpx.post(gw.url + "/orders", json={"item": "pen"}) for _ in range(2)]
    assert [r.status_code for r in unkeyed] == [201, 201]
    assert orders(origin.url) == before + 3


class SlowCompletes(MemoryStore):
    """A store whose completions take a while: the answer must not leave before one."""

    async def acomplete(self, *args: Any) -> bool:
        await asyncio.sleep(0.3)
        return await super().acomplete(*args)


def test_a_retry_sent_the_moment_the_answer_arrives_is_replayed(
    origin: UpstreamProcess, gateway: Callable[..., Running]
) -> None:
    gw = gateway(origin.url, store=SlowCompletes("memory://"))
    key = {"Idempotency-Key": "fast-retry", **CALLER}
    first = httpx.post(gw.url + "/orders", json={}, headers=key)  # has its whole body here
    second = httpx.post(gw.url + "/orders", json={}, headers=key)  # on a new connection
    assert first.status_code == second.status_code == 201
    assert second.headers["idempotent-replayed"] == "true"


def test_require_key(origin: UpstreamProcess, gateway: Callable[..., Running]) -> None:
    gw = gateway(origin.url, require_key=True)
    r = httpx.post(gw.url + "/orders", json={})
    assert r.status_code == 400 and r.json()["code"] == "idempotency_key_required"
    assert httpx.get(gw.url + "/count").status_code == 200  # GET needs no key


def test_upstream_down_is_502_and_a_retry_runs_once_it_is_back(
    gateway: Callable[..., Running],
) -> None:
    with UpstreamProcess() as later:  # bound, not listening yet: connections are refused
        gw = gateway(later.url)
        key = {"Idempotency-Key": "down-1", **CALLER}
        r = httpx.post(gw.url + "/orders", json={"n": 1}, headers=key)
        assert r.status_code == 502
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["code"] == "upstream_unavailable"
        assert gw.record("down-1").status is Status.FAILED  # nothing completed
        later.start()
        r = httpx.post(gw.url + "/orders", json={"n": 1}, headers=key)
        assert r.status_code == 201 and "idempotent-replayed" not in r.headers
        assert (
            httpx.post(gw.url + "/orders", json={"n": 1}, headers=key).headers[
                "idempotent-replayed"
            ]
            == "true"
        )
        assert orders(later.url) == 1


def test_slow_upstream_is_504(origin: UpstreamProcess, gateway: Callable[..., Running]) -> None:
    gw = gateway(origin.url, timeout=0.5)
    r = httpx.get(gw.url + "/slow?s=3")
    assert r.status_code == 504 and r.json()["code"] == "upstream_timeout"
    r = httpx.post(gw.url + "/slow?s=3", headers={"Idempotency-Key": "slow-1", **CALLER})
    assert r.status_code == 504
    assert gw.record("slow-1").status is Status.FAILED  # retryable


# -- the upstream client: framings, malformed answers, kept-alive connections ---------------


def always(answer: bytes, close: bool = False) -> Reply:
    return lambda request: (answer, close)


@pytest.mark.parametrize(
    ("answer", "close", "body", "reused"),
    [
        (  # chunk extensions and trailers; the connection is kept
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n"
            b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n",
            False,
            b"hello world",
            True,
        ),
        (  # a body that runs to the close of the connection
            b"HTTP/1.1 200 OK\r\nX-A: 1\r\n\r\nuntil the close",
            True,
            b"until the close",
            False,
        ),
        (  # HTTP/1.0: never kept
            b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\nhello",
            False,
            b"hello",
            False,
        ),
        (  # bare LF line ends, a folded header and an interim 103 before the answer
            b"HTTP/1.1 103 Early Hints\nLink: </a.css>\n\n"
            b"HTTP/1.1 200 OK\nContent-Length: 5\nX-A: 1\n X-Folded\n\nhello",
            False,
            b"hello",
            True,
        ),
        (  # Transfer-Encoding wins over Content-Length, which is not passed on
            b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n"
            b"X-A: 1\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            False,
            b"ok",
            False,
        ),
        (  # the same Content-Length twice: passed on once
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\nX-A: 1\r\n\r\nok",
            False,
            b"ok",
            True,
        ),
    ],
    ids=["chunked", "until-close", "http10", "lf-fold-103", "te-and-cl", "cl-twice"],
)
def test_answer_framings(
    gateway: Callable[..., Running], answer: bytes, close: bool, body: bytes, reused: bool
) -> None:
    with RawUpstream(always(answer, close)) as up:
        gw = gateway(up.url)
        for _ in range(2):
            r = httpx.get(gw.url + "/x")
            assert r.status_code == 200 and r.content == body
            assert r.headers["x-a"].startswith("1")
            assert r.headers.get_list("content-length") in ([], [str(len(body))])
            assert "link" not in r.headers and "x-trailer" not in r.headers
        assert up.connections == (1 if reused else 2)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/2 200 OK\r\n\r\n",
        b"hello\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"x" * (70 << 10) + b"\r\n\r\n",
    ],
    ids=[
        "http2",
        "garbage",
        "space-in-name",
        "nul-in-value",
        "two-lengths",
        "negative-length",
        "101",
        "huge-head",
    ],
)
def test_malformed_answer_is_502(gateway: Callable[..., Running], answer: bytes) -> None:
    with RawUpstream(always(answer, close=True)) as up:
        gw = gateway(up.url)
        r = httpx.post(gw.url + "/x", json={}, headers={"Idempotency-Key": "bad-1", **CALLER})
        assert r.status_code == 502 and r.json()["code"] == "upstream_unavailable"
        assert gw.record("bad-1").status is Status.FAILED


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n64\r\nonly ten b",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\nbad size",
    ],
    ids=["short-length", "short-chunk", "bad-chunk-size"],
)
def test_broken_off_answer_is_left_unfinished(
    gateway: Callable[..., Running], answer: bytes
) -> None:
    with RawUpstream(always(answer, close=True)) as up:
        gw = gateway(up.url)
        with pytest.raises(httpx.RemoteProtocolError):  # truncated, never a short answer
            httpx.post(gw.url + "/x", json={}, headers={"Idempotency-Key": "cut-1", **CALLER})
        assert gw.record("cut-1").status is Status.FAILED


def slowly(*chunks: bytes) -> Iterator[bytes]:
    """A request body whose chunks reach the gateway's app as messages of their own."""
    for i, chunk in enumerate(chunks):
        if i:
            time.sleep(0.2)
        yield chunk


def test_request_framing_reaches_the_upstream(gateway: Callable[..., Running]) -> None:
    with RawUpstream(always(b"HTTP/1.1 204 No Content\r\n\r\n")) as up:
        gw = gateway(up.url)
        httpx.post(gw.url + "/empty")  # no body: Content-Length: 0
        httpx.post(gw.url + "/chunked", content=slowly(b"ab", b"cd"))  # streamed as it came
        httpx.post(gw.url + "/sized", content=slowly(b"ab", b"cd"), headers={"Content-Length": "4"})
        httpx.get(gw.url + "/get")  # no body, no length
    empty, chunked, sized, get = up.requests
    assert empty.startswith(b"POST /empty HTTP/1.1\r\n") and b"\r\ncontent-length: 0\r\n" in empty
    assert b"\r\ntransfer-encoding: chunked\r\n" in chunked and b"content-length" not in chunked
    assert chunked.endswith(b"\r\n\r\n2\r\nab\r\n2\r\ncd\r\n0\r\n\r\n")
    assert b"\r\ncontent-length: 4\r\n" in sized and sized.endswith(b"\r\n\r\nabcd")
    assert b"transfer-encoding" not in sized
    assert b"content-length" not in get and b"transfer-encoding" not in get
    assert up.connections == 1  # one kept-alive connection carried all four


def test_kept_alive_connection_closed_by_the_upstream(gateway: Callable[..., Running]) -> None:
    """A request on a connection the upstream closed unanswered: an idempotent one is sent
    again on a new connection, a POST is not (it may have run): 502."""
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    seen: list[bytes] = []

    def reply(request: bytes) -> tuple[bytes, bool] | None:
        seen.append(request)
        return None if len(seen) in (2, 4) else (ok, False)  # drop every second request

    with RawUpstream(reply) as up:
        gw = gateway(up.url)
        assert httpx.get(gw.url + "/a").text == "ok"  # connection 1
        assert httpx.get(gw.url + "/b").text == "ok"  # dropped on 1, sent again on 2
        assert up.connections == 2 and len(seen) == 3
        r = httpx.post(gw.url + "/c", json={})  # dropped on 2: not sent again
        assert r.status_code == 502 and r.json()["code"] == "upstream_unavailable"
        assert len(seen) == 4


def test_lifespan_startup_freezes_what_is_loaded(gateway: Callable[..., Running]) -> None:
    """Objects loaded before the gateway started are out of the collector's sight."""
    with RawUpstream(always(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")) as up:
        gw = gateway(up.url)
        assert httpx.get(gw.url + "/a").text == "ok"
        assert gc.get_freeze_count() > 0
        app = gw.app  # built before the startup: frozen, in no generation the collector scans
        assert not any(o is app for generation in (0, 1, 2) for o in gc.get_objects(generation))


def test_lifespan_shutdown_closes_the_upstream_connections(
    gateway: Callable[..., Running],
) -> None:
    with RawUpstream(always(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")) as up:
        gw = gateway(up.url)
        assert httpx.get(gw.url + "/a").text == "ok"
        assert up.closed_by_peer == 0  # kept alive
        gw.server.stop()  # lifespan shutdown
        for _ in range(500):
            if up.closed_by_peer == 1:
                break
            time.sleep(0.01)
        assert up.closed_by_peer == 1
        assert not gw.app.proxy._pools


# -- the gateway's own pages ---------------------------------------------------------------


def test_health_and_own_paths(origin: UpstreamProcess, gateway: Callable[..., Running]) -> None:
    gw = gateway(origin.url, admin_loopback=True)
    r = httpx.get(gw.url + "/_retrysafe/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "store": "ok"}
    assert r.headers["cache-control"] == "no-store"
    head = httpx.head(gw.url + "/_retrysafe/health")
    assert head.status_code == 200 and head.content == b""
    post = httpx.post(gw.url + "/_retrysafe/health", headers={"Idempotency-Key": "h", **CALLER})
    assert post.status_code == 405 and post.headers["allow"] == "GET, HEAD"
    for path in ("/_retrysafe/x", "/%5Fretrysafe/x", "/_retrysafe/api/nope"):
        status, head_bytes, body = raw_get(gw.port, path.encode(), host=b"127.0.0.1")
        assert status == 404, path
        assert b"application/problem+json" in head_bytes
        assert json.loads(body)["code"] == "not_found"
    # The admin pages (loopback here, opted in, no token): never the upstream's.
    r = httpx.get(gw.url + "/_retrysafe")
    assert r.status_code == 308 and r.headers["location"] == "/_retrysafe/"
    r = httpx.get(gw.url + "/_retrysafe/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "retrysafe dashboard" in r.text
    assert "retrysafe_duplicate_rate" in httpx.get(gw.url + "/_retrysafe/metrics").text
    # Not for a page of another site rebound to 127.0.0.1, nor through a proxy.
    status, _, body = raw_get(gw.port, b"/_retrysafe/metrics")  # Host: gw.test
    assert status == 403 and json.loads(body)["code"] == "admin_loopback_only"


def test_admin_pages_are_closed_by_default(
    origin: UpstreamProcess, gateway: Callable[..., Running], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a token or the loopback opt-in, a loopback connection with no proxy
    header (what nginx in front on this host sends by default) gets no admin page,
    nor the key inspector; health still answers, and the upstream is never asked."""
    monkeypatch.delenv("RETRYSAFE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("RETRYSAFE_ADMIN_LOOPBACK", raising=False)
    gw = gateway(origin.url)
    before = orders(gw.url)  # (the upstream serves the whole module)
    httpx.post(gw.url + "/orders", json={}, headers={"Idempotency-Key": "k-1", **CALLER})
    for path in (
        b"/_retrysafe/",
        b"/_retrysafe/metrics",
        b"/_retrysafe/api/stats",
        b"/_retrysafe/api/records?key=k-1",
        b"/_retrysafe/x",
    ):
        status, head, body = raw_get(gw.port, path, host=b"127.0.0.1")
        assert status == 403 and b"application/problem+json" in head, path
        problem = json.loads(body)
        assert problem["code"] == "admin_closed" and "--admin-loopback" in problem["detail"]
        assert b"k-1" not in body
    assert httpx.get(gw.url + "/_retrysafe/health").status_code == 200
    assert orders(gw.url) == before + 1  # the admin paths never reached the upstream


def test_health_is_503_when_the_store_is_down(
    origin: UpstreamProcess, gateway: Callable[..., Running]
) -> None:
    pytest.importorskip("redis")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: the store is down
        port = closed.getsockname()[1]
        gw = gateway(origin.url, store=f"redis://127.0.0.1:{port}/0")
        r = httpx.get(gw.url + "/_retrysafe/health")
        assert r.status_code == 503
        assert r.json() == {"status": "unavailable", "store": "unavailable"}
        keyed = httpx.post(gw.url + "/orders", headers={"Idempotency-Key": "k", **CALLER})
        assert keyed.status_code == 503
        assert keyed.json()["code"] == "idempotency_store_unavailable"
        assert httpx.get(gw.url + "/count").status_code == 200  # unkeyed: still proxied


@pytest.mark.parametrize(
    "url",
    ["", "ftp://h", "http://", "http://h:99999", "http://u:pw@h", "http://h/?q=1", "nonsense"],
)
def test_bad_upstream_url_is_a_value_error(url: str) -> None:
    with pytest.raises(ValueError, match="upstream URL") as info:
        create_app(url, store="memory://")
    assert "pw" not in str(info.value)


def test_bad_timeout_is_a_value_error() -> None:
    for timeout in (0, -1, float("nan"), float("inf"), "5", True):
        with pytest.raises(ValueError, match="timeout"):
            create_app("http://127.0.0.1:1", store="memory://", timeout=timeout)


# -- the background sweeper ------------------------------------------------------------


def _expired_records(url: str, n: int) -> None:
    """``n`` completed records whose day-long TTL ran out a day ago."""
    from retrysafe import Engine, Outcome, open_store

    store = open_store(url)
    engine = Engine(store, clock=lambda: time.time() - 2 * 86400)
    for i in range(n):
        claim = engine.begin(f"old-{i}")
        engine.complete(claim, Outcome(b"x" * 1000))
    store.close()


def _wait_for(check: Callable[[], bool], what: str) -> None:
    for _ in range(3000):  # polls a state, up to 30 s on a busy machine
        if check():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def test_gateway_workers_sweep_expired_records_one_at_a_time(
    origin: UpstreamProcess, gateway: Callable[..., Running], tmp_path: Path
) -> None:
    """Two gateways on one SQLite file (two workers): each ticks at start-up, one sweeps."""
    url = f"sqlite:///{tmp_path}/swept.db"
    _expired_records(url, 50)
    first = gateway(origin.url, store=url, sweep_every=3600)
    second = gateway(origin.url, store=url, sweep_every=3600)
    sweepers = [first.app.sweeper, second.app.sweeper]
    assert all(s is not None for s in sweepers)
    _wait_for(lambda: all(s.ticks >= 1 for s in sweepers), "both workers ticked")
    assert sum(s.sweeps for s in sweepers) == 1  # the lease let one of them sweep
    assert first.app.store.records(limit=100) == []
    r = httpx.post(first.url + "/orders", json={}, headers={"Idempotency-Key": "live", **CALLER})
    assert r.status_code == 201 and first.record("live").status is Status.COMPLETED


def test_gateway_sweeper_can_be_turned_off(
    origin: UpstreamProcess,
    gateway: Callable[..., Running],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from retrysafe.gateway import ENV_SWEEP, ENV_UPSTREAM, app_from_env

    url = f"sqlite:///{tmp_path}/kept.db"
    _expired_records(url, 3)
    off = gateway(origin.url, store=url, sweep_every=None)
    assert off.app.sweeper is None
    assert httpx.get(off.url + "/_retrysafe/health").status_code == 200
    assert len(off.app.store.records(limit=100)) == 3  # nobody swept them
    monkeypatch.setenv(ENV_UPSTREAM, origin.url)
    monkeypatch.setenv("RETRYSAFE_STORE", url)
    for text, every in [("off", None), ("0", None), ("", 300.0), ("2.5", 2.5)]:
        monkeypatch.setenv(ENV_SWEEP, text)
        app = app_from_env()
        assert isinstance(app, Gateway)
        assert (None if app.sweeper is None else app.sweeper.every) == every
        app.store.close()
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv(ENV_SWEEP, bad)
        with pytest.raises(ValueError, match=ENV_SWEEP):
            app_from_env()


# -- fingerprinting large JSON bodies ----------------------------------------------------------


def _big_json(n: int) -> bytes:
    """About ``n`` times 80 bytes of JSON with many small values (costly to parse)."""
    items = [{"id": i, "name": f"item-{i}", "tags": ["a", "b"], "price": i * 1.5} for i in range(n)]
    return json.dumps({"items": items, "note": "x"}).encode()


def test_large_json_bodies_are_fingerprinted_without_stalling_others(gw: Running) -> None:
    """Three keyed 4 MB JSON posts at once: the health page keeps answering at once
    (the C JSON parser holds the GIL, about 0.3 s per MB, so it runs in a helper process)."""
    body = _big_json(50_000)
    assert len(body) > 3 * MiB
    reordered = json.dumps(json.loads(body), indent=1, sort_keys=True).encode()
    gc.collect()  # the parsed copy's objects: gone before the measurement

    def post(key: str, content: bytes = body) -> tuple[httpx.Response, float]:
        headers = {"Idempotency-Key": key, "content-type": "application/json", **CALLER}
        started = time.perf_counter()
        r = httpx.post(gw.url + "/orders", content=content, headers=headers, timeout=120)
        return r, time.perf_counter() - started

    first, _ = post("big-0")  # also starts the helper process
    assert first.status_code == 201
    again, _ = post("big-0", reordered)  # the same JSON, keys reordered: a replay
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    pool = concurrent.futures.ThreadPoolExecutor(3)
    posts = [pool.submit(post, f"big-{i}") for i in range(1, 4)]
    latencies = []
    with httpx.Client(timeout=120) as client:
        while not all(p.done() for p in posts):
            started = time.perf_counter()
            assert client.get(gw.url + "/_retrysafe/health").status_code == 200
            latencies.append(time.perf_counter() - started)
    pool.shutdown()
    durations = [p.result()[1] for p in posts]
    assert all(p.result()[0].status_code == 201 for p in posts)
    assert len(latencies) >= 3
    # Unblocked, the longest wait is a scheduling hiccup; blocked, it is a whole parse
    # (the posts' own time is a few parses, one after another in the helper).
    assert max(latencies) * 10 < max(durations), (latencies, durations)
