"""The gateway against hostile input on both sides: paths spelled to dodge a route or
a fingerprint, forwarding headers a client forges, and upstream answers that are
cut short, badly framed or followed by bytes nobody asked for.

Upstreams are real processes on free loopback ports: the test API of
``_upstream`` and the byte-level ``_hostile_upstream``.
"""

from __future__ import annotations

import asyncio
import json
import select
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _hangup import CALLER
from _upstream import UpstreamProcess
from test_gateway import Running, gateway  # noqa: F401  (the fixture)
from test_map_http import send_target

from retrysafe import Status
from retrysafe._gateway.upstream import Pool
from retrysafe.gateway import create_app

HOSTILE = str(Path(__file__).with_name("_hostile_upstream.py"))


@pytest.fixture(scope="module")
def origin() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as up:
        yield up.start()


@pytest.fixture(scope="module")
def hostile() -> Iterator[UpstreamProcess]:
    with UpstreamProcess(HOSTILE) as up:
        yield up.start()


def test_encoded_slash_is_another_request_than_a_slash(
    origin: UpstreamProcess,
    gateway: Callable[..., Running],  # noqa: F811
) -> None:
    """The fingerprint covers the exact target forwarded: ``/echo/a%2Fb`` then
    ``/echo/a/b`` with the same key is a conflict, never the first answer replayed."""
    gw = gateway(origin.url)
    headers = {"idempotency-key": "slash-1"}
    status, body = send_target(gw.url, "/echo/a%2Fb", headers)
    assert status == 200 and json.loads(body)["raw_path"] == "/echo/a%2Fb"
    status, body = send_target(gw.url, "/echo/a/b", headers)
    assert status == 422 and json.loads(body)["code"] == "idempotency_conflict", body
    status, body = send_target(gw.url, "/echo/a%2Fb", headers)  # the same target: replayed
    assert status == 200 and json.loads(body)["raw_path"] == "/echo/a%2Fb"


FORGED = {
    "Forwarded": "for=6.6.6.6;proto=https;host=bank.test",
    "X-Forwarded-For": "6.6.6.6",
    "X-Forwarded-Host": "bank.test",
    "X-Forwarded-Proto": "https",
    "X-Forwarded-Port": "443",
    "X-Forwarded-Prefix": "/admin",
    "X-Forwarded-Server": "bank.test",
    "X-Real-IP": "6.6.6.6",
    "True-Client-IP": "6.6.6.6",
    "X-Client-IP": "6.6.6.6",
    "X-Original-URL": "/admin/delete",
    "X-Rewrite-URL": "/admin/delete",
}


def seen_headers(url: str, headers: dict[str, str]) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for name, value in httpx.get(url + "/echo/forwarded", headers=headers).json()["headers"]:
        seen.setdefault(name, []).append(value)
    return seen


@pytest.mark.parametrize("trusted", [(), ("10.0.0.0/8", "::1")], ids=["default", "others"])
def test_forwarding_headers_from_a_client_never_reach_the_upstream(
    origin: UpstreamProcess,
    gateway: Callable[..., Running],  # noqa: F811
    trusted: tuple[str, ...],
) -> None:
    gw = gateway(origin.url, trusted_proxies=trusted)
    seen = seen_headers(gw.url, {**FORGED, "X-Kept": "yes"})
    assert seen["x-kept"] == ["yes"]
    assert seen["x-forwarded-for"] == ["127.0.0.1"]
    assert seen["x-forwarded-host"] == [f"127.0.0.1:{gw.port}"]
    assert seen["x-forwarded-proto"] == ["http"]
    forged = {name.lower() for name in FORGED} - {
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
    }
    assert not forged & set(seen), forged & set(seen)
    assert "6.6.6.6" not in json.dumps(seen) and "bank.test" not in json.dumps(seen)


def test_a_trusted_proxy_forwarding_headers_are_kept_and_extended(
    origin: UpstreamProcess,
    gateway: Callable[..., Running],  # noqa: F811
) -> None:
    gw = gateway(origin.url, trusted_proxies=["127.0.0.0/8"])
    seen = seen_headers(gw.url, FORGED)
    assert seen["x-forwarded-for"] == ["6.6.6.6, 127.0.0.1"]  # the peer appended
    assert seen["x-forwarded-host"] == ["bank.test"]
    assert seen["x-forwarded-proto"] == ["https"]
    for name in (
        "Forwarded",
        "X-Forwarded-Port",
        "X-Forwarded-Prefix",
        "X-Real-IP",
        "True-Client-IP",
    ):
        assert seen[name.lower()] == [FORGED[name]]


