"""retrysafe.client: keys, the retry decision (fake clock), and real servers end to end.

The unit tests drive the clients over ``httpx.MockTransport`` with a fake clock
and a seeded random, so no test sleeps. The end-to-end tests run a real flaky
upstream process (tests/_flaky_upstream.py) behind the real ``retrysafe
gateway`` process, and again behind the ASGI middleware, and count effects in
the upstream's SQLite file.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from _flaky_upstream import FRONTS, effects, serve
from _hangup import CALLER

from retrysafe.client import AsyncClient, Client, RetryPolicy, decide, was_replayed

NOW = 1_800_000_000.0


class FakeTime:
    """A clock that only moves when the client sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def wall(self) -> float:
        return NOW + self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


def policy(fake: FakeTime, seed: int = 7, **options: object) -> RetryPolicy:
    return RetryPolicy(
        random=random.Random(seed),
        sleep=fake.sleep,
        asleep=fake.asleep,
        clock=fake.clock,
        wall=fake.wall,
        **options,
    )


Handler = Callable[[httpx.Request], httpx.Response]


def scripted(answers: list[httpx.Response | Exception]) -> tuple[Handler, list[httpx.Request]]:
    """A handler that gives ``answers`` in turn (the last one forever) and keeps the requests."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers[min(len(seen) - 1, len(answers) - 1)]
        if isinstance(answer, Exception):
            raise answer
        return answer

    return handler, seen


def problem(status: int, code: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(
        status,
        json={"code": code, "status": status},
        headers={"content-type": "application/problem+json", **(headers or {})},
    )


def expected_delays(seed: int, n: int, base: float = 0.1, cap: float = 10.0) -> list[float]:
    rnd = random.Random(seed)
    return [rnd.uniform(0, min(cap, base * 2**i)) for i in range(n)]


# -- the decision and the delays -----------------------------------------------------------


def test_delays_follow_full_jitter_and_attempts_are_bounded() -> None:
    fake = FakeTime()
    handler, seen = scripted([httpx.Response(503)])
    with Client(transport=httpx.MockTransport(handler), retry=policy(fake, seed=3)) as c:
        r = c.post("http://api.test/x", json={})
    assert r.status_code == 503
    assert len(seen) == 5
    assert fake.sleeps == pytest.approx(expected_delays(3, 4))


def test_total_time_is_bounded() -> None:
    fake = FakeTime()
    handler, seen = scripted([httpx.Response(503, headers={"retry-after": "4"})])
    p = policy(fake, max_attempts=100, max_time=10)
    with Client(transport=httpx.MockTransport(handler), retry=p) as c:
        r = c.post("http://api.test/x")
    assert r.status_code == 503
    assert fake.sleeps == [4, 4, 2]  # the last wait is capped by what is left
    assert len(seen) == 4
    assert fake.now == 10


def test_retry_after_seconds_and_http_date() -> None:
    p = RetryPolicy(random=random.Random(1))
    r = problem(409, "idempotency_in_flight", {"retry-after": "3"})
    assert decide(1, r, p, 0.0, NOW) == 3
    date = email.utils.formatdate(NOW + 7, usegmt=True)
    r = httpx.Response(503, headers={"retry-after": date})
    assert decide(1, r, p, 0.0, NOW) == pytest.approx(7)
    r = httpx.Response(429, headers={"retry-after": "2"})
    assert decide(1, r, p, 0.0, NOW) == 2
    assert decide(1, r, p, 29.5, NOW) == pytest.approx(0.5)  # capped by the time left
    mesh = httpx.Response(
        503,
        json={
            "error": {
                "code": "IDEMPOTENCY_PROCESSING",
                "retry_after": {"value": 1500, "unit": "ms"},
            }
        },
    )
    assert decide(1, mesh, p, 0.0, NOW) == 1.5


def test_retry_after_date_through_the_client() -> None:
    fake = FakeTime()
    fake.now = 2.0  # the fake wall clock reads NOW + 2
    first = email.utils.formatdate(NOW + 7, usegmt=True)
    second = email.utils.formatdate(NOW + 20, usegmt=True)
    handler, seen = scripted(
        [
            problem(409, "idempotency_in_flight", {"retry-after": first}),
            httpx.Response(503, headers={"retry-after": second}),
            httpx.Response(503, headers={"retry-after": "Tue, 01 Jan 2019 00:00:00 GMT"}),
            httpx.Response(201),
        ]
    )
    with Client(transport=httpx.MockTransport(handler), retry=policy(fake)) as c:
        assert c.post("http://api.test/x").status_code == 201
    assert fake.sleeps == [pytest.approx(5), pytest.approx(13), 0]  # a past date: at once
    assert len(seen) == 4


def test_unsupported_protocol_is_not_retried() -> None:
    fake = FakeTime()
    with Client(retry=policy(fake)) as c, pytest.raises(httpx.UnsupportedProtocol):
        c.post("ftp://api.test/x")
    assert fake.sleeps == []


@pytest.mark.parametrize(
    "answer",
    [
        problem(422, "idempotency_conflict"),
        problem(400, "idempotency_key_invalid"),
        httpx.Response(404),
        httpx.Response(401),
        httpx.Response(429),  # no Retry-After
        problem(409, "idempotency_conflict", {"retry-after": "1"}),
        httpx.Response(409, json={"code": "other"}),
        httpx.Response(501),
    ],
)
def test_never_retried(answer: httpx.Response) -> None:
    fake = FakeTime()
    handler, seen = scripted([answer])
    with Client(transport=httpx.MockTransport(handler), retry=policy(fake)) as c:
        r = c.post("http://api.test/x")
    assert r.status_code == answer.status_code
    assert len(seen) == 1 and fake.sleeps == []


@pytest.mark.parametrize(
    "first",
    [
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
        httpx.RemoteProtocolError("dropped"),
        httpx.Response(500),
        httpx.Response(502),
        httpx.Response(504),
        problem(409, "idempotency_in_flight", {"retry-after": "1"}),
        httpx.Response(409, headers={"retry-after": "1"}),
        httpx.Response(429, headers={"retry-after": "1"}),
    ],
)
def test_retried_then_the_answer(first: httpx.Response | Exception) -> None:
    fake = FakeTime()
    handler, seen = scripted([first, httpx.Response(201, headers={"idempotent-replayed": "true"})])
    with Client(transport=httpx.MockTransport(handler), retry=policy(fake)) as c:
        r = c.post("http://api.test/x", json={"a": 1})
    assert r.status_code == 201 and was_replayed(r)
    assert len(seen) == 2
    assert [s.content for s in seen] == [b'{"a":1}'] * 2


def test_the_last_error_is_raised() -> None:
    fake = FakeTime()
    handler, seen = scripted([httpx.ConnectError("refused")])
    p = policy(fake, max_attempts=3)
    with (
        Client(transport=httpx.MockTransport(handler), retry=p) as c,
        pytest.raises(httpx.ConnectError),
    ):
        c.post("http://api.test/x")
    assert len(seen) == 3 and len(fake.sleeps) == 2


def test_non_http_errors_are_not_retried() -> None:
    assert decide(1, ValueError("bug"), RetryPolicy(), 0.0) is None


# -- keys ----------------------------------------------------------------------------------


def test_same_key_on_every_attempt_and_a_new_key_per_call(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeTime()
    handler, seen = scripted([httpx.Response(503), httpx.Response(201)])
    caplog.set_level(logging.DEBUG, logger="retrysafe.client")
    with Client(transport=httpx.MockTransport(handler), retry=policy(fake)) as c:
        c.post("http://api.test/x", headers={"Authorization": "Bearer s3cret"}, content=b"body!")
        first = {r.headers["idempotency-key"] for r in seen}
        c.post("http://api.test/x")
    assert len(first) == 1
    key = first.pop()
    assert uuid.UUID(key).version == 4
    assert seen[-1].headers["idempotency-key"] != key
    attempts = [r for r in caplog.records if r.name == "retrysafe.client"]
    assert any(key in r.getMessage() and "attempt=2" in r.getMessage() for r in attempts)
    assert not any("s3cret" in r.getMessage() or "body!" in r.getMessage() for r in attempts)


@pytest.mark.parametrize("header", ["Idempotency-Key", "idempotency-key", "X-Idempotency-Key"])
def test_a_callers_key_is_kept(header: str) -> None:
    fake = FakeTime()
    handler, seen = scripted([httpx.Response(503), httpx.Response(201)])
    with Client(transport=httpx.MockTransport(handler), retry=policy(fake)) as c:
        c.post("http://api.test/x", headers={header: "mine-1"})
    assert [r.headers.get_list(header) for r in seen] == [["mine-1"], ["mine-1"]]
    assert all(len([k for k in r.headers if "idempotency-key" in k]) == 1 for r in seen)


def test_uuid7_keys_and_a_custom_header() -> None:
    handler, seen = scripted([httpx.Response(201)])
    p = RetryPolicy(key_version=7)
    with Client(transport=httpx.MockTransport(handler), retry=p, key_header="X-Key") as c:
        c.post("http://api.test/x")
        c.patch("http://api.test/x")
    keys = [r.headers["x-key"] for r in seen]
    assert [uuid.UUID(k).version for k in keys] == [7, 7] and keys[0] < keys[1]


def test_methods_keyed_and_retried_by_policy() -> None:
    fake = FakeTime()
    handler, seen = scripted([httpx.Response(503)])
    with Client(transport=httpx.MockTransport(handler), retry=policy(fake, max_attempts=2)) as c:
        c.get("http://api.test/x")
        c.put("http://api.test/x")
        c.delete("http://api.test/x")
    assert [r.method for r in seen] == ["GET", "PUT", "DELETE"]
    assert all("idempotency-key" not in r.headers for r in seen)
    seen.clear()
    p = policy(fake, max_attempts=2, retry_methods=frozenset({"put", "delete"}))
    with Client(transport=httpx.MockTransport(handler), retry=p) as c:
        c.put("http://api.test/x")
        c.delete("http://api.test/x")
        c.post("http://api.test/x")
    assert [r.method for r in seen] == ["PUT", "PUT", "DELETE", "DELETE", "POST"]
    assert seen[0].headers["idempotency-key"] == seen[1].headers["idempotency-key"]


def test_a_streamed_body_is_sent_once() -> None:
    fake = FakeTime()
    handler, seen = scripted([httpx.Response(503)])

    def body() -> Iterator[bytes]:
        yield b"one-shot"

    with Client(transport=httpx.MockTransport(handler), retry=policy(fake)) as c:
        r = c.post("http://api.test/x", content=body())
    assert r.status_code == 503 and len(seen) == 1
    assert "idempotency-key" in seen[0].headers


def test_policy_is_validated() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(key_version=5)
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


def test_async_client_same_decisions() -> None:
    fake = FakeTime()
    handler, seen = scripted(
        [
            httpx.ReadTimeout("slow"),
            problem(409, "idempotency_in_flight", {"retry-after": "2"}),
            httpx.Response(201, headers={"idempotent-replayed": "true"}),
        ]
    )

    async def main() -> httpx.Response:
        async with AsyncClient(transport=httpx.MockTransport(handler), retry=policy(fake, 5)) as c:
            return await c.post("http://api.test/x", json={})

    r = asyncio.run(main())
    assert r.status_code == 201 and was_replayed(r)
    assert fake.sleeps == [pytest.approx(expected_delays(5, 1)[0]), 2]
    assert len({s.headers["idempotency-key"] for s in seen}) == 1


def test_async_streamed_problem_is_read_for_its_code() -> None:
    fake = FakeTime()
    handler, seen = scripted([problem(422, "idempotency_conflict")])

    async def main() -> int:
        transport = httpx.MockTransport(handler)
        async with (
            AsyncClient(transport=transport, retry=policy(fake)) as c,
            c.stream("POST", "http://api.test/x", json={}) as r,
        ):
            return r.status_code

    assert asyncio.run(main()) == 422 and len(seen) == 1


# -- real servers: the gateway or the middleware in front of a flaky upstream ---------


@pytest.fixture(scope="module", params=FRONTS)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(retrysafe's URL, the upstream's effects DB): the gateway or the middleware
    in front of the flaky upstream, in real processes."""
    with serve(request.param, tmp_path_factory.mktemp("client")) as stack:
        yield stack


