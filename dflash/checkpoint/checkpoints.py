"""Drafter checkpoints: servable by z-lab's DFlashDraftModel, resumable, never picked half-written.

Layout of one checkpoint, ``<root>/step-<n>/``:

- ``config.json``       the drafter config (z-lab keys: architectures, auto_map, block_size,
                        num_target_layers, dflash_config{mask_token_id, target_layer_ids, block_size},
                        layer_types, sliding_window; plus ``rope_theta`` for transformers 4.x readers and
                        ``eagle_aux_hidden_state_layer_ids`` for vLLM: ``dflash.model.contract``, which also
                        refuses, before anything is written, what a serving engine would get wrong)
- ``model.safetensors`` drafter weights only, z-lab parameter names (no target embedding or lm_head)
- ``trainer_state.pt``  {"step", "trainer_state", "optimizer"}: whatever the trainer needs to resume
                        (data position, RNG, pipeline config); loaded with ``weights_only=True``, so
                        it may hold tensors, numbers, strings, lists, tuples and dicts
- ``dflash.py``         the drafter as HF remote code (``dflash.model.hf_remote``): config.json's auto_map loads it
- ``checkpoint.json``   the manifest, written last: step, the run id, the size and sha256 of every file above

Everything is written into ``<root>/.tmp-step-<n>-<pid>``, fsynced, and renamed to ``step-<n>``, so a
``step-*`` directory is either absent or complete; ``latest_complete`` also checks the manifest, so a
directory copied or truncated by hand is not picked either, and the sha256 sums, so a corrupted file is
skipped (with a warning naming it) for the previous checkpoint.

Runs: every run has an id (``new_run_id``: its UTC start time, then random hex), written into each of its
checkpoints and kept across resumes. ``keep`` prunes only the run's own checkpoints, and only after the
new one is renamed in; a ``step-<n>`` of ANOTHER run that is in the way is moved into
``<root>/old-<its run id>-<time>/``, never deleted. ``resume_order`` lists the newest run's checkpoints
first (newest step first), then older runs'. Checkpoints written before run ids (and sha256 sums)
existed still load; they count as one run older than any other.

The best checkpoint (``<root>/best`` and ``best.json``) is ``dflash.checkpoint.best``'s: pruning never removes the
checkpoint ``best`` points to (nor a step whose eval is still running: ``protect``), and ``move_aside`` takes
both along with their run. ``choose`` is what ``dflash export`` and ``dflash eval --drafter`` read a folder
with: a checkpoint dir itself, else ``best`` when there is one, else the latest complete checkpoint, and a
line that says which. What makes a directory a complete checkpoint (its manifest, read) is ``dflash.checkpoint.manifest``'s.

Writing in the background: ``snapshot`` copies what a checkpoint holds to CPU (the only part that must
happen while the drafters wait), ``CheckpointWriter`` writes snapshots in one background thread, one at
a time, and re-raises a failed write as ``CheckpointWriteError`` at the next ``wait``/``check``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import threading
import typing as t
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash import inputs
from dflash.checkpoint.best import BEST_FILE, BEST_LINK, BEST_LOCK, best_of, move_best, read_best
from dflash.checkpoint.manifest import (
    CONFIG_FILE,
    FORMAT,
    MANIFEST_FILE,
    STATE_FILE,
    STEP_DIR,
    WEIGHTS_FILE,
    CheckpointError,
    manifest_problem,
    read_manifest,
    step_of,
)
from dflash.errors import DflashError
from dflash.model import contract, hf_remote, model_config
from dflash.model.drafter import ARCHITECTURES, DFlashDraftConfig, DFlashDraftModel
from dflash.outputs import fsync_dir, fsync_file

__all__ = [
    "Checkpoint",
    "CheckpointWriteError",
    "CheckpointWriter",
    "Snapshot",
    "latest_complete",
    "choose",
    "list_complete",
    "load_checkpoint",
    "load_drafter",
    "move_aside",
    "new_run_id",
    "prune",
    "nonfinite_weights",
    "restore_rng_state",
    "resume_order",
    "rng_state",
    "run_of",
    "save_checkpoint",
    "snapshot",
    "write_checkpoint",
]

logger = logging.getLogger("dflash.checkpoint")  # the name train.log has always shown

_TMP_DIR = re.compile(r"^\.(?:tmp|old)-step-(\d+)-(\d+)$")
_HASH_CHUNK = 1 << 20


class CheckpointWriteError(DflashError, RuntimeError):
    """A background checkpoint write failed (disk full, ...): the run fails; earlier checkpoints stand."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    config: DFlashDraftConfig
    state_dict: dict[str, torch.Tensor]
    trainer_state: dict[str, t.Any]
    optimizer_state: dict[str, t.Any] | None
    run_id: str | None = None  # None: written before run ids existed


