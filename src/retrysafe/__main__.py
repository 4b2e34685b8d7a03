"""``python -m retrysafe`` and the ``retrysafe`` command → the CLI."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from retrysafe.errors import MissingExtraError


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; without the ``cli`` extra, say which one in one line and exit 2."""
    try:
        from retrysafe._cli.app import main as cli
    except MissingExtraError as exc:
        print(f"retrysafe: error: {exc}", file=sys.stderr)
        return 2
    return cli(argv)


if __name__ == "__main__":
    raise SystemExit(main())
