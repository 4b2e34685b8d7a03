"""``@idempotent``: the function front door.

Everything that decides is here once, as plain code: :class:`_Call` turns a call
into (key, options), :class:`_Results` turns a result or an exception into what
is stored and a stored record back into a result. The sync and async wrappers
are thin shells that differ only in ``await``.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import logging
import re
import string
import threading
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from retrysafe._core.engine import (
    DEFAULT_LEASE,
    DEFAULT_TTL,
    Attempt,
    Engine,
    Options,
    Plan,
    Replay,
    engine_for,
)
from retrysafe._core.heartbeat import renewing
from retrysafe._core.metrics import METRICS
from retrysafe._map.operations import Operation
from retrysafe._model.hashing import fingerprint, is_key, validate_key
from retrysafe._model.record import Outcome
from retrysafe.errors import IdempotencyError, InvalidKeyError
from retrysafe.serializers import Serializer, resolve
from retrysafe.stores import Store

__all__ = ["idempotent"]

log = logging.getLogger("retrysafe")

F = TypeVar("F", bound=Callable[..., Any])
KeySpec = str | Callable[..., str | None] | None
StoreSpec = Store[Any] | Engine | str | None
FinalSpec = bool | type[BaseException] | tuple[type[BaseException], ...]

_FORMATTER = string.Formatter()
_ROOT = re.compile(r"[^.\[]*")
_MISSING = object()


#: A ``str.format`` field path split once: its root and its ``.attr`` / ``[item]`` steps.
_Path = tuple[Any, tuple[tuple[bool, Any], ...]]


_STEP = re.compile(r"\.([^.\[]+)|\[([^\]]+)\]")


def _split(path: str) -> _Path:
    """``path`` (``order[id]``, ``self.account``) split as ``string.Formatter.get_field``
    walks it: an item key of decimal digits is an int."""
    root = _ROOT.match(path).group()  # type: ignore[union-attr]  # matches every str
    steps: list[tuple[bool, Any]] = []
    at = len(root)
    while at < len(path):
        step = _STEP.match(path, at)
        if step is None:
            raise ValueError(f"field {{{path}}} is not a str.format field")
        attr, item = step.groups()
        if attr is not None:
            steps.append((True, attr))
        else:
            steps.append((False, int(item) if item.isdecimal() else item))
        at = step.end()
    return root, tuple(steps)


def _lookup(path: _Path, arguments: dict[str, Any]) -> Any:
    """The value at a split field path (as ``string.Formatter.get_field``), or _MISSING."""
    first, rest = path
    try:
        value = arguments[first]
        for is_attr, step in rest:
            value = getattr(value, step) if is_attr else value[step]
        return value
    except (KeyError, IndexError, AttributeError, TypeError):
        return _MISSING


def _check_paths(what: str, paths: Iterable[str], params: frozenset[str] | None, name: str) -> None:
    """Refuse, at decoration, a path whose root is not a parameter of the function."""
    for path in paths:
        root = _ROOT.match(path).group()  # type: ignore[union-attr]  # matches every str
        if not root or root.isdigit():
            raise ValueError(f"{what} field {{{path}}} must name an argument, e.g. {{order[id]}}")
        if params is not None and root not in params:
            raise ValueError(
                f"{what} field {{{path}}} is not an argument of {name}({', '.join(sorted(params))})"
            )


class _Template:
    """A ``str.format`` key template over the bound arguments, parsed once."""

    def __init__(self, text: str, params: frozenset[str] | None, name: str) -> None:
        try:
            self.parts = list(_FORMATTER.parse(text))
        except ValueError as exc:
            raise ValueError(f"key template {text!r} is not a str.format template: {exc}") from None
        self.text = text
        _check_paths("key template", (p[1] for p in self.parts if p[1] is not None), params, name)
        self.fields = [
            (literal, path, None if path is None else _split(path), spec or "", conversion)
            for literal, path, spec, conversion in self.parts
        ]

    def render(self, arguments: dict[str, Any]) -> str | None:
        """The key, or None when a field is absent, None or empty."""
        out: list[str] = []
        for literal, path, split, spec, conversion in self.fields:
            out.append(literal)
            if split is None:
                continue
            value = _lookup(split, arguments)
            if value is _MISSING or value is None or value == "":
                return None
            if conversion:
                value = _FORMATTER.convert_field(value, conversion)
            try:
                out.append(format(value, spec))
            except (TypeError, ValueError) as exc:
                raise InvalidKeyError(
                    f"key template {self.text!r}: cannot format {{{path}}}: {exc}"
                ) from None
        return "".join(out)


class _Call:
    """What one call of a decorated function turns into: key, scope, fingerprint."""

    def __init__(
        self,
        func: Callable[..., Any],
        key: KeySpec | Operation,
        scope: str | Callable[..., str] | None,
        validate: str | Iterable[str] | None,
    ) -> None:
        self.signature = inspect.signature(func)
        params = list(self.signature.parameters.values())
        # A method's receiver is not part of the request (but templates may use it).
        self.skip = params[0].name if params and params[0].name in {"self", "cls"} else None
        # Plain parameters (no *args, **kwargs or keyword-only) bind without inspect.
        plain = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        self.names = tuple(p.name for p in params) if plain else None
        self.known = frozenset(self.names or ())
        self.defaults = {p.name: p.default for p in params if p.default is not p.empty}
        names = frozenset(p.name for p in params if p.kind is not p.VAR_KEYWORD)
        known = None if any(p.kind is p.VAR_KEYWORD for p in params) else names
        title = getattr(func, "__qualname__", repr(func))
        self.template: _Template | None = None
        self.operation: Operation | None = None
        self.key_func: Callable[..., Any] | None = None
        if isinstance(key, Operation):
            self.operation = key
            _check_paths("operation key", key.fields, known, title)
        elif isinstance(key, str):
            self.template = _Template(key, known, title)
        elif key is not None:
            self.key_func = key
        if isinstance(validate, str):
            validate = (validate,)
        self.validate = None if validate is None else tuple(validate)
        self.checked: tuple[tuple[str, _Path], ...] = ()  # the validate paths, split
        if self.validate is not None:
            _check_paths("validate", self.validate, known, title)
            self.checked = tuple((path, _split(path)) for path in self.validate)
        self.scope = scope

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The bound arguments, defaults applied (the receiver included)."""
        names = self.names
        if names is None or len(args) > len(names):
            return self._bind(args, kwargs)
        if args:
            if not kwargs.keys().isdisjoint(names[: len(args)]):
                return self._bind(args, kwargs)  # raises TypeError as a call would
            arguments = dict(zip(names, args, strict=False))
            arguments.update(kwargs)
        else:
            arguments = dict(kwargs)
        if len(arguments) < len(names):
            for name, default in self.defaults.items():
                arguments.setdefault(name, default)
        if len(arguments) != len(names) or not arguments.keys() <= self.known:
            arguments = self._bind(args, kwargs)  # raises TypeError as a call would
        return arguments

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def _hash(self, value: Any) -> str:
        try:
            return fingerprint(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{exc}: name the arguments that identify a call with validate=(...) "
                "and give a key="
            ) from None

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | None, str, str]:
        """(key or None when it is missing, scope, fingerprint) for this call."""
        arguments = self.arguments(args, kwargs)
        request = arguments
        if self.skip is not None:
            request = {k: v for k, v in arguments.items() if k != self.skip}
        if self.validate is None:
            fp = self._hash(request)
        else:
            fp = self._hash(
                {path: _optional(_lookup(split, arguments)) for path, split in self.checked}
            )
        key: Any
        if self.template is not None:
            key = self.template.render(arguments)
        elif self.operation is not None:
            key = self._operation_key(arguments)
        elif self.key_func is not None:
            key = self.key_func(*args, **kwargs)
            if key == "":
                key = None
        else:  # the whole canonical argument set is the key
            key = fp if self.validate is None else self._hash(request)
        if key is not None and not is_key(key):
            validate_key(key)  # raises with the reason
        scope = self.scope(*args, **kwargs) if callable(self.scope) else (self.scope or "")
        return key, scope, fp

    def _operation_key(self, arguments: dict[str, Any]) -> str | None:
        op = self.operation
        assert op is not None
        values = {}
        for name in op.fields:
            value = arguments.get(name)
            if value is None or value == "":
                return None
            values[name] = value
        return op.build(**values)

    def describe_key(self) -> str:
        if self.template is not None:
            return f"key template {self.template.text!r}"
        if self.operation is not None:
            return f"operation {self.operation.name!r} key {self.operation.key!r}"
        return "key callable"


