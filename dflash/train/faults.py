"""Fault injection, for tests, the bench and the supervisor's end-to-end checks: off unless asked.

A ``FaultInjector`` is handed to the pipeline (``Pipeline(injector=...)``, the pipeline's ``Injector``;
without one nothing fires); ``DFLASH_FAULT`` in a run's environment builds one (``faults_from_env``); the trainer
checks the ``checkpoint`` role when it saves and pickles ``SigkillWhenPickled`` for ``kill-in-checkpoint``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import threading
import typing as t
from pathlib import Path

import torch

from dflash.train.pipeline import InjectedFault

logger = logging.getLogger("dflash.faults")  # the name train.log has always shown


@dataclasses.dataclass(slots=True)
class Fault:
    role: str  # "target", "drafter", "checkpoint" (checked by the trainer when it saves) or "update" (a replica's)
    index: int | None  # None: whichever worker of that role gets there first
    step: int
    kind: str = "raise"  # "raise", "hang" (stop making progress until the run stops), "kill" (checkpoint), "nan"
    exc: t.Callable[[str], BaseException] | None = None  # built from the worker's device
    times: int = 1  # consecutive checks it fires on (2 = also the OOM retry)
    fatal: bool = False  # stop the whole run instead of one worker
    label: str = ""
    on_fire: t.Callable[[Fault], None] | None = None
    fired: int = 0


class FaultInjector:
    """Faults keyed by (role, worker index, step), fired at the first check at or after that step.

    Drafters check with the global step they are about to train, targets with their own batch count.
    ``counts`` says what fired, per (role, index).
    """

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.counts: collections.Counter[tuple[str, int]] = collections.Counter()

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def fail_at(
        self,
        role: str,
        index: int | None,
        step: int,
        exc: BaseException | t.Callable[[str], BaseException] | None = None,
        *,
        times: int = 1,
        fatal: bool = False,
        label: str = "",
        on_fire: t.Callable[[Fault], None] | None = None,
    ) -> Fault:
        make: t.Callable[[str], BaseException] | None
        if isinstance(exc, BaseException):
            make = lambda _device, e=exc: e  # noqa: E731
        else:
            make = exc
        return self.add(Fault(role, index, step, "raise", make, times, fatal, label, on_fire))

    def hang_at(
        self,
        role: str,
        index: int | None,
        step: int,
        *,
        times: int = 1,
        label: str = "",
        on_fire: t.Callable[[Fault], None] | None = None,
    ) -> Fault:
        return self.add(Fault(role, index, step, "hang", None, times, False, label, on_fire))

    def check(self, role: str, index: int, step: int) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.role == role and (f.index is None or f.index == index) and step >= f.step and f.fired < f.times:
                    f.fired += 1
                    self.counts[(role, index)] += 1
                    hit = f
                    break
            else:
                return None
        if hit.on_fire is not None:
            hit.on_fire(hit)
        return hit


def cuda_oom(device: str) -> torch.OutOfMemoryError:
    """An out-of-memory error with the text the CUDA caching allocator writes (for injection)."""
    gpu = device.split(":")[1] if device.startswith("cuda:") else "0"
    return torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. "
        f"GPU {gpu} has a total capacity of 95.00 GiB of which 1.12 GiB is free. "
        "Including non-PyTorch memory, this process has 93.86 GiB memory in use. "
        "Of the allocated memory 90.10 GiB is allocated by PyTorch, and 2.31 GiB is reserved by PyTorch "
        "but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )


FAULT_ENV = "DFLASH_FAULT"


def faults_from_env(spec: str, marker_dir: Path) -> FaultInjector:
    """Parse ``DFLASH_FAULT`` (comma-separated) into an injector whose faults fire once per run dir.

    - ``raise-at-step:N``           the run dies at global step N with ``InjectedFault`` (a Python exception)
    - ``oom-at-step:N``             the run dies at step N with a CUDA out-of-memory error
    - ``drafter-oom-at-step:N:I``   drafter I dies at step N with a CUDA OOM (the others go on)
    - ``hang-at-step:N``            every drafter stops making progress at step N (until SIGTERM)
    - ``kill-in-checkpoint:N``      SIGKILL in the middle of writing the first checkpoint at step >= N
    - ``nan-at-step:N``             the update at step N has a NaN loss and NaN gradients (``DrafterReplica.poison``)

    Before firing, a marker file ``.dflash-fault-<spec>`` is written into ``marker_dir`` (the checkpoint
    dir): a resumed run with the same environment sees it and does not fire again.
    """
    inj = FaultInjector()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        kind, _, rest = part.partition(":")
        args = rest.split(":") if rest else []
        try:
            nums = [int(a) for a in args]
        except ValueError:
            raise ValueError(f"{FAULT_ENV}: bad fault {part!r}: steps and indices are integers") from None
        want = {
            "raise-at-step": 1,
            "oom-at-step": 1,
            "hang-at-step": 1,
            "drafter-oom-at-step": 2,
            "kill-in-checkpoint": 1,
            "nan-at-step": 1,
        }
        if kind not in want:
            raise ValueError(f"{FAULT_ENV}: unknown fault {kind!r} (known: {', '.join(want)})")
        if len(nums) != want[kind]:
            raise ValueError(f"{FAULT_ENV}: {kind} takes {want[kind]} number(s), got {part!r}")
        marker = marker_dir / (".dflash-fault-" + part.replace(":", "-"))
        if marker.exists():
            logger.info("%s: %s already fired (marker %s); not again", FAULT_ENV, part, marker)
            continue

        def fire(_fault: Fault, marker: Path = marker, part: str = part) -> None:
            if marker.exists():
                return
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(part + "\n")
            logger.warning("%s: firing %s", FAULT_ENV, part)

        step = nums[0]
        if kind == "raise-at-step":
            msg = f"{FAULT_ENV} {part}: injected failure at step {step}"

            def injected(_device: str, m: str = msg) -> BaseException:
                return InjectedFault(m)  # the pipeline's own error (its name is in crash reports)

            inj.fail_at("drafter", None, step, injected, fatal=True, label=part, on_fire=fire)
        elif kind == "oom-at-step":
            inj.fail_at("drafter", None, step, cuda_oom, fatal=True, label=part, on_fire=fire)
        elif kind == "drafter-oom-at-step":
            inj.fail_at("drafter", nums[1], step, cuda_oom, times=2, label=part, on_fire=fire)
        elif kind == "kill-in-checkpoint":
            inj.add(Fault("checkpoint", 0, step, "kill", label=part, on_fire=fire))
        elif kind == "nan-at-step":  # checked by the drafter replica itself, on its real update
            inj.add(Fault("update", None, step, "nan", label=part, on_fire=fire))
        else:  # every drafter hangs, not only the first one there
            inj.hang_at("drafter", None, step, times=1 << 30, label=part, on_fire=fire)
    return inj


class SigkillWhenPickled:
    """``kill-in-checkpoint``: the process dies by SIGKILL while torch.save writes the trainer state."""

    def __reduce__(self) -> t.Any:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")
