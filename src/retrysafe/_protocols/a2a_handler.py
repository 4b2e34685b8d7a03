"""An a2a-sdk ``RequestHandler`` that runs each message once per ``messageId``.

It wraps the handler an SDK server calls (``DefaultRequestHandler``), so one
layer deduplicates every binding the SDK serves: JSON-RPC v1.0 and its v0.3
compatibility adapter, HTTP+JSON (REST) and gRPC, streaming sends and not.

- A first send runs in a task of its own, recorded when it ends: a client that
  leaves mid-stream does not leave a claim that a retry would run again.
- A repeat after the run ended gets the stored outcome: the Task or Message
  (a stream: one event holding it, a valid stream of either kind, A2A §3.1.2).
- A repeat while the run goes on in this process joins it: a stream resubscribes
  to the running task (the current Task first, §3.1.6), a plain send waits for
  its end; in another process it gets the in-flight error (or waits ``wait``).
- The same messageId with another message is refused before anything runs.

Records are the :class:`~retrysafe.a2a.A2AMiddleware`'s (same key, scope and
fingerprint), so the middleware and this handler replay each other's sends.
Needs the ``a2a-sdk`` package (the ``a2a`` extra).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Mapping,
)
from dataclasses import dataclass, field
from typing import Any, Unpack

from a2a.server.context import ServerCallContext
from a2a.server.request_handlers import RequestHandler
from a2a.types import (
    AgentCard,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    SendMessageRequest,
    SendMessageResponse,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
)
from a2a.utils.errors import (
    JSON_RPC_ERROR_CODE_MAP,
    A2AError,
    InternalError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from google.protobuf.json_format import MessageToDict, ParseDict  # type: ignore[import-untyped]

from retrysafe._core.engine import Attempt, DoorOptions, Engine, door_engine
from retrysafe._core.heartbeat import renewing
from retrysafe._core.metrics import METRICS
from retrysafe._core.principal import Anonymous, Principal, PrincipalFn, Principals, unscoped
from retrysafe._core.recording import arecord
from retrysafe._core.secret import asecret_of, check_secret
from retrysafe._model.hashing import protocol_key
from retrysafe._model.record import Outcome
from retrysafe._protocols.a2a import (
    V10,
    A2AErrorInfo,
    Send,
    error_info,
    error_metadata,
    failed_finally,
    parse_send,
    result_as,
)
from retrysafe.errors import (
    AmbiguousCredentialsError,
    IdempotencyError,
    InProgressError,
    InvalidKeyError,
    PrincipalRequiredError,
)
from retrysafe.stores import Store

__all__ = ["CALLER_STATE", "Caller", "IdempotentRequestHandler", "sdk_error"]

log = logging.getLogger("retrysafe.a2a")

#: What a send's run yields: the SDK's stream events (Task, Message, updates).
Event = Any
#: The key of :class:`Caller` in ``ServerCallContext.state``.
CALLER_STATE = "retrysafe.caller"


@dataclass(frozen=True)
class Caller:
    """Who sent an HTTP request, as :class:`~retrysafe.a2a.IdempotentContextBuilder`
    puts it in the call context: the Starlette user's identity (``asgi_user``, as
    the middleware names it) and the request's raw header lines."""

    user: str | None
    headers: tuple[tuple[str, str], ...]


#: The end of a run's events, on its queue.
_END: Any = object()
#: How many events of a stream wait for its client: the run waits while that many do.
_BACKLOG = 64
#: How many times a repeat joins a run that ended and tries again (each try is one
#: store round trip; a third run in a row would be a new first send each time).
_ROUNDS = 3


# -- errors ---------------------------------------------------------------------------


#: The a2a-sdk error class of each JSON-RPC code (retrysafe's among them).
_BY_CODE: dict[Any, type[A2AError]] = {code: cls for cls, code in JSON_RPC_ERROR_CODE_MAP.items()}


def sdk_error(info: A2AErrorInfo) -> A2AError:
    """The a2a-sdk error that answers as ``info`` does: the SDK serializes it in
    each binding's shape (its ErrorInfo carries ``info.metadata``)."""
    return _BY_CODE[info.code](info.message, data=info.metadata)


def _sdk_error(exc: IdempotencyError) -> A2AError:
    """The a2a-sdk error answering ``exc`` (raises ``exc`` if A2A has none)."""
    return sdk_error(error_info(exc))


def _failed_finally() -> A2AError:
    return sdk_error(failed_finally())


# -- what is stored -------------------------------------------------------------------


