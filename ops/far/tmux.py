"""tmux: argv builders and the table that reads tmux's stderr (docs/design.md sections 5-7).

Shared by the agent (inside the container) and the operator's raw fallback, so it is stdlib only.
Every client-side tmux failure exits 1; only the stderr text tells a dead server from a missing
session, so the texts below are the evidence (tmux >= 2.1 first, older spellings after them).
Targets are always exact (``=name``): ``-t dflash`` would also match a session called ``dflash-old``.
"""

from __future__ import annotations

import re
import shlex
import typing as t

HISTORY_LIMIT = 100_000
WIDTH, HEIGHT = 240, 60

# One tab-separated row per pane: what the probe needs, read in the same call that checks the session.
PANE_FIELDS = (
    "pane_dead",
    "pane_dead_status",
    "pane_dead_signal",  # tmux >= 3.3; empty before
    "pane_pid",
    "pane_current_command",
    "window_index",
    "pane_index",
    "pid",  # the server's pid
    "session_created",
)
PANE_FORMAT = "\t".join("#{" + f + "}" for f in PANE_FIELDS)


def base(socket: str, tmux: str = "tmux") -> list[str]:
    return [tmux, "-L", socket]


def exact(session: str) -> str:
    return f"={session}"


def pane_target(session: str) -> str:
    # "=name:" is the session's current window; a bare "=name" fails for pane commands on old tmux.
    return f"={session}:"


SAFE_CWD = "/"  # tmux expands formats (#(cmd), #{...}) in -c: it only ever gets this constant
SHELL = "/bin/sh"  # tmux runs the command with default-shell -c: never the user's fish or csh


def start_argv(socket: str, session: str, command: t.Sequence[str], tmux: str = "tmux") -> list[str]:
    """ONE invocation: options are set before the command can exit (a fast failure would otherwise take
    the session and the server down before remain-on-exit applies). tmux's shell (``default-shell``,
    set to /bin/sh here, whatever $SHELL says) parses the command string, so it is built with
    shlex.join exactly once; ``exec`` makes the runner the pane's process. No user value goes where
    tmux expands formats: the start directory is fixed, the runner enters the real one (--cwd)."""
    return [
        *base(socket, tmux),
        "start-server",
        ";",
        "set-option",
        "-g",
        "exit-empty",
        "off",
        ";",
        "set-option",
        "-g",
        "remain-on-exit",
        "on",
        ";",
        "set-option",
        "-g",
        "history-limit",
        str(HISTORY_LIMIT),
        ";",
        "set-option",
        "-g",
        "default-shell",
        SHELL,
        ";",
        "new-session",
        "-d",
        "-s",
        session,
        "-x",
        str(WIDTH),
        "-y",
        str(HEIGHT),
        "-c",
        SAFE_CWD,
        shlex.join(["exec", *command]),
    ]


def panes_argv(socket: str, session: str, tmux: str = "tmux") -> list[str]:
    """has-session first so a missing session reports ``can't find session: X`` (list-panes alone says
    ``can't find window``), then every pane of the session in one row each."""
    return [
        *base(socket, tmux),
        "has-session",
        "-t",
        exact(session),
        ";",
        "list-panes",
        "-s",
        "-t",
        exact(session),
        "-F",
        PANE_FORMAT,
    ]


def capture_argv(socket: str, session: str, lines: int, tmux: str = "tmux") -> list[str]:
    # -J joins wrapped rows; -S -N is N history lines PLUS the whole screen, so callers keep the last N.
    return [*base(socket, tmux), "capture-pane", "-p", "-J", "-t", pane_target(session), "-S", f"-{int(lines)}"]


def attach_argv(socket: str, session: str, tmux: str = "tmux") -> list[str]:
    return [*base(socket, tmux), "attach-session", "-t", exact(session)]


# --------------------------------------------------------------------------------------------
# stderr -> verdict


class Verdict(t.NamedTuple):
    """What one tmux stderr text proves. ``server``: "alive" | "dead" | None (cannot tell);
    ``session``: "alive" | "missing" | None; ``kind`` names the row of the table."""

    server: str | None
    session: str | None
    kind: str
    text: str


# (pattern, server, session, kind); first match wins.
_TABLE: tuple[tuple[re.Pattern[str], str | None, str | None, str], ...] = tuple(
    (re.compile(p), server, session, kind)
    for p, server, session, kind in (
        # socket file there, nobody listening: killed, or exited when its last session closed
        (r"no server running on (?P<path>\S+)", "dead", None, "stale-socket"),
        # no socket file: never started, or /tmp was wiped (container reboot)
        (r"error connecting to (?P<path>\S+) \(No such file or directory\)", "dead", None, "no-socket"),
        (r"error connecting to (?P<path>\S+) \((?P<why>[^)]*)\)", "dead", None, "socket-error"),
        (r"server exited unexpectedly|lost server", "dead", None, "server-exited"),
        (r"failed to connect to server", "dead", None, "no-server"),  # tmux <= 2.0
        (r"no current target", "alive", "missing", "no-sessions"),
        (r"can't find session:? (?P<name>\S+)|session not found: (?P<name2>\S+)", "alive", "missing", "no-session"),
        (r"can't find (?:window|pane):? (?P<name>\S+)|(?:window|pane) not found", "alive", "missing", "no-session"),
        (r"no such session: (?P<name>\S+)", "alive", "missing", "no-session"),
        (r"duplicate session: (?P<name>\S+)", "alive", "alive", "duplicate-session"),
        (r"open terminal failed: not a terminal", None, None, "no-terminal"),
        (r"sessions should be nested with care", None, None, "nested"),
        (r"couldn't create directory|has unsafe permissions|is not a directory", None, None, "socket-dir"),
    )
)


def classify(stderr: str) -> Verdict:
    """Read a tmux stderr text (the first matching row of the table decides)."""
    text = " ".join(stderr.strip().splitlines()).strip()
    for pattern, server, session, kind in _TABLE:
        if pattern.search(text):
            return Verdict(server, session, kind, text)
    return Verdict(None, None, "unknown", text)


def not_found(exit_code: int | None, stderr: str) -> bool:
    """The tmux binary itself is missing (shell 127, or our transports' ENOENT text)."""
    return exit_code == 127 or "No such file or directory: 'tmux'" in stderr


# --------------------------------------------------------------------------------------------
# Reading panes and logs


def parse_panes(stdout: str) -> list[dict[str, str]]:
    rows = []
    for line in stdout.splitlines():
        cells = line.split("\t")
        if len(cells) == len(PANE_FIELDS):
            rows.append(dict(zip(PANE_FIELDS, cells)))
    return rows


def last_lines(rows: t.Iterable[str], n: int) -> list[str]:
    """The last ``n`` rows of a capture with the trailing blank rows (the unused screen) stripped."""
    rows = list(rows)
    while rows and not rows[-1].strip():
        rows.pop()
    return rows[-n:] if n > 0 else []


def collapse_cr(line: str) -> str:
    """A ``\\r`` progress row (tqdm) collapses to what a terminal would show last: its last non-empty segment."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


def decode_lines(data: bytes) -> list[str]:
    """Bytes of a log -> display lines: UTF-8 with replacement, ``\\r`` rows collapsed."""
    text = data.decode("utf-8", "replace")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [collapse_cr(line) for line in lines]
