"""The ``retrysafe.django`` app: the records table in Django's own database.

Adding ``"retrysafe.django"`` to ``INSTALLED_APPS`` is needed only for the
``django://`` store (``manage.py migrate`` creates its table, the ``retrysafe_sweep``
and ``retrysafe_stats`` commands work on it); the middleware alone, with any other
store, needs no app.
"""

from __future__ import annotations

from django.apps import AppConfig

__all__ = ["RetrysafeConfig"]


class RetrysafeConfig(AppConfig):  # type: ignore[misc]  # (Django ships no types)
    """The app: label ``retrysafe``, an unmanaged model over the native records table."""

    name = "retrysafe.django"
    label = "retrysafe"
    verbose_name = "retrysafe idempotency records"
    default_auto_field = "django.db.models.BigAutoField"
