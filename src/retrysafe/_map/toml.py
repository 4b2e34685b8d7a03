"""The idempotency map's TOML file: reading it (errors point at their line), and writing it."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from os import PathLike
from typing import TYPE_CHECKING, Any

from retrysafe._core.metrics import Alerts
from retrysafe._map.checks import FieldPath, boolean, duration, duration_or_zero, kind, suggest
from retrysafe._map.operations import Operation
from retrysafe._map.routes import PrincipalOptions, Route
from retrysafe._model.duration import format_duration
from retrysafe._model.record import RETENTIONS
from retrysafe.errors import MapError

if TYPE_CHECKING:
    from retrysafe._map.map import IdempotencyMap

__all__ = ["dumps", "from_data", "load", "loads"]

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
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def load(cls: type[IdempotencyMap], path: str | PathLike[str]) -> IdempotencyMap:
    """A map of class ``cls`` from a TOML file; every problem is a :class:`MapError`."""
    source = str(path)
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as error:
        raise MapError(f"cannot read the map: {error.strerror or error}", source=source) from None
    try:
        text = data.decode()
    except UnicodeDecodeError as error:
        raise MapError(f"not UTF-8: {error.reason}", source=source) from None
    return loads(cls, text, source)


def loads(cls: type[IdempotencyMap], text: str, source: str) -> IdempotencyMap:
    """A map of class ``cls`` from TOML text; ``source`` names it in error messages."""
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
        return from_data(cls, data)
    except MapError as error:
        raise MapError(
            error.message,
            source=source,
            line=lines.line_of(error.field_path),
            field=error.field_path,
        ) from None


def dumps(imap: IdempotencyMap) -> str:
    """``imap`` as a TOML file that :func:`loads` reads back to an equal map."""
    out: list[str] = []
    for name, op in imap.operations.items():
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
    for route in imap.routes:
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
    if imap.alerts is not None:
        a = imap.alerts
        if out:
            out.append("")
        out.append("[alerts]")
        out.append(f"burst = {a.burst}")
        out.append(f"burst_window = {_toml_str(format_duration(a.burst_window))}")
        out.append(f"failures = {a.failures}")
        out.append(f"stuck_after = {_toml_str(format_duration(a.stuck_after))}")
    if imap.principals is not None:
        if out:
            out.append("")
        out.append("[principals]")
        for name, value in imap.principals.to_dict().items():
            if isinstance(value, list):
                value = "[" + ", ".join(_toml_str(v) for v in value) + "]"
            else:
                value = _toml_str(value)
            out.append(f"{name} = {value}")
    return "\n".join(out) + "\n" if out else ""


# -- reading plain data (the parsed TOML) ------------------------------------------


def _table(value: Any, path: FieldPath) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise MapError(f"must be a table, not {kind(value)}", field=path)
    return value


def _known(table: Mapping[str, Any], allowed: tuple[str, ...], path: FieldPath, what: str) -> None:
    for name in table:
        if name not in allowed:
            raise MapError(
                f"unknown key {name!r} in {what}{suggest(str(name), allowed)} "
                f"(allowed: {', '.join(allowed)})",
                field=(*path, name),
            )


def from_data(cls: type[IdempotencyMap], data: Mapping[str, Any]) -> IdempotencyMap:
    """A map of class ``cls`` from plain data shaped like the TOML file."""
    data = _table(data, ())
    _known(data, _TOP_KEYS, (), "the map")
    include = data.get("include_defaults", False)
    if not isinstance(include, bool):
        raise MapError(f"must be true or false, not {kind(include)}", field=("include_defaults",))

    defaults: dict[str, Any] = {}
    if "defaults" in data:
        table = _table(data["defaults"], ("defaults",))
        _known(table, _DEFAULTS_KEYS, ("defaults",), "[defaults]")
        for name, value in table.items():
            path: FieldPath = ("defaults", name)
            if name in ("ttl", "lease"):
                _at(path, duration, value, name)
            elif name == "final_failures":
                _at(path, boolean, value, name)
            elif value not in RETENTIONS:
                raise MapError(
                    f"must be one of {', '.join(map(repr, RETENTIONS))}, not {kind(value)}",
                    field=path,
                )
            defaults[name] = value

    base = cls.default().operations if include else {}
    operations: dict[str, Operation] = dict(base)
    tables = _table(data.get("operations", {}), ("operations",))
    for name, value in tables.items():
        path = ("operations", name)
        table = _table(value, path)
        _known(table, _OPERATION_KEYS, path, f"operation {name!r}")
        inherited = base.get(name)
        origins: dict[str, FieldPath] = {}
        if inherited is not None:
            settings = inherited.to_dict()
            settings.update(table)
        else:
            settings = {**defaults, **table}
            origins.update((key, ("defaults", key)) for key in defaults if key not in table)
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
            f"must be an array of tables ([[routes]]), not {kind(entries)}", field=("routes",)
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
                    f"must be a whole number of at least 1, not {kind(item)}", field=path
                )
            settings[name] = item
        else:
            check = duration_or_zero if name == "stuck_after" else duration
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
