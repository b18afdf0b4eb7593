"""`dflashctl history`: what happened to a session, attempt by attempt, in one table.

ONE agent call (``history``, ops/far/agent.py) brings every attempt's records from the run dir (which
outlives the container's restarts): run.json (with ``started_by``: an operator or a supervisor, and
why), exit.json, stop.json, the last metrics record, the log's tail when the attempt crashed, and the
checkpoint its log says it resumed from (ops/far/history.py). Each attempt is classified by the rules
of `status` (``ops.probe.classify`` on that attempt's facts). An attempt that left no exit record (lost)
takes the cause the supervisor saw when it restarted it (the next attempt's ``started_by.after``), else
the cause of a local incident about it, else what the records tell (a container restarted since).

The supervisor's incidents come from its state dir on this machine (restart-on-crash's, or --state-dir)
and are placed between the attempts by time: under the attempt that was the newest when they happened.
With ``--group``, one call per node at once, a row per node and attempt.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing as t
from pathlib import Path

from ops import errors, probe, wire
from ops import session as run
from ops.far import records
from ops.group import fan_out
from ops.hosts import Host
from ops.redaction import Scrubber, secret_values
from ops.states import Cause, State
from ops.times import duration, parse_iso

if t.TYPE_CHECKING:
    from ops.remote import Remote

HISTORY_TIMEOUT = 60.0
DETAIL_WIDTH = 160  # a crash's detail under its row in the table (--json has all of it)
CELL_WIDTH = 80  # a started-by cell: names and reasons, never a value printed whole
TEXT_KEEP = 400  # characters an incident's text field keeps when read


@dataclasses.dataclass
class Incident:
    """The gist of one incident file of restart-on-crash."""

    time: str | None
    host: str | None
    attempt: int | None
    state: str | None
    cause: str | None
    action: str | None
    outcome: str | None
    reason: str | None
    next_attempt: int | None
    excluded: str | None = None  # `GPU 0000:b3:00.0 (Xid 79) excluded; attempt 2 runs without it`

    def line(self) -> str:
        what = f"{self.state}" + (f" ({self.cause})" if self.cause else "")
        if self.attempt is not None:
            what += f" of attempt {self.attempt}"
        out = f"{self.action}: {self.outcome}" if self.outcome not in (None, "noted") else f"{self.action}"
        if self.next_attempt is not None:
            out += f", attempt {self.next_attempt} started"
        if self.excluded:
            out += f"; {self.excluded}"
        return f"{_clock(self.time)}  supervisor saw {what} -> {out}"


@dataclasses.dataclass
class Row:
    """One attempt of one host."""

    host: str
    attempt: int | None
    started_at: str | None
    ended_at: str | None
    last_seen_at: str | None  # a lost attempt's last log or metrics write (it left no end)
    duration_s: float | None
    state: str
    cause: str | None
    detail: str | None
    gpu: int | None
    exit_code: int | None
    signal: int | None
    step: int | None
    resumed_from: dict[str, t.Any] | None
    started_by: dict[str, t.Any] | None
    cause_from: str | None  # where a lost attempt's cause comes from: records, supervisor, incident
    log: str | None
    incidents: list[Incident] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)  # its records' problems, each naming the file

    def to_json(self) -> dict[str, t.Any]:
        d = dataclasses.asdict(self)
        d["incidents"] = [dataclasses.asdict(i) for i in self.incidents]
        return d


@dataclasses.dataclass
class History:
    """Every attempt shown (oldest first; with a group, a row per node), and the incidents before the first."""

    name: str  # the host, or "group NAME"
    session: str
    hosts: list[str]
    rows: list[Row]
    total: dict[str, int]  # attempts on record per host (-n shows fewer)
    before: list[Incident]
    incidents_dir: str | None
    errors: dict[str, str] = dataclasses.field(default_factory=dict)  # a host that could not be read: why

    def to_json(self) -> dict[str, t.Any]:
        return {
            "name": self.name,
            "session": self.session,
            "hosts": self.hosts,
            "total": self.total,
            "incidents_dir": self.incidents_dir,
            "before": [dataclasses.asdict(i) for i in self.before],
            "attempts": [r.to_json() for r in self.rows],
            "errors": self.errors,
        }

    def lines(self) -> list[str]:
        group = len(self.hosts) > 1 or self.name != (self.hosts[0] if self.hosts else self.name)
        shown = len({(r.host, r.attempt) for r in self.rows})
        on_record = sum(self.total.values())
        head = f"history of {self.name}/{self.session}: {shown} attempt(s)"
        if shown < on_record:
            head += f" of {on_record}"
        head += f"; supervisor incidents from {self.incidents_dir}" if self.incidents_dir else "; no incidents read"
        out = [head]
        for host, why in self.errors.items():
            out.append(f"{host}: cannot read the history: {why}")
        if not self.rows:
            return [*out, "no attempt on record"]
        cols = ["attempt", *(["node"] if group else []), "started", "ended", "lasted", "state", "exit", "step"]
        cols += ["resumed from", "started by"]
        table = [cols]
        below: dict[int, list[str]] = {}
        for r in self.rows:
            unread = r.started_at is None and bool(r.errors)  # its run.json could not be read: nothing is known
            table.append(
                [
                    str(r.attempt),
                    *([r.host] if group else []),
                    _stamp(r.started_at),
                    _ended(r),
                    duration(r.duration_s) if r.duration_s is not None else "?",
                    "?" if unread else printable(_state(r), CELL_WIDTH),
                    _exit(r),
                    "-" if r.step is None else str(r.step),
                    f"step {r.resumed_from['step']}" if r.resumed_from else "-",
                    printable(_by(r.started_by), CELL_WIDTH),
                ]
            )
            notes = [f"    {printable(i.line(), DETAIL_WIDTH)}" for i in r.incidents]
            if r.detail and r.state in (State.CRASHED, State.LOST) and not unread:
                notes.insert(0, f"    {r.host + ': ' if group else ''}{printable(r.detail, DETAIL_WIDTH)}")
            notes[:0] = [f"    {r.host + ': ' if group else ''}{printable(e, DETAIL_WIDTH)}" for e in r.errors]
            if notes:
                below[len(table) - 1] = notes
        widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
        for k, row in enumerate(table):
            out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            out.extend(below.get(k, []))
        if self.before:
            out.insert(1, f"before attempt {self.rows[0].attempt}:")
            for n, i in enumerate(self.before):
                out.insert(2 + n, f"    {i.line()}")
        return out


# --------------------------------------------------------------------------------------------
# Human cells


def printable(text: str, width: int) -> str:
    """``text`` as a terminal may show it: control characters escaped (no escape sequence from a record
    reaches the terminal: titles, clipboard), cut to ``width``."""
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text[: width * 2])
    return out if len(out) <= width else out[: width - 3] + "..."


def _clock(ts: str | None) -> str:
    return ts[11:19] if ts and len(ts) >= 19 else "?"


def _stamp(ts: str | None) -> str:
    return f"{ts[:10]} {ts[11:19]}" if ts and len(ts) >= 19 else "?"


def _ended(r: Row) -> str:
    if r.ended_at:
        return _clock(r.ended_at) if (r.started_at or "")[:10] == r.ended_at[:10] else _stamp(r.ended_at)
    if r.state in (State.RUNNING, State.STALLED):
        return "-"
    return f"~{_clock(r.last_seen_at)}" if r.last_seen_at else "?"


def _state(r: Row) -> str:
    if not r.cause:
        return r.state
    cause = f"{r.cause}, GPU {r.gpu}" if r.gpu is not None else r.cause
    return f"{r.state} ({cause})"


def _exit(r: Row) -> str:
    if r.signal is not None and r.exit_code is None:
        return f"signal {r.signal}"
    if r.exit_code is not None:
        return f"exit {r.exit_code}"
    return "-"


def _by(by: dict[str, t.Any] | None) -> str:
    if not by:
        return "?"
    if by.get("by") == "operator":
        who = "@".join(x for x in (by.get("user"), by.get("machine")) if x)
        return f"operator {who}".strip() + (" (--replace)" if "--replace" in str(by.get("why")) else "")
    if by.get("by") == "supervisor":
        after = by.get("after") or {}
        what = f"{after.get('state')}" + (f" {after.get('cause')}" if after.get("cause") else "")
        return f"supervisor on {by.get('machine')}: {by.get('action')} after {what}"
    return str(by.get("by"))


# --------------------------------------------------------------------------------------------
# Reading


def fetch(remote: Remote, session: str | None, last: int | None = None) -> dict[str, t.Any]:
    """The agent's ``history`` answer (one call)."""
    host = remote.host
    req = run.request(host, session)
    if last is not None:
        req["last"] = last
    return run.ask(remote, "history", req, timeout=HISTORY_TIMEOUT, lacking="has no history")


