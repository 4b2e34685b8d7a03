"""Serving ASGI apps on uvicorn: a socket bound up front, servers in threads.

Binding the socket before uvicorn starts turns "port in use" into a plain
``OSError`` (uvicorn would log it and exit), makes port 0 (any free port) work,
and leaves no window in which another process could take the port.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any, Self

import uvicorn

__all__ = [
    "ServerThread",
    "bind",
    "parse_listen",
    "server_config",
    "sigterm_as_interrupt",
    "url_of",
]

#: What every retrysafe server sets: the gateway passes the upstream's ``Date``
#: and ``Server`` through and builds ``X-Forwarded-*`` itself.
SERVER_OPTIONS: dict[str, Any] = {
    "proxy_headers": False,
    "server_header": False,
    "date_header": False,
    "timeout_graceful_shutdown": 5,
}


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8000`` for IPv6) as (host, port); ValueError if malformed."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--listen {text!r} is not HOST:PORT (for example 127.0.0.1:8000)")
    return host, int(port)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); OSError saying which address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        raise OSError(f"cannot listen on {where}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def server_config(app: Any, **options: Any) -> uvicorn.Config:
    """A uvicorn config with :data:`SERVER_OPTIONS`; ``options`` override them."""
    return uvicorn.Config(app, **{**SERVER_OPTIONS, **options})


class ServerThread:
    """A uvicorn server on ``sock`` in a thread of its own (its own event loop).

    Quiet by default: no access log, and uvicorn's messages go through the
    ``logging`` configuration the process already has. ``with`` starts and stops it.
    """

    def __init__(self, app: Any, sock: socket.socket, **options: Any) -> None:
        options = {"log_config": None, "log_level": "warning", "access_log": False, **options}
        self.sock = sock
        self.url = url_of(sock)
        self.server = uvicorn.Server(server_config(app, **options))
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [sock]},
            name=f"uvicorn {self.url}",
            daemon=True,
        )

    def start(self, timeout: float = 30.0) -> Self:
        """Start serving; return once the server accepts requests."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.005)
        return self

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        """Stop accepting, finish open requests (5 s at most), close the socket."""
        self.server.should_exit = True
        if self.thread.ident is not None:
            self.thread.join()
        self.sock.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM stops the process as cleanly as Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
