"""Who the caller is: the principal whose records a keyed request may read and write.

Every front door names the caller by the same rules, first answer wins: the
``principal=`` callable, the framework's authenticated identity, every
credential the request carries, else anonymous (``anonymous`` decides). A
``principal=`` callable that returns :data:`ANONYMOUS` says the caller is
unauthenticated: ``anonymous`` decides at once, whatever the request carries. Records
keep an HMAC of the principal under the deployment secret, never a credential.
The decision table per door: docs/principals.md. No I/O here.
"""

from __future__ import annotations

import enum
import logging
import urllib.parse
import warnings
from collections.abc import Callable, Collection, Iterable
from typing import Any, Final, Literal, NamedTuple

from retrysafe._core.metrics import METRICS
from retrysafe._core.secret import Secret
from retrysafe.errors import AmbiguousCredentialsError, PrincipalRequiredError

__all__ = [
    "ANONYMOUS",
    "ANONYMOUS_MODES",
    "DEFAULT_PRINCIPAL_HEADERS",
    "LONE_BYTES",
    "LONE_CACHED",
    "NOBODY",
    "NOT_IDENTITY_COOKIES",
    "PUBLIC",
    "SESSION_HINTS",
    "Anonymous",
    "NoPrincipal",
    "Principal",
    "PrincipalFn",
    "Principals",
    "asgi_user",
    "is_identity_cookie",
    "principal_option",
    "unscoped",
]

log = logging.getLogger("retrysafe.http")

Anonymous = Literal["run", "refuse", "share"]
ANONYMOUS_MODES: tuple[str, ...] = ("run", "refuse", "share")

#: Headers whose values are credentials, besides every ``Authorization`` line
#: (which always counts). ``principal_headers=`` replaces this list.
DEFAULT_PRINCIPAL_HEADERS: tuple[str, ...] = (
    "Proxy-Authorization",
    "X-API-Key",
    "Api-Key",
    "X-Api-Token",
    "X-Auth-Token",
    "X-Access-Token",
    "X-Session-Token",
    "X-User-Token",
)

#: Cookies that never name a caller, by the default rule (lower case, without a
#: ``__Host-`` or ``__Secure-`` prefix): analytics, consent, CSRF, load balancing
#: and display preferences. They change between retries without the session
#: changing, so counting them would run a retry twice.
NOT_IDENTITY_COOKIES: frozenset[str] = frozenset(
    {
        # analytics and advertising
        "_ga",
        "_gid",
        "_gat",
        "__utma",
        "__utmb",
        "__utmc",
        "__utmt",
        "__utmz",
        "__utmv",
        "amp_token",
        "_fbp",
        "_fbc",
        "_clck",
        "_clsk",
        "_uetsid",
        "_uetvid",
        "muid",
        "ajs_anonymous_id",
        "ajs_user_id",
        "ajs_group_id",
        "hubspotutk",
        "__hstc",
        "__hssc",
        "__hssrc",
        "_ttp",
        "__stripe_mid",
        "__stripe_sid",
        "_pin_unauth",
        # consent
        "cookieconsent_status",
        "cookieconsent",
        "optanonconsent",
        "optanonalertboxclosed",
        "euconsent-v2",
        "cookie_consent",
        # CSRF: a per-browser token, not an identity (some frameworks rotate it on every answer)
        "csrftoken",
        "xsrf-token",
        "_csrf",
        "csrf_token",
        "csrf",
        # load balancers and edge
        "awsalb",
        "awsalbcors",
        "awselb",
        "awsalbtg",
        "awsalbtgcors",
        "arraffinity",
        "arraffinitysamesite",
        "__cf_bm",
        "cf_clearance",
        "__cflb",
        "_cfuvid",
        "serverid",
        "route",
        "routeid",
        # display preferences
        "django_language",
        "lang",
        "language",
        "locale",
        "theme",
        "timezone",
        "tz",
    }
)
#: Name prefixes of cookies that never name a caller (lower case).
NOT_IDENTITY_PREFIXES: tuple[str, ...] = (
    "_ga_",
    "_gat_",
    "_gcl_",
    "_gac_",
    "_hj",
    "mp_",
    "amp_",
    "amplitude_id",
    "_pk_",
    "mtm_",
    "intercom-",
    "optimizely",
    "bigipserver",
    "_dc_gtm_",
)


#: Parts of the names of session cookies (lower case): ``sessionid``, ``PHPSESSID``,
#: ``connect.sid``, ``_app_session``, ``.ASPXAUTH``, ``next-auth.session-token``,
#: ``remember_web_*``, ``wordpress_logged_in_*``. By the default rule, cookies alone
#: name a caller only if one of them is a session cookie.
SESSION_HINTS: tuple[str, ...] = (
    "sess",
    "sid",
    "auth",
    "token",
    "jwt",
    "login",
    "logged",
    "remember",
    "identity",
    "sso",
)