MODES = ["ok", "503&n=2", "drop&n=1", "slow&s=1.2"]


def real_policy() -> RetryPolicy:
    return RetryPolicy(base=0.05, cap=0.5, max_attempts=10, max_time=20)


def check(db: str, results: list[tuple[str, str, httpx.Response]]) -> None:
    done = effects(db)
    for ident, mode, r in results:
        assert r.status_code == 201, (mode, r.status_code, r.text)
        assert r.json()["id"] == ident
        assert done.get(ident) == 1, (mode, done.get(ident))
        if mode.startswith("slow"):
            assert was_replayed(r)  # the first answer was lost to the timeout


def test_real_server_sync_exactly_once(stack: tuple[str, str]) -> None:
    url, db = stack
    results = []
    with Client(base_url=url, timeout=0.5, retry=real_policy(), headers=CALLER) as c:
        for mode in MODES:
            ident = uuid.uuid4().hex
            results.append((ident, mode, c.post(f"/work?mode={mode}", json={"id": ident})))
    check(db, results)


def test_real_server_async_16_concurrent_callers(stack: tuple[str, str]) -> None:
    url, db = stack

    async def one(c: AsyncClient, mode: str) -> tuple[str, str, httpx.Response]:
        ident = uuid.uuid4().hex
        return ident, mode, await c.post(f"/work?mode={mode}", json={"id": ident})

    async def main() -> list[tuple[str, str, httpx.Response]]:
        async with AsyncClient(base_url=url, timeout=0.5, retry=real_policy(), headers=CALLER) as c:
            return list(await asyncio.gather(*(one(c, MODES[i % 4]) for i in range(16))))

    check(db, asyncio.run(main()))


