"""Idempotency for any ASGI application (Starlette, FastAPI, Quart, plain ASGI).

::

    from retrysafe.asgi import IdempotencyMiddleware

    app = IdempotencyMiddleware(app, store="redis://localhost:6379/0")
    # or, in Starlette / FastAPI:
    app.add_middleware(IdempotencyMiddleware, store="sqlite:///idempotency.db")

Pure ASGI: it needs no framework, and requests that carry no key (or use a
method it does not protect) go straight to the app.
"""

from retrysafe._http.asgi import ASGIApp, IdempotencyMiddleware, Message, Receive, Scope, Send

__all__ = ["ASGIApp", "IdempotencyMiddleware", "Message", "Receive", "Scope", "Send"]
