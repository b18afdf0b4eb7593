"""The release program: everything `dflashctl deploy` does on the far side. stdlib only.

    <python> [-I -S] -c <program> <inspect|install|rollback> <request JSON>

It cannot live in a release (the first deploy has none), so it travels by value on every call:
``ops.far.program("ops.far.release", ...)`` reads this file and the helpers it imports as text and
sends them with ``-c`` (ops/deploy.py). Python >= 3.7 at run time: it must run far enough on
an old interpreter to report it. The request is one JSON object (an argv item, since ``install``'s
stdin is the tar); the answer is one JSON object on stdout, the envelope every far-side verb uses
(``ops.far.protocol``): ``{"ok": true, "protocol", "verb", ...}`` or ``{"ok": false, ..., "error", "message"}``.

Layout (docs/design.md section 4)::

    <workdir>/releases/<id>/            one per deploy; <id> = first 16 hex of the manifest's sha256
    <workdir>/releases/<id>/.release.json   the manifest (full id, per-file sha256/size/mode)
    <workdir>/current  -> releases/<id>     switched atomically (new symlink, then rename over)
    <workdir>/previous -> releases/<id>     what --rollback goes back to
    <workdir>/.deploy.lock                  one deploy at a time

``install`` does in ONE call what used to take two: it reads the host's state first (``inspect``), and
when the request's ``expect`` (what the operator's cache says is there) does not match, or anything
would make the operator stop (an old python, missing modules, a live run), it answers ``recheck``
with those facts before reading any of the upload; the operator then decides as it did after
``inspect`` and sends again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import tarfile
import typing as t

from ops.far import atomic, lock, procfs, records, refusal

MANIFEST = ".release.json"
MANIFEST_FORMAT = 1
IDLEN = 16
CHUNK = 1 << 20
PROTOCOL = 1
VERBS = ("inspect", "install", "rollback")

Row = t.List[t.Any]  # noqa: UP006 -- [path, sha256, size, mode]; a run-time alias: list[...] needs 3.9


class Refused(Exception):
    def __init__(self, message: str, kind: str = refusal.REFUSED, **extra: t.Any) -> None:
        super().__init__(message)
        self.kind = kind
        self.extra = extra


class Interrupted(BaseException):
    pass


def on_signal(signum: int, frame: object) -> None:
    raise Interrupted(f"interrupted by signal {signum}")


# --------------------------------------------------------------------------------------------
# The release id rule (ops/bundle.py imports it: one rule on both sides)


def canonical(rows: t.Sequence[t.Sequence[t.Any]]) -> bytes:
    """The bytes the release id hashes: the rows sorted by path, in canonical JSON."""
    rows = sorted((list(r) for r in rows), key=lambda r: r[0])
    return json.dumps({"files": rows, "format": MANIFEST_FORMAT}, sort_keys=True, separators=(",", ":")).encode()


def release_id(rows: t.Sequence[t.Sequence[t.Any]]) -> str:
    return hashlib.sha256(canonical(rows)).hexdigest()


def state_digest(current: str | None, hashes: t.Iterable[str]) -> str:
    """What the operator's cache remembers of a host: its current release and the contents its releases hold."""
    return hashlib.sha256(json.dumps([current, sorted(set(hashes))]).encode()).hexdigest()


# --------------------------------------------------------------------------------------------
# Reading what is there


def check_rows(rows: t.Any) -> list[Row]:
    if not isinstance(rows, list):
        raise Refused("manifest: files is not a list")
    seen = set()
    for row in rows:
        if not (isinstance(row, list) and len(row) == 4):
            raise Refused(f"manifest: bad entry {row!r:.200}")
        path, sha, size, mode = row
        parts = path.split("/") if isinstance(path, str) else [""]
        if (
            path.startswith("/")
            or any(p in ("", ".", "..") for p in parts)
            or "\0" in path
            or path == MANIFEST
            or path in seen
        ):
            raise Refused(f"manifest: refused path {path!r:.200} (must be relative, inside, unique)")
        if not (
            isinstance(sha, str)
            and len(sha) == 64
            and isinstance(size, int)
            and not isinstance(size, bool)
            and size >= 0
            and mode in (0o644, 0o755)
        ):
            raise Refused(f"manifest: bad entry for {path!r:.200}")
        seen.add(path)
    return rows


