"""Clients that leave mid-answer, and waiting for what the server records after they left.

Also who the front-door tests are: a keyed request without credentials runs
without a record, so the tests' requests carry :data:`CALLER`, and their
records are found under :func:`caller_scope`.
"""

from __future__ import annotations

import http.cookiejar
import socket
import time
from typing import Any

from retrysafe import Status, Store, key_hash
from retrysafe._core.principal import Principals
from retrysafe._core.secret import secret_of

#: The credentials the front-door tests send (a keyed request without any runs unrecorded).
CALLER = {"authorization": "Bearer test-caller"}


def cookieless() -> http.cookiejar.CookieJar:
    """A cookie jar that keeps nothing, for test clients that retry as API clients do.

    The test API's answers set a ``session`` cookie; a client that sent it back
    would be another caller (its credentials changed), and would run again.
    """
    return http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))


def caller_scope(store: Store[Any], headers: dict[str, str] = CALLER) -> str:
    """The record scope of a request carrying ``headers`` (credentials only) on ``store``."""
    who = Principals().credentials(list(headers.items()), "")
    assert who is not None
    return who.scope(secret_of(store))


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


def status_of(store: Store[Any], key: str, scope: str | None = None) -> Status | None:
    """The status of the record of ``key`` (operation ``http``, the scope of
    :data:`CALLER` unless given), or None."""
    record = store.get(key_hash(caller_scope(store) if scope is None else scope, "http", key))
    return None if record is None else record.status


def wait_for(store: Store[Any], key: str, status: Status, timeout: float = 10.0) -> None:
    """Poll the store until the record of ``key`` has ``status``."""
    deadline = time.monotonic() + timeout
    while status_of(store, key) is not status:
        if time.monotonic() > deadline:
            raise AssertionError(f"the record of {key!r} never became {status}")
        time.sleep(0.005)
