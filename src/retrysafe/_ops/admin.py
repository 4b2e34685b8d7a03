"""The admin pages: the dashboard, Prometheus metrics, their JSON API, and who may see them.

One core, :class:`AdminSite`, answers a request from its method, path, query,
headers and client address with a :class:`~retrysafe._http.problems.Response`; the ASGI
and WSGI apps (``retrysafe.dashboard``, ``retrysafe.metrics``) and the gateway
only move bytes. It may call the store, so async servers run it in a thread.

Access, decided before anything else (``health`` is not an admin page and
stays open): with ``RETRYSAFE_ADMIN_TOKEN`` set, a request without
``Authorization: Bearer TOKEN`` gets 401 (a browser gets a small page that asks
for the token). Without a token the pages are closed (403 ``admin_closed``),
unless the operator opts in to loopback access (``loopback=True``,
``RETRYSAFE_ADMIN_LOOPBACK=1``, ``--admin-loopback``): then a loopback client,
addressed by a local name and with no proxy header, is answered without a
token. A proxy on the same host that adds no ``X-Forwarded-For`` is such a
client, which is why loopback access is never the default.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import html
import ipaddress
import json
import os
import urllib.parse
from collections.abc import Mapping
from importlib import resources
from typing import Any

from retrysafe._http.problems import Response, problem
from retrysafe._model.hashing import key_hash, validate_key
from retrysafe._model.record import record_json
from retrysafe._ops.monitor import Monitor
from retrysafe.errors import IdempotencyError, InvalidKeyError, StoreUnavailableError
from retrysafe.stores import Store

__all__ = ["ENV_LOOPBACK", "ENV_TOKEN", "AdminSite", "loopback_from_env"]

ENV_TOKEN = "RETRYSAFE_ADMIN_TOKEN"
#: Set to 1 (true, yes, on) to answer loopback clients without a token.
ENV_LOOPBACK = "RETRYSAFE_ADMIN_LOOPBACK"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class _FromEnv:
    def __repr__(self) -> str:
        return "(from the environment)"


FROM_ENV: Any = _FromEnv()


def loopback_from_env() -> bool:
    """``$RETRYSAFE_ADMIN_LOOPBACK`` as a bool (unset: False); ValueError if unclear."""
    value = os.environ.get(ENV_LOOPBACK, "").strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(f"{ENV_LOOPBACK} must be 1 or 0 (true/false, yes/no, on/off), not {value!r}")


def _asset(name: str) -> str:
    return (resources.files("retrysafe._ops") / "assets" / name).read_text("utf-8")


def _page(html: str, script: str) -> tuple[bytes, str, str]:
    """The page with its style and script inlined, and their CSP hashes."""
    style = _asset("dashboard.css")
    page = _asset(html).replace("/*STYLE*/", style).replace("/*SCRIPT*/", script)

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    return page.encode(), digest(style), digest(script)


class _Pages:
    """The dashboard and the token page, built once; one CSP allows both."""

    def __init__(self) -> None:
        self.dashboard, style, dash_js = _page("dashboard.html", _asset("dashboard.js"))
        self.login, _, login_js = _page("login.html", _asset("login.js"))
        self.csp = (
            f"default-src 'none'; script-src {dash_js} {login_js}; style-src {style}; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'"
        )

    def html(self, status: int, body: bytes, extra: list[tuple[str, str]] = []) -> Response:  # noqa: B006
        headers = [
            ("content-type", "text/html; charset=utf-8"),
            ("content-length", str(len(body))),
            ("cache-control", "no-store"),
            ("content-security-policy", self.csp),
            ("x-content-type-options", "nosniff"),
            ("referrer-policy", "no-referrer"),
            ("x-frame-options", "DENY"),
            *extra,
        ]
        return Response(status, headers, body)


@functools.cache
def pages() -> _Pages:
    return _Pages()


def _json(status: int, doc: Any) -> Response:
    body = json.dumps(doc, separators=(",", ":"), default=str).encode()
    headers = [
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        ("cache-control", "no-store"),
        ("x-content-type-options", "nosniff"),
    ]
    return Response(status, headers, body)


def is_loopback(host: str | None) -> bool:
    """Whether a client address is this machine. No address (a Unix socket, whose
    clients may be anyone a proxy lets in) is not."""
    if host is None:
        return False
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return bool((mapped or ip).is_loopback)


def is_local_name(host: str | None) -> bool:
    """Whether a ``Host`` header names this machine (``localhost``, a loopback address),
    so that a page of another site whose name was rebound to 127.0.0.1 (DNS rebinding)
    is not answered. No ``Host`` at all (HTTP/1.0) is not a browser's request."""
    if host is None:
        return True
    host = host.strip().lower()
    name = host[1 : host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
    return name == "localhost" or name.endswith(".localhost") or is_loopback(name)


#: Headers a proxy adds: a request that has passed one is not a loopback client's.
_PROXIED = ("x-forwarded-for", "forwarded", "x-real-ip")


class AdminSite:
    """The admin pages over ``store`` (see the module docstring).

    ``token`` is the admin token (default ``$RETRYSAFE_ADMIN_TOKEN``; None: no
    token). ``loopback``: answer loopback clients without a token (default
    ``$RETRYSAFE_ADMIN_LOOPBACK``, else False); with neither, every admin page
    is closed. ``monitor`` the live figures (a new
    :class:`~retrysafe._ops.monitor.Monitor` over ``store`` by default).
    """

    def __init__(
        self,
        store: Store[Any] | None = None,
        *,
        token: str | None = FROM_ENV,
        loopback: bool = FROM_ENV,
        monitor: Monitor | None = None,
    ) -> None:
        if token is FROM_ENV:
            token = os.environ.get(ENV_TOKEN) or None
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise ValueError("the admin token must be a non-empty str (or None)")
        if loopback is FROM_ENV:
            loopback = loopback_from_env()
        if not isinstance(loopback, bool):
            raise TypeError(f"loopback must be True or False, not {loopback!r}")
        self.token = None if token is None else token.strip()  # headers arrive stripped
        self.loopback = loopback
        self.store = store
        self.monitor = monitor if monitor is not None else Monitor(store)

    # -- access ---------------------------------------------------------------------------

    def refusal(self, headers: Mapping[str, str], client: str | None) -> Response | None:
        """401 or 403 for a request that may not see admin pages, else None."""
        if self.loopback and (
            is_loopback(client)
            and is_local_name(headers.get("host"))
            and not any(name in headers for name in _PROXIED)
        ):
            return None
        if self.token is None and not self.loopback:
            return problem(
                403,
                "admin_closed",
                f"the admin pages are closed: set {ENV_TOKEN} and send it as "
                f"Authorization: Bearer TOKEN, or, if no proxy runs on this host, answer "
                f"loopback clients without a token ({ENV_LOOPBACK}=1, --admin-loopback)",
            )
        if self.token is None:
            return problem(
                403,
                "admin_loopback_only",
                f"no {ENV_TOKEN} is set, so the admin pages answer loopback clients only "
                "(addressed as localhost or a loopback address, not through a proxy); set "
                "it to open them to other hosts",
            )
        scheme, _, given = headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self.token.encode()
        ):
            return None
        challenge = [("www-authenticate", 'Bearer realm="retrysafe"')]
        if "text/html" in headers.get("accept", ""):
            return pages().html(401, pages().login, challenge)
        return problem(
            401,
            "admin_token_required",
            f"send the admin token ({ENV_TOKEN}) as Authorization: Bearer TOKEN",
            headers=challenge,
        )

    # -- pages ----------------------------------------------------------------------------

    def answer(
        self,
        method: str,
        path: str,
        query: str,
        headers: Mapping[str, str],
        client: str | None,
        base: str = "",
    ) -> Response:
        """The answer to a request for ``path`` (relative to where the site is
        mounted, ``base``); ``headers`` have lower-case names."""
        refused = self.refusal(headers, client)
        if refused is not None:
            return refused
        if method not in ("GET", "HEAD"):
            return problem(
                405,
                "method_not_allowed",
                f"{base}{path or '/'} answers GET and HEAD",
                headers=[("allow", "GET, HEAD")],
            )
        if path == "":
            return Response(308, [("location", f"{base}/"), ("content-length", "0")], b"")
        if path == "/":
            self.monitor.start()
            self.monitor.watched()
            mount = html.escape(base + "/", quote=True).encode()
            return pages().html(200, pages().dashboard.replace(b"/*BASE*/", mount))
        if path == "/metrics":
            return self.metrics()
        if path == "/api/stats":
            return self.stats(urllib.parse.parse_qs(query))
        if path == "/api/records":
            return self.records(urllib.parse.parse_qs(query))
        return problem(404, "not_found", f"no admin page at {base}{path}")

    def metrics(self) -> Response:
        """The Prometheus text of every metric."""
        self.monitor.watched()
        body, ctype = self.monitor.exposition()
        headers = [
            ("content-type", ctype),
            ("content-length", str(len(body))),
            ("cache-control", "no-store"),
        ]
        return Response(200, headers, body)

    def stats(self, query: Mapping[str, list[str]] | None = None) -> Response:
        """Every live figure as JSON (what the dashboard draws); ``points``: how
        many points of each series (default 300, one a second)."""
        try:
            points = int((query or {}).get("points", ["300"])[0])
        except ValueError:
            points = -1
        if not 0 <= points <= 10_000:
            return problem(400, "bad_request", "points must be a whole number from 0 to 10000")
        self.monitor.start()
        self.monitor.watched()
        doc = self.monitor.snapshot(points=points)
        doc["admin"] = {"token": self.token is not None}
        return _json(200, doc)

    def records(self, query: Mapping[str, list[str]]) -> Response:
        """The key inspector: the records of a raw key (in every scope and operation,
        or the one given), with their stored answers."""
        key = (query.get("key") or [""])[0]
        try:
            validate_key(key)
        except InvalidKeyError as exc:
            return problem(400, "idempotency_key_invalid", str(exc))
        if self.store is None:
            return problem(404, "no_store", "this admin site has no store to search")
        operations = query.get("operation")
        operation = operations[0] if operations else None
        scope = (query.get("scope") or [""])[0]
        try:
            if operation is not None:
                found = self.store.get(key_hash(scope, operation, key))
                records = [] if found is None else [found]
            else:
                records = self.store.records(key=key, limit=20)
        except StoreUnavailableError as exc:
            return problem(
                503, "idempotency_store_unavailable", str(exc), headers=[("retry-after", "1")]
            )
        except (IdempotencyError, NotImplementedError) as exc:
            return problem(501, "not_supported", str(exc))
        return _json(200, {"records": [record_json(r, answer=True) for r in records]})
