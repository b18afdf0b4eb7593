"""dflashctl's exit codes, and THE mapping of states and errors to them (docs/design.md section 6):
``ops.cli.main`` and every command return what this module says."""

from __future__ import annotations

import enum
import os
import sys
import typing as t

from ops import errors
from ops.states import State


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1  # dflashctl's own error: bad config, bad argument values
    USAGE = 2  # click's usage error
    STALLED = 3
    SUCCEEDED = 4
    CRASHED = 5
    LOST = 6
    NOT_STARTED = 7
    STOPPED = 8
    CONTAINER_DOWN = 9
    UNREACHABLE = 10
    CRASH_LOOP = 11
    DIVERGED = 12  # restart-on-crash gave up on a run whose training diverged
    GPU_FAULT = 13  # restart-on-crash gave up on a GPU that failed in hardware


# docs/design.md section 6: the state a status reports -> the exit code of `status`.
STATE_EXIT: dict[str, ExitCode] = {
    State.RUNNING: ExitCode.OK,
    State.STALLED: ExitCode.STALLED,
    State.SUCCEEDED: ExitCode.SUCCEEDED,
    State.CRASHED: ExitCode.CRASHED,
    State.LOST: ExitCode.LOST,
    State.NOT_STARTED: ExitCode.NOT_STARTED,
    State.STOPPED: ExitCode.STOPPED,
    State.CONTAINER_DOWN: ExitCode.CONTAINER_DOWN,
    State.UNREACHABLE: ExitCode.UNREACHABLE,
}

# Errors -> exit codes; the first matching class wins (subclasses before their parents).
ERROR_EXIT: tuple[tuple[type[errors.OpsError], ExitCode], ...] = (
    (errors.UnreachableError, ExitCode.UNREACHABLE),
    (errors.ContainerDown, ExitCode.CONTAINER_DOWN),
    (errors.GaveUpDiverged, ExitCode.DIVERGED),
    (errors.CrashLoop, ExitCode.CRASH_LOOP),
    (errors.GpuFaultGiveUp, ExitCode.GPU_FAULT),
    (errors.OpsError, ExitCode.ERROR),
)


def exit_code_for_error(exc: errors.OpsError) -> ExitCode:
    for cls, code in ERROR_EXIT:
        if isinstance(exc, cls):
            return code
    return ExitCode.ERROR


def exit_code_for_state(state: str) -> ExitCode:
    return STATE_EXIT[state]


def end_process(code: int) -> t.NoReturn:
    """Exit without tearing the interpreter down: freeing paramiko's, click's and our modules' objects took
    ~150 ms of every status under load, ~6 ms this way (bench/status_vs_raw.py). A flush that fails (a
    closed pipe) exits the usual way, which reports it as before."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        sys.exit(code)
    os._exit(code)
