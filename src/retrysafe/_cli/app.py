"""The ``retrysafe`` command line (typer + rich).

Every command takes ``--store URL`` (default ``$RETRYSAFE_STORE``); the reading
commands take ``--json`` for scripts. Errors print one line and exit 2 (1 for
``map check`` on an invalid map, and for ``inspect`` of an absent key); never a
traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from retrysafe._model.hashing import key_hash, printable
from retrysafe._model.record import Status, iso_time, record_json
from retrysafe.errors import IdempotencyError, StoreUnavailableError
from retrysafe.stores import DEFAULT_STORE_URL, Store, open_store, redact

__all__ = ["app", "main"]

DEMO_STORE_URL = "sqlite:///retrysafe-demo.db"
STORE_HELP = f"Store URL (default: $RETRYSAFE_STORE or {DEFAULT_STORE_URL})."

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
DEFAULT_OUTBOX = "retrysafe-outbox.db"
OutboxOpt = Annotated[
    str | None,
    typer.Option(
        "--path",
        metavar="FILE",
        help=f"The outbox file (default: $RETRYSAFE_OUTBOX or {DEFAULT_OUTBOX}).",
    ),
]

# Keys, operations, URLs and errors are client input: printed literally, never as Rich
# markup or emoji codes, and with control characters escaped (see _row).
out = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)


class CliError(Exception):
    """An error already worded for the user, with its exit status."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def _store_url(store: str | None, default: str = DEFAULT_STORE_URL) -> str:
    return store or os.environ.get("RETRYSAFE_STORE") or default


def _open(store: str | None) -> Store[Any]:
    return open_store(_store_url(store))


def _age(seconds: float) -> str:
    from retrysafe._model.duration import format_duration

    return format_duration(max(0.0, round(seconds, 1))) if seconds >= 0.1 else "0s"


def _duration(text: str | None, option: str) -> float | None:
    if text is None:
        return None
    from retrysafe._model.duration import parse_duration

    return parse_duration(text, field=option)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _row(table: Table, *cells: str) -> None:
    """Add a row of text shown as it is (control characters escaped visibly)."""
    table.add_row(*(printable(c) for c in cells))


