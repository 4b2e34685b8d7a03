"""The Redis record layout: version 2's compact fields, and records of version 1.

Version 2 stores a SHA-256 fingerprint as 32 bytes and an outcome's status, media
type and headers in a compact prefix; every record must still read back exactly,
and so must the records version 1 wrote (docs/stores.md, "Redis layout"). What a
live server does with version-1 records is in tests/test_redis_store.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from _redis_records import make_record, v1_value

from retrysafe import Outcome, Status
from retrysafe._model.record import Record
from retrysafe.stores.redis import LAYOUT_VERSION, record_from_value
from retrysafe.stores.redis.codec import _record_value

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


# -- version 2 -----------------------------------------------------------------------


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
    assert value[:1] == LAYOUT_VERSION == b"2"
    assert record_from_value(value, record.key_hash) == record


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
    and its content-type header one byte together, the content-length one byte."""
    outcome = Outcome(b'{"id":1}', 201, JSON_HEADERS, "application/json")
    token = "0123456789abcdef0123a"  # as the engine makes them: 21 hex digits
    compact = _record_value(_record(outcome=outcome, token=token))
    assert bytes.fromhex(SHA) in compact and SHA.encode() not in compact
    assert int.from_bytes(compact[56:60]) == 12
    assert compact[60:72] == b"\x01" + bytes.fromhex("0" + token)
    assert b"application/json" not in compact and b"content-length" not in compact
    assert len(compact) < len(v1_value(_record(outcome=outcome))) - 100


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
