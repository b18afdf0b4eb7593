"""restart-on-crash: watch one run and bring it back after a crash, without thrashing and never blind.

Two halves: ``Policy`` (``policy``), the pure state machine (Status, time) -> Decision where backoff, the
crash-loop guard and every "never restart this" rule live, tested from Status sequences and a fake clock;
and ``Supervisor`` (``loop``), the loop that probes over one kept connection and carries the decisions out.
``state`` holds the state dir, lock, incidents and hook. What a user can count on, and why: docs/design.md
sections 8 (restart-on-crash) and 18 (the supervisor on the Proxmox host).
"""

from ops.state_dir import default_state_dir, private_dir
from ops.states import RECOVERY, Action
from ops.supervise.loop import STACK_FILE, STACK_TIMEOUT, Outcome, Supervisor, save_stack
from ops.supervise.policy import (
    DONE,
    GIVE_UP,
    JITTER,
    RECONNECT_CAP,
    RECONNECT_FIRST,
    RESTART,
    START_CONTAINER,
    STOP_THEN_RESTART,
    WAIT,
    Decision,
    Options,
    Pending,
    Policy,
    backoff_delay,
    describe,
    reconnect_delay,
)
from ops.supervise.state import (
    HOOK_TIMEOUT,
    IncidentLog,
    Lock,
    incident_for,
    parse_hook,
    run_hook,
)
from ops.times import parse_iso

__all__ = [
    "Action",
    "DONE",
    "GIVE_UP",
    "HOOK_TIMEOUT",
    "JITTER",
    "RECONNECT_CAP",
    "RECONNECT_FIRST",
    "RECOVERY",
    "RESTART",
    "STACK_FILE",
    "STACK_TIMEOUT",
    "START_CONTAINER",
    "STOP_THEN_RESTART",
    "WAIT",
    "Decision",
    "IncidentLog",
    "Lock",
    "Options",
    "Outcome",
    "Pending",
    "Policy",
    "Supervisor",
    "backoff_delay",
    "default_state_dir",
    "describe",
    "incident_for",
    "parse_hook",
    "parse_iso",
    "private_dir",
    "reconnect_delay",
    "run_hook",
    "save_stack",
]
