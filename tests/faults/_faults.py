"""What the fault tests share: servers that can be crashed, keyed load, and the checks.

- :class:`Server`: a server command in its own process group (as
  ``_http_servers.Process``) whose output goes to a log file, so a test can read
  what it logged and a chatty server never blocks on a full pipe.
- :class:`CrashableRedis` and :class:`CrashablePostgres`: ``_servers``' servers
  that :meth:`kill` SIGKILLs (PostgreSQL: the postmaster and every backend) and
  ``start()`` brings back on the same port and data. The PostgreSQL one runs with
  the server's durable defaults (``fsync``, ``synchronous_commit``,
  ``full_page_writes`` on), not the fast test settings.
- :class:`Load`: threads that send keyed requests, several copies of each key at
  once, each copy retrying until it gets a 2xx; every answer is kept with its times.
- :func:`check_answers` and :func:`check_runs`: what every fault case asserts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _fault_apps import connect
from _hangup import CALLER, caller_scope
from _http_servers import TESTS, Process, free_port, uvicorn_argv, wait_until_up
from _servers import PostgresServer, RedisServer, _pg_bin

from retrysafe import key_hash, open_store

FAULTS = Path(__file__).resolve().parent
PROBLEM = "application/problem+json"


def wait_for(what: str, condition: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Poll ``condition`` until it returns something true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


# -- processes ---------------------------------------------------------------------------


class Server(Process):
    """:class:`Process` with its output in ``log`` instead of a pipe."""

    def __init__(
        self, argv: list[str], port: int, env: dict[str, str], health: str, log: Path
    ) -> None:
        super().__init__(argv, port, env, health)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(FAULTS), str(TESTS), os.environ.get("PYTHONPATH", "")]
        )
        self.log = log

    def __enter__(self) -> Server:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_until_up(self.url + self.health, timeout=60, proc=self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def work_server(root: Path, store: str, lease: float) -> Server:
    """:class:`~_fault_apps.Work` behind the middleware on ``store`` with ``lease``, in
    ``uvicorn --workers 2``, logging to ``root/app.log`` (enter it to start it)."""
    connect(root).close()  # the effects file, made before the workers race to make it
    port = free_port()
    env = {"FAULT_ROOT": str(root), "FAULT_STORE": store, "FAULT_LEASE": str(lease)}
    argv = uvicorn_argv("_fault_apps:app_from_env", port, workers=2)
    return Server(argv, port, env, "/health", root / "app.log")


def first_of(root: Path, query: str, key: str) -> Any:
    """The first column of the first row ``query`` finds for ``key`` in the effects
    file, or None."""
    conn = sqlite3.connect(root / "effects.db", timeout=30)
    try:
        row = conn.execute(query, (key,)).fetchone()
    finally:
        conn.close()
    return row[0] if row else None


def children(pid: int) -> list[int]:
    """The live descendants of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] not in "ZX":
                parents[int(entry)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent:
                found.append(child)
                frontier.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: nobody here reaps reparented processes)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in "ZX"