def load_incidents(state_dir: Path, name: str, session: str, scrub: t.Callable[[str], str] = str) -> list[Incident]:
    """The incidents restart-on-crash wrote for ``name`` (a host, or ``group NAME``) and ``session``, by time;
    each text scrubbed (``scrub``) before it is cut."""
    found = []
    for p in sorted((state_dir / "incidents").glob("*.json")):
        try:
            d = records.parse_record(p.read_bytes())
        except (OSError, ValueError):
            continue  # unreadable (not JSON, NaN, nested too deep...): skipped like any other
        if d.get("host") != name or d.get("session") != session:
            continue

        def text(key: str) -> str | None:
            v = d.get(key)  # noqa: B023
            return scrub(v)[:TEXT_KEEP] if isinstance(v, str) else None

        def whole(key: str) -> int | None:
            v = d.get(key)  # noqa: B023
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        found.append(
            Incident(
                time=text("time"),
                host=text("host"),
                attempt=whole("attempt"),
                state=text("state"),
                cause=text("cause"),
                action=text("action"),
                outcome=text("outcome"),
                reason=text("reason"),
                next_attempt=whole("next_attempt"),
                excluded=text("excluded"),
            )
        )
    return sorted(found, key=lambda i: parse_iso(i.time) or 0.0)


