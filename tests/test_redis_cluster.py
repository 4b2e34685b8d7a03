"""Redis Cluster: 3 primaries with a replica each, on loopback (``_servers.RedisCluster``).

The conformance suite and the race tests run here on ``redis+cluster://``
(``store_spec`` and ``shared_spec`` are overridden below). Then what only a
cluster has: every record and script in one slot; slots moved between primaries
while processes race on the keys (MOVED and ASK redirections); a primary failed
over by hand, and one SIGKILLed, while they race. In each, every key's side
effect ran exactly once, every racer got that execution's answer, and every key
replays it afterwards; and the same with every client connection cut again and
again.

The load: ``PROCESSES`` spawned processes each ask for every key once (so each
key is asked for ``PROCESSES`` times at about the same moment), half of them from
threads and half from asyncio tasks. A racer that meets an unreachable store
(what an HTTP client sees as 503 + Retry-After) or a key in flight (409) asks
again with the same key, as a client would.

A fault must meet the load, however fast the load runs on the machine: one key
on each primary is *held*. The racer that runs it keeps its claim (renewing the
lease) and completes it only when the test opens the gate, after the fault; the
racers asking for it meanwhile wait and ask again. So no racer can finish before
the fault, and a completion, a claim and waiting racers on every primary cross it.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _servers import RedisCluster, RedisServer
from conftest import StoreSpec, make_spec
from redis.crc import key_slot

# The shared suites, collected again in this module, on the cluster.
from test_conformance import (  # noqa: F401
    test_an_outcome_that_cannot_be_stored_fails_finally,
    test_attempt_context_manager,
    test_bad_arguments_touch_nothing,
    test_cancelled_during_claim_releases_the_key,
    test_cancelled_during_completion_still_completes,
    test_expired_processing_record_is_free,
    test_failure_is_retryable_by_default,
    test_final_failure_is_replayed,
    test_fingerprint_conflict_in_every_state,
    test_good_keys,
    test_lease_expiry_takeover_and_fencing,
    test_one_mebibyte_body_round_trip,
    test_record_keeps_what_design_lists,
    test_renew_extends_a_live_lease,
    test_scope_and_operation_separate_records,
    test_state_machine,
    test_ttl_expiry_and_narrowing,
    test_wait_ends_with_the_first_attempt,
    test_wait_is_bounded,
)
from test_races import test_processes_race, test_tasks_race, test_threads_race  # noqa: F401

from retrysafe import (
    Claim,
    Engine,
    InProgressError,
    Outcome,
    Replay,
    StoreUnavailableError,
)
from retrysafe._model.hashing import key_hash
from retrysafe.stores.redis import RedisStore


@pytest.fixture
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSpec:
    return make_spec("redis-cluster", request, tmp_path)


@pytest.fixture
def shared_spec(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSpec:
    return make_spec("redis-cluster", request, tmp_path)


OP = "load"
PROCESSES = 4
THREADS = 6
LEASE = 10.0  # a completion is resent until then; a claim whose reply was lost waits it out


# -- slots -------------------------------------------------------------------------


def test_every_record_and_script_stays_in_one_slot(redis_cluster: RedisCluster) -> None:
    """A record's Redis key is ``<prefix>{<key hash>}``: the hash tag is the whole key
    hash, so a record's slot is the key hash's, whatever the prefix; every script
    takes that one key. The whole life of records spread over every primary works."""
    store = RedisStore(redis_cluster.url, prefix=f"slots-{uuid.uuid4().hex[:8]}:")
    engine = Engine(store, final_failures=True)
    try:
        slots, nodes = set(), set()
        client = store._sync_client()
        for i in range(60):
            claim = engine.begin(f"k{i}", operation=OP)
            assert isinstance(claim, Claim)
            rkey = store.record_key(claim.key_hash)
            assert key_slot(rkey.encode()) == key_slot(claim.key_hash.encode())
            assert key_slot(f"other:{{{claim.key_hash}}}".encode()) == key_slot(rkey.encode())
            slots.add(key_slot(rkey.encode()))
            nodes.add(client.get_node_from_key(rkey).name)
            engine.renew(claim)
            if i % 2:
                engine.complete(claim, Outcome.json(i))
            else:
                engine.fail(claim, Outcome.json(-i))
            replay = engine.begin(f"k{i}", operation=OP)
            assert isinstance(replay, Replay) and replay.outcome.value == (i if i % 2 else -i)
            assert store.delete(claim.key_hash)
        assert len(nodes) == 3, "the keys should reach every primary"
        assert len(slots) == 60
    finally:
        store.close()


# -- the load ----------------------------------------------------------------------


def _answer(result: Any) -> tuple[str, Any] | None:
    """What a racer does with ``begin``'s result: ('replay', value) or None (it ran)."""
    if isinstance(result, Replay):
        return "replay", result.outcome.value
    return None


