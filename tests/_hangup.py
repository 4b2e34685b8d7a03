"""Clients that leave mid-answer, and waiting for what the server records after they left."""

from __future__ import annotations

import socket
import time
from typing import Any

from retrysafe import Status, Store, key_hash


def hang_up(port: int, target: str, headers: dict[str, str], after: int = 12_000) -> bytes:
    """POST ``target`` on loopback, read the first ``after`` bytes of the answer, hang up."""
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    request = f"POST {target} HTTP/1.1\r\nHost: t\r\n{lines}Content-Length: 0\r\n\r\n"
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request.encode("latin-1"))
        while len(got) < after:
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk
    return got


def status_of(store: Store[Any], key: str, scope: str = "") -> Status | None:
    """The status of the record of ``key`` (operation ``http``), or None."""
    record = store.get(key_hash(scope, "http", key))
    return None if record is None else record.status


def wait_for(store: Store[Any], key: str, status: Status, timeout: float = 10.0) -> None:
    """Poll the store until the record of ``key`` has ``status``."""
    deadline = time.monotonic() + timeout
    while status_of(store, key) is not status:
        if time.monotonic() > deadline:
            raise AssertionError(f"the record of {key!r} never became {status}")
        time.sleep(0.005)
