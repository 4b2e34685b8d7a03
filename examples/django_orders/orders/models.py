from django.db import models


class Order(models.Model):
    """One order per cart mandate: the database's unique constraint holds even when
    the idempotency key cannot (another key, or a record past its seven days)."""

    cart_mandate_id = models.CharField(max_length=200, unique=True)
    user_id = models.CharField(max_length=200)
    total = models.IntegerField()
    created = models.DateTimeField(auto_now_add=True)
