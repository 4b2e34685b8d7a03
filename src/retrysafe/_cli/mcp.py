"""``retrysafe mcp-proxy``: idempotent ``tools/call`` in front of any MCP server."""

from __future__ import annotations

import asyncio
import getpass
from typing import Annotated

import typer

from retrysafe._cli.common import CliError, StoreOpt, app, duration_option, store_url_for

__all__ = ["mcp_proxy"]


def local_principal() -> str:
    """The principal of a stdio proxy's one client by default: the local user."""
    try:
        return f"local user {getpass.getuser()}"
    except (KeyError, OSError):  # no user name for this uid
        return "local user"


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
    server and relays its newline-delimited JSON-RPC.
    """
    from retrysafe._protocols.mcp import call_engine
    from retrysafe._protocols.mcp_proxy import StdioRelay

    if not command:
        raise CliError("give the MCP server's command after --, or --upstream URL")
    engine, plan = call_engine(
        store_url_for(store),
        ttl=duration_option(ttl, "--ttl"),
        lease=duration_option(lease, "--lease"),
    )
    who = local_principal() if principal is None else principal
    if not who.strip():
        raise CliError("--principal must not be blank")
    relay = StdioRelay(engine, plan, list(command), principal=who)
    try:
        return asyncio.run(relay.run())
    except KeyboardInterrupt:
        return 130
    finally:
        engine.store.close()
