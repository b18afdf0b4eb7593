"""Every pattern over a run's output does bounded work: a long adversarial line (900 KB) costs each
reader a fraction of a second (ops/diagnosis.py caps what a pattern sees and anchors the patterns to
the lines' own shapes). Each case ran for minutes before."""

from __future__ import annotations

import time

import pytest

from ops import diagnosis, gpu_fault, wire

N = 900_000
TRACE = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>']


def _line(unit: str) -> str:
    return (unit * (N // len(unit) + 1))[:N]


CASES = {
    # the diverged line's `.*?` tried at every `dflash: diverged` of the line
    "diverged": lambda: diagnosis.diagnose(
        [_line("dflash: diverged at step 1: a not finite; ")], exit_code=3, signal=None
    ),
    # the progress line's `\bstep N\b.*?\| loss`
    "step": lambda: diagnosis.progress_from_lines([_line("step 1 ")], None),
    "ktok": lambda: diagnosis.progress_from_lines(["step 1 | loss 2 | " + _line("1")], None),
    # Xid 154's `recovery action changed from .* to 0x0 (None)`
    "recovery": lambda: diagnosis.find(["NVRM: Xid (PCI:0000:3b:00): 154, " + _line("recovery action changed from ")]),
    # gloo's `\S+\] (?:.*Connection reset by peer...)`
    "peer-lost": lambda: diagnosis.diagnose([_line("gloo/transport/tcp/x] ")], exit_code=1, signal=None),
    "exception": lambda: diagnosis.diagnose([*TRACE, _line("a.") + "!"], exit_code=1, signal=None),
    "fingerprint": lambda: diagnosis.diagnose([*TRACE, "E: " + _line("1.")], exit_code=1, signal=None).fingerprint,
    "bus-and-pid": lambda: gpu_fault.ours([_line("pid=1 0000:")], None, ()),
    "kernel-lines": lambda: gpu_fault.explain(
        [],
        wire.KernelLog("dmesg", (_line("NVRM: Xid (PCI:0000:3b:00): 154, recovery action changed from "),), None),
        None,
        None,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_900_kb_line_costs_each_pattern_a_bounded_time(name: str) -> None:
    start = time.process_time()
    CASES[name]()
    assert time.process_time() - start < 0.5, name
