"""What runs on the far side (inside the container), stdlib only, in real modules (tests/ops/test_layout.py
holds every module here to the stdlib and to ``ops.far.*``).

- ``agent``    probe/start/stop/tail/read: one JSON request on stdin, one JSON answer
- ``runner``   the wrapper tmux runs: runner (pane) + keeper (records) + the command writing train.log
- ``tmux``     tmux argv builders and the table that reads tmux's stderr (the operator's raw fallback too)
- ``procfs``   processes and the machine: stat, boot time, THE liveness verdict (by start time)
- ``members``  the run's processes: every process its command started (subreaper + tag), ended as one
- ``nvidia_smi`` the probe's GPU facts
- ``logs``     a run's log and metrics.jsonl read from their end (O(1) in their size)
- ``records``  a session's attempt layout and its run.json / exit.json
- ``atomic``   records written then renamed; symlinks switched by rename
- ``lock``     the one flock (deploy's and a session's)
- ``protocol`` the request/answer envelope and the agent's typed facts
- ``release``  the release program (deploy's far side)

How they reach the far side: the agent and the runner run from the deployed release
(``<workdir>/current``), which holds the whole ``ops`` package, these modules included. The release
program cannot (the first deploy has no release yet), so ``program()`` sends it by value: the source
text of the module and of the helpers it imports, in one ``-c`` program that registers them in
``sys.modules`` before anything is imported (an ``ops`` installed in the far side's site-packages is
never consulted).
"""

from __future__ import annotations

import os

# os.path, not pathlib: every agent call imports this package, and pathlib (with urllib.parse, ipaddress and
# fnmatch) was a fifth of the agent's imports
HERE = os.path.dirname(os.path.realpath(__file__))

_BOOT = """import sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
import types
def _module(name, source, package=False):
    m = types.ModuleType(name)
    m.__file__ = "<dflash by value: %s>" % name
    if package:
        m.__path__ = []
    sys.modules[name] = m
    parent, _, leaf = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], leaf, m)
    exec(compile(source, m.__file__, "exec"), m.__dict__)
    return m
_module("ops", "", True)
_module("ops.far", "", True)
"""


def program(main: str, deps: tuple[str, ...]) -> str:
    """A ``python -c`` program: ``ops.far.<dep>`` for each dep, then ``ops.far.<main>``; runs ``main(sys.argv[1:])``.
    Python >= 3.7 (the far side's interpreter may be old; it must run far enough to say so)."""
    parts = [_BOOT]
    for name in (*deps, main):
        parts.append("_module({!r}, {!r})\n".format(f"ops.far.{name}", _read(os.path.join(HERE, f"{name}.py"))))
    parts.append("sys.exit(sys.modules[{!r}].main(sys.argv[1:]))\n".format(f"ops.far.{main}"))
    return "".join(parts)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
