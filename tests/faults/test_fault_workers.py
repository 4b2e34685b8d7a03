"""A worker process SIGKILLed mid-request, under keyed load on a shared store.

Two front doors, each with two worker processes on one store:

- the ASGI middleware in ``uvicorn --workers 2`` (SQLite, Redis, PostgreSQL): the
  worker dies while its handler has started but done nothing yet;
- ``retrysafe gateway --workers 2`` in front of an upstream process: the gateway
  worker dies after the upstream did the side effect, before its answer came back
  (so before the record could be completed).

The victim's lease (a few seconds, set for the test) keeps running after the kill,
because nobody renews it any more; the retries wait on what the store says
(``lease_until``), never on a sleep of a guessed length.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from _fault_apps import connect
from _faults import (
    Answer,
    Load,
    Server,
    check_answers,
    check_problem,
    check_runs,
    children,
    client,
    effects,
    first_of,
    pid_with_local_port,
    post,
    wait_for,
    work_server,
)
from _hangup import caller_scope
from _http_servers import free_port, uvicorn_argv
from conftest import SHARED_STORES, store_url

from retrysafe import Status, key_hash, open_store

#: The lease of every attempt: long enough that a retry sent right after the kill
#: lands while it runs (the heartbeat renews it every third, so at least two thirds
#: are left at the kill), short enough to wait out.
LEASE = 6.0
KEYS = 24


def retry_through_lease(url: str, key: str, lease_until: float, body: dict) -> list[Answer]:
    """Retry ``key`` until an answer other than 409; check every 409 against the lease.

    A 409 must have been sent before ``lease_until`` (the store refuses a takeover
    only while the lease runs), and must be an ``idempotency_in_flight`` problem
    with a Retry-After.
    """
    answers = []
    with client() as c:
        while True:
            a = post(c, url, key, body)
            answers.append(a)
            if a.status != 409:
                break
            check_problem(a, 409, "idempotency_in_flight")
            assert a.sent < lease_until, f"409 after the lease ran out: {a}"
            assert time.time() < lease_until + 60, "no takeover a minute after the lease"
            time.sleep(0.2)
    during = [a for a in answers if a.status == 409 and a.received < lease_until]
    assert during, f"no retry was refused while the lease ran: {answers}"
    return answers


def replays(url: str, key: str, body: dict, expected: Answer) -> None:
    """Two more retries replay ``expected`` exactly."""
    with client() as c:
        for _ in range(2):
            a = post(c, url, key, body)
            assert a.status == expected.status and a.replayed, a
            assert a.body == expected.body, a


@pytest.mark.parametrize("name", SHARED_STORES)
def test_middleware_worker_killed_mid_request(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """What the client sees when the worker running its request is SIGKILLed:

    - the request itself: no answer (the connection breaks);
    - its retries with the same key, while the dead worker's lease runs: 409
      ``idempotency_in_flight`` with ``Retry-After``;
    - the first retry after the lease ran out: 201 from a takeover that runs the
      handler (its side effect once, since the dead worker had done none);
    - every later retry: that same 201, ``Idempotent-Replayed: true``.

    Meanwhile 24 keys, 3 racing copies each, run through both workers: each ran
    once and its answers agree, except a key whose side effect the killed worker
    did but never answered (no client saw it), which may run again (none expected).
    """
    url = store_url(name, request, tmp_path)
    with work_server(tmp_path, url, LEASE) as app:
        work = app.url + "/work"
        victim, body = f"victim-{uuid.uuid4().hex[:8]}", {"hold": True}
        held: list[Answer] = []
        first = threading.Thread(target=lambda: held.append(post(client(), work, victim, body)))
        first.start()

        started = "SELECT pid FROM starts WHERE key = ?"
        pid = wait_for("the victim's handler to start", lambda: first_of(tmp_path, started, victim))
        keys = [f"k{i}-{uuid.uuid4().hex[:6]}" for i in range(KEYS)]
        load = Load(work, keys, copies=3).start()
        wait_for("a first part of the load to be answered", lambda: len(load.ok_keys()) >= 4)

        os.kill(pid, signal.SIGKILL)
        first.join(60)
        assert held and held[0].status is None, held  # the connection broke, no answer

        store = open_store(url)
        try:
            record = store.get(key_hash(caller_scope(store), "http", victim))
        finally:
            store.close()
        assert record is not None and record.status is Status.PROCESSING, record
        lease_until = record.lease_until
        retries = retry_through_lease(work, victim, lease_until, body)
        takeover = retries[-1]
        assert takeover.status == 201 and not takeover.replayed, takeover
        assert takeover.received >= lease_until
        runs = effects(tmp_path)
        assert len(runs[victim]) == 1 and runs[victim][0][1] != pid, runs[victim]
        assert takeover.doc()["effect"] == runs[victim][0][0]
        replays(work, victim, body, takeover)

        answers = load.join()
        seen = check_answers(answers, {201, 409, None})
        runs = effects(tmp_path)
        answered = {a.doc()["effect"] for a in answers if a.ok}
        # The documented exception: the killed worker did the effect, nobody saw it.
        excused = {k for k in keys if any(p == pid and n not in answered for n, p in runs[k])}
        check_runs(answers, runs, keys, excused)
        with client() as c:  # every key's answer is stored: a retry now replays it
            for key in keys:
                a = post(c, work, key, {"n": key})
                assert a.status == 201 and a.replayed and a.doc()["effect"] == runs[key][-1][0]
        print(f"\n{name}: load answers {seen}, excused {sorted(excused)}")


MAP = f"""
[operations.charge]
key = "charge:{{id}}"
scope = "order"
lease = "{LEASE:g}s"

