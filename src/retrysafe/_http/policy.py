"""The HTTP core shared by every HTTP front door (ASGI, WSGI, Django, gateway).

Everything here is plain code with no I/O: reading the key header, the request
fingerprint, the principal's scope, which response headers are stored, and the
answers (replays and RFC 9457 problems). The adapters only move bytes.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import logging
import math
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from retrysafe._core.engine import (
    DEFAULT_MAX_BODY,
    Attempt,
    Claim,
    Engine,
    Options,
    Plan,
    Replay,
    engine_for,
)
from retrysafe._core.metrics import METRICS
from retrysafe._core.principal import Anonymous, Principal, Principals, principal_option
from retrysafe._core.secret import Secret, asecret_of, check_secret, secret_of
from retrysafe._map.map import IdempotencyMap, Route
from retrysafe._model.hashing import KEY_PATTERN, canonical_json, validate_key
from retrysafe._model.record import Outcome
from retrysafe.errors import (
    AmbiguousCredentialsError,
    FingerprintMismatchError,
    IdempotencyError,
    InProgressError,
    InvalidKeyError,
    PrincipalRequiredError,
    StoreUnavailableError,
)
from retrysafe.stores import Store

__all__ = [
    "MAX_KEY_HEADER",
    "OFFLOAD_JSON",
    "BodyError",
    "Canonicalize",
    "Headers",
    "HttpPolicy",
    "HttpRequest",
    "Response",
    "problem",
]

log = logging.getLogger("retrysafe.http")

DEFAULT_HEADERS = ("Idempotency-Key", "X-Idempotency-Key")
DEFAULT_MAX_REQUEST_BODY = 10 << 20
#: The most characters the key header's lines may hold together, checked before
#: any parsing: the longest key (255 characters) quoted with every character
#: escaped, twice over (a proxy that repeats the line), with room to spare.
MAX_KEY_HEADER = 2048
REPLAYED = ("idempotent-replayed", "true")
PROBLEM_TYPE = "application/problem+json"
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


@dataclass(slots=True)
class Response:
    """An answer the core gives instead of running the handler."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


