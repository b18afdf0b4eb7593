"""`dflash` / `python -m dflash`: the training core's command line (filled in by the training issues)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("dflash: the training core is not built yet", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
