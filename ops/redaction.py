"""What no message, record or line of ours may carry: the secrets, in every form they are printed in.

A secret is each value of a host entry's ``env``, the Proxmox API token's value (``token_value_env``, as
this machine has it) and each --notify URL. A run, a library or a service prints them in other forms than
the plain one: percent-encoded (a token in a URL's query, as ``requests`` prints it), JSON-escaped,
``repr``-escaped, or one inside another. ``Scrubber`` replaces every one of those forms, and a secret's
part where a cut left it (``abc...``, a line's end, or ``...xyz`` where the front was cut off): whoever
cut before us must not leak the first 17 characters of a 26-character token. Scrub once, before any cut
of our own. Stdlib only: the supervisor on the Proxmox host loads this module.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing as t
import urllib.parse

if t.TYPE_CHECKING:
    from ops.hosts import Host

MIN_SECRET = 4  # shorter env values ("0", "1", "yes") are no secrets, and scrubbing them would blank every digit
MIN_PART = 6  # a secret's part left by a cut is redacted from this many characters on
REDACTED = "[redacted]"
_CUTS = ("...", "\u2026")  # how a cut text says it was cut
# Schemes whose host part is a machine's name (webhooks), not a token: a label may show it.
HOST_SCHEMES = {"json", "jsons", "xml", "xmls", "form", "forms", "ntfy", "ntfys", "gotify", "gotifys", "mailto"}
_HEX = re.compile(r"%[0-9A-F]{2}")


def secret_values(hosts: t.Iterable[Host], environ: t.Mapping[str, str]) -> list[str]:
    """What no message may carry: every value of each host's ``env``, and the value of each host's
    ``[proxmox] token_value_env`` variable as this machine has it."""
    out: list[str] = []
    for h in hosts:
        out.extend(h.env.values())
        out.extend(environ[name] for name in h.secret_env if environ.get(name))
    return out


def url_secrets(url: str) -> list[str]:
    """A --notify URL's secrets: the URL itself, its password and query values, and (unless its host part
    is a machine's name: a webhook's) its host and path parts, which hold a service's tokens."""
    out = [url]
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return out
    if parts.password:
        out.append(parts.password)
    out.extend(v for _, v in urllib.parse.parse_qsl(parts.query))
    if parts.scheme.lower() not in HOST_SCHEMES:
        out.append(parts.netloc)
        out.extend(p for p in parts.path.split("/") if p)
    return out


def _encodings(s: str) -> set[str]:
    """One level of the encodings a secret is printed in."""
    out = {
        s,
        urllib.parse.quote(s, safe=""),
        urllib.parse.quote(s),  # "/" kept: a path's, or a query as requests requotes it
        urllib.parse.quote_plus(s),
        urllib.parse.quote_plus(s, safe="/"),
        json.dumps(s)[1:-1],
        json.dumps(s, ensure_ascii=False)[1:-1],
        json.dumps(s)[1:-1].replace("/", "\\/"),  # PHP's and some loggers' JSON
        repr(s)[1:-1],
        ascii(s)[1:-1],
        repr(s.replace("'", '"'))[1:-1],
    }
    return out


def forms(secret: str) -> set[str]:
    """Every form of ``secret`` that is scrubbed: each encoding, and each encoding of one (a query in a
    JSON string, a JSON string in a repr)."""
    first = _encodings(secret)
    out = set(first)
    for x in first:
        out |= _encodings(x)
    return out


