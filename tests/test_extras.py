"""The core install needs no optional package; a missing extra says which one.

Each check runs in a fresh interpreter: what a module imports shows in its
``sys.modules``, and the packages of the extras are blocked there by a
``sys.meta_path`` finder installed before retrysafe is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: The packages of the extras that the core must not need.
OPTIONAL = (
    "uvicorn",
    "typer",
    "rich",
    "prometheus_client",
    "httpx",
    "opentelemetry",
    "a2a",
    "mcp",
    "sqlalchemy",
)

#: A ``sitecustomize`` module: it blocks the packages named (``{blocked}``) in every
#: interpreter started with its folder on ``PYTHONPATH``.
BLOCK = """
import sys


class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ImportError(f"No module named {{name!r}} (blocked)", name=name)
        return None


sys.meta_path.insert(0, _Block())
"""

#: Imports the core's front doors, runs an ``@idempotent`` call and a request through
#: the ASGI middleware on SQLite (each twice: the second is a replay), and prints the
#: optional packages that were imported.
CORE = """
import asyncio
import os
import sys

import retrysafe
import retrysafe.a2a
import retrysafe.asgi
import retrysafe.django
import retrysafe.errors
import retrysafe.guards
import retrysafe.http
import retrysafe.keys
import retrysafe.mcp
import retrysafe.mesh
import retrysafe.steps
import retrysafe.stores
import retrysafe.webhooks
import retrysafe.wsgi
from retrysafe import idempotent
from retrysafe.asgi import IdempotencyMiddleware

OPTIONAL = {optional!r}


def loaded():
    return sorted({{m.partition(".")[0] for m in sys.modules}} & set(OPTIONAL))


at_import = loaded()
store = "sqlite:///" + os.path.join(sys.argv[1], "core.db")
runs = []


@idempotent(store=store, key="{{order_id}}")
def charge(order_id: str, amount: int) -> dict:
    runs.append(order_id)
    return {{"order": order_id, "amount": amount}}


assert charge("o_1", 100) == charge("o_1", 100) == {{"order": "o_1", "amount": 100}}
assert runs == ["o_1"], runs


async def endpoint(scope, receive, send):
    runs.append(scope["path"])
    await receive()
    await send({{"type": "http.response.start", "status": 201, "headers": []}})
    await send({{"type": "http.response.body", "body": b'{{"ok":true}}'}})


async def post(app):
    scope = {{
        "type": "http",
        "method": "POST",
        "path": "/orders",
        "query_string": b"",
        "headers": [(b"idempotency-key", b"k-1"), (b"authorization", b"Bearer caller-1")],
    }}
    sent = []

    async def receive():
        return {{"type": "http.request", "body": b'{{"a":1}}', "more_body": False}}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"])


