"""The operations commands: list, stats, sweep, archive list, map check/show, inspect --json.

In-process through ``main()`` for the output, and as real processes for the
exit codes, the one-line errors, the schedule and its Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from retrysafe import Claim, Engine, Outcome, open_store
from retrysafe._cli.app import main

ENV = {**os.environ, "RETRYSAFE_STORE": ""}
HOUR = 3600.0


def run(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "retrysafe", *args],
        cwd=cwd,
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


def output(capsys: Any, *argv: str, status: int = 0) -> str:
    assert main(list(argv)) == status
    return str(capsys.readouterr().out)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return populate(f"sqlite:///{tmp_path}/ops.db")


def populate(url: str) -> str:
    """``url``'s store, with, as of now: 3 live completed payments, 1 live processing
    order (claimed 10 minutes ago), 4 expired standard and 2 expired financial records."""
    store = open_store(url)
    now = time.time()

    def make(engine: Engine, key: str, operation: str, complete: bool) -> None:
        claim = engine.begin(key, operation=operation, fingerprint="fp")
        assert isinstance(claim, Claim)
        if complete:
            engine.complete(claim, Outcome.json({"ok": key}, status=201))

    live = Engine(store, ttl=24 * HOUR)
    for i in range(3):
        make(live, f"pay-{i}", "payment", True)
    old = Engine(store, ttl=24 * HOUR, lease=3600, clock=lambda: now - 600)
    make(old, "order-1", "order", False)
    past = Engine(store, ttl=HOUR, clock=lambda: now - 2 * HOUR)
    money = Engine(store, ttl=HOUR, retention="financial", clock=lambda: now - 2 * HOUR)
    for i in range(4):
        make(past, f"gone-{i}", "session", True)
    for i in range(2):
        make(money, f"paid-{i}", "payment", True)
    store.close()
    return url


def test_list_filters_and_json(url: str, capsys: Any) -> None:
    rows = json.loads(output(capsys, "list", "--store", url, "--json", "--limit", "100"))
    assert len(rows) == 10
    processing = json.loads(
        output(capsys, "list", "--store", url, "--status", "processing", "--json")
    )
    assert [r["key"] for r in processing] == ["order-1"]
    old = json.loads(output(capsys, "list", "--store", url, "--older-than", "5m", "--json"))
    assert {r["key"] for r in old} == {"order-1"} | {f"gone-{i}" for i in range(4)} | {
        "paid-0",
        "paid-1",
    }
    payments = json.loads(
        output(capsys, "list", "--store", url, "--operation", "payment", "--json")
    )
    assert {r["operation"] for r in payments} == {"payment"} and len(payments) == 5
    table = output(capsys, "list", "--store", url, "--status", "processing")
    assert "order-1" in table and "processing" in table


def test_stats(url: str, capsys: Any) -> None:
    data = json.loads(output(capsys, "stats", "--store", url, "--json"))
    assert data["live"] == 4 and data["expired_awaiting_sweep"] == 6
    assert data["by_status"] == {"processing": 1, "completed": 3, "failed": 0}
    assert data["by_operation"] == {"order": 1, "payment": 3}
    oldest = data["oldest_processing"]
    assert oldest["key"] == "order-1" and 590 <= oldest["age_seconds"] <= 700
    text = output(capsys, "stats", "--store", url)
    assert "order-1" in text and "awaiting the sweeper: 6" in text


def test_sweep_then_archive_list(url: str, capsys: Any) -> None:
    report = json.loads(output(capsys, "sweep", "--store", url, "--json", "--batch-size", "4"))
    assert (report["deleted"], report["archived"]) == (6, 2) and report["batches"] >= 2
    assert json.loads(output(capsys, "stats", "--store", url, "--json"))["archived"] == 2
    archived = json.loads(output(capsys, "archive", "list", "--store", url, "--json"))
    assert sorted(a["key"] for a in archived) == ["paid-0", "paid-1"]
    assert all(a["retention"] == "financial" and a["archived_at"] for a in archived)
    assert "paid-0" in output(capsys, "archive", "list", "--store", url)
    again = json.loads(output(capsys, "sweep", "--store", url, "--json"))
    assert again["deleted"] == 0


def test_inspect_json(url: str, capsys: Any) -> None:
    doc = json.loads(
        output(capsys, "inspect", "pay-1", "--operation", "payment", "--store", url, "--json")
    )
    assert doc["status"] == "completed" and doc["answer"]["status"] == 201
    assert main(["inspect", "pay-1", "--store", url]) == 1  # the operation is part of the key


def test_store_from_the_environment(url: str, tmp_path: Path) -> None:
    result = run("stats", "--json", cwd=tmp_path, env={**ENV, "RETRYSAFE_STORE": url})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["live"] == 4


def test_sweep_every_runs_on_schedule_and_stops_on_sigterm(url: str, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "sweep", "--store", url, "--every", "200ms", "--json"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert "every 200ms" in proc.stdout.readline()
    reports = [json.loads(proc.stdout.readline()) for _ in range(3)]
    assert reports[0]["deleted"] == 6 and reports[1]["deleted"] == reports[2]["deleted"] == 0
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stopped" in out and "Traceback" not in err


MAP = """\
[operations.payment]
key = "payment:{order_id}:{amount}"
scope = "order"
ttl = "7d"
retention = "financial"

