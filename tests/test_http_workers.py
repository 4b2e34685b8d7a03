"""Four worker processes on one shared store: still one run per key and caller.

Starlette on ``uvicorn --workers 4``, Flask and Django on ``gunicorn -w 4``
and the gateway on ``retrysafe gateway --workers 4``, each on SQLite, Redis
and PostgreSQL; duplicates race across processes, and two callers race on
every key (one by bearer token, one by a session cookie beside an analytics
cookie that changes with every copy): each caller's request runs once.
"""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from _http_apps import Counter
from _http_servers import Process, free_port, gunicorn_argv, uvicorn_argv
from conftest import SHARED_STORES, store_url

WORKERS = 4
#: The two callers of every key: a bearer token, and a session cookie beside an
#: analytics cookie that is new on every copy.
CALLERS = {
    "a": lambda: {"authorization": "Bearer alice"},
    "b": lambda: {"cookie": f"session=bob; _ga=GA1.1.{uuid.uuid4().int % 10**9}"},
}


def _argv(door: str, port: int, store: str, upstream: str | None) -> list[str]:
    if door == "starlette":
        return uvicorn_argv("_http_apps:starlette_from_env", port, WORKERS)
    if door in ("flask", "django"):
        return gunicorn_argv(f"_http_apps:{door}_from_env()", port, WORKERS)
    assert upstream is not None
    return [
        sys.executable,
        "-m",
        "retrysafe",
        "gateway",
        "--upstream",
        upstream,
        "--store",
        store,
        "--listen",
        f"127.0.0.1:{port}",
        "--workers",
        str(WORKERS),
        "--admin-loopback",
    ]


@pytest.fixture(
    params=[(d, s) for d in ("starlette", "flask", "django", "gateway") for s in SHARED_STORES],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def workers(
    request: pytest.FixtureRequest, counter: Counter, tmp_path: Path
) -> Iterator[tuple[str, str]]:
    door, store_name = request.param
    store = store_url(store_name, request, tmp_path)
    upstream = request.getfixturevalue("upstream") if door == "gateway" else None
    port = free_port()
    metrics = tmp_path / "metrics"  # the workers' counters, added up by any of them
    metrics.mkdir()
    env = {
        "RETRYSAFE_TEST_COUNTERS": str(counter.root),
        "RETRYSAFE_TEST_STORE": store,
        "PROMETHEUS_MULTIPROC_DIR": str(metrics),
    }
    health = "/_retrysafe/health" if door == "gateway" else "/count/none"
    with Process(_argv(door, port, store, upstream), port, env, health=health) as proc:
        yield door, proc.url


ROUNDS = 3


def test_duplicates_across_worker_processes_run_once(
    workers: tuple[str, str], counter: Counter
) -> None:
    """20 keys, 10 concurrent copies each (5 from each of two callers), 50 at a
    time, over 4 processes.

    Every round must run each key once. The kernel, not the test, decides which
    worker accepts a connection, and an async worker can take a whole round by
    itself now and then (seen once in CI); such a round proves nothing about
    processes racing, so another round with new keys follows, up to ROUNDS.
    """
    door, url = workers
    metrics = f"{url}/_retrysafe/metrics" if door == "gateway" else f"{url}/_metrics/"
    seen: list[set[str]] = []
    for _ in range(ROUNDS):
        before = _totals(metrics)
        pids = _round(url, counter)
        # Every worker's counters, added up by whichever worker answers the scrape.
        for _ in range(3):
            after = _totals(metrics)
            assert after["executions"] - before["executions"] == 40, (before, after)
            keyed = sum(after[n] - before[n] for n in ("executions", "replays", "in_flight"))
            assert keyed == 200 and after["conflicts"] == before["conflicts"], (before, after)
        seen.append(pids)
        if door == "gateway" or len(pids) >= 2:  # the gateway's upstream is one process
            return
    pytest.fail(f"the load never reached a second worker in {ROUNDS} rounds: {seen}")


_COUNTERS = {
    "executions": "retrysafe_executions_total",
    "replays": "retrysafe_replays_total",
    "in_flight": "retrysafe_in_flight_conflicts_total",
    "conflicts": "retrysafe_fingerprint_conflicts_total",
}


def _totals(url: str) -> dict[str, float]:
    """The retrysafe counters that a scrape of ``url`` reports, summed over operations."""
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200, r.text
    totals = dict.fromkeys(_COUNTERS, 0.0)
    for line in r.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, metric in _COUNTERS.items():
            if name == metric:
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals


def _round(url: str, counter: Counter) -> set[str]:
    """One storm of keyed duplicates from two callers, with unkeyed requests mixed in.

    Returns the pids that ran handlers: each unkeyed request runs one, so they
    show which workers took the load.
    """
    keys = [uuid.uuid4().hex for _ in range(20)]
    tids = [f"{key}-{who}" for key in keys for who in CALLERS]
    filler = uuid.uuid4().hex
    # One unkeyed request before every third keyed one.
    jobs: list[str | None] = []
    for i, tid in enumerate(tid for tid in tids for _ in range(5)):
        jobs.extend((None, tid) if i % 3 == 0 else (tid,))

    local = threading.local()
    clients: list[httpx.Client] = []

    def send(tid: str | None) -> httpx.Response:
        if tid is None:
            headers = {"x-test-id": filler}
        else:
            key, who = tid.split("-")
            headers = {"x-test-id": tid, "idempotency-key": f"k-{key}", **CALLERS[who]()}
        # A client per thread (httpx's shared pool raced under this load) and a new
        # connection per request, so the kernel spreads them over the workers.
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=60, headers={"connection": "close"})
            clients.append(local.client)
        body = {"t": tid and tid.split("-")[0]}  # one request for both callers
        return local.client.post(f"{url}/slow?ms=200", json=body, headers=headers)

    with ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(send, jobs))
    for client in clients:
        client.close()
    keyed = [r for r, tid in zip(answers, jobs, strict=True) if tid is not None]
    unkeyed = [r for r, tid in zip(answers, jobs, strict=True) if tid is None]
    assert {r.status_code for r in keyed} <= {200, 409}, [r.text for r in keyed][:3]
    assert {r.status_code for r in unkeyed} == {200}
    assert [counter.count(tid) for tid in tids] == [1] * len(tids)
    assert counter.count(filler) == len(unkeyed)
    ran = [r for r in keyed if r.status_code == 200 and "idempotent-replayed" not in r.headers]
    assert len(ran) == len(tids)
    for tid in tids:  # a caller's replays are its own answer, never the other caller's
        mine = [r for r, t in zip(answers, jobs, strict=True) if t == tid and r.status_code == 200]
        assert len({r.content for r in mine}) == 1, tid
    return {r.headers.get("x-pid", "?") for r in ran + unkeyed}
