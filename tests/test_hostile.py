"""Hostile input (issue 9): no crash, no 500, every rejection a clear 4xx, nothing written.

Hypothesis drives arbitrary bytes and unicode, huge values, deep nesting,
NaN/Infinity, duplicate JSON keys, wrong types, lying or absurd
``Content-Length`` headers, control characters, non-UTF-8 and wrong content
types through

- the pure parsers: the key header (``parse_key``), the request fingerprint's
  JSON canonical form (``request_fingerprint``), Mesh's body reader
  (``loads``), A2A's send parser (``parse_send``), the webhook verifiers
  (``verify``, with deliveries that are correctly signed and then tampered with);
- the front doors, called as a server calls them: the ASGI middleware in front
  of a Starlette app, the WSGI middleware in front of a Flask app (on SQLite),
  ``MeshApp``, the A2A middleware in front of the real a2a-sdk agent of
  ``_a2a_app.py``, and the webhook ``Receiver``'s ASGI app.

Over HTTP the properties are: never a 5xx and never an exception out of the
app; a refusal is a 4xx ``application/problem+json`` with a machine ``code``
(Mesh and A2A answer in their own envelope instead, as DESIGN.md says); a
refused request never reaches the handler and writes nothing to the store; a
request that is accepted runs once and its retry is a replay.

The example budget is ``RETRYSAFE_FUZZ_EXAMPLES`` (default 100 per property);
``scripts/fuzz.py`` runs the same properties with a large one.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import hashlib
import hmac
import io
import json
import math
import os
import re
import socket
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from starlette.requests import ClientDisconnect

from retrysafe import (
    Claim,
    Engine,
    InvalidKeyError,
    Outcome,
    Replay,
    Store,
    fingerprint,
    open_store,
)
from retrysafe._http.problems import PROBLEM_TYPE
from retrysafe._http.request import MAX_KEY_HEADER, BodyError, parse_key, request_fingerprint
from retrysafe._model.hashing import KEY_PATTERN, printable
from retrysafe._model.record import MAX_REQUEST_ID, stored_request_id
from retrysafe._protocols.a2a import Send, parse_send
from retrysafe._protocols.mesh import loads
from retrysafe.a2a import A2AMiddleware
from retrysafe.asgi import IdempotencyMiddleware as ASGIMiddleware
from retrysafe.mesh import URN, MeshApp, status_of
from retrysafe.stores.memory import MemoryStore, record_bytes
from retrysafe.webhooks import SCHEMES, Receiver, SignatureError, verify
from retrysafe.wsgi import IdempotencyMiddleware as WSGIMiddleware

EXAMPLES = int(os.environ.get("RETRYSAFE_FUZZ_EXAMPLES") or 100)
HOSTILE = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)

#: The machine codes of the HTTP front doors' refusals (DESIGN.md, "Answers").
HTTP_CODES = {
    "idempotency_key_required",
    "idempotency_key_invalid",
    "idempotency_body_invalid",
    "idempotency_body_too_large",
    "idempotency_in_flight",
    "idempotency_conflict",
    "idempotency_credentials_ambiguous",
    "idempotency_principal_required",
}
MAX_REQUEST_BODY = 4096

Headers = list[tuple[bytes, bytes]]
T = TypeVar("T")


# == helpers: one event loop, and an ASGI request as a server makes it ============================


@cache
def _loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    atexit.register(loop.close)
    return loop


def run(coroutine: Awaitable[T]) -> T:
    """Run ``coroutine`` on this module's event loop (the apps keep loop-bound state)."""
    return _loop().run_until_complete(coroutine)


@dataclass
class Answer:
    """What an ASGI app sent back; ``status`` None if it sent nothing (the client left)."""

    status: int | None = None
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


async def asgi_call(
    app: Any,
    method: str,
    path: str,
    headers: Headers,
    chunks: list[bytes],
    *,
    query: bytes = b"",
    disconnect: bool = False,
) -> Answer:
    """Call ``app`` as a server would: the body in ``chunks`` (then ``http.disconnect``
    instead of the last one if ``disconnect``). Any exception fails the property
    (a server would answer it with a 500)."""
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks or [b""])
    ]
    if disconnect:
        messages[-1] = {"type": "http.disconnect"}
    answer = Answer()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(0)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert answer.status is None, "two response starts"
            answer.status = message["status"]
            answer.headers = {k.lower(): v for k, v in message.get("headers", ())}
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("utf-8", "replace"),
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }
    await app(scope, receive, send)
    return answer


def is_problem(status: int, headers: dict[bytes, bytes], body: bytes) -> dict[str, Any]:
    """A 4xx RFC 9457 problem with a machine code; its document."""
    assert 400 <= status < 500, (status, body[:300])
    assert headers.get(b"content-type", b"").decode() == PROBLEM_TYPE, headers
    doc = json.loads(body)
    assert doc["status"] == status and isinstance(doc["detail"], str) and doc["title"]
    assert doc["type"] == f"urn:retrysafe:problem:{doc['code']}"
    return doc  # type: ignore[no-any-return]


def record_count(store: Store[Any]) -> int:
    stats = store.stats(time.time())
    return sum(stats.counts.values()) + stats.expired


# == strategies ===================================================================================

# Characters the key header's grammar cares about, to reach every branch of the parser.
_GRAMMAR = st.sampled_from(list('"\\,; \t=?*:/-.aZ09~\x00\x7f\xe9'))
_BAD_CHARS = st.characters(codec="latin-1") | st.characters(blacklist_categories=("Cs",))
key_values = st.one_of(
    st.text(_GRAMMAR, max_size=40),
    st.text(_BAD_CHARS, max_size=40),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=240, max_size=300),
    st.builds(
        lambda k, p: '"' + k.replace("\\", "\\\\").replace('"', '\\"') + '"' + p,
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20),
        st.text(_GRAMMAR, max_size=10),
    ),
    st.sampled_from(
        [
            '"',
            '""',
            '"\\',
            '"a"b',
            '" x"; a=?1;b=:AA==:',
            ",",
            ", ,",
            "a,b",
            '"a", "a"',
            "k, k",
            '"k";x=1,k',
            " ",
            "\t",
        ]
    ),
    st.integers(0, 12).map(lambda n: ("k" * 300 + ",") * n),
)
valid_keys = st.one_of(
    st.uuids().map(str),
    st.text(
        st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters='",'),
        min_size=1,
        max_size=40,
    ),
)
header_bytes = st.one_of(
    valid_keys.map(str.encode),
    valid_keys.map(lambda k: b'"' + k.replace("\\", "\\\\").encode() + b'";v=1'),
    key_values.map(lambda s: s.encode("latin-1", "replace")),
    st.binary(max_size=80),
)

