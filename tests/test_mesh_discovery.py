"""Mesh discovery over HTTP: capabilities, describe, and a function that opts out of idempotency."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _hangup import CALLER
from _http_servers import ThreadServer

from retrysafe import Store, open_store
from retrysafe.client import MeshClient
from retrysafe.mesh import URN, MeshApp, MeshFunction

PROTOCOL = {"name": "mesh", "version": "0.1.0"}
CAPABILITIES = "urn:cline:mesh:fn:capabilities"
DESCRIBE = "urn:cline:mesh:fn:describe"
TRACING = {"urn": "urn:mesh:ext:tracing", "options": {"trace_id": "tr_1"}}


def request(
    function: str,
    arguments: dict[str, Any] | None = None,
    key: str | None = None,
    rid: str = "req_001",
    extensions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    envelope: dict[str, Any] = {
        "protocol": dict(PROTOCOL),
        "id": rid,
        "call": {"function": function, "version": "1.0.0", "arguments": arguments or {}},
    }
    extensions = list(extensions or [])
    if key is not None:
        extensions.append({"urn": URN, "options": {"key": key}})
    if extensions:
        envelope["extensions"] = extensions
    return envelope


class Orders:
    """A charge that takes idempotency keys and a lookup that does not; both count their runs."""

    def __init__(self) -> None:
        self.runs: list[str] = []

    def charge(self, call: dict[str, Any]) -> Any:
        """Charge a card.

        Not part of the description: only the first line is.
        """
        self.runs.append("charge")
        return {"charge_id": "ch_1"}

    def lookup(self, call: dict[str, Any]) -> Any:
        self.runs.append("lookup")
        return {"status": "succeeded"}

    def handlers(self) -> dict[str, Any]:
        return {
            "payments.charge": MeshFunction(self.charge, side_effects=["create"]),
            "payments.lookup": MeshFunction(
                self.lookup,
                idempotency=False,
                description="Look a charge up",
                side_effects=[],
                versions=["1.0.0", "2.0.0"],
            ),
            "payments.refund": lambda call: {"refunded": True},
        }


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[httpx.Client, Orders, Store[Any]]]:
    orders = Orders()
    store = open_store(f"sqlite:///{tmp_path}/mesh.db")
    app = MeshApp(orders.handlers(), store, max_body=4096, service="orders-api")
    with (
        ThreadServer(app, "asgi") as server,
        httpx.Client(base_url=server.url, headers=CALLER) as client,
    ):
        yield client, orders, store
    store.close()


Served = tuple[httpx.Client, Orders, Store[Any]]


@pytest.mark.parametrize("function", [CAPABILITIES, "urn:cline:mesh:ext:discovery:fn:capabilities"])
def test_capabilities(served: Served, function: str) -> None:
    client, orders, store = served
    answer = client.post("/mesh", json=request(function))
    assert answer.status_code == 200
    body = answer.json()
    assert body["id"] == "req_001" and body["protocol"] == PROTOCOL and not body.get("errors")
    assert body["result"] == {
        "service": "orders-api",
        "protocol_versions": ["0.1.0"],
        "extensions": [{"urn": URN}],
        "functions": [
            "payments.charge",
            "payments.lookup",
            "payments.refund",
            CAPABILITIES,
            DESCRIBE,
        ],
        "limits": {"max_request_bytes": 4096},
    }
    assert orders.runs == [] and store.records() == []


def test_describe_a_function_that_takes_idempotency(served: Served) -> None:
    client, _, _ = served
    answer = client.post("/mesh", json=request(DESCRIBE, {"function": "payments.charge"}))
    assert answer.status_code == 200
    assert answer.json()["result"] == {
        "function": "payments.charge",
        "description": "Charge a card.",
        "side_effects": ["create"],
        "versions": [{"version": "1.0.0", "stability": "stable"}],  # no extensions: all of them
        "recommended_version": "1.0.0",
    }
    plain = client.post("/mesh", json=request(DESCRIBE, {"function": "payments.refund"}))
    assert plain.json()["result"] == {
        "function": "payments.refund",
        "description": "",
        "versions": [{"version": "1.0.0", "stability": "stable"}],
        "recommended_version": "1.0.0",
    }


@pytest.mark.parametrize("function", [DESCRIBE, "urn:cline:mesh:ext:discovery:fn:describe"])
def test_describe_an_opted_out_function(served: Served, function: str) -> None:
    client, _, store = served
    excluded = {"excluded": [URN]}
    answer = client.post("/mesh", json=request(function, {"function": "payments.lookup"}))
    assert answer.status_code == 200
    assert answer.json()["result"] == {
        "function": "payments.lookup",
        "description": "Look a charge up",
        "side_effects": [],
        "versions": [
            {"version": "1.0.0", "stability": "stable", "extensions": excluded},
            {"version": "2.0.0", "stability": "stable", "extensions": excluded},
        ],
        "recommended_version": "2.0.0",
    }
    one = client.post(
        "/mesh",
        json=request(function, {"function": "payments.lookup", "version": "1.0.0"}),
    )
    assert one.json()["result"]["versions"] == [
        {"version": "1.0.0", "stability": "stable", "extensions": excluded}
    ]
    assert one.json()["result"]["recommended_version"] == "2.0.0"
    assert store.records() == []


def test_describe_the_discovery_functions(served: Served) -> None:
    client, _, _ = served
    for name in (CAPABILITIES, "urn:cline:mesh:ext:discovery:fn:describe"):
        result = client.post("/mesh", json=request(DESCRIBE, {"function": name})).json()["result"]
        assert result["function"] == name and result["side_effects"] == []
        assert result["versions"] == [{"version": "1.0.0", "stability": "stable"}]


@pytest.mark.parametrize(
    ("arguments", "status", "code", "pointer", "details"),
    [
        ({}, 400, "INVALID_ARGUMENTS", "/call/arguments/function", {"reason": "required"}),
        ({"function": 7}, 400, "INVALID_ARGUMENTS", "/call/arguments/function", {}),
        ({"function": ""}, 400, "INVALID_ARGUMENTS", "/call/arguments/function", {}),
        (
            {"function": "payments.charge", "version": 2},
            400,
            "INVALID_ARGUMENTS",
            "/call/arguments/version",
            {},
        ),
        (
            {"function": "payments.charge", "include_schema": "yes"},
            400,
            "INVALID_ARGUMENTS",
            "/call/arguments/include_schema",
            {},
        ),
        (
            {"function": "payments.nope"},
            404,
            "FUNCTION_NOT_FOUND",
            "/call/arguments/function",
            {"function": "payments.nope"},
        ),
        (
            {"function": "payments.lookup", "version": "3.0.0"},
            404,
            "VERSION_NOT_FOUND",
            "/call/arguments/version",
            {"function": "payments.lookup", "version": "3.0.0", "versions": ["1.0.0", "2.0.0"]},
        ),
    ],
)
def test_describe_refuses_bad_arguments(
    served: Served,
    arguments: dict[str, Any],
    status: int,
    code: str,
    pointer: str,
    details: dict[str, Any],
) -> None:
    client, _, store = served
    answer = client.post("/mesh", json=request(DESCRIBE, arguments))
    assert answer.status_code == status
    body = answer.json()
    assert body["result"] is None and body["id"] == "req_001"
    [error] = body["errors"]
    assert error["code"] == code and error["retryable"] is False
    assert error["source"] == {"pointer": pointer}
    assert details.items() <= error["details"].items()
    assert store.records() == []


def test_a_keyed_call_to_an_opted_out_function_is_not_applicable(served: Served) -> None:
    """The spec's ``EXTENSION_NOT_APPLICABLE``: 400, pointing at the extension; nothing runs."""
    client, orders, store = served
    envelope = request("payments.lookup", {"charge": "ch_1"}, "k1", extensions=[TRACING])
    answer = client.post("/mesh", json=envelope)
    assert answer.status_code == 400
    body = answer.json()
    assert body["result"] is None and body["id"] == "req_001"
    assert body["errors"] == [
        {
            "code": "EXTENSION_NOT_APPLICABLE",
            "message": "'payments.lookup' does not take the idempotency extension",
            "retryable": False,
            "source": {"pointer": "/extensions/1"},
            "details": {"extension": URN, "function": "payments.lookup"},
        }
    ]
    assert orders.runs == [] and store.records() == []
    # Without the extension the function runs, every time, and nothing is kept.
    for _ in range(2):
        plain = client.post("/mesh", json=request("payments.lookup", {"charge": "ch_1"}))
        assert plain.status_code == 200 and plain.json()["result"] == {"status": "succeeded"}
    assert orders.runs == ["lookup", "lookup"] and store.records() == []


