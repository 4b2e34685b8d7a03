"""Webhooks: verify a delivery's signature, then deduplicate it by its event, then dispatch.

::

    from retrysafe.webhooks import Receiver, verify, SignatureError

    receiver = Receiver(store, scheme="stripe", secrets=["whsec_new", "whsec_old"],
                        handler=on_event)
    answer = receiver.handle(request.headers, raw_body)   # or await receiver.ahandle(...)

    dedup_id = verify("stripe", request.headers, raw_body, ["whsec_new", "whsec_old"])

:class:`Receiver` runs ``handler`` once per event (the Idempotency Map's
``webhook:{source}:{event_id}``, or ``webhook:{source}:{transaction_id}:{event_type}``
for a payment gateway) and answers every delivery (see docs/webhooks.md for
the table); ``receiver.asgi`` and ``receiver.wsgi`` serve it over HTTP.

:func:`verify` is one plain function for every scheme. It returns an id
the signature covers, to deduplicate on (the event id where it is signed, the
body's hash where only the body is), or raises :class:`SignatureError`
(a :class:`~retrysafe.IdempotencyError`); it never stores anything. Every
comparison of a signature is in constant time, and several secrets may be given
at once, so a secret can be rotated without dropping deliveries.

Schemes:

* ``"shopify"``: ``X-Shopify-Hmac-Sha256``, the base64 HMAC-SHA256 of the raw
  body. Event id: ``X-Shopify-Event-Id`` (the same for every retry of an
  event), else ``X-Shopify-Webhook-Id``, neither signed: :func:`verify`
  returns ``sha256:`` and the body's hash. No timestamp is signed.
* ``"stripe"``: ``Stripe-Signature: t=…,v1=…`` (several ``v1`` during a
  rotation), the hex HMAC-SHA256 of ``"{t}.{body}"`` with the endpoint secret
  as given (``whsec_…``). A ``t`` more than ``tolerance`` (300 s) from now is
  refused. Event id: the ``id`` (``evt_…``) of the JSON body.
* ``"standard"`` (Standard Webhooks, used by Svix and others): ``webhook-id``,
  ``webhook-timestamp`` and ``webhook-signature`` (space-separated
  ``v1,<base64>``), the HMAC-SHA256 of ``"{id}.{timestamp}.{body}"`` keyed with
  the base64 after ``whsec_``. Tolerance 300 s. Event id: ``webhook-id``.
* ``"hmac"``: a generic scheme, ``X-Signature`` (or ``X-Hub-Signature-256``):
  the HMAC-SHA256 of the raw body, hex (optionally ``sha256=…``) or base64. Event
  id: ``X-Event-Id``, ``X-Webhook-Id`` or ``X-GitHub-Delivery``, unsigned:
  :func:`verify` returns ``sha256:`` and the body's hash (identical
  redeliveries share it). No timestamp: no replay window.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import hashlib
import hmac
import inspect
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from retrysafe._core.engine import (
    DEFAULT_MAX_BODY,
    Attempt,
    Engine,
    Replay,
    engine_for,
)
from retrysafe._core.heartbeat import renewing
from retrysafe._core.recording import arecord, record
from retrysafe._http.asgi import (
    ASGIApp,
    Receive,
    Scope,
    Send,
    at_most,
    is_async,
    lifespan,
    read_body,
    send_answer,
    to_the_end,
)
from retrysafe._http.policy import REPLAYED
from retrysafe._http.problems import Response, problem, retry_after_header
from retrysafe._http.request import Headers
from retrysafe._http.wsgi import environ_headers, status_line
from retrysafe._http.wsgi import read_body as read_wsgi_body
from retrysafe._map.map import IdempotencyMap
from retrysafe._model.record import Outcome
from retrysafe.errors import (
    BodyError,
    BodyTooLarge,
    IdempotencyError,
    InProgressError,
    SignatureError,
    StoreUnavailableError,
)
from retrysafe.stores import Store

__all__ = ["SCHEMES", "Delivery", "Receiver", "SignatureError", "WebhookResponse", "verify"]

log = logging.getLogger("retrysafe")

#: What a failed recording names in the log.
_ANSWER = "a webhook's answer"

#: Seconds a signed timestamp may be away from now (Stripe's and Standard Webhooks' default).
DEFAULT_TOLERANCE = 300.0


def _need(h: Headers, name: str) -> str:
    """The value of the header ``name`` (:class:`SignatureError` if it is missing or empty)."""
    value = h.first(name)
    if value is None:
        raise SignatureError(f"the {name} header is missing", reason="missing_header")
    return value


def _secrets(secrets: str | bytes | Iterable[str | bytes]) -> list[str | bytes]:
    if isinstance(secrets, (str, bytes)):
        secrets = [secrets]
    found = [s for s in secrets if s]
    if not found or not all(isinstance(s, (str, bytes)) for s in found):
        raise SignatureError("no secret to verify with", reason="bad_secret")
    return found


def _raw(secret: str | bytes) -> bytes:
    return secret.encode() if isinstance(secret, str) else secret


def _check(keys: Iterable[bytes], message: bytes, given: list[bytes]) -> None:
    """Some key's HMAC-SHA256 of ``message`` is one of the ``given`` signatures, or
    :class:`SignatureError`. Every pair is compared, each in constant time."""
    ok = False
    for key in keys:
        want = hmac.new(key, message, hashlib.sha256).digest()
        for got in given:
            ok |= hmac.compare_digest(want, got)
    if not ok:
        raise SignatureError("no secret produces this signature", reason="bad_signature")


def _b64(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def _utf8(text: str) -> bytes:
    """``text`` as signed; a lone surrogate (only a str header can hold one) cannot
    match any signature, but must not raise either."""
    return text.encode("utf-8", "surrogatepass")


def _check_time(timestamp: str, tolerance: float, now: float) -> None:
    try:
        signed = int(timestamp)
    except ValueError:
        raise SignatureError(
            f"the signed timestamp {timestamp[:40]!r} is not a number", reason="malformed_header"
        ) from None
    try:
        skew = float(abs(now - signed))
    except OverflowError:  # a number past float range: as far from now as there is
        skew = math.inf
    if skew > tolerance:
        raise SignatureError(
            f"the signed timestamp is {skew:.0f} s from now "
            f"(tolerance {tolerance:g} s): a replay or a skewed clock",
            reason="timestamp_out_of_tolerance",
        )


# -- the schemes ---------------------------------------------------------------------


def _shopify(h: Headers, body: bytes, secrets: list[str | bytes], tol: float, now: float) -> _Ids:
    given = _b64(_need(h, "X-Shopify-Hmac-Sha256"))
    if given is None:
        raise SignatureError("X-Shopify-Hmac-Sha256 is not base64", reason="malformed_header")
    _check(map(_raw, secrets), body, [given])
    event = h.first("X-Shopify-Event-Id", "X-Shopify-Webhook-Id")
    if event is None:
        raise SignatureError(
            "neither X-Shopify-Event-Id nor X-Shopify-Webhook-Id is present", reason="no_event_id"
        )
    return event, _signed_body(body)


def _stripe(h: Headers, body: bytes, secrets: list[str | bytes], tol: float, now: float) -> _Ids:
    header = _need(h, "Stripe-Signature")
    timestamp, signatures = None, []
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        if name == "t":
            timestamp = value
        elif name == "v1":
            try:
                signatures.append(bytes.fromhex(value))
            except ValueError:
                continue  # (a malformed one cannot match; others may)
    if timestamp is None or not signatures:
        raise SignatureError(
            "Stripe-Signature needs t=<timestamp> and at least one v1=<signature>",
            reason="malformed_header",
        )
    signed = _utf8(timestamp) + b"." + body
    _check(map(_raw, secrets), signed, signatures)
    _check_time(timestamp, tol, now)  # after the signature: the timestamp is authentic
    try:
        event = json.loads(body)
    except (ValueError, RecursionError):
        event = None
    event_id = event.get("id") if isinstance(event, dict) else None
    if not isinstance(event_id, str) or not event_id:
        raise SignatureError("the Stripe event has no id", reason="no_event_id")
    return event_id, event_id  # the id is in the signed body


def _standard_key(secret: str | bytes) -> bytes:
    if isinstance(secret, bytes):
        return secret
    key = _b64(secret.removeprefix("whsec_"))
    if key is None:
        raise SignatureError(
            "a Standard Webhooks secret is whsec_ followed by base64", reason="bad_secret"
        )
    return key


def _standard(h: Headers, body: bytes, secrets: list[str | bytes], tol: float, now: float) -> _Ids:
    event_id = _need(h, "webhook-id")
    timestamp = _need(h, "webhook-timestamp")
    given = []
    for item in _need(h, "webhook-signature").split():
        version, _, value = item.partition(",")
        if version == "v1" and (sig := _b64(value)) is not None:
            given.append(sig)
    if not given:
        raise SignatureError(
            "webhook-signature holds no v1,<base64> signature", reason="malformed_header"
        )
    signed = _utf8(f"{event_id}.{timestamp}.") + body
    _check(map(_standard_key, secrets), signed, given)
    _check_time(timestamp, tol, now)
    return event_id, event_id  # webhook-id is signed


def _generic(h: Headers, body: bytes, secrets: list[str | bytes], tol: float, now: float) -> _Ids:
    header = h.first("X-Signature", "X-Hub-Signature-256")
    if header is None:
        raise SignatureError("the X-Signature header is missing", reason="missing_header")
    value = header.removeprefix("sha256=")
    given = []
    with contextlib.suppress(ValueError):
        given.append(bytes.fromhex(value))
    if (decoded := _b64(value)) is not None:
        given.append(decoded)
    given = [g for g in given if len(g) == hashlib.sha256().digest_size]
    if not given:
        raise SignatureError(
            "the signature is neither hex nor base64 of a SHA-256 HMAC", reason="malformed_header"
        )
    _check(map(_raw, secrets), body, given)
    signed = _signed_body(body)
    event = h.first("X-Event-Id", "X-Webhook-Id", "X-GitHub-Delivery")
    return (event if event is not None else signed), signed


def _signed_body(body: bytes) -> str:
    """The id of a delivery by what its signature covers: ``sha256:`` and the body's hash."""
    return "sha256:" + hashlib.sha256(body).hexdigest()


