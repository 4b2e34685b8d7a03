"""``ttl_from="completion"``: an answer is kept ``ttl`` from when it is stored, not
from its claim (the Mesh door's ``ttl`` is a cache duration). On every store, the
Redis Cluster, the partitioned PostgreSQL table and MySQL included, sync and async, with
the engine's clock moved by hand."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Api, Clock, StoreSpec, make_spec
from test_conformance import claim, replay

from retrysafe import Engine, LeaseLostError, Outcome, Status, Store, key_hash
from retrysafe.mesh import URN, MeshIdempotency
from retrysafe.stores.memory import MemoryStore

OP = "reports.build"
TTL = 3600.0
RUN = 600.0  # the handler's time: the answer is stored this long after its claim

ALL_STORES = [
    "memory",
    "sqlite",
    "redis",
    "postgres",
    "mysql",
    "redis-cluster",
    "postgres-partitioned",
]


@pytest.fixture(params=ALL_STORES)
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSpec:
    return make_spec(request.param, request, tmp_path)


def test_a_completion_keeps_the_answer_ttl_from_then(
    make_api: Any, clock: Clock, store: Store[Any]
) -> None:
    api: Api = make_api(ttl=TTL, lease=2 * RUN)
    start = clock.now
    c = claim(api.begin("k", operation=OP, ttl_from="completion"))
    assert c.expires_at == start + TTL  # in flight: bounded from the claim, as before
    clock.advance(RUN)
    api.complete(c, Outcome.json("report"))
    stored = start + RUN
    assert c.expires_at == stored + TTL  # the attempt knows the record's expiry
    record = store.get(c.key_hash)
    assert record is not None and record.status is Status.COMPLETED
    assert record.expires_at == stored + TTL and record.completed_at == stored
    clock.advance(TTL - RUN + 1)  # past the claim's expiry, before the answer's
    found = replay(api.begin("k", operation=OP, ttl_from="completion"))
    assert found.outcome is not None and found.outcome.value == "report"
    assert found.record.expires_at == stored + TTL
    clock.advance(RUN)  # past the answer's expiry: the key is free again
    again = claim(api.begin("k", operation=OP, ttl_from="completion"))
    assert again.took_over is None and again.attempts == 1


def test_a_final_failure_keeps_its_answer_ttl_from_then(
    make_api: Any, clock: Clock, store: Store[Any]
) -> None:
    api: Api = make_api(ttl=TTL, lease=2 * RUN)
    start = clock.now
    c = claim(api.begin("k", operation=OP, ttl_from="completion"))
    clock.advance(RUN)
    api.fail(c, Outcome.json({"error": "declined"}), final=True)
    record = store.get(c.key_hash)
    assert record is not None and (record.status, record.final) == (Status.FAILED, True)
    assert record.expires_at == start + RUN + TTL == c.expires_at
    clock.advance(TTL - RUN + 1)
    assert replay(api.begin("k", operation=OP)).failed
    n = claim(api.begin("n", operation=OP, ttl_from="completion"))  # and without an outcome
    api.fail(n, final=True)
    kept = store.get(n.key_hash)
    assert kept is not None and kept.outcome is None and kept.expires_at == clock.now + TTL


def test_by_default_the_expiry_stays_the_claims(
    make_api: Any, clock: Clock, store: Store[Any]
) -> None:
    api: Api = make_api(ttl=TTL, lease=2 * RUN)
    start = clock.now
    for key, settle in (("c", "complete"), ("f", "fail")):
        c = claim(api.begin(key, operation=OP))
        clock.advance(RUN)
        if settle == "complete":
            api.complete(c, Outcome.json("done"))
        else:
            api.fail(c, final=True)
        record = store.get(c.key_hash)
        assert record is not None and record.expires_at == c.expires_at
        assert c.expires_at == start + TTL + (RUN if key == "f" else 0)
        start = clock.now - RUN


def test_a_retryable_failure_moves_nothing(make_api: Any, clock: Clock, store: Store[Any]) -> None:
    """Nothing is kept from a retryable failure, so its record keeps the claim's expiry."""
    api: Api = make_api(ttl=TTL, lease=2 * RUN)
    c = claim(api.begin("k", operation=OP, ttl_from="completion"))
    claimed = c.expires_at
    clock.advance(RUN)
    api.fail(c, final=False)
    record = store.get(c.key_hash)
    assert record is not None and record.expires_at == claimed == c.expires_at


