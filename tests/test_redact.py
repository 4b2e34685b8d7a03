"""Store URLs and connection strings lose every password before they are shown.

``redact`` feeds the CLI's start-up lines and errors, the logs, store reprs and
the dashboard's ``api/stats``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from retrysafe import open_store
from retrysafe.stores import redact
from retrysafe.stores.postgres import PostgresStore

ENV = {**os.environ, "RETRYSAFE_STORE": ""}

CASES = [
    ("redis://u:pa/ss@h:6379/0", "redis://u:***@h:6379/0"),
    ("redis://u:p@ss@h", "redis://u:***@h"),
    ("redis://:s3cret@127.0.0.1:1/0", "redis://:***@127.0.0.1:1/0"),
    ("rediss://u:p?s#s@h/0", "rediss://u:***@h/0"),
    ("redis+cluster://u:a://b@h:7000", "redis+cluster://u:***@h:7000"),
    ("unix://:pw@/tmp/redis.sock?db=0", "unix://:***@/tmp/redis.sock?db=0"),
    ("redis://h/0?password=pw&prefix=x", "redis://h/0?password=***&prefix=x"),
    (
        "postgresql://u@h/db?sslpassword=pw&sslmode=require",
        "postgresql://u@h/db?sslpassword=***&sslmode=require",
    ),
    ("postgresql://u@h/db?PassWord=pw", "postgresql://u@h/db?PassWord=***"),
    (
        "postgresql://u@h/db?redis_password=pw&token=t",
        "postgresql://u@h/db?redis_password=***&token=***",
    ),
    ("postgresql://u:s3cr%zzet@h/db", "postgresql://u:***@h/db"),
    ("host=h port=5432 password=pw dbname=d", "host=h port=5432 password=*** dbname=d"),
    ("host=h sslpassword = 'p w\\'s' dbname=d", "host=h sslpassword = *** dbname=d"),
    (
        "redis://h/0?archive=" + quote("postgresql://u:pw@h/db?password=pw2", safe=""),
        "redis://h/0?archive=postgresql://u:***@h/db%3Fpassword%3D***",
    ),
    ("redis://h/0?archive=postgresql://u:p/w@h/db", "redis://h/0?archive=postgresql://u:***@h/db"),
    # Nothing to hide: unchanged.
    ("sqlite:///tmp/a@b.db", "sqlite:///tmp/a@b.db"),
    ("sqlite:///retrysafe.db", "sqlite:///retrysafe.db"),
    ("postgresql://u@h:5432/db?sslmode=require", "postgresql://u@h:5432/db?sslmode=require"),
    ("memory://", "memory://"),
]


@pytest.mark.parametrize(("url", "shown"), CASES)
def test_redact_hides_every_password_form(url: str, shown: str) -> None:
    assert redact(url) == shown


# Passwords as users write them: anything visible, including / @ : ? # and %.
_visible = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40)
_no_nested = _visible.filter(lambda p: "://" not in p and "%3a%2f%2f" not in p.lower())
_param_names = st.sampled_from(
    ["password", "sslpassword", "PASSWORD", "redis_password", "passwd", "db_secret"]
)


@settings(max_examples=300, deadline=None)
@given(password=_no_nested, scheme=st.sampled_from(["redis", "rediss", "postgresql", "unix"]))
def test_a_userinfo_password_never_shows(password: str, scheme: str) -> None:
    url = f"{scheme}://user:{password}@db.example:5432/app?sslmode=require"
    assert redact(url) == f"{scheme}://user:***@db.example:5432/app?sslmode=require"


@settings(max_examples=300, deadline=None)
@given(password=_visible.filter(lambda p: not set(p) & set("&#")), name=_param_names)
def test_a_password_parameter_never_shows(password: str, name: str) -> None:
    for value in (password, quote(password, safe="")):
        url = f"postgresql://user@db.example/app?sslmode=require&{name}={value}&x=1"
        assert redact(url) == f"postgresql://user@db.example/app?sslmode=require&{name}=***&x=1"


@settings(max_examples=300, deadline=None)
@given(
    password=st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1),
    name=_param_names,
)
def test_a_keyword_dsn_password_never_shows(password: str, name: str) -> None:
    quoted = "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"
    dsn = f"host=db.example {name}={quoted} dbname=app"
    assert redact(dsn) == f"host=db.example {name}=*** dbname=app"
    if not set(password) & set(" '\\"):
        assert redact(f"host=db.example {name}={password} dbname=app") == (
            f"host=db.example {name}=*** dbname=app"
        )


@settings(max_examples=200, deadline=None)
@given(password=_no_nested.filter(lambda p: len(p) >= 6))
def test_a_nested_archive_password_never_shows(password: str) -> None:
    # A password that is also a piece of what is shown ("postgr") is in it anyway.
    masked = "postgresql://user:***@db.example/app"
    around = f"redis://cache.example:6379/0?archive={masked} {quote(masked, safe='')}"
    assume(password not in around and quote(password, safe="") not in around)
    archive = f"postgresql://user:{password}@db.example/app"
    for value in (archive, quote(archive, safe="")):
        shown = redact(f"redis://cache.example:6379/0?archive={value}")
        assert password not in shown and quote(password, safe="") not in shown
        assert "cache.example:6379/0" in shown and "db.example/app" in shown


def test_store_errors_and_reprs_hide_the_password() -> None:
    shown = repr(PostgresStore("postgresql://u:pa%2Fss@127.0.0.1:1/db?sslpassword=k3y"))
    assert "pa%2Fss" not in shown and "k3y" not in shown and "127.0.0.1:1/db" in shown
    for url in ("postgresql://u:s3c/r3t@127.0.0.1:1/db", "postgresql://u:s3c@r3t@127.0.0.1:1/db"):
        # libpq would take the password's tail for the host or the database: refused.
        with pytest.raises(ValueError, match="percent-encode") as bad:
            PostgresStore(url)
        assert "r3t" not in str(bad.value)
    with pytest.raises(ValueError, match="percent-encoded") as info:
        PostgresStore("postgresql://u:s3cr%zzet@127.0.0.1:1/db")
    assert "s3cr" not in str(info.value)
    with pytest.raises(ValueError) as refused:
        open_store("host=127.0.0.1 password=s3cret dbname=app")
    assert "s3cret" not in str(refused.value) and "password=***" in str(refused.value)
    with pytest.raises(ValueError) as redis:
        open_store("redis+cluster://u:pa/ss@127.0.0.1:1/3")
    assert "pa/ss" not in str(redis.value)


@pytest.mark.parametrize(
    "store",
    [
        "postgresql://u:s3c/r3t@127.0.0.1:1/db",
        "postgresql://u:s3c@r3t@127.0.0.1:1/db",
        "redis://u:s3c/r3t@127.0.0.1:1/0",
        "bogus://h/db?sslpassword=s3cr3t",
        "host=127.0.0.1 port=1 password=s3cr3t",
    ],
)
def test_the_cli_never_prints_the_password(tmp_path: Path, store: str) -> None:
    for args in (("migrate", "--store", store), ("stats", "--store", store)):
        result = subprocess.run(
            [sys.executable, "-m", "retrysafe", *args],
            cwd=tmp_path,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode in (0, 2), result
        assert "r3t" not in result.stdout + result.stderr, (args, result)
        assert "Traceback" not in result.stderr
