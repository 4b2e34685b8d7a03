"""Metrics, alerts and traces from the engine, and apps that serve them.

Every front door reports through the engine, so nothing needs wiring: the
counters (``retrysafe_executions_total``, ``retrysafe_replays_total``, …, by
operation), the histograms of store round trips and handler time, and alerts
(``retrysafe.alerts`` log events and ``retrysafe_alerts_total``) are there as
soon as a request is served. Serve them with :class:`MetricsApp` (ASGI) or
:func:`wsgi_app` (WSGI), or let the gateway do it at ``/_retrysafe/metrics``.
Several workers: set ``PROMETHEUS_MULTIPROC_DIR`` to an empty folder before they
start. See ``docs/metrics.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from retrysafe._core.metrics import (
    COUNTERS,
    METRICS,
    AlertLog,
    Alerts,
    Event,
    Metrics,
    multiprocess_dir,
)
from retrysafe._http.asgi import Scope
from retrysafe._http.wsgi import environ_headers, status_line
from retrysafe._ops.admin import FROM_ENV, AdminSite
from retrysafe._ops.dashboard import DashboardApp, admin_site
from retrysafe._ops.monitor import Monitor
from retrysafe.stores import Store

__all__ = [
    "COUNTERS",
    "METRICS",
    "Alerts",
    "Event",
    "Metrics",
    "MetricsApp",
    "Monitor",
    "configure",
    "disable",
    "enable",
    "multiprocess_dir",
    "wsgi_app",
]


def enable() -> None:
    """Report metrics (the default, unless ``RETRYSAFE_METRICS=0``)."""
    METRICS.enabled = True


def disable() -> None:
    """Report nothing: every engine call skips its metrics."""
    METRICS.enabled = False


def configure(*, alerts: Alerts | None = None, alert_interval: float | None = None) -> None:
    """Set the alert thresholds of this process, and ``alert_interval``: the seconds
    over which alerts of one kind make at most one log line (default 10)."""
    if alert_interval is not None:
        METRICS.alert_log.flush(everything=True)
        METRICS.alert_log = AlertLog(alert_interval)
    if alerts is not None:
        METRICS.alerts = alerts


class MetricsApp(DashboardApp):
    """Prometheus text at any path, as an ASGI app (e.g. ``Mount("/metrics", app=…)``).

    ``store`` (optional) adds its gauges: records by status, the oldest
    processing record's age, the archive's size. Access as the dashboard's.
    """

    def _where(self, scope: Scope) -> tuple[str, str]:
        return "/metrics", ""


def wsgi_app(
    store: Store[Any] | str | None = None,
    *,
    token: str | None = FROM_ENV,
    loopback: bool = FROM_ENV,
    monitor: Monitor | None = None,
) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    """Prometheus text at any path, as a WSGI app (Flask, Django, gunicorn).

    Mount it with werkzeug's ``DispatcherMiddleware`` or serve it on a path of
    its own. Access as the dashboard's.
    """
    site: AdminSite = admin_site(store, token, loopback, monitor)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        response = site.answer(
            environ.get("REQUEST_METHOD", "GET"),
            "/metrics",
            environ.get("QUERY_STRING", ""),
            dict(environ_headers(environ)),
            environ.get("REMOTE_ADDR"),
        )
        start_response(status_line(response.status), response.headers)
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [response.body]

    app.site = site  # type: ignore[attr-defined]  # the WSGI function carries its site
    return app
