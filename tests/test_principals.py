"""Who the caller is: no stored answer ever crosses principals, on every front door.

The rules first, without a server; then the deployment secret on every store
(made once, however many threads and processes race for it); then every HTTP
front door (Starlette, FastAPI, Flask, Django and the gateway in front of a
real upstream process) on every store, served for real: callers by cookie, by
API key, by bearer token and by query string never share an answer, a caller
whose analytics cookie changed still gets its replay, anonymous callers never
get one another's answer, two different ``Authorization`` lines are refused.
Then the identities frameworks establish (Starlette's ``scope["user"]``,
Django's ``request.user``; Mesh and A2A behind Starlette's authentication): a
token refresh replays. Last, the gateway's command line and the map's
``[principals]`` table.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from _doors import Door
from _http_apps import Counter
from _http_servers import Process, ThreadServer, free_port
from _racing import race_processes
from conftest import StoreSpec, store_url
from test_http import problem

from retrysafe import (
    AmbiguousCredentialsError,
    IdempotencyMap,
    Outcome,
    PrincipalRequiredError,
    Store,
    key_hash,
    open_store,
)
from retrysafe._core.principal import (
    NOBODY,
    PUBLIC,
    Principal,
    Principals,
    is_identity_cookie,
)
from retrysafe._core.secret import CELL_KEY, ENV_SECRET, SecretError, check_secret, secret_of
from retrysafe.http import ANONYMOUS

SECRET = b"s" * 32


def creds(principals: Principals, query: str = "", **headers: str) -> Principal | None:
    """The principal of a request carrying ``headers`` (``_`` for ``-`` in names)."""
    pairs = [(name.replace("_", "-"), value) for name, value in headers.items()]
    return principals.credentials(pairs, query)


def scope_of(principals: Principals, **headers: str) -> str:
    who = creds(principals, **headers)
    assert who is not None
    return who.scope(SECRET)


# -- the rules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "counts"),
    [
        ("session", True),
        ("sessionid", True),
        ("__Host-session", True),
        ("connect.sid", True),
        ("pf", True),
        ("_ga", False),
        ("_ga_X1Y2", False),
        ("__Secure-_ga", False),
        ("_gid", False),
        ("ajs_anonymous_id", False),
        ("mp_abc_mixpanel", False),
        ("csrftoken", False),
        ("XSRF-TOKEN", False),
        ("AWSALB", False),
        ("_hjSession_1", False),
        ("theme", False),
        ("OptanonConsent", False),
        ("__stripe_mid", False),
    ],
)
def test_which_cookies_name_the_caller(name: str, counts: bool) -> None:
    assert is_identity_cookie(name) is counts


def test_every_credential_counts_together_in_any_order() -> None:
    p = Principals()
    both = scope_of(p, authorization="Bearer a", cookie="session=s1")
    assert both != scope_of(p, authorization="Bearer a")  # more credentials: another caller
    assert both != scope_of(p, cookie="session=s1")
    assert both == scope_of(p, cookie="_ga=1; session=s1; theme=dark", authorization="Bearer a")
    assert scope_of(p, cookie="session=s1; sid=2") == scope_of(p, cookie="sid=2;session=s1")
    assert scope_of(p, x_api_key="k1") != scope_of(p, api_key="k1")  # the header is part of it
    assert creds(p) is None and creds(p, cookie="_ga=1; csrftoken=x; theme=dark") is None
    assert creds(p, authorization="  ") is None and creds(p, cookie="session=") is None


def test_two_different_lines_of_one_credential_are_ambiguous() -> None:
    p = Principals()
    for pairs in (
        [("authorization", "Bearer mallory"), ("authorization", "")],
        [("authorization", "Bearer a"), ("authorization", "Bearer b")],
        [("x-api-key", "a"), ("x-api-key", "b")],
    ):
        with pytest.raises(AmbiguousCredentialsError) as info:
            p.credentials(pairs, "")
        assert info.value.code == "idempotency_credentials_ambiguous"
    same = p.credentials([("authorization", "Bearer a"), ("authorization", "Bearer a")], "")
    assert same == p.credentials([("authorization", "Bearer a")], "")
    # Cookie lines are crumbs of one header (HTTP/2): they add up.
    crumbs = p.credentials([("cookie", "a=1"), ("cookie", "b=2")], "")
    assert crumbs == p.credentials([("cookie", "a=1; b=2")], "")


def test_the_options_narrow_and_extend_what_counts() -> None:
    named = Principals(
        principal_cookies=["sid"], principal_headers=["X-Tenant-Key"], principal_query=["api_key"]
    )
    assert creds(named, cookie="session=x") is None  # only the named cookie counts now
    assert creds(named, cookie="sid=1; session=x") == creds(named, cookie="sid=1; session=y")
    assert creds(named, x_api_key="k") is None  # the default list was replaced
    assert creds(named, x_tenant_key="t") is not None
    assert creds(named, authorization="Bearer a") is not None  # always counts
    alice = named.credentials([], "api_key=alice&page=1")
    assert alice is not None and alice != named.credentials([], "api_key=bob&page=1")
    assert named.credentials([], "page=1") is None
    assert named.strip_query("page=1&api_key=alice&API_KEY=x&b=2") == "page=1&b=2"
    assert Principals().strip_query("api_key=1") == "api_key=1"


def test_the_scope_is_a_keyed_hash_that_holds_no_credential() -> None:
    who = creds(Principals(), authorization="Basic " + base64.b64encode(b"ann:hunter2").decode())
    assert who is not None
    scope = who.scope(SECRET)
    assert scope.startswith("credentials:") and len(scope) == len("credentials:") + 32
    assert scope != who.scope(b"t" * 32)  # another deployment, another scope
    assert "hunter2" not in scope and "Basic" not in scope
    # Neither the old format (a plain SHA-256 of the header) nor any plain hash of it.
    for text in (who.material, "Basic " + base64.b64encode(b"ann:hunter2").decode()):
        assert hashlib.sha256(text.encode()).hexdigest()[:32] not in scope
    # Kinds never meet: a user called like a credential list is another principal.
    assert Principal("user", who.material).scope(SECRET) != scope
    assert PUBLIC.scope(SECRET).startswith("public:")


@pytest.mark.parametrize("key", [b"", b"s" * 32, b"k" * 64, b"x" * 100])
def test_the_keyed_hash_is_hmac_sha256(key: bytes) -> None:
    from retrysafe._core.secret import Secret

    for message in (b"", b"abc", bytes(range(256)) * 9):
        expected = hmac.new(key, message, "sha256").hexdigest()
        assert Secret(key).hmac(message) == expected
        assert Secret(key).hmac(message[:5], message[5:]) == expected
    assert "s" * 8 not in repr(Secret(key))


def test_the_principal_callable_and_the_user_come_first() -> None:
    def request() -> Any:
        return None

    def alice() -> str:
        return "alice"

    def nobody() -> None:
        return None

    def unread() -> str:
        raise AssertionError("the user is read only when principal= does not decide")

    p = Principals(principal=lambda r: "tenant-1")
    assert p.identify(request, unread, [], "") == Principal("principal", "tenant-1")
    for undecided in (None, "", "  "):  # None or blank: the other rules decide
        p = Principals(principal=lambda r, u=undecided: u)  # type: ignore[misc]
        assert p.identify(request, alice, [("authorization", "Bearer x")], "") == Principal(
            "user", "alice"
        )
        assert p.identify(request, nobody, [], "") is None
    with pytest.raises(PrincipalRequiredError):
        Principals(anonymous="refuse").identify(request, nobody, [], "")
    assert Principals(anonymous="share").identify(request, nobody, [], "") == PUBLIC
    with pytest.raises(TypeError, match="not int"):
        Principals(principal=lambda r: 7).identify(request, nobody, [], "")  # type: ignore[arg-type,return-value]


def test_a_principal_callable_says_a_caller_is_anonymous() -> None:
    """ANONYMOUS: ``anonymous`` decides at once; neither the user nor the request's
    credentials are read (the Go middleware pattern: no auth context, no idempotency)."""

    def request() -> Any:
        return None

    def unread() -> str:
        raise AssertionError("the user is not read when principal= says ANONYMOUS")

    bearer = [("authorization", "Bearer rejected-by-the-app")]
    p = Principals(principal=lambda r: ANONYMOUS)
    assert p.identify(request, unread, bearer, "") is None  # "run": no record
    assert p.named(request) is NOBODY
    p = Principals(principal=lambda r: ANONYMOUS, anonymous="share")
    assert p.identify(request, unread, bearer, "") == PUBLIC
    p = Principals(principal=lambda r: ANONYMOUS, anonymous="refuse")
    with pytest.raises(PrincipalRequiredError, match="unauthenticated"):
        p.identify(request, unread, bearer, "")
    with pytest.raises(TypeError, match="ANONYMOUS"):
        Principals(principal=lambda r: b"anonymous").identify(request, unread, [], "")  # type: ignore[arg-type,return-value]


def test_cookies_alone_need_a_session_cookie() -> None:
    """A cookie everyone has (``currency=USD``) beside a credential retrysafe cannot see
    (an unlisted header) must not make all those callers one principal."""
    p = Principals()
    assert creds(p, cookie="currency=USD; ab_variant=b") is None  # anonymous, never shared
    assert creds(p, cookie="currency=USD; sessionid=s1") is not None
    assert creds(p, cookie="currency=USD; sessionid=s1") != creds(p, cookie="sessionid=s1")
    sessions = [
        "PHPSESSID",
        "connect.sid",
        "_app_session",
        ".ASPXAUTH",
        "access_token",
        "__Secure-next-auth.session-token",
        "remember_web_59",
        "wordpress_logged_in_1",
    ]
    for name in sessions:
        assert creds(p, cookie=f"{name}=v") is not None, name
    # Beside another credential, every cookie that may name a caller counts.
    assert creds(p, authorization="Basic c2hhcmVk", cookie="pf=alice") != creds(
        p, authorization="Basic c2hhcmVk", cookie="pf=bob"
    )
    named = Principals(principal_cookies=["pf"])  # a session cookie by any name, when named
    assert creds(named, cookie="pf=alice") is not None


def test_a_user_class_that_raises_never_fails_the_request() -> None:
    from retrysafe._core.principal import asgi_user

    class Claims:
        is_authenticated = True

        @property
        def identity(self) -> str:
            raise KeyError("sub")

    class Plain:
        is_authenticated = True
        identity = 42

    assert asgi_user({"user": Claims()}) is None  # the credentials decide instead
    assert asgi_user({"user": Plain()}).endswith("Plain:42")  # type: ignore[union-attr]
    assert asgi_user({"user": object()}) is None and asgi_user({}) is None


class _User:
    is_authenticated = True
    identity = "alice"


def _general(principals: Principals, scope: dict[str, Any], query: str) -> Principal | None:
    """The general rules, as the ASGI door applied them to every request before."""
    from retrysafe._core.principal import asgi_user
    from retrysafe._http.asgi import http_request

    wanted = principals.raw_names
    headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k in wanted]
    return principals.identify(
        lambda: http_request(scope), lambda: asgi_user(scope), headers, query
    )


@pytest.mark.parametrize(
    ("options", "headers", "query", "user"),
    [
        ({}, [(b"authorization", b"Bearer a")], "", False),  # the lone path
        ({}, [(b"x-api-key", b" k1 ")], "", False),  # the lone path, stripped
        ({}, [(b"authorization", b"")], "", False),  # empty: anonymous
        ({"anonymous": "share"}, [(b"authorization", b"")], "", False),
        ({}, [(b"authorization", b"Bearer a"), (b"cookie", b"sessionid=s")], "", False),
        ({}, [(b"authorization", b"Bearer a"), (b"x-api-key", b"k")], "", False),
        ({}, [(b"cookie", b"sessionid=s")], "", False),
        ({}, [(b"authorization", b"Bearer a")], "", True),  # the user comes first
        ({"principal": lambda r: "tenant"}, [(b"authorization", b"Bearer a")], "", False),
        ({"principal_query": ["token"]}, [(b"authorization", b"Bearer a")], "token=t", False),
        ({"principal_query": ["token"]}, [(b"authorization", b"Bearer a")], "", False),
        ({"principal_headers": ["x-tenant"]}, [(b"x-tenant", b"t1")], "", False),
    ],
)
def test_the_lone_credential_path_names_whom_the_rules_name(
    options: dict[str, Any], headers: list[tuple[bytes, bytes]], query: str, user: bool
) -> None:
    """The ASGI door's shortcut for one credential header line gives the principal the
    general rules give (and remembers it); every other request takes the rules."""
    from retrysafe._http.asgi import caller

    p = Principals(**options)
    scope: dict[str, Any] = {"method": "POST", "path": "/o", "headers": [(b"host", b"h"), *headers]}
    scope["query_string"] = query.encode()
    if user:
        scope["user"] = _User()
    for _ in range(2):  # the second time from memory, where the shortcut remembers
        assert caller(scope, p) == _general(p, scope, query)


def test_two_different_lone_credentials_are_two_principals() -> None:
    from retrysafe._core.principal import LONE_BYTES, LONE_CACHED
    from retrysafe._http.asgi import caller

    p = Principals()

    def who(value: bytes) -> Principal | None:
        return caller({"headers": [(b"authorization", value)], "query_string": b""}, p)

    assert who(b"Bearer a") == who(b"Bearer a") != who(b"Bearer b")
    for i in range(LONE_CACHED + 5):  # a full memory starts afresh: bounded
        assert who(b"Bearer %d" % i) == creds(p, authorization=f"Bearer {i}")
    assert len(p._lone) <= LONE_CACHED
    long = b"Bearer " + b"x" * LONE_BYTES  # too long to remember, still named
    assert who(long) == creds(p, authorization=long.decode())
    assert (b"authorization", long) not in p._lone


def test_a_policy_remembers_scopes_under_its_own_secret_only() -> None:
    from retrysafe._core.secret import Secret
    from retrysafe._http.policy import SCOPES_CACHED, HttpPolicy

    policy = HttpPolicy("memory://")
    secret = policy.load_secret()
    alice, bob = Principal("credentials", "a"), Principal("credentials", "b")
    assert policy.scope_of(alice, secret) == alice.scope(secret) == policy.scope_of(alice, secret)
    assert policy.scope_of(bob, secret) == bob.scope(secret) != alice.scope(secret)
    other = Secret(b"o" * 32)  # another secret: never an answer remembered under this one
    assert policy.scope_of(alice, other) == alice.scope(other) != alice.scope(secret)
    for i in range(SCOPES_CACHED + 5):
        one = Principal("credentials", str(i))
        assert policy.scope_of(one, secret) == one.scope(secret)
    assert len(policy._scopes) <= SCOPES_CACHED


@pytest.mark.parametrize(
    "options",
    [
        {"anonymous": "allow"},
        {"principal": "tenant"},
        {"principal_headers": [""]},
        {"principal_cookies": [3]},
        {"principal_query": [None]},
    ],
)
def test_bad_options_fail_at_construction(options: dict[str, Any]) -> None:
    from retrysafe.asgi import IdempotencyMiddleware

    with pytest.raises((TypeError, ValueError)):
        Principals(**options)
    with pytest.raises((TypeError, ValueError)):
        IdempotencyMiddleware(lambda *a: None, store="memory://", **options)


# -- the deployment secret ---------------------------------------------------------------------


def test_the_secret_is_made_once_and_kept_in_the_store(store_spec: StoreSpec) -> None:
    first = store_spec.open()
    try:
        secret = secret_of(first).value
        assert len(secret) >= 32 and secret_of(first).value == secret
        if store_spec.name != "memory":  # another process opening the store agrees
            second = store_spec.open()
            try:
                assert secret_of(second).value == secret
            finally:
                second.close()
    finally:
        first.close()


async def test_the_secret_from_a_coroutine(store: Store[Any]) -> None:
    from retrysafe._core.secret import asecret_of

    assert (await asecret_of(store)).value == secret_of(store).value
    await store.aclose()


def _secret_racer(store: Store[Any]) -> Any:
    def race(who: str) -> str:
        return base64.b64encode(secret_of(store).value).decode()

    return race


def test_racing_processes_agree_on_one_secret(shared_spec: StoreSpec) -> None:
    """4 processes of 8 threads each read a store that has no secret yet, at once:
    one secret is written, and every one of them gets it."""
    answers = race_processes(shared_spec, _secret_racer)
    assert len(answers) == 32 and len(set(answers)) == 1
    store = shared_spec.open()
    try:
        assert base64.b64encode(secret_of(store).value).decode() == answers[0]
    finally:
        store.close()


def test_racing_threads_agree_on_one_secret(store: Store[Any]) -> None:
    barrier = threading.Barrier(16)

    def read(_: int) -> bytes:
        barrier.wait()
        return secret_of(store).value

    with ThreadPoolExecutor(16) as pool:
        assert len(set(pool.map(read, range(16)))) == 1


def test_the_environment_secret_wins_and_must_be_long(monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store("memory://")
    monkeypatch.setenv(ENV_SECRET, "x" * 40)
    assert secret_of(store).value == b"x" * 40
    assert store._cells == {}  # type: ignore[attr-defined]  # nothing was written
    monkeypatch.setenv(ENV_SECRET, "short")
    with pytest.raises(SecretError, match="at least 32"):
        check_secret(store)
    from retrysafe.asgi import IdempotencyMiddleware

    with pytest.raises(SecretError, match=ENV_SECRET):
        IdempotencyMiddleware(lambda *a: None, store=store)


def test_a_store_without_cells_needs_the_environment_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from retrysafe.stores.memory import MemoryStore

    class Bare(MemoryStore):
        _cell_read = Store._cell_read
        _cell_write = Store._cell_write  # type: ignore[assignment]

    monkeypatch.delenv(ENV_SECRET, raising=False)
    with pytest.raises(SecretError, match=ENV_SECRET):
        check_secret(Bare())
    monkeypatch.setenv(ENV_SECRET, "y" * 32)
    check_secret(Bare())


def test_a_secret_that_retrysafe_did_not_write_is_refused(
    memory: Store[Any], caplog: pytest.LogCaptureFixture
) -> None:
    from retrysafe import StoreUnavailableError
    from retrysafe._core.cells import Cells

    assert Cells(memory, "retrysafe", "deployment").write(CELL_KEY, None, "short", None)
    with pytest.raises(StoreUnavailableError, match="not one retrysafe wrote") as info:
        secret_of(memory)
    assert info.value.transient is False  # no retry helps: said as an error, not an outage
    assert any(r.levelname == "ERROR" and CELL_KEY in r.getMessage() for r in caplog.records)


# -- every door, every store ----------------------------------------------------------------------


def post(
    url: str,
    tid: str,
    key: str | None = None,
    *,
    path: str = "/orders",
    body: Any = None,
    headers: Any = (),
    **named: str,
) -> httpx.Response:
    """A keyed POST of test ``tid`` with the given credentials (``_`` for ``-``)."""
    sent: list[tuple[str, str]] = [("x-test-id", tid), ("idempotency-key", key or f"k-{tid}")]
    sent.extend(headers)
    sent.extend((name.replace("_", "-"), value) for name, value in named.items())
    return httpx.post(url + path, json={} if body is None else body, headers=sent, timeout=30)


def replayed(response: httpx.Response) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


def test_cookie_users_never_share(door: Door, tid: str) -> None:
    alice = post(door.url, tid, cookie="session=alice")
    bob = post(door.url, tid, cookie="session=bob")
    assert alice.status_code == bob.status_code == 201
    assert not replayed(bob) and bob.json()["n"] == 2  # bob's order ran: not alice's replayed
    again = post(door.url, tid, cookie="session=alice")
    assert replayed(again) and again.content == alice.content
    assert door.counter.count(tid) == 2


def test_api_key_users_never_share(door: Door, tid: str) -> None:
    for name in ("x_api_key", "api_key", "x_auth_token"):
        t = f"{tid}-{name}"
        first = post(door.url, t, **{name: "alice-key"})
        other = post(door.url, t, **{name: "bob-key"})
        mine = post(door.url, t, **{name: "alice-key"})
        assert not replayed(other) and replayed(mine) and mine.content == first.content
        assert door.counter.count(t) == 2, name


def test_an_analytics_cookie_that_changed_still_replays(door: Door, tid: str) -> None:
    first = post(door.url, tid, cookie="session=alice; _ga=GA1.1.111; _gid=GA1.1.1")
    again = post(door.url, tid, cookie="_ga=GA1.1.222; session=alice; csrftoken=new; theme=dark")
    assert replayed(again) and again.content == first.content
    assert door.counter.count(tid) == 1


def test_callers_racing_on_one_key_each_run_once(door: Door, tid: str) -> None:
    """Three callers (bearer token, API key, session cookie whose analytics cookie
    changes with every copy) send 8 copies each of one keyed request, all at once:
    each caller's request runs once, and each gets only its own answer."""
    callers = {
        "alice": lambda: {"authorization": "Bearer alice"},
        "bob": lambda: {"x-api-key": "bob-key"},
        "carol": lambda: {"cookie": f"session=carol; _ga=GA1.1.{uuid.uuid4().int % 10**9}"},
    }
    barrier = threading.Barrier(24)

    def send(who: str) -> tuple[str, httpx.Response]:
        headers = list(callers[who]().items())
        barrier.wait()
        return who, post(url, f"{tid}-{who}", f"k-{tid}", headers=headers, path="/slow?ms=300")

    with door.serve(wait=20) as url, ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(send, [who for who in callers for _ in range(8)]))
    for who in callers:
        mine = [r for w, r in answers if w == who]
        assert [r.status_code for r in mine] == [200] * 8, [r.text for r in mine]
        assert sum(not replayed(r) for r in mine) == 1
        assert door.counter.count(f"{tid}-{who}") == 1, who


