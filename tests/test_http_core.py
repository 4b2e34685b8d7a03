"""The HTTP core without a server: the key header, fingerprints, stored headers, answers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrysafe import InvalidKeyError, Outcome, Record, Replay, Status
from retrysafe._http.policy import OMITTED, HttpPolicy
from retrysafe._http.request import BodyError, parse_key, request_fingerprint
from retrysafe.http import MAX_KEY_HEADER

KEYS = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=255)


def sf_string(key: str) -> str:
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


@given(KEYS)
def test_any_key_round_trips_as_an_sf_string(key: str) -> None:
    assert parse_key([sf_string(key)]) == key


@given(KEYS.filter(lambda k: "," not in k and not k.startswith('"') and k.strip() == k))
def test_a_bare_key_is_taken_as_it_stands(key: str) -> None:
    assert parse_key([key]) == key
    assert parse_key([key, key]) == key  # a repeated line with the same key is one key
    assert parse_key([f"{key}, {sf_string(key)}"]) == key  # folded by a server


@given(st.lists(st.text(max_size=30), min_size=1, max_size=3))
def test_parse_key_only_ever_raises_invalid_key(values: list[str]) -> None:
    try:
        key = parse_key(values)
    except InvalidKeyError:
        return
    assert key is None or 1 <= len(key) <= 255


@pytest.mark.parametrize(
    "value, key",
    [
        ('"abc";v=1;x', "abc"),
        ('"a\\"b"', 'a"b'),
        ('"a\\\\b"', "a\\b"),
        ("  padded  ", "padded"),
        ('"with, comma"', "with, comma"),
        ('"x" ; a=?1', None),  # a space before ';' is not RFC 8941
    ],
)
def test_sf_string_forms(value: str, key: str | None) -> None:
    if key is None:
        with pytest.raises(InvalidKeyError):
            parse_key([value])
    else:
        assert parse_key([value]) == key


@pytest.mark.parametrize(
    "values",
    [
        [""],
        ["a", "b"],
        ["a,b"],
        ['"a", "b"'],
        ['"a'],
        ['"a\\n"'],
        ['"é"'],
        ["é"],
        ["k" * 256],
        ['"a" b'],
        ["a,"],
        [",a"],
        ["a\x00"],
    ],
)
def test_malformed_key_headers(values: list[str]) -> None:
    with pytest.raises(InvalidKeyError):
        parse_key(values)


def test_the_longest_legal_key_header_fits_the_bound() -> None:
    key = ('"\\' * 128)[:255]  # every character escaped when quoted
    quoted = sf_string(key)
    assert len(f"{quoted}, {quoted}") <= MAX_KEY_HEADER
    assert parse_key([f"{quoted}, {quoted}"]) == key


@pytest.mark.parametrize(
    "values",
    [
        ["k," * (2 << 20) + "k"],  # 4 MiB of one key repeated: a valid header, if a costly one
        ["k"] * (MAX_KEY_HEADER + 1),  # many short lines of the same key
        ['"' + "k" * MAX_KEY_HEADER + '"'],
    ],
    ids=["4MiB-comma-list", "many-lines", "one-long-member"],
)
def test_a_key_header_over_the_bound_is_refused_unparsed(values: list[str]) -> None:
    with pytest.raises(InvalidKeyError, match=f"the limit is {MAX_KEY_HEADER}"):
        parse_key(values)
    with pytest.raises(InvalidKeyError, match=f"the limit is {MAX_KEY_HEADER}"):
        HttpPolicy("memory://").key(values)


def test_no_header_is_no_key() -> None:
    assert HttpPolicy("memory://").key([]) is None


def test_fingerprint_canonicalises_json_only() -> None:
    fp = request_fingerprint
    j = "application/json; charset=utf-8"
    assert fp("POST", "/a", "", j, b'{"x":1,"y":2}') == fp("POST", "/a", "", j, b'{ "y":2, "x":1 }')
    assert fp("POST", "/a", "", "application/vnd.api+json", b'{"x":1}') == fp(
        "POST", "/a", "", j, b'{ "x": 1 }'
    )
    assert fp("POST", "/a", "", "text/plain", b'{"x":1}') != fp(
        "POST", "/a", "", "text/plain", b'{ "x":1}'
    )
    # Every part counts, and parts cannot be shifted into one another.
    base = fp("POST", "/a", "q=1", None, b"body")
    assert (
        len(
            {
                base,
                fp("PATCH", "/a", "q=1", None, b"body"),
                fp("POST", "/a/", "q=1", None, b"body"),
                fp("POST", "/a", "q=2", None, b"body"),
                fp("POST", "/a", "q=1", None, b"bodz"),
                fp("POST", "/aq=1", "", None, b"body"),
            }
        )
        == 6
    )


@pytest.mark.parametrize("body", [b"{", b"[1,", b"NaN", b'{"a": NaN}', b"[" * 100_000])
def test_bad_json_bodies_are_refused(body: bytes) -> None:
    with pytest.raises(BodyError) as info:
        request_fingerprint("POST", "/", "", "application/json", body)
    assert info.value.code == "idempotency_body_invalid" and info.value.status == 400


def test_a_keyed_fingerprint_needs_the_secret() -> None:
    """The stored fingerprint of a body holding a password is an HMAC: without the
    deployment secret, hashing guesses never finds it."""
    body = b'{"user":"alice","password":"hunter2"}'
    plain = request_fingerprint("POST", "/login", "", "application/json", body)
    keyed = request_fingerprint("POST", "/login", "", "application/json", body, b"s" * 32)
    assert keyed != plain
    assert keyed == request_fingerprint("POST", "/login", "", "application/json", body, b"s" * 32)
    assert keyed != request_fingerprint("POST", "/login", "", "application/json", body, b"t" * 32)


def test_sensitive_headers_are_not_stored_unless_allowed() -> None:
    headers = [
        ("Set-Cookie", "a=b"),
        ("Authorization", "x"),
        ("X-Id", "1"),
        ("Transfer-Encoding", "chunked"),
        ("Content-Type", "text/plain"),
    ]
    assert HttpPolicy("memory://").stored_headers(headers) == (
        ("x-id", "1"),
        ("content-type", "text/plain"),
    )
    allowed = HttpPolicy("memory://", store_headers=["set-cookie", "x-id"])
    assert allowed.stored_headers(headers) == (("set-cookie", "a=b"), ("x-id", "1"))
    dropped = HttpPolicy("memory://", drop_headers=["X-Id"])
    assert dropped.stored_headers(headers) == (("content-type", "text/plain"),)


def _replay(outcome: Outcome | None, status: Status = Status.COMPLETED) -> Replay:
    record = Record(
        key_hash="h",
        key="k",
        scope="",
        operation="http",
        fingerprint="fp",
        status=status,
        token="t",
        lease_until=0,
        expires_at=1,
        created_at=0,
        updated_at=0,
        outcome=outcome,
    )
    return Replay(record)


def test_answers_for_replays() -> None:
    policy = HttpPolicy("memory://", max_body=4)
    stored = policy.outcome(201, [("content-type", "text/plain"), ("x-a", "1")], b"abc", 3)
    answer = policy.replay(_replay(stored))
    assert (answer.status, answer.body) == (201, b"abc")
    assert answer.headers == [
        ("content-type", "text/plain"),
        ("x-a", "1"),
        ("idempotent-replayed", "true"),
    ]
    big = policy.outcome(200, [("content-type", "text/plain"), ("x-a", "1")], b"", 5)
    assert big.media_type == OMITTED and big.body == b""
    answer = policy.replay(_replay(big))
    assert answer.body == b"" and ("idempotent-body-omitted", "true") in answer.headers
    assert ("content-type", "text/plain") not in answer.headers and ("x-a", "1") in answer.headers
    final = policy.replay(_replay(None, Status.FAILED))
    assert final.status == 500 and json.loads(final.body)["code"] == "idempotency_failed"
    no_content = HttpPolicy("memory://", duplicate_response="no_content")
    assert no_content.replay(_replay(stored)).status == 204


@pytest.mark.parametrize(
    "options",
    [
        {"duplicate_response": "ignore"},
        {"fail_mode": "maybe"},
        {"header": ""},
        {"header": []},
        {"require_key": "yes"},
        {"scope": "tenant"},
        {"max_body": -1},
        {"ttl": 0},
    ],
)
def test_bad_options_fail_at_construction(options: dict[str, object]) -> None:
    with pytest.raises((TypeError, ValueError)):
        HttpPolicy("memory://", **options)  # type: ignore[arg-type]


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
    ),
    max_leaves=12,
)


@given(JSON_VALUES)
def test_the_fast_json_canonical_form_is_canonical_json(value: object) -> None:
    from retrysafe import canonical_json
    from retrysafe._http.request import _canonical

    text = json.dumps(value, indent=1, ensure_ascii=True)
    assert _canonical(text) == canonical_json(json.loads(text))


@pytest.mark.parametrize("body", [b"\xff{}", b"\xef\xbb\xbf{}", b"{} x", b" "])
def test_json_bodies_must_be_utf8_json(body: bytes) -> None:
    with pytest.raises(BodyError):
        request_fingerprint("POST", "/", "", "application/json", body)


def test_one_headers_class_serves_every_door() -> None:
    """The request headers (``retrysafe.http``) and a webhook's are one class: a
    case-insensitive mapping over str or bytes pairs that keeps repeats."""
    from retrysafe.http import Headers
    from retrysafe.webhooks import Headers as WebhookHeaders

    assert WebhookHeaders is Headers
    h = Headers([(b"X-Sig", b" v1 "), ("x-sig", "v2"), ("Content-Type", "application/json")])
    assert h["X-SIG"] == h.get("x-sig") == "v1"  # the first of repeated names, stripped
    assert h.getlist("X-Sig") == ["v1", "v2"]
    assert h.items() == [("x-sig", "v1"), ("x-sig", "v2"), ("content-type", "application/json")]
    assert list(h) == ["x-sig", "content-type"] and len(h) == 2
    assert "CONTENT-TYPE" in h and "missing" not in h and h.get("missing") is None
    assert h.first("missing", "x-sig") == "v1"
    assert Headers({"A": "1"}) == {"a": "1"}
    assert "v1" not in repr(h)  # names only: values may be secrets


async def test_recording_an_outcome_never_raises_for_the_store(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every door records through ``_core.recording``: a store that refuses the
    outcome is logged, and the answer still goes out."""
    from retrysafe import StoreUnavailableError
    from retrysafe._core.recording import arecord, record

    calls: list[tuple[str, object, object]] = []

    class Refusing:
        claim = None

        def complete(self, outcome: object) -> None:
            calls.append(("complete", outcome, None))
            raise StoreUnavailableError("down")

        def fail(self, outcome: object, *, final: object) -> None:
            calls.append(("fail", outcome, final))
            raise ValueError("too large")

        async def acomplete(self, outcome: object) -> None:
            self.complete(outcome)

        async def afail(self, outcome: object, *, final: object) -> None:
            self.fail(outcome, final=final)

    att: Any = Refusing()
    done = Outcome.json({"ok": True})
    record(att, done)
    record(att, done, failed=True, final=True)
    await arecord(att, None, final=False, answer="a webhook's answer")
    assert calls == [("complete", done, None), ("fail", done, True), ("fail", None, False)]
    assert caplog.text.count("was sent but not recorded") == 3
    assert "a webhook's answer was sent but not recorded" in caplog.text


