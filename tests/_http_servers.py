"""Real HTTP servers for the front-door tests, on free loopback ports.

ASGI apps run on uvicorn and WSGI apps on werkzeug's threaded server, each in
a thread of the test process; ``Process`` runs a command (uvicorn, gunicorn,
the gateway) as a separate process group and waits until it answers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

TESTS = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_up(
    url: str, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Poll ``url`` until it answers at all (any status)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"server exited with {proc.returncode}:\n{out[-3000:]}")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class ThreadServer:
    """Serve an ASGI (uvicorn) or WSGI (werkzeug, threaded) app from a thread."""

    def __init__(self, app: Any, kind: str) -> None:
        self.app, self.kind = app, kind
        self.port = 0
        self._server: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadServer:
        if self.kind == "asgi":
            from retrysafe._ops.serve import ServerThread, bind

            self._server = ServerThread(self.app, bind("127.0.0.1", 0), log_level="error")
            self._server.start()
            self.port = self._server.sock.getsockname()[1]
        else:
            from werkzeug.serving import make_server

            self._server = make_server("127.0.0.1", 0, self.app, threaded=True)
            self.port = self._server.port
            self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.kind == "asgi":
            self._server.stop()
        else:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(20)


class Process:
    """A server command in its own process group; stopped (and reaped) on exit."""

    def __init__(
        self, argv: list[str], port: int, env: dict[str, str] | None = None, health: str = "/"
    ) -> None:
        self.argv, self.port, self.health = argv, port, health
        self.env = {
            **os.environ,
            "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        self.env.update(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Process:
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_until_up(self.url + self.health, proc=self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        if proc.stdout:
            proc.stdout.close()


def uvicorn_argv(factory: str, port: int, workers: int = 1) -> list[str]:
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        factory,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--log-level",
        "warning",
    ]


def gunicorn_argv(app: str, port: int, workers: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gunicorn",
        app,
        "--bind",
        f"127.0.0.1:{port}",
        "--workers",
        str(workers),
        "--threads",
        "8",
        "--log-level",
        "warning",
    ]
