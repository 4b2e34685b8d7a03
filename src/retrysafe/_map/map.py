"""The Idempotency Map: operation → key template, scope, TTL, lease, retention; route → operation.

Written in Python or in a TOML file (:meth:`IdempotencyMap.load`). Everything
is validated when the map is built, so a front door only looks routes up
(:meth:`IdempotencyMap.route`, precompiled) and builds or checks keys.
"""

from __future__ import annotations

import dataclasses
import decimal
import difflib
import json
import re
import tomllib
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import KW_ONLY, dataclass, field
from os import PathLike
from string import Formatter
from types import MappingProxyType
from typing import Any

from retrysafe._core.engine import DEFAULT_LEASE, DEFAULT_TTL, Engine
from retrysafe._core.metrics import Alerts
from retrysafe._core.principal import ANONYMOUS_MODES
from retrysafe._model.duration import format_duration, parse_duration
from retrysafe._model.hashing import MAX_KEY_LENGTH, validate_key
from retrysafe._model.record import FINANCIAL, RETENTIONS, STANDARD
from retrysafe.errors import FieldPath, InvalidKeyError, MapError

__all__ = [
    "IdempotencyMap",
    "Operation",
    "PrincipalOptions",
    "Route",
    "route_path",
]

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,99}")
_SCOPE = re.compile(r"[a-z_]+")
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_VISIBLE = re.compile(r"[!-~]*")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token
_METHOD = re.compile(r"[A-Za-z]+")
_SEGMENT = re.compile(r"[!-~]+")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")  # a TOML bare key, written without quotes
_DUPLICATE_RESPONSES = ("replay", "no_content")
_SLASHES = re.compile(r"//+")


