"""FakePve: a fake Proxmox host on this machine, driven through the fake ``pct`` (testkit/pct.py)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testkit import pct as pct_program

# Container-visible test folders live outside /tmp: a container has its own tmpfs there.
BASE = "/var/tmp"


def shared_tmp_paths() -> list[str]:
    """Folders the tests run from that a container must see: the checkout and the interpreter's prefix."""
    repo = Path(__file__).resolve().parents[1]
    found: list[str] = []
    for p in (str(repo), sys.prefix, os.path.realpath(sys.prefix)):
        if p.startswith("/tmp/") and not any(p == f or p.startswith(f + "/") for f in found):
            found.append(p)
    return found


class FakePve:
    """A fake PVE node: ``pct`` (a script for hosts.toml), containers as real namespaces.

    ``root`` holds ``state/`` (what pct reads), ``bin/pct`` and ``fs/`` (folders that the
    host and every container see at the same path: put workdir and run_dir there).
    """

    def __init__(
        self, root: str | os.PathLike[str] | None = None, *, node: str = "pve", python: str = sys.executable
    ) -> None:
        self.owns_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="dflash-pve-", dir=BASE))
        if str(self.root).startswith("/tmp/") or str(self.root) == "/tmp":
            raise ValueError(f"FakePve root must be outside /tmp (containers mount their own /tmp): {self.root}")
        self.node = node
        self.state = self.root / "state"
        self.fs = self.root / "fs"
        for d in (self.state / "nodes" / node / "lxc", self.state / "run", self.fs, self.root / "bin"):
            d.mkdir(parents=True, exist_ok=True)
        (self.state / "node").write_text(node + "\n")
        self.pct = self.root / "bin" / "pct"
        self.pct.write_text(
            "#!/bin/sh\n"
            f'exec {shlex.quote(python)} {shlex.quote(pct_program.__file__)} --state {shlex.quote(str(self.state))} "$@"\n'
        )
        self.pct.chmod(0o755)

    # -- the host's kernel log -----------------------------------------------------------------

    @property
    def bin(self) -> Path:
        """The host's own commands (pct, and the kernel log's): put it first on PATH of what runs "on the host"."""
        return self.root / "bin"

    def kernel_log(self, *lines: str) -> None:
        """The host's kernel log says ``lines``: ``journalctl -k ...`` prints them (write them as ``-o
        short-iso`` does); ``dmesg`` is refused, as an unprivileged reader's is."""
        (self.root / "kernel.log").write_text("".join(f"{x}\n" for x in lines))
        journal = self.bin / "journalctl"
        journal.write_text(f"#!/bin/sh\nexec cat {shlex.quote(str(self.root / 'kernel.log'))}\n")
        dmesg = self.bin / "dmesg"
        dmesg.write_text("#!/bin/sh\necho 'dmesg: read kernel buffer failed: Operation not permitted' >&2\nexit 1\n")
        for exe in (journal, dmesg):
            exe.chmod(0o755)

    # -- containers ---------------------------------------------------------------------------

    def create(self, vmid: int = 200, *, start: bool = False) -> int:
        conf = self.state / "nodes" / self.node / "lxc" / f"{vmid}.conf"
        lines = [
            "arch: amd64",
            f"hostname: ct{vmid}",
            "memory: 2048",
            "ostype: debian",
            f"rootfs: local-lvm:vm-{vmid}-disk-0,size=8G",
        ]
        # This checkout and its venv, bind-mounted like PVE's mpN when they live under the host's /tmp
        # (a CI clone may): the container mounts its own /tmp and would not see them otherwise.
        lines += [f"mp{i}: {p},mp={p}" for i, p in enumerate(shared_tmp_paths())]
        conf.write_text("\n".join(lines) + "\n")
        if start:
            self.start(vmid)
        return vmid

    def pct_run(
        self, *args: str | int, input: bytes | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[bytes]:
        """Run the fake pct on this machine (as the host would) and return what it did."""
        return subprocess.run([str(self.pct), *map(str, args)], input=input, capture_output=True, timeout=timeout)

    def _check(self, *args: str | int) -> None:
        r = self.pct_run(*args)
        if r.returncode != 0:
            raise RuntimeError(
                f"pct {' '.join(map(str, args))}: exit {r.returncode}: {r.stderr.decode(errors='replace').strip()}"
            )

    def start(self, vmid: int = 200) -> None:
        self._check("start", vmid)

    def stop(self, vmid: int = 200) -> None:
        self._check("stop", vmid)

    def reboot(self, vmid: int = 200) -> None:
        self._check("reboot", vmid)

    def destroy(self, vmid: int = 200) -> None:
        if self.init_pid(vmid) is not None:
            self.stop(vmid)
        self._check("destroy", vmid)

    def init_pid(self, vmid: int = 200) -> int | None:
        """Host pid of the container's init, None when it is stopped."""
        info = pct_program.State(self.state).init_info(str(vmid))
        return int(info["pid"]) if info else None

    def run_in(
        self, vmid: int, argv: list[str], *, input: bytes | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[bytes]:
        """``pct exec <vmid> -- argv`` on this machine, for assertions about the inside."""
        return self.pct_run("exec", vmid, "--", *argv, input=input, timeout=timeout)

    def close(self) -> None:
        """Kill every container init this state dir knows (by pid), then remove the folders."""
        for f in (self.state / "run").glob("*.json"):
            vmid = f.stem
            try:
                pid = int(json.loads(f.read_text())["pid"])
            except (OSError, ValueError, KeyError):
                continue
            if pct_program.is_our_init(pid, self.state, vmid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                deadline = time.monotonic() + 10
                while pct_program.is_our_init(pid, self.state, vmid) and time.monotonic() < deadline:
                    time.sleep(0.01)
            f.unlink(missing_ok=True)
        if self.owns_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> FakePve:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
