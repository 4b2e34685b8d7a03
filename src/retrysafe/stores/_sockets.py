"""What the stores with pooled sockets share: whether an idle connection's socket has
input, without a round trip."""

from __future__ import annotations

import select

__all__ = ["has_input"]

_poll = getattr(select, "poll", None)


def has_input(fd: int) -> bool:
    """True when the socket ``fd`` has something to read, by a zero-timeout poll. An
    idle pooled connection expects nothing, so input (EOF, a shutdown notice) means the
    server closed it, or is closing it: discard it."""
    if _poll is None:  # pragma: no cover - platforms without poll()
        return bool(fd < 1024 and select.select([fd], [], [], 0)[0])
    poller = _poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
