"""httpx clients that add idempotency keys and retry safely.

:class:`Client` and :class:`AsyncClient` are subclasses of ``httpx.Client`` and
``httpx.AsyncClient``: every httpx keyword argument and method works. A write
request (POST and PATCH by default; PUT and DELETE if the policy says so) gets
an ``Idempotency-Key`` unless the caller gave one, and the same key is sent on
every retry of that call. :class:`MeshClient` and :class:`AsyncMeshClient` add
``call()``, a Mesh call with the idempotency extension; :class:`Outbox` queues
mutations durably for later. See ``docs/client.md`` and ``docs/outbox.md``.
"""

from retrysafe.errors import MissingExtraError

try:
    import httpx  # noqa: F401
except ImportError as exc:
    raise MissingExtraError("client", "retrysafe.client", name=exc.name) from exc

from retrysafe._client.clients import AsyncClient, Client, was_replayed
from retrysafe._client.mesh import AsyncMeshClient, MeshClient
from retrysafe._client.outbox import FlushResult, Outbox, OutboxItem
from retrysafe._client.retry import RetryPolicy, decide, retry_after, retryable
from retrysafe.errors import OutboxError

__all__ = [
    "AsyncClient",
    "AsyncMeshClient",
    "Client",
    "FlushResult",
    "MeshClient",
    "Outbox",
    "OutboxError",
    "OutboxItem",
    "RetryPolicy",
    "decide",
    "retry_after",
    "retryable",
    "was_replayed",
]
