"""The client outbox commands: ``outbox list``, ``outbox flush`` and ``outbox drop``."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from retrysafe._cli.common import (
    DEFAULT_OUTBOX,
    CliError,
    JsonOpt,
    OutboxOpt,
    add_row,
    format_age,
    out,
    outbox_app,
    plural,
    print_json,
)
from retrysafe._model.hashing import printable
from retrysafe._model.record import iso_time

__all__ = ["outbox_drop", "outbox_flush", "outbox_list"]


def _outbox(path: str | None) -> Any:
    from retrysafe.client import Outbox

    file = Path(path or os.environ.get("RETRYSAFE_OUTBOX") or DEFAULT_OUTBOX)
    if not file.is_file():
        raise CliError(f"no outbox at {str(file)!r}")
    # Read-only first: another program's SQLite file must not get the outbox's tables.
    import sqlite3

    try:
        with contextlib.closing(
            sqlite3.connect(f"{file.resolve().as_uri()}?mode=ro", uri=True)
        ) as conn:
            found = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE name = 'retrysafe_outbox'"
            ).fetchone()
    except sqlite3.Error as exc:
        raise CliError(f"{str(file)!r} is not an outbox: {exc}") from None
    if found is None:
        raise CliError(f"{str(file)!r} is not an outbox: it has no retrysafe_outbox table")
    return Outbox(file)


def _item_json(item: Any) -> dict[str, Any]:
    answer = item.answer
    return {
        "seq": item.seq,
        "key": item.key,
        "state": item.state,
        "method": item.method,
        "url": item.url,
        "bytes": len(item.body),
        "attempts": item.attempts,
        "last_error": item.last_error,
        "created_at": iso_time(item.created_at),
        "status_code": item.status_code,
        "answer": None if answer is None else answer.decode("utf-8", "replace"),
        "finished_at": iso_time(item.finished_at),
    }


@outbox_app.command("list")
def outbox_list(
    path: OutboxOpt = None,
    failed: Annotated[
        bool, typer.Option("--failed", help="The mutations a server finally refused.")
    ] = False,
    as_json: JsonOpt = False,
) -> int:
    """List the queued mutations in the order they will be sent (or the failed ones)."""
    box = _outbox(path)
    items = box.failures() if failed else box.items()
    if as_json:
        print_json([_item_json(i) for i in items])
        return 0
    if not items:
        out.print("no failed mutations" if failed else "the outbox is empty")
        return 0
    now = time.time()
    table = Table(
        "seq", "request", "bytes", "age", "attempts", "answer" if failed else "last error"
    )
    table.add_column("key", min_width=36, overflow="fold")  # whole, for outbox drop
    for i in items:
        last = (
            f"{i.status_code} {(i.answer or b'')[:60].decode('utf-8', 'replace')}"
            if failed
            else (i.last_error or "-")
        )
        add_row(
            table,
            str(i.seq),
            f"{i.method} {i.url}",
            str(len(i.body)),
            format_age(now - i.created_at),
            str(i.attempts),
            last,
            i.key,
        )
    out.print(table)
    return 0


@outbox_app.command("flush")
def outbox_flush(
    path: OutboxOpt = None,
    base_url: Annotated[
        str | None,
        typer.Option(metavar="URL", help="Where relative URLs go, e.g. https://api.example.com."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds for each HTTP attempt.")] = 10.0,
    max_attempts: Annotated[int, typer.Option(min=1, help="Attempts per mutation.")] = 5,
    max_time: Annotated[float, typer.Option(help="Seconds of retrying per mutation.")] = 30.0,
    header: Annotated[
        list[str] | None,
        typer.Option(
            metavar="'NAME: VALUE'",
            help="A header every request carries (repeat for several), such as the "
            "caller's credentials: the outbox never keeps them, the flusher adds them.",
        ),
    ] = None,
    header_env: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAME=VAR",
            help="A header whose value is read from the environment variable VAR (keeps "
            "a token off the command line), e.g. Authorization=API_AUTHORIZATION.",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> int:
    """Send the queued mutations in order; exit 1 unless every one was accepted."""
    import httpx

    from retrysafe.client import Client, RetryPolicy

    box = _outbox(path)
    policy = RetryPolicy(max_attempts=max_attempts, max_time=max_time)
    options: dict[str, Any] = {"retry": policy, "timeout": timeout}
    headers = _flush_headers(header or [], header_env or [])
    if headers:
        options["headers"] = headers
    if base_url is not None:
        options["base_url"] = base_url
    try:
        with Client(**options) as client:
            result = box.flush(client)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # not an answer: a bad base URL
        raise CliError(f"cannot send: {exc}") from exc
    if as_json:
        print_json(
            {
                "delivered": [i.key for i in result.delivered],
                "failed": [_item_json(i) for i in result.failed],
                "remaining": result.remaining,
                "error": result.error,
            }
        )
    else:
        print(
            f"{plural(len(result.delivered), 'mutation')} delivered, {len(result.failed)} "
            f"refused, {result.remaining} still queued"
        )
        for i in result.failed:
            print(printable(f"  refused: {i.method} {i.url} (key {i.key}): HTTP {i.status_code}"))
        if result.error:
            print(f"  stopped at {printable(str(result.error))}")
    return 0 if result.complete else 1


def _flush_headers(given: list[str], from_env: list[str]) -> dict[str, str]:
    """``--header 'NAME: VALUE'`` and ``--header-env NAME=VAR`` as one dict (CliError if bad)."""
    headers: dict[str, str] = {}
    for text in given:
        name, sep, value = text.partition(":")
        if not sep or not name.strip():
            raise CliError(f"--header {text.split(':', 1)[0]!r}...: give it as 'NAME: VALUE'")
        headers[name.strip()] = value.strip()
    for text in from_env:
        name, sep, var = text.partition("=")
        if not sep or not name.strip() or not var.strip():
            raise CliError(f"--header-env {text!r}: give it as NAME=VARIABLE")
        found = os.environ.get(var.strip())
        if found is None:
            raise CliError(f"--header-env {text!r}: the environment has no {var.strip()}")
        headers[name.strip()] = found
    return headers


@outbox_app.command("drop")
def outbox_drop(
    key: Annotated[str, typer.Argument(help="The mutation's idempotency key.")],
    path: OutboxOpt = None,
) -> int:
    """Remove a queued or failed mutation (it will not be sent)."""
    if not _outbox(path).drop(key):
        raise CliError(f"no mutation with key {key!r}", 1)
    print(f"dropped {printable(key)}")
    return 0
