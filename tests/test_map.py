"""The Idempotency Map: operations, routes, key building, the TOML format, durations."""

from __future__ import annotations

import pickle
import textwrap
import uuid
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import retrysafe
from retrysafe import Engine, IdempotencyMap, InvalidKeyError, MapError, Operation, Route
from retrysafe._model.duration import format_duration, parse_duration
from retrysafe._model.record import FINANCIAL, STANDARD

DAY = 24 * 3600.0
WEEK = 7 * DAY

# -- durations ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30),
        ("5m", 300),
        ("24h", 86400),
        ("7d", 604800),
        ("1h30m", 5400),
        ("1h 30m", 5400),
        ("250ms", 0.25),
        ("1.5h", 5400),
        ("1d2h3m4s5ms", 93784.005),
        ("90", 90),
        (" 2.5 ", 2.5),
        (45, 45),
        (0.5, 0.5),
    ],
)
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    ["", "  ", "-5s", "-5", "0", "0s", "abc", "5x", "1m1h", "1h1h", "5 m", "1.h", ".5s", "5M"],
)
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="every") as info:
        parse_duration(text, field="every")
    assert repr(text) in str(info.value) or not text.strip()


def test_parse_duration_zero_numbers_and_types() -> None:
    assert parse_duration("0s", allow_zero=True) == 0
    assert parse_duration(0, allow_zero=True) == 0
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="ttl"):
            parse_duration(bad, field="ttl")
    for bad in (True, None, [1]):
        with pytest.raises(TypeError, match="ttl"):
            parse_duration(bad, field="ttl")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (1800, "30m"),
        (WEEK, "7d"),
        (5400, "1h30m"),
        (1.5, "1.5s"),
        (0.25, "250ms"),
        (0, "0s"),
        (86400 + 1, "1d1s"),
        (0.0005, "0.0005s"),
        (60.25, "1m0.25s"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@given(st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False))
def test_format_duration_round_trips(seconds: float) -> None:
    assert parse_duration(format_duration(seconds), allow_zero=True) == seconds


# -- the default map ---------------------------------------------------------------

SEED_EXAMPLES = [
    (
        "session",
        {"user_id": "user_12345", "timestamp": 1705420800, "nonce": "a7b3c9d2"},
        "session:user_12345:1705420800:a7b3c9d2",
    ),
    (
        "cart_mandate",
        {"session_id": "sess_abc123", "cart_hash": "hash_xyz789"},
        "cart_mandate:sess_abc123:hash_xyz789",
    ),
    (
        "intent_mandate",
        {"user_id": "user_12345", "intent_hash": "hash_def456"},
        "intent_mandate:user_12345:hash_def456",
    ),
    (
        "payment",
        {"order_id": "order_789", "amount": 2999, "currency": "USD", "timestamp": 1705420800},
        "payment:order_789:2999:USD:1705420800",
    ),
    (
        "order",
        {"cart_mandate_id": "mandate_xyz789", "user_id": "user_12345"},
        "order:mandate_xyz789:user_12345",
    ),
    (
        "webhook",
        {"source": "shopify", "event_id": "evt_12345abcde"},
        "webhook:shopify:evt_12345abcde",
    ),
    (
        "sync",
        {"entity": "product", "entity_id": "prod_456", "version": "v3"},
        "sync:product:prod_456:v3",
    ),
    (
        "payment_webhook",
        {"gateway": "stripe", "transaction_id": "txn_1", "event_type": "payment.succeeded"},
        "webhook:stripe:txn_1:payment.succeeded",
    ),
]


@pytest.mark.parametrize(("name", "fields", "key"), SEED_EXAMPLES)
def test_default_keys_reproduce_the_seed_examples(
    name: str, fields: dict[str, object], key: str
) -> None:
    imap = IdempotencyMap.default()
    assert imap.key(name, **fields) == key
    assert imap.operation(name).parse(key) == {k: str(v) for k, v in fields.items()}


