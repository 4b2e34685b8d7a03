"""A store's figures as ``retrysafe stats --json`` prints them (the CLI and Django's
``retrysafe_stats`` command share it)."""

from __future__ import annotations

from typing import Any

from retrysafe.stores import StoreStats

__all__ = ["stats_summary"]


def stats_summary(st: StoreStats, now: float) -> dict[str, Any]:
    """Counts by status and operation, expired, archived and the oldest processing record
    (as of ``now``), as JSON-ready values."""
    oldest = st.oldest_processing
    return {
        "by_status": st.by_status(),
        "by_operation": dict(sorted(st.by_operation().items())),
        "live": sum(st.counts.values()),
        "expired_awaiting_sweep": st.expired,
        "archived": st.archived,
        "oldest_processing": None
        if oldest is None
        else {
            "key": oldest.key,
            "operation": oldest.operation,
            "age_seconds": round(now - oldest.created_at, 3),
            "lease_expired": oldest.lease_until <= now,
        },
    }