RAW_HEADERS = st.lists(
    st.tuples(
        st.sampled_from(
            [b"content-type", b"Content-Type", b"x-a", b"set-cookie", b"connection", b"etag"]
        )
        | st.binary(min_size=1, max_size=8),
        st.binary(max_size=8) | st.just(b"x" * (40 << 10)),
    ),
    max_size=5,
)


@given(
    RAW_HEADERS,
    st.sampled_from([200, 201, 204, 302, 404, 408, 429, 500, 503]),
    st.integers(0, 4),
    st.sampled_from([{}, {"store_headers": ["x-a", "set-cookie"]}, {"final_failures": True}]),
)
def test_what_an_answer_records_is_its_verdict_in_one_pass(
    headers: list[tuple[bytes, bytes]], status: int, size: int, options: dict[str, Any]
) -> None:
    """The middleware's one-pass ``recorded`` gives what the verdict of the answer's
    outcome gives: the same headers kept, media type (an empty Content-Type too),
    omitted body, header bound and failure; so does the WSGI and Django doors'
    ``recorded_text`` of the same headers as str, in any case."""
    policy = HttpPolicy("memory://", max_body=2, **options)
    body = b"abcd"[:size] if size <= 2 else b""
    decoded = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
    expected = policy.verdict(status, policy.outcome(status, decoded, body, size))
    assert policy.recorded(status, headers, body, size) == expected
    assert policy.recorded_text(status, decoded, body, size) == expected
    titled = [(k.title(), v) for k, v in decoded]
    assert policy.recorded_text(status, titled, body, size) == policy.verdict(
        status, policy.outcome(status, titled, body, size)
    )


@pytest.mark.parametrize("body", [b' {"a":1}', b'{"a":1} ', b'\n\t{"a":1}\r\n', b'{ "a" : 1 }'])
def test_whitespace_around_a_json_body_is_not_fingerprinted(body: bytes) -> None:
    fp = request_fingerprint
    assert fp("POST", "/", "", "application/json", body) == fp(
        "POST", "/", "", "application/json", b'{"a":1}'
    )


def _key_or_error(parse: Any, value: str) -> object:
    try:
        return parse([value])
    except InvalidKeyError:
        return InvalidKeyError


@given(
    st.text(st.characters(min_codepoint=0, max_codepoint=0x200), max_size=300)
    | KEYS.map(lambda k: f" {k}\t")
    | KEYS.map(sf_string)
)
def test_the_policy_takes_one_key_line_as_parse_key_does(value: str) -> None:
    """The policy's shortcut for one bare key line answers what parse_key answers."""
    assert _key_or_error(HttpPolicy("memory://").key, value) == _key_or_error(parse_key, value)
