"""The gateway: a reverse proxy that makes the retries of any HTTP API safe.

::

    from retrysafe.gateway import create_app

    app = create_app("http://127.0.0.1:9000", store="sqlite:///retrysafe.db")

or ``retrysafe gateway --upstream http://127.0.0.1:9000``. Each request goes
through :class:`retrysafe.asgi.IdempotencyMiddleware` to the upstream, so a
keyed request runs upstream once and its retries get the stored answer. Paths
under ``/_retrysafe/`` are the gateway's own and never reach the upstream:
``health`` (always open), the live dashboard at ``/_retrysafe/``, Prometheus
``metrics`` and the dashboard's ``api/…`` (the admin token, or loopback clients
when opted in; closed otherwise).

What one client may hold is bounded (``max_head_size``, ``head_timeout``,
``body_timeout``, ``max_connections``): serve the app with
``http=HTTPProtocol`` (``retrysafe gateway`` does) for the head and connection
bounds; the idle-body bound is the app's own.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import json
import logging
import math
import os
import re
import ssl
import urllib.parse
from collections.abc import AsyncGenerator, Iterable
from typing import Any, TypeAlias

from retrysafe.errors import MissingExtraError

try:
    import httpx
    import uvicorn  # noqa: F401  (the server whose protocols the gateway's limits extend)
except ImportError as exc:
    raise MissingExtraError("gateway", "retrysafe.gateway", name=exc.name) from exc

from retrysafe._gateway.limits import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEAD_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEAD_SIZE,
    BodyTimeout,
    ServerLimits,
    protocol_class,
)
from retrysafe._gateway.upstream import HOP_BY_HOP, Pool, connection_tokens, end_to_end
from retrysafe._http.asgi import (
    UNPROVEN_END,
    ASGIApp,
    IdempotencyMiddleware,
    Message,
    Receive,
    Scope,
    Send,
    lifespan,
    send_answer,
)
from retrysafe._http.problems import Response, problem
from retrysafe._ops.admin import FROM_ENV, AdminSite
from retrysafe._ops.dashboard import serve_admin
from retrysafe._ops.sweep import DEFAULT_SWEEP_EVERY, BackgroundSweeper
from retrysafe.errors import UpstreamError
from retrysafe.stores import Store, redact

__all__ = [
    "ADMIN_PREFIX",
    "DASHBOARD_PATH",
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_HEAD_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_HEAD_SIZE",
    "DEFAULT_TIMEOUT",
    "ENV_BODY_TIMEOUT",
    "ENV_HEAD_TIMEOUT",
    "ENV_MAX_CONNECTIONS",
    "ENV_MAX_HEAD_SIZE",
    "ENV_PRINCIPALS",
    "ENV_REQUIRE_KEY",
    "ENV_SWEEP",
    "ENV_TIMEOUT",
    "ENV_TRUSTED_PROXIES",
    "ENV_UPSTREAM",
    "FORWARDING_HEADERS",
    "HEALTH_PATH",
    "METRICS_PATH",
    "Gateway",
    "HTTPProtocol",
    "app_from_env",
    "create_app",
    "forwarder",
    "parse_upstream",
    "probe_store",
    "trusted_networks",
]

log = logging.getLogger("retrysafe.gateway")

IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Seconds to connect to, send to, or wait for the next bytes from the upstream.
DEFAULT_TIMEOUT = 60.0
ADMIN_PREFIX = "/_retrysafe/"
HEALTH_PATH = "/_retrysafe/health"
DASHBOARD_PATH = "/_retrysafe/"
METRICS_PATH = "/_retrysafe/metrics"
_ADMIN_ROOT = ADMIN_PREFIX[:-1]
#: The environment that :func:`app_from_env` reads (with ``RETRYSAFE_STORE``).
ENV_UPSTREAM = "RETRYSAFE_GATEWAY_UPSTREAM"
ENV_REQUIRE_KEY = "RETRYSAFE_GATEWAY_REQUIRE_KEY"
ENV_TIMEOUT = "RETRYSAFE_GATEWAY_TIMEOUT"
ENV_MAP = "RETRYSAFE_GATEWAY_MAP"
ENV_MAX_HEAD_SIZE = "RETRYSAFE_GATEWAY_MAX_HEAD_SIZE"
ENV_HEAD_TIMEOUT = "RETRYSAFE_GATEWAY_HEAD_TIMEOUT"
ENV_BODY_TIMEOUT = "RETRYSAFE_GATEWAY_BODY_TIMEOUT"
ENV_MAX_CONNECTIONS = "RETRYSAFE_GATEWAY_MAX_CONNECTIONS"
#: The uvicorn protocol (``http=``) that holds clients to the gateway's limits:
#: uvicorn's httptools one when httptools is installed, else its h11 one.
HTTPProtocol = protocol_class()
#: Seconds between background sweeps; ``0`` or ``off``: no sweeper.
ENV_SWEEP = "RETRYSAFE_GATEWAY_SWEEP"
#: The principal options (JSON: ``principal_headers``, ``principal_cookies``,
#: ``principal_query``, ``anonymous``), as ``retrysafe gateway`` gives its workers.
ENV_PRINCIPALS = "RETRYSAFE_GATEWAY_PRINCIPALS"
#: The trusted proxies (addresses or CIDRs, comma-separated).
ENV_TRUSTED_PROXIES = "RETRYSAFE_GATEWAY_TRUSTED_PROXIES"
_PRINCIPAL_OPTIONS = ("principal_headers", "principal_cookies", "principal_query", "anonymous")

# A key hash that no record has: reading it is the store's cheapest round trip.
_PROBE_KEY = "0" * 64
_PROBE_TIMEOUT = 5.0
# Headers that say who the client is, where it connected or what it asked for, as a
# proxy in front sets them. From a client that is not a trusted proxy they are
# forgeries: dropped, with every X-Forwarded-* (the gateway sets its own three).
FORWARDING_HEADERS = frozenset(
    {
        b"forwarded",
        b"x-forwarded",
        b"x-real-ip",
        b"true-client-ip",
        b"x-client-ip",
        b"x-cluster-client-ip",
        b"client-ip",
        b"cf-connecting-ip",
        b"fastly-client-ip",
        b"x-original-forwarded-for",
        b"x-original-url",
        b"x-rewrite-url",
        b"x-original-host",
        b"x-host",
    }
)
_OWN = frozenset({b"host", b"x-forwarded-for", b"x-forwarded-host", b"x-forwarded-proto"})
_NOT_VCHAR = re.compile(rb"[^\x21-\x7e]")
_BOOLS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
    "": False,
}


def parse_upstream(url: str) -> httpx.URL:
    """The upstream's base URL, checked: ``http(s)://host[:port][/base/path]``.

    Raises ValueError saying what is wrong (passwords redacted).
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError("the upstream URL is empty: give one like http://127.0.0.1:9000")
    shown = redact(url)
    try:
        parsed = httpx.URL(url.strip())
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"bad upstream URL {shown!r}: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"bad upstream URL {shown!r}: it must start with http:// or https://")
    if not parsed.host:
        raise ValueError(f"bad upstream URL {shown!r}: it has no host")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise ValueError(f"bad upstream URL {shown!r}: port {parsed.port} is out of range")
    if parsed.userinfo:
        raise ValueError(f"bad upstream URL {shown!r}: credentials in the URL are not supported")
    if parsed.query or parsed.fragment:
        raise ValueError(f"bad upstream URL {shown!r}: it must not have a query or fragment")
    return parsed


