"""Multi-step operations with recovery points (Stripe's "atomic phases").

The operation is one engine record under its key; each step is another, under
the derived key ``{key}:{step}`` and the operation ``{operation}/{step}`` in the
same scope. A retry runs the body again: finished steps answer from their
records (the step function is not called), the first unfinished one runs with
the same derived key, which the step passes to its downstream API.

Every decision is here once, as plain code in :class:`Run` and :class:`Workflow`
(``_step_attempt``, ``_stored``, ``_replayed``, ``_final``, ``_result``); the
sync and async shells differ only in ``await``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Generator, Iterable
from typing import Any

from retrysafe._core.engine import (
    DEFAULT_LEASE,
    DEFAULT_TTL,
    Attempt,
    Engine,
    Options,
    Plan,
    Replay,
    engine_for,
)
from retrysafe._core.heartbeat import renewing
from retrysafe._decorator import failure_logged
from retrysafe._model.hashing import json_default, key_hash, validate_key
from retrysafe._model.record import JSON_MEDIA_TYPE, Outcome, Record, Status
from retrysafe.errors import InvalidKeyError, LeaseLostError, StepResultError
from retrysafe.stores import Store

__all__ = ["Run", "StepResultError", "Workflow"]

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_JSON = json.JSONEncoder(
    separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=json_default
).encode
#: Step plans kept per workflow (names come from code; dynamic ones beyond this are not cached).
_MAX_PLANS = 1024

Reference = str | Callable[[Any], Any] | None


def _step_name(name: object) -> str:
    if type(name) is not str or not _NAME.fullmatch(name):
        raise InvalidKeyError(
            f"step name {name!r} must be a non-empty str of letters, digits, '_', '.' or '-'"
        )
    return name


def _derived(key: str, name: str) -> str:
    derived = f"{key}:{name}"
    try:
        return validate_key(derived)
    except InvalidKeyError as exc:
        raise InvalidKeyError(f"step {name!r}: derived key: {exc}") from None


def _json(value: Any) -> Any:
    """A value of the stored form: encode, decode (so a first run sees what a replay sees)."""
    return json.loads(_JSON(value))


def _extract(reference: Reference, value: Any) -> str | None:
    if reference is None:
        return None
    ref = reference(value) if callable(reference) else value[reference]
    if ref is None:
        return None
    if isinstance(ref, bool) or not isinstance(ref, (str, int)):
        raise TypeError(f"a reference must be a str or an int, not {type(ref).__name__}")
    return str(ref)


class Run:
    """One attempt at a workflow's body: ``step`` / ``astep`` run or replay each step.

    ``key``, ``scope``: the operation's. ``attempts``: this attempt's number (2+ on
    a retry). ``references``: step name → downstream id of the steps so far.
    """

    def __init__(self, flow: Workflow, key: str, scope: str, fp: str, att: Attempt) -> None:
        self._flow, self.key, self.scope, self._fp = flow, key, scope, fp
        self.attempts = att.claim.attempts if att.claim is not None else 0
        self.references: dict[str, str] = {}
        self._seen: set[str] = set()
        self._watch: renewing | None = None

    def _renewing(self, att: Attempt) -> renewing:
        self._watch = renewing(att, self._flow.renew)
        return self._watch

    def key_for(self, name: str) -> str:
        """The derived key of step ``name`` (what its function gets)."""
        return _derived(self.key, _step_name(name))

    # -- the decisions (no I/O) --------------------------------------------------

    def _step_attempt(self, name: str) -> Attempt:
        """Validate the step and build its attempt (nothing written yet)."""
        derived = self.key_for(name)
        if name in self._seen:
            raise InvalidKeyError(f"step {name!r} appears twice in one run")
        watch = self._watch
        if watch is not None and watch.entry is not None and watch.entry.done:
            # The heartbeat found this run's lease lost: another attempt owns it.
            raise LeaseLostError(
                f"step {name!r} not started: this run's lease ran out", key=self.key
            )
        self._seen.add(name)
        plan = self._flow._plan(name).derive(derived, self.scope, self._fp)
        att = Attempt(self._flow.engine, plan)
        att.final = False  # a step that raises stays retryable, whatever the engine's policy
        return att

    def _replayed(self, name: str, replay: Replay) -> Any:
        outcome = replay.outcome
        if replay.failed or outcome is None:
            raise StepResultError(
                f"step {name!r} failed finally earlier (its result could not be stored); "
                f"reconcile with its derived key {self.key_for(name)!r}",
                step=name,
                derived_key=self.key_for(name),
            )
        stored = outcome.value
        if "reference" in stored:
            self.references[name] = stored["reference"]
        return stored["value"]

    def _stored(self, att: Attempt, name: str, value: Any, reference: Reference) -> Any:
        """Set the step's outcome; its value as stored. Unstorable: final failure."""
        try:
            if inspect.isawaitable(value):
                raise TypeError("the step function returned an awaitable: use astep")
            stored: dict[str, Any] = {"value": _json(value)}
            ref = _extract(reference, value)
            if ref is not None:
                stored["reference"] = ref
            att.outcome = Outcome.json(stored)
        except Exception as exc:  # (a reference callable may raise anything)
            if inspect.iscoroutine(value):  # it never ran: retryable
                value.close()
                raise TypeError(f"step {name!r}: {exc}") from None
            att.final = True
            raise StepResultError(
                f"step {name!r} ran but its result cannot be stored: {exc!r}; the step and "
                f"the operation were marked failed (final) so it is never called again; "
                f"reconcile with its derived key {att._plan.key!r}",
                step=name,
                derived_key=att._plan.key,
            ) from exc
        if ref is not None:
            self.references[name] = ref
        return stored["value"]

    # -- the shells ---------------------------------------------------------------

    def step(self, name: str, fn: Callable[[str], Any], *, reference: Reference = None) -> Any:
        """Run ``fn(derived_key)`` once for this operation; its (JSON) result.

        Finished before: its stored result, ``fn`` not called. ``reference``: a
        field name of the result, or a callable over it, giving the downstream id.
        """
        with self._step_attempt(name) as att:
            if att.replay is not None:
                return self._replayed(name, att.replay)
            with renewing(att, self._flow.renew):
                value = fn(att._plan.key)
            return self._stored(att, name, value, reference)

    async def astep(
        self, name: str, fn: Callable[[str], Awaitable[Any] | Any], *, reference: Reference = None
    ) -> Any:
        """Async :meth:`step`: ``fn`` may be async or not."""
        async with self._step_attempt(name) as att:
            if att.replay is not None:
                return self._replayed(name, att.replay)
            with renewing(att, self._flow.renew):
                value = fn(att._plan.key)
                value = await value if inspect.isawaitable(value) else value
            return self._stored(att, name, value, reference)