def _optional(value: Any) -> Any:
    return None if value is _MISSING else value


class _Results:
    """How results and final exceptions are stored, and given back on a replay."""

    def __init__(self, func: Callable[..., Any], serializer: Any, final: FinalSpec) -> None:
        self.func = func
        self.spec = serializer
        self._serializer: Serializer | None = None
        with contextlib.suppress(NameError):  # a forward reference: resolved at the first call
            self.serializer  # noqa: B018 - resolve now if the annotation can be resolved
        self.final_types: tuple[type[BaseException], ...]
        if final is True or final is False:
            self.final_all, self.final_types = final, ()
        else:
            types = (final,) if isinstance(final, type) else tuple(final)
            for t in types:
                if not (isinstance(t, type) and issubclass(t, BaseException)):
                    raise TypeError(f"final_failures must hold exception classes, not {t!r}")
            self.final_all, self.final_types = False, types

    @property
    def serializer(self) -> Serializer:
        if self._serializer is None:
            self._serializer = resolve(self.spec, self._return_type())
        return self._serializer

    def _return_type(self) -> Any:
        if self.spec is not None:
            return None
        target = inspect.unwrap(self.func)
        annotation = getattr(target, "__annotations__", {}).get("return")
        if annotation is None:
            return None
        try:
            return typing.get_type_hints(_Returns(annotation), getattr(target, "__globals__", {}))[
                "return"
            ]
        except NameError as exc:
            raise NameError(
                f"cannot resolve the return annotation {annotation!r} of "
                f"{target.__qualname__}: {exc}; pass serializer= explicitly"
            ) from None

    def check(self) -> None:
        """Resolve the serializer before anything runs (TypeError if it cannot be)."""
        if self._serializer is None:
            try:
                self.serializer  # noqa: B018
            except NameError as exc:
                raise TypeError(str(exc)) from None

    def outcome(self, att: Attempt, value: Any) -> Outcome:
        """The stored form of a result. The function has run: if its result cannot be
        stored, the failure is final, so a retry gets the error, not a second run."""
        try:
            return Outcome.json(self.serializer.dump(value))
        except (TypeError, ValueError) as exc:
            att.final = True
            raise TypeError(
                f"the result of an @idempotent function cannot be stored: {exc} (return JSON "
                "values, annotate the return type, or pass serializer=); the attempt was "
                "marked failed (final), so retries will not run it again"
            ) from exc

    def value(self, replay: Replay) -> Any:
        """The replayed result, or the stored final exception raised again."""
        outcome = replay.outcome
        if replay.failed:
            raise self._rebuild(None if outcome is None else outcome.value)
        return self.serializer.load(None if outcome is None else outcome.value)

    def final_outcome(self, exc: BaseException, engine: Engine) -> Outcome | None:
        """The stored form of a final failure, or None when ``exc`` leaves the key retryable.

        Kept: the names of the exception's classes (most specific first). Its
        arguments and message only when its class is listed in ``final_failures``
        (the caller asked for it); a blanket ``True`` keeps no text of any error.
        """
        if not isinstance(exc, Exception):
            return None
        listed = isinstance(exc, self.final_types)
        if not (listed or self.final_all or engine.final_failures):
            return None
        types = [_name_of(c) for c in type(exc).__mro__ if issubclass(c, Exception)]
        error: dict[str, Any] = {"types": types}
        if listed:
            error["message"] = str(exc)
            error["args"] = list(exc.args)
            with contextlib.suppress(TypeError, ValueError):
                return Outcome.json({"error": error})
            del error["args"]  # arguments that are not JSON: the class and message only
        return Outcome.json({"error": error})

    def _rebuild(self, stored: Any) -> BaseException:
        """The stored final failure as an exception: the nearest class of it that this
        decorator lists (or a built-in one), else :class:`IdempotencyError`."""
        error = stored.get("error") if isinstance(stored, dict) else None
        types = error.get("types") if isinstance(error, dict) else None
        if not isinstance(error, dict) or not isinstance(types, list) or not types:
            return IdempotencyError(
                "an earlier attempt with this key failed finally; it is not run again"
            )
        args = error.get("args")
        args = args if isinstance(args, list) else []
        for name in types:
            cls = self._allowed(str(name))
            if cls is not None:
                with contextlib.suppress(Exception):
                    return cls(*args)
        return IdempotencyError(
            f"an earlier attempt with this key failed finally with {types[0]}; it is not run again"
        )

    def _allowed(self, name: str) -> type[BaseException] | None:
        """Only classes this decorator lists (or built-in ones) are rebuilt: a stored
        type name never imports anything."""
        for cls in self.final_types:
            if _name_of(cls) == name or _moved(cls, name):
                return cls
        module, _, qualname = name.rpartition(".")
        found = getattr(builtins, qualname, None) if module == "builtins" else None
        if found is Exception or not (isinstance(found, type) and issubclass(found, Exception)):
            return None  # (a bare Exception says nothing: IdempotencyError names the class)
        return found