def probe_store(store: Store[Any]) -> None:
    """One cheap read of ``store``; raises StoreUnavailableError if it cannot be reached."""
    store.get(_PROBE_KEY)


class _ClientGone(Exception):
    """The client disconnected while its request body was being forwarded."""


# How a request header reaches the upstream, from an untrusted client and from a
# trusted proxy: as it came, dropped, replaced by the gateway's own, or read for its
# tokens (Connection).
_FORWARD, _DROP, _OWN_FIELD, _CONNECTION = range(4)
# Header names seen, as sent, with their lower-cased form and what becomes of them
# (short names only, and so many at most: a client's random names are not kept).
_NAMES: dict[bytes, tuple[bytes, int, int]] = {}
_MAX_NAMES, _MAX_NAME = 1024, 64
_HOP_OR_EMPTY = HOP_BY_HOP | {b""}
_SCHEMES = {"http": b"http", "https": b"https"}


def _name_kinds(raw: bytes) -> tuple[bytes, int, int]:
    """A request header's name lower-cased, and how it is forwarded from an untrusted
    client and from a trusted proxy."""
    name = raw.lower()
    if name == b"connection":
        kinds = (name, _CONNECTION, _CONNECTION)
    elif name in HOP_BY_HOP or name.startswith(b"proxy-"):
        kinds = (name, _DROP, _DROP)
    elif name in _OWN:
        kinds = (name, _OWN_FIELD, _OWN_FIELD)
    elif name in FORWARDING_HEADERS or name.startswith(b"x-forwarded-"):
        kinds = (name, _DROP, _FORWARD)
    else:
        kinds = (name, _FORWARD, _FORWARD)
    if len(raw) <= _MAX_NAME and len(_NAMES) < _MAX_NAMES:
        _NAMES[raw] = kinds
    return kinds


