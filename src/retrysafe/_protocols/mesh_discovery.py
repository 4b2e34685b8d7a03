"""Mesh discovery: the protocol's capabilities and describe functions, as plain code, no I/O.

:class:`MeshFunction` declares a function of :class:`retrysafe.mesh.MeshApp`:
its handler, whether it takes the idempotency extension, and what ``describe``
says of it. :class:`Discovery` answers ``urn:cline:mesh:fn:capabilities`` and
``urn:cline:mesh:fn:describe`` (the protocol's system functions), and refuses
a keyed call to a function that opted out with ``EXTENSION_NOT_APPLICABLE``.
Discovery answers are reads: they are never recorded.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

from retrysafe._protocols.mesh import (
    FUNCTION_NOT_FOUND,
    INVALID_ARGUMENTS,
    URN,
    MeshCall,
    error_object,
)

__all__ = [
    "CAPABILITIES",
    "DESCRIBE",
    "DISCOVERY_ALIASES",
    "Discovery",
    "MeshFunction",
]

CAPABILITIES = "urn:cline:mesh:fn:capabilities"
DESCRIBE = "urn:cline:mesh:fn:describe"
#: The discovery extension's names of the same two functions: answered alike.
DISCOVERY_ALIASES = {
    "urn:cline:mesh:ext:discovery:fn:capabilities": CAPABILITIES,
    "urn:cline:mesh:ext:discovery:fn:describe": DESCRIBE,
}
#: The protocol versions this server speaks.
PROTOCOL_VERSIONS = ("0.1.0",)

VERSION_NOT_FOUND = "VERSION_NOT_FOUND"
EXTENSION_NOT_APPLICABLE = "EXTENSION_NOT_APPLICABLE"


def _texts(value: Iterable[str] | None, name: str, *, empty: bool) -> tuple[str, ...] | None:
    """``value`` as a tuple of distinct non-empty strings (TypeError, ValueError)."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a sequence of str, not {type(value).__name__}")
    texts = tuple(value)
    for text in texts:
        if type(text) is not str or not text:
            raise ValueError(f"{name} must hold non-empty strings, not {text!r}")
    if len(set(texts)) != len(texts):
        raise ValueError(f"{name} lists a value twice: {list(texts)!r}")
    if not texts and not empty:
        raise ValueError(f"{name} must not be empty")
    return texts


@dataclass(frozen=True, slots=True)
class MeshFunction:
    """A function of :class:`~retrysafe.mesh.MeshApp`: its handler, and what ``describe`` says.

    ``idempotency=False``: the function does not take the idempotency
    extension; a call that carries it is refused with ``EXTENSION_NOT_APPLICABLE``
    and the handler does not run. ``description`` defaults to the first line of
    the handler's docstring. ``side_effects`` (``"create"``, ``"update"``,
    ``"delete"``; empty: read-only) is left out of ``describe`` unless given.
    ``versions`` are the versions ``describe`` lists, the last one recommended.
    """

    handler: Callable[[dict[str, Any]], Any]
    _: KW_ONLY
    idempotency: bool = True
    description: str | None = None
    side_effects: Sequence[str] | None = None
    versions: Sequence[str] = ("1.0.0",)

    def __post_init__(self) -> None:
        if not callable(self.handler):
            raise TypeError(f"a handler must be callable, not {type(self.handler).__name__}")
        if type(self.idempotency) is not bool:
            raise TypeError(f"idempotency must be a bool, not {self.idempotency!r}")
        if self.description is not None and type(self.description) is not str:
            raise TypeError(f"description must be a str, not {type(self.description).__name__}")
        effects = _texts(self.side_effects, "side_effects", empty=True)
        versions = _texts(self.versions, "versions", empty=False)
        object.__setattr__(self, "side_effects", effects)
        object.__setattr__(self, "versions", versions)

    def describe(self, name: str, version: str | None = None) -> dict[str, Any]:
        """The ``describe`` result of this function under ``name`` (one version, or all)."""
        entry: dict[str, Any] = {"stability": "stable"}
        if not self.idempotency:
            entry["extensions"] = {"excluded": [URN]}
        versions = self.versions if version is None else (version,)
        description = self.description
        if description is None:  # a function's or a method's docstring, not a callable class's
            doc = inspect.getdoc(self.handler) if inspect.isroutine(self.handler) else None
            description = (doc or "").partition("\n")[0]
        result: dict[str, Any] = {"function": name, "description": description}
        if self.side_effects is not None:
            result["side_effects"] = list(self.side_effects)
        result["versions"] = [{"version": v, **entry} for v in versions]
        result["recommended_version"] = self.versions[-1]
        return result


