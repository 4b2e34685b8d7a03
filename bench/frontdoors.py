"""What each function-level front door costs on top of the engine it shares.

On the memory store (where nothing hides Python work) and on Redis (the usual
production store), one thread measures first calls and replays of:

* **engine**: ``engine.begin`` + ``engine.complete`` (the floor every front door
  stands on), with the arguments fingerprinted per call as a front door must;
* **@idempotent**: a decorated function keyed by a template;
* **mesh**: ``MeshIdempotency.handle`` of a Mesh request envelope (the Mesh idempotency extension);
* **a2a**: ``A2AIdempotency.handle`` of an A2A ``message/send`` JSON-RPC request.

Each front door is compared with the engine in the same run (interleaved rounds,
median; see bench/stores.py), and on Redis its round trips are counted: a front
door must add none. This is a benchmark, not a test.

    python bench/frontdoors.py [--rounds R] [--seconds S] [--redis-url URL]
                               [--write docs/performance.md]
"""

# ruff: noqa: E402  (the imports follow the sys.path guard below)
from __future__ import annotations

import sys
from pathlib import Path

# Keep this folder off sys.path: bench/http.py would shadow the standard library's http.
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse
import contextlib
import importlib.util
import itertools
import secrets
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from retrysafe import Claim, Engine, Outcome, Replay, fingerprint, idempotent, open_store
from retrysafe.a2a import A2AIdempotency
from retrysafe.mesh import MeshIdempotency

FIRST, REPLAY = "first call", "replay"
BEGIN_MARK = "<!-- bench/frontdoors.py: generated from here -->"
END_MARK = "<!-- bench/frontdoors.py: generated up to here -->"
ARGS = {"order_id": "o_1", "amount": 2999, "currency": "EUR"}
RESULT = {"charge_id": "ch_1", "status": "succeeded"}
DOORS = ("@idempotent", "mesh", "a2a")


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bs = _load("_rsbench_stores", HERE / "stores.py")
Contender = bs.Contender


def _pair(
    section: str, name: str, first: Callable[[str], Any], replay_check: Callable[[Any], bool]
) -> list[Any]:
    """First calls (a fresh key each) and replays (one completed key) of ``first(key)``."""
    tag, seq = secrets.token_hex(4), itertools.count()
    key = [""]

    def run_first(n: int) -> None:
        for _ in range(n):
            first(f"{name}-{tag}-{next(seq)}")

    def prepare_replay() -> None:
        key[0] = f"{name}-replay-{tag}-{next(seq)}"
        first(key[0])

    def run_replay(n: int) -> None:
        k = key[0]
        for _ in range(n):
            if not replay_check(first(k)):
                raise bs.BenchError(f"{section}/{name}: a completed key did not replay")

    return [
        Contender(section, name, FIRST, run_first),
        Contender(section, name, REPLAY, run_replay, prepare_replay),
    ]


def contenders(section: str, engine: Engine) -> list[Any]:
    """The engine and the three front doors over it, interleaved by workload."""
    outcome = Outcome.json(RESULT)

    def by_engine(key: str) -> Any:
        answer = engine.begin(key, operation="bench.charge", fingerprint=fingerprint(ARGS))
        if type(answer) is Claim:
            engine.complete(answer, outcome)
        return answer

    @idempotent(store=engine, key="{key}", operation="bench.decorated", validate=("args",))
    def charge(key: str, args: dict[str, Any]) -> dict[str, Any]:
        return RESULT

    def decorated(key: str) -> Any:
        return charge(key, ARGS)

    mesh = MeshIdempotency(engine)
    envelope: dict[str, Any] = {
        "protocol": {"name": "mesh", "version": "0.1.0"},
        "id": "req_1",
        "call": {"function": "payments.charge", "version": "1", "arguments": ARGS},
        "extensions": [{"urn": "urn:mesh:ext:idempotency", "options": {"key": ""}}],
    }

    def by_mesh(key: str) -> Any:
        envelope["extensions"][0]["options"]["key"] = key
        return mesh.handle(envelope, lambda call: RESULT)

    a2a = A2AIdempotency(engine)
    message: dict[str, Any] = {
        "kind": "message",
        "messageId": "",
        "role": "user",
        "parts": [{"kind": "text", "text": "charge order o_1"}],
    }
    request = {"jsonrpc": "2.0", "id": 1, "method": "message/send", "params": {"message": message}}
    task = {"kind": "task", "id": "t1", "contextId": "c1", "status": {"state": "completed"}}

    def by_a2a(key: str) -> Any:
        message["messageId"] = key
        return a2a.handle(request, lambda r: {"jsonrpc": "2.0", "id": r["id"], "result": task})

    engine_side = _pair(section, "engine", by_engine, lambda a: type(a) is Replay)
    doors = [
        _pair(section, "@idempotent", decorated, lambda a: a == RESULT),
        _pair(section, "mesh", by_mesh, lambda a: a["extensions"][0]["data"]["status"] == "cached"),
        _pair(section, "a2a", by_a2a, lambda a: a.get("result") == task),
    ]
    out = []
    for i in range(2):  # first calls together, then replays together
        out.append(engine_side[i])
        out.extend(d[i] for d in doors)
    return out


