"""The command line: the demo, the gateway, migrate, inspect, and errors without tracebacks."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _hangup import CALLER
from _upstream import UpstreamProcess

from retrysafe import Engine, Outcome
from retrysafe._cli.app import main

ENV = {**os.environ, "RETRYSAFE_STORE": ""}


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "retrysafe", *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


class Serving:
    """A ``retrysafe`` command that serves until Ctrl-C; its output tells where."""

    def __init__(self, *args: str, cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "retrysafe", *args],
            cwd=cwd,
            env=ENV,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.lines: list[str] = []

    def read_until(self, marker: str) -> str:
        """Lines of stdout up to the first one containing ``marker`` (returned)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if marker in line:
                return line
        raise AssertionError(f"no {marker!r} in {self.lines}: {self.proc.communicate()}")

    def ready(self, url: str) -> None:
        """Poll the health page until it answers."""
        for _ in range(1000):
            try:
                if httpx.get(url + "/_retrysafe/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, self.proc.communicate()
        raise AssertionError(f"{url} never became healthy")

    def interrupt(self, signum: int = signal.SIGINT) -> tuple[str, str]:
        """Ctrl-C (or ``signum``): the command stops cleanly, status 0, no traceback."""
        self.proc.send_signal(signum)
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, (out, err)
        assert "Traceback" not in err and "Error" not in err, err
        return "".join(self.lines) + out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def serving() -> Iterator[list[Serving]]:
    started: list[Serving] = []
    yield started
    for s in started:
        s.kill()


def curl_like(command: str) -> tuple[int, dict[str, str], str]:
    """Run a printed ``curl -i`` command (with httpx if curl is missing): status, headers, body."""
    if shutil.which("curl"):
        out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=30)
        head, _, body = out.stdout.replace("\r\n", "\n").partition("\n\n")
        status_line, *lines = head.splitlines()
        headers = dict(line.lower().split(": ", 1) for line in lines)
        return int(status_line.split()[1]), headers, body
    args = shlex.split(command)
    url, body = args[2], args[args.index("-d") + 1]
    sent = dict(args[i + 1].split(": ", 1) for i, a in enumerate(args) if a == "-H")
    r = httpx.post(url, content=body, headers=sent)
    return r.status_code, dict(r.headers), r.text


