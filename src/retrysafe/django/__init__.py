"""Idempotency for Django, configured from ``settings.RETRYSAFE``.

::

    # settings.py
    MIDDLEWARE = [
        "django.middleware.security.SecurityMiddleware",
        "retrysafe.django.IdempotencyMiddleware",
        # ...
    ]
    RETRYSAFE = {
        "store": "redis://localhost:6379/0",   # default: $RETRYSAFE_STORE, else SQLite
        "require_key": True,
        "ttl": 24 * 3600,
    }

``RETRYSAFE`` holds the keyword options of
:class:`retrysafe.asgi.IdempotencyMiddleware` (the same names everywhere);
``principal``, ``require_key`` and ``key_format`` may be dotted paths of
callables. An authenticated ``request.user`` names the caller (by its model
and primary key), so the middleware must come after Django's
``AuthenticationMiddleware``: it says so with ``ImproperlyConfigured``
otherwise. An unknown
name or a bad value is an ``ImproperlyConfigured`` error when Django loads its
middleware. The middleware runs sync under WSGI and async under
ASGI, whichever the chain around it is; ``HttpResponse`` and
``StreamingHttpResponse`` answers (sync or async content) are recorded.

With a ``django://`` store (:class:`DjangoStore`, records in Django's own
database; add ``"retrysafe.django"`` to ``INSTALLED_APPS`` and migrate), a keyed
request's view runs inside ``transaction.atomic(using=alias)`` and its answer is
recorded in that transaction: the view's ORM writes and the completed record
commit together or not at all (``"transactional": False`` turns it off).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

from asgiref.sync import async_to_sync, iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured, RequestDataTooBig
from django.db import connections
from django.http import HttpRequest as DjangoRequest
from django.http import HttpResponse
from django.http.response import HttpResponseBase
from django.utils.functional import SimpleLazyObject, empty
from django.utils.module_loading import import_string

from retrysafe._core.engine import Attempt
from retrysafe._http.flow import (
    Answer,
    Exchange,
    Held,
    PrepareFlow,
    Stream,
    aenter,
    arun_prepare,
    astream,
    enter,
    prepare,
    run_prepare,
)
from retrysafe._http.policy import HttpPolicy
from retrysafe._http.problems import Response, problem, retry_after_header
from retrysafe._http.request import Headers, HttpRequest
from retrysafe.errors import BodyError, LeaseLostError, StoreUnavailableError
from retrysafe.stores.django import DjangoStore, ViewBlock

__all__ = ["DjangoStore", "IdempotencyMiddleware"]

GetResponse = Callable[[DjangoRequest], Any]  # a response, or an awaitable of one

#: The option names ``settings.RETRYSAFE`` may hold.
OPTIONS = tuple(inspect.signature(HttpPolicy).parameters)
#: The Django middleware's own option: complete inside the view's transaction (None: when
#: the store is a ``django://`` one).
TRANSACTIONAL = "transactional"
#: Options that may also be given as the dotted path of a callable.
_CALLABLES = ("principal", "scope", "require_key", "key_format")
_AUTH = "django.contrib.auth.middleware.AuthenticationMiddleware"


class IdempotencyMiddleware:
    """Run each keyed request once; answer its retries with the stored response.

    Options come from ``settings.RETRYSAFE`` (read once, when Django loads its
    middleware); keyword ``options`` given here take precedence. ``transactional``
    (default: True with a ``django://`` store, else False) runs a keyed request's
    view in ``transaction.atomic(using=alias)`` and completes its record there.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: GetResponse, **options: Any) -> None:
        self.get_response = get_response
        _check_order(type(self))
        self.policy, transactional = _policy(options)
        #: The database alias whose transaction a keyed request's view runs in, or None.
        self.alias = _alias(self.policy, transactional)
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: DjangoRequest) -> Any:  # a response, or a coroutine of one
        if self.is_async:
            return self.__acall__(request)
        preparing = self._prepare(request, lambda: _user(request))
        step = None if preparing is None else run_prepare(preparing)
        if not isinstance(step, tuple):
            return self.get_response(request) if step is None else _answer(step)
        policy, attempt = step
        held = enter(policy, attempt)
        if held is None:  # the store is down and fail_mode="open"
            return self.get_response(request)
        if isinstance(held, Response):
            return _answer(held)
        if self.alias is not None:
            return self._atomic(request, policy, held, self.alias)
        try:
            response = self.get_response(request)
        except BaseException as exc:  # the attempt fails (retryable)
            held.leave(exc)
            raise
        exchange = _exchange(policy, held.att, held, response)
        if response.streaming:
            _stream(response, exchange)
        else:
            exchange.finish()
        return response

    async def __acall__(self, request: DjangoRequest) -> HttpResponseBase:
        preparing = self._prepare(request)
        step = None if preparing is None else await arun_prepare(preparing, lambda: _auser(request))
        if not isinstance(step, tuple):
            return await self.get_response(request) if step is None else _answer(step)
        policy, attempt = step
        alias = self.alias
        try:
            async with AsyncExitStack() as stack:
                att = await aenter(policy, stack, attempt)
                if att is None:
                    return await self.get_response(request)
                if isinstance(att, Response):
                    return _answer(att)
                if alias is None:
                    response = await self.get_response(request)
                    exchange: Exchange | None = _exchange(policy, att, stack, response)
                else:  # in the request's sync thread (Django's thread-sensitive one), where
                    # a sync view and an async view's ORM calls run: the same transaction
                    view = partial(async_to_sync(self.get_response), request)
                    atomic = sync_to_async(_atomic_view, thread_sensitive=True)
                    response, exchange = await atomic(alias, policy, att, stack, view)
                if exchange is not None:
                    exchange.stack = held = stack.pop_all()
        except (LeaseLostError, StoreUnavailableError) as exc:
            if alias is None:  # (the view's own)
                raise
            return _answer(_rolled_back(exc))  # the attempt failed; everything rolled back
        except _MarkedForRollback as exc:  # (the attempt failed, retryable)
            return exc.answer()
        if exchange is None:  # completed in the view's transaction
            return response
        if response.streaming:
            return _astream(response, exchange, held)
        await exchange.afinish()
        return response

    # -- completion inside the view's transaction (a django:// store) ------------------

    def _atomic(
        self, request: DjangoRequest, policy: HttpPolicy, held: Held, alias: str
    ) -> HttpResponseBase:
        """The sync chain in ``atomic(using=alias)``, the record completed in it."""
        try:
            response, exchange = _atomic_view(
                alias, policy, held.att, held, partial(self.get_response, request)
            )
        except (LeaseLostError, StoreUnavailableError) as exc:  # everything rolled back
            held.leave(exc)
            return _answer(_rolled_back(exc))
        except _MarkedForRollback as exc:
            held.leave(exc)
            return exc.answer()
        except BaseException as exc:
            held.leave(exc)
            raise
        if exchange is None:  # completed and committed
            held.leave()
        elif response.streaming:
            _stream(response, exchange)
        else:  # a failure: the view's writes rolled back
            exchange.finish()
        return response

    def _prepare(
        self, request: DjangoRequest, user: Callable[[], str | None] | None = None
    ) -> PrepareFlow | None:
        """The :func:`~retrysafe._http.flow.prepare` flow of a protected request, else None
        (``user``: the sync reader of ``request.user``; without it the flow asks for it)."""
        method = request.method or ""
        policy = self.policy.select(method, request.path)
        if policy is None:
            return None

        def http_request() -> HttpRequest:
            return HttpRequest(
                method,
                request.path,
                request.META.get("QUERY_STRING", ""),
                Headers(request.headers.items()),
                request,
            )

        return prepare(
            policy, request.META, method, request.path, lambda: _body(request), http_request, user
        )


