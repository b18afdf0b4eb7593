"""The read verb's answer (`dflashctl plot`): every attempt's records and the next bytes of its
metrics.jsonl, parsed once into frozen types as ``ops.wire`` reads the other answers. Stdlib only."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import typing as t

from ops.far import records
from ops.wire import Fields, Problems, record_fields


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """One attempt of the read verb's answer: its records and the next bytes of its metrics.jsonl."""

    attempt: int
    run: dict[str, t.Any] | None  # the records checked as the agent checks them, kept as they are (the
    exit: dict[str, t.Any] | None  # plot's cache stores them; ``parse_run`` and the others read them)
    stop: dict[str, t.Any] | None
    run_key: str | None  # which run wrote the attempt dir
    size: int | None
    offset: int  # where ``data`` starts in the file
    next: int  # where the next call starts
    reset: bool  # another run made the dir, or the file was cut: everything before ``offset`` is gone
    more: bool
    data: bytes
    log_tail: tuple[str, ...] | None  # None: not asked for


@dataclasses.dataclass(frozen=True, slots=True)
class ReadAnswer:
    attempts: tuple[Chunk, ...]
    checkpoints: list[dict[str, t.Any]]  # {step, time} under <run_dir>/<session>/checkpoints
    current: int | None
    session_dir: str | None
    problems: tuple[str, ...]


def _checked(value: t.Any, name: str, problems: Problems) -> dict[str, t.Any] | None:
    """A record checked as every wire answer's is (``ops.wire.record_fields``), as the dict the caller keeps."""
    f = record_fields(value, name, problems)
    return dict(f.rec) if f is not None else None  # an empty record, as an absent one: nothing to read


def parse_read(answer: t.Mapping[str, t.Any]) -> ReadAnswer:
    """The read verb's answer; an attempt without its number is left out (named in ``problems``)."""
    problems: Problems = []
    f = Fields(answer, "read", problems)
    chunks = []
    for k, rec in enumerate(f.objs("attempts")):
        c = Fields(rec, f"read.attempts[{k}]", problems)
        n = c.whole("attempt")
        if n is None:
            if "attempt" not in rec:
                problems.append(f"{c.where}: attempt: missing")
            continue
        try:
            data = base64.b64decode(c.text("data") or "")
        except binascii.Error as e:
            problems.append(f"{c.where}: data: not base64 ({e})")
            data = b""
        chunks.append(
            Chunk(
                attempt=n,
                run=_checked(rec.get("run"), records.RUN_JSON, problems),
                exit=_checked(rec.get("exit"), records.EXIT_JSON, problems),
                stop=_checked(rec.get("stop"), records.STOP_JSON, problems),
                run_key=c.text("run_key"),
                size=c.whole("size"),
                offset=c.whole("offset") or 0,
                next=c.whole("next") or 0,
                reset=bool(rec.get("reset")),
                more=bool(rec.get("more")),
                data=data,
                log_tail=c.lines("log_tail") if "log_tail" in rec else None,
            )
        )
    return ReadAnswer(
        attempts=tuple(chunks),
        checkpoints=[dict(x) for x in f.objs("checkpoints")],
        current=f.whole("current"),
        session_dir=f.text("session_dir"),
        problems=tuple(problems),
    )