class _Prefixed(logging.Formatter):
    """``retrysafe: `` before a log line, unless it already names retrysafe."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if text.startswith("retrysafe") else f"retrysafe: {text}"


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))


# -- demo and gateway ------------------------------------------------------------------


@app.command()
def demo(
    store: StoreOpt = None,
    listen: Annotated[
        str | None,
        typer.Option(
            metavar="HOST:PORT",
            help="The gateway's address (default 127.0.0.1:8000, or a free port if taken).",
        ),
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Send a retry storm through the gateway, report, and exit 0 only if "
            "every order ran exactly once.",
        ),
    ] = False,
    orders: Annotated[int, typer.Option(help="Orders in the storm (--check).")] = 20,
    retries: Annotated[int, typer.Option(help="Clients sending each order at once.")] = 8,
) -> int:
    """Start the gateway in front of a small demo API and show retries replayed."""
    from retrysafe._demo.run import run_demo

    return run_demo(
        _store_url(store, DEMO_STORE_URL),
        listen=listen,
        check=check,
        orders=orders,
        retries=retries,
    )


@app.command()
def gateway(
    upstream: Annotated[
        str, typer.Option(metavar="URL", help="The API to proxy to, e.g. http://127.0.0.1:9000.")
    ],
    store: StoreOpt = None,
    listen: Annotated[
        str, typer.Option(metavar="HOST:PORT", help="Where to listen (port 0: any free port).")
    ] = "127.0.0.1:8000",
    require_key: Annotated[
        bool,
        typer.Option("--require-key", help="Answer 400 to a POST or PATCH without a key."),
    ] = False,
    map_file: Annotated[
        Path | None,
        typer.Option(
            "--map", metavar="FILE", help="An Idempotency Map (TOML) with per-route policy."
        ),
    ] = None,
    workers: Annotated[int, typer.Option(help="Worker processes.")] = 1,
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for the upstream to connect or send.")
    ] = 60.0,
    principal_header: Annotated[
        list[str] | None,
        typer.Option(
            "--principal-header",
            metavar="NAME",
            help="A header that carries a credential (repeat for several). Given at all, "
            "it replaces the default list (Proxy-Authorization, X-API-Key, Api-Key, "
            "X-Api-Token, X-Auth-Token, X-Access-Token, X-Session-Token, X-User-Token); "
            "every Authorization line always counts.",
        ),
    ] = None,
    principal_cookie: Annotated[
        list[str] | None,
        typer.Option(
            "--principal-cookie",
            metavar="NAME",
            help="A session cookie's name (repeat for several): only these cookies name "
            "the caller. Default: every cookie but analytics, consent, CSRF and "
            "load-balancer ones.",
        ),
    ] = None,
    principal_query: Annotated[
        list[str] | None,
        typer.Option(
            "--principal-query",
            metavar="NAME",
            help="A query parameter that carries a credential (repeat for several).",
        ),
    ] = None,
    trusted_proxy: Annotated[
        list[str] | None,
        typer.Option(
            "--trusted-proxy",
            metavar="CIDR",
            help="A proxy in front of the gateway (an address or a CIDR; repeat for "
            "several) whose Forwarded, X-Forwarded-*, X-Real-IP and similar headers "
            "reach the upstream. Default none: they are dropped from every client.",
        ),
    ] = None,
    anonymous: Annotated[
        str | None,
        typer.Option(
            metavar="run|refuse|share",
            help="What a keyed request without credentials gets: run without a record "
            "(default), refuse (403), or share one public record space.",
        ),
    ] = None,
    admin_loopback: Annotated[
        bool,
        typer.Option(
            "--admin-loopback",
            help="Open the dashboard, metrics and key inspector to every loopback "
            "connection without the admin token (default $RETRYSAFE_ADMIN_LOOPBACK, else "
            "off: without $RETRYSAFE_ADMIN_TOKEN they are closed). Not behind a proxy on "
            "this host: its connections are loopback ones.",
        ),
    ] = False,
    max_head_size: Annotated[
        int | None,
        typer.Option(
            metavar="BYTES",
            help="The most bytes of request line and headers read (default 65536); "
            "a larger head gets 431.",
        ),
    ] = None,
    head_timeout: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="Seconds for a request's line and headers to arrive (default 30); "
            "a slower head gets 408.",
        ),
    ] = None,
    body_timeout: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="Seconds the gateway waits for the next byte of a request body "
            "(default 60); then 408.",
        ),
    ] = None,
    max_connections: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Open client connections per worker (default 512); one more gets 503.",
        ),
    ] = None,
    http: Annotated[
        str,
        typer.Option(
            metavar="auto|httptools|h11",
            help="The HTTP/1.1 parser: httptools (fast, the 'speed' extra) or h11; "
            "auto picks httptools when it is installed.",
        ),
    ] = "auto",
    sweep_every: Annotated[
        float,
        typer.Option(
            metavar="SECONDS",
            help="How often expired records are swept from the store in the background "
            "(one worker at a time).",
        ),
    ] = 300.0,
    no_sweep: Annotated[
        bool,
        typer.Option(
            "--no-sweep",
            help="Run no sweeper (when `retrysafe sweep` runs elsewhere, e.g. from cron).",
        ),
    ] = False,
) -> int:
    """A reverse proxy that makes an HTTP API's retries safe.

    Answers never cross callers: a caller is named by its credentials (every
    Authorization line, API-key headers, session cookies); see docs/principals.md.
    """
    import uvicorn

    from retrysafe import gateway as gw
    from retrysafe._gateway.limits import protocol_class
    from retrysafe._ops.serve import (
        SERVER_OPTIONS,
        bind,
        parse_listen,
        server_config,
        sigterm_as_interrupt,
        url_of,
    )

    if workers < 1:
        raise ValueError(f"--workers must be at least 1, not {workers}")
    if not (sweep_every > 0 and math.isfinite(sweep_every)):
        raise ValueError(f"--sweep-every must be a positive number of seconds, not {sweep_every}")
    sweep = None if no_sweep else sweep_every
    host, port = parse_listen(listen)
    store_url = _store_url(store)
    imap = None
    if map_file is not None:
        from retrysafe._map.map import IdempotencyMap

        imap = IdempotencyMap.load(map_file)
    principals = {
        "principal_headers": principal_header or None,
        "principal_cookies": principal_cookie or None,
        "principal_query": principal_query or None,
        "anonymous": anonymous,
    }
    principals = {name: value for name, value in principals.items() if value is not None}
    from retrysafe._ops.admin import ENV_LOOPBACK, loopback_from_env

    admin_loopback = admin_loopback or loopback_from_env()  # (a bad value: an error now)
    limits = {
        "max_head_size": max_head_size,
        "head_timeout": head_timeout,
        "body_timeout": body_timeout,
        "max_connections": max_connections,
    }
    limits = {name: value for name, value in limits.items() if value is not None}
    protocol = protocol_class(http)
    application = gw.create_app(
        upstream,
        store=store_url,
        require_key=require_key,
        timeout=timeout,
        map=imap,
        admin_loopback=admin_loopback,
        sweep_every=sweep,
        trusted_proxies=trusted_proxy or (),
        **principals,
        **limits,
    )
    try:
        gw.probe_store(application.store)
    except StoreUnavailableError as exc:
        if urllib.parse.urlsplit(store_url).scheme in ("sqlite", "memory"):
            raise  # an embedded store that cannot be opened is a configuration error
        print(
            f"retrysafe gateway: warning: {exc}; keyed requests get 503 until it answers",
            file=sys.stderr,
        )
    sock = bind(host, port)
    stack = contextlib.ExitStack()
    url = url_of(sock)
    print(f"retrysafe gateway: listening on {url}", flush=True)
    print(f"  upstream  {application.upstream}", flush=True)
    print(f"  store     {redact(store_url)}", flush=True)
    if map_file is not None:
        print(f"  map       {map_file}", flush=True)
    print(f"  callers   {application.middleware.policy.principals.describe()}", flush=True)
    print(f"  limits    {_limits_line(application.server_limits, protocol)}", flush=True)
    swept = "off (--no-sweep)" if sweep is None else f"every {sweep:g} s, one worker at a time"
    print(f"  sweeper   {swept}", flush=True)
    if trusted_proxy:
        print(f"  proxies   {', '.join(map(str, application.proxy.trusted))}", flush=True)
    print(f"  health    {url}{gw.HEALTH_PATH}", flush=True)
    print(f"  dashboard {url}{gw.DASHBOARD_PATH}  ({_admin_access(admin_loopback)})", flush=True)
    print(f"  metrics   {url}{gw.METRICS_PATH}", flush=True)
    try:
        if workers == 1:
            with sigterm_as_interrupt():  # uvicorn stops gracefully, then re-raises it
                config = server_config(application, lifespan="on", http=protocol)
                uvicorn.Server(config).run(sockets=[sock])
        else:
            # Workers import the app: a factory configured by the environment.
            port = sock.getsockname()[1]
            sock.close()
            application.store.close()
            env = {
                gw.ENV_UPSTREAM: upstream,
                "RETRYSAFE_STORE": store_url,
                gw.ENV_REQUIRE_KEY: "1" if require_key else "0",
                gw.ENV_TIMEOUT: repr(timeout),
                ENV_LOOPBACK: "1" if admin_loopback else "0",
                gw.ENV_MAX_HEAD_SIZE: str(application.server_limits.max_head_size),
                gw.ENV_HEAD_TIMEOUT: repr(application.server_limits.head_timeout),
                gw.ENV_BODY_TIMEOUT: repr(application.server_limits.body_timeout),
                gw.ENV_MAX_CONNECTIONS: str(application.server_limits.max_connections),
                gw.ENV_SWEEP: "off" if sweep is None else repr(sweep),
            }
            if map_file is not None:
                env[gw.ENV_MAP] = str(Path(map_file).resolve())
            if principals:
                env[gw.ENV_PRINCIPALS] = json.dumps(principals)
            if trusted_proxy:
                env[gw.ENV_TRUSTED_PROXIES] = ",".join(trusted_proxy)
            os.environ.update(env)
            stack.enter_context(_shared_metrics())  # the workers' counters, added up
            uvicorn.run(
                "retrysafe.gateway:app_from_env",
                factory=True,
                host=host,
                port=port,
                workers=workers,
                lifespan="on",
                http=protocol,
                **SERVER_OPTIONS,
            )
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        stack.close()
    print("retrysafe gateway: stopped", flush=True)
    return 0


def _limits_line(limits: Any, protocol: type) -> str:
    """What one client may hold of the gateway, for its start-up lines."""
    parser = "httptools" if "HttpTools" in protocol.__name__ else "h11"
    return (
        f"head {limits.max_head_size} bytes in {limits.head_timeout:g} s, "
        f"body idle {limits.body_timeout:g} s, {limits.max_connections} connections "
        f"per worker ({parser})"
    )


def _admin_access(loopback: bool) -> str:
    from retrysafe._ops.admin import ENV_TOKEN

    token = bool(os.environ.get(ENV_TOKEN))
    if token and loopback:
        return f"loopback connections, or the admin token from ${ENV_TOKEN}"
    if token:
        return f"needs the admin token from ${ENV_TOKEN}"
    if loopback:
        return f"open to loopback connections (--admin-loopback), no ${ENV_TOKEN}"
    return f"closed: set ${ENV_TOKEN}, or --admin-loopback"


@contextlib.contextmanager
def _shared_metrics() -> Iterator[None]:
    """A fresh PROMETHEUS_MULTIPROC_DIR for the workers, unless one is set; removed after."""
    from retrysafe._core.metrics import multiprocess_dir

    if multiprocess_dir():
        yield
        return
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="retrysafe-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    try:
        yield
    finally:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        shutil.rmtree(folder, ignore_errors=True)


# -- the store -------------------------------------------------------------------------


@app.command()
def migrate(store: StoreOpt = None) -> int:
    """Create or upgrade the store's SQL schema."""
    s = _open(store)
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
    s = _open(store)
    try:
        record = s.get(key_hash(scope, operation, key))
    finally:
        s.close()
    if record is None:
        raise CliError(
            f"no record for key {key!r} with operation {operation!r} and scope {scope!r}", 1
        )
    if as_json:
        _print_json(record_json(record))
        return 0
    table = Table(show_header=False, box=None, pad_edge=False)
    for name, value in record_json(record).items():
        if name == "answer" and value is not None:
            value = f"{value['status'] or ''} {value['media_type']}, {value['bytes']} bytes".strip()
        _row(table, name.replace("_", " "), "-" if value in (None, {}) else str(value))
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
    operation: Annotated[str | None, typer.Option(help="Only this operation.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many records.")] = 50,
    as_json: JsonOpt = False,
) -> int:
    """List records, oldest first."""
    age = _duration(older_than, "--older-than")
    now = time.time()
    s = _open(store)
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
        _print_json([record_json(r) for r in records])
        return 0
    if not records:
        out.print("no records")
        return 0
    table = Table("key", "operation", "scope", "status", "age", "attempts", "expires in")
    for r in records:
        status_text = r.status.value + (" (final)" if r.final else "")
        if r.expires_at <= now:
            status_text += " (expired)"
        _row(
            table,
            r.key,
            r.operation,
            (r.scope[:12] + "…") if len(r.scope) > 13 else r.scope,
            status_text,
            _age(now - r.created_at),
            str(r.attempts),
            "-" if r.expires_at <= now else _age(r.expires_at - now),
        )
    out.print(table)
    return 0