#: (the provider's event id, an id the signature covers): the same for Stripe and
#: Standard Webhooks; the body's hash for schemes that sign only the body.
_Ids = tuple[str, str]
_Scheme = Callable[[Headers, bytes, list[str | bytes], float, float], _Ids]

#: Every scheme :func:`verify` knows, by name.
SCHEMES: dict[str, _Scheme] = {
    "shopify": _shopify,
    "stripe": _stripe,
    "standard": _standard,
    "hmac": _generic,
}


def verify(
    scheme: str,
    headers: Mapping[str, Any] | Iterable[tuple[Any, Any]],
    body: bytes,
    secrets: str | bytes | Iterable[str | bytes],
    *,
    tolerance: float | None = None,
    now: float | None = None,
    trust_event_ids: bool = False,
) -> str:
    """The id to deduplicate an authentic delivery on; :class:`SignatureError` if it is not.

    The id is one the signature covers: the event id for ``stripe`` (in the
    body) and ``standard`` (``webhook-id``); for ``shopify`` and ``hmac``, which
    sign the body only, ``sha256:`` and the body's SHA-256, since their event-id
    header could be replaced by anyone who captured a delivery.
    ``trust_event_ids=True`` returns that unsigned header id instead.

    ``headers``: any mapping (or list of pairs), looked up case-insensitively.
    ``body``: the raw bytes as received (never re-serialized JSON). ``secrets``:
    one or several (rotation). ``tolerance``: seconds a signed timestamp may be
    from ``now`` (default 300; schemes without a timestamp ignore it). ``now``:
    seconds since the epoch (default: the clock).
    """
    event_id, signed_id = _verify(scheme, headers, body, secrets, tolerance, now)
    return event_id if trust_event_ids else signed_id


