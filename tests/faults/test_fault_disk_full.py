"""The SQLite store's disk fills up, then space is freed.

The store lives on a tmpfs of its own (``mount -t tmpfs -o size=2m``, so these
tests need root; without it they are skipped, not faked), filled with a file
until the kernel answers ENOSPC. SQLite then fails its writes with SQLITE_FULL
("database or disk is full") for real: no PRAGMA, no mock.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _fault_apps import Work, connect
from _faults import (
    Answer,
    check_answers,
    check_runs,
    client,
    effects,
    post,
    unrecorded,
)
from _hangup import caller_scope
from _http_servers import ThreadServer

from retrysafe import (
    Claim,
    Engine,
    InProgressError,
    Outcome,
    Replay,
    Status,
    StoreUnavailableError,
    key_hash,
    open_store,
)
from retrysafe.asgi import IdempotencyMiddleware

LEASE = 2.0


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, slack: int = 0) -> Path:
    """Write a file on ``disk`` until it is full (ENOSPC), then give ``slack`` bytes back
    (so that the store runs out of space in the middle of its work, not at once)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - slack))
    finally:
        os.close(fd)
    return filler


def integrity(path: Path) -> None:
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        conn.close()


def test_disk_full_http(disk: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The ASGI middleware on a SQLite store whose disk fills up. What clients see:

    - a new key whose claim cannot be written: 503 ``idempotency_store_unavailable``
      with ``Retry-After``, and the handler does not run;
    - a key completed before: its stored 201, replayed, even while the disk is full;
    - once space is freed, the refused keys run (once each) and replay after.

    Nothing is half-written: the file passes ``PRAGMA integrity_check``, a refused
    key has no record at all. A key whose claim was written but whose completion
    could not be (answered 201, logged "sent but not recorded") is the documented
    exception: after its lease a retry runs it again.
    """
    caplog.set_level(logging.ERROR, logger="retrysafe")
    db = disk / "store.db"
    connect(tmp_path).close()
    app = IdempotencyMiddleware(Work(tmp_path), store=f"sqlite:///{db}", lease=LEASE)
    tag = uuid.uuid4().hex[:6]
    with ThreadServer(app, "asgi") as srv, client() as c:
        work = srv.url + "/work"
        done = {f"done{i}-{tag}": post(c, work, f"done{i}-{tag}", {}) for i in range(10)}
        assert all(a.status == 201 for a in done.values()), done
        filler = fill(disk, slack=256 << 10)
        full: list[Answer] = []
        for i in range(3000):
            full.append(post(c, work, f"full{i}-{tag}", {"pad": "x" * 2000}))
            if sum(a.status == 503 for a in full) >= 5:
                break
        seen = check_answers(full, {201, 503})
        assert seen.get(503), f"the store never refused a write on a full disk: {seen}"
        # Completed records still replay while the disk is full.
        for key, first in done.items():
            a = post(c, work, key, {})
            assert a.status == 201 and a.replayed and a.body == first.body, a
        # Nothing half-written: refused keys have no record and never ran.
        store = open_store(f"sqlite:///{db}")
        runs = effects(tmp_path)
        refused = {a.key for a in full if a.status == 503}
        for key in refused:
            assert store.get(key_hash(caller_scope(store), "http", key)) is None, key
            assert key not in runs, key
        integrity(db)

        filler.unlink()  # space again
        keys = [a.key for a in full]
        answers = list(full)
        deadline = time.monotonic() + 60
        for key in keys:
            while True:
                a = post(c, work, key, {"pad": "x" * 2000})
                answers.append(a)
                if a.ok:
                    break
                assert a.status == 409 and time.monotonic() < deadline, a  # lease, then ours
                time.sleep(0.1)
        check_answers(answers, {201, 409, 503})
        runs = effects(tmp_path)
        excused = unrecorded(caplog.text, keys, f"sqlite:///{db}")
        check_runs(answers, runs, keys, excused)
        for key in refused:
            assert len(runs[key]) == 1
        for key in keys:
            record = store.get(key_hash(caller_scope(store), "http", key))
            assert record is not None and record.status is Status.COMPLETED, key
        store.close()
        integrity(db)
    print(f"\nfull disk: answers {seen}, logged unrecorded {sorted(excused)}")


def test_disk_full_transactions(disk: Path) -> None:
    """The Python API with :meth:`Attempt.transaction` (the order row and the completion
    commit together) on a SQLite file whose disk fills up. What the caller sees: a
    :class:`StoreUnavailableError` (the claim, or the commit), or SQLite's own
    ``database or disk is full`` from its INSERT (its own statement, passed on as
    docs/transactions.md says); completed orders replay; once space is freed every
    order is created once. Never an order row without its completed record, or a
    completed record without its row.
    """
    db = disk / "shop.db"
    engine = Engine(open_store(f"sqlite:///{db}"), lease=LEASE)
    setup = sqlite3.connect(db)
    setup.execute("CREATE TABLE orders (key TEXT, pad TEXT)")  # no UNIQUE: duplicates show
    setup.commit()
    setup.close()
    pad = "x" * 3000

    def order(key: str) -> Any:
        with engine.attempt(key, operation="order", fingerprint="f") as att:
            if att.replay is not None:
                assert att.replay.outcome is not None
                return att.replay.outcome.value
            with att.transaction() as conn:
                conn.execute("INSERT INTO orders VALUES (?, ?)", (key, pad))
                att.outcome = Outcome.json({"order": key})
            return {"order": key}

    def state() -> tuple[dict[str, int], dict[str, Status]]:
        conn = sqlite3.connect(db)
        rows = dict(conn.execute("SELECT key, COUNT(*) FROM orders GROUP BY key").fetchall())
        conn.close()
        status = {}
        for key in keys:
            record = engine.store.get(key_hash("", "order", key))
            if record is not None:
                status[key] = record.status
        return rows, status

    def consistent() -> dict[str, int]:
        """Every order row has its completed record and the other way round."""
        rows, status = state()
        for key in keys:
            completed = status.get(key) is Status.COMPLETED
            assert rows.get(key, 0) == (1 if completed else 0), (
                key,
                rows.get(key),
                status.get(key),
            )
        integrity(db)
        return rows

    keys = [f"o{i}" for i in range(400)]
    for key in keys[:5]:
        assert order(key) == {"order": key}
    filler = fill(disk, slack=256 << 10)
    errors: dict[str, Exception] = {}
    for key in keys[5:]:
        try:
            order(key)
        except (StoreUnavailableError, sqlite3.OperationalError) as exc:
            errors[key] = exc
            if len(errors) >= 5:
                break
    assert errors, "no write failed on a full disk"
    for exc in errors.values():
        assert isinstance(exc, StoreUnavailableError) or "full" in str(exc), repr(exc)
    tried = keys[: keys.index(max(errors, key=keys.index)) + 1]
    consistent()
    for key in keys[:5]:  # completed orders replay on the full disk
        assert isinstance(engine.begin(key, operation="order", fingerprint="f"), Replay)

    filler.unlink()
    deadline = time.monotonic() + 60
    for key in tried:
        while True:
            try:
                assert order(key) == {"order": key}
                break
            except InProgressError:  # a claim the full disk left behind: its lease runs out
                assert time.monotonic() < deadline
                time.sleep(0.1)
    rows = consistent()
    assert all(rows[key] == 1 for key in tried), rows
    assert not isinstance(engine.begin("after", operation="order"), Replay)
    assert isinstance(engine.begin("after2", operation="order"), Claim)
    engine.close()
    kinds = sorted({f"{type(e).__name__}: {str(e)[:60]}" for e in errors.values()})
    print(f"\nfull disk, transactions: {len(errors)} refused: {kinds}")