def read_manifest(rel: str) -> dict[str, t.Any] | None:
    try:
        with open(os.path.join(rel, MANIFEST), "rb") as f:
            doc = records.parse_record(f.read())  # NaN, huge numbers, deep nesting: not a manifest
        return doc if isinstance(doc.get("files"), list) else None
    except (OSError, ValueError):
        return None


def link_id(workdir: str, name: str) -> str | None:
    try:
        target = os.readlink(os.path.join(workdir, name))
    except OSError:
        return None
    head, _, rid = target.rstrip("/").rpartition("/")
    return rid if head == "releases" and rid else None


def releases(workdir: str) -> list[tuple[str, str, dict[str, t.Any]]]:
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


def sha_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                return h.hexdigest()
            h.update(b)


def damaged(rel: str, rows: t.Iterable[Row]) -> list[str]:
    bad = []
    for path, sha, size, _mode in rows:
        full = os.path.join(rel, path)
        try:
            ok = not os.path.islink(full) and os.path.getsize(full) == size and sha_of(full) == sha
        except OSError:
            ok = False
        if not ok:
            bad.append(path)
    return bad


def run_state(run_dir: str, session: str) -> dict[str, t.Any]:
    """The session's current attempt by its records: none, unknown, ended, alive or gone."""
    cur = os.path.join(run_dir, session, records.CURRENT)
    run, problems = records.read_record(os.path.join(cur, records.RUN_JSON))
    if run is None and problems:
        return {"state": "unknown", "detail": problems[0]}
    if run is None:
        return {"state": "none"}
    info: dict[str, t.Any] = {
        "attempt": run.get("attempt"),
        "pid": run.get("pid"),
        "started_at": run.get("started_at"),
        "dir": os.path.realpath(cur),
    }
    if os.path.exists(os.path.join(cur, records.EXIT_JSON)):
        info["state"] = "ended"
    elif any(procfs.alive(run.get(k), run.get(ks), info["started_at"]) for k, ks in records.PROCESSES):
        # the command outlives a killed runner (its keeper records the end): any of the three alive is a live run
        info["state"] = "alive"
    else:
        info["state"] = "gone"
    return info


def inspect(workdir: str, run_dir: str, session: str, modules: t.Sequence[str]) -> dict[str, t.Any]:
    import importlib.util  # here: only inspect asks (the program runs one verb, on any python >= 3.7)

    missing = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except Exception:
            missing.append(name)
    out: dict[str, t.Any] = {
        "python": list(sys.version_info[:3]),
        "executable": sys.executable,
        "missing": missing,
        "tar_filter": hasattr(tarfile, "data_filter"),
        "current": None,
        "previous": link_id(workdir, "previous"),
        "releases": [],
        "hashes": [],
        "problem": None,
        "damaged": [],
        "run": run_state(run_dir, session),
    }
    cur_path = os.path.join(workdir, "current")
    if os.path.lexists(cur_path) and not os.path.islink(cur_path):
        out["problem"] = f"{cur_path} is not a symlink; move it away so deploy can manage it"
    cur = link_id(workdir, "current")
    hashes: set[str] = set()
    for rid, path, doc in releases(workdir):
        out["releases"].append(rid)
        hashes.update(row[1] for row in doc["files"])
        if rid == cur:
            out["current"] = {"id": doc.get("id"), "files": doc["files"]}
            out["damaged"] = damaged(path, doc["files"])
    out["hashes"] = sorted(hashes)
    out["state"] = state_digest((out["current"] or {}).get("id"), hashes)
    return out


def recheck_reason(facts: dict[str, t.Any], req: dict[str, t.Any]) -> str | None:
    """Why the operator must look at the facts before this upload may go on, or None."""
    if facts["state"] != req["expect"]:
        return "the host is not as the operator's cache says"
    if tuple(facts["python"]) < tuple(req.get("min_python") or ()):
        return "python is too old"
    if facts["problem"] or facts["missing"]:
        return facts["problem"] or "missing modules"
    if facts["run"].get("state") == "alive":
        return "a run is live"
    return None


