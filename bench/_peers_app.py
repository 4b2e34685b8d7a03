"""bench/peers.py's app, the middlewares it compares, and how it drives an ASGI app in
process; bench/http.py's fik-redis variants (``fik_redis``).

Loaded by path by bench/peers.py (see its docstring); not a script of its own.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

HOST = "127.0.0.1"
PATH = "/orders"
HEALTH = "/health"
REQUEST_BODY = b'{"order_id":"o-1","amount":1999,"currency":"eur"}'
FIRST, REPLAY = "first call", "replay"
SUBJECT = "retrysafe"
#: Requests per contender when counting Redis round trips.
COUNT_CALLS = 200


class BenchError(RuntimeError):
    """A contender did not do the work it is measured for."""


# -- the app: one POST endpoint -------------------------------------------------------------


class Endpoint:
    """A Starlette app with one POST endpoint that answers 201 and a small JSON body naming
    the key. It counts its executions in process (``calls``) and, given a Redis client,
    per key in a Redis hash (``HINCRBY``), so that several processes can be counted."""

    def __init__(self, work: float = 0.0, redis: Any = None, counts: str = "") -> None:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, PlainTextResponse, Response
        from starlette.routing import Route

        self.calls = 0

        async def create(request: Request) -> Response:
            order = await request.json()
            key = request.headers.get("idempotency-key", "")
            if work:
                await asyncio.sleep(work)
            self.calls += 1
            if redis is not None:
                await redis.hincrby(counts, key, 1)
            answer = {"id": "ch_123", "order_id": order["order_id"], "key": key}
            return JSONResponse(answer, status_code=201)

        async def health(request: Request) -> Response:
            return PlainTextResponse("ok")

        self.app = Starlette(routes=[Route(PATH, create, methods=["POST"]), Route(HEALTH, health)])


# -- the middlewares ------------------------------------------------------------------------

Closer = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class Middleware:
    name: str
    dist: str
    replay_header: bytes  # lowercase, as ASGI headers are
    detail: str
    wrap: Callable[[Any, str, str], tuple[Any, Closer]]  # (app, redis url, key prefix)


def _wrap_retrysafe(app: Any, url: str, ns: str) -> tuple[Any, Closer]:
    from retrysafe import Engine, open_store
    from retrysafe.asgi import IdempotencyMiddleware

    engine = Engine(open_store(url, prefix=f"{ns}rs:"))
    return IdempotencyMiddleware(app, store=engine), engine.aclose


def _wrap_header(app: Any, url: str, ns: str) -> tuple[Any, Closer]:
    import redis.asyncio
    from idempotency_header_middleware import IdempotencyHeaderMiddleware
    from idempotency_header_middleware.backends.redis import RedisBackend

    client = redis.asyncio.Redis.from_url(url)
    backend = RedisBackend(client, keys_key=f"{ns}hdr:keys", response_key=f"{ns}hdr:resp:")
    return IdempotencyHeaderMiddleware(app, backend=backend), client.aclose


def _wrap_fik(app: Any, url: str, ns: str) -> tuple[Any, Closer]:
    from fastapi_idempotency_key import IdempotencyMiddleware, RedisBackend

    backend = RedisBackend(redis_url=url, prefix=f"{ns}fik:")
    return IdempotencyMiddleware(app, backend=backend), backend.close


def fik_redis(app: Any, url: str, keep_fingerprint: bool = False) -> Any:
    """fastapi-idempotency-key's middleware on its Redis backend, default options; with
    ``keep_fingerprint``, its completion writes the claim's fingerprint (0.1.1 writes
    ``""``, so that every replay is refused as another request, 422)."""
    from fastapi_idempotency_key import IdempotencyMiddleware, RedisBackend

    kind = _fik_kept(RedisBackend) if keep_fingerprint else RedisBackend
    return IdempotencyMiddleware(app, backend=kind(redis_url=url))


def _fik_kept(base: Any) -> Any:
    """fik's RedisBackend whose completion keeps the claim's fingerprint."""
    from fastapi_idempotency_key import IdempotencyRecord, IdempotencyStatus

    class KeptFingerprint(base):  # type: ignore[misc,valid-type]
        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            self.claimed: dict[str, str] = {}  # key -> fingerprint, while in flight

        async def _try_lock_once(self, key: str, fingerprint: str, ttl: int) -> Any:
            acquired, record = await super()._try_lock_once(key, fingerprint, ttl)
            if acquired:
                self.claimed[key] = fingerprint
            return acquired, record

        async def release_lock(self, key: str) -> None:
            self.claimed.pop(key, None)
            await super().release_lock(key)

        async def store_response(
            self, key: str, status_code: int, headers: Any, body: bytes, ttl: int
        ) -> None:
            # 0.1.1's store_response, with the claim's fingerprint for its ""
            now = time.time()
            record = IdempotencyRecord(
                key=key,
                fingerprint=self.claimed.pop(key, ""),
                status=IdempotencyStatus.COMPLETED,
                status_code=status_code,
                headers=list(headers),
                body=body,
                created_at=now,
                expires_at=now + ttl if ttl > 0 else 0.0,
            )
            payload = json.dumps(record.to_dict())
            await self.redis.eval(self.LUA_STORE_RESPONSE, 1, self._get_key(key), payload, ttl)

    return KeptFingerprint


MIDDLEWARES = {
    m.name: m
    for m in (
        Middleware(
            SUBJECT,
            "retrysafe",
            b"idempotent-replayed",
            "`retrysafe.asgi.IdempotencyMiddleware(app, store=Engine(open_store(url)))`, "
            "default options",
            _wrap_retrysafe,
        ),
        Middleware(
            "asgi-idempotency-header",
            "asgi-idempotency-header",
            b"idempotent-replayed",
            "`IdempotencyHeaderMiddleware(app, backend=RedisBackend(redis.asyncio.Redis"
            ".from_url(url)))`, default options",
            _wrap_header,
        ),
        Middleware(
            "fastapi-idempotency-key",
            "fastapi-idempotency-key",
            b"idempotency-replayed",
            "`fastapi_idempotency_key.IdempotencyMiddleware(app, backend=RedisBackend("
            "redis_url=url))`, default options",
            _wrap_fik,
        ),
    )
}
PEERS = [name for name in MIDDLEWARES if name != SUBJECT]


# -- driving an ASGI app in process ---------------------------------------------------------


async def post(app: Any, key: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """One POST through the raw ASGI interface: (status, headers, body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": PATH,
        "raw_path": PATH.encode(),
        "root_path": "",
        "query_string": b"",
        "client": (HOST, 50000),
        "server": (HOST, 80),
        "headers": [
            (b"host", b"bench"),
            (b"content-type", b"application/json"),
            (b"authorization", b"Bearer rsbench"),
            (b"content-length", str(len(REQUEST_BODY)).encode()),
            (b"idempotency-key", key.encode()),
        ],
    }
    done = asyncio.Event()
    started = False
    status = 0
    headers: list[tuple[bytes, bytes]] = []
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal started
        if not started:
            started = True
            return {"type": "http.request", "body": REQUEST_BODY, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status, headers = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await app(scope, receive, send)
    return status, headers, b"".join(chunks)


def classify(status: int, headers: Sequence[tuple[bytes, bytes]], replay_header: bytes) -> str:
    """What an answer was: ran, replay, or the status code."""
    if status == 201:
        replayed = any(k.lower() == replay_header and v == b"true" for k, v in headers)
        return "replay" if replayed else "ran"
    return str(status)


ANSWER_NAMES = {
    "ran": "ran the endpoint (201)",
    "replay": "replay (201 + replay header)",
    "409": "409 in flight",
    "422": "422",
    "500": "500",
}


def describe_answers(answers: Counter[str], names: dict[str, str] = ANSWER_NAMES) -> str:
    total = sum(answers.values())
    if not total:
        return "-"
    return ", ".join(f"{names.get(a, a)} {n / total:.0%}" for a, n in answers.most_common())