def _name_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _moved(cls: type, name: str) -> bool:
    """``name`` is ``cls``, a retrysafe error, as an earlier version stored it: the
    errors moved to :mod:`retrysafe.errors` from other modules (``retrysafe.guards``)."""
    module, _, qualname = name.rpartition(".")
    return (
        cls.__module__ == "retrysafe.errors"
        and module.startswith("retrysafe.")
        and qualname == cls.__qualname__
    )


class _Returns:
    """Carries a return annotation for ``typing.get_type_hints``."""

    def __init__(self, annotation: Any) -> None:
        self.__annotations__ = {"return": annotation}


@contextlib.contextmanager
def failure_logged(exc: BaseException) -> Iterator[None]:
    """Keep the function's own exception when recording its final failure fails."""
    try:
        yield
    except IdempotencyError as error:
        log.warning("retrysafe: could not record the final failure %r: %s", exc, error)


@typing.overload
def idempotent(func: F, /) -> F: ...


@typing.overload
def idempotent(
    *,
    store: StoreSpec = None,
    key: KeySpec = None,
    operation: str | Operation | None = None,
    version: str | int | None = None,
    validate: str | Iterable[str] | None = None,
    scope: str | Callable[..., str] | None = None,
    ttl: float | None = None,
    lease: float | None = None,
    wait: float | None = None,
    raise_on_missing_key: bool = True,
    serializer: Any = None,
    final_failures: FinalSpec = False,
    retention: str | None = None,
    renew: bool = True,
) -> Callable[[F], F]: ...


