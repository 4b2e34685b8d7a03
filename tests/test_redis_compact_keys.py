"""Compact Redis keys (``compact_keys``): ``<prefix>{<32 bytes>}`` instead of the key
hash's 64 hex digits (docs/stores.md, "Redis keys").

The conformance suite runs again here on a store with compact keys (``store_spec``
is overridden below). Then: the key's form, the option, the operations views and
commands on a keyspace holding both forms, errors that name the record by its key
hash, and a cluster, where a key's hash tag is whatever lies between its braces.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from _servers import RedisCluster, RedisServer
from conftest import StoreSpec
from redis.crc import key_slot

# The shared suite, collected again in this module, on compact keys.
from test_conformance import (  # noqa: F401
    test_attempt_context_manager,
    test_cancelled_during_claim_releases_the_key,
    test_cancelled_during_completion_still_completes,
    test_expired_processing_record_is_free,
    test_failure_is_retryable_by_default,
    test_final_failure_is_replayed,
    test_fingerprint_conflict_in_every_state,
    test_lease_expiry_takeover_and_fencing,
    test_one_mebibyte_body_round_trip,
    test_record_keeps_what_design_lists,
    test_renew_extends_a_live_lease,
    test_renewal_past_the_expiry_moves_it,
    test_scope_and_operation_separate_records,
    test_state_machine,
    test_ttl_expiry_and_narrowing,
    test_wait_ends_with_the_first_attempt,
)

from retrysafe import Claim, Engine, Outcome, Replay, StoreUnavailableError
from retrysafe._cli.app import main
from retrysafe._model.hashing import key_hash
from retrysafe.stores.redis import RedisStore

HOUR = 3600.0


@pytest.fixture
def store_spec(redis_server: RedisServer) -> StoreSpec:
    prefix = f"ck-{uuid.uuid4().hex[:8]}:"
    return StoreSpec("redis", redis_server.url, {"prefix": prefix, "compact_keys": True})


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def _pair(url: str) -> tuple[RedisStore, RedisStore]:
    """Two stores on one prefix: compact keys, and the hex keys of before."""
    prefix = f"ck-{uuid.uuid4().hex[:8]}:"
    return (
        RedisStore(url, prefix=prefix, compact_keys=True),
        RedisStore(url, prefix=prefix),
    )


def test_a_record_key_is_the_key_hash_s_32_bytes(redis_server: RedisServer, raw: Any) -> None:
    compact, hex_keys = _pair(redis_server.url)
    try:
        claim = Engine(compact).begin(str(uuid.uuid4()), operation="op")
        assert isinstance(claim, Claim)
        name = compact.record_key(claim.key_hash)
        prefix = compact.prefix.encode()
        assert name == prefix + b"{" + bytes.fromhex(claim.key_hash) + b"}"
        assert len(name) == len(prefix) + 34
        assert raw.get(name)[:1] == b"3"
        assert raw.exists(hex_keys.record_key(claim.key_hash)) == 0  # one name only
        # A key hash the engine never makes keeps its text (nothing to shorten).
        assert compact.record_key("not-hex") == f"{compact.prefix}{{not-hex}}"
        assert compact.record_key("ab" * 31) == f"{compact.prefix}{{{'ab' * 31}}}"
        assert compact.get("not-hex") is None and not compact.delete("not-hex")
    finally:
        compact.close()
        hex_keys.close()


@pytest.mark.parametrize(
    ("query", "keyword", "compact"),
    [
        ("", False, False),
        ("", True, True),
        ("?compact_keys=1", False, True),
        ("?compact_keys=true", False, True),
        ("?compact_keys=0", True, False),  # the URL wins
        ("?prefix=p:&compact_keys=off", False, False),
    ],
)
def test_the_option(query: str, keyword: bool, compact: bool) -> None:
    store = RedisStore(f"redis://127.0.0.1:1/0{query}", compact_keys=keyword)
    assert store.compact_keys is compact
    assert "compact_keys" not in store._client_url  # never handed to redis-py


def test_a_bad_value_of_the_option_is_refused() -> None:
    with pytest.raises(ValueError, match="compact_keys must be 1 or 0"):
        RedisStore("redis://127.0.0.1:1/0?compact_keys=maybe")


def test_an_error_names_the_record_by_its_key_hash(redis_server: RedisServer, raw: Any) -> None:
    store, _ = _pair(redis_server.url)
    try:
        kh = key_hash("", "op", "k")
        raw.set(store.record_key(kh), b"garbage")
        with pytest.raises(StoreUnavailableError) as info:
            Engine(store).begin("k", operation="op")
        assert f"{store.prefix}{{{kh}}}" in str(info.value)
    finally:
        store.close()


def test_the_operations_views_read_both_forms(
    redis_server: RedisServer, raw: Any, capsys: Any
) -> None:
    """A keyspace with records of both forms (a switch to compact keys): either store
    lists, counts, shows, sweeps and deletes both."""
    compact, hex_keys = _pair(redis_server.url)
    now = time.time()
    try:
        for store, tag in ((compact, "c"), (hex_keys, "h")):
            live = Engine(store, ttl=HOUR)
            past = Engine(store, ttl=HOUR, clock=lambda: now - 2 * HOUR)
            for engine, key in ((live, f"{tag}-live"), (past, f"{tag}-gone")):
                claim = engine.begin(key, operation="op")
                assert isinstance(claim, Claim)
                engine.complete(claim, Outcome.json(key))
        for store in (compact, hex_keys):
            listed = {r.key: r for r in store.records(limit=100)}
            assert set(listed) == {"c-live", "c-gone", "h-live", "h-gone"}
            assert all(r.key_hash == key_hash("", "op", k) for k, r in listed.items())
            assert store.stats(now).expired == 2
            assert sum(store.stats(now).counts.values()) == 2
            # get and delete address the store's own form, as a claim does.
            own, other = ("c-live", "h-live") if store is compact else ("h-live", "c-live")
            found = store.get(key_hash("", "op", own))
            assert found is not None and found.key == own
            assert store.get(key_hash("", "op", other)) is None
        url = f"{redis_server.url}?prefix={compact.prefix}&compact_keys=1"
        assert main(["list", "--store", url, "--json", "--limit", "100"]) == 0
        assert len(json.loads(capsys.readouterr().out)) == 4
        assert main(["inspect", "c-live", "--operation", "op", "--store", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["status"] == "completed"
        assert main(["sweep", "--store", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["deleted"] == 2
        assert {r.key for r in hex_keys.records(limit=100)} == {"c-live", "h-live"}
        assert not hex_keys.delete(key_hash("", "op", "c-live"))  # not its form
        assert hex_keys.delete(key_hash("", "op", "h-live"))
        assert {r.key for r in compact.records(limit=100)} == {"c-live"}
    finally:
        compact.close()
        hex_keys.close()


def test_a_retry_after_the_switch_needs_the_documented_wait(
    redis_server: RedisServer,
) -> None:
    """The switch looks under one name only: why docs/stores.md has it wait for the
    records of the other form to expire (or take a new prefix)."""
    compact, hex_keys = _pair(redis_server.url)
    try:
        first = Engine(hex_keys).begin("k", operation="op")
        assert isinstance(first, Claim)
        Engine(hex_keys).complete(first, Outcome.json(1))
        assert isinstance(Engine(hex_keys).begin("k", operation="op"), Replay)
        assert isinstance(Engine(compact).begin("k", operation="op"), Claim)
    finally:
        compact.close()
        hex_keys.close()


def test_compact_keys_on_a_cluster(redis_cluster: RedisCluster) -> None:
    """Each record stays in one slot (what lies between the first ``{`` and the next
    ``}``, even when the 32 bytes hold a ``}``) and the records spread."""
    store = RedisStore(redis_cluster.url, prefix=f"ck-{uuid.uuid4().hex[:8]}:", compact_keys=True)
    engine = Engine(store)
    try:
        client = store._sync_client()
        nodes, braced = set(), 0
        for i in range(80):
            claim = engine.begin(f"k{i}", operation="op")
            assert isinstance(claim, Claim)
            name = store.record_key(claim.key_hash)
            assert isinstance(name, bytes)
            inner = name[len(store.prefix) + 1 :]
            tag = inner[: inner.index(b"}")]
            braced += len(tag) < 32
            assert key_slot(name) == key_slot(tag or name)
            nodes.add(client.get_node_from_key(name).name)
            engine.renew(claim)
            engine.complete(claim, Outcome.json(i))
            replay = engine.begin(f"k{i}", operation="op")
            assert isinstance(replay, Replay) and replay.outcome.value == i
        assert len(nodes) == 3, "the keys should reach every primary"
        assert braced, "some of the 80 key hashes should hold a } (about 1 in 8 do)"
        assert len(store.records(limit=1000)) == 80
        for i in range(80):
            assert store.delete(key_hash("", "op", f"k{i}"))
    finally:
        store.close()