[[routes]]
method = "POST"
path = "/payments"
operation = "payment"
"""


def test_map_check_and_show(tmp_path: Path, capsys: Any) -> None:
    good = tmp_path / "good.toml"
    good.write_text(MAP)
    assert "ok, 1 operation, 1 route" in output(capsys, "map", "check", str(good))
    shown = output(capsys, "map", "show", str(good))
    assert 'key = "payment:{order_id}:{amount}"' in shown
    default = output(capsys, "map", "show")
    assert "[operations.cart_mandate]" in default and "[operations.payment]" in default
    assert json.loads(output(capsys, "map", "show", "--json"))["operations"]["payment"]

    bad = tmp_path / "bad.toml"
    bad.write_text(MAP.replace('ttl = "7d"', 'ttl = "seven days"'))
    result = run("map", "check", str(bad), cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert line.startswith("retrysafe map check: error:")
    assert f"{bad}:4:" in line and "operations.payment.ttl" in line
    doc = json.loads(run("map", "check", str(bad), "--json", cwd=tmp_path).stdout)
    assert doc == {**doc, "ok": False, "line": 4, "field": "operations.payment.ttl"}


def test_errors_are_one_line(tmp_path: Path, url: str) -> None:
    for args in (
        ("list", "--store", url, "--older-than", "soon"),
        ("list", "--store", url, "--status", "sleeping"),
        ("list", "--store", url, "--limit", "0"),
        ("stats", "--store", "bogus://x"),
        ("sweep", "--store", url, "--every", "0s"),
        ("sweep", "--store", url, "--batch-size", "0"),
        ("sweep", "--store", f"sqlite:///{tmp_path}/nodir/x.db"),
        ("archive", "list", "--store", "postgresql://u:s3cret@127.0.0.1:1/db"),
        ("stats", "--store", "mysql://u:s3cret@127.0.0.1:1/db"),
        (
            "stats",
            "--store",
            "redis://127.0.0.1:1/0?archive="
            + quote("postgresql://u:s3cret@127.0.0.1:1/db", safe=""),
        ),
        ("map", "check", str(tmp_path / "missing.toml")),
        ("map", "show", str(tmp_path / "missing.toml")),
        ("gateway", "--upstream", "http://127.0.0.1:1", "--map", str(tmp_path / "none.toml")),
        ("nonsense",),
    ):
        result = run(*args, cwd=tmp_path)
        assert result.returncode in (1, 2), (args, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr and "s3cret" not in result.stderr
        assert result.stderr.startswith("retrysafe") and "error:" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)


#: Client keys that Rich would read as markup or emoji codes, and an operation with an
#: ANSI colour sequence, a bell and a right-to-left override.
MARKUP_KEYS = ["a[/]b", "order:ok:1", "[bold]k1", "[link=http://evil]k2[/link]", ":smile:"]
CONTROL_OP = "op\x1b[31mred\x07\u202e"
ESCAPED_OP = "op\\x1b[31mred\\x07\\u202e"


def test_keys_and_operations_print_literally(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/keys.db"
    engine = Engine(url)
    for key in MARKUP_KEYS:
        claim = engine.begin(key, operation=CONTROL_OP, fingerprint="fp")
        assert isinstance(claim, Claim)
        if key != "[bold]k1":  # left processing: the oldest in `stats`
            engine.complete(claim, Outcome.json({"k": key}, status=201))
    engine.close()
    wide = {**ENV, "COLUMNS": "250"}
    printed = {
        "list": run("list", "--store", url, cwd=tmp_path, env=wide),
        "stats": run("stats", "--store", url, cwd=tmp_path, env=wide),
        **{
            f"inspect {key}": run(
                "inspect", key, "--operation", CONTROL_OP, "--store", url, cwd=tmp_path, env=wide
            )
            for key in MARKUP_KEYS
        },
    }
    for command, result in printed.items():
        assert result.returncode == 0, (command, result.stderr)
        assert "Traceback" not in result.stderr and not result.stderr, (command, result.stderr)
        for raw in ("\x1b", "\x07", "\u202e", "\U0001f604", "\U0001f197"):
            assert raw not in result.stdout, (command, raw, result.stdout)
    for key in MARKUP_KEYS:
        assert key in printed["list"].stdout, printed["list"].stdout
        assert key in printed[f"inspect {key}"].stdout
        assert ESCAPED_OP in printed[f"inspect {key}"].stdout
    assert ESCAPED_OP in printed["list"].stdout and ESCAPED_OP in printed["stats"].stdout
    assert "oldest processing record: '[bold]k1'" in printed["stats"].stdout
