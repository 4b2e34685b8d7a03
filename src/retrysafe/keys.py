"""Helpers to make and check idempotency keys.

- :func:`cart_hash` and :func:`intent_hash`: the content hashes of the
  ``cart_mandate:{session_id}:{cart_hash}`` and
  ``intent_mandate:{user_id}:{intent_hash}`` keys of the agentic-commerce
  idempotency map.
- :func:`uuid4`, :func:`uuid7` and :func:`new_key`: random keys for clients.
- :func:`validate_key`, :func:`is_valid_key` and :func:`parse_uuid_key`: checks
  for servers.
"""

from retrysafe._client.keys import (
    cart_hash,
    intent_hash,
    is_valid_key,
    new_key,
    parse_uuid_key,
    uuid4,
    uuid7,
    validate_key,
)

__all__ = [
    "cart_hash",
    "intent_hash",
    "is_valid_key",
    "new_key",
    "parse_uuid_key",
    "uuid4",
    "uuid7",
    "validate_key",
]
