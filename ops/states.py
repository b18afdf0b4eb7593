"""The words of the contract (docs/design.md sections 6 and 8), defined once: run states, their causes, and
restart-on-crash's actions.

``StrEnum``: a member IS its string (``"crashed" == State.CRASHED``, ``json.dumps`` and f-strings
give the bare value), so JSON output and messages are the same as with plain strings, and facts read
back from JSON compare equal. Stdlib only. Exit codes are not here: ops/exit_codes.py maps states to them.
"""

from __future__ import annotations

import enum


class State(enum.StrEnum):
    RUNNING = "running"
    STALLED = "stalled"
    SUCCEEDED = "succeeded"
    CRASHED = "crashed"
    LOST = "lost"
    NOT_STARTED = "not-started"
    STOPPED = "stopped"
    CONTAINER_DOWN = "container-down"
    UNREACHABLE = "unreachable"


class Cause(enum.StrEnum):
    # crashed
    CUDA_OOM = "cuda-oom"
    HOST_OOM = "host-oom"
    NCCL_TIMEOUT = "nccl-timeout"
    NCCL_ERROR = "nccl-error"
    PEER_LOST = "peer-lost"  # a node of a multi-node run lost the others (gloo: reset by peer, or timed out)
    DISK_FULL = "disk-full"  # crashed or lost
    PYTHON_EXCEPTION = "python-exception"
    DIVERGED = "diverged"  # a non-finite loss, gradient norm or weights stopped training (dflash exit 3)
    SIGNAL = "signal"
    NONZERO_EXIT = "nonzero-exit"
    # the driver said the GPU failed in hardware (Xid, uncorrectable ECC, fallen off the bus): a restart
    # runs into the same dead GPU
    GPU_FAULT = "gpu-fault"
    # the command ended (and its keeper is gone) but processes it started still run: nothing will end
    # them or record their end (docs/design.md section 5)
    ORPHANS_LEFT = "orphans-left"
    # lost
    CONTAINER_RESTART = "container-restart"
    TMUX_SERVER_KILLED = "tmux-server-killed"
    SESSION_KILLED = "session-killed"
    UNKNOWN = "unknown"  # lost or unreachable
    # container-down
    STOPPED = "stopped"
    MISSING = "missing"
    # unreachable
    REFUSED = "refused"
    TIMEOUT = "timeout"
    DNS = "dns"
    AUTH = "auth"
    HOST_KEY = "host-key"


# The causes each state can carry (the states not named here carry none).
CAUSES: dict[State, tuple[Cause, ...]] = {
    State.CRASHED: (
        Cause.CUDA_OOM,
        Cause.HOST_OOM,
        Cause.NCCL_TIMEOUT,
        Cause.NCCL_ERROR,
        Cause.PEER_LOST,
        Cause.DISK_FULL,
        Cause.PYTHON_EXCEPTION,
        Cause.SIGNAL,
        Cause.NONZERO_EXIT,
        Cause.ORPHANS_LEFT,
        Cause.GPU_FAULT,
        Cause.DIVERGED,
    ),
    State.LOST: (
        Cause.CONTAINER_RESTART,
        Cause.DISK_FULL,
        Cause.TMUX_SERVER_KILLED,
        Cause.SESSION_KILLED,
        Cause.UNKNOWN,
    ),
    State.CONTAINER_DOWN: (Cause.STOPPED, Cause.MISSING),
    State.UNREACHABLE: (Cause.REFUSED, Cause.TIMEOUT, Cause.DNS, Cause.AUTH, Cause.HOST_KEY, Cause.UNKNOWN),
}


class Action(enum.StrEnum):
    """What restart-on-crash decided about one status (its incidents' ``action``)."""

    RESTART = "restart"
    STOP_THEN_RESTART = "stop-then-restart"
    START_CONTAINER = "start-container"
    WAIT = "wait"
    GIVE_UP = "give-up"
    DONE = "done"


# The actions that change something (a recovery that is carried out, with its backoff).
RECOVERY = (Action.RESTART, Action.STOP_THEN_RESTART, Action.START_CONTAINER)
