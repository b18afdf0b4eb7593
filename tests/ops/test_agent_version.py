"""A release deployed by another dflashctl: its agent answers another protocol number, or is not where this
dflashctl looks for it (ops/far/agent.py). Either way every command says, in one line, to run `dflashctl
deploy`, with the exit code it has for that kind of error; `status` still answers from tmux."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ops.far import protocol
from ops.session import AGENT_PROTOCOL
from testkit import PveHosts
from testkit.runkit import REPO

REDEPLOY = "run `dflashctl deploy`"


def older_checkout(root: Path, *, protocol_number: int | None = None, agent_at_top: bool = False) -> Path:
    """This checkout as another dflashctl version had it: another PROTOCOL, or the agent, the runner and tmux
    in ops/ (their place before they moved into ops/far)."""
    for name in ("dflash", "ops", "configs", "pyproject.toml", "README.md"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, root / name)
    if protocol_number is not None:
        path = root / "ops" / "far" / "protocol.py"
        text = path.read_text()
        assert f"\nPROTOCOL = {protocol.PROTOCOL}\n" in text
        path.write_text(text.replace(f"\nPROTOCOL = {protocol.PROTOCOL}\n", f"\nPROTOCOL = {protocol_number}\n", 1))
    if agent_at_top:
        for name in ("agent.py", "runner.py", "tmux.py"):
            (root / "ops" / "far" / name).rename(root / "ops" / name)
    return root


def status(pve_hosts: PveHosts) -> tuple[int, dict[str, object]]:
    r = pve_hosts.cli("status", "--json")
    assert r.stdout.strip(), r.stderr
    return r.exit_code, json.loads(r.stdout)


def test_both_sides_read_one_protocol_number() -> None:
    assert AGENT_PROTOCOL == protocol.PROTOCOL


def test_an_older_agent_over_ssh_and_pct_says_redeploy(pve_hosts: PveHosts) -> None:
    """A real release (deployed through sshd + pct exec) whose agent answers protocol 0."""
    older = older_checkout(pve_hosts.root / "older", protocol_number=0)
    r = pve_hosts.cli("deploy", "--source", str(older), timeout=180)
    assert r.exit_code == 0, r.output
    line = f"the deployed agent speaks protocol 0, this dflashctl {protocol.PROTOCOL}: {REDEPLOY}"

    code, st = status(pve_hosts)
    assert (code, st["state"], st["mode"]) == (7, "not-started", "fallback")  # exit 7: not-started, as ever
    assert line in st["evidence"][0]

    r = pve_hosts.cli("start")
    assert (r.exit_code, r.stdout, r.stderr) == (1, "", f"dflashctl: {line}\n")  # AgentError: ERROR (1)
    assert not (pve_hosts.run_dir / "dflash").exists()  # nothing was started

    r = pve_hosts.cli("deploy", timeout=180)  # what the line says to do
    assert r.exit_code == 0, r.output
    code, st = status(pve_hosts)
    assert (code, st["state"], st["mode"]) == (7, "not-started", "agent")


def test_a_release_from_before_the_far_folder_says_redeploy(pve_hosts: PveHosts) -> None:
    """A real release whose agent is ops/agent.py (the layout before ops/far held it): no agent where this
    dflashctl looks, which is not "nothing is deployed"."""
    older = older_checkout(pve_hosts.root / "older", agent_at_top=True)
    r = pve_hosts.cli("deploy", "--source", str(older), timeout=180)
    assert r.exit_code == 0, r.output
    current = pve_hosts.workdir / "current"
    line = f"the release at {current} does not have this dflashctl's agent (no module ops.far.agent): {REDEPLOY}"

    code, st = status(pve_hosts)
    assert (code, st["state"], st["mode"]) == (7, "not-started", "fallback")
    assert st["evidence"][0].startswith(f"fallback mode: {line}")

    r = pve_hosts.cli("start")
    assert (r.exit_code, r.stdout, r.stderr) == (1, "", f"dflashctl: pve (ct 200): {line}\n")
    r = pve_hosts.cli("stop")
    assert (r.exit_code, r.stderr) == (1, f"dflashctl: pve (ct 200): {line}\n")
