"""``dflashctl doctor``: check, in order, everything a run on a host depends on.

Each check is ``ok``, ``fail`` (with the reason and, where one exists, the typed error that decides
the exit code) or ``skip`` (not applicable, or an earlier failure makes it moot). The order is
from the most basic up: reachable, host-key, login, container, tmux, python, packages, torch, kernels
(a hybrid target's linear-attention kernels), disk, nvidia-smi, gpu-health (ECC, row remapping, slowdowns per
GPU: ``warn`` is said and passes). Diagnosing never raises because something is down: down is a failed check.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import typing as t

from ops import errors, gpu_health
from ops.deploy import REQUIRED_MODULES
from ops.hosts import Host
from ops.proxmox import Container
from ops.remote import container_of
from ops.transport import CommandResult, LocalTransport, Transport

logger = logging.getLogger(__name__)

OK, FAIL, SKIP, WARN = "ok", "fail", "skip", "warn"
MIN_FREE_BYTES = 1 << 30  # below 1 GiB a checkpoint write will fail
TMUX_MIN = (2, 1)  # the stderr texts dflashctl classifies (docs/design.md section 6)

# One call inside the target: facts about the interpreter, printed as one JSON line.
PYTHON_PROBE = r"""
import json, sys
facts = {"version": sys.version.split()[0], "executable": sys.executable}
facts["missing"] = []
for name in sys.argv[1:]:
    try:
        __import__(name)
    except Exception as e:
        facts["missing"].append(f"{name} ({type(e).__name__}: {e})")
try:
    import torch
    facts["torch"] = torch.__version__
    facts["cuda"] = bool(torch.cuda.is_available())
    facts["gpus"] = torch.cuda.device_count() if facts["cuda"] else 0