def test_anonymous_callers_never_share_and_leave_no_record(door: Door, tid: str) -> None:
    """A keyed POST /login without credentials: the second caller gets a session of
    its own, never the first one's token (in the body or in a header)."""
    first = post(door.url, tid)
    second = post(door.url, tid)
    assert first.status_code == second.status_code == 201
    assert not replayed(second) and (first.json()["n"], second.json()["n"]) == (1, 2)
    assert door.counter.count(tid) == 2
    assert door.store.records(key=f"k-{tid}") == []  # nothing written for anyone


def test_a_cookie_everyone_has_names_no_caller(door: Door, tid: str) -> None:
    """Callers whose credential retrysafe cannot see (``X-Token``, not in the list), each
    with the cookie everyone has: anonymous, so each runs and nothing is kept."""
    alice = post(door.url, tid, x_token="alice", cookie="currency=USD")
    bob = post(door.url, tid, x_token="bob", cookie="currency=USD")
    assert not replayed(bob) and (alice.json()["n"], bob.json()["n"]) == (1, 2)
    assert door.store.records(key=f"k-{tid}") == []


def test_anonymous_callers_refused_or_sharing(door: Door, tid: str) -> None:
    with door.serve(anonymous="refuse") as url:
        doc = problem(post(url, tid), 403, "idempotency_principal_required")
        assert "credentials" in doc["detail"]
        assert post(url, tid, authorization="Bearer a").status_code == 201  # named: served
    assert door.counter.count(tid) == 1
    with door.serve(anonymous="share") as url:
        first = post(url, f"{tid}-s")
        again = post(url, f"{tid}-s")
        assert replayed(again) and again.content == first.content
        assert not replayed(post(url, f"{tid}-s", authorization="Bearer a"))
    assert door.counter.count(f"{tid}-s") == 2