class _Proxy:
    """The plain ASGI app that forwards a request to the upstream and streams the answer."""

    def __init__(
        self, upstream: httpx.URL, timeout: float, trusted: tuple[IPNetwork, ...] = ()
    ) -> None:
        self.upstream = upstream
        self.trusted = trusted
        self.prefix = upstream.raw_path.rstrip(b"/")
        self.host = upstream.netloc
        self.timeout = timeout
        https = upstream.scheme == "https"
        host = upstream.raw_host.decode("ascii")
        self.address = (host, upstream.port or (443 if https else 80), host if https else None)
        self._ssl: ssl.SSLContext | None = None
        self._pools: dict[asyncio.AbstractEventLoop, Pool] = {}
        self._pool: Pool | None = None

    def ssl_context(self) -> ssl.SSLContext | None:
        """For an ``https://`` upstream: certificates checked against certifi's CA bundle."""
        if self.upstream.scheme != "https":
            return None
        if self._ssl is None:
            try:
                import certifi  # installed with httpx

                cafile: str | None = certifi.where()
            except ImportError:
                cafile = None
            context = ssl.create_default_context(cafile=cafile)
            context.set_alpn_protocols(["http/1.1"])
            self._ssl = context
        return self._ssl

    def pool(self) -> Pool:
        """The running event loop's connection pool (made on first use)."""
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None:
            for old in [lp for lp in self._pools if lp.is_closed()]:
                del self._pools[old]
            pool = self._pools[loop] = Pool(self.address, self.ssl_context(), self.timeout, loop)
        self._pool = pool  # the last one used: most often the only one
        return pool

    async def aclose(self) -> None:
        """Close the running event loop's connections."""
        pool = self._pools.pop(asyncio.get_running_loop(), None)
        if pool is self._pool:
            self._pool = None
        if pool is not None:
            await pool.aclose()

    def path(self, scope: Scope) -> bytes:
        """The path the upstream is sent: base path and the raw path, as the client spelled it."""
        raw = scope.get("raw_path")
        if not raw or not raw.startswith(b"/"):
            raw = urllib.parse.quote(scope["path"], safe="/:@!$&'()*+,;=~").encode()
        return _visible(self.prefix + raw)

    def target(self, scope: Scope) -> bytes:
        """The request target for the upstream: base path, raw path and raw query."""
        query = scope.get("query_string", b"")
        return self.path(scope) + (b"?" + _visible(query) if query else b"")

    def trusts(self, client: Any) -> bool:
        """Whether the peer ``client`` (the ASGI scope's) is one of the trusted proxies."""
        if not self.trusted or not client:
            return False
        try:
            address = ipaddress.ip_address(str(client[0]))
        except ValueError:  # a Unix socket's path, say: not an address
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in self.trusted)

    def headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The request headers for the upstream, with ``Host`` and ``X-Forwarded-*``.

        The forwarding headers a client sent (:data:`FORWARDING_HEADERS`, every
        ``X-Forwarded-*``) reach the upstream only from a trusted proxy, whose
        ``X-Forwarded-For`` chain is extended and whose ``X-Forwarded-Host`` and
        ``-Proto`` are kept; from anyone else they are dropped.
        """
        headers = scope["headers"]
        client = scope.get("client")
        trusted = bool(self.trusted) and self.trusts(client)
        out = [(b"host", self.host)]
        own: dict[bytes, list[bytes]] = {}
        connection: list[bytes] = []
        side = 2 if trusted else 1
        for raw, value in headers:
            kinds = _NAMES.get(raw) or _name_kinds(raw)
            kind = kinds[side]
            if kind == _FORWARD:
                out.append((kinds[0], value))
            elif kind == _OWN_FIELD:
                own.setdefault(kinds[0], []).append(value)
            elif kind == _CONNECTION:
                connection.append(value)
        if connection and not connection_tokens([(b"connection", v) for v in connection]) <= (
            _HOP_OR_EMPTY
        ):
            # Connection names end-to-end headers as this connection's own: dropped too.
            out, own = self._listed(headers, trusted)
        if trusted:
            chain = [v for v in own.get(b"x-forwarded-for", ()) if v.strip()]
            if client:
                chain.append(str(client[0]).encode("latin-1"))
            if chain:
                out.append((b"x-forwarded-for", b", ".join(chain)))
        elif client:
            out.append((b"x-forwarded-for", str(client[0]).encode("latin-1")))
        given = own.get(b"x-forwarded-host") if trusted else None
        if given:
            out.extend((b"x-forwarded-host", v) for v in given)
        elif (host := own.get(b"host")) and host[0]:
            out.append((b"x-forwarded-host", host[0]))
        given = own.get(b"x-forwarded-proto") if trusted else None
        if given:
            out.extend((b"x-forwarded-proto", v) for v in given)
        elif scheme := scope.get("scheme", "http"):
            out.append((b"x-forwarded-proto", _SCHEMES.get(scheme) or scheme.encode("latin-1")))
        return out

    def _listed(
        self, headers: list[tuple[bytes, bytes]], trusted: bool
    ) -> tuple[list[tuple[bytes, bytes]], dict[bytes, list[bytes]]]:
        """The forwarded headers and the gateway's own that came, where a Connection
        header lists more than the hop-by-hop ones."""
        out = [(b"host", self.host)]
        own: dict[bytes, list[bytes]] = {}
        for name, value in end_to_end(headers):
            if name in _OWN:
                own.setdefault(name, []).append(value)
            elif trusted or not (name in FORWARDING_HEADERS or name.startswith(b"x-forwarded-")):
                out.append((name, value))
        return out, own

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        method = scope["method"]
        answer = None
        try:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            # A body in one message is sent whole; any other is streamed, never buffered.
            body: bytes | AsyncGenerator[bytes, None] = (
                _stream(message, receive)
                if message.get("more_body", False)
                else message.get("body", b"")
            )
            pool = self._pool
            if pool is None or pool.loop is not asyncio.get_running_loop():
                pool = self.pool()
            answer = await pool.send(method, self.target(scope), self.headers(scope), body)
            # Read before the status goes out: a framing error up to the first body
            # byte (a bad chunk size, say) is still the 502 problem.
            chunk = await answer.read()
        except _ClientGone:
            return
        except UpstreamError as exc:
            if answer is not None:
                answer.close()
            what = "timed out" if exc.timeout else "unavailable"
            log.warning(
                "retrysafe gateway: upstream %s: %s %s: %s", what, method, scope["path"], exc
            )
            status, code = (
                (504, "upstream_timeout") if exc.timeout else (502, "upstream_unavailable")
            )
            await send_answer(send, _upstream_problem(status, code, exc))
            return
        try:
            # The pool passes on the end-to-end headers only.
            headers = answer.headers
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            # The chunk that completes a declared Content-Length is the last message:
            # the middleware records the answer before that message leaves, and a
            # client holding the whole body may retry at once.
            left = answer.length
            ended = False
            while chunk:
                if not ended:
                    if left is not None:
                        left -= len(chunk)
                        ended = left <= 0
                    await send(
                        {"type": "http.response.body", "body": chunk, "more_body": not ended}
                    )
                chunk = b"" if answer.done else await answer.read()
            if not ended:
                # A body that ran to the close: passed on, but nothing proves it whole.
                last = {"type": "http.response.body", "body": b"", "more_body": False}
                if answer.until_close:
                    last[UNPROVEN_END] = True
                await send(last)
        except UpstreamError as exc:
            # Too late for a 502: the answer is left unfinished, so the server drops
            # the connection and the client sees a truncated answer, not a short one.
            log.warning(
                "retrysafe gateway: the upstream broke off its answer to %s %s: %s",
                method,
                scope["path"],
                exc,
            )
        finally:
            answer.close()


def trusted_networks(proxies: Iterable[str]) -> tuple[IPNetwork, ...]:
    """The networks of ``proxies`` (addresses or CIDRs such as ``10.0.0.0/8``);
    ValueError naming the first one that is neither."""
    if isinstance(proxies, str):
        proxies = [proxies]
    networks = []
    for proxy in proxies:
        try:
            networks.append(ipaddress.ip_network(str(proxy).strip(), strict=False))
        except ValueError:
            raise ValueError(
                f"bad trusted proxy {proxy!r}: give an IP address or a CIDR such as 10.0.0.0/8"
            ) from None
    return tuple(networks)


def _visible(target: bytes) -> bytes:
    """Bytes no HTTP/1.1 request line may carry percent-encoded; nothing else changes."""
    if _NOT_VCHAR.search(target) is None:  # the usual: nothing to encode
        return target
    return _NOT_VCHAR.sub(lambda m: b"%%%02X" % m.group()[0], target)


class _Recording(IdempotencyMiddleware):
    """The middleware in front of the proxy: a keyed request's fingerprint covers the
    exact path forwarded, so ``/a%2Fb`` and ``/a/b`` are two requests, as upstream."""

    app: _Proxy

    def request_path(self, scope: Scope) -> str:
        return self.app.path(scope).decode("ascii")


async def _stream(message: Message, receive: Receive) -> AsyncGenerator[bytes, None]:
    """The chunks of a body, from its first ``message`` on (streamed, never buffered)."""
    while message["type"] != "http.disconnect":
        if chunk := message.get("body", b""):
            yield chunk
        if not message.get("more_body", False):
            return
        message = await receive()
    raise _ClientGone


def _upstream_problem(status: int, code: str, exc: UpstreamError) -> Response:
    what = "did not answer in time" if status == 504 else "cannot be reached"
    detail = f"the upstream {what} ({exc.kind}); retry with the same key"
    return problem(status, code, detail)


def _json(status: int, doc: dict[str, Any]) -> Response:
    body = json.dumps(doc, separators=(",", ":")).encode()
    headers = [
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        ("cache-control", "no-store"),
    ]
    return Response(status, headers, body)


class Gateway:
    """The gateway's ASGI app: its own pages, then idempotency, then the upstream.

    ``upstream`` is the base URL requests go to (a base path is prefixed to
    theirs). ``store`` is a store, a store URL or an engine (default
    ``$RETRYSAFE_STORE`` or the embedded SQLite store); a store it opened from a
    URL it closes on lifespan shutdown. ``timeout`` bounds connecting to the
    upstream and each wait for its bytes. ``trusted_proxies``: the addresses or
    CIDRs of the proxies in front whose forwarding headers (``Forwarded``,
    ``X-Forwarded-*``, ``X-Real-IP``, ...) reach the upstream (default none:
    dropped from every client). ``admin_token`` guards the dashboard
    and metrics under ``/_retrysafe/`` (default ``$RETRYSAFE_ADMIN_TOKEN``);
    ``admin_loopback=True`` (default ``$RETRYSAFE_ADMIN_LOOPBACK``) answers loopback
    clients without it; with neither those pages are closed (``/_retrysafe/health``
    always answers). ``max_head_size`` (bytes of request line and headers),
    ``head_timeout`` (seconds for a whole head), ``body_timeout`` (seconds without a
    byte of a body being read) and ``max_connections`` (open client connections per
    process) bound each client; the head and connection bounds hold when the app is
    served with ``http=HTTPProtocol``. ``sweep_every`` is how often the gateway sweeps
    expired records from its store in the background (default 300 seconds, one worker at
    a time, see :class:`~retrysafe._ops.sweep.BackgroundSweeper`); None turns the sweeper
    off. ``options`` are those of :class:`retrysafe.asgi.IdempotencyMiddleware`.
    """

    def __init__(
        self,
        upstream: str,
        *,
        store: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        admin_token: str | None = FROM_ENV,
        admin_loopback: bool = FROM_ENV,
        max_head_size: int = DEFAULT_MAX_HEAD_SIZE,
        head_timeout: float = DEFAULT_HEAD_TIMEOUT,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        sweep_every: float | None = DEFAULT_SWEEP_EVERY,
        trusted_proxies: Iterable[str] = (),
        **options: Any,
    ) -> None:
        self.server_limits = ServerLimits(
            max_head_size, head_timeout, body_timeout, max_connections
        )
        self._body_timeout = BodyTimeout(self.server_limits.body_timeout)
        self.upstream = parse_upstream(upstream)
        self.proxy = _Proxy(self.upstream, _timeout(timeout), trusted_networks(trusted_proxies))
        self.middleware: IdempotencyMiddleware = _Recording(self.proxy, store=store, **options)
        self.engine = self.middleware.policy.engine
        self.store: Store[Any] = self.engine.store
        self._owns_store = store is None or isinstance(store, str)
        self.admin = AdminSite(self.store, token=admin_token, loopback=admin_loopback)
        self.sweeper: BackgroundSweeper | None = None
        if sweep_every is not None:  # the engine's clock says what has expired
            self.sweeper = BackgroundSweeper(self.store, sweep_every, clock=self.engine.clock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if path == HEALTH_PATH:
                await send_answer(send, await self._health(scope))
            elif path.startswith(ADMIN_PREFIX) or path == _ADMIN_ROOT:
                await serve_admin(self.admin, scope, send, path[len(_ADMIN_ROOT) :], _ADMIN_ROOT)
            else:
                await self._body_timeout(self.middleware, scope, receive, send)
        elif kind == "lifespan":
            # Sampling from the start, the dashboard has history when it is first opened.
            await lifespan(receive, send, self.aclose, self._start)
        else:  # WebSocket is not proxied: refuse the handshake
            await send({"type": "websocket.close", "code": 1008})

    def _start(self) -> None:
        # What is loaded by now (modules, classes, the app) lives as long as the
        # process: moved out of the collector's sight, it no longer lengthens every
        # full collection (tens of milliseconds here, the gateway's p99 tail).
        gc.collect()
        gc.freeze()
        self.admin.monitor.start()
        if self.sweeper is not None:
            self.sweeper.start()

    async def _health(self, scope: Scope) -> Response:
        path, method = scope["path"], scope["method"]
        if method not in ("GET", "HEAD"):
            return problem(
                405,
                "method_not_allowed",
                f"{path} answers GET and HEAD",
                headers=[("allow", "GET, HEAD")],
            )
        answer = await self.health()
        if method == "HEAD":
            answer.body = b""
        return answer

    async def health(self) -> Response:
        """200 ``{"status": "ok", "store": "ok"}`` after a store read, else 503."""
        try:
            await asyncio.wait_for(self.store.aget(_PROBE_KEY), _PROBE_TIMEOUT)
        except Exception as exc:  # any failure of the probe means "not healthy", never a 500
            log.warning(
                "retrysafe gateway: health: the store is unavailable: %s", exc or type(exc).__name__
            )
            return _json(503, {"status": "unavailable", "store": "unavailable"})
        return _json(200, {"status": "ok", "store": "ok"})

    async def aclose(self) -> None:
        """Close this event loop's upstream connections, and the store if it opened it."""
        try:
            if self.sweeper is not None:  # before the store closes under its sweep
                await self.sweeper.aclose()
            await asyncio.to_thread(self.admin.monitor.close)  # joins its thread
            await self.proxy.aclose()
            if self._owns_store:
                await self.engine.aclose()
        except Exception as exc:  # shutting down: report, never stop the shutdown
            log.warning("retrysafe gateway: error while closing: %s", exc)


