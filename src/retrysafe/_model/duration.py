"""Durations written as text: ``"30s"``, ``"5m"``, ``"24h"``, ``"7d"``, ``"1h30m"``, ``"250ms"``.

Used by the Idempotency Map's TOML files and by the CLI (``--every 1h``).
Arithmetic is done in :class:`~decimal.Decimal`, so a value written by
:func:`format_duration` parses back to the same float.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

__all__ = ["UNITS", "format_duration", "parse_duration"]

#: Seconds per unit, largest first (the order components must be written in).
UNITS: dict[str, Decimal] = {
    "d": Decimal(86400),
    "h": Decimal(3600),
    "m": Decimal(60),
    "s": Decimal(1),
    "ms": Decimal("0.001"),
}
_ORDER = {unit: i for i, unit in enumerate(UNITS)}
_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
_DURATION = re.compile(rf"(?:{_NUMBER}(?:ms|[dhms])\s*)+")
_COMPONENT = re.compile(rf"({_NUMBER})(ms|[dhms])")
_PLAIN = re.compile(_NUMBER)


def parse_duration(
    value: str | int | float, *, field: str = "duration", allow_zero: bool = False
) -> float:
    """Seconds in ``value``: a number of seconds, or text such as ``"1h30m"``.

    Units are ``d``, ``h``, ``m``, ``s`` and ``ms``, largest first, each at most
    once; a component may have a fraction (``"1.5h"``); a bare number is
    seconds. Raises ``ValueError`` naming ``field`` for a negative, zero
    (unless ``allow_zero``), empty, infinite or unreadable value, and
    ``TypeError`` for something that is neither text nor a number.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(
            f'{field} must be a duration such as "30s" or "24h", or a number of seconds, '
            f"not {type(value).__name__}"
        )
    if isinstance(value, str):
        seconds = _parse_text(value, field)
    else:
        if not math.isfinite(value):
            raise ValueError(f"{field} must be a finite number of seconds, not {value!r}")
        seconds = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    if seconds < 0:
        raise ValueError(f"{field} must not be negative, not {value!r}")
    if seconds == 0 and not allow_zero:
        raise ValueError(f"{field} must be longer than zero, not {value!r}")
    result = float(seconds)
    if not math.isfinite(result):
        raise ValueError(f"{field} is too long: {value!r}")
    return result


def _parse_text(value: str, field: str) -> Decimal:
    text = value.strip()
    if not text:
        raise ValueError(f'{field} is empty; write a duration such as "30s", "5m" or "24h"')
    if _PLAIN.fullmatch(text):
        return Decimal(text)
    if text.startswith("-"):
        raise ValueError(f"{field} must not be negative, not {value!r}")
    if not _DURATION.fullmatch(text):
        raise ValueError(
            f"{field} is not a duration: {value!r}; write a number with a unit "
            '(d, h, m, s, ms), such as "30s", "24h" or "1h30m"'
        )
    total = Decimal(0)
    last = -1
    for number, unit in _COMPONENT.findall(text):
        if _ORDER[unit] <= last:
            raise ValueError(
                f"{field} is not a duration: {value!r}; write each unit once, "
                'largest first (d, h, m, s, ms), such as "1h30m"'
            )
        last = _ORDER[unit]
        total += Decimal(number) * UNITS[unit]
    return total


def format_duration(seconds: float) -> str:
    """The compact text for ``seconds``: ``"30m"``, ``"7d"``, ``"1h30m"``, ``"1.5s"``.

    Whole days, hours and minutes, then seconds with any fraction; under one
    second it is milliseconds when that is exact (``"250ms"``). Exact:
    ``parse_duration(format_duration(x)) == x`` for every finite ``x >= 0``.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"seconds must be a number, not {type(seconds).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"seconds must be a finite number >= 0, not {seconds!r}")
    rest = Decimal(repr(seconds)) if isinstance(seconds, float) else Decimal(seconds)
    if rest == 0:
        return "0s"
    if rest < 1:
        millis = rest * 1000
        if millis == millis.to_integral_value():
            return f"{_plain(millis)}ms"
        return f"{_plain(rest)}s"
    parts = []
    for unit in ("d", "h", "m"):
        count, rest = divmod(rest, UNITS[unit])
        if count:
            parts.append(f"{_plain(count)}{unit}")
    if rest:
        parts.append(f"{_plain(rest)}s")
    return "".join(parts)


def _plain(number: Decimal) -> str:
    """``number`` in positional notation without trailing zeros (``1E+2`` → ``100``)."""
    return format(number.normalize(), "f")
