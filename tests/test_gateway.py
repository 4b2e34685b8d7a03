"""The gateway over real sockets: a real upstream process, the gateway on uvicorn, httpx.

The upstream (tests/_upstream.py) runs as its own process; each gateway is a
uvicorn server in a thread of this process, so a test can read its store.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import socket
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _upstream import GZIP_TEXT, UpstreamProcess, pattern

from retrysafe import Status, key_hash
from retrysafe._serve import ServerThread, bind
from retrysafe.gateway import Gateway, create_app
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
        return self.app.store.get(key_hash("", "http", key))


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Callable[..., Running]]:
    """``gateway(upstream_url, **options)`` starts one; all stop after the test."""
    servers: list[ServerThread] = []

    def start(upstream_url: str, **options: Any) -> Running:
        options.setdefault("store", f"sqlite:///{tmp_path}/gateway-{len(servers)}.db")
        app = create_app(upstream_url, **options)
        server = ServerThread(app, bind("127.0.0.1", 0))
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


def raw_get(port: int, target: bytes, headers: bytes = b"") -> tuple[int, bytes, bytes]:
    """One request with a request target sent byte for byte (httpx would normalise it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"GET "
            + target
            + b" HTTP/1.1\r\nHost: gw.test\r\n"
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
        "Connection": "keep-alive, X-Secret", "X-Secret": "s", "Keep-Alive": "timeout=5",
        "TE": "trailers", "Trailer": "X-Sum", "Proxy-Authorization": "Basic eDp5",
        "Proxy-Connection": "keep-alive", "X-Kept": "yes",
        "X-Forwarded-For": "10.0.0.1", "X-Forwarded-Host": "evil.test",
        "X-Forwarded-Proto": "gopher",
    }  # fmt: skip
    seen: dict[str, list[str]] = {}
    for k, v in httpx.get(gw.url + "/echo/hop", headers=sent).json()["headers"]:
        seen.setdefault(k, []).append(v)
    assert seen["x-kept"] == ["yes"]
    dropped = "connection x-secret keep-alive te trailer proxy-authorization proxy-connection"
    assert not set(seen) & set(dropped.split())
    assert seen["host"] == [f"127.0.0.1:{origin.port}"]
    assert seen["x-forwarded-for"] == ["10.0.0.1, 127.0.0.1"]  # the client appended
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
    key = {"Idempotency-Key": "big-1"}
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
        for method, headers in (("GET", {}), ("POST", {"Idempotency-Key": "flat-1"})):
            with httpx.stream(method, url, headers=headers) as r:
                total = sum(len(part) for part in r.iter_raw())
            assert r.status_code == 200 and total == 64 * MiB
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MiB, f"peak {peak / MiB:.1f} MiB: the gateway buffered the answer"


# -- idempotency through the gateway ------------------------------------------------------


def test_keyed_post_runs_once_and_is_replayed(gw: Running, origin: UpstreamProcess) -> None:
    before = orders(gw.url)  # an unkeyed GET, proxied
    key = {"Idempotency-Key": "order-1"}
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
    key = {"Idempotency-Key": "fast-retry"}
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
        key = {"Idempotency-Key": "down-1"}
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
    r = httpx.post(gw.url + "/slow?s=3", headers={"Idempotency-Key": "slow-1"})
    assert r.status_code == 504
    assert gw.record("slow-1").status is Status.FAILED  # retryable


# -- the gateway's own pages ---------------------------------------------------------------


def test_health_and_own_paths(gw: Running) -> None:
    r = httpx.get(gw.url + "/_retrysafe/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "store": "ok"}
    assert r.headers["cache-control"] == "no-store"
    head = httpx.head(gw.url + "/_retrysafe/health")
    assert head.status_code == 200 and head.content == b""
    post = httpx.post(gw.url + "/_retrysafe/health", headers={"Idempotency-Key": "h"})
    assert post.status_code == 405 and post.headers["allow"] == "GET, HEAD"
    for path in ("/_retrysafe", "/_retrysafe/", "/_retrysafe/metrics", "/%5Fretrysafe/x"):
        status, head_bytes, body = raw_get(gw.port, path.encode())
        assert status == 404, path
        assert b"application/problem+json" in head_bytes
        assert json.loads(body)["code"] == "not_found"


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
        keyed = httpx.post(gw.url + "/orders", headers={"Idempotency-Key": "k"})
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
