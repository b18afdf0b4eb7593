"""dflash.train.faults: fault injection is off unless asked, and what it raises reads as before."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from dflash.train.faults import FaultInjector, faults_from_env


def test_no_fault_fires_unless_asked(tmp_path: Path) -> None:
    assert FaultInjector().check("drafter", 0, 10**9) is None
    assert faults_from_env(" , ", tmp_path).check("drafter", 0, 10**9) is None


def test_an_injected_raise_keeps_the_name_crash_reports_show(tmp_path: Path) -> None:
    """README's crash examples and incident fingerprints name dflash.train.pipeline.InjectedFault."""
    hit = faults_from_env("raise-at-step:3", tmp_path).check("drafter", 1, 3)
    assert hit is not None and hit.exc is not None
    exc = hit.exc("cpu")
    assert f"{type(exc).__module__}.{type(exc).__qualname__}" == "dflash.train.pipeline.InjectedFault"
    assert str(exc) == "DFLASH_FAULT raise-at-step:3: injected failure at step 3"
    assert faults_from_env("raise-at-step:3", tmp_path).check("drafter", 1, 3) is None  # fired once per dir


def test_kill_in_checkpoint_dies_by_sigkill_when_pickled() -> None:
    code = "import pickle; from dflash.train.faults import SigkillWhenPickled; pickle.dumps(SigkillWhenPickled()); print('alive')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL and "alive" not in p.stdout, p.stderr
