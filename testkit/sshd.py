"""A real OpenSSH sshd on 127.0.0.1 with throwaway keys, started and stopped by pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def keygen(path: Path, comment: str) -> None:
    """An ed25519 key pair at ``path`` and ``path.pub``, no passphrase."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )


class Sshd:
    """``/usr/sbin/sshd -D -e -f /dev/null`` with every setting given as ``-o``.

    ``stop()``/``start()`` keep the port and the keys ("sshd down for a while, then back");
    ``rotate_host_key()`` gives the server a new host key (the "changed host key" case).
    """

    def __init__(
        self, root: Path, *, port: int | None = None, user: str = "root", login_shell: str | None = None
    ) -> None:
        from testkit import free_port

        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self.port = port or free_port()
        self.user = user
        # Another login shell for ``user`` (e.g. /usr/bin/fish): sshd then runs in its own mount
        # namespace over a copy of /etc/passwd that says so (HOME there: root/home). The real
        # /etc/passwd and the real user's home are never touched.
        self.login_shell = login_shell
        self.passwd = self.root / "passwd"
        if login_shell is not None:
            self._write_passwd(login_shell)
        self.host_key = self.root / "ssh_host_ed25519_key"
        self.client_key = self.root / "id_ed25519"
        self.authorized_keys = self.root / "authorized_keys"
        self.known_hosts = self.root / "known_hosts"
        self.log = self.root / "sshd.log"
        self.pid_file = self.root / "sshd.pid"
        self.proc: subprocess.Popen[bytes] | None = None
        keygen(self.host_key, "dflash-test-host")
        keygen(self.client_key, "dflash-test-client")
        self.authorized_keys.write_text(Path(f"{self.client_key}.pub").read_text())
        self.pin()

    def _write_passwd(self, shell: str) -> None:
        home = self.root / "home"
        home.mkdir(exist_ok=True)
        lines = []
        for line in Path("/etc/passwd").read_text().splitlines():
            f = line.split(":")
            if len(f) == 7 and f[0] == self.user:
                f[5], f[6] = str(home), shell
                line = ":".join(f)
            lines.append(line)
        self.passwd.write_text("\n".join(lines) + "\n")

    @property
    def host_key_pub(self) -> str:
        """The host's public key line, ``ssh-ed25519 AAAA... comment``."""
        return Path(f"{self.host_key}.pub").read_text().strip()

    @property
    def known_hosts_line(self) -> str:
        kind, blob = self.host_key_pub.split()[:2]
        return f"[127.0.0.1]:{self.port} {kind} {blob}"

    def pin(self) -> None:
        """Write the pinned known_hosts with the current host key."""
        self.known_hosts.write_text(self.known_hosts_line + "\n")

    def argv(self) -> list[str]:
        opts = {
            "ListenAddress": "127.0.0.1",
            "Port": str(self.port),
            "HostKey": str(self.host_key),
            "PidFile": str(self.pid_file),
            "AuthorizedKeysFile": str(self.authorized_keys),
            "PermitRootLogin": "prohibit-password",
            "PasswordAuthentication": "no",
            "KbdInteractiveAuthentication": "no",
            "PubkeyAuthentication": "yes",
            "StrictModes": "no",
            "UsePAM": "no",
            "AllowTcpForwarding": "yes",
            "MaxStartups": "200",
            "MaxSessions": "100",
            "LogLevel": "VERBOSE",
            "Subsystem": "sftp internal-sftp",
        }
        argv = [SSHD, "-D", "-e", "-f", "/dev/null"]
        for key, value in opts.items():
            argv += ["-o", f"{key}={value}"]
        if self.login_shell is not None:
            # unshare and sh both exec: the pid we hold is sshd's.
            argv = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                'mount --bind "$0" /etc/passwd && exec "$@"',
                str(self.passwd),
                *argv,
            ]
        return argv

    def start(self, timeout: float = 15.0) -> Sshd:
        if self.running:
            return self
        # sshd refuses to start without its privilege separation directory.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        log = open(self.log, "ab")
        try:
            self.proc = subprocess.Popen(
                self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while not self._banner():
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sshd gave no SSH-2.0 banner within {timeout:g}s: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)
        return self

    def _banner(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                return s.recv(64).startswith(b"SSH-2.0")
        except OSError:
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running and self.proc is not None else None

    def stop(self) -> None:
        """Stop the listener (by pid). Sessions already open keep their own sshd processes."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def rotate_host_key(self) -> None:
        """A new host key (the pinned known_hosts keeps the old one); restarts sshd if it ran."""
        was_running = self.running
        self.stop()
        for p in (self.host_key, Path(f"{self.host_key}.pub")):
            p.unlink(missing_ok=True)
        keygen(self.host_key, "dflash-test-host-rotated")
        if was_running:
            self.start()

    def ssh_argv(self, *remote: str) -> list[str]:
        """The OpenSSH client argv that reaches this sshd with the pinned key (for benchmarks)."""
        return [
            "ssh",
            "-F",
            "/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-i",
            str(self.client_key),
            "-p",
            str(self.port),
            f"{self.user}@127.0.0.1",
            *remote,
        ]

    def __enter__(self) -> Sshd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
