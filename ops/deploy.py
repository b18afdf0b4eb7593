"""`dflashctl deploy`: content-addressed releases, incremental upload, atomic switch, rollback.

Layout on the far side (DESIGN.md section 4)::

    <workdir>/releases/<id>/            one per deploy; <id> = first 16 hex of the manifest's sha256
    <workdir>/releases/<id>/.release.json   the manifest (full id, per-file sha256/size/mode)
    <workdir>/current  -> releases/<id>     switched atomically (new symlink, then rename over)
    <workdir>/previous -> releases/<id>     what --rollback goes back to
    <workdir>/.deploy.lock                  one deploy at a time

Everything on the far side is done by ``REMOTE_PROGRAM``: one small stdlib-only Python program
sent as ``<python> -c <source> <verb> <args...>`` (it cannot live in a release: the first deploy
has none). User values only ever travel as separate argv items or inside the tar on stdin.
A deploy is two calls: ``inspect`` (what is there: current manifest, the content hashes kept
releases hold, a live run, missing modules) and ``install`` (one tar on stdin: the manifest, then
only the files whose content the container lacks).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import typing as t

from ops.bundle import Bundle, FileEntry, TarStream, build_bundle
from ops.errors import DeployError, MissingDependencies, NotDeployed, RunActive
from ops.hosts import Host
from ops.transport import CommandResult

if t.TYPE_CHECKING:
    from ops.remote import Remote

# What the training core imports in the container, and how pip names them (the agent and the runner
# are stdlib only: status works before any of these is installed). torch is left unpinned on purpose: a GPU box needs its own
# CUDA build, not the CPU pin of pyproject.toml.
REQUIRED_MODULES: dict[str, str] = {
    "torch": "torch",
    "transformers": "transformers>=5.24,<6",
    "safetensors": "safetensors>=0.4",
    "accelerate": "accelerate>=1.1",  # targets load straight onto their GPU (device_map)
    "numpy": "numpy>=1.24",  # the averaging engine
    "click": "click>=8.1",
}
MIN_PYTHON = (3, 11)
INSPECT_TIMEOUT = 60.0
NEED_CONTENT = 3  # the install verb's exit code for "send me these hashes again"

# The far-side program. Stdlib only, Python >= 3.8 syntax (it must run far enough to report an old
# interpreter). Prints one JSON object on stdout; failures: "deploy: <why>" on stderr, exit 1.
REMOTE_PROGRAM = r'''
import sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
import fcntl, hashlib, json, os, shutil, signal, tarfile

MANIFEST = ".release.json"
IDLEN = 16
CHUNK = 1 << 20


class Refused(Exception):
    pass


class Interrupted(BaseException):
    pass


def on_signal(signum, frame):
    raise Interrupted("interrupted by signal %d" % signum)


def canonical(rows):
    return json.dumps({"files": rows, "format": 1}, sort_keys=True, separators=(",", ":")).encode()


def check_rows(rows):
    seen = set()
    for row in rows:
        if not (isinstance(row, list) and len(row) == 4):
            raise Refused("manifest: bad entry %r" % (row,))
        path, sha, size, mode = row
        parts = path.split("/") if isinstance(path, str) else [""]
        if (path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in path
                or path == MANIFEST or path in seen):
            raise Refused("manifest: refused path %r (must be relative, inside, unique)" % (path,))
        if not (isinstance(sha, str) and len(sha) == 64 and isinstance(size, int) and size >= 0
                and mode in (0o644, 0o755)):
            raise Refused("manifest: bad entry for %r" % (path,))
        seen.add(path)
    return rows


def read_manifest(rel):
    try:
        with open(os.path.join(rel, MANIFEST), "rb") as f:
            doc = json.loads(f.read().decode())
        return doc if isinstance(doc.get("files"), list) else None
    except (OSError, ValueError, AttributeError):
        return None


def link_id(workdir, name):
    try:
        target = os.readlink(os.path.join(workdir, name))
    except OSError:
        return None
    head, _, rid = target.rstrip("/").rpartition("/")
    return rid if head == "releases" and rid else None


def releases(workdir):
    """Complete releases, newest use first: [(id, path, manifest)]."""
    root = os.path.join(workdir, "releases")
    try:
        names = os.listdir(root)
    except OSError:
        return []
    out = []
    for name in names:
        path = os.path.join(root, name)
        if name.endswith(".partial") or name.startswith(".") or os.path.islink(path) or not os.path.isdir(path):
            continue
        doc = read_manifest(path)
        if doc is not None:
            out.append((os.stat(path).st_mtime, name, path, doc))
    out.sort(key=lambda r: (-r[0], r[1]))
    return [(name, path, doc) for _, name, path, doc in out]


def sha_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                return h.hexdigest()
            h.update(b)


def damaged(rel, rows):
    bad = []
    for path, sha, size, mode in rows:
        full = os.path.join(rel, path)
        try:
            ok = not os.path.islink(full) and os.path.getsize(full) == size and sha_of(full) == sha
        except OSError:
            ok = False
        if not ok:
            bad.append(path)
    return bad


def proc_alive(pid, started_at, pid_start=None):
    """Whether pid is a live (non-zombie) process that is not a newer one reusing the number."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rpartition(")")[2].split()
    except (OSError, ValueError):
        try:
            os.kill(pid, 0)
            return True
        except PermissionError:
            return True
        except OSError:
            return False
    if fields[0] in ("Z", "X"):
        return False
    if isinstance(pid_start, int):  # the runner's own record of its start (clock ticks since boot)
        return len(fields) > 19 and fields[19] == str(pid_start)
    try:
        import datetime
        with open("/proc/stat") as f:
            btime = int([l.split()[1] for l in f if l.startswith("btime ")][0])
        began = btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
        recorded = datetime.datetime.fromisoformat(str(started_at).replace("Z", "+00:00")).timestamp()
        return began <= recorded + 120  # a process born well after the record reuses the pid
    except Exception:
        return True


