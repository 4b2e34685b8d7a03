"""Routes: which requests (method, path pattern) belong to which operation, and how
front doors treat them; the ``[principals]`` table."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Literal

from retrysafe._map.checks import (
    FIELD_NAME,
    OPERATION_NAME,
    anonymous_mode,
    boolean,
    duration,
    kind,
    string,
    suggest,
)
from retrysafe.errors import MapError

__all__ = ["PrincipalOptions", "Route", "RouteTable", "route_path", "unreachable"]

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token
_METHOD = re.compile(r"[A-Za-z]+")
_SEGMENT = re.compile(r"[!-~]+")
_DUPLICATE_RESPONSES = ("replay", "no_content")
_SLASHES = re.compile(r"//+")


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
            raise MapError(f"must be a string, not {kind(pattern)}", field=("path",))

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
                if not FIELD_NAME.fullmatch(name):
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
    duplicate_response: Literal["replay", "no_content"] = "replay"
    wait: float = 0.0
    validate_key: bool = False
    anonymous: str | None = None
    _path: _Path = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        method = string(self.method, "method")
        if method != "*":
            if not _METHOD.fullmatch(method):
                raise MapError(
                    f'must be an HTTP method such as "POST", or "*", not {method!r}',
                    field=("method",),
                )
            method = method.upper()
        compiled = _Path(self.path)
        if not isinstance(self.operation, str) or not OPERATION_NAME.fullmatch(self.operation):
            raise MapError(
                f"must name an operation, not {kind(self.operation)}", field=("operation",)
            )
        boolean(self.require_key, "require_key")
        header = string(self.header, "header")
        if not _TOKEN.fullmatch(header):
            raise MapError(
                f"must be an HTTP header name (letters, digits, !#$%&'*+-.^_`|~), not {header!r}",
                field=("header",),
            )
        if self.duplicate_response not in _DUPLICATE_RESPONSES:
            raise MapError(
                f'must be "replay" or "no_content", not {self.duplicate_response!r}'
                + suggest(str(self.duplicate_response), _DUPLICATE_RESPONSES),
                field=("duplicate_response",),
            )
        wait = duration(self.wait, "wait", allow_zero=True)
        boolean(self.validate_key, "validate_key")
        if self.anonymous is not None:
            anonymous_mode(self.anonymous, ("anonymous",))
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


def unreachable(routes: Sequence[Route], i: int) -> str | None:
    """Why ``routes[i]`` can never match (an earlier route takes all it would), or None."""
    route = routes[i]
    for j, earlier in enumerate(routes[:i]):
        if earlier._covers(route):
            if earlier.method == route.method and earlier._path.shape == route._path.shape:
                return f"duplicate route: routes[{j}] is also {route.method} {earlier.path}"
            return (
                f"{route.method} {route.path} can never match: routes[{j}] "
                f"({earlier.method} {earlier.path}) comes first and takes every "
                "request it would; put the more specific route first"
            )
    return None


class RouteTable:
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
                raise MapError(f"must be an array of names, not {kind(value)}", field=path)
            value = tuple(value)
            for item in value:
                if not isinstance(item, str) or not _TOKEN.fullmatch(item):
                    raise MapError(
                        f"must be an array of names (letters, digits, !#$%&'*+-.^_`|~), "
                        f"not one holding {kind(item)}",
                        field=path,
                    )
            object.__setattr__(self, name, value)
        if self.anonymous is not None:
            anonymous_mode(self.anonymous, ("principals", "anonymous"))

    def to_dict(self) -> dict[str, Any]:
        return {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in dataclasses.asdict(self).items()
            if value is not None
        }