def test_a_short_answer_ttl_does_not_shorten_the_lease(
    make_api: Any, clock: Clock, store: Store[Any]
) -> None:
    """The answer's ttl is a cache duration: a running attempt keeps its whole lease
    (else a 1 ms ttl would be a 1 ms lease, renewed without end, and lost)."""
    api: Api = make_api(ttl=TTL, lease=RUN)
    start = clock.now
    c = claim(api.begin("k", operation=OP, ttl=60, ttl_from="completion"))
    assert c.lease_until == start + RUN and c.expires_at >= c.lease_until
    clock.advance(RUN / 2)
    api.complete(c, Outcome.json("done"))
    # (Redis keys expire on the server's clock: 60 s leaves room to read it back.)
    record = store.get(c.key_hash)
    assert record is not None and record.expires_at == clock.now + 60 == c.expires_at
    capped = claim(api.begin("n", operation=OP, ttl=60))  # from the claim: capped, as before
    assert capped.lease_until == clock.now + 60


def test_a_stale_attempt_moves_nothing(make_api: Any, clock: Clock, store: Store[Any]) -> None:
    """Fencing is unchanged: a completion that lost its lease writes nothing."""
    api: Api = make_api(ttl=TTL, lease=5)
    stale = claim(api.begin("k", operation=OP, ttl_from="completion"))
    clock.advance(6)
    new = claim(api.begin("k", operation=OP, ttl_from="completion"))
    clock.advance(RUN)
    for late in (
        lambda: api.complete(stale, Outcome.json("stale")),
        lambda: api.fail(stale, final=True),
    ):
        with pytest.raises(LeaseLostError):
            late()
        record = store.get(new.key_hash)
        assert record is not None and record.token == new.token
        assert record.status is Status.PROCESSING and record.expires_at == new.expires_at


def test_the_redis_key_ttl_follows(
    store_spec: StoreSpec, store: Store[Any], clock: Clock, mode: str
) -> None:
    """On Redis the key's own TTL moves with the record's expiry; a financial record
    (swept by the sweeper only, after it is archived) still gets none."""
    if not store_spec.name.startswith("redis"):
        pytest.skip("Redis keys only")
    for retention in ("standard", "financial"):
        api = Api(Engine(store, clock=clock, ttl=TTL, lease=2 * RUN, retention=retention), mode)
        client = store._sync_client()  # type: ignore[attr-defined]
        try:
            c = claim(api.begin(retention, operation=OP, ttl_from="completion"))
            key = store.record_key(c.key_hash)  # type: ignore[attr-defined]
            if retention == "standard":
                # The ten minutes of work, on the server's clock: the key's TTL runs down.
                assert client.pexpire(key, 5000)
            clock.advance(RUN)
            api.complete(c, Outcome.json("done"))
            pttl = client.pttl(key)
        finally:
            api.close()
        if retention == "financial":
            assert pttl == -1
        else:  # set by the completion, from the completion: the whole ttl is left
            assert TTL * 1000 - 60_000 < pttl <= TTL * 1000


def test_an_unknown_ttl_from_is_refused(make_api: Any, store: Store[Any]) -> None:
    api: Api = make_api()
    with pytest.raises(ValueError, match="ttl_from"):
        api.begin("k", operation=OP, ttl_from="settle")
    assert store.get(key_hash("", OP, "k")) is None


def test_a_store_that_cannot_move_the_expiry_keeps_the_claims(clock: Clock) -> None:
    """A store written before ``expires_at`` existed (no ``settle_expiry``, the old
    signature) still works: its records keep the claim's expiry."""

    class Older(MemoryStore):
        settle_expiry = False

        def complete(self, key_hash: str, token: str, outcome: Outcome, now: float) -> bool:  # type: ignore[override]
            return super().complete(key_hash, token, outcome, now)

    store = Older()
    assert not Engine(store).settles_expiry
    engine = Engine(store, clock=clock, ttl=TTL)
    c = claim(engine.begin("k", operation=OP, ttl_from="completion"))
    clock.advance(RUN)
    engine.complete(c, Outcome.json("done"))
    record = store.get(c.key_hash)
    assert record is not None and record.expires_at == c.expires_at == clock.now - RUN + TTL


def test_a_subclass_with_the_old_signature_keeps_the_claims_expiry(clock: Clock) -> None:
    """A built-in store's subclass that overrides a settling method without
    ``expires_at`` inherits ``settle_expiry``: the engine sees the override and keeps
    the claim's expiry, instead of failing the completion after the handler ran."""

    class Audited(MemoryStore):
        def complete(self, key_hash: str, token: str, outcome: Outcome, now: float) -> bool:  # type: ignore[override]
            return super().complete(key_hash, token, outcome, now)

    class Async(MemoryStore):
        async def afail(
            self, key_hash: str, token: str, outcome: Any, final: bool, now: float
        ) -> bool:  # type: ignore[override]
            return await super().afail(key_hash, token, outcome, final, now)

    assert Engine(MemoryStore()).settles_expiry
    assert not Engine(Async()).settles_expiry
    store = Audited()
    engine = Engine(store, clock=clock, ttl=TTL)
    assert not engine.settles_expiry
    c = claim(engine.begin("k", operation=OP, ttl_from="completion"))
    clock.advance(RUN)
    engine.complete(c, Outcome.json("done"))
    record = store.get(c.key_hash)
    assert record is not None and record.status is Status.COMPLETED
    assert record.expires_at == c.expires_at == clock.now - RUN + TTL


