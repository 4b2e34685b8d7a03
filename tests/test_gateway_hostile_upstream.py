"""The gateway against hostile input on both sides: paths spelled to dodge a route or
a fingerprint, forwarding headers a client forges, and upstream answers that are
cut short, badly framed or followed by bytes nobody asked for.

Upstreams are real processes on free loopback ports: the test API of
``_upstream`` and the byte-level ``_hostile_upstream``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
from _upstream import UpstreamProcess
from test_gateway import Running, gateway  # noqa: F401  (the fixture)
from test_map_http import send_target


@pytest.fixture(scope="module")
def origin() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as up:
        yield up.start()


def test_encoded_slash_is_another_request_than_a_slash(
    origin: UpstreamProcess,
    gateway: Callable[..., Running],  # noqa: F811
) -> None:
    """The fingerprint covers the exact target forwarded: ``/echo/a%2Fb`` then
    ``/echo/a/b`` with the same key is a conflict, never the first answer replayed."""
    gw = gateway(origin.url)
    headers = {"idempotency-key": "slash-1"}
    status, body = send_target(gw.url, "/echo/a%2Fb", headers)
    assert status == 200 and json.loads(body)["raw_path"] == "/echo/a%2Fb"
    status, body = send_target(gw.url, "/echo/a/b", headers)
    assert status == 422 and json.loads(body)["code"] == "idempotency_conflict", body
    status, body = send_target(gw.url, "/echo/a%2Fb", headers)  # the same target: replayed
    assert status == 200 and json.loads(body)["raw_path"] == "/echo/a%2Fb"
