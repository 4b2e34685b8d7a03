"""Recording a handler's outcome once it has run: the one way every front door does it.

The door decides what its answer records; :func:`record` and :func:`arecord` write
it and never raise: the answer goes out even when the store refuses it (down, or
the lease was lost), and :func:`unrecorded` logs that a retry may run it again.
"""

from __future__ import annotations

import logging

from retrysafe._core.engine import Attempt, Claim
from retrysafe._model.record import Outcome
from retrysafe.errors import IdempotencyError

__all__ = ["arecord", "record", "unrecorded"]

log = logging.getLogger("retrysafe.http")

#: What recording may raise that must not reach the client: the store's errors and
#: an outcome the engine cannot keep (it then failed the attempt finally).
_UNRECORDED = (IdempotencyError, ValueError)


def record(
    att: Attempt,
    outcome: Outcome | None,
    *,
    failed: bool = False,
    final: bool | None = None,
    answer: str = "the answer",
) -> None:
    """Complete ``att`` with ``outcome``; fail it instead if ``failed`` or there is no
    outcome (``final``: None for the engine's policy). Never raises for the store.

    ``answer`` names what was not recorded in the log (A2A: the answer to which message).
    """
    try:
        if failed or outcome is None:
            att.fail(outcome, final=final)
        else:
            att.complete(outcome)
    except _UNRECORDED as exc:
        unrecorded(att.claim, exc, answer)


async def arecord(
    att: Attempt,
    outcome: Outcome | None,
    *,
    failed: bool = False,
    final: bool | None = None,
    answer: str = "the answer",
) -> None:
    """Async :func:`record`."""
    try:
        if failed or outcome is None:
            await att.afail(outcome, final=final)
        else:
            await att.acomplete(outcome)
    except _UNRECORDED as exc:
        unrecorded(att.claim, exc, answer)


def unrecorded(claim: Claim | None, exc: Exception, answer: str = "the answer") -> None:
    """The handler ran but its answer could not be recorded: the client still gets it."""
    log.error(
        "retrysafe: %s was sent but not recorded (%s); a retry after the lease "
        "runs out may run the handler again (key_hash=%s)",
        answer,
        exc,
        claim.key_hash[:16] if claim else "-",
    )
