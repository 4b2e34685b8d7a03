"""Webhooks: verify a delivery's signature, then deduplicate it by its event id.

::

    from retrysafe.webhooks import verify, SignatureError

    event_id = verify("stripe", request.headers, raw_body, ["whsec_new", "whsec_old"])

:func:`verify` is one plain function for every scheme. It returns the
delivery's event id (the deduplication key) or raises :class:`SignatureError`
(a :class:`~retrysafe.IdempotencyError`); it never stores anything. Every
comparison of a signature is in constant time, and several secrets may be given
at once, so a secret can be rotated without dropping deliveries.

Schemes:

* ``"shopify"``: ``X-Shopify-Hmac-Sha256``, the base64 HMAC-SHA256 of the raw
  body. Event id: ``X-Shopify-Event-Id`` (the same for every retry of an
  event), else ``X-Shopify-Webhook-Id``. No timestamp is signed.
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
  id: ``X-Event-Id``, ``X-Webhook-Id`` or ``X-GitHub-Delivery``, else the SHA-256
  of the body (identical redeliveries share it). No timestamp: no replay window.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._errors import IdempotencyError

__all__ = ["SCHEMES", "SignatureError", "verify"]

#: Seconds a signed timestamp may be away from now (Stripe's and Standard Webhooks' default).
DEFAULT_TOLERANCE = 300.0


class SignatureError(IdempotencyError):
    """The delivery is not signed by a known secret, or is malformed or too old.

    Nothing was stored. ``reason`` is a short machine word: ``missing_header``,
    ``malformed_header``, ``bad_signature``, ``timestamp_out_of_tolerance``,
    ``no_event_id``, ``bad_secret`` or ``unknown_scheme``.
    """

    code = "webhook_signature_invalid"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Headers:
    """Case-insensitive lookup over any mapping (or list of pairs) of headers."""

    def __init__(self, headers: Mapping[str, Any] | Iterable[tuple[Any, Any]]) -> None:
        items = headers.items() if isinstance(headers, Mapping) else headers
        self._values: dict[str, str] = {}
        for name, value in items:
            key = (name.decode("latin-1") if isinstance(name, bytes) else str(name)).lower()
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            self._values.setdefault(key, text.strip())

    def get(self, *names: str) -> str | None:
        for name in names:
            value = self._values.get(name.lower())
            if value:
                return value
        return None

    def need(self, name: str) -> str:
        value = self.get(name)
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


def _check_time(timestamp: str, tolerance: float, now: float) -> None:
    try:
        signed = int(timestamp)
    except ValueError:
        raise SignatureError(
            f"the signed timestamp {timestamp[:40]!r} is not a number", reason="malformed_header"
        ) from None
    if abs(now - signed) > tolerance:
        raise SignatureError(
            f"the signed timestamp is {abs(now - signed):.0f} s from now "
            f"(tolerance {tolerance:g} s): a replay or a skewed clock",
            reason="timestamp_out_of_tolerance",
        )


# -- the schemes ---------------------------------------------------------------------


def _shopify(h: _Headers, body: bytes, secrets: list[str | bytes], tol: float, now: float) -> str:
    given = _b64(h.need("X-Shopify-Hmac-Sha256"))
    if given is None:
        raise SignatureError("X-Shopify-Hmac-Sha256 is not base64", reason="malformed_header")
    _check(map(_raw, secrets), body, [given])
    event = h.get("X-Shopify-Event-Id", "X-Shopify-Webhook-Id")
    if event is None:
        raise SignatureError(
            "neither X-Shopify-Event-Id nor X-Shopify-Webhook-Id is present", reason="no_event_id"
        )
    return event


def _stripe(h: _Headers, body: bytes, secrets: list[str | bytes], tol: float, now: float) -> str:
    header = h.need("Stripe-Signature")
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
    signed = timestamp.encode() + b"." + body
    _check(map(_raw, secrets), signed, signatures)
    _check_time(timestamp, tol, now)  # after the signature: the timestamp is authentic
    try:
        event = json.loads(body)
    except ValueError:
        event = None
    event_id = event.get("id") if isinstance(event, dict) else None
    if not isinstance(event_id, str) or not event_id:
        raise SignatureError("the Stripe event has no id", reason="no_event_id")
    return event_id


def _standard_key(secret: str | bytes) -> bytes:
    if isinstance(secret, bytes):
        return secret
    key = _b64(secret.removeprefix("whsec_"))
    if key is None:
        raise SignatureError(
            "a Standard Webhooks secret is whsec_ followed by base64", reason="bad_secret"
        )
    return key


def _standard(h: _Headers, body: bytes, secrets: list[str | bytes], tol: float, now: float) -> str:
    event_id = h.need("webhook-id")
    timestamp = h.need("webhook-timestamp")
    given = []
    for item in h.need("webhook-signature").split():
        version, _, value = item.partition(",")
        if version == "v1" and (sig := _b64(value)) is not None:
            given.append(sig)
    if not given:
        raise SignatureError(
            "webhook-signature holds no v1,<base64> signature", reason="malformed_header"
        )
    signed = f"{event_id}.{timestamp}.".encode() + body
    _check(map(_standard_key, secrets), signed, given)
    _check_time(timestamp, tol, now)
    return event_id


def _generic(h: _Headers, body: bytes, secrets: list[str | bytes], tol: float, now: float) -> str:
    header = h.get("X-Signature", "X-Hub-Signature-256")
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
    event = h.get("X-Event-Id", "X-Webhook-Id", "X-GitHub-Delivery")
    return event if event is not None else "sha256:" + hashlib.sha256(body).hexdigest()


_Scheme = Callable[[_Headers, bytes, list[str | bytes], float, float], str]

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
) -> str:
    """The event id of a delivery whose signature checks out; :class:`SignatureError` else.

    ``headers``: any mapping (or list of pairs), looked up case-insensitively.
    ``body``: the raw bytes as received (never re-serialized JSON). ``secrets``:
    one or several (rotation). ``tolerance``: seconds a signed timestamp may be
    from ``now`` (default 300; schemes without a timestamp ignore it). ``now``:
    seconds since the epoch (default: the clock).
    """
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
    return check(
        _Headers(headers), bytes(body), _secrets(secrets), tol, time.time() if now is None else now
    )
