"""``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://``: records in Redis.

:class:`RedisStore` is the store; the record codec, the Lua scripts, the clients
and the store's own connections live in modules of their own.
"""

from __future__ import annotations

from retrysafe.stores.redis.clients import DEFAULT_PREFIX, DEFAULT_URL, UNAVAILABLE_ERRORS
from retrysafe.stores.redis.codec import HEADER, LAYOUT_VERSION, record_from_value
from retrysafe.stores.redis.store import RedisStore

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_URL",
    "HEADER",
    "LAYOUT_VERSION",
    "UNAVAILABLE_ERRORS",
    "RedisStore",
    "record_from_value",
]
