"""The demo behind ``retrysafe demo``: a shop behind the gateway (the ``gateway`` extra)."""

from retrysafe.errors import MissingExtraError

try:
    import httpx  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as exc:
    raise MissingExtraError("gateway", "retrysafe demo", name=exc.name) from exc
