"""The ``retrysafe`` command line."""
