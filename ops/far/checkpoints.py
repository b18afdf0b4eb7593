"""A session's checkpoints as the box holds them: for `dflashctl pull` (the agent's `checkpoint` and `fetch`) and
for `dflashctl status` (``probe``'s checkpoint facts).

stdlib only: it reads what ``dflash.checkpoint.checkpoints`` writes without importing it (torch is not the agent's).
A checkpoint is ``<run_dir>/<session>/checkpoints/step-<n>/`` with ``checkpoint.json`` written last (its
format, step, run id, the size and sha256 of every other file); it is complete when that manifest is
well formed and every file has its size, as ``dflash.checkpoint.manifest.manifest_problem`` says. Which one:

- ``latest``: the newest step of the newest run (run ids sort by start time; no run id = oldest), as
  ``dflash.checkpoint.checkpoints.resume_order`` orders them;
- ``best``: what the ``best`` symlink points to (set by held-out eval), when complete;
- ``step``: ``step-<n>``, when complete.

An export folder (``dflash export``'s OUT) has no manifest: its regular files are listed and hashed here.
Sums the manifest does not carry (checkpoint.json itself, an old manifest's files) are computed here too.

For status: the sizes in each manifest, the ``best`` link, free space where
they go, and the trainer's own ``<attempt dir>/checkpointing.json`` (its checkpoint dir, ``keep``, low-disk
threshold, the last skipped checkpoint and the last sync: ``dflash.checkpoint.checkpoints.write_facts``); never
raises: a folder that cannot be read is an ``error`` in the facts, not a failed probe. Stdlib only, Python 3.8 syntax.
"""

from __future__ import annotations

import json
import os
import re
import stat
import typing as t

from ops.far import records
from ops.far.runner import disk_free

MANIFEST = "checkpoint.json"
FORMAT = "dflash-checkpoint/1"
BEST = "best"
STEP_DIR = re.compile(r"step-(\d+)")
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")  # a file of a checkpoint or an export: no path, no dot-file
SHA256 = re.compile(r"[0-9a-f]{64}")
MANIFEST_MAX = 1 << 20  # a checkpoint.json is a few hundred bytes: a bigger one is not ours
FETCH_CAP = 16 << 20  # `fetch`: at most this many bytes per call (base64 in the answer: 4/3 of it)
HASH_CHUNK = 1 << 20
REQUIRED = {"config.json", "model.safetensors", "trainer_state.pt"}  # what every dflash checkpoint holds
OPTIONAL = {"dflash.py"}  # the remote code: newer checkpoints only
FACTS_FILE = "checkpointing.json"  # dflash.checkpoint.checkpoints.FACTS_FILE
MAX_LISTED = 10000  # entries of the checkpoints folder looked at
MAX_CHECKPOINTS = 200  # the newest steps reported
MANIFEST_LIMIT = 64 << 10  # what the probe reads of one manifest: every status pays it


class Missing(Exception):
    """No such checkpoint (or export): the message names what there is."""


class FileFacts(t.TypedDict):
    name: str
    size: int
    sha256: str


def sha256_of(path: str) -> str:
    import hashlib  # here: the agent's every status probe imports this module, only pull hashes

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(HASH_CHUNK)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


def manifest(path: str) -> dict[str, t.Any] | None:
    """checkpoint.json of a complete checkpoint dir, or None (missing, half-written, not ours, a size off)."""
    m = STEP_DIR.fullmatch(os.path.basename(path))
    if m is None:
        return None
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            raw = f.read(MANIFEST_MAX + 1)
        rec = json.loads(raw) if len(raw) <= MANIFEST_MAX else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT or rec.get("step") != int(m.group(1)):
        return None
    files, sums = rec.get("files"), rec.get("sha256")
    if not isinstance(files, dict) or not REQUIRED <= set(files) <= REQUIRED | OPTIONAL:
        return None  # dflash.checkpoint's file list: another is no checkpoint of ours
    if sums is not None and not isinstance(sums, dict):
        return None
    for name, size in files.items():
        if not NAME.fullmatch(name) or name == MANIFEST or not isinstance(size, int) or isinstance(size, bool):
            return None
        try:
            if os.stat(os.path.join(path, name)).st_size != size:
                return None
        except OSError:
            return None
    for name, digest in (sums or {}).items():
        if name not in files or not isinstance(digest, str) or not SHA256.fullmatch(digest):
            return None
    return rec


class Found(t.NamedTuple):
    step: int
    run_id: str | None
    path: str