def stored_result(result: Task | Message) -> Outcome:
    """The outcome a send's result is stored as: the middleware's v1.0 JSON-RPC
    result, so either door replays it."""
    response = SendMessageResponse(task=result) if isinstance(result, Task) else None
    if response is None:
        response = SendMessageResponse(message=result)
    return Outcome.json({"method": "SendMessage", "result": MessageToDict(response)})


def replayed_result(outcome: Outcome | None) -> Task | Message:
    """The Task or Message stored in ``outcome`` (by this handler or the middleware,
    in either spelling); raises the SDK error of a send that failed finally."""
    stored = outcome.value if outcome is not None else None
    if isinstance(stored, dict) and isinstance(stored.get("result"), dict):
        response = SendMessageResponse()
        ParseDict(result_as(stored["result"], V10), response, ignore_unknown_fields=True)
        if response.HasField("task"):
            return response.task
        if response.HasField("message"):
            return response.message
    if isinstance(stored, dict) and isinstance(stored.get("error"), dict):
        # A JSON-RPC error the middleware stored (final_failures): the SDK class of
        # its code, with what it says of itself, so each binding answers it again.
        error = stored["error"]
        cls = _BY_CODE.get(error.get("code"), InternalError)
        message = str(error.get("message") or "the earlier attempt failed")
        raise cls(message, data=error_metadata(error))
    raise _failed_finally()


# -- a run in this process ------------------------------------------------------------


@dataclass(eq=False)
class _Run:
    """A first send running in this process, which its repeats may join."""

    fingerprint: str
    loop: asyncio.AbstractEventLoop
    #: The task's id once the run has one; None once it ended without one.
    task_id: asyncio.Future[str | None]
    done: asyncio.Event = field(default_factory=asyncio.Event)
    #: The events on their way to the first client (bounded: a slow client slows
    #: the run), then :data:`_END`.
    events: asyncio.Queue[Any] = field(default_factory=lambda: asyncio.Queue(_BACKLOG))
    #: Whether a client reads ``events``; once it left, nothing more is queued.
    listening: bool = True
    #: The last Task or Message seen.
    result: Task | Message | None = None
    #: What a repeat that joined it answers once it ended: the result stored (or
    #: replayed); None if it failed (the repeat then asks the store).
    final: Task | Message | None = None
    #: What ended the run, if it failed.
    error: BaseException | None = None
    #: How many repeats joined it.
    joiners: int = 0

    def saw(self, event: Event) -> None:
        if isinstance(event, Task) and not self.task_id.done():
            self.task_id.set_result(event.id)
        if isinstance(event, (Task, Message)):
            self.result = event

    async def put(self, item: Any) -> None:
        """Queue ``item`` for the client, if one still reads."""
        if self.listening:
            await self.events.put(item)

    def unheard(self) -> None:
        """The client stopped reading: queue nothing more, and free the run if it
        waits on a full queue."""
        self.listening = False
        while not self.events.empty():
            self.events.get_nowait()

    def ended(self) -> None:
        if not self.task_id.done():
            self.task_id.set_result(None)
        self.done.set()