def test_default_table() -> None:
    imap = IdempotencyMap.default()
    assert list(imap.operations) == [
        "session",
        "session_token",
        "session_update",
        "cart_mandate",
        "intent_mandate",
        "payment",
        "order",
        "webhook",
        "payment_webhook",
        "sync",
        "user_sync",
    ]
    table = {
        op.name: (op.key, op.scope, op.ttl, op.lease, op.retention, op.final_failures)
        for op in imap
    }
    assert table == {
        "session": ("session:{user_id}:{timestamp}:{nonce}", "user", DAY, 30, STANDARD, False),
        "session_token": (
            "session:{user_id}:{device_id}:{timestamp}",
            "user",
            DAY,
            30,
            STANDARD,
            False,
        ),
        "session_update": (
            "session_update:{session_id}:{operation_type}:{sequence_number}",
            "session",
            DAY,
            30,
            STANDARD,
            False,
        ),
        "cart_mandate": (
            "cart_mandate:{session_id}:{cart_hash}",
            "session",
            1800,
            30,
            STANDARD,
            False,
        ),
        "intent_mandate": (
            "intent_mandate:{user_id}:{intent_hash}",
            "user",
            DAY,
            30,
            STANDARD,
            False,
        ),
        "payment": (
            "payment:{order_id}:{amount}:{currency}:{timestamp}",
            "order",
            WEEK,
            30,
            FINANCIAL,
            False,
        ),
        "order": ("order:{cart_mandate_id}:{user_id}", "cart", WEEK, 30, FINANCIAL, False),
        "webhook": ("webhook:{source}:{event_id}", "event", DAY, 30, STANDARD, False),
        "payment_webhook": (
            "webhook:{gateway}:{transaction_id}:{event_type}",
            "event",
            DAY,
            30,
            STANDARD,
            False,
        ),
        "sync": ("sync:{entity}:{entity_id}:{version}", "entity", DAY, 30, STANDARD, False),
        "user_sync": (
            "sync:user:{user_id}:{version}:{timestamp}",
            "user",
            DAY,
            30,
            STANDARD,
            False,
        ),
    }
    assert imap.routes == ()
    assert IdempotencyMap.default() is imap
    assert imap.operation("payment").fields == ("order_id", "amount", "currency", "timestamp")
    assert "payment" in imap and "refund" not in imap and len(imap) == 11


def test_the_default_map_has_every_key_format_of_the_commerce_map() -> None:
    imap = IdempotencyMap.default()
    # Session token generation: the device id is a field of its own.
    key = imap.key("session_token", user_id="user_12345", device_id="dev_9", timestamp=1705420800)
    assert key == "session:user_12345:dev_9:1705420800"
    assert imap.operation("session_token").parse(key) == {
        "user_id": "user_12345",
        "device_id": "dev_9",
        "timestamp": "1705420800",
    }
    key = imap.key(
        "session_update", session_id="sess_abc", operation_type="cart_update", sequence_number=42
    )
    assert key == "session_update:sess_abc:cart_update:42"
    assert imap.operation("user_sync").parse("sync:user:user_12345:3:1705420800") == {
        "user_id": "user_12345",
        "version": "3",
        "timestamp": "1705420800",
    }
    # Product sync is the generic format, with the entity named.
    assert imap.operation("sync").parse("sync:product:prod_456:v3")["entity"] == "product"
    # Session creation and session tokens share a prefix and an arity, so a key alone
    # does not tell them apart: the route's operation does, and records hash it in.
    assert imap.key("session", user_id="u", timestamp=1, nonce="d") == imap.key(
        "session_token", user_id="u", device_id=1, timestamp="d"
    )


def test_orders_are_kept_as_financial_records_on_purpose() -> None:
    # The map places order creation among its transaction patterns, beside payments:
    # exactly once per cart mandate, archived for audit. 24 hours would let a late retry
    # create a second order; see docs/map.md.
    order = IdempotencyMap.default().operation("order")
    assert (order.ttl, order.retention) == (WEEK, FINANCIAL)


def test_operation_engine_takes_its_settings() -> None:
    op = IdempotencyMap.default().operation("payment")
    engine = op.engine("memory://", wait=2)
    assert isinstance(engine, Engine)
    assert (engine.ttl, engine.lease, engine.final_failures, engine.retention, engine.wait) == (
        WEEK,
        30,
        False,
        FINANCIAL,
        2,
    )
    claim = engine.begin("k1", operation=op.name)
    assert isinstance(claim, retrysafe.Claim)
    assert claim.expires_at - claim.lease_until == pytest.approx(WEEK - 30, abs=1)


