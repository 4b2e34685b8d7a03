"""Metrics, alerts and traces: every outcome counted once, on every front door.

Counters are per process and per operation, so each test uses an operation name
of its own and reads what it added. The HTTP front doors run on real servers
(threads of this process, so their counters are this process's); the
multi-worker totals are checked in tests/test_http_workers.py.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import itertools
import json
import logging
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _doors import build
from _hangup import CALLER, caller_scope, cookieless
from _http_apps import Counter
from _http_servers import ThreadServer

from retrysafe import Engine, LeaseLostError, Outcome, Store, idempotent, key_hash, open_store
from retrysafe._core.metrics import COUNTERS, METRICS, AlertLog, Alerts, Metrics
from retrysafe._ops.admin import AdminSite
from retrysafe._ops.monitor import Monitor, quantile, read_sample
from retrysafe.a2a import A2AIdempotency
from retrysafe.mesh import MeshIdempotency
from retrysafe.metrics import MetricsApp, configure, disable, enable, wsgi_app
from retrysafe.webhooks import Receiver

HTTP_DOORS = ["starlette", "fastapi", "flask", "django", "gateway"]


def counts(op: str) -> dict[str, float]:
    """This process's counters of operation ``op`` that are not zero."""
    totals = read_sample().totals
    return {o: n for o in COUNTERS if (n := totals[o].get(op, 0.0))}


def handler_count(op: str) -> float:
    pairs = read_sample().buckets["retrysafe_handler_seconds"].get(op, [])
    return pairs[-1][1] if pairs else 0.0


@pytest.fixture
def op() -> str:
    return f"m-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def alerts(caplog: pytest.LogCaptureFixture) -> Iterator[list[logging.LogRecord]]:
    """The ``retrysafe.alerts`` records logged during the test."""
    caplog.set_level(logging.WARNING, logger="retrysafe.alerts")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logging.getLogger("retrysafe.alerts").addHandler(handler)
    previous, METRICS.alert_log = METRICS.alert_log, AlertLog(timer=False)  # a fresh interval
    yield records
    METRICS.alert_log = previous
    logging.getLogger("retrysafe.alerts").removeHandler(handler)


# -- the HTTP front doors --------------------------------------------------------------------


@pytest.fixture(params=HTTP_DOORS)
def door(
    request: pytest.FixtureRequest, counter: Counter, memory: Store[Any], op: str
) -> Iterator[str]:
    upstream = request.getfixturevalue("upstream") if request.param == "gateway" else None
    app, kind = build(request.param, counter, memory, upstream, operation=op)
    with ThreadServer(app, kind) as server:
        yield server.url


def test_each_outcome_is_counted_once_on_every_http_door(
    door: str, memory: Store[Any], op: str, counter: Counter
) -> None:
    tid = uuid.uuid4().hex

    def keyed(key: str) -> dict[str, str]:
        return {"idempotency-key": key, "x-test-id": tid, **CALLER}

    with httpx.Client(base_url=door, timeout=30, cookies=cookieless()) as c:
        k = uuid.uuid4().hex
        assert c.post("/orders", json={"a": 1}, headers=keyed(k)).status_code == 201
        assert c.post("/orders", json={"a": 1}, headers=keyed(k)).headers["idempotent-replayed"]
        assert c.post("/orders", json={"a": 2}, headers=keyed(k)).status_code == 422
        assert c.post("/orders", json={}, headers=keyed('"open')).status_code == 400
        anonymous = {"idempotency-key": k, "x-test-id": tid}  # runs, unrecorded
        assert c.post("/orders", json={"a": 1}, headers=anonymous).status_code == 201
        assert c.post("/status/500", json={}, headers=keyed(uuid.uuid4().hex)).status_code == 500
        slow = uuid.uuid4().hex
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # Held until the duplicate has had its 409, not for 3 s that a busy
            # machine could spend between the claim and the duplicate.
            first = pool.submit(c.post, f"/slow?gate={slow}", json={}, headers=keyed(slow))
            try:
                h = key_hash(caller_scope(memory), op, slow)
                deadline = time.monotonic() + 20
                while memory.get(h) is None:
                    assert time.monotonic() < deadline, "the first request never claimed its key"
                    time.sleep(0.005)
                in_flight = c.post(f"/slow?gate={slow}", json={}, headers=keyed(slow))
            finally:
                counter.open_gate(slow)
            assert in_flight.status_code == 409
            assert first.result().status_code == 200
        assert c.get("/count/" + tid).status_code == 200  # not keyed: counts nothing
    assert counts(op) == {
        "executed": 3,
        "replayed": 1,
        "conflict": 1,
        "invalid_key": 1,
        "failed": 1,
        "in_flight": 1,
        "unscoped": 1,
    }
    assert handler_count(op) == 3  # two completions and one failure, each timed