def test_real_server_sync_16_concurrent_threads(stack: tuple[str, str]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    url, db = stack

    def one(mode: str) -> tuple[str, str, httpx.Response]:
        ident = uuid.uuid4().hex
        with Client(base_url=url, timeout=0.5, retry=real_policy(), headers=CALLER) as c:
            return ident, mode, c.post(f"/work?mode={mode}", json={"id": ident})

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, [MODES[i % 4] for i in range(16)]))
    check(db, results)


def test_real_server_conflict_is_not_retried(stack: tuple[str, str]) -> None:
    url, db = stack
    with Client(base_url=url, timeout=2, retry=real_policy(), headers=CALLER) as c:
        key = str(uuid.uuid4())
        first = c.post("/work", json={"id": "c-" + key}, headers={"Idempotency-Key": key})
        again = c.post("/work", json={"id": "c-" + key}, headers={"Idempotency-Key": key})
        other = c.post("/work", json={"id": "d-" + key}, headers={"Idempotency-Key": key})
    assert first.status_code == 201 and not was_replayed(first)
    assert again.status_code == 201 and was_replayed(again) and again.json() == first.json()
    assert other.status_code == 422 and json.loads(other.content)["code"] == "idempotency_conflict"
    assert effects(db).get("c-" + key) == 1 and "d-" + key not in effects(db)


def test_the_server_sees_one_key(stack: tuple[str, str], tmp_path: Path) -> None:
    # Effects are counted per mutation; the key the gateway saw is the client's one key.
    url, _ = stack
    with Client(base_url=url, timeout=0.5, retry=real_policy(), headers=CALLER) as c:
        r = c.post("/work?mode=503&n=3", json={"id": uuid.uuid4().hex})
        key = r.request.headers["idempotency-key"]
        replay = c.post(
            "/work?mode=503&n=3", json={"id": r.json()["id"]}, headers={"Idempotency-Key": key}
        )
    assert r.status_code == 201 and was_replayed(replay) and replay.json() == r.json()