def _exchange(
    policy: HttpPolicy, att: Attempt, stack: Held | AsyncExitStack, response: Any
) -> Exchange:
    """The exchange that records ``response`` (its content taken, unless it streams)."""
    exchange = Exchange(policy, att, stack, _answer_of(response))
    if not response.streaming:
        exchange.push(response.content)
    return exchange


class _Leave(Exception):
    """Leaves the view's transaction without completing the record."""


def _atomic_view(
    alias: str,
    policy: HttpPolicy,
    att: Attempt,
    stack: Held | AsyncExitStack,
    view: Callable[[], HttpResponseBase],
) -> tuple[HttpResponseBase, Exchange | None]:
    """Run ``view`` in ``att.transaction()`` (``transaction.atomic(using=alias)``, the
    outermost one) and complete ``att`` in it: the view's writes and the completion
    commit together, and ``att`` is settled only once that COMMIT succeeded (a failed
    COMMIT raises, and the attempt fails as when the view raises).

    Returns the response, and the exchange still to record unless the record was
    completed: a failure (a 5xx answer, or one that records nothing; the view's
    writes were rolled back) or a streamed answer (its writes committed when the
    view returned; the answer is recorded as it streams, as without a transaction).
    A lost lease or an unreachable store raises, after rolling everything back.
    """
    block = ViewBlock(alias)
    try:
        with att.transaction(block):
            response = view()
            if connections[alias].needs_rollback:  # Django rolls back, without an error
                raise _MarkedForRollback(response)
            exchange = _exchange(policy, att, stack, response)
            if response.streaming:
                block.commit = True
                raise _Leave
            failed, kept, _ = exchange.recorded()
            if failed or kept is None:
                raise _Leave  # rolls the view's writes back
            att.outcome = kept  # completed by the transaction's last statement
    except _Leave:
        return response, exchange
    except BaseException:
        if block.committed:  # an on_commit hook of the view's raised after the COMMIT
            att.finished = True  # (completed with the writes: never failed now)
        raise
    return response, None


