"""FastAPI: ``install`` protects the app and documents the key header in OpenAPI."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
from _hangup import CALLER
from _http_apps import Counter, fastapi_app
from _http_servers import ThreadServer

from retrysafe.fastapi import install


def test_install_protects_and_documents(tmp_path: Path) -> None:
    counter = Counter(tmp_path / "counters")
    app = fastapi_app(counter)
    install(app, store="memory://", require_key=True)
    tid = uuid.uuid4().hex
    with ThreadServer(app, "asgi") as server:
        schema = httpx.get(server.url + "/openapi.json").json()
        headers = {"idempotency-key": tid, "x-test-id": tid, **CALLER}
        first = httpx.post(server.url + "/orders", json={"a": 1}, headers=headers)
        again = httpx.post(server.url + "/orders", json={"a": 1}, headers=headers)
        missing = httpx.post(server.url + "/orders", json={"a": 1}, headers={"x-test-id": tid})
    assert first.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert missing.status_code == 400 and missing.json()["code"] == "idempotency_key_required"
    assert counter.count(tid) == 1

    post = schema["paths"]["/orders"]["post"]
    (param,) = [p for p in post["parameters"] if p["in"] == "header"]
    assert param["name"] == "Idempotency-Key" and param["required"] is True
    assert param["schema"]["maxLength"] == 255
    assert {"400", "409", "422", "503"} <= post["responses"].keys()
    assert post["responses"]["409"]["content"]["application/problem+json"]
    assert "Idempotent-Replayed" in post["responses"]["201"]["headers"]
    get = schema["paths"]["/count/{test_id}"]["get"]
    assert not any(p["in"] == "header" for p in get.get("parameters", []))
    assert "409" not in get["responses"]


def test_document_keeps_an_existing_header_parameter(tmp_path: Path) -> None:
    from fastapi import FastAPI, Header

    app = FastAPI()

    @app.post("/pay")
    async def pay(idempotency_key: str = Header(...)) -> dict[str, str]:
        return {"key": idempotency_key}

    install(app, store="memory://", header="Idempotency-Key")
    schema = app.openapi()
    assert schema is app.openapi()  # built once
    params = schema["paths"]["/pay"]["post"]["parameters"]
    assert [p["name"].lower() for p in params if p["in"] == "header"] == ["idempotency-key"]
