"""The Go middleware pattern (docs/http.md, "The Go middleware pattern"): every scenario
of its text against examples/go_middleware_pattern.py on a real server, on the memory
and SQLite stores; then its three options (``fingerprint=False``, ``keep_statuses``,
a ``principal=`` that answers ``ANONYMOUS``) behind every HTTP front door."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from _doors import DOORS, build
from _http_apps import Counter
from _http_servers import ThreadServer
from conftest import make_spec

from retrysafe import Engine
from retrysafe.http import ANONYMOUS, HttpRequest, NoPrincipal

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "go_middleware_pattern.py"
DAY = 24 * 3600.0


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("go_middleware_pattern", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


pattern = _example()


class GatedVisits(pattern.Visits):  # type: ignore[misc,name-defined]
    """The example's visits; with ``gate`` set, adding one waits until the test opens it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    async def add(self, workspace_id: int, outlet_id: int, date: str) -> dict[str, Any]:
        self.entered.set()
        if self.gate is not None:
            await asyncio.to_thread(self.gate.wait, 60)
        result: dict[str, Any] = await super().add(workspace_id, outlet_id, date)
        return result


@dataclass
class Api:
    url: str
    visits: GatedVisits
    now: list[float]

    def send(
        self,
        method: str,
        path: str,
        key: str | None,
        body: Any = None,
        token: str | None = "token-ana",
        **options: Any,
    ) -> httpx.Response:
        headers = {}
        if key is not None:
            headers["X-Idempotency-Key"] = key
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        options.setdefault("timeout", 30)
        return httpx.request(method, self.url + path, headers=headers, json=body, **options)

    def visit(self, key: str | None, body: Any = None, **options: Any) -> httpx.Response:
        body = {"outlet_id": 123, "scheduled_date": "2026-03-10"} if body is None else body
        return self.send("POST", "/app/v1/outlet-visits", key, body, **options)


@pytest.fixture(params=["memory", "sqlite"])
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Api]:
    """The example app on a real server, on its own store, with the engine's clock in
    the test's hands."""
    store = make_spec(request.param, request, tmp_path).open()
    now = [1_800_000_000.0]
    engine = Engine(store, clock=lambda: now[0])
    visits = GatedVisits()
    try:
        with ThreadServer(pattern.create_app(engine, visits), "asgi") as server:
            yield Api(server.url, visits, now)
    finally:
        store.close()


def _key() -> str:
    return str(uuid.uuid4())


def _duplicate(response: httpx.Response) -> None:
    """The pattern's duplicate: 204 No Content, no body, marked replayed."""
    assert response.status_code == 204, response.text
    assert response.content == b""
    assert response.headers["idempotent-replayed"] == "true"


# -- the scenarios of the text -------------------------------------------------------


def test_offline_retry_with_the_same_uuid(api: Api) -> None:
    key = _key()
    first = api.visit(key)
    assert first.status_code == 201
    assert first.json()["data"]["outlet_id"] == 123
    _duplicate(api.visit(key))  # the outbox sends it again, same UUID
    assert len(api.visits.rows) == 1


def test_network_timeout_then_retry_creates_one_visit(api: Api) -> None:
    key = _key()
    api.visits.gate = threading.Event()
    with pytest.raises(httpx.ReadTimeout):  # the handler is held: the client gives up
        api.visit(key, timeout=httpx.Timeout(30, read=0.5))
    assert api.visits.entered.is_set()
    api.visits.gate.set()
    _duplicate(api.visit(key))  # waits for the first if it still runs (wait=)
    assert len(api.visits.rows) == 1


def test_double_tap_sequential(api: Api) -> None:
    key = _key()
    assert api.visit(key).status_code == 201
    _duplicate(api.visit(key))
    assert len(api.visits.rows) == 1


def test_double_tap_concurrent_runs_once(api: Api) -> None:
    key = _key()
    api.visits.gate = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(api.visit, key)
        assert api.visits.entered.wait(30)  # the first tap is being processed
        second = pool.submit(api.visit, key)
        api.visits.gate.set()
        statuses = sorted([first.result().status_code, second.result().status_code])
    assert statuses == [201, 204]
    assert len(api.visits.rows) == 1


def test_same_key_another_body_is_a_duplicate(api: Api) -> None:
    key = _key()
    assert api.visit(key).status_code == 201
    _duplicate(api.visit(key, {"outlet_id": 999, "scheduled_date": "2027-01-01"}))
    _duplicate(api.send("POST", "/app/v1/outlet-visits", key, {"not": "json of a visit"}))
    assert [r["outlet_id"] for r in api.visits.rows.values()] == [123]