@app.command()
def stats(
    store: StoreOpt = None,
    as_json: JsonOpt = False,
    watch: Annotated[
        bool, typer.Option("--watch", help="Live figures (the dashboard's), until Ctrl-C.")
    ] = False,
    url: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help="With --watch: a dashboard to read, e.g. "
            "http://127.0.0.1:8000/_retrysafe/ (default: the store, and every "
            "worker's counters if $PROMETHEUS_MULTIPROC_DIR is set).",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            metavar="TOKEN", help="With --url: the admin token (default $RETRYSAFE_ADMIN_TOKEN)."
        ),
    ] = None,
    interval: Annotated[
        float, typer.Option(min=0.1, help="With --watch: seconds between refreshes.")
    ] = 1.0,
    count: Annotated[int | None, typer.Option(hidden=True, min=1)] = None,
) -> int:
    """Counts by status and operation, and the oldest processing record (--watch: live)."""
    if watch:
        return _watch_stats(store, url, token, interval, as_json, count)
    if url is not None:
        raise CliError("--url goes with --watch")
    now = time.time()
    s = _open(store)
    try:
        st = s.stats(now)
    finally:
        s.close()
    oldest = st.oldest_processing
    data = {
        "by_status": st.by_status(),
        "by_operation": dict(sorted(st.by_operation().items())),
        "live": sum(st.counts.values()),
        "expired_awaiting_sweep": st.expired,
        "archived": st.archived,
        "oldest_processing": None
        if oldest is None
        else {
            "key": oldest.key,
            "operation": oldest.operation,
            "age_seconds": round(now - oldest.created_at, 3),
            "lease_expired": oldest.lease_until <= now,
        },
    }
    if as_json:
        _print_json(data)
        return 0
    table = Table("operation", *(x.value for x in Status), "total")
    per_op: dict[str, dict[str, int]] = {}
    for (op, state), n in st.counts.items():
        per_op.setdefault(op, {})[state] = n
    for op in sorted(per_op):
        row = per_op[op]
        _row(
            table,
            op or "(none)",
            *(str(row.get(x.value, 0)) for x in Status),
            str(sum(row.values())),
        )
    totals = data["by_status"]
    table.add_row(
        "all", *(str(totals.get(x.value, 0)) for x in Status), str(data["live"]), style="bold"
    )
    out.print(table)
    out.print(f"expired, awaiting the sweeper: {st.expired}")
    if st.archived is not None:
        out.print(f"archived financial records: {st.archived}")
    if oldest is None:
        out.print("oldest processing record: none")
    else:
        late = " (lease expired: a crashed attempt)" if oldest.lease_until <= now else ""
        out.print(
            f"oldest processing record: {oldest.key!r} ({oldest.operation!r}), "
            f"{_age(now - oldest.created_at)} old{late}"
        )
    return 0