def test_two_authorization_lines_never_reach_anonymous_callers(door: Door, tid: str) -> None:
    """``Authorization: Bearer mallory`` and an empty ``Authorization:`` line: an ASGI
    door refuses it (400); a WSGI server joins the lines into one value, which is then
    the credential. Either way an anonymous retry never gets the answer."""
    lines = [("authorization", "Bearer mallory"), ("authorization", "")]
    first = post(door.url, tid, headers=lines)
    if door.name in ("flask", "django"):  # werkzeug hands the app "Bearer mallory,"
        assert first.status_code == 201
        assert door.counter.count(tid) == 1
    else:
        problem(first, 400, "idempotency_credentials_ambiguous")
        assert door.counter.count(tid) == 0
    anonymous = post(door.url, tid)
    assert not replayed(anonymous)
    other = post(door.url, tid, headers=[("authorization", "Bearer a"), ("authorization", "b")])
    assert not replayed(other)
    assert door.counter.count(tid) == (3 if door.name in ("flask", "django") else 1)


def test_query_string_credentials(door: Door, tid: str) -> None:
    with door.serve(principal_query=["api_key"]) as url:
        alice = post(url, tid, path="/orders?api_key=alice")
        bob = post(url, tid, path="/orders?api_key=bob")
        again = post(url, tid, path="/orders?api_key=alice")
    assert bob.status_code == 201 and not replayed(bob)  # not a 422: bob is another caller
    assert replayed(again) and again.content == alice.content
    assert door.counter.count(tid) == 2


