"""The idempotency map commands: ``map check`` and ``map show``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from retrysafe._cli.common import (
    CliError,
    JsonOpt,
    map_app,
    plural,
    print_json,
)

__all__ = ["map_check", "map_show"]


@map_app.command("check")
def map_check(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="The map to check (TOML).")],
    as_json: JsonOpt = False,
) -> int:
    """Validate an Idempotency Map; exit 1 naming the file, line and field if it is wrong."""
    from retrysafe._map.map import IdempotencyMap
    from retrysafe.errors import MapError

    try:
        imap = IdempotencyMap.load(file)
    except MapError as exc:
        if as_json:
            print_json(
                {
                    "ok": False,
                    "error": str(exc),
                    "source": str(exc.source),
                    "line": exc.line,
                    "field": exc.field,
                }
            )
            return 1
        raise CliError(str(exc), 1) from exc
    if as_json:
        print_json({"ok": True, "operations": len(imap.operations), "routes": len(imap.routes)})
    else:
        print(
            f"{file}: ok, {plural(len(imap.operations), 'operation')}, "
            f"{plural(len(imap.routes), 'route')}"
        )
    return 0


@map_app.command("show")
def map_show(
    file: Annotated[
        Path | None,
        typer.Argument(metavar="[FILE]", help="The map to show (default: the built-in map)."),
    ] = None,
    as_json: JsonOpt = False,
) -> int:
    """Print a map (the built-in default one without FILE) as TOML or JSON."""
    from retrysafe._map.map import IdempotencyMap

    imap = IdempotencyMap.default() if file is None else IdempotencyMap.load(file)
    if as_json:
        print_json(imap.to_dict())
    else:
        sys.stdout.write(imap.to_toml())
    return 0
