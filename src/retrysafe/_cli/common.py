"""What the CLI's commands share: the typer apps, the common options and the output helpers.

Keys, operations, URLs and errors are client input: they are printed literally,
never as Rich markup or emoji codes, with control characters escaped.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from retrysafe._model.duration import format_duration, parse_duration
from retrysafe._model.hashing import printable
from retrysafe.stores import DEFAULT_STORE_URL, Store, open_store

__all__ = [
    "DEFAULT_OUTBOX",
    "DEMO_STORE_URL",
    "CliError",
    "JsonOpt",
    "LimitOpt",
    "OperationOpt",
    "OutboxOpt",
    "StoreOpt",
    "add_row",
    "app",
    "archive_app",
    "duration_option",
    "err",
    "format_age",
    "map_app",
    "open_store_for",
    "out",
    "outbox_app",
    "plural",
    "print_json",
    "store_url_for",
]

DEMO_STORE_URL = "sqlite:///retrysafe-demo.db"
STORE_HELP = f"Store URL (default: $RETRYSAFE_STORE or {DEFAULT_STORE_URL})."
DEFAULT_OUTBOX = "retrysafe-outbox.db"

app = typer.Typer(
    name="retrysafe",
    help="Make retries safe: one side effect and the same answer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
map_app = typer.Typer(help="Check or show an Idempotency Map.", no_args_is_help=True)
archive_app = typer.Typer(help="Read the archive of financial records.", no_args_is_help=True)
outbox_app = typer.Typer(
    help="Inspect, send or drop the mutations queued in a client outbox.", no_args_is_help=True
)
app.add_typer(map_app, name="map")
app.add_typer(archive_app, name="archive")
app.add_typer(outbox_app, name="outbox")

StoreOpt = Annotated[str | None, typer.Option("--store", metavar="URL", help=STORE_HELP)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
OperationOpt = Annotated[str | None, typer.Option(help="Only this operation.")]
LimitOpt = Annotated[int, typer.Option(min=1, help="At most this many records.")]
OutboxOpt = Annotated[
    str | None,
    typer.Option(
        "--path",
        metavar="FILE",
        help=f"The outbox file (default: $RETRYSAFE_OUTBOX or {DEFAULT_OUTBOX}).",
    ),
]

out = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)


class CliError(Exception):
    """An error already worded for the user, with its exit status."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def store_url_for(store: str | None, default: str = DEFAULT_STORE_URL) -> str:
    """The ``--store`` URL, else ``$RETRYSAFE_STORE``, else ``default``."""
    return store or os.environ.get("RETRYSAFE_STORE") or default


def open_store_for(store: str | None) -> Store[Any]:
    """The store the ``--store`` option names (see :func:`store_url_for`)."""
    return open_store(store_url_for(store))


def format_age(seconds: float) -> str:
    """``seconds`` as a short duration (``"0s"`` under a tenth of a second)."""
    return format_duration(max(0.0, round(seconds, 1))) if seconds >= 0.1 else "0s"


def duration_option(text: str | None, option: str) -> float | None:
    """The seconds of a DURATION option (``"5m"``), or None if it was not given."""
    if text is None:
        return None
    return parse_duration(text, field=option)


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def add_row(table: Table, *cells: str) -> None:
    """Add a row of text shown as it is (control characters escaped visibly)."""
    table.add_row(*(printable(c) for c in cells))


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))