# --------------------------------------------------------------------------------------------
# Changing what is there


def deploy_lock(workdir: str) -> lock.Lock:
    return lock.Lock(os.path.join(workdir, ".deploy.lock"), mode=0o644)


def sweep(workdir: str) -> None:
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


def sync_fs(path: str) -> None:
    """Flush the release's filesystem once (syncfs), not every file: one call instead of hundreds."""
    fd = os.open(path, os.O_RDONLY)
    try:
        import ctypes  # here, in the try: a minimal python may lack _ctypes (then os.sync())

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs")
    except (OSError, AttributeError, ImportError):
        os.sync()
    finally:
        os.close(fd)


def switch(workdir: str, rid: str) -> str | None:
    """current -> releases/rid (atomic); previous -> what current was. Returns the old id."""
    old = link_id(workdir, "current")
    atomic.switch_link(workdir, "current", "releases/" + rid)
    if old and old != rid:
        atomic.switch_link(workdir, "previous", "releases/" + old)
    os.utime(os.path.join(workdir, "releases", rid))  # mtime = last use, for pruning
    atomic.fsync_dir(workdir)
    return old


def prune(workdir: str, keep: int) -> list[str]:
    protect = set([link_id(workdir, "current"), link_id(workdir, "previous")])
    kept, pruned = 0, []
    for rid, path, _doc in releases(workdir):  # most recently used first
        if rid in protect or kept < keep:
            kept += 1
            continue
        shutil.rmtree(path, ignore_errors=True)
        pruned.append(rid)
    return pruned


def after(workdir: str) -> dict[str, t.Any]:
    """The host once a deploy is done (current full id, contents kept): what the operator's cache keeps."""
    hashes: set[str] = set()
    cur = link_id(workdir, "current")
    full = None
    for rid, _, doc in releases(workdir):
        hashes.update(row[1] for row in doc["files"])
        if rid == cur:
            full = doc.get("id")
    return {"current": full, "hashes": sorted(hashes)}


def check_member(m: tarfile.TarInfo, dest: str) -> None:
    name = m.name
    if name.startswith("/"):
        raise Refused(f"refused tar member {name!r}: absolute path")
    if ".." in name.split("/"):
        raise Refused(f"refused tar member {name!r}: it would be extracted outside {dest}")
    if m.isreg() and name and "" not in name.split("/") and "\0" not in name:
        return  # a plain relative file name: nothing the data filter could add, and it costs a realpath
    if hasattr(tarfile, "data_filter"):  # links, devices, odd names: its reasons are the clearest
        try:
            tarfile.data_filter(m, dest)
        except tarfile.FilterError as e:
            raise Refused(f"refused tar member: {e}") from None
    if m.issym() or m.islnk():
        raise Refused(f"refused tar member {name!r}: links are not accepted (-> {m.linkname!r})")
    if not m.isreg():
        raise Refused(f"refused tar member {name!r}: not a regular file")


def write_file(src: t.IO[bytes], dst: str, size: int, sha: str, mode: int, mtime: float) -> bool:
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


def members(tar: tarfile.TarFile) -> t.Iterator[tarfile.TarInfo]:
    # tar.next() in stream mode; iterating the TarFile would start again from the manifest.
    while True:
        m = tar.next()
        if m is None:
            return
        yield m


