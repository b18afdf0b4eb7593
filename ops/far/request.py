"""The two ends of a JSON verb, shared by the agent (ops/far/agent.py, in the container) and the host service
(ops/supervise/service.py, on the Proxmox host): one request object read from stdin, one answer line written
to stdout. Stdlib only (both run with whatever python is there)."""

from __future__ import annotations

import json
import sys
import typing as t

from ops.far import records


def read_request(stdin: t.TextIO | None = None) -> dict[str, t.Any]:
    """The request on stdin as a JSON object (empty input: ``{}``); ValueError says why it is not one
    (not JSON, a huge integer, nested too deeply, not an object)."""
    req = records.parse_line((sys.stdin if stdin is None else stdin).read() or "{}")
    if not isinstance(req, dict):
        raise ValueError("expected a JSON object")
    return req


def answer(doc: t.Mapping[str, t.Any], code: int = 0) -> int:
    """Write the one answer line and return the exit status (0: an answer, ok or not; 2: usage, bad request)."""
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
    return code


__all__ = ["answer", "read_request"]
