"""Order once per cart mandate: FastAPI + SQLAlchemy, the completion in the ORM transaction.

The agentic-commerce idempotency map asks for two guards on order creation: the
idempotency key ``order:{cartMandateId}:{userId}`` and a unique constraint on
``cart_mandate_id``. Here the key's record lives in the application's own database
(``SQLAlchemyStore`` on the app's engine) and is completed inside the ORM
transaction that inserts the order: one ``session.commit()`` writes both, or neither.

::

    pip install 'retrysafe[sqlalchemy]' fastapi uvicorn httpx
    python examples/sqlalchemy_orders.py                  # serves on a free loopback port
    python examples/sqlalchemy_orders.py --port 8000
    python examples/sqlalchemy_orders.py --check          # a duplicate storm; exit 1 unless
                                                          # one order per mandate
    DATABASE_URL=postgresql+psycopg://app@localhost/shop python examples/sqlalchemy_orders.py

``POST /orders`` with a JSON body ``{"cart_mandate_id": ..., "total": ...}``, the
caller in ``X-User-Id`` (a stand-in for real authentication) and an
``Idempotency-Key`` header (required; kept as the record's request id). Answers:
201 and the order; the same order again with ``Idempotent-Replayed: true``; 409 with
``Retry-After`` while the first request runs; 409 when another user's order holds
the mandate; 422 for the same mandate with another total. ``GET /orders`` lists them.

Sync SQLAlchemy (a ``Session`` per request, in FastAPI's thread pool for ``def``
endpoints): the setup most FastAPI + SQLAlchemy applications run. The async form
is the same with ``AsyncSession`` and ``att.atransaction(session)``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import tempfile
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import sqlalchemy
from fastapi import FastAPI, Header, HTTPException, Response
from pydantic import BaseModel, Field
from sqlalchemy import Integer, String, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from retrysafe import (
    Engine,
    FingerprintMismatchError,
    IdempotencyMap,
    InProgressError,
    Outcome,
)
from retrysafe.sqlalchemy import SQLAlchemyStore, create_tables


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cart_mandate_id: Mapped[str] = mapped_column(String(255), unique=True)  # one per mandate
    user_id: Mapped[str] = mapped_column(String(255))
    total: Mapped[int] = mapped_column(Integer)

    def as_dict(self) -> dict[str, Any]:
        return {
            "order_id": self.id,
            "cart_mandate_id": self.cart_mandate_id,
            "user_id": self.user_id,
            "total": self.total,
        }


class OrderIn(BaseModel):
    cart_mandate_id: str = Field(min_length=1, max_length=100)
    total: int = Field(ge=0)


def make_app(database_url: str, *, lease: float = 30.0, wait: float = 10.0) -> FastAPI:
    """The shop: its engine, its tables and the records' table, the endpoints.

    A duplicate that arrives while the first request runs waits for its answer up to
    ``wait`` seconds (then 409); a request whose worker died is taken over once its
    ``lease`` has run out.
    """
    db = sqlalchemy.create_engine(database_url, pool_size=10, max_overflow=20)
    Base.metadata.create_all(db)
    create_tables(db)  # the idempotency records' table, next to the orders
    idempotency = Engine(SQLAlchemyStore(db), lease=lease, wait=wait)
    imap = IdempotencyMap.default()
    crash = os.environ.get("SQLALCHEMY_ORDERS_CRASH", "")  # tests: die mid-request
    app = FastAPI(title="orders, once per cart mandate")

    @app.post("/orders", status_code=201)
    def create_order(
        body: OrderIn,
        response: Response,
        idempotency_key: str = Header(min_length=1, max_length=255),
        x_user_id: str = Header(min_length=1, max_length=100),
    ) -> dict[str, Any]:
        key = imap.key("order", cart_mandate_id=body.cart_mandate_id, user_id=x_user_id)
        try:
            with idempotency.attempt(
                key,
                operation="order",
                scope=x_user_id,
                fingerprint=str(body.total),
                request_id=idempotency_key,
            ) as att:
                if att.replay is not None:
                    response.headers["Idempotent-Replayed"] = "true"
                    response.status_code = att.replay.outcome.status or 200
                    return att.replay.outcome.value  # type: ignore[no-any-return]
                with Session(db) as session, att.transaction(session):
                    order = Order(
                        cart_mandate_id=body.cart_mandate_id, user_id=x_user_id, total=body.total
                    )
                    session.add(order)
                    session.flush()  # the unique constraint speaks here
                    if crash == "after_flush":
                        os.kill(os.getpid(), signal.SIGKILL)
                    answer = order.as_dict()
                    att.outcome = Outcome.json(answer, status=201)
                return answer
        except InProgressError as exc:
            raise HTTPException(
                409, "this order is being created; retry", {"Retry-After": f"{exc.retry_after:g}"}
            ) from exc
        except FingerprintMismatchError as exc:
            raise HTTPException(422, "this cart mandate was ordered with another total") from exc
        except IntegrityError as exc:  # the attempt failed (retryable); nothing was written
            raise HTTPException(409, "this cart mandate has another user's order") from exc

    @app.get("/orders")
    def list_orders() -> list[dict[str, Any]]:
        with Session(db) as session:
            return [o.as_dict() for o in session.scalars(select(Order).order_by(Order.id))]

    return app


def storm(url: str, mandates: int = 20, copies: int = 8) -> list[str]:
    """Fire ``copies`` concurrent duplicates of each mandate's order (one key each), and a
    rival user's order for some; return what went wrong (empty: one order per mandate,
    every answer to its owner's key that very order, the rival refused)."""
    import httpx

    run = os.urandom(4).hex()

    def post(client: httpx.Client, mandate: str, user: str) -> tuple[int, Any]:
        headers = {"Idempotency-Key": f"{run}-{mandate}-{user}", "X-User-Id": user}
        for _ in range(5):
            answer = client.post(
                f"{url}/orders", json={"cart_mandate_id": mandate, "total": 100}, headers=headers
            )
            if answer.status_code != 409 or "being created" not in answer.text:
                break
        body = answer.json() if answer.status_code in (200, 201) else answer.text
        return answer.status_code, body

    jobs = [(f"{run}-m{i}", "alice") for i in range(mandates) for _ in range(copies)]
    jobs += [(f"{run}-m{i}", "mallory") for i in range(0, mandates, 4)]
    with httpx.Client(timeout=60) as client, ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda job: post(client, *job), jobs))
        orders = client.get(f"{url}/orders").json()
    problems = []
    ours = [o for o in orders if o["cart_mandate_id"].startswith(f"{run}-")]
    per_mandate = Counter(o["cart_mandate_id"] for o in ours)
    for i in range(mandates):
        if per_mandate[f"{run}-m{i}"] != 1:
            problems.append(f"mandate m{i}: {per_mandate[f'{run}-m{i}']} orders")
    committed = {o["cart_mandate_id"]: o for o in ours}
    created = Counter()
    for (mandate, user), (status, body) in zip(jobs, answers, strict=True):
        order = committed.get(mandate)
        if order is None:
            continue
        if user == order["user_id"]:  # the owner's key: the committed order, every time
            if status not in (200, 201) or body != order:
                problems.append(f"{mandate} {user}: {status} {body!r}, not the order {order}")
            created[mandate] += status == 201
        elif status != 409 or "another user" not in str(body):
            problems.append(f"{mandate} {user}: {status} {body!r}, not the rival's refusal")
    problems += [f"{m}: no 201 for its owner" for m in committed if not created[m]]
    return problems


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="default: a free loopback port")
    parser.add_argument("--check", action="store_true", help="storm the app, check, exit")
    parser.add_argument("--lease", type=float, default=30.0, help="the attempts' lease (s)")
    parser.add_argument("--wait", type=float, default=10.0, help="how long duplicates wait (s)")
    args = parser.parse_args()
    database_url = os.environ.get("DATABASE_URL") or (
        f"sqlite:///{tempfile.mkdtemp(prefix='orders-')}/shop.db"
        if args.check
        else "sqlite:///sqlalchemy_orders.db"
    )
    port = args.port or _free_port()
    app = make_app(database_url, lease=args.lease, wait=args.wait)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    if not args.check:
        print(f"serving on http://127.0.0.1:{port} ({database_url})", flush=True)
        server.run()
        return 0
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.01)
    problems = storm(f"http://127.0.0.1:{port}")
    server.should_exit = True
    thread.join(timeout=10)
    for problem in problems:
        print(problem, file=sys.stderr)
    print("one order per cart mandate" if not problems else "FAILED", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
