"""A request that runs longer than its lease keeps its key, on every front door.

The first request runs for 2.5 leases (it waits for an event the test sets);
meanwhile its duplicate, retried every 50 ms, must always be told "in flight"
and never take the key over. Afterwards the duplicate replays the answer, and
the side effect happened once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from _hangup import CALLER
from _http_servers import ThreadServer

from retrysafe import Engine, Store, open_store
from retrysafe.a2a import A2AIdempotency
from retrysafe.mesh import MeshIdempotency
from retrysafe.stores.memory import MemoryStore

LEASE = 1.0


class Slow:
    """The side effect: counts runs, and holds each run until released."""

    def __init__(self) -> None:
        self.runs = 0
        self.started, self.release = threading.Event(), threading.Event()

    def run(self) -> int:
        self.runs += 1
        self.started.set()
        assert self.release.wait(timeout=30)
        return self.runs


# Each front door: a context manager yielding call() -> "in flight" | the answer.


@contextmanager
def asgi(engine: Engine, slow: Slow) -> Iterator[Callable[[], Any]]:
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from retrysafe.asgi import IdempotencyMiddleware

    async def order(request: Any) -> JSONResponse:
        return JSONResponse({"run": await run_in_threadpool(slow.run)}, status_code=201)

    app = IdempotencyMiddleware(Starlette(routes=[Route("/o", order, methods=["POST"])]), engine)
    with ThreadServer(app, "asgi") as server:
        yield _http_call(server.url)


@contextmanager
def wsgi(engine: Engine, slow: Slow) -> Iterator[Callable[[], Any]]:
    from flask import Flask

    from retrysafe.wsgi import IdempotencyMiddleware

    flask = Flask(__name__)
    flask.add_url_rule("/o", "o", lambda: ({"run": slow.run()}, 201), methods=["POST"])
    with ThreadServer(IdempotencyMiddleware(flask, engine), "wsgi") as server:
        yield _http_call(server.url)


def _http_call(url: str) -> Callable[[], Any]:
    def call() -> Any:
        with httpx.Client(timeout=30) as client:
            answer = client.post(
                f"{url}/o", json={"n": 1}, headers={"Idempotency-Key": "k1", **CALLER}
            )
        if answer.status_code == 409:
            return "in flight"
        assert answer.status_code == 201, answer.text
        return answer.json()["run"]

    return call


@contextmanager
def mesh(engine: Engine, slow: Slow) -> Iterator[Callable[[], Any]]:
    door = MeshIdempotency(engine)
    envelope = {
        "protocol": {"name": "mesh", "version": "0.1.0"},
        "id": "req_1",
        "call": {"function": "orders.create", "version": "1", "arguments": {"n": 1}},
        "extensions": [{"urn": "urn:mesh:ext:idempotency", "options": {"key": "k1"}}],
    }

    def call() -> Any:
        answer = door.handle(envelope, lambda call: {"run": slow.run()})
        if "errors" in answer:
            assert answer["errors"][0]["code"] == "IDEMPOTENCY_PROCESSING"
            return "in flight"
        return answer["result"]["run"]

    yield call


@contextmanager
def a2a(engine: Engine, slow: Slow) -> Iterator[Callable[[], Any]]:
    door = A2AIdempotency(engine)
    request = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "message/send",
        "params": {
            "message": {
                "kind": "message",
                "messageId": "m1",
                "role": "user",
                "parts": [{"kind": "text", "text": "order one"}],
            }
        },
    }

    def handler(request: dict[str, Any]) -> dict[str, Any]:
        run = slow.run()
        task = {
            "kind": "task",
            "id": f"t{run}",
            "contextId": "c1",
            "status": {"state": "completed"},
        }
        return {"jsonrpc": "2.0", "id": request["id"], "result": task}

    def call() -> Any:
        answer = door.handle(request, handler)
        if "error" in answer:
            assert answer["error"]["data"]["code"] == "idempotency_in_flight"
            return "in flight"
        return int(answer["result"]["id"][1:])

    yield call


DOORS = {"asgi": asgi, "wsgi": wsgi, "mesh": mesh, "a2a": a2a}


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store[Any]]:
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path}/hb.db"
    s = open_store(url)
    yield s
    s.close()


@pytest.mark.parametrize("door", DOORS)
def test_a_long_request_keeps_its_key(store: Store[Any], door: str) -> None:
    slow = Slow()
    with DOORS[door](Engine(store, lease=LEASE), slow) as call:
        first: list[Any] = []
        thread = threading.Thread(target=lambda: first.append(call()))
        thread.start()
        assert slow.started.wait(timeout=30)
        answers = []
        deadline = time.monotonic() + 2.5 * LEASE
        while time.monotonic() < deadline:
            answers.append(call())
            time.sleep(0.05)  # a client's retry interval
        slow.release.set()
        thread.join(timeout=30)
        assert set(answers) == {"in flight"}, answers
        assert first == [1] and call() == 1 and slow.runs == 1


# -- the heartbeat itself -------------------------------------------------------------


def _hold_and_probe(call: Callable[[], Any], slow: Slow, leases: float = 2.5) -> list[Any]:
    """Start ``call`` in a thread; while it runs, probe it every 50 ms; return the probes."""
    first: list[Any] = []
    thread = threading.Thread(target=lambda: first.append(call()))
    thread.start()
    assert slow.started.wait(timeout=30)
    answers = []
    deadline = time.monotonic() + leases * LEASE
    while time.monotonic() < deadline:
        answers.append(call())
        time.sleep(0.05)  # a client's retry interval
    slow.release.set()
    thread.join(timeout=30)
    assert first == [1]
    return answers


class FlakyRenewals(MemoryStore):
    """A store whose first renewals fail with an unexpected error (a broken driver)."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> Any:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("driver hiccup")
        return super()._renew(key_hash, token, lease_until, now)


