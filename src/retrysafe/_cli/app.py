"""The ``retrysafe`` command line (typer + rich): the entry point that runs every command.

Every command takes ``--store URL`` (default ``$RETRYSAFE_STORE``); the reading
commands take ``--json`` for scripts. Errors print one line and exit 2 (1 for
``map check`` on an invalid map, and for ``inspect`` of an absent key); never a
traceback. The commands live in their own modules, registered on import.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import typer

# The command modules register their commands on the app, in the order --help lists them.
# isort: off
from retrysafe._cli import serve, mcp, records, ops, outbox, maps  # noqa: F401

# isort: on
from retrysafe._cli.common import CliError, app
from retrysafe._model.hashing import printable
from retrysafe.errors import IdempotencyError

__all__ = ["app", "main"]


class _Prefixed(logging.Formatter):
    """``retrysafe: `` before a log line, unless it already names retrysafe."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if text.startswith("retrysafe") else f"retrysafe: {text}"


def _command_name(argv: Sequence[str]) -> str:
    words = [a for a in argv if not a.startswith("-")][:2]
    if words[:1] in (["map"], ["archive"], ["outbox"]):
        return " ".join(words)
    return words[0] if words else ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit status (0 ok, 1 not found / invalid map, 2 error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = _command_name(argv)
    prefix = f"retrysafe {name}".strip()
    # Errors are reported once, below; connection pools must not add their own.
    stderr = logging.StreamHandler()
    stderr.setFormatter(_Prefixed())
    logging.basicConfig(level=logging.WARNING, handlers=[stderr])  # unless one is set
    logging.getLogger("psycopg").setLevel(logging.CRITICAL)
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="retrysafe", standalone_mode=False)
    except CliError as exc:
        print(f"{prefix}: error: {printable(str(exc))}", file=sys.stderr)
        return exc.status
    except (
        IdempotencyError,
        ValueError,
        TypeError,
        ImportError,
        OSError,
        NotImplementedError,
        KeyError,
    ) as exc:
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"{prefix}: error: {printable(str(text))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the click layer's own: --help, usage errors, Abort
        code = getattr(exc, "exit_code", None)
        if type(exc).__name__ == "Exit":
            return int(code or 0)
        if type(exc).__name__ == "Abort":
            return 130
        format_message = getattr(exc, "format_message", None)
        if format_message is None:
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":  # a group without its command
            print(format_message())
            return 2
        message = " ".join(str(format_message()).split())
        print(f"{prefix}: error: {message} (see --help)", file=sys.stderr)
        return 2
    return int(result or 0)
