"""What the SQL stores' URLs share: their own options (``?table=…&max_size=…``), given
in the URL or as keywords, and the table name they quote."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["option", "table_parts", "to_bool"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def to_bool(text: str) -> bool:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case); else
    ValueError."""
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


def table_parts(table: str, container: str = "schema") -> tuple[str, ...]:
    """``[container.]name`` as its parts, each checked: letters, digits and underscores,
    at most 48 characters (the name is quoted into statements, never bound)."""
    parts = tuple(table.split("."))
    if len(parts) > 2 or not all(_NAME.fullmatch(p) for p in parts):
        raise ValueError(
            f"invalid table name {table!r}: use [{container}.]name, letters, digits and "
            "underscores, at most 48 characters each"
        )
    return parts


def option(name: str, given: Any, default: Any, url_value: str | None, convert: Any) -> Any:
    """A store option from the URL or the keyword argument (not both, unless equal)."""
    if url_value is None:
        return given
    try:
        value = convert(url_value)
    except ValueError as exc:
        raise ValueError(f"invalid {name}={url_value!r} in the store URL") from exc
    if given != default and given != value:
        raise ValueError(f"{name} given both in the URL ({value!r}) and as an argument ({given!r})")
    return value
