"""A torchrun worker dies with its agent (docs/design.md section 13). stdlib only, run before torch loads.

torchrun starts each worker in a session of its own, so nothing ends a worker whose agent was SIGKILLed
(the last step of a stop, the OOM killer): it would train on alone, holding its GPUs, beside the next
attempt. ``PR_SET_PDEATHSIG`` has the kernel send it SIGKILL when its parent dies; the parent is read
before and checked again after, for an agent that died in between (then we are an orphan already).
"""

from __future__ import annotations

import ctypes
import os
import signal
import typing as t

PR_SET_PDEATHSIG = 1
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent for every worker it starts


def die_with_agent(environ: t.Mapping[str, str] = os.environ) -> bool:
    """Under torchrun: SIGKILL when the agent (our parent) dies. True when it is set."""
    if TORCHRUN_ENV not in environ:
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if int(libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) != 0:
            return False
    except (OSError, AttributeError):  # not Linux: nothing to set
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)  # the agent died before the kernel could tell us
    return True