# JSON text with the hostile parts JSON parsers disagree on.
_ATOMS = st.sampled_from(
    [
        "NaN",
        "Infinity",
        "-Infinity",
        "1e400",
        "-1e400",
        "-0",
        "0.0",
        "1E-400",
        "true",
        "null",
        '"\\ud800"',
        '"\\udfff\\ud800"',
        '"\\u0000"',
        '"\\x"',
        "'single'",
        "01",
        "1.",
        ".5",
        "+1",
        '"' + "\u00e9" * 3 + '"',
        '"\x01\x1f"',
        "[]",
        "{}",
        "",
    ]
) | st.integers(1, 5000).map(lambda n: "-" * (n % 2) + "9" * n)
_json_text = st.recursive(
    _ATOMS
    | st.integers().map(str)
    | st.floats().map(lambda f: json.dumps(f))
    | st.text(max_size=8).map(json.dumps),
    lambda inner: (
        st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]")
        | st.lists(
            st.tuples(st.sampled_from(['"a"', '"b"', '"a"', '""', "a", "1"]), inner), max_size=4
        ).map(lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}")
    ),
    max_leaves=10,
)


def _nested(depth: int, open_: str, close: str, inner: str, balanced: bool) -> str:
    return open_ * depth + inner + (close * depth if balanced else "")


deep_json = st.builds(
    _nested,
    st.integers(1, 100_000),
    st.sampled_from(["[", '{"a":', '[{"a":']),
    st.sampled_from(["]", "}", "}]"]),
    st.sampled_from(["1", "", "NaN"]),
    st.booleans(),
)
hostile_json_text = st.one_of(_json_text, deep_json)
hostile_json = st.one_of(
    hostile_json_text.map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.tuples(hostile_json_text, st.sampled_from(["utf-16", "utf-32", "latin-1"])).map(
        lambda t: t[0].encode(t[1], "replace")
    ),
    st.tuples(
        st.sampled_from([b"\xef\xbb\xbf", b"\xff", b" \t\n", b"\x00"]), hostile_json_text
    ).map(lambda t: t[0] + t[1].encode("utf-8", "surrogatepass")),
    st.binary(max_size=200),
)
content_types = st.one_of(
    st.sampled_from(
        [
            None,
            b"application/json",
            b"application/problem+json; charset=utf-8",
            b"APPLICATION/JSON",
            b"text/plain",
            b"application/json;;;",
            b"+json",
            b"multipart/form-data; boundary=x",
            b"",
        ]
    ),
    st.binary(max_size=40),
)


def _length_for(declared: str, body: bytes) -> bytes | None:
    return {
        "none": None,
        "true": str(len(body)).encode(),
        "short": b"1",
        "long": str(len(body) + 1000).encode(),
        "huge": b"9" * 5000,
        "superscript": "\u00b2".encode("latin-1"),
        "negative": b"-1",
        "hex": b"0x10",
        "spaced": b" 12 ",
    }[declared]


lengths = st.sampled_from(
    ["none", "true", "true", "short", "long", "huge", "superscript", "negative", "hex", "spaced"]
)


def chunked(body: bytes, cuts: list[int]) -> list[bytes]:
    """``body`` split at ``cuts`` (an ASGI body in several messages)."""
    points = sorted({c % (len(body) + 1) for c in cuts})
    return [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]


# == the key header parser ========================================================================


@HOSTILE
@given(values=st.lists(key_values, min_size=1, max_size=4))
@example(values=['"' + "a" * 255 + '"'])
@example(values=["k" * 256])
@example(values=['"a\\', "a"])
def test_key_header_parser_returns_a_key_or_raises_invalid_key(values: list[str]) -> None:
    started = time.perf_counter()
    try:
        key = parse_key(values)
    except InvalidKeyError as exc:
        assert str(exc)
        key = None
    else:
        assert key is None or KEY_PATTERN.fullmatch(key), key
    assert time.perf_counter() - started < 5.0  # no pathological backtracking


def test_key_header_parser_is_linear_on_huge_headers() -> None:
    for value in [
        '"' + "\\a" * 50_000,
        "a," * 100_000,
        '"x";' + "a=1;" * 30_000 + "b=",
        '"' + "a" * 200_000,
        "; " * 100_000,
    ]:
        started = time.perf_counter()
        with pytest.raises(InvalidKeyError):
            parse_key([value])
        # ~0.1 s when linear; quadratic work on 200 kB would take minutes
        assert time.perf_counter() - started < 5.0, value[:20]


@HOSTILE
@given(
    lines=st.integers(1, 3),
    over=st.integers(-64, 64),
    key=st.text(
        alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters='"\\,'),
        min_size=1,
        max_size=40,
    ),
)
@example(lines=1, over=0, key="k")
@example(lines=1, over=1, key="k")
def test_the_key_header_bound_is_exact(lines: int, over: int, key: str) -> None:
    """Lines of one quoted key padded to ``MAX_KEY_HEADER + over`` characters
    together: the key at or under the bound, ``InvalidKeyError`` over it, however
    the characters are spread over the lines."""
    total = MAX_KEY_HEADER + over
    quoted = f'"{key}"'
    if len(quoted) * lines > total:
        return
    sizes = [total // lines] * lines
    sizes[0] += total - sum(sizes)
    values = [quoted + " " * (size - len(quoted)) for size in sizes]
    assert sum(map(len, values)) == total
    if over > 0:
        with pytest.raises(InvalidKeyError, match="limit"):
            parse_key(values)
    else:
        assert parse_key(values) == key


# == the fingerprint canonicaliser ================================================================


@HOSTILE
@given(body=hostile_json, ctype=content_types)
@example(body=b"[" * 100_000, ctype=b"application/json")
@example(body=b"9" * 5000, ctype=b"application/json")
@example(body=b'"\\ud800"', ctype=b"application/json")
@example(body=b"\xef\xbb\xbf{}", ctype=b"application/json")
def test_fingerprint_canonicaliser_accepts_or_raises_body_error(
    body: bytes, ctype: bytes | None
) -> None:
    content_type = None if ctype is None else ctype.decode("latin-1")
    try:
        fp = request_fingerprint("POST", "/p", "q=1", content_type, body)
    except BodyError as exc:
        assert exc.status == 400 and exc.code == "idempotency_body_invalid" and str(exc)
        return
    assert re.fullmatch(r"[0-9a-f]{64}", fp)
    assert fp == request_fingerprint("POST", "/p", "q=1", content_type, body)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=15,
)


