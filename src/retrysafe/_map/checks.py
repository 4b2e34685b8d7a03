"""Value checks shared by the map's operations, routes and TOML reader.

Each raises :class:`~retrysafe.errors.MapError` naming the field at fault, and
words the value as TOML would (``a string ('x')``, ``a table``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from retrysafe._core.principal import ANONYMOUS_MODES
from retrysafe._model.duration import parse_duration
from retrysafe.errors import FieldPath, MapError

__all__ = [
    "FIELD_NAME",
    "OPERATION_NAME",
    "FieldPath",
    "anonymous_mode",
    "boolean",
    "duration",
    "duration_or_zero",
    "kind",
    "string",
    "suggest",
]

OPERATION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,99}")
FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a key template field or path parameter


def suggest(word: str, known: Iterable[str]) -> str:
    """``; did you mean 'x'?`` for the known word closest to ``word``, or nothing."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def duration(value: Any, name: str, *, allow_zero: bool = False) -> float:
    """Seconds from a duration (``"30s"``) or a number; :class:`MapError` at ``name``."""
    try:
        return parse_duration(value, field=name, allow_zero=allow_zero)
    except TypeError:
        raise MapError(
            f'must be a duration such as "30s" or "24h", or a number of seconds, not {kind(value)}',
            field=(name,),
        ) from None
    except ValueError as error:
        raise MapError(str(error), field=(name,)) from None


def duration_or_zero(value: Any, name: str) -> float:
    return duration(value, name, allow_zero=True)


def boolean(value: Any, name: str) -> bool:
    """``value`` if it is a bool; :class:`MapError` at ``name``."""
    if not isinstance(value, bool):
        raise MapError(f"must be true or false, not {kind(value)}", field=(name,))
    return value


def string(value: Any, name: str) -> str:
    """``value`` if it is a str; :class:`MapError` at ``name``."""
    if not isinstance(value, str):
        raise MapError(f"must be a string, not {kind(value)}", field=(name,))
    return value


def kind(value: Any) -> str:
    """What a (TOML) value is, for messages."""
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int):
        return f"an integer ({value})"
    if isinstance(value, float):
        return f"a float ({value!r})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, (list, tuple)):
        return "an array"
    return f"a {type(value).__name__}"


def anonymous_mode(value: Any, path: FieldPath) -> None:
    """Check an ``anonymous`` setting: one of the principal modes."""
    if value not in ANONYMOUS_MODES:
        raise MapError(
            f"must be one of {', '.join(map(repr, ANONYMOUS_MODES))}, not {kind(value)}"
            + suggest(str(value), ANONYMOUS_MODES),
            field=path,
        )