def functions(handlers: Mapping[str, Any]) -> dict[str, MeshFunction]:
    """``handlers`` (name → callable or :class:`MeshFunction`) as MeshFunctions."""
    if not isinstance(handlers, Mapping):
        raise TypeError("handlers must map function names to callables")
    return {
        str(name): fn if isinstance(fn, MeshFunction) else MeshFunction(fn)
        for name, fn in handlers.items()
    }


class _Refused(Exception):
    """A discovery call refused: its error object."""

    def __init__(self, code: str, message: str, pointer: str, details: dict[str, Any]) -> None:
        super().__init__(message)
        # not retryable, pointing into the request
        self.error = error_object(code, message, False, details, {"pointer": pointer})


def _argument(arguments: dict[str, Any], name: str, kind: type, required: bool) -> Any:
    value = arguments.get(name)
    if value is None and not required:
        return None
    if type(value) is not kind or value == "":
        what = "a non-empty string" if kind is str else "a boolean"
        raise _Refused(
            INVALID_ARGUMENTS,
            f"{name} must be {what}",
            f"/call/arguments/{name}",
            {"argument": name, "reason": "required" if value is None else "invalid"},
        )
    return value


#: What ``describe`` says of the discovery functions (their answers are Discovery's).
_BUILT_IN = {
    CAPABILITIES: MeshFunction(
        lambda call: None,
        description="What the service supports: protocol versions, extensions, functions, limits",
        side_effects=(),
    ),
    DESCRIBE: MeshFunction(
        lambda call: None,
        description="One function: its description, side effects, versions and extensions",
        side_effects=(),
    ),
}


class Discovery:
    """What :class:`~retrysafe.mesh.MeshApp` answers before its handlers: discovery, opt-outs.

    ``functions`` are the app's; one named like a discovery function replaces it.
    """

    def __init__(self, functions: Mapping[str, MeshFunction], *, service: str, max_body: int):
        if type(service) is not str or not service:
            raise ValueError(f"service must be a non-empty string, not {service!r}")
        self.functions = dict(functions)
        self.service, self.max_body = service, max_body

    def answer(self, request: dict[str, Any], call: MeshCall) -> dict[str, Any] | None:
        """The response when discovery answers ``call``; None: its handler does.

        ``request`` is the envelope ``call`` was parsed from.
        """
        own = self.functions.get(call.function)
        if own is not None:
            if own.idempotency or call.key is None:
                return None
            return self._refuse(call, _not_applicable(request, call.function))
        system = DISCOVERY_ALIASES.get(call.function, call.function)
        if system not in _BUILT_IN:
            return None
        arguments = call.call.get("arguments") or {}
        try:
            result = self.capabilities() if system == CAPABILITIES else self.describe(arguments)
        except _Refused as refused:
            return self._refuse(call, refused.error)
        return call.finish(result, None).response  # a read: never recorded

    def _refuse(self, call: MeshCall, error: dict[str, Any]) -> dict[str, Any]:
        return call.error(error)

    def capabilities(self) -> dict[str, Any]:
        """The ``capabilities`` result."""
        names = list(self.functions)
        names += [name for name in _BUILT_IN if name not in self.functions]
        return {
            "service": self.service,
            "protocol_versions": list(PROTOCOL_VERSIONS),
            "extensions": [{"urn": URN}],
            "functions": names,
            "limits": {"max_request_bytes": self.max_body},
        }

    def describe(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The ``describe`` result for its ``function``, ``version`` and ``include_schema``."""
        name = _argument(arguments, "function", str, True)
        version = _argument(arguments, "version", str, False)
        _argument(arguments, "include_schema", bool, False)  # no schemas to include
        fn = self.functions.get(name) or _BUILT_IN.get(DISCOVERY_ALIASES.get(name, name))
        if fn is None:
            raise _Refused(
                FUNCTION_NOT_FOUND,
                f"no function {name!r}",
                "/call/arguments/function",
                {"function": name},
            )
        if version is not None and version not in fn.versions:
            raise _Refused(
                VERSION_NOT_FOUND,
                f"{name!r} has no version {version!r}",
                "/call/arguments/version",
                {"function": name, "version": version, "versions": list(fn.versions)},
            )
        return fn.describe(name, version)


def _not_applicable(request: dict[str, Any], function: str) -> dict[str, Any]:
    """The ``EXTENSION_NOT_APPLICABLE`` error for the idempotency extension of ``request``."""
    at = next(i for i, ext in enumerate(request["extensions"]) if ext["urn"] == URN)
    return error_object(
        EXTENSION_NOT_APPLICABLE,
        f"{function!r} does not take the idempotency extension",
        False,
        {"extension": URN, "function": function},
        {"pointer": f"/extensions/{at}"},
    )
