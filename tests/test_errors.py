"""retrysafe.errors: one hierarchy, drawn in its docstring; the refusals keep their answers."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path
from typing import Any, cast

import pytest

import retrysafe
from retrysafe import Engine, errors, idempotent, open_store
from retrysafe._http.policy import HttpPolicy
from retrysafe._protocols.a2a import refusal as a2a_refusal
from retrysafe._protocols.mesh import URN, parse
from retrysafe.errors import (
    BodyTooLarge,
    IdempotencyError,
    InvalidTransitionError,
    MeshError,
    SecretError,
    StoreUnavailableError,
    UpstreamError,
)

PUBLIC = [
    "retrysafe",
    "retrysafe.errors",
    "retrysafe.asgi",
    "retrysafe.wsgi",
    "retrysafe.django",
    "retrysafe.sqlalchemy",
    "retrysafe.mcp",
    "retrysafe.fastapi",
    "retrysafe.gateway",
    "retrysafe.mesh",
    "retrysafe.a2a",
    "retrysafe.client",
    "retrysafe.webhooks",
    "retrysafe.stores",
    "retrysafe.stores.sqlite",
    "retrysafe.stores.memory",
    "retrysafe.stores.redis",
    "retrysafe.stores.postgres",
    "retrysafe.keys",
    "retrysafe.guards",
    "retrysafe.steps",
    "retrysafe.http",
    "retrysafe.metrics",
    "retrysafe.dashboard",
    "retrysafe.serializers",
]
#: Exception classes of the package that are no library errors: the demo shop's
#: answer, and the CLI's message to its user (``main`` prints it and exits).
NOT_LIBRARY_ERRORS = {"ShopError", "CliError"}

DOCS = Path(__file__).resolve().parent.parent / "docs" / "errors.md"


def _is_error(value: object) -> bool:
    # type(), not isinstance(): a lazy object (Django's settings) must not be set up
    return issubclass(type(value), type) and issubclass(cast(type, value), BaseException)


def _public_errors() -> dict[str, set[type[BaseException]]]:
    found: dict[str, set[type[BaseException]]] = {}
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name, value in list(vars(module).items()):
            if name.startswith("_") or not _is_error(value):
                continue
            if value.__module__.startswith("retrysafe"):
                found.setdefault(module_name, set()).add(value)
    return found


def test_every_error_a_public_module_exports_is_an_idempotency_error_in_errors() -> None:
    found = _public_errors()
    assert found["retrysafe.guards"] and found["retrysafe.webhooks"]  # the walk sees them
    for module_name, classes in found.items():
        for cls in classes:
            where = f"{module_name}.{cls.__name__}"
            assert issubclass(cls, IdempotencyError), where
            assert cls.__name__ in errors.__all__, where
            assert getattr(errors, cls.__name__) is cls, where


def test_every_error_class_of_the_package_is_defined_in_errors() -> None:
    """Private exceptions (control flow inside one module) are the only others."""
    for info in pkgutil.walk_packages(retrysafe.__path__, "retrysafe."):
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as exc:  # an extra that is not installed
            if (exc.name or "").startswith("retrysafe"):
                raise
            continue
        for name, value in list(vars(module).items()):
            if not _is_error(value) or value.__module__ != info.name:
                continue
            if name.startswith("_") or name in NOT_LIBRARY_ERRORS:
                continue
            assert info.name == "retrysafe.errors", f"{info.name}.{name}"


def test_the_root_exports_what_it_did() -> None:
    for name in (
        "IdempotencyError",
        "InvalidKeyError",
        "AmbiguousCredentialsError",
        "PrincipalRequiredError",
        "InProgressError",
        "FingerprintMismatchError",
        "LeaseLostError",
        "StoreUnavailableError",
        "MapError",
    ):
        assert name in retrysafe.__all__ and _is_error(getattr(retrysafe, name))


# -- the drawing ----------------------------------------------------------------------


def _tree(text: str) -> list[str]:
    """The lines of the drawn tree: from ``IdempotencyError`` to the last branch."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "IdempotencyError")
    indent = lines[start].index("I")
    tree = []
    for line in lines[start:]:
        if not line.strip() or line.startswith("```"):
            break
        tree.append(line[indent:])
    return tree


