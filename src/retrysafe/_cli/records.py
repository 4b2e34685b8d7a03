"""The record commands: ``migrate``, ``inspect``, ``list`` and ``archive list``."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from retrysafe._cli.common import (
    CliError,
    JsonOpt,
    LimitOpt,
    OperationOpt,
    StoreOpt,
    add_row,
    app,
    archive_app,
    duration_option,
    format_age,
    open_store_for,
    out,
    print_json,
)
from retrysafe._model.hashing import key_hash
from retrysafe._model.record import Status, iso_time, record_json
from retrysafe.stores import redact

__all__ = ["archive_list", "inspect", "list_", "migrate"]


@app.command()
def migrate(store: StoreOpt = None) -> int:
    """Create or upgrade the store's SQL schema."""
    s = open_store_for(store)
    upgrade = getattr(s, "migrate", None)
    if upgrade is None:
        print(f"{redact(s.url)}: nothing to migrate (this store has no schema)")
        return 0
    version = upgrade()
    s.close()
    print(f"{redact(s.url)}: schema at version {version}")
    return 0


@app.command()
def inspect(
    key: Annotated[str, typer.Argument(help="The client's idempotency key.")],
    store: StoreOpt = None,
    operation: Annotated[str, typer.Option(help="The record's operation.")] = "",
    scope: Annotated[str, typer.Option(help="The record's scope (principal).")] = "",
    as_json: JsonOpt = False,
) -> int:
    """Show the record of one key (scope and operation are part of the key)."""
    s = open_store_for(store)
    try:
        record = s.get(key_hash(scope, operation, key))
    finally:
        s.close()
    if record is None:
        raise CliError(
            f"no record for key {key!r} with operation {operation!r} and scope {scope!r}", 1
        )
    if as_json:
        print_json(record_json(record))
        return 0
    table = Table(show_header=False, box=None, pad_edge=False)
    for name, value in record_json(record).items():
        if name == "answer" and value is not None:
            value = f"{value['status'] or ''} {value['media_type']}, {value['bytes']} bytes".strip()
        add_row(table, name.replace("_", " "), "-" if value in (None, {}) else str(value))
    out.print(table)
    return 0


@app.command("list")
def list_(
    store: StoreOpt = None,
    status: Annotated[
        Status | None, typer.Option(help="Only records in this state.", case_sensitive=False)
    ] = None,
    older_than: Annotated[
        str | None,
        typer.Option(metavar="DURATION", help="Only records created longer ago, e.g. 5m."),
    ] = None,
    operation: OperationOpt = None,
    limit: LimitOpt = 50,
    as_json: JsonOpt = False,
) -> int:
    """List records, oldest first."""
    age = duration_option(older_than, "--older-than")
    now = time.time()
    s = open_store_for(store)
    try:
        records = s.records(
            status=status,
            operation=operation,
            created_before=None if age is None else now - age,
            limit=limit,
        )
    finally:
        s.close()
    if as_json:
        print_json([record_json(r) for r in records])
        return 0
    if not records:
        out.print("no records")
        return 0
    table = Table("key", "operation", "scope", "status", "age", "attempts", "expires in")
    for r in records:
        status_text = r.status.value + (" (final)" if r.final else "")
        if r.expires_at <= now:
            status_text += " (expired)"
        add_row(
            table,
            r.key,
            r.operation,
            (r.scope[:12] + "…") if len(r.scope) > 13 else r.scope,
            status_text,
            format_age(now - r.created_at),
            str(r.attempts),
            "-" if r.expires_at <= now else format_age(r.expires_at - now),
        )
    out.print(table)
    return 0


@archive_app.command("list")
def archive_list(
    store: StoreOpt = None,
    operation: OperationOpt = None,
    limit: LimitOpt = 50,
    as_json: JsonOpt = False,
) -> int:
    """List archived financial records, most recently archived first."""
    s = open_store_for(store)
    try:
        archived = s.archived_records(operation=operation, limit=limit)
    finally:
        s.close()
    if as_json:
        print_json(
            [dict(record_json(a.record), archived_at=iso_time(a.archived_at)) for a in archived]
        )
        return 0
    if not archived:
        out.print("the archive is empty")
        return 0
    table = Table("archived", "key", "operation", "status", "created", "answer")
    for a in archived:
        r, o = a.record, a.record.outcome
        add_row(
            table,
            iso_time(a.archived_at) or "",
            r.key,
            r.operation,
            r.status.value,
            iso_time(r.created_at) or "",
            "-" if o is None else f"{o.status or ''} {len(o.body)} B",
        )
    out.print(table)
    return 0
