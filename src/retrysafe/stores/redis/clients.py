"""The Redis store's clients: its URLs; its own connection pools for a standalone
server's hot commands (connections.py) and redis-py clients (standalone or cluster,
sync or one per event loop), made on first use and never carried across a fork."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_plus, urlsplit

try:
    import redis
    import redis.asyncio
    import redis.asyncio.cluster
    import redis.asyncio.retry
    import redis.cluster
    from redis import exceptions as _rx
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "retrysafe's Redis store needs redis-py: pip install 'retrysafe[redis]'"
    ) from _exc

try:  # redis-py >= 7
    from redis.maint_notifications import MaintNotificationsConfig
except ImportError:  # pragma: no cover - older redis-py
    _MAINT_CONFIG: type[MaintNotificationsConfig] | None = None
else:
    _MAINT_CONFIG = MaintNotificationsConfig

from retrysafe.stores._redact import redact
from retrysafe.stores.redis.connections import AsyncPool, Endpoint, Pool

if TYPE_CHECKING:
    from retrysafe.stores.redis.store import RedisStore

__all__ = ["DEFAULT_PREFIX", "DEFAULT_URL", "UNAVAILABLE_ERRORS", "RedisClients"]

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "retrysafe:"

_SCHEMES = {
    "redis": ("redis", False),
    "rediss": ("rediss", False),
    "unix": ("unix", False),
    "redis+cluster": ("redis", True),
    "rediss+cluster": ("rediss", True),
}

#: Errors that mean "the server could not be reached or refused to act right now".
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    _rx.ConnectionError,  # includes BusyLoadingError, AuthenticationError, MaxConnectionsError
    _rx.TimeoutError,
    _rx.ClusterError,  # ClusterDownError, MasterDownError
    _rx.RedisClusterException,  # no reachable node, slot not covered
    _rx.TryAgainError,
    _rx.ReadOnlyError,  # a write reached a replica during failover
    _rx.OutOfMemoryError,  # maxmemory reached; the script wrote nothing
    OSError,  # includes asyncio.TimeoutError
)

# -- URLs --------------------------------------------------------------------------


def _parse_url(url: str, prefix: str) -> tuple[str, bool, str, str | None, bool | None]:
    """(URL for redis-py, cluster?, prefix, archive URL, compact keys?).

    ``prefix=`` in the query wins over ``prefix``; ``archive=`` is a URL-encoded
    store URL; ``compact_keys=`` is 1/true/yes/on or 0/false/no/off (None: absent).
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(
            f"not a Redis URL: {redact(url)!r} (expected redis://, rediss://, unix://, "
            "redis+cluster:// or rediss+cluster://)"
        )
    client_scheme, cluster = _SCHEMES[scheme]
    keep: list[str] = []
    archive: str | None = None
    compact: bool | None = None
    for piece in parts.query.split("&"):
        if not piece:
            continue
        name, _, value = piece.partition("=")
        name = unquote_plus(name)
        if name == "prefix":
            prefix = unquote_plus(value)
        elif name == "archive":
            archive = unquote_plus(value)
        elif name == "compact_keys":
            compact = _flag(name, unquote_plus(value))
        elif name == "decode_responses":
            raise ValueError("decode_responses is not supported: record bodies are bytes")
        else:
            keep.append(piece)
    if cluster and parts.path not in ("", "/", "/0"):
        raise ValueError(f"Redis Cluster has only database 0: {redact(url)!r}")
    # (not urlunsplit: it drops the "//" of a unix:// URL, which redis-py then refuses)
    query = "&".join(keep)
    client_url = f"{client_scheme}://{parts.netloc}{parts.path}" + (f"?{query}" if query else "")
    return client_url, cluster, prefix, archive, compact


def _flag(name: str, value: str) -> bool:
    """A boolean URL option."""
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1 or 0 (true or false), not {value!r}")


#: Clients a forked child inherited from its parent, kept referenced and never closed
#: (a finalizer must not touch the parent's connections). One entry per store and fork.
_INHERITED: list[Any] = []


def _forget_clients(ref: weakref.ref[RedisStore]) -> None:
    """After ``fork()``, in the child: drop the parent's clients and lock (see ``__init__``)."""
    store = ref()
    if store is None:
        return
    _INHERITED.append(
        (
            store._sync,
            list(store._async.values()),
            list(store._starting.values()),
            store._pool,
            list(store._pools.values()),
        )
    )
    store._sync = None
    store._pool = None
    store._pools = weakref.WeakKeyDictionary()
    store._async = weakref.WeakKeyDictionary()
    store._starting = weakref.WeakKeyDictionary()
    store._lock = threading.Lock()
    store._sync_lock = threading.Lock()
    store._sweep_lock = threading.Lock()
    store._sweep_pass = None


