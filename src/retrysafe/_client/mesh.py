"""Mesh calls with the idempotency extension, retried safely (the caller's side).

``call()`` builds the request envelope with one key for the whole call and a new
``id`` per attempt (the extension: the id is per attempt, the key per operation), and
the send loop of :class:`~retrysafe.client.Client` retries it. An answer that is
a Mesh envelope is retried by its error codes, whatever its HTTP status
(``IDEMPOTENCY_PROCESSING`` always, ``IDEMPOTENCY_CONFLICT`` never), after its
``details.retry_after``; any other answer as the base client retries it (transport
errors, 5xx); see :func:`retrysafe._client.retry.mesh_retryable`. No ``Idempotency-Key`` header is
sent: the key lives in the envelope, and a header would let an HTTP idempotency
layer in front of the Mesh server (the retrysafe gateway or middleware) compare
the per-attempt bodies, which differ in their ``id``, and refuse every retry as a
conflict.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from retrysafe._client.clients import AsyncClient, Client, _Retrying
from retrysafe._client.keys import new_key
from retrysafe._client.retry import mesh_retryable
from retrysafe._model.hashing import protocol_key
from retrysafe._model.json_text import json_bytes
from retrysafe._protocols.mesh import PROTOCOL, URN

__all__ = ["AsyncMeshClient", "MeshClient"]

#: The ``httpx.Request.extensions`` entry that marks a Mesh call made by ``call()``.
_CALL = "retrysafe.mesh_call"
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


@dataclass(frozen=True, slots=True)
class _Call:
    """A Mesh call's envelope without its ``id``, and its idempotency key (None:
    sent without the extension, and not retried)."""

    envelope: dict[str, Any]
    key: str | None


def _mesh_call(request: httpx.Request) -> _Call | None:
    """The Mesh call that ``call()`` made ``request`` for (None: another request)."""
    call = request.extensions.get(_CALL)
    return call if isinstance(call, _Call) else None


def new_request_id() -> str:
    """A fresh envelope ``id`` for one attempt: ``req_`` and 32 hex digits."""
    return "req_" + uuid.uuid4().hex


def _ttl(ttl: float | Mapping[str, Any]) -> dict[str, Any]:
    """A ``ttl`` option: seconds as ``{"value": n, "unit": "second"}``, or a duration as given."""
    if isinstance(ttl, Mapping):
        return dict(ttl)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise TypeError(f"ttl must be seconds or a {{value, unit}} mapping, not {ttl!r}")
    if not (math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"ttl must be a positive number of seconds, not {ttl!r}")
    return {"value": ttl, "unit": "second"}


def _envelope(
    function: str,
    arguments: Mapping[str, Any],
    version: str | None,
    key: str | None,
    ttl: float | Mapping[str, Any] | None,
    extensions: Iterable[Mapping[str, Any]] | None,
) -> dict[str, Any]:
    """The request envelope without its ``id`` (without the idempotency extension if
    ``key`` is None); raises TypeError or ValueError for bad input."""
    if type(function) is not str or not function:
        raise ValueError(f"function must be a non-empty str, not {function!r}")
    if version is not None and (type(version) is not str or not version):
        raise ValueError(f"version must be a non-empty str or None, not {version!r}")
    if not isinstance(arguments, Mapping):
        raise TypeError(f"arguments must be a mapping, not {type(arguments).__name__}")
    call: dict[str, Any] = {"function": function}
    if version is not None:
        call["version"] = version
    call["arguments"] = dict(arguments)
    others = [dict(ext) for ext in extensions or ()]
    if any(ext.get("urn") == URN for ext in others):
        raise ValueError(f"pass the idempotency options as key= and ttl=, not as {URN}")
    if key is not None:
        options: dict[str, Any] = {"key": key}
        if ttl is not None:
            options["ttl"] = _ttl(ttl)
        others.append({"urn": URN, "options": options})
    envelope = {"protocol": dict(PROTOCOL), "call": call, "extensions": others}
    # A copy as JSON has it: not JSON fails now (TypeError, ValueError), before anything is
    # sent, and every attempt sends these arguments even if the caller changes them.
    return json.loads(_JSON(envelope))


def _answer(response: httpx.Response) -> dict[str, Any]:
    """The response envelope; an answer that is none raises (``HTTPStatusError`` if not 2xx)."""
    try:
        doc = response.json()
    except ValueError:
        doc = None
    if isinstance(doc, dict) and ("result" in doc or "errors" in doc):
        return doc
    response.raise_for_status()
    raise ValueError(f"the Mesh server answered {response.status_code} without an envelope")


class _MeshCalls(_Retrying):
    """What the sync and async Mesh clients share: the request, the attempts, the decision."""

    build_request: Any  # the base client's

    def _mesh_request(
        self,
        url: httpx.URL | str,
        function: str,
        arguments: Mapping[str, Any],
        version: str | None,
        key: str | None,
        ttl: float | Mapping[str, Any] | None,
        extensions: Iterable[Mapping[str, Any]] | None,
        idempotent: bool = True,
    ) -> httpx.Request:
        """The request that ``send`` turns into one request per attempt (its own ``id``)."""
        if not idempotent:
            if key is not None or ttl is not None:
                raise ValueError(
                    "key= and ttl= are the idempotency extension's: not with idempotent=False"
                )
        elif key is None:
            key = new_key(self.retry.key_version)
        else:
            protocol_key(key)  # any string of 1-1024 characters, as the server takes it
        envelope = _envelope(function, arguments, version, key, ttl, extensions)
        headers = {"content-type": "application/json", "accept": "application/json"}
        return self.build_request(
            "POST", url, headers=headers, extensions={_CALL: _Call(envelope, key)}
        )

    def _prepare(self, request: httpx.Request) -> tuple[str | None, bool]:
        """A Mesh call: its envelope's key, no header, always retryable (the key makes it safe)."""
        call = _mesh_call(request)
        if call is None:
            return super()._prepare(request)
        return call.key, call.key is not None

    def _for_attempt(self, request: httpx.Request, attempt: int) -> httpx.Request:
        """A Mesh call's attempt: the envelope with a new ``id``."""
        call = _mesh_call(request)
        if call is None:
            return request
        envelope = {**call.envelope, "id": new_request_id()}
        body = json_bytes(envelope)  # a lone surrogate (a key may be any string): \u escapes
        headers = request.headers.copy()
        headers.pop("content-length", None)
        return httpx.Request(
            request.method,
            request.url,
            headers=headers,
            content=body,
            extensions=request.extensions,
        )

    def _retryable(self, outcome: httpx.Response | BaseException) -> bool:
        """A Mesh call's answer: :func:`mesh_retryable`; any other: the base client's rule."""
        if isinstance(outcome, httpx.Response) and _mesh_call(outcome.request) is not None:
            return mesh_retryable(outcome)
        return super()._retryable(outcome)