def run_state(run_dir, session):
    cur = os.path.join(run_dir, session, "current")
    try:
        with open(os.path.join(cur, "run.json")) as f:
            run = json.load(f)
    except FileNotFoundError:
        return {"state": "none"}
    except (OSError, ValueError) as e:
        return {"state": "unknown", "detail": "%s/run.json: %s" % (cur, e)}
    info = {"attempt": run.get("attempt"), "pid": run.get("pid"), "started_at": run.get("started_at"),
            "dir": os.path.realpath(cur)}
    if os.path.exists(os.path.join(cur, "exit.json")):
        info["state"] = "ended"
    elif any(isinstance(run.get(k), int) and proc_alive(run[k], info["started_at"], run.get(ks))
             for k, ks in (("pid", "pid_start"), ("keeper_pid", "keeper_start"), ("child_pid", "child_start"))):
        # the command outlives a killed runner (its keeper records the end): any of the three alive is a live run
        info["state"] = "alive"
    else:
        info["state"] = "gone"
    return info


def inspect(workdir, run_dir, session, modules):
    import importlib.util
    missing = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except Exception:
            missing.append(name)
    out = {"python": list(sys.version_info[:3]), "executable": sys.executable, "missing": missing,
           "tar_filter": hasattr(tarfile, "data_filter"), "current": None, "previous": link_id(workdir, "previous"),
           "releases": [], "hashes": [], "problem": None, "damaged": [], "run": run_state(run_dir, session)}
    cur_path = os.path.join(workdir, "current")
    if os.path.lexists(cur_path) and not os.path.islink(cur_path):
        out["problem"] = "%s is not a symlink; move it away so deploy can manage it" % cur_path
    cur = link_id(workdir, "current")
    hashes = set()
    for rid, path, doc in releases(workdir):
        out["releases"].append(rid)
        hashes.update(row[1] for row in doc["files"])
        if rid == cur:
            out["current"] = {"id": doc.get("id"), "files": doc["files"]}
            out["damaged"] = damaged(path, doc["files"])
    out["hashes"] = sorted(hashes)
    return out


