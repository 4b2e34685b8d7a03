"""The serving commands: ``retrysafe demo`` and ``retrysafe gateway``."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from retrysafe._cli.common import (
    DEMO_STORE_URL,
    StoreOpt,
    app,
    store_url_for,
)
from retrysafe.errors import StoreUnavailableError
from retrysafe.stores import redact

__all__ = ["demo", "gateway"]


@app.command()
def demo(
    store: StoreOpt = None,
    listen: Annotated[
        str | None,
        typer.Option(
            metavar="HOST:PORT",
            help="The gateway's address (default 127.0.0.1:8000, or a free port if taken).",
        ),
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Send a retry storm through the gateway, report, and exit 0 only if "
            "every order ran exactly once.",
        ),
    ] = False,
    orders: Annotated[int, typer.Option(help="Orders in the storm (--check).")] = 20,
    retries: Annotated[int, typer.Option(help="Clients sending each order at once.")] = 8,
) -> int:
    """Start the gateway in front of a small demo API and show retries replayed."""
    from retrysafe._demo.run import run_demo

    return run_demo(
        store_url_for(store, DEMO_STORE_URL),
        listen=listen,
        check=check,
        orders=orders,
        retries=retries,
    )


@app.command()
def gateway(
    upstream: Annotated[
        str, typer.Option(metavar="URL", help="The API to proxy to, e.g. http://127.0.0.1:9000.")
    ],
    store: StoreOpt = None,
    listen: Annotated[
        str, typer.Option(metavar="HOST:PORT", help="Where to listen (port 0: any free port).")
    ] = "127.0.0.1:8000",
    require_key: Annotated[
        bool,
        typer.Option("--require-key", help="Answer 400 to a POST or PATCH without a key."),
    ] = False,
    map_file: Annotated[
        Path | None,
        typer.Option(
            "--map", metavar="FILE", help="An Idempotency Map (TOML) with per-route policy."
        ),
    ] = None,
    workers: Annotated[int, typer.Option(help="Worker processes.")] = 1,
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for the upstream to connect or send.")
    ] = 60.0,
    principal_header: Annotated[
        list[str] | None,
        typer.Option(
            "--principal-header",
            metavar="NAME",
            help="A header that carries a credential (repeat for several). Given at all, "
            "it replaces the default list (Proxy-Authorization, X-API-Key, Api-Key, "
            "X-Api-Token, X-Auth-Token, X-Access-Token, X-Session-Token, X-User-Token); "
            "every Authorization line always counts.",
        ),
    ] = None,
    principal_cookie: Annotated[
        list[str] | None,
        typer.Option(
            "--principal-cookie",
            metavar="NAME",
            help="A session cookie's name (repeat for several): only these cookies name "
            "the caller. Default: every cookie but analytics, consent, CSRF and "
            "load-balancer ones.",
        ),
    ] = None,
    principal_query: Annotated[
        list[str] | None,
        typer.Option(
            "--principal-query",
            metavar="NAME",
            help="A query parameter that carries a credential (repeat for several).",
        ),
    ] = None,
    trusted_proxy: Annotated[
        list[str] | None,
        typer.Option(
            "--trusted-proxy",
            metavar="CIDR",
            help="A proxy in front of the gateway (an address or a CIDR; repeat for "
            "several) whose Forwarded, X-Forwarded-*, X-Real-IP and similar headers "
            "reach the upstream. Default none: they are dropped from every client.",
        ),
    ] = None,
    anonymous: Annotated[
        str | None,
        typer.Option(
            metavar="run|refuse|share",
            help="What a keyed request without credentials gets: run without a record "
            "(default), refuse (403), or share one public record space.",
        ),
    ] = None,
    admin_loopback: Annotated[
        bool,
        typer.Option(
            "--admin-loopback",
            help="Open the dashboard, metrics and key inspector to every loopback "
            "connection without the admin token (default $RETRYSAFE_ADMIN_LOOPBACK, else "
            "off: without $RETRYSAFE_ADMIN_TOKEN they are closed). Not behind a proxy on "
            "this host: its connections are loopback ones.",
        ),
    ] = False,
    max_head_size: Annotated[
        int | None,
        typer.Option(
            metavar="BYTES",
            help="The most bytes of request line and headers read (default 65536); "
            "a larger head gets 431.",
        ),
    ] = None,
    head_timeout: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="Seconds for a request's line and headers to arrive (default 30); "
            "a slower head gets 408.",
        ),
    ] = None,
    body_timeout: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="Seconds the gateway waits for the next byte of a request body "
            "(default 60); then 408.",
        ),
    ] = None,
    max_connections: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Open client connections per worker (default 512); one more gets 503.",
        ),
    ] = None,
    http: Annotated[
        str,
        typer.Option(
            metavar="auto|httptools|h11",
            help="The HTTP/1.1 parser: httptools (fast, the 'speed' extra) or h11; "
            "auto picks httptools when it is installed.",
        ),
    ] = "auto",
    sweep_every: Annotated[
        float,
        typer.Option(
            metavar="SECONDS",
            help="How often expired records are swept from the store in the background "
            "(one worker at a time).",
        ),
    ] = 300.0,
    no_sweep: Annotated[
        bool,
        typer.Option(
            "--no-sweep",
            help="Run no sweeper (when `retrysafe sweep` runs elsewhere, e.g. from cron).",
        ),
    ] = False,
) -> int:
    """A reverse proxy that makes an HTTP API's retries safe.

    Answers never cross callers: a caller is named by its credentials (every
    Authorization line, API-key headers, session cookies); see docs/principals.md.
    """
    # isort: off
    from retrysafe import gateway as gw  # first: without uvicorn, it names the extra

    import uvicorn

    # isort: on
    from retrysafe._gateway.limits import protocol_class
    from retrysafe._ops.serve import (
        SERVER_OPTIONS,
        bind,
        parse_listen,
        server_config,
        sigterm_as_interrupt,
        url_of,
    )

    if workers < 1:
        raise ValueError(f"--workers must be at least 1, not {workers}")
    if not (sweep_every > 0 and math.isfinite(sweep_every)):
        raise ValueError(f"--sweep-every must be a positive number of seconds, not {sweep_every}")
    sweep = None if no_sweep else sweep_every
    host, port = parse_listen(listen)
    store_url = store_url_for(store)
    imap = None
    if map_file is not None:
        from retrysafe._map.map import IdempotencyMap

        imap = IdempotencyMap.load(map_file)
    principals = {
        "principal_headers": principal_header or None,
        "principal_cookies": principal_cookie or None,
        "principal_query": principal_query or None,
        "anonymous": anonymous,
    }
    principals = {name: value for name, value in principals.items() if value is not None}
    from retrysafe._ops.admin import ENV_LOOPBACK, loopback_from_env

    admin_loopback = admin_loopback or loopback_from_env()  # (a bad value: an error now)
    limits = {
        "max_head_size": max_head_size,
        "head_timeout": head_timeout,
        "body_timeout": body_timeout,
        "max_connections": max_connections,
    }
    limits = {name: value for name, value in limits.items() if value is not None}
    protocol = protocol_class(http)
    application = gw.create_app(
        upstream,
        store=store_url,
        require_key=require_key,
        timeout=timeout,
        map=imap,
        admin_loopback=admin_loopback,
        sweep_every=sweep,
        trusted_proxies=trusted_proxy or (),
        **principals,
        **limits,
    )
    try:
        gw.probe_store(application.store)
    except StoreUnavailableError as exc:
        if urllib.parse.urlsplit(store_url).scheme in ("sqlite", "memory"):
            raise  # an embedded store that cannot be opened is a configuration error
        print(
            f"retrysafe gateway: warning: {exc}; keyed requests get 503 until it answers",
            file=sys.stderr,
        )
    sock = bind(host, port)
    stack = contextlib.ExitStack()
    url = url_of(sock)
    print(f"retrysafe gateway: listening on {url}", flush=True)
    print(f"  upstream  {application.upstream}", flush=True)
    print(f"  store     {redact(store_url)}", flush=True)
    if map_file is not None:
        print(f"  map       {map_file}", flush=True)
    print(f"  callers   {application.middleware.policy.principals.describe()}", flush=True)
    print(f"  limits    {_limits_line(application.server_limits, protocol)}", flush=True)
    swept = "off (--no-sweep)" if sweep is None else f"every {sweep:g} s, one worker at a time"
    print(f"  sweeper   {swept}", flush=True)
    if trusted_proxy:
        print(f"  proxies   {', '.join(map(str, application.proxy.trusted))}", flush=True)
    print(f"  health    {url}{gw.HEALTH_PATH}", flush=True)
    print(f"  dashboard {url}{gw.DASHBOARD_PATH}  ({_admin_access(admin_loopback)})", flush=True)
    print(f"  metrics   {url}{gw.METRICS_PATH}", flush=True)
    try:
        if workers == 1:
            with sigterm_as_interrupt():  # uvicorn stops gracefully, then re-raises it
                config = server_config(application, lifespan="on", http=protocol)
                uvicorn.Server(config).run(sockets=[sock])
        else:
            # Workers import the app: a factory configured by the environment.
            port = sock.getsockname()[1]
            sock.close()
            application.store.close()
            env = {
                gw.ENV_UPSTREAM: upstream,
                "RETRYSAFE_STORE": store_url,
                gw.ENV_REQUIRE_KEY: "1" if require_key else "0",
                gw.ENV_TIMEOUT: repr(timeout),
                ENV_LOOPBACK: "1" if admin_loopback else "0",
                gw.ENV_MAX_HEAD_SIZE: str(application.server_limits.max_head_size),
                gw.ENV_HEAD_TIMEOUT: repr(application.server_limits.head_timeout),
                gw.ENV_BODY_TIMEOUT: repr(application.server_limits.body_timeout),
                gw.ENV_MAX_CONNECTIONS: str(application.server_limits.max_connections),
                gw.ENV_SWEEP: "off" if sweep is None else repr(sweep),
            }
            if map_file is not None:
                env[gw.ENV_MAP] = str(Path(map_file).resolve())
            if principals:
                env[gw.ENV_PRINCIPALS] = json.dumps(principals)
            if trusted_proxy:
                env[gw.ENV_TRUSTED_PROXIES] = ",".join(trusted_proxy)
            os.environ.update(env)
            stack.enter_context(_shared_metrics())  # the workers' counters, added up
            uvicorn.run(
                "retrysafe.gateway:app_from_env",
                factory=True,
                host=host,
                port=port,
                workers=workers,
                lifespan="on",
                http=protocol,
                **SERVER_OPTIONS,
            )
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        stack.close()
    print("retrysafe gateway: stopped", flush=True)
    return 0


def _limits_line(limits: Any, protocol: type) -> str:
    """What one client may hold of the gateway, for its start-up lines."""
    parser = "httptools" if "HttpTools" in protocol.__name__ else "h11"
    return (
        f"head {limits.max_head_size} bytes in {limits.head_timeout:g} s, "
        f"body idle {limits.body_timeout:g} s, {limits.max_connections} connections "
        f"per worker ({parser})"
    )


def _admin_access(loopback: bool) -> str:
    from retrysafe._ops.admin import ENV_TOKEN

    token = bool(os.environ.get(ENV_TOKEN))
    if token and loopback:
        return f"loopback connections, or the admin token from ${ENV_TOKEN}"
    if token:
        return f"needs the admin token from ${ENV_TOKEN}"
    if loopback:
        return f"open to loopback connections (--admin-loopback), no ${ENV_TOKEN}"
    return f"closed: set ${ENV_TOKEN}, or --admin-loopback"


@contextlib.contextmanager
def _shared_metrics() -> Iterator[None]:
    """A fresh PROMETHEUS_MULTIPROC_DIR for the workers, unless one is set; removed after."""
    from retrysafe._core.metrics import multiprocess_dir

    if multiprocess_dir():
        yield
        return
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="retrysafe-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    try:
        yield
    finally:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        shutil.rmtree(folder, ignore_errors=True)