def _shuffled(value: Any, rnd: Any) -> Any:
    if isinstance(value, dict):
        items = [(k, _shuffled(v, rnd)) for k, v in value.items()]
        rnd.shuffle(items)
        return dict(items)
    if isinstance(value, list):
        return [_shuffled(v, rnd) for v in value]
    return value


@HOSTILE
@given(
    value=_json_values, rnd=st.randoms(), indent=st.none() | st.integers(0, 3), ascii_=st.booleans()
)
def test_the_fingerprint_ignores_key_order_and_whitespace(
    value: Any, rnd: Any, indent: int | None, ascii_: bool
) -> None:
    compact = json.dumps(value, separators=(",", ":")).encode()
    other = json.dumps(_shuffled(value, rnd), indent=indent, ensure_ascii=ascii_).encode()
    ctype = "application/json"
    assert request_fingerprint("POST", "/", "", ctype, compact) == request_fingerprint(
        "POST", "/", "", ctype, b" \n" + other + b"\t"
    )
    # The same JSON under a duplicate key: the last one counts, as the app's parser sees it.
    doubled = b'{"k":0,' + json.dumps({"k": value}).encode()[1:]
    assert request_fingerprint("POST", "/", "", ctype, doubled) == request_fingerprint(
        "POST", "/", "", ctype, json.dumps({"k": value}).encode()
    )


@HOSTILE
@given(
    value=st.recursive(
        st.none()
        | st.floats()
        | st.integers()
        | st.text()
        | st.binary()
        | st.sampled_from([object(), {1, 2}, 1j, math.inf]),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(st.text(max_size=4) | st.integers() | st.none(), inner, max_size=3)
            | st.tuples(inner, inner)
        ),
        max_leaves=8,
    )
)
def test_argument_fingerprints_raise_only_type_or_value_errors(value: Any) -> None:
    try:
        fp = fingerprint(value)
    except (TypeError, ValueError):
        return
    assert re.fullmatch(r"[0-9a-f]{64}", fp)


# == the ASGI middleware in front of a Starlette app ==============================================


@dataclass
class Runs:
    """What the app behind a front door ran."""

    calls: list[bytes] = field(default_factory=list)


RUNS = Runs()


@cache
def starlette_app() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def anything(request: Request) -> JSONResponse:
        body = await request.body()
        RUNS.calls.append(body)
        return JSONResponse({"n": len(RUNS.calls), "size": len(body)}, 201)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    return Starlette(routes=[Route("/{path:path}", anything, methods=methods)])


@dataclass
class HttpCase:
    method: str
    path: str
    query: bytes
    headers: Headers
    chunks: list[bytes]
    disconnect: bool
    require_key: bool


_paths = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=30).map(
    lambda p: "/" + p
)
_extra_headers = st.lists(
    st.tuples(
        st.sampled_from(
            [
                b"authorization",
                b"x-request-id",
                b"x-test",
                b"content-encoding",
                b"transfer-encoding",
                b"cookie",
            ]
        ),
        st.binary(max_size=60),
    ),
    max_size=3,
)


@st.composite
def http_cases(draw: st.DrawFn) -> HttpCase:
    body = draw(
        st.one_of(
            hostile_json, st.binary(min_size=MAX_REQUEST_BODY - 4, max_size=MAX_REQUEST_BODY + 4)
        )
    )
    headers: Headers = []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from([b"idempotency-key", b"x-idempotency-key"]))
        headers.append((name, draw(header_bytes)))
    ctype = draw(content_types)
    if ctype is not None:
        headers.append((b"content-type", ctype))
    length = _length_for(draw(lengths), body)
    if length is not None:
        headers.append((b"content-length", length))
    headers += draw(_extra_headers)
    headers = draw(st.permutations(headers))
    return HttpCase(
        method=draw(st.sampled_from(["POST", "POST", "PATCH", "PUT", "GET", "DELETE"])),
        path=draw(_paths),
        query=draw(st.binary(max_size=30)),
        headers=list(headers),
        chunks=chunked(body, draw(st.lists(st.integers(0, 10_000), max_size=3))),
        disconnect=draw(st.booleans()) and draw(st.booleans()),
        require_key=draw(st.booleans()),
    )


@HOSTILE
@given(case=http_cases(), anonymous=st.sampled_from(["run", "share", "refuse"]))
@example(
    case=HttpCase(
        "POST",
        "/",
        b"",
        [(b"idempotency-key", b"k"), (b"content-length", b"9" * 5000)],
        [b"{}"],
        False,
        False,
    ),
    anonymous="share",
)
def test_asgi_front_door(case: HttpCase, anonymous: str) -> None:
    """Hostile requests; the credentials among their headers (Authorization lines,
    cookies) name the caller, and a request without any is run unrecorded, refused
    or shared as ``anonymous`` says."""
    store = open_store("memory://")
    app = ASGIMiddleware(
        starlette_app(),
        store=store,
        require_key=case.require_key,
        max_request_body=MAX_REQUEST_BODY,
        anonymous=anonymous,
    )
    RUNS.calls.clear()
    try:
        answer = run(
            asgi_call(
                app,
                case.method,
                case.path,
                case.headers,
                case.chunks,
                query=case.query,
                disconnect=case.disconnect,
            )
        )
    except ClientDisconnect:  # Starlette's, to a request passed through: the server's to handle
        answer = Answer()
    if answer.status is None:  # the client left before its body was read: nothing ran
        event("client left")
        assert case.disconnect and RUNS.calls == [] and len(store) == 0
        return
    assert answer.status < 500, answer
    if answer.status >= 400:
        doc = is_problem(answer.status, answer.headers, answer.body)
        event(f"refused: {answer.status} {doc['code']}")
        assert doc["code"] in HTTP_CODES, doc
        assert RUNS.calls == [] and len(store) == 0
        return
    assert answer.status == 201 and len(RUNS.calls) == 1
    if len(store) == 0:  # not a keyed request: passed through
        event("passed through")
        return
    event("keyed: ran once, then replayed")
    [record] = store.records()
    assert record.status.value == "completed"
    again = run(asgi_call(app, case.method, case.path, case.headers, case.chunks, query=case.query))
    assert again.status == 201 and again.body == answer.body, again
    assert again.headers[b"idempotent-replayed"] == b"true" and len(RUNS.calls) == 1


