"""The gateway's one-pass header paths give what the general paths give.

An upstream answer's common head (CRLF line ends) is read in one pass
(``_plain_answer``) and a request's headers are filtered in one pass
(``_Proxy.headers``); every other head goes to the general path. Here both run on
the same generated heads: where the fast path answers, it answers exactly as the
general path does, and the heads it routes elsewhere (folded lines, LF line ends,
Transfer-Encoding, repeated lengths, HEAD, 1xx, 204, 304) are routed elsewhere.
The pool reads the same answers however their bytes arrive.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrysafe._gateway.upstream import _LENGTH, Pool, _final, _parse_head, _plain_answer
from retrysafe.errors import UpstreamError
from retrysafe.gateway import FORWARDING_HEADERS, _Proxy, parse_upstream, trusted_networks

ANSWER_FIELDS = [
    (b"Content-Type", b"application/json"),
    (b"content-length", b"34"),
    (b"Content-Length", b" 34 "),
    (b"content-length", b"12"),
    (b"content-length", b"34, 34"),
    (b"content-length", b"x"),
    (b"content-length", b"1234567890123456789"),
    (b"Transfer-Encoding", b"chunked"),
    (b"Connection", b"close"),
    (b"Connection", b"keep-alive"),
    (b"connection", b"Keep-Alive, X-Secret"),
    (b"Connection", b"content-length"),
    (b"Connection", b" , "),
    (b"Keep-Alive", b"timeout=5"),
    (b"Proxy-Authenticate", b"Basic"),
    (b"X-Secret", b"s"),
    (b"Set-Cookie", b"a=b"),
    (b"set-cookie", b"c=d"),
    (b"date", b"Fri, 27 Nov 2026 12:00:00 GMT"),
    (b"X-Empty", b""),
    (b"X-Tab", b"\ta\tb\t"),
    (b"X-Latin", b"caf\xe9"),
    (b"Upgrade", b"h2c"),
    (b"Trailer", b"x-t"),
    (b"Expect", b"100-continue"),
]
STATUS_LINES = [
    b"HTTP/1.1 200 OK",
    b"HTTP/1.1 201 Created",
    b"HTTP/1.0 200 OK",
    b"HTTP/1.1 404",
    b"HTTP/1.1 204 No Content",
    b"HTTP/1.1 304 Not Modified",
    b"HTTP/1.1 100 Continue",
    b"HTTP/1.1 500 Server\tError",
    b"HTTP/2 200 OK",
    b"HTTP/1.1 20 OK",
]


def general(method: str, head: bytes) -> Any:
    """What the general path makes of a final answer's head (or the error it raises)."""
    try:
        http11, status, headers = _parse_head(head)
        if status < 200:
            return "interim"
        mode, length, keep, headers = _final(method, http11, status, headers)
    except UpstreamError as exc:
        return ("error", exc.kind)
    return status, mode, length, keep, headers


@st.composite
def answer_heads(draw: st.DrawFn) -> bytes:
    eol = draw(st.sampled_from([b"\r\n", b"\n"]))
    lines = [draw(st.sampled_from(STATUS_LINES))]
    for name, value in draw(st.lists(st.sampled_from(ANSWER_FIELDS), max_size=8)):
        space = draw(st.sampled_from([b"", b" ", b"\t ", b"  "]))
        lines.append(name + b":" + space + value + draw(st.sampled_from([b"", b" ", b"\t"])))
        if draw(st.integers(0, 30)) == 0:
            lines.append(b" folded")
        if draw(st.integers(0, 40)) == 0:
            lines.append(b"bad line")
    return eol.join([*lines, b"", b""])