class Lock(object):
    def __init__(self, workdir):
        self.fd = os.open(os.path.join(workdir, ".deploy.lock"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise Refused("another deploy into %s is in progress" % workdir)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def sweep(workdir):
    """Remove what failed deploys left: *.partial release dirs and temp links."""
    root = os.path.join(workdir, "releases")
    for name in os.listdir(root):
        if name.endswith(".partial"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for name in os.listdir(workdir):
        if name.startswith(".link-"):
            try:
                os.unlink(os.path.join(workdir, name))
            except OSError:
                pass


def sync_fs(path):
    """Flush the release's filesystem once (syncfs), not every file: one call instead of hundreds."""
    fd = os.open(path, os.O_RDONLY)
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs")
    except (OSError, AttributeError, ImportError):
        os.sync()
    finally:
        os.close(fd)


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def set_link(workdir, name, rid):
    tmp = os.path.join(workdir, ".link-%s-%d" % (name, os.getpid()))
    os.symlink("releases/" + rid, tmp)
    os.replace(tmp, os.path.join(workdir, name))


def switch(workdir, rid):
    """current -> releases/rid (atomic); previous -> what current was. Returns the old id."""
    old = link_id(workdir, "current")
    set_link(workdir, "current", rid)
    if old and old != rid:
        set_link(workdir, "previous", old)
    os.utime(os.path.join(workdir, "releases", rid))  # mtime = last use, for pruning
    fsync_dir(workdir)
    return old


def prune(workdir, keep):
    protect = set([link_id(workdir, "current"), link_id(workdir, "previous")])
    kept, pruned = 0, []
    for rid, path, doc in releases(workdir):  # most recently used first
        if rid in protect or kept < keep:
            kept += 1
            continue
        shutil.rmtree(path, ignore_errors=True)
        pruned.append(rid)
    return pruned


def check_member(m, dest):
    name = m.name
    if name.startswith("/"):
        raise Refused("refused tar member %r: absolute path" % name)
    if ".." in name.split("/"):
        raise Refused("refused tar member %r: it would be extracted outside %s" % (name, dest))
    if m.isreg() and name and "" not in name.split("/") and "\0" not in name:
        return  # a plain relative file name: nothing the data filter could add, and it costs a realpath
    if hasattr(tarfile, "data_filter"):  # links, devices, odd names: its reasons are the clearest
        try:
            tarfile.data_filter(m, dest)
        except tarfile.FilterError as e:
            raise Refused("refused tar member: %s" % e)
    if m.issym() or m.islnk():
        raise Refused("refused tar member %r: links are not accepted (-> %r)" % (name, m.linkname))
    if not m.isreg():
        raise Refused("refused tar member %r: not a regular file" % name)


def write_file(src, dst, size, sha, mode, mtime):
    """Stream src (a file object) into the new file dst; True when it matches sha and size."""
    parent = os.path.dirname(dst)
    if not os.path.isdir(parent):
        os.makedirs(parent)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    h, n = hashlib.sha256(), 0
    with os.fdopen(fd, "wb") as out:
        while True:
            b = src.read(CHUNK)
            if not b:
                break
            h.update(b)
            n += len(b)
            out.write(b)
    if n != size or h.hexdigest() != sha:
        os.unlink(dst)
        return False
    os.chmod(dst, mode)
    os.utime(dst, (mtime, mtime))
    return True


def members(tar):
    # tar.next() in stream mode; iterating the TarFile would start again from the manifest.
    while True:
        m = tar.next()
        if m is None:
            return
        yield m


def install(workdir, want, keep):
    root = os.path.join(workdir, "releases")
    if not os.path.isdir(root):
        os.makedirs(root)
    with Lock(workdir):
        sweep(workdir)
        tar = tarfile.open(fileobj=sys.stdin.buffer, mode="r|", bufsize=1 << 16)  # larger: slower (buffer slicing)
        first = tar.next()
        if first is None or first.name != MANIFEST or not first.isreg() or first.size > 64 << 20:
            raise Refused("the upload does not start with the manifest")
        doc = json.loads(tar.extractfile(first).read().decode())
        rows = check_rows(doc.get("files") or [])
        full = hashlib.sha256(canonical(rows)).hexdigest()
        if full != want or doc.get("id") != want:
            raise Refused("the manifest does not hash to release %s" % want[:IDLEN])
        rid = full[:IDLEN]
        final = os.path.join(root, rid)
        if link_id(workdir, "current") == rid and read_manifest(final) is not None:
            return {"id": rid, "from": rid, "switched": False, "received": 0, "pruned": []}
        partial = final + ".partial"
        if os.path.isdir(final):
            if read_manifest(final) is not None and not damaged(final, rows):
                for m in members(tar):  # nothing is expected after the manifest
                    raise Refused("unexpected tar member %r: release %s is already here" % (m.name, rid))
                old = switch(workdir, rid)
                return {"id": rid, "from": old, "switched": True, "received": 0, "pruned": prune(workdir, keep)}
        os.mkdir(partial)  # a damaged kept copy of this release is rebuilt beside it, then replaced
        try:
            by_path = dict((r[0], r) for r in rows)
            have = {}  # sha -> file in the partial
            for m in members(tar):
                check_member(m, partial)
                row = by_path.get(m.name)
                if row is None or os.path.lexists(os.path.join(partial, m.name)):
                    raise Refused("refused tar member %r: not in the manifest, or sent twice" % m.name)
                path, sha, size, mode = row
                if m.size != size or not write_file(tar.extractfile(m), os.path.join(partial, path), size, sha, mode, m.mtime):
                    raise Refused("%s: received content does not match the manifest" % path)
                have[sha] = os.path.join(partial, path)
            sources = {}
            cur = link_id(workdir, "current")
            for prid, ppath, pdoc in sorted(releases(workdir), key=lambda r: r[0] != cur):
                for p, sha, _, _ in pdoc["files"]:
                    sources.setdefault(sha, []).append(os.path.join(ppath, p))
            need = []
            for path, sha, size, mode in rows:
                dst = os.path.join(partial, path)
                if os.path.lexists(dst):
                    continue
                done = False
                for src in ([have[sha]] if sha in have else []) + sources.get(sha, []):
                    try:
                        with open(src, "rb") as f:
                            done = write_file(f, dst, size, sha, mode, int(os.fstat(f.fileno()).st_mtime))
                    except OSError:
                        done = False
                    if done:
                        have[sha] = dst
                        break
                if not done:
                    need.append(sha)
            if need:
                return {"need": sorted(set(need))}
            extra = []
            for dirpath, dirs, names in os.walk(partial):
                for n in names:
                    rel = os.path.relpath(os.path.join(dirpath, n), partial)
                    if rel not in by_path:
                        extra.append(rel)
            missing = [p for p in by_path if not os.path.isfile(os.path.join(partial, p))]
            if extra or missing:
                raise Refused("verification failed: extra %r, missing %r" % (extra[:5], missing[:5]))
            with open(os.path.join(partial, MANIFEST), "wb") as f:
                f.write(json.dumps(doc, separators=(",", ":")).encode())
            sync_fs(partial)  # the files are on disk before any name points at them
            if os.path.isdir(final):
                os.rename(final, final + ".old.partial")
            os.rename(partial, final)
            shutil.rmtree(final + ".old.partial", ignore_errors=True)
            fsync_dir(root)
        finally:
            if os.path.isdir(partial):
                shutil.rmtree(partial, ignore_errors=True)
        old = switch(workdir, rid)
        return {"id": rid, "from": old, "switched": True, "received": len(have), "pruned": prune(workdir, keep)}


def rollback(workdir, keep):
    with Lock(workdir):
        cur, prev = link_id(workdir, "current"), link_id(workdir, "previous")
        if prev is None or prev == cur:
            raise Refused("no previous release to roll back to in %s" % workdir)
        path = os.path.join(workdir, "releases", prev)
        doc = read_manifest(path)
        if doc is None:
            raise Refused("previous release %s is gone or incomplete" % path)
        bad = damaged(path, doc["files"])
        if bad:
            raise Refused("previous release %s differs from its manifest (%s); not switching" % (path, ", ".join(bad[:5])))
        switch(workdir, prev)
        return {"from": cur, "to": prev}


def main(argv):
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, on_signal)
    verb, workdir = argv[0], os.path.abspath(argv[1])
    try:
        if verb == "inspect":
            out = inspect(workdir, argv[2], argv[3], argv[4:])
        elif verb == "install":
            out = install(workdir, argv[2], int(argv[3]))
        elif verb == "rollback":
            out = rollback(workdir, int(argv[2]))
        else:
            raise Refused("unknown verb %r" % verb)
    except Refused as e:
        sys.stderr.write("deploy: %s\n" % e)
        return 1
    except (tarfile.TarError, EOFError) as e:
        sys.stderr.write("deploy: the upload was cut short or is not a tar (%s); nothing was switched\n" % e)
        return 1
    except Interrupted as e:
        sys.stderr.write("deploy: %s; nothing was switched\n" % e)
        return 1
    except OSError as e:
        sys.stderr.write("deploy: %s\n" % e)
        return 1
    sys.stdout.write(json.dumps(out) + "\n")
    return 3 if "need" in out else 0


sys.exit(main(sys.argv[1:]))
'''


# --------------------------------------------------------------------------------------------
# The plan


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a deploy changes against the current release, and what it must send."""

    bundle: Bundle
    current_id: str | None
    added: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]
    send: tuple[FileEntry, ...]  # one file per content hash the container lacks

    @property
    def up_to_date(self) -> bool:
        return self.current_id == self.bundle.id

    @property
    def send_bytes(self) -> int:
        return sum(e.size for e in self.send)

    def describe(self) -> str:
        """``1 file changed``, ``87 files added, 1 removed``, or ``no file changed``."""
        counts = [(len(v), k) for k, v in (("added", self.added), ("changed", self.changed), ("removed", self.removed)) if v]
        if not counts:
            return "no file changed"
        (n, word), rest = counts[0], counts[1:]
        return ", ".join([f"{n} {'file' if n == 1 else 'files'} {word}", *(f"{m} {k}" for m, k in rest)])


def make_plan(bundle: Bundle, current_rows: t.Sequence[t.Sequence[t.Any]] | None, current_id: str | None,
              have_hashes: t.Iterable[str]) -> Plan:
    current = {r[0]: (r[1], r[3]) for r in current_rows or ()}
    ours = bundle.by_path()
    added = tuple(p for p in ours if p not in current)
    changed = tuple(p for p, f in ours.items() if p in current and current[p] != (f.sha256, f.mode))
    removed = tuple(sorted(p for p in current if p not in ours))
    have = set(have_hashes)
    send: dict[str, FileEntry] = {}
    for f in bundle.files:
        if f.sha256 not in have and f.sha256 not in send:
            send[f.sha256] = f
    return Plan(bundle, current_id, added, changed, removed, tuple(send.values()))


# --------------------------------------------------------------------------------------------
# Talking to the far side


@dataclasses.dataclass(frozen=True)
class Facts:
    """What ``inspect`` found on the host (see REMOTE_PROGRAM.inspect)."""

    raw: dict[str, t.Any]

    @property
    def current_id(self) -> str | None:
        cur = self.raw.get("current")
        return cur["id"][:16] if cur and cur.get("id") else None

    @property
    def current_rows(self) -> list[list[t.Any]] | None:
        cur = self.raw.get("current")
        return cur["files"] if cur else None

    @property
    def previous_id(self) -> str | None:
        return self.raw.get("previous")

    @property
    def hashes(self) -> list[str]:
        return self.raw.get("hashes", [])

    @property
    def missing(self) -> list[str]:
        return self.raw.get("missing", [])

    @property
    def damaged(self) -> list[str]:
        return self.raw.get("damaged", [])


def _program(host: Host, verb: str, *args: str | int) -> list[str]:
    # -I -S: stdlib only, nothing from the environment or site-packages, a faster start. Not for
    # inspect: it must see the site-packages (user site included) to tell which modules are missing.
    flags = [] if verb == "inspect" else ["-I", "-S"]
    return [host.python, *flags, "-c", REMOTE_PROGRAM, verb, host.workdir, *(str(a) for a in args)]


def _fail(host: Host, result: CommandResult, doing: str) -> DeployError:
    """One clear error for a failed far-side call (the program's own ``deploy:`` line when there is one)."""
    err = result.err.strip()
    if result.exit_code in (126, 127) and ("not found" in err or "Failed to exec" in err or "No such file" in err or not err):
        return DeployError(
            f"{host.label}: cannot run {host.python!r} there ({err.splitlines()[-1] if err else 'not found'}); "
            f"set hosts.{host.name}.python to an interpreter that exists")
    if result.timed_out:
        return DeployError(f"{host.label}: {doing} did not finish in time (killed); current is unchanged")
    lines = [ln for ln in err.splitlines() if ln.startswith("deploy: ")]
    why = lines[-1][len("deploy: "):] if lines else (err.splitlines()[-1] if err else f"exit {result.exit_code}")
    return DeployError(f"{host.label}: {doing} failed: {why}")


def _answer(host: Host, result: CommandResult) -> dict[str, t.Any]:
    """The one JSON object the far-side program prints last."""
    try:
        answer = json.loads(result.out.strip().splitlines()[-1])
        if isinstance(answer, dict):
            return answer
    except (ValueError, IndexError):
        pass
    raise DeployError(f"{host.label}: unreadable answer from the release program: {result.out[-200:]!r} {result.err[-200:]!r}")


def inspect(remote: Remote, host: Host) -> Facts:
    """One call: the current release, the hashes kept releases hold, a live run, missing modules."""
    result = remote.run(_program(host, "inspect", host.run_dir, host.session, *REQUIRED_MODULES), timeout=INSPECT_TIMEOUT)
    if not result.ok:
        raise _fail(host, result, "reading the deployed releases")
    raw = _answer(host, result)
    facts = Facts(raw)
    version = tuple(raw.get("python") or ())
    if version < MIN_PYTHON:
        raise DeployError(
            f"{host.label}: {host.python} is Python {'.'.join(map(str, version))}; dflash needs >= "
            f"{'.'.join(map(str, MIN_PYTHON))} (set hosts.{host.name}.python)")
    if raw.get("problem"):
        raise DeployError(f"{host.label}: {raw['problem']}")
    return facts


def active_run(facts: Facts) -> dict[str, t.Any] | None:
    """The live run that a deploy would pull the code from under, or None.

    Decided by the runner's record, read in the same ``inspect`` call: ``run.json`` without ``exit.json``
    and its pid alive (same ``pid_start``) -- the durable evidence the probe also trusts first. Not the
    agent's probe: that is one more ``pct exec`` per deploy and needs a release to run from. This is
    the one place to switch if deploy should ever refuse on more states (e.g. a bare tmux session).
    """
    run = facts.raw.get("run") or {}
    return run if run.get("state") == "alive" else None


# --------------------------------------------------------------------------------------------
# Output


class Progress:
    """Upload progress: one updating line on a TTY (bytes, rate); nothing otherwise."""

    def __init__(self, total: int, stream: t.TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = total
        self.start = time.monotonic()
        self._last = 0.0

    def __call__(self, sent: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and sent < self.total):
            return
        self._last = now
        rate = sent / max(now - self.start, 1e-6)
        pct = f" ({100 * sent // self.total}%)" if self.total else ""
        self.stream.write(f"\ruploading {human_bytes(sent)} of {human_bytes(self.total)}{pct} at {human_bytes(rate)}/s\x1b[K")
        self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


# --------------------------------------------------------------------------------------------
# The flow


@dataclasses.dataclass
class Outcome:
    """What a deploy did; the CLI prints ``summary`` last."""

    action: t.Literal["deployed", "unchanged", "dry-run", "rolled-back", "switched"]
    release: str | None
    previous: str | None = None
    plan: Plan | None = None
    bytes_sent: int = 0
    files_sent: int = 0
    seconds: float = 0.0
    pruned: tuple[str, ...] = ()
    summary: str = ""


def deploy(remote: Remote, host: Host, *, source: str | None = None, dry_run: bool = False, force: bool = False,
           install: bool = False, echo: t.Callable[[str], None] = print, progress: t.TextIO | None = None) -> Outcome:
    """Bundle the source, compare with what the host has, send only what it lacks, switch ``current``."""
    started = time.monotonic()
    bundle = build_bundle(source)
    facts = inspect(remote, host)
    _check_modules(remote, host, facts, install=install, dry_run=dry_run, echo=echo)
    plan = make_plan(bundle, facts.current_rows, facts.current_id, facts.hashes)
    where = host.label

    if plan.up_to_date:
        if facts.damaged:
            echo(f"warning: releases/{bundle.id} on {where} differs from its manifest (edited in place?): "
                 + ", ".join(facts.damaged[:10]))
        summary = f"{bundle.id} is already deployed to {where}: nothing uploaded (0 B sent); current -> releases/{bundle.id}"
        return Outcome("unchanged", bundle.id, facts.previous_id, plan, summary=summary)

    if dry_run:
        if (run := active_run(facts)) is not None:
            echo(f"note: a run is live in session {host.session!r} (pid {run.get('pid')}); a real deploy needs --force")
        for mark, paths in (("+", plan.added), ("~", plan.changed), ("-", plan.removed)):
            for p in paths:
                echo(f"{mark} {p}")
        current = f"releases/{facts.current_id}" if facts.current_id else "nothing deployed"
        summary = (f"dry run: {bundle.id} vs {current} on {where}: {plan.describe()}; would send "
                   f"{len(plan.send)} {'file' if len(plan.send) == 1 else 'files'} ({human_bytes(plan.send_bytes)}); nothing was sent or switched")
        return Outcome("dry-run", bundle.id, facts.current_id, plan, summary=summary)

    _refuse_live_run(facts, host, force=force, doing="deploy", echo=echo)
    meta = {"built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "source": str(bundle.root)}
    send = list(plan.send)
    sent = 0
    answer: dict[str, t.Any] = {}
    for attempt in (1, 2):
        stream = TarStream(bundle, send, bundle.manifest_bytes(**meta))
        if send:
            echo(f"uploading {len(send)} {'file' if len(send) == 1 else 'files'} ({human_bytes(plan.send_bytes)}) to {where}")
        bar = Progress(stream.expected_size, progress)
        stream.on_chunk = bar
        timeout = 300.0 + stream.expected_size / 200e3  # generous: a slow link still finishes
        result = remote.run(_program(host, "install", bundle.full_id, host.keep_releases), stdin=stream, timeout=timeout)
        bar.done()
        sent += stream.sent
        if stream.error:
            raise DeployError(f"{stream.error}; nothing was switched on {where}")
        if result.exit_code == NEED_CONTENT:
            # A kept copy turned out damaged (edited in place): send those contents too, once.
            need = set(_answer(host, result).get("need", []))
            again = [f for f in {f.sha256: f for f in bundle.files if f.sha256 in need}.values() if f not in send]
            if attempt == 2 or not again:
                raise DeployError(f"{where}: {len(need)} file contents are still missing after sending them; current is unchanged")
            echo(f"{len(again)} kept {'copy was' if len(again) == 1 else 'copies were'} damaged on {where} (edited in place?); "
                 f"sending {'it' if len(again) == 1 else 'them'} too")
            send += again
            continue
        if result.exit_code is None and not result.timed_out:
            # Killed, or the connection died: no answer. The far side switches only after the whole tar.
            if stream.sent < stream.expected_size:
                raise DeployError(f"{where}: the upload was cut after {human_bytes(stream.sent)} of "
                                  f"{human_bytes(stream.expected_size)} (connection lost or the far side was killed); "
                                  "nothing was switched; run deploy again")
            raise DeployError(f"{where}: no answer after the upload (connection lost or the far side was killed); "
                              "`dflashctl deploy --dry-run` shows what current is now")
        if not result.ok:
            raise _fail(host, result, "installing the release")
        answer = _answer(host, result)
        break
    seconds = time.monotonic() - started
    pruned = tuple(answer.get("pruned") or ())
    for rid in pruned:
        echo(f"pruned releases/{rid}")
    summary = (f"deployed {bundle.id} to {where}: {plan.describe()}, {human_bytes(sent)} sent in {seconds:.1f}s; "
               f"current -> releases/{bundle.id}")
    return Outcome("deployed", bundle.id, answer.get("from"), plan, bytes_sent=sent, files_sent=len(plan.send),
                   seconds=seconds, pruned=pruned, summary=summary)


def rollback(remote: Remote, host: Host, *, force: bool = False, dry_run: bool = False,
             echo: t.Callable[[str], None] = print) -> Outcome:
    """Switch ``current`` back to ``previous`` (atomic); ``previous`` then names what was current."""
    facts = inspect(remote, host)
    if facts.current_id is None:
        raise NotDeployed(f"{host.label}: nothing is deployed in {host.workdir}; run `dflashctl deploy` first")
    prev = facts.previous_id
    if prev is None or prev == facts.current_id or prev not in facts.raw.get("releases", []):
        raise DeployError(f"{host.label}: no previous release to roll back to (current is releases/{facts.current_id})")
    if dry_run:
        return Outcome("dry-run", prev, facts.current_id,
                       summary=f"dry run: would roll back {host.label}: current releases/{facts.current_id} -> releases/{prev}")
    _refuse_live_run(facts, host, force=force, doing="roll back", echo=echo)
    result = remote.run(_program(host, "rollback", host.keep_releases), timeout=INSPECT_TIMEOUT)
    if not result.ok:
        raise _fail(host, result, "rolling back")
    answer = _answer(host, result)
    summary = f"rolled back {host.label}: current releases/{answer['from']} -> releases/{answer['to']}"
    return Outcome("rolled-back", answer["to"], answer["from"], summary=summary)


def _refuse_live_run(facts: Facts, host: Host, *, force: bool, doing: str, echo: t.Callable[[str], None]) -> None:
    run = active_run(facts)
    if run is None:
        return
    what = f"a run is live in session {host.session!r} on {host.label} (pid {run.get('pid')}, attempt {run.get('attempt')})"
    why = ("a running Python process keeps the modules it already imported, so it would go on with the old code "
           "and pick up new files only for modules it imports later")
    if not force:
        raise RunActive(f"{what}: refusing to {doing}: {why}. Stop it first (dflashctl stop), or pass --force")
    echo(f"warning: {what}; going on because of --force: {why}")


def _check_modules(remote: Remote, host: Host, facts: Facts, *, install: bool, dry_run: bool,
                   echo: t.Callable[[str], None]) -> None:
    missing = facts.missing
    if not missing:
        return
    names = ", ".join(missing)
    python = facts.raw.get("executable") or host.python
    if not install:
        message = (f"{host.label}: {python} cannot import {names} (needed by training); "
                   f"run `dflashctl deploy --install` to pip-install {'it' if len(missing) == 1 else 'them'}, "
                   f"or install by hand")
        if dry_run:
            echo(f"warning: {message}")
            return
        raise MissingDependencies(message, missing)
    specs = [REQUIRED_MODULES[m] for m in missing]
    if dry_run:
        echo(f"would pip-install into {python}: {' '.join(specs)}")
        return
    echo(f"installing into {python} on {host.label}: {' '.join(specs)}")
    result = remote.run([host.python, "-m", "pip", "install", "--disable-pip-version-check", *specs], timeout=3600.0)
    if not result.ok:
        tail = (result.err.strip().splitlines() or [f"exit {result.exit_code}"])[-1]
        raise MissingDependencies(f"{host.label}: pip install {' '.join(specs)} failed: {tail}", missing)