def test_unknown_operation_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match=r"did you mean 'payment'\?.*known: cart_mandate"):
        IdempotencyMap.default().operation("paymnt")
    with pytest.raises(KeyError):
        IdempotencyMap.default().key("refund", id="1")


# -- building keys -----------------------------------------------------------------

PAY = {"order_id": "order_789", "amount": 2999, "currency": "USD", "timestamp": 1705420800}


def pay(**changes: object) -> str:
    return IdempotencyMap.default().key("payment", **{**PAY, **changes})


def test_key_value_types() -> None:
    assert pay(amount=Decimal("29.90")) == pay(amount=Decimal("29.9")) == pay(amount="29.9")
    assert pay(amount=Decimal("1E+2")) == pay(amount=100)
    token = uuid.UUID("0190b6a2-7d3c-7cc1-9d3e-5f1a2b3c4d5e")
    assert pay(order_id=token) == f"payment:{token}:2999:USD:1705420800"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"amount": 29.99}, "float"),
        ({"amount": True}, "bool"),
        ({"amount": None}, "NoneType"),
        ({"amount": object()}, "object"),
        ({"amount": Decimal("NaN")}, "NaN"),
        ({"order_id": ""}, "empty"),
        ({"order_id": "a:b"}, "separator ':'"),
        ({"order_id": "a{b"}, "brace"),
        ({"order_id": "a}b"}, "brace"),
        ({"order_id": "a b"}, "visible ASCII"),
        ({"order_id": "caf\u00e9"}, "visible ASCII"),
        ({"order_id": "a\nb"}, "visible ASCII"),
        ({"order_id": "x" * 250}, "255"),
    ],
)
def test_key_refuses_bad_values(changes: dict[str, object], reason: str) -> None:
    with pytest.raises(InvalidKeyError, match=reason) as info:
        pay(**changes)
    if reason != "255":
        assert f"payment key field {next(iter(changes))}" in str(info.value)


def test_key_refuses_missing_and_extra_fields() -> None:
    imap = IdempotencyMap.default()
    with pytest.raises(InvalidKeyError, match="missing currency, timestamp"):
        imap.key("payment", order_id="o", amount=1)
    with pytest.raises(InvalidKeyError, match="unexpected tip"):
        imap.key("payment", **PAY, tip=1)


def test_a_field_may_be_called_operation() -> None:
    op = Operation("audit", key="audit:{operation}:{id}", scope="entity")
    assert IdempotencyMap([op]).key("audit", operation="charge", id=7) == "audit:charge:7"


def test_parse_refuses_keys_that_do_not_fit() -> None:
    op = IdempotencyMap.default().operation("payment")
    for bad in [
        "payment:order_789:2999:USD",
        "payment:a:b:c:d:e",
        "refund:a:b:c:d",
        "payment::1:2:3",
    ]:
        with pytest.raises(InvalidKeyError, match=r"payment key format 'payment:\{order_id\}"):
            op.parse(bad)
    with pytest.raises(InvalidKeyError, match="255"):
        op.parse("x" * 300)
    with pytest.raises(InvalidKeyError):
        op.parse(42)  # type: ignore[arg-type]


@given(
    st.lists(
        st.text(
            st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters=":{}"),
            min_size=1,
            max_size=12,
        ),
        min_size=4,
        max_size=4,
    )
)
def test_build_and_parse_are_inverse(values: list[str]) -> None:
    op = IdempotencyMap.default().operation("payment")
    fields = dict(zip(op.fields, values, strict=True))
    assert op.parse(op.build(**fields)) == fields


# -- templates ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        ("pay:{order.id}", "attribute or index"),
        ("pay:{order[id]}", "attribute or index"),
        ("pay:{order!r}", "conversion"),
        ("pay:{order:>5}", "format spec"),
        ("pay:{}", "positional"),
        ("pay:{0}", "positional"),
        ("pay:{a}:{a}", "twice"),
        ("pay:{a}{b}", "separated"),
        ("pay:{a}x{b}", "separated"),
        ("pay", "no {field}"),
        ("pay:{a", "expected '}'"),
        ("pay}:{a}", "Single '}'"),
        ("pay {a}", "visible ASCII"),
        ("{{pay}}:{a}", "literal braces"),
        ("pay:{a-b}", "not a valid field name"),
        ("x" * 260 + "{a}", "255"),
        (42, "must be a string"),
    ],
)
def test_bad_templates(template: str, reason: str) -> None:
    with pytest.raises(MapError, match=reason) as info:
        Operation("op", key=template, scope="order")
    assert info.value.field == "key"


