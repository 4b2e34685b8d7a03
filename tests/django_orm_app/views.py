"""Order creation views (sync and async) and a count, for the middleware's tests."""

from __future__ import annotations

import json
import os
import signal
import time

from asgiref.sync import sync_to_async
from django.db import IntegrityError, transaction
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from django_orm_app.models import Line, Order


def _order(order: Order) -> JsonResponse:
    body = {"id": order.pk, "cart_mandate_id": order.cart_mandate_id, "total": order.total}
    return JsonResponse(body, status=201)


def _after_write(request: HttpRequest) -> None:
    """What the test asks of the view after its write (headers: not in the fingerprint)."""
    if request.headers.get("x-crash"):  # killed between the ORM write and the commit
        os.kill(os.getpid(), signal.SIGKILL)
    written = request.headers.get("x-written")
    if written:  # tell the test the ORM write is done (not committed)
        open(written, "w").close()
    gate = request.headers.get("x-hold")
    if gate:  # hold the transaction open until the test opens the gate (a file appears)
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
    if request.headers.get("x-fail"):
        raise RuntimeError("the view failed after its write")
    if request.headers.get("x-hook"):  # a hook of the app's that raises after the COMMIT
        transaction.on_commit(lambda: 1 / 0)
    if request.headers.get("x-rollback"):  # a dry run: Django rolls back without an error
        transaction.set_rollback(True)
    if request.headers.get("x-swallow"):  # an error caught without a savepoint (a bug)
        try:
            Order.objects.create(cart_mandate_id="dup", user_id="u", total=1)
            Order.objects.create(cart_mandate_id="dup", user_id="u", total=1)
        except IntegrityError:
            pass  # (PostgreSQL's transaction is now aborted; SQLite's goes on)


@csrf_exempt
def orders(request: HttpRequest) -> JsonResponse:
    data = json.loads(request.body)
    order = Order.objects.create(
        cart_mandate_id=data["cart_mandate_id"], user_id=data["user_id"], total=data["total"]
    )
    _after_write(request)
    if request.headers.get("x-status"):
        status = int(request.headers["x-status"])
        return JsonResponse({"status": status}, status=status)
    return _order(order)


@csrf_exempt
async def aorders(request: HttpRequest) -> JsonResponse:
    data = json.loads(request.body)
    order = await Order.objects.acreate(
        cart_mandate_id=data["cart_mandate_id"], user_id=data["user_id"], total=data["total"]
    )
    await sync_to_async(_after_write)(request)  # (in the thread of the ORM's calls)
    return _order(order)


@csrf_exempt
def lines(request: HttpRequest) -> JsonResponse:
    """A line of an order that does not exist: Django checks the foreign key at COMMIT."""
    line = Line.objects.create(order_id=999_999)
    return JsonResponse({"line": line.pk}, status=201)


def count(request: HttpRequest, mandate: str) -> JsonResponse:
    return JsonResponse({"orders": Order.objects.filter(cart_mandate_id=mandate).count()})


urlpatterns = [
    path("orders", orders),
    path("aorders", aorders),
    path("lines", lines),
    path("count/<str:mandate>", count),
]
