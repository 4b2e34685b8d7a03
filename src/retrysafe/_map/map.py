"""The idempotency map: operations by name, and routes that send requests to them.

Written in Python or in a TOML file (:meth:`IdempotencyMap.load`). Everything
is validated when the map is built, so a front door only looks routes up
(:meth:`IdempotencyMap.route`, precompiled) and builds or checks keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from os import PathLike
from types import MappingProxyType
from typing import Any

from retrysafe._core.metrics import Alerts
from retrysafe._map import toml
from retrysafe._map.checks import suggest
from retrysafe._map.operations import Operation, default_operations
from retrysafe._map.routes import PrincipalOptions, Route, RouteTable, route_path, unreachable
from retrysafe._model.duration import format_duration
from retrysafe.errors import MapError

__all__ = ["IdempotencyMap"]

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
                    + suggest(route.operation, by_name)
                    + f" (known: {known})",
                    field=("routes", i, "operation"),
                )
            why = unreachable(routes, i)
            if why is not None:
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
        self._tables = {method: RouteTable(routes, method) for method in methods}
        self._any = RouteTable(routes, "*")

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
                f"no operation {name!r} in the map{suggest(str(name), self._operations)} "
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
            _DEFAULT = cls(default_operations())
        return _DEFAULT

    # -- TOML ----------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | PathLike[str]) -> IdempotencyMap:
        """Read a map from a TOML file; every problem is a :class:`MapError`."""
        return toml.load(cls, path)

    @classmethod
    def loads(cls, text: str, source: str = "<string>") -> IdempotencyMap:
        """Read a map from TOML text; ``source`` names it in error messages."""
        return toml.loads(cls, text, source)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> IdempotencyMap:
        """A map from plain data shaped like the TOML file (as :meth:`to_dict` gives)."""
        try:
            return toml.from_data(cls, data)
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
        return toml.dumps(self)

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