def test_separators_are_the_punctuation_next_to_fields() -> None:
    op = Operation("cart", key="cart_mandate:{session_id}/{cart_hash}", scope="session")
    assert op.separators == "/:"
    assert op.build(session_id="sess_1", cart_hash="h-1") == "cart_mandate:sess_1/h-1"
    assert op.parse("cart_mandate:sess_1/h-1") == {"session_id": "sess_1", "cart_hash": "h-1"}
    with pytest.raises(InvalidKeyError, match="separator '/'"):
        op.build(session_id="a/b", cart_hash="h")


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ({"name": "has space"}, "name", "operation name"),
        ({"scope": "Order"}, "scope", "lower-case word"),
        ({"scope": ""}, "scope", "lower-case word"),
        ({"ttl": "forever"}, "ttl", "not a duration"),
        ({"ttl": 0}, "ttl", "longer than zero"),
        ({"lease": "2d"}, "lease", "must not be longer than ttl"),
        ({"retention": "financal"}, "retention", "did you mean 'financial'"),
        ({"final_failures": "yes"}, "final_failures", "true or false"),
        ({"description": 3}, "description", "string"),
    ],
)
def test_bad_operations(changes: dict[str, object], field: str, reason: str) -> None:
    settings: dict[str, object] = {"name": "op", "key": "op:{id}", "scope": "order", **changes}
    with pytest.raises(MapError, match=reason) as info:
        Operation(**settings)  # type: ignore[arg-type]
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_operation_takes_duration_text_and_compares_by_value() -> None:
    op = Operation("op", key="op:{id}", scope="order", ttl="1h30m", lease="5s")
    assert (op.ttl, op.lease) == (5400.0, 5.0)
    assert op == Operation("op", key="op:{id}", scope="order", ttl=5400, lease=5)
    assert hash(op) == hash(Operation("op", key="op:{id}", scope="order", ttl=5400, lease=5))
    assert pickle.loads(pickle.dumps(op)) == op
    with pytest.raises(TypeError):
        Operation("op", "op:{id}", "order")  # type: ignore[misc]


# -- routes ------------------------------------------------------------------------


def routed(*routes: Route) -> IdempotencyMap:
    return IdempotencyMap(IdempotencyMap.default().operations, routes)


def test_route_patterns() -> None:
    imap = routed(
        Route("POST", "/payments/refunds", "order"),
        Route("POST", "/payments/{order_id}", "payment", wait="5s"),
        Route("post", "/orders/{cart_mandate_id}/users/{user_id}", "order"),
        Route("PUT", "/sync/{entity}/*", "sync"),
        Route("*", "/webhooks/{source:path}", "webhook", require_key=False),
        Route("*", "/", "session"),
    )
    assert imap.route("POST", "/payments/refunds") == (imap.routes[0], {})
    route, params = imap.route("POST", "/payments/order_789") or (None, None)
    assert route is imap.routes[1] and params == {"order_id": "order_789"}
    assert route.wait == 5.0
    assert imap.route("POST", "/payments/order_789?x=1") == (route, {"order_id": "order_789"})
    assert imap.route("post", "/payments/o") == (route, {"order_id": "o"})
    assert imap.route("GET", "/payments/o") is None
    assert imap.route("POST", "/payments/o/extra") is None
    assert imap.route("POST", "/payments/") is None
    assert imap.route("POST", "/orders/m/users/u") == (
        imap.routes[2],
        {
            "cart_mandate_id": "m",
            "user_id": "u",
        },
    )
    assert imap.route("PUT", "/sync/product/a/b") == (imap.routes[3], {"entity": "product"})
    assert imap.route("PUT", "/sync/product/") == (imap.routes[3], {"entity": "product"})
    assert imap.route("PUT", "/sync/product") is None
    assert imap.route("DELETE", "/webhooks/shopify/x") == (imap.routes[4], {"source": "shopify/x"})
    assert imap.route("PATCH", "/") == (imap.routes[5], {})
    assert imap.route("PATCH", "/nothing") is None
    assert imap.routes[1].match("POST", "/payments/9") == {"order_id": "9"}
    assert imap.routes[1].match("GET", "/payments/9") is None
    assert imap.routes[4].match("GET", "/webhooks/") == {"source": ""}


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("//payments/o1", {"order_id": "o1"}),
        ("/./payments/o1", {"order_id": "o1"}),
        ("/x/../payments/o1", {"order_id": "o1"}),
        ("/payments//o1", {"order_id": "o1"}),
        ("/payments/./o1", {"order_id": "o1"}),
        ("/payments/x/../o1", {"order_id": "o1"}),
        ("/../../payments/o1", {"order_id": "o1"}),
        ("/payments/refunds/..//o1", {"order_id": "o1"}),
    ],
)
def test_a_path_spelled_with_repeated_slashes_or_dot_segments_takes_its_route(
    path: str, params: dict[str, str]
) -> None:
    imap = routed(
        Route("POST", "/payments/refunds", "order"),
        Route("POST", "/payments/{order_id}", "payment"),
    )
    assert imap.route("POST", path) == (imap.routes[1], params)
    assert imap.routes[1].match("POST", path) == params


