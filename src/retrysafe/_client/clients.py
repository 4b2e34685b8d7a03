"""httpx clients that add idempotency keys to writes and retry them safely.

:class:`Client` and :class:`AsyncClient` subclass ``httpx.Client`` and
``httpx.AsyncClient``; the same key is sent on every retry of one call.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeGuard

import httpx

from retrysafe._client.keys import new_key
from retrysafe._client.retry import RetryPolicy, decide, is_replayable, retryable

__all__ = ["AsyncClient", "Client", "was_replayed"]

log = logging.getLogger("retrysafe.client")
_KEY_HEADERS = ("Idempotency-Key", "X-Idempotency-Key")  # a caller's key in either is kept


def was_replayed(response: httpx.Response) -> bool:
    """Whether the server answered from its store (``Idempotent-Replayed: true``)."""
    return response.headers.get("idempotent-replayed", "").strip().lower() == "true"


class _Retrying:
    """What the sync and async clients share: the key and the bookkeeping of a call."""

    retry: RetryPolicy
    key_header: str

    def _setup(self, retry: RetryPolicy | None, key_header: str) -> None:
        self.retry = retry if retry is not None else RetryPolicy()
        self.key_header = key_header

    def _prepare(self, request: httpx.Request) -> tuple[str | None, bool]:
        """The call's key (added if missing), and whether it may be retried at all."""
        if request.method.upper() not in self.retry.retry_methods:
            return None, False
        key = next(
            (request.headers[h] for h in (self.key_header, *_KEY_HEADERS) if h in request.headers),
            None,
        )
        if key is None:
            key = new_key(self.retry.key_version)
            request.headers[self.key_header] = key
        if not is_replayable(request):
            log.debug(
                "retrysafe: %s %s has a streamed body: sent once, not retried",
                request.method,
                _where(request),
            )
            return key, False
        return key, True

    def _for_attempt(self, request: httpx.Request, attempt: int) -> httpx.Request:
        """The request to send as attempt ``attempt`` (from 1): ``request`` itself.

        A subclass may build a new one per attempt (a Mesh call's ``id``).
        """
        return request

    def _retryable(self, outcome: httpx.Response | BaseException) -> bool:
        """Whether an answer may be retried at all; a subclass may widen it."""
        return retryable(outcome)

    def _log(self, request: httpx.Request, key: str | None, attempt: int) -> None:
        log.debug(
            "retrysafe: %s %s key=%s attempt=%d", request.method, _where(request), key, attempt
        )

    def _outcome(
        self,
        request: httpx.Request,
        key: str | None,
        attempt: int,
        outcome: httpx.Response | BaseException,
        started: float,
        may_retry: bool,
    ) -> float | None:
        """Seconds to wait before the next attempt, or None: ``outcome`` is the answer."""
        if not may_retry or (isinstance(outcome, httpx.Response) and not self._retryable(outcome)):
            return None
        elapsed = self.retry.clock() - started
        wait = decide(
            attempt, outcome, self.retry, elapsed, self.retry.wall(), retryable=self._retryable
        )
        what = (
            f"{type(outcome).__name__}"
            if isinstance(outcome, BaseException)
            else (str(outcome.status_code))
        )
        if wait is not None:
            log.debug(
                "retrysafe: %s %s key=%s attempt=%d got %s; retrying in %.3fs",
                request.method,
                _where(request),
                key,
                attempt,
                what,
                wait,
            )
        return wait


#: Answers whose body ``decide`` may read (a problem code, Mesh's ``retry_after``).
_READ_BODY = frozenset({409, 429, 500, 502, 503, 504})


def _read_first(
    outcome: httpx.Response | BaseException, may_retry: bool
) -> TypeGuard[httpx.Response]:
    """Whether a (streamed) answer must be read before the retry decision."""
    return may_retry and isinstance(outcome, httpx.Response) and outcome.status_code in _READ_BODY


def _answer(outcome: httpx.Response | BaseException) -> httpx.Response:
    """The call's final answer: the response, or its error raised."""
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def _where(request: httpx.Request) -> str:
    url = request.url
    return f"{url.scheme}://{url.netloc.decode('ascii', 'replace')}{url.path}"


class Client(_Retrying, httpx.Client):
    """An ``httpx.Client`` that adds idempotency keys to writes and retries them safely.

    ``retry`` is the :class:`RetryPolicy` (the default one if None);
    ``key_header`` the header that carries the key. Every other argument is httpx's.
    The answer is the last response, or the last error is raised.
    """

    def __init__(
        self,
        *,
        retry: RetryPolicy | None = None,
        key_header: str = "Idempotency-Key",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._setup(retry, key_header)

    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        key, may_retry = self._prepare(request)
        started = self.retry.clock()
        attempt = 0
        while True:
            attempt += 1
            sent = self._for_attempt(request, attempt)
            self._log(sent, key, attempt)
            outcome: httpx.Response | BaseException
            try:
                outcome = super().send(sent, **kwargs)
            except httpx.TransportError as exc:
                outcome = exc
            if _read_first(outcome, may_retry):
                outcome.read()
            wait = self._outcome(sent, key, attempt, outcome, started, may_retry)
            if wait is None:
                return _answer(outcome)
            if isinstance(outcome, httpx.Response):
                outcome.close()
            self.retry.sleep(wait)


class AsyncClient(_Retrying, httpx.AsyncClient):
    """An ``httpx.AsyncClient`` that adds idempotency keys to writes and retries them safely.

    The same options and behaviour as :class:`Client`; waits use
    ``policy.asleep`` if set, else ``asyncio.sleep``.
    """

    def __init__(
        self,
        *,
        retry: RetryPolicy | None = None,
        key_header: str = "Idempotency-Key",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._setup(retry, key_header)

    async def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        import asyncio

        key, may_retry = self._prepare(request)
        started = self.retry.clock()
        attempt = 0
        while True:
            attempt += 1
            sent = self._for_attempt(request, attempt)
            self._log(sent, key, attempt)
            outcome: httpx.Response | BaseException
            try:
                outcome = await super().send(sent, **kwargs)
            except httpx.TransportError as exc:
                outcome = exc
            if _read_first(outcome, may_retry):
                await outcome.aread()  # the problem code is in it
            wait = self._outcome(sent, key, attempt, outcome, started, may_retry)
            if wait is None:
                return _answer(outcome)
            if isinstance(outcome, httpx.Response):
                await outcome.aclose()
            sleep: Callable[[float], Awaitable[object]] = self.retry.asleep or asyncio.sleep
            await sleep(wait)
