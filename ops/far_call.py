"""The operator side of every far-side verb: run one program, read its one JSON answer (the envelope).

The agent (ops/far/agent.py, JSON request on stdin) and the release program (ops/far/release.py, JSON
request as an argv item: its stdin is the upload) answer alike: one JSON object, ``{"ok": true,
"protocol", "verb", ...}`` or ``{"ok": false, "protocol", "verb", "error": <kind>, "message"}``.
Callers word their own errors from ``Reply``; this module only runs and reads.
"""

from __future__ import annotations

import json
import typing as t

from ops.transport import CommandResult, Stdin

if t.TYPE_CHECKING:
    from ops.remote import Remote


class Reply(t.NamedTuple):
    result: CommandResult
    answer: dict[str, t.Any] | None  # None: the program printed no answer (it could not run, died, timed out)


def cannot_exec(result: CommandResult) -> bool:
    """The interpreter itself could not be started (missing, not executable): sh says 126/127, lxc-attach
    'Failed to exec'. The one test for it (deploy and the agent client both ask)."""
    return result.exit_code in (126, 127) or "Failed to exec" in result.err


def last_answer(out: str) -> dict[str, t.Any] | None:
    """The JSON object on the last line of stdout, when it is an envelope (has ``ok``)."""
    lines = out.strip().splitlines()
    if not lines:
        return None
    try:
        answer = json.loads(lines[-1])
    except (ValueError, RecursionError):
        return None
    return answer if isinstance(answer, dict) and "ok" in answer else None


def call(remote: Remote, argv: t.Sequence[str], *, stdin: Stdin = None, timeout: float) -> Reply:
    """Run a far-side program through ``remote.run`` (in the container when there is one) and read its answer."""
    result = remote.run(argv, stdin=stdin, timeout=timeout)
    return Reply(result, None if result.timed_out else last_answer(result.out))