def _effect(path: str, key: str, who: str) -> None:
    """The side effect: one line per execution, appended atomically (O_APPEND)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{key} {who}\n".encode())
    finally:
        os.close(fd)


def _hold(engine: Engine, claim: Claim, gate: Any, seen: Counter[str]) -> None:
    """A held key: keep the claim (renew its lease) until the test opens ``gate``."""
    while not gate.wait(0.5):
        try:
            engine.renew(claim)
        except StoreUnavailableError:
            seen["unavailable"] += 1


async def _ahold(engine: Engine, claim: Claim, gate: Any, seen: Counter[str]) -> None:
    while not await asyncio.to_thread(gate.wait, 0.5):
        try:
            await engine.arenew(claim)
        except StoreUnavailableError:
            seen["unavailable"] += 1


def _ask_sync(engine: Engine, key: str, who: str, race: _Race, seen: Counter[str]) -> Any:
    while True:
        try:
            result = engine.begin(key, operation=OP, fingerprint="f", wait=5)
            answer = _answer(result)
            if answer is not None:
                return answer
            _effect(race.effects, key, who)
            if key in race.held:
                _hold(engine, result, race.gate, seen)
            engine.complete(result, Outcome.json(who))
            return "claim", who
        except StoreUnavailableError:
            seen["unavailable"] += 1
            time.sleep(0.05)
        except InProgressError:
            seen["in_flight"] += 1
            time.sleep(0.05)


async def _ask_async(engine: Engine, key: str, who: str, race: _Race, seen: Counter[str]) -> Any:
    while True:
        try:
            result = await engine.abegin(key, operation=OP, fingerprint="f", wait=5)
            answer = _answer(result)
            if answer is not None:
                return answer
            _effect(race.effects, key, who)
            if key in race.held:
                await _ahold(engine, result, race.gate, seen)
            await engine.acomplete(result, Outcome.json(who))
            return "claim", who
        except StoreUnavailableError:
            seen["unavailable"] += 1
            await asyncio.sleep(0.05)
        except InProgressError:
            seen["in_flight"] += 1
            await asyncio.sleep(0.05)


@dataclass(frozen=True)
class _Race:
    """What every racer process shares: where effects go, the held keys, the gate."""

    url: str
    prefix: str
    keys: list[str]
    effects: str
    held: frozenset[str]
    gate: Any  # a multiprocessing Event


def _racer(race: _Race, n: int, queue: Any) -> None:
    """One process: asks for every key once, from threads (even n) or tasks (odd n)."""
    keys = list(race.keys)
    random.Random(n).shuffle(keys)
    engine = Engine(RedisStore(race.url, prefix=race.prefix), lease=LEASE)
    seen: Counter[str] = Counter()
    me = f"p{n}"
    if n % 2 == 0:

        def ask(key: str) -> Any:
            return key, _ask_sync(engine, key, me, race, seen)

        with ThreadPoolExecutor(THREADS) as pool:
            answers = list(pool.map(ask, keys))
    else:

        async def run() -> list[Any]:
            gate = asyncio.Semaphore(THREADS * 4)

            async def ask(key: str) -> Any:
                async with gate:
                    return key, await _ask_async(engine, key, me, race, seen)

            return await asyncio.gather(*(ask(k) for k in keys))

        answers = asyncio.run(run())
    engine.store.close()
    queue.put((answers, dict(seen)))


class Load:
    """``PROCESSES`` racers over ``count`` keys, started at once; see the docstring."""

    def __init__(self, cluster: RedisCluster, tmp_path: Path, count: int) -> None:
        self.cluster = cluster
        url = cluster.url
        self.prefix = f"load-{uuid.uuid4().hex[:8]}:"
        self.keys = [f"key-{i}" for i in range(count)]
        self.effects = tmp_path / "effects"
        self.effects.touch()
        self.held = _one_key_per_primary(cluster, self.keys)
        ctx = mp.get_context("spawn")
        self.gate = ctx.Event()
        self.queue = ctx.Queue()
        race = _Race(url, self.prefix, self.keys, str(self.effects), self.held, self.gate)
        self.procs = [
            ctx.Process(target=_racer, args=(race, n, self.queue)) for n in range(PROCESSES)
        ]
        for proc in self.procs:
            proc.start()

    def executed(self) -> int:
        """Side effects so far."""
        return len(self.effects.read_bytes().splitlines())

    def wait_held(self, timeout: float = 120) -> None:
        """Wait until every held key has run (and is being held)."""
        deadline = time.monotonic() + timeout
        while not self.held <= {line.split()[0] for line in self.effects.read_text().splitlines()}:
            assert time.monotonic() < deadline, "the held keys did not run"
            assert all(p.is_alive() for p in self.procs), "a racer ended early"
            time.sleep(0.02)

    def release(self) -> None:
        """Open the gate: the held keys complete."""
        self.gate.set()

    def wait_for(self, executed: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.executed() < executed:
            assert time.monotonic() < deadline, f"the load stalled at {self.executed()}"
            assert any(p.is_alive() for p in self.procs), "the racers ended early"
            time.sleep(0.02)

    def check(self, timeout: float = 240) -> Counter[str]:
        """Every key executed once, everyone got that answer, and it replays now."""
        results = [self.queue.get(timeout=timeout) for _ in self.procs]
        for proc in self.procs:
            proc.join(30)
            assert proc.exitcode == 0
        lines = [line.split() for line in self.effects.read_text().splitlines()]
        runs = Counter(key for key, _ in lines)
        twice = {k: n for k, n in runs.items() if n > 1}
        assert not twice, f"{len(twice)} keys executed more than once: {list(twice.items())[:5]}"
        assert set(runs) == set(self.keys)
        winner = dict(lines)
        seen: Counter[str] = Counter()
        for answers, counts in results:
            seen.update(counts)
            assert len(answers) == len(self.keys)
            for key, (_, value) in answers:
                assert value == winner[key], f"{key}: answered {value}, ran as {winner[key]}"
        engine = Engine(RedisStore(self.cluster.url, prefix=self.prefix))
        try:
            for key in self.keys:
                replay = engine.begin(key, operation=OP, fingerprint="f")
                assert isinstance(replay, Replay), f"{key} was lost"
                assert replay.outcome.value == winner[key]
        finally:
            engine.store.close()
        return seen

    def stop(self) -> None:
        self.gate.set()
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


def _one_key_per_primary(cluster: RedisCluster, keys: list[str]) -> frozenset[str]:
    """A key of ``keys`` in a slot of each primary."""
    held = []
    for primary in cluster.primaries():
        owned = _owned_slots(cluster, primary)
        held.append(next(k for k in keys if key_slot(key_hash("", OP, k).encode()) in owned))
    return frozenset(held)


@pytest.fixture
def load(redis_cluster: RedisCluster, tmp_path: Path) -> Iterator[Callable[[int], Load]]:
    made: list[Load] = []

    def start(count: int) -> Load:
        made.append(Load(redis_cluster, tmp_path, count))
        return made[-1]

    yield start
    for one in made:
        one.stop()


# -- redirections ------------------------------------------------------------------


def _node_id(cluster: RedisCluster, node: RedisServer) -> str:
    return cluster.cli(node, "CLUSTER", "MYID").strip()


def _owned_slots(cluster: RedisCluster, node: RedisServer) -> set[int]:
    me = _node_id(cluster, node)
    owned: set[int] = set()
    for line in cluster.cli(node, "CLUSTER", "NODES").splitlines():
        parts = line.split()
        if parts[0] != me:
            continue
        for piece in parts[8:]:
            if piece.startswith("["):
                continue  # a slot being migrated or imported
            first, _, last = piece.partition("-")
            owned.update(range(int(first), int(last or first) + 1))
    return owned


def _reshard(cluster: RedisCluster, source: RedisServer, target: RedisServer, slots: int) -> None:
    """Move ``slots`` slots (and their keys, by MIGRATE) from ``source`` to ``target``."""
    cluster.cli(
        source,
        "--cluster",
        "reshard",
        f"127.0.0.1:{source.port}",
        "--cluster-from",
        _node_id(cluster, source),
        "--cluster-to",
        _node_id(cluster, target),
        "--cluster-slots",
        str(slots),
        "--cluster-yes",
        "--cluster-pipeline",
        "5",
        timeout=120,
    )


def test_slots_moved_during_load(redis_cluster: RedisCluster, load: Callable[[int], Load]) -> None:
    """``redis-cli --cluster reshard`` moves slots from one primary to another and back
    while the racers run: clients follow MOVED (the slot has moved) and ASK (the key
    has already been migrated, the slot not yet) to the node that holds the key, and
    every key still runs once. Some racers get StoreUnavailableError meanwhile (503
    + Retry-After over HTTP): redis-py drops connections that other threads and tasks
    are using when it refreshes its map of the slots."""
    redis_cluster.wait_healthy()
    a, b = redis_cluster.primaries()[:2]
    before = _owned_slots(redis_cluster, a)
    running = load(3000)
    running.wait_for(300)
    running.wait_held()
    _reshard(redis_cluster, a, b, 1500)
    moved = before - _owned_slots(redis_cluster, a)
    assert len(moved) == 1500 and moved <= _owned_slots(redis_cluster, b)
    running.release()
    redis_cluster.wait_healthy()  # every node knows the new owner before moving back
    _reshard(redis_cluster, b, a, 1500)
    seen = running.check()
    redis_cluster.wait_healthy()
    hashes = {key_hash("", OP, k) for k in running.keys}
    touched = [h for h in hashes if key_slot(h.encode()) in moved]
    assert len(touched) > 50, "the load should have keys in the slots that moved"
    # Some racers did get StoreUnavailableError (a 503 over HTTP) and asked again:
    # when a slot moves, redis-py refreshes its map of the cluster and closes
    # connections that other threads and tasks were using.
    print(f"racers told the store was unavailable: {seen['unavailable']}")


# -- failover ----------------------------------------------------------------------


def _promoted(cluster: RedisCluster, replica: RedisServer, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while cluster.role(replica) != "master":
        assert time.monotonic() < deadline, "the replica was not promoted"
        time.sleep(0.05)


def test_manual_failover_during_load(
    redis_cluster: RedisCluster, load: Callable[[int], Load]
) -> None:
    """``CLUSTER FAILOVER`` on a replica: the primary stops taking writes, the replica
    catches up and takes over; clients follow the MOVED that the old primary answers
    from then on. Nothing acknowledged is lost (the handover waits for the replica)."""
    primary = redis_cluster.primaries()[0]
    (replica,) = redis_cluster.replicas_of(primary)
    running = load(3000)
    running.wait_for(300)
    running.wait_held()
    redis_cluster.cli(replica, "CLUSTER", "FAILOVER")
    _promoted(redis_cluster, replica)
    running.release()
    redis_cluster.wait_healthy()
    running.check()
    assert redis_cluster.role(primary) == "slave"


def test_primary_killed_during_load(
    redis_cluster: RedisCluster, load: Callable[[int], Load]
) -> None:
    """A primary SIGKILLed: for the cluster node timeout and the election (about 2 s
    here), its slots are unreachable and racers on them get StoreUnavailableError
    (over HTTP: 503 + Retry-After) and ask again; a completion in flight is sent again
    (``settle_retry``) until the promoted replica takes it. Then the old primary
    comes back as a replica. No key runs twice, none is lost."""
    primary = redis_cluster.primaries()[0]
    (replica,) = redis_cluster.replicas_of(primary)
    running = load(3000)
    running.wait_for(300)
    running.wait_held()
    try:
        primary.kill()
        _promoted(redis_cluster, replica)
        running.release()
        seen = running.check()
    finally:
        if not primary.running:
            primary.start()
        redis_cluster.wait_healthy()
    assert seen["unavailable"] > 0, "no racer met the outage"
    assert redis_cluster.role(primary) == "slave"


def test_connections_cut_during_load(
    redis_cluster: RedisCluster, load: Callable[[int], Load]
) -> None:
    """``CLIENT KILL TYPE normal`` on every primary, every 0.2 s while the racers run:
    a call on a cut connection raises StoreUnavailableError (503) and is asked
    again; a completion on one is sent again on a new connection. Every key runs
    once and none is lost."""
    redis_cluster.wait_healthy()
    running = load(2000)
    running.wait_for(100)
    running.wait_held()
    cuts = 0
    deadline = time.monotonic() + 240
    while True:
        for node in redis_cluster.primaries():
            cuts += int(redis_cluster.cli(node, "CLIENT", "KILL", "TYPE", "normal") or 0)
        running.release()  # after the first cut, made while every racer was connected
        if running.executed() >= len(running.keys):
            break
        assert time.monotonic() < deadline, f"the load stalled at {running.executed()}"
        time.sleep(0.2)
    running.check()
    assert cuts > 0, "no connection was cut"


def test_cluster_client_reads_one_node_url(redis_cluster: RedisCluster) -> None:
    """Any node's address finds the whole cluster, a replica's included."""
    replica = redis_cluster.replicas_of(redis_cluster.primaries()[0])[0]
    store = RedisStore(f"redis+cluster://127.0.0.1:{replica.port}", prefix="any-node:")
    try:
        engine = Engine(store)
        claims = [engine.begin(f"k{i}", operation=OP) for i in range(30)]
        assert all(isinstance(c, Claim) for c in claims)
        for c in claims:
            assert isinstance(c, Claim)
            engine.complete(c, Outcome.json(1))
            assert store.delete(c.key_hash)
    finally:
        store.close()
