"""known_hosts as OpenSSH reads it (patterns, hashed names, @revoked, @cert-authority), the host-key
policy every connection uses, and trust-host's record of a scanned key."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import logging
import re
import secrets
import typing as t
from pathlib import Path

from ops.errors import HostKeyRejected, HostKeyRevoked
from ops.transport._paramiko import paramiko
from ops.transport.ssh_config import SSHTarget

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KnownHostsEntry:
    """One readable known_hosts line. ``marker`` is None (a host key), "revoked" or "cert-authority"."""

    file: str
    line: int
    hosts: str  # the first field as written: a pattern list, or one hashed name ``|1|salt|hash``
    key: paramiko.PKey
    marker: str | None = None

    def matches(self, name: str) -> bool:
        """OpenSSH's rule: a hashed name matches exactly; else the comma-separated patterns (``*``,
        ``?``, ``!negation``) are matched against the lowercase name, and any negated match wins."""
        name = name.lower()
        if self.hosts.startswith("|"):
            return _hashed_matches(self.hosts, name)
        positive = False
        for pattern in self.hosts.split(","):
            negated = pattern.startswith("!")
            if _pattern_matches(pattern[1:] if negated else pattern, name):
                if negated:
                    return False
                positive = True
        return positive


def _pattern_matches(pattern: str, name: str) -> bool:
    """OpenSSH ``match_pattern``: ``*`` any run, ``?`` one character, all else literal (so ``[host]:*``
    works; ``[`` is not a character class as in fnmatch)."""
    rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return re.fullmatch(rx, name, re.DOTALL) is not None


def _hashed_matches(field: str, name: str) -> bool:
    parts = field.split("|")
    if len(parts) != 4 or parts[1] != "1":
        return False
    try:
        return hmac.compare_digest(paramiko.HostKeys.hash_host(name, parts[2]), field)
    except (binascii.Error, ValueError, AssertionError):
        return False  # a salt we cannot decode never matches (the line was already counted as readable)


MARKERS = {"@revoked": "revoked", "@cert-authority": "cert-authority"}


def parse_known_hosts_line(text: str, *, file: str = "", line: int = 0) -> KnownHostsEntry | None:
    """One known_hosts line like OpenSSH reads it: None for a blank line or a comment; ValueError
    (with the reason) for a line we cannot use: unknown marker, missing fields, bad base64, a key
    type paramiko does not know."""
    fields = text.split()
    if not fields or fields[0].startswith("#"):
        return None
    marker = None
    if fields[0].startswith("@"):
        if fields[0] not in MARKERS:
            raise ValueError(f"unknown marker {fields[0]}")
        marker = MARKERS[fields[0]]
        fields = fields[1:]
    if len(fields) < 3:
        raise ValueError("expected: hosts key-type base64-key")
    hosts, key_type, blob = fields[:3]
    if hosts.startswith("|") and (len(hosts.split("|")) != 4 or hosts.split("|")[1] != "1"):
        raise ValueError("unknown hashed host name format")
    try:
        raw = base64.b64decode(blob, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"bad base64 key ({e})") from e
    try:
        key = paramiko.PKey.from_type_string(key_type, raw)
    except paramiko.UnknownKeyType as e:
        raise ValueError(f"key type {key_type} is not supported") from e
    except Exception as e:  # noqa: BLE001 - any malformed key blob is "cannot read", whatever paramiko raises
        raise ValueError(f"unreadable {key_type} key ({type(e).__name__})") from e
    if key.get_name() != key_type and key_type not in key.identifiers():
        raise ValueError(f"the key is a {key.get_name()}, the line says {key_type}")
    return KnownHostsEntry(file, line, hosts, key, marker)


class KnownHosts:
    """Every known_hosts file we read, checked the way ssh does: a key that matches an entry in
    any file is accepted; entries for the name with no match mean the key CHANGED; a key under a
    matching ``@revoked`` line is refused whatever else says. Lines we cannot read are skipped
    and counted (like OpenSSH), never fatal; ``@cert-authority`` keys are not host keys."""

    def __init__(self, files: t.Sequence[str]) -> None:
        self.files = tuple(files)
        self._entries: list[KnownHostsEntry] = []
        self.skipped: list[tuple[str, int, str]] = []  # (file, line number, why)
        for f in self.files:
            try:
                # surrogateescape: one stray byte must not hide the file's other lines
                text = Path(f).read_text(encoding="utf-8", errors="surrogateescape")
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as e:
                logger.warning("cannot read known_hosts %s: %s", f, e)
                self.skipped.append((f, 0, f"cannot read the file: {e}"))
                continue
            for n, line in enumerate(text.splitlines(), 1):
                try:
                    entry = parse_known_hosts_line(line, file=f, line=n)
                except ValueError as e:
                    logger.info("known_hosts %s:%d skipped: %s", f, n, e)
                    self.skipped.append((f, n, str(e)))
                    continue
                if entry is not None:
                    self._entries.append(entry)

    def matching(self, name: str, marker: str | None = None) -> list[KnownHostsEntry]:
        return [e for e in self._entries if e.marker == marker and e.matches(name)]

    def entries(self, name: str) -> list[tuple[str, paramiko.PKey]]:
        """``(file, key)`` for every host key recorded for ``name`` (plain, hashed or by pattern)."""
        return [(e.file, e.key) for e in self.matching(name)]

    def check(self, name: str, key: paramiko.PKey) -> tuple[str, list[tuple[str, paramiko.PKey]]]:
        """``("known" | "unknown" | "changed" | "revoked", the recorded entries)``."""
        entries = self.entries(name)
        if any(e.key == key for e in self.matching(name, "revoked")):
            return "revoked", entries
        if any(k == key for _, k in entries):
            return "known", entries
        return ("changed" if entries else "unknown"), entries

    def revoked_at(self, name: str, key: paramiko.PKey) -> list[str]:
        """``file:line`` of each ``@revoked`` line that revokes ``key`` for ``name``."""
        return [f"{e.file}:{e.line}" for e in self.matching(name, "revoked") if e.key == key]

    def has_cert_authority(self, name: str) -> bool:
        return bool(self.matching(name, "cert-authority"))

    def key_types(self, name: str) -> list[str]:
        return list(dict.fromkeys(k.get_name() for _, k in self.entries(name)))

    def note(self, name: str) -> str:
        """What a host-key message should add: skipped lines, a CA we do not use."""
        parts = []
        if self.skipped:
            where = ", ".join(f"{f}:{n}" if n else f for f, n, _ in self.skipped[:3])
            more = f" and {len(self.skipped) - 3} more" if len(self.skipped) > 3 else ""
            parts.append(f"{len(self.skipped)} unreadable known_hosts line(s) skipped ({where}{more})")
        if self.has_cert_authority(name):
            parts.append(
                "a @cert-authority line matches this host, but host certificates are not supported: pin the host key itself"
            )
        return "; ".join(parts)


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's ``SHA256:...`` fingerprint."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class HostKeyCheck(paramiko.MissingHostKeyPolicy):  # type: ignore[misc]  # paramiko ships no types
    """Our own known_hosts check in the place of paramiko's (nothing is loaded into the client, so
    paramiko asks us about every key): unknown or changed -> ``HostKeyRejected``, nothing runs."""

    def __init__(self, target: SSHTarget, known: KnownHosts) -> None:
        self.target = target
        self.known = known

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        verdict, entries = self.known.check(self.target.known_name, key)
        if verdict == "known":
            return
        fp = fingerprint(key)
        tgt = self.target
        note = self.known.note(tgt.known_name)
        note = f" ({note})" if note else ""
        if verdict == "revoked":
            raise revoked_error(tgt, key, self.known.revoked_at(tgt.known_name, key))
        if verdict == "changed":
            same_type = [k for _, k in entries if k.get_name() == key.get_name()] or [k for _, k in entries]
            old = fingerprint(same_type[0])
            files = ", ".join(sorted({f for f, _ in entries}))
            raise HostKeyRejected(
                tgt.label,
                f"HOST KEY CHANGED for {tgt.known_name}: known_hosts ({files}) has {old}, the server now offers "
                f"{key.get_name()} {fp}. Nothing was run. This can be an attack; if the change is expected "
                f"(host reinstalled), check the new fingerprint and run: dflashctl --host {tgt.label} trust-host --replace",
                fingerprint=fp,
                changed=True,
                expected=old,
                key_type=key.get_name(),
            )
        raise HostKeyRejected(
            tgt.label,
            f"host key for {tgt.known_name} is not known ({key.get_name()} {fp}; looked in {', '.join(tgt.known_hosts)}{note}). "
            f"Nothing was run. Check the fingerprint, then run: dflashctl --host {tgt.label} trust-host",
            fingerprint=fp,
            key_type=key.get_name(),
        )


def revoked_error(target: SSHTarget, key: paramiko.PKey, where: t.Sequence[str]) -> HostKeyRevoked:
    """The one refusal for a revoked key (connect, doctor and trust-host say the same)."""
    fp = fingerprint(key)
    return HostKeyRevoked(
        target.label,
        f"host key for {target.known_name} is REVOKED ({key.get_name()} {fp}, @revoked in {', '.join(where)}). "
        f"Nothing was run. The server offers a key you marked as never to be trusted; trust-host will not record it.",
        fingerprint=fp,
        key_type=key.get_name(),
    )


# --------------------------------------------------------------------------------------------
# trust-host: show the server's key and record it only when the user says so


@dataclasses.dataclass(frozen=True)
class HostKeyScan:
    target: SSHTarget
    key: paramiko.PKey
    verdict: str  # "known" | "unknown" | "changed" | "revoked"
    recorded: tuple[tuple[str, str, str], ...]  # (file, key type, fingerprint) already on record
    note: str = ""  # skipped unreadable lines, a @cert-authority we do not use (KnownHosts.note)
    revoked_at: tuple[str, ...] = ()  # file:line of the @revoked lines that name this key
    patterns: tuple[str, ...] = ()  # file:line of pattern entries (not this exact name) on record

    @property
    def key_type(self) -> str:
        return str(self.key.get_name())

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)

    @property
    def file(self) -> str:
        """Where trust-host writes: the configured known_hosts, else ~/.ssh/known_hosts."""
        return self.target.known_hosts[0]


def record_host_key(scan: HostKeyScan, *, replace: bool = False) -> str:
    """Append the scanned key to ``scan.file`` (created 0600 in a 0700 folder); with ``replace``,
    drop the entries for that name from the file first. Returns the file."""
    path = Path(scan.file)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    name = scan.target.known_name
    lines: list[str] = []
    if path.exists():
        # surrogateescape: bytes we cannot decode are written back as they were
        lines = path.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    if replace:
        lines = [kept for ln in lines if (kept := _without_name(ln, name)) is not None]
    lines.append(f"{name} {scan.key.get_name()} {scan.key.get_base64()}")
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogateescape")
    tmp.chmod(0o600 if not path.exists() else path.stat().st_mode & 0o777)
    tmp.replace(path)
    return str(path)


def line_names(hosts: str, name: str) -> bool:
    """True when a known_hosts host field names ``name`` itself (plain or hashed), not by pattern."""
    name = name.lower()
    for h in hosts.split(","):
        if h.lower() == name:
            return True
        if h.startswith("|") and _hashed_matches(h, name):
            return True
    return False


def _without_name(line: str, name: str) -> str | None:
    """``line`` with ``name`` taken out of its host list (None: nothing is left of it). Marker lines
    (``@revoked``, ``@cert-authority``), comments, pattern and unreadable lines stay as they are:
    --replace drops the old key of this host, never a revocation or another host's entry."""
    fields = line.split()
    if not fields or fields[0].startswith(("#", "@")) or not line_names(fields[0], name):
        return line
    rest = [h for h in fields[0].split(",") if not line_names(h, name)]
    if not [h for h in rest if not h.startswith("!")]:
        return None
    return line.replace(fields[0], ",".join(rest), 1)
