"""The HTTP policy: the options every HTTP front door takes, validated once, and its
decisions: which requests are protected, refusals, replays, and what of an answer
is stored. Plain code with no I/O; the adapters only move bytes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Container, Iterable
from typing import Any, Literal

from retrysafe._core.engine import (
    DEFAULT_MAX_BODY,
    Attempt,
    Engine,
    Options,
    Plan,
    Replay,
    engine_for,
)
from retrysafe._core.metrics import METRICS
from retrysafe._core.principal import (
    LONE_BYTES,
    Anonymous,
    NoPrincipal,
    Principal,
    Principals,
    principal_option,
)
from retrysafe._core.secret import Secret, asecret_of, check_secret, secret_of
from retrysafe._http.problems import Response, problem, retry_after_header
from retrysafe._http.request import (
    BodyForm,
    Canonicalize,
    HttpRequest,
    body_form,
    declared_length,
    form_fingerprint,
    parse_key,
)
from retrysafe._map.map import IdempotencyMap
from retrysafe._map.routes import Route
from retrysafe._model.record import Outcome
from retrysafe.errors import (
    AmbiguousCredentialsError,
    BodyError,
    FingerprintMismatchError,
    InProgressError,
    InvalidKeyError,
    PrincipalRequiredError,
    StoreUnavailableError,
)
from retrysafe.stores import Store

__all__ = [
    "DEFAULT_HEADERS",
    "DEFAULT_MAX_REQUEST_BODY",
    "MAX_STORED_HEADERS",
    "OMITTED",
    "REPLAYED",
    "SCOPES_CACHED",
    "Capture",
    "HttpPolicy",
    "NotKept",
]

log = logging.getLogger("retrysafe.http")

DEFAULT_HEADERS = ("Idempotency-Key", "X-Idempotency-Key")
DEFAULT_MAX_REQUEST_BODY = 10 << 20
REPLAYED = ("idempotent-replayed", "true")
#: The stored media type of an answer whose body was over ``max_body``.
OMITTED = "application/vnd.retrysafe.body-omitted"

#: Never stored unless named in ``store_headers``: they carry credentials.
SENSITIVE = frozenset({"set-cookie", "authorization", "proxy-authorization", "cookie"})
#: Never stored at all: they describe one connection, not the answer.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "idempotent-replayed",
    }
)
#: Answers that say the request was refused before it was processed (timeout
#: waiting for it, too large, URI or head too long, rate limited): never stored,
#: the attempt fails retryable, so the retry of a corrected request runs.
UNPROCESSED = frozenset({408, 413, 414, 429, 431})
#: How many callers' record scopes a policy remembers (see :meth:`HttpPolicy.scope_of`).
SCOPES_CACHED = 1024
#: The most bytes of answer headers a record keeps (names, values, ": " and CRLF):
#: with ``max_body`` and the key, the byte bound of an HTTP record.
MAX_STORED_HEADERS = 64 << 10
#: Headers that describe a body; an omitted body is replayed without them.
REPRESENTATION = frozenset(
    {
        "content-length",
        "content-type",
        "content-encoding",
        "etag",
        "content-range",
        "content-md5",
        "digest",
        "last-modified",
    }
)


# -- the policy ---------------------------------------------------------------------

PrincipalSpec = Callable[[HttpRequest], str | NoPrincipal | None] | None
RequireSpec = bool | Callable[[HttpRequest], bool]


class NotKept:
    """The statuses an answer is not stored under when only ``keep`` are kept:
    those outside ``keep``, and the :data:`UNPROCESSED` refusals."""

    __slots__ = ("keep",)

    def __init__(self, keep: frozenset[int]) -> None:
        self.keep = keep

    def __contains__(self, status: object) -> bool:
        return status not in self.keep or status in UNPROCESSED


def _keep_statuses(value: Iterable[int]) -> frozenset[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError("keep_statuses must be a collection of status codes, e.g. range(200, 300)")
    keep = frozenset(value)
    bad = [s for s in keep if isinstance(s, bool) or not isinstance(s, int) or not 100 <= s <= 999]
    if bad:
        raise ValueError(f"keep_statuses must hold HTTP status codes (100 to 999), not {bad[0]!r}")
    if not keep:
        raise ValueError("keep_statuses must name at least one status (None keeps the default)")
    return keep


class HttpPolicy:
    """The options every HTTP front door takes, validated once, and its decisions.

    See :class:`retrysafe.asgi.IdempotencyMiddleware` for what each option means.
    """

    def __init__(
        self,
        store: Store[Any] | Engine | str | None = None,
        *,
        methods: Collection[str] = ("POST", "PATCH"),
        require_key: RequireSpec = False,
        header: str | Collection[str] = DEFAULT_HEADERS,
        principal: PrincipalSpec = None,
        principal_headers: Collection[str] | None = None,
        principal_cookies: Collection[str] | None = None,
        principal_query: Collection[str] | None = None,
        anonymous: Anonymous | None = None,
        scope: PrincipalSpec = None,
        operation: str = "http",
        ttl: float | None = None,
        lease: float | None = None,
        wait: float | None = None,
        duplicate_response: Literal["replay", "no_content"] = "replay",
        fail_mode: Literal["closed", "open"] = "closed",
        final_failures: bool = False,
        keep_statuses: Iterable[int] | None = None,
        fingerprint: bool = True,
        max_body: int = DEFAULT_MAX_BODY,
        max_request_body: int = DEFAULT_MAX_REQUEST_BODY,
        store_headers: Collection[str] | None = None,
        drop_headers: Collection[str] = (),
        retention: str | None = None,
        map: IdempotencyMap | str | os.PathLike[str] | None = None,
        key_format: Callable[[str], object] | None = None,
    ) -> None:
        self.engine = engine_for(
            store,
            max_body=max(int(max_body), DEFAULT_MAX_BODY),
            ttl=ttl,
            lease=lease,
            retention=retention,
        )
        self.methods = frozenset(m.upper() for m in methods)
        if not callable(require_key) and not isinstance(require_key, bool):
            raise TypeError("require_key must be a bool or a callable taking the request")
        self.require_key = require_key
        names = (header,) if isinstance(header, str) else tuple(header)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError("header must name at least one header")
        self.header = names[0]
        self.header_names = frozenset(n.lower() for n in names)
        self.raw_header_names = frozenset(n.encode("latin-1") for n in self.header_names)
        # What WSGI servers call them: HTTP_IDEMPOTENCY_KEY.
        self.environ_names = tuple("HTTP_" + n.upper().replace("-", "_") for n in names)
        principal = principal_option(principal, scope, native=False)
        imap = None if map is None else _load_map(map)
        table = imap.principals if imap is not None else None
        if table is not None:  # the map's [principals] table, under explicit options
            principal_headers = _given(principal_headers, table.headers)
            principal_cookies = _given(principal_cookies, table.cookies)
            principal_query = _given(principal_query, table.query)
            anonymous = _given(anonymous, table.anonymous)
        self.principals = Principals(
            principal=principal,
            principal_headers=principal_headers,
            principal_cookies=principal_cookies,
            principal_query=principal_query,
            anonymous=anonymous,
        )
        check_secret(self.engine.store)
        self._secret: Secret | None = None
        self._scopes: dict[Principal, str] = {}
        if not isinstance(operation, str):
            raise TypeError("operation must be a str")
        self.operation = operation
        self.ttl, self.lease, self.wait = ttl, lease, wait
        if duplicate_response not in ("replay", "no_content"):
            raise ValueError('duplicate_response must be "replay" or "no_content"')
        self.no_content = duplicate_response == "no_content"
        if fail_mode not in ("closed", "open"):
            raise ValueError('fail_mode must be "closed" or "open"')
        self.fail_open = fail_mode == "open"
        self.final_failures = bool(final_failures)
        #: The statuses whose answers are never stored (the attempt fails retryable).
        self.not_kept: Container[int] = (
            UNPROCESSED if keep_statuses is None else NotKept(_keep_statuses(keep_statuses))
        )
        if not isinstance(fingerprint, bool):
            raise TypeError("fingerprint must be True or False")
        #: False: a key's record stands for any request under it; the body is not read.
        self.fingerprint = fingerprint
        if int(max_body) < 0 or int(max_request_body) < 0:
            raise ValueError("max_body and max_request_body must not be negative")
        self.max_body = int(max_body)
        self.max_request_body = int(max_request_body)
        self.store_headers = (
            None if store_headers is None else frozenset(h.lower() for h in store_headers)
        )
        # The engine options every request shares, validated once.
        self._plan = Plan.shared(self.engine, operation, Options(ttl=ttl, lease=lease, wait=wait))
        self.drop_headers = frozenset(h.lower() for h in drop_headers) | HOP_BY_HOP
        # What an answer keeps, as one test per header: never these, or only those.
        self._unkept = self.drop_headers | SENSITIVE if self.store_headers is None else None
        self._only = None if self.store_headers is None else self.store_headers - self.drop_headers
        if key_format is not None and not callable(key_format):
            raise TypeError("key_format must be a callable that raises InvalidKeyError")
        self.key_format = key_format
        # The Idempotency Map's routes: a policy per route, sharing the store.
        self.map: IdempotencyMap | None = None
        self._routes: dict[Route, HttpPolicy] = {}
        if imap is not None:
            p = self.principals
            common = {
                "principal": p.fn,
                "principal_headers": p.headers,
                "principal_cookies": p.cookies,
                "principal_query": p.query,
                "fail_mode": fail_mode,
                "keep_statuses": keep_statuses,
                "fingerprint": fingerprint,
                "max_body": max_body,
                "max_request_body": max_request_body,
                "store_headers": store_headers,
                "drop_headers": drop_headers,
            }
            self.map = imap
            if imap.alerts is not None:  # the process's alert thresholds
                METRICS.alerts = imap.alerts
            for route in imap.routes:
                common["anonymous"] = route.anonymous or p.anonymous
                self._routes[route] = _route_policy(self.engine.store, imap, route, common)

    def select(self, method: str, path: str) -> HttpPolicy | None:
        """The policy of a request: its map route's, else this one for a protected
        method, else None (the request passes through untouched)."""
        if self.map is not None:
            found = self.map.route(method, path)
            if found is not None:
                policy = self._routes[found[0]]
                if method in policy.methods:
                    return policy
        return self if method in self.methods else None

    # -- the request -------------------------------------------------------------

    def key(self, values: list[str]) -> str | None:
        """The request's key from the key header lines (:class:`InvalidKeyError` if bad)."""
        if not values:
            return None
        if len(values) == 1 and self.key_format is None:
            # One bare key of visible ASCII, nothing to strip: parse_key's answer, at once.
            line = values[0]
            if (
                len(line) <= 255
                and line.isascii()
                and line.isprintable()
                and line[:1] not in ' "'
                and line[-1] != " "
                and "," not in line
            ):
                return line
        key = parse_key(values)
        if self.key_format is not None and key is not None:
            self.key_format(key)
        return key

    def missing(self, request: Callable[[], HttpRequest]) -> Response | None:
        """The answer to a request without a key: 400 if one is required, else None."""
        required = self.require_key
        if callable(required):
            required = bool(required(request()))
        if not required:
            return None
        METRICS.count("invalid_key", self.operation)
        return problem(
            400,
            "idempotency_key_required",
            f"this request needs an {self.header} header",
        )

    def check_declared(self, value: str | bytes | None) -> None:
        """:meth:`check_length` of a ``Content-Length`` header (one that is not a
        number is left to the server)."""
        length = declared_length(value)
        if length is not None:
            self.check_length(length)

    def check_length(self, length: int) -> None:
        if length > self.max_request_body:
            raise BodyError(
                f"the request body is over {self.max_request_body} bytes, the most that is "
                "fingerprinted for an idempotent request",
                status=413,
                code="idempotency_body_too_large",
            )

    @property
    def secret(self) -> Secret | None:
        """The deployment secret once this policy has it, else None (see :meth:`load_secret`)."""
        return self._secret

    def load_secret(self) -> Secret:
        """The deployment secret, read from the environment or the store once
        (:class:`~retrysafe.StoreUnavailableError` if the store cannot be read)."""
        if self._secret is None:
            self._secret = secret_of(self.engine.store)
        return self._secret

    async def aload_secret(self) -> Secret:
        """Async :meth:`load_secret`."""
        if self._secret is None:
            self._secret = await asecret_of(self.engine.store)
        return self._secret

    def attempt(
        self,
        key: str,
        method: str,
        path: str,
        query: str,
        content_type: str | None,
        body: bytes,
        who: Principal,
        secret: Secret,
        request_id: str | None,
        form: BodyForm | None = None,
    ) -> Attempt:
        """The engine attempt of a keyed request (:class:`BodyError` for a bad body).

        The scope and the fingerprint are keyed hashes under ``secret``; the
        query's credential parameters are left out of the fingerprint. ``form``
        is the body's :func:`body_form` if the caller has it already.
        """
        if form is None:
            found = self.body_form(content_type, body)
            form = found.run() if isinstance(found, Canonicalize) else found
        else:
            self.check_length(len(body))
        query = self.principals.strip_query(query)
        fp = form_fingerprint(method, path, query, form, secret)
        return Attempt(
            self.engine, self._plan.derive(key, self.scope_of(who, secret), fp, request_id)
        )

    def bare_attempt(
        self, key: str, who: Principal, secret: Secret, request_id: str | None
    ) -> Attempt:
        """The engine attempt of a keyed request under ``fingerprint=False``: no
        fingerprint (the empty one), so any request under the key is its duplicate."""
        return Attempt(
            self.engine, self._plan.derive(key, self.scope_of(who, secret), "", request_id)
        )

    def scope_of(self, who: Principal, secret: Secret) -> str:
        """``who.scope(secret)``; under this policy's secret, the last
        :data:`SCOPES_CACHED` callers' scopes are remembered (a keyed hash each time
        costs about as much as the rest of the caller's identification)."""
        if secret is not self._secret:
            return who.scope(secret)
        scopes = self._scopes
        found = scopes.get(who)
        if found is None:
            found = who.scope(secret)
            if len(who.material) <= LONE_BYTES:
                if len(scopes) >= SCOPES_CACHED:
                    scopes = self._scopes = {}
                scopes[who] = found
        return found

    def body_form(self, content_type: str | None, body: bytes) -> BodyForm | Canonicalize:
        """:func:`body_form` of a body within ``max_request_body`` (:class:`BodyError` if not)."""
        self.check_length(len(body))
        return body_form(content_type, body)

    # -- answers instead of the handler --------------------------------------------

    def refusal(self, error: Exception) -> Response | None:
        """The answer to an error of the key, the body or the engine; None to fail open."""
        METRICS.refused(self.operation, error)  # once: the engine's errors are counted there
        if isinstance(error, InvalidKeyError):
            return problem(400, "idempotency_key_invalid", str(error))
        if isinstance(error, AmbiguousCredentialsError):
            return problem(400, error.code, str(error))
        if isinstance(error, PrincipalRequiredError):
            return problem(403, error.code, str(error))
        if isinstance(error, BodyError):
            return problem(error.status, error.code, str(error))
        if isinstance(error, InProgressError):
            return problem(
                409,
                "idempotency_in_flight",
                str(error),
                headers=[retry_after_header(error.retry_after)],
                retry_after=error.retry_after,
            )
        if isinstance(error, FingerprintMismatchError):
            return problem(422, "idempotency_conflict", str(error))
        if isinstance(error, StoreUnavailableError):
            if self.fail_open:
                log.warning(
                    "retrysafe: store unavailable; serving without idempotency (fail open): %s",
                    error,
                )
                return None
            log.error("retrysafe: store unavailable, answering 503: %s", error)
            return problem(
                503,
                "idempotency_store_unavailable",
                "the idempotency store cannot be reached; retry with the same key",
                headers=[retry_after_header(error.retry_after)],
            )
        raise error

    def replay(self, replay: Replay) -> Response:
        """The stored answer, marked ``Idempotent-Replayed: true``."""
        outcome = replay.outcome
        if outcome is None:  # a final failure without an answer (the handler raised)
            return problem(
                500,
                "idempotency_failed",
                "an earlier attempt with this key failed finally; it is not run again",
                headers=[REPLAYED],
            )
        status = outcome.status or 200
        if self.no_content and 200 <= status < 300 and not replay.failed:
            return Response(204, [REPLAYED], b"")
        headers = list(outcome.headers)
        if outcome.media_type == OMITTED:
            headers = [(k, v) for k, v in headers if k not in REPRESENTATION]
            headers.append(("idempotent-body-omitted", "true"))
            headers.append(("content-length", "0"))
        headers.append(REPLAYED)
        return Response(status, headers, outcome.body)

    # -- the handler's answer ----------------------------------------------------------

    def stored_headers(self, headers: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
        """The response headers kept for replay: lower-cased, sensitive ones left out."""
        unkept, only = self._unkept, self._only
        if unkept is not None:
            return tuple([(n, v) for k, v in headers if (n := k.lower()) not in unkept])
        assert only is not None
        return tuple([(n, v) for k, v in headers if (n := k.lower()) in only])

    def is_failure(self, status: int) -> bool:
        """A 5xx answer fails the attempt (retryable unless ``final_failures``)."""
        return status >= 500

    #: What the log names when an answer could not be recorded.
    answer = "the answer"

    def verdict(self, status: int, outcome: Outcome) -> tuple[bool, Outcome | None, bool]:
        """What an answer records (the front doors hand it to
        :func:`~retrysafe._core.recording.record`): (failed, what is stored, final). An
        :data:`UNPROCESSED` refusal stores nothing and stays retryable; an answer
        whose stored headers are over :data:`MAX_STORED_HEADERS` stores nothing
        and is final (it was processed: a retry must not run it again). With
        ``keep_statuses``, a status outside them is an unprocessed one."""
        if status in self.not_kept:
            return True, None, False
        if _header_bytes(outcome.headers) > MAX_STORED_HEADERS:
            return True, None, True
        if self.is_failure(status):
            return True, outcome, self.final_failures
        return False, outcome, False

    def recorded(
        self,
        status: int,
        headers: Iterable[tuple[bytes, bytes]] | Iterable[tuple[str, str]],
        body: bytes,
        size: int,
        raw: bool = True,
    ) -> tuple[bool, Outcome | None, bool]:
        """What an ASGI answer records, from its (name, value) byte pairs: ``verdict(status,
        outcome(status, headers, body, size))`` of the latin-1 decoded headers, in one
        pass (the ASGI recorder calls it; the A2A door's answers define their own).
        Not ``raw``: the pairs are str (:meth:`recorded_text`)."""
        if status in self.not_kept:
            return True, None, False
        unkept, only = self._unkept, self._only
        kept: list[tuple[str, str]] = []
        media = None
        total = 0  # the bytes of the kept headers, as _header_bytes counts them
        pairs: Iterable[tuple[Any, Any]] = headers
        for k, v in pairs:
            name = (k.decode("latin-1") if raw else k).lower()
            if unkept is not None:
                if name in unkept:
                    continue
            elif only is None or name not in only:
                continue
            value = v.decode("latin-1") if raw else v
            kept.append((name, value))
            total += len(name) + len(value) + 4
            if media is None and name == "content-type":
                media = value
        if total > MAX_STORED_HEADERS:
            return True, None, True
        if size > self.max_body:
            outcome = Outcome(b"", status, tuple(kept), OMITTED)
        else:
            if media is None:
                media = "application/octet-stream"
            outcome = Outcome(body, status, tuple(kept), media)
        if self.is_failure(status):
            return True, outcome, self.final_failures
        return False, outcome, False

    def recorded_text(
        self, status: int, headers: Iterable[tuple[str, str]], body: bytes, size: int
    ) -> tuple[bool, Outcome | None, bool]:
        """:meth:`recorded` of (name, value) str pairs (the WSGI and Django doors)."""
        return self.recorded(status, headers, body, size, False)

    def outcome(
        self, status: int, headers: Iterable[tuple[str, str]], body: bytes, size: int
    ) -> Outcome:
        """The stored form of an answer; ``size`` is the whole body's length.

        A body over ``max_body`` is not kept: status and headers are, and a replay
        answers them with an empty body and ``Idempotent-Body-Omitted: true``.
        """
        return self.outcome_of(status, self.stored_headers(headers), body, size)

    def outcome_of(
        self, status: int, kept: tuple[tuple[str, str], ...], body: bytes, size: int
    ) -> Outcome:
        """:meth:`outcome` of headers already filtered for storage."""
        if size > self.max_body:
            return Outcome(b"", status, kept, OMITTED)
        media = next((v for k, v in kept if k == "content-type"), "application/octet-stream")
        return Outcome(body, status, kept, media)


def _header_bytes(headers: Iterable[tuple[str, str]]) -> int:
    return sum(len(k) + len(v) + 4 for k, v in headers)  # ": " and CRLF, as sent


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


class Capture:
    """A copy of a streamed body, kept up to ``limit`` bytes; the size is always counted."""

    __slots__ = ("chunks", "limit", "size")

    def __init__(self, limit: int) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.limit = limit

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size <= self.limit:
            self.chunks.append(chunk)
        elif self.chunks:
            self.chunks = []  # over the limit: the copy is dropped, memory stays flat

    def body(self) -> bytes:
        return b"".join(self.chunks) if self.size <= self.limit else b""


def _load_map(value: IdempotencyMap | str | os.PathLike[str]) -> IdempotencyMap:
    if isinstance(value, IdempotencyMap):
        return value
    if isinstance(value, (str, os.PathLike)):
        return IdempotencyMap.load(value)
    raise TypeError(f"map must be an IdempotencyMap or the path of a TOML file, not {value!r}")


def _route_policy(
    store: Store[Any], imap: IdempotencyMap, route: Route, common: dict[str, Any]
) -> HttpPolicy:
    """The policy of one map route: the operation's record options, the route's HTTP ones."""
    op = imap.operation(route.operation)
    header = route.header
    headers = DEFAULT_HEADERS if header.lower() == DEFAULT_HEADERS[0].lower() else (header,)
    methods = _ALL_METHODS if route.method == "*" else (route.method,)
    engine = Engine(
        store,
        ttl=op.ttl,
        lease=op.lease,
        final_failures=op.final_failures,
        retention=op.retention,
        max_body=max(int(common["max_body"]), DEFAULT_MAX_BODY),
    )
    return HttpPolicy(
        engine,
        methods=methods,
        require_key=route.require_key,
        header=headers,
        operation=op.name,
        wait=route.wait,
        duplicate_response=route.duplicate_response,
        final_failures=op.final_failures,
        key_format=op.parse if route.validate_key else None,
        **common,
    )


#: What a route with method "*" protects: the methods that change state. GET, HEAD
#: and OPTIONS (a CORS preflight never carries the key) get the middleware's options.
_ALL_METHODS = ("POST", "PUT", "PATCH", "DELETE")
