"""The engine's compact JSON and key hash give what the standard library gives."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_http_core import JSON_VALUES

from retrysafe._model import hashing
from retrysafe._model.hashing import json_default, key_hash
from retrysafe._model.json_text import compact_encoder, json_value

#: JSON values with tuples in them too (the encoders write a tuple as a list).
_values = JSON_VALUES | st.tuples(JSON_VALUES, JSON_VALUES)


def _standard(sort_keys: bool, default: Any = None) -> Any:
    return json.JSONEncoder(
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
        sort_keys=sort_keys,
        default=default,
    ).encode


@given(_values, st.booleans())
def test_the_same_text_as_the_standard_encoder(value: Any, sort_keys: bool) -> None:
    assert compact_encoder(sort_keys=sort_keys)(value) == _standard(sort_keys)(value)


def _outcome(encode: Any, value: Any) -> tuple[Any, ...]:
    try:
        return ("ok", encode(value))
    except Exception as exc:
        return (type(exc), str(exc))


def test_the_same_errors_as_the_standard_encoder() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    inner: dict[str, Any] = {}
    inner["x"] = [inner]
    for sort_keys in (False, True):
        fast, standard = compact_encoder(sort_keys=sort_keys), _standard(sort_keys)
        for bad in (cycle, inner, float("nan"), float("inf"), object(), {(1,): 2}):
            got = _outcome(fast, bad)
            assert got == _outcome(standard, bad) and got[0] != "ok"
        got = _outcome(fast, {1: 2, "1": 3})
        assert got == _outcome(standard, {1: 2, "1": 3})
    fast = compact_encoder(sort_keys=True, default=json_default)
    standard = _standard(True, json_default)
    for value in ({"s": {3, 1}, "b": b"\x00"}, [cycle], object()):
        assert _outcome(fast, value) == _outcome(standard, value)


def test_a_value_deeper_than_the_recursion_limit_fails_as_before() -> None:
    deep: Any = 1
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(RecursionError):
        compact_encoder()(deep)


@given(st.text(max_size=40), st.text(max_size=40), st.text(min_size=1, max_size=255))
def test_key_hash_is_sha256_of_the_length_prefixed_parts(scope: str, op: str, key: str) -> None:
    text = f"{len(scope)}:{scope}{len(op)}:{op}{len(key)}:{key}"
    want = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    try:
        got = key_hash(scope, op, key)
    except UnicodeEncodeError:  # a lone surrogate: refused as before
        with pytest.raises(UnicodeEncodeError):
            hashlib.sha256(text.encode())
        return
    assert got == want


def test_key_hash_heads_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "_MAX_HEADS", 3)
    monkeypatch.setattr(hashing, "_heads", {})
    for i in range(10):
        assert key_hash(f"s{i}", "op", "k") == key_hash(f"s{i}", "op", "k")
    assert len(hashing._heads) <= 3
    long = "s" * 600  # a head past _MAX_HEAD is made each time and never kept
    assert key_hash(long, "op", "k") == hashlib.sha256(f"600:{long}2:op1:k".encode()).hexdigest()
    assert (long, "op") not in hashing._heads


def _read(read: Any, data: bytes) -> tuple[Any, ...]:
    try:
        return ("ok", repr(read(data)))
    except Exception as exc:
        return (type(exc), str(exc))


@given(_values)
def test_json_value_reads_what_json_loads_reads(value: Any) -> None:
    for data in (
        compact_encoder()(value).encode(),
        json.dumps(value).encode(),
        json.dumps(value, indent=1).encode("utf-16"),
    ):
        assert _read(json_value, data) == _read(json.loads, data)


@given(
    st.binary(max_size=12) | st.sampled_from([b'{"a":1}x', b"[1] ", b"\xef\xbb\xbf1", b"1\x00\x00"])
)
def test_json_value_fails_as_json_loads_fails(data: bytes) -> None:
    assert _read(json_value, data) == _read(json.loads, data)


def test_a_cycle_under_a_raised_recursion_limit_is_refused_not_a_crash() -> None:
    # In a child process: on the old code this ended the process (the C stack ran out
    # before the raised limit), which would take the test run down with it.
    code = (
        "import sys, threading\n"
        "from retrysafe import Outcome\n"
        "from retrysafe._model.json_text import compact_encoder\n"
        "sys.setrecursionlimit(100_000)\n"
        "cycle = []\n"
        "cycle.append(cycle)\n"
        "def run():\n"
        "    for encode in (compact_encoder(), Outcome.json):\n"
        "        try:\n"
        "            encode(cycle)\n"
        "        except ValueError as exc:\n"
        "            print(exc)\n"
        "thread = threading.Thread(target=run)\n"
        "thread.start()\n"
        "thread.join()\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("Circular reference detected") == 2


def test_json_bytes_writes_compact_utf8_and_escapes_what_utf8_cannot_carry():
    from retrysafe._model.json_text import json_bytes

    assert json_bytes({"a": "é", "b": [1, 2]}) == '{"a":"é","b":[1,2]}'.encode()
    # A lone surrogate that arrived as "\ud800" leaves as it came, not as an error.
    assert json_bytes({"k": "\ud800"}) == b'{"k":"\\ud800"}'
    assert json.loads(json_bytes({"k": "\ud800x"})) == {"k": "\ud800x"}
