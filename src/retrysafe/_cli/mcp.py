"""``retrysafe mcp-proxy``: idempotent ``tools/call`` in front of any MCP server."""

from __future__ import annotations

import asyncio
import math
from typing import Annotated, Any

import typer

from retrysafe._cli.common import CliError, StoreOpt, app, duration_option, store_url_for

__all__ = ["mcp_proxy"]


@app.command(
    "mcp-proxy",
    context_settings={"allow_interspersed_args": False},
)
def mcp_proxy(
    command: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="-- COMMAND [ARGS]...",
            help="The MCP server to spawn and relay to over stdio.",
            show_default=False,
        ),
    ] = None,
    store: StoreOpt = None,
    principal: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help="Over stdio: the one client's name, the scope of its keys (default: the "
            "local user). Give each client its own when several proxies share a store.",
        ),
    ] = None,
    ttl: Annotated[
        str | None,
        typer.Option(metavar="DURATION", help="How long an answer is kept (e.g. 24h)."),
    ] = None,
    upstream: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help="Over Streamable HTTP: the MCP endpoint to front, e.g. http://127.0.0.1:9000/mcp.",
        ),
    ] = None,
    listen: Annotated[
        str,
        typer.Option(
            metavar="HOST:PORT", help="With --upstream: where to listen (port 0: any free port)."
        ),
    ] = "127.0.0.1:8000",
    timeout: Annotated[
        float,
        typer.Option(help="With --upstream: seconds to wait for the upstream to connect or send."),
    ] = 300.0,
    principal_header: Annotated[
        list[str] | None,
        typer.Option(
            "--principal-header",
            metavar="NAME",
            help="With --upstream: a header that carries a credential (repeat for several); "
            "as for retrysafe gateway. Every Authorization line always counts.",
        ),
    ] = None,
    anonymous: Annotated[
        str | None,
        typer.Option(
            metavar="run|refuse|share",
            help="With --upstream: what a keyed call without credentials gets: refused "
            "(default), one public record space shared by all such callers, or run without "
            "a record (unsafe with clients that retry).",
        ),
    ] = None,
    max_body: Annotated[
        int | None,
        typer.Option(
            metavar="BYTES",
            min=1,
            help="The longest client message read (a stdio line, an HTTP body; default "
            "1 MiB): a longer one is refused and never reaches the server.",
        ),
    ] = None,
    lease: Annotated[
        str | None,
        typer.Option(
            metavar="DURATION",
            help="How long a call is held in flight without a heartbeat (e.g. 30s): after a "
            "crash of the proxy, its key is free again when its lease ends.",
        ),
    ] = None,
) -> int:
    """Make a retried tools/call run once, in front of any MCP server (no change to it).

    Over stdio: retrysafe mcp-proxy [--store URL] -- COMMAND [ARGS]... spawns the
    server and relays its newline-delimited JSON-RPC. Over Streamable HTTP:
    retrysafe mcp-proxy --upstream URL --listen HOST:PORT [--store URL].
    """
    from retrysafe._protocols.mcp import call_engine, local_principal
    from retrysafe._protocols.mcp_proxy import DEFAULT_MAX_LINE, StdioRelay

    times = {"ttl": duration_option(ttl, "--ttl"), "lease": duration_option(lease, "--lease")}
    limit = DEFAULT_MAX_LINE if max_body is None else max_body
    if upstream is not None:
        if command:
            raise CliError("give either --upstream URL or a command after --, not both")
        if principal is not None:
            raise CliError("--principal is for stdio; over HTTP the credentials name the caller")
        if not (timeout > 0 and math.isfinite(timeout)):
            raise CliError(f"--timeout must be a positive number of seconds, not {timeout}")
        return _serve_http(
            upstream,
            store_url_for(store),
            listen,
            timeout,
            principal_header,
            anonymous,
            times,
            limit,
        )
    if not command:
        raise CliError("give the MCP server's command after --, or --upstream URL")
    if anonymous is not None or principal_header:
        raise CliError(
            "--anonymous and --principal-header are for --upstream; over stdio "
            "the one caller is --principal"
        )
    who = local_principal() if principal is None else principal
    if not who.strip():
        raise CliError("--principal must not be blank")
    engine, plan = call_engine(
        store_url_for(store), ttl=times["ttl"], lease=times["lease"], max_body=limit
    )
    relay = StdioRelay(engine, plan, list(command), principal=who, max_line=limit)
    try:
        return asyncio.run(relay.run())
    except KeyboardInterrupt:
        return 130
    finally:
        engine.store.close()


def _serve_http(
    upstream: str,
    store_url: str,
    listen: str,
    timeout: float,
    principal_header: list[str] | None,
    anonymous: str | None,
    times: dict[str, float | None],
    max_body: int,
) -> int:
    """Serve the MCP middleware in front of the forwarding to ``upstream`` until stopped."""
    # isort: off
    from retrysafe import gateway as gw  # first: without uvicorn, it names the extra

    import uvicorn

    # isort: on
    from retrysafe._gateway.limits import protocol_class
    from retrysafe._ops.serve import bind, parse_listen, server_config, sigterm_as_interrupt, url_of
    from retrysafe._protocols.mcp_asgi import McpProxyMiddleware
    from retrysafe.stores import redact

    host, port = parse_listen(listen)
    # The proxy serves the upstream's paths: its endpoint has the upstream's path.
    endpoint = gw.parse_upstream(upstream)
    origin = str(endpoint.copy_with(path="/", query=None, fragment=None)).rstrip("/")
    forward = gw.forwarder(origin, timeout=timeout)
    options: dict[str, Any] = {"principal_headers": principal_header or None}
    if anonymous is not None:
        options["anonymous"] = anonymous
    application = McpProxyMiddleware(
        forward, store_url, ttl=times["ttl"], lease=times["lease"], max_body=max_body, **options
    )
    served = _Limited(application)
    sock = bind(host, port)
    url = url_of(sock)
    print(f"retrysafe mcp-proxy: listening on {url}", flush=True)
    print(f"  endpoint  {url}{endpoint.path}", flush=True)
    print(f"  upstream  {upstream}", flush=True)
    print(f"  store     {redact(store_url)}", flush=True)
    print(f"  callers   {application.principals.describe()}", flush=True)
    limits = served.server_limits
    print(
        f"  limits    head {limits.max_head_size} B in {limits.head_timeout:g} s, body idle "
        f"{limits.body_timeout:g} s, {limits.max_connections} connections",
        flush=True,
    )
    try:
        with sigterm_as_interrupt():
            config = server_config(served, lifespan="off", http=protocol_class())
            uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        application.engine.store.close()
    print("retrysafe mcp-proxy: stopped", flush=True)
    return 0


class _Limited:
    """The proxy's app under the gateway's bounds on each client (docs/gateway.md,
    "Limits on clients"): head size and time and connections (its protocol class
    reads :attr:`server_limits`), and an idle request body's time."""

    def __init__(self, app: Any) -> None:
        from retrysafe._gateway.limits import BodyTimeout, ServerLimits

        self.app = app
        self.server_limits = ServerLimits()
        self._body_timeout = BodyTimeout(self.server_limits.body_timeout)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await self._body_timeout(self.app, scope, receive, send)
        else:
            await self.app(scope, receive, send)