[[routes]]
method = "POST"
path = "/charge"
operation = "charge"
"""


def _local_ports(pid: int) -> set[int]:
    """The local ports of ``pid``'s TCP sockets (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.parametrize("name", ["sqlite", "postgres"])
def test_gateway_worker_killed_after_the_upstream_ran(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A gateway worker SIGKILLed while the upstream answers: the upstream's effect ran,
    the record was never completed. What the client sees:

    - the request itself: no answer (the connection breaks);
    - retries while the dead worker's lease runs: 409 ``idempotency_in_flight``
      with ``Retry-After``;
    - the first retry after the lease: the gateway takes over and forwards the
      request again, with the same ``Idempotency-Key``: the upstream is called a
      second time. That is the documented limit (docs/gateway.md: the upstream sees
      the key, so it can dedupe); this upstream dedupes on it, so the side effect
      still happened once and the answer (201) names the first effect;
    - later retries: that 201, replayed.

    The concurrent load (24 keys x 3 copies): every key answered 2xx, its answers
    agree, and the upstream was called once per key, except for keys whose call was
    in flight on the killed worker (those reach the upstream again, deduped there).
    """
    url = store_url(name, request, tmp_path)
    connect(tmp_path).close()
    up_port, gw_port = free_port(), free_port()
    env = {"FAULT_ROOT": str(tmp_path)}
    (tmp_path / "map.toml").write_text(MAP)
    # Without proxy headers: the upstream sees the gateway worker's own port, not the
    # client's address from X-Forwarded-For.
    up_argv = [*uvicorn_argv("_fault_apps:upstream_from_env", up_port), "--no-proxy-headers"]
    with Server(up_argv, up_port, env, "/health", tmp_path / "upstream.log") as upstream:
        gw_argv = [
            sys.executable,
            "-m",
            "retrysafe",
            "gateway",
            "--upstream",
            upstream.url,
            "--store",
            url,
            "--listen",
            f"127.0.0.1:{gw_port}",
            "--workers",
            "2",
            "--map",
            str(tmp_path / "map.toml"),
        ]
        with Server(gw_argv, gw_port, {}, "/_retrysafe/health", tmp_path / "gw.log") as gw:
            charge = gw.url + "/charge"
            victim, body = f"victim-{uuid.uuid4().hex[:8]}", {"hold": True}
            held: list[Answer] = []
            first = threading.Thread(
                target=lambda: held.append(post(client(), charge, victim, body))
            )
            first.start()

            called = "SELECT port FROM calls WHERE key = ?"
            port = wait_for(
                "the upstream to get the victim's call", lambda: first_of(tmp_path, called, victim)
            )
            pid = wait_for(
                "the gateway worker that forwards it",
                lambda: pid_with_local_port(children(gw.proc.pid), port),  # type: ignore[union-attr]
            )
            keys = [f"k{i}-{uuid.uuid4().hex[:6]}" for i in range(KEYS)]
            load = Load(charge, keys, copies=3).start()
            wait_for("a first part of the load to be answered", lambda: len(load.ok_keys()) >= 4)

            # Frozen first, so that the ports it calls the upstream from are all known.
            os.kill(pid, signal.SIGSTOP)
            ports = _local_ports(pid)
            os.kill(pid, signal.SIGKILL)
            first.join(60)
            assert held and held[0].status is None, held

            store = open_store(url)
            try:
                record = store.get(key_hash(caller_scope(store), "charge", victim))
            finally:
                store.close()
            assert record is not None and record.status is Status.PROCESSING, record
            retries = retry_through_lease(charge, victim, record.lease_until, body)
            takeover = retries[-1]
            assert takeover.status == 201 and not takeover.replayed, takeover
            calls = calls_now(tmp_path)
            assert next(p for k, p in calls if k == victim) == port
            assert sum(k == victim for k, _ in calls) == 2  # forwarded again: the limit
            ran = effects(tmp_path, "upstream_effects")
            assert [n for n, _ in ran[victim]] == [takeover.doc()["effect"]]  # deduped: once
            replays(charge, victim, body, takeover)

            answers = load.join()
            seen = check_answers(answers, {201, 409, None})
            ran = effects(tmp_path, "upstream_effects")
            # A key's "runs" are its calls upstream, each naming the key's one effect.
            runs = {
                k: [(ran[k][0][0], p) for kk, p in calls_now(tmp_path) if kk == k] for k in keys
            }
            # Run again upstream only where the first call was the killed worker's.
            excused = {k for k in keys if len(runs[k]) > 1 and runs[k][0][1] in ports}
            check_runs(answers, runs, keys, excused)
            (tmp_path / "release").touch()  # let the upstream's held handler finish
            print(f"\n{name}: load answers {seen}, excused {sorted(excused)}")


def calls_now(root: Path) -> list[tuple[str, int]]:
    conn = sqlite3.connect(root / "effects.db", timeout=30)
    try:
        return conn.execute("SELECT key, port FROM calls ORDER BY t").fetchall()
    finally:
        conn.close()
