"""The kinds of a refusal: the ``error`` of an answer ``{"ok": false, "error": KIND, "message": ...}``.

The far side (the agent, the release program) and the host's supervisor service say them; the operator
side tells them apart (ops/session.py, ops/deploy.py, ops/supervise/install.py). Stdlib only, Python 3.7
syntax: the release program loads it (ops/deploy.py RELEASE_DEPS).
"""

import typing as t


class Refused(Exception):
    """A verb declines on purpose (nothing deployed, a live run...): ``kind`` says which."""

    def __init__(self, kind: str, message: str, **extra: t.Any) -> None:
        super().__init__(message)
        self.kind = kind
        self.extra = extra


# any verb
USAGE = "usage"  # no such verb (an older agent: it lacks this one)
BAD_REQUEST = "bad-request"
PROTOCOL = "protocol"  # the request speaks another protocol: refused before acting

# the agent's verbs
NOT_DEPLOYED = "not-deployed"
RUN_ACTIVE = "run-active"
CANCELLED = "cancelled"
BUSY = "busy"  # another start or stop of the session holds its lock (the host service: it did not stop)
NO_TMUX = "no-tmux"
NO_PANE = "no-pane"
NO_LOG = "no-log"
NOTHING = "nothing"
RUN_DIR = "run-dir"
DISK_FULL = "disk-full"
NO_CHECKPOINT = "no-checkpoint"  # pull's verbs: no such checkpoint or file

# the release program
REFUSED = "refused"  # also the host service's: the supervisor did not start watching
RECHECK = "recheck"
NEED_CONTENT = "need-content"
CUT = "cut"
INTERRUPTED = "interrupted"
OS = "os"

# the supervisor service on the Proxmox host
NOT_INSTALLED = "not-installed"
NOT_OURS = "not-ours"
BAD_CONFIG = "bad-config"
BAD_RECORD = "bad-record"
TAKEN = "taken"
LOCKED = "locked"
FAILED = "failed"
