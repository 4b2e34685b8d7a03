"""``retrysafe demo``: a retry storm through the engine, and what it did."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ._engine import Engine, Replay
from ._errors import FingerprintMismatchError, InProgressError
from ._keys import fingerprint
from ._record import Outcome

__all__ = ["StormReport", "retry_storm"]


@dataclass
class StormReport:
    payments: int = 0
    requests: int = 0
    charges: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)
    disagreements: int = 0
    seconds: float = 0.0

    @property
    def exactly_once(self) -> bool:
        return (
            len(self.charges) == self.payments
            and all(n == 1 for n in self.charges.values())
            and self.disagreements == 0
        )

    def render(self, store_url: str) -> str:
        twice = sum(1 for n in self.charges.values() if n > 1)
        lines = [
            f"retrysafe demo: retry storm on {store_url}",
            f"  payments            {self.payments}",
            f"  requests sent       {self.requests}  "
            f"({self.requests / max(self.seconds, 1e-9):,.0f}/s over {self.seconds:.2f} s)",
            f"  charges executed    {sum(self.charges.values())}",
            f"  replayed answers    {self.answers['replayed']}",
            f"  'in flight' (409)   {self.answers['in_flight']}",
            f"  conflicts (422)     {self.answers['conflict']}",
            f"  charged twice       {twice}",
            f"  answers that differ {self.disagreements}",
            "  result              "
            + ("exactly once: every payment charged once, every retry got its answer"
               if self.exactly_once else "DUPLICATES OR LOST ANSWERS"),
        ]  # fmt: skip
        return "\n".join(lines)


def retry_storm(
    engine: Engine, *, payments: int = 50, clients: int = 16, retries: int = 6, seed: int = 0
) -> StormReport:
    """Simulate impatient clients: each payment is sent ``retries`` times from
    several threads at once (timeouts, double taps); a few reuse a key with another
    amount. Counts charges (side effects) and checks every caller got one answer."""
    rng = random.Random(seed)
    report = StormReport(payments=payments)
    lock = threading.Lock()
    first_answer: dict[str, Any] = {}
    run_id = f"{time.time_ns():x}"
    jobs = []
    for p in range(payments):
        amount = rng.randrange(100, 10_000)
        jobs += [(p, amount)] * retries
        if p % 10 == 0:
            jobs.append((p, amount + 1))  # a client bug: same key, other request
    rng.shuffle(jobs)

    def send(job: tuple[int, int]) -> None:
        p, amount = job
        key = f"payment:demo-{run_id}:{p}"
        fp = fingerprint({"amount": amount, "currency": "EUR"})
        delay = 0.005
        while True:
            with lock:
                report.requests += 1
            try:
                result = engine.begin(key, operation="payment", fingerprint=fp, wait=0)
            except InProgressError:
                with lock:
                    report.answers["in_flight"] += 1
                time.sleep(delay * rng.random())  # backoff with jitter, then retry
                delay = min(delay * 2, 0.1)
                continue
            except FingerprintMismatchError:
                with lock:
                    report.answers["conflict"] += 1
                return
            if isinstance(result, Replay):
                answer = result.outcome.value if result.outcome else None
                kind = "replayed"
            else:
                time.sleep(0.002)  # the charge takes a moment; retries pile up meanwhile
                answer = {"charge": f"ch_{p}_{rng.random():.6f}", "amount": amount}
                with lock:
                    report.charges[key] += 1
                engine.complete(result, Outcome.json(answer))
                kind = "executed"
            with lock:
                report.answers[kind] += 1
                if first_answer.setdefault(key, answer) != answer:
                    report.disagreements += 1
            return

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(send, jobs))
    report.seconds = time.perf_counter() - started
    return report
