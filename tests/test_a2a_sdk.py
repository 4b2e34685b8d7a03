"""retrysafe.a2a as the official a2a-sdk client sees it.

The a2a-sdk agent of ``_a2a_app.py`` runs behind ``A2AMiddleware`` on a real
uvicorn; the official client (``a2a.client.create_client``, non-streaming
sends over JSON-RPC v1.0) talks to it. A refusal must reach the caller as the
SDK's own error class with retrysafe's metadata in ``exc.data``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _a2a_app import Counter, make_app
from _a2a_cards import card, card_app
from _http_servers import ThreadServer, free_port
from a2a.client import A2ACardResolver, Client, ClientConfig, create_client
from a2a.types import (
    AgentCard,
    AgentCardSignature,
    AgentExtension,
    GetExtendedAgentCardRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    Task,
)
from a2a.utils.errors import InternalError, InvalidParamsError
from google.protobuf.json_format import MessageToDict

import retrysafe.a2a
from retrysafe.a2a import EXTENSION_URI, MAX_CARD_BYTES, A2AMiddleware, agent_extension

#: A2A's own error codes (A2A v1.0 §9.5): retrysafe's answers stay out of them.
A2A_RESERVED = range(-32099, -32000)


class Caller:
    """One test's official client (its test id and principal) and the agent's counter."""

    def __init__(self, url: str, counter: Counter) -> None:
        self.url, self.counter = url, counter
        self.tid = uuid.uuid4().hex
        auth = f"Bearer caller-{self.tid}"  # a principal of its own: fixed ids never meet
        self.http = httpx.AsyncClient(
            headers={"authorization": auth, "x-test-id": self.tid}, timeout=30
        )

    async def client(self, *, streaming: bool = False) -> Client:
        card = await A2ACardResolver(self.http, self.url).get_agent_card()
        for interface in card.supported_interfaces:  # the card names a placeholder URL
            interface.url = self.url + "/"
        config = ClientConfig(httpx_client=self.http, streaming=streaming)
        return await create_client(card, config)

    async def send(self, message_id: str, text: str = "hello", **options: Any) -> Task:
        """Send one message with the official client; the Task it answers."""
        client = await self.client(**options)
        message = Message(message_id=message_id, role=Role.ROLE_USER, parts=[Part(text=text)])
        events = [e async for e in client.send_message(SendMessageRequest(message=message))]
        assert events[0].HasField("task"), events
        return events[0].task

    @property
    def tasks(self) -> int:
        return self.counter.count(self.tid)

    async def started(self, n: int = 1) -> None:
        """Until the agent has started ``n`` executions for this test."""
        for _ in range(3000):
            if self.tasks >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the agent did not start {n} executions in 30 s")

    def open_gate(self) -> None:
        self.counter.gate(self.tid).touch()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Counter]]:
    """The agent behind the middleware on SQLite, and its counter."""
    root = tmp_path_factory.mktemp("a2a-sdk")
    counter = Counter(root / "counters")
    with ThreadServer(make_app(counter.root, f"sqlite:///{root / 'a2a.db'}"), "asgi") as server:
        yield server.url, counter


@pytest.fixture
async def caller(agent: tuple[str, Counter]) -> AsyncIterator[Caller]:
    c = Caller(*agent)
    yield c
    c.open_gate()  # never leave an execution waiting
    await c.http.aclose()


def mid() -> str:
    return str(uuid.uuid4())


# -- item: errors the client keeps ------------------------------------------------------


async def test_a_duplicate_in_flight_is_an_internal_error_with_retry_guidance(
    caller: Caller,
) -> None:
    m = mid()
    first = asyncio.create_task(caller.send(m, "gate"))
    await caller.started()
    with pytest.raises(InternalError) as raised:
        await caller.send(m, "gate")
    assert not first.done()
    data = raised.value.data
    assert data is not None
    assert data["code"] == "idempotency_in_flight"
    assert data["retryable"] == "true"
    assert int(data["retryAfter"]) >= 1
    assert data["originalRequestId"]
    caller.open_gate()
    task = await first
    assert (await caller.send(m, "gate")).id == task.id
    assert caller.tasks == 1


async def test_other_content_under_one_message_id_is_invalid_params(caller: Caller) -> None:
    m = mid()
    task = await caller.send(m, "one thing")
    with pytest.raises(InvalidParamsError) as raised:
        await caller.send(m, "another thing")
    data = raised.value.data
    assert data is not None
    assert (data["code"], data["retryable"]) == ("idempotency_conflict", "false")
    assert len(data["originalFingerprint"]) == 64
    assert (await caller.send(m, "one thing")).id == task.id
    assert caller.tasks == 1


async def test_an_unreachable_store_is_an_internal_error_with_retry_guidance(
    tmp_path: Path,
) -> None:
    app = make_app(tmp_path, f"redis://127.0.0.1:{free_port()}/0")
    with ThreadServer(app, "asgi") as server:
        caller = Caller(server.url, Counter(tmp_path))
        try:
            with pytest.raises(InternalError) as raised:
                await caller.send(mid())
        finally:
            await caller.http.aclose()
    data = raised.value.data
    assert data is not None
    assert (data["code"], data["retryable"]) == ("idempotency_store_unavailable", "true")
    assert int(data["retryAfter"]) >= 1
    assert caller.tasks == 0


async def test_the_v10_error_data_is_a_list_of_typed_details(caller: Caller) -> None:
    """As A2A v1.0 §9.5 asks, with codes clear of A2A's own range (raw JSON-RPC)."""
    m = mid()
    await caller.send(m, "one thing")
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendMessage",
        "params": {"message": {"messageId": m, "role": "ROLE_USER", "parts": [{"text": "x"}]}},
    }
    response = await caller.http.post(caller.url + "/", json=body, headers={"a2a-version": "1.0"})
    error = response.json()["error"]
    assert error["code"] == -32602
    assert error["code"] not in A2A_RESERVED
    assert isinstance(error["data"], list)
    assert all("@type" in detail for detail in error["data"])
    assert error["data"][0]["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"
    assert error["data"][0]["reason"] == "INVALID_PARAMS"
    assert error["data"][0]["metadata"]["code"] == "idempotency_conflict"


# -- item: any messageId A2A allows -------------------------------------------------------


@pytest.mark.parametrize(
    "message_id", ["msg-é-42", "m" * 300, "🙂", "sha256:" + "0" * 64, "x" * 1024, " spaced "]
)
async def test_any_message_id_a2a_allows_runs_once(caller: Caller, message_id: str) -> None:
    """A2A's messageId is any string: each one is deduplicated, none is refused."""
    first = await caller.send(message_id)
    assert (await caller.send(message_id)).id == first.id
    assert caller.tasks == 1
    with pytest.raises(InvalidParamsError) as raised:  # still a key: a conflict
        await caller.send(message_id, "other")
    assert raised.value.data is not None
    assert raised.value.data["code"] == "idempotency_conflict"


async def test_a_hashed_message_id_never_stands_for_another(caller: Caller) -> None:
    """A long or non-ASCII id is stored as its SHA-256: sending that hash as an id
    is another message."""
    from retrysafe._model.hashing import protocol_key

    first = await caller.send("🙂")
    other = await caller.send(protocol_key("🙂"))
    assert other.id != first.id
    assert caller.tasks == 2


@pytest.mark.parametrize("message_id", ["", "x" * 1025])
async def test_an_unusable_message_id_is_invalid_params(caller: Caller, message_id: str) -> None:
    with pytest.raises(InvalidParamsError) as raised:
        await caller.send(message_id)
    assert raised.value.data is not None
    assert raised.value.data["code"] == "idempotency_key_invalid"
    assert caller.tasks == 0


# -- item: the agent card ---------------------------------------------------------------


def declared(card: AgentCard) -> list[Any]:
    return [e for e in card.capabilities.extensions if e.uri == EXTENSION_URI]


async def test_the_agent_card_advertises_deduplication(caller: Caller) -> None:
    """The official card resolver reads the extension; the client still works."""
    card = await A2ACardResolver(caller.http, caller.url).get_agent_card()
    [extension] = declared(card)
    assert extension.required is False
    params = MessageToDict(extension.params)
    assert params["key"] == "message.messageId"
    assert params["ttlSeconds"] == 86400
    assert params["streaming"] is False
    assert extension == AgentExtension(**agent_extension())
    task = await caller.send(m := mid())
    assert (await caller.send(m)).id == task.id


async def test_the_extended_card_advertises_it_in_both_spellings(tmp_path: Path) -> None:
    app = A2AMiddleware(card_app(tmp_path, card()), store="memory://", ttl=60)
    with ThreadServer(app, "asgi") as server:
        caller = Caller(server.url, Counter(tmp_path))
        try:
            client = await caller.client()
            extended = await client.get_extended_agent_card(GetExtendedAgentCardRequest())
            legacy = await caller.http.post(
                server.url + "/",
                json={"jsonrpc": "2.0", "id": 1, "method": "agent/getAuthenticatedExtendedCard"},
                headers={"a2a-version": "0.3"},
            )
        finally:
            await caller.http.aclose()
    [extension] = declared(extended)
    assert MessageToDict(extension.params)["ttlSeconds"] == 60
    extensions = legacy.json()["result"]["capabilities"]["extensions"]
    assert [e["uri"] for e in extensions] == [EXTENSION_URI]
    assert legacy.headers["content-length"] == str(len(legacy.content))


def test_the_rewritten_card_has_an_etag_of_its_own(tmp_path: Path) -> None:
    """The card with the extension is another entity than the app's: another ETag
    (and another for another ttl); a client holding the app's card gets the new
    one, a client holding the new one a 304."""
    plain = card_app(tmp_path, card())
    path = "/.well-known/agent-card.json"
    with (
        ThreadServer(plain, "asgi") as bare,
        ThreadServer(A2AMiddleware(plain, store="memory://", ttl=60), "asgi") as one,
        ThreadServer(A2AMiddleware(plain, store="memory://", ttl=120), "asgi") as two,
    ):
        original = httpx.get(bare.url + path).headers["etag"]
        etag = httpx.get(one.url + path).headers["etag"]
        assert etag.startswith('W/"') and etag != original
        assert etag != httpx.get(two.url + path).headers["etag"]
        stale = httpx.get(one.url + path, headers={"if-none-match": original})
        assert stale.status_code == 200 and stale.headers["etag"] == etag
        assert [e["uri"] for e in stale.json()["capabilities"]["extensions"]] == [EXTENSION_URI]
        fresh = httpx.get(one.url + path, headers={"if-none-match": etag})
        assert fresh.status_code == 304 and fresh.headers["etag"] == etag
        assert fresh.content == b""


def test_a_card_left_as_it_is_keeps_its_etag(tmp_path: Path) -> None:
    signed = card(signatures=[AgentCardSignature(protected="e30", signature="c2ln")])
    plain = card_app(tmp_path, signed)
    path = "/.well-known/agent-card.json"
    with (
        ThreadServer(plain, "asgi") as bare,
        ThreadServer(A2AMiddleware(plain, store="memory://"), "asgi") as wrapped,
    ):
        etag = httpx.get(bare.url + path).headers["etag"]
        assert httpx.get(wrapped.url + path).headers["etag"] == etag
        again = httpx.get(wrapped.url + path, headers={"if-none-match": etag})
        assert again.status_code == 304 and again.headers["etag"] == etag


@pytest.mark.parametrize(
    ("served", "options"),
    [
        (card(signatures=[AgentCardSignature(protected="e30", signature="c2ln")]), {}),
        (card(AgentExtension(**agent_extension(ttl=5))), {}),
        (card(), {"advertise": False}),
        (card(documentation_url="https://docs.example/" + "d" * MAX_CARD_BYTES), {}),
    ],
    ids=["signed", "declared", "advertise=False", "over MAX_CARD_BYTES"],
)
def test_a_card_is_left_as_it_is(
    tmp_path: Path, served: AgentCard, options: dict[str, Any]
) -> None:
    """A signed card (a change would break its signatures), a card that declares
    the extension itself, advertise=False, and a card too large to read whole:
    the app's own bytes, and a 304 to a client that holds them."""
    plain = card_app(tmp_path, served)
    with (
        ThreadServer(plain, "asgi") as bare,
        ThreadServer(A2AMiddleware(plain, store="memory://", **options), "asgi") as wrapped,
    ):
        path = "/.well-known/agent-card.json"
        original = httpx.get(bare.url + path)
        assert httpx.get(wrapped.url + path).content == original.content
        etag = original.headers["etag"]
        again = httpx.get(wrapped.url + path, headers={"if-none-match": etag})
        assert (again.status_code, again.headers["etag"], again.content) == (304, etag, b"")


def test_the_former_name_is_deprecated() -> None:
    with pytest.warns(DeprecationWarning, match="A2AMiddleware"):
        from retrysafe.a2a import IdempotencyMiddleware
    assert IdempotencyMiddleware is A2AMiddleware
    assert "IdempotencyMiddleware" not in retrysafe.a2a.__all__
    assert {"A2AMiddleware", "EXTENSION_URI", "agent_extension"} <= set(retrysafe.a2a.__all__)
    with pytest.raises(AttributeError):
        retrysafe.a2a.NoSuchName  # noqa: B018
