"""``manage.py retrysafe_stats``: counts of a ``django://`` store's records."""

from __future__ import annotations

import json
import time
from typing import Any

from django.core.management.base import BaseCommand

from retrysafe._ops.summary import stats_summary
from retrysafe.django.commands import open_alias

__all__ = ["Command"]


class Command(BaseCommand):  # type: ignore[misc]  # (Django ships no types)
    help = (
        "Counts of a database's idempotency records by status and operation, and the "
        "oldest processing one: `retrysafe stats` on the django:// store."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--database", default="default", help="The database alias.")
        parser.add_argument("--json", action="store_true", help="JSON, for scripts.")

    def handle(self, *args: Any, **options: Any) -> None:
        store = open_alias(options["database"])
        now = time.time()
        try:
            st = store.stats(now)
        finally:
            store.close()
        oldest = st.oldest_processing
        data = stats_summary(st, now)
        if options["json"]:
            self.stdout.write(json.dumps(data))
            return
        for name in ("by_status", "by_operation"):
            counts = ", ".join(f"{k or '(none)'}: {n}" for k, n in data[name].items())
            self.stdout.write(f"{name.replace('_', ' ')}: {counts or 'none'}")
        self.stdout.write(f"expired, awaiting the sweeper: {st.expired}")
        if st.archived is not None:
            self.stdout.write(f"archived financial records: {st.archived}")
        late = "none" if oldest is None else f"{oldest.key!r} ({oldest.operation!r})"
        self.stdout.write(f"oldest processing record: {late}")