def test_dot_segments_that_leave_a_directory_are_not_its_last_segment() -> None:
    imap = routed(Route("POST", "/payments", "payment"))
    assert imap.route("POST", "/payments/x/..") is None  # "/payments/", another path
    assert imap.route("POST", "/payments/.") is None
    assert imap.route("POST", "/payments/x/../../payments") == (imap.routes[0], {})


def test_routes_hash_by_value_and_pickle() -> None:
    route = Route("post", "/a/{x}", "order", wait="1s")
    same = Route("POST", "/a/{x}", "order", wait=1)
    assert route == same and hash(route) == hash(same) and {route: 1}[same] == 1
    copy = pickle.loads(pickle.dumps(route))
    assert copy == route and hash(copy) == hash(route)
    assert route != Route("POST", "/a/{x}", "order", wait=2)


def test_first_declared_route_wins() -> None:
    imap = routed(
        Route("POST", "/a/special", "order"),
        Route("*", "/a/{x}", "payment"),
    )
    assert imap.route("POST", "/a/special")[0].operation == "order"  # type: ignore[index]
    assert imap.route("GET", "/a/special")[0].operation == "payment"  # type: ignore[index]


@pytest.mark.parametrize(
    ("routes", "reason"),
    [
        ((Route("POST", "/a/{x}", "order"), Route("POST", "/a/{y}", "payment")), "duplicate"),
        ((Route("POST", "/a/*", "order"), Route("POST", "/a/{p:path}", "order")), "duplicate"),
        ((Route("POST", "/a/{x}", "order"), Route("POST", "/a/b", "order")), "never match"),
        ((Route("*", "/a/b", "order"), Route("POST", "/a/b", "order")), "never match"),
        ((Route("POST", "/a/*", "order"), Route("POST", "/a/b/{c}", "order")), "never match"),
        ((Route("POST", "/*", "order"), Route("POST", "/a/*", "order")), "never match"),
    ],
)
def test_dead_routes_are_refused(routes: tuple[Route, ...], reason: str) -> None:
    with pytest.raises(MapError, match=reason) as info:
        routed(*routes)
    assert info.value.field == "routes[1].path"


@pytest.mark.parametrize(
    "routes",
    [
        (Route("POST", "/a/b", "order"), Route("POST", "/a/{x}", "order")),
        (Route("POST", "/a/{x}", "order"), Route("POST", "/a/*", "order")),
        (Route("POST", "/a/{x}", "order"), Route("GET", "/a/{x}", "order")),
        (Route("POST", "/a/{x}", "order"), Route("*", "/a/{x}", "order")),
        (Route("POST", "/a/*", "order"), Route("POST", "/a", "order")),
        (Route("POST", "/a/{x}/*", "order"), Route("POST", "/a/*", "order")),
    ],
)
def test_live_routes_are_kept(routes: tuple[Route, ...]) -> None:
    assert routed(*routes).routes == routes