app = IdempotencyMiddleware(endpoint, store=store)
first, _ = asyncio.run(post(app))
again, headers = asyncio.run(post(app))
assert (first, again) == (201, 201), (first, again)
assert headers.get(b"idempotent-replayed") == b"true", headers
assert runs == ["o_1", "/orders"], runs
print("import", ",".join(at_import))
print("after", ",".join(loaded()))
"""


def _run(
    tmp_path: Path, *args: str, blocked: bool | tuple[str, ...] = False
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a fresh interpreter, the extras' packages (or those named)
    blocked if asked."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if blocked:
        names = OPTIONAL if blocked is True else blocked
        folder = tmp_path / "blocked"
        folder.mkdir(exist_ok=True)
        (folder / "sitecustomize.py").write_text(BLOCK.format(blocked=frozenset(names)))
        env["PYTHONPATH"] = str(folder)
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )


def _lines(out: str) -> dict[str, list[str]]:
    words = (line.partition(" ") for line in out.splitlines())
    return {head: [p for p in rest.split(",") if p] for head, _, rest in words}


def test_the_core_imports_no_optional_package(tmp_path: Path) -> None:
    done = _run(tmp_path, "-c", CORE.format(optional=OPTIONAL), str(tmp_path))
    assert done.returncode == 0, done.stderr
    seen = _lines(done.stdout)
    assert seen["import"] == []
    # With prometheus_client installed (the "metrics" extra), the first report
    # registers the counters in its default registry; nothing else is imported.
    assert set(seen["after"]) <= {"prometheus_client"}


def test_the_core_works_without_the_extras(tmp_path: Path) -> None:
    done = _run(tmp_path, "-c", CORE.format(optional=OPTIONAL), str(tmp_path), blocked=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no metrics report failed, say
    assert _lines(done.stdout) == {"import": [], "after": []}


@pytest.mark.parametrize(
    ("module", "extra"),
    [
        ("retrysafe.gateway", "gateway"),
        ("retrysafe.client", "client"),
        ("retrysafe._cli.app", "cli"),
        ("retrysafe._demo.run", "gateway"),
        ("retrysafe.sqlalchemy", "sqlalchemy"),
    ],
)
def test_a_missing_extra_is_named(tmp_path: Path, module: str, extra: str) -> None:
    code = textwrap.dedent(f"""
        from retrysafe.errors import IdempotencyError, MissingExtraError
        try:
            import {module}
        except MissingExtraError as exc:
            assert isinstance(exc, ImportError) and isinstance(exc, IdempotencyError)
            assert exc.extra == {extra!r}, exc.extra
            print(exc)
        else:
            raise SystemExit("imported")
    """)
    done = _run(tmp_path, "-c", code, blocked=True)
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"pip install 'retrysafe[{extra}]'" in done.stdout


@pytest.mark.parametrize(
    ("module", "name", "extra"),
    [("a2a", "IdempotentRequestHandler", "a2a"), ("mcp", "IdempotencyMiddleware", "mcp")],
)
def test_a_protocol_sdk_adapter_without_the_sdk_names_the_extra(
    tmp_path: Path, module: str, name: str, extra: str
) -> None:
    code = textwrap.dedent(f"""
        import retrysafe.{module}
        from retrysafe.errors import MissingExtraError
        try:
            retrysafe.{module}.{name}
        except MissingExtraError as exc:
            assert exc.extra == {extra!r}, exc.extra
            print(exc)
        else:
            raise SystemExit("imported")
    """)
    done = _run(tmp_path, "-c", code, blocked=True)
    assert done.returncode == 0, done.stderr
    assert f"pip install 'retrysafe[{extra}]'" in done.stdout


def test_metrics_count_without_prometheus_and_serving_them_names_the_extra(
    tmp_path: Path,
) -> None:
    code = textwrap.dedent("""
        from retrysafe._core.metrics import Metrics
        from retrysafe.errors import MissingExtraError
        from retrysafe.metrics import MetricsApp

        m = Metrics()
        m.count("executed", "charge")
        m.count("executed", "charge")
        assert m._cells is not None
        slot = m._cells._slots[("executed", "charge")]
        assert [values[slot] for values in m._cells._lists] == [0, 2], m._cells._lists
        try:
            MetricsApp()
        except MissingExtraError as exc:
            print(exc)
    """)
    done = _run(tmp_path, "-c", code, blocked=True)
    assert done.returncode == 0, done.stderr
    assert "pip install 'retrysafe[metrics]'" in done.stdout


def test_the_command_without_the_cli_extra_says_so_in_one_line(tmp_path: Path) -> None:
    done = _run(tmp_path, "-m", "retrysafe", "--help", blocked=True)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "pip install 'retrysafe[cli]'" in done.stderr


def test_the_gateway_command_without_uvicorn_names_the_extra(tmp_path: Path) -> None:
    done = _run(
        tmp_path,
        "-m",
        "retrysafe",
        "gateway",
        "--upstream",
        "http://127.0.0.1:9",
        blocked=("uvicorn",),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "pip install 'retrysafe[gateway]'" in done.stderr


def test_all_holds_every_other_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert project["dependencies"] == []
    (everything,) = extras["all"]
    name, _, rest = everything.partition("[")
    assert name == "retrysafe"
    named = set(rest.rstrip("]").split(","))
    runtime = set(extras) - {"all", "test", "bench"}
    assert named == runtime
    assert {"cli", "client", "gateway", "metrics", "otel", "speed", "redis", "postgres"} <= runtime