def rows_of(host: Host, session: str, h: wire.HistoryAnswer, incidents: t.Sequence[Incident]) -> list[Row]:
    """The agent's answer -> one Row per attempt, oldest first (incidents not placed yet)."""
    rows = []
    for k, af in enumerate(h.attempts):
        st = _classify(host, session, h, af)
        nxt = h.attempts[k + 1] if k + 1 < len(h.attempts) else None
        by = af.run.started_by if af.run else None
        row = Row(
            host=host.name,
            attempt=af.attempt,
            started_at=st.started_at,
            ended_at=st.ended_at,
            last_seen_at=None,
            duration_s=None,
            state=st.state,
            cause=st.cause,
            detail=st.detail,
            gpu=st.gpu,
            exit_code=st.exit_code,
            signal=st.signal,
            step=st.progress.step if st.progress else None,
            resumed_from=af.resumed_from,
            started_by=dict(by) if by is not None else None,
            cause_from="records" if st.cause else None,
            log=st.log,
            errors=list(af.errors),
        )
        if st.state == State.LOST:
            _lost_cause(row, nxt, incidents)
            marks = [m for m in (af.log.mtime if af.log else None, af.metrics.mtime if af.metrics else None) if m]
            row.last_seen_at = probe.iso(max(marks)) if marks else None
        elif st.state == State.CRASHED:
            _gpu_fault_seen(row, incidents)
        start = parse_iso(row.started_at)
        end = parse_iso(row.ended_at or row.last_seen_at)
        if end is None and row.state in (State.RUNNING, State.STALLED):
            end = h.now
        row.duration_s = max(0.0, end - start) if start is not None and isinstance(end, (int, float)) else None
        rows.append(row)
    return rows


def _classify(host: Host, session: str, h: wire.HistoryAnswer, af: wire.Attempt) -> probe.Status:
    """``status``'s rules on one attempt's facts. There is no tmux view of a past attempt: a lost one's
    cause is found by ``_lost_cause``, or from the container's PID 1 (restarted since)."""
    if af.run is None:
        # no run.json: the runner never wrote one (it died at once, or a run dir from elsewhere)
        return probe.Status(host=host.name, session=session, state=State.LOST, cause=Cause.UNKNOWN, attempt=af.attempt)
    agent = wire.Probe(
        now=h.now,
        pid1_start=h.pid1_start,
        pid1_ticks=h.pid1_ticks,
        oom_kill=None,
        disk=None,
        tmux=None,
        attempt=af,
        capture=None,
        foreign_run=None,
        gpus=None,
        gpu_error=None,
        supervisor=None,
        has_supervisor=False,  # a past attempt's supervisor is not known
        kernel=None,
        checkpoints=None,
    )
    facts = wire.Facts(
        host=host.name,
        session=session,
        socket=host.tmux_socket,
        container_id=None,
        hang_after=host.hang_after,
        startup_grace=host.startup_grace,
        checked_at=h.now,
        mode="agent",
        unreachable=None,
        container_down=None,
        agent_timeout=None,
        agent=agent,
        fallback=None,
        problems=(),
    )
    return probe.judge(facts)


