"""What the ``retrysafe_*`` management commands share."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from retrysafe.stores import Store
from retrysafe.stores.django import DjangoStore

__all__ = ["open_alias"]


def open_alias(alias: str) -> Store[Any]:
    """The ``django://alias`` store, or CommandError naming what is wrong."""
    try:
        store: Store[Any] = DjangoStore(alias)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    return store
