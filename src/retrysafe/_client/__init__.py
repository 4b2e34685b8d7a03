"""The retrying clients, the Mesh client and the outbox."""