# == the WSGI middleware in front of a Flask app, on SQLite =======================================


@cache
def sqlite_store() -> Store[Any]:
    root = Path(tempfile.mkdtemp(prefix="retrysafe-hostile-"))
    return open_store(f"sqlite:///{root}/hostile.db?synchronous=off")


@cache
def flask_app() -> Any:
    from flask import Flask, request

    app = Flask("hostile")

    @app.route("/", defaults={"path": ""}, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    @app.route("/<path:path>", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    def anything(path: str) -> tuple[dict[str, int], int]:
        body = request.get_data()
        RUNS.calls.append(body)
        return {"n": len(RUNS.calls), "size": len(body)}, 201

    return app


def _run_scope(request: Any) -> str | None:
    """Each example its own principal, so that keys never meet across examples."""
    return request.headers.get("x-hostile-run")  # type: ignore[no-any-return]


@cache
def wsgi_apps() -> dict[bool, Any]:
    return {
        required: WSGIMiddleware(
            flask_app().wsgi_app,
            store=sqlite_store(),
            require_key=required,
            max_request_body=MAX_REQUEST_BODY,
            principal=_run_scope,
        )
        for required in (False, True)
    }


def wsgi_call(app: Any, environ: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    started: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc: Any = None) -> Any:
        started.append((status, headers))
        return lambda data: None

    result = app(environ, start_response)
    try:
        body = b"".join(result)
    finally:
        getattr(result, "close", lambda: None)()
    status, headers = started[-1]
    return int(status.split()[0]), {k.lower(): v for k, v in headers}, body


@HOSTILE
@given(case=http_cases(), terminated=st.booleans())
@example(
    case=HttpCase(
        "POST",
        "/",
        b"",
        [(b"idempotency-key", b"k"), (b"content-length", "\u00b2".encode("latin-1"))],
        [b"{}"],
        False,
        False,
    ),
    terminated=False,
)
def test_wsgi_front_door(case: HttpCase, terminated: bool) -> None:
    app = wsgi_apps()[case.require_key]
    body = b"".join(case.chunks)
    environ: dict[str, Any] = {
        "REQUEST_METHOD": case.method,
        "SCRIPT_NAME": "",
        "PATH_INFO": case.path.encode("utf-8").decode("latin-1"),
        "QUERY_STRING": case.query.decode("latin-1"),
        "SERVER_NAME": "localhost",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": io.StringIO(),
        "wsgi.multithread": False,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
        "wsgi.input_terminated": terminated,
        "HTTP_X_HOSTILE_RUN": uuid.uuid4().hex,
    }
    for name, value in case.headers:
        text = value.decode("latin-1")
        if name in (b"content-type", b"content-length"):
            environ[name.decode().upper().replace("-", "_")] = text
        else:
            key = "HTTP_" + name.decode().upper().replace("-", "_")
            environ[key] = environ[key] + "," + text if key in environ else text
    store = sqlite_store()
    before = record_count(store)
    RUNS.calls.clear()
    status, headers, answer = wsgi_call(app, environ)
    assert status < 500, (status, answer[:300])
    if status >= 400:
        doc = is_problem(status, {k.encode(): v.encode() for k, v in headers.items()}, answer)
        event(f"refused: {status} {doc['code']}")
        assert doc["code"] in HTTP_CODES, doc
        assert RUNS.calls == [] and record_count(store) == before
        return
    assert status == 201 and len(RUNS.calls) == 1, (status, answer)
    event("keyed: ran once" if record_count(store) > before else "passed through")


# == Mesh =========================================================================================


@HOSTILE
@given(body=hostile_json)
@example(body=b"[" * 100_000)
@example(body=b"\xff\xfe")
@example(body=b"1e400")
def test_mesh_body_reader_gives_a_value_or_a_parse_error(body: bytes) -> None:
    value, refusal = loads(body)
    event("JSON" if refusal is None else "PARSE_ERROR")
    if refusal is None:
        # A JSON value; the NaN and Infinity literals are refused. (A number out of a
        # double's range, 1e400, reads as inf: it is refused where it counts, in the
        # fingerprinted arguments, with INVALID_REQUEST.)
        assert body.strip() not in (b"NaN", b"Infinity", b"-Infinity")
        json.dumps(value)
        return
    assert value is None
    [error] = refusal["errors"]
    assert error["code"] == "PARSE_ERROR" and error["retryable"] is False
    position = error["source"]["position"]
    assert isinstance(position, int) and position >= 0
    json.dumps(refusal, allow_nan=False)


_MISSING: Any = object()


class Deep(list):  # type: ignore[type-arg]
    """A list nested ``depth`` deep (in lists or objects), that reprs short: a report
    of a failing example must not recurse through it."""

    def __init__(self, depth: int, as_object: bool) -> None:
        value: Any = 1
        for _ in range(depth - 1):
            value = {"a": value} if as_object else [value]
        super().__init__([value])
        self.depth, self.as_object = depth, as_object

    def __repr__(self) -> str:
        return f"Deep({self.depth}, as_object={self.as_object})"


_hostile_values = st.one_of(
    _json_values,
    st.builds(Deep, st.integers(1, 600), st.booleans()),
    st.integers(min_value=10**300, max_value=10**4000),
)
_ttls = st.fixed_dictionaries(
    {
        "value": st.integers(1, 10**6) | st.integers() | st.floats() | st.text(max_size=3),
        "unit": st.sampled_from(["second", "days", "millisecond", "week", ""]) | _hostile_values,
    }
)
#: Where a Mesh request may be given a hostile value instead (JSON pointer parts).
_MESH_PATHS = [
    ("protocol",),
    ("id",),
    ("call",),
    ("call", "function"),
    ("call", "version"),
    ("call", "arguments"),
    ("context",),
    ("extensions",),
    ("extensions", 0),
    ("extensions", 0, "urn"),
    ("extensions", 0, "options"),
    ("extensions", 0, "options", "key"),
    ("extensions", 0, "options", "ttl"),
]


@st.composite
def mesh_envelopes(draw: st.DrawFn) -> dict[str, Any]:
    """A Mesh request with hostile arguments, often with one part replaced by a hostile value."""
    options: dict[str, Any] = {"key": draw(valid_keys)}
    if draw(st.booleans()):
        options["ttl"] = draw(_ttls)
    request: dict[str, Any] = {
        "protocol": draw(st.sampled_from([{"name": "mesh", "version": "0.1.0"}, "mesh/0.1"])),
        "id": draw(st.sampled_from(["req_1", "r"])),
        "call": {
            "function": draw(st.sampled_from(["charge", "charge", "nowhere"])),
            "arguments": draw(st.dictionaries(st.text(max_size=5), _hostile_values, max_size=3)),
        },
        "extensions": [{"urn": URN, "options": options}],
    }
    for _ in range(draw(st.integers(0, 2))):
        *parents, last = draw(st.sampled_from(_MESH_PATHS))
        node: Any = request
        for part in parents:
            inside = isinstance(node, dict) and part in node
            inside |= isinstance(node, list) and isinstance(part, int) and part < len(node)
            node = node[part] if inside else None
        if isinstance(node, dict):
            node[last] = draw(_hostile_values | key_values)
        elif isinstance(node, list) and node:
            node[0] = draw(_hostile_values)
    return request


MESH_REFUSALS = {
    "INVALID_REQUEST",
    "INVALID_ARGUMENTS",  # a key, or a ttl over the maximum
    "FUNCTION_NOT_FOUND",
    "PARSE_ERROR",
}


def _mesh_body(envelope: Any) -> bytes:
    return json.dumps(envelope, allow_nan=True).encode()


mesh_bodies = st.one_of(
    mesh_envelopes().map(_mesh_body),
    mesh_envelopes().map(_mesh_body),
    mesh_envelopes().map(_mesh_body),
    hostile_json,
    st.builds(lambda env, cut: _mesh_body(env)[:cut], mesh_envelopes(), st.integers(0, 200)),
)


@HOSTILE
@given(
    body=mesh_bodies,
    method=st.sampled_from(["POST"] * 6 + ["GET", "PUT"]),
    declared=lengths,
    cuts=st.lists(st.integers(0, 5000), max_size=2),
    ctype=content_types,
)
@example(body=b"{}", method="POST", declared="superscript", cuts=[], ctype=None)
@example(body=b"{}", method="POST", declared="huge", cuts=[], ctype=None)
@example(
    body=json.dumps(
        {
            "protocol": {"name": "mesh", "version": "0.1.0"},
            "id": "r",
            "call": {"function": "charge"},
            "extensions": [
                {"urn": URN, "options": {"key": "k", "ttl": {"value": 1e-249, "unit": "second"}}}
            ],
        }
    ).encode(),
    method="POST",
    declared="none",
    cuts=[],
    ctype=None,
)
def test_mesh_app(
    body: bytes, method: str, declared: str, cuts: list[int], ctype: bytes | None
) -> None:
    store = open_store("memory://")
    calls: list[Any] = []

    def charge(call: dict[str, Any]) -> Any:
        calls.append(call)
        return {"charged": call.get("arguments")}

    app = MeshApp({"charge": charge}, store, max_body=MAX_REQUEST_BODY * 16)
    caller = (b"authorization", b"Bearer hostile")
    headers: Headers = [caller] if ctype is None else [caller, (b"content-type", ctype)]
    length = _length_for(declared, body)
    if length is not None:
        headers.append((b"content-length", length))
    answer = run(asgi_call(app, method, "/", headers, chunked(body, cuts)))
    assert answer.status in (200, 400, 404, 405, 413), answer
    assert answer.headers[b"content-type"] == b"application/json"
    doc = answer.json()
    assert (
        {"protocol", "id", "result"}
        <= set(doc)
        <= {"protocol", "id", "result", "errors", "extensions"}
    ), doc
    if answer.status != 200 or "errors" in doc:
        [error] = doc["errors"]
        event(f"refused: {answer.status} {error['code']}")
        assert error["code"] in MESH_REFUSALS and error["retryable"] is False, error
        assert isinstance(error["message"], str) and error["message"]
        assert answer.status in (405, 413) or answer.status == status_of(doc)
        assert calls == [] and len(store) == 0
        return
    assert len(calls) == 1
    own = [e for e in doc.get("extensions", []) if e["urn"] == URN]
    if not own:  # a call without the idempotency extension: nothing kept
        assert len(store) == 0
        return
    assert own[0]["data"]["status"] == "processed"
    [record] = store.records()
    again = run(asgi_call(app, "POST", "/", [caller], [body]))
    [status] = [e["data"]["status"] for e in again.json()["extensions"] if e["urn"] == URN]
    if status == "processed":  # only if the request's own ttl ran out before its retry
        event("processed, expired (the request's ttl), processed again")
        assert record.expires_at <= time.time() and len(calls) == 2
    else:
        event("processed once, then cached")
        assert status == "cached" and len(calls) == 1, again


# == A2A ==========================================================================================


def _a2a_message(mid: Any, parts: Any, extra: dict[str, Any]) -> dict[str, Any]:
    return {"messageId": mid, "role": "user", "kind": "message", "parts": parts, **extra}


a2a_messages = st.builds(
    _a2a_message,
    mid=st.one_of(
        st.builds(lambda: str(uuid.uuid4())),
        st.builds(lambda: str(uuid.uuid4())),
        key_values,
        _hostile_values,
    ),
    parts=st.just([{"kind": "text", "text": "hi"}])
    | st.just([{"text": "hi"}])
    | st.lists(
        st.dictionaries(
            st.sampled_from(["kind", "text", "raw", "data", "url", "file", "metadata"]),
            _hostile_values,
            max_size=3,
        ),
        max_size=2,
    )
    | _hostile_values,
    extra=st.dictionaries(
        st.sampled_from(["contextId", "context_id", "taskId", "metadata", "role", "message_id"]),
        _hostile_values,
        max_size=2,
    ),
)
a2a_requests = st.builds(
    lambda method, rid, message, params: {
        "jsonrpc": "2.0",
        "id": rid,
        "method": method,
        "params": {"message": message, **params} if message is not _MISSING else params,
    },
    method=st.sampled_from(["message/send", "SendMessage"]),
    rid=st.one_of(
        st.integers(0, 10**6),
        st.text(max_size=5),
        st.integers(0, 10**6),
        st.none(),
        _hostile_values,
    ),
    message=st.one_of(a2a_messages, a2a_messages, a2a_messages, st.just(_MISSING), _hostile_values),
    params=st.dictionaries(
        st.sampled_from(["tenant", "metadata", "configuration"]), _hostile_values, max_size=2
    ),
)


@HOSTILE
@given(request=a2a_requests | _hostile_values, principal=st.text(max_size=10))
@example(
    request={
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendMessage",
        "params": {"message": {"messageId": "m", "parts": []}, "metadata": Deep(5000, False)},
    },
    principal="",
)
def test_a2a_send_parser_gives_a_send_none_or_invalid_key(request: Any, principal: str) -> None:
    try:
        send = parse_send(request, principal)
    except InvalidKeyError as exc:
        event("InvalidKeyError")
        assert str(exc)
        return
    event("not a send" if send is None else "a send")
    assert send is None or (isinstance(send, Send) and KEY_PATTERN.fullmatch(send.key))


@cache
def a2a_parts() -> tuple[Any, Any]:
    """The real a2a-sdk agent of ``_a2a_app.py`` (built once), and its counter."""
    from _a2a_app import Counter, agent_app

    counter = Counter(tempfile.mkdtemp(prefix="retrysafe-hostile-a2a-"))
    return agent_app(counter), counter


def _a2a_body(request: Any) -> bytes:
    return json.dumps(request, allow_nan=True).encode()


a2a_bodies = st.one_of(
    a2a_requests.map(_a2a_body),
    a2a_requests.map(_a2a_body),
    a2a_requests.map(_a2a_body),
    st.lists(a2a_requests, min_size=1, max_size=2).map(_a2a_body),
    hostile_json,
    st.builds(lambda r, cut: _a2a_body(r)[:cut], a2a_requests, st.integers(0, 300)),
)


@HOSTILE
@given(body=a2a_bodies, version=st.sampled_from([b"0.3", b"1.0"]), ctype=content_types)
@example(body=b"[" * 100_000, version=b"1.0", ctype=b"application/json")
@example(
    body=_a2a_body(
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "message/send",
            "params": {
                "message": {
                    "messageId": "m",
                    "role": "user",
                    "parts": [{"kind": "text", "text": "x"}],
                },
                "metadata": json.loads("[" * 900 + "]" * 900),
            },
        }
    ),
    version=b"0.3",
    ctype=b"application/json",
)
def test_a2a_front_door(body: bytes, version: bytes, ctype: bytes | None) -> None:
    agent, counter = a2a_parts()
    store = open_store("memory://")
    app = A2AMiddleware(agent, store=store, max_request_body=MAX_REQUEST_BODY * 64)
    tid = uuid.uuid4().hex
    headers: Headers = [(b"a2a-version", version), (b"x-test-id", tid.encode())]
    if ctype is not None:
        headers.append((b"content-type", ctype))
    answer = run(asgi_call(app, "POST", "/", headers, [body]))
    assert answer.status is not None and answer.status < 500, answer
    doc = answer.json() if answer.status == 200 else None
    error = doc.get("error") if isinstance(doc, dict) else None
    data = error.get("data") if isinstance(error, dict) else None
    code = data.get("code") if isinstance(data, dict) else None
    if isinstance(code, str) and code.startswith("idempotency_"):  # retrysafe refused it
        assert code in {
            "idempotency_key_invalid",
            "idempotency_batch_unsupported",
            "idempotency_body_too_large",
        }, doc
        assert error["code"] in (-32600, -32602) and error["message"]
        assert counter.count(tid) == 0 and len(store) == 0
        event(f"refused: {code}")
        return
    if not len(store):  # passed through, or a send that failed (retryable: nothing kept)
        event(f"answered by the app ({'agent ran' if counter.count(tid) else 'agent idle'})")
    else:  # a send the agent ran: once, and its retry is a replay
        event(f"send ({store.records()[0].status.value}), then repeated")
        runs = counter.count(tid)
        again = run(asgi_call(app, "POST", "/", headers, [body]))
        assert again.status == 200 and counter.count(tid) == runs
        if store.records()[0].status.value == "completed":
            assert again.headers.get(b"idempotent-replayed") == b"true", again


# == webhooks =====================================================================================

NOW = 1_763_900_000
STANDARD_KEY = b"k" * 24
SECRETS = {
    "shopify": "shpss_hostile",
    "stripe": "whsec_hostile",
    "standard": "whsec_" + base64.b64encode(STANDARD_KEY).decode(),
    "hmac": "hostile-secret",
}
REASONS = {
    "missing_header",
    "malformed_header",
    "bad_signature",
    "timestamp_out_of_tolerance",
    "no_event_id",
    "bad_secret",
    "unknown_scheme",
}


def _mac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


def signed(scheme: str, body: bytes, event_id: str, timestamp: str) -> dict[str, str]:
    """A delivery signed as the provider signs it (``event_id``, ``timestamp`` as given)."""
    if scheme == "shopify":
        mac = _mac(SECRETS[scheme].encode(), body)
        return {
            "X-Shopify-Hmac-Sha256": base64.b64encode(mac).decode(),
            "X-Shopify-Event-Id": event_id,
        }
    if scheme == "stripe":
        mac = _mac(
            SECRETS[scheme].encode(), timestamp.encode("utf-8", "surrogatepass") + b"." + body
        )
        return {"Stripe-Signature": f"t={timestamp},v1={mac.hex()}"}
    if scheme == "standard":
        message = f"{event_id}.{timestamp}.".encode("utf-8", "surrogatepass") + body
        sig = base64.b64encode(_mac(STANDARD_KEY, message)).decode()
        return {
            "webhook-id": event_id,
            "webhook-timestamp": timestamp,
            "webhook-signature": f"v1,{sig}",
        }
    mac = _mac(SECRETS[scheme].encode(), body)
    return {"X-Signature": "sha256=" + mac.hex(), "X-Event-Id": event_id}


_timestamps = st.one_of(
    st.integers(NOW - 1000, NOW + 1000).map(str),
    st.integers().map(str),
    st.sampled_from(
        [
            "9" * 400,
            "9" * 5000,
            "-" + "9" * 400,
            "1_763_900_000",
            "1e9",
            "",
            " ",
            "\u0661\u0667\u0666\u0663\u0669\u0660\u0660\u0660\u0660\u0660",
            "NaN",
            f"{NOW}.5",
            f" {NOW} ",
            f"+{NOW}",
            "0x10",
        ]
    ),
    st.text(max_size=12),
)
_event_ids = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["evt_1", "", " ", "\ud800"]),
    st.text(min_size=300, max_size=400),
)
_stripe_bodies = st.one_of(
    st.builds(lambda v: json.dumps({"id": v}, allow_nan=True).encode(), _hostile_values),
    hostile_json,
    st.just(b'{"id":"evt_1","x":' + b"[" * 5000 + b"]" * 5000 + b"}"),
)