def test_a_trusted_proxy_that_is_not_an_address_is_a_value_error(
    origin: UpstreamProcess,
) -> None:
    with pytest.raises(ValueError, match=r"bad trusted proxy 'proxy\.local'"):
        create_app(origin.url, store="memory://", trusted_proxies=["10.0.0.0/8", "proxy.local"])


# -- broken upstream answers -------------------------------------------------------


@pytest.mark.parametrize("path", ["/cut", "/cut10"], ids=["http11", "http10"])
def test_an_answer_ended_by_the_close_is_passed_on_but_never_stored(
    hostile: UpstreamProcess,
    gateway: Callable[..., Running],  # noqa: F811
    path: str,
) -> None:
    """Without a length or chunks, a clean close cannot prove the answer whole: the
    client gets it as it came, the attempt fails, and the retry runs again."""
    gw = gateway(hostile.url)
    key = f"close-{path}"
    headers = {"idempotency-key": key, **CALLER}
    first = httpx.post(gw.url + path, json={}, headers=headers)
    assert first.status_code == 200 and first.text == "run 1: the first half"
    record = gw.record(key)
    assert record.status is Status.FAILED and record.outcome is None
    again = httpx.post(gw.url + path, json={}, headers=headers)
    assert again.text == "run 2: the first half"
    assert "idempotent-replayed" not in again.headers
    plain = httpx.post(gw.url + path, json={}, headers=CALLER)  # unkeyed: passed on as ever
    assert plain.status_code == 200 and plain.text == "run 3: the first half"


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
def test_a_bad_chunk_size_before_the_body_is_the_502_problem(
    hostile: UpstreamProcess,
    gateway: Callable[..., Running],  # noqa: F811
    keyed: bool,
) -> None:
    gw = gateway(hostile.url)
    headers = {"idempotency-key": "chunk-1", **CALLER} if keyed else CALLER
    r = httpx.post(gw.url + "/badchunk", json={}, headers=headers)
    assert r.status_code == 502, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["code"] == "upstream_unavailable"
    assert "RemoteProtocolError" in r.json()["detail"]
    if keyed:
        assert gw.record("chunk-1").status is Status.FAILED


def test_bytes_after_an_answer_close_the_idle_connection(
    hostile: UpstreamProcess,
    gateway: Callable[..., Running],  # noqa: F811
) -> None:
    """Bytes an upstream sends after its answer's end, while the connection waits in
    the pool, close it at once: they never become the next request's answer."""
    gw = gateway(hostile.url)
    assert httpx.post(gw.url + "/late", json={}, headers=CALLER).text == "hello"
    assert httpx.get(hostile.url + "/go").text == "sent"  # the late bytes are on their way
    assert httpx.get(hostile.url + "/closed", timeout=60).text == "closed"
    headers = {"idempotency-key": "after-late", **CALLER}
    r = httpx.post(gw.url + "/next", json={}, headers=headers)
    assert r.status_code == 200 and r.text == "real"
    assert gw.record("after-late").outcome.body == b"real"


def test_a_pooled_connection_with_unread_bytes_is_not_reused(hostile: UpstreamProcess) -> None:
    """Late bytes already in the socket, not yet read by the event loop, when the next
    request takes the connection: the pool checks the socket, and opens another."""
    port = int(hostile.url.rsplit(":", 1)[1])

    async def scenario() -> bytes:
        pool = Pool(("127.0.0.1", port, None), None, 30.0, asyncio.get_running_loop())
        host = [(b"host", b"upstream")]
        answer = await pool.send("POST", b"/late", host, b"")
        assert await answer.read() == b"hello" and await answer.read() == b""
        idle = pool._idle[-1]  # kept alive, waiting for the next request
        assert idle.transport is not None
        fd = idle.transport.get_extra_info("socket").fileno()
        # The loop is not run until the next send: the late bytes stay unread in the socket.
        assert httpx.get(hostile.url + "/go").text == "sent"
        assert select.select([fd], [], [], 30)[0], "the late bytes never came"
        answer = await pool.send("GET", b"/next", host, b"")
        body = b"".join([chunk async for chunk in _chunks(answer)])
        await pool.aclose()
        return body

    assert asyncio.run(scenario()) == b"real"


async def _chunks(answer: Any) -> Any:
    while chunk := await answer.read():
        yield chunk