class _MarkedForRollback(Exception):
    """The view's transaction was marked for rollback (``transaction.set_rollback(True)``,
    an error caught around an inner ``atomic()``, DRF's handled exceptions under
    ``ATOMIC_REQUESTS``): nothing committed, the attempt fails (retryable)."""

    def __init__(self, response: HttpResponseBase) -> None:
        super().__init__("the view's transaction was marked for rollback")
        self.response = response

    def answer(self) -> HttpResponseBase:
        """The view's own answer if it reports an error (4xx, 5xx), else a 500 saying that
        nothing was committed (never a success that was rolled back)."""
        if self.response.status_code >= 400:
            return self.response
        self.response.close()
        return _answer(
            problem(
                500,
                "idempotency_rolled_back",
                "the view's transaction was marked for rollback "
                "(transaction.set_rollback(True), or an error caught inside atomic()); "
                "nothing was committed: retry with the same key",
            )
        )


def _rolled_back(exc: LeaseLostError | StoreUnavailableError) -> Response:
    """The answer when the view's writes were rolled back with its completion."""
    if isinstance(exc, LeaseLostError):
        return problem(
            409,
            exc.code,
            "another attempt took this request over while it ran; its writes were rolled "
            "back: retry with the same key to get that attempt's answer",
            headers=[retry_after_header(1)],
        )
    return problem(
        503,
        "idempotency_store_unavailable",
        "the idempotency record could not be written; nothing was committed: retry with the "
        "same key",
        headers=[retry_after_header(exc.retry_after or 1)],
    )


def _astream(response: Any, exchange: Exchange, held: AsyncExitStack) -> HttpResponseBase:
    """Record an async streamed answer before its last chunk leaves."""
    chunks = response.streaming_content
    if not response.is_async:
        chunks = _from_sync(chunks)
    # The view's resources (Django closes them first) close once the answer is recorded.
    held.push_async_callback(sync_to_async(response.close, thread_sensitive=True))
    response.close = _closed
    response.streaming_content = astream(exchange, chunks)
    return response


def _alias(policy: HttpPolicy, transactional: bool | None) -> str | None:
    """The alias a keyed request's view runs in a transaction of, or None."""
    store = policy.engine.store
    if isinstance(store, DjangoStore):
        return None if transactional is False else store.alias
    if transactional:
        raise ImproperlyConfigured(
            "settings.RETRYSAFE: transactional=True needs a django:// store (the records in "
            f"the database the views write to), not {type(store).__name__}"
        )
    return None


def _check_order(middleware: type) -> None:
    """ImproperlyConfigured if ``settings.MIDDLEWARE`` puts this middleware before
    Django's ``AuthenticationMiddleware``: ``request.user`` would not be known yet,
    and a token refresh of one user would run a request twice."""
    listed = list(getattr(settings, "MIDDLEWARE", None) or ())
    mine = auth = None
    for i, path in enumerate(listed):
        try:
            cls = import_string(path)
        except ImportError:
            continue
        if not isinstance(cls, type):
            continue
        if mine is None and issubclass(cls, middleware):
            mine = i
        elif path == _AUTH or any(f"{c.__module__}.{c.__qualname__}" == _AUTH for c in cls.__mro__):
            auth = i
    if mine is not None and auth is not None and auth > mine:
        raise ImproperlyConfigured(
            f"settings.MIDDLEWARE lists {listed[mine]} before {listed[auth]}: move the "
            "idempotency middleware after it, so that request.user names the caller "
            "(otherwise a user whose token is refreshed would run a request twice)"
        )


def _identity(user: Any) -> str | None:
    """An authenticated user as its model label and primary key, else None."""
    if user is None or getattr(user, "is_authenticated", False) is not True:
        return None
    pk = getattr(user, "pk", None)
    if pk is None:
        return None
    meta = getattr(user, "_meta", None)
    label = meta.label_lower if meta is not None else type(user).__qualname__
    return f"{label}:{pk}"


def _user(request: DjangoRequest) -> str | None:
    """The identity of ``request.user`` (set by ``AuthenticationMiddleware``), else None."""
    return _identity(getattr(request, "user", None))


