"""``retrysafe demo``: the gateway in front of the demo API, and a retry storm through it.

Both run as uvicorn servers in threads of this process: the demo API on a free
loopback port, the gateway on 127.0.0.1:8000 (or a free port if that one is
taken) with the embedded SQLite store.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import shlex
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from retrysafe._demo.api import DemoApi
from retrysafe._ops.serve import ServerThread, bind, parse_listen, sigterm_as_interrupt, url_of
from retrysafe.asgi import ASGIApp, Message, Receive, Scope, Send
from retrysafe.gateway import (
    DASHBOARD_PATH,
    HEALTH_PATH,
    METRICS_PATH,
    HTTPProtocol,
    create_app,
    probe_store,
)
from retrysafe.stores import open_store, redact

__all__ = ["StormReport", "run_demo", "storm"]

DEFAULT_LISTEN = "127.0.0.1:8000"


@dataclass
class StormReport:
    """What a retry storm sent, what came back, and what the API did."""

    orders: int
    retries: int
    requests: int = 0
    orders_created: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    ids: dict[int, set[str]] = field(default_factory=dict)
    unanswered: int = 0
    seconds: float = 0.0

    @property
    def conflicts_expected(self) -> int:
        return len(range(0, self.orders, 5))

    @property
    def exactly_once(self) -> bool:
        """Each order created once, every retry answered with its order, conflicts refused."""
        ids = [next(iter(s)) for s in self.ids.values() if len(s) == 1]
        return (
            self.orders_created == self.orders
            and len(ids) == self.orders
            and len(set(ids)) == self.orders
            and self.unanswered == 0
            and self.answers["conflict"] == self.conflicts_expected
        )

    def render(self, gateway_url: str, store_url: str) -> str:
        differ = sum(1 for s in self.ids.values() if len(s) > 1)
        rate = self.requests / max(self.seconds, 1e-9)
        lines = [
            f"retrysafe demo --check: a retry storm through the gateway at {gateway_url}",
            f"  store                {store_url}",
            f"  orders               {self.orders}, each sent by {self.retries} clients at once "
            "with one Idempotency-Key",
            f"  requests sent        {self.requests}  ({rate:,.0f}/s over {self.seconds:.2f} s)",
            f"  orders created       {self.orders_created}  (side effects, from the API's /stats)",
            f"  replayed answers     {self.answers['replayed']}  (Idempotent-Replayed: true)",
            f"  'in flight' (409)    {self.answers['in_flight']}  (asked again after a backoff)",
            f"  conflicts (422)      {self.answers['conflict']}  (same key, other body: refused)",
            f"  answers that differ  {differ}",
            f"  unanswered           {self.unanswered}",
            "  result               "
            + (
                "exactly once: every order created once, every retry got its answer"
                if self.exactly_once
                else "DUPLICATES OR LOST ANSWERS"
            ),
        ]
        return "\n".join(lines)


async def _order_until_answered(
    client: httpx.AsyncClient, report: StormReport, index: int, key: str, body: dict[str, Any]
) -> None:
    """Send one order until it gets a final answer, as a patient client would."""
    deadline = time.monotonic() + 30
    backoff = 0.02
    while time.monotonic() < deadline:
        report.requests += 1
        try:
            r = await client.post("/orders", json=body, headers=_headers(key, body))
        except httpx.TransportError:
            r = None
        if r is None or r.status_code == 409 or r.status_code >= 500:
            kind = "network_error" if r is None else "in_flight" if r.status_code == 409 else "5xx"
            report.answers[kind] += 1
            # Retry-After is when the attempt's lease ends, the longest it can take;
            # an impatient client backs off (with jitter) and asks again sooner.
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 1.0)
            continue
        if r.status_code == 422:
            report.answers["conflict"] += 1
            return
        if r.status_code == 201:
            replayed = r.headers.get("idempotent-replayed") == "true"
            report.answers["replayed" if replayed else "executed"] += 1
            report.ids.setdefault(index, set()).add(r.json()["id"])
            return
        report.answers[f"http_{r.status_code}"] += 1
        break
    report.unanswered += 1


def _headers(key: str, body: dict[str, Any]) -> dict[str, str]:
    """An order's headers: its key, and its customer's token (the gateway tells callers
    apart by their credentials; a keyed request without any runs unrecorded)."""
    return {"Idempotency-Key": key, "Authorization": f"Bearer {body['user_id']}-token"}


def _cart(run: str, i: int, quantity: int) -> dict[str, Any]:
    """The order body of the storm's ``i``-th customer: one line of ``quantity`` items."""
    item = {"variant_id": f"item-{i}", "quantity": quantity, "price": "9.99"}
    return {"user_id": f"storm-{run}-{i}", "items": [item]}


async def storm(gateway_url: str, *, orders: int = 20, retries: int = 8) -> StormReport:
    """Send each of ``orders`` orders from ``retries`` clients at once with one key;
    then, for every fifth order, the same key with another body (a client bug).
    Counts requests, answers and the API's side effects."""
    report = StormReport(orders=orders, retries=retries)
    run = secrets.token_hex(4)
    limits = httpx.Limits(max_connections=orders * retries + 10)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30, limits=limits) as client:
        before = (await client.get("/stats")).json()["orders_created"]
        bodies = {i: _cart(run, i, 1 + i % 3) for i in range(orders)}
        await asyncio.gather(
            *(
                _order_until_answered(client, report, i, f"demo-{run}-{i}", bodies[i])
                for i in range(orders)
                for _ in range(retries)
            )
        )
        await asyncio.gather(
            *(
                _order_until_answered(
                    client,
                    report,
                    -1,
                    f"demo-{run}-{i}",
                    _cart(run, i, 2 + i % 3),
                )
                for i in range(0, orders, 5)
            )
        )
        report.orders_created = (await client.get("/stats")).json()["orders_created"] - before
    report.seconds = time.perf_counter() - started
    return report


