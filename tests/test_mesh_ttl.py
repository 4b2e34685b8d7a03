"""The Mesh ``ttl`` option: honoured up to the policy's maximum, refused above it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from conftest import Clock

from retrysafe import Engine, Store, key_hash
from retrysafe.mesh import MAX_TTL, URN, MeshApp, MeshIdempotency

KEY = "charge_order456_v1"
OPERATION = "payments.charge@1"
DAY = 86400.0


def request(rid: str = "req_001", key: str = KEY, **options: Any) -> dict[str, Any]:
    return {
        "protocol": {"name": "mesh", "version": "0.1.0"},
        "id": rid,
        "call": {"function": "payments.charge", "version": "1", "arguments": {"amount": 100}},
        "extensions": [{"urn": URN, "options": {"key": key, **options}}],
    }


def iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


class Charges:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, call: dict[str, Any]) -> Any:
        self.calls += 1
        return {"charged": self.calls}


def test_a_ttl_over_the_maximum_is_refused(memory: Store[Any], clock: Clock) -> None:
    mesh = MeshIdempotency(memory, max_ttl=MAX_TTL)  # ttl 24 h, max_ttl 30 days (the reference's)
    mesh.engine.clock = clock
    charge = Charges()
    for ttl in ({"value": 31, "unit": "day"}, {"value": 2592001, "unit": "second"}):
        answer = mesh.handle(request(ttl=ttl), charge)
        assert answer["result"] is None and "extensions" not in answer
        [error] = answer["errors"]
        assert error["code"] == "INVALID_ARGUMENTS" and error["retryable"] is False
        assert error["source"] == {"pointer": "/extensions/0/options/ttl"}
        assert error["details"] == {"max_ttl": {"value": 2592000, "unit": "second"}}
        assert "2592000" in error["message"]
        assert asyncio.run(mesh.ahandle(request(ttl=ttl), charge)) == answer
    assert charge.calls == 0 and memory.records() == []  # nothing run, nothing written


def test_a_ttl_past_float_range_is_refused(memory: Store[Any]) -> None:
    answer = MeshIdempotency(memory).handle(
        request(ttl={"value": 10**400, "unit": "day"}), Charges()
    )
    assert answer["errors"][0]["code"] == "INVALID_ARGUMENTS"
    assert memory.records() == []


def test_a_ttl_up_to_the_maximum_is_honoured(memory: Store[Any], clock: Clock) -> None:
    mesh = MeshIdempotency(Engine(memory, clock=clock, ttl=30 * DAY), ttl=DAY, max_ttl=30 * DAY)
    charge = Charges()
    start = clock.now
    for key, ttl, seconds in [
        ("two-days", {"value": 2, "unit": "day"}, 2 * DAY),  # over the default: honoured
        ("thirty", {"value": 30, "unit": "days"}, 30 * DAY),  # the maximum itself
        ("short", {"value": 10, "unit": "minute"}, 600),
        ("plain", None, DAY),  # no ttl: the default
    ]:
        options = {} if ttl is None else {"ttl": ttl}
        answer = mesh.handle(request(key=key, **options), charge)
        assert answer["extensions"][0]["data"]["expires_at"] == iso(start + seconds)
        record = memory.get(key_hash("", OPERATION, key))
        assert record is not None and record.expires_at == start + seconds
    clock.advance(DAY + 1)
    again = mesh.handle(request("req_002", key="two-days"), charge)
    assert again["extensions"][0]["data"]["status"] == "cached" and charge.calls == 4


def test_the_maximum_is_an_option(memory: Store[Any]) -> None:
    mesh = MeshIdempotency(memory, ttl=600, max_ttl=3600)
    assert (mesh.ttl, mesh.max_ttl, mesh.engine.ttl) == (600, 3600, 3600)
    answer = mesh.handle(request(ttl={"value": 61, "unit": "minute"}), Charges())
    assert answer["errors"][0]["details"] == {"max_ttl": {"value": 3600, "unit": "second"}}
    assert "max_ttl=3600s" in repr(mesh)
    half = MeshIdempotency(memory, max_ttl=1.5)
    answer = half.handle(request(ttl={"value": 2, "unit": "second"}), Charges())
    assert answer["errors"][0]["details"] == {"max_ttl": {"value": 1.5, "unit": "second"}}


def test_the_defaults() -> None:
    memory = Engine("memory://").store
    mesh = MeshIdempotency(memory)  # a request may shorten the policy's ttl, not lengthen it
    assert (mesh.ttl, mesh.max_ttl, mesh.engine.ttl) == (DAY, DAY, DAY)
    answer = mesh.handle(request(ttl={"value": 25, "unit": "hour"}), Charges())
    assert answer["errors"][0]["details"] == {"max_ttl": {"value": DAY, "unit": "second"}}
    assert MeshIdempotency(memory, ttl=600).max_ttl == 600
    assert MeshIdempotency(memory, max_ttl=600).ttl == 600  # the default fits the maximum
    reference = MeshIdempotency(memory, max_ttl=MAX_TTL)  # the reference implementation's
    assert (reference.ttl, reference.max_ttl, reference.engine.ttl) == (DAY, 30 * DAY, 30 * DAY)
    engine = Engine(memory, ttl=7200)  # an engine's ttl is the maximum
    assert (MeshIdempotency(engine).ttl, MeshIdempotency(engine).max_ttl) == (7200, 7200)
    assert (MeshIdempotency(engine, ttl=60).ttl, MeshIdempotency(engine, ttl=60).max_ttl) == (
        60,
        60,
    )
    assert MeshIdempotency(engine, ttl=60, max_ttl=600).max_ttl == 600


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"ttl": 7200, "max_ttl": 3600}, ValueError),
        ({"max_ttl": 0}, ValueError),
        ({"max_ttl": float("inf")}, ValueError),
        ({"max_ttl": "30d"}, TypeError),
    ],
)
def test_bad_maximum(options: dict[str, Any], error: type[Exception], memory: Store[Any]) -> None:
    with pytest.raises(error):
        MeshIdempotency(memory, **options)


def test_an_engine_caps_the_maximum(memory: Store[Any]) -> None:
    with pytest.raises(ValueError, match="over the engine's ttl"):
        MeshIdempotency(Engine(memory, ttl=3600), max_ttl=7200)


def test_mesh_app_refuses_over_the_maximum(memory: Store[Any]) -> None:
    charge = Charges()
    app = MeshApp({"payments.charge": charge}, memory, max_ttl=3600, principal=lambda r: "t1")
    assert app.mesh.max_ttl == 3600

    async def post(body: dict[str, Any]) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://mesh") as client:
            return await client.post("/", json=body)

    answer = asyncio.run(post(request(ttl={"value": 2, "unit": "hour"}))).json()
    assert answer["errors"][0]["code"] == "INVALID_ARGUMENTS"
    assert answer["errors"][0]["source"] == {"pointer": "/extensions/0/options/ttl"}
    assert charge.calls == 0 and memory.records() == []
    ok = asyncio.run(post(request(ttl={"value": 1, "unit": "hour"}))).json()
    assert ok["result"] == {"charged": 1}
