"""The durable outbox: mutations queued in a SQLite file and sent later, in order.

A mutation is stored with its idempotency key before anything is sent, and is
removed only after the server gave it a final answer. A crash at any point
leaves it queued, and sending it again with the same key is what the server's
idempotency makes safe: it runs once and answers the retry from its store.

One flusher at a time sends (an exclusive ``flock`` on ``PATH.lock``, which the
kernel releases when its process dies, SIGKILL included), oldest first, and
stops at the first mutation that got no final answer, so a later one never
overtakes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json as _json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from retrysafe._client.clients import Client
from retrysafe._client.keys import new_key
from retrysafe._client.retry import RetryPolicy, retryable
from retrysafe._model.hashing import validate_key
from retrysafe.errors import (
    FingerprintMismatchError,
    InvalidKeyError,
    OutboxError,
)

__all__ = ["FlushResult", "Outbox", "OutboxItem"]

#: Headers that carry credentials: give them to the flushing client instead.
SENSITIVE_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "x-api-key"})
#: The most of a final failure's answer kept for inspection.
MAX_KEPT_ANSWER = 64 * 1024

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_MISSING: Any = object()

_SCHEMA = """
CREATE TABLE IF NOT EXISTS retrysafe_outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    method TEXT NOT NULL,
    url TEXT NOT NULL,
    headers TEXT NOT NULL,
    body BLOB NOT NULL,
    created_at REAL NOT NULL,
    state TEXT NOT NULL DEFAULT 'queued',
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    status_code INTEGER,
    answer BLOB,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS retrysafe_outbox_state ON retrysafe_outbox (state, seq);
