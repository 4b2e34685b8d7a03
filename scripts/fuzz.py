"""A long fuzzing run of the hostile-input properties of tests/test_hostile.py.

::

    .venv/bin/python scripts/fuzz.py                      # 20000 inputs per target
    .venv/bin/python scripts/fuzz.py --examples 2000 --only webhook

Each target is one Hypothesis property (the key header parser, the fingerprint
canonicaliser, the ASGI, WSGI, Mesh, A2A and webhook front doors...), run with
``--examples`` as its budget (``RETRYSAFE_FUZZ_EXAMPLES``, default 20000). It
prints how many inputs each target ran and how long it took, and exits 1 if
any property failed (Hypothesis prints the smallest failing input, and keeps it
in ``.hypothesis/`` so the next run of the test file tries it first).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _counting(target: Callable[..., None]) -> list[int]:
    """Count the inputs ``target`` runs (every call of its inner test)."""
    calls = [0]
    inner = target.hypothesis.inner_test  # type: ignore[attr-defined]

    def counted(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        inner(*args, **kwargs)

    target.hypothesis.inner_test = counted  # type: ignore[attr-defined]
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--examples",
        type=int,
        default=int(os.environ.get("RETRYSAFE_FUZZ_EXAMPLES") or 20_000),
        help="inputs per target (default $RETRYSAFE_FUZZ_EXAMPLES or 20000)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="run only the targets whose name holds this text (repeatable)",
    )
    args = parser.parse_args(argv)
    # Every refusal is logged (a warning per bad webhook signature...): millions of lines.
    logging.disable(logging.CRITICAL)
    # The budget is read when the test module is imported.
    os.environ["RETRYSAFE_FUZZ_EXAMPLES"] = str(args.examples)
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "src")]
    hostile = importlib.import_module("test_hostile")

    targets = {
        name: test
        for name, test in hostile.TARGETS.items()
        if not args.only or any(part.lower() in name.lower() for part in args.only)
    }
    print(f"fuzzing {len(targets)} targets, up to {args.examples} inputs each", flush=True)
    failed: list[str] = []
    total_inputs, started_all = 0, time.perf_counter()
    for name, test in targets.items():
        calls = _counting(test)
        started = time.perf_counter()
        try:
            test()
        except BaseException as exc:  # a failure, or a Ctrl-C: report it and stop or go on
            failed.append(name)
            traceback.print_exception(exc)
            if isinstance(exc, KeyboardInterrupt):
                break
            verdict = "FAILED"
        else:
            verdict = "ok"
        seconds = time.perf_counter() - started
        total_inputs += calls[0]
        rate = calls[0] / seconds if seconds else 0.0
        print(
            f"{name:28} {verdict:6} {calls[0]:7d} inputs {seconds:8.1f} s ({rate:,.0f}/s)",
            flush=True,
        )
    elapsed = time.perf_counter() - started_all
    print(
        f"{'total':28} {'FAILED' if failed else 'ok':6} {total_inputs:7d} inputs {elapsed:8.1f} s",
        flush=True,
    )
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