def test_mesh_client_calls_an_opted_out_function_without_the_extension(served: Served) -> None:
    client, orders, store = served
    with MeshClient(base_url=str(client.base_url), headers=CALLER) as mesh:
        answer = mesh.call("/mesh", "payments.lookup", {"charge": "ch_1"}, idempotent=False)
        assert answer["result"] == {"status": "succeeded"} and "extensions" not in answer
        keyed = mesh.call("/mesh", "payments.lookup", {"charge": "ch_1"})
        assert keyed["errors"][0]["code"] == "EXTENSION_NOT_APPLICABLE"
        with pytest.raises(ValueError, match="idempotent=False"):
            mesh.call("/mesh", "payments.lookup", {}, key="k1", idempotent=False)
    assert orders.runs == ["lookup"] and store.records() == []


def test_other_functions_keep_the_extension(served: Served) -> None:
    client, orders, store = served
    for rid in ("req_001", "req_002"):
        client.post("/mesh", json=request("payments.charge", key="k1", rid=rid))
    assert orders.runs == ["charge"] and len(store.records()) == 1


def test_discovery_with_a_key_is_answered_and_never_recorded(served: Served) -> None:
    """Clients that key every call (MeshClient does) can still discover: a read is not kept."""
    client, _, store = served
    for rid in ("req_001", "req_002"):
        body = client.post("/mesh", json=request(CAPABILITIES, key="caps", rid=rid)).json()
        assert body["result"]["service"] == "orders-api"
        [entry] = body["extensions"]
        assert entry == {
            "urn": URN,
            "data": {"key": "caps", "status": "processed", "original_request_id": rid},
        }
    assert store.records() == []


