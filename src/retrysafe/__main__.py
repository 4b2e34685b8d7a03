"""``python -m retrysafe`` → the CLI."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