class Scrubber:
    """Replaces each secret (``MIN_SECRET`` characters or more) in every form (``forms``), longest
    first (a secret that contains another is replaced whole), then a secret's part a cut left at the
    end (``MIN_PART`` characters or more before ``...``, a line's end or the text's end) or at the start
    (after ``...``, a line's start or the text's start)."""

    def __init__(self, secrets: t.Iterable[str]) -> None:
        found = {s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET}
        self.secrets = sorted(found, key=len, reverse=True)
        every = {f for s in found for f in forms(s)}
        self.forms = sorted(every, key=len, reverse=True)
        # a percent-encoded form in either case of its hex digits (%2F, %2f: encoders differ)
        self._any_case = {f: re.compile(re.escape(f), re.IGNORECASE) for f in self.forms if _HEX.search(f)}
        self._parts = [f for f in self.forms if len(f) > MIN_PART]

    def __call__(self, text: str) -> str:
        if not self.forms or not text:
            return text
        low = text.lower()
        for f in self.forms:
            if f in self._any_case:
                if f.lower() in low:
                    text = self._any_case[f].sub(REDACTED, text)
            elif f in text:
                text = text.replace(f, REDACTED)
        if self._parts:
            text = self._cut_parts(text)
        return text

    def _cut_parts(self, text: str) -> str:
        # a cut shows where a part may be: at the text's (or a line's) end or start, or next to "..."
        lines = text.split("\n")
        return "\n".join(self._line_parts(line) for line in lines)

    def _line_parts(self, line: str) -> str:
        if len(line) < MIN_PART:
            return line
        pieces = [line]
        for cut in _CUTS:
            pieces = [p for piece in pieces for p in _split_keep(piece, cut)]
        out = []
        for p in pieces:
            if p in _CUTS:
                out.append(p)
                continue
            out.append(self._ends(p))
        return "".join(out)

    def _ends(self, piece: str) -> str:
        """``piece`` with a secret's head at its end, and a secret's tail at its start, redacted."""
        end = piece[-MIN_PART:]  # a part holds it: most forms are out at once
        head = max((k for f in self._parts if end in f and (k := _head(piece, f)) >= MIN_PART), default=0)
        if head:
            piece = piece[:-head] + REDACTED
        start = piece[:MIN_PART]
        tail = max((k for f in self._parts if start in f and (k := _tail(piece, f)) >= MIN_PART), default=0)
        if tail:
            piece = REDACTED + piece[tail:]
        return piece

    def tree(self, value: t.Any) -> t.Any:
        """Every string of a JSON-like value, scrubbed (dict keys too)."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {self(k) if isinstance(k, str) else k: self.tree(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.tree(v) for v in value]
        return value


def _split_keep(text: str, sep: str) -> list[str]:
    parts = text.split(sep)
    out: list[str] = []
    for i, p in enumerate(parts):
        if i:
            out.append(sep)
        if p:
            out.append(p)
    return out


def _head(piece: str, form: str) -> int:
    """The length of the longest head of ``form`` (shorter than it) that ``piece`` ends with."""
    for k in range(min(len(form) - 1, len(piece)), MIN_PART - 1, -1):
        if piece.endswith(form[:k]):
            return k
    return 0


def _tail(piece: str, form: str) -> int:
    """The length of the longest tail of ``form`` (shorter than it) that ``piece`` starts with."""
    for k in range(min(len(form) - 1, len(piece)), MIN_PART - 1, -1):
        if piece.startswith(form[-k:]):
            return k
    return 0


_StatusT = t.TypeVar("_StatusT")


def scrubbed_status(st: _StatusT, scrub: Scrubber) -> _StatusT:
    """A probe's Status with every text the run could have printed scrubbed (its detail, evidence, log
    tail, fingerprint, the last sync's error): what the supervisor decides, records and says from it."""
    if not scrub.forms:
        return st
    changes: dict[str, t.Any] = {}
    for name in ("detail", "fingerprint"):
        v = getattr(st, name, None)
        if isinstance(v, str):
            changes[name] = scrub(v)
    for name in ("evidence", "tail"):
        v = getattr(st, name, None)
        if isinstance(v, list):
            changes[name] = [scrub(x) if isinstance(x, str) else x for x in v]
    sync: t.Any = getattr(st, "sync", None)
    if sync is not None and isinstance(getattr(sync, "error", None), str):
        changes["sync"] = dataclasses.replace(sync, error=scrub(sync.error))
    return dataclasses.replace(st, **changes)  # type: ignore[type-var]