def complete(root: str) -> list[Found]:
    """The complete checkpoints under ``root``, in ``resume_order``: newest run first, newest step first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(root, name)
        rec = manifest(path) if STEP_DIR.fullmatch(name) and os.path.isdir(path) else None
        if rec is not None:
            run = rec.get("run_id")
            found.append(Found(rec["step"], run if isinstance(run, str) else None, path))
    return sorted(found, key=lambda f: (f.run_id is not None, f.run_id or "", f.step), reverse=True)


def best(root: str) -> Found | None:
    """The complete checkpoint ``<root>/best`` points to (a relative ``step-<n>``), or None."""
    try:
        name = os.readlink(os.path.join(root, BEST))
    except OSError:
        return None
    if not STEP_DIR.fullmatch(name):
        return None
    return next((f for f in complete(root) if os.path.basename(f.path) == name), None)


def _what_there_is(root: str, found: list[Found]) -> str:
    if not found:
        return f"no checkpoint under {root} (the run has written none yet)"
    steps = ", ".join(f"step-{n}" for n in sorted({f.step for f in found}))
    b = best(root)
    return f"there are {steps} under {root}" + (f" (best: step-{b.step})" if b else " (no best)")


def choose(root: str, pick: t.Any) -> Found:
    """``pick``: "latest", "best" or {"step": N}. Missing (one line naming what there is) when there is none."""
    found = complete(root)
    if not found:
        raise Missing(_what_there_is(root, found))
    if pick == "latest":
        return found[0]
    if pick == "best":
        b = best(root)
        if b is None:
            raise Missing(f"no best checkpoint (held-out eval, [eval] every, sets one); {_what_there_is(root, found)}")
        return b
    if isinstance(pick, dict) and isinstance(pick.get("step"), int) and not isinstance(pick["step"], bool):
        hits = [f for f in found if f.step == pick["step"]]
        if not hits:
            raise Missing(f"no checkpoint step-{pick['step']}; {_what_there_is(root, found)}")
        return hits[0]
    raise ValueError('pick: expected "latest", "best" or {"step": N}')


def checkpoint_files(path: str) -> list[FileFacts]:
    """A complete checkpoint's files with their manifest's sizes and sums (computed where it has none),
    checkpoint.json last: a copy that has it is complete."""
    rec = manifest(path)
    if rec is None:
        raise Missing(f"{path} is no longer a complete checkpoint (pruned or being replaced?)")
    sums = rec.get("sha256") or {}
    out: list[FileFacts] = [
        {"name": name, "size": size, "sha256": sums.get(name) or sha256_of(os.path.join(path, name))}
        for name, size in sorted(rec["files"].items())
    ]
    mpath = os.path.join(path, MANIFEST)
    out.append({"name": MANIFEST, "size": os.stat(mpath).st_size, "sha256": sha256_of(mpath)})
    return out


def export_files(path: str) -> list[FileFacts]:
    """An export folder's regular files, hashed here (an export has no manifest); refused when it holds
    anything else (a folder, a link): it is then no export of ours."""
    try:
        names = sorted(os.listdir(path))
    except FileNotFoundError:
        raise Missing(f"no export folder {path} on the box (made by `dflash export CKPT {path}`)") from None
    except OSError as e:
        raise Missing(f"cannot list {path}: {e.strerror or e}") from None
    out: list[FileFacts] = []
    for name in names:
        st = os.lstat(os.path.join(path, name))
        if not NAME.fullmatch(name) or not stat.S_ISREG(st.st_mode):
            raise Missing(f"{path} holds {name!r}, which is not a file `dflash export` writes: not an export folder")
        out.append({"name": name, "size": st.st_size, "sha256": sha256_of(os.path.join(path, name))})
    if not any(f["name"] == "config.json" for f in out):
        raise Missing(f"{path} has no config.json: not an export folder (`dflash export CKPT {path}` makes one)")
    return out


def read_range(folder: str, name: str, offset: int, length: int) -> tuple[bytes, int]:
    """Up to ``length`` bytes (``FETCH_CAP`` at most) of ``folder/name`` from ``offset``, and the file's size
    now. A plain file only (no link followed, no path in ``name``); Missing when it is gone."""
    if not NAME.fullmatch(name):
        raise ValueError(f"name: {name!r} is not a file name of a checkpoint")
    try:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise Missing(f"{os.path.join(folder, name)} is gone from the box (pruned while pulling?)") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise Missing(f"{os.path.join(folder, name)} is not a plain file")
        f.seek(offset)
        return f.read(max(0, min(length, FETCH_CAP))), st.st_size


# ---- the probe's facts (verb `probe`: `dflashctl status`'s low-disk flag and the last sync)


def _int(value: t.Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def manifest_size(folder: str) -> tuple[int | None, str | None]:
    """(bytes of a complete checkpoint: its files and manifest, its run id) from its manifest; (None, None)
    when it has none yet (half-written) or one that does not say."""
    path = os.path.join(folder, MANIFEST)
    rec, _ = records.read_json(path, MANIFEST_LIMIT)
    files = rec.get("files") if rec is not None else None
    if not isinstance(files, dict):
        return None, None
    sizes = [_int(v) for v in files.values()]
    if not sizes or any(s is None for s in sizes):
        return None, None
    try:
        own = os.stat(path).st_size
    except OSError:
        return None, None
    run_id = rec.get("run_id") if rec is not None else None
    return sum(t.cast("list[int]", sizes)) + own, run_id if isinstance(run_id, str) else None


def checkpoint_facts(attempt_dir: str | None, default_dir: str) -> dict[str, t.Any]:
    """The checkpoints' facts (``ops.far.protocol.CheckpointFacts``). ``default_dir``: where dflash puts
    them without ``checkpoint.dir`` (next to the attempts) when the trainer wrote no facts file."""
    facts: dict[str, t.Any] = {
        "dir": default_dir,
        "record": None,
        "free": None,
        "checkpoints": [],
        "truncated": False,
        "best_step": None,
        "error": None,
    }
    if attempt_dir is not None:
        rec, problem = records.read_json(os.path.join(attempt_dir, FACTS_FILE))
        if problem is not None:
            facts["error"] = problem
        elif rec is not None:
            facts["record"] = rec
            if isinstance(rec.get("dir"), str) and os.path.isabs(rec["dir"]):
                facts["dir"] = rec["dir"]
    root = facts["dir"]
    probe_at = root
    while not os.path.isdir(probe_at) and os.path.dirname(probe_at) != probe_at:
        probe_at = os.path.dirname(probe_at)
    facts["free"] = disk_free(probe_at)
    try:
        with os.scandir(root) as it:
            names = []
            for n, entry in enumerate(it):
                if n >= MAX_LISTED:
                    facts["truncated"] = True
                    break
                m = STEP_DIR.fullmatch(entry.name)
                if m and entry.is_dir(follow_symlinks=False):
                    names.append((int(m.group(1)), entry.name))
    except FileNotFoundError:
        return facts
    except OSError as e:
        facts["error"] = f"{root}: {e.strerror or e}"
        return facts
    names.sort()
    if len(names) > MAX_CHECKPOINTS:
        names, facts["truncated"] = names[-MAX_CHECKPOINTS:], True
    found = []
    for step, name in names:
        size, run_id = manifest_size(os.path.join(root, name))
        if size is not None:
            found.append({"step": step, "bytes": size, "run_id": run_id})
    facts["checkpoints"] = found
    try:
        target = os.readlink(os.path.join(root, BEST))
        m = STEP_DIR.fullmatch(target)
        facts["best_step"] = int(m.group(1)) if m else None
    except OSError:
        pass
    return facts


# ---- the agent's verbs (ops/far/agent.py turns Missing into `no-checkpoint`, ValueError into `bad-request`)


def root_of(sdir: str) -> str:
    """Where the training core puts a supervised run's checkpoints: ``<run_dir>/<session>/checkpoints``."""
    return os.path.join(sdir, "checkpoints")


