"""What step 5's blocks cost: webhooks, workflows, guards and transactional completion.

In one run, from one thread, on the memory store, SQLite, a real Redis and (when
it starts) a real PostgreSQL:

* **round trips**, counted on Redis (the requests redis-py writes to the socket):
  ``Receiver.handle`` (first delivery, duplicate), a 3-step ``Workflow`` (first
  run, replay, a run whose step 3 raises, the retry that resumes it) and each
  guard method, set against what the docs claim;
* **ratios** against a floor measured in the same run: ``Receiver.handle``
  against the engine's own begin + complete / replay (and ``verify()`` alone);
  a 3-step ``Workflow`` against 4 plain engine attempts; on SQLite and
  PostgreSQL, ``att.transaction()`` with one INSERT against a plain attempt plus
  a separate autocommit INSERT (one commit more).

Contenders run interleaved in rounds (the order flips every round) after a
warm-up; every figure is the median over the rounds (see bench/stores.py). This
is a benchmark, not a test.

    python bench/blocks.py [--rounds R] [--seconds S] [--stores memory,sqlite,redis,postgres]
                           [--redis-url URL] [--postgres-url URL] [--rev REV]
                           [--write docs/performance.md]

``--rev`` measures a commit's ``src/`` (exported with ``git archive``, run in a child
process) instead of a working tree that others may be editing.
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
import base64
import contextlib
import hashlib
import hmac
import importlib.util
import itertools
import json
import os
import secrets
import shlex
import sqlite3
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from retrysafe import Claim, Engine, Outcome, Replay, open_store
from retrysafe.guards import (
    History,
    PaymentStateMachine,
    SequenceGuard,
    SessionRegistry,
    VersionedRecords,
)
from retrysafe.steps import Workflow
from retrysafe.webhooks import Receiver, verify

BEGIN_MARK = "<!-- bench/blocks.py: generated from here -->"
END_MARK = "<!-- bench/blocks.py: generated up to here -->"
SECTION = "## Step 5 blocks"
STORES = ("memory", "sqlite", "redis", "postgres")
#: Calls per operation when counting Redis round trips.
COUNT_CALLS = 50
#: Lease of a simulated dead worker's claims (seconds).
CRASH_LEASE = 0.5


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bs = _load("_rsbench_stores", HERE / "stores.py")
Contender = bs.Contender
BenchError = bs.BenchError

SECRET = "shpss_bench_secret"
STRIPE_SECRET = "whsec_bench_secret"
RESULT = {"ok": True}
RESULT_OUTCOME = Outcome.json(RESULT)
ORDER_BODY = json.dumps(
    {
        "id": 820982911946154508,
        "email": "jon@example.com",
        "total_price": "29.99",
        "currency": "EUR",
        "line_items": [{"sku": "MUG-1", "quantity": 1, "price": "29.99"}],
    },
    separators=(",", ":"),
).encode()
STEPS = ("create_order", "charge", "receipt")


class _Boom(RuntimeError):
    """The step that fails on purpose (to measure a resume)."""


def _tag() -> str:
    return secrets.token_hex(4)


# -- webhooks ----------------------------------------------------------------------------


def shopify_headers(event_id: str) -> dict[str, str]:
    """A Shopify delivery: the body's base64 HMAC-SHA256; the event id is not signed."""
    sig = base64.b64encode(hmac.new(SECRET.encode(), ORDER_BODY, hashlib.sha256).digest())
    return {
        "X-Shopify-Hmac-Sha256": sig.decode(),
        "X-Shopify-Event-Id": event_id,
        "X-Shopify-Topic": "orders/create",
        "X-Shopify-Shop-Domain": "bench.myshopify.com",
        "Content-Type": "application/json",
    }


def stripe_delivery() -> tuple[dict[str, str], bytes]:
    body = json.dumps(
        {
            "id": f"evt_{_tag()}",
            "type": "payment_intent.succeeded",
            "data": {"object": {"id": "pi_1", "amount": 2999}},
        }
    ).encode()
    t = str(int(time.time()))
    sig = hmac.new(STRIPE_SECRET.encode(), t.encode() + b"." + body, hashlib.sha256).hexdigest()
    return {"Stripe-Signature": f"t={t},v1={sig}", "Content-Type": "application/json"}, body