def create_app(
    upstream: str, *, store: Any = None, timeout: float = DEFAULT_TIMEOUT, **options: Any
) -> Gateway:
    """The gateway in front of ``upstream`` as an ASGI app (see :class:`Gateway`)."""
    return Gateway(upstream, store=store, timeout=timeout, **options)


def forwarder(
    upstream: str, *, timeout: float = DEFAULT_TIMEOUT, trusted_proxies: Iterable[str] = ()
) -> ASGIApp:
    """The gateway's forwarding alone, with no idempotency of its own: a plain ASGI app
    that sends every HTTP request to ``upstream`` and streams its answer back (what
    ``retrysafe mcp-proxy --upstream`` puts behind its MCP middleware). Its ``aclose()``
    closes the running event loop's upstream connections. :class:`ValueError` for a
    ``timeout`` that is not a positive number of seconds."""
    return _Proxy(parse_upstream(upstream), _timeout(timeout), trusted_networks(trusted_proxies))


def _timeout(timeout: Any) -> float:
    """``timeout``, checked: a positive, finite number of seconds."""
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not (timeout > 0 and math.isfinite(timeout))
    ):
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    return float(timeout)


def app_from_env() -> ASGIApp:
    """The gateway configured by the environment: a factory for ``uvicorn --factory``.

    ``RETRYSAFE_GATEWAY_UPSTREAM`` (required), ``RETRYSAFE_STORE``,
    ``RETRYSAFE_GATEWAY_REQUIRE_KEY`` (``1``/``0``), ``RETRYSAFE_GATEWAY_TIMEOUT``,
    ``RETRYSAFE_GATEWAY_MAP`` (the path of an Idempotency Map),
    ``RETRYSAFE_GATEWAY_PRINCIPALS`` (a JSON object of principal options),
    ``RETRYSAFE_GATEWAY_MAX_HEAD_SIZE``, ``RETRYSAFE_GATEWAY_HEAD_TIMEOUT``,
    ``RETRYSAFE_GATEWAY_BODY_TIMEOUT``, ``RETRYSAFE_GATEWAY_MAX_CONNECTIONS``,
    ``RETRYSAFE_GATEWAY_SWEEP`` (seconds between sweeps; ``0`` or ``off``: none) and
    ``RETRYSAFE_GATEWAY_TRUSTED_PROXIES`` (addresses or CIDRs, comma-separated); the
    admin pages read ``RETRYSAFE_ADMIN_TOKEN`` and ``RETRYSAFE_ADMIN_LOOPBACK``.
    """
    upstream = os.environ.get(ENV_UPSTREAM, "")
    if not upstream:
        raise ValueError(f"set {ENV_UPSTREAM} to the upstream's URL")
    require = os.environ.get(ENV_REQUIRE_KEY, "").strip().lower()
    if require not in _BOOLS:
        raise ValueError(f"{ENV_REQUIRE_KEY} must be 1 or 0, not {require!r}")
    imap = os.environ.get(ENV_MAP) or None
    principals = _principal_options(os.environ.get(ENV_PRINCIPALS, ""))
    proxies = [p for p in os.environ.get(ENV_TRUSTED_PROXIES, "").split(",") if p.strip()]
    return create_app(
        upstream,
        require_key=_BOOLS[require],
        timeout=_env_number(ENV_TIMEOUT, float, DEFAULT_TIMEOUT),
        map=imap,
        max_head_size=_env_number(ENV_MAX_HEAD_SIZE, int, DEFAULT_MAX_HEAD_SIZE),
        head_timeout=_env_number(ENV_HEAD_TIMEOUT, float, DEFAULT_HEAD_TIMEOUT),
        body_timeout=_env_number(ENV_BODY_TIMEOUT, float, DEFAULT_BODY_TIMEOUT),
        max_connections=_env_number(ENV_MAX_CONNECTIONS, int, DEFAULT_MAX_CONNECTIONS),
        sweep_every=_sweep_interval(os.environ.get(ENV_SWEEP, "")),
        trusted_proxies=proxies,
        **principals,
    )


def _sweep_interval(text: str) -> float | None:
    """The sweep interval in ``RETRYSAFE_GATEWAY_SWEEP``: empty for the default,
    ``0`` or ``off`` for none, else positive seconds (ValueError otherwise)."""
    text = text.strip().lower()
    if not text:
        return DEFAULT_SWEEP_EVERY
    if text in ("0", "off", "false", "no"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{ENV_SWEEP} must be a number of seconds, 0 or off, not {text!r}")
    return seconds


def _env_number(name: str, kind: type[int] | type[float], default: float) -> Any:
    """The number in environment variable ``name`` (``default`` if unset or empty)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number of seconds"
        raise ValueError(f"{name} must be {what}, not {text!r}") from None


def _principal_options(text: str) -> dict[str, Any]:
    """The principal options in ``RETRYSAFE_GATEWAY_PRINCIPALS`` (ValueError if malformed)."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{ENV_PRINCIPALS} is not JSON: {exc}") from None
    if not isinstance(options, dict) or set(options) - set(_PRINCIPAL_OPTIONS):
        raise ValueError(
            f"{ENV_PRINCIPALS} must be a JSON object of {', '.join(_PRINCIPAL_OPTIONS)}"
        )
    return options
