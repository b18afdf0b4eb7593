"""dflashctl's console entry: `status` without click where it can (``ops.session.quick_status``: the same
output and exit code, a start-up that imports only what status needs), else the click CLI (``ops.cli``)."""

from __future__ import annotations

import sys


def main() -> None:
    from ops.session import quick_status

    code = quick_status(sys.argv[1:])
    if code is not None:
        from ops.exit_codes import end_process

        end_process(code)
    from ops.cli import main as cli_main

    cli_main()
