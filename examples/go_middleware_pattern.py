"""The Go middleware pattern of a mobile API, reproduced with retrysafe.

The pattern (a gin middleware in front of a field-sales app's API):

- the mobile client sends a fresh UUID in ``X-Idempotency-Key`` on every POST, PUT,
  PATCH and DELETE, and the same UUID again when it retries (outbox, timeout,
  double tap);
- a request without the header is processed normally;
- a request without an auth context (no token, or one the app rejects) is
  processed normally too: idempotency is skipped, nothing is stored;
- keys are scoped to the caller's workspace: two users of one workspace share them;
- a key whose stored answer is 2xx is a duplicate, whatever the body: ``204 No
  Content``, and nothing runs; any other answer (a 422, a 500) is not kept, so a
  retry under the same key runs again;
- keys live 24 hours.

The options that say so are in :func:`create_app`. Two differences are deliberate
(docs/http.md, "The Go middleware pattern"): a duplicate that arrives while the first
request is still running waits for it (``wait=``) and gets the 204, where the Go code
runs both; and the 204 has no body (HTTP forbids one, and Go drops it too).

Run it (Starlette and uvicorn)::

    python examples/go_middleware_pattern.py          # http://127.0.0.1:8000

and send the same request twice::

    curl -i localhost:8000/app/v1/outlet-visits -H 'Authorization: Bearer token-ana' \\
        -H 'X-Idempotency-Key: 550e8400-e29b-41d4-a716-446655440000' \\
        -H 'Content-Type: application/json' -d '{"outlet_id": 123, "scheduled_date": "2026-03-10"}'

The first answers ``201 Created`` with the visit; the second ``204 No Content``.
tests/test_go_pattern.py plays every scenario of the pattern against this app.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from retrysafe.asgi import IdempotencyMiddleware
from retrysafe.http import ANONYMOUS, HttpRequest, NoPrincipal

#: The API's tokens: who each one is (a real app asks its auth service).
TOKENS: dict[str, dict[str, int]] = {
    "token-ana": {"user_id": 1, "workspace_id": 10},
    "token-ben": {"user_id": 2, "workspace_id": 10},
    "token-eve": {"user_id": 3, "workspace_id": 20},
}

#: The mobile client's write methods: the ones that carry the key.
WRITE_METHODS = ("POST", "PUT", "PATCH", "DELETE")


class BearerAuth:
    """The app's auth middleware: ``scope["state"]["auth"]`` is the caller of a valid
    bearer token, else None (the Go code's auth context)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            token = ""
            for name, value in scope["headers"]:
                if name == b"authorization" and value.startswith(b"Bearer "):
                    token = value[7:].decode("latin-1")
            scope.setdefault("state", {})["auth"] = TOKENS.get(token)
        await self.app(scope, receive, send)


def workspace(request: HttpRequest) -> str | NoPrincipal:
    """Whose keys a request uses: its workspace's; unauthenticated callers skip
    idempotency (``ANONYMOUS``: the token they carry, if any, is not used)."""
    auth = request.native.get("state", {}).get("auth")
    if auth is None:
        return ANONYMOUS
    return f"workspace:{auth['workspace_id']}"


class Visits:
    """The outlet visits (a real app keeps them in its database)."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, Any]] = {}
        self.feedback: list[str] = []
        self.available = True  # False: the database is down, the API answers 503
        self._ids = itertools.count(1)

    async def add(self, workspace_id: int, outlet_id: int, date: str) -> dict[str, Any]:
        visit = {"id": next(self._ids), "outlet_id": outlet_id, "scheduled_date": date}
        self.rows[visit["id"]] = {**visit, "workspace_id": workspace_id}
        return visit

    async def update(self, visit_id: int, date: str) -> dict[str, Any] | None:
        row = self.rows.get(visit_id)
        if row is None:
            return None
        row["scheduled_date"] = date
        return {k: v for k, v in row.items() if k != "workspace_id"}

    async def delete(self, visit_id: int) -> bool:
        return self.rows.pop(visit_id, None) is not None


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"success": False, "code": code, "message": message}, status)


async def _fields(request: Request) -> dict[str, Any] | None:
    try:
        body = json.loads(await request.body())
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def api(visits: Visits) -> Starlette:
    """The API's routes (what the Go middleware sits in front of)."""

    async def create_visit(request: Request) -> Response:
        auth = request.state.auth
        if auth is None:
            return _error(401, "UNAUTHORIZED", "a valid bearer token is required")
        fields = await _fields(request)
        if fields is None or not isinstance(fields.get("outlet_id"), int):
            return _error(422, "VALIDATION_ERROR", "outlet_id must be an integer")
        if not visits.available:
            return _error(503, "UNAVAILABLE", "try again")
        date = str(fields.get("scheduled_date", ""))
        visit = await visits.add(auth["workspace_id"], fields["outlet_id"], date)
        return JSONResponse({"success": True, "data": visit}, 201)

    async def change_visit(request: Request) -> Response:
        if request.state.auth is None:
            return _error(401, "UNAUTHORIZED", "a valid bearer token is required")
        visit_id = int(request.path_params["visit_id"])
        if request.method == "DELETE":
            if not await visits.delete(visit_id):
                return _error(404, "NOT_FOUND", "no such visit")
            return Response(status_code=204)
        fields = await _fields(request) or {}
        visit = await visits.update(visit_id, str(fields.get("scheduled_date", "")))
        if visit is None:
            return _error(404, "NOT_FOUND", "no such visit")
        return JSONResponse({"success": True, "data": visit}, 200)

    async def send_feedback(request: Request) -> Response:
        # A public endpoint: anyone may send feedback, signed in or not.
        visits.feedback.append((await request.body()).decode("utf-8", "replace"))
        return JSONResponse({"success": True, "data": {"n": len(visits.feedback)}}, 201)

    return Starlette(
        routes=[
            Route("/app/v1/outlet-visits", create_visit, methods=["POST"]),
            Route("/app/v1/outlet-visits/{visit_id:int}", change_visit, methods=["PUT", "DELETE"]),
            Route("/app/v1/feedback", send_feedback, methods=["POST"]),
        ]
    )


def create_app(store: Any = None, visits: Visits | None = None) -> Any:
    """The API behind the pattern's idempotency, behind the app's auth.

    ``store``: a store URL, a :class:`~retrysafe.Store` or an
    :class:`~retrysafe.Engine` (default ``$RETRYSAFE_STORE``, else SQLite).
    """
    guarded = IdempotencyMiddleware(
        api(visits or Visits()),
        store=store,
        header="X-Idempotency-Key",  # the mobile client's header only
        methods=WRITE_METHODS,
        principal=workspace,  # workspace-scoped; unauthenticated callers skip it
        fingerprint=False,  # the same key with another body is still a duplicate
        keep_statuses=range(200, 300),  # only 2xx answers are kept; the rest run again
        duplicate_response="no_content",  # a duplicate gets 204 No Content
        ttl=24 * 3600,  # keys live 24 hours
        wait=10.0,  # a duplicate of a request in flight waits for it (then 204)
    )
    return BearerAuth(guarded)


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(create_app(), host="127.0.0.1", port=8000)
