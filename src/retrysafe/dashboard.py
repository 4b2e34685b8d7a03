"""The live dashboard as an ASGI app, mountable in any ASGI server or framework.

::

    from starlette.applications import Starlette
    from starlette.routing import Mount
    from retrysafe.dashboard import DashboardApp

    app = Starlette(routes=[Mount("/_retrysafe", app=DashboardApp(store="sqlite:///retrysafe.db"))])

At its root it serves the dashboard page; under it ``metrics`` (Prometheus
text), ``api/stats`` (every live figure as JSON) and ``api/records?key=…`` (the
key inspector). Everything it needs ships in the package: no CDN. With
``RETRYSAFE_ADMIN_TOKEN`` set (or ``token=``) every page needs
``Authorization: Bearer TOKEN``; without one every page is closed (403), unless
``loopback=True`` (or ``RETRYSAFE_ADMIN_LOOPBACK=1``) opens it to loopback clients.
The ``retrysafe gateway`` mounts it at ``/_retrysafe/``. See ``docs/dashboard.md``.
"""

from retrysafe._ops.dashboard import DashboardApp, admin_site, serve_admin

__all__ = ["DashboardApp", "admin_site", "serve_admin"]