def webhook_contenders(section: str, store: Any) -> tuple[list[Any], Receiver]:
    """Receiver.handle against the engine's begin + complete / replay, same engine."""
    receiver = Receiver(store, scheme="shopify", secrets=[SECRET], handler=lambda d: RESULT)
    engine = receiver.engine
    options = dict(receiver._options["webhook"])  # ttl, lease, retention as the receiver's
    tag, seq = _tag(), itertools.count()
    headers = shopify_headers("")
    dup: dict[str, Any] = {}

    def deliver(event_id: str) -> Any:
        h = dict(headers)
        h["X-Shopify-Event-Id"] = event_id
        return receiver.handle(h, ORDER_BODY)

    def recv_first(n: int) -> None:
        for _ in range(n):
            answer = deliver(f"{tag}-{next(seq)}")
            if answer.status != 200 or answer.body["status"] != "processed":
                raise BenchError(f"{section}: a first delivery was not processed: {answer!r}")

    def recv_prepare() -> None:
        dup["event"] = f"{tag}-dup-{next(seq)}"
        deliver(dup["event"])

    def recv_dup(n: int) -> None:
        h = dict(headers)
        h["X-Shopify-Event-Id"] = dup["event"]
        handle = receiver.handle
        for _ in range(n):
            answer = handle(h, ORDER_BODY)
        if answer.body["status"] != "duplicate":
            raise BenchError(f"{section}: a repeated delivery was not a duplicate: {answer!r}")

    def eng_first(n: int) -> None:
        begin, complete = engine.begin, engine.complete
        for _ in range(n):
            claim = begin(f"webhook:floor:{tag}-{next(seq)}", **options)
            if type(claim) is not Claim:
                raise BenchError(f"{section}: a new key was not claimed")
            complete(claim, RESULT_OUTCOME)

    def eng_prepare() -> None:
        dup["floor"] = key = f"webhook:floor:{tag}-dup-{next(seq)}"
        engine.complete(engine.begin(key, **options), RESULT_OUTCOME)  # type: ignore[arg-type]

    def eng_dup(n: int) -> None:
        begin, key = engine.begin, dup["floor"]
        for _ in range(n):
            answer = begin(key, **options)
        if type(answer) is not Replay:
            raise BenchError(f"{section}: a completed key did not replay")

    return [
        Contender(section, "engine", "webhook first", eng_first),
        Contender(section, "Receiver.handle", "webhook first", recv_first),
        Contender(section, "engine", "webhook duplicate", eng_dup, eng_prepare),
        Contender(section, "Receiver.handle", "webhook duplicate", recv_dup, recv_prepare),
    ], receiver


def verify_contenders(section: str) -> list[Any]:
    """verify() alone: the signature check every delivery pays, duplicates included."""
    headers = shopify_headers("e1")
    stripe: list[Any] = [None]

    def shopify(n: int) -> None:
        for _ in range(n):
            verify("shopify", headers, ORDER_BODY, [SECRET])

    def stripe_prepare() -> None:
        stripe[0] = stripe_delivery()  # a fresh timestamp, well inside the tolerance

    def stripe_verify(n: int) -> None:
        h, body = stripe[0]
        for _ in range(n):
            verify("stripe", h, body, [STRIPE_SECRET])

    return [
        Contender(section, "verify", "shopify", shopify),
        Contender(section, "verify", "stripe", stripe_verify, stripe_prepare),
    ]


# -- workflows ---------------------------------------------------------------------------


def _step(key: str) -> dict[str, Any]:
    return {"ok": True}


