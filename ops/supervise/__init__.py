"""restart-on-crash: watch one run and bring it back after a crash, without thrashing and never blind.

Two halves (docs/design.md sections 8 and 11):

- ``Policy`` is a pure state machine: it takes a ``Status`` and the time and returns a ``Decision``
  (``restart``, ``stop-then-restart``, ``start-container``, ``wait``, ``give-up``, ``done``) with its
  reason. Backoff, the crash-loop guard and every "never restart this" rule live here, so they are
  tested from sequences of Status objects and a fake clock, without processes.
- ``Supervisor`` is the loop that executes decisions: it starts a probe every ``--interval`` over ONE
  kept connection, reconnects with jittered backoff when it drops, restarts through the start path of
  ``dflashctl start`` (``ops.session.start``: a new attempt dir, the old one's evidence kept), writes
  one JSON file per incident and hands it to ``--on-event``.

Decisions a user can count on:
- An outage (``unreachable``) is never a crash: the loop reconnects, re-probes, and only a fresh probe
  can lead to a restart. A backoff longer than the interval is watched (probed every interval), so a
  run started by hand meanwhile cancels the restart; a crashed or lost run is restarted WITHOUT
  ``--replace``, so the agent refuses if any run came alive since the probe. Only a stalled run is
  replaced (stopped: C-c, TERM, KILL), after a re-probe that still says stalled.
- ``stopped`` (a ``dflashctl stop`` during supervision) is reported once and never restarted; the
  supervisor keeps watching, so a later ``dflashctl start`` is supervised again without restarting it.
- A run started by hand (an attempt this supervisor did not start) resets the crash-loop memory.
- The memory (restart times, backoff streak, last fingerprint) is kept in the state dir, so a
  supervisor run from cron with ``--once`` or restarted by systemd still sees a crash loop.

The code: ``policy`` (Options, backoff, Policy), ``state`` (state dir, lock, incidents, hook), ``loop``
(Supervisor, save_stack).
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
