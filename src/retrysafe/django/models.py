"""Read-only ORM access to the records table the ``django://`` store keeps.

The table is the native store's (``managed = False``: Django never creates,
alters or drops it; the migration runs the native store's own migration). Its
columns hold the native store's forms, so :meth:`Record.record` decodes a row
through the store; ``operation`` and the timestamps (seconds since the epoch) read
as they are. ``key_hash`` and ``status`` are packed on SQLite and PostgreSQL (bytes,
a code) and text on MySQL (hex, the status's name): :meth:`RecordRow.key_hex` and
:attr:`RecordRow.status_name` read either.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import models

from retrysafe.stores.django import status_of

__all__ = ["Record", "RecordRow"]


def _when(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


class RecordRow:
    """What :class:`Record` reads of a row, beyond its columns."""

    operation: str
    status: int
    created_at: float
    completed_at: float | None
    expires_at: float
    key_hash: Any
    _state: Any

    def __str__(self) -> str:
        return f"{self.operation or '(none)'} {self.status_name} {self.key_hex()[:16]}"

    def key_hex(self) -> str:
        """The record's key hash in hex (the column's bytes, or MySQL's text)."""
        key_hash = self.key_hash
        return key_hash if isinstance(key_hash, str) else bytes(key_hash).hex()

    @property
    def status_name(self) -> str:
        """``processing``, ``completed`` or ``failed``."""
        status: Any = self.status
        if isinstance(status, str):  # MySQL keeps the name
            return status
        return str(status_of(status).value)

    @property
    def created(self) -> datetime | None:
        """:attr:`created_at` as an aware datetime (UTC)."""
        return _when(self.created_at)

    @property
    def completed(self) -> datetime | None:
        """:attr:`completed_at` as an aware datetime (UTC), or None."""
        return _when(self.completed_at)

    @property
    def expires(self) -> datetime | None:
        """:attr:`expires_at` as an aware datetime (UTC)."""
        return _when(self.expires_at)

    def record(self) -> Any:
        """The whole :class:`retrysafe.Record` (key, scope, stored answer …), decoded by
        the store of this row's database."""
        from retrysafe.stores.django import DjangoStore

        store = DjangoStore(self._state.db or "default")
        try:
            return store.get(self.key_hex())
        finally:
            store.close()


# Django imports this module with its settings loaded; a walk of the package outside a
# Django project (documentation tools, tests of the package) gets no model.
if settings.configured:

    class Record(RecordRow, models.Model):  # type: ignore[misc]  # (Django ships no types)
        """One idempotency record, as the native store wrote it (read it, never write it)."""

        key_hash = models.BinaryField(primary_key=True)
        operation = models.TextField()
        status = models.SmallIntegerField()  # the code of retrysafe.Status (see status_name)
        attempts = models.IntegerField()
        created_at = models.FloatField()
        updated_at = models.FloatField()
        completed_at = models.FloatField(null=True)
        lease_until = models.FloatField()
        expires_at = models.FloatField()
        response_status = models.IntegerField(null=True)

        class Meta:
            managed = False
            db_table = "retrysafe_records"
            app_label = "retrysafe"
            ordering = ("-created_at",)