def _lost_cause(row: Row, nxt: wire.Attempt | None, incidents: t.Sequence[Incident]) -> None:
    """What the supervisor saw of a lost attempt outranks what the records can tell afterwards (a tmux
    server killed leaves no trace on disk)."""
    by = nxt.run.started_by if nxt is not None and nxt.run is not None else None
    after = (by or {}).get("after") or {}
    if after.get("attempt") == row.attempt and after.get("state") == State.LOST and after.get("cause"):
        row.cause, row.cause_from = after["cause"], "supervisor"
        row.detail = after.get("detail") or row.detail
        return
    seen = [i for i in incidents if i.attempt == row.attempt and i.state == State.LOST and i.cause]
    if seen:
        row.cause, row.cause_from = seen[-1].cause, "incident"


def _gpu_fault_seen(row: Row, incidents: t.Sequence[Incident]) -> None:
    """A supervisor on the Proxmox host read the host's kernel log, which the records do not hold: the
    gpu-fault it saw outranks the CUDA exception the log tail shows."""
    if row.cause != Cause.GPU_FAULT and any(
        i.attempt == row.attempt and i.state == State.CRASHED and i.cause == Cause.GPU_FAULT for i in incidents
    ):
        row.cause, row.cause_from = Cause.GPU_FAULT, "incident"


def place(rows: list[Row], incidents: t.Sequence[Incident]) -> list[Incident]:
    """Each incident under the attempt it is about, else the newest attempt started by its time (a group's:
    that attempt's last row); returns those older than every attempt shown."""
    starts = sorted(
        ((parse_iso(r.started_at), k) for k, r in enumerate(rows) if parse_iso(r.started_at) is not None),
        key=lambda x: (x[0], rows[x[1]].attempt or 0, x[1]),
    )
    before = []
    for inc in incidents:
        about = [k for k, r in enumerate(rows) if inc.attempt is not None and r.attempt == inc.attempt]
        if about:  # the attempt it is about: its time has whole seconds, and a restart starts the next in the same one
            rows[max(about)].incidents.append(inc)
            continue
        if inc.attempt is not None and all(r.attempt is not None and inc.attempt < r.attempt for r in rows):
            before.append(inc)  # about an attempt older than every one shown, whatever second it was told in
            continue
        when = parse_iso(inc.time)
        if when is None:
            continue
        owner = None
        for start, k in starts:
            if start is not None and start <= when:
                owner = k
        if owner is None:
            before.append(inc)
            continue
        # a group's attempt: the block's last row (every node of that attempt)
        same = [k for k, r in enumerate(rows) if r.attempt == rows[owner].attempt]
        rows[max(same)].incidents.append(inc)
    return before


def history(
    hosts: t.Sequence[Host],
    name: str,
    session: str | None,
    connect: t.Callable[[Host], Remote],
    *,
    state_dir: Path | None,
    last: int | None = None,
) -> History:
    """The history of one host (``name`` = its name) or a group's nodes (``name`` = ``group NAME``)."""
    sess = run.session_name(hosts[0], session)
    # what the runs printed (a crash's detail, the log tail, why a supervisor restarted) is shown scrubbed
    scrub = Scrubber(secret_values(hosts, os.environ))

    def one(h: Host) -> dict[str, t.Any]:
        remote = connect(h)
        try:
            return t.cast(dict[str, t.Any], scrub.tree(fetch(remote, sess, last)))
        finally:
            remote.close()

    incidents: list[Incident] = []
    if state_dir is not None:
        for who in dict.fromkeys([name, *(h.name for h in hosts)]):
            incidents.extend(load_incidents(state_dir, who, sess, scrub))
        incidents.sort(key=lambda i: parse_iso(i.time) or 0.0)
    rows: list[Row] = []
    total: dict[str, int] = {}
    failed: dict[str, str] = {}
    outcomes = fan_out(hosts, one)
    for h, o in zip(hosts, outcomes):
        if o.error is not None:
            if not isinstance(o.error, errors.OpsError) or len(hosts) == 1:
                raise o.error
            failed[h.name] = str(o.error)
            continue
        answer = wire.parse_history(o.value or {})
        total[h.name] = answer.total
        mine = [i for i in incidents if i.host in (h.name, name)]
        rows.extend(rows_of(h, sess, answer, mine))
    rows.sort(key=lambda r: (r.attempt if r.attempt is not None else math.inf, [x.name for x in hosts].index(r.host)))
    before = place(rows, incidents)
    return History(
        name=name,
        session=sess,
        hosts=[h.name for h in hosts],
        rows=rows,
        total=total,
        before=before,
        incidents_dir=str(state_dir / "incidents") if state_dir is not None else None,
        errors=failed,
    )
