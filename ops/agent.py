"""The agent: runs inside the container (or on this machine) and answers one JSON object per call.

    <python> -I -S -c BOOT <workdir>/current <probe|start|stop|tail> --json  < request.json

(``ops.session.agent_argv``; by hand, ``python -m ops.agent probe --json < request.json`` does the same.)

The request is ONE JSON object on stdin (session, socket, run_dir, workdir, python, command, env,
options), so no user value is ever quoted into a command line. stdlib only (it runs with whatever
python the container has): tmux is called directly rather than through libtmux because libtmux waits
on tmux with no timeout and hides the stderr texts that are our evidence. Every subprocess call has a
timeout, so the agent never hangs; probing never raises because something is down.

The operator side of the protocol (``agent_argv``, ``call``) is in ops/session.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import typing as t

from ops import tmux
from ops.runner import (
    EXIT_JSON,
    LOG,
    METRICS,
    RUN_JSON,
    STOP_JSON,
    iso,
    oom_kill_count,
    pid1_start,
    proc_stat,
    write_json_atomic,
)

PROTOCOL = 1
VERBS = ("probe", "start", "stop", "tail")
TMUX_TIMEOUT = 10.0
DIAG_LINES = 200  # log lines the probe brings back for diagnosis
FOLLOW_CHUNK = 1 << 20  # at most this many bytes per `tail -f` poll

Request = t.Mapping[str, t.Any]


class Refused(Exception):
    """A verb declines on purpose (nothing deployed, a live run...): ``kind`` says which."""

    def __init__(self, kind: str, message: str, **extra: t.Any) -> None:
        super().__init__(message)
        self.kind = kind
        self.extra = extra


# --------------------------------------------------------------------------------------------
# Running tmux (and friends) with a timeout


def _tmux_env(req: Request) -> dict[str, str]:
    """The environment tmux (and so the server and every pane) gets: no $TMUX, we are not inside a pane
    (pct exec keeps the ssh session's environment, so an operator inside tmux would leak it)."""
    env = dict(os.environ)
    for key in ("TMUX", "TMUX_PANE"):
        env.pop(key, None)
    return env


def _run(argv: t.Sequence[str], *, timeout: float = TMUX_TIMEOUT, env: dict[str, str] | None = None) -> dict[str, t.Any]:
    """{exit_code, stdout, stderr, timed_out}; a missing program is exit 127, never an exception."""
    try:
        p = subprocess.run(
            list(argv), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, env=env, check=False
        )
    except FileNotFoundError as e:
        return {"exit_code": 127, "stdout": "", "stderr": f"{argv[0]}: {e.strerror}", "timed_out": False}
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode("utf-8", "replace") if isinstance(e.stderr, bytes) else ""
        return {"exit_code": None, "stdout": "", "stderr": err, "timed_out": True}
    return {
        "exit_code": p.returncode,
        "stdout": p.stdout.decode("utf-8", "replace"),
        "stderr": p.stderr.decode("utf-8", "replace"),
        "timed_out": False,
    }


def tmux_facts(req: Request) -> dict[str, t.Any]:
    """Server, session and panes in ONE tmux call (has-session ; list-panes), with the exact stderr."""
    socket_name, session = req["socket"], req["session"]
    argv = tmux.panes_argv(socket_name, session, req.get("tmux", "tmux"))
    for _ in range(4):
        res = _run(argv, env=_tmux_env(req))
        # tmux marks a pane dead when its pty closes, a moment before it reaps the process: in that
        # window pane_dead=1 with neither status nor signal. Ask again rather than report "unknown".
        if res["exit_code"] != 0 or not any(_status_pending(p) for p in tmux.parse_panes(res["stdout"])):
            break
        time.sleep(0.05)
    facts: dict[str, t.Any] = {
        "socket": socket_name,
        "exit_code": res["exit_code"],
        "stderr": res["stderr"].strip(),
        "timed_out": res["timed_out"],
        "installed": not tmux.not_found(res["exit_code"], res["stderr"]),
        "panes": tmux.parse_panes(res["stdout"]) if res["exit_code"] == 0 else [],
    }
    return facts


def _status_pending(pane: dict[str, str]) -> bool:
    return pane.get("pane_dead") == "1" and not pane.get("pane_dead_status") and not pane.get("pane_dead_signal")


def _session_alive(tf: dict[str, t.Any]) -> bool:
    return tf["exit_code"] == 0


def _pane(tf: dict[str, t.Any], pid: int | None = None) -> dict[str, str] | None:
    """The run's pane: the one whose process is our runner, else the first one."""
    panes = tf.get("panes") or []
    for p in panes:
        if pid is not None and p.get("pane_pid") == str(pid):
            return p
    return panes[0] if panes else None


def capture(req: Request, lines: int) -> dict[str, t.Any]:
    res = _run(tmux.capture_argv(req["socket"], req["session"], lines, req.get("tmux", "tmux")), env=_tmux_env(req))
    rows = res["stdout"].split("\n") if res["exit_code"] == 0 else []
    return {"exit_code": res["exit_code"], "stderr": res["stderr"].strip(), "lines": tmux.last_lines(rows, lines)}


# --------------------------------------------------------------------------------------------
# The run's records on disk


def session_dir(req: Request) -> str:
    return os.path.join(req["run_dir"], req["session"])


def _attempt_number(name: str) -> int | None:
    m = re.fullmatch(r"attempt-(\d+)", name)
    return int(m.group(1)) if m else None


def current_attempt(req: Request) -> str | None:
    """The attempt dir `current` points to, else the highest attempt-<n>, else None."""
    sdir = session_dir(req)
    link = os.path.join(sdir, "current")
    if os.path.isdir(link):
        return os.path.join(sdir, os.readlink(link)) if os.path.islink(link) else link
    try:
        numbered = [(n, name) for name in os.listdir(sdir) if (n := _attempt_number(name)) is not None]
    except OSError:
        return None
    return os.path.join(sdir, max(numbered)[1]) if numbered else None


def _read_json(path: str) -> tuple[dict[str, t.Any] | None, str | None]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"{path}: {e}"
    return (data, None) if isinstance(data, dict) else (None, f"{path}: not a JSON object")


def process_facts(pid: t.Any, start: t.Any) -> dict[str, t.Any] | None:
    """Is the recorded pid still OUR process? (same start time: a reused pid is not.)"""
    if not isinstance(pid, int):
        return None
    st = proc_stat(pid)
    if st is None:
        return {"pid": pid, "alive": False, "state": None, "same": None}
    state, ticks = st
    same = None if not isinstance(start, int) else ticks == start
    alive = state not in ("Z", "X") and same is not False
    return {"pid": pid, "alive": alive, "state": state, "same": same}


def _tail_bytes(path: str, max_lines: int, block: int = 1 << 16) -> tuple[bytes, int, float]:
    """The last ``max_lines`` lines of a file (read backwards), its size and mtime."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        pos, data = size, b""
        while pos > 0 and data.count(b"\n") <= max_lines:
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    # drop the partial first line unless we read from the very start
    if pos > 0 and b"\n" in data:
        data = data[data.index(b"\n") + 1 :]
    lines = data.split(b"\n")
    trailing = lines[-1] == b""
    if trailing:
        lines.pop()
    lines = lines[-max_lines:] if max_lines > 0 else []
    out = b"\n".join(lines) + (b"\n" if trailing and lines else b"")
    return out, size, st.st_mtime


def log_facts(path: str, lines: int) -> dict[str, t.Any] | None:
    try:
        data, size, mtime = _tail_bytes(path, lines)
    except FileNotFoundError:
        return None
    except OSError as e:
        return {"path": path, "error": str(e)}
    return {"path": path, "size": size, "mtime": mtime, "tail": tmux.decode_lines(data)}


def metrics_facts(path: str) -> dict[str, t.Any] | None:
    """The last complete JSON line of metrics.jsonl and the file's mtime."""
    try:
        data, size, mtime = _tail_bytes(path, 5)
    except FileNotFoundError:
        return None
    except OSError as e:
        return {"path": path, "error": str(e)}
    last = None
    for line in reversed(data.decode("utf-8", "replace").splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written right now
        if isinstance(rec, dict):
            last = rec
            break
    return {"path": path, "size": size, "mtime": mtime, "last": last}


def attempt_facts(req: Request, lines: int = DIAG_LINES) -> dict[str, t.Any] | None:
    adir = current_attempt(req)
    if adir is None:
        return None
    errors: list[str] = []
    facts: dict[str, t.Any] = {"dir": adir, "attempt": _attempt_number(os.path.basename(adir))}
    for key, name in (("run", RUN_JSON), ("exit", EXIT_JSON), ("stop", STOP_JSON)):
        facts[key], err = _read_json(os.path.join(adir, name))
        if err:
            errors.append(err)
    run = facts["run"] or {}
    facts["runner"] = process_facts(run.get("pid"), run.get("pid_start"))
    facts["child"] = process_facts(run.get("child_pid"), run.get("child_start"))
    facts["log"] = log_facts(os.path.join(adir, LOG), lines)
    facts["metrics"] = metrics_facts(os.path.join(adir, METRICS))
    facts["errors"] = errors
    return facts


def _alive(af: dict[str, t.Any] | None) -> dict[str, t.Any] | None:
    """The live process of an attempt (the command first, then its runner), or None."""
    if not af or af.get("exit"):
        return None
    for key in ("child", "runner"):
        p = af.get(key)
        if p and p["alive"]:
            return p
    return None


# --------------------------------------------------------------------------------------------
# nvidia-smi (started first, read last: it is the slow fact)

_GPU_QUERY = "index,name,memory.used,memory.total,utilization.gpu"


def _start_gpus() -> subprocess.Popen[bytes] | None:
    import shutil

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        return subprocess.Popen(
            [exe, f"--query-gpu={_GPU_QUERY}", "--format=csv,noheader,nounits"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
    except OSError:
        return None


def _finish_gpus(proc: subprocess.Popen[bytes] | None) -> list[dict[str, t.Any]] | dict[str, str] | None:
    if proc is None:
        return None
    try:
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": "nvidia-smi did not answer within 10s"}
    if proc.returncode != 0:
        return {"error": (err or out).decode("utf-8", "replace").strip()[-300:]}
    gpus = []
    for line in out.decode("utf-8", "replace").splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 5:
            continue

        def num(s: str) -> float | None:
            try:
                return float(s)
            except ValueError:
                return None

        gpus.append({"index": int(num(cells[0]) or 0), "name": cells[1], "memory_used_mib": num(cells[2]),
                     "memory_total_mib": num(cells[3]), "utilization_pct": num(cells[4])})
    return gpus


# --------------------------------------------------------------------------------------------
# Verbs


def probe(req: Request) -> dict[str, t.Any]:
    """Every fact the classification needs, in one call."""
    gpus = _start_gpus()
    tf = tmux_facts(req)
    af = attempt_facts(req, int(req.get("lines", DIAG_LINES)))
    pane_capture = None
    if (af is None or af.get("run") is None) and _session_alive(tf):
        # no run record (a session started by hand): the pane is the only log there is
        pane_capture = capture(req, int(req.get("lines", DIAG_LINES)))
    boot, boot_ticks = pid1_start()
    return {
        "now": time.time(),
        "hostname": os.uname().nodename,
        "pid1_start": boot,
        "pid1_ticks": boot_ticks,
        "oom_kill": oom_kill_count(),
        "tmux": tf,
        "attempt": af,
        "pane_capture": pane_capture,
        "gpus": _finish_gpus(gpus),
    }


def _next_attempt_dir(sdir: str) -> tuple[int, str]:
    os.makedirs(sdir, exist_ok=True)
    while True:
        existing = [n for name in os.listdir(sdir) if (n := _attempt_number(name)) is not None]
        n = max(existing, default=0) + 1
        path = os.path.join(sdir, f"attempt-{n}")
        try:
            os.mkdir(path)  # atomic: two starts never share an attempt
        except FileExistsError:
            continue
        return n, path


def _point_current(sdir: str, name: str) -> None:
    """`current -> attempt-<n>` switched atomically (relative symlink, then rename over)."""
    tmp = os.path.join(sdir, f".current.{os.getpid()}")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    os.symlink(name, tmp)
    os.replace(tmp, os.path.join(sdir, "current"))


def _describe(af: dict[str, t.Any], live: dict[str, t.Any]) -> str:
    run = af.get("run") or {}
    started = run.get("started_at")
    return f"attempt {af.get('attempt')}, pid {live['pid']}" + (f", started {started}" if started else "")


def start(req: Request) -> dict[str, t.Any]:
    workdir = req["workdir"]
    current = os.path.join(workdir, "current")
    if not os.path.isdir(current):
        raise Refused("not-deployed", f"nothing is deployed at {current}: run `dflashctl deploy` first")
    release = os.path.basename(os.path.realpath(current))
    session, socket_name = req["session"], req["socket"]
    env = _tmux_env(req)
    tmux_bin = req.get("tmux", "tmux")

    tf = tmux_facts(req)
    if not tf["installed"]:
        raise Refused("no-tmux", f"tmux is not installed where the run lives ({tf['stderr']})")
    af = attempt_facts(req, 0)
    live = _alive(af)
    pane = _pane(tf)
    pane_live = pane is not None and pane.get("pane_dead") == "0"
    replaced = None
    if live or pane_live:
        what = _describe(af, live) if (af and live) else f"pane pid {pane['pane_pid']} (no run record)" if pane else "?"
        if not req.get("replace"):
            raise Refused(
                "run-active",
                f"session '{session}' already has a live run ({what}): "
                "stop it with `dflashctl stop`, or start with --replace",
                attempt=af.get("attempt") if af else None, pid=live["pid"] if live else None,
            )
        # A live pane with no live run record (started by hand): the last attempt dir, if any, belongs
        # to an ended run whose evidence must not be touched, so stop the pane, not that attempt.
        replaced = _stop(req, af if live else None, tf, grace=float(req.get("replace_grace", 10.0)), reason="replaced")
        tf = tmux_facts(req)
    if _session_alive(tf):
        # a dead pane (remain-on-exit) or a replaced run still holds the name
        _run(tmux.base(socket_name, tmux_bin) + ["kill-session", "-t", tmux.exact(session)], env=env)

    sdir = session_dir(req)
    n, adir = _next_attempt_dir(sdir)
    _point_current(sdir, os.path.basename(adir))
    python = req.get("python") or sys.executable
    runner = [python, "-m", "ops.runner", "--attempt-dir", adir, "--session", session, "--attempt", str(n),
              "--python", python, "--release", release]
    for key, value in (req.get("env") or {}).items():
        runner += ["--env", f"{key}={value}"]
    runner += ["--", *req["command"]]
    res = _run(tmux.start_argv(socket_name, session, current, runner, tmux_bin), env=env)
    if res["exit_code"] != 0:
        raise Refused("tmux-failed", f"tmux could not create session '{session}': {res['stderr'].strip() or res}",
                      attempt=n)

    # Wait for the runner's record, so we can say which pid runs (and catch an instant failure).
    run = None
    deadline = time.monotonic() + float(req.get("wait", 10.0))
    while run is None and time.monotonic() < deadline:
        run, _ = _read_json(os.path.join(adir, RUN_JSON))
        if run is None:
            time.sleep(0.02)
    exit_rec, _ = _read_json(os.path.join(adir, EXIT_JSON))
    out: dict[str, t.Any] = {
        "attempt": n, "attempt_dir": adir, "log": os.path.join(adir, LOG), "release": release,
        "pid": run.get("pid") if run else None, "child_pid": run.get("child_pid") if run else None,
        "started_at": run.get("started_at") if run else None, "exit": exit_rec, "replaced": replaced,
    }
    if run is None:
        tf = tmux_facts(req)
        pane = _pane(tf)
        out["warning"] = "the runner wrote no run.json yet"
        if pane and pane.get("pane_dead") == "1":
            out["warning"] = "the runner died at once: " + " | ".join(capture(req, 20)["lines"][-5:])
    return out


def _stop(req: Request, af: dict[str, t.Any] | None, tf: dict[str, t.Any], *, grace: float, reason: str) -> dict[str, t.Any]:
    """C-c to the pane, wait `grace` for exit.json, TERM the command (by pid, same start time),
    wait again, then KILL. The stop record is written FIRST: whatever the run does next, it was on purpose."""
    socket_name, session = req["socket"], req["session"]
    tmux_bin = req.get("tmux", "tmux")
    env = _tmux_env(req)
    adir = af["dir"] if af else None
    t0 = time.monotonic()
    if adir and af and af.get("run") is not None:
        write_json_atomic(os.path.join(adir, STOP_JSON),
                          {"requested_at": iso(time.time()), "grace": grace, "reason": reason, "by": "dflashctl"})

    def ended() -> bool:
        if af is None or af.get("run") is None:
            cur = _pane(tmux_facts(req))
            return cur is None or cur.get("pane_dead") == "1"
        if os.path.exists(os.path.join(adir, EXIT_JSON)):
            return True
        return _alive(attempt_facts(req, 0)) is None

    def wait(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if ended():
                return True
            time.sleep(0.1)
        return ended()

    steps = []
    pane = _pane(tf)
    if pane is not None and pane.get("pane_dead") == "0":
        _run(tmux.base(socket_name, tmux_bin) + ["send-keys", "-t", tmux.pane_target(session), "C-c"], env=env)
        steps.append("interrupt")
    how = "interrupt"
    if not (steps and wait(grace)):
        run = (af or {}).get("run") or {}
        targets = [(run.get("child_pid"), run.get("child_start")), (run.get("pid"), run.get("pid_start"))]
        if not run and pane is not None:
            targets = [(int(pane["pane_pid"]), None)]
        for sig, name in ((signal.SIGTERM, "term"), (signal.SIGKILL, "kill")):
            sent = False
            for pid, start_ticks in targets:
                p = process_facts(pid, start_ticks)
                if p and p["alive"]:
                    try:
                        os.kill(pid, sig)
                        sent = True
                    except ProcessLookupError:
                        pass
                if sent:
                    break  # the runner exits by itself once the command is gone
            if sent:
                how = name
                steps.append(name)
                if wait(grace if name == "term" else 5.0):
                    break
            elif ended():
                break
    exit_rec = _read_json(os.path.join(adir, EXIT_JSON))[0] if adir else None
    return {"attempt": (af or {}).get("attempt"), "how": how, "steps": steps, "exit": exit_rec,
            "ended": ended(), "seconds": round(time.monotonic() - t0, 2)}


def stop(req: Request) -> dict[str, t.Any]:
    tf = tmux_facts(req)
    af = attempt_facts(req, 0)
    live = _alive(af)
    pane = _pane(tf)
    hand_started = (af is None or af.get("run") is None) and pane is not None and pane.get("pane_dead") == "0"
    if live is None and not hand_started:
        state = "nothing to stop"
        if af and af.get("exit"):
            state = f"attempt {af.get('attempt')} already ended"
        return {"stopped": False, "reason": state, "attempt": (af or {}).get("attempt"),
                "exit": (af or {}).get("exit")}
    result = _stop(req, af if not hand_started else None, tf, grace=float(req.get("grace", 60.0)), reason="stop")
    result["stopped"] = result["ended"]
    return result


def tail(req: Request) -> dict[str, t.Any]:
    """The last N lines from the pane (live session) or the durable log, and why; or, with an
    ``offset``, the log's new complete lines after that offset (``tail -f``)."""
    n = int(req.get("lines", 30))
    source = req.get("source", "auto")
    if req.get("offset") is not None:
        return _follow(req)
    adir = current_attempt(req)
    log = os.path.join(adir, LOG) if adir else None
    have_log = log is not None and os.path.exists(log)
    tf = tmux_facts(req)
    pane = _pane(tf)
    verdict = tmux.classify(tf["stderr"]) if not _session_alive(tf) else None

    # `tail -f` reads ONE stream, the log: its first lines and what follows come from the same offsets
    live_pane = pane is not None and pane.get("pane_dead") == "0" and not (req.get("follow") and have_log)
    if source == "pane" or (source == "auto" and live_pane):
        if pane is None:
            raise Refused("no-pane", f"no pane to show: {verdict.text if verdict else 'no session'}")
        cap = capture(req, n)
        if cap["exit_code"] != 0:
            raise Refused("no-pane", f"cannot capture the pane: {cap['stderr']}")
        why = f"session '{req['session']}' is alive; showing its pane"
        if pane.get("pane_dead") == "1":
            why = f"showing the dead pane of session '{req['session']}'"
        # `tail -f` goes on from the log's end as it is now
        offset = os.path.getsize(log) if have_log else None  # type: ignore[arg-type]
        return {"source": "pane", "reason": why, "lines": cap["lines"], "log": log if have_log else None, "offset": offset}

    if have_log:
        assert log is not None
        if source == "log":
            why = f"showing the log {log}"
        elif req.get("follow") and pane is not None and pane.get("pane_dead") == "0":
            why = f"following the log {log} (the session is alive too: `dflashctl attach` for the pane)"
        elif verdict is not None and verdict.server == "dead":
            why = f"tmux server is not running ({verdict.text}); showing the log {log}"
        elif verdict is not None:
            why = f"session '{req['session']}' is gone ({verdict.text}); showing the log {log}"
        elif pane is not None:
            why = f"the pane is dead; showing the log {log}"
        else:
            why = f"showing the log {log}"
        data, size, _ = _tail_bytes(log, n)
        return {"source": "log", "reason": why, "lines": tmux.decode_lines(data), "log": log, "offset": size}
    if source == "auto" and pane is not None:
        cap = capture(req, n)
        return {"source": "pane", "reason": f"no log yet; showing the dead pane of session '{req['session']}'",
                "lines": cap["lines"], "log": None}
    where = f"no log under {session_dir(req)}"
    raise Refused("nothing", f"nothing to show: {where}" + (f" and {verdict.text}" if verdict else ""))


def _follow(req: Request) -> dict[str, t.Any]:
    adir = current_attempt(req)
    current_log = os.path.join(adir, LOG) if adir else None
    log = req.get("log") or current_log
    offset = int(req["offset"])
    try:
        with open(log, "rb") as f:  # type: ignore[arg-type]
            size = os.fstat(f.fileno()).st_size
            if size < offset:
                offset = 0  # truncated or replaced: start over
            f.seek(offset)
            data = f.read(FOLLOW_CHUNK)
    except (OSError, TypeError) as e:
        raise Refused("no-log", f"cannot read the log {log}: {e}") from None
    # only complete lines; a partial one waits for its newline (unless it is huge)
    cut = data.rfind(b"\n") + 1
    if cut == 0 and len(data) < FOLLOW_CHUNK:
        cut = 0
    elif cut == 0:
        cut = len(data)
    return {"source": "log", "log": log, "current_log": current_log, "lines": tmux.decode_lines(data[:cut]),
            "offset": offset + cut, "size": size}


HANDLERS: dict[str, t.Callable[[Request], dict[str, t.Any]]] = {
    "probe": probe, "start": start, "stop": stop, "tail": tail,
}
REQUIRED = {"probe": ("session", "socket", "run_dir"), "start": ("session", "socket", "run_dir", "workdir", "command"),
            "stop": ("session", "socket", "run_dir"), "tail": ("session", "socket", "run_dir")}


def main(argv: t.Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    args = [a for a in args if a != "--json"]  # JSON is the only output there is
    if len(args) != 1 or args[0] not in HANDLERS:
        print(json.dumps({"ok": False, "error": "usage", "message": f"usage: python -m ops.agent {{{','.join(VERBS)}}} --json"}))
        return 2
    verb = args[0]
    try:
        req = json.loads(sys.stdin.read() or "{}")
        if not isinstance(req, dict):
            raise ValueError("expected a JSON object")
        missing = [k for k in REQUIRED[verb] if k not in req]
        if missing:
            raise ValueError(f"missing keys: {', '.join(missing)}")
        for key in ("session", "socket"):
            # a tmux target and a folder name: nothing that could walk out of run_dir or change the target
            if not re.fullmatch(r"[A-Za-z0-9_-]+", str(req[key])):
                raise ValueError(f"{key}: use letters, digits, '-', '_' only, got {req[key]!r}")
    except ValueError as e:
        print(json.dumps({"ok": False, "error": "bad-request", "message": f"{verb}: bad request: {e}"}))
        return 2
    try:
        result = HANDLERS[verb](req)
        answer = {"ok": True, "protocol": PROTOCOL, "verb": verb, **result}
    except Refused as e:
        answer = {"ok": False, "protocol": PROTOCOL, "verb": verb, "error": e.kind, "message": str(e), **e.extra}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
