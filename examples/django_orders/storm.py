"""A duplicate storm against the example shop: every order sent many times at once.

::

    python examples/django_orders/storm.py http://127.0.0.1:8000 --mandates 20 --copies 8 --check

Each cart mandate's order is POSTed ``--copies`` times concurrently with the same
``Idempotency-Key: order:{cartMandateId}:{userId}``. ``--check`` then asks the
shop how many orders each mandate has and exits 1 unless every mandate has
exactly one and every copy got the same answer.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the shop, e.g. http://127.0.0.1:8000")
    parser.add_argument("--mandates", type=int, default=20)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--check", action="store_true", help="exit 1 unless one order each")
    args = parser.parse_args(argv)
    run = uuid.uuid4().hex[:8]
    user = "user-1"
    mandates = [f"cm-{run}-{i}" for i in range(args.mandates)]

    def send(mandate: str) -> tuple[str, int, bytes]:
        for attempt in range(5):
            try:
                response = httpx.post(
                    f"{args.url}/orders",
                    json={"cart_mandate_id": mandate, "user_id": user, "total": 4200},
                    headers={
                        "Idempotency-Key": f"order:{mandate}:{user}",
                        "Authorization": f"Bearer {user}",  # the caller (its records' scope)
                    },
                    timeout=60,
                )
            except httpx.TransportError:  # (runserver's short listen queue resets some)
                if attempt == 4:
                    raise
                continue  # a retry with the same key: exactly what the key is for
            return mandate, response.status_code, response.content
        raise AssertionError("unreachable")

    jobs = [m for m in mandates for _ in range(args.copies)]
    with ThreadPoolExecutor(min(64, len(jobs))) as pool:
        answers = list(pool.map(send, jobs))
    by_mandate: dict[str, set[tuple[int, bytes]]] = {}
    for mandate, status, body in answers:
        by_mandate.setdefault(mandate, set()).add((status, body))
    differing = [m for m, seen in by_mandate.items() if len(seen) != 1]
    statuses = sorted({status for _, status, _ in answers})
    print(f"sent {len(jobs)} requests for {len(mandates)} mandates; statuses {statuses}")
    if not args.check:
        return 0
    counts = {m: httpx.get(f"{args.url}/orders/{m}", timeout=30).json()["orders"] for m in mandates}
    wrong = {m: n for m, n in counts.items() if n != 1}
    print(
        f"orders per mandate: {sorted(set(counts.values()))}; answers differing: {len(differing)}"
    )
    if wrong or differing or statuses != [201]:
        print("FAILED: not exactly one order per mandate with one answer", file=sys.stderr)
        return 1
    print("OK: one order per cart mandate, every duplicate got the same answer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