def workflow_body(fail: list[bool], ran: Counter[str]) -> Callable[[Any], Any]:
    def body(run: Any) -> Any:
        def counted(key: str) -> dict[str, Any]:
            ran["steps"] += 1
            return {"ok": True}

        def third(key: str) -> dict[str, Any]:
            if fail[0]:
                raise _Boom("step 3 fails on purpose")
            ran["steps"] += 1
            return {"ok": True}

        run.step(STEPS[0], counted)
        run.step(STEPS[1], counted)
        run.step(STEPS[2], third)
        return {"done": True}

    return body


def workflow_contenders(section: str, engine: Engine) -> list[Any]:
    """A 3-step Workflow against 4 plain engine attempts (its floor), and replays."""
    flow = Workflow(engine, operation="bench.flow", steps=STEPS)
    ran: Counter[str] = Counter()
    body = workflow_body([False], ran)
    tag, seq = _tag(), itertools.count()
    keys: dict[str, str] = {}
    ops = [f"bench.floor{i}" for i in range(4)]

    def flow_first(n: int) -> None:
        before = ran["steps"]
        for _ in range(n):
            if flow.run(f"wf-{tag}-{next(seq)}", body) != {"done": True}:
                raise BenchError(f"{section}: the workflow returned something else")
        if ran["steps"] - before != 3 * n:
            raise BenchError(f"{section}: {ran['steps'] - before} steps ran for {n} workflows")

    def flow_prepare() -> None:
        keys["flow"] = f"wf-{tag}-replay-{next(seq)}"
        flow.run(keys["flow"], body)

    def flow_replay(n: int) -> None:
        key, before = keys["flow"], ran["steps"]
        for _ in range(n):
            result = flow.run(key, body)
        if result != {"done": True} or ran["steps"] != before:
            raise BenchError(f"{section}: a completed workflow did not replay")

    def floor_first(n: int) -> None:
        begin, complete = engine.begin, engine.complete
        for _ in range(n):
            key = f"fl-{tag}-{next(seq)}"
            for op in ops:
                claim = begin(key, operation=op)
                if type(claim) is not Claim:
                    raise BenchError(f"{section}: a new key was not claimed")
                complete(claim, RESULT_OUTCOME)

    def floor_prepare() -> None:
        keys["floor"] = key = f"fl-{tag}-replay-{next(seq)}"
        engine.complete(engine.begin(key, operation=ops[0]), RESULT_OUTCOME)  # type: ignore[arg-type]

    def floor_replay(n: int) -> None:
        begin, key = engine.begin, keys["floor"]
        for _ in range(n):
            answer = begin(key, operation=ops[0])
        if type(answer) is not Replay:
            raise BenchError(f"{section}: a completed key did not replay")

    return [
        Contender(section, "4 engine attempts", "workflow first run", floor_first),
        Contender(section, "Workflow (3 steps)", "workflow first run", flow_first),
        Contender(section, "1 engine replay", "workflow replay", floor_replay, floor_prepare),
        Contender(section, "Workflow (3 steps)", "workflow replay", flow_replay, flow_prepare),
    ]


# -- transactional completion ----------------------------------------------------------------


def transaction_contenders(
    section: str, engine: Engine, app: Any, insert: str, commit_note: str
) -> list[Any]:
    """att.transaction() with one INSERT against a plain attempt + an autocommit INSERT.

    The floor's INSERT commits on its own (3 commits per operation: claim, INSERT,
    completion); in a transaction the INSERT and the completion commit together (2)."""
    tag, seq = _tag(), itertools.count()

    def plain(n: int) -> None:
        execute = app.execute
        for _ in range(n):
            key = f"tx-{tag}-{next(seq)}"
            with engine.attempt(key, operation="bench.order") as att:
                if att.replay is not None:
                    raise BenchError(f"{section}: a new key replayed")
                execute(insert, (key, 2999))
                att.outcome = RESULT_OUTCOME

    def own(n: int) -> None:
        for _ in range(n):
            key = f"tx-{tag}-{next(seq)}"
            with engine.attempt(key, operation="bench.order") as att:
                if att.replay is not None:
                    raise BenchError(f"{section}: a new key replayed")
                with att.transaction() as conn:
                    conn.execute(insert, (key, 2999))
                    att.outcome = RESULT_OUTCOME

    def given(n: int) -> None:
        for _ in range(n):
            key = f"tx-{tag}-{next(seq)}"
            with engine.attempt(key, operation="bench.order") as att:
                if att.replay is not None:
                    raise BenchError(f"{section}: a new key replayed")
                with att.transaction(app) as conn:
                    conn.execute(insert, (key, 2999))
                    att.outcome = RESULT_OUTCOME

    return [
        Contender(section, "attempt + autocommit INSERT", "order", plain, detail=commit_note),
        Contender(section, "att.transaction()", "order", own),
        Contender(section, "att.transaction(app_conn)", "order", given),
    ]


