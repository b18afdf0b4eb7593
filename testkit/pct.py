"""A fake Proxmox ``pct`` whose containers are real Linux pid+mount namespaces (stdlib only).

Run as ``<python> pct.py --state <dir> <verb> ...`` through the script ``FakePve`` writes (its path
goes into hosts.toml ``pct``). The texts and exit codes are pct's own (pve-container
``src/PVE/CLI/pct.pm``; a perl ``die`` exits 255) and lxc-attach's for ``exec`` (the child's exit
status, 128+N for a signalled child, 127/126 + ``Failed to exec "<prog>"``).

A container is ``unshare --pid --mount --fork --mount-proc --propagation private`` running an init
(this file with ``__init__``) that mounts a fresh tmpfs on /tmp, then sleeps and reaps. Killing the
init kills every process in the namespace (tmux servers included) and the next start gets an empty
/tmp. The rest of the filesystem is the host's. ``exec`` is ``nsenter -t <init> -p -m``.

State (``--state``): ``nodes/<node>/lxc/<id>.conf`` (the container exists), ``run/<id>.json``
(init pid, start time), ``node`` (the node name), ``lock``.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# pct runs its commands with this PATH (pve-common CLIHandler), and lxc-attach passes it on.
PCT_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"
INIT_MARK = "__init__"
MS_BIND, MS_MOVE, MS_REC = 4096, 8192, 16384  # <sys/mount.h>


class Die(Exception):
    """A perl ``die``: message on stderr, exit 255."""

    def __init__(self, message: str, code: int = 255) -> None:
        super().__init__(message)
        self.code = code


class State:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = (root / "node").read_text().strip() if (root / "node").exists() else "pve"

    def conf(self, vmid: str) -> Path:
        return self.root / "nodes" / self.node / "lxc" / f"{vmid}.conf"

    def run_file(self, vmid: str) -> Path:
        return self.root / "run" / f"{vmid}.json"

    def load_config(self, vmid: str) -> None:
        if not self.conf(vmid).is_file():
            raise Die(f"Configuration file 'nodes/{self.node}/lxc/{vmid}.conf' does not exist")

    def init_info(self, vmid: str) -> dict[str, float] | None:
        """The running container's init ``{"pid", "started_at"}``, or None when it is stopped."""
        try:
            info: dict[str, float] = json.loads(self.run_file(vmid).read_text())
        except (FileNotFoundError, ValueError):
            return None
        if not is_our_init(int(info["pid"]), self.root, vmid):
            return None
        return info

    def lock(self) -> int:
        fd = os.open(self.root / "lock", os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd


def is_our_init(pid: int, root: Path, vmid: str) -> bool:
    """True when ``pid`` is alive and is the init of container ``vmid`` of this state dir."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return False
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, IndexError):
        return False
    return INIT_MARK.encode() in args and str(root).encode() in args and vmid.encode() in args


def children_of(ppid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == ppid:
            found.append(int(entry))
    return found


# ------------------------------------------------------------------------------------------
# Verbs


def cmd_status(st: State, vmid: str, args: list[str]) -> int:
    st.load_config(vmid)
    verbose = "--verbose" in args or "--verbose=1" in args
    info = st.init_info(vmid)
    status = "running" if info else "stopped"
    if not verbose:
        print(f"status: {status}")
        return 0
    facts: dict[str, object] = {
        "cpus": 1,
        "disk": 0,
        "diskread": 0,
        "diskwrite": 0,
        "maxdisk": 8 << 30,
        "maxmem": 2 << 30,
        "maxswap": 512 << 20,
        "mem": 0,
        "name": f"ct{vmid}",
        "netin": 0,
        "netout": 0,
        "status": status,
        "swap": 0,
        "type": "lxc",
        "uptime": 0,
        "vmid": vmid,
    }
    if info:
        facts["pid"] = int(info["pid"])
        facts["uptime"] = max(0, int(time.time() - float(info["started_at"])))
    for key in sorted(facts):
        print(f"{key}: {facts[key]}")
    return 0


def cmd_start(st: State, vmid: str, args: list[str]) -> int:
    st.load_config(vmid)
    fd = st.lock()
    try:
        if st.init_info(vmid):
            raise Die(f"CT {vmid} already running")
        start_init(st, vmid)
    finally:
        os.close(fd)
    return 0


def start_init(st: State, vmid: str) -> None:
    st.run_file(vmid).parent.mkdir(parents=True, exist_ok=True)
    r, w = os.pipe()
    argv = [
        "unshare",
        "--pid",
        "--mount",
        "--fork",
        "--mount-proc",
        "--propagation",
        "private",
        sys.executable,
        os.path.abspath(__file__),
        INIT_MARK,
        str(st.root),
        vmid,
        str(w),
    ]
    # Its own session, no inherited stdio: the caller (an ssh channel) must not wait on it.
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(w,),
        start_new_session=True,
    )
    os.close(w)
    # One line from the init once /tmp is mounted (unshare keeps the write end open: no EOF).
    with os.fdopen(r, "rb") as pipe:
        ready = pipe.readline()
    if not ready.startswith(b"ok"):
        raise Die(f"startup for container '{vmid}' failed: {ready.decode(errors='replace').strip() or 'init died'}")
    deadline = time.monotonic() + 10
    while True:
        kids = [p for p in children_of(proc.pid) if is_our_init(p, st.root, vmid)]
        if kids:
            break
        if time.monotonic() > deadline:
            raise Die(f"startup for container '{vmid}' failed: init not found")
        time.sleep(0.01)
    tmp = st.run_file(vmid).with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": kids[0], "unshare": proc.pid, "started_at": time.time()}))
    tmp.replace(st.run_file(vmid))


def kill_init(st: State, vmid: str) -> None:
    info = st.init_info(vmid)
    if info:
        pid = int(info["pid"])
        try:
            os.kill(pid, signal.SIGKILL)  # pid 1 of the namespace: the kernel kills the rest
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 10
        while is_our_init(pid, st.root, vmid) and time.monotonic() < deadline:
            time.sleep(0.01)
    st.run_file(vmid).unlink(missing_ok=True)


def _kill_running(st: State, vmid: str, *, then_start: bool) -> int:
    """stop and reboot: only a running CT; under the state lock."""
    st.load_config(vmid)
    fd = st.lock()
    try:
        if not st.init_info(vmid):
            raise Die(f"CT {vmid} not running")
        kill_init(st, vmid)
        if then_start:
            start_init(st, vmid)
    finally:
        os.close(fd)
    return 0


def cmd_stop(st: State, vmid: str, args: list[str]) -> int:
    return _kill_running(st, vmid, then_start=False)


def cmd_reboot(st: State, vmid: str, args: list[str]) -> int:
    return _kill_running(st, vmid, then_start=True)


def cmd_destroy(st: State, vmid: str, args: list[str]) -> int:
    st.load_config(vmid)
    if st.init_info(vmid):
        raise Die(f"CT {vmid} is running - destroy failed")
    st.conf(vmid).unlink()
    return 0


def _running_init(st: State, vmid: str, not_running: str) -> int:
    st.load_config(vmid)
    info = st.init_info(vmid)
    if not info:
        raise Die(not_running)
    return int(info["pid"])


def cmd_exec(st: State, vmid: str, args: list[str]) -> int:
    if "--" in args:
        cut = args.index("--")
        opts, argv = args[:cut], args[cut + 1 :]
    else:
        opts, argv = [], args
        for a in argv:
            if a.startswith("-"):
                raise Die(f"Unknown option: {a.lstrip('-')}\n400 unable to parse option")
    for o in opts:
        if o not in ("--keep-env", "--keep-env=1", "--keep-env=0", "0", "1"):
            raise Die(f"Unknown option: {o.lstrip('-')}\n400 unable to parse option")
    init = _running_init(st, vmid, f"container '{vmid}' not running!")
    if not argv:
        raise Die("missing command (this fake pct has no interactive shell)")
    env = dict(os.environ, PATH=PCT_PATH)
    missing = _exec_problem(init, argv[0], env["PATH"])
    if missing:
        errno_text, rc = missing
        print(
            f'lxc-attach: {vmid}: ../src/lxc/attach.c: lxc_attach_run_command: 1841 {errno_text} - Failed to exec "{argv[0]}"',
            file=sys.stderr,
        )
        return rc
    sys.stdout.flush()
    rc = subprocess.call(["nsenter", "-t", str(init), "-p", "-m", "--wd=/", "--", *argv], env=env)
    return 128 - rc if rc < 0 else rc  # lxc-attach: a signalled child is 128+N


def _exec_problem(init: int, prog: str, path: str) -> tuple[str, int] | None:
    """What lxc-attach's exec would fail with, looked up in the container's own view of the files."""
    root = f"/proc/{init}/root"
    candidates = (
        [prog if prog.startswith("/") else "/" + prog] if "/" in prog else [f"{d}/{prog}" for d in path.split(":") if d]
    )
    for c in candidates:
        full = root + c
        if os.path.isfile(full):
            return None if os.access(full, os.X_OK) else ("Permission denied", 126)
    return ("No such file or directory", 127)


def cmd_push(st: State, vmid: str, args: list[str]) -> int:
    perms = None
    rest: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "--perms" and i + 1 < len(args):
            perms = int(args[i + 1], 8)
            i += 2
        elif args[i].startswith("--perms="):
            perms = int(args[i].split("=", 1)[1], 8)
            i += 1
        elif args[i] in ("--user", "--group") and i + 1 < len(args):
            i += 2
        else:
            rest.append(args[i])
            i += 1
    if len(rest) != 2:
        raise Die("400 wrong number of arguments\npct push <vmid> <file> <destination> [OPTIONS]")
    init = _running_init(st, vmid, "can only push files to a running CT")
    src, dst = rest
    # Like pct's fork_worker: the copy's error is printed, but the exit code stays 0 (no $upid_exit).
    try:
        data = Path(src).read_bytes()
    except OSError:
        print(f"failed to open {src} for reading", file=sys.stderr)
        return 0
    target = f"/proc/{init}/root{dst if dst.startswith('/') else '/' + dst}"
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, perms if perms is not None else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if perms is not None:
            os.chmod(target, perms)
    except OSError as e:
        print(f"failed to open {dst} for writing: {e.strerror}", file=sys.stderr)
    return 0


def cmd_pull(st: State, vmid: str, args: list[str]) -> int:
    rest = [a for a in args if not a.startswith("--")]
    if len(rest) != 2:
        raise Die("400 wrong number of arguments\npct pull <vmid> <path> <destination> [OPTIONS]")
    init = _running_init(st, vmid, "can only pull files from a running VM")
    src, dst = rest
    try:
        data = Path(f"/proc/{init}/root{src if src.startswith('/') else '/' + src}").read_bytes()
        Path(dst).write_bytes(data)
    except OSError as e:
        print(f"failed to open {src} for reading: {e.strerror}", file=sys.stderr)
    return 0


VERBS = {
    "status": cmd_status,
    "start": cmd_start,
    "stop": cmd_stop,
    "shutdown": cmd_stop,
    "reboot": cmd_reboot,
    "destroy": cmd_destroy,
    "exec": cmd_exec,
    "push": cmd_push,
    "pull": cmd_pull,
}


# ------------------------------------------------------------------------------------------
# The container's init (pid 1 of the namespace)


def mount_points(conf: Path) -> list[tuple[str, str]]:
    """``(host path, container path)`` of the ``mpN: <host>,mp=<ct>`` bind mounts in a CT config."""
    points = []
    for line in conf.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.startswith("mp") and key[2:].isdigit():
            host, *opts = value.strip().split(",")
            ct = next((o[3:] for o in opts if o.startswith("mp=")), None)
            if ct:
                points.append((host, ct))
    return points


def init_main(state: str, vmid: str, ready_fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(src: bytes, dst: bytes, fstype: bytes | None, flags: int, data: bytes | None) -> None:
        if libc.mount(src, dst, fstype, flags, data) != 0:
            err = ctypes.get_errno()
            os.write(ready_fd, f"mount {dst.decode()}: {os.strerror(err)}\n".encode())
            os._exit(1)

    # A fresh tmpfs for /tmp, built aside first so that bind mounts of host folders that live under the
    # host's /tmp (mpN lines, like PVE's) can still be reached, then moved over /tmp.
    st = State(Path(state))
    staging = Path(state) / "run" / f"{vmid}.tmp.d"
    staging.mkdir(parents=True, exist_ok=True)
    mount(b"tmpfs", bytes(staging), b"tmpfs", 0, b"mode=1777,size=268435456")
    for host, ct in mount_points(st.conf(vmid)):
        if ct == "/tmp" or not ct.startswith("/tmp/"):
            continue  # outside /tmp the container sees the host's filesystem anyway
        target = staging / os.path.relpath(ct, "/tmp")
        target.mkdir(parents=True, exist_ok=True)
        mount(host.encode(), bytes(target), None, MS_BIND | MS_REC, None)
    mount(bytes(staging), b"/tmp", None, MS_MOVE, None)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    os.write(ready_fd, b"ok\n")
    os.close(ready_fd)
    os.chdir("/")
    while True:  # pid 1: reap every orphan that lands here
        signal.sigtimedwait({signal.SIGCHLD}, 30)
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def main(argv: list[str]) -> int:
    if argv and argv[0] == INIT_MARK:
        init_main(argv[1], argv[2], int(argv[3]))
        return 0
    if len(argv) < 2 or argv[0] != "--state":
        print("usage: pct.py --state DIR <verb> <vmid> ...", file=sys.stderr)
        return 2
    st = State(Path(argv[1]))
    rest = argv[2:]
    if not rest or rest[0] not in VERBS:
        print(f"ERROR: unknown command 'pct {' '.join(rest[:1])}'", file=sys.stderr)
        print(f"USAGE: pct <COMMAND> [ARGS] [OPTIONS]  (this fake knows: {', '.join(VERBS)})", file=sys.stderr)
        return 255
    if len(rest) < 2:
        print("400 not enough arguments\nvmid: property is missing and it is not optional", file=sys.stderr)
        return 255
    verb, vmid, args = rest[0], rest[1], rest[2:]
    if not vmid.isdigit():
        print(
            f"400 Parameter verification failed.\nvmid: type check ('integer') failed - got '{vmid}'", file=sys.stderr
        )
        return 255
    try:
        return VERBS[verb](st, vmid, args)
    except Die as e:
        print(str(e), file=sys.stderr)
        return e.code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
