"""`dflashctl deploy`: content-addressed releases, incremental upload, atomic switch, rollback.

Layout on the far side (docs/design.md section 4)::

    <workdir>/releases/<id>/            one per deploy; <id> = first 16 hex of the manifest's sha256
    <workdir>/releases/<id>/.release.json   the manifest (full id, per-file sha256/size/mode)
    <workdir>/current  -> releases/<id>     switched atomically (new symlink, then rename over)
    <workdir>/previous -> releases/<id>     what --rollback goes back to
    <workdir>/.deploy.lock                  one deploy at a time

Everything on the far side is done by the release program (ops/far/release.py and the helpers it
imports), sent by value as ``<python> -c <program> <verb> <request JSON>`` (it cannot live in a release:
the first deploy has none). User values only ever travel inside the JSON request or the tar on stdin.
The common deploy is ONE call: ``install`` with the manifest and the files the operator's cache
(``<state>/deploy-cache/``: what the last deploy left on the host) says the container lacks; the far side
first checks that its state is the cached one and that nothing would stop the deploy (an old python,
missing modules, a live run), and otherwise answers ``recheck`` with what it found before reading the
upload. Then the flow is the two-call one (``inspect``'s facts, the plan, ``install``), word for word.
Every file is verified by its sha256 on the far side either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
import typing as t
from pathlib import Path

from ops import far
from ops.bundle import Bundle, FileEntry, TarStream, build_bundle
from ops.errors import DeployError, MissingDependencies, NotDeployed, RunActive
from ops.far import refusal
from ops.far.release import state_digest
from ops.far_call import Reply, call, cannot_exec
from ops.hosts import Host
from ops.state_dir import default_state_dir, private_dir

if t.TYPE_CHECKING:
    from ops.remote import Remote

# What the training core imports in the container, and how pip names them (the agent and the runner
# are stdlib only: status works before any of these is installed). torch is left unpinned on purpose: a GPU box needs its own
# CUDA build, not the CPU pin of pyproject.toml.
REQUIRED_MODULES: dict[str, str] = {
    "torch": "torch",
    "transformers": "transformers>=5.17,<6",
    "safetensors": "safetensors>=0.4",
    "accelerate": "accelerate>=1.1",  # targets load straight onto their GPU (device_map)
    "numpy": "numpy>=1.24",  # the averaging engine
    "click": "click>=8.1",
}
MIN_PYTHON = (3, 11)
INSPECT_TIMEOUT = 60.0

# The far-side program (ops/far/release.py and the helpers it imports), sent by value with -c on every
# call: it cannot live in a release, the first deploy has none. User values travel inside the JSON
# request (one argv item) or the tar on stdin, never in code.
RELEASE_DEPS = ("refusal", "procfs", "atomic", "records", "lock")  # each after what it imports
REMOTE_PROGRAM = far.program("release", RELEASE_DEPS)


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
        counts = [
            (len(v), k) for k, v in (("added", self.added), ("changed", self.changed), ("removed", self.removed)) if v
        ]
        if not counts:
            return "no file changed"
        (n, word), rest = counts[0], counts[1:]
        return ", ".join([f"{n} {'file' if n == 1 else 'files'} {word}", *(f"{m} {k}" for m, k in rest)])


def make_plan(
    bundle: Bundle,
    current_rows: t.Sequence[t.Sequence[t.Any]] | None,
    current_id: str | None,
    have_hashes: t.Iterable[str],
) -> Plan:
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
    """What ``inspect`` found on the host (see ops.far.release.inspect)."""

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
        return list(self.raw.get("hashes", []))

    @property
    def missing(self) -> list[str]:
        return list(self.raw.get("missing", []))

    @property
    def damaged(self) -> list[str]:
        return list(self.raw.get("damaged", []))


def _program(host: Host, verb: str, req: t.Mapping[str, t.Any], *, isolated: bool = True) -> list[str]:
    # -I -S: stdlib only, nothing from the environment or site-packages, a faster start. Not when the
    # program checks the modules: it must see the site-packages (user site included) to tell which are missing.
    flags = ["-I", "-S"] if isolated else []
    return [host.python, *flags, "-c", REMOTE_PROGRAM, verb, json.dumps({"workdir": host.workdir, **req})]


def _checks(host: Host, modules: t.Sequence[str] | None = None) -> dict[str, t.Any]:
    """What the release program needs to look at the host (``inspect``, and ``install`` in one trip).
    ``modules``: what the python there must import (default: training's, REQUIRED_MODULES)."""
    return {
        "run_dir": host.run_dir,
        "session": host.session,
        "modules": list(REQUIRED_MODULES if modules is None else modules),
    }


def _fail(host: Host, reply: Reply, doing: str) -> DeployError:
    """One clear error for a failed far-side call (the program's own message when there is one)."""
    result = reply.result
    err = result.err.strip()
    if cannot_exec(result):
        return DeployError(
            f"{host.label}: cannot run {host.python!r} there ({err.splitlines()[-1] if err else 'not found'}); "
            f"set hosts.{host.name}.python to an interpreter that exists"
        )
    if result.timed_out:
        return DeployError(f"{host.label}: {doing} did not finish in time (killed); current is unchanged")
    if reply.answer is not None and not reply.answer.get("ok"):
        return DeployError(f"{host.label}: {doing} failed: {reply.answer.get('message')}")
    if result.exit_code == 0:
        return DeployError(
            f"{host.label}: unreadable answer from the release program: {result.out[-200:]!r} {result.err[-200:]!r}"
        )
    why = err.splitlines()[-1] if err else f"exit {result.exit_code}"
    return DeployError(f"{host.label}: {doing} failed: {why}")


def _answer(host: Host, reply: Reply, doing: str) -> dict[str, t.Any]:
    """The answer of a call that went well, else the one clear error."""
    if reply.answer is None or not reply.answer.get("ok"):
        raise _fail(host, reply, doing)
    return reply.answer


def inspect(remote: Remote, host: Host, *, modules: t.Sequence[str] | None = None) -> Facts:
    """One call: the current release, the hashes kept releases hold, a live run, missing modules."""
    reply = call(remote, _program(host, "inspect", _checks(host, modules), isolated=False), timeout=INSPECT_TIMEOUT)
    return _checked(host, Facts(_answer(host, reply, "reading the deployed releases")))


def _checked(host: Host, facts: Facts) -> Facts:
    raw = facts.raw
    version = tuple(raw.get("python") or ())
    if version < MIN_PYTHON:
        raise DeployError(
            f"{host.label}: {host.python} is Python {'.'.join(map(str, version))}; dflash needs >= "
            f"{'.'.join(map(str, MIN_PYTHON))} (set hosts.{host.name}.python)"
        )
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


class Cache:
    """What the last deploy from this machine left on a host: ``<state>/deploy-cache/<key>.json`` (0600).

    Only a guess that saves a round trip: the far side checks it (``state``, a digest of the current
    release and the contents kept) before it reads an upload planned from it."""

    def __init__(self, host: Host, state_dir: Path | None = None) -> None:
        if state_dir is None:
            state_dir = default_state_dir()
        key = json.dumps([host.name, host.address, host.port, host.container, host.workdir])
        self.path = state_dir / "deploy-cache" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"

    def load(self) -> dict[str, t.Any]:
        """{"current": full id or None, "files": rows, "hashes": [...]}; a fresh host when there is none."""
        try:
            doc = json.loads(self.path.read_text())
            if isinstance(doc, dict) and isinstance(doc.get("hashes"), list):
                return doc
        except (OSError, ValueError, RecursionError):
            pass
        return {"current": None, "files": None, "hashes": []}

    def save(self, current: str, files: list[list[t.Any]], hashes: list[str]) -> None:
        try:
            private_dir(self.path.parent.parent)  # dflashctl's state dir: 0700, as restart-on-crash keeps it
            self.path.parent.mkdir(exist_ok=True, mode=0o700)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(fd, "w") as f:
                json.dump({"current": current, "files": files, "hashes": hashes}, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a cache that cannot be written costs the next deploy one round trip, nothing else

    def drop(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


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
        self.stream.write(
            f"\ruploading {human_bytes(sent)} of {human_bytes(self.total)}{pct} at {human_bytes(rate)}/s\x1b[K"
        )
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


def deploy(
    remote: Remote,
    host: Host,
    *,
    source: str | None = None,
    dry_run: bool = False,
    force: bool = False,
    install: bool = False,
    echo: t.Callable[[str], None] = print,
    progress: t.TextIO | None = None,
    state_dir: Path | None = None,
    modules: t.Sequence[str] | None = None,
) -> Outcome:
    """Bundle the source, compare with what the host has, send only what it lacks, switch ``current``.
    ``modules``: what the python there must import (default: training's; the supervisor's release on a
    Proxmox host needs none)."""
    started = time.monotonic()
    bundle = build_bundle(source)
    cache = Cache(host, state_dir)
    where = host.label
    meta = {"built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "source": str(bundle.root)}
    if dry_run:
        facts = inspect(remote, host, modules=modules)
    else:
        # One round trip: plan from the cache, and let the far side check the cache before it reads the upload.
        guess = cache.load()
        plan = make_plan(bundle, guess["files"], guess["current"][:16] if guess["current"] else None, guess["hashes"])
        req = {
            **_checks(host, modules),
            "id": bundle.full_id,
            "keep": host.keep_releases,
            "expect": state_digest(guess["current"], guess["hashes"]),
            "min_python": list(MIN_PYTHON),
        }
        answer, sent = _upload(remote, host, bundle, plan, req, meta, echo=echo, progress=progress)
        facts = Facts(answer["facts"])
        if answer.get("ok"):
            return _done(cache, bundle, plan, facts, answer, sent, started, where, echo)
        _checked(host, facts)  # the far side is not as cached, or something stops the deploy: decide as before
    _check_modules(remote, host, facts, install=install, dry_run=dry_run, echo=echo)
    plan = make_plan(bundle, facts.current_rows, facts.current_id, facts.hashes)

    if plan.up_to_date:
        return _done(cache, bundle, plan, facts, None, 0, started, where, echo)

    if dry_run:
        if (run := active_run(facts)) is not None:
            echo(f"note: a run is live in session {host.session!r} (pid {run.get('pid')}); a real deploy needs --force")
        for mark, paths in (("+", plan.added), ("~", plan.changed), ("-", plan.removed)):
            for p in paths:
                echo(f"{mark} {p}")
        current = f"releases/{facts.current_id}" if facts.current_id else "nothing deployed"
        summary = (
            f"dry run: {bundle.id} vs {current} on {where}: {plan.describe()}; would send "
            f"{len(plan.send)} {'file' if len(plan.send) == 1 else 'files'} ({human_bytes(plan.send_bytes)}); nothing was sent or switched"
        )
        return Outcome("dry-run", bundle.id, facts.current_id, plan, summary=summary)

    _refuse_live_run(facts, host, force=force, doing="deploy", echo=echo)
    answer, sent = _upload(
        remote,
        host,
        bundle,
        plan,
        {"id": bundle.full_id, "keep": host.keep_releases},
        meta,
        echo=echo,
        progress=progress,
    )
    return _done(cache, bundle, plan, facts, answer, sent, started, where, echo)


def _upload(
    remote: Remote,
    host: Host,
    bundle: Bundle,
    plan: Plan,
    req: dict[str, t.Any],
    meta: dict[str, str],
    *,
    echo: t.Callable[[str], None],
    progress: t.TextIO | None,
) -> tuple[dict[str, t.Any], int]:
    """``install``: the manifest and ``plan.send`` as one tar; once more with the contents a damaged kept
    copy lacked. With ``expect`` in ``req`` (one round trip), a ``recheck`` answer comes back as is."""
    one_trip = checked = "expect" in req
    send = list(plan.send)
    sent = 0
    where = host.label

    def announce() -> None:
        if send:
            echo(
                f"uploading {len(send)} {'file' if len(send) == 1 else 'files'} ({human_bytes(plan.send_bytes)}) to {where}"
            )

    for attempt in (1, 2):
        stream = TarStream(bundle, send, bundle.manifest_bytes(**meta))
        if not one_trip:
            announce()
        bar = Progress(stream.expected_size, progress)
        stream.on_chunk = bar
        timeout = 300.0 + stream.expected_size / 200e3  # generous: a slow link still finishes
        # Already current by the cache: no upload at all (the far side checks that before anything else).
        data = None if one_trip and plan.up_to_date else stream
        reply = call(remote, _program(host, "install", req, isolated=not checked), stdin=data, timeout=timeout)
        bar.done()
        answer = reply.answer or {}
        if one_trip and answer.get("error") == refusal.RECHECK:
            return answer, 0  # nothing was read: the flow goes on from its facts
        if one_trip:
            if not cannot_exec(reply.result):  # as the two-call flow: no upload line when python could not even start
                announce()
            one_trip = False
        sent += stream.sent
        if stream.error:
            raise DeployError(f"{stream.error}; nothing was switched on {where}")
        if answer.get("error") == refusal.NEED_CONTENT:
            # A kept copy turned out damaged (edited in place): send those contents too, once.
            need = set(answer.get("need", []))
            again = [f for f in {f.sha256: f for f in bundle.files if f.sha256 in need}.values() if f not in send]
            if attempt == 2 or not again:
                raise DeployError(
                    f"{where}: {len(need)} file contents are still missing after sending them; current is unchanged"
                )
            echo(
                f"{len(again)} kept {'copy was' if len(again) == 1 else 'copies were'} damaged on {where} (edited in place?); "
                f"sending {'it' if len(again) == 1 else 'them'} too"
            )
            send += again
            continue
        result = reply.result
        if reply.answer is None and result.exit_code is None and not result.timed_out:
            # Killed, or the connection died: no answer. The far side switches only after the whole tar.
            if stream.sent < stream.expected_size:
                raise DeployError(
                    f"{where}: the upload was cut after {human_bytes(stream.sent)} of "
                    f"{human_bytes(stream.expected_size)} (connection lost or the far side was killed); "
                    "nothing was switched; run deploy again"
                )
            raise DeployError(
                f"{where}: no answer after the upload (connection lost or the far side was killed); "
                "`dflashctl deploy --dry-run` shows what current is now"
            )
        return _answer(host, reply, "installing the release"), sent
    raise AssertionError("unreachable")


def _done(
    cache: Cache,
    bundle: Bundle,
    plan: Plan,
    facts: Facts,
    answer: dict[str, t.Any] | None,
    sent: int,
    started: float,
    where: str,
    echo: t.Callable[[str], None],
) -> Outcome:
    """The outcome of a deploy that went through (or had nothing to do); the cache remembers the host."""
    if answer is not None and answer.get("after"):
        cache.save(answer["after"]["current"], [f.row() for f in bundle.files], answer["after"]["hashes"])
    if answer is None or not answer.get("switched"):
        if facts.damaged:
            echo(
                f"warning: releases/{bundle.id} on {where} differs from its manifest (edited in place?): "
                + ", ".join(facts.damaged[:10])
            )
        summary = (
            f"{bundle.id} is already deployed to {where}: nothing uploaded (0 B sent); current -> releases/{bundle.id}"
        )
        return Outcome("unchanged", bundle.id, facts.previous_id, plan, summary=summary)
    seconds = time.monotonic() - started
    pruned = tuple(answer.get("pruned") or ())
    for rid in pruned:
        echo(f"pruned releases/{rid}")
    summary = (
        f"deployed {bundle.id} to {where}: {plan.describe()}, {human_bytes(sent)} sent in {seconds:.1f}s; "
        f"current -> releases/{bundle.id}"
    )
    return Outcome(
        "deployed",
        bundle.id,
        answer.get("from"),
        plan,
        bytes_sent=sent,
        files_sent=len(plan.send),
        seconds=seconds,
        pruned=pruned,
        summary=summary,
    )


def rollback(
    remote: Remote,
    host: Host,
    *,
    force: bool = False,
    dry_run: bool = False,
    echo: t.Callable[[str], None] = print,
    state_dir: Path | None = None,
) -> Outcome:
    """Switch ``current`` back to ``previous`` (atomic); ``previous`` then names what was current."""
    facts = inspect(remote, host)
    if facts.current_id is None:
        raise NotDeployed(f"{host.label}: nothing is deployed in {host.workdir}; run `dflashctl deploy` first")
    prev = facts.previous_id
    if prev is None or prev == facts.current_id or prev not in facts.raw.get("releases", []):
        raise DeployError(f"{host.label}: no previous release to roll back to (current is releases/{facts.current_id})")
    if dry_run:
        return Outcome(
            "dry-run",
            prev,
            facts.current_id,
            summary=f"dry run: would roll back {host.label}: current releases/{facts.current_id} -> releases/{prev}",
        )
    _refuse_live_run(facts, host, force=force, doing="roll back", echo=echo)
    Cache(host, state_dir).drop()  # current changes: the next deploy asks the host
    reply = call(remote, _program(host, "rollback", {"keep": host.keep_releases}), timeout=INSPECT_TIMEOUT)
    answer = _answer(host, reply, "rolling back")
    summary = f"rolled back {host.label}: current releases/{answer['from']} -> releases/{answer['to']}"
    return Outcome("rolled-back", answer["to"], answer["from"], summary=summary)


def _refuse_live_run(facts: Facts, host: Host, *, force: bool, doing: str, echo: t.Callable[[str], None]) -> None:
    run = active_run(facts)
    if run is None:
        return
    what = f"a run is live in session {host.session!r} on {host.label} (pid {run.get('pid')}, attempt {run.get('attempt')})"
    why = (
        "a running Python process keeps the modules it already imported, so it would go on with the old code "
        "and pick up new files only for modules it imports later"
    )
    if not force:
        raise RunActive(f"{what}: refusing to {doing}: {why}. Stop it first (dflashctl stop), or pass --force")
    echo(f"warning: {what}; going on because of --force: {why}")


def _check_modules(
    remote: Remote, host: Host, facts: Facts, *, install: bool, dry_run: bool, echo: t.Callable[[str], None]
) -> None:
    missing = facts.missing
    if not missing:
        return
    names = ", ".join(missing)
    python = facts.raw.get("executable") or host.python
    if not install:
        message = (
            f"{host.label}: {python} cannot import {names} (needed by training); "
            f"run `dflashctl deploy --install` to pip-install {'it' if len(missing) == 1 else 'them'}, "
            f"or install by hand"
        )
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
