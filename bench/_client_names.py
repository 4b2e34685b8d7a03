"""What bench/client.py's measurement and its report share: the request, the answer,
the contenders' names, and the record of the syscall pass.

Loaded by path by bench/client.py (see its docstring); not a script of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

HOST = "127.0.0.1"
PATH = "/orders"
CALLS_PATH = "/_calls"
PAYLOAD = {"order_id": "o-1", "amount": 1999, "currency": "eur"}
BODY = json.dumps(PAYLOAD, separators=(",", ":")).encode()
HEADERS = {"Content-Type": "application/json"}
#: Who calls through the gateway (a keyed request without credentials runs unrecorded there).
VIA = {**HEADERS, "Authorization": "Bearer rsbench"}
ANSWER = json.dumps({"id": "ch_123", "status": "created"}, separators=(",", ":")).encode()
#: Operations per outbox variant when counting syscalls under strace.
SYSCALL_OPS = 100

# Contender names.
HTTPX, CLIENT = "httpx.Client.post", "Client.post"
AHTTPX, ACLIENT = "httpx.AsyncClient.post", "AsyncClient.post"
DIRECT, GW_FIRST, GW_REPLAY = "Client.post, direct", "Client.post via gateway", "retry via gateway"
FLOOR_FULL = "sqlite3 INSERT, one open connection (FULL)"
FLOOR_NORMAL = "sqlite3 INSERT, one open connection (NORMAL)"
FLOOR_PER_CALL = "sqlite3 INSERT, a connection per call (FULL)"
ENQUEUE = "Outbox.enqueue"
ENQUEUE_HELD = "Outbox.enqueue, file held open"
POSTS = "N x Client.post, direct"
FLUSH = "Outbox.flush of N"
FLUSH_HELD = "Outbox.flush of N, file held open"
MOCK = ", no socket"
ENQUEUE_NAMES = (FLOOR_FULL, FLOOR_NORMAL, FLOOR_PER_CALL, ENQUEUE, ENQUEUE_HELD)
FLUSH_NAMES = (FLUSH, FLUSH_HELD)


@dataclass
class Syscalls:
    connections: float  # sqlite3.connect calls
    fsyncs: float | None  # None: not counted (no strace)
    deletes: float | None