@st.composite
def tampered(draw: st.DrawFn) -> tuple[str, list[tuple[Any, Any]], bytes]:
    """A delivery signed right for hostile fields, then perhaps tampered with."""
    scheme = draw(st.sampled_from(sorted(SCHEMES)))
    body = draw(_stripe_bodies if scheme == "stripe" else hostile_json)
    headers: list[tuple[Any, Any]] = list(
        signed(scheme, body, draw(_event_ids), draw(_timestamps)).items()
    )
    how = draw(
        st.sampled_from(
            ["none", "none", "body", "drop", "value", "bytes", "repeat", "case", "append"]
        )
    )
    if how == "body":
        body = draw(hostile_json)
    elif how == "drop" and headers:
        headers.pop(draw(st.integers(0, len(headers) - 1)))
    elif how == "value" and headers:
        i = draw(st.integers(0, len(headers) - 1))
        headers[i] = (headers[i][0], draw(key_values | _timestamps))
    elif how == "bytes" and headers:
        i = draw(st.integers(0, len(headers) - 1))
        headers[i] = (headers[i][0].encode(), draw(st.binary(max_size=80)))
    elif how == "repeat" and headers:
        name = headers[draw(st.integers(0, len(headers) - 1))][0]
        headers.insert(0, (name, draw(key_values)))
    elif how == "case":
        headers = [(k.upper(), v) for k, v in headers]
    elif how == "append" and headers:
        i = draw(st.integers(0, len(headers) - 1))
        headers[i] = (
            headers[i][0],
            headers[i][1] + draw(st.sampled_from([",", " ", ",v1=00", " v1,AAAA", "\x00"])),
        )
    return scheme, headers, body