def _parsed(tree: list[str]) -> dict[str, tuple[str | None, list[str]]]:
    """``{class: (parent drawn, built-in bases in brackets)}``; four columns a level."""
    drawn: dict[str, tuple[str | None, list[str]]] = {}
    parents: list[str] = []
    for line in tree:
        match = re.fullmatch(r"([│├└─ ]*)(\w+)(?: \[(\w+(?:, \w+)*)\])?", line)
        assert match, line
        depth = len(match[1]) // 4
        name, builtins = match[2], (match[3] or "").split(", ") if match[3] else []
        del parents[depth:]
        assert name not in drawn, f"{name} is drawn twice"
        drawn[name] = (parents[-1] if parents else None, builtins)
        parents.append(name)
    return drawn


def test_the_docstring_draws_every_error_where_it_is() -> None:
    drawn = _parsed(_tree(errors.__doc__ or ""))
    assert set(drawn) == set(errors.__all__)
    for name, (parent, builtins) in drawn.items():
        cls = getattr(errors, name)
        ours = [b.__name__ for b in cls.__bases__ if b.__module__ == "retrysafe.errors"]
        theirs = [b.__name__ for b in cls.__bases__ if b.__module__ == "builtins"]
        assert ours == ([] if parent is None else [parent]), name
        if name != "IdempotencyError":
            assert theirs == builtins, name


def test_the_docs_draw_the_same_tree() -> None:
    assert _tree(DOCS.read_text()) == _tree(errors.__doc__ or "")


# -- the new bases change no answer -------------------------------------------------------

#: Errors that derive from IdempotencyError now and that no refusal answers.
UNANSWERED = [
    SecretError("$RETRYSAFE_SECRET must be at least 32 characters long"),
    UpstreamError("ConnectError", "refused"),
    MeshError("OUT_OF_STOCK", "no more"),
    BodyTooLarge("request body over 10 bytes"),
]


@pytest.mark.parametrize("error", UNANSWERED, ids=lambda e: type(e).__name__)
def test_the_http_refusal_raises_what_it_does_not_answer(error: IdempotencyError) -> None:
    """Not a 503, and not served without idempotency (fail open): raised, as before."""
    policy = HttpPolicy("memory://", fail_mode="open")
    assert policy.refusal(StoreUnavailableError("down")) is None  # what fail open is for
    with pytest.raises(type(error)) as raised:
        policy.refusal(error)
    assert raised.value is error


@pytest.mark.parametrize("error", UNANSWERED, ids=lambda e: type(e).__name__)
def test_the_mesh_and_a2a_refusals_raise_what_they_do_not_answer(error: IdempotencyError) -> None:
    envelope: dict[str, Any] = {
        "protocol": {"name": "mesh", "version": "0.1.0"},
        "id": "req_1",
        "call": {"function": "payments.charge", "version": "1", "arguments": {}},
        "extensions": [{"urn": URN, "options": {"key": "charge_1"}}],
    }
    call = parse(envelope)
    assert not isinstance(call, dict)
    with pytest.raises(type(error)) as raised:
        call.refused(error)
    assert raised.value is error
    with pytest.raises(type(error)) as raised:
        a2a_refusal(1, error)
    assert raised.value is error


def test_codes() -> None:
    assert UpstreamError("ReadTimeout", "slow", timeout=True).code == "upstream_timeout"
    assert UpstreamError("ConnectError", "refused").code == "upstream_unavailable"
    assert MeshError("OUT_OF_STOCK", "no more").code == "OUT_OF_STOCK"
    assert BodyTooLarge().code == "idempotency_body_too_large"
    assert issubclass(SecretError, ValueError) and SecretError.code == "idempotency_secret_invalid"


def test_a_failure_stored_under_an_error_s_former_module_replays_as_it() -> None:
    """Records written before the errors moved name them ``retrysafe.guards.…``: a
    decorator that lists the error still rebuilds it from them."""
    engine = Engine(open_store("memory://"))

    class Former(Exception):  # InvalidTransitionError as an earlier version named it
        pass

    Former.__module__, Former.__qualname__ = "retrysafe.guards", "InvalidTransitionError"

    def advance(payment_id: str) -> None:
        raise Former(payment_id, "captured", "authorized")

    options: dict[str, Any] = {"store": engine, "key": "{payment_id}", "operation": "advance"}
    before = idempotent(**options, final_failures=(Former,))(advance)
    with pytest.raises(Former):
        before("p_1")
    after = idempotent(**options, final_failures=(InvalidTransitionError,))(advance)
    with pytest.raises(InvalidTransitionError) as raised:
        after("p_1")  # replayed, not run
    assert (raised.value.payment_id, raised.value.current) == ("p_1", "captured")
