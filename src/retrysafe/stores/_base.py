"""The Store protocol: the seam between the engine and a server.

Each operation is one round trip. A concrete store describes an operation once,
as an *op* (its own opaque value: a closure, a script call, a SQL statement),
and supplies two executors, ``_run`` and ``_arun``; the sync and async methods
below are shared by every store, so no store writes its logic twice.
"""

from __future__ import annotations

import abc
from typing import Any, Generic, TypeVar

from .._record import ClaimResult, Outcome, Record

__all__ = ["Store"]

OpT = TypeVar("OpT")


class Store(abc.ABC, Generic[OpT]):
    """Where records live. Sync and async methods are equals.

    * ``claim(record)``: atomically write ``record`` (status processing) if the
      key is claimable (see :func:`retrysafe._decide.claimable`), else return
      the live record. Taking over a live record keeps its ``created_at`` and
      counts ``attempts`` on; the result carries the new attempt number.
    * ``complete`` / ``fail`` / ``renew``: compare-and-set on the fencing
      token of a processing record; ``False`` when the token no longer owns it.
    * ``get`` / ``delete``: read or remove one record by key hash.

    Errors reaching the server raise :class:`~retrysafe.StoreUnavailableError`
    and leave nothing half-written.
    """

    url: str = ""

    # -- what each store defines -------------------------------------------------

    @abc.abstractmethod
    def _claim(self, record: Record) -> OpT: ...

    @abc.abstractmethod
    def _complete(self, key_hash: str, token: str, outcome: Outcome, now: float) -> OpT: ...

    @abc.abstractmethod
    def _fail(
        self, key_hash: str, token: str, outcome: Outcome | None, final: bool, now: float
    ) -> OpT: ...

    @abc.abstractmethod
    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> OpT: ...

    @abc.abstractmethod
    def _get(self, key_hash: str) -> OpT: ...

    @abc.abstractmethod
    def _delete(self, key_hash: str) -> OpT: ...

    @abc.abstractmethod
    def _run(self, op: OpT) -> Any:
        """Execute one op synchronously."""

    @abc.abstractmethod
    async def _arun(self, op: OpT) -> Any:
        """Execute one op from a coroutine."""

    def close(self) -> None:
        """Release connections (the store reconnects if used again)."""

    async def aclose(self) -> None:
        """Release connections from a coroutine."""
        self.close()

    # -- the shared protocol ---------------------------------------------------

    def claim(self, record: Record) -> ClaimResult:
        return self._run(self._claim(record))

    async def aclaim(self, record: Record) -> ClaimResult:
        return await self._arun(self._claim(record))

    def complete(self, key_hash: str, token: str, outcome: Outcome, now: float) -> bool:
        return self._run(self._complete(key_hash, token, outcome, now))

    async def acomplete(self, key_hash: str, token: str, outcome: Outcome, now: float) -> bool:
        return await self._arun(self._complete(key_hash, token, outcome, now))

    def fail(
        self, key_hash: str, token: str, outcome: Outcome | None, final: bool, now: float
    ) -> bool:
        return self._run(self._fail(key_hash, token, outcome, final, now))

    async def afail(
        self, key_hash: str, token: str, outcome: Outcome | None, final: bool, now: float
    ) -> bool:
        return await self._arun(self._fail(key_hash, token, outcome, final, now))

    def renew(self, key_hash: str, token: str, lease_until: float, now: float) -> bool:
        return self._run(self._renew(key_hash, token, lease_until, now))

    async def arenew(self, key_hash: str, token: str, lease_until: float, now: float) -> bool:
        return await self._arun(self._renew(key_hash, token, lease_until, now))

    def get(self, key_hash: str) -> Record | None:
        return self._run(self._get(key_hash))

    async def aget(self, key_hash: str) -> Record | None:
        return await self._arun(self._get(key_hash))

    def delete(self, key_hash: str) -> bool:
        return self._run(self._delete(key_hash))

    async def adelete(self, key_hash: str) -> bool:
        return await self._arun(self._delete(key_hash))

    def __enter__(self) -> Store[OpT]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"