"""
_COLUMNS = (
    "seq, key, method, url, headers, body, created_at, state, attempts, last_error, "
    "status_code, answer, finished_at"
)


#: Flush locks this process holds. A child forked meanwhile closes its copies, or the
#: lock (shared by the copies of one open file) would outlive the flush in the child.
_held: set[int] = set()


def _close_held() -> None:
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held)


@dataclass(frozen=True)
class OutboxItem:
    """One queued (or finally failed) mutation.

    ``attempts`` counts the flushes that sent it; ``last_error`` says why the
    last one did not get a final answer. A failed item keeps the answer's
    ``status_code`` and (the first 64 KiB of) its body as ``answer``.
    """

    seq: int
    key: str
    method: str
    url: str
    headers: dict[str, str]
    body: bytes
    created_at: float
    state: str = "queued"
    attempts: int = 0
    last_error: str | None = None
    status_code: int | None = None
    answer: bytes | None = field(default=None, repr=False)
    finished_at: float | None = None


@dataclass(frozen=True)
class FlushResult:
    """What one :meth:`Outbox.flush` did.

    ``delivered`` got a final success (2xx, or 303 See Other) and left the
    outbox; ``failed`` got a final refusal (a 4xx that a retry cannot change, or
    a redirect other than 303: the mutation was not made there) and are kept as
    failed. ``error`` says why the flush stopped before the queue was
    empty (``remaining`` items are still queued, the first of them unsent), and
    ``busy`` that another flusher held the outbox (``block=False``).
    """

    delivered: tuple[OutboxItem, ...] = ()
    failed: tuple[OutboxItem, ...] = ()
    remaining: int = 0
    error: str | None = None
    busy: bool = False

    @property
    def complete(self) -> bool:
        """Whether everything queued was sent and accepted."""
        return not self.failed and not self.remaining and not self.busy


def _item(row: tuple[Any, ...]) -> OutboxItem:
    return OutboxItem(
        seq=row[0],
        key=row[1],
        method=row[2],
        url=row[3],
        headers=_json.loads(row[4]),
        body=bytes(row[5]),
        created_at=row[6],
        state=row[7],
        attempts=row[8],
        last_error=row[9],
        status_code=row[10],
        answer=None if row[11] is None else bytes(row[11]),
        finished_at=row[12],
    )


def _describe(outcome: httpx.Response | BaseException) -> str:
    if isinstance(outcome, BaseException):
        return f"{type(outcome).__name__}: {outcome}".rstrip(": ")
    return f"HTTP {outcome.status_code}"


class Outbox:
    """Mutations stored in the SQLite file at ``path`` until a server accepts them.

    ``retry`` is the policy of the client that :meth:`flush` builds when it is
    given none, ``timeout`` that client's httpx timeout. Credentials
    (``Authorization``, ``Cookie``, …) are refused by :meth:`enqueue` unless
    ``keep_credentials``: the flushing client should carry them.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        retry: RetryPolicy | None = None,
        timeout: float = 10.0,
        keep_credentials: bool = False,
    ) -> None:
        self.path = Path(path)
        self.retry = retry if retry is not None else RetryPolicy()
        self.timeout = timeout
        self.keep_credentials = keep_credentials
        self._ready = False
        self._local = threading.local()

    def close(self) -> None:
        """Close this thread's connection to the file (others close when their thread ends)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Outbox({str(self.path)!r})"

    # -- storage -------------------------------------------------------------------------

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection (one per thread and process: a fork opens its own).

        Kept open, so SQLite keeps its WAL files instead of checkpointing and
        deleting them at every call; each write still commits (and syncs) at once.
        """
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            try:
                conn = sqlite3.connect(
                    self.path, timeout=30, isolation_level=None, check_same_thread=False
                )
            except sqlite3.Error as exc:
                raise OutboxError(f"cannot open the outbox {str(self.path)!r}: {exc}") from exc
            self._local.conn, self._local.pid = conn, os.getpid()
        try:
            if not self._ready:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.executescript(_SCHEMA)
                self._ready = True
            yield conn
        except sqlite3.Error as exc:
            self._local.conn = None  # a broken connection is not used again
            conn.close()
            raise OutboxError(f"outbox {str(self.path)!r}: {exc}") from exc

    def _select(
        self, where: str, params: tuple[Any, ...] = (), limit: int = -1
    ) -> list[OutboxItem]:
        with self._db() as conn:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM retrysafe_outbox WHERE {where} ORDER BY seq LIMIT ?",
                (*params, limit),
            ).fetchall()
        return [_item(r) for r in rows]

    def _update(self, sql: str, params: tuple[Any, ...]) -> int:
        with self._db() as conn:
            return conn.execute(sql, params).rowcount

    # -- the queue -----------------------------------------------------------------------

    def enqueue(
        self,
        method: str,
        url: str,
        body: bytes | str | None = None,
        key: str | None = None,
        *,
        json: Any = _MISSING,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        """Store a mutation and return its idempotency key (a new UUID unless given).

        ``url`` is absolute, or relative to the flushing client's ``base_url``.
        ``json=`` sends a JSON body (``Content-Type: application/json``).
        Enqueuing the same key again with the same request stores nothing new (a
        failed one stays failed: drop it to queue it again); with another request
        it raises :class:`FingerprintMismatchError`.
        Nothing is sent: :meth:`flush` does that.
        """
        method = self._method(method)
        url = self._url(url)
        head = self._headers(headers)
        if json is not _MISSING:
            if body is not None:
                raise TypeError("enqueue() takes body or json=, not both")
            body = _json.dumps(json, separators=(",", ":"), ensure_ascii=False)
            if not any(name.lower() == "content-type" for name in head):
                head["Content-Type"] = "application/json"
        data = body.encode() if isinstance(body, str) else bytes(body or b"")
        key = new_key(self.retry.key_version) if key is None else validate_key(key)
        if key != key.strip():
            raise InvalidKeyError("an outbox key must not start or end with a space")
        values = (key, method, url, _json.dumps(head, sort_keys=True), data, time.time())
        with self._db() as conn:
            conn.execute(
                "INSERT INTO retrysafe_outbox (key, method, url, headers, body, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO NOTHING",
                values,
            )
            row = conn.execute(
                "SELECT method, url, headers, body FROM retrysafe_outbox WHERE key = ?", (key,)
            ).fetchone()
        if row is not None and (row[0], row[1], row[2], bytes(row[3])) != values[1:5]:
            raise FingerprintMismatchError(
                f"outbox key {key!r} is already queued with another request", key=key
            )
        return key

    def items(self) -> list[OutboxItem]:
        """The queued mutations, in the order they will be sent."""
        return self._select("state = 'queued'")

    def failures(self) -> list[OutboxItem]:
        """The mutations a server finally refused, kept for inspection until dropped."""
        return self._select("state = 'failed'")

    def get(self, key: str) -> OutboxItem | None:
        """The queued or failed mutation with this key, if any."""
        found = self._select("key = ?", (key,))
        return found[0] if found else None

    def drop(self, key: str) -> bool:
        """Remove a queued or failed mutation; whether there was one.

        A mutation that a flush is sending at that moment may still reach the server
        (with its key: once at most).
        """
        return self._update("DELETE FROM retrysafe_outbox WHERE key = ?", (key,)) > 0

    def __len__(self) -> int:
        with self._db() as conn:
            (n,) = conn.execute(
                "SELECT COUNT(*) FROM retrysafe_outbox WHERE state = 'queued'"
            ).fetchone()
        return int(n)

    # -- sending -------------------------------------------------------------------------

    def flush(
        self,
        client: httpx.Client | None = None,
        *,
        block: bool = True,
        on_answer: Callable[[OutboxItem, httpx.Response], object] | None = None,
    ) -> FlushResult:
        """Send the queued mutations in order, each with its key, and keep what is left.

        ``client`` sends them (a :class:`retrysafe.client.Client` retries each
        by its policy; its ``base_url`` and credentials apply); without one, a
        ``Client(retry=self.retry, timeout=self.timeout)`` is used. Another
        flusher, in this process or another, is waited for (``block``) or
        reported as ``busy``. ``on_answer`` sees each final success before it
        is removed; if it raises, the mutation stays queued and the error
        propagates, so it may see an answer again (then a replay).
        """
        with self._flush_lock(block) as held:
            if not held:
                return FlushResult(remaining=len(self), busy=True)
            if client is not None:
                return self._flush(client, on_answer)
            with Client(retry=self.retry, timeout=self.timeout) as own:
                return self._flush(own, on_answer)

    @contextmanager
    def _flush_lock(self, block: bool) -> Iterator[bool]:
        lock = Path(f"{self.path}.lock")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise OutboxError(f"cannot open the outbox lock {str(lock)!r}: {exc}") from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            _held.add(fd)
            yield True
        finally:
            _held.discard(fd)
            os.close(fd)  # releases the lock

    def _flush(
        self,
        client: httpx.Client,
        on_answer: Callable[[OutboxItem, httpx.Response], object] | None,
    ) -> FlushResult:
        header = getattr(client, "key_header", "Idempotency-Key")
        delivered: list[OutboxItem] = []
        failed: list[OutboxItem] = []
        error: str | None = None
        while True:
            first = self._select("state = 'queued'", limit=1)
            if not first:
                break
            item = first[0]
            self._update(
                "UPDATE retrysafe_outbox SET attempts = attempts + 1 WHERE seq = ?", (item.seq,)
            )
            outcome: httpx.Response | BaseException
            try:
                outcome = client.request(
                    item.method,
                    item.url,
                    content=item.body,
                    headers={**item.headers, header: item.key},
                )
            except httpx.TransportError as exc:  # the client's retries are spent
                outcome = exc
            if isinstance(outcome, BaseException) or retryable(outcome):
                error = f"{item.method} {item.url} (key {item.key}): {_describe(outcome)}"
                self._update(
                    "UPDATE retrysafe_outbox SET last_error = ? WHERE seq = ?",
                    (_describe(outcome), item.seq),
                )
                break
            if outcome.status_code < 300 or outcome.status_code == 303:
                if on_answer is not None:
                    on_answer(item, outcome)
                self._update("DELETE FROM retrysafe_outbox WHERE seq = ?", (item.seq,))
                delivered.append(item)
                continue
            refused = replace(
                item,
                state="failed",
                attempts=item.attempts + 1,
                last_error=_describe(outcome),
                status_code=outcome.status_code,
                answer=outcome.content[:MAX_KEPT_ANSWER],
                finished_at=time.time(),
            )
            self._update(
                "UPDATE retrysafe_outbox SET state = 'failed', last_error = ?, status_code = ?,"
                " answer = ?, finished_at = ? WHERE seq = ?",
                (
                    refused.last_error,
                    refused.status_code,
                    refused.answer,
                    refused.finished_at,
                    item.seq,
                ),
            )
            failed.append(refused)
        return FlushResult(tuple(delivered), tuple(failed), len(self), error)

    # -- input checks --------------------------------------------------------------------

    @staticmethod
    def _method(method: str) -> str:
        if not isinstance(method, str) or not _TOKEN.fullmatch(method):
            raise ValueError(f"not an HTTP method: {method!r}")
        return method.upper()

    @staticmethod
    def _url(url: str) -> str:
        if not isinstance(url, str) or not url:
            raise ValueError(f"url must be a non-empty str, not {url!r}")
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError) as exc:
            raise ValueError(f"not a URL: {url!r} ({exc})") from exc
        if parsed.is_absolute_url and parsed.scheme not in ("http", "https"):
            raise ValueError(f"url must be http(s) or relative, not {url!r}")
        return url

    def _headers(self, headers: Mapping[str, str] | None) -> dict[str, str]:
        head: dict[str, str] = {}
        for name, value in (headers or {}).items():
            if not isinstance(name, str) or not _TOKEN.fullmatch(name):
                raise ValueError(f"not a header name: {name!r}")
            if not isinstance(value, str) or any(c in value for c in "\r\n\x00"):
                raise ValueError(f"header {name!r} has an invalid value")
            low = name.lower()
            if low in ("idempotency-key", "x-idempotency-key"):
                raise ValueError("give the idempotency key as key=, not as a header")
            if low in SENSITIVE_HEADERS and not self.keep_credentials:
                raise ValueError(
                    f"header {name!r} carries credentials, which the outbox does not store: "
                    "set them on the flushing client, or pass keep_credentials=True"
                )
            head[name] = value
        return head