# -- Redis round trips ---------------------------------------------------------------------


@dataclass
class Trips:
    block: str
    operation: str
    claim: str  # what the docs say, "-" for none
    rt: Any  # bs.RoundTrips

    @property
    def counted(self) -> str:
        return bs._count(self.rt.per_call)

    @property
    def verdict(self) -> str:
        if self.claim == "-":
            return "-"
        return "as documented" if self.counted == self.claim else "**differs**"


def count(
    client: Any,
    setup: Callable[[int], Any],
    call: Callable[[Any], Any],
    calls: int = COUNT_CALLS,
    pause: float = 0.0,
) -> Any:
    """Round trips of ``call(item)`` per call; ``setup(i)`` (not counted) makes each item,
    ``pause`` seconds before the calls (for leases to run out)."""
    warm = setup(-1)
    items = [setup(i) for i in range(calls)]
    time.sleep(pause)
    call(warm)  # warm: scripts loaded, connections open
    calls_before, usec_before = bs._commandstats(client)
    with bs.counting_requests() as sent:
        for item in items:
            call(item)
    calls_after, usec_after = bs._commandstats(client)
    server, usec = calls_after - calls_before, usec_after - usec_before
    server.pop("INFO", None)
    return bs.RoundTrips(Counter(sent), server, usec, calls)


