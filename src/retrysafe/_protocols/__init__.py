"""The protocol cores, without I/O: the Mesh idempotency extension and A2A."""