def test_the_principal_callable_on_every_door(door: Door, tid: str) -> None:
    def tenant(request: Any) -> str | None:
        return request.headers.get("x-tenant")

    with door.serve(principal=tenant) as url:
        a = post(url, tid, x_tenant="t1", authorization="Bearer one")
        b = post(url, tid, x_tenant="t1", authorization="Bearer two")  # the callable decides
        c = post(url, tid, x_tenant="t2")
        d = post(url, tid)  # None: the other rules decide (anonymous: run unrecorded)
    assert replayed(b) and b.content == a.content and not replayed(c) and not replayed(d)
    assert door.counter.count(tid) == 3


def test_no_credential_reaches_the_store(door: Door, tid: str) -> None:
    """Records hold keyed hashes only: not a credential, not a plain hash of one, not
    a plain hash of a body that holds a password."""
    basic = "Basic " + base64.b64encode(b"ann:hunter2").decode()
    sent = {"authorization": basic, "x-api-key": "key-hunter3", "cookie": "session=cookie-hunter4"}
    body = {"user": "ann", "password": "hunter5"}
    for name, value in sent.items():
        assert post(door.url, f"{tid}-{name}", body=body, **{name: value}).status_code == 201
    assert (
        post(
            door.url, f"{tid}-q", path="/orders?token=q-hunter6", authorization="Bearer x"
        ).status_code
        == 201
    )
    records = [r for r in door.store.records(limit=10_000) if r.key.startswith(f"k-{tid}")]
    assert len(records) == 4
    dumped = json.dumps(
        [[r.scope, r.fingerprint, r.key, r.request_id, r.metadata] for r in records]
    )
    assert "hunter" not in dumped and "ann" not in dumped
    canonical = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    plain = [*sent.values(), basic.split()[1], "ann:hunter2"]
    for text in plain:
        for digest in (
            hashlib.sha256(text.encode()).hexdigest(),
            hashlib.md5(text.encode()).hexdigest(),
        ):
            assert digest[:16] not in dumped
    head = b"4:POST7:/orders0:j"
    assert hashlib.sha256(head + canonical).hexdigest() not in dumped  # fingerprints are keyed
    secret = secret_of(door.store).value
    assert hmac.new(secret, head + canonical, "sha256").hexdigest() in dumped