class BodyError(IdempotencyError):
    """The request body cannot be fingerprinted (malformed JSON, or too large)."""

    code = "idempotency_body_invalid"

    def __init__(self, message: str, *, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        if code is not None:
            self.code = code


class Headers:
    """A read-only, case-insensitive view of request headers (repeats kept)."""

    __slots__ = ("_items",)

    def __init__(self, items: Iterable[tuple[str, str]]) -> None:
        self._items = [(k.lower(), v) for k, v in items]

    def get(self, name: str, default: str | None = None) -> str | None:
        name = name.lower()
        for k, v in self._items:
            if k == name:
                return v
        return default

    def getlist(self, name: str) -> list[str]:
        name = name.lower()
        return [v for k, v in self._items if k == name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def items(self) -> list[tuple[str, str]]:
        return list(self._items)

    def __repr__(self) -> str:
        return f"Headers({[k for k, _ in self._items]!r})"


@dataclass(slots=True)
class HttpRequest:
    """The request as ``principal=`` and ``require_key=`` callables see it.

    ``native`` is the framework's own object: the ASGI scope, the WSGI environ
    or the Django ``HttpRequest``.
    """

    method: str
    path: str
    query: str
    headers: Headers
    native: Any = None


# -- the key header ----------------------------------------------------------------

# RFC 8941 parameters after an sf-string item: ;key[=bare-item]
_BARE = r'(?:-?\d+(?:\.\d+)?|"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*"|[A-Za-z*][!#$%&\'*+\-.^_`|~:/\w]*|:[A-Za-z0-9+/=]*:|\?[01])'  # noqa: E501
_PARAMS = re.compile(rf"(?:;[ ]*[a-z*][a-z0-9_\-.*]*(?:={_BARE})?)*[ \t]*")
_MEMBER = re.compile(r'[ \t]*("(?:[^"\\]|\\.)*"?|[^,]*)')


def _sf_string(member: str) -> str:
    """The value of an RFC 8941 sf-string item (parameters allowed, then ignored)."""
    out = []
    i, n = 1, len(member)
    while i < n:
        c = member[i]
        if c == "\\":
            if i + 1 < n and member[i + 1] in '"\\':
                out.append(member[i + 1])
                i += 2
                continue
            raise InvalidKeyError("malformed quoted idempotency key: bad escape")
        if c == '"':
            if not _PARAMS.fullmatch(member, i + 1):
                raise InvalidKeyError(
                    "malformed quoted idempotency key: unexpected text after the closing quote"
                )
            return "".join(out)
        if not " " <= c <= "~":
            raise InvalidKeyError(
                f"malformed quoted idempotency key: {c!r} is not allowed in an sf-string"
            )
        out.append(c)
        i += 1
    raise InvalidKeyError("malformed quoted idempotency key: no closing quote")


def parse_key(values: list[str]) -> str | None:
    """The one key carried by the key header's field lines, or None if there is none.

    A member that starts with ``"`` is an RFC 8941 sf-string; any other member is
    the key as it stands. Commas outside quotes separate members (servers fold
    repeated header lines into one comma-separated value), so a bare key cannot
    hold a comma: quote it. Several members must all be the same key. Lines
    over :data:`MAX_KEY_HEADER` characters together are refused unread.
    """
    size = sum(map(len, values))
    if size > MAX_KEY_HEADER:
        raise InvalidKeyError(
            f"the idempotency key header is {size} characters long; the limit is {MAX_KEY_HEADER}"
        )
    if len(values) == 1:
        value = values[0].strip(" \t")
        if value and value[0] != '"' and "," not in value:
            if KEY_PATTERN.fullmatch(value):
                return value
            return validate_key(value)  # raises with the reason
    keys: list[str] = []
    for value in values:
        pos, n = 0, len(value)
        while True:
            m = _MEMBER.match(value, pos)
            assert m is not None
            member = m.group(1).strip(" \t")
            pos = m.end()
            # A quoted member may be followed by parameters up to the next comma.
            if member.startswith('"'):
                rest = value.find(",", pos)
                tail = value[pos:] if rest < 0 else value[pos:rest]
                member += tail
                pos = n if rest < 0 else rest
                keys.append(_sf_string(member.rstrip(" \t")))
            elif not member:
                if not value.strip(" \t") and len(values) == 1:
                    raise InvalidKeyError("idempotency key is empty")
                raise InvalidKeyError("idempotency key header has an empty member")
            else:
                keys.append(member)
            if pos >= n:
                break
            pos += 1  # the comma
    if not keys:
        return None
    if any(k != keys[0] for k in keys):
        raise InvalidKeyError("the request carries more than one idempotency key")
    return validate_key(keys[0])


def declared_length(value: str | bytes | None) -> int | None:
    """The length a ``Content-Length`` value declares: ASCII digits, else None.

    ``str.isdigit`` is true of ``²`` and other digits ``int`` refuses, and
    ``int`` refuses more than 4300 digits: a value that long is taken as a
    length past every limit.
    """
    if not value or not value.isascii() or not value.isdigit():
        return None
    try:
        return int(value)
    except ValueError:  # over sys.get_int_max_str_digits() digits
        return 1 << 63


# -- fingerprint and scope -------------------------------------------------------------


_JSON_TYPES: dict[str, bool] = {}


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    known = _JSON_TYPES.get(content_type)
    if known is None:
        media = content_type.split(";", 1)[0].strip().lower()
        known = media == "application/json" or media.endswith("+json")
        if len(_JSON_TYPES) < 256:  # a few distinct types in practice; bounded anyway
            _JSON_TYPES[content_type] = known
    return known


# JSON parsed and re-serialised by the C scanner and encoder directly: the same
# canonical form as canonical_json(json.loads(body)) (sorted keys, no whitespace,
# UTF-8, no NaN) without the pure-Python layers around them.
_scan = json.JSONDecoder().scan_once
_space = json.decoder.WHITESPACE.match
try:
    from json.encoder import c_make_encoder as _c_make_encoder
except ImportError:  # pragma: no cover - CPython always has _json
    _c_make_encoder = None


def _no_default(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not JSON")


if _c_make_encoder is not None:
    _encode = _c_make_encoder(
        None, _no_default, json.encoder.encode_basestring, None, ":", ",", True, False, False
    )

    def _canonical(text: str) -> bytes:
        end = _space(text, 0).end()
        try:
            value, end = _scan(text, end)
        except StopIteration as stop:
            raise ValueError(f"no JSON value at character {stop.value}") from None
        if _space(text, end).end() != len(text):
            raise ValueError(f"extra data after the JSON value at character {end}")
        return "".join(_encode(value, 0)).encode()
else:  # pragma: no cover

    def _canonical(text: str) -> bytes:
        return canonical_json(json.loads(text))


#: A JSON body larger than this (64 KiB) is made canonical in a helper process:
#: the C parser and encoder hold the GIL for about 0.3 s per MB, which would stall
#: every other request of the process (its event loop and its threads alike).
OFFLOAD_JSON = 64 << 10
#: Body forms: (kind, the bytes fingerprinted).
BodyForm = tuple[bytes, bytes]


def _canonical_job(body: bytes) -> bytes | str:
    """The canonical form of a JSON body, or why it is not JSON (the helper's job)."""
    try:
        return _canonical(body.decode())
    except (ValueError, RecursionError, TypeError) as exc:
        return f"the request body is not valid JSON: {exc}"


def _json_form(result: bytes | str) -> BodyForm:
    if isinstance(result, str):
        raise BodyError(result)
    return b"j", result


class _Helper:
    """A helper process that makes large JSON bodies canonical, one at a time (so
    their memory is bounded too), started on first use and again after it died
    or served :data:`_HELPER_JOBS` bodies (to give its memory back); a forked
    child starts its own. Frames on its pipes: 8-byte length and bytes in; a
    flag byte (0 canonical JSON, 1 the error's text), 8-byte length and bytes out.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._jobs = 0
        os.register_at_fork(after_in_child=self._forget)
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the helper process, if there is one (a later body starts another)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            _stop(proc)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._proc = None  # the parent's helper: never used, never stopped, here

    def _start(self) -> subprocess.Popen[bytes]:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": root if not path else root + os.pathsep + path}
        self._jobs = 0
        return subprocess.Popen(
            [sys.executable, "-c", _HELPER_CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # Ctrl-C on the terminal is the parent's to handle
        )

    def canonical(self, body: bytes) -> BodyForm:
        """The body's form, computed by the helper; this thread waits without the GIL."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None or self._jobs >= _HELPER_JOBS:
                if proc is not None:
                    _stop(proc)
                proc = self._proc = self._start()
            self._jobs += 1
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(len(body).to_bytes(8, "big"))
                proc.stdin.write(body)
                proc.stdin.flush()
                head = _read_exactly(proc.stdout, 9)
                data = _read_exactly(proc.stdout, int.from_bytes(head[1:], "big"))
            except (OSError, EOFError) as exc:
                self._proc = None
                _stop(proc)
                log.error("retrysafe: the JSON fingerprinting process failed: %s", exc)
                raise BodyError(
                    "the request body could not be fingerprinted",
                    status=413,
                    code="idempotency_body_too_large",
                ) from None
        return _json_form(data.decode() if head[0] else data)


#: Bodies the helper process makes canonical before it is started afresh.
_HELPER_JOBS = 64
_HELPER_CODE = "from retrysafe._http.policy import serve_canonical; serve_canonical()"


def _read_exactly(stream: Any, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError("the helper process closed its pipe")
    return bytes(data)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def serve_canonical() -> None:
    """The helper process's loop: canonical JSON for each body framed on stdin."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while len(head := inp.read(8)) == 8:
        result = _canonical_job(inp.read(int.from_bytes(head, "big")))
        flag, data = (1, result.encode()) if isinstance(result, str) else (0, result)
        out.write(bytes((flag,)) + len(data).to_bytes(8, "big"))
        out.write(data)
        out.flush()


_HELPER = _Helper()


class Canonicalize:
    """A large JSON body to make canonical in the helper process (see :data:`OFFLOAD_JSON`)."""

    __slots__ = ("body",)

    def __init__(self, body: bytes) -> None:
        self.body = body

    def run(self) -> BodyForm:
        """The body's form, waited for on this thread (which holds no GIL meanwhile)."""
        return _HELPER.canonical(self.body)

    async def arun(self) -> BodyForm:
        """:meth:`run` on a worker thread: the event loop goes on meanwhile."""
        return await asyncio.to_thread(_HELPER.canonical, self.body)


def body_form(content_type: str | None, body: bytes) -> BodyForm | Canonicalize:
    """What of ``body`` is fingerprinted: JSON in canonical form, else the bytes;
    a :class:`Canonicalize` for a JSON body over :data:`OFFLOAD_JSON`."""
    if body and _is_json(content_type):
        if len(body) > OFFLOAD_JSON:
            return Canonicalize(body)
        return _json_form(_canonical_job(body))
    return b"b", body


def request_fingerprint(
    method: str,
    path: str,
    query: str,
    content_type: str | None,
    body: bytes,
    secret: Secret | bytes | None = None,
) -> str:
    """SHA-256 over method, path, query and body; JSON bodies in canonical form.

    With ``secret``, an HMAC-SHA256 under it instead (what the front doors
    store: a body may hold a password, and a plain hash of it could be
    reversed with a dictionary). Raises :class:`BodyError` for a body declared
    as JSON that is not valid UTF-8 JSON (RFC 8259). A JSON body over
    :data:`OFFLOAD_JSON` is made canonical in a helper process.
    """
    form = body_form(content_type, body)
    if isinstance(form, Canonicalize):
        form = form.run()
    return form_fingerprint(method, path, query, form, secret)


def form_fingerprint(
    method: str, path: str, query: str, form: BodyForm, secret: Secret | bytes | None = None
) -> str:
    """:func:`request_fingerprint` of a body's :func:`body_form`."""
    kind, body = form
    m, p, q = method.encode(), path.encode("utf-8", "surrogateescape"), query.encode()
    head = b"%d:%s%d:%s%d:%s%s" % (len(m), m, len(p), p, len(q), q, kind)
    if secret is None:
        return hashlib.sha256(head + body).hexdigest()
    if not isinstance(secret, Secret):
        secret = Secret(secret)
    return secret.hmac(head, body)


# -- answers ----------------------------------------------------------------------

_TITLES = {
    "idempotency_key_required": "Idempotency key required",
    "idempotency_key_invalid": "Invalid idempotency key",
    "idempotency_in_flight": "Request in progress",
    "idempotency_conflict": "Idempotency key reused",
    "idempotency_store_unavailable": "Idempotency store unavailable",
    "idempotency_body_invalid": "Request body cannot be fingerprinted",
    "idempotency_body_too_large": "Request body too large",
    "idempotency_credentials_ambiguous": "Ambiguous credentials",
    "idempotency_principal_required": "Credentials required",
    "idempotency_failed": "Request failed",
    "upstream_unavailable": "Upstream unavailable",
    "upstream_timeout": "Upstream timed out",
    "not_found": "Not found",
    "method_not_allowed": "Method not allowed",
    "request_header_too_large": "Request header too large",
    "request_header_timeout": "Request header timeout",
    "request_body_timeout": "Request body timeout",
    "too_many_connections": "Too many connections",
}


def problem(
    status: int,
    code: str,
    detail: str,
    *,
    headers: Iterable[tuple[str, str]] = (),
    **extra: Any,
) -> Response:
    """An RFC 9457 ``application/problem+json`` answer with a machine ``code``."""
    doc = {
        "type": f"urn:retrysafe:problem:{code}",
        "title": _TITLES.get(code, code),
        "status": status,
        "detail": detail,
        "code": code,
    }
    doc.update(extra)
    body = json.dumps(doc, separators=(",", ":")).encode()
    out = [("content-type", PROBLEM_TYPE), ("content-length", str(len(body)))]
    out.extend(headers)
    return Response(status, out, body)


def retry_after_header(seconds: float) -> tuple[str, str]:
    return ("retry-after", str(max(1, math.ceil(seconds))))


# -- the policy ---------------------------------------------------------------------

PrincipalSpec = Callable[[HttpRequest], str | None] | None
RequireSpec = bool | Callable[[HttpRequest], bool]


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
        key = parse_key(values)
        if self.key_format is not None:
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
        return Attempt(self.engine, self._plan.derive(key, who.scope(secret), fp, request_id))

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
        allow, drop = self.store_headers, self.drop_headers
        out = []
        for name, value in headers:
            name = name.lower()
            if name in drop:
                continue
            if allow is None:
                if name in SENSITIVE:
                    continue
            elif name not in allow:
                continue
            out.append((name, value))
        return tuple(out)

    def stored_raw_headers(
        self, headers: Iterable[tuple[bytes, bytes]]
    ) -> tuple[tuple[str, str], ...]:
        """:meth:`stored_headers` of ASGI's (name, value) byte pairs."""
        return self.stored_headers((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)

    def is_failure(self, status: int) -> bool:
        """A 5xx answer fails the attempt (retryable unless ``final_failures``)."""
        return status >= 500

    def _settlement(self, status: int, outcome: Outcome) -> tuple[str, Outcome | None, bool]:
        """How an answer settles its attempt: ("complete" or "fail", what is stored,
        final). An :data:`UNPROCESSED` refusal stores nothing and stays retryable;
        an answer whose stored headers are over :data:`MAX_STORED_HEADERS` stores
        nothing and is final (it was processed: a retry must not run it again)."""
        if status in UNPROCESSED:
            return "fail", None, False
        if _header_bytes(outcome.headers) > MAX_STORED_HEADERS:
            return "fail", None, True
        if self.is_failure(status):
            return "fail", outcome, self.final_failures
        return "complete", outcome, False

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

    async def asettle(self, att: Any, status: int, outcome: Outcome) -> None:
        """Record the answer (before its last byte leaves); never raises."""
        how, kept, final = self._settlement(status, outcome)
        try:
            if how == "fail":
                await att.afail(kept, final=final)
            else:
                await att.acomplete(kept)
        except IdempotencyError as exc:
            unrecorded(att.claim, exc)

    def settle(self, att: Any, status: int, outcome: Outcome) -> None:
        """Sync :meth:`asettle`."""
        how, kept, final = self._settlement(status, outcome)
        try:
            if how == "fail":
                att.fail(kept, final=final)
            else:
                att.complete(kept)
        except IdempotencyError as exc:
            unrecorded(att.claim, exc)


def _header_bytes(headers: Iterable[tuple[str, str]]) -> int:
    return sum(len(k) + len(v) + 4 for k, v in headers)  # ": " and CRLF, as sent


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def unrecorded(claim: Claim | None, exc: Exception, answer: str = "the answer") -> None:
    """The handler ran but its answer could not be recorded: the client still gets it.

    Every front door reports it here; ``answer`` names what was not recorded
    (A2A: the answer to which message).
    """
    log.error(
        "retrysafe: %s was sent but not recorded (%s); a retry after the lease "
        "runs out may run the handler again (key_hash=%s)",
        answer,
        exc,
        claim.key_hash[:16] if claim else "-",
    )


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