def idempotent(
    func: F | None = None,
    /,
    *,
    store: StoreSpec = None,
    key: KeySpec = None,
    operation: str | Operation | None = None,
    version: str | int | None = None,
    validate: str | Iterable[str] | None = None,
    scope: str | Callable[..., str] | None = None,
    ttl: float | None = None,
    lease: float | None = None,
    wait: float | None = None,
    raise_on_missing_key: bool = True,
    serializer: Any = None,
    final_failures: FinalSpec = False,
    retention: str | None = None,
    renew: bool = True,
) -> Callable[[F], F] | F:
    """Run a function once per key; repeated calls return the stored result.

    ``@idempotent`` alone keys on all arguments with the default store;
    ``@idempotent(...)`` takes the options below. Every option is checked
    here, when the function is decorated.

    ``store``: a Store, a URL or an :class:`Engine` (default: ``RETRYSAFE_STORE``
    or the embedded SQLite file). ``key``: a ``str.format`` template over the
    bound arguments (``"{order[id]}"``; a method's ``self`` too), a callable
    taking the function's own arguments, or omitted to key on all arguments.
    ``operation`` and ``version`` name the function in the key hash (default:
    its qualified name); an :class:`Operation` of an Idempotency Map also gives
    the key template, ttl, lease, final failures and retention. ``validate``:
    the argument paths whose change is a conflict (default: all arguments).
    ``raise_on_missing_key=False`` runs a call whose key is absent, None or
    empty without idempotency (logged) instead of raising
    :class:`InvalidKeyError`. ``serializer``: how results are stored (default:
    by the return annotation; see :mod:`retrysafe.serializers`).
    ``final_failures``: exception classes (or True for all) that fail the key
    finally; retries raise them again without running. ``renew``: renew the
    lease every third of it while the function runs, so only a crash lets
    another caller take the key over. See docs/decorator.md.
    """
    if key is not None and not isinstance(key, str) and not callable(key):
        raise TypeError("key must be a str.format template or a callable")
    if store is not None and not isinstance(store, (str, Store, Engine)):
        raise TypeError(f"store must be a Store, a URL or an Engine, not {type(store).__name__}")
    if scope is not None and not isinstance(scope, str) and not callable(scope):
        raise TypeError("scope must be a str or a callable over the arguments")
    options = Options(ttl=ttl, lease=lease, wait=wait, retention=retention)
    if validate is not None and not isinstance(validate, str):
        validate = tuple(validate)
        if not all(isinstance(v, str) for v in validate):
            raise TypeError("validate must be argument paths (str), e.g. ('order[amount]',)")
    lock = threading.Lock()
    shared: Engine | None = store if isinstance(store, Engine) else None
    op_spec = operation if isinstance(operation, Operation) else None
    if operation is not None and op_spec is None and not isinstance(operation, str):
        raise TypeError("operation must be a str or an Operation of an IdempotencyMap")
    if op_spec is not None:  # the map's operation, under explicit options
        options = Options(
            ttl=op_spec.ttl if ttl is None else options.ttl,
            lease=op_spec.lease if lease is None else options.lease,
            wait=options.wait,
            retention=op_spec.retention if retention is None else options.retention,
        )
        if final_failures is False:
            final_failures = op_spec.final_failures
    # An engine made here keeps records for this decorator's ttl (a given
    # engine's ttl can only be narrowed per call).
    own_ttl = DEFAULT_TTL if options.ttl is None else options.ttl
    own_lease = DEFAULT_LEASE if options.lease is None else options.lease

    def decorate(func: F) -> F:
        if not callable(func):
            raise TypeError(f"@idempotent decorates a function, not {type(func).__name__}")
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError("@idempotent cannot store a generator's results: return a list instead")
        call = _Call(func, op_spec if key is None and op_spec is not None else key, scope, validate)
        if call.skip is not None and key is None and op_spec is None and scope is None:
            raise TypeError(
                f"{call.skip}.{getattr(func, '__name__', 'method')}: the receiver is not part "
                f"of the request, so every instance would share one record: give key= "
                f"(e.g. '{{{call.skip}.id}}:...') or scope="
            )
        results = _Results(func, serializer, final_failures)
        if isinstance(operation, Operation):
            op = operation.name
        else:
            qualname = getattr(func, "__qualname__", None)
            if operation is None and qualname is None:
                raise TypeError(f"give operation= to name {func!r} (it has no __qualname__)")
            op = operation or f"{func.__module__}.{qualname}"
        if version is not None:
            op = f"{op}#v{version}"
        engine = shared

        def get_engine() -> Engine:
            nonlocal engine
            if engine is None:
                with lock:
                    if engine is None:
                        engine = engine_for(store, share=True, ttl=own_ttl, lease=own_lease)
            return engine

        plan: Plan | None = None  # the options every call shares, checked once

        def prepare(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Attempt | None:
            """The attempt of this call, or None to run it unprotected."""
            nonlocal plan
            results.check()
            try:
                k, s, fp = call.prepare(args, kwargs)
            except InvalidKeyError as exc:
                METRICS.refused(op, exc)
                raise
            if k is None:
                message = f"no idempotency key for {op}: the {call.describe_key()} has no value"
                if raise_on_missing_key:
                    METRICS.count("invalid_key", op)
                    raise InvalidKeyError(message)
                log.warning("retrysafe: %s; running it without idempotency", message)
                return None
            if type(s) is not str:
                raise TypeError(f"scope= must return a str, not {type(s).__name__}")
            e = get_engine()
            if plan is None:
                plan = Plan.shared(e, op, options)
            return Attempt(e, plan.derive(k, s, fp))

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                attempt = prepare(args, kwargs)
                if attempt is None:
                    return await func(*args, **kwargs)
                async with attempt as att:
                    if att.replay is not None:
                        return results.value(att.replay)
                    try:
                        with renewing(att, renew):
                            value = await func(*args, **kwargs)
                    except BaseException as exc:
                        failed = results.final_outcome(exc, get_engine())
                        if failed is not None:
                            with failure_logged(exc):
                                await att.afail(failed, final=True)
                        raise
                    att.outcome = results.outcome(att, value)
                    return value

            wrapper: Any = async_wrapper
        else:

            @functools.wraps(func)
            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                attempt = prepare(args, kwargs)
                if attempt is None:
                    return func(*args, **kwargs)
                with attempt as att:
                    if att.replay is not None:
                        return results.value(att.replay)
                    try:
                        with renewing(att, renew):
                            value = func(*args, **kwargs)
                    except BaseException as exc:
                        failed = results.final_outcome(exc, get_engine())
                        if failed is not None:
                            with failure_logged(exc):
                                att.fail(failed, final=True)
                        raise
                    att.outcome = results.outcome(att, value)
                    return value

            wrapper = sync_wrapper
        wrapper.engine = get_engine
        wrapper.operation = op
        return wrapper

    return decorate if func is None else decorate(func)