def _verify(
    scheme: str,
    headers: Any,
    body: bytes,
    secrets: Any,
    tolerance: float | None,
    now: float | None,
) -> _Ids:
    """:func:`verify`'s checks: (the provider's event id, an id the signature covers)."""
    check = SCHEMES.get(scheme) if isinstance(scheme, str) else None
    if check is None:
        raise SignatureError(
            f"unknown webhook scheme {scheme!r}: one of {', '.join(SCHEMES)}",
            reason="unknown_scheme",
        )
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise TypeError("body must be the raw request bytes")
    tol = DEFAULT_TOLERANCE if tolerance is None else float(tolerance)
    if not tol >= 0:
        raise ValueError("tolerance must be >= 0 seconds")
    h = headers if isinstance(headers, Headers) else Headers(headers)
    return check(h, bytes(body), _secrets(secrets), tol, time.time() if now is None else now)


# -- the receiver: verify, then deduplicate, then dispatch ---------------------------------

_UNSET: Any = object()
#: What a field of a key may hold as is: the Idempotency Map's rule for a value
#: (visible ASCII, none of the template's ``:`` or braces), at most 64 characters,
#: so that the longest key (three fields and a source) stays under 255.
_KEY_FIELD = re.compile(r"[!-9;-z|~]{1,64}")
_SOURCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_PROBLEM_TITLES = {
    "webhook_signature_invalid": "Invalid webhook signature",
    "webhook_handler_failed": "Webhook handler failed",
    "webhook_result_invalid": "Webhook result cannot be stored",
}


