"""POST /orders: create the order of a cart mandate, once.

The client sends ``Idempotency-Key: order:{cartMandateId}:{userId}``. The middleware
claims the key, runs this view inside ``transaction.atomic()`` and writes the
completed record in that same transaction: the order row and the record commit
together. A retry gets the stored answer (``Idempotent-Replayed: true``) and no
second row.
"""

import json

from django.db import IntegrityError, transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from orders.models import Order


def _answer(order: Order, status: int = 201) -> JsonResponse:
    return JsonResponse(
        {
            "order_id": order.pk,
            "cart_mandate_id": order.cart_mandate_id,
            "user_id": order.user_id,
            "total": order.total,
        },
        status=status,
    )


@csrf_exempt
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    data = json.loads(request.body)
    mandate, user = data["cart_mandate_id"], data["user_id"]
    try:
        with transaction.atomic():  # a savepoint: a unique violation leaves the rest usable
            order = Order.objects.create(
                cart_mandate_id=mandate, user_id=user, total=int(data["total"])
            )
    except IntegrityError:  # the mandate has its order already (another key)
        order = Order.objects.get(cart_mandate_id=mandate)
        if order.user_id != user:
            return JsonResponse({"error": "the cart mandate belongs to another order"}, status=409)
        return _answer(order, status=200)
    return _answer(order)


@require_GET
def order_count(request: HttpRequest, cart_mandate_id: str) -> JsonResponse:
    return JsonResponse({"orders": Order.objects.filter(cart_mandate_id=cart_mandate_id).count()})
