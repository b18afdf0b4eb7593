"""The files `dflashctl supervise install` writes on the Proxmox host (docs/design.md section 18): the
launcher, the systemd unit, the host entry, and the restart-on-crash options as a command line. Pure
text builders (stdlib only), shared by the operator's side and the host's.

Layout on the host (``[hosts.NAME.supervise] dir``, default /var/lib/dflashctl)::

    <dir>/releases/<id>/, current, previous     dflashctl's own code, put there by deploy's machinery
    <dir>/bin/dflashctl-supervise               the launcher: `run SESSION` (systemd) or `loop SESSION` (tmux)
    <dir>/sessions/<session>/                   0700: the supervisor's state dir (lock, memory, incidents)
        hosts.toml                              0600: the container as a `transport = "local"` host
        service.json                            0600: what install decided (id, mode, who it is, the options)
        env.json                                0600: secrets: token_value_env's value, --notify URLs
        status.json                             its last probe and last action (written by the supervisor)
        supervisor.log                          its own log (`dflashctl supervise logs`)
    /etc/systemd/system/dflashctl-supervise@<session>.service   (systemd mode)
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import typing as t

from ops.supervise.policy import Options

UNIT_DIR = "/etc/systemd/system"
LAUNCHER = "bin/dflashctl-supervise"
RESTART_SEC = 10  # seconds before a supervisor that ended is started again (both modes)
# The supervisor's program: the release path and the verb travel as argv items, never inside the code.
BOOT = "import sys; sys.path.insert(0, sys.argv.pop(1)); from ops.supervise.service import main; sys.exit(main())"
MARK = "dflashctl-supervise"  # argv[0] of an installed supervisor (its lock file names it so)
# The host's python must run ops/ (deploy.MIN_PYTHON: Proxmox VE 8 has 3.11, VE 7 has 3.9): install asks
# its version with this before anything is sent. It runs on any python, 2.7 included.
PYTHON_CHECK = "import json, sys; print(json.dumps({'ok': True, 'version': list(sys.version_info[:3])}))"

# The folder is dflashctl's once this file is in it: install writes it first (into a folder that is new or
# empty) and refuses a folder with anything else in it and no such file; uninstall removes it last.
MARKER = ".dflashctl-supervise"
# What deploy and install write at the folder's top (uninstall removes these, and only these).
INSTALL_LOCK = ".install.lock"  # one install or uninstall at a time on this host
OWN_NAMES = ("bin", "releases", "current", "previous", ".deploy.lock", INSTALL_LOCK, "sessions", "runs", MARKER)
# Run by install before anything is sent (argv: the folder): claims the folder, or says why not. Stdlib only,
# and no backslash in it (it travels as one ssh command line).
CLAIM = """
import json, os, sys, time
d = sys.argv[1]; marker = os.path.join(d, sys.argv[2]); system = set(json.loads(sys.argv[3])); own = set(sys.argv[4:])
def say(**kw):
    print(json.dumps(kw)); sys.exit(0)
real = os.path.realpath(d)
if real in system:
    say(ok=False, why="is " + real + " through a link: a folder of the system itself")
if os.path.islink(d) or (os.path.exists(d) and not os.path.isdir(d)):
    say(ok=False, why="exists and is not a folder")
if os.path.isfile(marker):
    say(ok=True, state="ours")
names = sorted(os.listdir(d)) if os.path.isdir(d) else []
def installed_before():  # a folder an install wrote before the marker existed: deploy's layout, nothing else
    if any(n not in own for n in names) or not os.path.islink(os.path.join(d, "current")):
        return False
    for n in ("current", "previous"):
        p = os.path.join(d, n)
        if os.path.lexists(p) and not (os.path.islink(p) and os.readlink(p).startswith("releases/")):
            return False
    rel = os.path.join(d, "releases")
    if os.path.isdir(rel) and any(not os.path.isfile(os.path.join(rel, r, ".release.json")) for r in os.listdir(rel) if not r.startswith(".")):
        return False
    b = os.path.join(d, "bin")
    return not (os.path.isdir(b) and set(os.listdir(b)) - {"dflashctl-supervise"})