def redis_trips(client: Any, engine: Engine, receiver: Receiver) -> list[Trips]:
    out: list[Trips] = []
    tag, seq = _tag(), itertools.count()

    def add(block: str, operation: str, claim: str, *how: Any, **options: Any) -> None:
        out.append(Trips(block, operation, claim, count(client, *how, **options)))

    def new(prefix: str) -> Callable[[int], str]:
        return lambda i: f"{prefix}-{tag}-{next(seq)}"

    # The engine itself, for reference.
    def eng_first(key: str) -> None:
        engine.complete(engine.begin(key, operation="bench.e"), RESULT_OUTCOME)  # type: ignore[arg-type]

    def eng_done(i: int) -> str:
        key = f"ed-{tag}-{next(seq)}"
        eng_first(key)
        return key

    add("engine", "begin + complete (new key)", "2", new("e"), eng_first)
    add("engine", "begin (replay)", "1", eng_done, lambda k: engine.begin(k, operation="bench.e"))

    # Webhooks.
    def deliver(event_id: str) -> Any:
        answer = receiver.handle(shopify_headers(event_id), ORDER_BODY)
        if answer.status != 200:
            raise BenchError(f"webhook answered {answer.status}")
        return answer

    def delivered(i: int) -> str:
        event_id = f"wd-{tag}-{next(seq)}"
        deliver(event_id)
        return event_id

    add("webhooks", "Receiver.handle, first delivery", "2", new("w"), deliver)
    add("webhooks", "Receiver.handle, duplicate", "1", delivered, deliver)

    # Workflows (3 steps).
    fail = [False]
    ran: Counter[str] = Counter()
    flow = Workflow(engine, operation="bench.flow", steps=STEPS)
    body = workflow_body(fail, ran)

    def run(key: str) -> None:
        fail[0] = False
        flow.run(key, body)

    def failing(key: str) -> None:
        fail[0] = True
        with contextlib.suppress(_Boom):
            flow.run(key, body)
        fail[0] = False

    def done(i: int) -> str:
        key = f"wfd-{tag}-{next(seq)}"
        run(key)
        return key

    def failed(i: int) -> str:
        key = f"wff-{tag}-{next(seq)}"
        failing(key)
        return key

    n = len(STEPS)
    add("steps", f"Workflow, {n} steps, first run", str(2 * n + 2), new("wf"), run)
    add("steps", f"Workflow, {n} steps, replay", "1", done, run)
    k = 3  # 1 + 2 (k - 1) + 2 + 1
    add(
        "steps",
        f"Workflow, step {k} raises (first run)",
        str(1 + 2 * (k - 1) + 3),
        new("wfx"),
        failing,
    )
    add(
        "steps",
        f"Workflow, retry resuming at step {k}",
        str(2 * n - k + 5),  # docs/steps.md before this benchmark said 1 + (k-1) + 2(n-k+1) + 1
        failed,
        run,
    )

    def crashed(i: int) -> str:
        """A worker that died inside step 3: steps 1-2 recorded, step 3 and the operation
        claimed with a lease that runs out (what the dead worker's records look like)."""
        key = f"wfc-{tag}-{next(seq)}"
        engine.begin(key, operation="bench.flow", lease=CRASH_LEASE)
        for name in STEPS[:2]:
            claim = engine.begin(f"{key}:{name}", operation=f"bench.flow/{name}")
            engine.complete(claim, Outcome.json({"value": {"ok": True}}))  # type: ignore[arg-type]
        engine.begin(f"{key}:{STEPS[2]}", operation=f"bench.flow/{STEPS[2]}", lease=CRASH_LEASE)
        return key

    add(
        "steps",
        f"Workflow, retry after a crash inside step {k}",
        str(2 * n - k + 5),
        crashed,
        run,
        pause=CRASH_LEASE * 1.5,
    )

    # Guards.
    store = engine.store
    payments = PaymentStateMachine(store, namespace=f"bench{tag}")

    def started(i: int) -> str:
        pid = f"pay-{tag}-{next(seq)}"
        payments.start(pid)
        return pid

    def succeeded(i: int) -> str:
        pid = started(i)
        payments.advance(pid, "payment.succeeded")
        return pid

    add("guards", "PaymentStateMachine.start (new payment)", "-", new("pay"), payments.start)
    add(
        "guards",
        "PaymentStateMachine.advance (a move)",
        "-",
        started,
        lambda p: payments.advance(p, "payment.succeeded"),
    )
    add(
        "guards",
        "PaymentStateMachine.advance (a repeat: no-op)",
        "-",
        succeeded,
        lambda p: payments.advance(p, "payment.succeeded"),
    )

    seqs = SequenceGuard(store, namespace=f"bench{tag}")
    numbers = itertools.count(1)
    session = f"sess-{tag}"
    add(
        "guards",
        "SequenceGuard.accept (next number)",
        "-",
        lambda i: next(numbers),
        lambda s: seqs.accept(session, "cart", s),
    )

    sessions = SessionRegistry(store, namespace=f"bench{tag}")

    def opened(i: int) -> str:
        user = f"u-{tag}-{next(seq)}"
        sessions.open(user, "d1")
        return user

    add(
        "guards",
        "SessionRegistry.open (new session)",
        "-",
        new("u"),
        lambda u: sessions.open(u, "d1"),
    )
    add(
        "guards",
        "SessionRegistry.open (active session reused)",
        "-",
        opened,
        lambda u: sessions.open(u, "d1"),
    )

    users = VersionedRecords(store, namespace=f"bench{tag}")
    version = [0]

    def put(item: None) -> None:  # the version read back is the next put's expected one
        version[0] = users.put(
            "user", "u1", {"email": "a@example.com"}, expected_version=version[0]
        ).version

    add("guards", "VersionedRecords.put (cas, next version)", "-", lambda i: None, put)
    history = History(store, namespace=f"bench{tag}")
    add(
        "guards", "History.append", "-", new("subj"), lambda s: history.append(s, {"consent": True})
    )
    return out