def _bare(name: str) -> str:
    name = name.strip().lower()
    for prefix in ("__host-", "__secure-"):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def is_identity_cookie(name: str) -> bool:
    """Whether a cookie may name the caller by the default rule (:data:`NOT_IDENTITY_COOKIES`)."""
    name = _bare(name)
    return not (name in NOT_IDENTITY_COOKIES or name.startswith(NOT_IDENTITY_PREFIXES))


def _is_session(name: str) -> bool:
    """Whether a cookie (one that may name the caller) looks like a session cookie."""
    name = _bare(name)
    return any(hint in name for hint in SESSION_HINTS)


class Principal(NamedTuple):
    """Who sent a request: ``kind`` (``user``, ``principal``, ``credentials`` or
    ``public``) and what names them (an identity, or the canonical credentials)."""

    kind: str
    material: str

    def scope(self, secret: Secret | bytes) -> str:
        """The record scope: ``kind:`` and 32 hex digits of an HMAC-SHA256 under the
        deployment ``secret``."""
        if not isinstance(secret, Secret):
            secret = Secret(secret)
        text = f"{len(self.kind)}:{self.kind}{self.material}"
        return f"{self.kind}:{secret.hmac(text.encode('utf-8', 'surrogatepass'))[:32]}"


#: The principal of anonymous callers that opted in to sharing (``anonymous="share"``).
PUBLIC = Principal("public", "")
#: What :meth:`Principals.named` gives for a caller the ``principal=`` callable
#: called :data:`ANONYMOUS` when ``anonymous="run"``: run without a record.
NOBODY = Principal("anonymous", "")


class NoPrincipal(enum.Enum):
    """The type of :data:`ANONYMOUS`."""

    ANONYMOUS = "anonymous"


#: What a ``principal=`` callable returns for an unauthenticated caller: no
#: fallback to the framework's user or the request's credentials; ``anonymous``
#: decides (``"run"``: the request runs without a record).
ANONYMOUS: Final = NoPrincipal.ANONYMOUS

#: A ``principal=`` callable: the caller's identity, None to let the default rules
#: decide, or :data:`ANONYMOUS` for an unauthenticated caller.
PrincipalFn = Callable[[Any], "str | NoPrincipal | None"]


def principal_option(
    principal: PrincipalFn | None, scope: PrincipalFn | None, *, native: bool
) -> PrincipalFn | None:
    """The ``principal=`` callable, from ``scope=`` (its old name, deprecated) if given.

    ``native``: the old ``scope=`` took the ASGI scope itself (Mesh, A2A), so it is
    called with the request's ``native`` object.
    """
    if scope is None:
        return principal
    if principal is not None:
        raise TypeError("give principal= only (scope= is its old name)")
    if not callable(scope):
        raise TypeError("scope must be a callable (it is now called principal=)")
    warnings.warn(
        "scope= is now called principal= and takes the request (retrysafe.http.HttpRequest); "
        "a None answer now lets the default rules name the caller",
        DeprecationWarning,
        stacklevel=3,
    )
    if native:
        return lambda request: scope(request.native)
    return scope