def _watch_stats(
    store: str | None,
    url: str | None,
    token: str | None,
    interval: float,
    as_json: bool,
    count: int | None,
) -> int:
    from retrysafe._ops import watch as _watch

    if url is not None:
        from retrysafe._ops.admin import ENV_TOKEN

        source = _watch.http_source(url, token or os.environ.get(ENV_TOKEN))
    else:
        from retrysafe._ops.monitor import Monitor

        monitor = Monitor(_open(store), interval=interval, store_every=interval)

        def source() -> dict[str, Any]:
            monitor.watched()
            monitor.sample()
            return monitor.snapshot(points=2)

    try:
        return _watch.watch(source, out, interval=interval, as_json=as_json, count=count)
    except KeyboardInterrupt:
        return 0


# -- sweeping ----------------------------------------------------------------------------


class _Progress:
    """Progress of a long sweep: a live line on a terminal, a log line every 2 s otherwise."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = err.is_terminal
        self.last = time.monotonic()
        self.status: Any = None

    def __call__(self, report: Any) -> None:
        if self.quiet:
            return
        text = (
            f"swept {report.deleted} records ({report.archived} archived), "
            f"{report.rate:,.0f}/s, {report.batches} batches"
        )
        if self.tty:
            if self.status is None:
                self.status = err.status(text)
                self.status.start()
            else:
                self.status.update(text)
        elif time.monotonic() - self.last >= 2.0:
            self.last = time.monotonic()
            print(f"retrysafe sweep: {text}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def _report_json(report: Any) -> dict[str, Any]:
    data = dataclasses.asdict(report)
    data["seconds"] = round(data["seconds"], 3)
    data["rate"] = round(report.rate, 1)
    return data


@app.command()
def sweep(
    store: StoreOpt = None,
    every: Annotated[
        str | None,
        typer.Option(metavar="DURATION", help="Sweep now and then on this schedule, e.g. 1h."),
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Records deleted per batch.")] = 1000,
    pause: Annotated[float, typer.Option(min=0.0, help="Seconds to rest between batches.")] = 0.0,
    as_json: JsonOpt = False,
) -> int:
    """Delete expired records in bounded batches, archiving financial ones first."""
    from retrysafe._ops.sweep import Sweeper

    interval = _duration(every, "--every")
    s = _open(store)
    sweeper = Sweeper(s, batch_size=batch_size, pause=pause)
    progress = _Progress(quiet=as_json)

    def done(report: Any) -> None:
        progress.stop()
        if as_json:
            print(json.dumps(_report_json(report)), flush=True)
        else:
            print(
                f"retrysafe sweep: deleted {report.deleted} expired records "
                f"({report.archived} archived) in {report.seconds:.2f}s, "
                f"{report.batches} batches",
                flush=True,
            )

    try:
        if interval is None:
            done(sweeper.run(progress=progress))
            return 0
        stop = threading.Event()
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())

        def failed(exc: Exception) -> None:
            progress.stop()
            print(f"retrysafe sweep: error: {exc} (next try in {every})", file=sys.stderr)

        try:
            print(f"retrysafe sweep: every {every}, Ctrl-C to stop", flush=True)
            sweeper.run_every(
                interval, stop=stop, on_sweep=done, on_error=failed, progress=progress
            )
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
        print("retrysafe sweep: stopped", flush=True)
        return 0
    finally:
        progress.stop()
        s.close()


@archive_app.command("list")
def archive_list(
    store: StoreOpt = None,
    operation: Annotated[str | None, typer.Option(help="Only this operation.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many records.")] = 50,
    as_json: JsonOpt = False,
) -> int:
    """List archived financial records, most recently archived first."""
    s = _open(store)
    try:
        archived = s.archived_records(operation=operation, limit=limit)
    finally:
        s.close()
    if as_json:
        _print_json(
            [dict(record_json(a.record), archived_at=iso_time(a.archived_at)) for a in archived]
        )
        return 0
    if not archived:
        out.print("the archive is empty")
        return 0
    table = Table("archived", "key", "operation", "status", "created", "answer")
    for a in archived:
        r, o = a.record, a.record.outcome
        _row(
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


# -- the client outbox ----------------------------------------------------------------------


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
        _print_json([_item_json(i) for i in items])
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
        _row(
            table,
            str(i.seq),
            f"{i.method} {i.url}",
            str(len(i.body)),
            _age(now - i.created_at),
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
        _print_json(
            {
                "delivered": [i.key for i in result.delivered],
                "failed": [_item_json(i) for i in result.failed],
                "remaining": result.remaining,
                "error": result.error,
            }
        )
    else:
        print(
            f"{_count(len(result.delivered), 'mutation')} delivered, {len(result.failed)} "
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
        value = os.environ.get(var.strip())
        if value is None:
            raise CliError(f"--header-env {text!r}: the environment has no {var.strip()}")
        headers[name.strip()] = value
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


# -- the map -------------------------------------------------------------------------------


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
            _print_json(
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
        _print_json({"ok": True, "operations": len(imap.operations), "routes": len(imap.routes)})
    else:
        print(
            f"{file}: ok, {_count(len(imap.operations), 'operation')}, "
            f"{_count(len(imap.routes), 'route')}"
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
        _print_json(imap.to_dict())
    else:
        sys.stdout.write(imap.to_toml())
    return 0


# -- the entry point -------------------------------------------------------------------------


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