def _suggest(word: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _duration(value: Any, name: str, *, allow_zero: bool = False) -> float:
    try:
        return parse_duration(value, field=name, allow_zero=allow_zero)
    except TypeError:
        raise MapError(
            f'must be a duration such as "30s" or "24h", or a number of seconds, '
            f"not {_kind(value)}",
            field=(name,),
        ) from None
    except ValueError as error:
        raise MapError(str(error), field=(name,)) from None


def _duration_or_zero(value: Any, name: str) -> float:
    return _duration(value, name, allow_zero=True)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise MapError(f"must be true or false, not {_kind(value)}", field=(name,))
    return value


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise MapError(f"must be a string, not {_kind(value)}", field=(name,))
    return value


def _kind(value: Any) -> str:
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


def plain_decimal(value: decimal.Decimal) -> str | None:
    """``value`` written out exactly, without exponent or trailing zeros.

    ``29.90`` → ``29.9``, ``1E+2`` → ``100``, ``-0`` → ``0``. None if it is not
    finite or would be over 300 digits long.
    """
    if not value.is_finite():
        return None
    exponent = value.as_tuple().exponent
    assert isinstance(exponent, int)
    if len(value.as_tuple().digits) + abs(exponent) > 300:
        return None
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


# -- key templates -----------------------------------------------------------------


def _template(template: Any) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """Check a key template; return (literals, fields, separators).

    ``literals`` has one more entry than ``fields``: the key is
    ``literals[0] + value0 + literals[1] + … + literals[-1]``. The separators are
    the punctuation characters right next to a field; values may not contain
    them, and two fields must be separated by one, so a key splits back into
    its values in exactly one way.
    """
    if not isinstance(template, str):
        raise MapError(f"key template must be a string, not {_kind(template)}", field=("key",))

    def bad(why: str) -> MapError:
        return MapError(f"bad key template {template!r}: {why}", field=("key",))

    try:
        parsed = list(Formatter().parse(template))
    except ValueError as error:
        raise bad(str(error)) from None
    literals: list[str] = [""]
    fields: list[str] = []
    for literal, name, spec, conversion in parsed:
        if "{" in literal or "}" in literal:
            raise bad("literal braces ({{ or }}) are not allowed in a key")
        literals[-1] += literal
        if name is None:
            continue
        shown = (
            "{"
            + name
            + (f"!{conversion}" if conversion else "")
            + (f":{spec}" if spec else "")
            + "}"
        )
        if name == "" or name.isdigit():
            raise bad(f"{shown} is positional; name every field, such as {{order_id}}")
        if "." in name or "[" in name:
            raise bad(
                f"{shown} uses attribute or index access; use a plain name such as {{order_id}}"
            )
        if not _FIELD.fullmatch(name):
            raise bad(f"{shown} is not a valid field name (letters, digits and _)")
        if conversion:
            raise bad(f"{shown} has a conversion (!{conversion}); conversions are not allowed")
        if spec:
            raise bad(f"{shown} has a format spec (:{spec}); format specs are not allowed")
        if name in fields:
            raise bad(f"field {{{name}}} appears twice")
        fields.append(name)
        literals.append("")
    if not fields:
        raise bad("it has no {field}, so every request would share one key")
    for literal in literals:
        if not _VISIBLE.fullmatch(literal):
            odd = next(c for c in literal if not "!" <= c <= "~")
            raise bad(f"it contains {odd!r}; keys are visible ASCII without spaces")
    separators: set[str] = set()
    for i, literal in enumerate(literals):
        if i > 0 and literal and not literal[0].isalnum():
            separators.add(literal[0])
        if i < len(fields) and literal and not literal[-1].isalnum():
            separators.add(literal[-1])
    for i in range(1, len(fields)):
        middle = literals[i]
        if not (middle and (middle[0] in separators or middle[-1] in separators)):
            raise bad(
                f"fields {{{fields[i - 1]}}} and {{{fields[i]}}} must be separated by "
                "punctuation such as ':', or their values could run together"
            )
    if sum(map(len, literals)) + len(fields) > MAX_KEY_LENGTH:
        raise bad(f"its keys would be over {MAX_KEY_LENGTH} characters long")
    return tuple(literals), tuple(fields), "".join(sorted(separators))


def _value_class(separators: str) -> str:
    """A regex character class: visible ASCII except braces and ``separators``."""
    excluded = "".join(f"\\x{ord(c):02x}" for c in sorted(set(separators) | {"{", "}"}))
    return f"[^\\x00-\\x20\\x7f-\\U0010ffff{excluded}]"


# -- operations --------------------------------------------------------------------


@dataclass(frozen=True)
class Operation:
    """One kind of idempotent operation: how its key is built and how long it is kept.

    ``key`` is a template such as ``"payment:{order_id}:{amount}"`` (plain named
    fields only). ``scope`` documents what the key is unique within (``user``,
    ``order``, …; it is not the engine's principal scope). ``ttl`` and ``lease``
    are seconds or duration text (``"7d"``); ``lease`` may not exceed ``ttl``.
    ``retention`` is ``"standard"`` or ``"financial"`` (archived before deletion).
    Raises :class:`MapError` for any invalid value.
    """

    name: str
    _: KW_ONLY
    key: str
    scope: str
    ttl: float = DEFAULT_TTL
    lease: float = DEFAULT_LEASE
    final_failures: bool = False
    retention: str = STANDARD
    description: str = ""
    _literals: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _fields: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _separators: str = field(init=False, repr=False, compare=False)
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _value_re: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _field_set: frozenset[str] = field(init=False, repr=False, compare=False)
    _format: Callable[..., str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise MapError(
                f"operation name must be a letter then up to 99 letters, digits, '_', '.' "
                f"or '-', not {self.name!r}",
                field=("name",),
            )
        literals, fields, separators = _template(self.key)
        scope = _str(self.scope, "scope")
        if not _SCOPE.fullmatch(scope):
            raise MapError(
                f"must be a lower-case word such as user, order or session, not {scope!r}",
                field=("scope",),
            )
        ttl = _duration(self.ttl, "ttl")
        lease = _duration(self.lease, "lease")
        if lease > ttl:
            raise MapError(
                f"lease ({format_duration(lease)}) must not be longer than ttl "
                f"({format_duration(ttl)})",
                field=("lease",),
            )
        _bool(self.final_failures, "final_failures")
        if self.retention not in RETENTIONS:
            raise MapError(
                f"must be one of {', '.join(map(repr, RETENTIONS))}, not {self.retention!r}"
                + _suggest(str(self.retention), RETENTIONS),
                field=("retention",),
            )
        _str(self.description, "description")
        value = _value_class(separators)
        pattern = "".join(
            re.escape(literal) + (f"(?P<{name}>{value}+)" if name else "")
            for literal, name in zip(literals, (*fields, None), strict=True)
        )
        setter = object.__setattr__
        setter(self, "ttl", ttl)
        setter(self, "lease", lease)
        setter(self, "_literals", literals)
        setter(self, "_fields", fields)
        setter(self, "_separators", separators)
        setter(self, "_regex", re.compile(pattern))
        setter(self, "_value_re", re.compile(f"{value}+"))
        setter(self, "_field_set", frozenset(fields))
        # Templates hold no literal braces, so "{}" placeholders are safe.
        setter(self, "_format", "{}".join(literals).format)

    @property
    def fields(self) -> tuple[str, ...]:
        """The template's field names, in order."""
        return self._fields

    @property
    def separators(self) -> str:
        """The characters a field value may not contain (besides braces)."""
        return self._separators

    def engine(self, store: Any = None, **options: Any) -> Engine:
        """An :class:`Engine` with this operation's ttl, lease, final_failures and retention.

        ``store`` and any other ``options`` (``wait``, ``clock``, …) go to the engine.
        """
        settings: dict[str, Any] = {
            "ttl": self.ttl,
            "lease": self.lease,
            "final_failures": self.final_failures,
            "retention": self.retention,
        }
        settings.update(options)
        return Engine(store, **settings)

    def build(self, **values: Any) -> str:
        """The key for ``values`` (see :meth:`IdempotencyMap.key`)."""
        return self._build(values)

    def _build(self, values: dict[str, Any]) -> str:
        # Fill the template, then check the whole key with one regex: it must
        # parse back to exactly these values (no separator, brace, space or
        # other character that would make it ambiguous or invalid).
        if values.keys() != self._field_set:
            raise self._fields_error(values)
        fields = self._fields
        texts = list(map(values.__getitem__, fields))
        for i, value in enumerate(texts):
            if type(value) is not str:
                texts[i] = self._text(fields[i], value)
        key = self._format(*texts)
        found = self._regex.fullmatch(key)
        if found is None or found.groups() != tuple(texts):
            for name, text in zip(fields, texts, strict=True):
                self._check(name, text)
            raise InvalidKeyError(f"{self.name} key {key!r} does not parse back to its values")
        if len(key) > MAX_KEY_LENGTH:
            validate_key(key)  # raises with the length
        return key

    def _fields_error(self, values: Mapping[str, Any]) -> InvalidKeyError:
        fields = self._fields
        problems = []
        missing = [name for name in fields if name not in values]
        if missing:
            problems.append("missing " + ", ".join(missing))
        extra = [name for name in values if name not in fields]
        if extra:
            problems.append("unexpected " + ", ".join(extra))
        return InvalidKeyError(
            f"{self.name} key {self.key!r}: {'; '.join(problems)} (it takes {', '.join(fields)})"
        )

    def _text(self, name: str, value: Any) -> str:
        """A field value as key text: str, int, Decimal (plain, normalized) or UUID."""
        if type(value) is int:
            return str(value)
        if isinstance(value, decimal.Decimal):
            plain = plain_decimal(value)
            if plain is None:
                raise InvalidKeyError(f"{self.name} key field {name} is {value}: not a key part")
            return plain
        if isinstance(value, uuid.UUID):
            return str(value)
        if isinstance(value, str):
            return str.__str__(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return int.__repr__(value)
        if isinstance(value, float):
            raise InvalidKeyError(
                f"{self.name} key field {name} is a float ({value!r}): floats round, and a "
                "rounded amount makes a different key; pass an int (minor units), a "
                "Decimal or a str"
            )
        raise InvalidKeyError(
            f"{self.name} key field {name} is a {type(value).__name__}; pass a str, an "
            "int, a Decimal or a UUID"
        )

    def _check(self, name: str, text: str) -> None:
        """Raise :class:`InvalidKeyError` saying why ``text`` cannot be a field value."""
        if self._value_re.fullmatch(text):
            return
        if not text:
            raise InvalidKeyError(f"{self.name} key field {name} is empty")
        odd = next(c for c in text if c in self._separators or c in "{}" or not "!" <= c <= "~")
        if odd in self._separators:
            why = f"the separator {odd!r} of {self.key!r}, so the key would be ambiguous"
        elif odd in "{}":
            why = f"{odd!r}; braces are not allowed in keys"
        else:
            why = f"{odd!r}; keys are visible ASCII without spaces"
        raise InvalidKeyError(f"{self.name} key field {name} ({text!r}) contains {why}")

    def parse(self, key: str) -> dict[str, str]:
        """The field values of a client's ``key``; :class:`InvalidKeyError` if it does not fit."""
        match = self._regex.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            validate_key(key)
            shown = key if len(key) <= 80 else key[:77] + "..."
            raise InvalidKeyError(
                f"idempotency key {shown!r} does not match the {self.name} key format {self.key!r}"
            )
        return match.groupdict()

    def to_dict(self) -> dict[str, Any]:
        """The operation as plain data (durations in seconds), without its name."""
        data: dict[str, Any] = {
            "key": self.key,
            "scope": self.scope,
            "ttl": self.ttl,
            "lease": self.lease,
            "final_failures": self.final_failures,
            "retention": self.retention,
        }
        if self.description:
            data["description"] = self.description
        return data


# -- routes ------------------------------------------------------------------------


def route_path(path: str) -> str:
    """``path`` as routes match it: repeated slashes collapsed, then the dot segments
    removed (RFC 3986 5.2.4), so ``//pay``, ``/./pay`` and ``/x/../pay`` are ``/pay``.

    A path that does not start with ``/`` is returned as it is.
    """
    if not path.startswith("/") or ("//" not in path and "/." not in path):
        return path
    segments = _SLASHES.sub("/", path).split("/")[1:]
    out: list[str] = []
    last = len(segments) - 1
    for i, segment in enumerate(segments):
        if segment == "..":
            if out:
                out.pop()
        elif segment != ".":
            out.append(segment)
            continue
        if i == last:  # "/a/." and "/a/b/..": the path ends in a directory, "/a/"
            out.append("")
    return "/" + "/".join(out)


class _Path:
    """A compiled route path pattern.

    ``literal`` is the path itself when the pattern has no parameter; ``named``
    matches with named groups, ``bare`` is the same regex text with plain groups
    (for the map's one-regex-per-method table) and ``names`` their names in
    order. ``shape`` writes parameters as ``{}`` and a rest as ``*``, so two
    patterns that match the same paths have the same shape.
    """

    __slots__ = ("bare", "literal", "named", "names", "shape")

    def __init__(self, pattern: Any) -> None:
        if not isinstance(pattern, str):
            raise MapError(f"must be a string, not {_kind(pattern)}", field=("path",))

        def bad(why: str) -> MapError:
            return MapError(f"bad path pattern {pattern!r}: {why}", field=("path",))

        if not pattern.startswith("/"):
            raise bad("it must start with '/'")
        if "?" in pattern or "#" in pattern:
            raise bad("it must not contain '?' or '#': routes match the path only")
        segments = pattern[1:].split("/")
        named, bare, shape = "", "", ""
        names: list[str] = []
        literal = True
        for i, segment in enumerate(segments):
            last = i == len(segments) - 1
            if segment == "" and not last:
                raise bad("it has an empty segment ('//')")
            rest = segment == "*" or (segment.startswith("{") and segment.endswith(":path}"))
            if rest and not last:
                raise bad(f"{segment} matches the rest of the path, so it must come last")
            if segment == "*":
                named, bare, shape = named + "/(?:.*)", bare + "/(?:.*)", shape + "/*"
                literal = False
                continue
            if segment.startswith("{") and segment.endswith("}"):
                name = segment[1:-6] if rest else segment[1:-1]
                if not _FIELD.fullmatch(name):
                    raise bad(
                        f"{segment} is not a valid parameter; write {{name}} or {{name:path}}"
                    )
                if name in names:
                    raise bad(f"parameter {{{name}}} appears twice")
                names.append(name)
                value = ".*" if rest else "[^/]+"
                named += f"/(?P<{name}>{value})"
                bare += f"/({value})"
                shape += "/*" if rest else "/{}"
                literal = False
                continue
            if "{" in segment or "}" in segment or "*" in segment:
                raise bad(
                    f"segment {segment!r} mixes text and a parameter; a parameter is a whole "
                    "segment"
                )
            if segment and not _SEGMENT.fullmatch(segment):
                raise bad(f"segment {segment!r} is not visible ASCII")
            named += "/" + re.escape(segment)
            bare += "/" + re.escape(segment)
            shape += "/" + segment
        self.literal = pattern if literal else None
        self.named = re.compile(named, re.DOTALL)  # a decoded "%0A" is part of the rest
        self.bare = bare
        self.names = tuple(names)
        self.shape = shape


@dataclass(frozen=True)
class Route:
    """Requests (``method``, ``path`` pattern) that belong to an operation.

    ``path`` is a pattern of literal segments, ``{name}`` (one segment) and a
    last ``*`` or ``{name:path}`` (the rest of the path after that ``/``, even
    empty). ``method`` is an HTTP method or ``"*"``. The other fields tell a
    front door how to treat the requests: whether a key is required, in which
    header, what a duplicate gets (``"replay"`` or ``"no_content"``), how long it
    waits for an attempt in flight (seconds or ``"5s"``), and whether the key
    must fit the operation's template. ``anonymous`` is what a request without
    credentials gets on this route (``"run"``, ``"refuse"`` or ``"share"``; None:
    the map's ``[principals]`` or the front door's option).
    """

    method: str
    path: str
    operation: str
    _: KW_ONLY
    require_key: bool = True
    header: str = "Idempotency-Key"
    duplicate_response: str = "replay"
    wait: float = 0.0
    validate_key: bool = False
    anonymous: str | None = None
    _path: _Path = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        method = _str(self.method, "method")
        if method != "*":
            if not _METHOD.fullmatch(method):
                raise MapError(
                    f'must be an HTTP method such as "POST", or "*", not {method!r}',
                    field=("method",),
                )
            method = method.upper()
        compiled = _Path(self.path)
        if not isinstance(self.operation, str) or not _NAME.fullmatch(self.operation):
            raise MapError(
                f"must name an operation, not {_kind(self.operation)}", field=("operation",)
            )
        _bool(self.require_key, "require_key")
        header = _str(self.header, "header")
        if not _TOKEN.fullmatch(header):
            raise MapError(
                f"must be an HTTP header name (letters, digits, !#$%&'*+-.^_`|~), not {header!r}",
                field=("header",),
            )
        if self.duplicate_response not in _DUPLICATE_RESPONSES:
            raise MapError(
                f'must be "replay" or "no_content", not {self.duplicate_response!r}'
                + _suggest(str(self.duplicate_response), _DUPLICATE_RESPONSES),
                field=("duplicate_response",),
            )
        wait = _duration(self.wait, "wait", allow_zero=True)
        _bool(self.validate_key, "validate_key")
        if self.anonymous is not None:
            _anonymous(self.anonymous, ("anonymous",))
        setter = object.__setattr__
        setter(self, "method", method)
        setter(self, "wait", wait)
        setter(self, "_path", compiled)
        setter(self, "_hash", hash(tuple(self.to_dict().values())))

    def __hash__(self) -> int:  # computed once: front doors key dicts by route
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its fields: the cached hash of str differs between processes.
        return (_rebuild_route, (self.to_dict(),))

    def match(self, method: str, path: str) -> dict[str, str] | None:
        """The path parameters if this route takes the request, else None (``path``
        is matched as :func:`route_path` gives it)."""
        if self.method != "*" and method != self.method and method.upper() != self.method:
            return None
        return self._match_path(route_path(path))

    def _match_path(self, path: str) -> dict[str, str] | None:
        if self._path.literal is not None:
            return {} if path == self._path.literal else None
        found = self._path.named.fullmatch(path)
        return None if found is None else found.groupdict()

    def _covers(self, other: Route) -> bool:
        """Whether this route takes every request ``other`` takes (so ``other`` is dead)."""
        if self.method != "*" and self.method != other.method:
            return False
        # A sample path for each way other's pattern can vary: a parameter value
        # no literal can equal, and for a rest, nothing, one segment and two.
        marker = "\x00"
        base = other._path.shape.replace("{}", marker)
        if not base.endswith("/*"):
            return self._match_path(base) is not None
        head = base[:-1]
        return all(self._match_path(head + tail) is not None for tail in ("", marker, "\x00/\x00"))

    def to_dict(self) -> dict[str, Any]:
        """The route as plain data (``wait`` in seconds)."""
        return {
            "method": self.method,
            "path": self.path,
            "operation": self.operation,
            "require_key": self.require_key,
            "header": self.header,
            "duplicate_response": self.duplicate_response,
            "wait": self.wait,
            "validate_key": self.validate_key,
            "anonymous": self.anonymous,
        }


class _Table:
    """The routes one method can take: literal paths in a dict, the rest in one regex.

    A literal route is left out of the dict when an earlier route also takes its
    path (that one wins); literal routes can match only their own path, so the
    regex needs none of them. In the regex, each route's alternative ends in an
    empty group, so ``lastindex`` says which route matched; alternatives are
    tried in declared order.
    """

    __slots__ = ("literals", "regex", "slots")

    def __init__(self, routes: tuple[Route, ...], method: str) -> None:
        mine = [r for r in routes if r.method == "*" or r.method == method]
        self.literals: dict[str, Route] = {}
        self.slots: dict[int, tuple[Route, tuple[str, ...], tuple[int, ...]]] = {}
        parts: list[str] = []
        group = 0
        for i, route in enumerate(mine):
            compiled = route._path
            if compiled.literal is not None:
                taken = any(r._match_path(compiled.literal) is not None for r in mine[:i])
                if not taken:
                    self.literals.setdefault(compiled.literal, route)
                continue
            groups = tuple(range(group + 1, group + 1 + len(compiled.names)))
            group += len(compiled.names) + 1
            self.slots[group] = (route, compiled.names, groups)
            parts.append(f"{compiled.bare}()")
        self.regex = re.compile("|".join(parts), re.DOTALL) if parts else None


def _rebuild_route(data: dict[str, Any]) -> Route:
    return Route(**data)


@dataclass(frozen=True)
class PrincipalOptions:
    """The ``[principals]`` table: how the HTTP front doors name the caller.

    Each field is the front doors' option of the same name without its
    ``principal_`` prefix (``headers``: ``principal_headers``, and so on; see
    docs/principals.md); None leaves the front door's own option or default.
    An option given to the front door itself wins over the table.
    """

    headers: tuple[str, ...] | None = None
    cookies: tuple[str, ...] | None = None
    query: tuple[str, ...] | None = None
    anonymous: str | None = None

    def __post_init__(self) -> None:
        for name in ("headers", "cookies", "query"):
            value = getattr(self, name)
            if value is None:
                continue
            path = ("principals", name)
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise MapError(f"must be an array of names, not {_kind(value)}", field=path)
            value = tuple(value)
            for item in value:
                if not isinstance(item, str) or not _TOKEN.fullmatch(item):
                    raise MapError(
                        f"must be an array of names (letters, digits, !#$%&'*+-.^_`|~), "
                        f"not one holding {_kind(item)}",
                        field=path,
                    )
            object.__setattr__(self, name, value)
        if self.anonymous is not None:
            _anonymous(self.anonymous, ("principals", "anonymous"))

    def to_dict(self) -> dict[str, Any]:
        return {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in dataclasses.asdict(self).items()
            if value is not None
        }


def _anonymous(value: Any, path: FieldPath) -> None:
    if value not in ANONYMOUS_MODES:
        raise MapError(
            f"must be one of {', '.join(map(repr, ANONYMOUS_MODES))}, not {_kind(value)}"
            + _suggest(str(value), ANONYMOUS_MODES),
            field=path,
        )


# -- the map -----------------------------------------------------------------------


_OPERATION_KEYS = ("key", "scope", "ttl", "lease", "final_failures", "retention", "description")
_DEFAULTS_KEYS = ("ttl", "lease", "retention", "final_failures")
_ROUTE_KEYS = (
    "method",
    "path",
    "operation",
    "require_key",
    "header",
    "duplicate_response",
    "wait",
    "validate_key",
    "anonymous",
)
_ALERT_KEYS = ("burst", "burst_window", "failures", "stuck_after")
_PRINCIPAL_KEYS = ("headers", "cookies", "query", "anonymous")
_TOP_KEYS = ("include_defaults", "defaults", "operations", "routes", "alerts", "principals")

_DEFAULT: IdempotencyMap | None = None


class IdempotencyMap:
    """Operations by name, and routes that send requests to them.

    Names must be unique and every route must name a known operation; a route
    that an earlier one always takes first is refused too. Raises
    :class:`MapError` for an invalid map.
    """

    __slots__ = ("_alerts", "_any", "_operations", "_principals", "_routes", "_tables")

    def __init__(
        self,
        operations: Iterable[Operation] = (),
        routes: Iterable[Route] = (),
        alerts: Alerts | None = None,
        principals: PrincipalOptions | None = None,
    ) -> None:
        if isinstance(operations, Mapping):
            operations = operations.values()
        by_name: dict[str, Operation] = {}
        for i, operation in enumerate(operations):
            if not isinstance(operation, Operation):
                raise MapError(
                    f"must be an Operation, not {type(operation).__name__}", field=("operations", i)
                )
            if operation.name in by_name:
                raise MapError("operation name used twice", field=("operations", operation.name))
            by_name[operation.name] = operation
        routes = tuple(routes)
        for i, route in enumerate(routes):
            if not isinstance(route, Route):
                raise MapError(f"must be a Route, not {type(route).__name__}", field=("routes", i))
            if route.operation not in by_name:
                known = ", ".join(sorted(by_name)) or "none"
                raise MapError(
                    f"unknown operation {route.operation!r}"
                    + _suggest(route.operation, by_name)
                    + f" (known: {known})",
                    field=("routes", i, "operation"),
                )
            for j, earlier in enumerate(routes[:i]):
                if earlier._covers(route):
                    if earlier.method == route.method and earlier._path.shape == route._path.shape:
                        why = f"duplicate route: routes[{j}] is also {route.method} {earlier.path}"
                    else:
                        why = (
                            f"{route.method} {route.path} can never match: routes[{j}] "
                            f"({earlier.method} {earlier.path}) comes first and takes every "
                            "request it would; put the more specific route first"
                        )
                    raise MapError(why, field=("routes", i, "path"))
        if alerts is not None and not isinstance(alerts, Alerts):
            raise MapError(f"must be an Alerts, not {type(alerts).__name__}", field=("alerts",))
        self._alerts = alerts
        if principals is not None and not isinstance(principals, PrincipalOptions):
            raise MapError(
                f"must be a PrincipalOptions, not {type(principals).__name__}",
                field=("principals",),
            )
        self._principals = principals
        self._operations = MappingProxyType(by_name)
        self._routes = routes
        # Per method, a table of the routes that can take it, in declared order.
        methods = {route.method for route in routes} - {"*"}
        self._tables = {method: _Table(routes, method) for method in methods}
        self._any = _Table(routes, "*")

    # -- reading -------------------------------------------------------------------

    @property
    def operations(self) -> Mapping[str, Operation]:
        """Operations by name (read-only)."""
        return self._operations

    @property
    def routes(self) -> tuple[Route, ...]:
        """Routes in declared order (the first that matches wins)."""
        return self._routes

    @property
    def alerts(self) -> Alerts | None:
        """The alert thresholds of its ``[alerts]`` table, if it has one."""
        return self._alerts

    @property
    def principals(self) -> PrincipalOptions | None:
        """How front doors name the caller: its ``[principals]`` table, if it has one."""
        return self._principals

    def operation(self, name: str) -> Operation:
        """The operation called ``name``; ``KeyError`` listing the known names if none."""
        try:
            return self._operations[name]
        except KeyError:
            known = ", ".join(sorted(self._operations)) or "none"
            raise KeyError(
                f"no operation {name!r} in the map{_suggest(str(name), self._operations)} "
                f"(known: {known})"
            ) from None

    def route(self, method: str, path: str) -> tuple[Route, dict[str, str]] | None:
        """The first declared route that takes ``method path``, with its parameters.

        A query string is ignored, and the path matched as :func:`route_path`
        gives it (repeated slashes and dot segments cannot dodge a route). One
        dict lookup, then at most one regex match.
        """
        table = self._tables.get(method)
        if table is None:
            table = self._tables.get(method.upper(), self._any)
        if "?" in path:
            path = path.partition("?")[0]
        if "//" in path or "/." in path:  # route_path's own test, without a call
            path = route_path(path)
        route = table.literals.get(path)
        if route is not None:
            return route, {}
        if table.regex is None:
            return None
        found = table.regex.fullmatch(path)
        if found is None:
            return None
        route, names, groups = table.slots[found.lastindex]  # type: ignore[index]
        if len(groups) > 1:
            return route, dict(zip(names, found.group(*groups), strict=True))
        return route, {names[0]: found.group(groups[0])} if groups else {}

    def key(self, operation: str, /, **fields: Any) -> str:
        """The key of ``operation`` for ``fields``, built from its template.

        Values are str, int, Decimal (normalized: ``29.90`` → ``29.9``) or UUID.
        Raises :class:`InvalidKeyError` for a missing or extra field, an empty
        value, a value holding one of the template's separators, a brace or a
        character outside visible ASCII, a float, bool or other type, or a key
        over 255 characters. ``KeyError`` for an unknown operation.
        """
        found = self._operations.get(operation)
        return (found or self.operation(operation))._build(fields)

    def __contains__(self, name: object) -> bool:
        return name in self._operations

    def __iter__(self) -> Iterator[Operation]:
        return iter(self._operations.values())

    def __len__(self) -> int:
        return len(self._operations)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IdempotencyMap):
            return NotImplemented
        return (
            dict(self._operations) == dict(other._operations)
            and self._routes == other._routes
            and self._alerts == other._alerts
            and self._principals == other._principals
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"<IdempotencyMap operations=[{', '.join(self._operations)}] "
            f"routes={len(self._routes)}>"
        )

    # -- building ------------------------------------------------------------------

    def with_operations(self, *operations: Operation) -> IdempotencyMap:
        """A new map with ``operations`` added (replacing any of the same name)."""
        by_name = dict(self._operations)
        for operation in operations:
            by_name[operation.name] = operation
        return IdempotencyMap(by_name.values(), self._routes, self._alerts, self._principals)

    def with_routes(self, *routes: Route) -> IdempotencyMap:
        """A new map with ``routes`` added after the existing ones."""
        return IdempotencyMap(
            self._operations.values(), (*self._routes, *routes), self._alerts, self._principals
        )

    def merge(self, other: IdempotencyMap) -> IdempotencyMap:
        """A new map: ``other``'s operations replace same-named ones; its routes come after;
        its ``[alerts]`` and ``[principals]`` tables, when it has them, replace these."""
        by_name = {**self._operations, **other._operations}
        return IdempotencyMap(
            by_name.values(),
            (*self._routes, *other._routes),
            other._alerts or self._alerts,
            other._principals or self._principals,
        )

    @classmethod
    def default(cls) -> IdempotencyMap:
        """The operations of the agentic-commerce idempotency map, named as their key prefixes.

        24 h and standard retention, except cart mandates (30 min: stale prices)
        and payments and orders (7 days, financial: archived before deletion).
        No routes. The map is immutable, so the same one is returned each time.
        """
        global _DEFAULT
        if _DEFAULT is None:
            _DEFAULT = cls(_default_operations())
        return _DEFAULT

    # -- TOML ----------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | PathLike[str]) -> IdempotencyMap:
        """Read a map from a TOML file; every problem is a :class:`MapError`."""
        source = str(path)
        try:
            with open(path, "rb") as file:
                data = file.read()
        except OSError as error:
            raise MapError(
                f"cannot read the map: {error.strerror or error}", source=source
            ) from None
        try:
            text = data.decode()
        except UnicodeDecodeError as error:
            raise MapError(f"not UTF-8: {error.reason}", source=source) from None
        return cls.loads(text, source=source)

    @classmethod
    def loads(cls, text: str, source: str = "<string>") -> IdempotencyMap:
        """Read a map from TOML text; ``source`` names it in error messages."""
        lines = _Lines(text)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            message = str(error)
            line: int | None = None
            found = re.search(r" \(at line (\d+), column \d+\)$", message)
            if found:
                line = int(found.group(1))
                message = message[: found.start()]
            elif message.endswith(" (at end of document)"):
                line = max(1, len(text.splitlines()))
                message = message[: -len(" (at end of document)")]
            field = lines.field_at(line) if line else None
            raise MapError(
                f"not valid TOML: {message}", source=source, line=line, field=field
            ) from None
        try:
            return _from_data(cls, data)
        except MapError as error:
            raise MapError(
                error.message,
                source=source,
                line=lines.line_of(error.field_path),
                field=error.field_path,
            ) from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> IdempotencyMap:
        """A map from plain data shaped like the TOML file (as :meth:`to_dict` gives)."""
        try:
            return _from_data(cls, data)
        except MapError as error:
            if source is None:
                raise
            raise MapError(error.message, source=source, field=error.field_path) from None

    def to_dict(self) -> dict[str, Any]:
        """The map as plain data (durations in seconds); :meth:`from_dict` reads it back."""
        data: dict[str, Any] = {
            "operations": {name: op.to_dict() for name, op in self._operations.items()},
            "routes": [route.to_dict() for route in self._routes],
        }
        if self._alerts is not None:
            data["alerts"] = dataclasses.asdict(self._alerts)
        if self._principals is not None:
            data["principals"] = self._principals.to_dict()
        return data

    def to_toml(self) -> str:
        """The map as a TOML file that :meth:`loads` reads back to an equal map."""
        out: list[str] = []
        for name, op in self._operations.items():
            if out:
                out.append("")
            out.append(f"[operations.{_toml_key(name)}]")
            out.append(f"key = {_toml_str(op.key)}")
            out.append(f"scope = {_toml_str(op.scope)}")
            out.append(f"ttl = {_toml_str(format_duration(op.ttl))}")
            out.append(f"lease = {_toml_str(format_duration(op.lease))}")
            out.append(f"retention = {_toml_str(op.retention)}")
            out.append(f"final_failures = {str(op.final_failures).lower()}")
            if op.description:
                out.append(f"description = {_toml_str(op.description)}")
        for route in self._routes:
            if out:
                out.append("")
            out.append("[[routes]]")
            out.append(f"method = {_toml_str(route.method)}")
            out.append(f"path = {_toml_str(route.path)}")
            out.append(f"operation = {_toml_str(route.operation)}")
            out.append(f"require_key = {str(route.require_key).lower()}")
            out.append(f"header = {_toml_str(route.header)}")
            out.append(f"duplicate_response = {_toml_str(route.duplicate_response)}")
            out.append(f"wait = {_toml_str(format_duration(route.wait))}")
            out.append(f"validate_key = {str(route.validate_key).lower()}")
            if route.anonymous is not None:
                out.append(f"anonymous = {_toml_str(route.anonymous)}")
        if self._alerts is not None:
            a = self._alerts
            if out:
                out.append("")
            out.append("[alerts]")
            out.append(f"burst = {a.burst}")
            out.append(f"burst_window = {_toml_str(format_duration(a.burst_window))}")
            out.append(f"failures = {a.failures}")
            out.append(f"stuck_after = {_toml_str(format_duration(a.stuck_after))}")
        if self._principals is not None:
            if out:
                out.append("")
            out.append("[principals]")
            for name, value in self._principals.to_dict().items():
                if isinstance(value, list):
                    value = "[" + ", ".join(_toml_str(v) for v in value) + "]"
                else:
                    value = _toml_str(value)
                out.append(f"{name} = {value}")
        return "\n".join(out) + "\n" if out else ""

    def describe(self) -> str:
        """A plain-text table of the operations and routes."""
        rows = [("operation", "key", "scope", "ttl", "lease", "retention")]
        for op in self._operations.values():
            rows.append(
                (
                    op.name,
                    op.key,
                    op.scope,
                    format_duration(op.ttl),
                    format_duration(op.lease),
                    op.retention + (", final failures" if op.final_failures else ""),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
            + "  "
            + row[-1]
            for row in rows
        ]
        if self._routes:
            lines.append("")
            for route in self._routes:
                extra = [] if route.require_key else ["key optional"]
                if route.duplicate_response != "replay":
                    extra.append(route.duplicate_response)
                if route.wait:
                    extra.append(f"wait {format_duration(route.wait)}")
                if route.validate_key:
                    extra.append("key must fit the template")
                if route.header != "Idempotency-Key":
                    extra.append(f"header {route.header}")
                if route.anonymous is not None:
                    extra.append(f"anonymous {route.anonymous}")
                tail = f" ({', '.join(extra)})" if extra else ""
                lines.append(f"{route.method} {route.path} -> {route.operation}{tail}")
        return "\n".join(line.rstrip() for line in lines) + "\n"


def _default_operations() -> tuple[Operation, ...]:
    day, week = 24 * 3600.0, 7 * 24 * 3600.0
    return (
        Operation(
            "session",
            key="session:{user_id}:{timestamp}:{nonce}",
            scope="user",
            ttl=day,
            description="Session creation",
        ),
        Operation(
            "cart_mandate",
            key="cart_mandate:{session_id}:{cart_hash}",
            scope="session",
            ttl=30 * 60.0,
            description="Cart mandate: the user's commitment to these items at these prices "
            "(expires after 30 minutes to prevent stale pricing)",
        ),
        Operation(
            "intent_mandate",
            key="intent_mandate:{user_id}:{intent_hash}",
            scope="user",
            ttl=day,
            description="Intent mandate",
        ),
        Operation(
            "payment",
            key="payment:{order_id}:{amount}:{currency}:{timestamp}",
            scope="order",
            ttl=week,
            retention=FINANCIAL,
            description="Payment transaction (pass the same key to the payment gateway)",
        ),
        Operation(
            "order",
            key="order:{cart_mandate_id}:{user_id}",
            scope="cart",
            ttl=week,
            retention=FINANCIAL,
            description="Order creation, exactly once per cart mandate (kept like a payment: "
            "an order commits money)",
        ),
        Operation(
            "webhook",
            key="webhook:{source}:{event_id}",
            scope="event",
            ttl=day,
            description="Webhook processing (Shopify: X-Shopify-Event-Id)",
        ),
        Operation(
            "payment_webhook",
            key="webhook:{gateway}:{transaction_id}:{event_type}",
            scope="event",
            ttl=day,
            description="Payment gateway webhook (payment.succeeded, payment.failed, "
            "refund.processed)",
        ),
        Operation(
            "sync",
            key="sync:{entity}:{entity_id}:{version}",
            scope="entity",
            ttl=day,
            description="Data synchronization",
        ),
    )


# -- reading plain data (the parsed TOML) ------------------------------------------


def _table(value: Any, path: FieldPath) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise MapError(f"must be a table, not {_kind(value)}", field=path)
    return value


def _known(table: Mapping[str, Any], allowed: tuple[str, ...], path: FieldPath, what: str) -> None:
    for name in table:
        if name not in allowed:
            raise MapError(
                f"unknown key {name!r} in {what}{_suggest(str(name), allowed)} "
                f"(allowed: {', '.join(allowed)})",
                field=(*path, name),
            )


def _from_data(cls: type[IdempotencyMap], data: Mapping[str, Any]) -> IdempotencyMap:
    data = _table(data, ())
    _known(data, _TOP_KEYS, (), "the map")
    include = data.get("include_defaults", False)
    if not isinstance(include, bool):
        raise MapError(f"must be true or false, not {_kind(include)}", field=("include_defaults",))

    defaults: dict[str, Any] = {}
    if "defaults" in data:
        table = _table(data["defaults"], ("defaults",))
        _known(table, _DEFAULTS_KEYS, ("defaults",), "[defaults]")
        for name, value in table.items():
            path = ("defaults", name)
            if name in ("ttl", "lease"):
                _at(path, _duration, value, name)
            elif name == "final_failures":
                _at(path, _bool, value, name)
            elif value not in RETENTIONS:
                raise MapError(
                    f"must be one of {', '.join(map(repr, RETENTIONS))}, not {_kind(value)}",
                    field=path,
                )
            defaults[name] = value

    base = cls.default().operations if include else {}
    operations: dict[str, Operation] = dict(base)
    tables = _table(data.get("operations", {}), ("operations",))
    for name, value in tables.items():
        path: FieldPath = ("operations", name)
        table = _table(value, path)
        _known(table, _OPERATION_KEYS, path, f"operation {name!r}")
        inherited = base.get(name)
        if inherited is not None:
            settings = inherited.to_dict()
            settings.update(table)
            origins = {}
        else:
            settings = {**defaults, **table}
            origins = {key: ("defaults", key) for key in defaults if key not in table}
            for required in ("key", "scope"):
                if required not in settings:
                    raise MapError(f"operation {name!r} needs a {required}", field=path)
        try:
            operations[name] = Operation(name, **settings)
        except MapError as error:
            raise _relocate(error, path, table, origins) from None

    routes: list[Route] = []
    entries = data.get("routes", [])
    if not isinstance(entries, list):
        raise MapError(
            f"must be an array of tables ([[routes]]), not {_kind(entries)}", field=("routes",)
        )
    for i, value in enumerate(entries):
        path = ("routes", i)
        table = _table(value, path)
        _known(table, _ROUTE_KEYS, path, "a route")
        for required in ("method", "path", "operation"):
            if required not in table:
                raise MapError(f"a route needs a {required}", field=path)
        try:
            routes.append(Route(**table))
        except MapError as error:
            raise MapError(error.message, field=(*path, *error.field_path)) from None
    alerts = _alerts(data["alerts"]) if "alerts" in data else None
    principals = None
    if "principals" in data:
        table = _table(data["principals"], ("principals",))
        _known(table, _PRINCIPAL_KEYS, ("principals",), "[principals]")
        principals = PrincipalOptions(**table)
    return cls(operations.values(), routes, alerts, principals)


def _alerts(value: Any) -> Alerts:
    """The ``[alerts]`` table: thresholds of the alerts (see retrysafe.metrics.Alerts)."""
    table = _table(value, ("alerts",))
    _known(table, _ALERT_KEYS, ("alerts",), "[alerts]")
    settings: dict[str, Any] = {}
    for name, item in table.items():
        path = ("alerts", name)
        if name in ("burst", "failures"):
            if isinstance(item, bool) or not isinstance(item, int) or item < 1:
                raise MapError(
                    f"must be a whole number of at least 1, not {_kind(item)}", field=path
                )
            settings[name] = item
        else:
            check = _duration_or_zero if name == "stuck_after" else _duration
            settings[name] = _at(path, check, item, name)
    return Alerts(**settings)


def _at(path: FieldPath, check: Any, *args: Any) -> Any:
    try:
        return check(*args)
    except MapError as error:
        raise MapError(error.message, field=path) from None


def _relocate(
    error: MapError, path: FieldPath, table: Mapping[str, Any], origins: dict[str, FieldPath]
) -> MapError:
    """Point an operation's error at the line that caused it."""
    name = error.field_path[0] if error.field_path else None
    if name == "name":
        return MapError(error.message, field=path)
    if name == "lease" and "lease" not in table and "ttl" in table:
        # The lease came from elsewhere; the ttl written here is the short one.
        return MapError(error.message, field=(*path, "ttl"))
    if isinstance(name, str) and name not in table and name in origins:
        return MapError(f"{error.message} (in operation {path[-1]!r})", field=origins[name])
    return MapError(error.message, field=(*path, *error.field_path))


# -- finding lines in the TOML text ------------------------------------------------

_KEY_PART = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_KEY_PATH = rf"{_KEY_PART}(?:\s*\.\s*{_KEY_PART})*"
_ARRAY_HEADER = re.compile(rf"\s*\[\[\s*({_KEY_PATH})\s*\]\]")
_TABLE_HEADER = re.compile(rf"\s*\[\s*({_KEY_PATH})\s*\]")
_KEY_LINE = re.compile(rf"\s*({_KEY_PATH})\s*=")
_KEY_PARTS = re.compile(_KEY_PART)


def _key_parts(text: str) -> tuple[str, ...]:
    parts = []
    for part in _KEY_PARTS.findall(text):
        if part.startswith('"'):
            try:
                part = json.loads(part)
            except ValueError:
                part = part[1:-1]
        elif part.startswith("'"):
            part = part[1:-1]
        parts.append(part)
    return tuple(parts)


class _Lines:
    """Where each table and key of a TOML text is written (a light scan, not a parser)."""

    def __init__(self, text: str) -> None:
        self.lines: dict[FieldPath, int] = {}
        self.fields: dict[int, FieldPath] = {}
        arrays: dict[FieldPath, int] = {}
        table: FieldPath = ()
        closing: str | None = None  # the quotes of an open multi-line string
        for number, line in enumerate(text.splitlines(), 1):
            if closing is not None:
                if line.count(closing) % 2:
                    closing = None
                continue
            header = _ARRAY_HEADER.match(line)
            if header:
                name = _key_parts(header.group(1))
                index = arrays.get(name, -1) + 1
                arrays[name] = index
                table = (*name, index)
                self._note(table, number)
                continue
            header = _TABLE_HEADER.match(line)
            if header:
                table = _key_parts(header.group(1))
                self._note(table, number)
                continue
            key = _KEY_LINE.match(line)
            if key:
                path = (*table, *_key_parts(key.group(1)))
                self._note(path, number)
                self.fields[number] = path
                rest = line[key.end() :]
                for quotes in ('"""', "'''"):
                    if rest.count(quotes) % 2:
                        closing = quotes
                        break

    def _note(self, path: FieldPath, number: int) -> None:
        for end in range(1, len(path) + 1):
            self.lines.setdefault(path[:end], number)

    def line_of(self, path: FieldPath) -> int | None:
        """The line of ``path``, else of its nearest enclosing table or key, else None."""
        for end in range(len(path), 0, -1):
            line = self.lines.get(path[:end])
            if line is not None:
                return line
        return None

    def field_at(self, line: int) -> FieldPath | None:
        """The key written on ``line``, if any."""
        return self.fields.get(line)


def _toml_key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else _toml_str(name)


def _toml_str(text: str) -> str:
    """A TOML basic string (JSON's escapes are valid TOML, except none used here)."""
    out = []
    for char in text:
        code = ord(char)
        if char == '"':
            out.append('\\"')
        elif char == "\\":
            out.append("\\\\")
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif char == "\r":
            out.append("\\r")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
