"""bench/metrics.py's report: the tables, and the Markdown that ``--write`` splices into
docs/performance.md.

Loaded by path by bench/metrics.py (see its docstring); not a script of its own.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

# bench/metrics.py loads this module by path, as it loads bench/stores.py and bench/http.py
# (the bench folder stays off sys.path: see there); they are in sys.modules by then.
bs = sys.modules["_rsbench_stores"]
bh = sys.modules["_rsbench_http"]
mp = sys.modules["_rsbench_metrics_pairs"]
mc = sys.modules["_rsbench_metrics_calls"]
mn = sys.modules["_rsbench_metrics_count"]
TARGET = 0.95


def instructions_table(counts: dict[tuple[str, str], tuple[float, float]]) -> list[str]:
    lines = [
        "| variant | workload | instructions/req off | on | added | off / on | target >= 0.95 |",
        "|---|---|--:|--:|--:|--:|---|",
    ]
    for (section, workload), (off, on) in counts.items():
        lines.append(
            f"| {section} / memory | {workload} | {off:,.0f} | {on:,.0f} | {on - off:+,.0f} | "
            f"{off / on:.3f} | {verdict(off / on)} |"
        )
    return lines


# -- report -------------------------------------------------------------------------------------


def verdict(ratio: float) -> str:
    return "meets" if ratio >= TARGET else "**misses**"


def server_table(pairs: Sequence[mp.Pair]) -> list[str]:
    lines = [
        "| variant | workload | server thread CPU us/req off | on | added "
        "| off / on (rounds min-max) | target >= 0.95 |",
        "|---|---|--:|--:|--:|--:|---|",
    ]
    for p in pairs:
        off, on, added, ratio = p.server_figures()
        rs = [b / a for a, b in zip(p.server_us["on"], p.server_us["off"], strict=True)]
        lines.append(
            f"| {p.section} / {p.store} | {p.workload} | {off:.1f} | {on:.1f} | "
            f"{added:+.1f} | {ratio:.3f} ({min(rs):.2f}-{max(rs):.2f}) | "
            f"{verdict(ratio)} |"
        )
    return lines


def results_table(pairs: Sequence[mp.Pair], unit: str) -> list[str]:
    lines = [
        f"| variant | workload | {unit}/s off | {unit}/s on | on / off (rounds min-max) "
        f"| CPU us/{unit} off | on | added | CPU ratio | target >= 0.95 |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for p in pairs:
        rs = p.ratios
        lines.append(
            f"| {p.section} / {p.store} | {p.workload} | {p.off.median:,.0f} | "
            f"{p.on.median:,.0f} | {p.ratio:.3f} ({min(rs):.2f}-{max(rs):.2f}) | "
            f"{p.off.cpu:.1f} | {p.on.cpu:.1f} | {p.added_cpu:+.1f} | {p.cpu_ratio:.3f} | "
            f"{verdict(p.ratio)} |"
        )
    return lines


def costs_table(costs: mc.Costs, unit: str = "ns per call") -> list[str]:
    """One row per call of :data:`CALLS` and the scrape; a column per mode."""
    modes = list(costs)
    lines = [
        "| call | " + " | ".join(f"{unit}, {mode}" for mode in modes) + " | how often |",
        "|---|" + "--:|" * len(modes) + "---|",
    ]
    rows = [(what, note) for what, _, _, note in mc.CALLS]
    rows.append((mc.SCRAPE, f"per scrape, {mc.SCRAPE_OPS} operations"))
    for what, note in rows:
        cells = [f"{costs[mode][what]:,.0f}" if what in costs[mode] else "-" for mode in modes]
        if any(c != "-" for c in cells):
            lines.append(f"| {what} | " + " | ".join(cells) + f" | {note} |")
    return lines


def added_ns(costs: dict[str, Any]) -> tuple[float, float]:
    """What metrics add to a first request and to a replay (ns), by the call costs."""
    on, off = (
        [costs[f"`METRICS.{call}(...)`, {state}"] for call in ("claimed", "settled", "replayed")]
        for state in ("on", "off")
    )
    return on[0] + on[1] - off[0] - off[1], on[2] - off[2]


def _wrap(text: str) -> str:
    return textwrap.fill(text, 88, break_long_words=False, break_on_hyphens=False)


def library_info() -> str:
    names = [
        "prometheus-client",
        "opentelemetry-api",
        "opentelemetry-sdk",
        "uvicorn",
        "uvloop",
        "httptools",
        "httpx",
    ]
    return bs.library_info(names)


def otel_state() -> str:
    try:
        from opentelemetry import trace
    except ImportError:
        return "opentelemetry-api not installed: `_Otel.event` returns at once"
    provider = type(trace.get_tracer_provider()).__name__
    state = f"opentelemetry-api installed, tracer provider `{provider}`"
    if provider in ("ProxyTracerProvider", "NoOpTracerProvider"):
        state += (
            " (none configured: `trace.get_current_span()` returns a non-recording span, "
            "so `_Otel.event` adds no event)"
        )
    return state


def render(
    sections: dict[str, list[mp.Pair]],
    costs: mc.Costs,
    counts: dict[tuple[str, str], tuple[float, float]],
    args: Any,
    command: str,
    info: dict[str, str],
    elapsed: float,
    per_call: mc.Costs | None = None,
) -> str:
    first_added, replay_added = added_ns(costs[mc.SINGLE])
    out = [
        "### The last run",
        "",
        _wrap(
            f"Generated by `bench/metrics.py --write` on {datetime.now(UTC):%Y-%m-%d %H:%M} "
            "UTC; do not edit by hand. One process, one thread driving the requests; every "
            "variant is measured with `METRICS.enabled` on and off, interleaved (on, off, "
            f"the next variant's on, off, ...) in {args.rounds} rounds of {args.seconds:g} s "
            "each, the whole order flipping every round, after a warm-up. *on / off* is the "
            "median over the rounds of the rate with metrics on divided by the rate with "
            "them off in the same round; rates and CPU are medians over the rounds; *added* "
            "is the median of the per-round difference in this process's CPU time per "
            "request (on - off), and the *CPU ratio* (off's CPU per request over on's) is "
            "the rate ratio of a process that is CPU-bound, which other load on the machine "
            "moves far less than the wall-clock rate. Before the rounds, every variant was "
            "checked to count each request once with metrics on and none with them off."
        ),
        "",
        "```",
        command,
        "```",
        "",
        f"The run took {elapsed:.0f} s.",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
    ]
    if "asgi" in sections:
        out += [
            "#### The middleware, in process (no socket)",
            "",
            _wrap(
                "`IdempotencyMiddleware(endpoint, store=URL, operation=...)` around "
                "bench/http.py's endpoint (a pure ASGI app that reads the body and answers "
                f"201 with a {len(bh.ANSWER_BYTES)}-byte JSON body), called directly on one "
                f"{mp.loop_name()} event loop with a {len(mp.BODY)}-byte JSON body and an "
                "`Idempotency-Key`: a new key per request (*first*), one completed key "
                "(*replay*), or the two alternating (*mix*). The SQLite store is "
                "`sqlite:///<temp dir>/m.db` with its default options (WAL, "
                "`synchronous=FULL`; its async calls run in a thread, which counts in CPU)."
            ),
            "",
            *results_table(sections["asgi"], "req"),
            "",
        ]
    if "engine" in sections:
        out += [
            "#### The engine alone (memory store)",
            "",
            _wrap(
                "bench/stores.py's engine contenders: `engine.begin(new_key, operation=..., "
                "fingerprint=...)` + `engine.complete(claim, prebuilt outcome)` (*first*), "
                "and `engine.begin` of one completed key (*replay*), sync API, one thread."
            ),
            "",
            *results_table(sections["engine"], "op"),
            "",
        ]
    if "server" in sections:
        out += [
            "#### Through a real server (uvicorn in a thread of this process)",
            "",
            _wrap(
                "The same middleware and endpoint served by `retrysafe._ops.serve.ServerThread` "
                "(uvicorn, one thread of this process with its own event loop, default "
                "settings: httptools and uvloop when installed, no access log), and an "
                "`httpx.Client` (keep-alive, one connection) posting from the main thread, "
                "one request after another, over loopback. Client and server share this "
                "process, so its CPU per request is both sides' (the client's part does not "
                "change with metrics)."
            ),
            "",
            *results_table(sections["server"], "req"),
            "",
            _wrap(
                "The server's own CPU per request: the CPU clock of uvicorn's thread "
                "(`time.pthread_getcpuclockid`) over each measurement, divided by the "
                "requests sent in it. *off / on* here (the median of the per-round ratios) "
                "is the rate ratio of a saturated server, which the rates above, with one "
                "client waiting for each answer and its own CPU in the same process, do not "
                "show."
            ),
            "",
            *server_table(sections["server"]),
            "",
        ]
    if counts:
        out += [
            "#### Instructions per request (valgrind)",
            "",
            _wrap(
                "The in-process variants on the memory store, each in a child process under "
                "valgrind's callgrind: after a warm-up of "
                f"{mn.COUNT_WARMUP} requests with metrics off and as many on, "
                f"{args.instructions} requests with metrics off and {args.instructions} on, "
                "each batch the only code callgrind counts (start-up, warm-up and one-time "
                "costs left out) and started after `gc.collect()` + `gc.freeze()` (so that "
                "a full collection in one batch does not walk the whole heap); "
                "instructions per request. The count is the same on every "
                "run, whatever the machine's load; *off / on* is the rate ratio a CPU-bound "
                "process would reach (an instruction is not a fixed time, but metrics add "
                "plain Python work like the rest)."
            ),
            "",
            *instructions_table(counts),
            "",
        ]
    out += [
        "#### What each metrics call costs",
        "",
        _wrap(
            "`timeit` of each call the engine makes to `METRICS`: the least of 7 runs of "
            "100,000 calls, minus an empty loop, on the process's real `METRICS` (with "
            f"{mc.SCRAPE_OPS} operations counted already, from this thread and an ended one; "
            "a scrape: 200 calls). A first request makes "
            "`claimed` + `settled`, a replay `replayed`; with metrics off each is a method "
            "call that returns at once. By these figures metrics add "
            f"{first_added / 1000:.2f} us to a first request and {replay_added / 1000:.2f} us "
            f"to a replay. *{mc.MULTI}*: the same in a child process with "
            "`PROMETHEUS_MULTIPROC_DIR` set to an empty temp dir (what `retrysafe gateway "
            "--workers N` does), where every value lives in a memory-mapped file; there "
            + (
                "metrics add {:.2f} us to a first request and {:.2f} us to a replay.".format(
                    *(ns / 1000 for ns in added_ns(costs[mc.MULTI]))
                )
                if mc.MULTI in costs
                else "(not measured)."
            )
        ),
        "",
        *costs_table(costs),
        "",
        *(f"- the values timed, {mode}: `{c[mc.CHILDREN]}`" for mode, c in costs.items()),
        f"- {otel_state()}",
        "",
    ]
    if per_call:
        out += [
            "#### Instructions per metrics call (valgrind)",
            "",
            _wrap(
                "The same calls counted by callgrind in a child process (in each mode): "
                f"after a warm-up of {mn.CALL_WARMUP} calls, {args.call_instructions} calls of "
                "each inside one `functools.reduce` call, the only code counted, minus an "
                f"empty loop's instructions; a scrape, {max(1, args.call_instructions // 100)} "
                "times, whole. The same on every run, whatever the machine's load."
            ),
            "",
            *costs_table(per_call, "instructions"),
            "",
        ]
    return "\n".join(out)
