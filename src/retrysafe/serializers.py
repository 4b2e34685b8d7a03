"""How ``@idempotent`` stores a function's result and gives it back on a replay.

A serializer turns a result into a JSON value (``dump``) and a stored JSON value
back into a result (``load``). By default ``@idempotent`` reads the function's
return annotation: JSON types replay as decoded JSON; dataclasses, pydantic
models, ``Decimal``, ``datetime``, ``UUID``, ``Enum``, tuples and sets (and
containers of them) replay as the annotated type.

::

    @idempotent(store=store, key="{order_id}")
    def charge(order_id: str, amount: Decimal) -> Charge:   # a dataclass
        ...

    @idempotent(store=store, serializer=(Money.to_json, Money.from_json))
    def quote(...) -> Money: ...

There is no pickle serializer on purpose: a stored answer is data, and loading
it must never run code.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import decimal
import enum
import types
import typing
import uuid
from collections import abc
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "JSON",
    "CustomSerializer",
    "JsonSerializer",
    "Serializer",
    "TypedSerializer",
    "resolve",
    "to_json",
]


@runtime_checkable
class Serializer(Protocol):
    """Turns a result into a JSON value and back."""

    def dump(self, value: Any) -> Any:
        """The JSON value (dicts, lists, str, int, float, bool, None) to store."""
        ...

    def load(self, data: Any) -> Any:
        """The result to return for the stored JSON value ``data``."""
        ...


class JsonSerializer:
    """Results that are JSON values; they replay as decoded JSON (tuples as lists)."""

    def dump(self, value: Any) -> Any:
        return value

    def load(self, data: Any) -> Any:
        return data

    def __repr__(self) -> str:
        return "JSON"


#: The plain JSON serializer.
JSON = JsonSerializer()


class CustomSerializer:
    """A serializer from a pair of functions: ``dump(value) -> JSON``, ``load(JSON) -> value``."""

    dump: Callable[[Any], Any]
    load: Callable[[Any], Any]

    def __init__(self, dump: Callable[[Any], Any], load: Callable[[Any], Any]) -> None:
        if not callable(dump) or not callable(load):
            raise TypeError("a custom serializer is a pair of callables (dump, load)")
        self.dump = dump
        self.load = load

    def __repr__(self) -> str:
        return f"CustomSerializer({self.dump!r}, {self.load!r})"


class TypedSerializer:
    """Round-trips values of one type (a class or an annotation such as ``list[Charge]``).

    Dumps with :func:`to_json`; loads by walking the type: dataclasses (by their
    field annotations), pydantic models (``model_validate``), named tuples,
    ``list``/``tuple``/``set``/``frozenset``/``dict`` and abstract collections,
    ``Optional`` and unions (tried in order), ``Literal``, ``Annotated``,
    ``Decimal``, ``datetime``/``date``/``time``, ``UUID``, ``Enum`` and ``bytes``.
    A field annotated ``Any`` keeps its JSON form.
    """

    def __init__(self, tp: Any) -> None:
        self.type = tp
        self._load = _loader(tp) or _same

    def dump(self, value: Any) -> Any:
        return to_json(value)

    def load(self, data: Any) -> Any:
        return self._load(data)

    def __repr__(self) -> str:
        return f"TypedSerializer({_name(self.type)})"


def resolve(spec: Any, annotation: Any = None) -> Serializer:
    """The serializer for ``@idempotent(serializer=spec)`` of a function returning ``annotation``.

    ``spec`` may be None (follow ``annotation``: plain JSON unless it names a
    type that JSON cannot give back), ``"json"``, a :class:`Serializer`, a
    ``(dump, load)`` pair, or a type/annotation. Raises ``TypeError`` for a
    type it cannot rebuild.
    """
    if spec is None:
        if annotation is None:
            return JSON
        loader = _loader(annotation)
        return JSON if loader is None else TypedSerializer(annotation)
    if isinstance(spec, str):
        if spec == "json":
            return JSON
        raise TypeError(f"unknown serializer {spec!r}: use 'json', a type or a (dump, load) pair")
    if isinstance(spec, tuple) and len(spec) == 2:
        return CustomSerializer(*spec)
    if isinstance(spec, Serializer) and not isinstance(spec, type):
        return spec
    return TypedSerializer(spec)


# -- dumping ----------------------------------------------------------------------


def to_json(value: Any) -> Any:
    """``value`` as a JSON value: dataclasses and pydantic models as objects,
    ``Decimal``/``UUID`` as strings, dates as ISO 8601, enums as their values,
    bytes as base64, tuples and sets as arrays. ``TypeError`` for anything else."""
    cls = value.__class__
    if cls in _NATIVE:
        return value
    if cls is dict:
        return {_json_key(k): to_json(v) for k, v in value.items()}
    if cls is list or cls is tuple:
        return [to_json(v) for v in value]
    return _to_json_other(value)


_NATIVE = frozenset({str, int, float, bool, type(None)})


def _to_json_other(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return to_json(value.value)
    if isinstance(value, (str, int, float)):  # subclasses (IntEnum handled above)
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)  # pydantic v2
    if callable(dump) and not isinstance(value, type):
        return dump(mode="json")
    if isinstance(value, Mapping):
        return {_json_key(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return [to_json(v) for v in value]
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return str(value)
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode()
    raise TypeError(
        f"cannot store a {type(value).__name__} result as JSON: return JSON values, "
        "dataclasses or pydantic models, or pass serializer=(dump, load)"
    )


def _json_key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, bool) or key is None:
        raise TypeError(f"cannot store a dict key {key!r} as JSON")
    value = to_json(key)
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise TypeError(f"cannot store a dict key of type {type(key).__name__} as JSON")


# -- loading ----------------------------------------------------------------------

Loader = Callable[[Any], Any]


def _same(data: Any) -> Any:
    return data


def _name(tp: Any) -> str:
    if isinstance(tp, type) and typing.get_origin(tp) is None:
        return tp.__qualname__
    return repr(tp)


_SCALARS: dict[Any, Loader] = {
    decimal.Decimal: decimal.Decimal,
    uuid.UUID: uuid.UUID,
    _dt.datetime: _dt.datetime.fromisoformat,
    _dt.date: _dt.date.fromisoformat,
    _dt.time: _dt.time.fromisoformat,
    bytes: base64.b64decode,
    float: lambda d: float(d) if isinstance(d, int) and not isinstance(d, bool) else d,
}


def _loader(tp: Any) -> Loader | None:
    """A function rebuilding a ``tp`` from its JSON form; None when the JSON is already it."""
    if isinstance(tp, (str, typing.ForwardRef)):
        raise TypeError(f"cannot resolve the type {tp!r}: pass serializer= explicitly")
    if tp is Any or tp is None or isinstance(tp, typing.TypeVar):
        return None
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin = typing.get_origin(tp)
    if origin is not None:
        return _generic_loader(tp, origin, typing.get_args(tp))
    if isinstance(tp, typing.NewType):
        return _loader(tp.__supertype__)
    if isinstance(tp, type):
        return _class_loader(tp)
    raise TypeError(f"cannot replay a {tp!r} result: pass serializer=(dump, load)")


_PLAIN = (object, type(None), str, int, bool, dict, list)
_ISO = (_dt.datetime, _dt.date, _dt.time)


def _class_loader(cls: type) -> Loader | None:
    if cls in _PLAIN:
        return None
    if issubclass(cls, enum.Enum):
        return cls
    if dataclasses.is_dataclass(cls):
        return _dataclass_loader(cls)
    validate = getattr(cls, "model_validate", None)  # pydantic v2
    if callable(validate):
        return validate
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):  # NamedTuple
        hints = typing.get_type_hints(cls)
        loaders = [_loader(hints.get(name, Any)) or _same for name in cls._fields]
        return lambda data: cls(*(f(v) for f, v in zip(loaders, data, strict=False)))
    if issubclass(cls, _ISO):
        return cls.fromisoformat
    if issubclass(cls, bytes):
        return lambda data: cls(base64.b64decode(data))
    if issubclass(cls, (str, int, float, decimal.Decimal, uuid.UUID, tuple, set, frozenset)):
        return cls  # a subclass: rebuilt from its JSON form
    if issubclass(cls, (dict, list)):
        return lambda data: cls(data)
    raise TypeError(
        f"cannot replay a {cls.__qualname__} result from JSON: use a dataclass or a "
        "pydantic model, or pass serializer=(dump, load)"
    )


def _dataclass_loader(cls: type) -> Loader:
    hints = typing.get_type_hints(cls)
    fields = [
        (f.name, _loader(hints.get(f.name, Any)) or _same)
        for f in dataclasses.fields(cls)
        if f.init
    ]

    def load(data: Any) -> Any:
        if not isinstance(data, dict):
            raise TypeError(f"stored value is not an object for {cls.__qualname__}")
        return cls(**{name: f(data[name]) for name, f in fields if name in data})

    return load


def _generic_loader(tp: Any, origin: Any, args: tuple[Any, ...]) -> Loader | None:
    each: Loader
    build: Callable[[Any], Any]
    if origin is typing.Annotated:
        return _loader(args[0])
    if origin is typing.Literal:
        return None
    if origin is typing.Union or origin is types.UnionType:
        return _union_loader(args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            each = _loader(args[0]) or _same
            return lambda data: tuple(each(v) for v in data)
        items = [_loader(a) or _same for a in args]
        return lambda data: tuple(f(v) for f, v in zip(items, data, strict=False))
    if not isinstance(origin, type):
        raise TypeError(f"cannot replay a {tp!r} result: pass serializer=(dump, load)")
    make: Callable[[Any], Any] = origin  # the narrowed type[Mapping] etc. hides its constructor
    if issubclass(origin, (abc.Mapping,)) and not issubclass(origin, (list, tuple)):
        key = _loader(args[0]) if args else None
        value = _loader(args[1]) if len(args) > 1 else None
        build = dict if origin in (dict, abc.Mapping, abc.MutableMapping) else make
        if key is None and value is None and build is dict:
            return None
        k_load, v_load = key or _same, value or _same
        return lambda data: build({k_load(k): v_load(v) for k, v in data.items()})
    if issubclass(origin, (abc.Set,)):
        each = (_loader(args[0]) if args else None) or _same
        build = set if origin in (abc.Set, abc.MutableSet) else make
        return lambda data: build(each(v) for v in data)
    if issubclass(origin, (abc.Iterable,)):
        found = _loader(args[0]) if args else None
        if origin in (list, abc.Sequence, abc.MutableSequence, abc.Iterable, abc.Collection):
            if found is None:
                return None
            each = found
            return lambda data: [each(v) for v in data]
        each = found or _same
        return lambda data: make(each(v) for v in data)
    raise TypeError(f"cannot replay a {tp!r} result: pass serializer=(dump, load)")


def _union_loader(args: tuple[Any, ...]) -> Loader | None:
    options = [a for a in args if a is not type(None)]
    loaders = [_loader(a) for a in options]
    if all(f is None for f in loaders):
        return None
    if len(options) == 1:
        only = loaders[0]
        assert only is not None
        return lambda data: None if data is None else only(data)

    def load(data: Any) -> Any:
        if data is None and len(options) < len(args):
            return None
        for f in loaders:
            if f is None:
                return data
            try:
                return f(data)
            except (TypeError, ValueError, KeyError, AttributeError):
                continue
        raise TypeError(f"stored value fits none of {args!r}")

    return load
