"""dflashctl doctor: every condition is reported by the real CLI with its own line and exit code."""

from __future__ import annotations

import socket
import typing as t
from pathlib import Path

import pytest

from ops import doctor
from ops.hosts import parse_inventory
from testkit import PveHosts
from testkit.hostsfile import dump_hosts
from testkit.sshd import keygen


def checks(result: t.Any, host: str = "pve") -> dict[str, dict[str, t.Any]]:
    data = result.json()
    report = next(h for h in data["hosts"] if h["host"] == host)
    return {c["check"]: c for c in report["checks"]}


def statuses(result: t.Any, host: str = "pve") -> dict[str, str]:
    return {name: c["status"] for name, c in checks(result, host).items()}


def test_everything_passes_on_both_hosts(pve_hosts: PveHosts) -> None:
    r = pve_hosts.cli("doctor", "--json", timeout=180)
    assert r.exit_code == 0, r.output
    data = r.json()
    assert data["ok"] is True and [h["host"] for h in data["hosts"]] == ["pve", "local"]
    pve = statuses(r)
    assert pve == {
        "reachable": "ok",
        "host-key": "ok",
        "login": "ok",
        "container": "ok",
        "tmux": "ok",
        "python": "ok",
        "packages": "ok",
        "torch": "ok",
        "kernels": "skip",
        "plan": "skip",
        "disk": "ok",
        "nvidia-smi": "skip",
        "gpu-health": "skip",
    }
    c = checks(r)
    assert c["plan"]["detail"] == "hosts.pve.command names no --config: no run to plan"
    assert c["tmux"]["detail"].startswith("tmux 3.")
    assert c["packages"]["detail"] == "imports transformers, safetensors, accelerate, numpy, click" and c["torch"][
        "detail"
    ].startswith("torch 2.")
    assert "GiB free" in c["disk"]["detail"] and "ct 200 running since" in c["container"]["detail"]
    assert "SHA256:" in c["host-key"]["detail"]
    local = statuses(r, "local")
    assert local["reachable"] == "ok" and "container" not in local and "host-key" not in local


def _text_lines(stdout: str) -> dict[str, str]:
    lines = {}
    for line in stdout.splitlines()[1:]:
        status, name, *rest = line.split(maxsplit=2)
        lines[name] = f"{status} {rest[0] if rest else ''}"
    return lines


def test_sshd_down_is_unreachable_refused(pve_hosts: PveHosts) -> None:
    pve_hosts.sshd.stop()
    r = pve_hosts.cli("--host", "pve", "doctor")
    assert r.exit_code == 10
    lines = _text_lines(r.stdout)
    assert lines["reachable"].startswith("FAIL cannot connect to 127.0.0.1:")
    assert all(
        lines[n].startswith("skip reachable failed") for n in ("host-key", "login", "container", "tmux", "nvidia-smi")
    )
    j = pve_hosts.cli("--host", "pve", "doctor", "--json")
    assert j.exit_code == 10 and checks(j)["reachable"]["cause"] == "refused"


def test_silent_port_is_unreachable_timeout(pve_hosts: PveHosts) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(5)
        pve_hosts.write(port=silent.getsockname()[1], connect_timeout=1)
        r = pve_hosts.cli("--host", "pve", "doctor", "--json")
    assert r.exit_code == 10
    assert checks(r)["reachable"]["cause"] == "timeout" and "no SSH banner" in checks(r)["reachable"]["detail"]


