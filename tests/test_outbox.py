"""retrysafe.client.Outbox: the durable outbox, unit-tested and then killed for real.

The unit tests send over ``httpx.MockTransport`` with a fake clock. The real
tests queue mutations for the flaky upstream behind the gateway or the
middleware (tests/_flaky_upstream.py), SIGKILL ``retrysafe outbox flush``
processes again and again, and check in the upstream's own SQLite file that
every mutation took effect exactly once, in the order it was queued.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _flaky_upstream import FRONTS, SCHEMA, effects, serve
from _hangup import CALLER
from _http_servers import ThreadServer
from test_client import FakeTime, policy, problem, scripted

from retrysafe import FingerprintMismatchError, InvalidKeyError
from retrysafe._cli.app import main as cli
from retrysafe.client import Client, Outbox, OutboxError, RetryPolicy

BASE = "http://api.test"


@pytest.fixture
def box(tmp_path: Path) -> Outbox:
    return Outbox(tmp_path / "outbox.db")


def client_for(
    answers: list[httpx.Response | Exception], **options: object
) -> tuple[Client, list[httpx.Request], FakeTime]:
    handler, seen = scripted(answers)
    fake = FakeTime()
    retry = policy(fake, **{"max_attempts": 3, **options})
    return Client(base_url=BASE, transport=httpx.MockTransport(handler), retry=retry), seen, fake


def ok(status: int = 201) -> httpx.Response:
    return httpx.Response(status, json={"ok": True})


# -- the queue ---------------------------------------------------------------------------------


def test_enqueue_keeps_order_and_survives_a_new_process_object(box: Outbox) -> None:
    keys = [box.enqueue("post", "/orders", json={"n": i}) for i in range(3)]
    keys.append(
        box.enqueue(
            "PATCH",
            f"{BASE}/orders/1",
            b"raw",
            key="mine-1",
            headers={"Content-Type": "text/plain"},
        )
    )
    again = Outbox(box.path)  # as another process would open it
    items = again.items()
    assert [i.key for i in items] == keys and len(again) == 4
    assert [i.seq for i in items] == sorted(i.seq for i in items)
    assert items[0].method == "POST" and items[0].url == "/orders"
    assert json.loads(items[1].body) == {"n": 1}
    assert items[1].headers == {"Content-Type": "application/json"}
    assert items[3].key == "mine-1" and items[3].body == b"raw"
    assert len(set(keys)) == 4 and all(uuid.UUID(k).version == 4 for k in keys[:3])


def test_uuid7_keys_follow_the_policy(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.db", retry=RetryPolicy(key_version=7))
    assert uuid.UUID(box.enqueue("POST", "/x")).version == 7


def test_the_same_key_again_stores_nothing_new_or_is_a_conflict(box: Outbox) -> None:
    key = box.enqueue("POST", "/orders", json={"a": 1})
    assert box.enqueue("POST", "/orders", json={"a": 1}, key=key) == key
    assert len(box) == 1
    with pytest.raises(FingerprintMismatchError, match="another request"):
        box.enqueue("POST", "/orders", json={"a": 2}, key=key)
    with pytest.raises(FingerprintMismatchError):
        box.enqueue("PUT", "/orders", json={"a": 1}, key=key)
    assert len(box) == 1 and json.loads(box.items()[0].body) == {"a": 1}


@pytest.mark.parametrize(
    ("args", "options", "error", "match"),
    [
        (("GET /", "/x"), {}, ValueError, "HTTP method"),
        (("", "/x"), {}, ValueError, "HTTP method"),
        (("POST", ""), {}, ValueError, "non-empty"),
        (("POST", "ftp://host/x"), {}, ValueError, "http"),
        (("POST", "http://[::1/x"), {}, ValueError, "not a URL"),
        (("POST", "/x"), {"key": ""}, InvalidKeyError, "empty"),
        (("POST", "/x"), {"key": "k\n"}, InvalidKeyError, "contains"),
        (("POST", "/x"), {"key": "x" * 256}, InvalidKeyError, "limit"),
        (("POST", "/x"), {"key": " k"}, InvalidKeyError, "space"),
        (("POST", "/x", b"b"), {"json": {}}, TypeError, "not both"),
        (("POST", "/x"), {"headers": {"Authorization": "Bearer t"}}, ValueError, "credentials"),
        (("POST", "/x"), {"headers": {"cookie": "s=1"}}, ValueError, "credentials"),
        (("POST", "/x"), {"headers": {"Idempotency-Key": "k"}}, ValueError, "key="),
        (("POST", "/x"), {"headers": {"bad name": "v"}}, ValueError, "header name"),
        (("POST", "/x"), {"headers": {"X-A": "a\r\nX-B: b"}}, ValueError, "invalid value"),
    ],
)
def test_bad_input_is_refused_and_writes_nothing(
    box: Outbox, args: tuple[object, ...], options: dict[str, object], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        box.enqueue(*args, **options)  # type: ignore[arg-type]
    assert not box.path.exists() or len(box) == 0


def test_credentials_only_when_asked(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.db", keep_credentials=True)
    box.enqueue("POST", "/x", headers={"Authorization": "Bearer t"})
    assert box.items()[0].headers == {"Authorization": "Bearer t"}


def test_a_file_that_is_not_an_outbox(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("not a database, just text " * 100)
    with pytest.raises(OutboxError, match="not a database"):
        Outbox(bad).enqueue("POST", "/x")
    with pytest.raises(OutboxError, match="cannot open"):
        Outbox(tmp_path / "missing-dir" / "o.db").enqueue("POST", "/x")


def test_drop_and_get(box: Outbox) -> None:
    a, b = box.enqueue("POST", "/a"), box.enqueue("POST", "/b")
    assert box.get(a) is not None and box.drop(a) and not box.drop(a)
    assert box.get(a) is None and [i.key for i in box.items()] == [b]


# -- flushing ----------------------------------------------------------------------------------


def test_flush_sends_in_order_with_each_key_and_empties_the_queue(box: Outbox) -> None:
    keys = [box.enqueue("POST", f"/orders/{i}", json={"n": i}) for i in range(4)]
    client, seen, _ = client_for([ok()])
    result = box.flush(client)
    assert result.complete and result.error is None and result.remaining == 0
    assert [i.key for i in result.delivered] == keys
    assert [r.headers["idempotency-key"] for r in seen] == keys
    assert [r.url.path for r in seen] == [f"/orders/{i}" for i in range(4)]
    assert [json.loads(r.content) for r in seen] == [{"n": i} for i in range(4)]
    assert seen[0].headers["content-type"] == "application/json"
    assert len(box) == 0 and box.failures() == []


def test_a_retried_item_keeps_its_key_and_waits_by_the_policy(box: Outbox) -> None:
    key = box.enqueue("POST", "/x")
    client, seen, fake = client_for(
        [httpx.ConnectError("down"), problem(503, "x", {"retry-after": "2"}), ok()], max_attempts=5
    )
    assert box.flush(client).complete
    assert [r.headers["idempotency-key"] for r in seen] == [key] * 3
    assert fake.sleeps[1] == 2.0  # the server's Retry-After


def test_no_final_answer_stops_the_flush_and_keeps_the_order(box: Outbox) -> None:
    first, second = box.enqueue("POST", "/a"), box.enqueue("POST", "/b")
    client, seen, _ = client_for([problem(503, "busy")])
    result = box.flush(client)
    assert not result.complete and result.remaining == 2 and result.delivered == ()
    assert result.error is not None and "HTTP 503" in result.error and first in result.error
    assert {r.url.path for r in seen} == {"/a"}  # /b never overtook /a
    items = box.items()
    assert [i.key for i in items] == [first, second]
    assert items[0].attempts == 1 and items[0].last_error == "HTTP 503"
    client, seen, _ = client_for([httpx.ConnectError("offline")])
    result = box.flush(client)
    assert result.remaining == 2 and "ConnectError" in (result.error or "")
    assert box.items()[0].attempts == 2 and "offline" in (box.items()[0].last_error or "")
    client, seen, _ = client_for([ok()])
    assert box.flush(client).complete and [r.url.path for r in seen] == ["/a", "/b"]


def test_a_final_refusal_is_kept_for_inspection_and_the_rest_goes_on(box: Outbox) -> None:
    keys = [box.enqueue("POST", f"/{i}") for i in range(3)]
    answers = [ok(), problem(422, "idempotency_conflict"), ok()]

    def handler(request: httpx.Request) -> httpx.Response:
        return answers[int(request.url.path[1:])]

    client = Client(base_url=BASE, transport=httpx.MockTransport(handler), retry=policy(FakeTime()))
    result = box.flush(client)
    assert [i.key for i in result.delivered] == [keys[0], keys[2]]
    assert [i.key for i in result.failed] == [keys[1]] and not result.complete
    (failed,) = box.failures()
    assert failed.key == keys[1] and failed.state == "failed" and failed.status_code == 422
    assert failed.answer is not None and b"idempotency_conflict" in failed.answer
    assert failed.finished_at is not None and len(box) == 0
    assert box.flush(client).complete  # a failure is never sent again
    assert box.drop(keys[1]) and box.failures() == []


def test_on_answer_sees_each_success_and_an_error_keeps_the_item(box: Outbox) -> None:
    a, b = box.enqueue("POST", "/a"), box.enqueue("POST", "/b")
    client, _, _ = client_for([ok()])
    seen: list[str] = []

    def on_answer(item: object, response: httpx.Response) -> None:
        seen.append(item.key)  # type: ignore[attr-defined]
        if len(seen) == 2:
            raise RuntimeError("the application's own failure")

    with pytest.raises(RuntimeError):
        box.flush(client, on_answer=on_answer)
    assert seen == [a, b] and [i.key for i in box.items()] == [b]
    assert box.flush(client, on_answer=lambda i, r: seen.append(i.key)).complete
    assert seen == [a, b, b]


def test_a_client_key_header_is_used(box: Outbox) -> None:
    key = box.enqueue("POST", "/x")
    handler, seen = scripted([ok()])
    client = Client(base_url=BASE, transport=httpx.MockTransport(handler), key_header="X-Key")
    assert box.flush(client).complete and seen[0].headers["x-key"] == key


def test_one_flusher_at_a_time(box: Outbox) -> None:
    box.enqueue("POST", "/slow")
    entered, release = threading.Event(), threading.Event()
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        entered.set()
        assert release.wait(10)
        return ok()

    client = Client(base_url=BASE, transport=httpx.MockTransport(handler))
    results: list[object] = []
    first = threading.Thread(target=lambda: results.append(box.flush(client)))
    first.start()
    assert entered.wait(10)
    other = Outbox(box.path)  # another object on the file, as another process has
    busy = other.flush(client, block=False)
    assert busy.busy and busy.remaining == 1 and not busy.complete and sent == ["/slow"]
    waiting = threading.Thread(target=lambda: results.append(other.flush(client)))
    waiting.start()  # waits for the first flusher, then finds nothing left to send
    release.set()
    first.join(10)
    waiting.join(10)
    assert sent == ["/slow"] and len(box) == 0 and len(results) == 2


def test_flush_without_a_client_uses_the_outbox_policy(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.db", retry=RetryPolicy(max_attempts=2, base=0.01), timeout=1)
    box.enqueue("POST", "http://127.0.0.1:9/x")  # the discard port: nothing listens
    result = box.flush()
    assert result.remaining == 1 and "ConnectError" in (result.error or "")
    assert box.items()[0].attempts == 1


# -- the CLI -----------------------------------------------------------------------------------


def test_cli(box: Outbox, capsys: pytest.CaptureFixture[str]) -> None:
    key = box.enqueue("POST", "http://127.0.0.1:9/x", json={"a": 1})
    path = str(box.path)
    assert cli(["outbox", "list", "--path", path]) == 0
    assert key in capsys.readouterr().out
    assert cli(["outbox", "list", "--path", path, "--json"]) == 0
    (shown,) = json.loads(capsys.readouterr().out)
    assert shown["key"] == key and shown["state"] == "queued" and shown["bytes"] == 7
    assert cli(["outbox", "flush", "--path", path, "--max-attempts", "1", "--timeout", "1"]) == 1
    printed = capsys.readouterr().out
    assert "0 mutations delivered" in printed and "1 still queued" in printed
    assert "ConnectError" in printed
    assert cli(["outbox", "list", "--path", path, "--failed"]) == 0
    assert "no failed mutations" in capsys.readouterr().out
    assert cli(["outbox", "drop", key, "--path", path]) == 0
    assert cli(["outbox", "drop", key, "--path", path]) == 1
    assert "no mutation with key" in capsys.readouterr().err
    assert cli(["outbox", "list", "--path", path]) == 0
    assert "the outbox is empty" in capsys.readouterr().out


def test_cli_flush_sends_the_callers_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outbox keeps no credentials: ``--header`` and ``--header-env`` give them to
    the flusher, whose every request carries them (the server tells callers apart)."""
    seen: list[dict[str, str]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    box = Outbox(tmp_path / "o.db")
    box.enqueue("POST", "/x", json={"a": 1})
    monkeypatch.setenv("TEST_TOKEN", "Bearer from-env")
    with ThreadServer(app, "asgi") as server:
        argv = [
            "outbox",
            "flush",
            "--path",
            str(box.path),
            "--base-url",
            server.url,
            "--header",
            "X-Tenant: t1",
            "--header-env",
            "Authorization=TEST_TOKEN",
        ]
        assert cli(argv) == 0
    [sent] = seen
    assert sent["authorization"] == "Bearer from-env" and sent["x-tenant"] == "t1"
    assert "idempotency-key" in sent and len(box) == 0


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["outbox", "list", "--path", str(tmp_path / "none.db")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"retrysafe outbox list: error: no outbox at '{tmp_path / 'none.db'}'"
    )
    box = Outbox(tmp_path / "o.db")
    box.enqueue("POST", "/x")
    assert cli(["outbox", "flush", "--path", str(box.path), "--base-url", "http://[::1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("retrysafe outbox flush: error: cannot send") and err.count("\n") == 1
    assert len(box) == 1
    for given in (
        ["--header", "no colon"],
        ["--header", ": v"],
        ["--header-env", "Authorization"],
        ["--header-env", "A=NO_SUCH_VARIABLE"],
    ):
        assert cli(["outbox", "flush", "--path", str(box.path), *given]) == 2, given
        err = capsys.readouterr().err
        assert err.startswith("retrysafe outbox flush: error: --header") and err.count("\n") == 1
    assert len(box) == 1
    bad = tmp_path / "bad.db"
    bad.write_text("garbage " * 200)
    assert cli(["outbox", "list", "--path", str(bad)]) == 2
    assert "not a database" in capsys.readouterr().err


# -- real servers: kill the flusher again and again ---------------------------------------------


@pytest.fixture(scope="module", params=FRONTS)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    with serve(request.param, tmp_path_factory.mktemp("outbox")) as stack:
        yield stack


def applied(db: str, idents: list[str]) -> list[str]:
    """The mutations among ``idents`` in the order the upstream applied them."""
    wanted = set(idents)
    with sqlite3.connect(db) as conn:
        conn.execute(SCHEMA)
        rows = conn.execute("SELECT id FROM effects ORDER BY n").fetchall()
    return [r[0] for r in rows if r[0] in wanted]


#: ``retrysafe outbox flush`` (the CLI's own code), started with the CLI already imported:
#: it says ``ready``, then flushes when ``go`` comes on its stdin. Importing takes 2 s
#: or more on a busy machine; a kill timed from the process start would land in the
#: imports, and a flush timed from ``go`` lands in the flush.
_FLUSHER = textwrap.dedent(
    """
    import sys
    import retrysafe._cli.app, retrysafe._client.outbox, retrysafe.client
    print("ready", flush=True)
    if sys.stdin.readline().strip() == "go":  # not when the test ended without a word
        sys.exit(retrysafe._cli.app.main(sys.argv[1:]))
    """
)


def flusher(url: str, path: Path, *, go: bool = True) -> subprocess.Popen[bytes]:
    """A ``retrysafe outbox flush`` process, sending the caller's token (the outbox
    keeps no credentials; the server keeps each caller's answers apart). It flushes
    once told (:func:`start`); ``go=True`` tells it at once."""
    argv = [
        sys.executable,
        "-c",
        _FLUSHER,
        "outbox",
        "flush",
        "--path",
        str(path),
        "--base-url",
        url,
        "--timeout",
        "2",
        "--max-time",
        "20",
        "--header-env",
        "Authorization=TEST_AUTHORIZATION",
    ]
    env = {**os.environ, "TEST_AUTHORIZATION": CALLER["authorization"]}
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    if go:
        start(proc)
    return proc


def start(proc: subprocess.Popen[bytes]) -> None:
    """Lets a :func:`flusher` flush, once it is ready."""
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n", proc.stderr.read() if proc.stderr else ""
    proc.stdin.write(b"go\n")
    proc.stdin.close()


def sends(path: Path) -> list[tuple[int, int]]:
    """What the outbox shows of flushing: each queued mutation and its attempts."""
    return [(i.seq, i.attempts) for i in Outbox(path).items()]


def queue(path: Path, n: int) -> list[str]:
    """``n`` mutations of the flaky kinds; the slow ones do their work, then answer late."""
    box = Outbox(path)
    modes = ["slow&s=0.15", "ok", "slow&s=0.15", "503&n=1", "slow&s=0.15", "drop&n=1"]
    idents = [f"m{i:03d}-{uuid.uuid4().hex[:8]}" for i in range(n)]
    for i, ident in enumerate(idents):
        box.enqueue("POST", f"/work?mode={modes[i % len(modes)]}", json={"id": ident})
    return idents


def test_sigkilled_flushers_apply_every_mutation_once_in_order(
    stack: tuple[str, str], tmp_path: Path
) -> None:
    """Kills at random moments of a flush, and kills right after a slow mutation took
    effect (its answer not yet sent): the next flusher sends it again, and the server
    answers that from its store.

    The work is bounded by count (18 mutations, each round a flusher process, 40 rounds
    at most), and every wait is for an event: a round starts its flusher once it is
    ready, kills it after the flush has begun or a slow mutation took effect, and the
    deadlines only end a hung flusher.
    """
    url, db = stack
    path = tmp_path / "outbox.db"
    idents = queue(path, 18)
    slow = set(idents[::2])
    rnd = random.Random(1234)
    kills = answer_lost = 0
    spare = flusher(url, path, go=False)  # each round's flusher imports during the last one
    for round_ in range(40):
        if len(Outbox(path)) == 0:
            break
        proc, spare = spare, flusher(url, path, go=False)
        before, sent = set(applied(db, idents)), sends(path)
        start(proc)
        deadline = time.monotonic() + 30
        if round_ % 2:  # a random moment once the flush has begun
            while proc.poll() is None and sends(path) == sent:
                assert time.monotonic() < deadline, "the flusher never began"
                time.sleep(0.005)
            time.sleep(rnd.uniform(0, 0.5))
        else:  # wait for a slow mutation's effect, then kill before its answer arrives
            while proc.poll() is None and not (set(applied(db, idents)) - before) & slow:
                assert time.monotonic() < deadline, "no slow mutation took effect"
                time.sleep(0.005)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait(30)
        assert proc.stderr is not None
        assert b"Traceback" not in proc.stderr.read()
        queued = {json.loads(i.body)["id"] for i in Outbox(path).items()}
        answer_lost += bool(queued & set(applied(db, idents)))
    start(spare)  # the last flusher finishes what is left
    assert spare.wait(60) == 0, spare.stderr.read() if spare.stderr else ""
    assert len(Outbox(path)) == 0 and Outbox(path).failures() == []
    assert kills >= 5, "the flushers were never killed mid-flush"
    assert answer_lost >= 1, "no kill landed between a mutation's effect and its removal"
    done = effects(db)
    assert {i: done.get(i) for i in idents} == {i: 1 for i in idents}
    assert applied(db, idents) == idents  # in the order they were queued


def test_flushers_in_several_processes_at_once(stack: tuple[str, str], tmp_path: Path) -> None:
    url, db = stack
    path = tmp_path / "outbox.db"
    idents = queue(path, 12)
    procs = [flusher(url, path, go=False) for _ in range(4)]
    for proc in procs:
        start(proc)
    codes = [p.wait(60) for p in procs]
    assert codes == [0] * 4, [p.stderr.read() for p in procs if p.stderr]
    done = effects(db)
    assert {i: done.get(i) for i in idents} == {i: 1 for i in idents}
    assert applied(db, idents) == idents and len(Outbox(path)) == 0


def test_a_redirect_is_not_a_delivery_but_see_other_is(box: Outbox) -> None:
    moved, created = box.enqueue("POST", "/moved"), box.enqueue("POST", "/created")
    answers = {
        "/moved": httpx.Response(307, headers={"location": "/elsewhere"}),
        "/created": httpx.Response(303, headers={"location": "/orders/1"}),
    }
    client = Client(base_url=BASE, transport=httpx.MockTransport(lambda r: answers[r.url.path]))
    result = box.flush(client)
    assert [i.key for i in result.failed] == [moved]
    assert [i.key for i in result.delivered] == [created]
    assert box.failures()[0].status_code == 307


def test_the_cli_never_turns_another_sqlite_file_into_an_outbox(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "app.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE users (id INTEGER)")
    before = other.read_bytes()
    for command in (["list"], ["flush"], ["drop", "k"]):
        assert cli(["outbox", *command, "--path", str(other)]) == 2
        assert "is not an outbox" in capsys.readouterr().err
    assert other.read_bytes() == before and not Path(f"{other}-wal").exists()