except Exception as e:
    facts["torch_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(facts))
"""

# The run's target and the kernels its linear-attention (Gated DeltaNet) layers need: the same rule as
# dflash/model/kernels.py, stdlib only (the far side has no dflash to import). argv: the run config as the command
# names it, the host's workdir (the command runs in <workdir>/current). One JSON line.
KERNEL_PROBE = r"""
import importlib.util, json, os, sys
def out(**kw):
    print(json.dumps(kw))
    sys.exit(0)
name, workdir = sys.argv[1], sys.argv[2]
cwd = os.path.join(workdir, "current") if os.path.isdir(os.path.join(workdir, "current")) else workdir
path = os.path.join(cwd, os.path.expanduser(name))
try:
    import tomllib
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
except (ImportError, OSError, ValueError) as e:
    out(skip=f"cannot read the run config {path}: {e}")
target = cfg.get("target")
if not isinstance(target, dict) or not isinstance(target.get("path"), str):
    out(skip="the run builds its target from [target.tiny]")
tp = os.path.expanduser(target["path"])
if not os.path.isabs(tp):  # dflash's rule: next to the config first, then the working directory
    beside = os.path.join(os.path.dirname(path), tp)
    tp = beside if os.path.exists(beside) else os.path.join(cwd, tp)
try:
    with open(os.path.join(tp, "config.json")) as f:
        c = json.load(f)
except (OSError, ValueError) as e:
    out(skip=f"cannot read the target's config.json in {tp}: {e}")
text = c.get("text_config") if isinstance(c.get("text_config"), dict) else {}
types = c.get("layer_types") or text.get("layer_types") or []
linear = sum(1 for kind in types if kind == "linear_attention")
kernels = (("flash-linear-attention", "fla"), ("causal-conv1d", "causal_conv1d"))
out(target=tp, linear=linear, missing=[pip for pip, mod in kernels if importlib.util.find_spec(mod) is None])
"""
KERNELS_HINT = "pip install flash-linear-attention causal-conv1d"

# Free space where the run directory is (or would be): df of its nearest existing ancestor.
# A constant script; the path arrives as "$1", never spliced into the text.
DISK_PROBE = 'p=$1; while [ ! -e "$p" ]; do p=$(dirname -- "$p"); done; df -P -k -- "$p"'


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail" | "skip"
    detail: str
    error: errors.OpsError | None = dataclasses.field(default=None, compare=False)

    @property
    def cause(self) -> str | None:
        return getattr(self.error, "cause", None) if self.error is not None else None

    def to_json(self) -> dict[str, t.Any]:
        return {"check": self.name, "status": self.status, "detail": self.detail, "cause": self.cause}


@dataclasses.dataclass
class HostReport:
    host: str
    label: str
    checks: list[Check] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    @property
    def first_failure(self) -> Check | None:
        return next((c for c in self.checks if c.status == FAIL), None)

    def to_json(self) -> dict[str, t.Any]:
        return {"host": self.host, "ok": self.ok, "checks": [c.to_json() for c in self.checks]}

    def render(self) -> str:
        lines = [self.label]
        for c in self.checks:
            first, *more = c.detail.split("\n")  # gpu-health: a line per GPU
            lines.append(f"  {c.status.upper() if c.status == FAIL else c.status:<5} {c.name:<11} {first}")
            lines.extend(f"{'':<19}{x}" for x in more)
        return "\n".join(lines)


def reports_json(reports: t.Sequence[HostReport]) -> str:
    return json.dumps({"ok": all(r.ok for r in reports), "hosts": [r.to_json() for r in reports]}, indent=2)


class _Report:
    """Collects checks; once something basic fails, the checks that need it are skipped."""

    def __init__(self, report: HostReport) -> None:
        self.report = report
        self.blocked: str | None = None

    def add(self, name: str, status: str, detail: str, error: errors.OpsError | None = None) -> None:
        self.report.checks.append(Check(name, status, detail, error))

    def fail(self, name: str, detail: str, error: errors.OpsError | None = None, *, blocks: bool = False) -> None:
        self.add(name, FAIL, detail, error)
        if blocks:
            self.blocked = f"{name} failed"

    def skip_rest(self, names: t.Sequence[str]) -> None:
        for n in names:
            self.add(n, SKIP, self.blocked or "not checked")


INSIDE_CHECKS = ("tmux", "python", "packages", "torch", "kernels", "plan", "disk", "nvidia-smi", "gpu-health")
# `dflash plan` of the run config in the deployed release (else the workdir): the box's own GPUs and RAM
PLAN_SHELL = 'cd "$1" 2>/dev/null || cd "$2" || exit 2; shift 2; exec "$@"'


def diagnose(host: Host) -> HostReport:
    """Run every check for ``host``; never raises for a host or container that is down."""
    rep = _Report(HostReport(host.name, host.label))
    if host.is_local:
        rep.add("reachable", OK, "this machine (transport = local)")
        local = LocalTransport()
        ct = container_of(host, local)  # dflashctl on the Proxmox host itself: pct exec, no ssh
        if ct is None:
            _inside(rep, host, local)
        elif _container(rep, host, ct):
            _inside(rep, host, ct)
        else:
            rep.skip_rest(INSIDE_CHECKS)
        return rep.report

    from ops.transport import SSHTransport, scan_host_key  # here: paramiko, for ssh hosts only

    try:
        scan = scan_host_key(host)
    except errors.UnreachableError as e:
        rep.fail("reachable", e.detail, e, blocks=True)
        rep.skip_rest(("host-key", "login", *(("container",) if host.container is not None else ()), *INSIDE_CHECKS))
        return rep.report
    except errors.ConfigError as e:
        rep.fail("reachable", str(e), e, blocks=True)
        rep.skip_rest(("host-key", "login", *(("container",) if host.container is not None else ()), *INSIDE_CHECKS))
        return rep.report
    tgt = scan.target
    via = f" via {tgt.proxy_jump.hostname}:{tgt.proxy_jump.port}" if tgt.proxy_jump else ""
    rep.add("reachable", OK, f"{tgt.hostname}:{tgt.port} answers{via}")
    rest = ("login", *(("container",) if host.container is not None else ()), *INSIDE_CHECKS)
    if scan.verdict == "known":
        files = sorted({f for f, _, fp in scan.recorded if fp == scan.fingerprint})
        note = f"; {scan.note}" if scan.note else ""
        rep.add("host-key", OK, f"{scan.key_type} {scan.fingerprint} (pinned in {', '.join(files)}{note})")
    elif scan.verdict == "revoked":
        from ops.transport import revoked_error  # here: paramiko, for ssh hosts only

        revoked = revoked_error(tgt, scan.key, scan.revoked_at)
        rep.fail("host-key", revoked.detail, revoked, blocks=True)
        rep.skip_rest(rest)
        return rep.report
    else:
        changed = scan.verdict == "changed"
        old = next((fp for _, _, fp in scan.recorded), None)
        detail = (
            f"CHANGED: known_hosts has {old}, the server offers {scan.key_type} {scan.fingerprint}; "
            f"if expected, run: dflashctl --host {host.name} trust-host --replace"
            if changed
            else f"unknown: {tgt.known_name} offers {scan.key_type} {scan.fingerprint}, in none of {', '.join(tgt.known_hosts)}; "
            f"check it, then run: dflashctl --host {host.name} trust-host"
        ) + (f" ({scan.note})" if scan.note else "")
        err = errors.HostKeyRejected(
            host.name, detail, fingerprint=scan.fingerprint, changed=changed, expected=old, key_type=scan.key_type
        )
        rep.fail("host-key", detail, err, blocks=True)
        rep.skip_rest(rest)
        return rep.report

    try:
        transport = SSHTransport.connect(host)
    except (errors.UnreachableError, errors.ConfigError) as e:
        rep.fail("login", getattr(e, "detail", str(e)), e, blocks=True)
        rep.skip_rest(rest[1:])
        return rep.report
    with transport:
        keys = ", ".join(tgt.key_files) or "ssh-agent/default keys"
        rep.add("login", OK, f"{tgt.where} with {keys}")
        where: Transport | Container = transport
        ct = container_of(host, transport)
        if ct is not None:
            if not _container(rep, host, ct):
                rep.skip_rest(INSIDE_CHECKS)
                return rep.report
            where = ct
        _inside(rep, host, where)
    return rep.report


def _container(rep: _Report, host: Host, ct: Container) -> bool:
    try:
        status = ct.status()
    except errors.OpsError as e:
        rep.fail("container", f"cannot get the status of ct {ct.vmid}: {e}", e, blocks=True)
        return False
    pct = " ".join(host.pct)
    if status == "running":
        booted = None
        try:
            booted = ct.booted_at()
        except errors.OpsError as e:
            logger.info("booted_at of ct %s: %s", ct.vmid, e)
        since = f" since {booted.strftime('%Y-%m-%dT%H:%M:%SZ')}" if booted else ""
        rep.add("container", OK, f"ct {ct.vmid} running{since}")
        return True
    if status == "stopped":
        detail = f"ct {ct.vmid} is stopped; start it on the host with `{pct} start {ct.vmid}`"
    else:
        detail = f"ct {ct.vmid} does not exist on this host (no nodes/*/lxc/{ct.vmid}.conf); check hosts.{host.name}.container"
    rep.fail("container", detail, errors.ContainerDown(ct.vmid, status, detail), blocks=True)
    return False


def _run(where: Transport | Container, argv: list[str], timeout: float = 60) -> CommandResult | errors.OpsError:
    try:
        return where.run(argv, timeout=timeout)
    except errors.OpsError as e:
        return e


def _inside(rep: _Report, host: Host, where: Transport | Container) -> None:
    # tmux
    res = _run(where, ["tmux", "-V"], timeout=30)
    if isinstance(res, errors.OpsError):
        rep.fail("tmux", str(res), res)
    elif res.exit_code == 0:
        text = res.out.strip()
        version = _version(text)
        if version and version < TMUX_MIN:
            rep.fail("tmux", f"{text}: too old, dflashctl needs tmux >= 2.1")
        else:
            rep.add("tmux", OK, text)
    else:
        rep.fail("tmux", f"tmux not found or not working: {_why(res)}; install it (apt-get install tmux)")

    # python, the training packages, torch: one call
    packages = [m for m in REQUIRED_MODULES if m != "torch"]
    res = _run(where, [host.python, "-c", PYTHON_PROBE, *packages], timeout=120)
    facts: dict[str, t.Any] | None = None
    if isinstance(res, errors.OpsError):
        rep.fail("python", str(res), res)
    elif res.exit_code == 0:
        try:
            facts = json.loads(res.out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            rep.fail("python", f"{host.python} ran but printed no facts: {_why(res)}")
    else:
        rep.fail("python", f"cannot run {host.python!r} (hosts.{host.name}.python): {_why(res)}")
    if facts is None:
        rep.add("packages", SKIP, "python failed")
        rep.add("torch", SKIP, "python failed")
    else:
        rep.add("python", OK, f"{host.python}: Python {facts.get('version')}")
        if not facts.get("missing"):
            rep.add("packages", OK, f"imports {', '.join(packages)}")
        else:
            rep.fail(
                "packages",
                f"{host.python} cannot import {'; '.join(facts['missing'])}; dflashctl deploy --install installs them",
            )
        if "torch" in facts:
            gpus = f", CUDA, {facts.get('gpus')} GPU(s)" if facts.get("cuda") else ", no CUDA"
            rep.add("torch", OK, f"torch {facts['torch']}{gpus}")
        else:
            rep.fail("torch", f"{host.python} cannot import torch ({facts.get('torch_error')})")

    _kernels(rep, host, where, facts)

    # disk
    res = _run(where, ["sh", "-c", DISK_PROBE, "sh", host.run_dir], timeout=30)
    if isinstance(res, errors.OpsError):
        rep.fail("disk", str(res), res)
    else:
        free = _df_free(res)
        if free is None:
            rep.fail("disk", f"cannot read free space for {host.run_dir}: {_why(res)}")
        elif free[0] < MIN_FREE_BYTES:
            rep.fail("disk", f"only {_gib(free[0])} free at {free[1]} (run_dir {host.run_dir}); checkpoints need room")
        else:
            rep.add("disk", OK, f"{_gib(free[0])} free at {free[1]} (run_dir {host.run_dir})")

    # nvidia-smi: optional (a CPU box has none)
    res = _run(where, ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"], timeout=60)
    if isinstance(res, errors.OpsError):
        rep.fail("nvidia-smi", str(res), res)
    elif res.exit_code == 0:
        listed = [ln.strip() for ln in res.out.splitlines() if ln.strip()]
        rep.add("nvidia-smi", OK, f"{len(listed)} GPU(s): " + "; ".join(listed) if listed else "no GPU listed")
        rep.report.checks.append(health_check(where))
        return
    elif res.exit_code in (126, 127) or "not found" in res.err or "No such file" in res.err:
        rep.add("nvidia-smi", SKIP, "not installed (no NVIDIA GPU visible here)")
    else:
        rep.fail("nvidia-smi", f"nvidia-smi failed: {_why(res)}")
    rep.add("gpu-health", SKIP, "nvidia-smi did not answer")


def health_check(where: Transport | Container) -> Check:
    """ECC errors, row remapping and forced slowdowns of each GPU, one line each (ops/gpu_health.py)."""
    res = _run(where, list(gpu_health.ARGV), timeout=60)
    if isinstance(res, errors.OpsError):
        return Check("gpu-health", FAIL, str(res), res)
    # nvidia-smi exits non-zero when a GPU does not answer, and still judges the others: read both streams
    found = gpu_health.parse(f"{res.out}\n{res.err}")
    if res.exit_code != 0 and not found:
        return Check("gpu-health", FAIL, f"{' '.join(gpu_health.ARGV)} failed: {_why(res)}")
    if not found:
        return Check("gpu-health", SKIP, "nvidia-smi -q listed no GPU")
    worst = FAIL if any(g.status == FAIL for g in found) else WARN if any(g.status == WARN for g in found) else OK
    return Check("gpu-health", worst, "\n".join(g.line() for g in found))


def run_config(command: t.Sequence[str]) -> str | None:
    """The run config a training command names (``--config PATH`` or ``--config=PATH``), else None."""
    for i, arg in enumerate(command):
        if arg == "--config" and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _kernels(rep: _Report, host: Host, where: Transport | Container, facts: dict[str, t.Any] | None) -> None:
    if facts is None:
        rep.add("kernels", SKIP, "python failed")
        rep.add("plan", SKIP, "python failed")
        return
    rep.report.checks.append(kernel_check(host, where))
    rep.report.checks.append(plan_check(host, where))


def plan_check(host: Host, where: Transport | Container) -> Check:
    """Will the host's run fit: ``dflash plan`` of the run config its command names, where the run lives (the
    box's GPUs and RAM); its table as the detail, or its one line when it does not fit."""
    config = run_config(host.command)
    if config is None:
        return Check("plan", SKIP, f"hosts.{host.name}.command names no --config: no run to plan")
    release = os.path.join(host.workdir, "current")
    argv = [
        "sh",
        "-c",
        PLAN_SHELL,
        "sh",
        release,
        host.workdir,
        host.python,
        "-m",
        "dflash",
        "plan",
        "--config",
        config,
    ]
    res = _run(where, argv, timeout=300)
    if isinstance(res, errors.OpsError):
        return Check("plan", FAIL, str(res), res)
    if res.exit_code == 0:
        return Check("plan", OK, "\n".join(ln for ln in res.out.strip().splitlines() if ln.strip()))
    if res.exit_code == 1 and res.err.strip().startswith("dflash plan:"):
        return Check("plan", FAIL, res.err.strip().splitlines()[-1])
    return Check("plan", SKIP, f"cannot plan {config}: {_why(res)}")  # not deployed, no target there yet


def kernel_check(host: Host, where: Transport | Container) -> Check:
    """A target with linear-attention (Gated DeltaNet) layers needs flash-linear-attention and causal-conv1d:
    the run config the host's command names, its target's config.json, and the host python's imports."""
    config = run_config(host.command)
    if config is None:
        return Check("kernels", SKIP, f"hosts.{host.name}.command names no --config: no target to look at")
    res = _run(where, [host.python, "-c", KERNEL_PROBE, config, host.workdir], timeout=60)
    if isinstance(res, errors.OpsError):
        return Check("kernels", FAIL, str(res), res)
    try:
        got = json.loads(res.out.strip().splitlines()[-1]) if res.exit_code == 0 else None
    except (ValueError, IndexError):
        got = None
    if not isinstance(got, dict):
        return Check("kernels", FAIL, f"cannot look at the run's target: {_why(res)}")
    if "skip" in got:
        return Check("kernels", SKIP, str(got["skip"]))
    if not got.get("linear"):
        return Check("kernels", SKIP, f"the target in {got.get('target')} has no linear-attention layers")
    if got.get("missing"):
        return Check(
            "kernels",
            FAIL,
            f"the target in {got.get('target')} has {got['linear']} linear-attention (Gated DeltaNet) layers but "
            f"{host.python} cannot import {', '.join(got['missing'])}: transformers would run them as a slow Python "
            f"loop; {KERNELS_HINT}",
        )
    return Check(
        "kernels",
        OK,
        f"the target's {got['linear']} linear-attention layers: flash-linear-attention and causal-conv1d importable",
    )


def _why(res: CommandResult) -> str:
    text = (res.err.strip() or res.out.strip()).splitlines()
    last = text[-1] if text else "no output"
    if res.timed_out:
        return f"no answer (timed out); {last}"
    return f"{last} (exit {res.exit_code if res.exit_code is not None else 'signal ' + str(res.signal)})"


def _version(text: str) -> tuple[int, int] | None:
    m = re.search(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _df_free(res: CommandResult) -> tuple[int, str] | None:
    if res.exit_code != 0:
        return None
    lines = res.out.strip().splitlines()
    if len(lines) < 2:
        return None
    fields = lines[-1].split()
    try:
        return int(fields[3]) * 1024, fields[-1]
    except (IndexError, ValueError):
        return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
