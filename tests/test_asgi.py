"""The pure ASGI middleware on a bare ASGI app (no framework), on a real uvicorn."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _hangup import CALLER
from _http_servers import ThreadServer

from retrysafe.asgi import IdempotencyMiddleware


class LateEnd:
    """Sends a complete Content-Length body, then holds the final message back."""

    def __init__(self) -> None:
        self.runs = 0
        self.release = threading.Event()
        self.lifespan: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                self.lifespan.append(message["type"])
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        await receive()
        self.runs += 1
        body = b'{"run":%d}' % self.runs
        await send(
            {
                "type": "http.response.start",
                "status": 201,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(body)),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 10)
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def late() -> Iterator[tuple[LateEnd, str]]:
    app = LateEnd()
    with ThreadServer(IdempotencyMiddleware(app, store="memory://"), "asgi") as server:
        yield app, server.url
        app.release.set()
    assert app.lifespan == ["lifespan.startup", "lifespan.shutdown"]  # passed through


def test_an_answer_is_recorded_when_its_content_length_is_reached(
    late: tuple[LateEnd, str],
) -> None:
    """The client has the whole answer before the app's last message: a retry replays."""
    app, url = late
    headers = {"idempotency-key": uuid.uuid4().hex, **CALLER}
    first = httpx.post(url, json={}, headers=headers, timeout=10)
    assert first.status_code == 201 and first.json() == {"run": 1}
    again = httpx.post(url, json={}, headers=headers, timeout=10)
    assert again.status_code == 201, again.text
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert app.runs == 1


def test_requests_without_a_key_are_untouched(late: tuple[LateEnd, str]) -> None:
    app, url = late
    app.release.set()
    assert httpx.post(url, json={}).json() == {"run": 1}
    assert httpx.post(url, json={}).json() == {"run": 2}


async def test_a_cancelled_request_runs_once() -> None:
    """A server or middleware that cancels the request's task while a sync endpoint
    runs in a thread: the request still ends and is recorded; a retry meanwhile is
    told it is in flight and never runs the endpoint alongside."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from retrysafe import open_store

    entered, release = threading.Event(), threading.Event()
    runs: list[int] = []

    def order(request: Any) -> JSONResponse:  # a sync endpoint: Starlette runs it in a thread
        runs.append(1)
        entered.set()
        assert release.wait(10)
        return JSONResponse({"order": len(runs)}, status_code=201)

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/o", order, methods=["POST"])]), store=open_store("memory://")
    )

    async def post(sent: list[Any]) -> list[Any]:
        done = False

        async def receive() -> Any:
            nonlocal done
            if done:
                await asyncio.Event().wait()  # the client stays until the task is cancelled
            done = True
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/o",
            "raw_path": b"/o",
            "query_string": b"",
            "root_path": "",
            "scheme": "http",
            "http_version": "1.1",
            "headers": [
                (b"idempotency-key", b"k1"),
                (b"content-type", b"application/json"),
                (b"authorization", b"Bearer test-caller"),
            ],
            "server": ("127.0.0.1", 80),
            "client": ("127.0.0.1", 1),
        }
        await app(scope, receive, send)
        return sent

    first_sent: list[Any] = []
    first = asyncio.create_task(post(first_sent))
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        retry = await asyncio.wait_for(post([]), 5)
        assert retry[0]["status"] == 409 and runs == [1]
    finally:
        release.set()
    deadline = asyncio.get_running_loop().time() + 10
    while (answer := await post([]))[0]["status"] == 409:
        assert asyncio.get_running_loop().time() < deadline, "the answer was never recorded"
        await asyncio.sleep(0.01)
    assert answer[0]["status"] == 201 and runs == [1]
    assert (b"idempotent-replayed", b"true") in answer[0]["headers"]
    assert first_sent == []  # the cancelled request heard nothing more


def test_an_answer_with_headers_over_the_bound_is_not_stored_nor_run_again() -> None:
    """72 KiB of answer headers (over MAX_STORED_HEADERS): the client gets them, the
    record keeps nothing of them and is final, so a retry does not run the app again."""
    from _hangup import caller_scope

    from retrysafe import Status, key_hash
    from retrysafe._http.policy import MAX_STORED_HEADERS
    from retrysafe.stores.memory import MemoryStore

    runs = 0
    big = [(b"x-big-%d" % i, b"v" * (9 << 10)) for i in range(8)]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal runs
        if scope["type"] != "http":
            return  # lifespan: nothing to start
        await receive()
        runs += 1
        await send({"type": "http.response.start", "status": 200, "headers": big})
        await send({"type": "http.response.body", "body": b"done"})

    assert sum(len(k) + len(v) for k, v in big) > MAX_STORED_HEADERS
    store = MemoryStore()
    with ThreadServer(IdempotencyMiddleware(app, store=store), "asgi") as server:
        headers = {"idempotency-key": uuid.uuid4().hex, **CALLER}
        first = httpx.post(server.url, json={}, headers=headers, timeout=10)
        assert first.status_code == 200 and first.content == b"done"
        assert first.headers["x-big-7"] == "v" * (9 << 10)  # passed through whole
        record = store.get(key_hash(caller_scope(store), "http", headers["idempotency-key"]))
        assert record.status is Status.FAILED and record.final and record.outcome is None
        again = httpx.post(server.url, json={}, headers=headers, timeout=10)
        assert again.status_code == 500 and again.json()["code"] == "idempotency_failed"
        assert again.headers["idempotent-replayed"] == "true"
    assert runs == 1


@pytest.mark.parametrize("fail_mode", ["open", "closed"])
@pytest.mark.parametrize(
    "headers", [[], [(b"idempotency-key", b"k1")]], ids=["no-key", "anonymous"]
)
async def test_the_apps_own_idempotency_error_is_neither_rerun_nor_answered(
    fail_mode: str, headers: list[tuple[bytes, bytes]]
) -> None:
    """An app that raises an IdempotencyError of its own (its store is down, say) on a
    request the middleware lets through unrecorded (no key; a keyed request from an
    anonymous caller): the error is the app's, so it propagates as it is; the app is
    not run a second time under fail_mode="open" nor answered with a refusal."""
    from retrysafe import StoreUnavailableError, open_store

    runs: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        runs.append(1)
        raise StoreUnavailableError("the app's own store is down")

    middleware = IdempotencyMiddleware(app, store=open_store("memory://"), fail_mode=fail_mode)
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/o",
        "raw_path": b"/o",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
    }
    with pytest.raises(StoreUnavailableError, match="the app's own store"):
        await middleware(scope, receive, send)
    assert runs == [1]
    assert sent == []


async def test_to_the_end_hands_over_the_outcome_and_outlives_its_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The handling's result or exception reaches its caller; a caller cancelled
    meanwhile leaves it running to its end, and its failure is logged."""
    from retrysafe._http import asgi

    async def seven() -> int:
        return 7

    async def fails() -> int:
        raise ValueError("no")

    assert await asgi.to_the_end(seven()) == 7
    with pytest.raises(ValueError, match="no"):
        await asgi.to_the_end(fails())

    started, release, ended = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow() -> None:
        started.set()
        try:
            await release.wait()
            raise ValueError("late")
        finally:
            ended.set()

    caller = asyncio.create_task(asgi.to_the_end(slow()))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert not ended.is_set() and len(asgi._orphans) == 1  # it runs on, held
    release.set()
    await ended.wait()
    for _ in range(3):  # the task's last step and its done callback
        await asyncio.sleep(0)
    assert not asgi._orphans
    assert "the handling of a cancelled request failed: ValueError('late')" in caplog.text
