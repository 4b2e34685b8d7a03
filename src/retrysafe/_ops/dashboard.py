"""The live dashboard as an ASGI app, and the admin pages the gateway serves."""

from __future__ import annotations

import asyncio
from typing import Any

from retrysafe._core.engine import shared_store
from retrysafe._http.asgi import Receive, Scope, Send, lifespan, send_answer
from retrysafe._http.problems import Response
from retrysafe._ops.admin import FROM_ENV, AdminSite
from retrysafe._ops.monitor import Monitor
from retrysafe.stores import Store

__all__ = ["DashboardApp", "admin_site", "serve_admin"]


def admin_site(
    store: Store[Any] | str | None, token: str | None, loopback: bool, monitor: Monitor | None
) -> AdminSite:
    """The admin site over ``store`` (a store, a URL opened once per process, or None)."""
    opened = None if store is None else shared_store(store)
    return AdminSite(opened, token=token, loopback=loopback, monitor=monitor)


async def serve_admin(site: AdminSite, scope: Scope, send: Send, path: str, base: str) -> None:
    """Answer an admin request (``path`` relative to ``base``) from a worker thread."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    client = scope.get("client")
    response: Response = await asyncio.to_thread(
        site.answer,
        scope["method"],
        path,
        scope.get("query_string", b"").decode("latin-1"),
        headers,
        client[0] if client else None,
        base,
    )
    if scope["method"] == "HEAD":
        response = Response(response.status, response.headers, b"")
    await send_answer(send, response)


def relative(scope: Scope) -> tuple[str, str]:
    """(the path under the app's mount point, the mount point) of an ASGI request."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root) :], root
    return path, root


class DashboardApp:
    """The dashboard, metrics and inspector over ``store`` (a store, a URL, or None).

    ``token``: the admin token (default ``$RETRYSAFE_ADMIN_TOKEN``; None: no
    token). ``loopback``: answer loopback clients without a token (default
    ``$RETRYSAFE_ADMIN_LOOPBACK``, else False); with neither every page is closed.
    ``monitor``: the live figures, if you keep your own.
    """

    def __init__(
        self,
        store: Store[Any] | str | None = None,
        *,
        token: str | None = FROM_ENV,
        loopback: bool = FROM_ENV,
        monitor: Monitor | None = None,
    ) -> None:
        self.site = admin_site(store, token, loopback, monitor)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self.aclose, self.site.monitor.start)
            return
        if scope["type"] != "http":
            return
        path, base = self._where(scope)
        await serve_admin(self.site, scope, send, path, base)

    def _where(self, scope: Scope) -> tuple[str, str]:
        """(the page asked for, the mount point)."""
        return relative(scope)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.site.monitor.close)  # joins its thread
