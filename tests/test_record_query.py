"""RecordQuery: one validated filter for Store.records, as an object or as keywords."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from retrysafe import Engine, Outcome, Status
from retrysafe._model.record import Record
from retrysafe.stores import RecordQuery, Store, open_store


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store[Any]]:
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        url = f"{server.url}?table=q_{uuid.uuid4().hex[:12]}"
    else:
        url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path}/q.db"
    engine = Engine(open_store(url))
    for i in range(5):
        claim = engine.begin(f"k{i}", operation="pay" if i % 2 else "ship", fingerprint="f")
        if i < 3:
            engine.complete(claim, Outcome.json({"i": i}))
    yield engine.store
    engine.store.close()


def keys(records: list[Record]) -> list[str]:
    return [r.key for r in records]


def test_keywords_and_a_query_select_the_same_records(store: Store[Any]) -> None:
    assert keys(store.records()) == ["k0", "k1", "k2", "k3", "k4"]
    assert keys(store.records(status="processing")) == ["k3", "k4"]
    assert keys(store.records(RecordQuery(status=Status.PROCESSING))) == ["k3", "k4"]
    assert keys(store.records(RecordQuery(operation="pay"), limit=1)) == ["k1"]
    assert keys(store.records(key="k3")) == ["k3"]
    assert store.records(limit=0) == []


def test_a_query_is_validated_once_when_made() -> None:
    assert RecordQuery(status="failed").status is Status.FAILED
    with pytest.raises(ValueError, match="limit"):
        RecordQuery(limit=-1)
    with pytest.raises(ValueError, match="limit"):
        RecordQuery(limit=True)
    with pytest.raises(ValueError):
        RecordQuery(status="lost")
    with pytest.raises(TypeError):
        open_store("memory://").records(state="processing")
