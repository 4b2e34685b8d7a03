"""``python -m retrysafe`` → the CLI."""

from retrysafe._cli.app import main

if __name__ == "__main__":
    raise SystemExit(main())