@dataclass(frozen=True, eq=False)
class Delivery:
    """One authentic delivery, as the handler gets it (its signature checked out).

    ``event_id``: the provider's id of the event (for ``shopify`` and ``hmac`` an
    unsigned header: show it, never deduplicate on it; ``key`` is safe);
    ``source``: the receiver's name for the provider; ``key``: the
    deduplication key (``webhook:{source}:{event_id}``, or
    ``webhook:{source}:{transaction_id}:{event_type}`` for a payment gateway);
    ``headers``: a case-insensitive mapping; ``body``: the raw bytes.
    ``transaction_id`` and ``event_type`` are what ``transaction=`` gave (else None).
    """

    event_id: str
    source: str
    key: str
    headers: Mapping[str, str]
    body: bytes = field(repr=False)
    transaction_id: str | None = None
    event_type: str | None = None
    _parsed: Any = field(default=_UNSET, init=False, repr=False)

    def json(self) -> Any:
        """The body parsed as JSON (once; later calls return the same object).

        ``ValueError`` if it is not JSON: schemes that do not need the body
        (Shopify, Standard Webhooks, ``hmac``) accept any bytes.
        """
        if self._parsed is _UNSET:
            object.__setattr__(self, "_parsed", json.loads(self.body))
        return self._parsed


_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