def marks(root: str) -> list[dict[str, t.Any]]:
    """Verb ``read`` (`dflashctl plot`'s checkpoint marks): every ``step-<n>`` with a checkpoint.json, by step."""
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    out = []
    for name in names:
        m = STEP_DIR.fullmatch(name)
        manifest = os.path.join(root, name, MANIFEST)
        if m and os.path.exists(manifest):
            out.append({"step": int(m.group(1)), "time": os.path.getmtime(manifest)})
    return sorted(out, key=lambda c: c["step"])


def export_dir(sdir: str, req: t.Mapping[str, t.Any]) -> str | None:
    """The request's export folder: absolute, or relative to ``<run_dir>/<session>``; None: a checkpoint."""
    export = req.get("export")
    if export is None:
        return None
    if not isinstance(export, str) or not export or "\0" in export:
        raise ValueError("export: expected a path on the box")
    return os.path.normpath(os.path.join(sdir, export))


def listing(sdir: str, req: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """Verb ``checkpoint``: the one ``pick`` names ("latest", "best", {"step": N}) or the ``export`` folder,
    and its files with sizes and sha256: what the caller fetches."""
    folder = export_dir(sdir, req)
    if folder is not None:
        return {
            "kind": "export",
            "dir": folder,
            "step": None,
            "run_id": None,
            "best": None,
            "files": export_files(folder),
        }
    root = root_of(sdir)
    found = choose(root, req.get("pick", "latest"))
    files = checkpoint_files(found.path)
    b = best(root)
    return {
        "kind": "checkpoint",
        "dir": found.path,
        "step": found.step,
        "run_id": found.run_id,
        "best": b.step if b is not None else None,
        "files": files,
    }


def chunk(sdir: str, req: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """Verb ``fetch``: up to ``length`` bytes of ``dir/name`` from ``offset`` (base64) and the file's size now.
    ``dir`` is a ``step-<n>`` of the session's checkpoints, or the request's ``export`` folder."""
    folder, name, offset, length = req.get("dir"), req.get("name"), req.get("offset", 0), req.get("length", 0)
    if not isinstance(folder, str) or not isinstance(name, str):
        raise ValueError("dir and name: expected strings")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (offset, length)):
        raise ValueError("offset and length: expected whole numbers >= 0")
    folder = os.path.normpath(folder)
    export = export_dir(sdir, req)
    if export is not None:
        allowed = folder == export
    else:
        parent = os.path.realpath(os.path.dirname(folder))
        allowed = STEP_DIR.fullmatch(os.path.basename(folder)) is not None and parent == os.path.realpath(root_of(sdir))
    if not allowed:
        raise ValueError(f"dir: {folder} is not a checkpoint of this session (nor the export asked for)")
    data, size = read_range(folder, name, int(offset), int(length))
    import base64  # here, as hashlib above

    return {"name": name, "offset": offset, "size": size, "data": base64.b64encode(data).decode("ascii")}