@pytest.mark.parametrize("name", HTTP_DOORS)
def test_a_store_that_is_down_is_counted_on_every_http_door(
    name: str, counter: Counter, request: pytest.FixtureRequest, op: str
) -> None:
    down = open_store("redis://127.0.0.1:9/0?socket_timeout=0.5")  # the discard port
    upstream = request.getfixturevalue("upstream") if name == "gateway" else None
    app, kind = build(name, counter, down, upstream, operation=op)
    with ThreadServer(app, kind) as server:
        r = httpx.post(
            server.url + "/orders", json={}, headers={"idempotency-key": "k", **CALLER}, timeout=30
        )
    assert r.status_code == 503 and r.json()["code"] == "idempotency_store_unavailable"
    assert counts(op) == {"store_unavailable": 1}


# -- the other front doors --------------------------------------------------------------------


def test_the_decorator_mesh_a2a_and_webhooks_report_through_the_engine(
    memory: Store[Any], op: str
) -> None:
    @idempotent(store=memory, key="{n}", operation=op)
    def work(n: int) -> int:
        return n

    assert [work(1), work(1), work(2)] == [1, 1, 2]
    assert counts(op) == {"executed": 2, "replayed": 1}
    with pytest.raises(Exception, match="no idempotency key"):
        work(None)  # type: ignore[arg-type]
    assert counts(op)["invalid_key"] == 1

    mesh = MeshIdempotency(memory)
    function = f"svc.{op.replace('-', '_')}"
    extension = {"urn": "urn:mesh:ext:idempotency", "options": {"key": "k1"}}
    envelope = {
        "protocol": {"name": "mesh", "version": "0.1.0"},
        "id": "r1",
        "call": {"function": function, "version": "1", "arguments": {"a": 1}},
        "extensions": [extension],
    }
    for _ in range(3):
        mesh.handle(envelope, lambda call: {"ok": True})
    conflict = json.loads(json.dumps(envelope))
    conflict["call"]["arguments"] = {"a": 2}
    assert mesh.handle(conflict, lambda call: {})["errors"][0]["code"] == "IDEMPOTENCY_CONFLICT"
    assert counts(f"{function}@1") == {"executed": 1, "replayed": 2, "conflict": 1}

    a2a = A2AIdempotency(memory, operation=op + "-a2a")
    send = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "message/send",
        "params": {
            "message": {
                "kind": "message",
                "messageId": "m-1",
                "role": "user",
                "parts": [{"kind": "text", "text": "hi"}],
            }
        },
    }
    reply = {
        "jsonrpc": "2.0",
        "id": 1,
        "result": {"kind": "message", "messageId": "a", "role": "agent", "parts": []},
    }
    for _ in range(2):
        a2a.handle(send, lambda request: reply)
    bad = json.loads(json.dumps(send))
    del bad["params"]["message"]["messageId"]
    assert a2a.handle(bad, lambda request: reply)["error"]["code"] == -32602
    assert counts(op + "-a2a") == {"executed": 1, "replayed": 1, "invalid_key": 1}

    before = counts("webhook")
    secret = "shh"
    receiver = Receiver(
        memory,
        scheme="hmac",
        secrets=secret,
        handler=lambda d: {"ok": 1},
        source=op.replace("-", "_"),
    )
    body = json.dumps({"event": op}).encode()
    signature = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    for _ in range(3):
        assert receiver.handle({"x-signature": f"sha256={signature}"}, body).status == 200
    after = counts("webhook")
    assert after.get("executed", 0) - before.get("executed", 0) == 1
    assert after.get("replayed", 0) - before.get("replayed", 0) == 2


# -- the engine's own events: takeovers, stale completions, alerts -----------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_takeover_and_the_stale_completion_it_causes(
    memory: Store[Any], op: str, alerts: list[logging.LogRecord]
) -> None:
    clock = Clock()
    engine = Engine(memory, lease=1, clock=clock)
    key = f"secret-key-{uuid.uuid4().hex}"
    first = engine.begin(key, operation=op)
    clock.now += 5  # the first worker stalled past its lease
    second = engine.begin(key, operation=op)
    assert counts(op) == {"executed": 2, "lease_takeover": 1}
    with pytest.raises(LeaseLostError):
        engine.complete(first, Outcome.json(1))
    engine.complete(second, Outcome.json(2))
    assert counts(op) == {"executed": 2, "lease_takeover": 1, "stale_refused": 1}
    (alert,) = [a for a in alerts if a.retrysafe["alert"] == "stale_completion"]  # type: ignore[attr-defined]
    fields = alert.retrysafe  # type: ignore[attr-defined]
    assert fields["operation"] == op and fields["key_hash"] == key_hash("", op, key)[:16]
    assert key not in alert.getMessage() and key not in json.dumps(fields)  # never the raw key
    assert read_sample().alerts["stale_completion"] >= 1


