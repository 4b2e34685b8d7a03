"""bench/peers.py's HTTP throughput: each middleware over its own endpoint, first calls
and replays, and the Redis round trips per request.

Loaded by path by bench/peers.py (see its docstring); not a script of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import secrets
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# bench/peers.py loads this module by path, after the ones it uses (the bench
# folder stays off sys.path: see there); they are in sys.modules by then.
pa = sys.modules["_rsbench_peers_app"]


# -- HTTP throughput -----------------------------------------------------------------------


@dataclass
class HttpSide:
    """One middleware over its own endpoint, driven from ``runner``'s event loop."""

    mw: pa.Middleware
    endpoint: pa.Endpoint
    app: Any
    close: pa.Closer
    answers: dict[str, Counter[str]] = field(default_factory=dict)


def http_contenders(
    bs: Any, runner: asyncio.Runner, url: str, ns: str
) -> tuple[list[Any], dict[str, HttpSide]]:
    sides: dict[str, HttpSide] = {}
    contenders: list[Any] = []
    for name, mw in pa.MIDDLEWARES.items():
        endpoint = pa.Endpoint()
        app, close = mw.wrap(endpoint.app, url, f"{ns}tp:")
        side = HttpSide(mw, endpoint, app, close, {pa.FIRST: Counter(), pa.REPLAY: Counter()})
        sides[name] = side
        contenders += _side_contenders(bs, runner, side)
    # retrysafe first, each peer's first, retrysafe replay, each peer's replay
    firsts = [c for c in contenders if c.workload == pa.FIRST]
    return firsts + [c for c in contenders if c.workload == pa.REPLAY], sides


def _side_contenders(bs: Any, runner: asyncio.Runner, side: HttpSide) -> list[Any]:
    tag, seq = secrets.token_hex(4), itertools.count()
    replay_key = [""]
    replay_body = [b""]
    name, app, header = side.mw.name, side.app, side.mw.replay_header

    async def first(n: int) -> None:
        answers = side.answers[pa.FIRST]
        for _ in range(n):
            status, headers, _ = await pa.post(app, f"first-{tag}-{next(seq)}")
            answer = pa.classify(status, headers, header)
            answers[answer] += 1
            if answer != "ran":
                raise pa.BenchError(f"{name}: a first call answered {status}")

    async def prepare() -> None:
        replay_key[0] = f"replay-{tag}-{next(seq)}"
        status, _, body = await pa.post(app, replay_key[0])
        if status != 201:
            raise pa.BenchError(f"{name}: the first call of the replay key answered {status}")
        replay_body[0] = body

    async def replay(n: int) -> None:
        answers, key = side.answers[pa.REPLAY], replay_key[0]
        for _ in range(n):
            status, headers, body = await pa.post(app, key)
            answer = pa.classify(status, headers, header)
            answers[answer] += 1
            # A peer that does not replay is reported as it answers (see describe_answers);
            # retrysafe must replay, and every replay must be the first answer.
            if answer == "replay" and json.loads(body) != json.loads(replay_body[0]):
                raise pa.BenchError(f"{name}: a replay answered {body!r}, not {replay_body[0]!r}")
            if name == pa.SUBJECT and answer != "replay":
                raise pa.BenchError(f"{name}: a replay answered {status}")

    def executions() -> int:
        return side.endpoint.calls

    def sync(coro_fn: Callable[[int], Awaitable[None]]) -> Callable[[int], None]:
        return lambda n: runner.run(coro_fn(n))  # type: ignore[arg-type]

    return [
        bs.Contender(
            "http", name, pa.FIRST, sync(first), executions=executions, detail=side.mw.detail
        ),
        bs.Contender(
            "http",
            name,
            pa.REPLAY,
            sync(replay),
            lambda: runner.run(prepare()),
            executions,
            detail=side.mw.detail,
        ),
    ]


@contextlib.contextmanager
def counting_async_requests() -> Iterator[Counter[str]]:
    """Count every request redis.asyncio writes to a socket (one per round trip)."""
    from redis.asyncio.connection import AbstractConnection

    from_sync = sys.modules["_rsbench_stores"]._command_name
    original = AbstractConnection.send_packed_command
    sent: Counter[str] = Counter()

    async def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
        sent[from_sync(command)] += 1
        await original(self, command, check_health)

    AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        AbstractConnection.send_packed_command = original  # type: ignore[method-assign]


def count_round_trips(c: Any, calls: int = pa.COUNT_CALLS) -> Counter[str]:
    """Requests sent to Redis per call, by command (``c`` prepared first)."""
    c.prepare()
    with counting_async_requests() as sent:
        c.run(calls)
    return Counter({k: v / calls for k, v in sent.items()})