def test_unknown_host_key(pve_hosts: PveHosts, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("")
    pve_hosts.write(known_hosts=str(empty))
    r = pve_hosts.cli("--host", "pve", "doctor")
    assert r.exit_code == 10
    lines = _text_lines(r.stdout)
    assert lines["reachable"].startswith("ok ")
    assert (
        lines["host-key"].startswith("FAIL unknown: ")
        and "trust-host" in lines["host-key"]
        and "SHA256:" in lines["host-key"]
    )
    assert lines["login"].startswith("skip host-key failed")


def test_changed_host_key(pve_hosts: PveHosts) -> None:
    pve_hosts.sshd.rotate_host_key()
    r = pve_hosts.cli("--host", "pve", "doctor", "--json")
    assert r.exit_code == 10
    c = checks(r)["host-key"]
    assert (c["status"], c["cause"]) == ("fail", "host-key")
    assert c["detail"].startswith("CHANGED: ") and "--replace" in c["detail"]


def test_wrong_client_key(pve_hosts: PveHosts, tmp_path: Path) -> None:
    keygen(tmp_path / "stranger", "stranger")
    pve_hosts.write(identity_file=str(tmp_path / "stranger"))
    r = pve_hosts.cli("--host", "pve", "doctor", "--json")
    assert r.exit_code == 10
    c = checks(r)
    assert (c["host-key"]["status"], c["login"]["status"], c["login"]["cause"]) == ("ok", "fail", "auth")
    assert "authentication failed for root@127.0.0.1" in c["login"]["detail"]
    assert c["container"]["status"] == "skip"


def test_stopped_container(pve_hosts: PveHosts) -> None:
    pve_hosts.pve.stop(200)
    r = pve_hosts.cli("--host", "pve", "doctor")
    assert r.exit_code == 9
    lines = _text_lines(r.stdout)
    assert lines["login"].startswith("ok ")
    assert lines["container"] == f"FAIL ct 200 is stopped; start it on the host with `{pve_hosts.pve.pct} start 200`"
    assert lines["tmux"].startswith("skip container failed")


def test_missing_container(pve_hosts: PveHosts) -> None:
    pve_hosts.pve.destroy(200)
    r = pve_hosts.cli("--host", "pve", "doctor", "--json")
    assert r.exit_code == 9
    c = checks(r)["container"]
    assert (c["status"], c["cause"]) == ("fail", "missing") and "does not exist" in c["detail"]


def test_python_missing_in_the_container(pve_hosts: PveHosts) -> None:
    pve_hosts.write(python="/opt/no-python/bin/python3")
    r = pve_hosts.cli("--host", "pve", "doctor", "--json")
    assert r.exit_code == 1
    s = statuses(r)
    assert (s["container"], s["tmux"], s["python"], s["packages"], s["torch"], s["disk"]) == (
        "ok",
        "ok",
        "fail",
        "skip",
        "skip",
        "ok",
    )
    assert (
        "/opt/no-python/bin/python3" in checks(r)["python"]["detail"]
        and "hosts.pve.python" in checks(r)["python"]["detail"]
    )


def test_most_basic_failure_decides_the_exit_code(pve_hosts: PveHosts) -> None:
    pve_hosts.write(python="/opt/no-python/bin/python3")  # a python failure (1) ...
    pve_hosts.pve.stop(200)  # ... behind a stopped container (9): 9 wins
    r = pve_hosts.cli("--host", "pve", "doctor")
    assert r.exit_code == 9


def _local_host(tmp_path: Path, python: str = "/opt/no-python/bin/python3") -> t.Any:
    text = dump_hosts(
        None, {"l": {"transport": "local", "workdir": str(tmp_path / "w"), "python": python, "command": "true"}}
    )
    return parse_inventory(text, path=None, base=tmp_path).get()


def test_nvidia_smi_present_and_failing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU cannot run here: a stand-in nvidia-smi with the real output shapes.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0, NVIDIA H200, 143771 MiB\\n1, NVIDIA H200, 143771 MiB\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    report = doctor.diagnose(_local_host(tmp_path))
    gpu = next(c for c in report.checks if c.name == "nvidia-smi")
    assert (gpu.status, gpu.detail) == ("ok", "2 GPU(s): 0, NVIDIA H200, 143771 MiB; 1, NVIDIA H200, 143771 MiB")

    smi.write_text(
        '#!/bin/sh\necho "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\nexit 9\n'
    )
    report = doctor.diagnose(_local_host(tmp_path))
    gpu = next(c for c in report.checks if c.name == "nvidia-smi")
    assert gpu.status == "fail" and "couldn't communicate with the NVIDIA driver" in gpu.detail


def test_render_has_one_line_per_check(tmp_path: Path) -> None:
    report = doctor.diagnose(_local_host(tmp_path))
    text = report.render().splitlines()
    assert text[0] == "l"
    assert [ln.split()[1] for ln in text[1:]] == [c.name for c in report.checks]
    assert {ln.split()[0] for ln in text[1:]} <= {"ok", "FAIL", "skip"}