@dataclass(frozen=True)
class WebhookResponse:
    """The answer to a delivery: ``status``, ``headers`` (``content-type`` included)
    and ``body``, a JSON object; :attr:`content` is the body encoded."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: dict[str, Any]

    @property
    def content(self) -> bytes:
        """The body as compact UTF-8 JSON."""
        return _ENCODE(self.body).encode()


def _answer(status: int, body: dict[str, Any], *headers: tuple[str, str]) -> WebhookResponse:
    return WebhookResponse(status, (("content-type", "application/json"), *headers), body)


def _problem(
    status: int, code: str, detail: str, headers: Iterable[tuple[str, str]] = (), **extra: Any
) -> WebhookResponse:
    """An RFC 9457 problem (as :func:`retrysafe._http.problems.problem`) as a WebhookResponse."""
    if code in _PROBLEM_TITLES:
        extra["title"] = _PROBLEM_TITLES[code]
    made = problem(status, code, detail, headers=headers, **extra)
    kept = tuple((k, v) for k, v in made.headers if k != "content-length")
    return WebhookResponse(status, kept, json.loads(made.body))


def _refused(exc: IdempotencyError) -> WebhookResponse:
    """The answer when the engine would not start the handler (nothing ran)."""
    if isinstance(exc, InProgressError):
        return _problem(
            409,
            exc.code,
            "this event is being processed by another delivery; retry later",
            [retry_after_header(exc.retry_after)],
            retry_after=exc.retry_after,
        )
    if isinstance(exc, StoreUnavailableError):
        log.error("retrysafe: store unavailable, webhook answered 503: %s", exc)
        return _problem(
            503,
            exc.code,
            "the idempotency store cannot be reached; deliver the event again",
            [retry_after_header(exc.retry_after)],
        )
    raise exc


def _too_large(limit: int) -> WebhookResponse:
    return _problem(413, "idempotency_body_too_large", f"the delivery is over {limit} bytes")


def _crashed(detail: str) -> WebhookResponse:
    """A 500 that tells the provider to deliver again; the exception stays in the log."""
    return _problem(500, "webhook_handler_failed", detail)


def _key_field(value: str) -> str:
    """``value`` as a field of a key: itself, or ``sha256-`` and a hash of it when it
    holds a character a key field may not (``:``, braces, spaces, non-ASCII) or is long.

    A provider's own id is kept readable; any other is still one key per value.
    """
    if _KEY_FIELD.fullmatch(value):
        return value
    return "sha256-" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:40]


#: Schemes whose event id is a header their signature does not cover.
_UNSIGNED_IDS = frozenset({"shopify", "hmac"})


def _body_id(body: bytes) -> str:
    """The id of a delivery by what is signed: its body's SHA-256 (as a key field)."""
    return "sha256-" + hashlib.sha256(body).hexdigest()[:40]


def _transaction_of(given: Any) -> tuple[str, str] | None:
    if given is None:
        return None
    if (
        isinstance(given, (tuple, list))
        and len(given) == 2
        and all(type(part) is str and part for part in given)
    ):
        return given[0], given[1]
    raise TypeError(
        "transaction= must return (transaction_id, event_type), two non-empty str, or None; "
        f"not {given!r:.80}"
    )


class _DeliveryOptions(TypedDict):
    """The engine options of one kind of delivery (the rest come per delivery)."""

    operation: str
    ttl: float | None
    lease: float | None
    retention: str