@HOSTILE
@given(delivery=tampered(), tolerance=st.none() | st.sampled_from([0.0, 300.0, math.inf]))
@example(
    delivery=("standard", list(signed("standard", b"{}", "m", "9" * 400).items()), b"{}"),
    tolerance=None,
)
@example(
    delivery=("stripe", list(signed("stripe", b"[" * 50_000, "", str(NOW)).items()), b"[" * 50_000),
    tolerance=None,
)
@example(
    delivery=("standard", list(signed("standard", b"{}", "\ud800", str(NOW)).items()), b"{}"),
    tolerance=None,
)
def test_webhook_verify_returns_the_event_id_or_raises_signature_error(
    delivery: tuple[str, list[tuple[Any, Any]], bytes], tolerance: float | None
) -> None:
    scheme, headers, body = delivery
    try:
        event_id = verify(scheme, headers, body, SECRETS[scheme], tolerance=tolerance, now=NOW)
    except SignatureError as exc:
        event(f"SignatureError: {exc.reason}")
        assert exc.reason in REASONS and exc.code == "webhook_signature_invalid" and str(exc)
        return
    event("verified")
    assert isinstance(event_id, str) and event_id


@HOSTILE
@given(
    delivery=tampered(),
    method=st.sampled_from(["POST", "POST", "POST", "GET"]),
    declared=lengths,
)
def test_webhook_receiver_front_door(
    delivery: tuple[str, list[tuple[Any, Any]], bytes], method: str, declared: str
) -> None:
    scheme, pairs, body = delivery
    store = open_store("memory://")
    runs: list[str] = []

    def handler(d: Any) -> dict[str, str]:
        runs.append(d.event_id)
        return {"ok": d.key}

    receiver = Receiver(
        store,
        scheme=scheme,
        secrets=SECRETS[scheme],
        handler=handler,
        max_body=MAX_REQUEST_BODY,
        tolerance=math.inf,
    )
    headers: Headers = []
    for name, value in pairs:
        raw_name = name if isinstance(name, bytes) else name.encode()
        raw = value if isinstance(value, bytes) else value.encode("latin-1", "replace")
        headers.append((raw_name.lower(), raw))
    length = _length_for(declared, body)
    if length is not None:
        headers.append((b"content-length", length))
    answer = run(asgi_call(receiver.asgi, method, "/hooks", headers, [body]))
    assert answer.status is not None and answer.status < 500, answer
    if answer.status >= 400:
        doc = is_problem(answer.status, answer.headers, answer.body)
        assert doc["code"] in {
            "webhook_signature_invalid",
            "idempotency_body_too_large",
            "method_not_allowed",
        }, doc
        assert runs == [] and len(store) == 0
        event(f"refused: {answer.status} {doc.get('reason', doc['code'])}")
        return
    event("handled once, then duplicate")
    assert answer.status == 200 and runs and len(store) == 1
    again = run(asgi_call(receiver.asgi, method, "/hooks", headers, [body]))
    assert again.status == 200 and again.json()["status"] == "duplicate" and len(runs) == 1