def test_scopes_and_fingerprints_are_keyed_by_the_deployment_secret(
    door: Door, tid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request under two deployment secrets: two scopes and two fingerprints, so
    nothing stored can be matched to a credential or a body without the secret."""
    seen = []
    for n, secret in enumerate(("a" * 32, "b" * 32)):
        monkeypatch.setenv(ENV_SECRET, secret)
        with door.serve() as url:
            assert post(url, f"{tid}-{n}", f"k-{tid}", authorization="Bearer x").status_code == 201
        [record] = door.store.records(key=f"k-{tid}", limit=10)[n:]
        seen.append((record.scope, record.fingerprint))
    assert seen[0][0] != seen[1][0] and seen[0][1] != seen[1][1]


def test_records_of_the_old_scope_format_never_replay(door: Door, tid: str) -> None:
    """Records written before principals were keyed (a plain hash of Authorization,
    or "" for every other caller) are never found by a request after the upgrade."""
    from retrysafe import Engine
    from retrysafe.http import request_fingerprint

    key = f"k-{tid}"
    # The fingerprint a request gets now: only the scope keeps these records apart.
    fp = request_fingerprint(
        "POST", "/orders", "", "application/json", b"{}", secret_of(door.store)
    )
    stale = Outcome(
        b'{"n":"stale"}', 201, (("content-type", "application/json"),), "application/json"
    )
    engine = Engine(door.store)
    for scope in ("auth:" + hashlib.sha256(b"Bearer alice").hexdigest()[:32], ""):
        with engine.attempt(key, operation="http", scope=scope, fingerprint=fp) as att:
            att.outcome = stale
        assert door.store.get(key_hash(scope, "http", key)) is not None
    for auth in ("Bearer alice", ""):
        answer = post(door.url, tid, **({"authorization": auth} if auth else {}))
        assert answer.status_code == 201 and "stale" not in answer.text and not replayed(answer)
    with door.serve(anonymous="share") as url:
        assert "stale" not in post(url, tid).text
    assert door.counter.count(tid) == 3


# -- identities the framework established --------------------------------------------------------

TOKENS = {"alice-1": "alice", "alice-2": "alice", "bob-1": "bob"}


def _token_auth() -> Any:
    """Starlette's AuthenticationMiddleware backend: tokens checked against TOKENS."""
    from starlette.authentication import (
        AuthCredentials,
        AuthenticationBackend,
        AuthenticationError,
        SimpleUser,
    )

    class Tokens(AuthenticationBackend):
        async def authenticate(self, conn: Any) -> Any:
            auth = conn.headers.get("authorization", "")
            if not auth:
                return None
            user = TOKENS.get(auth.removeprefix("Bearer "))
            if user is None:
                raise AuthenticationError("unknown token")
            return AuthCredentials(["authenticated"]), SimpleUser(user)

    return Tokens()


@pytest.mark.parametrize("framework", ["starlette", "fastapi"])
def test_a_token_refresh_replays_for_an_authenticated_starlette_user(
    framework: str, counter: Counter, memory: Store[Any], tid: str
) -> None:
    from _http_apps import fastapi_app, starlette_app
    from starlette.middleware import Middleware
    from starlette.middleware.authentication import AuthenticationMiddleware

    from retrysafe.asgi import IdempotencyMiddleware

    app = (starlette_app if framework == "starlette" else fastapi_app)(counter)
    # The first in the list is the outermost: authentication runs first.
    app.user_middleware[:0] = [
        Middleware(AuthenticationMiddleware, backend=_token_auth()),
        Middleware(IdempotencyMiddleware, store=memory),
    ]
    with ThreadServer(app, "asgi") as server:
        first = post(server.url, tid, authorization="Bearer alice-1")
        refreshed = post(server.url, tid, authorization="Bearer alice-2")
        bob = post(server.url, tid, authorization="Bearer bob-1")
        anonymous = post(server.url, tid)
    assert replayed(refreshed) and refreshed.content == first.content
    assert not replayed(bob) and not replayed(anonymous)
    assert counter.count(tid) == 3
    scopes = {r.scope for r in memory.records(key=f"k-{tid}")}
    assert len(scopes) == 2 and all(s.startswith("user:") and "alice" not in s for s in scopes)


@pytest.mark.parametrize("auth_first", [True, False])
def test_fastapi_install_goes_inside_the_authentication(
    auth_first: bool, counter: Counter, memory: Store[Any], tid: str
) -> None:
    """``retrysafe.fastapi.install`` puts the middleware next to the routes, so the
    user is known whether authentication was added before or after it."""
    from _http_apps import fastapi_app
    from starlette.middleware.authentication import AuthenticationMiddleware

    from retrysafe.fastapi import install

    app = fastapi_app(counter)
    if auth_first:
        app.add_middleware(AuthenticationMiddleware, backend=_token_auth())
    install(app, store=memory)
    if not auth_first:
        app.add_middleware(AuthenticationMiddleware, backend=_token_auth())
    with ThreadServer(app, "asgi") as server:
        first = post(server.url, tid, authorization="Bearer alice-1")
        refreshed = post(server.url, tid, authorization="Bearer alice-2")
    assert replayed(refreshed) and refreshed.content == first.content
    assert counter.count(tid) == 1


def test_an_unverified_token_never_names_the_caller(door: Door, tid: str) -> None:
    """Two JWTs with the same ``sub``, the second forged (its signature is garbage):
    without an identity the app verified, they are two callers, and the forger never
    gets the first caller's answer."""

    def jwt(sub: str, signature: str) -> str:
        def part(doc: dict[str, Any]) -> str:
            return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")

        return f"Bearer {part({'alg': 'HS256'})}.{part({'sub': sub})}.{signature}"

    first = post(door.url, tid, authorization=jwt("alice", "valid-signature"))
    forged = post(door.url, tid, authorization=jwt("alice", "forged"))
    assert first.status_code == 201 and not replayed(forged)
    assert door.counter.count(tid) == 2


def test_mesh_and_a2a_replay_a_token_refresh(memory: Store[Any]) -> None:
    """MeshApp and the A2A middleware behind Starlette's AuthenticationMiddleware: a
    refreshed token of one user replays, another user's call runs."""
    from starlette.middleware.authentication import AuthenticationMiddleware
    from test_a2a import v03
    from test_mesh import RESULT, request

    from retrysafe.a2a import A2AMiddleware
    from retrysafe.mesh import MeshApp

    runs: list[str] = []

    def charge(call: Any) -> Any:
        runs.append("mesh")
        return RESULT

    async def agent(scope: Any, receive: Any, send: Any) -> None:
        from starlette.responses import JSONResponse

        body = json.loads((await receive())["body"])
        runs.append("a2a")
        task = {
            "kind": "task",
            "id": f"task-{len(runs)}",
            "contextId": "c",
            "status": {"state": "submitted"},
        }
        await JSONResponse({"jsonrpc": "2.0", "id": body["id"], "result": task})(
            scope, receive, send
        )

    mesh = AuthenticationMiddleware(MeshApp({"payments.charge": charge}, memory), _token_auth())
    a2a = AuthenticationMiddleware(A2AMiddleware(agent, store=memory), _token_auth())
    with ThreadServer(mesh, "asgi") as m, ThreadServer(a2a, "asgi") as a:
        for token in ("alice-1", "alice-2", "bob-1"):
            headers = {"authorization": f"Bearer {token}"}
            httpx.post(m.url, json=request(), headers=headers, timeout=30).raise_for_status()
            message = v03("m-1")
            httpx.post(a.url, json=message, headers=headers, timeout=30).raise_for_status()
    assert runs.count("mesh") == 2 and runs.count("a2a") == 2


@pytest.fixture(scope="module")
def django_users(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Users alice and bob with two sessions each (two logins: a phone and a laptop)."""
    from _http_apps import django_app
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client

    django_app(Counter(tmp_path_factory.mktemp("unused")), {"store": "memory://"})
    call_command("migrate", verbosity=0)
    sessions: dict[str, list[str]] = {}
    for name in ("alice", "bob"):
        user = User.objects.create_user(f"{name}-{uuid.uuid4().hex[:8]}")
        sessions[name] = []
        for _ in range(2):
            client = Client()
            client.force_login(user)
            sessions[name].append(client.cookies["sessionid"].value)
    return sessions


_AUTH_CHAIN = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "retrysafe.django.IdempotencyMiddleware",
]


@pytest.mark.parametrize("kind", ["wsgi", "asgi"])
def test_a_django_user_replays_across_sessions(
    kind: str, django_users: dict[str, list[str]], counter: Counter, memory: Store[Any], tid: str
) -> None:
    """``request.user`` names the caller: the same user in another session (a new
    login, a refreshed token) replays; another user, or nobody, runs."""
    from _http_apps import django_app
    from django.core.handlers.asgi import ASGIHandler
    from django.test import override_settings

    django_app(counter, {"store": memory})
    with override_settings(MIDDLEWARE=_AUTH_CHAIN, RETRYSAFE={"store": memory}):
        app = django_app(counter, {"store": memory}) if kind == "wsgi" else ASGIHandler()
    alice, bob = django_users["alice"], django_users["bob"]
    with ThreadServer(app, kind) as server:
        first = post(server.url, tid, cookie=f"sessionid={alice[0]}")
        other_login = post(server.url, tid, cookie=f"sessionid={alice[1]}; _ga=GA1.2.3")
        bobs = post(server.url, tid, cookie=f"sessionid={bob[0]}")
        nobody = post(server.url, tid)
    assert first.status_code == 201 and replayed(other_login)
    assert other_login.content == first.content
    assert not replayed(bobs) and not replayed(nobody)
    assert counter.count(tid) == 3


def test_django_says_where_the_middleware_goes() -> None:
    from _http_apps import django_app
    from django.core.exceptions import ImproperlyConfigured
    from django.core.handlers.wsgi import WSGIHandler
    from django.test import override_settings

    django_app(Counter(Path("/tmp") / f"unused-{uuid.uuid4().hex}"), {"store": "memory://"})
    wrong = [_AUTH_CHAIN[0], _AUTH_CHAIN[2], _AUTH_CHAIN[1]]
    with (
        override_settings(MIDDLEWARE=wrong, RETRYSAFE={"store": "memory://"}),
        pytest.raises(ImproperlyConfigured, match=r"after it, so that request\.user"),
    ):
        WSGIHandler()
    with override_settings(MIDDLEWARE=_AUTH_CHAIN, RETRYSAFE={"store": "memory://"}):
        WSGIHandler()


# -- the gateway's command line and the map -----------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_the_gateway_command_line(
    workers: int, upstream: str, counter: Counter, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "retrysafe",
        "gateway",
        "--upstream",
        upstream,
        "--store",
        store_url("sqlite", request, tmp_path),
        "--listen",
        f"127.0.0.1:{port}",
        "--workers",
        str(workers),
        "--principal-header",
        "X-Tenant-Key",
        "--principal-cookie",
        "sid",
        "--anonymous",
        "refuse",
    ]
    tid = uuid.uuid4().hex
    with Process(argv, port, health="/_retrysafe/health") as gw:
        problem(post(gw.url, tid), 403, "idempotency_principal_required")
        problem(post(gw.url, tid, x_api_key="k"), 403, "idempotency_principal_required")
        problem(post(gw.url, tid, cookie="session=s"), 403, "idempotency_principal_required")
        t1 = post(gw.url, tid, x_tenant_key="t1")
        t2 = post(gw.url, tid, x_tenant_key="t2")
        t1_again = post(gw.url, tid, x_tenant_key="t1", cookie="session=other")
        sid = post(gw.url, tid, cookie="sid=s1; session=x")
        sid_again = post(gw.url, tid, cookie="sid=s1; session=y")
    assert not replayed(t2) and replayed(t1_again) and t1_again.content == t1.content
    assert not replayed(sid) and replayed(sid_again)
    assert counter.count(tid) == 3


def test_the_map_principals_table_and_a_public_route(
    counter: Counter, memory: Store[Any], tid: str
) -> None:
    from _http_apps import starlette_app

    from retrysafe.asgi import IdempotencyMiddleware

    imap = IdempotencyMap.loads(
        """
[operations.order]
key = "{id}"
scope = "user"

[[routes]]
method = "POST"
path = "/raw"
operation = "order"
require_key = false
anonymous = "share"

[principals]
headers = ["X-Tenant-Key"]
anonymous = "refuse"
"""
    )
    assert IdempotencyMap.loads(imap.to_toml()) == imap
    merged = IdempotencyMap.default().merge(imap)  # the table survives a merge
    assert merged.principals == imap.principals and merged.routes == imap.routes
    app = starlette_app(counter)
    app.add_middleware(IdempotencyMiddleware, store=memory, map=imap)
    with ThreadServer(app, "asgi") as server:
        problem(post(server.url, tid), 403, "idempotency_principal_required")
        problem(post(server.url, tid, x_api_key="k"), 403, "idempotency_principal_required")
        assert post(server.url, tid, x_tenant_key="t").status_code == 201
        public = post(server.url, f"{tid}-p", path="/raw", body={"a": 1})
        again = post(server.url, f"{tid}-p", path="/raw", body={"a": 1})
        assert replayed(again) and again.content == public.content
    assert counter.count(tid) == 1 and counter.count(f"{tid}-p") == 1
    with ThreadServer(_with(starlette_app(counter), memory, imap, anonymous="run"), "asgi") as s:
        assert post(s.url, tid).status_code == 201  # the keyword option wins over the table


def _with(app: Any, store: Store[Any], imap: IdempotencyMap, **options: Any) -> Any:
    from retrysafe.asgi import IdempotencyMiddleware

    app.add_middleware(IdempotencyMiddleware, store=store, map=imap, **options)
    return app