# -- sections -------------------------------------------------------------------------------


def store_contenders(section: str, store: Any) -> tuple[list[Any], Receiver, Engine]:
    hooks, receiver = webhook_contenders(section, store)
    engine = Engine(store)
    return hooks + workflow_contenders(section, engine), receiver, engine


def sqlite_transactions(
    directory: Path, synchronous: str, stack: contextlib.ExitStack
) -> list[Any]:
    path = directory / f"tx-{synchronous}.db"
    engine = Engine(f"sqlite:///{path}?synchronous={synchronous}")
    stack.callback(engine.close)
    engine.complete(engine.begin("warm", operation="bench.order"), RESULT_OUTCOME)  # type: ignore[arg-type]
    app = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    stack.callback(app.close)
    app.execute(f"PRAGMA synchronous={synchronous}")
    app.execute("PRAGMA busy_timeout=5000")
    app.execute("CREATE TABLE IF NOT EXISTS bench_orders (key TEXT PRIMARY KEY, total INTEGER)")
    insert = "INSERT INTO bench_orders (key, total) VALUES (?, ?)"
    section = f"sqlite, synchronous={synchronous}"
    return transaction_contenders(section, engine, app, insert, "sqlite3, autocommit")


def postgres_transactions(url: str, tag: str, stack: contextlib.ExitStack) -> list[Any]:
    import psycopg

    engine = Engine(open_store(url, table=f"rsblocks_tx_{tag}"))
    stack.callback(engine.close)
    engine.complete(engine.begin("warm", operation="bench.order"), RESULT_OUTCOME)  # type: ignore[arg-type]
    app = psycopg.connect(url, autocommit=True)
    stack.callback(app.close)
    app.execute(f"CREATE TABLE rsblocks_orders_{tag} (key text PRIMARY KEY, total integer)")
    insert = f"INSERT INTO rsblocks_orders_{tag} (key, total) VALUES (%s, %s)"
    return transaction_contenders("postgres", engine, app, insert, "psycopg, autocommit")


# -- report ---------------------------------------------------------------------------------


def _rate(c: Any) -> str:
    return f"{c.median:,.0f}"


def _spread(c: Any) -> str:
    return f"{min(c.samples):,.0f}-{max(c.samples):,.0f}"


def ratio_table(sections: dict[str, list[Any]], workloads: Sequence[str]) -> list[str]:
    """Pairs: (floor, subject) in each section, in contender order."""
    lines = [
        "| store | workload | floor | floor ops/s | subject | subject ops/s (rounds min-max) "
        "| subject / floor | client CPU us/op, subject / floor |",
        "|---|---|---|--:|---|--:|--:|--:|",
    ]
    for section, cs in sections.items():
        for workload in workloads:
            pair = [c for c in cs if c.workload == workload]
            if len(pair) != 2:
                continue
            floor, sub = pair
            lines.append(
                f"| {section} | {workload} | {floor.name} | {_rate(floor)} | {sub.name} | "
                f"{_rate(sub)} ({_spread(sub)}) | {sub.median / floor.median:.2f} | "
                f"{sub.cpu:.1f} / {floor.cpu:.1f} |"
            )
    return lines


