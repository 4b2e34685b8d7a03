"""A store used before ``os.fork()`` keeps working in the parent and in every child.

gunicorn ``--preload``, Celery's prefork pool and ``multiprocessing`` with the
fork start method all fork a process whose stores may already hold connections.
Each child must open its own (never talk on the parent's sockets, never wait on
a lock or a pool worker that did not survive the fork), and the parent's must
stay intact. A child that hangs is killed at the deadline and fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from retrysafe import Claim, Engine, Outcome, Replay, Store

CHILDREN = 4
KEYS = 100
ASYNC_KEYS = 25
DEADLINE = 60.0
OP = "fork"

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork()")


def _replays(result: Claim | Replay, value: Any, what: str) -> None:
    if not isinstance(result, Replay):
        raise AssertionError(f"{what}: expected a Replay, got {result!r}")
    assert result.outcome is not None, f"{what}: replay without an outcome"
    if result.outcome.value != value:
        raise AssertionError(f"{what}: replayed {result.outcome.value!r}, expected {value!r}")


def _claim_and_replay(engine: Engine, key: str, value: Any) -> None:
    """Claim a new key, complete it with ``value``, then check it replays ``value``."""
    claim = engine.begin(key, operation=OP, fingerprint=key)
    if not isinstance(claim, Claim):
        raise AssertionError(f"{key}: expected a Claim, got {claim!r}")
    engine.complete(claim, Outcome.json(value))
    _replays(engine.begin(key, operation=OP, fingerprint=key), value, key)


async def _aclaim_and_replay(engine: Engine, key: str, value: Any) -> None:
    claim = await engine.abegin(key, operation=OP, fingerprint=key)
    if not isinstance(claim, Claim):
        raise AssertionError(f"{key}: expected a Claim, got {claim!r}")
    await engine.acomplete(claim, Outcome.json(value))
    _replays(await engine.abegin(key, operation=OP, fingerprint=key), value, key)


def _fork_children(body: Callable[[int], None], errors: Path) -> list[int]:
    """Fork :data:`CHILDREN` processes running ``body(i)``; each exits 0 on success, else 1.

    A child never returns into pytest: it leaves with ``os._exit`` whatever happens
    (no atexit handlers, so the test servers of the parent stay up), after writing
    any traceback to ``errors/child-<i>``.
    """
    pids = []
    for i in range(CHILDREN):
        pid = os.fork()
        if pid == 0:  # the child
            status = 1
            try:
                body(i)
                status = 0
            except BaseException:
                with contextlib.suppress(BaseException):
                    (errors / f"child-{i}").write_text(traceback.format_exc())
            finally:
                os._exit(status)
        pids.append(pid)
    return pids


def _wait_children(pids: list[int], errors: Path) -> None:
    """Reap every child within :data:`DEADLINE`; kill the rest and fail on a hang."""
    deadline = time.monotonic() + DEADLINE
    codes: dict[int, int] = {}
    try:
        while len(codes) < len(pids):
            for i, pid in enumerate(pids):
                if i in codes:
                    continue
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i] = os.waitstatus_to_exitcode(status)
            if len(codes) < len(pids):
                if time.monotonic() > deadline:
                    hung = [i for i in range(len(pids)) if i not in codes]
                    pytest.fail(f"children {hung} did not finish within {DEADLINE:g}s (hung)")
                time.sleep(0.01)
    finally:
        for i, pid in enumerate(pids):
            if i not in codes:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
    failed = {i: code for i, code in codes.items() if code != 0}
    if failed:
        reports = "\n".join(
            f"--- child {i} (exit {code}) ---\n"
            + (
                (errors / f"child-{i}").read_text()
                if (errors / f"child-{i}").exists()
                else "(no traceback)"
            )
            for i, code in sorted(failed.items())
        )
        pytest.fail(f"{len(failed)} of {len(pids)} children failed:\n{reports}")


def test_fork_sync(shared_store: Store[Any], tmp_path: Path) -> None:
    engine = Engine(shared_store)
    _claim_and_replay(engine, "parent", "from-parent")  # the parent's pool is now live

    def child(i: int) -> None:
        answer = engine.begin("parent", operation=OP, fingerprint="parent")
        _replays(answer, "from-parent", "parent")
        for j in range(KEYS):
            _claim_and_replay(engine, f"child-{i}-{j}", [i, j, os.getpid()])

    pids = _fork_children(child, tmp_path)
    _wait_children(pids, tmp_path)

    # The parent's own connections survived the children.
    _claim_and_replay(engine, "parent-after", "after")
    _replays(engine.begin("parent", operation=OP, fingerprint="parent"), "from-parent", "parent")
    for i, pid in enumerate(pids):
        key = f"child-{i}-{KEYS - 1}"
        _replays(engine.begin(key, operation=OP, fingerprint=key), [i, KEYS - 1, pid], key)


def test_fork_async(shared_store: Store[Any], tmp_path: Path) -> None:
    """The async API in children (each on a loop of its own) after the parent used it.

    A child must not run the parent's event loop: its selector (an epoll instance)
    and default executor do not survive a fork, whatever the store does.
    """
    engine = Engine(shared_store)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_aclaim_and_replay(engine, "parent", "from-parent"))

        def child(i: int) -> None:
            async def body() -> None:
                answer = await engine.abegin("parent", operation=OP, fingerprint="parent")
                _replays(answer, "from-parent", "parent")
                for j in range(ASYNC_KEYS):
                    await _aclaim_and_replay(engine, f"achild-{i}-{j}", [i, j, os.getpid()])

            asyncio.run(body())

        pids = _fork_children(child, tmp_path)
        _wait_children(pids, tmp_path)

        async def after() -> None:
            await _aclaim_and_replay(engine, "parent-after", "after")
            answer = await engine.abegin("parent", operation=OP, fingerprint="parent")
            _replays(answer, "from-parent", "parent")
            for i, pid in enumerate(pids):
                key = f"achild-{i}-{ASYNC_KEYS - 1}"
                answer = await engine.abegin(key, operation=OP, fingerprint=key)
                _replays(answer, [i, ASYNC_KEYS - 1, pid], key)

        loop.run_until_complete(after())
    finally:
        loop.run_until_complete(shared_store.aclose())
        loop.close()