def report(
    sections: dict[str, list[Any]], trips: dict[tuple[str, str, str], float], args: Any
) -> str:
    lines = [
        "## Front doors over the engine",
        "",
        "What `@idempotent`, `MeshIdempotency.handle` and `A2AIdempotency.handle` cost on top of",
        "the engine they share, from one thread, measured in one run against the engine itself",
        "(`begin` + `complete` with the arguments fingerprinted; interleaved rounds, median).",
        "A ratio of 0.80 means the front door does 80 % of the engine's calls per second.",
        "",
        "| store | workload | engine ops/s | front door | ops/s | / engine | client CPU us/call, "
        "front door / engine | round trips per call |",
        "|---|---|--:|---|--:|--:|--:|--:|",
    ]
    for section, cs in sections.items():
        by = {(c.name, c.workload): c for c in cs}
        for workload in (FIRST, REPLAY):
            base = by[("engine", workload)]
            for door in DOORS:
                c = by[(door, workload)]
                rt = trips.get((section, door, workload))
                rts = (
                    "-"
                    if rt is None
                    else f"{rt:.0f} (engine {trips[(section, 'engine', workload)]:.0f})"
                )
                lines.append(
                    f"| {section} | {workload} | {base.median:,.0f} | {door} | {c.median:,.0f} | "
                    f"{c.median / base.median:.2f} | {c.cpu:.1f} / {base.cpu:.1f} | {rts} |"
                )
    info = bs.machine_info()
    command = f"python bench/frontdoors.py --rounds {args.rounds} --seconds {args.seconds}"
    lines += ["", f"Command: `{command}`.", ""]
    lines += [f"- {name}: {value}" for name, value in info.items() if "load" not in name]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--warmup", type=float, default=0.3)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--write", type=Path, default=None)
    args = parser.parse_args(argv)
    sections: dict[str, list[Any]] = {}
    trips: dict[tuple[str, str, str], float] = {}
    with contextlib.ExitStack() as stack:
        memory = Engine(open_store("memory://"))
        sections["memory"] = contenders("memory", memory)
        url = args.redis_url or bs.start_server("redis", stack)
        ns = f"rsbench-doors-{secrets.token_hex(3)}:"
        store = open_store(url, prefix=ns)
        stack.callback(store.close)
        sections["redis"] = contenders("redis", Engine(store))
        import redis

        client = redis.Redis.from_url(url)
        stack.callback(client.close)
        for c in sections["redis"]:
            trips[("redis", c.name, c.workload)] = bs.count_round_trips(c, client, 200).per_call
        for name, cs in sections.items():
            print(f"== {name} ==", flush=True)
            bs.run_rounds(cs, args.rounds, args.seconds, args.warmup)
        bs.redis_cleanup(client, ns)
    text = report(sections, trips, args)
    print(text)
    if args.write is not None:
        args.write.write_text(bs.splice(args.write, text, (BEGIN_MARK, END_MARK)))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