class Workflow:
    """An operation made of steps, each recorded as it finishes; see docs/steps.md.

    ``store``: a Store, a URL or an :class:`Engine`. ``operation`` names the
    workflow in every key hash (no ``/``). ``ttl``, ``lease``, ``wait``,
    ``retention``: as for the engine (``wait`` is for a duplicate of the whole
    operation; a step waits up to one lease for a previous owner of that step).
    ``renew``: renew the leases of the body and of each step while they run.
    ``steps``: optional step names, checked now, whose derived keys are checked
    before the operation is claimed and whose references :meth:`references` reads
    for an unfinished operation.
    """

    def __init__(
        self,
        store: Store[Any] | Engine | str | None = None,
        *,
        operation: str,
        ttl: float | None = None,
        lease: float | None = None,
        wait: float | None = None,
        retention: str | None = None,
        renew: bool = True,
        steps: Iterable[str] = (),
    ) -> None:
        if type(operation) is not str or not operation or "/" in operation:
            raise ValueError(f"operation must be a non-empty str without '/', not {operation!r}")
        self.operation, self.renew = operation, bool(renew)
        self.steps = tuple(_step_name(s) for s in steps)
        if len(set(self.steps)) != len(self.steps):
            raise InvalidKeyError(f"steps holds a name twice: {self.steps}")
        options = Options(ttl=ttl, lease=lease, wait=wait, retention=retention)
        self.engine = engine_for(
            store,
            share=True,
            ttl=DEFAULT_TTL if options.ttl is None else options.ttl,
            lease=DEFAULT_LEASE if options.lease is None else options.lease,
        )
        self._options = dataclasses.replace(options, wait=None)  # each step's own wait
        self._parent = Plan.shared(self.engine, operation, options)
        self._plans: dict[str, Plan] = {}

    def __repr__(self) -> str:
        return f"<Workflow {self.operation!r} {self.engine!r}>"

    def _plan(self, name: str) -> Plan:
        plan = self._plans.get(name)
        if plan is None:
            plan = Plan.shared(self.engine, f"{self.operation}/{name}", self._options)
            plan.wait = plan.lease  # a takeover waits out the previous owner of the step
            plan.step = True  # counted as a step, not as a request of its own
            if len(self._plans) < _MAX_PLANS:
                self._plans[name] = plan
        return plan

    # -- the decisions (no I/O) --------------------------------------------------

    def _attempt(self, key: str, scope: str, fp: str, request_id: str | None) -> Attempt:
        validate_key(key)
        if type(scope) is not str or type(fp) is not str:
            raise TypeError("scope and fingerprint must be str")
        if request_id is not None and type(request_id) is not str:
            raise TypeError("request_id must be a str or None")
        for name in self.steps:
            _derived(key, name)
        att = Attempt(self.engine, self._parent.derive(key, scope, fp, request_id))
        att.final = False  # a body that raises leaves the operation retryable
        return att

    @staticmethod
    def _result(replay: Replay) -> Any:
        outcome = replay.outcome
        stored: Any = None if outcome is None else outcome.value
        if replay.failed:
            error = stored.get("error", {}) if isinstance(stored, dict) else {}
            raise StepResultError(
                str(error.get("message", "the operation failed finally")),
                step=str(error.get("step", "")),
                derived_key=str(error.get("derived_key", "")),
            )
        return stored["value"]

    @staticmethod
    def _final(exc: BaseException) -> Outcome | None:
        """The stored final failure for ``exc``, or None: the operation stays retryable."""
        if not isinstance(exc, StepResultError):
            return None
        error = {"message": str(exc), "step": exc.step, "derived_key": exc.derived_key}
        return Outcome.json({"error": error})

    @staticmethod
    def _stored(att: Attempt, run: Run, value: Any) -> Any:
        try:
            stored = {"value": _json(value), "references": run.references}
        except (TypeError, ValueError) as exc:  # every step is recorded: a retry is safe
            raise TypeError(f"the workflow's result cannot be stored: {exc}") from exc
        att.outcome = Outcome.json(stored)
        return stored["value"]

    # -- the shells ---------------------------------------------------------------

    def run(
        self,
        key: str,
        body: Callable[[Run], Any],
        *,
        scope: str = "",
        fingerprint: str = "",
        request_id: str | None = None,
    ) -> Any:
        """Run ``body(run)`` for ``key`` (resuming after its last finished step), or
        replay its stored result. Raises what the engine raises for the key
        (:class:`InProgressError`, :class:`FingerprintMismatchError`, ...)."""
        with self._attempt(key, scope, fingerprint, request_id) as att:
            if att.replay is not None:
                return self._result(att.replay)
            run = Run(self, key, scope, fingerprint, att)
            try:
                with run._renewing(att):
                    value = body(run)
            except BaseException as exc:
                failed = self._final(exc)
                if failed is not None:
                    with failure_logged(exc):
                        att.fail(failed, final=True)
                raise
            return self._stored(att, run, value)

    async def arun(
        self,
        key: str,
        body: Callable[[Run], Awaitable[Any]],
        *,
        scope: str = "",
        fingerprint: str = "",
        request_id: str | None = None,
    ) -> Any:
        """Async :meth:`run`: ``body`` is async and uses ``await run.astep(...)``."""
        async with self._attempt(key, scope, fingerprint, request_id) as att:
            if att.replay is not None:
                return self._result(att.replay)
            run = Run(self, key, scope, fingerprint, att)
            try:
                with run._renewing(att):
                    value = await body(run)
            except BaseException as exc:
                failed = self._final(exc)
                if failed is not None:
                    with failure_logged(exc):
                        await att.afail(failed, final=True)
                raise
            return self._stored(att, run, value)

    def _reads(self, key: str, scope: str) -> Generator[str, Record | None, dict[str, str]]:
        """The reads of :meth:`references`: yields a key hash, is sent its record."""
        validate_key(key)
        now = self.engine.clock()
        parent = _stored_value((yield key_hash(scope, self.operation, key)), now)
        if parent is not None:
            return dict(parent.get("references", {}))
        found: dict[str, str] = {}
        for name in self.steps:
            op = f"{self.operation}/{name}"
            stored = _stored_value((yield key_hash(scope, op, _derived(key, name))), now)
            if stored is not None and stored.get("reference") is not None:
                found[name] = stored["reference"]
        return found

    def references(self, key: str, *, scope: str = "") -> dict[str, str]:
        """Step name → downstream id (gateway transaction id) for reconciliation.

        One store read for a completed operation (its record holds them all); for
        an unfinished one, one more per name in ``steps`` (a finished step's
        record holds its id). Expired records count as absent.
        """
        reads = self._reads(key, scope)
        try:
            wanted = next(reads)
            while True:
                wanted = reads.send(self.engine.store.get(wanted))
        except StopIteration as done:
            return done.value

    async def areferences(self, key: str, *, scope: str = "") -> dict[str, str]:
        """Async :meth:`references`."""
        reads = self._reads(key, scope)
        try:
            wanted = next(reads)
            while True:
                wanted = reads.send(await self.engine.store.aget(wanted))
        except StopIteration as done:
            return done.value


def _stored_value(record: Record | None, now: float) -> Any:
    """What a live completed record of a workflow holds, or None."""
    if record is None or record.expires_at <= now or record.status is not Status.COMPLETED:
        return None
    outcome = record.outcome
    if outcome is None or outcome.media_type != JSON_MEDIA_TYPE:
        return None
    return outcome.value
