"""The demo shop: the backend of the agentic-commerce idempotency map, built from
retrysafe's blocks (guards, steps, webhooks, transactions).

Each operation is a plain method returning ``(status, document)``, served over
HTTP by :mod:`retrysafe._demo.api`; business rows live in the SQLite file of the
idempotency records and commit with them. Which block serves each route:
docs/demo.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import sqlite3
import threading
import time
from decimal import Decimal, InvalidOperation
from typing import Any

from retrysafe._core.engine import Engine
from retrysafe._map.map import IdempotencyMap
from retrysafe._model.record import Outcome
from retrysafe.errors import IdempotencyError
from retrysafe.guards import (
    History,
    InvalidTransitionError,
    OutOfOrderError,
    PaymentStateMachine,
    SequenceGuard,
    SessionRegistry,
    VersionConflictError,
    VersionedRecords,
)
from retrysafe.keys import cart_hash, intent_hash
from retrysafe.steps import Workflow
from retrysafe.stores.sqlite import SQLiteStore
from retrysafe.webhooks import Receiver

__all__ = ["DEMO_SECRETS", "PaymentGateway", "Shop", "ShopError", "refusal"]

#: The demo's webhook signing secrets (demo only: never reuse them).
DEMO_SECRETS = {
    "stripe": "whsec_retrysafe_demo_stripe",
    "shopify": "retrysafe-demo-shopify",
}
CART_MANDATE_TTL = 30 * 60.0
Doc = dict[str, Any]

_TABLES = """
CREATE TABLE IF NOT EXISTS shop_sessions (
    token_hash TEXT PRIMARY KEY, user_id TEXT NOT NULL, device_id TEXT NOT NULL,
    created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS shop_cart_mandates (
    id TEXT PRIMARY KEY, session_id TEXT NOT NULL, user_id TEXT NOT NULL,
    cart_hash TEXT NOT NULL, items TEXT NOT NULL, total INTEGER NOT NULL,
    currency TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS shop_intent_mandates (
    id TEXT PRIMARY KEY, user_id TEXT NOT NULL, intent TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS shop_orders (
    id TEXT PRIMARY KEY, cart_mandate_id TEXT NOT NULL UNIQUE, user_id TEXT NOT NULL,
    total INTEGER NOT NULL, currency TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS shop_payments (
    id TEXT PRIMARY KEY, order_id TEXT NOT NULL, amount INTEGER NOT NULL,
    currency TEXT NOT NULL, transaction_id TEXT NOT NULL UNIQUE, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS shop_webhook_effects (
    source TEXT NOT NULL, event TEXT NOT NULL, kind TEXT NOT NULL, subject TEXT NOT NULL,
    created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS shop_session_updates (
    session_id TEXT NOT NULL, operation TEXT NOT NULL, sequence INTEGER NOT NULL,
    payload TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS gateway_charges (
    idempotency_key TEXT PRIMARY KEY, transaction_id TEXT NOT NULL UNIQUE,
    amount INTEGER NOT NULL, currency TEXT NOT NULL, created_at REAL NOT NULL);
"""

#: What ``GET /stats`` counts: side effects, one row each.
_COUNTS = {
    "sessions_created": "shop_sessions",
    "cart_mandates_created": "shop_cart_mandates",
    "intent_mandates_created": "shop_intent_mandates",
    "orders_created": "shop_orders",
    "payments_recorded": "shop_payments",
    "gateway_charges": "gateway_charges",
    "webhooks_processed": "shop_webhook_effects",
    "session_updates_applied": "shop_session_updates",
}

#: Stripe-style event types and the payment state each one means.
STRIPE_EVENTS = {
    "payment_intent.succeeded": "payment.succeeded",
    "payment_intent.payment_failed": "payment.failed",
    "charge.refunded": "refund.processed",
}


class ShopError(Exception):
    """A request the shop refuses: an HTTP status, a machine code and a message."""

    def __init__(self, status: int, code: str, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.extra = status, code, detail, extra


def _id(prefix: str, *parts: str) -> str:
    """A stable id from the key that made it: a retry recomputes the same one."""
    return f"{prefix}_{hashlib.sha256(':'.join(parts).encode()).hexdigest()[:16]}"


def _text(doc: Doc, name: str, limit: int = 64) -> str:
    value = doc.get(name)
    if not isinstance(value, str) or not value or len(value) > limit or ":" in value:
        raise ShopError(
            400,
            "invalid_field",
            f'"{name}" must be a non-empty string of at most {limit} characters without ":"',
        )
    return value


def _cents(items: list[Any]) -> int:
    try:
        # Decimal(0) to start: an empty cart totals 0 (an int start had no to_integral_value).
        total = sum((Decimal(str(i["price"])) * int(i["quantity"]) for i in items), Decimal(0))
    except (InvalidOperation, KeyError, TypeError, ValueError):
        raise ShopError(400, "invalid_cart", "every item needs a price and a quantity") from None
    return int((total * 100).to_integral_value())


class _Local(threading.local):
    conn: sqlite3.Connection | None = None


class _Db:
    """One connection per thread to the shop's file (business tables only)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._local = _Local()

    def conn(self) -> sqlite3.Connection:
        conn = self._local.conn
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            self._local.conn = conn
        return conn

    def one(self, sql: str, *params: Any) -> Any:
        return self.conn().execute(sql, params).fetchone()


class PaymentGateway:
    """A simulated payment gateway (think Stripe, Adyen) that dedupes by idempotency key.

    ``charge`` with a key it has seen returns the first charge; with the same key
    and another amount it refuses, as Stripe does. ``delay`` is its latency.
    """

    def __init__(self, db: _Db, *, delay: float = 0.0) -> None:
        self.db, self.delay = db, delay

    def charge(self, amount: int, currency: str, *, idempotency_key: str) -> Doc:
        time.sleep(self.delay)
        txn = _id("txn", idempotency_key)
        self.db.conn().execute(
            "INSERT INTO gateway_charges VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (idempotency_key, txn, amount, currency, time.time()),
        )
        row = self.db.one(
            "SELECT transaction_id, amount, currency FROM gateway_charges "
            "WHERE idempotency_key = ?",
            idempotency_key,
        )
        if (row[1], row[2]) != (amount, currency):
            raise ShopError(502, "gateway_refused", "the gateway saw this key with another amount")
        return {"transaction_id": row[0], "amount": amount, "currency": currency}


class Shop:
    """The agentic-commerce backend over one SQLite file (``path``): see the module's table."""

    def __init__(
        self, path: str, *, gateway_delay: float = 0.0, lease: float = 10.0, wait: float = 10.0
    ) -> None:
        self.store = SQLiteStore(f"sqlite:///{path}")
        # Duplicates wait for the first attempt's answer (up to ``wait``) instead of
        # getting "in flight": every caller of a burst gets the same answer.
        self.engine = Engine(self.store, lease=lease, wait=wait)
        self.db = _Db(path)
        self.db.conn().executescript(_TABLES)
        self.map = IdempotencyMap.default()
        self.gateway = PaymentGateway(self.db, delay=gateway_delay)
        self.sessions = SessionRegistry(self.store, ttl=3600)
        self.payment_states = PaymentStateMachine(self.store)
        self.sequences = SequenceGuard(self.store)
        self.profiles = VersionedRecords(self.store, namespace="profile", conflict="cas")
        self.consents = History(self.store, namespace="consent")
        self.payments = Workflow(self.engine, operation="payment", retention="financial")
        self.stripe = Receiver(
            self.engine,
            scheme="stripe",
            secrets=DEMO_SECRETS["stripe"],
            handler=self._stripe_event,
            transaction=self._stripe_transaction,
        )
        self.shopify = Receiver(
            self.engine,
            scheme="shopify",
            secrets=DEMO_SECRETS["shopify"],
            handler=self._shopify_event,
        )

    def close(self) -> None:
        self.store.close()

    # -- a claimed operation whose business rows commit with its record ---------------

    def _once(
        self,
        operation: str,
        scope: str,
        fingerprint: Any,
        insert: Any,
        *,
        key: str | None = None,
        **fields: Any,
    ) -> tuple[Doc, bool]:
        """Run ``insert(conn) -> doc`` once for ``key`` (default: the map key of
        ``operation`` from ``fields``), its writes committed with the record.

        Returns the document and whether it was replayed.
        """
        mapped = self.map.operations.get(operation)
        if key is None:
            key = self.map.key(operation, **fields)
        try:
            with self.engine.attempt(
                key,
                operation=operation,
                scope=scope,
                fingerprint=_digest(fingerprint),
                ttl=mapped.ttl if mapped else None,
            ) as att:
                if att.replay is not None:
                    # The document stored below as att.outcome.
                    return att.replay.outcome.value, True  # type: ignore[union-attr]
                with att.transaction() as conn:
                    doc = insert(conn)
                    att.outcome = Outcome.json(doc)
                return doc, False
        except IdempotencyError as exc:
            raise refusal(exc) from None

    # -- sessions ----------------------------------------------------------------------

    def open_session(self, doc: Doc) -> tuple[int, Doc]:
        user, device = _text(doc, "user_id"), _text(doc, "device_id")
        session = self.sessions.open(user, device)
        if session.created:
            self.db.conn().execute(
                "INSERT OR IGNORE INTO shop_sessions VALUES (?, ?, ?, ?)",
                (_session_id(session.token), user, device, time.time()),
            )
        answer = {
            "token": session.token,
            "session_id": _session_id(session.token),
            "created": session.created,
            "expires_at": session.expires_at,
        }
        return (201 if session.created else 200), answer

    def _session_of(self, doc: Doc) -> str:
        """The session id of the caller, who must show the session's token."""
        user, device = _text(doc, "user_id"), _text(doc, "device_id")
        token = doc.get("session_token")
        session = self.sessions.get(user, device)
        if session is None or not isinstance(token, str):
            raise ShopError(
                401,
                "no_session",
                "open a session first (POST /sessions) and send its token as session_token",
            )
        if not hmac.compare_digest(token.encode(), session.token.encode()):
            raise ShopError(401, "no_session", "session_token is not this session's token")
        return _session_id(session.token)

    # -- mandates and orders ----------------------------------------------------------

    def cart_mandate(self, doc: Doc) -> tuple[int, Doc]:
        """A cart mandate for these items at these prices, once per session and cart."""
        user = _text(doc, "user_id")
        session = self._session_of(doc) if "device_id" in doc else f"direct-{user}"
        items, currency = doc.get("items"), doc.get("currency", "EUR")
        if not isinstance(currency, str) or not re.fullmatch("[A-Z]{3}", currency):
            raise ShopError(400, "invalid_field", '"currency" must be an ISO 4217 code like "EUR"')
        if not isinstance(items, list):
            raise ShopError(400, "invalid_cart", '"items" must be a list of cart items')
        try:
            digest = cart_hash(items)
        except (TypeError, ValueError) as exc:
            raise ShopError(400, "invalid_cart", str(exc)) from None
        mandate_id = _id("cm", session, digest)

        def insert(conn: sqlite3.Connection) -> Doc:
            now = time.time()
            mandate = {
                "id": mandate_id,
                "user_id": user,
                "cart_hash": digest,
                "total": _cents(items),
                "currency": currency,
                "expires_at": round(now + CART_MANDATE_TTL, 3),
            }
            conn.execute(
                "INSERT INTO shop_cart_mandates VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    mandate_id,
                    session,
                    user,
                    digest,
                    json.dumps(items),
                    mandate["total"],
                    currency,
                    now,
                    mandate["expires_at"],
                ),
            )
            return mandate

        mandate, _ = self._once(
            "cart_mandate", user, [items, currency], insert, session_id=session, cart_hash=digest
        )
        return 201, mandate

    def intent_mandate(self, doc: Doc) -> tuple[int, Doc]:
        user, intent = _text(doc, "user_id"), doc.get("intent")
        if not isinstance(intent, dict) or not intent:
            raise ShopError(400, "invalid_intent", '"intent" must be a non-empty object')
        digest = intent_hash(intent)
        mandate_id = _id("im", user, digest)

        def insert(conn: sqlite3.Connection) -> Doc:
            conn.execute(
                "INSERT INTO shop_intent_mandates VALUES (?, ?, ?, ?)",
                (mandate_id, user, json.dumps(intent), time.time()),
            )
            return {"id": mandate_id, "user_id": user, "intent": intent}

        answer, _ = self._once(
            "intent_mandate", user, intent, insert, user_id=user, intent_hash=digest
        )
        return 201, answer

    def order(self, doc: Doc) -> tuple[int, Doc]:
        """An order, exactly once per cart mandate (``items`` makes the mandate first)."""
        if "cart_mandate_id" not in doc:
            _, mandate = self.cart_mandate(doc)
            doc = {"cart_mandate_id": mandate["id"], "user_id": mandate["user_id"]}
        user, mandate_id = _text(doc, "user_id"), _text(doc, "cart_mandate_id")
        row = self.db.one(
            "SELECT user_id, total, currency, expires_at FROM shop_cart_mandates WHERE id = ?",
            mandate_id,
        )
        if row is None or row[0] != user:
            raise ShopError(404, "unknown_mandate", "no such cart mandate for this user")
        order_id = _id("ord", mandate_id)

        def insert(conn: sqlite3.Connection) -> Doc:
            if row[3] < time.time():
                raise ShopError(410, "mandate_expired", "the cart mandate expired (30 minutes)")
            # The unique constraint on cart_mandate_id is the last word: a second key
            # for the same mandate (an expired record, another client) finds the order.
            conn.execute(
                "INSERT INTO shop_orders VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (order_id, mandate_id, user, row[1], row[2], time.time()),
            )
            return {
                "id": order_id,
                "cart_mandate_id": mandate_id,
                "user_id": user,
                "total": row[1],
                "currency": row[2],
                "status": "created",
            }

        answer, _ = self._once(
            "order", user, [mandate_id], insert, cart_mandate_id=mandate_id, user_id=user
        )
        return 201, answer

    # -- payments ----------------------------------------------------------------------

    def pay(self, doc: Doc) -> tuple[int, Doc]:
        """Charge an order once: a workflow whose charge step passes its derived key on."""
        user, order_id = _text(doc, "user_id"), _text(doc, "order_id")
        row = self.db.one(
            "SELECT total, currency, created_at FROM shop_orders WHERE id = ? AND user_id = ?",
            order_id,
            user,
        )
        if row is None:
            raise ShopError(404, "unknown_order", "no such order for this user")
        amount, currency, stamp = row[0], row[1], int(doc.get("timestamp") or row[2])
        key = self.map.key(
            "payment", order_id=order_id, amount=amount, currency=currency, timestamp=stamp
        )
        payment_id = _id("pay", key)

        def body(run: Any) -> Doc:
            run.step("authorize", lambda _key: self.payment_states.start(payment_id).state)
            charge = run.step(
                "charge",
                lambda derived: self.gateway.charge(amount, currency, idempotency_key=derived),
                reference="transaction_id",
            )
            txn = charge["transaction_id"]

            def record(_key: str) -> str:
                self.db.conn().execute(
                    "INSERT INTO shop_payments VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    (payment_id, order_id, amount, currency, txn, time.time()),
                )
                return self.payment_states.advance(payment_id, "payment.succeeded").state

            state = run.step("record", record)
            return {
                "id": payment_id,
                "order_id": order_id,
                "amount": amount,
                "currency": currency,
                "transaction_id": txn,
                "status": state,
            }

        try:
            answer = self.payments.run(key, body, scope=user)
        except IdempotencyError as exc:
            raise refusal(exc) from None
        return 201, answer

    def payment(self, payment_id: str) -> tuple[int, Doc]:
        state = self.payment_states.state(payment_id)
        if state is None:
            raise ShopError(404, "unknown_payment", "no such payment")
        return 200, {"id": payment_id, "status": state}

    # -- webhooks ----------------------------------------------------------------------

    @staticmethod
    def _stripe_transaction(delivery: Any) -> tuple[str, str]:
        event = delivery.json()
        return event["data"]["object"]["id"], event["type"]

    def _stripe_event(self, delivery: Any) -> Doc:
        event = delivery.json()
        txn, kind = event["data"]["object"]["id"], event["type"]
        if kind not in STRIPE_EVENTS:
            return {"ignored": kind}
        row = self.db.one("SELECT id FROM shop_payments WHERE transaction_id = ?", txn)
        if row is None:  # the payment is not recorded yet: fail, so the gateway redelivers
            raise LookupError(f"no payment with transaction {txn} yet")
        try:
            moved = self.payment_states.advance(row[0], STRIPE_EVENTS[kind])
        except InvalidTransitionError as exc:
            machine = self.payment_states
            if _reachable(machine.transitions, exc.current, machine.events[STRIPE_EVENTS[kind]]):
                # Early (a refund while the payment is still pending): fail (5xx), and
                # the gateway's redelivery after the success applies it.
                raise
            # Stale (a success delivered after the refund, a failure of an earlier
            # attempt after the success): the payment is past it. Acknowledge it, or
            # the gateway would redeliver it for days; the state does not move.
            self._effect("stripe", delivery.event_id, kind, row[0])
            return {"payment_id": row[0], "status": exc.current, "changed": False, "stale": True}
        self._effect("stripe", delivery.event_id, kind, row[0])
        return {"payment_id": row[0], "status": moved.state, "changed": moved.changed}

    def _shopify_event(self, delivery: Any) -> Doc:
        topic = delivery.headers.get("x-shopify-topic", "unknown")
        subject = str((delivery.json() or {}).get("id", ""))
        self._effect("shopify", delivery.event_id, topic, subject)
        return {"topic": topic, "subject": subject}

    def _effect(self, source: str, event: str, kind: str, subject: str) -> None:
        self.db.conn().execute(
            "INSERT INTO shop_webhook_effects VALUES (?, ?, ?, ?, ?)",
            (source, event, kind, subject, time.time()),
        )

    # -- session updates, profiles and consent --------------------------------------

    def session_update(self, doc: Doc) -> tuple[int, Doc]:
        """Apply an update in sequence: an earlier number after a later one is refused."""
        session, operation = self._session_of(doc), _text(doc, "operation")
        sequence = doc.get("sequence")
        if isinstance(sequence, bool) or not isinstance(sequence, int) or sequence < 1:
            raise ShopError(400, "invalid_field", '"sequence" must be a positive integer')
        payload = doc.get("payload", {})

        def apply(conn: sqlite3.Connection) -> Doc:
            # On the shop's SQLite store the guard's cell joins the transaction: the
            # sequence moves only if the update and its record commit.
            self.sequences.accept(session, operation, sequence)
            conn.execute(
                "INSERT INTO shop_session_updates VALUES (?, ?, ?, ?, ?)",
                (session, operation, sequence, json.dumps(payload), time.time()),
            )
            return {"operation": operation, "sequence": sequence, "applied": True}

        key = f"session_update:{session}:{operation}:{sequence}"
        answer, replayed = self._once("session_update", session, payload, apply, key=key)
        return (200 if replayed else 201), answer

    def put_profile(self, user: str, doc: Doc) -> tuple[int, Doc]:
        """Replace a profile if ``version`` is the stored one (optimistic locking)."""
        user = _text({"user": user}, "user")
        version, data = doc.get("version"), doc.get("data")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ShopError(400, "invalid_field", '"version" must be the version you read (0: new)')
        try:
            saved = self.profiles.put("user", user, data, expected_version=version)
        except VersionConflictError as exc:
            raise ShopError(
                409, "version_conflict", str(exc), current_version=exc.current
            ) from None
        return 200, {"user_id": user, "version": saved.version, "data": saved.value}

    def add_consent(self, user: str, doc: Doc) -> tuple[int, Doc]:
        """Record a consent change: appended, never updated."""
        user = _text({"user": user}, "user")
        purpose, granted = _text(doc, "purpose"), doc.get("granted")
        change = _text(doc, "change_id")
        if not isinstance(granted, bool):
            raise ShopError(400, "invalid_field", '"granted" must be true or false')
        entry = {"purpose": purpose, "granted": granted, "change_id": change}

        def append(conn: sqlite3.Connection) -> Doc:
            # One entry per change, however often it is sent: the append joins the
            # record's transaction (SQLite), so a retry never appends it twice.
            return {"user_id": user, "position": self.consents.append(user, entry)}

        answer, _ = self._once("consent", user, entry, append, key=f"consent:{user}:{change}")
        return 201, answer

    def consent_history(self, user: str) -> tuple[int, Doc]:
        user = _text({"user": user}, "user")
        entries = [
            {"position": e.position, **e.entry, "recorded_at": e.recorded_at}
            for e in self.consents.entries(user)
        ]
        return 200, {"user_id": user, "entries": entries}

    # -- counters ------------------------------------------------------------------

    def stats(self) -> Doc:
        conn = self.db.conn()
        counts = {
            name: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for name, table in _COUNTS.items()
        }
        return counts


def _session_id(token: str) -> str:
    """The public id of a session (its token is a secret and never in a key)."""
    return _id("sess", token)


def _reachable(transitions: Any, current: str | None, target: str) -> bool:
    """Whether ``target`` lies ahead of ``current`` (a later state, not a past one);
    a payment with no state yet has everything ahead of it."""
    if current is None:
        return True
    seen: set[str] = set()
    todo = [current]
    while todo:
        state = todo.pop()
        for nxt in transitions.get(state, ()):
            if nxt == target:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def refusal(exc: IdempotencyError) -> ShopError:
    """An idempotency error as the shop's answer (in flight, conflict, invalid transition)."""
    if isinstance(exc, InvalidTransitionError):
        return ShopError(409, "invalid_transition", str(exc))
    if isinstance(exc, OutOfOrderError):
        return ShopError(409, "out_of_order", str(exc), last=exc.last)
    status = {
        "idempotency_in_flight": 409,
        "idempotency_conflict": 422,
        "idempotency_key_invalid": 400,
        "idempotency_store_unavailable": 503,
    }
    return ShopError(status.get(exc.code, 500), exc.code, str(exc))