class Receiver:
    """Webhooks exactly once: verify the signature, deduplicate by event, run ``handler``.

    ::

        receiver = Receiver("redis://localhost:6379/0", scheme="stripe",
                            secrets=["whsec_new", "whsec_old"], handler=on_event)
        answer = receiver.handle(request.headers, raw_body)   # a WebhookResponse

    ``store``: a :class:`~retrysafe.stores.Store`, a store URL or an
    :class:`~retrysafe.Engine`. ``scheme`` and ``secrets`` are those of
    :func:`verify` (several secrets while one is rotated). ``handler(delivery)``
    gets a :class:`Delivery`, may be sync or async, and returns a JSON value
    (or None): it is stored and sent back to the provider. ``source`` names the
    provider in the keys (default: the scheme): give two endpoints of one
    provider two sources. ``transaction``: for a payment gateway, a callable
    ``transaction(delivery) -> (transaction_id, event_type)`` (or None for an
    event about no transaction): the key is then
    ``webhook:{source}:{transaction_id}:{event_type}`` and each event type of a
    transaction is handled once, whatever event ids the gateway sends it under
    (``transaction`` sees the delivery before its key is made: ``key`` is "").
    ``tolerance``: seconds a signed timestamp may be from now (default 300).
    ``ttl`` (default the Idempotency Map's, 24 h) and ``lease`` (30 s, renewed
    while the handler runs) are the records'. ``max_body``: larger deliveries
    get 413.

    Deliveries are deduplicated by their key alone: a redelivery is re-signed
    (new timestamp, new signature) and its body may differ (Stripe's
    ``pending_webhooks`` counts down), so neither is fingerprinted.

    Shopify and the generic ``hmac`` scheme sign the body only: their event-id
    header is not signed, and whoever captured one delivery could resend it
    under new ids (each handled again) or under an id the provider will use
    later (the real event then dropped as a duplicate). So for them the key's
    event id is the SHA-256 of the signed body (``sha256-…``), and the header's
    id is kept as the record's request id and the delivery's ``event_id``.
    ``trust_event_ids=True`` keys by the header instead: only behind a transport
    that no one else can send through.
    """

    def __init__(
        self,
        store: Store[Any] | Engine | str | None = None,
        *,
        scheme: str,
        secrets: str | bytes | Iterable[str | bytes],
        handler: Callable[[Delivery], Any],
        source: str | None = None,
        transaction: Callable[[Delivery], tuple[str, str] | None] | None = None,
        tolerance: float | None = None,
        ttl: float | None = None,
        lease: float | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        trust_event_ids: bool = False,
    ) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown webhook scheme {scheme!r}: one of {', '.join(SCHEMES)}")
        try:
            self._secrets = _secrets(secrets)
            if scheme == "standard":
                for secret in self._secrets:
                    _standard_key(secret)
        except SignatureError as exc:
            raise ValueError(str(exc)) from None
        if not callable(handler):
            raise TypeError(f"handler must be callable, not {type(handler).__name__}")
        if transaction is not None and not callable(transaction):
            raise TypeError("transaction must be a callable taking the delivery (or None)")
        if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 0:
            raise ValueError(f"max_body must be a number of bytes >= 0, not {max_body!r}")
        self.scheme = scheme
        self.source = scheme if source is None else source
        self.handler, self.transaction = handler, transaction
        self.tolerance = DEFAULT_TOLERANCE if tolerance is None else float(tolerance)
        if not self.tolerance >= 0:
            raise ValueError("tolerance must be >= 0 seconds")
        self.max_body = max_body
        self._body_ids = scheme in _UNSIGNED_IDS and not trust_event_ids
        self._async = is_async(handler)
        if type(self.source) is not str or not _SOURCE.fullmatch(self.source):
            raise ValueError(
                f"source must be 1-64 letters, digits, '_', '.' or '-', not {self.source!r}"
            )
        imap = self._map = IdempotencyMap.default()
        self.engine = engine_for(store, ttl=ttl, lease=lease)
        # Every option as each delivery uses it, checked now (TypeError, ValueError); no I/O.
        self._options: dict[str, _DeliveryOptions] = {}
        for name in ("webhook", "payment_webhook"):
            op = imap.operation(name)
            options: _DeliveryOptions = {
                "operation": name,
                "ttl": op.ttl if ttl is None else ttl,
                "lease": op.lease if lease is None else lease,
                "retention": op.retention,
            }
            self.engine.attempt("-", **options)
            self._options[name] = options
        self._final = imap.operation("webhook").final_failures

    def __repr__(self) -> str:  # (never the secrets)
        return f"<Receiver scheme={self.scheme} source={self.source} engine={self.engine!r}>"

    # -- the decision core: plain code, no I/O ------------------------------------------

    def _delivery(self, headers: Any, body: bytes) -> Delivery | WebhookResponse:
        """The authentic delivery with its key, or the answer instead (401, 413, 500)."""
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise TypeError("body must be the raw request bytes, as received")
        if len(body) > self.max_body:
            return _too_large(self.max_body)
        h = Headers(headers)
        body = bytes(body)
        try:
            event_id, _ = _verify(self.scheme, h, body, self._secrets, self.tolerance, None)
        except SignatureError as exc:
            log.warning("retrysafe: webhook from %s refused (%s): %s", self.source, exc.reason, exc)
            return _problem(401, exc.code, str(exc), reason=exc.reason)
        delivery = Delivery(event_id, self.source, "", h, body)
        if self.transaction is None:
            found = None
        else:
            try:
                found = _transaction_of(self.transaction(delivery))
            except Exception:
                log.exception("retrysafe: transaction= failed on webhook %s", event_id)
                return _crashed("the event's transaction could not be read; nothing was stored")
        if found is None:
            signed = _body_id(body) if self._body_ids else _key_field(event_id)
            key = self._map.key("webhook", source=self.source, event_id=signed)
        else:
            key = self._map.key(
                "payment_webhook",
                gateway=self.source,
                transaction_id=_key_field(found[0]),
                event_type=_key_field(found[1]),
            )
            return Delivery(event_id, self.source, key, h, body, *found)
        return Delivery(event_id, self.source, key, h, body)

    def _attempt(self, delivery: Delivery) -> Attempt:
        metadata: dict[str, Any] = {"source": delivery.source, "event_id": delivery.event_id}
        if delivery.transaction_id is None:
            options = self._options["webhook"]
        else:
            options = self._options["payment_webhook"]
            metadata["transaction_id"] = delivery.transaction_id
            metadata["event_type"] = delivery.event_type
        return self.engine.attempt(
            delivery.key, **options, request_id=delivery.event_id, metadata=metadata
        )

    def _outcome(self, delivery: Delivery, result: Any) -> tuple[WebhookResponse, Outcome | None]:
        """The answer to the handler's ``result``, and the outcome to store (None: the
        result cannot be stored, and the attempt is failed finally)."""
        try:
            outcome = Outcome.json(result)
        except (TypeError, ValueError, RecursionError) as exc:
            why = f"is not a JSON value ({exc})"
        else:
            if len(outcome.body) <= self.engine.max_body:
                body = {"status": "processed", "event_id": delivery.event_id}
                return _answer(200, {**body, "result": outcome.value}), outcome
            why = f"is {len(outcome.body)} bytes, over the {self.engine.max_body} kept"
        log.error(
            "retrysafe: the handler of webhook %s ran but its result %s; it is not run again "
            "for this event (redeliveries get 200 duplicate)",
            delivery.key,
            why,
        )
        return _problem(
            500,
            "webhook_result_invalid",
            "the event was handled but the handler's result cannot be stored; "
            "it is not handled again",
        ), None

    @staticmethod
    def _replayed(delivery: Delivery, replay: Replay) -> WebhookResponse:
        """A delivery of an event already handled: the stored result, handler not run."""
        outcome = None if replay.failed else replay.outcome
        return _answer(
            200,
            {
                "status": "duplicate",
                "event_id": delivery.event_id,
                "original_event_id": replay.record.request_id,
                "result": None if outcome is None else outcome.value,
            },
            REPLAYED,
        )

    def _failed(self, delivery: Delivery, exc: Exception) -> WebhookResponse:
        log.error(
            "retrysafe: the handler of webhook %s failed; the next delivery runs it again",
            delivery.key,
            exc_info=exc,
        )
        return _crashed("the event could not be handled; deliver it again")

    # -- sync -------------------------------------------------------------------------

    def handle(
        self, headers: Mapping[str, Any] | Iterable[tuple[Any, Any]], body: bytes
    ) -> WebhookResponse:
        """The answer to one delivery: ``headers`` (any mapping or list of pairs, str or
        bytes) and the raw ``body``. Never raises for a delivery (every outcome is an
        answer); an async handler runs in an event loop of its own (use :meth:`ahandle`
        from async code)."""
        if self._async and _loop_running():
            raise RuntimeError("this receiver's handler is async: await receiver.ahandle()")
        delivery = self._delivery(headers, body)
        if isinstance(delivery, WebhookResponse):
            return delivery
        entered = False
        try:
            with self._attempt(delivery) as att:
                entered = True
                if att.replay is not None:
                    return self._replayed(delivery, att.replay)
                with renewing(att):
                    try:
                        result = self._run(delivery)
                    except Exception as exc:
                        record(att, None, final=self._final, answer=_ANSWER)
                        return self._failed(delivery, exc)
                answer, outcome = self._outcome(delivery, result)
                record(att, outcome, final=True, answer=_ANSWER)
                return answer
        except IdempotencyError as exc:
            if entered:
                raise
            return _refused(exc)

    def _run(self, delivery: Delivery) -> Any:
        result = self.handler(delivery)
        if inspect.isawaitable(result):
            return asyncio.run(_awaited(result))
        return result

    def close(self) -> None:
        """Close the engine's store."""
        self.engine.close()

    # -- async: the same shells with await ------------------------------------------------

    async def ahandle(
        self, headers: Mapping[str, Any] | Iterable[tuple[Any, Any]], body: bytes
    ) -> WebhookResponse:
        """Async :meth:`handle`: an async handler runs on the loop, a plain one in a
        worker thread."""
        delivery = self._delivery(headers, body)
        if isinstance(delivery, WebhookResponse):
            return delivery
        entered = False
        try:
            async with self._attempt(delivery) as att:
                entered = True
                if att.replay is not None:
                    return self._replayed(delivery, att.replay)
                with renewing(att):
                    try:
                        result = await self._arun(delivery)
                    except Exception as exc:
                        await arecord(att, None, final=self._final, answer=_ANSWER)
                        return self._failed(delivery, exc)
                answer, outcome = self._outcome(delivery, result)
                await arecord(att, outcome, final=True, answer=_ANSWER)
                return answer
        except IdempotencyError as exc:
            if entered:
                raise
            return _refused(exc)

    async def _arun(self, delivery: Delivery) -> Any:
        if self._async:
            result = self.handler(delivery)
        else:
            result = await asyncio.to_thread(self.handler, delivery)
        return await result if inspect.isawaitable(result) else result

    async def aclose(self) -> None:
        """Close the store's connections of the running event loop."""
        await self.engine.aclose()

    # -- adapters ---------------------------------------------------------------------------

    @functools.cached_property
    def asgi(self) -> ASGIApp:
        """An ASGI app that receives deliveries (POST; any path), lifespan included.

        An object, not a function, so that Starlette's ``Route`` (FastAPI's
        ``add_route``) serves it as an ASGI app at an exact path.
        """
        return _ReceiverApp(self)

    async def _asgi_answer(self, scope: Scope, receive: Receive) -> WebhookResponse | None:
        if scope["method"] != "POST":
            return _not_post()
        try:  # (the limit holds while reading: a body is never read far past it)
            body = await read_body(receive, at_most(self.max_body))
        except BodyTooLarge:
            return _too_large(self.max_body)
        if body is None:
            return None  # the provider hung up: it delivers again
        return await to_the_end(self.ahandle(scope["headers"], body))

    @functools.cached_property
    def wsgi(self) -> Callable[[dict[str, Any], Callable[..., Any]], list[bytes]]:
        """A WSGI app that receives deliveries (POST; any path)."""

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
            answer = self._wsgi_answer(environ)
            content = answer.content
            headers = [*answer.headers, ("content-length", str(len(content)))]
            start_response(status_line(answer.status), headers)
            return [content]

        return app

    def _wsgi_answer(self, environ: dict[str, Any]) -> WebhookResponse:
        if environ.get("REQUEST_METHOD") != "POST":
            return _not_post()
        try:
            body = read_wsgi_body(environ, _Limit(self.max_body))
        except BodyError as exc:
            return _problem(exc.status, exc.code, str(exc))
        return self.handle(environ_headers(environ), body)


class _ReceiverApp:
    """:attr:`Receiver.asgi`."""

    __slots__ = ("receiver",)

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self.receiver.aclose)
        elif scope["type"] == "http":
            answer = await self.receiver._asgi_answer(scope, receive)
            if answer is not None:
                await send_answer(
                    send, Response.sized(answer.status, answer.headers, answer.content)
                )


class _Limit:
    """The request-size check :func:`retrysafe._http.wsgi.read_body` asks of its policy."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def check_length(self, length: int) -> None:
        if length > self.limit:
            raise BodyError(
                f"the delivery is over {self.limit} bytes",
                status=413,
                code="idempotency_body_too_large",
            )


def _not_post() -> WebhookResponse:
    return _problem(405, "method_not_allowed", "deliver webhooks with POST", [("allow", "POST")])


async def _awaited(result: Awaitable[Any]) -> Any:
    return await result


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