@settings(max_examples=400, deadline=None)
@given(answer_heads(), st.sampled_from(["GET", "POST", "HEAD", "PUT"]))
def test_the_one_pass_answer_head_is_the_general_one(head: bytes, method: str) -> None:
    plain = _plain_answer(method, head)
    if plain is None:
        return
    status, length, headers, keep = plain
    assert general(method, head) == (status, _LENGTH, length, keep, headers)


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 34\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ndate: x\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n",
        b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Tab:\ta\tb\t\r\nX-Empty:\r\nContent-Length:  5 \r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close, x-a\r\nx-a: 1\r\n\r\n",
    ],
)
def test_common_answer_heads_take_the_one_pass_path(head: bytes) -> None:
    plain = _plain_answer("POST", head)
    assert plain is not None
    status, length, headers, keep = plain
    assert general("POST", head) == (status, _LENGTH, length, keep, headers)
    assert all(name == name.lower() for name, _ in headers)


@pytest.mark.parametrize(
    ("method", "head"),
    [
        ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"),
        ("GET", b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n"),
        ("GET", b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n"),
        ("GET", b"HTTP/1.1 100 Continue\r\n\r\n"),
        ("GET", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"),
        ("GET", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n"),
        ("GET", b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\n"),
        ("GET", b"HTTP/1.1 200 OK\r\nX-A: 1\r\n folded\r\nContent-Length: 5\r\n\r\n"),
        ("GET", b"HTTP/1.1 200 OK\r\nX-A: 1\r\n\r\n"),  # runs to the close
        ("GET", b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 5\r\n\r\n"),
        ("GET", b"HTTP/1.1 200 OK\r\nX A: 1\r\nContent-Length: 5\r\n\r\n"),
        # LF line ends (RFC 9112 2.2 lets a recipient take them): read the general way
        ("GET", b"HTTP/1.1 200 OK\ndate: x\nContent-Length: 0\nConnection: keep-alive\n\n"),
        ("GET", b"HTTP/1.1 200 OK\r\nContent-Length: 5\n\r\n"),
        ("GET", b"HTTP/1.1 200 OK\r\nX-A: 1\r\n\r\nContent-Length: 5\r\n\r\n"),
        ("GET", b"HTTP/1.1 200 OK\r\nX-A: \x00\r\nContent-Length: 5\r\n\r\n"),
    ],
)
def test_other_answer_heads_go_to_the_general_path(method: str, head: bytes) -> None:
    assert _plain_answer(method, head) is None


REQUEST_FIELDS = [
    (b"content-type", b"application/json"),
    (b"Content-Length", b"49"),
    (b"authorization", b"Bearer t"),
    (b"idempotency-key", b"k-1"),
    (b"Host", b"gw.example"),
    (b"host", b"second.example"),
    (b"X-Forwarded-For", b"10.9.9.9"),
    (b"x-forwarded-for", b" "),
    (b"X-Forwarded-Host", b"front.example"),
    (b"x-forwarded-proto", b"https"),
    (b"X-Forwarded-Port", b"443"),
    (b"Forwarded", b"for=1.2.3.4"),
    (b"X-Real-IP", b"1.2.3.4"),
    (b"Connection", b"keep-alive"),
    (b"connection", b"close"),
    (b"Connection", b"X-Hop"),
    (b"connection", b"x-forwarded-host"),
    (b"Connection", b"Host"),
    (b"X-Hop", b"1"),
    (b"TE", b"trailers"),
    (b"Expect", b"100-continue"),
    (b"Proxy-Authorization", b"Basic x"),
    (b"keep-alive", b"5"),
    (b"Cookie", b"a=b"),
    (b"X-" + b"Long" * 40, b"v"),
]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(REQUEST_FIELDS), max_size=10),
    st.booleans(),
    st.sampled_from([("10.0.0.5", 4000), ("192.0.2.1", 5000), None]),
)
def test_the_one_pass_request_headers_are_the_general_ones(
    fields: list[tuple[bytes, bytes]], trusting: bool, client: Any
) -> None:
    proxy = _Proxy(
        parse_upstream("http://127.0.0.1:9000/base"),
        5.0,
        trusted_networks(["10.0.0.0/8"] if trusting else []),
    )
    scope = {"type": "http", "scheme": "https", "headers": fields, "client": client}
    fast = proxy.headers(scope)
    # The same headers behind a Connection header that sends them to the general path.
    forced = dict(scope, headers=[(b"connection", b"x-never-sent"), *fields])
    assert proxy.headers(forced) == fast
    assert fast[0] == (b"host", b"127.0.0.1:9000")
    names = {name for name, _ in fast}
    assert not names & {b"connection", b"te", b"expect", b"keep-alive", b"proxy-authorization"}
    if not proxy.trusts(client):
        assert not names & FORWARDING_HEADERS
        assert b"x-forwarded-port" not in names
        sent = [value for name, value in fast if name == b"x-forwarded-for"]
        assert sent == ([client[0].encode()] if client else [])


HELLO = [(b"content-length", b"5")]
ANSWERS = [
    # the common head: read where it lies in the connection's buffer
    (
        b"HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\ncontent-length: 5\r\n\r\nhello",
        201,
        [(b"content-type", b"text/plain"), *HELLO],
    ),
    (
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX-A: 1\r\n\r\n",
        200,
        [
            (b"content-length", b"0"),
            (b"x-a", b"1"),
        ],
    ),
    # every other head: read the general way
    (b"HTTP/1.1 200 OK\nContent-Length: 5\nX-A: 1\n\nhello", 200, [*HELLO, (b"x-a", b"1")]),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 202 OK\r\nContent-Length: 5\r\n\r\nhello", 202, HELLO),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 200, []),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello", 200, HELLO),
    (
        b"HTTP/1.1 200 OK\r\nX-A: 1\r\n b\r\nContent-Length: 5\r\n\r\nhello",
        200,
        [
            (b"x-a", b"1 b"),
            *HELLO,
        ],
    ),
]


@pytest.mark.parametrize(("answer", "status", "headers"), ANSWERS)
@pytest.mark.parametrize("cut", [None, 1, 15, -9, -5, -1])
def test_an_answer_reads_the_same_however_its_bytes_arrive(
    answer: bytes, status: int, headers: list[tuple[bytes, bytes]], cut: int | None
) -> None:
    """The pool reads a common head from its buffer at once when it is all there, else
    waits for the rest: either way the same answer, and its connection is kept."""

    async def scenario() -> list[tuple[int, list[tuple[bytes, bytes]], bytes, int]]:
        pieces = [answer] if cut is None else [answer[:cut], answer[cut:]]

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await reader.readuntil(b"\r\n\r\n"):
                for piece in pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Pool(("127.0.0.1", port, None), None, 30.0, asyncio.get_running_loop())
        results = []
        for _ in range(2):  # the second on the kept-alive connection
            got = await pool.send("GET", b"/", [(b"host", b"upstream")], b"")
            data = b""
            while chunk := await got.read():
                data += chunk
            results.append((got.status, got.headers, data, pool._open))
        await pool.aclose()
        server.close()
        return results

    body = b"hello" if answer.endswith((b"hello", b"0\r\n\r\n")) else b""
    assert asyncio.run(scenario()) == [(status, headers, body, 1)] * 2


def test_a_kept_alive_connections_later_wait_still_times_out() -> None:
    """A connection's one timer, armed by a first wait, moves on to the deadline of
    a later one: an upstream that never answers the second request times out."""

    async def scenario() -> UpstreamError:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await reader.readuntil(b"\r\n\r\n")  # and no answer
            await reader.read()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Pool(("127.0.0.1", port, None), None, 0.3, asyncio.get_running_loop())
        first = await pool.send("GET", b"/", [(b"host", b"upstream")], b"")
        assert await first.read() == b"ok"
        with pytest.raises(UpstreamError) as caught:
            await pool.send("GET", b"/", [(b"host", b"upstream")], b"")
        assert pool._open == 0
        await pool.aclose()
        server.close()
        return caught.value

    error = asyncio.run(scenario())
    assert error.timeout and error.kind == "ReadTimeout"