@pytest.mark.parametrize(
    ("args", "kwargs", "field", "reason"),
    [
        (("GET POST", "/a", "order"), {}, "method", "HTTP method"),
        ((1, "/a", "order"), {}, "method", "string"),
        (("POST", "a", "order"), {}, "path", "start with '/'"),
        (("POST", "/a//b", "order"), {}, "path", "empty segment"),
        (("POST", "/a/*/b", "order"), {}, "path", "must come last"),
        (("POST", "/a/order-{id}", "order"), {}, "path", "whole segment"),
        (("POST", "/a/{x}/{x}", "order"), {}, "path", "twice"),
        (("POST", "/a/{1x}", "order"), {}, "path", "not a valid parameter"),
        (("POST", "/a?b", "order"), {}, "path", "'?'"),
        (("POST", "/a", "order"), {"header": "Idempotency Key"}, "header", "header name"),
        (
            ("POST", "/a", "order"),
            {"duplicate_response": "replays"},
            "duplicate_response",
            "replay",
        ),
        (("POST", "/a", "order"), {"wait": "-1s"}, "wait", "negative"),
        (("POST", "/a", "order"), {"require_key": 1}, "require_key", "true or false"),
        (("POST", "/a", "order"), {"validate_key": "no"}, "validate_key", "true or false"),
    ],
)
def test_bad_routes(args: tuple, kwargs: dict, field: str, reason: str) -> None:
    with pytest.raises(MapError, match=reason) as info:
        Route(*args, **kwargs)
    assert info.value.field == field


def test_map_refuses_unknown_operations_and_duplicate_names() -> None:
    with pytest.raises(MapError, match="unknown operation 'paymnt'; did you mean 'payment'") as e:
        routed(Route("POST", "/p", "paymnt"))
    assert e.value.field == "routes[0].operation"
    op = Operation("x", key="x:{id}", scope="order")
    with pytest.raises(MapError, match="twice"):
        IdempotencyMap([op, op])


def test_with_operations_and_merge() -> None:
    base = IdempotencyMap.default()
    refund = Operation("refund", key="refund:{payment_id}", scope="order", retention=FINANCIAL)
    more = base.with_operations(refund).with_routes(Route("POST", "/refunds", "refund"))
    assert "refund" in more and "refund" not in base
    merged = IdempotencyMap().merge(more)
    assert merged == more
    assert merged != base


# -- TOML --------------------------------------------------------------------------

FULL = textwrap.dedent(
    """\
    # An Idempotency Map
    include_defaults = false

    [defaults]
    ttl = "12h"
    lease = "20s"

    [operations.payment]
    key = "payment:{order_id}:{amount}:{currency}:{timestamp}"
    scope = "order"
    ttl = "7d"
    lease = 30
    retention = "financial"
    final_failures = false
    description = "Charge \\"an\\" order"

    [operations.signup]
    key = "signup:{user_id}"
    scope = "user"

    [[routes]]
    method = "POST"
    path = "/payments/{order_id}"
    operation = "payment"
    require_key = true
    header = "Idempotency-Key"
    duplicate_response = "replay"
    wait = "5s"
    validate_key = true

    [[routes]]
    method = "*"
    path = "/signup"
    operation = "signup"
    require_key = false
    duplicate_response = "no_content"
    """
)


def test_loads_a_full_file(tmp_path: Path) -> None:
    path = tmp_path / "idempotency.toml"
    path.write_text(FULL)
    imap = IdempotencyMap.load(path)
    assert imap == IdempotencyMap.loads(FULL)
    payment, signup = imap.operation("payment"), imap.operation("signup")
    assert (payment.ttl, payment.lease, payment.retention) == (WEEK, 30, FINANCIAL)
    assert payment.description == 'Charge "an" order'
    assert (signup.ttl, signup.lease, signup.retention) == (12 * 3600, 20, STANDARD)
    first, second = imap.routes
    assert first == Route("POST", "/payments/{order_id}", "payment", wait=5, validate_key=True)
    assert second == Route(
        "*", "/signup", "signup", require_key=False, duplicate_response="no_content"
    )
    assert "session" not in imap