def render(
    args: Any,
    command: str,
    info: dict[str, str],
    sections: dict[str, list[Any]],
    verifies: list[Any],
    tx: dict[str, list[Any]],
    trips: list[Trips],
    elapsed: float,
) -> str:
    out = [
        "### The last run",
        "",
        "Generated by `bench/blocks.py --write`; do not edit by hand. One thread; every",
        f"variant runs interleaved with its floor in {args.rounds} rounds of {args.seconds:g} s",
        "(the order flips every round) after a warm-up; figures are medians over the rounds,",
        "ratios are ratios of medians. Client CPU is this process's CPU time per operation,",
        "which other load on the machine moves far less than the wall-clock rate.",
        "",
        "```",
        command,
        "```",
        "",
        f"The run took {elapsed:.0f} s.",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
    ]
    if trips:
        out += [
            "#### Redis round trips per operation",
            "",
            f"Counted over {COUNT_CALLS} calls each (after one warm-up call): the requests",
            "redis-py wrote to the socket. The claim column is what docs/steps.md (or the",
            "engine's rule, for the engine and the receiver) says; the guards' doc gives no",
            "per-method figure (a change is a read and a compare-and-set, a no-op the read).",
            "",
            "| block | operation | round trips (counted) | requests per call | "
            "run inside Lua per call | docs claim | |",
            "|---|---|--:|---|---|--:|---|",
        ]
        for t in trips:
            out.append(
                f"| {t.block} | {t.operation} | {t.counted} | {t.rt.describe(t.rt.sent)} | "
                f"{t.rt.describe(t.rt.in_scripts) or '-'} | {t.claim} | {t.verdict} |"
            )
        out.append("")
    out += [
        "#### Webhooks: `Receiver.handle` against the engine",
        "",
        '`Receiver(store, scheme="shopify", secrets=[...], handler=lambda d: {"ok": True})`;',
        f"a delivery is a {len(ORDER_BODY)}-byte JSON body and five headers (HMAC-SHA256 over the",
        "body, base64; a new `X-Shopify-Event-Id` for each first delivery). The floor is the",
        "receiver's own engine: `engine.begin(key, **the receiver's webhook options)` +",
        "`engine.complete(claim, prebuilt outcome)`, then `begin` of a completed key.",
        "",
        *ratio_table(sections, ("webhook first", "webhook duplicate")),
        "",
        "`verify()` alone (no store), the signature check that every delivery pays,",
        "duplicates included:",
        "",
        "| scheme | verify() calls/s (rounds min-max) | client CPU us/call |",
        "|---|--:|--:|",
        *(f"| {c.workload} | {_rate(c)} ({_spread(c)}) | {c.cpu:.1f} |" for c in verifies),
        "",
        "#### Workflows: 3 trivial steps against 4 plain engine attempts",
        "",
        "`Workflow(engine, operation=..., steps=(3 names)).run(new_key, body)`, the body",
        "calling `run.step(name, fn)` three times with a function returning a small dict",
        "(default `renew=True`). The floor is what a 3-step workflow must store at least:",
        "4 records (the operation and 3 steps), each `engine.begin` + `engine.complete`.",
        "Replays: `run` of a completed key against one `engine.begin` of a completed key.",
        "",
        *ratio_table(sections, ("workflow first run", "workflow replay")),
        "",
    ]
    if tx:
        out += [
            "#### Transactional completion: one INSERT with the record",
            "",
            "Each operation claims a new key, INSERTs one order row (text key, int) into a",
            "table in the store's database, and completes. The floor: a plain attempt and",
            "the INSERT on the application's autocommit connection (its own commit), the",
            "completion after it. `att.transaction()`: the INSERT and the completion in one",
            "transaction on the store's connection (SQLite: the one the store uses in this",
            "thread; PostgreSQL: one from the store's pool); `att.transaction(app_conn)`: on",
            "the application's connection. SQLite: WAL, the same `synchronous` on both sides",
            "(`FULL`, the store's default: a commit waits for an fsync; `NORMAL`: it does not).",
            "",
            "| store | variant | commits per op | ops/s (rounds min-max) | / floor | "
            "client CPU us/op |",
            "|---|---|--:|--:|--:|--:|",
        ]
        for section, cs in tx.items():
            floor = cs[0]
            for c in cs:
                commits = 3 if c is floor else 2
                ratio = "-" if c is floor else f"{c.median / floor.median:.2f}"
                out.append(
                    f"| {section} | {c.name} | {commits} | {_rate(c)} ({_spread(c)}) | {ratio} | "
                    f"{c.cpu:.1f} |"
                )
        out.append("")
    return "\n".join(out)