def install(workdir: str, want: str, keep: int, stdin: t.IO[bytes]) -> dict[str, t.Any]:
    root = os.path.join(workdir, "releases")
    if not os.path.isdir(root):
        os.makedirs(root)
    try:
        held = deploy_lock(workdir).__enter__()
    except lock.Busy:
        raise Refused(f"another deploy into {workdir} is in progress") from None
    try:
        sweep(workdir)
        tar = tarfile.open(fileobj=stdin, mode="r|", bufsize=1 << 16)  # larger: slower (buffer slicing)
        first = tar.next()
        if first is None or first.name != MANIFEST or not first.isreg() or first.size > 64 << 20:
            raise Refused("the upload does not start with the manifest")
        body = tar.extractfile(first)
        assert body is not None
        doc = records.parse_record(body.read())
        rows = check_rows(doc.get("files") or [])
        full = release_id(rows)
        if full != want or doc.get("id") != want:
            raise Refused(f"the manifest does not hash to release {want[:IDLEN]}")
        rid = full[:IDLEN]
        final = os.path.join(root, rid)
        if link_id(workdir, "current") == rid and read_manifest(final) is not None:
            return {"id": rid, "from": rid, "switched": False, "received": 0, "pruned": []}
        partial = final + ".partial"
        if os.path.isdir(final):
            if read_manifest(final) is not None and not damaged(final, rows):
                for m in members(tar):  # nothing is expected after the manifest
                    raise Refused(f"unexpected tar member {m.name!r}: release {rid} is already here")
                old = switch(workdir, rid)
                return {"id": rid, "from": old, "switched": True, "received": 0, "pruned": prune(workdir, keep)}
        os.mkdir(partial)  # a damaged kept copy of this release is rebuilt beside it, then replaced
        try:
            need, received = fill(workdir, partial, rows, tar)
            if need:
                raise Refused(f"{len(need)} file contents are missing", refusal.NEED_CONTENT, need=need)
            with open(os.path.join(partial, MANIFEST), "wb") as f:
                f.write(json.dumps(doc, separators=(",", ":")).encode())
            sync_fs(partial)  # the files are on disk before any name points at them
            if os.path.isdir(final):
                os.rename(final, final + ".old.partial")
            os.rename(partial, final)
            shutil.rmtree(final + ".old.partial", ignore_errors=True)
            atomic.fsync_dir(root)
        finally:
            if os.path.isdir(partial):
                shutil.rmtree(partial, ignore_errors=True)
        old = switch(workdir, rid)
        return {"id": rid, "from": old, "switched": True, "received": received, "pruned": prune(workdir, keep)}
    finally:
        held.__exit__()


def fill(workdir: str, partial: str, rows: list[Row], tar: tarfile.TarFile) -> tuple[list[str], int]:
    """The release's files into ``partial``: the tar's members, then copies from kept releases;
    every file verified against its sha256. Returns the contents still missing (sorted hashes) and
    how many arrived in the tar."""
    by_path = dict((r[0], r) for r in rows)
    have = {}  # sha -> file in the partial
    for m in members(tar):
        check_member(m, partial)
        row = by_path.get(m.name)
        if row is None or os.path.lexists(os.path.join(partial, m.name)):
            raise Refused(f"refused tar member {m.name!r}: not in the manifest, or sent twice")
        path, sha, size, mode = row
        src = tar.extractfile(m)
        if m.size != size or src is None or not write_file(src, os.path.join(partial, path), size, sha, mode, m.mtime):
            raise Refused(f"{path}: received content does not match the manifest")
        have[sha] = os.path.join(partial, path)
    sources: dict[str, list[str]] = {}
    cur = link_id(workdir, "current")
    for _prid, ppath, pdoc in sorted(releases(workdir), key=lambda r: r[0] != cur):
        for p, sha, _, _ in pdoc["files"]:
            sources.setdefault(sha, []).append(os.path.join(ppath, p))
    need = []
    for path, sha, size, mode in rows:
        dst = os.path.join(partial, path)
        if os.path.lexists(dst):
            continue
        done = False
        for src_path in ([have[sha]] if sha in have else []) + sources.get(sha, []):
            try:
                with open(src_path, "rb") as f:
                    done = write_file(f, dst, size, sha, mode, int(os.fstat(f.fileno()).st_mtime))
            except OSError:
                done = False
            if done:
                have[sha] = dst
                break
        if not done:
            need.append(sha)
    if need:
        return sorted(set(need)), len(have)
    extra = []
    for dirpath, _dirs, names in os.walk(partial):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), partial)
            if rel not in by_path:
                extra.append(rel)
    missing = [p for p in by_path if not os.path.isfile(os.path.join(partial, p))]
    if extra or missing:
        raise Refused(f"verification failed: extra {extra[:5]!r}, missing {missing[:5]!r}")
    return [], len(have)