def test_include_defaults_overrides_fields() -> None:
    imap = IdempotencyMap.loads(
        textwrap.dedent(
            """\
            include_defaults = true
            [defaults]
            ttl = "1h"
            [operations.payment]
            ttl = "14d"
            [operations.refund]
            key = "refund:{payment_id}"
            scope = "order"
            """
        )
    )
    default = IdempotencyMap.default()
    assert set(imap.operations) == {*default.operations, "refund"}
    payment = imap.operation("payment")
    assert payment.ttl == 14 * DAY
    assert (payment.key, payment.retention) == (default.operation("payment").key, FINANCIAL)
    assert imap.operation("refund").ttl == 3600  # [defaults] applies to new operations
    assert imap.operation("session") == default.operation("session")


def test_empty_file_is_an_empty_map() -> None:
    assert IdempotencyMap.loads("") == IdempotencyMap()
    assert IdempotencyMap().to_toml() == ""


def test_to_toml_round_trips() -> None:
    imap = IdempotencyMap.loads(FULL).merge(IdempotencyMap.default())
    odd = Operation(
        "odd.name",
        key="odd:{a}",
        scope="entity",
        ttl=0.25,
        lease=0.001,
        description='quotes " and \\ and \n newline and \t tab',
        final_failures=True,
    )
    imap = imap.with_operations(odd)
    text = imap.to_toml()
    assert '[operations."odd.name"]' in text
    assert IdempotencyMap.loads(text) == imap
    assert IdempotencyMap.from_dict(imap.to_dict()) == imap
    assert "payment" in imap.describe() and "POST /payments/{order_id} -> payment" in (
        imap.describe()
    )


def error_of(text: str, source: str = "imap.toml") -> MapError:
    with pytest.raises(MapError) as info:
        IdempotencyMap.loads(textwrap.dedent(text), source=source)
    return info.value


OP = """\
[operations.payment]
key = "payment:{order_id}"
scope = "order"
"""