async def _auser(request: DjangoRequest) -> str | None:
    """Async :func:`_user`, the same user without a blocking query on the event loop.

    ``request.user`` as it stands wins, as under WSGI: a user another middleware
    set, or the lazy one once read. Still lazy, it is read with ``request.auser()``
    (the session, read without blocking), else in Django's sync thread.
    """
    user = request.__dict__.get("user")
    if user is None:
        return None
    if isinstance(user, SimpleLazyObject) and user._wrapped is empty:
        auser = request.__dict__.get("auser")
        if auser is not None:
            return _identity(await auser())
        return await sync_to_async(_user, thread_sensitive=True)(request)
    return _identity(user)


def _policy(overrides: Mapping[str, Any]) -> tuple[HttpPolicy, bool | None]:
    """The policy of ``settings.RETRYSAFE`` (with ``overrides``) and its ``transactional``
    option, or ImproperlyConfigured."""
    configured = getattr(settings, "RETRYSAFE", None) or {}
    if not isinstance(configured, Mapping):
        raise ImproperlyConfigured(
            "settings.RETRYSAFE must be a dict of retrysafe.django.IdempotencyMiddleware "
            f"options, not {type(configured).__name__}"
        )
    options = {**configured, **overrides}
    transactional = options.pop(TRANSACTIONAL, None)
    if transactional is not None and not isinstance(transactional, bool):
        raise ImproperlyConfigured(
            f"settings.RETRYSAFE: transactional must be True or False, not {transactional!r}"
        )
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ImproperlyConfigured(
            f"settings.RETRYSAFE has unknown option(s) {', '.join(map(repr, unknown))}; "
            f"the options are {', '.join(OPTIONS)}, {TRANSACTIONAL}"
        )
    for name in _CALLABLES:  # a dotted path: settings.py need not import the app's code
        path = options.get(name)
        if isinstance(path, str):
            try:
                options[name] = import_string(path)
            except ImportError as exc:
                raise ImproperlyConfigured(
                    f"settings.RETRYSAFE: {name} {path!r} is not the dotted path of a callable: "
                    f"{exc}"
                ) from exc
    try:
        return HttpPolicy(**options), transactional
    except (TypeError, ValueError, OSError) as exc:  # OSError: a map file that cannot be read
        raise ImproperlyConfigured(f"settings.RETRYSAFE: {exc}") from exc


def _body(request: DjangoRequest) -> bytes:
    try:
        return request.body
    except RequestDataTooBig as exc:  # over settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        raise BodyError(str(exc), status=413, code="idempotency_body_too_large") from None


def _answer_of(response: HttpResponseBase) -> Answer:
    """The response's status and headers, cookies included, when it is recorded."""

    def answer() -> tuple[int, list[tuple[str, str]]]:
        headers = list(response.items())
        cookies = response.cookies
        if cookies:  # (most answers set none)
            headers.extend(
                ("Set-Cookie", morsel.output(header="").strip()) for morsel in cookies.values()
            )
        return response.status_code, headers

    return answer


def _answer(answer: Response) -> HttpResponse:
    """A replay or problem as a Django response: exactly its status, headers and body."""
    joined: dict[str, tuple[str, str]] = {}  # lower-case name: (name, the values joined)
    cookies = []
    for name, value in answer.headers:
        low = name.lower()
        if low == "set-cookie":  # stored only when store_headers allows it
            cookies.append(value)
        elif low in joined:
            first, before = joined[low]
            joined[low] = (first, f"{before}, {value}")
        else:
            joined[low] = (name, value)
    response = HttpResponse(answer.body, status=answer.status, headers=dict(joined.values()))
    if "content-type" not in joined:  # only the answer's own headers describe its body
        del response["Content-Type"]
    for cookie in cookies:
        response.cookies.load(cookie)
    return response


def _stream(response: Any, exchange: Exchange) -> None:
    """Record a sync streamed answer before its last chunk leaves."""
    stream = Stream(exchange, iter(response))
    # The view's resources (Django closes them first) close once the answer is recorded.
    exchange.stack.callback(response.close)
    response.streaming_content = stream
    response.close = stream.close


def _closed() -> None:
    """``close()`` of a response whose resources close with its recording."""


async def _from_sync(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """A sync streamed body under ASGI, read a chunk at a time in Django's sync thread."""
    step = sync_to_async(_next_chunk, thread_sensitive=True)
    while (chunk := await step(chunks)) is not None:
        yield chunk


def _next_chunk(chunks: Iterator[bytes]) -> bytes | None:
    return next(chunks, None)
