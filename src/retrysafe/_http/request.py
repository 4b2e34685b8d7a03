"""The request side of the HTTP core: headers, the key header, the body's fingerprint.

Plain code with no I/O but one: a JSON body over :data:`OFFLOAD_JSON` is made
canonical in a helper process (docs/http.md says why).
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from retrysafe._core.secret import Secret
from retrysafe._model.hashing import KEY_PATTERN, canonical_json, validate_key
from retrysafe.errors import BodyError, InvalidKeyError

__all__ = [
    "MAX_KEY_HEADER",
    "OFFLOAD_JSON",
    "BodyForm",
    "Canonicalize",
    "Headers",
    "HttpRequest",
    "body_form",
    "declared_length",
    "form_fingerprint",
    "parse_key",
    "request_fingerprint",
    "serve_canonical",
]

log = logging.getLogger("retrysafe.http")

#: The most characters the key header's lines may hold together, checked before
#: any parsing: the longest key (255 characters) quoted with every character
#: escaped, twice over (a proxy that repeats the line), with room to spare.
MAX_KEY_HEADER = 2048


class Headers(Mapping[str, str]):
    """A read-only, case-insensitive mapping of request headers, the one every
    front door hands out (:class:`HttpRequest`, webhook deliveries).

    Built from any mapping or list of (name, value) pairs, names and values as
    ``str`` or ``bytes`` (latin-1); values are stripped of surrounding
    whitespace. Lookups give the first of repeated names; :meth:`getlist` all of
    them, and :meth:`items` every pair in order, repeats kept (as Starlette's
    ``Headers``). Iterating gives each name once, in lower case.
    """

    __slots__ = ("_first", "_items")

    def __init__(self, headers: Mapping[str, Any] | Iterable[tuple[Any, Any]] = ()) -> None:
        pairs = headers.items() if isinstance(headers, Mapping) else headers
        self._items = items = [(_text(k).lower(), _text(v).strip()) for k, v in pairs]
        first: dict[str, str] = {}
        for name, value in items:
            first.setdefault(name, value)
        self._first = first

    def __getitem__(self, name: str) -> str:
        return self._first[name.lower()]

    def getlist(self, name: str) -> list[str]:
        """Every value of ``name``, in order."""
        name = name.lower()
        return [v for k, v in self._items if k == name]

    def first(self, *names: str) -> str | None:
        """The first non-empty value among ``names``, or None."""
        for name in names:
            value = self._first.get(name.lower())
            if value:
                return value
        return None

    def items(self) -> list[tuple[str, str]]:  # type: ignore[override]
        """Every (lower-case name, value) pair, in order, repeats kept."""
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._first

    def __iter__(self) -> Iterator[str]:
        return iter(self._first)

    def __len__(self) -> int:
        return len(self._first)

    def __repr__(self) -> str:
        return f"Headers({[k for k, _ in self._items]!r})"  # (names only: values may be secrets)


def _text(value: Any) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


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
# (typeshed leaves these CPython internals out: hence the ignores)
_scan = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_space = json.decoder.WHITESPACE.match  # type: ignore[attr-defined]
_BLANK = " \t\n\r"  # JSON's whitespace (the empty string is "in" it too: no IndexError)
try:
    from json.encoder import c_make_encoder as _c_make_encoder  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - CPython always has _json
    _c_make_encoder = None


def _no_default(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not JSON")


if _c_make_encoder is not None:
    _encode = _c_make_encoder(
        None, _no_default, json.encoder.encode_basestring, None, ":", ",", True, False, False
    )

    def _canonical(text: str) -> bytes:
        # (the whitespace regex only where there is whitespace: most bodies have none
        # around their value, and each match costs as much as a tenth of the rest)
        end = _space(text, 0).end() if text[:1] in _BLANK else 0
        try:
            value, end = _scan(text, end)
        except StopIteration as stop:
            raise ValueError(f"no JSON value at character {stop.value}") from None
        if end != len(text) and _space(text, end).end() != len(text):
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
_HELPER_CODE = "from retrysafe._http.request import serve_canonical; serve_canonical()"


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
