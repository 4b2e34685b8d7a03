"""What one client may hold of the gateway: the head's size and time, an idle body, connections.

A real upstream process, the gateway on uvicorn (in a thread of this process, so
that tracemalloc sees its allocations, and as ``retrysafe gateway --workers 2``),
and raw socket clients that send what no HTTP client would: a head of many
megabytes in pieces, half a head, three bytes of a hundred-byte body. Every test
runs on both of uvicorn's HTTP/1.1 parsers, httptools and h11.
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _hangup import CALLER, caller_scope
from _upstream import UpstreamProcess

from retrysafe import key_hash
from retrysafe._gateway.limits import ServerLimits, protocol_class
from retrysafe._ops.serve import ServerThread, bind
from retrysafe.gateway import (
    DEFAULT_MAX_HEAD_SIZE,
    ENV_BODY_TIMEOUT,
    ENV_HEAD_TIMEOUT,
    ENV_MAX_CONNECTIONS,
    ENV_MAX_HEAD_SIZE,
    ENV_UPSTREAM,
    Gateway,
    app_from_env,
    create_app,
)
from retrysafe.http import MAX_KEY_HEADER

MiB = 1 << 20
#: How long a test waits for an answer that should come: ten times any timeout
#: the tests configure (1 s), and far less than the 80 s and more a stalled
#: client was held before.
PATIENCE = 15.0


@pytest.fixture(scope="module")
def origin() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as up:
        yield up.start()


@pytest.fixture(params=["httptools", "h11"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Running:
    """A gateway on a free loopback port, served with the limited protocol."""

    def __init__(self, app: Gateway, server: ServerThread) -> None:
        self.app, self.url = app, server.url
        self.port = int(server.url.rsplit(":", 1)[1])

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=PATIENCE)
        return sock

    def health(self) -> int:
        return httpx.get(self.url + "/_retrysafe/health", timeout=PATIENCE).status_code

    def record(self, key: str) -> Any:
        return self.app.store.get(key_hash(caller_scope(self.app.store), "http", key))


@pytest.fixture
def gateway(
    tmp_path: Path, origin: UpstreamProcess, protocol: str
) -> Iterator[Callable[..., Running]]:
    """``gateway(**options)`` starts one in front of the origin; all stop after the test."""
    servers: list[ServerThread] = []

    def start(**options: Any) -> Running:
        options.setdefault("store", f"sqlite:///{tmp_path}/gateway-{len(servers)}.db")
        app = create_app(origin.url, **options)
        server = ServerThread(app, bind("127.0.0.1", 0), http=protocol_class(protocol))
        servers.append(server)
        server.start()
        running = Running(app, server)
        assert running.health() == 200
        return running

    yield start
    for server in servers:
        server.stop()


def orders(origin: UpstreamProcess) -> int:
    """How many POST /orders the upstream ran (asked of it directly)."""
    return int(httpx.get(origin.url + "/count").json()["orders"])


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one answer that ends the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    return int(status_line.split(" ", 2)[1]), headers, body


def problem_code(headers: dict[str, str], body: bytes) -> str:
    assert headers["content-type"] == "application/problem+json"
    assert headers["connection"] == "close"
    return str(json.loads(body)["code"])


def send_until_answered(sock: socket.socket, total: int, piece: bytes) -> int:
    """Send up to ``total`` bytes in ``piece``-sized writes, stopping as soon as an
    answer can be read; returns how many were sent."""
    sent = 0
    while sent < total:
        if select.select([sock], [], [], 0)[0]:
            break
        sock.sendall(piece)
        sent += len(piece)
    return sent


# -- the head's size ----------------------------------------------------------------------


def test_a_huge_header_gets_431_without_memory_or_the_upstream(
    gateway: Callable[..., Running], origin: UpstreamProcess
) -> None:
    """32 MiB of one header, written in 64 KiB pieces: 431 after the limit, not
    buffered (the gateway's allocations stay far below the header's size), never
    forwarded, while another connection keeps being served."""
    gw = gateway()
    before = orders(origin)
    piece = b"a" * 65536
    tracemalloc.start()
    try:
        with gw.connect() as sock:
            sock.sendall(b"POST /orders HTTP/1.1\r\nHost: gw.test\r\nContent-Length: 0\r\nX-Big: ")
            sock.sendall(piece[: DEFAULT_MAX_HEAD_SIZE // 2])  # half the limit: a head under way
            assert gw.health() == 200  # others are served while it is held
            send_until_answered(sock, 32 * MiB, piece)
            status, headers, body = read_answer(sock)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert status == 431 and problem_code(headers, body) == "request_header_too_large"
    assert peak < 8 * MiB, f"peak {peak / MiB:.1f} MiB: the gateway buffered the header"
    assert orders(origin) == before  # it never reached the upstream
    assert gw.health() == 200


def test_the_head_limit_is_exact(gateway: Callable[..., Running]) -> None:
    """A head of exactly ``max_head_size`` bytes is served; one byte more gets 431."""
    gw = gateway(max_head_size=4096)
    start = b"GET /echo HTTP/1.1\r\nHost: gw.test\r\nConnection: close\r\nX-Pad: "
    for extra, status in ((0, 200), (1, 431)):
        pad = b"p" * (4096 - len(start) - len(b"\r\n\r\n") + extra)
        with gw.connect() as sock:
            sock.sendall(start + pad + b"\r\n\r\n")
            got, headers, body = read_answer(sock)
        assert got == status, (extra, body[:200])
    assert problem_code(headers, body) == "request_header_too_large"


def test_pipelined_requests_are_counted_head_by_head(gateway: Callable[..., Running]) -> None:
    """Two requests in one write, 5 KB in all: the first's head, its body and the
    start of the second's head come in the first 4 KB read, and neither head is
    over the limit, so both are answered."""
    gw = gateway(max_head_size=4096)
    first = b"POST /echo HTTP/1.1\r\nHost: gw.test\r\nContent-Length: 3000\r\n\r\n" + b"b" * 3000
    second = b"GET /echo HTTP/1.1\r\nHost: gw.test\r\nConnection: close\r\nX-Pad: " + b"p" * 2000
    with gw.connect() as sock:
        sock.sendall(first + second + b"\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200 ") == 2, data[:300]


def test_a_kept_alive_connections_next_head_is_bounded_too(
    gateway: Callable[..., Running],
) -> None:
    """After one answer on a kept-alive connection, the next head, over the limit and
    sent in one write, gets 431 as on a new connection (httptools once let a head
    through whole when it began in a read of its own)."""
    gw = gateway(max_head_size=4096)
    with gw.connect() as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: gw.test\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), head
        length = int(re.search(rb"(?i)\r\ncontent-length: *([0-9]+)", head)[1])  # type: ignore[index]
        while len(body) < length:
            body += sock.recv(65536)
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: gw.test\r\nX-Pad: " + b"p" * 60000 + b"\r\n\r\n")
        status, headers, body = read_answer(sock)
    assert status == 431 and problem_code(headers, body) == "request_header_too_large"


def test_a_4MiB_key_header_is_refused_before_it_is_parsed(
    gateway: Callable[..., Running], origin: UpstreamProcess
) -> None:
    """A 4 MiB comma list of one key stops at the head limit (431); a list under the
    head limit but over the key header's bound gets 400 without being parsed;
    neither reaches the upstream nor writes a record."""
    gw = gateway()
    before = orders(origin)
    with gw.connect() as sock:
        sock.sendall(
            b"POST /orders HTTP/1.1\r\nHost: gw.test\r\nAuthorization: Bearer test-caller\r\n"
        )
        sock.sendall(b"Idempotency-Key: ")
        send_until_answered(sock, 4 * MiB, b"k," * 32768)
        status, headers, body = read_answer(sock)
    assert status == 431 and problem_code(headers, body) == "request_header_too_large"
    listed = "k," * MAX_KEY_HEADER + "k"  # one key, repeated: 4097 characters
    r = httpx.post(
        gw.url + "/orders", headers={"Idempotency-Key": listed, **CALLER}, timeout=PATIENCE
    )
    assert r.status_code == 400 and r.json()["code"] == "idempotency_key_invalid"
    assert f"the limit is {MAX_KEY_HEADER}" in r.json()["detail"]
    assert orders(origin) == before
    assert gw.record("k") is None


# -- the head's and the body's time -------------------------------------------------------


@pytest.mark.parametrize("sent", [b"", b"POST /orders HTTP/1.1\r\nHost: gw.te"])
def test_a_head_that_does_not_arrive_gets_408(gateway: Callable[..., Running], sent: bytes) -> None:
    """A connection that sends nothing, or half a head, is answered 408 and closed
    after ``head_timeout``, while others are served."""
    gw = gateway(head_timeout=1)
    with gw.connect() as sock:
        sock.sendall(sent)
        assert gw.health() == 200
        status, headers, body = read_answer(sock)
    assert status == 408 and problem_code(headers, body) == "request_header_timeout"


@pytest.mark.parametrize("keyed", [True, False])
def test_a_stalled_body_gets_408_and_a_keyed_retry_runs_once(
    gateway: Callable[..., Running], origin: UpstreamProcess, keyed: bool
) -> None:
    """3 of 100 body bytes, then nothing: 408 after ``body_timeout``. A keyed
    request did not run, and its retry runs it once and is then replayed."""
    gw = gateway(body_timeout=1)
    before = orders(origin)
    key = b"Idempotency-Key: stalled-1\r\n" if keyed else b""
    with gw.connect() as sock:
        sock.sendall(
            b"POST /orders HTTP/1.1\r\nHost: gw.test\r\nAuthorization: Bearer test-caller\r\n"
            + key
            + b"Content-Length: 100\r\n\r\nabc"
        )
        status, headers, body = read_answer(sock)
    assert status == 408 and problem_code(headers, body) == "request_body_timeout"
    if not keyed:  # streamed as it came: the upstream saw the client go, as on a hang-up
        return
    assert orders(origin) == before
    assert gw.record("stalled-1") is None  # nothing claimed, nothing to wait out
    headers_ = {"Idempotency-Key": "stalled-1", **CALLER}
    first = httpx.post(gw.url + "/orders", content=b"x" * 100, headers=headers_, timeout=PATIENCE)
    again = httpx.post(gw.url + "/orders", content=b"x" * 100, headers=headers_, timeout=PATIENCE)
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true" and again.text == first.text
    assert orders(origin) == before + 1


# -- connections --------------------------------------------------------------------------


def test_a_connection_over_the_limit_gets_503_and_the_others_keep_working(
    gateway: Callable[..., Running],
) -> None:
    gw = gateway(max_connections=3)
    held = [gw.connect() for _ in range(3)]
    try:
        for sock in held:  # each is served, so each is counted
            sock.sendall(b"GET /_retrysafe/health HTTP/1.1\r\nHost: gw.test\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        with gw.connect() as extra:
            status, headers, body = read_answer(extra)
        assert status == 503 and problem_code(headers, body) == "too_many_connections"
        assert headers["retry-after"] == "1"
        held[0].sendall(b"GET /_retrysafe/health HTTP/1.1\r\nHost: gw.test\r\n\r\n")
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200 ")  # the held ones still work
    finally:
        for sock in held:
            sock.close()
    for _ in range(1000):  # a slot is free once the server has seen a close
        with gw.connect() as sock:
            sock.sendall(
                b"GET /_retrysafe/health HTTP/1.1\r\nHost: gw.test\r\nConnection: close\r\n\r\n"
            )
            if read_answer(sock)[0] == 200:
                return
    raise AssertionError("no connection was served after the held ones closed")


# -- configuration ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option, value",
    [
        ("max_head_size", 0),
        ("max_head_size", 1.5),
        ("head_timeout", 0),
        ("body_timeout", -1),
        ("body_timeout", float("inf")),
        ("max_connections", 0),
        ("max_connections", True),
    ],
)
def test_bad_limits_are_refused(option: str, value: Any, origin: UpstreamProcess) -> None:
    with pytest.raises(ValueError, match=option):
        create_app(origin.url, store="memory://", **{option: value})


def test_limits_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, origin: UpstreamProcess
) -> None:
    monkeypatch.setenv(ENV_UPSTREAM, origin.url)
    monkeypatch.setenv("RETRYSAFE_STORE", "memory://")
    assert app_from_env().server_limits == ServerLimits()  # type: ignore[attr-defined]
    values = {
        ENV_MAX_HEAD_SIZE: "8192",
        ENV_HEAD_TIMEOUT: "2.5",
        ENV_BODY_TIMEOUT: "7",
        ENV_MAX_CONNECTIONS: "40",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    assert app_from_env().server_limits == ServerLimits(8192, 2.5, 7.0, 40)  # type: ignore[attr-defined]
    monkeypatch.setenv(ENV_MAX_HEAD_SIZE, "lots")
    with pytest.raises(ValueError, match=ENV_MAX_HEAD_SIZE):
        app_from_env()


# -- the command line, with two workers ---------------------------------------------------


def test_the_limits_hold_on_gateway_workers(
    tmp_path: Path, origin: UpstreamProcess, protocol: str
) -> None:
    """``retrysafe gateway --workers 2`` gives its workers the limits and the parser."""
    argv = [
        sys.executable,
        "-m",
        "retrysafe",
        "gateway",
        "--upstream",
        origin.url,
        "--store",
        f"sqlite:///{tmp_path}/gw.db",
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "2",
        "--max-head-size",
        "4096",
        "--head-timeout",
        "1",
        "--http",
        protocol,
    ]
    env = {**os.environ, "RETRYSAFE_STORE": ""}
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "  limits " in line:
                break
        url = lines[0].split()[-1]
        assert "head 4096 bytes in 1 s" in lines[-1] and protocol in lines[-1], lines
        for _ in range(1000):
            try:
                if httpx.get(url + "/_retrysafe/health", timeout=PATIENCE).status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None, proc.communicate()
        port = int(url.rsplit(":", 1)[1])
        for _ in range(4):  # connections are spread over the workers: each must refuse
            with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) as sock:
                sock.sendall(b"GET /echo HTTP/1.1\r\nHost: gw.test\r\nX-Big: " + b"b" * 8192)
                status, headers, body = read_answer(sock)
            assert status == 431 and problem_code(headers, body) == "request_header_too_large"
            with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) as sock:
                sock.sendall(b"GET /echo HTTP/1.1\r\nHo")
                status, headers, body = read_answer(sock)
            assert status == 408 and problem_code(headers, body) == "request_header_timeout"
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