if names and not installed_before():
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    say(ok=False, why="holds files dflashctl did not write (" + shown + ")")
os.makedirs(d, mode=0o755, exist_ok=True)
fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
with os.fdopen(fd, "w") as f:
    print(json.dumps({"by": "dflashctl supervise install", "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}), file=f)
say(ok=True, state="adopted" if names else "claimed")
"""

HOSTS_TOML = "hosts.toml"
SERVICE_JSON = "service.json"
ENV_JSON = "env.json"
STATUS_JSON = "status.json"
LOG = "supervisor.log"


def unit_name(session: str) -> str:
    return f"dflashctl-supervise@{session}.service"


def session_dir(root: str, session: str) -> str:
    return f"{root.rstrip('/')}/sessions/{session}"


# --------------------------------------------------------------------------------------------
# The options of restart-on-crash as a command line (and back: ops/supervise/service.py's parser)

# What an installed supervisor never takes: it runs for good (no --once), and its state dir is its own.
NOT_FORWARDED = ("once",)


def options_argv(opts: Options) -> list[str]:
    """``--interval 30 --backoff 10 ... --start-container``: every option, so the unit says the whole policy."""
    argv: list[str] = []
    for f in dataclasses.fields(Options):
        if f.name in NOT_FORWARDED:
            continue
        value = getattr(opts, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        else:
            argv += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return argv


def supervisor_argv(root: str, session: str, opts: Options, *, loop: bool) -> list[str]:
    """What systemd (``run``) or tmux (``loop``) starts: the launcher, the session, the policy. Secrets
    never: they are in env.json, which the supervisor reads itself."""
    return [f"{root.rstrip('/')}/{LAUNCHER}", "loop" if loop else "run", session, *options_argv(opts)]


# --------------------------------------------------------------------------------------------
# The launcher (/bin/sh)


def launcher_text(root: str, python: str) -> str:
    q = shlex.quote
    return f"""#!/bin/sh
# Written by `dflashctl supervise install` (each install writes it again): the supervisor of one session of
# this Proxmox host, from dflashctl's release in {root}/current and this host's python (stdlib only).
#   dflashctl-supervise run SESSION [options]    the supervisor (systemd runs this; Restart=always)
#   dflashctl-supervise loop SESSION [options]   the same, started again {RESTART_SEC} s after it ends (tmux mode)
dir={q(root)}
python={q(python)}
boot={q(BOOT)}
verb=$1
[ $# -gt 0 ] && shift
case "$verb" in
run) exec "$python" -I -c "$boot" "$dir/current" run "$dir" "$@" ;;
loop)
    while :; do
        "$python" -I -c "$boot" "$dir/current" run "$dir" "$@"
        echo "dflashctl-supervise: the supervisor ended (status $?); starting it again in {RESTART_SEC} s" >&2
        sleep {RESTART_SEC}
    done ;;
*) echo "usage: dflashctl-supervise run|loop SESSION [options]" >&2; exit 2 ;;
esac
"""


# --------------------------------------------------------------------------------------------
# The systemd unit


def systemd_quote(arg: str) -> str:
    """One ExecStart word: double quotes, C escapes, ``%%`` for a literal % (specifiers) and ``$$`` for a
    literal $ (variables): systemd.service(5), "Command lines"."""
    body = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{body}"'


def unit_text(root: str, session: str, opts: Options) -> str:
    argv = supervisor_argv(root, session, opts, loop=False)
    return f"""# Written by `dflashctl supervise install`; `dflashctl supervise uninstall` removes it.
[Unit]
Description=dflashctl supervisor of session {session} (restart-on-crash on this Proxmox host)
After=network-online.target pve-guests.service
Wants=network-online.target
# Never stop restarting the supervisor itself: the crash-loop guard is the supervisor's, for the run.
StartLimitIntervalSec=0

[Service]
Type=simple
ExecStart={" ".join(systemd_quote(a) for a in argv)}
Restart=always
RestartSec={RESTART_SEC}
# Only the supervisor is stopped with the unit, never what it started: its pct exec calls end by their own
# timeouts, and a run it restarted lives in the container, even where lxc-attach left it in our cgroup.
KillMode=process
TimeoutStopSec=90
Environment=PYTHONUNBUFFERED=1

[Install]
WantedBy=multi-user.target
"""


# --------------------------------------------------------------------------------------------
# The host entry (hosts.toml)


def toml_string(value: str) -> str:
    # JSON's escapes are TOML's, except that TOML wants DEL escaped and JSON leaves it raw.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_value(value: t.Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def hosts_text(name: str, entry: t.Mapping[str, t.Any], proxmox: t.Mapping[str, t.Any] | None) -> str:
    """The one host of the supervisor's inventory: ``[hosts.NAME]`` (+ ``[hosts.NAME.proxmox]``)."""
    lines = [
        "# Written by `dflashctl supervise install`: the container as this Proxmox host's supervisor reaches it",
        "# (pct exec, no ssh). Edit the entry on your own machine and install again instead.",
        f"default = {toml_string(name)}",
        "",
        f"[hosts.{toml_string(name)}]",
    ]
    lines += [f"{k} = {toml_value(v)}" for k, v in entry.items() if v is not None]
    if proxmox:
        lines += ["", f"[hosts.{toml_string(name)}.proxmox]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in proxmox.items() if v is not None]
    return "\n".join(lines) + "\n"


def host_entry(host: t.Any) -> dict[str, t.Any]:
    """The operator's host (an ``ops.hosts.Host`` with a container) as the host-side entry's keys."""
    return {
        "transport": "local",
        "container": host.container,
        "pct": list(host.pct),
        "workdir": host.workdir,
        "run_dir": host.run_dir,
        "python": host.python,
        "session": host.session,
        "command": list(host.command),
        "env": dict(host.env),
        "tmux_socket": host.tmux_socket,
        "hang_after": host.hang_after,
        "startup_grace": host.startup_grace,
        "keep_releases": host.keep_releases,
    }


def proxmox_entry(host: t.Any) -> dict[str, t.Any] | None:
    api = host.proxmox
    if api is None:
        return None
    return {
        "node": api.node,
        "backend": api.backend,
        "api_host": api.api_host,
        "port": api.port,
        "user": api.user,
        "token_name": api.token_name,
        "token_value_env": api.token_value_env,
        "verify_ssl": api.verify_ssl,
    }
