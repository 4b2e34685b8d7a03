"""FastAPI: the ASGI middleware, plus the key header in the OpenAPI schema.

::

    from fastapi import FastAPI
    from retrysafe.fastapi import install

    app = FastAPI()
    install(app, store="redis://localhost:6379/0", require_key=True)

The middleware goes innermost, after any authentication middleware, whatever
the order they are added in. Every operation whose method the middleware
protects then documents the
``Idempotency-Key`` header, the ``Idempotent-Replayed`` answer header and the
problem answers (400, 409, 422, 503).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from retrysafe._http.asgi import IdempotencyMiddleware
from retrysafe._http.policy import DEFAULT_HEADERS
from retrysafe._http.problems import PROBLEM_TYPE

__all__ = ["document", "install"]

_PROBLEMS = {
    "400": "Missing or malformed idempotency key, a body that cannot be fingerprinted, or "
    "two different credentials (`idempotency_key_required`, `idempotency_key_invalid`, "
    "`idempotency_body_invalid`, `idempotency_credentials_ambiguous`)",
    "409": "A request with this key is still in progress (`idempotency_in_flight`); "
    "retry after `Retry-After` seconds with the same key",
    "422": "The key was used before with a different request (`idempotency_conflict`)",
    "503": "The idempotency store is unavailable (`idempotency_store_unavailable`); "
    "retry after `Retry-After` seconds with the same key",
}

_REFUSED = (
    "A keyed request without credentials (`idempotency_principal_required`): "
    "send your credentials with it"
)

_PROBLEM_SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "code": {"type": "string"},
    },
    "required": ["type", "title", "status", "detail", "code"],
}


def install(app: Any, store: Any = None, **options: Any) -> None:
    """Add :class:`~retrysafe.asgi.IdempotencyMiddleware` to ``app`` and document it.

    The middleware goes innermost, next to the routes, whenever the app's other
    middleware are added: it then sees the user that an authentication
    middleware put in ``scope["user"]``, so a token refresh of one user replays
    (see docs/principals.md).
    """
    from starlette.middleware import Middleware

    if getattr(app, "middleware_stack", None) is not None:
        raise RuntimeError("Cannot add middleware after an application has started")
    # mypy infers starlette's ParamSpec wrongly for a class taking **options.
    factory: Any = IdempotencyMiddleware
    app.user_middleware.append(Middleware(factory, store=store, **options))
    header = options.get("header", DEFAULT_HEADERS)
    document(
        app,
        methods=options.get("methods", ("POST", "PATCH")),
        header=header if isinstance(header, str) else next(iter(header)),
        required=options.get("require_key", False) is True,
        anonymous=options.get("anonymous") or "run",
    )


def document(
    app: Any,
    *,
    methods: Collection[str] = ("POST", "PATCH"),
    header: str = DEFAULT_HEADERS[0],
    required: bool = False,
    anonymous: str = "run",
) -> None:
    """Add the key header and the idempotency answers to ``app``'s OpenAPI schema.

    ``anonymous="refuse"`` documents the 403 a keyed request without credentials gets.
    """
    problems = dict(_PROBLEMS)
    if anonymous == "refuse":
        problems["403"] = _REFUSED
    protected = {m.lower() for m in methods}
    build = app.openapi
    done = False

    def openapi() -> dict[str, Any]:
        nonlocal done
        schema: dict[str, Any] = build()
        if not done:
            for item in schema.get("paths", {}).values():
                for method, operation in item.items():
                    if method in protected:
                        _describe(operation, header, required, problems)
            done = True
        return schema

    app.openapi = openapi


def _describe(
    operation: dict[str, Any], header: str, required: bool, problems: dict[str, str]
) -> None:
    params = operation.setdefault("parameters", [])
    if not any(
        p.get("in") == "header" and p.get("name", "").lower() == header.lower() for p in params
    ):
        params.append(
            {
                "name": header,
                "in": "header",
                "required": required,
                "description": "A unique key for this operation (e.g. a UUID); send the same key "
                "on every retry to get the first answer instead of a second side effect.",
                "schema": {"type": "string", "minLength": 1, "maxLength": 255},
            }
        )
    responses = operation.setdefault("responses", {})
    for status, description in problems.items():
        responses.setdefault(
            status,
            {
                "description": description,
                "content": {PROBLEM_TYPE: {"schema": _PROBLEM_SCHEMA}},
            },
        )
    for status, answer in responses.items():
        if status not in problems and isinstance(answer, dict):
            answer.setdefault("headers", {}).setdefault(
                "Idempotent-Replayed",
                {
                    "description": "`true` when this is the stored answer of an earlier request",
                    "schema": {"type": "string", "enum": ["true"]},
                },
            )