class IdempotentRequestHandler(RequestHandler):
    """``inner`` (an a2a-sdk ``RequestHandler``) with each send run once per ``messageId``.

    ::

        handler = IdempotentRequestHandler(
            DefaultRequestHandler(agent_executor, task_store, agent_card),
            store="redis://localhost:6379/0",
        )
        routes = [*create_jsonrpc_routes(handler, "/"), *create_rest_routes(handler)]

    ``store``, ``ttl``, ``lease``, ``wait``, ``final_failures``, ``operation``,
    ``retention``, ``max_body``: as :class:`~retrysafe.a2a.A2AIdempotency`.
    ``principal`` (a callable over the ``ServerCallContext``, returning a name or
    None), ``principal_headers``, ``principal_cookies``, ``anonymous``: who the
    caller is, by the rules of every door (docs/principals.md): the callable,
    the authenticated user (over HTTP: its Starlette ``identity``, which
    :class:`~retrysafe.a2a.IdempotentContextBuilder` gives the handler; a
    ``User`` of the app's own: its ``user_name``, which must be unique), the
    credentials among the request's headers, else ``anonymous``.
    Every other method is ``inner``'s.
    """

    def __init__(
        self,
        inner: RequestHandler,
        store: Store[Any] | Engine | str | None = None,
        *,
        principal: PrincipalFn | None = None,
        principal_headers: Collection[str] | None = None,
        principal_cookies: Collection[str] | None = None,
        anonymous: Anonymous | None = None,
        final_failures: bool | None = None,
        **options: Unpack[DoorOptions],
    ) -> None:
        self.inner = inner
        self.principals = Principals(
            principal=principal,
            principal_headers=principal_headers,
            principal_cookies=principal_cookies,
            anonymous=anonymous,
        )
        self.engine, self._plan = door_engine(store, "a2a.send", **options)
        check_secret(self.engine.store)
        self.final_failures = final_failures
        self.operation = self._plan.operation
        self._runs: dict[tuple[str, str], _Run] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"<IdempotentRequestHandler inner={self.inner!r} engine={self.engine!r}>"

    # -- the send and its caller -------------------------------------------------------

    def _principal(self, context: ServerCallContext) -> Principal | None:
        return self.principals.identify(
            lambda: context, lambda: _user(context), _headers(context), ""
        )

    async def _send(self, params: SendMessageRequest, context: ServerCallContext) -> Send | None:
        """The send of ``params``, as the middleware keys it; None: an anonymous caller
        that runs without a record. Raises the SDK error refusing it."""
        try:
            key = protocol_key(params.message.message_id)
            who = self._principal(context)
        except (InvalidKeyError, AmbiguousCredentialsError, PrincipalRequiredError) as exc:
            METRICS.refused(self.operation, exc)
            raise _sdk_error(exc) from None
        if who is None:
            unscoped(self.operation)
            return None
        try:
            caller = who.scope(await asecret_of(self.engine.store))
        except IdempotencyError as exc:
            raise _sdk_error(exc) from None
        doc = MessageToDict(params)
        if _tenant(params, context):
            doc["tenant"] = _tenant(params, context)
        # The scope and fingerprint leave the id out; the key is protocol_key's.
        doc.setdefault("message", {})["messageId"] = "-"
        try:
            send = parse_send({"method": "SendMessage", "params": doc}, caller)
        except InvalidKeyError as exc:
            METRICS.refused(self.operation, exc)
            raise _sdk_error(exc) from None
        assert send is not None  # a SendMessage request is a send
        send.key = key
        return send

    async def _claim(self, send: Send) -> Attempt:
        """``send``'s attempt, entered: one store round trip (more only while ``wait``)."""
        plan = self._plan.derive(send.key, send.scope, send.fingerprint)
        att = Attempt(self.engine, plan)
        try:
            return await att.__aenter__()
        except IdempotencyError as exc:
            raise _sdk_error(exc) from None

    # -- the first run ----------------------------------------------------------------

    def _pending(self, send: Send) -> _Run:
        """A run of ``send``, registered before it claims so that repeats in this
        process join it; left unregistered when another run holds the key (another
        message, or another loop's): the store answers it, and that run stays
        joinable."""
        loop = asyncio.get_running_loop()
        run = _Run(send.fingerprint, loop, loop.create_future())
        self._runs.setdefault((send.scope, send.key), run)
        return run

    def _forget(self, send: Send, run: _Run) -> None:
        """``run`` is over: later repeats go to the store."""
        if self._runs.get((send.scope, send.key)) is run:
            del self._runs[send.scope, send.key]
        run.ended()

    async def _begin(self, send: Send) -> tuple[_Run, Attempt | None, Task | Message | None]:
        """Claim ``send`` as a run of this process: ``(run, attempt, None)`` to run it,
        ``(run, None, stored result)`` to replay it. Raises the SDK error refusing it."""
        run = self._pending(send)
        try:
            att = await self._claim(send)
            if att.replay is None:
                return run, att, None
            run.final = replayed_result(att.replay.outcome)
            self._forget(send, run)
            return run, None, run.final
        except BaseException:
            self._forget(send, run)
            raise

    def _start(
        self,
        run: _Run,
        att: Attempt,
        send: Send,
        events: AsyncIterator[Event],
        final: Callable[[_Run], Awaitable[Task | Message | None]],
    ) -> None:
        """Run ``events`` to their end in a task of its own, recording the result."""
        task = run.loop.create_task(self._drive(att, send, run, events, final))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drive(
        self,
        att: Attempt,
        send: Send,
        run: _Run,
        events: AsyncIterator[Event],
        final: Callable[[_Run], Awaitable[Task | Message | None]],
    ) -> None:
        answer = f"the answer to message {send.key!r}"
        try:
            with renewing(att):
                async for event in events:
                    run.saw(event)
                    await run.put(event)
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError  # the SDK's stream ended on our cancel
                result = run.final = await _ended(final, run)
        except BaseException as exc:
            await arecord(att, None, failed=True, final=self.final_failures, answer=answer)
            run.error = exc
            await run.put(_END)
            if not isinstance(exc, Exception):
                raise
        else:
            try:
                outcome = None if result is None else stored_result(result)
            except (TypeError, ValueError):
                outcome = None
            # A run without a result, or one that cannot be stored, ran: never again.
            await arecord(att, outcome, failed=outcome is None, final=True, answer=answer)
            await run.put(_END)
        finally:
            self._forget(send, run)

    # -- sends ------------------------------------------------------------------------

    def _joinable(self, send: Send) -> _Run | None:
        run = self._runs.get((send.scope, send.key))
        if run is None or run.fingerprint != send.fingerprint:
            return None  # another message: the store says conflict
        if run.loop is not asyncio.get_running_loop():
            return None
        return run

    async def on_message_send(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Task | Message:
        send = await self._send(params, context)
        if send is None:
            return await self.inner.on_message_send(params, context)
        for _ in range(_ROUNDS):
            joined = self._joinable(send)
            if joined is not None:
                joined.joiners += 1
                try:  # as long as a repeat may wait, or the run may hold its lease
                    limit = max(self._plan.wait, self._plan.lease)
                    await asyncio.wait_for(joined.done.wait(), limit)
                except TimeoutError:
                    break
                if joined.final is not None:
                    return joined.final
                continue
            run, att, stored = await self._begin(send)
            if att is None:
                assert stored is not None  # a replay holds a Task or a Message
                return stored
            run.unheard()  # the result is read at the end
            self._start(run, att, send, _one(self.inner.on_message_send(params, context)), _last)
            await run.done.wait()
            return _result_of(run)
        raise _sdk_error(InProgressError("the message is still being processed", retry_after=1))

    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event, None]:
        send = await self._send(params, context)
        if send is None:
            async for event in self.inner.on_message_send_stream(params, context):
                yield event
            return
        for _ in range(_ROUNDS):
            joined = self._joinable(send)
            if joined is not None:
                joined.joiners += 1
                # Shielded: a repeat that leaves must not cancel what the others await.
                task_id = await asyncio.shield(joined.task_id)
                if task_id is not None:
                    async for event in self._resubscribe(task_id, params, context):
                        yield event
                        task_id = None  # joined: the stream is the running task's
                    if task_id is None:
                        return
                await joined.done.wait()
                if joined.final is not None:
                    yield joined.final
                    return
                continue
            run, att, stored = await self._begin(send)
            if att is None:
                yield stored
                return
            final = _final_task(self.inner, context, _tenant(params, context))
            self._start(run, att, send, self.inner.on_message_send_stream(params, context), final)
            try:
                while (event := await run.events.get()) is not _END:
                    yield event
            finally:
                run.unheard()
            _raise_failure(run)
            return
        raise _sdk_error(InProgressError("the message is still being processed", retry_after=1))

    async def _resubscribe(
        self, task_id: str, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncIterator[Event]:
        """The running task's events; nothing if it ended before the subscription."""
        request = SubscribeToTaskRequest(id=task_id, tenant=_tenant(params, context))
        try:
            async for event in self.inner.on_subscribe_to_task(request, context):
                yield event
        except (UnsupportedOperationError, TaskNotFoundError):
            return  # terminal already (or gone): the caller replays what was stored

    # -- everything else is the inner handler's ---------------------------------------

    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task | None:
        return await self.inner.on_get_task(params, context)

    async def on_list_tasks(
        self, params: ListTasksRequest, context: ServerCallContext
    ) -> ListTasksResponse:
        return await self.inner.on_list_tasks(params, context)

    async def on_cancel_task(
        self, params: CancelTaskRequest, context: ServerCallContext
    ) -> Task | None:
        return await self.inner.on_cancel_task(params, context)

    async def on_create_task_push_notification_config(
        self, params: TaskPushNotificationConfig, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        return await self.inner.on_create_task_push_notification_config(params, context)

    async def on_get_task_push_notification_config(
        self, params: GetTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        return await self.inner.on_get_task_push_notification_config(params, context)

    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event, None]:
        async for event in self.inner.on_subscribe_to_task(params, context):
            yield event

    async def on_list_task_push_notification_configs(
        self, params: ListTaskPushNotificationConfigsRequest, context: ServerCallContext
    ) -> ListTaskPushNotificationConfigsResponse:
        return await self.inner.on_list_task_push_notification_configs(params, context)

    async def on_delete_task_push_notification_config(
        self, params: DeleteTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> None:
        await self.inner.on_delete_task_push_notification_config(params, context)

    async def on_get_extended_agent_card(
        self, params: GetExtendedAgentCardRequest, context: ServerCallContext
    ) -> AgentCard:
        return await self.inner.on_get_extended_agent_card(params, context)

    async def aclose(self, timeout: float = 30.0) -> None:
        """Let the sends running in this loop end and be recorded (``timeout`` seconds
        at most: then they are cancelled, recorded as failed, and a retry runs them
        again), then close the engine (the inner handler is the caller's). Call it
        in the app's shutdown."""
        loop = asyncio.get_running_loop()
        running = [task for task in self._tasks if task.get_loop() is loop]
        if running:
            _, late = await asyncio.wait(running, timeout=timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self.engine.aclose()


def _tenant(params: SendMessageRequest, context: ServerCallContext) -> str:
    """The send's tenant: the request's, else the call's (REST's ``/{tenant}`` path)."""
    return params.tenant or context.tenant


def _headers(context: ServerCallContext) -> list[tuple[str, str]]:
    """The request's headers (lower-case names): every line of an HTTP request whose
    context :class:`Caller` describes, else those the SDK's HTTP routes put in
    ``state["headers"]`` (one value a name), else a gRPC call's metadata."""
    state = context.state
    caller = state.get(CALLER_STATE)
    if isinstance(caller, Caller):
        return list(caller.headers)
    headers = state.get("headers")
    if isinstance(headers, Mapping):
        items: Iterable[Any] = headers.items()
    else:
        call = state.get("grpc_context")
        items = (call.invocation_metadata() or ()) if call is not None else ()
    return [(str(k).lower(), v) for k, v in items if isinstance(v, str)]


def _user(context: ServerCallContext) -> str | None:
    """The authenticated caller's identity, else None.

    Over HTTP with :class:`Caller` in the context: the Starlette user's identity.
    A Starlette user without it is not used (its ``user_name`` is the display
    name, which two users may share): the credentials decide. Any other A2A
    ``User`` is named by its ``user_name`` (the only name the SDK's ``User`` has,
    and what the SDK scopes task owners by).
    """
    caller = context.state.get(CALLER_STATE)
    if isinstance(caller, Caller):
        return caller.user
    user = context.user
    try:
        if user.is_authenticated is not True:
            return None
        if _display_named(user):
            _warn_display_name()
            return None
        name = user.user_name
    except Exception:  # the server's user class: whatever it raises, never a 500
        return None
    return f"a2a.user:{name}" if isinstance(name, str) and name.strip() else None


def _display_named(user: object) -> bool:
    """Whether ``user`` is the SDK's adapter of a Starlette user (its ``user_name`` is
    the user's ``display_name``); the class exists only once its module is loaded."""
    common = sys.modules.get("a2a.server.routes.common")
    adapter = getattr(common, "StarletteUser", None)
    return isinstance(adapter, type) and isinstance(user, adapter)


@functools.cache
def _warn_display_name() -> None:
    log.warning(
        "retrysafe: an authenticated Starlette user reached IdempotentRequestHandler "
        "without its identity (the SDK passes only its display name, which two users "
        "may share): the request's credentials name the caller instead. Build the "
        "routes with context_builder=IdempotentContextBuilder() (retrysafe.a2a)"
    )


async def _one(result: Awaitable[Task | Message]) -> AsyncIterator[Event]:
    yield await result


async def _last(run: _Run) -> Task | Message | None:
    return run.result


def _final_task(
    inner: RequestHandler, context: ServerCallContext, tenant: str
) -> Callable[[_Run], Awaitable[Task | Message | None]]:
    """A stream's result: its Message, or its task as the task store holds it at the end."""

    async def final(run: _Run) -> Task | Message | None:
        if isinstance(run.result, Message):
            return run.result
        task_id = run.task_id.result() if run.task_id.done() else None
        if task_id is None:
            return None
        found = await inner.on_get_task(GetTaskRequest(id=task_id, tenant=tenant), context)
        return found if found is not None else run.result

    return final


async def _ended(
    final: Callable[[_Run], Awaitable[Task | Message | None]], run: _Run
) -> Task | Message | None:
    """The result of a run whose events all went out: ``final``'s, else (it failed:
    the agent ran all the same) the last Task or Message the run carried."""
    try:
        return await final(run)
    except Exception:
        log.warning(
            "retrysafe: reading the result of a finished send failed; its last Task or "
            "Message is stored instead",
            exc_info=True,
        )
        return run.result


def _raise_failure(run: _Run) -> None:
    """Raise what ended ``run``, if it failed: the agent's error, or an InternalError
    for a run that was cancelled (the handler closing): never a CancelledError in
    the client's own task."""
    if isinstance(run.error, Exception):
        raise run.error
    if run.error is not None:
        raise InternalError("the send was interrupted before it ended: send it again")


def _result_of(run: _Run) -> Task | Message:
    """A plain send's result, or what ended its run."""
    _raise_failure(run)
    if run.result is None:
        raise _failed_finally()
    return run.result