def test_a_4xx_answer_is_not_kept_the_retry_runs(api: Api) -> None:
    key = _key()
    assert api.visit(key, {"outlet_id": "abc"}).status_code == 422
    assert api.visit(key, {"outlet_id": "abc"}).status_code == 422  # not replayed: runs
    assert api.visit(key).status_code == 201  # the corrected request, same key
    _duplicate(api.visit(key))
    assert len(api.visits.rows) == 1


def test_a_5xx_answer_is_not_kept_the_retry_runs(api: Api) -> None:
    key = _key()
    api.visits.available = False
    assert api.visit(key).status_code == 503
    api.visits.available = True
    assert api.visit(key).status_code == 201
    _duplicate(api.visit(key))
    assert len(api.visits.rows) == 1


def test_unauthenticated_requests_skip_idempotency(api: Api) -> None:
    key = _key()
    # A token the app rejects: no auth context, so nothing is stored under it.
    for _ in range(2):
        answer = api.send("POST", "/app/v1/feedback", key, {"text": "hi"}, token="bad")
        assert answer.status_code == 201
        assert "idempotent-replayed" not in answer.headers
    for _ in range(2):  # no token at all
        assert (
            api.send("POST", "/app/v1/feedback", key, {"text": "hi"}, token=None).status_code == 201
        )
    assert len(api.visits.feedback) == 4
    # The same key from a signed-in caller is a fresh one: nothing was kept above.
    assert api.send("POST", "/app/v1/feedback", key, {"text": "hi"}).status_code == 201
    _duplicate(api.send("POST", "/app/v1/feedback", key, {"text": "hi"}))
    assert len(api.visits.feedback) == 5


def test_a_request_without_a_key_runs_every_time(api: Api) -> None:
    for _ in range(3):
        assert api.visit(None).status_code == 201
    assert len(api.visits.rows) == 3


def test_keys_are_scoped_to_the_workspace(api: Api) -> None:
    key = _key()
    assert api.visit(key, token="token-ana").status_code == 201  # workspace 10
    assert api.visit(key, token="token-eve").status_code == 201  # workspace 20: its own
    _duplicate(api.visit(key, token="token-ben"))  # workspace 10 again, another user
    assert len(api.visits.rows) == 2


def test_a_key_lives_24_hours(api: Api) -> None:
    key = _key()
    assert api.visit(key).status_code == 201
    api.now[0] += DAY - 60
    _duplicate(api.visit(key))
    api.now[0] += 120  # past 24 hours
    assert api.visit(key).status_code == 201
    assert len(api.visits.rows) == 2


def test_put_and_delete_are_protected(api: Api) -> None:
    visit_id = api.visit(_key()).json()["data"]["id"]
    path = f"/app/v1/outlet-visits/{visit_id}"
    key = _key()
    assert api.send("PUT", path, key, {"scheduled_date": "2026-04-01"}).status_code == 200
    api.visits.rows[visit_id]["scheduled_date"] = "changed since"
    _duplicate(api.send("PUT", path, key, {"scheduled_date": "2026-04-01"}))
    assert api.visits.rows[visit_id]["scheduled_date"] == "changed since"  # not run again
    key = _key()
    assert api.send("DELETE", path, key).status_code == 204
    retry = api.send("DELETE", path, key)  # not run again: no 404
    _duplicate(retry)
    assert api.send("DELETE", path, _key()).status_code == 404  # a new key runs


# -- the options behind every front door ---------------------------------------------------


def _principal(request: HttpRequest) -> str | NoPrincipal:
    value = request.headers.get("authorization")
    return "workspace:1" if value == "Bearer good" else ANONYMOUS


GO_OPTIONS: dict[str, Any] = {
    "header": "X-Idempotency-Key",
    "principal": _principal,
    "fingerprint": False,
    "keep_statuses": range(200, 300),
    "duplicate_response": "no_content",
    "max_request_body": 16,  # under fingerprint=False the body is not read: no 413
}


@dataclass
class Served:
    url: str
    counter: Counter

    def post(
        self, path: str, key: str, test_id: str, body: bytes = b"{}", token: str = "good"
    ) -> httpx.Response:
        headers = {
            "X-Idempotency-Key": key,
            "X-Test-Id": test_id,
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
        }
        return httpx.post(self.url + path, content=body, headers=headers, timeout=30)