@pytest.mark.parametrize("length", ["9" * 5000, "\u00b2", "-1", ""])
def test_webhook_receiver_wsgi_reads_any_content_length(length: str) -> None:
    store = open_store("memory://")
    receiver = Receiver(store, scheme="hmac", secrets=SECRETS["hmac"], handler=lambda d: None)
    body = b'{"x":1}'
    environ: dict[str, Any] = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/",
        "CONTENT_LENGTH": length,
        "wsgi.input": io.BytesIO(body),
        **{
            "HTTP_" + k.upper().replace("-", "_"): v
            for k, v in signed("hmac", body, "evt_1", "").items()
        },
    }
    status, headers, answer = wsgi_call(receiver.wsgi, environ)
    if length == "9" * 5000:  # past any limit: 413 before the body is read
        doc = is_problem(status, {k.encode(): v.encode() for k, v in headers.items()}, answer)
        assert doc["code"] == "idempotency_body_too_large" and len(store) == 0
    else:  # no length: no body (PEP 3333), so no signature matches
        assert status == 401 and len(store) == 0, answer


#: The properties, for ``scripts/fuzz.py``: the name a report gives each.
# == the gateway's head limit =====================================================================

#: The head limit of the fuzzed gateways: small, so that inputs cross it cheaply.
HEAD_LIMIT = 1024
_header_names = st.sampled_from(
    ["X-Pad", "Cookie", "Authorization", "Idempotency-Key", "X-Request-Id", "Forwarded", "A"]
)
_header_values = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=700
).map(str.strip)


