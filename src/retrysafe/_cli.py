"""The ``retrysafe`` command line. Errors print one line and exit 2; never a traceback."""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import sys
from collections.abc import Sequence

from ._engine import Engine
from ._errors import IdempotencyError
from ._keys import key_hash
from .stores import DEFAULT_STORE_URL, open_store, redact

__all__ = ["main"]

DEMO_STORE_URL = "sqlite:///retrysafe-demo.db"


def _store_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        default=None,
        help=f"store URL (default: $RETRYSAFE_STORE or {DEFAULT_STORE_URL})",
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import retry_storm

    url = args.store or os.environ.get("RETRYSAFE_STORE") or DEMO_STORE_URL
    engine = Engine(url)
    report = retry_storm(engine, payments=args.payments, clients=args.clients, retries=args.retries)
    engine.close()
    print(report.render(redact(url)))
    return 0 if report.exactly_once else 1


def _cmd_migrate(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    migrate = getattr(store, "migrate", None)
    if migrate is None:
        print(f"{redact(store.url)}: nothing to migrate (this store has no schema)")
        return 0
    version = migrate()
    store.close()
    print(f"{redact(store.url)}: schema at version {version}")
    return 0


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="milliseconds")


def _cmd_inspect(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    record = store.get(key_hash(args.scope, args.operation, args.key))
    store.close()
    if record is None:
        print("no record for this key (scope and operation are part of it)")
        return 1
    out = record.outcome
    rows = [
        ("key", record.key), ("scope", record.scope), ("operation", record.operation),
        ("key hash", record.key_hash), ("status", record.status.value),
        ("final", str(record.final)), ("attempts", str(record.attempts)),
        ("fingerprint", record.fingerprint), ("request id", record.request_id or "-"),
        ("created", _when(record.created_at)), ("updated", _when(record.updated_at)),
        ("completed", _when(record.completed_at)), ("lease until", _when(record.lease_until)),
        ("expires", _when(record.expires_at)),
        ("answer", "-" if out is None else f"{out.status or ''} {out.media_type}, "
                                           f"{len(out.body)} bytes"),
    ]  # fmt: skip
    for name, value in rows:
        print(f"{name:<12} {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="retrysafe", description="Make retries safe.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a retry storm through the engine and report")
    demo.add_argument(
        "--store", default=None,
        help=f"store URL (default: $RETRYSAFE_STORE or {DEMO_STORE_URL})",
    )  # fmt: skip
    demo.add_argument("--payments", type=int, default=50)
    demo.add_argument("--clients", type=int, default=16)
    demo.add_argument("--retries", type=int, default=6)
    demo.set_defaults(func=_cmd_demo)

    migrate = sub.add_parser("migrate", help="create or upgrade the store's schema")
    _store_arg(migrate)
    migrate.set_defaults(func=_cmd_migrate)

    inspect = sub.add_parser("inspect", help="show the record of one key")
    _store_arg(inspect)
    inspect.add_argument("key")
    inspect.add_argument("--operation", default="")
    inspect.add_argument("--scope", default="")
    inspect.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Errors are reported once, below; connection pools must not add their own.
    logging.basicConfig(level=logging.WARNING, format="retrysafe: %(message)s")
    logging.getLogger("psycopg").setLevel(logging.CRITICAL)
    try:
        return int(args.func(args))
    except (IdempotencyError, ValueError, TypeError, ImportError, OSError) as exc:
        print(f"retrysafe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
