"""The ``retrysafe`` command line (the ``cli`` extra: typer and rich)."""

from retrysafe.errors import MissingExtraError

try:
    import rich  # noqa: F401
    import typer  # noqa: F401
except ImportError as exc:
    raise MissingExtraError("cli", "the retrysafe command", name=exc.name) from exc