def rollback(workdir: str, keep: int) -> dict[str, t.Any]:
    try:
        held = deploy_lock(workdir).__enter__()
    except lock.Busy:
        raise Refused(f"another deploy into {workdir} is in progress") from None
    try:
        cur, prev = link_id(workdir, "current"), link_id(workdir, "previous")
        if prev is None or prev == cur:
            raise Refused(f"no previous release to roll back to in {workdir}")
        path = os.path.join(workdir, "releases", prev)
        doc = read_manifest(path)
        if doc is None:
            raise Refused(f"previous release {path} is gone or incomplete")
        bad = damaged(path, doc["files"])
        if bad:
            raise Refused(
                "previous release {} differs from its manifest ({}); not switching".format(path, ", ".join(bad[:5]))
            )
        switch(workdir, prev)
        return {"from": cur, "to": prev}
    finally:
        held.__exit__()


# --------------------------------------------------------------------------------------------
# The verbs, one JSON request -> one JSON answer


def handle(verb: str, req: dict[str, t.Any], stdin: t.IO[bytes]) -> dict[str, t.Any]:
    workdir = os.path.abspath(req["workdir"])
    if verb == "inspect":
        return inspect(workdir, req["run_dir"], req["session"], req.get("modules") or [])
    if verb == "rollback":
        return rollback(workdir, int(req["keep"]))
    if verb == "install":
        facts = None
        if "expect" in req:  # one round trip: look first, read the upload only when all is as expected
            facts = inspect(workdir, req["run_dir"], req["session"], req.get("modules") or [])
            why = recheck_reason(facts, req)
            if why is not None:
                raise Refused(why, refusal.RECHECK, facts=facts)
            if (facts["current"] or {}).get("id") == req["id"]:  # already current: no upload to read
                rid = req["id"][:IDLEN]
                return {
                    "id": rid,
                    "from": rid,
                    "switched": False,
                    "received": 0,
                    "pruned": [],
                    "facts": facts,
                    "after": after(workdir),
                }
        out = install(workdir, req["id"], int(req["keep"]), stdin)
        out["after"] = after(workdir)
        if facts is not None:
            out["facts"] = facts
        return out
    raise Refused(f"unknown verb {verb!r}", refusal.USAGE)


def main(argv: t.Sequence[str], stdin: t.IO[bytes] | None = None, stdout: t.IO[str] | None = None) -> int:
    """``<verb> <request JSON>``: prints one answer; exit 0 when it is ok, 1 when not."""
    out = sys.stdout if stdout is None else stdout
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, on_signal)
    verb = argv[0] if argv else ""
    answer: dict[str, t.Any] = {"ok": True, "protocol": PROTOCOL, "verb": verb}
    try:
        if len(argv) != 2 or verb not in VERBS:
            raise Refused("usage: <program> {{{}}} <request JSON>".format(",".join(VERBS)), refusal.USAGE)
        req = json.loads(argv[1])
        if not isinstance(req, dict) or not isinstance(req.get("workdir"), str):
            raise Refused("the request is not a JSON object with a workdir", refusal.BAD_REQUEST)
        answer.update(handle(verb, req, sys.stdin.buffer if stdin is None else stdin))
    except Refused as e:
        answer.update(ok=False, error=e.kind, message=str(e), **e.extra)
    except (KeyError, ValueError, TypeError) as e:
        answer.update(ok=False, error=refusal.BAD_REQUEST, message=f"bad request: {e}")
    except (tarfile.TarError, EOFError) as e:
        answer.update(
            ok=False, error=refusal.CUT, message=f"the upload was cut short or is not a tar ({e}); nothing was switched"
        )
    except Interrupted as e:
        answer.update(ok=False, error=refusal.INTERRUPTED, message=f"{e}; nothing was switched")
    except OSError as e:
        answer.update(ok=False, error=refusal.OS, message=str(e))
    out.write(json.dumps(answer) + "\n")
    out.flush()
    return 0 if answer["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
