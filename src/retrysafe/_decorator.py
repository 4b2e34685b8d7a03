"""``@idempotent``: the function front door."""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ._engine import DEFAULT_LEASE, DEFAULT_TTL, Attempt, Engine, Replay
from ._errors import IdempotencyError, InvalidKeyError
from ._keys import fingerprint, validate_key
from ._record import Outcome
from .stores import DEFAULT_STORE_URL, Store, open_store

__all__ = ["idempotent"]

F = TypeVar("F", bound=Callable[..., Any])
KeySpec = str | Callable[..., str] | None
StoreSpec = Store[Any] | Engine | str | None


class _Call:
    """What one call of a decorated function turns into: key, scope, fingerprint."""

    def __init__(
        self, func: Callable[..., Any], key: KeySpec, scope: str | Callable[..., str] | None
    ) -> None:
        self.signature = inspect.signature(func)
        params = list(self.signature.parameters.values())
        # A method's receiver is not part of the request.
        self.skip = params[0].name if params and params[0].name in {"self", "cls"} else None
        # Plain parameters (no *args, **kwargs or keyword-only) bind without inspect.
        plain = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        self.names = tuple(p.name for p in params) if plain else None
        self.defaults = {p.name: p.default for p in params if p.default is not p.empty}
        self.key = key
        self.scope = scope

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The bound arguments, defaults applied, the receiver left out."""
        names = self.names
        if names is not None and len(args) <= len(names) and not kwargs.keys() & names[: len(args)]:
            arguments = dict(zip(names, args, strict=False))
            arguments.update(kwargs)
            if len(arguments) < len(names):
                for name, default in self.defaults.items():
                    arguments.setdefault(name, default)
            if len(arguments) != len(names) or not arguments.keys() <= set(names):
                arguments = self._bind(args, kwargs)  # raises TypeError as a call would
        else:
            arguments = self._bind(args, kwargs)
        if self.skip is not None:
            arguments.pop(self.skip, None)
        return arguments

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, str, str]:
        """(key, scope, fingerprint) for this call, or :class:`InvalidKeyError`."""
        arguments = self.arguments(args, kwargs)
        fp = fingerprint(arguments)
        spec = self.key
        if spec is None:
            key = fp  # the whole canonical argument set is the key
        elif isinstance(spec, str):
            try:
                key = spec.format(**arguments)
            except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
                raise InvalidKeyError(
                    f"key template {spec!r} does not fit the arguments: {exc!r}"
                ) from None
        else:
            key = spec(*args, **kwargs)
        scope = self.scope(*args, **kwargs) if callable(self.scope) else (self.scope or "")
        return validate_key(key), scope, fp


_stores: dict[str, Store[Any]] = {}
_stores_lock = threading.Lock()


def _shared_store(store: Store[Any] | str | None) -> Store[Any]:
    """One store (one pool) per URL for every decorated function that names it."""
    if isinstance(store, Store):
        return store
    url = store or os.environ.get("RETRYSAFE_STORE") or DEFAULT_STORE_URL
    with _stores_lock:
        if url not in _stores:
            _stores[url] = open_store(url)
        return _stores[url]


def _outcome(att: Attempt, value: Any) -> Outcome:
    """The stored form of a result. The function has run: if its result cannot be
    stored, the failure is final, so a retry gets the error, not a second run."""
    try:
        return Outcome.json(value)
    except (TypeError, ValueError) as exc:
        att.final = True
        raise TypeError(
            f"the result of an @idempotent function must be a JSON value: {exc}; "
            "the attempt was marked failed (final), so retries will not run it again"
        ) from exc


def _replayed(replay: Replay) -> Any:
    if replay.failed:
        raise IdempotencyError(
            "an earlier attempt with this key failed finally; it is not run again"
        )
    outcome = replay.outcome
    return None if outcome is None else outcome.value


def idempotent(
    *,
    store: StoreSpec = None,
    key: KeySpec = None,
    ttl: float | None = None,
    lease: float | None = None,
    wait: float | None = None,
    operation: str | None = None,
    version: str | int | None = None,
    scope: str | Callable[..., str] | None = None,
) -> Callable[[F], F]:
    """Run a function once per key; repeated calls return the stored result.

    ``store``: a Store, a URL or an :class:`Engine` (default: ``RETRYSAFE_STORE``
    or the embedded SQLite file). ``key``: a ``str.format`` template over the
    bound arguments (``"{order[id]}"``), a callable taking the function's own
    arguments, or omitted to key on all arguments. The fingerprint covers every
    argument, so the same key with other arguments raises
    :class:`FingerprintMismatchError`. ``operation`` and ``version`` name the
    function in the key hash (default: its qualified name); ``scope`` (a str or
    a callable over the arguments) separates principals. Results must be JSON
    values; they replay as decoded JSON (tuples as lists). Works on plain and
    ``async def`` functions.
    """
    if key is not None and not isinstance(key, str) and not callable(key):
        raise TypeError("key must be a str.format template or a callable")
    lock = threading.Lock()
    shared: Engine | None = store if isinstance(store, Engine) else None
    # An engine made here keeps records for this decorator's ttl (a given
    # engine's ttl can only be narrowed per call).
    own_ttl = DEFAULT_TTL if ttl is None else ttl
    own_lease = DEFAULT_LEASE if lease is None else lease

    def decorate(func: F) -> F:
        call = _Call(func, key, scope)
        op = operation or f"{func.__module__}.{func.__qualname__}"
        if version is not None:
            op = f"{op}#v{version}"
        engine = shared

        def get_engine() -> Engine:
            nonlocal engine
            if engine is None:
                with lock:
                    if engine is None:
                        engine = Engine(_shared_store(store), ttl=own_ttl, lease=own_lease)
            return engine

        def options(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
            k, s, fp = call.prepare(args, kwargs)
            return k, {"operation": op, "scope": s, "fingerprint": fp, "ttl": ttl,
                       "lease": lease, "wait": wait}  # fmt: skip

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                k, opts = options(args, kwargs)
                async with get_engine().attempt(k, **opts) as att:
                    if att.replay is not None:
                        return _replayed(att.replay)
                    value = await func(*args, **kwargs)
                    att.outcome = _outcome(att, value)
                    return value

            wrapper: Any = async_wrapper
        else:

            @functools.wraps(func)
            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                k, opts = options(args, kwargs)
                with get_engine().attempt(k, **opts) as att:
                    if att.replay is not None:
                        return _replayed(att.replay)
                    value = func(*args, **kwargs)
                    att.outcome = _outcome(att, value)
                    return value

            wrapper = sync_wrapper
        wrapper.engine = get_engine
        wrapper.operation = op
        return wrapper  # type: ignore[no-any-return]

    return decorate
