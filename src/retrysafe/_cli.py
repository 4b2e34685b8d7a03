"""The ``retrysafe`` command line. Errors print one line and exit 2; never a traceback."""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import sys
import urllib.parse
from collections.abc import Sequence

from ._errors import IdempotencyError, StoreUnavailableError
from ._keys import key_hash
from .stores import DEFAULT_STORE_URL, open_store, redact

__all__ = ["main"]

DEMO_STORE_URL = "sqlite:///retrysafe-demo.db"


def _store_arg(parser: argparse.ArgumentParser, default: str = DEFAULT_STORE_URL) -> None:
    parser.add_argument(
        "--store",
        default=None,
        help=f"store URL (default: $RETRYSAFE_STORE or {default})",
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    url = args.store or os.environ.get("RETRYSAFE_STORE") or DEMO_STORE_URL
    return run_demo(
        url, listen=args.listen, check=args.check, orders=args.orders, retries=args.retries
    )


def _cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from . import gateway
    from ._serve import (
        SERVER_OPTIONS,
        bind,
        parse_listen,
        server_config,
        sigterm_as_interrupt,
        url_of,
    )

    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, not {args.workers}")
    host, port = parse_listen(args.listen)
    store_url = args.store or os.environ.get("RETRYSAFE_STORE") or DEFAULT_STORE_URL
    app = gateway.create_app(
        args.upstream, store=store_url, require_key=args.require_key, timeout=args.timeout
    )
    try:
        gateway.probe_store(app.store)
    except StoreUnavailableError as exc:
        if urllib.parse.urlsplit(store_url).scheme in ("sqlite", "memory"):
            raise  # an embedded store that cannot be opened is a configuration error
        print(
            f"retrysafe gateway: warning: {exc}; keyed requests get 503 until it answers",
            file=sys.stderr,
        )
    sock = bind(host, port)
    url = url_of(sock)
    print(f"retrysafe gateway: listening on {url}", flush=True)
    print(f"  upstream  {app.upstream}", flush=True)
    print(f"  store     {redact(store_url)}", flush=True)
    print(f"  health    {url}{gateway.HEALTH_PATH}", flush=True)
    try:
        if args.workers == 1:
            with sigterm_as_interrupt():  # uvicorn stops gracefully, then re-raises it
                uvicorn.Server(server_config(app, lifespan="on")).run(sockets=[sock])
        else:
            # Workers import the app: a factory configured by the environment.
            port = sock.getsockname()[1]
            sock.close()
            app.store.close()
            os.environ.update(
                {
                    gateway.ENV_UPSTREAM: args.upstream,
                    "RETRYSAFE_STORE": store_url,
                    gateway.ENV_REQUIRE_KEY: "1" if args.require_key else "0",
                    gateway.ENV_TIMEOUT: repr(args.timeout),
                }
            )
            uvicorn.run(
                "retrysafe.gateway:app_from_env",
                factory=True,
                host=host,
                port=port,
                workers=args.workers,
                lifespan="on",
                **SERVER_OPTIONS,
            )
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    print("retrysafe gateway: stopped", flush=True)
    return 0


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

    demo = sub.add_parser(
        "demo", help="start the gateway in front of a small demo API and show retries replayed"
    )
    _store_arg(demo, DEMO_STORE_URL)
    demo.add_argument(
        "--listen",
        default=None,
        metavar="HOST:PORT",
        help="the gateway's address (default 127.0.0.1:8000, or a free port if that one is taken)",
    )
    demo.add_argument(
        "--check",
        action="store_true",
        help="send a retry storm through the gateway, report, and exit 0 only "
        "if every order ran exactly once",
    )
    demo.add_argument("--orders", type=int, default=20, help="orders in the storm (--check)")
    demo.add_argument(
        "--retries", type=int, default=8, help="clients sending each order at once (--check)"
    )
    demo.set_defaults(func=_cmd_demo)

    gw = sub.add_parser("gateway", help="a reverse proxy that makes an HTTP API's retries safe")
    gw.add_argument(
        "--upstream",
        required=True,
        metavar="URL",
        help="the API to proxy to, e.g. http://127.0.0.1:9000",
    )
    _store_arg(gw)
    gw.add_argument(
        "--listen",
        default="127.0.0.1:8000",
        metavar="HOST:PORT",
        help="where to listen (default 127.0.0.1:8000; port 0: any free port)",
    )
    gw.add_argument(
        "--require-key",
        action="store_true",
        help="answer 400 to a POST or PATCH without an Idempotency-Key",
    )
    gw.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    gw.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the upstream to connect or send (default 60)",
    )
    gw.set_defaults(func=_cmd_gateway)

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
