"""The a2a-sdk call-context builder that tells the handler who calls over HTTP.

The SDK's own builder gives a request handler the Starlette user's
``display_name`` (as ``user_name``) and one value per header name; this one adds
the user's ``identity`` and every header line, as :class:`Caller`.
"""

from __future__ import annotations

from a2a.server.context import ServerCallContext
from a2a.server.routes import DefaultServerCallContextBuilder
from starlette.requests import Request

from retrysafe._core.principal import asgi_user
from retrysafe._protocols.a2a_handler import CALLER_STATE, Caller

__all__ = ["IdempotentContextBuilder"]


class IdempotentContextBuilder(DefaultServerCallContextBuilder):
    """The SDK's default call context, plus who sent the request (:class:`Caller`).

    Pass it to the routes of an :class:`~retrysafe.a2a.IdempotentRequestHandler`::

        builder = IdempotentContextBuilder()
        routes = [
            *create_jsonrpc_routes(handler, "/", context_builder=builder),
            *create_rest_routes(handler, context_builder=builder),
        ]
    """

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        lines = request.scope.get("headers") or ()
        context.state[CALLER_STATE] = Caller(
            user=asgi_user(request.scope),
            headers=tuple((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in lines),
        )
        return context
