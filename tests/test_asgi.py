"""The pure ASGI middleware on a bare ASGI app (no framework), on a real uvicorn."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _http_servers import ThreadServer

from retrysafe.asgi import IdempotencyMiddleware


class LateEnd:
    """Sends a complete Content-Length body, then holds the final message back."""

    def __init__(self) -> None:
        self.runs = 0
        self.release = threading.Event()
        self.lifespan: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                self.lifespan.append(message["type"])
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        await receive()
        self.runs += 1
        body = b'{"run":%d}' % self.runs
        await send({
            "type": "http.response.start", "status": 201,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", b"%d" % len(body))],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 10)
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def late() -> Iterator[tuple[LateEnd, str]]:
    app = LateEnd()
    with ThreadServer(IdempotencyMiddleware(app, store="memory://"), "asgi") as server:
        yield app, server.url
        app.release.set()
    assert app.lifespan == ["lifespan.startup", "lifespan.shutdown"]  # passed through


def test_an_answer_is_recorded_when_its_content_length_is_reached(
    late: tuple[LateEnd, str],
) -> None:
    """The client has the whole answer before the app's last message: a retry replays."""
    app, url = late
    headers = {"idempotency-key": uuid.uuid4().hex}
    first = httpx.post(url, json={}, headers=headers, timeout=10)
    assert first.status_code == 201 and first.json() == {"run": 1}
    again = httpx.post(url, json={}, headers=headers, timeout=10)
    assert again.status_code == 201, again.text
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert app.runs == 1


def test_requests_without_a_key_are_untouched(late: tuple[LateEnd, str]) -> None:
    app, url = late
    app.release.set()
    assert httpx.post(url, json={}).json() == {"run": 1}
    assert httpx.post(url, json={}).json() == {"run": 2}
