"""Take docs/dashboard.png: the dashboard of a running ``retrysafe demo`` under a retry storm.

    .venv/bin/python scripts/dashboard_screenshot.py [--out docs/dashboard.png]

Starts ``retrysafe demo`` on a temporary store and a free port, runs
examples/retry_storm.py against it a few times while the page is open, and
saves a full-page screenshot taken by Debian's headless chromium (Playwright).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    parser.add_argument("--storms", type=int, default=6)
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        print("dashboard_screenshot: chromium is not installed", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        demo = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "retrysafe",
                "demo",
                "--store",
                f"sqlite:///{tmp}/demo.db",
                "--listen",
                f"127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=tmp,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(url + "/_retrysafe/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the demo did not start")
                time.sleep(0.2)
            with sync_playwright() as p:
                browser = p.chromium.launch(
                    executable_path=chromium,
                    args=[
                        "--no-sandbox",
                        "--disable-gpu",
                        "--disable-background-networking",
                        "--disable-component-update",
                        "--disable-sync",
                        "--no-first-run",
                    ],
                )
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(url + "/_retrysafe/")
                storm = [sys.executable, str(ROOT / "examples" / "retry_storm.py"), url]
                for _ in range(args.storms):
                    subprocess.run(storm, stdout=subprocess.DEVNULL, check=True, timeout=120)
                    time.sleep(1.5)
                page.wait_for_timeout(2500)
                page.screenshot(path=args.out, full_page=True)
                browser.close()
        finally:
            demo.terminate()
            demo.wait(15)
    print(f"dashboard_screenshot: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
