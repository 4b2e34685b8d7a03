"""The demo behind ``retrysafe demo``: a shop behind the gateway."""