def test_a_transactional_completion_moves_it_too(
    store_spec: StoreSpec, store: Store[Any], clock: Clock
) -> None:
    if store_spec.name not in ("sqlite", "postgres", "postgres-partitioned", "mysql"):
        pytest.skip("transactional completion: SQL stores only")
    engine = Engine(store, clock=clock, ttl=TTL, lease=2 * RUN)
    with engine.attempt("k", operation=OP, ttl_from="completion") as att:
        clock.advance(RUN)
        with att.transaction():
            att.outcome = Outcome.json("done")
    record = store.get(key_hash("", OP, "k"))
    assert record is not None and record.status is Status.COMPLETED
    assert record.expires_at == clock.now + TTL


# -- the Mesh door ------------------------------------------------------------------------


def _request(rid: str, ttl: dict[str, Any] | None = None) -> dict[str, Any]:
    options: dict[str, Any] = {"key": "report-42"}
    if ttl is not None:
        options["ttl"] = ttl
    return {
        "protocol": {"name": "mesh", "version": "0.1.0"},
        "id": rid,
        "call": {"function": "reports.build", "arguments": {"month": "2026-10"}},
        "extensions": [{"urn": URN, "options": options}],
    }


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _data(answer: dict[str, Any]) -> dict[str, Any]:
    [entry] = [e for e in answer["extensions"] if e["urn"] == URN]
    return entry["data"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("ttl", [{"value": 1, "unit": "hour"}, None])
def test_mesh_counts_the_ttl_from_when_the_answer_is_stored(
    store: Store[Any], clock: Clock, mode: str, ttl: dict[str, Any] | None
) -> None:
    """A 10-minute handler with ``ttl`` 1 h keeps its answer 1 h after it is stored,
    and its ``expires_at`` says so (so does the policy's default ``ttl``)."""
    mesh = MeshIdempotency(Engine(store, clock=clock, lease=2 * RUN, ttl=30 * 86400), ttl=TTL)
    runs: list[float] = []

    def build(call: dict[str, Any]) -> Any:
        runs.append(clock.now)
        clock.advance(RUN)  # the work takes ten minutes
        return {"rows": 12}

    async def abuild(call: dict[str, Any]) -> Any:
        await asyncio.sleep(0)
        return build(call)

    loop = asyncio.new_event_loop()

    def handle(envelope: dict[str, Any]) -> dict[str, Any]:
        if mode == "sync":
            return mesh.handle(envelope, build)
        return loop.run_until_complete(mesh.ahandle(envelope, abuild))

    try:
        start = clock.now
        first = handle(_request("req_1", ttl))
        stored = start + RUN
        assert _data(first)["status"] == "processed"
        assert _data(first)["expires_at"] == _iso(stored + TTL)
        clock.advance(TTL - RUN + 1)  # past claim + ttl, the expiry before
        again = handle(_request("req_2", ttl))
        assert _data(again)["status"] == "cached" and again["result"] == {"rows": 12}
        assert _data(again)["expires_at"] == _iso(stored + TTL)
        assert _data(again)["cached_at"] == _iso(stored) and len(runs) == 1
        clock.advance(RUN)  # past stored + ttl
        assert _data(handle(_request("req_3", ttl)))["status"] == "processed"
        assert len(runs) == 2
    finally:
        loop.run_until_complete(mesh.aclose())
        loop.close()


def test_an_expiry_past_every_partition_made_ahead(
    make_api: Any, clock: Clock, store: Store[Any]
) -> None:
    """On a partitioned table (half-hour partitions, made an hour ahead here) the
    completion moves its row to a partition nobody made yet: it makes it, as a
    claim does, and the record is kept."""
    api: Api = make_api(ttl=5 * TTL, lease=TTL)
    c = claim(api.begin("far", operation=OP, ttl_from="completion"))
    clock.advance(2000)  # past the claim's partition's upper bound
    api.complete(c, Outcome.json("far"))
    stored = clock.now
    record = store.get(c.key_hash)
    assert record is not None and record.expires_at == stored + 5 * TTL
    clock.advance(5 * TTL - 1)
    assert replay(api.begin("far", operation=OP)).outcome.value == "far"  # type: ignore[union-attr]
    f = claim(api.begin("fail", operation=OP, ttl_from="completion"))
    clock.advance(2000)
    api.fail(f, final=True)
    failed = store.get(f.key_hash)
    assert failed is not None and failed.expires_at == clock.now + 5 * TTL
