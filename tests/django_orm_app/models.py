"""The order of the agentic-commerce idempotency map: one per cart mandate."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    cart_mandate_id = models.CharField(max_length=100, unique=True)
    user_id = models.CharField(max_length=100)
    total = models.IntegerField()

    class Meta:
        app_label = "django_orm_app"


class Line(models.Model):
    """A line of an order (a foreign key: Django checks it at COMMIT, deferred)."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE)

    class Meta:
        app_label = "django_orm_app"