class RedisClients:
    """The client half of :class:`RedisStore`: makes its pools and redis-py clients on
    first use."""

    cluster: bool
    #: A standalone server the store's own pools reach (None: everything on redis-py).
    _endpoint: Endpoint | None
    _pool: Pool | None
    _pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncPool]
    max_connections: int
    _client_url: str
    _options: dict[str, Any]
    _lock: threading.Lock
    _sync_lock: threading.Lock
    _sync: Any
    _async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any]
    _starting: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any]

    def _client_options(self, retry: Any) -> dict[str, Any]:
        options = {**self._options, "retry": retry}
        if _MAINT_CONFIG is not None:
            # With maintenance notifications on ("auto", the default) redis-py's asyncio
            # pool skips its stale-connection check, so the first call after a server
            # restart would fail; they only matter for RESP3 on Redis Enterprise.
            options["maint_notifications_config"] = _MAINT_CONFIG(enabled=False)
        return options

    def _sync_pool(self) -> Pool:
        with self._sync_lock:
            if self._pool is None:
                assert self._endpoint is not None
                self._pool = Pool(self._endpoint)
            return self._pool

    def _async_pool(self, loop: asyncio.AbstractEventLoop) -> AsyncPool:
        with self._lock:
            pool = self._pools.get(loop)
            if pool is None:
                # A pool pins its loop: forget the pools of loops that were closed.
                for old in [lp for lp in self._pools if lp.is_closed()]:
                    del self._pools[old]
                assert self._endpoint is not None
                pool = self._pools[loop] = AsyncPool(self._endpoint, loop)
            return pool

    def _sync_client(self) -> Any:
        # Its own lock: a cluster client connects while it is built, and the event
        # loop must not wait on that for ``self._lock`` (which the async clients take).
        with self._sync_lock:
            if self._sync is None:
                options = self._client_options(Retry(NoBackoff(), 0))
                if self.cluster:
                    # A cluster client connects here (topology discovery); a plain one lazily.
                    self._sync = redis.cluster.RedisCluster.from_url(self._client_url, **options)
                else:
                    # As for the asyncio clients below: redis-py's default pool (bounded
                    # at 100 since redis-py 8) refuses a call past its limit, which the
                    # store would report as unavailable; a burst of threads waits instead.
                    pool = redis.BlockingConnectionPool.from_url(
                        self._client_url,
                        max_connections=self.max_connections,
                        timeout=self._options["socket_timeout"],
                        **options,
                    )
                    self._sync = redis.Redis.from_pool(pool)  # (closes the pool too)
            return self._sync

    async def _aconnect(self, loop: asyncio.AbstractEventLoop) -> Any:
        """The loop's client, made on first use. A cluster client maps the slots once,
        before any task uses it: redis-py's asyncio cluster client, first used by many
        tasks at once, maps them in each and closes connections the others are using
        (seen as "Connection closed by server" from a healthy cluster)."""
        if not self.cluster:
            return self._async_client(loop)
        task = self._starting.get(loop)
        if task is None or task.done():
            task = self._starting[loop] = loop.create_task(self._astart(loop))
            # A start whose every caller was cancelled still has its error read.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(task)  # a cancelled caller leaves the others' start

    async def _astart(self, loop: asyncio.AbstractEventLoop) -> Any:
        client = self._async_client(loop, register=False)
        try:
            await client.initialize()
        except BaseException:
            with contextlib.suppress(Exception):
                await client.aclose()
            raise
        finally:
            if self._starting.get(loop) is asyncio.current_task():
                del self._starting[loop]
        self._async[loop] = client
        return client

    def _async_client(self, loop: asyncio.AbstractEventLoop, *, register: bool = True) -> Any:
        with self._lock:
            client = self._async.get(loop)
            if client is None:
                # A client pins its loop (so the weak key never dies by itself):
                # forget the clients of loops that were closed.
                for old in [lp for lp in self._async if lp.is_closed()]:
                    del self._async[old]
                options = self._client_options(redis.asyncio.retry.Retry(NoBackoff(), 0))
                if self.cluster:
                    options["max_connections"] = self.max_connections
                    client = redis.asyncio.cluster.RedisCluster.from_url(
                        self._client_url, **options
                    )
                else:
                    # redis-py's default asyncio pool refuses a call past its limit
                    # ("Too many connections"): under a burst of concurrent tasks, a
                    # call waits for a free connection instead (up to socket_timeout).
                    pool = redis.asyncio.BlockingConnectionPool.from_url(
                        self._client_url,
                        max_connections=self.max_connections,
                        timeout=self._options["socket_timeout"],
                        **options,
                    )
                    client = redis.asyncio.Redis.from_pool(pool)  # (closes the pool too)
                if register:
                    self._async[loop] = client
            return client