def pid_with_local_port(pids: Iterable[int], port: int) -> int | None:
    """Which of ``pids`` owns the TCP socket bound to local port ``port`` (from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return pid
            except OSError:
                continue
    return None


class CrashableRedis(RedisServer):
    """A Redis server that :meth:`kill` SIGKILLs; ``start()`` brings it back."""

    def kill(self) -> None:
        proc = self._proc
        assert proc is not None and proc.poll() is None, "redis-server is not running"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


class CrashablePostgres(PostgresServer):
    """PostgreSQL with its durable defaults, that :meth:`kill` crashes (SIGKILL to all)."""

    def _pg_ctl_start(self) -> None:
        assert self._base is not None
        opts = (
            f"-p {self.port} -k {self._base / 'sock'} -c listen_addresses=127.0.0.1"
            " -c max_connections=200"
        )
        self._run(
            _pg_bin("pg_ctl"),
            "-D",
            str(self._base / "data"),
            "-o",
            opts,
            "-l",
            str(self._base / "postgres.log"),
            "-w",
            "-t",
            "60",
            "start",
        )

    def kill(self) -> None:
        """SIGKILL the postmaster and all its processes at once, as a crash would."""
        assert self._base is not None
        lock = self._base / "data" / "postmaster.pid"
        postmaster = int(lock.read_text().split()[0])
        victims = [postmaster, *children(postmaster)]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for("the killed PostgreSQL processes to die", lambda: not any(map(alive, victims)))
        # The dead postmaster stays a zombie (nothing reaps it here), and its pid in
        # the lock files would look alive to the next one: remove them, as an
        # operator does once the processes are gone. The data directory is untouched.
        lock.unlink()
        for stale in (self._base / "sock").glob(".s.PGSQL.*"):
            stale.unlink()


# -- load --------------------------------------------------------------------------------


@dataclass
class Answer:
    """One request and what came back (``status`` None: no answer, the connection broke)."""

    key: str
    status: int | None
    headers: dict[str, str]
    body: bytes
    sent: float  # time.time(), comparable with the store's lease_until
    received: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def replayed(self) -> bool:
        return self.headers.get("idempotent-replayed") == "true"

    def doc(self) -> Any:
        return json.loads(self.body)


def post(client: httpx.Client, url: str, key: str, body: dict[str, Any]) -> Answer:
    """POST ``body`` with ``key``; a broken connection is an Answer with status None."""
    sent = time.time()
    try:
        r = client.post(url, json=body, headers={"idempotency-key": key})
    except httpx.TransportError as exc:
        return Answer(key, None, {}, b"", sent, time.time(), f"{type(exc).__name__}: {exc}")
    return Answer(key, r.status_code, dict(r.headers), r.content, sent, time.time())


def client() -> httpx.Client:
    """A client whose every request opens a new connection (the kernel spreads them over
    workers, and no request waits on a connection a dead worker held)."""
    return httpx.Client(timeout=60, headers={"connection": "close", **CALLER})


@dataclass
class Load:
    """``copies`` threads per key, racing; each sends until it gets a 2xx (or the deadline).

    Between tries a copy waits ``pause`` seconds (not the Retry-After, to keep the
    test short: the checks read the Retry-After instead).
    """

    url: str
    keys: list[str]
    copies: int = 2
    threads: int = 12
    pause: float = 0.1
    deadline: float = 150.0
    answers: list[Answer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs = [k for k in self.keys for _ in range(self.copies)]
        self._next = 0
        self._stop_at = time.monotonic() + self.deadline
        self._threads = [
            threading.Thread(target=self._work, daemon=True) for _ in range(self.threads)
        ]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def _take(self) -> str | None:
        with self._lock:
            if self._next >= len(self._jobs):
                return None
            self._next += 1
            return self._jobs[self._next - 1]

    def _work(self) -> None:
        with client() as c:
            while (key := self._take()) is not None:
                while time.monotonic() < self._stop_at:
                    answer = post(c, self.url, key, {"n": key})
                    with self._lock:
                        self.answers.append(answer)
                    if answer.ok:
                        break
                    time.sleep(self.pause)

    def snapshot(self) -> list[Answer]:
        with self._lock:
            return list(self.answers)

    def ok_keys(self) -> set[str]:
        return {a.key for a in self.snapshot() if a.ok}

    def join(self) -> list[Answer]:
        for t in self._threads:
            t.join(self.deadline + 30)
            assert not t.is_alive(), "a load thread is still running past its deadline"
        return self.snapshot()


# -- checks ------------------------------------------------------------------------------


def check_problem(answer: Answer, status: int, code: str) -> None:
    """``answer`` is an RFC 9457 problem ``status``/``code`` with a whole-second Retry-After."""
    assert answer.status == status, answer
    assert answer.headers.get("content-type") == PROBLEM, answer
    assert answer.doc()["code"] == code, answer
    retry_after = answer.headers.get("retry-after", "")
    assert retry_after.isdigit() and int(retry_after) >= 1, answer


def check_answers(answers: list[Answer], allowed: set[int | None]) -> dict[int | None, int]:
    """Every answer's status is in ``allowed``; 409 and 503 are well-formed problems.

    Returns how many answers had each status.
    """
    seen: dict[int | None, int] = defaultdict(int)
    for a in answers:
        seen[a.status] += 1
        assert a.status in allowed, f"unexpected answer {a}"
        if a.status == 409:
            check_problem(a, 409, "idempotency_in_flight")
        elif a.status == 503:
            check_problem(a, 503, "idempotency_store_unavailable")
        elif a.ok and not a.replayed:
            assert a.doc()["key"] == a.key, a
    return dict(seen)


def effects(root: Path, table: str = "effects") -> dict[str, list[tuple[int, int]]]:
    """Each key's side effects, in order: (effect number, pid) (pid 0 upstream)."""
    conn = sqlite3.connect(root / "effects.db", timeout=60)
    try:
        pid = "pid" if table == "effects" else "0"
        rows = conn.execute(f"SELECT key, n, {pid} FROM {table} ORDER BY n").fetchall()
    finally:
        conn.close()
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for key, n, p in rows:
        out[key].append((n, p))
    return out


def check_runs(
    answers: list[Answer],
    runs: dict[str, list[tuple[int, int]]],
    keys: Iterable[str],
    excused: set[str] = frozenset(),  # type: ignore[assignment]
) -> None:
    """Every key was answered 2xx, ran exactly once, and all its 2xx answers agree.

    A key in ``excused`` (the documented exception: its side effect ran but its
    answer was never recorded) may have run twice, never more; its 2xx answers
    then agree from the second run on.
    """
    ok: dict[str, list[Answer]] = defaultdict(list)
    for a in answers:
        if a.ok:
            ok[a.key].append(a)
    problems = []
    for key in keys:
        n = len(runs.get(key, []))
        if key not in ok:
            problems.append(f"{key}: never answered 2xx")
        limit = 2 if key in excused else 1
        if not 1 <= n <= limit:
            problems.append(f"{key}: ran {n} times {runs.get(key)} (at most {limit})")
        effect_ids = {a.doc()["effect"] for a in ok[key]}
        if key not in excused and len(effect_ids) > 1:
            problems.append(f"{key}: 2xx answers name different effects {effect_ids}")
        last = runs[key][-1][0] if runs.get(key) else None
        for a in ok[key]:
            if a.replayed and a.doc()["effect"] != last:
                problems.append(f"{key}: replayed effect {a.doc()['effect']}, ran {runs.get(key)}")
    assert not problems, "\n".join(problems[:20])


def unrecorded(log: str, keys: Iterable[str], url: str, operation: str = "http") -> set[str]:
    """The keys whose answer a front door logged as sent but not recorded (the
    requests of :data:`CALLER`, on the store at ``url``)."""
    marks = {
        line.rsplit("key_hash=", 1)[1].strip(" )\n")[:16]
        for line in log.splitlines()
        if "was sent but not recorded" in line and "key_hash=" in line
    }
    scope = scope_on(url)
    return {k for k in keys if key_hash(scope, operation, k)[:16] in marks}


def scope_on(url: str) -> str:
    """The record scope of :data:`CALLER`'s requests on the store at ``url``."""
    store = open_store(url)
    try:
        return caller_scope(store)
    finally:
        store.close()