@pytest.mark.parametrize(
    ("text", "line", "field", "reason"),
    [
        # TOML syntax
        (
            '[operations.payment]\nkey = "payment:{id}\n',
            2,
            "operations.payment.key",
            "not valid TOML",
        ),
        ("x = 1\nx = 2\n", 2, "x", "not valid TOML"),
        # the top level
        ("includ_defaults = true\n", 1, "includ_defaults", "did you mean 'include_defaults'"),
        ("\n[operation.payment]\nkey = 'a:{b}'\n", 2, "operation", "did you mean 'operations'"),
        ('include_defaults = "yes"\n', 1, "include_defaults", "true or false"),
        ("operations = 3\n", 1, "operations", "must be a table"),
        ("routes = 3\n", 1, "routes", "array of tables"),
        # [defaults]
        ('[defaults]\nttl = "1 day"\n', 2, "defaults.ttl", "not a duration"),
        ('[defaults]\nretention = "gold"\n', 2, "defaults.retention", "must be one of"),
        ("[defaults]\nscope = 'user'\n", 2, "defaults.scope", "unknown key 'scope'"),
        ('[defaults]\nlease = "2d"\n' + OP, 2, "defaults.lease", "longer than ttl"),
        # operations
        (OP + 'tll = "1h"\n', 4, "operations.payment.tll", "did you mean 'ttl'"),
        (OP + 'ttl = "1y"\n', 4, "operations.payment.ttl", "not a duration"),
        (OP + "ttl = true\n", 4, "operations.payment.ttl", "boolean"),
        (OP + "ttl = -5\n", 4, "operations.payment.ttl", "negative"),
        (OP + 'ttl = "10s"\nlease = "30s"\n', 5, "operations.payment.lease", "longer than ttl"),
        (OP + 'ttl = "10s"\n', 4, "operations.payment.ttl", "longer than ttl"),
        (OP + 'retention = "finance"\n', 4, "operations.payment.retention", "'financial'"),
        (OP + "final_failures = 1\n", 4, "operations.payment.final_failures", "true or false"),
        (OP + "description = ['x']\n", 4, "operations.payment.description", "array"),
        (
            '[operations.payment]\nkey = "payment:{order.id}"\nscope = "order"\n',
            2,
            "operations.payment.key",
            "attribute",
        ),
        ("[operations.payment]\nkey = 5\nscope = 'order'\n", 2, "operations.payment.key", "string"),
        ('[operations.payment]\nscope = "order"\n', 1, "operations.payment", "needs a key"),
        ('[operations.payment]\nkey = "p:{a}"\n', 1, "operations.payment", "needs a scope"),
        (
            '[operations.payment]\nkey = "p:{a}"\nscope = "Order"\n',
            3,
            "operations.payment.scope",
            "lower-case",
        ),
        ('[operations."pay ment"]\nkey = "p:{a}"\nscope = "order"\n', 1, '"pay ment"', "name"),
        ("[operations]\npayment = 3\n", 2, "operations.payment", "must be a table"),
        (
            '[operations]\npayment = { key = "p:{a}", scope = "order", ttl = "x" }\n',
            2,
            "operations.payment.ttl",
            "not a duration",
        ),
        # routes
        (
            OP + '[[routes]]\nmethod = "POST"\npath = "/p"\noperation = "paymnt"\n',
            7,
            "routes[0].operation",
            "did you mean 'payment'",
        ),
        (
            OP + '[[routes]]\nmethod = "POST"\npath = "/p"\noperation = "payment"\n'
            '[[routes]]\nmethod = "GET POST"\npath = "/p"\noperation = "payment"\n',
            9,
            "routes[1].method",
            "HTTP method",
        ),
        (
            OP + '[[routes]]\nmethod = "POST"\npath = "p"\noperation = "payment"\n',
            6,
            "routes[0].path",
            "start with '/'",
        ),
        (
            OP + '[[routes]]\nmethod = "POST"\npath = "/p/{x}"\noperation = "payment"\n'
            '[[routes]]\nmethod = "POST"\npath = "/p/{y}"\noperation = "payment"\n',
            10,
            "routes[1].path",
            "duplicate route",
        ),
        (
            OP + '[[routes]]\nmethod = "POST"\npath = "/p"\noperation = "payment"\n'
            'duplicate_response = "no-content"\n',
            8,
            "routes[0].duplicate_response",
            "did you mean 'no_content'",
        ),
        (
            OP + '[[routes]]\nmethod = "POST"\npath = "/p"\noperation = "payment"\n'
            'header = "Idempotency Key"\n',
            8,
            "routes[0].header",
            "header name",
        ),
        (
            OP + '[[routes]]\nmethod = "POST"\npath = "/p"\noperation = "payment"\nwait = "soon"\n',
            8,
            "routes[0].wait",
            "not a duration",
        ),
        (
            OP + '[[routes]]\nmethod = "POST"\npath = "/p"\noperation = "payment"\nheaders = "X"\n',
            8,
            "routes[0].headers",
            "did you mean 'header'",
        ),
        (
            OP + '[[routes]]\nmethod = "POST"\noperation = "payment"\n',
            4,
            "routes[0]",
            "needs a path",
        ),
        (OP + "[routes]\nmethod = 'POST'\n", 4, "routes", "array of tables"),
    ],
)
def test_broken_files_name_file_line_and_field(
    text: str, line: int, field: str, reason: str
) -> None:
    error = error_of(text)
    assert (error.source, error.line) == ("imap.toml", line), str(error)
    assert error.field == field or error.field.endswith(field), str(error)
    assert reason in error.message, str(error)
    assert str(error).startswith(f"imap.toml:{line}: {error.field}: ")
    assert isinstance(error, ValueError)


def test_multiline_strings_do_not_confuse_line_numbers() -> None:
    error = error_of(
        '[operations.payment]\ndescription = """\n[routes]\nttl = 1\n"""\n'
        'key = "p:{a}"\nscope = "order"\nttl = "nope"\n'
    )
    assert (error.line, error.field) == (8, "operations.payment.ttl")


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(MapError, match="cannot read") as info:
        IdempotencyMap.load(missing)
    assert info.value.source == str(missing) and info.value.line is None
    bad = tmp_path / "bad.toml"
    bad.write_text('[operations.payment]\nkey = "p:{a}"\nscope = "order"\nttl = "x"\n')
    with pytest.raises(MapError) as info:
        IdempotencyMap.load(bad)
    assert str(info.value).startswith(f"{bad}:4: operations.payment.ttl: ")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(MapError, match="UTF-8"):
        IdempotencyMap.load(binary)


def test_map_error_pickles() -> None:
    error = MapError("bad", source="f.toml", line=3, field=("routes", 2, "operation"))
    assert str(error) == "f.toml:3: routes[2].operation: bad"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.source, copy.line, copy.field, str(copy)) == (
        "f.toml",
        3,
        "routes[2].operation",
        str(error),
    )