class MeshClient(_MeshCalls, Client):
    """A :class:`~retrysafe.client.Client` that makes Mesh calls exactly once.

    ``call()`` sends a Mesh request with the idempotency extension and retries it
    with the same key until the answer is final or the policy is spent. Every
    other method (``post``, ``stream``, ...) is the base client's, unchanged.
    """

    def call(
        self,
        url: httpx.URL | str,
        function: str,
        arguments: Mapping[str, Any],
        *,
        version: str | None = None,
        key: str | None = None,
        ttl: float | Mapping[str, Any] | None = None,
        extensions: Iterable[Mapping[str, Any]] | None = None,
        idempotent: bool = True,
    ) -> dict[str, Any]:
        """POST a Mesh call of ``function`` and return the response envelope.

        ``key`` is the idempotency key (a new UUID by default; any string of
        1-1024 characters, else :class:`~retrysafe.InvalidKeyError`), the same on
        every attempt; ``ttl`` how long the server should keep the answer
        (seconds, or a ``{"value", "unit"}`` duration); ``extensions`` other
        extension objects to send. ``idempotent=False`` sends the call without
        the idempotency extension (a function that opted out of it, see
        :class:`retrysafe.mesh.MeshFunction`), once: it is never retried. The
        answer is the last envelope, a
        retryable error included once the policy is spent; a transport error
        is raised, as is ``httpx.HTTPStatusError`` for a non-2xx answer that is
        not a Mesh envelope.
        """
        request = self._mesh_request(
            url, function, arguments, version, key, ttl, extensions, idempotent
        )
        return _answer(self.send(request))


class AsyncMeshClient(_MeshCalls, AsyncClient):
    """The async :class:`MeshClient`: ``await client.call(...)``."""

    async def call(
        self,
        url: httpx.URL | str,
        function: str,
        arguments: Mapping[str, Any],
        *,
        version: str | None = None,
        key: str | None = None,
        ttl: float | Mapping[str, Any] | None = None,
        extensions: Iterable[Mapping[str, Any]] | None = None,
        idempotent: bool = True,
    ) -> dict[str, Any]:
        """:meth:`MeshClient.call`, awaited."""
        request = self._mesh_request(
            url, function, arguments, version, key, ttl, extensions, idempotent
        )
        return _answer(await self.send(request))
