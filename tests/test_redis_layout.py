"""The Redis record layout: version 3's short header and UUID keys, version 2's
compact fields, and records of versions 1 and 2.

Version 2 stores a SHA-256 fingerprint as 32 bytes and an outcome's status, media
type and headers in a compact prefix; version 3 adds a 44-byte header (one-byte
lengths, completed_at not stored twice) and a UUID key as 16 bytes. Every record
must still read back exactly, and so must the records versions 1 and 2 wrote
(docs/stores.md, "Redis layout"). What a live server does with them is in
tests/test_redis_store.py.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import pytest
from _redis_records import make_record, v1_value, v2_value

from retrysafe import Outcome, Status
from retrysafe._model.record import Record
from retrysafe.stores.redis import LAYOUT_VERSION, record_from_value
from retrysafe.stores.redis.codec import HEAD, LENGTHS, _record_value

SHA = "0123456789abcdef" * 4

#: A completed record as retrysafe wrote it before layout version 2 (attempts 2).
V1_COMPLETED = (
    b"1\x00\x00\x00\x02A\xda\xd2t\x80\x00\x00\x00A\xda\xd2\xc8\xe0\x00\x00\x00A\xda\xd2t\x87"
    b"\x80\x00\x00\x00c\x01A\xda\xd2t\x80 \x00\x00A\xda\xd2t\x80 \x00\x00\x00\x00\x00@\x00"
    b"\x00\x00$\x00\x00\x00\x03t0k0123456789abcdef0123456789abcdef0123456789abcdef01234567"
    b'89abcdef1\x00order-1\x00credentials:ab\x00http\x00req-1\x00[201,"application/json",'
    b'[["content-type","application/json"],["content-length","8"]]]\x00{"id":1}'
)


def _record(**changes: Any) -> Record:
    """A completed record (fingerprint SHA) with ``changes``."""
    done = {"fingerprint": SHA, "status": Status.COMPLETED, "updated_at": 1.5, "completed_at": 1.5}
    return make_record(**{**done, **changes})


# -- versions 2 and 3 ----------------------------------------------------------------


JSON_HEADERS = (("content-type", "application/json"), ("content-length", "8"))


@pytest.mark.parametrize(
    "outcome",
    [
        Outcome.json({"id": 1}),
        Outcome(b'{"id":1}', 201, JSON_HEADERS, "application/json"),
        Outcome(b"", 204),
        Outcome(b"body", 200, (("content-length", "99"),), "text/plain"),  # not the body's
        Outcome(b"x", 200, (("Content-Type", "text/csv"),), "text/csv"),
        Outcome(b"x", 200, (("content-type", "text/html"),), "application/json"),
        Outcome(b"x", 0, (("x-\u00e9", "v\udcff\u2603"), ("x-a", "")), "t/\u00fc"),
        Outcome(b"x", 100, (), "application/json"),  # the status in one byte: 100-355
        Outcome(b"x", 355, (), "application/json"),
        Outcome(b"x", 356, (("content-length", "1"),), "application/json"),  # two bytes
        Outcome(b"x", 99, (), "application/json"),
        Outcome(b"x", 65535, (), "application/octet-stream"),  # past uint16's 0xFFFF mark
        Outcome(b"x", -1, (), "text/plain; charset=utf-8"),
        Outcome(b"x", 200, (("x-big", "v" * 70_000),), "text/plain"),
        Outcome(b"x", 200, (("n" * 300, "v"),), "m" * 300),
        Outcome(b"x", 200, tuple((f"x-{i}", "v") for i in range(300)), "text/plain"),
        Outcome(b"\x00\x01[", None, (("content-length", "3"),), ""),
    ],
    ids=lambda o: f"{o.status}-{o.media_type[:20]}-{len(o.headers)}",
)
def test_outcomes_round_trip(outcome: Outcome) -> None:
    record = _record(outcome=outcome)
    value = _record_value(record)
    assert value[:1] == LAYOUT_VERSION == b"3"
    assert record_from_value(value, record.key_hash) == record
    assert record_from_value(v2_value(record), record.key_hash) == record


@pytest.mark.parametrize(
    "fingerprint",
    [SHA, SHA.upper(), SHA[:63], "fp", "", "\x00" + SHA[1:], "\x01x", "\x00", "ü" * 40],
    ids=["sha256", "upper", "short", "text", "empty", "nul", "soh", "nul-only", "unicode"],
)
def test_fingerprints_round_trip(fingerprint: str) -> None:
    record = _record(fingerprint=fingerprint, outcome=Outcome(b"x"))
    assert record_from_value(_record_value(record), record.key_hash) == record


@pytest.mark.parametrize(
    "token",
    ["ab12", "abc", "0ab", "0", "0" * 41, "ABC", "tok", "", "\x00t", "\x02", "g" + "a" * 30],
)
def test_tokens_round_trip(token: str) -> None:
    record = _record(token=token)
    assert record_from_value(_record_value(record), record.key_hash) == record


def test_the_compact_fields_store_nothing_twice() -> None:
    """A SHA-256 takes 33 bytes, a hex token half its length and one, the media type
    and its content-type header one byte together, the content-length one byte, a
    completed_at equal to updated_at nothing, a UUID key 16 bytes."""
    outcome = Outcome(b'{"id":1}', 201, JSON_HEADERS, "application/json")
    token = "0123456789abcdef0123a"  # as the engine makes them: 21 hex digits
    key = str(uuid.uuid4())
    record = _record(outcome=outcome, token=token, key=key)
    compact = _record_value(record)
    assert bytes.fromhex(SHA) in compact and SHA.encode() not in compact
    assert compact[31] == 2  # completed_at: the same as updated_at
    assert LENGTHS.unpack_from(compact, HEAD.size)[0] == 12
    assert compact[44:56] == b"\x01" + bytes.fromhex("0" + token)
    assert b"application/json" not in compact and b"content-length" not in compact
    assert key.encode() not in compact and uuid.UUID(key).bytes in compact
    assert len(compact) < len(v2_value(record)) - 30
    assert len(v2_value(record)) < len(v1_value(record)) - 100


@pytest.mark.parametrize(
    ("changes", "version"),
    [
        ({"completed_at": 1.25}, b"3"),  # not updated_at: stored
        ({"completed_at": None, "status": Status.FAILED, "final": True}, b"3"),
        ({"token": "t" * 300}, b"2"),  # too long for version 3's lengths: version 2
        ({"fingerprint": "x" * 300}, b"2"),
        ({"request_payload": b"p\x00" * 40_000}, b"2"),
        ({"request_payload": b"p\x00q", "request_id": "r\x00", "metadata": {"a": [1]}}, b"3"),
        ({"attempts": 70_000, "retention": "financial"}, b"3"),
    ],
    ids=[
        "completed-apart",
        "failed",
        "long-token",
        "long-fingerprint",
        "big-payload",
        "json-fields",
        "financial",
    ],
)
def test_every_record_reads_back(changes: dict[str, Any], version: bytes) -> None:
    for key in ("order-1", str(uuid.uuid4())):
        record = _record(key=key, outcome=Outcome.json([1]), **changes)
        value = _record_value(record)
        assert value[:1] == version
        read = record_from_value(value, record.key_hash)
        assert read == dataclasses.replace(record, attempts=1)  # a claim writes attempt 1
        assert record_from_value(v2_value(record), record.key_hash) == record


@pytest.mark.parametrize(
    "key",
    [
        str(uuid.uuid4()),
        str(uuid.uuid4()).upper(),  # stored as its text: the bytes would lose the case
        "{" + str(uuid.uuid4()) + "}",
        str(uuid.uuid4())[:-1] + "g",
        str(uuid.UUID(int=0)),
    ],
    ids=["uuid", "upper", "braced", "not-hex", "nil"],
)
@pytest.mark.parametrize(
    "changes",
    [{}, {"request_id": "r"}, {"request_payload": b"\x00p"}, {"scope": "a\x00b"}],
    ids=["plain", "request-id", "payload", "json-fields"],
)
def test_uuid_keys_round_trip(key: str, changes: dict[str, Any]) -> None:
    record = _record(key=key, **changes)
    value = _record_value(record)
    assert (key.encode() in value) is (key != key.lower() or len(key) != 36 or "g" in key)
    assert record_from_value(value, record.key_hash) == record


HEX32 = "fedcba9876543210" * 2  # not in the fingerprint SHA


@pytest.mark.parametrize(
    ("scope", "digest"),
    [
        (f"credentials:{HEX32}", True),  # what the HTTP doors make of credentials
        (f":{HEX32}", True),
        (f"a:b:{HEX32}", True),
        (f"credentials:{HEX32.upper()}", False),
        (f"credentials:{HEX32}0", False),
        (f"credentials:{HEX32[1:]}", False),
        (HEX32, False),
        (f"credentials-{HEX32}", False),
        (f"a\x00b:{HEX32}", True),  # with JSON fields
        ("", False),
    ],
)
@pytest.mark.parametrize("key", ["order-1", str(uuid.uuid4())])
@pytest.mark.parametrize("changes", [{}, {"request_payload": b"\x00p", "request_id": "r"}])
def test_scope_digests_round_trip(
    scope: str, digest: bool, key: str, changes: dict[str, Any]
) -> None:
    record = _record(key=key, scope=scope, **changes)
    value = _record_value(record)
    assert (HEX32.encode() in value) is (not digest and HEX32 in scope)
    assert (bytes.fromhex(HEX32) in value) is digest
    assert record_from_value(value, record.key_hash) == record


@pytest.mark.parametrize("flags", [b"/", b"p", b"\x00", b"\xff"])
def test_unknown_claim_flags_are_malformed(flags: bytes) -> None:
    value = bytearray(_record_value(_record(key="k")))
    at = value.index(b"0\x00k\x00")
    value[at : at + 1] = flags
    with pytest.raises(ValueError, match="claim flags"):
        record_from_value(bytes(value), "h" * 64)


def test_a_record_of_version_1_reads_the_same() -> None:
    record = record_from_value(V1_COMPLETED, "h" * 64)
    assert record == _record(
        key="order-1",
        scope="credentials:ab",
        operation="http",
        token="t0k",
        lease_until=1800000030.0,
        expires_at=1800086400.0,
        created_at=1800000000.0,
        updated_at=1800000000.5,
        completed_at=1800000000.5,
        attempts=2,
        request_id="req-1",
        outcome=Outcome(b'{"id":1}', 201, JSON_HEADERS, "application/json"),
    )
    assert v1_value(record) == V1_COMPLETED  # the test's writer is version 1's
