"""`dflashctl pull`: a checkpoint (or an export folder) from the box into a folder on this machine.

Over the host's ``Remote`` (ssh + ``pct exec``, or this machine for a local host), as two agent verbs:
``checkpoint`` names the checkpoint and lists its files with sizes and sha256 (the manifest's; the agent
hashes what the manifest does not carry), ``fetch`` brings up to ``CHUNK`` bytes of one file from an
offset. Each file is written to ``DEST/NAME.part`` and renamed to ``NAME`` once its sha256 is the listed
one, checkpoint.json last (a DEST that has it holds the whole checkpoint). So a pull that is cut
continues: a ``.part`` goes on from its size, a file already there and matching is not fetched again.
A file whose sum is wrong after its transfer is fetched once more from the start; wrong again, the pull
stops with one line naming it. DEST may hold only what a pull of this checkpoint writes.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import hashlib
import os
import shutil
import stat
import typing as t
from pathlib import Path

from ops import errors
from ops.far import checkpoints

if t.TYPE_CHECKING:
    from ops.remote import Remote

CHUNK = 8 << 20  # bytes per `fetch` call (the agent gives 16 MiB at most)
LIST_TIMEOUT = 600.0  # `checkpoint` hashes what the manifest does not carry (an export: every file)
FETCH_TIMEOUT = 120.0
PART = ".part"
HASH_CHUNK = 1 << 20

Pick = str | dict[str, int]  # "latest", "best" or {"step": N}


class PullError(errors.OpsError):
    """A pull that cannot go on (DEST in the way, a file that stays wrong): one line."""


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Source:
    """What the agent's ``checkpoint`` verb named: where it is on the box and its files."""

    kind: str  # "checkpoint" or "export"
    dir: str
    step: int | None
    run_id: str | None
    best: int | None
    files: tuple[RemoteFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def label(self) -> str:
        return f"step-{self.step}" if self.kind == "checkpoint" else f"export {self.dir}"

    @classmethod
    def parse(cls, answer: t.Mapping[str, t.Any]) -> Source:
        """The agent's answer, checked once: a name that is a path, a size or sum of the wrong kind is no answer."""
        try:
            files = tuple(
                RemoteFile(str(f["name"]), int(f["size"]), str(f["sha256"])) for f in answer.get("files") or ()
            )
            step, best = answer.get("step"), answer.get("best")
            source = cls(
                kind=str(answer["kind"]),
                dir=str(answer["dir"]),
                step=int(step) if step is not None else None,
                run_id=answer.get("run_id") if isinstance(answer.get("run_id"), str) else None,
                best=int(best) if best is not None else None,
                files=files,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise errors.AgentError(f"agent checkpoint: answer is not one this dflashctl reads ({e})") from None
        for f in files:
            if not checkpoints.NAME.fullmatch(f.name) or f.size < 0 or not checkpoints.SHA256.fullmatch(f.sha256):
                raise errors.AgentError(f"agent checkpoint: answer names a file this dflashctl refuses: {f.name!r}")
        return source


@dataclasses.dataclass(frozen=True)
class Pulled:
    """What one pull did: per file "fetched", "resumed" (a .part continued), "refetched" (wrong once),
    or "kept" (already there, its sum right)."""

    source: Source
    dest: Path
    actions: dict[str, str]
    fetched_bytes: int
    calls: int

    def lines(self, host: str) -> list[str]:
        s = self.source
        said = (["the best"] if s.best is not None and s.best == s.step else []) + (
            [f"run {s.run_id}"] if s.run_id else []
        )
        what = s.label + (f" ({'; '.join(said)})" if said else "")
        counts: dict[str, int] = {}
        for a in self.actions.values():
            counts[a] = counts.get(a, 0) + 1
        done = ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
        return [
            f"pulled {what} from {host}:{s.dir} to {self.dest}",
            f"  {len(s.files)} files, {_mib(s.size)} ({done}); {_mib(self.fetched_bytes)} fetched in {self.calls} "
            f"call(s); every file's sha256 checked",
        ]

    def to_json(self, host: str, session: str) -> dict[str, t.Any]:
        s = self.source
        return {
            "host": host,
            "session": session,
            "kind": s.kind,
            "step": s.step,
            "run_id": s.run_id,
            "best": s.best,
            "source": s.dir,
            "dest": str(self.dest),
            "files": [
                {"name": f.name, "size": f.size, "sha256": f.sha256, "action": self.actions[f.name]} for f in s.files
            ],
            "bytes": s.size,
            "fetched_bytes": self.fetched_bytes,
            "calls": self.calls,
        }


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class ProgressLine:
    """One stderr line, rewritten in place (a terminal only): what is pulled, MiB done of MiB, percent."""

    def __init__(self, stream: t.TextIO) -> None:
        self.stream, self.total, self.done, self.label, self.shown = stream, 0, 0, "", ""

    def start(self, src: Source) -> None:
        self.total, self.label = src.size, src.label
        self.update(0)

    def update(self, n: int) -> None:
        self.done = max(0, min(self.total, self.done + n))
        pct = 100 * self.done // self.total if self.total else 100
        line = f"pull {self.label}: {_mib(self.done)} of {_mib(self.total)} ({pct}%)"
        if line != self.shown:
            self.stream.write("\r" + line)
            self.stream.flush()
            self.shown = line

    def end(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def request(remote: Remote, session: str | None) -> dict[str, t.Any]:
    from ops import session as run

    return run.request(remote.host, session)


def source(remote: Remote, session: str | None, *, pick: Pick = "latest", export: str | None = None) -> Source:
    """One ``checkpoint`` call: the checkpoint ``pick`` names (or the export folder) and its files."""
    req = request(remote, session)
    if export is not None:
        req["export"] = export
    else:
        req["pick"] = pick
    return Source.parse(_ask(remote, "checkpoint", req, LIST_TIMEOUT))


def _ask(remote: Remote, verb: str, req: t.Mapping[str, t.Any], timeout: float) -> dict[str, t.Any]:
    """``session.ask`` for the pull verbs. A refusal (plain OpsError) is one line naming what there is,
    without the verb's name; the host down, the container stopped, an old agent keep their own error and
    exit code."""
    from ops import session as run

    try:
        return run.ask(remote, verb, req, timeout=timeout, lacking="cannot pull checkpoints")
    except errors.OpsError as e:
        if type(e) is not errors.OpsError:
            raise
        raise PullError(str(e).replace(f": {verb}: ", ": ", 1)) from None


def check_dest(dest: Path, src: Source) -> set[str]:
    """DEST holds nothing but this source's files and their .part files, each a plain file (lstat: a link
    planted there is never followed), each file already there this source's own (its sha256), and room for
    what is left to fetch; created when missing. Returns the names already there and right."""
    if dest.is_symlink() and not dest.exists():
        raise PullError(f"{dest}: a link to nothing: pull into a folder")
    if dest.exists() and not dest.is_dir():
        raise PullError(f"{dest}: exists and is not a folder")
    if not dest.exists():
        _room(dest, src, src.size)
        try:
            dest.mkdir(parents=True)
        except OSError as e:
            raise PullError(f"cannot create {dest}: {e.strerror or e}") from None
        return set()
    ours = {f.name for f in src.files} | {f.name + PART for f in src.files}
    try:
        names = sorted(os.listdir(dest))
        kinds = {n: os.lstat(dest / n).st_mode for n in names}
    except OSError as e:
        raise PullError(f"cannot list {dest}: {e.strerror or e}") from None
    odd = [n for n in names if not stat.S_ISREG(kinds[n])]
    if odd:
        what = "a link" if stat.S_ISLNK(kinds[odd[0]]) else "not a plain file"
        raise PullError(
            f"{dest / odd[0]} is {what}: pull writes plain files only and never through a link; "
            "pull into an empty or new folder"
        )
    foreign = [n for n in names if n not in ours]
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise PullError(
            f"{dest} holds files that are not part of {src.label} ({', '.join(foreign[:3])}{more}): "
            "pull into an empty or new folder"
        )
    kept: set[str] = set()
    need = 0
    # the manifest first (the agent lists it last): a wrong one names the other checkpoint
    for f in sorted(src.files, key=lambda f: f.name != checkpoints.MANIFEST):
        final, part = dest / f.name, dest / (f.name + PART)
        if f.name in kinds and (final.stat().st_size != f.size or _sha256(final) != f.sha256):
            other = "checkpoint" if src.kind == "checkpoint" else "export"
            raise PullError(
                f"{dest} holds another {other} (its {f.name} is not {src.label}'s): pull into another folder"
            )
        if f.name in kinds and f.name + PART not in kinds:
            kept.add(f.name)
            continue
        have = part.stat().st_size if f.name + PART in kinds else 0
        need += f.size - have if have <= f.size else f.size
    _room(dest, src, need)
    return kept


def _room(dest: Path, src: Source, need: int) -> None:
    """Refused before a byte moves when the files left to fetch are bigger than DEST's free space."""
    where = dest
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return  # not known: the write itself says so
    if need > free:
        raise PullError(
            f"{where} has {_mib(free)} free, and {src.label} needs {_mib(need)} more ({len(src.files)} files, "
            f"{_mib(src.size)} in all): nothing was fetched; free some space or pull elsewhere"
        )


def _sha256(path: Path, upto: int | None = None) -> str:
    return str(_hasher(path, upto).hexdigest())


def _hasher(path: Path, upto: int | None = None) -> t.Any:
    h = hashlib.sha256()
    left = upto
    with open(path, "rb") as f:
        while left is None or left > 0:
            chunk = f.read(HASH_CHUNK if left is None else min(HASH_CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h


def _open_part(part: Path, resume: bool) -> t.BinaryIO:
    """A .part file of ours: created new (O_EXCL: whatever was there is gone first), or one we wrote,
    continued; never through a link (O_NOFOLLOW: a link planted meanwhile is refused, not followed)."""
    flags = (os.O_RDWR if resume else os.O_WRONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    if not resume:
        part.unlink(missing_ok=True)
        flags |= os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(part, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PullError(f"{part} is a link: pull writes plain files only and never through a link") from None
        if e.errno == errno.EEXIST:  # put there since the unlink: not ours
            raise PullError(f"{part} appeared while pulling: pull writes only files it creates") from None
        raise
    return os.fdopen(fd, "r+b" if resume else "wb")


class _Fetcher:
    """Brings files of ``src`` into DEST, counting calls and bytes; ``progress(n)`` after each chunk."""

    def __init__(
        self,
        remote: Remote,
        session: str | None,
        src: Source,
        progress: t.Callable[[int], None],
        kept: t.Collection[str] = (),
    ) -> None:
        self.remote, self.src, self.progress, self.kept = remote, src, progress, kept
        self.req = request(remote, session)
        if src.kind == "export":
            self.req["export"] = src.dir
        self.calls = self.fetched = 0

    def chunk(self, f: RemoteFile, offset: int) -> bytes:
        req = {**self.req, "dir": self.src.dir, "name": f.name, "offset": offset, "length": min(CHUNK, f.size - offset)}
        a = _ask(self.remote, "fetch", req, FETCH_TIMEOUT)
        self.calls += 1
        try:
            data = base64.b64decode(a.get("data") or "", validate=True)
            size = int(a["size"])
        except (KeyError, TypeError, ValueError) as e:
            raise errors.AgentError(f"agent fetch: answer is not one this dflashctl reads ({e})") from None
        if size != f.size:
            raise PullError(
                f"{f.name} on the box has {size} bytes now, {f.size} when the pull began: "
                f"{self.src.label} changed while pulling; pull again"
            )
        if not data and offset < f.size:
            raise PullError(f"{f.name}: the box sent nothing at byte {offset} of {f.size}")
        return data

    def into(self, f: RemoteFile, part: Path, resume: bool) -> tuple[str, bool]:
        """Fill ``part`` (from its size when ``resume``); (its sha256, whether it went on from a .part)."""
        try:
            st = os.lstat(part) if resume else None
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise PullError(f"{part} is a link: pull writes plain files only and never through a link")
        have = st.st_size if st is not None else 0
        if have > f.size:
            have = 0  # longer than the file: not a piece of it
        h = _hasher(part, have) if have else hashlib.sha256()
        self.progress(have)
        with _open_part(part, have > 0) as out:
            out.seek(have)
            out.truncate()
            offset = have
            while offset < f.size:
                data = self.chunk(f, offset)
                out.write(data)
                h.update(data)
                offset += len(data)
                self.fetched += len(data)
                self.progress(len(data))
            out.flush()
            os.fsync(out.fileno())
        return h.hexdigest(), have > 0

    def file(self, f: RemoteFile, dest: Path) -> str:
        final, part = dest / f.name, dest / (f.name + PART)
        if f.name in self.kept:  # there and right (check_dest summed it)
            self.progress(f.size)
            return "kept"
        digest, resumed = self.into(f, part, resume=True)
        action = "resumed" if resumed else "fetched"
        if digest != f.sha256:
            self.progress(-f.size)
            digest, _ = self.into(f, part, resume=False)  # once more, from the start
            action = "refetched"
            if digest != f.sha256:
                part.unlink(missing_ok=True)
                raise PullError(
                    f"{f.name}: its sha256 after the transfer is not the one the box lists, twice (fetched again "
                    f"from the start): the file on the box may be corrupted ({self.src.dir}/{f.name})"
                )
        os.replace(part, final)
        return action


def pull(
    remote: Remote,
    session: str | None,
    dest: Path,
    *,
    pick: Pick = "latest",
    export: str | None = None,
    progress: t.Callable[[int], None] | None = None,
    on_source: t.Callable[[Source], None] | None = None,
) -> Pulled:
    """Pull the checkpoint (or export) into ``dest``; ``on_source`` hears what it is before the bytes move."""
    src = source(remote, session, pick=pick, export=export)
    kept = check_dest(dest, src)
    if on_source is not None:
        on_source(src)
    fetcher = _Fetcher(remote, session, src, progress or (lambda n: None), kept)
    actions = {}
    try:
        for f in src.files:  # checkpoint.json last (the agent lists it last): a DEST with it is whole
            actions[f.name] = fetcher.file(f, dest)
    except OSError as e:
        raise PullError(f"cannot write into {dest}: {e.strerror or e}") from None
    fd = os.open(dest, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return Pulled(src, dest, actions, fetcher.fetched, fetcher.calls)
