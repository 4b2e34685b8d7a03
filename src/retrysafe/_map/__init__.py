"""The idempotency map: operations, routes and their TOML file."""