class _Narrator:
    """Prints one line per request the gateway answers (the demo's running commentary)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def narrate(message: Message) -> None:
            if message["type"] == "http.response.start":
                replayed = (b"idempotent-replayed", b"true") in message.get("headers", ())
                note = "  (replayed: the API did not run)" if replayed else ""
                _say(f"  gateway   {scope['method']} {scope['path']} -> {message['status']}{note}")
            await send(message)

        await self.app(scope, receive, narrate)


def _print_effect(kind: str, record: dict[str, Any]) -> None:
    shown = {k: ("…" if k == "token" else v) for k, v in record.items()}  # never a secret
    _say(f"  demo API  {kind}: {json.dumps(shown, ensure_ascii=False)}")


_said = threading.Lock()


def _say(line: str) -> None:
    """One whole line of commentary: the gateway's and the API's threads both talk."""
    with _said:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def shop_path(store_url: str) -> str:
    """The demo shop's SQLite file: the store's own file, so orders commit with their
    records; ``retrysafe-demo-shop.db`` when the store is not SQLite."""
    if store_url.startswith("sqlite:///"):
        return store_url[len("sqlite:///") :].split("?", 1)[0]
    return "retrysafe-demo-shop.db"


def _gateway_socket(listen: str | None) -> tuple[Any, str | None]:
    """The gateway's socket: ``listen``, else 127.0.0.1:8000 or a free port if it is taken."""
    if listen is not None:
        return bind(*parse_listen(listen)), None
    host, port = parse_listen(DEFAULT_LISTEN)
    try:
        return bind(host, port), None
    except OSError:
        sock = bind(host, 0)
        return sock, f"port {port} is busy: the gateway listens on {url_of(sock)} instead"


def _banner(gateway: str, api: str, store_url: str, note: str | None) -> str:
    key = f"order-{secrets.token_hex(3)}"
    item = {"variant_id": "book", "quantity": 1, "price": "12.99"}
    body = json.dumps({"user_id": "alice", "items": [item]})
    curl = (
        f"curl -i {gateway}/orders -H {shlex.quote('Idempotency-Key: ' + key)} "
        "-H 'Authorization: Bearer alice-token' "
        f"-H 'Content-Type: application/json' -d {shlex.quote(body)}"
    )
    lines = [
        "retrysafe demo: the gateway in front of a small agentic-commerce shop",
        *([f"  note      {note}"] if note else []),
        f"  gateway   {gateway}   (retries are safe here)",
        f"  demo API  {api}   (direct, no idempotency)",
        f"  dashboard {gateway}{DASHBOARD_PATH}   (live: duplicate rate, in flight, inspector)",
        f"  metrics   {gateway}{METRICS_PATH}",
        f"  health    {gateway}{HEALTH_PATH}",
        f"  store     {store_url}",
        "",
        "Create an order through the gateway. Run it twice: the second answer is the",
        "first one replayed (Idempotent-Replayed: true) and the API does not run again.",
        "The token says who asks: another caller's retry never gets alice's answer, and",
        "a keyed request without credentials runs without a record (docs/principals.md).",
        "",
        f"  {curl}",
        "",
        "Count the side effects (still one order):",
        "",
        f"  curl {gateway}/stats",
        "",
        "GET / lists the shop's routes (sessions, mandates, payments, webhooks, sync);",
        "examples/retry_storm.py fires duplicated, reordered and concurrent calls at them.",
        "",
        "Press Ctrl-C to stop.",
        "",
    ]
    return "\n".join(lines)


def run_demo(
    store_url: str,
    *,
    listen: str | None = None,
    check: bool = False,
    orders: int = 20,
    retries: int = 8,
) -> int:
    """Start the demo API and the gateway; with ``check`` run a storm and report, else
    serve until Ctrl-C. Returns the exit status."""
    if orders < 1 or retries < 1:
        raise ValueError("--orders and --retries must be at least 1")
    store = open_store(store_url)
    try:
        probe_store(store)
        gw_sock, note = _gateway_socket(listen)
    except BaseException:
        store.close()
        raise
    try:
        api = DemoApi(shop_path(store_url), on_effect=None if check else _print_effect)
    except BaseException:
        gw_sock.close()
        store.close()
        raise
    try:
        with sigterm_as_interrupt(), ServerThread(api, bind("127.0.0.1", 0)) as api_server:
            # The demo's dashboard is for whoever runs it on this machine.
            app: ASGIApp = create_app(api_server.url, store=store, admin_loopback=True)
            if not check:
                app = _Narrator(app)
            with ServerThread(app, gw_sock, http=HTTPProtocol) as gw_server:
                if check:
                    report = asyncio.run(storm(gw_server.url, orders=orders, retries=retries))
                    print(report.render(gw_server.url, redact(store_url)), flush=True)
                    return 0 if report.exactly_once else 1
                print(_banner(gw_server.url, api_server.url, redact(store_url), note), flush=True)
                while gw_server.alive and api_server.alive:
                    # Not thread.join(timeout): before Python 3.12 a Ctrl-C inside it marks
                    # the thread finished, and the server's socket is closed under it.
                    time.sleep(0.2)
                return 1  # a server stopped by itself
    except KeyboardInterrupt:
        print("retrysafe demo: stopped", flush=True)
        return 0
    finally:
        api.close()
        gw_sock.close()
        store.close()