# -- main -------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--seconds", type=float, default=0.3)
    p.add_argument("--warmup", type=float, default=0.3)
    p.add_argument("--stores", default=",".join(STORES))
    p.add_argument("--redis-url")
    p.add_argument("--postgres-url")
    p.add_argument("--write", type=Path)
    p.add_argument("--rev", help="measure this git revision's src/ (git archive), not the tree")
    args = p.parse_args(argv)
    if args.rev and not bs.in_rev():
        return bs.run_rev(args.rev)
    chosen = [s.strip() for s in args.stores.split(",") if s.strip()]
    if set(chosen) - set(STORES) or args.rounds < 1 or args.seconds <= 0:
        p.error(f"--stores from {', '.join(STORES)}; --rounds >= 1, --seconds > 0")
    script = os.path.relpath(sys.argv[0]) if sys.argv[0] else "bench/blocks.py"
    command = shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)])
    started = time.monotonic()
    info = bs.machine_info()
    bs.note_rev(info)
    sections: dict[str, list[Any]] = {}
    tx: dict[str, list[Any]] = {}
    trips: list[Trips] = []
    verifies = verify_contenders("verify")
    tag = _tag()

    def measure(name: str, cs: list[Any]) -> None:
        print(
            f"\n[{name}] {len(cs)} contenders, {args.rounds} rounds of {args.seconds:g}s",
            flush=True,
        )
        bs.run_rounds(cs, args.rounds, args.seconds, args.warmup)

    with contextlib.ExitStack() as stack:
        if "memory" in chosen:
            cs, _, _ = store_contenders("memory", open_store("memory://"))
            sections["memory"] = cs
            measure("memory", cs + verifies)
        else:
            measure("verify", verifies)
        if "sqlite" in chosen:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rsblocks-")))
            store = open_store(f"sqlite:///{directory / 'store.db'}?synchronous=normal")
            stack.callback(store.close)
            sections["sqlite"], _, _ = store_contenders("sqlite", store)
            measure("sqlite", sections["sqlite"])
            for synchronous in ("FULL", "NORMAL"):  # the store's default, and the usual trade
                name = f"sqlite, synchronous={synchronous}"
                tx[name] = sqlite_transactions(directory, synchronous, stack)
                measure(name, tx[name])
        if "redis" in chosen:
            import redis

            url = args.redis_url or bs.start_server("redis", stack)
            ns = f"rsblocks-{tag}:"
            store = open_store(url, prefix=ns)
            stack.callback(store.close)
            client = redis.Redis.from_url(url)
            stack.callback(client.close)
            if args.redis_url:
                stack.callback(bs.redis_cleanup, client, ns)
            info["redis-server"] = client.info("server")["redis_version"]
            sections["redis"], receiver, engine = store_contenders("redis", store)
            trips = redis_trips(client, engine, receiver)
            measure("redis", sections["redis"])
        if "postgres" in chosen:
            url = args.postgres_url
            if url is None:
                try:
                    url = bs.start_server("postgres", stack)
                except Exception as exc:  # no PostgreSQL here: the rest still stands
                    print(f"PostgreSQL skipped: {exc}", flush=True)
            if url is not None:
                store = open_store(url, table=f"rsblocks_{tag}")
                stack.callback(store.close)
                sections["postgres"], _, _ = store_contenders("postgres", store)
                measure("postgres", sections["postgres"])
                tx["postgres"] = postgres_transactions(url, tag, stack)
                measure("postgres transactions", tx["postgres"])
                import psycopg

                with psycopg.connect(url) as conn:
                    version = conn.execute("SHOW server_version").fetchone()
                info["PostgreSQL"] = str(version[0] if version else "?")
    elapsed = time.monotonic() - started
    info["load average at end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    info["SQLite"] = sqlite3.sqlite_version
    info["client libraries"] = bs.library_info(["redis", "hiredis", "psycopg", "psycopg-pool"])
    text = render(args, command, info, sections, verifies, tx, trips, elapsed)
    print()
    print(text)
    if args.write is not None:
        args.write.write_text(bs.splice(args.write, text, (BEGIN_MARK, END_MARK), SECTION))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
