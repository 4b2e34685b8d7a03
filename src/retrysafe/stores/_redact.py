"""Passwords out of store URLs and connection strings, for messages and logs."""

from __future__ import annotations

import re
from urllib.parse import quote, unquote_plus

__all__ = ["redact", "redact_in"]

MASK = "***"

#: A parameter whose value is a secret: ``password``, ``sslpassword``,
#: ``redis_password``, ``passwd``, ``pwd``, ``secret``, ``token``...
_SECRET_NAME = r"[\w.-]*(?:passw(?:or)?d|pwd|secret|token)[\w.-]*"
_SECRET = re.compile(_SECRET_NAME, re.IGNORECASE)
#: libpq's keyword form, ``host=h password=pw`` or ``password = 'p w\'s'``: a bare
#: value runs to the next space, a quoted one to its closing quote.
_KEYWORD = re.compile(
    rf"(?<![\w.-])({_SECRET_NAME}\s*=\s*)('(?:[^'\\]|\\.?)*'?|\S*)", re.IGNORECASE
)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
#: A URL nested in a parameter's value (a Redis store's ``archive=``), plain or encoded.
_NESTED_VALUE = re.compile(r"=[A-Za-z][A-Za-z0-9+.-]*(?:://|%3A%2F%2F)", re.IGNORECASE)


def redact(url: str) -> str:
    """``url`` with every password replaced by ``***`` (for messages and logs).

    Covers the userinfo of a URL (``redis://u:pa/ss@h``, ``u:p@ss@h``: the
    userinfo ends at the last ``@`` before the host), query parameters named
    like a secret (``password=``, ``sslpassword=``, ``redis_password=``, ``token=``...),
    URLs nested in a parameter, plain or percent-encoded (``?archive=``), and
    libpq's keyword form (``host=h password='p w'``). When in doubt it hides
    more than the password, never less.
    """
    return _redact(url, [])


def redact_in(text: str, url: str) -> str:
    """``text`` (a driver's message about ``url``) without any password of ``url``.

    For errors that quote a piece of the URL, such as libpq's
    ``invalid percent-encoded token: "s3cr%zzet"``.
    """
    found: list[str] = []
    _redact(url, found)
    for secret in sorted({s for f in found for s in (f, unquote_plus(f)) if s}, key=len)[::-1]:
        text = text.replace(secret, MASK)
    return text


def _redact(url: str, found: list[str]) -> str:
    """:func:`redact`, adding each value it hides to ``found``."""

    def keyword(match: re.Match[str]) -> str:
        found.append(match.group(2).strip("'"))
        return f"{match.group(1)}{MASK}"

    scheme, sep, rest = url.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        return _KEYWORD.sub(keyword, url)
    nested = _NESTED_VALUE.search(rest)
    head = rest[: nested.start()] if nested else rest
    at = head.rfind("@")
    if at >= 0 and not head.startswith("/"):
        user, colon, password = head[:at].partition(":")
        if colon:
            found.append(password)
            rest = f"{user}:{MASK}{rest[at:]}"
    base, question, query = rest.partition("?")
    if question:
        pieces = query.split("&")
        for i, piece in enumerate(pieces):
            name, _, value = piece.partition("=")
            if "://" in value and not _SECRET.fullmatch(unquote_plus(name).strip()):
                # A plain nested URL runs to the end: its own & and @ are part of it.
                pieces[i:] = [f"{name}={_redact('&'.join([value, *pieces[i + 1 :]]), found)}"]
                break
            pieces[i] = _param(piece, found)
        query = "&".join(pieces)
    return f"{scheme}://{base}{question}{query}"


def _param(piece: str, found: list[str]) -> str:
    name, eq, value = piece.partition("=")
    if not eq:
        return piece
    if _SECRET.fullmatch(unquote_plus(name).strip()):
        found.append(value)
        return f"{name}={MASK}"
    decoded = unquote_plus(value)
    if "://" not in decoded:
        return piece
    hidden = _redact(decoded, found)  # a percent-encoded nested URL
    return piece if hidden == decoded else f"{name}={quote(hidden, safe=':/@*')}"
