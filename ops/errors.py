"""Errors of dflashctl: one root, narrow subclasses that carry their facts.

Exit codes are not decided here: ``ops/exit_codes.py`` maps these classes to codes in one place
(``ops.cli.main`` applies it).
"""

from __future__ import annotations

import typing as t

from ops.states import Cause


class OpsError(Exception):
    """Root of every error dflashctl raises on purpose."""


class ConfigError(OpsError):
    """hosts.toml (or a command-line value) is wrong; ``path`` names the key, e.g. ``hosts.pve.port``."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


class UnreachableError(OpsError):
    """The host cannot be reached or refused us. ``cause`` is one of docs/design.md section 6's unreachable causes."""

    cause: t.ClassVar[str] = Cause.UNKNOWN

    def __init__(self, host: str, detail: str) -> None:
        super().__init__(f"{host}: {detail}")
        self.host = host
        self.detail = detail


class ConnectionRefused(UnreachableError):
    cause = Cause.REFUSED


class ConnectTimeout(UnreachableError):
    cause = Cause.TIMEOUT


class NameResolutionError(UnreachableError):
    cause = Cause.DNS


class AuthenticationFailed(UnreachableError):
    cause = Cause.AUTH


class ConnectionLost(UnreachableError):
    """An open connection broke (sshd restarted, reset, EOF): the host dropped us."""

    cause = Cause.REFUSED


class HostKeyRejected(UnreachableError):
    """The host's key is unknown or changed: never accepted silently (``dflashctl trust-host``).

    ``fingerprint`` is the server's key (``SHA256:...``), ``expected`` the one known_hosts holds
    when ``changed``.
    """

    cause = Cause.HOST_KEY

    def __init__(
        self,
        host: str,
        detail: str,
        *,
        fingerprint: str | None = None,
        changed: bool = False,
        expected: str | None = None,
        key_type: str | None = None,
    ) -> None:
        super().__init__(host, detail)
        self.fingerprint = fingerprint
        self.changed = changed
        self.expected = expected
        self.key_type = key_type


class HostKeyRevoked(HostKeyRejected):
    """The server's key is listed under a matching ``@revoked`` line of known_hosts: refused, and
    trust-host will not record it either (the line has to be removed by hand)."""


class ContainerDown(OpsError):
    """The LXC container is stopped (``cause="stopped"``) or does not exist (``cause="missing"``)."""

    def __init__(self, vmid: int, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.vmid = vmid
        self.cause = cause
        self.detail = detail


class RemoteCommandError(OpsError):
    """A command on the host or in the container failed where it had to succeed."""

    def __init__(self, argv: t.Sequence[str], exit_code: int | None, stderr: str, *, what: str | None = None) -> None:
        first = (stderr.strip().splitlines() or ["(no stderr)"])[-1]
        head = what or (argv[0] if argv else "command")
        super().__init__(f"{head}: {first} (exit {exit_code})")
        self.argv = tuple(argv)
        self.exit_code = exit_code
        self.stderr = stderr


class CommandTimeout(OpsError):
    """A command outlived its timeout and was killed (on the remote side too)."""

    def __init__(self, argv: t.Sequence[str], timeout: float) -> None:
        super().__init__(f"{argv[0] if argv else 'command'}: no answer within {timeout:g}s (killed)")
        self.argv = tuple(argv)
        self.timeout = timeout


class NotDeployed(OpsError):
    """Nothing is deployed on the host yet."""


class RunActive(OpsError):
    """A live run holds the session; refusing to start or deploy over it."""


class StartCancelled(OpsError):
    """The start was taken back (its dflashctl was interrupted) before the host ran it."""


class BundleError(OpsError):
    """The local source cannot be bundled (unreadable file, no ops/ package...)."""


class DeployError(OpsError):
    """A deploy, rollback or release check failed; ``current`` was left as it was."""


class MissingDependencies(OpsError):
    """The host's python cannot import what the agent and training need; ``modules`` names them."""

    def __init__(self, message: str, modules: t.Sequence[str]) -> None:
        super().__init__(message)
        self.modules = tuple(modules)


class AgentError(OpsError):
    """The agent ran but its answer could not be used (not JSON, unknown verb...)."""


class CrashLoop(OpsError):
    """restart-on-crash gave up: the run crashes again and again."""


class GaveUpDiverged(CrashLoop):
    """restart-on-crash gave up on a run whose training diverged (a restart would replay the same data)."""


class GpuFaultGiveUp(OpsError):
    """restart-on-crash gave up: the run's GPU failed in hardware (cause gpu-fault); a restart would run
    into it again."""


class SupervisorLocked(OpsError):
    """Another restart-on-crash already watches this host and session."""


class SuperviseError(OpsError):
    """`dflashctl supervise` could not do what was asked on the Proxmox host (one line: why)."""


class NotInstalled(SuperviseError):
    """No supervisor is installed on the host for this session."""
