"""The operating commands: ``stats`` (``--watch``: live) and ``sweep``."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from typing import Annotated, Any

import typer
from rich.table import Table

from retrysafe._cli.common import (
    CliError,
    JsonOpt,
    StoreOpt,
    add_row,
    app,
    duration_option,
    err,
    format_age,
    open_store_for,
    out,
    print_json,
)
from retrysafe._model.record import Status
from retrysafe._ops.summary import stats_summary

__all__ = ["stats", "sweep"]


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
    s = open_store_for(store)
    try:
        st = s.stats(now)
    finally:
        s.close()
    oldest = st.oldest_processing
    data = stats_summary(st, now)
    if as_json:
        print_json(data)
        return 0
    table = Table("operation", *(x.value for x in Status), "total")
    per_op: dict[str, dict[str, int]] = {}
    for (op, state), n in st.counts.items():
        per_op.setdefault(op, {})[state] = n
    for op in sorted(per_op):
        row = per_op[op]
        add_row(
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
            f"{format_age(now - oldest.created_at)} old{late}"
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

        monitor = Monitor(open_store_for(store), interval=interval, store_every=interval)

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

    interval = duration_option(every, "--every")
    s = open_store_for(store)
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