def test_a_burst_on_one_key_is_one_alert(
    memory: Store[Any], op: str, alerts: list[logging.LogRecord]
) -> None:
    engine = Engine(memory)
    claim = engine.begin("burst", operation=op)
    for _ in range(5):  # six requests with one key at once: an alert at the third refusal
        with pytest.raises(Exception, match="in progress"):
            engine.begin("burst", operation=op)
    engine.complete(claim, Outcome.json(None))
    bursts = [a.retrysafe for a in alerts if a.retrysafe["alert"] == "burst"]  # type: ignore[attr-defined]
    assert [b["requests"] for b in bursts] == [4]
    assert counts(op)["in_flight"] == 5


def test_a_key_failing_again_and_again_alerts_at_the_threshold(
    memory: Store[Any], op: str, alerts: list[logging.LogRecord]
) -> None:
    engine = Engine(memory)
    for attempt in range(1, 5):
        claim = engine.begin("flaky", operation=op)
        assert claim.attempts == attempt
        engine.fail(claim)
    repeated = [a.retrysafe for a in alerts if a.retrysafe["alert"] == "repeated_failures"]  # type: ignore[attr-defined]
    assert [r["attempts"] for r in repeated] == [3]  # the 4th: in this interval's summary
    METRICS.alert_log.flush(everything=True)
    (summary,) = [a.retrysafe for a in alerts if a.retrysafe.get("summary")]  # type: ignore[attr-defined]
    assert summary["alert"] == "repeated_failures" and summary["count"] == 1
    assert counts(op) == {"executed": 4, "failed": 4}


def test_an_alert_storm_is_one_line_per_interval(
    memory: Store[Any], op: str, alerts: list[logging.LogRecord]
) -> None:
    """1,000 keys raced by 16 threads, an alert each: one line at once, then one
    summary per interval with the right count; the counter still sees every alert."""
    clock = Clock()
    METRICS.alert_log = AlertLog(interval=10, clock=clock, timer=False)
    before = read_sample().alerts.get("burst", 0.0)
    configure(alerts=Alerts(burst=1))
    engine = Engine(memory)

    def race(key: str) -> None:
        with pytest.raises(Exception, match="in progress"):
            engine.begin(key, operation=op)

    try:
        for storm in ("a", "b"):
            keys = [f"storm-{storm}-{i}" for i in range(1000)]
            for key in keys:
                engine.begin(key, operation=op)
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                list(pool.map(race, keys))
            clock.now += 10  # the interval ends
            METRICS.alert_log.flush()
    finally:
        configure(alerts=Alerts())
    lines = [a.retrysafe for a in alerts]  # type: ignore[attr-defined]
    first, *summaries = lines
    assert first["alert"] == "burst" and not first.get("summary")
    assert [(s["alert"], s["count"], s["operations"]) for s in summaries] == [
        ("burst", 999, {op: 999}),
        ("burst", 1000, {op: 1000}),
    ]
    assert all(len(s["key_hashes"]) == 5 for s in summaries)
    assert "999 more within 10s" in alerts[1].getMessage()
    assert read_sample().alerts["burst"] - before == 2000
    METRICS.alert_log.flush(everything=True)
    assert len(alerts) == 3  # nothing was left held


def test_an_alert_summary_comes_when_the_interval_ends() -> None:
    """Without another alert or a flush: the timer writes it (waited on, not slept).
    The interval is on a clock of the test's, so that a slow loop stays in it."""
    written = threading.Event()
    now = [0.0]
    seen: list[logging.LogRecord] = []

    class Summary(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)
            if record.retrysafe.get("summary"):  # type: ignore[attr-defined]
                written.set()

    handler = Summary()
    logging.getLogger("retrysafe.alerts").addHandler(handler)
    try:
        log = AlertLog(interval=0.05, clock=lambda: now[0])
        for i in range(50):
            log.emit(
                "burst",
                "retrysafe alert %s: %d",
                ("burst", i),
                {"operation": "o", "key_hash": str(i)},
            )
        now[0] = 0.06  # the interval ends; the timer (every 10 ms till then) sees it
        assert written.wait(10)
    finally:
        logging.getLogger("retrysafe.alerts").removeHandler(handler)
    assert [r.retrysafe.get("count") for r in seen] == [None, 49]  # type: ignore[attr-defined]
    assert seen[1].retrysafe["key_hashes"] == ["1", "2", "3", "4", "5"]  # type: ignore[attr-defined]


