"""``retrysafe stats --watch``: the dashboard's live figures in a terminal.

The figures come from a running dashboard (``--url``: its ``api/stats``), or
from this process's own :class:`~retrysafe._ops.monitor.Monitor` over the store,
which also reads every worker's counters when ``PROMETHEUS_MULTIPROC_DIR``
points at their folder. On a terminal the view is redrawn in place; otherwise a
line (or a JSON document with ``--json``) is printed at each refresh.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from retrysafe._core.metrics import COUNTERS
from retrysafe._model.hashing import printable

__all__ = ["Source", "line", "render", "watch"]

Source = Callable[[], dict[str, Any]]
#: The outcomes shown (a workflow's steps are not requests of their own).
_OUTCOMES = tuple(o for o in COUNTERS if not o.startswith("step_"))


def http_source(url: str, token: str | None, timeout: float = 5.0) -> Source:
    """Figures from a dashboard at ``url`` (e.g. ``http://host:8000/_retrysafe/``). A URL
    with no path at all (``http://host:8000``) means the gateway's ``/_retrysafe/``, so
    the token never goes to the app behind it; ``http://host:8000/`` is a dashboard
    mounted at the root."""
    import urllib.parse

    import httpx

    path = urllib.parse.urlsplit(url).path or "/_retrysafe/"
    target = str(httpx.URL(url).copy_with(path=path.rstrip("/") + "/api/stats", query=b"points=2"))
    headers = {"authorization": f"Bearer {token}"} if token else {}

    def fetch() -> dict[str, Any]:
        r = httpx.get(target, headers=headers, timeout=timeout)
        if r.status_code != 200:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text[:200]
            raise RuntimeError(f"{target}: HTTP {r.status_code}: {detail}")
        try:
            doc = r.json()
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or not {"totals", "duplicate_rate", "latency"} <= set(doc):
            raise RuntimeError(f"{target} is not a retrysafe dashboard's api/stats")
        return doc

    return fetch


_NONE = "-"


def _pct(x: float | None) -> str:
    return _NONE if x is None else f"{100 * x:.1f} %"


def _secs(x: float | None) -> str:
    if x is None:
        return _NONE
    return f"{x * 1e6:.0f} µs" if x < 0.001 else f"{x * 1000:.1f} ms" if x < 1 else f"{x:.1f} s"


def _last(series: dict[str, list[Any]], name: str) -> float:
    values = series.get(name) or []
    return float(values[-1] or 0) if values else 0.0


def render(doc: dict[str, Any]) -> Group:
    """The live view of one snapshot."""
    rate = doc["duplicate_rate"]
    store = doc.get("store")
    head = Text()
    head.append("retrysafe  ", style="bold")
    if store is None:
        head.append("no store")
    else:
        head.append(f"store {store['url']}  ")
        head.append(
            "up" if store["up"] else f"DOWN: {store['error']}",
            style="green" if store["up"] else "bold red",
        )
    head.append(f"   {time.strftime('%H:%M:%S', time.localtime(doc['now']))}", style="dim")
    dup = Text.assemble(
        ("duplicate rate ", "bold"),
        (_pct(rate["window"]), "bold cyan"),
        f" over {rate['window_seconds']:g} s, {_pct(rate['lifetime'])} lifetime",
    )
    outcomes = Table("outcome", "total", "per second", box=None, pad_edge=False)
    series = doc.get("series", {})
    for name in _OUTCOMES:
        per_s = f"{_last(series, name):.1f}" if name in series else ""
        outcomes.add_row(name.replace("_", " "), f"{doc['totals'][name]:,.0f}", per_s)
    alerts = sum(doc.get("alerts", {}).values())
    outcomes.add_row("alerts", f"{alerts:,.0f}", "")
    parts: list[Any] = [head, dup, outcomes]
    claim = doc["latency"]["store"]["claim"]
    handler = doc["latency"]["handler"]
    times = (
        f"store claim p50 {_secs(claim['p50'])} p99 {_secs(claim['p99'])}   "
        f"handler p50 {_secs(handler['p50'])} p99 {_secs(handler['p99'])}"
    )
    parts.append(Text(times))
    if store is not None and store["up"]:
        st = store["by_status"]
        parts.append(
            Text(
                f"records: {st.get('processing', 0):,} processing, {st.get('completed', 0):,} "
                f"completed, {st.get('failed', 0):,} failed, {store['expired']:,} expired; "
                f"oldest processing {_secs(store['oldest_processing_age'])}"
            )
        )
    flight = doc.get("in_flight", [])
    stuck = sum(1 for r in flight if r.get("stuck"))
    parts.append(
        Text(f"in flight: {len(flight)}" + (f" ({stuck} past their lease)" if stuck else ""))
    )
    recent = doc.get("recent", [])[:5]
    if recent:
        table = Table("when", "what", "detail", box=None, pad_edge=False)
        for e in recent:
            what = printable(f"{e['kind']} {e['operation']}")
            when = time.strftime("%H:%M:%S", time.localtime(e["at"]))
            table.add_row(when, what, printable(e["detail"]))
        parts.append(table)
    return Group(*parts)


def line(doc: dict[str, Any]) -> str:
    """One line of figures, for logs."""
    t = doc["totals"]
    rate = doc["duplicate_rate"]
    store = doc.get("store")
    health = "no store" if store is None else ("store up" if store["up"] else "store DOWN")
    return (
        f"duplicate rate {_pct(rate['window'])} ({_pct(rate['lifetime'])} lifetime); "
        f"executed {t['executed']:,.0f}, replayed {t['replayed']:,.0f}, in flight "
        f"{t['in_flight']:,.0f}, conflicts {t['conflict']:,.0f}, failed {t['failed']:,.0f}; "
        f"{len(doc.get('in_flight', []))} running; {health}"
    )


def watch(
    source: Source, out: Console, *, interval: float, as_json: bool, count: int | None = None
) -> int:
    """Show ``source``'s figures every ``interval`` seconds until Ctrl-C (or ``count``
    times: then 1 if the last reading failed)."""
    from rich.live import Live

    shown, failed = 0, False

    def take() -> tuple[dict[str, Any] | None, str | None]:
        try:
            return source(), None
        except Exception as exc:  # unreachable, refused: shown, and retried at the next tick
            return None, f"{type(exc).__name__}: {exc}"

    if out.is_terminal and not as_json:
        with Live(Text("waiting for figures…"), console=out, auto_refresh=False) as live:
            while count is None or shown < count:
                doc, error = take()
                failed = doc is None
                view = render(doc) if doc else Text(f"cannot read: {error}", style="bold red")
                live.update(view, refresh=True)
                shown += 1
                if count is None or shown < count:
                    time.sleep(interval)
        return int(failed)
    while count is None or shown < count:
        doc, error = take()
        failed = doc is None
        if as_json:
            print(json.dumps(doc if doc else {"error": error}), flush=True)
        else:
            print(line(doc) if doc else f"cannot read the figures: {error}", flush=True)
        shown += 1
        if count is None or shown < count:
            time.sleep(interval)
    return int(failed)