@cache
def limited_gateway(parser: str) -> str:
    """The URL of a gateway served with ``parser`` and a ``HEAD_LIMIT``-byte head
    limit (its own health page answers; the upstream is never asked)."""
    from retrysafe._gateway.limits import protocol_class
    from retrysafe._ops.serve import ServerThread, bind
    from retrysafe.gateway import create_app

    app = create_app(
        "http://127.0.0.1:9", store="memory://", max_head_size=HEAD_LIMIT, sweep_every=None
    )
    server = ServerThread(
        app, bind("127.0.0.1", 0), http=protocol_class(parser), lifespan="off"
    ).start()
    atexit.register(server.stop)
    return server.url


def _exchange(url: str, pieces: list[bytes]) -> tuple[int, bytes]:
    """Send ``pieces`` on a fresh connection, one write each; the status and body
    of the answer (read to the connection's close)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        try:
            for piece in pieces:
                sock.sendall(piece)
        except OSError:  # refused before the rest was sent: the answer is already there
            pass
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@HOSTILE
@given(
    parser=st.sampled_from(["httptools", "h11"]),
    headers=st.lists(st.tuples(_header_names, _header_values), max_size=4),
    pad=st.integers(0, 2 * HEAD_LIMIT),
    cuts=st.lists(st.integers(0, 3 * HEAD_LIMIT), max_size=6),
)
@example(parser="httptools", headers=[], pad=HEAD_LIMIT - 70, cuts=[])
@example(parser="h11", headers=[], pad=HEAD_LIMIT - 70, cuts=[])
def test_gateway_head_limit(
    parser: str, headers: list[tuple[str, str]], pad: int, cuts: list[int]
) -> None:
    """A head of at most ``HEAD_LIMIT`` bytes is served, a longer one gets the 431
    problem, however its bytes are split into writes; the gateway answers the
    next client either way."""
    url = limited_gateway(parser)
    lines = ["GET /_retrysafe/health HTTP/1.1", "Host: gw.test", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers]
    lines.append(f"X-Fill: {'f' * pad}")
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode()
    status, body = _exchange(url, chunked(raw, sorted({c % (len(raw) + 1) for c in cuts})))
    if len(raw) <= HEAD_LIMIT:
        event("served")
        assert status == 200, (len(raw), body[:200])
    else:
        event("refused")
        assert status == 431, (len(raw), body[:200])
        assert json.loads(body)["code"] == "request_header_too_large"
    assert httpx.get(url + "/_retrysafe/health", timeout=30).status_code == 200


# == fields a record keeps, and what the CLI prints ================================================


@HOSTILE
@given(
    value=st.none()
    | st.text(max_size=300)
    | st.text(
        alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=120, max_size=140
    )
)
@example(value="r" * MAX_REQUEST_ID)
@example(value="r" * (MAX_REQUEST_ID + 1))
@example(value="\ud800")
def test_a_stored_request_id_is_bounded(value: str | None) -> None:
    """1 to 128 visible ASCII characters are kept as they are; anything else becomes
    ``sha256:`` and 64 hex digits; nothing kept is longer than 128 characters."""
    kept = stored_request_id(value)
    if not value:
        assert kept is None
    elif re.fullmatch(r"[\x21-\x7e]{1,128}", value):
        assert kept == value
    else:
        assert kept is not None and re.fullmatch(r"sha256:[0-9a-f]{64}", kept)
    assert kept is None or len(kept) <= MAX_REQUEST_ID


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


@HOSTILE
@given(text=st.text(max_size=200))
@example(text="\x1b[31mred\x1b[0m")
@example(text="a\u202eb")
def test_printed_client_text_holds_no_control_character(text: str) -> None:
    """What the CLI prints of a key or an operation has no control character that a
    terminal would obey, and Rich (as the CLI configures it) prints it verbatim."""
    from rich.console import Console

    shown = printable(text)
    assert not _UNPRINTABLE.search(shown), repr(shown)
    if not _UNPRINTABLE.search(text):
        assert shown == text
    out = io.StringIO()
    Console(file=out, markup=False, emoji=False, highlight=False, width=10_000).print(
        shown, end="", soft_wrap=True
    )
    assert out.getvalue() == shown


@HOSTILE
@given(
    sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=30),
    bound=st.integers(10_000, 100_000),
)
def test_the_memory_store_stays_within_max_bytes(sizes: list[int], bound: int) -> None:
    """Completed answers of any sizes: the store's byte count is the sum of its
    records' and never over ``max_bytes``; the newest record that fits replays."""
    store = MemoryStore(max_bytes=bound)
    engine = Engine(store, max_body=1 << 20)
    for i, size in enumerate(sizes):
        claim = engine.begin(f"k{i}")
        assert isinstance(claim, Claim)
        engine.complete(claim, Outcome(b"x" * size))
        assert store.bytes <= bound
        assert store.bytes == sum(record_bytes(r) for r in store.records(limit=1000))
        kept = store.get(claim.key_hash)
        if size + 2_000 <= bound:  # a record's own strings are a few hundred bytes
            assert kept is not None
        if kept is not None:
            assert isinstance(engine.begin(f"k{i}"), Replay)


TARGETS: dict[str, Callable[..., None]] = {
    "key header parser": test_key_header_parser_returns_a_key_or_raises_invalid_key,
    "fingerprint canonicaliser": test_fingerprint_canonicaliser_accepts_or_raises_body_error,
    "fingerprint invariance": test_the_fingerprint_ignores_key_order_and_whitespace,
    "argument fingerprints": test_argument_fingerprints_raise_only_type_or_value_errors,
    "ASGI front door": test_asgi_front_door,
    "WSGI front door (SQLite)": test_wsgi_front_door,
    "Mesh body reader": test_mesh_body_reader_gives_a_value_or_a_parse_error,
    "Mesh app": test_mesh_app,
    "A2A send parser": test_a2a_send_parser_gives_a_send_none_or_invalid_key,
    "A2A front door": test_a2a_front_door,
    "webhook verify": test_webhook_verify_returns_the_event_id_or_raises_signature_error,
    "webhook receiver": test_webhook_receiver_front_door,
    "key header bound": test_the_key_header_bound_is_exact,
    "gateway head limit": test_gateway_head_limit,
    "stored request id": test_a_stored_request_id_is_bounded,
    "printed client text": test_printed_client_text_holds_no_control_character,
    "memory store bytes": test_the_memory_store_stays_within_max_bytes,
}