def test_demo_check_reports_exactly_once(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run(
        "demo",
        "--check",
        "--orders",
        "10",
        "--retries",
        "4",
        "--listen",
        "127.0.0.1:0",
        cwd=tmp_path,
    )
    intervals = (time.monotonic() - started) / 10  # alert summaries: one per 10 s at most
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "exactly once" in out and "orders created       10" in out
    assert "answers that differ  0" in out and "conflicts (422)      2" in out
    assert "Traceback" not in result.stderr
    assert "retrysafe: retrysafe" not in result.stderr  # one prefix per log line
    bursts = [line for line in result.stderr.splitlines() if "alert burst" in line]
    assert len(bursts) <= 2 + intervals, bursts  # the first, then a summary per interval
    assert (tmp_path / "retrysafe-demo.db").exists()  # the embedded store by default


def test_demo_curl_example_replays_and_ctrl_c_stops(tmp_path: Path, serving: list[Serving]) -> None:
    demo = Serving("demo", "--listen", "127.0.0.1:0", cwd=tmp_path)
    serving.append(demo)
    gateway = demo.read_until("  gateway ").split()[1]
    curl = demo.read_until("curl -i ").strip()
    demo.read_until("Ctrl-C")
    demo.ready(gateway)
    first, second = (curl_like(curl) for _ in range(2))
    assert first[0] == second[0] == 201
    assert "idempotent-replayed" not in first[1]
    assert second[1]["idempotent-replayed"] == "true"
    assert first[2] == second[2]  # the same order, answered twice
    stats = httpx.get(gateway + "/stats").json()
    assert stats["orders_created"] == stats["cart_mandates_created"] == 1
    assert stats["gateway_charges"] == 0
    # The demo opts in to loopback access: its dashboard answers without a token.
    assert httpx.get(gateway + "/_retrysafe/api/stats").status_code == 200
    assert "retrysafe dashboard" in httpx.get(gateway + "/_retrysafe/").text
    out, _ = demo.interrupt()
    assert "replayed: the API did not run" in out and "retrysafe demo: stopped" in out


@pytest.mark.parametrize(
    ("workers", "signum"), [(1, signal.SIGINT), (2, signal.SIGINT), (1, signal.SIGTERM)]
)
def test_gateway_serves_and_stops_on_ctrl_c(
    tmp_path: Path, serving: list[Serving], workers: int, signum: int
) -> None:
    with UpstreamProcess() as origin:
        origin.start()
        gw = Serving(
            "gateway",
            "--upstream",
            origin.url,
            "--listen",
            "127.0.0.1:0",
            "--store",
            f"sqlite:///{tmp_path}/gw.db",
            "--workers",
            str(workers),
            cwd=tmp_path,
        )
        serving.append(gw)
        url = gw.read_until("listening on").split()[-1]
        gw.read_until("store")
        callers = gw.read_until("callers")
        gw.ready(url)
        key = {"Idempotency-Key": "cli-1", **CALLER}
        answers = [httpx.post(url + "/orders", json={}, headers=key) for _ in range(4)]
        assert [r.status_code for r in answers] == [201] * 4
        assert [r.headers.get("idempotent-replayed") for r in answers] == [None] + ["true"] * 3
        assert httpx.get(url + "/count").json() == {"orders": 1}
        out, _ = gw.interrupt(signum)
    assert f"upstream  {origin.url}" in out and f"sqlite:///{tmp_path}/gw.db" in out
    assert "callers   by their credentials: headers Authorization, " in callers
    assert "retrysafe gateway: stopped" in out


@pytest.mark.parametrize("sweep", ["--sweep-every=3600", "--no-sweep"])
def test_gateway_workers_sweep_the_store_unless_told_not_to(
    tmp_path: Path, serving: list[Serving], sweep: str
) -> None:
    """Two workers (configured by the environment) sweep expired records at start-up."""
    from retrysafe import Engine, Outcome, open_store

    url = f"sqlite:///{tmp_path}/gw.db"
    store = open_store(url)
    old = Engine(store, clock=lambda: time.time() - 2 * 86400)  # expired a day ago
    for i in range(20):
        old.complete(old.begin(f"old-{i}"), Outcome(b"x"))  # type: ignore[arg-type]
    with UpstreamProcess() as origin:
        origin.start()
        gw = Serving(
            "gateway",
            "--upstream",
            origin.url,
            "--listen",
            "127.0.0.1:0",
            "--store",
            url,
            "--workers",
            "2",
            sweep,
            cwd=tmp_path,
        )
        serving.append(gw)
        address = gw.read_until("listening on").split()[-1]
        swept = gw.read_until("sweeper")
        gw.ready(address)
        if sweep == "--no-sweep":
            assert "off (--no-sweep)" in swept
            httpx.post(address + "/orders", json={}, headers={"Idempotency-Key": "k", **CALLER})
            assert len(store.records(limit=100)) == 21  # the old ones are still there
        else:
            assert "every 3600 s" in swept
            for _ in range(3000):  # polls the store, up to 30 s on a busy machine
                if not store.records(limit=100):
                    break
                time.sleep(0.01)
            assert store.records(limit=100) == []
        gw.interrupt()
    store.close()


def test_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = f"127.0.0.1:{busy.getsockname()[1]}"
    up = ("gateway", "--upstream", "http://127.0.0.1:1", "--store", "memory://")
    with busy:
        for args in (
            ("demo", "--store", "bogus://x"),
            ("demo", "--listen", taken),
            ("demo", "--check", "--orders", "0"),
            ("inspect", "k", "--store", f"sqlite:///{tmp_path}/nodir/x.db"),
            ("migrate", "--store", "postgresql://u@127.0.0.1:1/db"),
            ("gateway", "--upstream", "ftp://example.com"),
            ("gateway", "--upstream", "http://"),
            ("gateway", "--upstream", "http://h?q=1"),
            ("gateway", "--upstream", "http://127.0.0.1:1", "--store", "bogus://x"),
            (
                "gateway",
                "--upstream",
                "http://127.0.0.1:1",
                "--store",
                f"sqlite:///{tmp_path}/nodir/x.db",
            ),
            (*up, "--listen", taken),
            (*up, "--listen", "nonsense"),
            (*up, "--listen", "127.0.0.1:99999"),
            (*up, "--workers", "0"),
            (*up, "--timeout", "0"),
            (*up, "--max-head-size", "0"),
            (*up, "--head-timeout", "0"),
            (*up, "--body-timeout", "-1"),
            (*up, "--max-connections", "0"),
            (*up, "--http", "spdy"),
            (*up, "--sweep-every", "0"),
        ):
            result = run(*args, cwd=tmp_path)
            assert result.returncode == 2, (args, result.stdout, result.stderr)
            assert "Traceback" not in result.stderr
            assert result.stderr.startswith("retrysafe ") and "error:" in result.stderr
            assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "in use" in run(*up, "--listen", taken, cwd=tmp_path).stderr


def test_passwords_never_printed(tmp_path: Path) -> None:
    for args in (
        ("migrate", "--store", "postgresql://u:s3cret@127.0.0.1:1/db"),
        ("migrate", "--store", "redis://:s3cret@127.0.0.1:1/0"),
        ("demo", "--store", "bogus://u:s3cret@x"),
        ("gateway", "--upstream", "http://u:s3cret@127.0.0.1:1"),
        ("gateway", "--upstream", "http://127.0.0.1:1", "--store", "bogus://u:s3cret@x"),
    ):
        result = run(*args, cwd=tmp_path)
        assert "s3cret" not in result.stdout + result.stderr, args


def test_migrate_and_inspect(tmp_path: Path, capsys: object) -> None:
    url = f"sqlite:///{tmp_path}/x.db"
    assert main(["migrate", "--store", url]) == 0
    engine = Engine(url)
    claim = engine.begin("order:1", operation="order", scope="alice")
    engine.complete(claim, Outcome.json({"id": 1}, status=201))
    assert (
        main(["inspect", "order:1", "--operation", "order", "--scope", "alice", "--store", url])
        == 0
    )
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "completed" in out and "201 application/json" in out
    assert main(["inspect", "order:1", "--store", url]) == 1  # scope is part of the key
