"""``manage.py retrysafe_sweep``: delete the expired records of a ``django://`` store."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from retrysafe._ops.sweep import Sweeper
from retrysafe.django.commands import open_alias

__all__ = ["Command"]


class Command(BaseCommand):  # type: ignore[misc]  # (Django ships no types)
    help = (
        "Delete the expired idempotency records of a database (archiving financial ones "
        "first), in bounded batches: `retrysafe sweep` on the django:// store."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--database", default="default", help="The database alias.")
        parser.add_argument("--batch-size", type=int, default=1000, help="Records per batch.")
        parser.add_argument("--pause", type=float, default=0.0, help="Seconds between batches.")
        parser.add_argument("--json", action="store_true", help="One JSON line.")

    def handle(self, *args: Any, **options: Any) -> None:
        store = open_alias(options["database"])
        try:
            report = Sweeper(store, batch_size=options["batch_size"], pause=options["pause"]).run()
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        finally:
            store.close()
        if options["json"]:
            data = {"deleted": report.deleted, "archived": report.archived}
            data |= {"batches": report.batches, "cells": report.cells}
            self.stdout.write(json.dumps(data))
        else:
            self.stdout.write(
                f"retrysafe sweep: deleted {report.deleted} expired records "
                f"({report.archived} archived) in {report.seconds:.2f}s, {report.batches} batches"
            )
