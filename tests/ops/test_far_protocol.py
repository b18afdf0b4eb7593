"""The agent <-> probe contract is typed (ops/far/protocol.py): what the agent emits today has exactly
the TypedDicts' keys, and the recorded fact sets (tests/ops/facts) hold no key the types do not know."""

from __future__ import annotations

import json
import typing as t
from pathlib import Path

import pytest

from ops.far import agent
from ops.far.procfs import ProcessFacts
from ops.far.protocol import AttemptFacts, Envelope, ProbeFacts, TmuxFacts

FACTS = Path(__file__).with_name("facts")


def keys(td: t.Any) -> set[str]:
    return set(t.get_type_hints(td))


def test_the_agent_emits_the_typed_facts(tmp_path: Path, tmux_socket: str) -> None:
    req = {"session": "s", "socket": tmux_socket, "run_dir": str(tmp_path)}
    none = agent.probe(req)
    assert set(none) == keys(ProbeFacts) and set(none["tmux"]) == keys(TmuxFacts) and none["attempt"] is None
    assert none["tmux"]["exit_code"] != 0 and none["tmux"]["stderr"]  # no server: tmux's own words are the evidence

    adir = tmp_path / "s" / "attempt-1"
    adir.mkdir(parents=True)
    (adir / "run.json").write_text(
        json.dumps({"attempt": 1, "pid": 1, "pid_start": -1, "started_at": "2026-01-01T00:00:00Z"})
    )
    (adir / "train.log").write_text("step 1\n")
    af = agent.probe(req)["attempt"]
    assert af is not None and set(af) == keys(AttemptFacts)
    assert af["runner"] is not None and set(af["runner"]) == keys(ProcessFacts)
    assert af["runner"]["same"] is False and not af["runner"]["alive"]  # not the recorded start: a reused pid


@pytest.mark.parametrize("path", sorted(FACTS.glob("*.json")), ids=lambda p: p.stem)
def test_recorded_facts_hold_no_key_the_types_do_not_know(path: Path) -> None:
    answer = json.loads(path.read_text())["facts"].get("agent")
    if not answer:
        return
    assert set(answer) <= keys(ProbeFacts) | keys(Envelope)
    assert set(answer["tmux"]) <= keys(TmuxFacts)
    attempt = answer.get("attempt")
    if attempt:
        assert set(attempt) <= keys(AttemptFacts)
        for who in ("runner", "keeper", "child"):
            if attempt.get(who):
                assert set(attempt[who]) <= keys(ProcessFacts)