def test_cli_alerts_are_prefixed_once_and_summarised(tmp_path: Path) -> None:
    """The CLI's stderr handler (used when nothing else handles logging): one
    ``retrysafe`` prefix, and 1,000 alerts make two lines (the first, the summary at exit)."""
    code = (
        "from retrysafe._cli.app import main\n"
        "from retrysafe._core.metrics import METRICS\n"
        "main(['map', 'check', 'none.toml'])\n"
        "for i in range(1000):\n"
        "    METRICS.alert('burst', 'op', 'k', f'{i:016x}' + '0' * 48, '4 requests with one key')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("retrysafe map check: error:")
    assert lines[1:] == [
        "retrysafe alert burst: 4 requests with one key (operation=op key_hash=0000000000000000)",
        "retrysafe alert burst: 999 more within 10s (operations: op x999; key_hash e.g. "
        "0000000000000001, 0000000000000002, 0000000000000003, 0000000000000004, "
        "0000000000000005)",
    ]


def test_thresholds_are_options(
    memory: Store[Any], op: str, alerts: list[logging.LogRecord]
) -> None:
    configure(alerts=Alerts(burst=1, failures=1))
    try:
        engine = Engine(memory)
        claim = engine.begin("x", operation=op)
        with pytest.raises(Exception, match="in progress"):
            engine.begin("x", operation=op)
        engine.fail(claim)
    finally:
        configure(alerts=Alerts())
    assert sorted(a.retrysafe["alert"] for a in alerts) == ["burst", "repeated_failures"]  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        Alerts(burst=0)


def test_a_stuck_processing_record_alerts_once(
    memory: Store[Any], op: str, alerts: list[logging.LogRecord]
) -> None:
    # Claimed a minute ago with a 1 s lease, and never completed: a crashed worker.
    engine = Engine(memory, lease=1, clock=lambda: time.time() - 60)
    claim = engine.begin("stuck", operation=op)
    monitor = Monitor(memory)
    for _ in range(2):
        view = monitor.read_store()
        assert view.up and view.by_status["processing"] == 1
        (row,) = [r for r in view.in_flight if r["key"] == "stuck"]
        assert row["stuck"] and row["lease_left"] < 0
    stuck = [a.retrysafe for a in alerts if a.retrysafe["alert"] == "stuck_processing"]  # type: ignore[attr-defined]
    assert len(stuck) == 1 and stuck[0]["operation"] == op
    engine.fail(claim)


def test_disabled_metrics_count_nothing(memory: Store[Any], op: str) -> None:
    disable()
    try:
        with Engine(memory).attempt("k", operation=op) as att:
            att.outcome = Outcome.json(1)
    finally:
        enable()
    assert counts(op) == {}
    with Engine(memory).attempt("k", operation=op) as att:
        assert att.replay is not None
    assert counts(op) == {"replayed": 1}


def test_operation_labels_are_bounded() -> None:
    from prometheus_client import CollectorRegistry

    from retrysafe._core import metrics as _metrics

    registry = CollectorRegistry()
    m = Metrics(registry=registry)
    for i in range(_metrics.MAX_OPERATIONS + 50):
        m.count("executed", f"op-{i}")
    (family,) = [f for f in registry.collect() if f.name == "retrysafe_executions"]
    labels = {s.labels["operation"]: s.value for s in family.samples}
    assert len(labels) == _metrics.MAX_OPERATIONS + 1 and labels["other"] == 50


def test_counts_from_many_threads_are_exact_and_ended_threads_retire() -> None:
    import threading

    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    m = Metrics(registry=registry)

    def work() -> None:
        for _ in range(500):
            m.count("replayed", "op")
            m.store_call("claim", 0.0007)

    threads = [threading.Thread(target=work) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Every ended thread retired: left are the retired totals and the main thread's.
    assert len(m._cells._lists) <= 2  # type: ignore[union-attr]
    families = {f.name: f for f in registry.collect()}
    (replays,) = families["retrysafe_replays"].samples
    assert replays.value == 20_000
    samples = {
        (s.name, s.labels.get("le")): s.value for s in families["retrysafe_store_seconds"].samples
    }
    assert samples[("retrysafe_store_seconds_bucket", "0.0005")] == 0
    assert samples[("retrysafe_store_seconds_bucket", "0.001")] == 20_000
    assert samples[("retrysafe_store_seconds_count", None)] == 20_000
    assert samples[("retrysafe_store_seconds_sum", None)] == pytest.approx(14.0)


def test_quantiles_follow_prometheus() -> None:
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (float("inf"), 40.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.3)  # rank 20: half-way into (0.1, 0.5]
    assert quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * 9.6 / 10)
    assert quantile(0.5, []) is None and quantile(0.5, [(0.1, 0.0)]) is None


# -- OpenTelemetry ------------------------------------------------------------------------------


def test_claims_completions_and_replays_are_span_events(memory: Store[Any], op: str) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # Events go to the current span once an application has set its provider.
    trace.set_tracer_provider(provider)
    tracer = provider.get_tracer("test")
    engine = Engine(memory)
    key = f"raw-key-{uuid.uuid4().hex}"
    for name in ("first", "retry"):
        with tracer.start_as_current_span(name), engine.attempt(key, operation=op) as att:
            if att.replay is None:
                att.outcome = Outcome.json({"charged": True})
    first, retry = sorted(exporter.get_finished_spans(), key=lambda s: s.name)
    events = {
        s.name: [(e.name, dict(e.attributes or {})) for e in s.events] for s in (first, retry)
    }
    h = key_hash("", op, key)
    assert [name for name, _ in events["first"]] == ["retrysafe.claim", "retrysafe.complete"]
    assert events["first"][0][1] == {
        "retrysafe.operation": op,
        "retrysafe.outcome": "executed",
        "retrysafe.key_hash": h,
    }
    replayed = {"retrysafe.operation": op, "retrysafe.outcome": "replayed", "retrysafe.key_hash": h}
    assert events["retry"] == [("retrysafe.replay", replayed)]
    assert key not in repr(events) and "charged" not in repr(events)


# -- serving the metrics -------------------------------------------------------------------------


def test_the_asgi_and_wsgi_metrics_apps(memory: Store[Any], op: str) -> None:
    with Engine(memory).attempt("k", operation=op) as att:
        att.outcome = Outcome.json(1)
    with Engine(memory).attempt("k", operation=op) as att:
        assert att.replay is not None
    for app, kind in (
        (MetricsApp(memory, token=None, loopback=True), "asgi"),
        (wsgi_app(memory, token=None, loopback=True), "wsgi"),
    ):
        with ThreadServer(app, kind) as server:
            r = httpx.get(server.url + "/anything")
            head = httpx.head(server.url + "/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
        assert f'retrysafe_replays_total{{operation="{op}"}} 1.0' in text
        assert f'retrysafe_executions_total{{operation="{op}"}} 1.0' in text
        assert 'retrysafe_duplicate_rate{window="lifetime"}' in text
        assert 'retrysafe_records{status="completed"}' in text and "retrysafe_store_up 1.0" in text
        assert 'retrysafe_store_seconds_bucket{call="claim"' in text
        assert head.status_code == 200 and head.content == b""


def test_admin_access() -> None:
    site = AdminSite(open_store("memory://"), token="s3cret")
    for auth in (None, "Bearer wrong", "Basic s3cret", "Bearer s3cret-and-more"):
        headers = {} if auth is None else {"authorization": auth}
        r = site.answer("GET", "/metrics", "", headers, "127.0.0.1")
        assert r.status == 401 and json.loads(r.body)["code"] == "admin_token_required"
        assert ("www-authenticate", 'Bearer realm="retrysafe"') in r.headers
    ok = site.answer("GET", "/metrics", "", {"authorization": "Bearer s3cret"}, "203.0.113.9")
    assert ok.status == 200
    page = site.answer("GET", "/", "", {"accept": "text/html"}, "127.0.0.1")
    assert page.status == 401 and b"admin token" in page.body and b"s3cret" not in page.body
    open_site = AdminSite(open_store("memory://"), token=None, loopback=True)
    assert open_site.answer("GET", "/metrics", "", {}, "127.0.0.1").status == 200
    assert open_site.answer("GET", "/metrics", "", {}, "::1").status == 200
    far = open_site.answer("GET", "/metrics", "", {}, "203.0.113.9")
    assert far.status == 403 and json.loads(far.body)["code"] == "admin_loopback_only"
    assert open_site.answer("GET", "/metrics", "", {}, "::ffff:127.0.0.1").status == 200
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "app.localhost"):
        assert open_site.answer("GET", "/metrics", "", {"host": host}, "127.0.0.1").status == 200
    # A site rebound to 127.0.0.1 (DNS rebinding), a proxy, a Unix socket: not loopback.
    assert (
        open_site.answer("GET", "/metrics", "", {"host": "evil.example"}, "127.0.0.1").status == 403
    )
    assert (
        open_site.answer("GET", "/metrics", "", {"x-forwarded-for": "1.2.3.4"}, "127.0.0.1").status
        == 403
    )
    assert open_site.answer("GET", "/metrics", "", {}, None).status == 403
    assert open_site.answer("POST", "/metrics", "", {}, "127.0.0.1").status == 405
    assert open_site.answer("GET", "/nope", "", {}, "127.0.0.1").status == 404
    with pytest.raises(ValueError):
        AdminSite(None, token=" ")
    with pytest.raises(TypeError):
        AdminSite(None, token=None, loopback="yes")  # type: ignore[arg-type]
    # The token and the loopback opt-in together: loopback without it, others with it.
    both = AdminSite(open_store("memory://"), token="s3cret", loopback=True)
    assert both.answer("GET", "/metrics", "", {}, "127.0.0.1").status == 200
    assert both.answer("GET", "/metrics", "", {}, "203.0.113.9").status == 401
    bearer = {"authorization": "Bearer s3cret"}
    assert both.answer("GET", "/metrics", "", bearer, "203.0.113.9").status == 200


def test_admin_pages_are_closed_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """No token and no opt-in: nothing answers, not even loopback. A proxy on this host
    that adds no X-Forwarded-For (nginx's default) connects from loopback."""
    monkeypatch.delenv("RETRYSAFE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("RETRYSAFE_ADMIN_LOOPBACK", raising=False)
    site = AdminSite(open_store("memory://"))
    assert site.token is None and site.loopback is False
    for path in ("/", "/metrics", "/api/stats", "/api/records"):
        for client in ("127.0.0.1", "::1", "203.0.113.9"):
            r = site.answer("GET", path, "key=k", {"host": "localhost"}, client)
            problem = json.loads(r.body)
            assert r.status == 403 and problem["code"] == "admin_closed", (path, client)
            assert "RETRYSAFE_ADMIN_TOKEN" in problem["detail"]
            assert "RETRYSAFE_ADMIN_LOOPBACK=1" in problem["detail"]
    monkeypatch.setenv("RETRYSAFE_ADMIN_LOOPBACK", "1")
    assert AdminSite(None).answer("GET", "/metrics", "", {}, "127.0.0.1").status == 200
    monkeypatch.setenv("RETRYSAFE_ADMIN_LOOPBACK", "maybe")
    with pytest.raises(ValueError, match="RETRYSAFE_ADMIN_LOOPBACK"):
        AdminSite(None)


def test_the_inspector_api(memory: Store[Any], op: str) -> None:
    with Engine(memory).attempt("find-me", operation=op, scope="tenant") as att:
        att.outcome = Outcome(b"\xff\x00", 201, (("x-order", "7"),), "application/octet-stream")
    with Engine(memory).attempt("find-me", operation=op + "-2") as att:
        att.outcome = Outcome.json({"n": 1})
    site = AdminSite(memory, token=None, loopback=True)

    def find(query: str) -> Any:
        r = site.answer("GET", "/api/records", query, {}, "127.0.0.1")
        return r.status, json.loads(r.body)

    status, doc = find("key=find-me")
    assert status == 200 and {r["operation"] for r in doc["records"]} == {op, op + "-2"}
    status, doc = find(f"key=find-me&operation={op}&scope=tenant")
    (rec,) = doc["records"]
    assert rec["status"] == "completed" and rec["scope"] == "tenant" and rec["attempts"] == 1
    assert rec["answer"]["status"] == 201 and rec["answer"]["headers"] == [["x-order", "7"]]
    assert rec["answer"]["body"] is None and rec["answer"]["bytes"] == 2  # binary: not shown
    status, doc = find(f"key=find-me&operation={op}-2")
    assert json.loads(doc["records"][0]["answer"]["body"]) == {"n": 1}
    assert find(f"key=find-me&operation={op}")[1]["records"] == []  # another scope
    assert find("key=")[0] == 400 and find("key=%0A")[0] == 400
    assert find("key=nobody")[1]["records"] == []


# -- retrysafe stats --watch -----------------------------------------------------------------------


def test_stats_watch_from_the_store(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from retrysafe._cli.app import main as cli

    url = f"sqlite:///{tmp_path}/w.db"
    store = open_store(url)
    with Engine(store).attempt("k", operation="w") as att:
        att.outcome = Outcome.json(1)
    store.close()
    assert cli(["stats", "--watch", "--store", url, "--count", "2", "--interval", "0.1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("store up" in line and "executed" in line for line in lines)
    assert cli(["stats", "--watch", "--store", url, "--count", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["store"]["by_status"]["completed"] == 1 and "duplicate_rate" in doc
    assert cli(["stats", "--url", "http://127.0.0.1:9/"]) == 2
    assert "--url goes with --watch" in capsys.readouterr().err


def test_stats_watch_from_a_dashboard(
    memory: Store[Any], op: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from retrysafe._cli.app import main as cli
    from retrysafe.dashboard import DashboardApp

    for _ in range(3):  # this process serves the dashboard: these are its figures
        with Engine(memory).attempt("k", operation=op) as att:
            if att.replay is None:
                att.outcome = Outcome.json(1)
    with ThreadServer(DashboardApp(memory, token="tok"), "asgi") as server:
        url = server.url + "/"
        argv = ["stats", "--watch", "--url", url, "--token", "tok", "--count", "1", "--json"]
        assert cli(argv) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["by_operation"][op] == {"executed": 1.0, "replayed": 2.0}
        assert len(doc["series"]["t"]) <= 2  # asked for two points, not five minutes
        assert cli(["stats", "--watch", "--url", url, "--token", "bad", "--count", "1"]) == 1
        assert "HTTP 401" in capsys.readouterr().out
        # Not a dashboard: said so, not a KeyError.
        assert (
            cli(["stats", "--watch", "--url", url + "api/stats/", "--token", "tok", "--count", "1"])
            == 1
        )
        assert "cannot read the figures" in capsys.readouterr().out
    assert cli(["stats", "--watch", "--url", url, "--count", "1"]) == 1  # the server is gone
    assert "cannot read the figures: ConnectError" in capsys.readouterr().out


def test_stats_watch_finds_the_gateways_dashboard(monkeypatch: pytest.MonkeyPatch) -> None:
    from retrysafe._ops.watch import http_source

    seen: list[str] = []

    def fake_get(url: str, **kwargs: Any) -> Any:
        seen.append(url)
        raise httpx.ConnectError("no")

    monkeypatch.setattr(httpx, "get", fake_get)
    cases = [
        ("http://gw:8000", "http://gw:8000/_retrysafe/api/stats?points=2"),
        ("http://gw:8000/_retrysafe", "http://gw:8000/_retrysafe/api/stats?points=2"),
        ("http://h:9/", "http://h:9/api/stats?points=2"),
    ]
    for given, asked in cases:
        with pytest.raises(httpx.ConnectError):
            http_source(given, "tok")()
        assert seen[-1] == asked, (given, seen[-1])


def test_the_terminal_view() -> None:
    from rich.console import Console

    from retrysafe._ops.watch import render

    monitor = Monitor(open_store("memory://"))
    monitor.sample()
    monitor.read_store()
    doc = monitor.snapshot(points=2)
    console = Console(record=True, width=120, force_terminal=True)
    console.print(render(doc))
    text = console.export_text()
    for words in (
        "duplicate rate",
        "executed",
        "replayed",
        "in flight",
        "store claim p50",
        "records:",
        "store memory://",
        "up",
    ):
        assert words in text, words


def test_alert_thresholds_from_the_idempotency_map(counter: Counter, memory: Store[Any]) -> None:
    from retrysafe import IdempotencyMap, MapError

    text = """
include_defaults = true

[alerts]
burst = 5
burst_window = "2s"
failures = 4
stuck_after = "1m"
"""
    imap = IdempotencyMap.loads(text)
    assert imap.alerts == Alerts(burst=5, burst_window=2.0, failures=4, stuck_after=60.0)
    assert IdempotencyMap.loads(imap.to_toml()) == imap  # round trip, the table included
    assert IdempotencyMap.from_dict(imap.to_dict()) == imap
    cases = [
        ("burst = 0", "alerts.burst"),
        ('burst_window = "soon"', "alerts.burst_window"),
        ("bursts = 3", "alerts.bursts"),
        ("failures = true", "alerts.failures"),
    ]
    for bad, where in cases:
        with pytest.raises(MapError, match=where.replace(".", r"\.")):
            IdempotencyMap.loads(f"[alerts]\n{bad}\n")
    try:
        build("flask", counter, memory, None, map=imap)  # a front door loads the map
        assert metrics_alerts() == imap.alerts
    finally:
        configure(alerts=Alerts())


def metrics_alerts() -> Alerts:
    from retrysafe._core.metrics import METRICS

    return METRICS.alerts


# -- found in review -----------------------------------------------------------------------------


def test_workflow_steps_are_counted_apart_from_requests(memory: Store[Any], op: str) -> None:
    from retrysafe.steps import Workflow

    wf = Workflow(memory, operation=op, steps=("a", "b"))

    def body(run: Any) -> list[Any]:
        return [run.step(name, lambda key: {"id": key}) for name in ("a", "b")]

    for _ in range(2):  # the retry replays the operation: its steps are not read again
        wf.run("order-1", body)
    assert counts(op) == {"executed": 1, "replayed": 1}
    assert counts(f"{op}/a") == {"step_executed": 1} == counts(f"{op}/b")


def test_a_completion_the_store_cannot_take_is_counted_and_alerted(
    op: str, alerts: list[logging.LogRecord]
) -> None:
    from _servers import RedisServer

    from retrysafe import StoreUnavailableError

    with RedisServer() as server:
        store = open_store(server.url + "?socket_timeout=0.5")
        engine = Engine(store, settle_retry=0)
        claim = engine.begin("k", operation=op)
        server.stop()  # the handler ran; now its answer cannot be written
        with pytest.raises(StoreUnavailableError):
            engine.complete(claim, Outcome.json(1))
        store.close()
    assert counts(op) == {"executed": 1, "unrecorded": 1}
    (alert,) = [a.retrysafe for a in alerts if a.retrysafe["alert"] == "unrecorded_outcome"]  # type: ignore[attr-defined]
    assert alert["operation"] == op


def test_a_failing_metrics_report_never_fails_the_request(
    memory: Store[Any], op: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from retrysafe._core.metrics import METRICS

    def broken(call: str) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(METRICS, "_store_child", broken)
    engine = Engine(memory)
    for _ in range(3):
        with engine.attempt("k", operation=op) as att:
            if att.replay is None:
                att.outcome = Outcome.json(1)
    errors = [r for r in caplog.records if "metrics report failed" in r.getMessage()]
    assert len(errors) == 1  # logged once, and every request went on
    assert memory.get(key_hash("", op, "k")) is not None


def test_the_snapshot_survives_events_arriving_while_it_is_read(memory: Store[Any]) -> None:
    """The sampler thread and the recorder append to the deques a snapshot reads. Here
    they append at the worst moment, every time: reading a sample or an event appends
    another, so a snapshot that iterates the live deques instead of a copy raises
    "deque mutated during iteration" at once, on any machine, with no threads racing."""
    from prometheus_client import CollectorRegistry

    from retrysafe._core.metrics import Event
    from retrysafe._ops.monitor import Sample

    metrics = Metrics(registry=CollectorRegistry())
    monitor = Monitor(memory, window=5, history=100, interval=1, metrics=metrics)

    class ArrivingSample(Sample):
        def __getattribute__(self, name: str) -> Any:
            if name == "t":  # the sampler appends while this sample is read
                monitor.samples.append(monitor.samples[-1])
            return super().__getattribute__(name)

    class ArrivingEvent(Event):
        def __getattribute__(self, name: str) -> Any:
            if name == "at":  # an event is recorded while this one is read
                metrics.recent.append(Event(0.0, "in_flight", "op", "new", "h" * 64))
            return super().__getattribute__(name)

    now = read_sample()
    for i in range(40):  # the older ones out of the window: _since reads past them
        monitor.samples.append(ArrivingSample(now.t - 39 + i, now.totals, now.buckets))
    for i in range(60):
        metrics.recent.append(ArrivingEvent(float(i), "in_flight", "op", f"k{i}", "h" * 64))
    snap = monitor.snapshot(points=50)  # raised on the live deques
    assert [e["key"] for e in snap["recent"]] == [f"k{i}" for i in range(59, 9, -1)]
    assert snap["now"] == now.t
    assert len(monitor.samples) > 40 and len(metrics.recent) > 60  # both arrived meanwhile


def test_counters_never_go_down_while_threads_end(memory: Store[Any]) -> None:
    """Threads start and end (a thread-per-request server) while scrapes run: a thread's
    values move into the retired total, and no scrape may count them twice."""
    import sys
    import threading

    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    m = Metrics(registry=registry)
    batches, size = 125, 8

    def work() -> None:
        for _ in range(10):
            m.count("executed", "op")
            for j in range(20):  # many cells per thread: a long retirement
                m.count("replayed", f"op{j}")

    def spawn() -> None:
        for _ in range(batches):
            batch = [threading.Thread(target=work) for _ in range(size)]
            for t in batch:
                t.start()
            for t in batch:
                t.join()

    # A number of thread ends, not a number of seconds: on the code that summed outside
    # the lock, 1000 retirements gave 6 to 11 drops (a busy machine takes longer to get
    # there, and interleaves as often with a switch interval of a microsecond).
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    spawner = threading.Thread(target=spawn)
    spawner.start()
    seen: list[float] = []
    try:
        while spawner.is_alive():
            seen.append(
                registry.get_sample_value("retrysafe_executions_total", {"operation": "op"}) or 0.0
            )
    finally:
        spawner.join()
        sys.setswitchinterval(old)
    drops = sum(1 for a, b in itertools.pairwise(seen) if b < a)
    assert len(seen) > 100 and drops == 0, f"{drops} of {len(seen)} scrapes went down"
    final = registry.get_sample_value("retrysafe_executions_total", {"operation": "op"})
    assert final == batches * size * 10


def test_a_closed_monitor_stays_closed(memory: Store[Any]) -> None:
    monitor = Monitor(memory, interval=0.01)
    monitor.start()
    monitor.close()
    monitor.start()  # a request that arrives during shutdown
    assert monitor._thread is None or not monitor._thread.is_alive()


def test_the_store_is_read_only_while_someone_watches(memory: Store[Any]) -> None:
    monitor = Monitor(memory, interval=0.01, store_every=0.01, idle=60)
    monitor.sample()
    assert monitor.view.checked_at is None  # nobody asked: the store is left alone
    monitor.watched()
    monitor.sample()
    first = monitor.view.checked_at
    assert first is not None
    # A minute passes, without waiting for it: the last request for the figures and
    # the last store reading are moved back (a 0.2 s idle and a 0.25 s sleep failed
    # whenever the machine stalled the test for 0.2 s between watched() and sample()).
    monitor._watched -= 60
    monitor._store_read -= 60
    monitor.sample()
    assert monitor.view.checked_at == first  # idle again
