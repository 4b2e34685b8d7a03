"""The dashboard in a real headless browser (Debian's chromium, driven by Playwright).

The gateway runs in front of the test API's upstream process; a load thread
sends keyed requests with duplicates through it while the page is open, and the
page's numbers and charts must follow. Every test fails on a console error.
"""

from __future__ import annotations

import shutil
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _hangup import CALLER, cookieless
from _http_servers import ThreadServer

from retrysafe.gateway import create_app

TOKEN = "dash-" + uuid.uuid4().hex
CHROMIUM = shutil.which("chromium") or shutil.which(
    "chromium-browser"
)  # scripts/test.sh installs it


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert CHROMIUM is not None, "chromium is not installed"
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield b
        b.close()


@pytest.fixture(scope="module")
def gateway(upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The gateway with an admin token, on SQLite."""
    store = f"sqlite:///{tmp_path_factory.mktemp('dash')}/gw.db"
    with ThreadServer(create_app(upstream, store=store, admin_token=TOKEN), "asgi") as s:
        yield s.url


class Page:
    """A browser page that records console errors."""

    def __init__(self, browser: Any, **context: Any) -> None:
        self.context = browser.new_context(**context)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    p = Page(browser, extra_http_headers={"Authorization": f"Bearer {TOKEN}"})
    yield p
    p.close()
    assert p.errors == []


def count(page: Any, outcome: str) -> int:
    text = page.locator(f'#counts [data-outcome="{outcome}"] b').inner_text()
    return int(text.replace(",", "").replace("\u202f", "").replace(".", "") or 0)


def load(url: str, stop: threading.Event) -> None:
    """Keyed orders until ``stop``: each key sent three times."""
    with httpx.Client(base_url=url, timeout=10, headers=CALLER, cookies=cookieless()) as c:
        while not stop.is_set():
            key = uuid.uuid4().hex
            for _ in range(3):
                c.post(
                    "/orders",
                    json={"k": key},
                    headers={"idempotency-key": key, "x-test-id": "dash"},
                )
            time.sleep(0.02)


def test_the_numbers_and_charts_move_while_load_runs(gateway: str, page: Page) -> None:
    p = page.page
    p.goto(gateway + "/_retrysafe/")
    p.wait_for_selector('#counts [data-outcome="executed"]')
    before = count(p, "executed"), count(p, "replayed")
    stop = threading.Event()
    worker = threading.Thread(target=load, args=(gateway, stop))
    worker.start()
    try:
        # Updated without a reload: three figures while the load runs (which lasts until
        # they are seen, not 8 s that a busy machine could spend on one or two refreshes;
        # the minute is only there to end a page that never refreshes).
        seen = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(seen) < 3:
            seen.add(count(p, "executed"))
            p.wait_for_timeout(700)
        assert len(seen) >= 3, f"the figures did not keep changing: {seen}"
        p.wait_for_function(
            "() => document.querySelector('#chart-outcomes path[data-series=\"executed\"]')"
        )
    finally:
        stop.set()
        worker.join()
    after = count(p, "executed"), count(p, "replayed")
    assert after[0] > before[0] and after[1] > before[1]
    assert "%" in p.locator("#rate-window").inner_text()
    assert p.locator("#chart-rate path").count() >= 1
    assert p.locator("#store-health").inner_text().startswith("store up")
    assert p.locator("#loopback-note").is_hidden()  # a token is set


def test_the_inspector_finds_a_key(gateway: str, page: Page) -> None:
    key = "inspect-" + uuid.uuid4().hex
    r = httpx.post(
        gateway + "/orders", json={"find": "me"}, headers={"idempotency-key": key, **CALLER}
    )
    assert r.status_code == 201
    p = page.page
    p.goto(gateway + "/_retrysafe/")
    p.fill("#inspect-key", key)
    p.click("#inspect button")
    result = p.wait_for_selector("#inspect-result [data-record]")
    text = result.inner_text()
    assert key in text and "completed" in text and '"find"' in text and "201" in text
    p.fill("#inspect-key", "nobody-" + uuid.uuid4().hex)
    p.click("#inspect button")
    p.wait_for_selector("#inspect-result .empty")


def test_without_the_token_access_is_refused(gateway: str, browser: Any) -> None:
    assert httpx.get(gateway + "/_retrysafe/").status_code == 401
    assert httpx.get(gateway + "/_retrysafe/api/stats").status_code == 401
    assert httpx.get(gateway + "/_retrysafe/metrics").status_code == 401
    assert httpx.get(gateway + "/_retrysafe/health").status_code == 200  # always open
    anonymous = Page(browser)
    try:
        p = anonymous.page
        response = p.goto(gateway + "/_retrysafe/")
        assert response is not None and response.status == 401
        assert p.locator("#counts").count() == 0  # nothing of the dashboard
        p.fill("#token", "wrong")
        p.click("#login button")
        p.wait_for_selector("#login-error:not([hidden])")
        p.fill("#token", TOKEN)
        p.click("#login button")
        p.wait_for_selector('#counts [data-outcome="executed"]')
        p.wait_for_function("() => document.querySelector('#updated').textContent.length > 0")
    finally:
        anonymous.close()
    # The refused token and the 401 page itself are logged as failed loads: nothing else.
    assert [e for e in anonymous.errors if "401" not in e] == []


def test_readable_on_a_phone(gateway: str, browser: Any) -> None:
    phone = Page(
        browser,
        viewport={"width": 390, "height": 844},
        is_mobile=True,
        extra_http_headers={"Authorization": f"Bearer {TOKEN}"},
    )
    try:
        p = phone.page
        p.goto(gateway + "/_retrysafe/")
        p.wait_for_selector('#counts [data-outcome="executed"]')
        assert p.evaluate("document.scrollingElement.scrollWidth <= innerWidth")
        for section in ("#chart-rate", "#in-flight", "#inspect"):
            box = p.locator(section).bounding_box()
            assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390
    finally:
        phone.close()
    assert phone.errors == []


def test_loopback_only_without_a_token(upstream: str, browser: Any, tmp_path: Path) -> None:
    app = create_app(
        upstream, store=f"sqlite:///{tmp_path}/open.db", admin_token=None, admin_loopback=True
    )
    with ThreadServer(app, "asgi") as s:
        open_page = Page(browser)
        try:
            p = open_page.page
            assert p.goto(s.url + "/_retrysafe/").status == 200  # type: ignore[union-attr]
            p.wait_for_selector("#loopback-note:not([hidden])")
        finally:
            open_page.close()
    assert open_page.errors == []


def test_closed_without_a_token_or_the_loopback_opt_in(
    upstream: str, browser: Any, tmp_path: Path
) -> None:
    """The default: a browser on this machine (or a proxy on it) gets no dashboard."""
    app = create_app(
        upstream, store=f"sqlite:///{tmp_path}/closed.db", admin_token=None, admin_loopback=False
    )
    with ThreadServer(app, "asgi") as s:
        closed = Page(browser)
        try:
            answer = closed.page.goto(s.url + "/_retrysafe/")
            assert answer is not None and answer.status == 403
            assert answer.json()["code"] == "admin_closed"
            assert closed.page.locator("#loopback-note").count() == 0  # no dashboard at all
        finally:
            closed.close()


def test_the_token_never_leaves_the_admin_pages(gateway: str, browser: Any) -> None:
    """Opened without the trailing slash, the page still asks only /_retrysafe/…: a
    relative URL would send the token to the app behind the gateway."""
    anonymous = Page(browser)
    asked: list[str] = []
    anonymous.page.on("request", lambda request: asked.append(request.url))
    try:
        p = anonymous.page
        p.goto(gateway + "/_retrysafe")
        p.fill("#token", TOKEN)
        p.click("#login button")
        p.wait_for_selector('#counts [data-outcome="executed"]')
        deadline = time.monotonic() + 10
        while sum("/api/" in u for u in asked) < 3:  # a few refreshes
            assert time.monotonic() < deadline, asked
            p.wait_for_timeout(200)
        assert p.url == gateway + "/_retrysafe/"
        api = [u for u in asked if "/api/" in u]
        assert api and all(u.startswith(gateway + "/_retrysafe/api/") for u in api), api
    finally:
        anonymous.close()
    assert [e for e in anonymous.errors if "401" not in e] == []


def test_a_json_page_opened_with_the_token_is_shown_as_text(gateway: str, browser: Any) -> None:
    """Stored answers and keys are other people's text: never parsed as a page."""
    key = '<meta http-equiv="refresh" content="0;url=https://example.invalid/">'
    assert (
        httpx.post(
            gateway + "/orders", json={"x": 1}, headers={"idempotency-key": key, **CALLER}
        ).status_code
        == 201
    )
    anonymous = Page(browser)
    try:
        p = anonymous.page
        target = f"{gateway}/_retrysafe/api/records?{urllib.parse.urlencode({'key': key})}"
        p.goto(target)
        p.fill("#token", TOKEN)
        p.click("#login button")
        p.wait_for_selector("pre")
        assert p.url == target and "example.invalid" in p.locator("pre").inner_text()
        assert p.locator("meta[http-equiv]").count() == 0
    finally:
        anonymous.close()