def _names(value: Collection[str] | str, option: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise TypeError(f"{option} must be a list of non-empty names, not {value!r}")
    return tuple(dict.fromkeys(n.strip().lower() for n in names))


#: How many principals of lone credentials :meth:`Principals.lone` keeps, and the
#: longest credential it keeps (longer ones are worked out each time).
LONE_CACHED = 1024
LONE_BYTES = 512


class Principals:
    """The principal options every HTTP front door takes, validated once.

    ``principal``: a callable over the request (see the module docstring);
    ``principal_headers``: headers carrying credentials besides ``Authorization``
    (default :data:`DEFAULT_PRINCIPAL_HEADERS`); ``principal_cookies``: the
    session cookies' names (default None: every cookie but those that never
    name a caller, :func:`is_identity_cookie`); ``principal_query``: query
    parameters carrying credentials (default none); ``anonymous``: what a
    request without any gets (``"run"``, ``"refuse"`` or ``"share"``).
    """

    __slots__ = (
        "_lone",
        "anonymous",
        "cookies",
        "environ_names",
        "fn",
        "header_set",
        "headers",
        "lone_names",
        "query",
        "raw_names",
    )

    def __init__(
        self,
        *,
        principal: PrincipalFn | None = None,
        principal_headers: Collection[str] | None = None,
        principal_cookies: Collection[str] | None = None,
        principal_query: Collection[str] | None = None,
        anonymous: Anonymous | None = None,
    ) -> None:
        if principal is not None and not callable(principal):
            raise TypeError("principal must be a callable taking the request (or None)")
        self.fn = principal
        headers = _names(
            DEFAULT_PRINCIPAL_HEADERS if principal_headers is None else principal_headers,
            "principal_headers",
        )
        # Authorization always counts, and cookies by the cookie rule: not twice.
        self.headers = tuple(h for h in headers if h not in ("authorization", "cookie"))
        #: Every credential header (lower case), ``authorization`` included.
        self.header_set = frozenset(("authorization", *self.headers))
        self.cookies = (
            None
            if principal_cookies is None
            else frozenset(_names(principal_cookies, "principal_cookies"))
        )
        self.query = frozenset(_names(principal_query or (), "principal_query"))
        if anonymous is None:
            anonymous = "run"
        if anonymous not in ANONYMOUS_MODES:
            raise ValueError(f'anonymous must be "run", "refuse" or "share", not {anonymous!r}')
        self.anonymous: Anonymous = anonymous
        #: The raw (ASGI) names of every header read: credentials and cookies.
        self.raw_names = frozenset(
            n.encode("latin-1") for n in ("authorization", "cookie", *self.headers)
        )
        #: The raw names of the credential headers (``authorization`` included, cookies not).
        self.lone_names = frozenset(n.encode("latin-1") for n in ("authorization", *self.headers))
        self._lone: dict[tuple[bytes, bytes], Principal] = {}
        #: (lower-case name, WSGI environ name) of each credential header.
        self.environ_names = tuple(
            (n, "HTTP_" + n.upper().replace("-", "_")) for n in ("authorization", *self.headers)
        )

    def describe(self) -> str:
        """One line saying how callers are told apart (for a server's start-up lines)."""
        headers = ", ".join(["Authorization", *self.headers])
        cookies = (
            "all but analytics and the like"
            if self.cookies is None
            else (", ".join(sorted(self.cookies)) or "none")
        )
        said = f"by their credentials: headers {headers}; cookies {cookies}"
        if self.query:
            said += f"; query {', '.join(sorted(self.query))}"
        return f"{said}; without any: {self.anonymous}"

    # -- the decision -----------------------------------------------------------------

    def identify(
        self,
        request: Callable[[], Any],
        user: Callable[[], str | None],
        headers: Iterable[tuple[str, str]],
        query: str,
    ) -> Principal | None:
        """The principal of a request, or None when it is anonymous and may run unrecorded.

        ``request()`` builds the :class:`~retrysafe.http.HttpRequest` for the
        ``principal`` callable; ``user()`` gives the framework's authenticated
        identity (None: none), read only when the callable does not decide;
        ``headers`` are the request's (lower-case name, value) pairs of
        ``Authorization``, ``Cookie`` and the principal headers (others are
        ignored); ``query`` is the raw query string.

        Raises :class:`~retrysafe.AmbiguousCredentialsError` for two different
        values of one credential header, and
        :class:`~retrysafe.PrincipalRequiredError` for an anonymous request
        when ``anonymous="refuse"``.
        """
        who = self.named(request)
        if who is None:
            return self.others(user(), headers, query)
        return None if who is NOBODY else who

    def named(self, request: Callable[[], Any]) -> Principal | None:
        """Rule 1: what the ``principal`` callable says; None (or a blank str): it does
        not decide. :data:`ANONYMOUS`: what ``anonymous`` gives (:data:`NOBODY` for
        ``"run"``), with no fallback to the other rules."""
        if self.fn is None:
            return None
        named = self.fn(request())
        if named is None:
            return None
        if not isinstance(named, str):
            if named is ANONYMOUS:
                return self.absent("the principal= callable says this caller is unauthenticated")
            raise TypeError(
                "principal= must return a str, None or retrysafe.http.ANONYMOUS, "
                f"not {type(named).__name__}"
            )
        named = str(named)
        return Principal("principal", named) if named.strip() else None

    def others(
        self, user: str | None, headers: Iterable[tuple[str, str]], query: str
    ) -> Principal | None:
        """Rules 2 to 4: the framework's user, the credentials, else ``anonymous``."""
        if user is not None:
            return Principal("user", user)
        found = self.credentials(headers, query)
        if found is not None:
            return found
        if self.anonymous == "share":
            return PUBLIC
        if self.anonymous == "refuse":
            raise PrincipalRequiredError(
                "this request carries no credentials; an idempotent request must say who "
                "sends it (Authorization, an API key or a session cookie)"
            )
        return None

    def absent(self, why: str) -> Principal:
        """What ``anonymous`` gives a caller the ``principal=`` callable called
        :data:`ANONYMOUS`: :data:`PUBLIC` (``"share"``), :data:`NOBODY` (``"run"``),
        or :class:`~retrysafe.PrincipalRequiredError` saying ``why`` (``"refuse"``)."""
        if self.anonymous == "share":
            return PUBLIC
        if self.anonymous == "refuse":
            raise PrincipalRequiredError(f"{why}; an idempotent request must say who sends it")
        return NOBODY

    def credentials(self, headers: Iterable[tuple[str, str]], query: str) -> Principal | None:
        """Every credential of the request as one principal; None if it carries none."""
        found: dict[str, str] = {}
        cookies: list[str] = []
        wanted = self.header_set
        for name, value in headers:
            if name in wanted:
                value = value.strip(" \t")
                if found.setdefault(name, value) != value:  # an empty line differs too
                    raise AmbiguousCredentialsError(
                        f"the request carries two different {name} headers; send one"
                    )
            elif name == "cookie":
                cookies.append(value)
        parts = [("header", name, value) for name, value in found.items() if value]
        if self.query and query:
            for name, value in urllib.parse.parse_qsl(query, keep_blank_values=False):
                if name.lower() in self.query:
                    parts.append(("query", name.lower(), value))
        if cookies:
            jar = [("cookie", n, v) for text in cookies for n, v in self._cookies(text)]
            # Cookies alone name a caller only if one of them is a session cookie: a
            # request whose credential retrysafe cannot see (an unlisted header) may
            # still carry a cookie everyone has (currency=USD): never a principal.
            if parts or self.cookies is not None or any(_is_session(c[1]) for c in jar):
                parts.extend(jar)
        if not parts:
            return None
        if len(parts) > 1:
            parts.sort()
        # Each part length-prefixed: no choice of names and values can run into another.
        material = "".join(f"{len(k)}:{k}{len(n)}:{n}{len(v)}:{v}" for k, n, v in parts)
        return Principal("credentials", material)

    def _cookies(self, header: str) -> Iterable[tuple[str, str]]:
        """The ``(name, value)`` pairs of a ``Cookie`` header that name the caller."""
        wanted = self.cookies
        for pair in header.split(";"):
            name, eq, value = pair.partition("=")
            name, value = name.strip(), value.strip()
            if not eq or not name or not value:
                continue
            if wanted is None:
                if not is_identity_cookie(name):
                    continue
            elif name.lower() not in wanted:
                continue
            yield name, value

    def lone(self, name: bytes, value: bytes) -> Principal | None:
        """:meth:`others` of a request whose only credential is one header line
        (``name`` in :data:`lone_names`, no cookie, no ``principal_query`` parameter,
        no framework user), as a server gives it: the same answer, remembered.

        Callers that send one credential send the same one again and again: the
        principal of each of the last :data:`LONE_CACHED` short ones is kept (the
        cache holds credentials in memory, as the request did; it is bounded in
        entries and bytes, and starts afresh when full).
        """
        known = self._lone.get((name, value))
        if known is not None:
            return known
        who = self.others(None, ((name.decode("latin-1"), value.decode("latin-1")),), "")
        if who is not None and len(value) <= LONE_BYTES:
            if len(self._lone) >= LONE_CACHED:
                self._lone = {}
            self._lone[name, value] = who
        return who

    def strip_query(self, query: str) -> str:
        """``query`` without the credential parameters (they are in the scope, and a
        fingerprint must not hold a credential)."""
        if not self.query or not query:
            return query
        kept = [
            part
            for part in query.split("&")
            if urllib.parse.unquote_plus(part.partition("=")[0]).lower() not in self.query
        ]
        return "&".join(kept)


def unscoped(operation: str) -> None:
    """A keyed request without credentials (or one the ``principal=`` callable
    called :data:`ANONYMOUS`) runs without a record: counted, and said once per
    process (a deployment whose callers authenticate in a way retrysafe does not
    see would otherwise lose its idempotency silently)."""
    METRICS.count("unscoped", operation)
    _warn_once(
        "a keyed request without credentials ran without a record: anonymous callers "
        "never share answers (anonymous='run'). If your callers authenticate in a way "
        "retrysafe does not see, name it: principal=, principal_headers=, "
        "principal_cookies= or principal_query= (docs/principals.md)"
    )


def asgi_user(scope: Any) -> str | None:
    """The identity of an authenticated ``scope["user"]`` (Starlette's
    ``AuthenticationMiddleware``), else None.

    The user's ``identity`` names it; a user object without one is not used
    (logged once), so the request's credentials decide instead.
    """
    user = scope.get("user")
    if user is None:
        return None
    try:
        if getattr(user, "is_authenticated", False) is not True:
            return None
        identity = user.identity
    except Exception as exc:  # the app's user class: whatever it raises, never a 500
        _warn_once(
            f"scope['user'] ({type(user).__name__}) gave no identity ({type(exc).__name__}); "
            "the request's credentials name the caller instead (give the user class an "
            "identity property, or pass principal=)"
        )
        return None
    if identity is None or str(identity).strip() == "":
        return None
    return f"{type(user).__module__}.{type(user).__qualname__}:{identity}"


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned and len(_warned) < 64:
        _warned.add(message)
        log.warning("retrysafe: %s", message)