def test_a_handler_named_like_a_discovery_function_replaces_it(tmp_path: Path) -> None:
    mine = {"service": "my own"}
    app = MeshApp({CAPABILITIES: lambda call: mine}, f"sqlite:///{tmp_path}/mesh.db")
    with ThreadServer(app, "asgi") as server:
        answer = httpx.post(server.url, json=request(CAPABILITIES), headers=CALLER)
        assert answer.json()["result"] == mine
        described = httpx.post(server.url, json=request(DESCRIBE, {"function": CAPABILITIES}))
        assert described.json()["result"]["description"] == ""
    app.mesh.close()


def test_mesh_function_options() -> None:
    def charge(call: dict[str, Any]) -> Any:
        return None

    with pytest.raises(TypeError, match="callable"):
        MeshFunction("charge")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="idempotency"):
        MeshFunction(charge, idempotency="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="description"):
        MeshFunction(charge, description=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="side_effects"):
        MeshFunction(charge, side_effects="create")
    with pytest.raises(ValueError, match="side_effects"):
        MeshFunction(charge, side_effects=["create", ""])
    with pytest.raises(ValueError, match="versions"):
        MeshFunction(charge, versions=[])
    with pytest.raises(ValueError, match="twice"):
        MeshFunction(charge, versions=["1", "1"])
    with pytest.raises(TypeError):
        MeshFunction(charge, False)  # type: ignore[misc]  # options are keyword-only
    fn = MeshFunction(charge, side_effects=["create"], versions=["1", "2"])
    assert fn.side_effects == ("create",) and fn.versions == ("1", "2")
    with pytest.raises(ValueError, match="service"):
        MeshApp({"f": fn}, "memory://", service="")
    assert MeshApp({"f": fn}, "memory://").functions["f"] is fn
