"""The options of an engine, or of one call on it, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from retrysafe._model.record import RETENTIONS

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_MAX_BODY",
    "DEFAULT_TTL",
    "Options",
    "positive",
    "retention_class",
]

DEFAULT_TTL = 24 * 3600.0
DEFAULT_LEASE = 30.0
DEFAULT_MAX_BODY = 1 << 20


def positive(name: str, value: float, *, zero: bool = False) -> float:
    """A finite number of seconds above zero (or zero too, with ``zero``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    value = float(value)
    if not (value > 0 or (zero and value == 0)) or value == float("inf"):
        sign = "zero or a positive" if zero else "a positive"
        raise ValueError(f"{name} must be {sign} number of seconds, not {value!r}")
    return value


def retention_class(value: object) -> str:
    """``value`` if it names a retention class (``standard``, ``financial``)."""
    if value not in RETENTIONS:
        raise ValueError(f"retention must be one of {', '.join(RETENTIONS)}, not {value!r}")
    return str(value)


@dataclass(frozen=True, slots=True)
class Options:
    """Engine options, checked and normalised when built (so each front door checks
    them once, where it is configured, and never per call).

    ``None`` means "not given": a call then takes the engine's value, and an
    engine the default. ``ttl`` and ``lease`` are
    positive seconds, ``wait`` zero or more, ``settle_retry`` zero or more,
    ``retention`` a retention class, ``max_body`` a number of bytes (not negative).
    """

    ttl: float | None = None
    lease: float | None = None
    wait: float | None = None
    retention: str | None = None
    max_body: int | None = None
    settle_retry: float | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        if self.ttl is not None:
            put(self, "ttl", positive("ttl", self.ttl))
        if self.lease is not None:
            put(self, "lease", positive("lease", self.lease))
        wait = self.wait
        if wait is not None:
            if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:
                raise ValueError(f"wait must be a number of seconds >= 0, not {wait!r}")
            put(self, "wait", float(wait))
        if self.retention is not None:
            put(self, "retention", retention_class(self.retention))
        if self.max_body is not None:
            max_body = int(self.max_body)
            if max_body < 0:
                raise ValueError(f"max_body must not be negative, not {max_body}")
            put(self, "max_body", max_body)
        if self.settle_retry is not None:
            put(self, "settle_retry", positive("settle_retry", self.settle_retry, zero=True))

    @property
    def given(self) -> bool:
        """Whether any option that a call may set (ttl, lease, wait, retention) is given."""
        return not (
            self.ttl is None and self.lease is None and self.wait is None and self.retention is None
        )
