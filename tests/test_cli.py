"""The command line: the demo's report, migrate, inspect, and errors without tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from retrysafe import Engine, Outcome
from retrysafe._cli import main


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RETRYSAFE_STORE": ""}
    return subprocess.run(
        [sys.executable, "-m", "retrysafe", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_demo_reports_exactly_once(tmp_path: Path) -> None:
    result = run("demo", "--payments", "20", "--retries", "4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "exactly once" in out and "charges executed    20" in out
    assert "charged twice       0" in out
    assert (tmp_path / "retrysafe-demo.db").exists()  # the embedded store by default


def test_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    for args in (
        ("demo", "--store", "bogus://x"),
        ("inspect", "k", "--store", f"sqlite:///{tmp_path}/nodir/x.db"),
        ("migrate", "--store", "postgresql://u@127.0.0.1:1/db"),
    ):
        result = run(*args, cwd=tmp_path)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr
        assert result.stderr.startswith("retrysafe ") and "error:" in result.stderr


def test_passwords_never_printed(tmp_path: Path) -> None:
    for args in (
        ("migrate", "--store", "postgresql://u:s3cret@127.0.0.1:1/db"),
        ("migrate", "--store", "redis://:s3cret@127.0.0.1:1/0"),
        ("demo", "--store", "bogus://u:s3cret@x"),
    ):
        result = run(*args, cwd=tmp_path)
        assert "s3cret" not in result.stdout + result.stderr, args


def test_migrate_and_inspect(tmp_path: Path, capsys: object) -> None:
    url = f"sqlite:///{tmp_path}/x.db"
    assert main(["migrate", "--store", url]) == 0
    engine = Engine(url)
    claim = engine.begin("order:1", operation="order", scope="alice")
    engine.complete(claim, Outcome.json({"id": 1}, status=201))
    assert main(["inspect", "order:1", "--operation", "order", "--scope", "alice",
                 "--store", url]) == 0  # fmt: skip
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "completed" in out and "201 application/json" in out
    assert main(["inspect", "order:1", "--store", url]) == 1  # scope is part of the key