def new_run_id() -> str:
    """A fresh run's identity: its start time (UTC, so ids sort by start) and random hex. Microseconds,
    because a run forked from an older checkpoint often starts within the second of the run it forks
    from, and must still sort after it (resume picks the newest run first)."""
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S.%fZ") + "-" + secrets.token_hex(4)


# ---- writing --------------------------------------------------------------------------------


def config_json(config: DFlashDraftConfig, *, dtype: torch.dtype | None = None) -> str:
    """The config.json text: transformers' own serialisation plus the keys older readers and the serving
    engines need (``contract.serving_keys``)."""
    data = json.loads(config.to_json_string(use_diff=True))
    full = config.to_dict()
    for key in (
        "architectures",
        "block_size",
        "num_target_layers",
        "dflash_config",
        "layer_types",
        "sliding_window",
        "use_sliding_window",
        "model_type",
        "vocab_size",
        "hidden_size",
    ):
        data.setdefault(key, full.get(key))
    data["architectures"] = [ARCHITECTURES[config.kind]]  # DFlash2's name is what the engines load it under
    rope = data.get("rope_parameters") or {}
    if "rope_theta" in rope and rope.get("rope_type", "default") == "default":
        # transformers 4.x (z-lab pins 4.57) reads rope_theta, not rope_parameters.
        data.setdefault("rope_theta", rope["rope_theta"])
    if dtype is not None:
        data["dtype"] = str(dtype).removeprefix("torch.")
    return json.dumps(contract.serving_keys(data), indent=2, sort_keys=True) + "\n"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(root: Path) -> None:
    """Remove temp dirs that a dead process left behind (a crash mid-save)."""
    for entry in root.iterdir():
        match = _TMP_DIR.match(entry.name)
        if match and entry.is_dir() and int(match.group(2)) != os.getpid() and not _pid_alive(int(match.group(2))):
            shutil.rmtree(entry, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What one checkpoint holds, as CPU copies no one else references: safe to write from another thread."""

    step: int
    run_id: str | None
    config: DFlashDraftConfig
    weights: dict[str, torch.Tensor]
    trainer_state: dict[str, t.Any]
    optimizer_state: dict[str, t.Any] | None


def _cpu_copy(value: t.Any, into: t.Any = None, copies: set[torch.device] | None = None) -> t.Any:
    """Tensors copied to CPU (a CPU tensor too: training goes on changing the original), containers rebuilt.

    ``into``: the same structure from an earlier snapshot whose write is done; its tensors of the same
    shape and dtype are written over instead of allocating (fresh memory's page faults cost more than the copy).
    A GPU tensor goes into pinned host memory by a ``non_blocking`` copy (a DMA at full link speed, not a
    staged pageable copy; the copies of one device queue up back to back); its device lands in ``copies``,
    and the caller waits for them once (``_wait_copies``) before anyone reads the snapshot.
    """
    if isinstance(value, torch.Tensor):
        src = value.detach()
        if src.device.type == "cuda" and copies is not None:
            dst = into if _fits(into, src) and into.is_pinned() else _pinned_like(src)
            dst.copy_(src, non_blocking=dst.is_pinned())
            copies.add(src.device)
            return dst
        if _fits(into, src):
            return into.copy_(src)
        return src.to("cpu", copy=True).contiguous()
    if isinstance(value, dict):
        old = into if isinstance(into, dict) else {}
        return {k: _cpu_copy(v, old.get(k), copies) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        olds = into if isinstance(into, (list, tuple)) and len(into) == len(value) else [None] * len(value)
        return type(value)(_cpu_copy(v, o, copies) for v, o in zip(value, olds))
    return value


def _fits(into: t.Any, src: torch.Tensor) -> bool:
    return (
        isinstance(into, torch.Tensor)
        and into.shape == src.shape
        and into.dtype == src.dtype
        and into.device.type == "cpu"
        and into.is_contiguous()
    )


def _pinned_like(src: torch.Tensor) -> torch.Tensor:
    try:
        return torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    except RuntimeError:  # pinned memory refused (a locked-memory limit): pageable, a blocking copy
        return torch.empty(src.shape, dtype=src.dtype)


def _wait_copies(devices: set[torch.device]) -> None:
    """Wait for the snapshot's device-to-host copies: an event on each device's current stream, not a
    device-wide sync (the other drafters' queued work on other streams is not waited for)."""
    for dev in devices:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        ev.synchronize()


@torch.no_grad()
def snapshot(
    drafter: DFlashDraftModel,
    *,
    step: int,
    trainer_state: dict[str, t.Any],
    optimizer_state: dict[str, t.Any] | None = None,
    run_id: str | None = None,
    reuse: Snapshot | None = None,
) -> Snapshot:
    """Copy a checkpoint's contents to CPU: call it while no thread changes the drafter (the barrier).
    ``reuse``: a written snapshot (``CheckpointWriter.spare``) whose buffers this one may overwrite."""
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    # A torch.compile wrapper adds "_orig_mod." to names; the file keeps z-lab's plain names.
    state = {name.replace("_orig_mod.", ""): tensor for name, tensor in drafter.state_dict().items()}
    copies: set[torch.device] = set()
    snap = Snapshot(
        step=step,
        run_id=run_id,
        config=drafter.config,
        weights=_cpu_copy(state, reuse.weights if reuse else None, copies),
        trainer_state=_cpu_copy(trainer_state, reuse.trainer_state if reuse else None, copies),
        optimizer_state=_cpu_copy(optimizer_state, reuse.optimizer_state if reuse else None, copies),
    )
    _wait_copies(copies)
    return snap


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(
    root: str | os.PathLike[str],
    *,
    step: int,
    drafter: DFlashDraftModel,
    trainer_state: dict[str, t.Any],
    optimizer_state: dict[str, t.Any] | None = None,
    keep: int | None = 3,
    run_id: str | None = None,
) -> Path:
    """Write ``<root>/step-<step>`` atomically now and keep only the run's ``keep`` newest (None/0: keep all).

    Call it when no thread is changing the drafter (at the trainer's barrier). Returns the directory.
    """
    return write_checkpoint(
        root,
        snapshot(drafter, step=step, trainer_state=trainer_state, optimizer_state=optimizer_state, run_id=run_id),
        keep=keep,
    )


def check_servable(drafter: torch.nn.Module, config: DFlashDraftConfig, *, vocab_size: int | None = None) -> None:
    """The serving contract ``write_checkpoint`` applies, checked on a drafter before training starts: a run
    whose checkpoints an engine would refuse fails at start in one line, not at its first checkpoint."""
    shapes = {name.replace("_orig_mod.", ""): tuple(w.shape) for name, w in drafter.state_dict().items()}
    contract.check(json.loads(config_json(config)), shapes, target=contract.Target(vocab_size=vocab_size))


def nonfinite_weights(weights: t.Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first tensor holding a NaN or inf (None: all finite): such weights are never written."""
    for name, w in weights.items():
        if w.is_floating_point() and not bool(torch.isfinite(w).all()):
            return name
    return None


def write_checkpoint(
    root: str | os.PathLike[str],
    snap: Snapshot,
    *,
    keep: int | None = 3,
    protect: t.Callable[[], t.Collection[int]] | None = None,
) -> Path:
    """Write a snapshot as ``<root>/step-<n>``: temp dir, fsync, rename; then prune the run's oldest, except
    the one ``best`` points to and the steps ``protect()`` names (evals in flight)."""
    step = snap.step
    if keep is not None and keep < 0:
        raise ValueError(f"keep: must be >= 0 (0 or None keeps all), got {keep}")
    weights = snap.weights
    if (bad := nonfinite_weights(weights)) is not None:
        raise CheckpointError(f"step {step}: {bad} is not finite (NaN or inf): no checkpoint from these weights")
    dtype = next(iter(weights.values())).dtype if weights else None
    config_text = config_json(snap.config, dtype=dtype)
    # what an engine would refuse or serve wrongly is refused before anything is written (one line)
    contract.check(json.loads(config_text), {name: tuple(w.shape) for name, w in weights.items()})
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale(root)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(config_text)
        hf_remote.write(tmp)  # AutoModel.from_pretrained(..., trust_remote_code=True) without this package
        torch.save(
            {"step": step, "trainer_state": snap.trainer_state, "optimizer": snap.optimizer_state}, tmp / STATE_FILE
        )
        names = (CONFIG_FILE, WEIGHTS_FILE, STATE_FILE, hf_remote.FILE_NAME)
        manifest = {
            "format": FORMAT,
            "step": step,
            "run_id": snap.run_id,
            "saved_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "files": {name: (tmp / name).stat().st_size for name in names},
            "sha256": {name: _sha256(tmp / name) for name in names},
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for name in (*names, MANIFEST_FILE):
            fsync_file(tmp / name)
        fsync_dir(tmp)
        if final.exists():  # another run's (a fork's parent, a corrupted one): never deleted, moved aside
            aside = _archive_dir(root, _manifest_run(final))
            final.rename(aside / final.name)
            logger.warning(
                "%s was in the way of step %d of run %s: moved aside to %s",
                final,
                step,
                snap.run_id,
                aside / final.name,
            )
        tmp.rename(final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("checkpoint step %d written to %s", step, final)
    if keep:
        prune(root, snap.run_id, keep=keep, protect=protect, newest=final)
    return final


def prune(
    root: str | os.PathLike[str],
    run_id: str | None,
    *,
    keep: int,
    protect: t.Callable[[], t.Collection[int]] | None = None,
    newest: Path | None = None,
) -> list[Path]:
    """Remove the run's complete checkpoints but its ``keep`` newest, the one ``best`` points to and the
    steps ``protect()`` names (evals in flight: a run prunes once more when they end). Returns the removed."""
    root = Path(root)
    removed = []
    with BEST_LOCK:
        kept = {step_of(b)} if (b := best_of(root)) is not None else set()
        kept |= set(protect() if protect is not None else ())
        mine = [p for p in list_complete(root) if p != newest and _manifest_run(p) == run_id]
        if newest is not None:
            mine.append(newest)  # the newest of its run: steps only grow within a run
        for old_path in mine[:-keep]:
            if step_of(old_path) in kept:
                continue  # the best (or an eval in flight): it stays, beyond keep
            # Rename first: a half-deleted directory must not look like a checkpoint.
            doomed = root / f".old-step-{step_of(old_path)}-{os.getpid()}"
            old_path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(old_path)
    return removed


def _archive_dir(root: Path, run_id: str | None) -> Path:
    """A new ``<root>/old-<run id>-<time>/`` (not a ``step-*`` name, so never resumed or pruned by itself)."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    base = f"old-{run_id or 'no-run-id'}-{stamp}"
    for n in range(1000):
        aside = root / (base if n == 0 else f"{base}-{n}")
        try:
            aside.mkdir()
        except FileExistsError:
            continue
        return aside
    raise CheckpointError(f"{root}: cannot find a free name for {base}")


def move_aside(root: str | os.PathLike[str]) -> list[Path]:
    """Move every ``step-*`` directory under ``root`` into ``old-<run id>-<time>/`` (one per run), for a
    run that starts afresh (``resume = "never"``) in a directory that already holds checkpoints.
    Returns the folders it made; deletes nothing."""
    root = Path(root)
    if not root.is_dir():
        return []
    by_run: dict[str | None, list[Path]] = {}
    for entry in sorted(root.iterdir()):
        if STEP_DIR.match(entry.name) and entry.is_dir():
            by_run.setdefault(_manifest_run(entry), []).append(entry)
    link = root / BEST_LINK
    best_name = os.readlink(link) if link.is_symlink() else None
    made = []
    best_aside: Path | None = None
    for run_id, paths in by_run.items():
        aside = _archive_dir(root, run_id)
        for p in paths:
            if p.name == best_name:
                best_aside = aside  # best and best.json go with the checkpoint they name
            p.rename(aside / p.name)
        made.append(aside)
    if link.is_symlink() or (root / BEST_FILE).exists():
        if best_aside is None:  # its checkpoint is gone already: in an archive of their own
            best_aside = _archive_dir(root, "best")
            made.append(best_aside)
        move_best(root, best_aside)
    if made:
        fsync_dir(root)
    return made


class CheckpointWriter:
    """Writes snapshots to ``root`` in ONE background thread, one at a time.

    ``submit`` first waits for the previous write, so at most one snapshot is held in memory and the
    writes stay in step order. A failed write is raised (as ``CheckpointWriteError``) by the next
    ``submit``, ``check`` or ``wait``; the run must ``wait`` before it exits, or the last one is lost.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep: int | None = 3,
        protect: t.Callable[[], t.Collection[int]] | None = None,
        room_for: t.Callable[[Snapshot], t.Any] | None = None,
        on_skip: t.Callable[[int, t.Any], None] | None = None,
        on_written: t.Callable[[Path], None] | None = None,
        room_after: t.Callable[[Snapshot, BaseException], t.Any] | None = None,
    ) -> None:
        self.root = Path(root)
        self.keep = keep
        # before each write: room on disk for it (``dflash.checkpoint.room.make_room``: a ``Room``, pruning early first)
        self.room_for = room_for
        # after a failed write: a Room that does not fit when the disk was the cause (``room.after_failure``), else None
        self.room_after = room_after
        self.skipped: int | None = None  # the step of the last snapshot skipped for want of room
        self.on_skip = on_skip  # a checkpoint skipped for want of room: the caller records it
        self.on_written = on_written  # a checkpoint is on disk (from the writer's thread: must not block)
        self.protect = protect  # steps pruning must leave alone (evals in flight): write_checkpoint
        self.written: Path | None = None  # the last checkpoint written
        self._spare: Snapshot | None = None  # the last snapshot written: its buffers serve the next one
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._error: BaseException | None = None
        self._ended: int | None = None  # the step of the last write that ended (written or failed)
        self._ended_cond = threading.Condition()

    def submit(self, snap: Snapshot) -> None:
        self.wait()
        self._step = snap.step
        # Not a daemon: an interpreter that exits without wait() still finishes the write.
        self._thread = threading.Thread(target=self._write, args=(snap,), name=f"checkpoint-{snap.step}")
        self._thread.start()

    def _write(self, snap: Snapshot) -> None:
        try:
            if self._skip(snap):
                return
            try:
                self.written = write_checkpoint(self.root, snap, keep=self.keep, protect=self.protect)
            except Exception as e:  # a disk that filled during the write: skipped like one with no room
                found = self.room_after(snap, e) if self.room_after is not None else None
                if found is None:
                    raise
                self._skipped(snap, found)
                return
            self._spare = snap
            if self.on_written is not None:
                self.on_written(self.written)
        except BaseException as e:  # reported by the caller's next wait()
            self._error = e
        finally:
            with self._ended_cond:
                self._ended = snap.step
                self._ended_cond.notify_all()

    def _skip(self, snap: Snapshot) -> bool:
        """No room for ``snap`` even after pruning what ``keep`` lets go: one line, ``on_skip``, no write
        (a write that died half-way would cost the run; the earlier checkpoints stand)."""
        if self.room_for is None:
            return False
        room = self.room_for(snap)
        if room.fits:
            return False
        self._skipped(snap, room)
        return True

    def _skipped(self, snap: Snapshot, room: t.Any) -> None:
        self._spare = snap  # its buffers are free again
        self.skipped = snap.step
        if room.failed is not None:
            why = f" (the write stopped: {room.failed})"
        elif room.pruned:
            why = f" after pruning {len(room.pruned)}"
        elif room.freeable:
            why = f" (pruning what keep lets go would free only {room.freeable / 2**20:.1f} MiB: nothing pruned)"
        else:
            why = " (nothing keep lets go)"
        logger.warning(
            "checkpoint step %d skipped: it needs %.1f MiB and %s has %.1f MiB free%s; the last checkpoint stays %s",
            snap.step,
            room.need / 2**20,
            self.root,
            room.free / 2**20,
            why,
            getattr(latest_complete(self.root, verify=False), "name", "none"),
        )
        if self.on_skip is not None:
            self.on_skip(snap.step, room)

    def ended(self, step: int, timeout: float | None = None) -> bool:
        """From any thread: wait until the write of ``step`` (or a later one) has ended, written or failed
        (an eval waits for its checkpoint before ``set_best``). False: not within ``timeout``."""
        with self._ended_cond:
            return self._ended_cond.wait_for(lambda: self._ended is not None and self._ended >= step, timeout)

    def spare(self) -> Snapshot | None:
        """After ``wait``: the last written snapshot, handed over once, for ``snapshot(reuse=...)``."""
        if self.busy:
            return None
        spare, self._spare = self._spare, None
        return spare

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise a finished write's error now; never blocks."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> Path | None:
        """Block until the write in flight is on disk; raise its error. Returns the last checkpoint written."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointWriteError(
                f"checkpoint step {self._step} could not be written to {self.root}: {type(error).__name__}: {error}"
            ) from error
        return self.written


def choose(path: str | os.PathLike[str]) -> tuple[Path, str | None]:
    """The checkpoint a folder means to ``dflash export`` and ``dflash eval --drafter``: a checkpoint dir
    (config.json) itself; under a checkpoints root or a run dir that holds ``checkpoints/``, the ``best``
    one when there is one, else the latest complete one. Returns it and the line that says so when it is
    ``best`` (None: a checkpoint dir itself, or the latest of a run without ``best``; a broken ``best`` is
    a warning). Raises nothing: (path, None) when nothing is found."""
    p = Path(path).expanduser()
    if (p / CONFIG_FILE).is_file():
        return p, None
    for root in (p, p / "checkpoints"):
        best = best_of(root)
        if best is not None:
            latest = next(iter(resume_order(root)), None)  # for the note only: no hashing
            problem = _hash_problem(best, _read_manifest(best) or {})
            if problem is None:
                rec = read_best(root) or {}
                tau = rec.get("tau")
                said = f" (held-out tau {tau:.2f})" if isinstance(tau, (int, float)) else ""
                other = f"; the latest is {latest.name}" if latest is not None and latest != best else ""
                return best, f"{root / BEST_LINK} -> {best.name}: the best checkpoint{said}{other}"
            logger.warning("%s -> %s: %s; taking the latest instead", root / BEST_LINK, best.name, problem)
        elif (root / BEST_LINK).is_symlink():
            logger.warning("%s points to no complete checkpoint; taking the latest instead", root / BEST_LINK)
        latest = latest_complete(root)
        if latest is not None:  # no best (a run without [eval]): the latest, as always, said by no line
            return latest, None
    return p, None


# ---- finding and reading ------------------------------------------------------------------


def _read_manifest(path: Path) -> dict[str, t.Any] | None:
    return read_manifest(path)[0]


def _manifest_run(path: Path) -> str | None:
    run_id = (_read_manifest(path) or {}).get("run_id")
    return run_id if isinstance(run_id, str) else None


def run_of(path: str | os.PathLike[str]) -> str | None:
    """The id of the run that wrote the checkpoint at ``path`` (None: written before run ids existed)."""
    return _manifest_run(Path(path))


def _hash_problem(path: Path, manifest: dict[str, t.Any]) -> str | None:
    """A file whose sha256 is not the manifest's (same size, other bytes); None for old manifests without sums."""
    sums = manifest.get("sha256")
    if not isinstance(sums, dict):
        return None
    for name, expected in sorted(sums.items()):
        try:
            actual = _sha256(path / name)
        except OSError as exc:
            return f"{name} unreadable: {exc.strerror}"
        if actual != expected:
            return f"{name} is corrupted: its sha256 is not the one in {MANIFEST_FILE}"
    return None


def list_complete(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints under ``root`` (every run's), oldest step first. Sizes only: no hashing."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        if STEP_DIR.match(entry.name) and entry.is_dir():
            problem = manifest_problem(entry)
            if problem is None:
                found.append(entry)
            else:
                logger.warning("skipping checkpoint %s: %s", entry, problem)
    return sorted(found, key=step_of)


def resume_order(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints in the order to try them: the newest run first (run ids sort by start time;
    checkpoints without a run id last), and within a run the newest step first."""
    found = list_complete(root)
    runs = {p: _manifest_run(p) for p in found}
    return sorted(found, key=lambda p: (runs[p] is not None, runs[p] or "", step_of(p)), reverse=True)


def latest_complete(root: str | os.PathLike[str], *, verify: bool = True) -> Path | None:
    """The newest complete checkpoint of the newest run under ``root`` (never a half-written one), or None.

    With ``verify`` the files' sha256 sums are checked too: a corrupted checkpoint is skipped, with a
    warning naming it, for the previous one."""
    for path in resume_order(root):
        problem = _hash_problem(path, _read_manifest(path) or {}) if verify else None
        if problem is None:
            return path
        logger.warning("skipping checkpoint %s: %s; trying the previous one", path, problem)
    return None


def _check_ranges(rec: inputs.Record) -> None:
    """What the drafter config's own checks leave to its reader: a nested dflash_config that is an object,
    a vocabulary a model can have, a positive RoPE base and norm epsilon (a negative one trains and
    serves NaN); CheckpointError naming the key."""
    try:
        rec.record("dflash_config", default=None)
        rec.integer("vocab_size", lo=1, hi=model_config.MAX_VOCAB, default=None)
        for key in ("rope_theta", "rms_norm_eps"):
            if rec.number(key, default=None) is not None and rec.data[key] <= 0:
                rec.bad(key, "a number > 0")
    except inputs.RecordError as exc:
        raise CheckpointError(str(exc)) from None


def read_config(path: Path) -> DFlashDraftConfig:
    """The drafter config of a checkpoint or a published folder: its config.json is a user's file, read
    bounded (``inputs.read_json``) and validated field by field; CheckpointError (one line) otherwise."""
    if not (path / CONFIG_FILE).exists():
        raise CheckpointError(f"{path}: no {CONFIG_FILE}")
    try:
        data = inputs.read_json(path / CONFIG_FILE, str(path))
    except inputs.InputFileError as exc:
        raise CheckpointError(str(exc).removeprefix(f"{path}: ")) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path / CONFIG_FILE}: expected a JSON object")
    _check_ranges(inputs.as_record(data, str(path / CONFIG_FILE)))
    try:
        return DFlashDraftConfig.from_dict(data)
    except (TypeError, ValueError, StrictDataclassError) as exc:  # strict fields: "expected int, got str"
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        raise CheckpointError(f"{path / CONFIG_FILE}: {lines[-1] if lines else type(exc).__name__}") from None


def _load_weights(path: Path, device: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from exc


def load_checkpoint(
    path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu", verify: bool = True
) -> Checkpoint:
    """Read a complete checkpoint for resuming: config, drafter weights, trainer and optimizer state.
    ``verify`` checks every file against the manifest's sha256 first (manifests without sums: sizes only)."""
    path = Path(path)
    problem = manifest_problem(path) if path.is_dir() else "no such directory"
    if problem is not None:
        raise CheckpointError(f"{path}: not a complete checkpoint: {problem}")
    problem = _hash_problem(path, _read_manifest(path) or {}) if verify else None
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    config = read_config(path)
    state_dict = _load_weights(path / WEIGHTS_FILE, str(map_location))
    try:
        state = torch.load(path / STATE_FILE, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError subclasses and RuntimeErrors here
        raise CheckpointError(f"{path / STATE_FILE}: cannot be loaded with weights_only=True: {exc}") from exc
    return Checkpoint(
        path=path,
        step=int(state["step"]),
        config=config,
        state_dict=state_dict,
        trainer_state=state["trainer_state"],
        optimizer_state=state.get("optimizer"),
        run_id=_manifest_run(path),
    )


def load_drafter(
    path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> DFlashDraftModel:
    """A drafter for serving or evaluation, in eval mode. Also reads z-lab's published drafter folders
    (``config.json`` + ``model.safetensors``, no trainer state, no manifest). Weights must match exactly;
    where there is a manifest, its sha256 sums are checked first."""
    path = Path(path)
    manifest, problem = read_manifest(path)
    if manifest is None and (path / MANIFEST_FILE).exists():  # a manifest we cannot check is no checkpoint
        raise CheckpointError(f"{path}: {problem}")
    problem = _hash_problem(path, manifest) if manifest is not None else None
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    config = read_config(path)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise CheckpointError(f"{path}: no {WEIGHTS_FILE}")
    state_dict = _load_weights(weights_path, "cpu")
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    try:
        model.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as exc:  # size mismatch, missing or unexpected names: say the first one
        detail = next((x.strip() for x in str(exc).splitlines()[1:] if x.strip()), str(exc))
        raise CheckpointError(f"{weights_path} does not match {path / CONFIG_FILE}: {detail}") from exc
    # Non-persistent buffers (RoPE frequencies) are not in the file: rebuild them for real.
    model.rotary_emb = type(model.rotary_emb)(config)
    model.to(
        device=device,
        dtype=dtype if dtype is not None else next(v.dtype for v in state_dict.values() if v.is_floating_point()),
    )
    model.requires_grad_(False)
    return model.eval()


# ---- RNG state helpers (for trainer_state) -----------------------------------------------


def rng_state(generator: torch.Generator | None = None) -> dict[str, t.Any]:
    """Python, torch CPU (and CUDA, where present) RNG states, plus a generator's, for trainer_state."""
    state: dict[str, t.Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def restore_rng_state(state: dict[str, t.Any], generator: torch.Generator | None = None) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"].cpu())


def _as_tuple(value: t.Any) -> t.Any:
    # random.setstate needs tuples all the way down; torch.load may hand back lists.
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