@pytest.fixture(scope="module", params=DOORS)
def go_door(
    request: pytest.FixtureRequest, counter: Counter, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """Each HTTP front door with the pattern's options, on a memory store."""
    store = make_spec("memory", request, tmp_path_factory.mktemp("go")).open()
    upstream = request.getfixturevalue("upstream") if request.param == "gateway" else None
    app, kind = build(request.param, counter, store, upstream, **GO_OPTIONS)
    try:
        with ThreadServer(app, kind) as server:
            yield Served(server.url, counter)
    finally:
        store.close()


def test_door_another_body_is_a_duplicate(go_door: Served, tid: str) -> None:
    key = _key()
    big = b'{"note": "' + b"x" * 200 + b'"}'  # over max_request_body: never read by retrysafe
    first = go_door.post("/orders", key, tid, big)
    assert first.status_code == 201
    assert first.json()["body"]["note"] == "x" * 200  # the app read the body whole
    _duplicate(go_door.post("/orders", key, tid, b'{"other": 1}'))
    _duplicate(go_door.post("/orders", key, tid, b"not json at all"))
    assert go_door.counter.count(tid) == 1


def test_door_only_kept_statuses_are_stored(go_door: Served, tid: str) -> None:
    key = _key()
    for _ in range(2):  # 409 is not kept: each retry runs
        assert go_door.post("/status/409", key, tid).status_code == 409
    assert go_door.counter.count(tid) == 2
    assert go_door.post("/status/202", key, tid).status_code == 202
    _duplicate(go_door.post("/status/202", key, tid))
    assert go_door.counter.count(tid) == 3


def test_door_anonymous_principal_skips_idempotency(go_door: Served, tid: str) -> None:
    key = _key()
    for _ in range(2):  # a credential the app rejects is not used as a principal
        answer = go_door.post("/orders", key, tid, token="bad")
        assert answer.status_code == 201
        assert "idempotent-replayed" not in answer.headers
    assert go_door.counter.count(tid) == 2


# -- the options themselves ----------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"keep_statuses": "2xx"},
        {"keep_statuses": 200},
        {"keep_statuses": [200, "201"]},
        {"keep_statuses": [True]},
        {"keep_statuses": [99]},
        {"keep_statuses": []},
        {"fingerprint": "no"},
        {"fingerprint": None},
    ],
)
def test_bad_options_fail_at_construction(options: dict[str, Any]) -> None:
    from retrysafe.asgi import IdempotencyMiddleware

    with pytest.raises((TypeError, ValueError)):
        IdempotencyMiddleware(lambda *a: None, store="memory://", **options)


def test_keep_statuses_narrows_what_is_stored() -> None:
    """Outside ``keep_statuses``: stored nothing, retryable; inside: the default rules
    (a refusal such as 429 is never stored; a 5xx is a failure, final by ``final_failures``)."""
    from retrysafe import Outcome
    from retrysafe._http.policy import HttpPolicy

    def verdicts(policy: HttpPolicy, status: int) -> list[tuple[bool, bool, bool]]:
        out = Outcome(b"{}", status, (("content-type", "application/json"),), "application/json")
        by_verdict = policy.verdict(status, out)
        by_pass = policy.recorded(status, [(b"content-type", b"application/json")], b"{}", 2)
        return [(v[0], v[1] is not None, v[2]) for v in (by_verdict, by_pass)]

    stored, unstored, failed = (False, True, False), (True, False, False), (True, True, False)
    policy = HttpPolicy("memory://", keep_statuses=range(200, 300))
    for status in (200, 201, 204, 299):
        assert verdicts(policy, status) == [stored, stored]
    for status in (301, 400, 404, 409, 422, 500, 503):
        assert verdicts(policy, status) == [unstored, unstored]
    policy = HttpPolicy("memory://", keep_statuses=[201, 429, 500], final_failures=True)
    assert verdicts(policy, 201) == [stored, stored]
    assert verdicts(policy, 429) == [unstored, unstored]
    assert verdicts(policy, 500) == [(True, True, True)] * 2
    assert verdicts(policy, 200) == [unstored, unstored]
    policy = HttpPolicy("memory://")  # the default: all but the refusals; 5xx retryable
    assert verdicts(policy, 422) == [stored, stored]
    assert verdicts(policy, 429) == [unstored, unstored]
    assert verdicts(policy, 500) == [failed, failed]