def test_renewal_survives_unexpected_errors(caplog: pytest.LogCaptureFixture) -> None:
    store = FlakyRenewals(failures=2)
    slow = Slow()
    with mesh(Engine(store, lease=LEASE), slow) as call:
        assert set(_hold_and_probe(call, slow)) == {"in flight"}
        assert call() == 1 and slow.runs == 1
    assert store.failures == 0 and "driver hiccup" in caplog.text
    slow2 = Slow()  # and the heartbeat thread still serves the next long call
    with mesh(Engine(MemoryStore(), lease=LEASE), slow2) as call:
        assert set(_hold_and_probe(call, slow2)) == {"in flight"} and slow2.runs == 1


def test_a_request_ttl_shorter_than_the_handler_keeps_the_key() -> None:
    """Mesh: a duplicate while processing never starts new processing, whatever the ttl."""
    slow = Slow()
    door = MeshIdempotency(Engine(MemoryStore(), lease=LEASE))
    envelope = {
        "protocol": {"name": "mesh", "version": "0.1.0"},
        "id": "req_1",
        "call": {"function": "orders.create", "version": "1", "arguments": {}},
        "extensions": [
            {
                "urn": "urn:mesh:ext:idempotency",
                "options": {"key": "k1", "ttl": {"value": 500, "unit": "millisecond"}},
            }
        ],
    }

    def call() -> Any:
        answer = door.handle(envelope, lambda call: slow.run())
        return "in flight" if "errors" in answer else answer["result"]

    assert set(_hold_and_probe(call, slow, leases=3)) == {"in flight"}
    assert call() == 1 and slow.runs == 1


def test_finished_calls_are_let_go() -> None:
    """Watches of finished calls do not pile up (they hold the attempt and its answer)."""
    from retrysafe import idempotent
    from retrysafe._core.heartbeat import _heartbeat

    big = "x" * 10_000

    @idempotent(store=Engine(MemoryStore(), lease=600), key="{n}")
    def fn(n: int) -> str:
        return big

    for n in range(2000):
        fn(n)
    assert not _heartbeat.active  # nothing is kept once a call ends


async def test_a_long_async_call_keeps_its_key() -> None:
    import asyncio

    from retrysafe import InProgressError, idempotent

    runs: list[int] = []
    release = asyncio.Event()

    @idempotent(store=Engine(MemoryStore(), lease=LEASE), key="k", validate=())
    async def slow() -> int:
        runs.append(1)
        await release.wait()
        return len(runs)

    first = asyncio.create_task(slow())
    await asyncio.sleep(0)
    probes = []
    deadline = time.monotonic() + 2.5 * LEASE
    while time.monotonic() < deadline:
        try:
            probes.append(await slow())
        except InProgressError:
            probes.append("in flight")
        await asyncio.sleep(0.05)
    release.set()
    assert await first == 1 and set(probes) == {"in flight"} and await slow() == 1
