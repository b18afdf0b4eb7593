"""restart-on-crash's policy, pure: sequences of Status objects and a fake clock in, Decisions out.
Plus the small real parts of ops/supervise/ (state.py) that need no host: the lock, incident files, the hook.
The loop against real processes is tests/ops/test_fault_matrix.py."""

from __future__ import annotations

import json
import random
import sys
import typing as t
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from ops import errors
from ops.probe import Status, iso
from ops.supervise import (
    DONE,
    GIVE_UP,
    RESTART,
    START_CONTAINER,
    STOP_THEN_RESTART,
    WAIT,
    Decision,
    IncidentLog,
    Lock,
    Options,
    Policy,
    backoff_delay,
    default_state_dir,
    incident_for,
    parse_hook,
    reconnect_delay,
    run_hook,
)

T0 = 1_800_000_000.0  # the fake clock starts here
OOM = "cuda-oom|gpu 5"


def status(
    state: str,
    attempt: int | None = 1,
    *,
    cause: str | None = None,
    fp: str | None = None,
    started: float | None = None,
    ended: float | None = None,
    detail: str | None = None,
) -> Status:
    return Status(
        host="pve",
        session="dflash",
        state=state,
        cause=cause,
        attempt=attempt,
        fingerprint=fp,
        started_at=iso(started),
        ended_at=iso(ended),
        detail=detail,
        exit_code=1 if state == "crashed" else None,
    )


def crashed(
    attempt: int,
    *,
    at: float,
    lived: float = 30.0,
    fp: str | None = "python-exception|KeyError: 'x'",
    cause: str = "python-exception",
) -> Status:
    return status("crashed", attempt, cause=cause, fp=fp, started=at - lived, ended=at, detail=cause)


def policy(**kw: t.Any) -> Policy:
    return Policy(Options(**kw), rng=random.Random(7))


def restart_now(p: Policy, st: Status, now: float) -> tuple[Decision, float]:
    """Observe ``st`` until its recovery is due (the loop re-probes while it waits), carry it out."""
    d = p.observe(st, now)
    assert d.action in (RESTART, STOP_THEN_RESTART), d
    now += d.delay
    due = p.observe(st, now)
    assert due.action == d.action and due.delay == 0 and not due.new
    p.recovered(now, d.action, attempt=(st.attempt or 0) + 1)
    return d, now


# ---------------------------------------------------------------------------------------------
# what is restarted, and what never is


def test_a_first_crash_even_an_early_one_is_restarted_after_the_first_backoff() -> None:
    p = policy(backoff=10, max_backoff=900)
    d = p.observe(crashed(1, at=T0, lived=2), T0)
    assert (d.action, d.new) == (RESTART, True)
    assert (
        10 <= d.delay <= 12.5
        and d.reason.startswith("restart in ")
        and "(restart 1 of at most 5 within 60m)" in d.reason
    )
    # the loop re-probes while the backoff runs: same plan, not a new incident
    half = p.observe(crashed(1, at=T0, lived=2), T0 + 5)
    assert (half.action, half.new) == (RESTART, False) and half.delay == pytest.approx(d.delay - 5)
    due = p.observe(crashed(1, at=T0, lived=2), T0 + 13)
    assert (due.action, due.delay, due.new) == (RESTART, 0.0, False)
    p.recovered(T0 + 13, RESTART, attempt=2)
    assert p.pending is None and p.last_started == 2 and p.restarts == [T0 + 13]


def test_lost_is_restarted() -> None:
    d = policy().observe(status("lost", 1, cause="container-restart"), T0)
    assert (d.action, d.new) == (RESTART, True)


@pytest.mark.parametrize(
    "state, cause",
    [("succeeded", None), ("stopped", None), ("not-started", None), ("running", None), ("unreachable", "refused")],
)
def test_never_restarted(state: str, cause: str | None) -> None:
    p = policy(restart_stalled=True, start_container=True, retry_oom=True)
    for i in range(5):
        d = p.observe(status(state, 1, cause=cause), T0 + 100 * i)
        assert d.action not in (RESTART, STOP_THEN_RESTART, START_CONTAINER), d
    assert p.restarts == [] and p.pending is None


def test_succeeded_is_done_and_stopped_is_reported_once_then_watched() -> None:
    p = policy()
    d = p.observe(status("stopped"), T0)
    assert (d.action, d.new) == (WAIT, True) and "stopped on purpose" in d.reason and "not restarted" in d.reason
    assert p.observe(status("stopped"), T0 + 30).new is False
    d = p.observe(status("succeeded"), T0 + 60)
    assert (d.action, d.new) == (DONE, True)


def test_what_a_dead_keeper_left_running_is_stopped_then_restarted_unless_a_stop_was_asked() -> None:
    orphans = status("crashed", 1, cause="orphans-left", fp="orphans-left", detail="pid 21 (python train.py)")
    d = policy().observe(orphans, T0)
    assert (d.action, d.new) == (STOP_THEN_RESTART, True) and d.reason.startswith("stop and restart in "), d
    orphans.stop_requested = True  # a stop was asked for and did not end them: a human's job
    d = policy().observe(orphans, T0)
    assert (d.action, d.new) == (WAIT, True) and "`dflashctl stop`" in d.reason, d


def test_cuda_oom_is_restarted_only_with_retry_oom() -> None:
    oom = crashed(1, at=T0, fp=OOM, cause="cuda-oom")
    d = policy().observe(oom, T0)
    assert (d.action, d.new) == (WAIT, True) and "--retry-oom" in d.reason
    p = policy()
    p.observe(oom, T0)
    assert p.observe(oom, T0 + 30) == Decision(WAIT, d.reason)  # said once, not again
    assert policy(retry_oom=True).observe(oom, T0).action == RESTART


def test_stalled_is_stopped_and_restarted_only_with_restart_stalled() -> None:
    st = status("stalled", 1, detail="no progress for 20m")
    d = policy().observe(st, T0)
    assert (d.action, d.new) == (WAIT, True) and "--restart-stalled" in d.reason
    d = policy(restart_stalled=True).observe(st, T0)
    assert (d.action, d.new) == (STOP_THEN_RESTART, True) and d.reason.startswith("stop and restart in ")


def test_a_stalled_run_that_moves_again_cancels_its_restart() -> None:
    p = policy(restart_stalled=True)
    p.observe(status("stalled", 1), T0)
    d = p.observe(status("running", 1), T0 + 3)
    assert d.action == WAIT and d.cancelled and "is running now" in d.cancelled
    assert p.pending is None


def test_container_down_is_started_only_with_start_container() -> None:
    down = status("container-down", None, cause="stopped")
    p = policy()
    d = p.observe(down, T0)
    assert (d.action, d.new) == (WAIT, True) and "pass --start-container" in d.reason
    assert p.observe(down, T0 + 30).new is False
    p = policy(start_container=True, backoff=10)
    d = p.observe(down, T0)
    assert (d.action, d.new) == (START_CONTAINER, True) and 10 <= d.delay <= 12.5
    assert p.observe(down, T0 + 13).delay == 0
    p.recovered(T0 + 13, START_CONTAINER)
    assert p.restarts == []  # starting the container is not a restart of the run
    # a missing container cannot be started
    d = policy(start_container=True).observe(status("container-down", None, cause="missing"), T0)
    assert d.action == WAIT and "does not exist" in d.reason


def test_a_container_that_will_not_start_is_tried_again_with_growing_backoff() -> None:
    p = policy(start_container=True, backoff=10, max_backoff=1000)
    down = status("container-down", None, cause="stopped")
    d = p.observe(down, T0)
    now = T0 + d.delay
    delays = []
    for _ in range(3):
        assert p.observe(down, now).delay == 0
        delays.append(p.recovered(now, START_CONTAINER, ok=False, error="pct start: failed"))
        now += delays[-1]
    assert 20 <= delays[0] <= 25 and 40 <= delays[1] <= 50 and 80 <= delays[2] <= 100


# ---------------------------------------------------------------------------------------------
# backoff


def test_backoff_doubles_with_jitter_up_to_max_backoff() -> None:
    p = policy(backoff=10, max_backoff=100, max_restarts=100)
    now, delays = T0, []
    for n in range(1, 7):
        # a different bug each time, each early: only the backoff grows
        d, now = restart_now(p, crashed(n, at=now, lived=5, fp=f"python-exception|E{'x' * n}"), now)
        delays.append(d.delay)
        now += 5
    for k, d in enumerate(delays):
        assert min(100, 10 * 2**k) <= d <= min(100, 12.5 * 2**k), (k, delays)
    assert delays[-1] == 100 and delays[-2] == 100


def test_backoff_resets_after_a_run_survives_min_uptime() -> None:
    p = policy(backoff=10, max_backoff=1000, min_uptime=600, max_restarts=100)
    now = T0
    for n in range(1, 4):
        d, now = restart_now(p, crashed(n, at=now, lived=5, fp=f"python-exception|E{'x' * n}"), now)
    assert p.streak == 3
    # attempt 4 is seen alive for 10 minutes
    for dt in (0, 300, 601):
        p.observe(status("running", 4), now + dt)
    assert p.streak == 0
    d = p.observe(crashed(4, at=now + 700, lived=700), now + 700)
    assert d.action == RESTART and 10 <= d.delay <= 12.5


def test_a_crash_after_a_long_unwatched_life_resets_the_backoff_too() -> None:
    p = policy(backoff=10, max_backoff=1000, min_uptime=600, max_restarts=100)
    now = T0
    for n in range(1, 4):
        d, now = restart_now(p, crashed(n, at=now, lived=5, fp=f"python-exception|E{'x' * n}"), now)
    # the supervisor never saw attempt 4 run (a long outage); its records say it lived 2 hours
    d = p.observe(crashed(4, at=now + 7200, lived=7200), now + 7200)
    assert d.action == RESTART and 10 <= d.delay <= 12.5


@given(hs.integers(0, 80), hs.floats(0, 1000), hs.floats(0, 5000), hs.integers(0, 2**32))
def test_backoff_delay_stays_between_backoff_and_max_backoff(
    streak: int, backoff: float, extra: float, seed: int
) -> None:
    d = backoff_delay(streak, backoff, backoff + extra, random.Random(seed))
    assert backoff <= d <= backoff + extra


@given(hs.integers(1, 200), hs.floats(0.01, 600), hs.integers(0, 2**32))
def test_reconnect_delay_grows_to_a_cap(failures: int, interval: float, seed: int) -> None:
    d = reconnect_delay(failures, interval, random.Random(seed))
    first, cap = min(interval, 1.0), max(interval, 60.0)
    nominal = min(cap, first * 2 ** (failures - 1))
    assert nominal / 2 <= d <= nominal


# ---------------------------------------------------------------------------------------------
# the crash-loop guard


def test_the_same_fingerprint_twice_before_min_uptime_is_a_crash_loop() -> None:
    p = policy(retry_oom=True, min_uptime=600)
    # after 3 hours: not early, so it starts no row
    _, now = restart_now(p, crashed(1, at=T0, lived=3 * 3600, fp=OOM, cause="cuda-oom"), T0)
    # the first early one is restarted (transient failures happen)
    _, now = restart_now(p, crashed(2, at=now + 120, lived=120, fp=OOM, cause="cuda-oom"), now + 120)
    d = p.observe(crashed(3, at=now + 90, lived=90, fp=OOM, cause="cuda-oom"), now + 90)
    assert (d.action, d.new) == (GIVE_UP, True)
    assert "crash loop: the same failure twice in a row, the second after 90s, before --min-uptime 10m" in d.reason
    assert "CUDA out of memory" in d.reason
    assert "attempt 3" in d.reason


def test_a_new_supervisor_does_not_count_the_same_crashed_attempt_twice() -> None:
    # cron's --once judged attempt 3 and its restart failed (ssh dropped); the next --once sees attempt 3 again
    p = policy(once=True, min_uptime=600)
    p.observe(crashed(3, at=T0, lived=30), T0)
    p.recovered(T0, RESTART, ok=False, error="connection lost")
    q = policy(once=True, min_uptime=600)
    q.load(json.loads(json.dumps(p.memory())))
    assert q.observe(crashed(3, at=T0, lived=30), T0 + 300).action == RESTART


def test_the_same_fingerprint_after_min_uptime_is_restarted() -> None:
    p = policy(min_uptime=600)
    _, now = restart_now(p, crashed(1, at=T0, lived=10), T0)
    assert p.observe(crashed(2, at=now + 700, lived=700), now + 700).action == RESTART


def test_a_different_failure_in_between_breaks_the_row() -> None:
    p = policy(min_uptime=600)
    _, now = restart_now(p, crashed(1, at=T0, lived=10), T0)
    _, now = restart_now(p, status("lost", 2, cause="unknown"), now + 10)
    assert p.observe(crashed(3, at=now + 10, lived=10), now + 10).action == RESTART
    _, now = restart_now(p, crashed(3, at=now + 10, lived=10), now + 10)
    assert p.observe(crashed(4, at=now + 10, lived=10, fp="python-exception|ValueError: y"), now + 10).action == RESTART


def test_more_than_max_restarts_within_the_window_gives_up() -> None:
    p = policy(max_restarts=2, window=3600, min_uptime=0)
    now = T0
    for n in (1, 2):
        _, now = restart_now(p, crashed(n, at=now), now)
        now += 60
    d = p.observe(crashed(3, at=now), now)
    assert (d.action, d.new) == (GIVE_UP, True)
    assert "crash loop: 2 restarts within --window 60m (--max-restarts 2); last failure: crashed:" in d.reason


def test_restarts_older_than_the_window_do_not_count() -> None:
    p = policy(max_restarts=2, window=3600, min_uptime=0)
    now = T0
    for n in (1, 2):
        _, now = restart_now(p, crashed(n, at=now), now)
    now += 3601
    assert p.observe(crashed(3, at=now), now).action == RESTART


def test_max_restarts_zero_only_reports() -> None:
    d = policy(max_restarts=0).observe(crashed(1, at=T0), T0)
    assert d.action == GIVE_UP and "0 restarts within" in d.reason


def test_a_start_that_keeps_failing_is_retried_with_backoff_then_given_up() -> None:
    p = policy(max_restarts=3, backoff=10, max_backoff=1000, min_uptime=600)
    st = crashed(1, at=T0, lived=5)
    d = p.observe(st, T0)
    now = T0 + d.delay
    for i in range(3):
        assert p.observe(st, now).action == RESTART  # the same failure: never a fingerprint "loop"
        delay = p.recovered(now, RESTART, ok=False, error="agent start: tmux could not create session")
        assert delay is not None and delay >= 10 * 2 ** (i + 1)
        assert p.observe(st, now + 1).delay > 0
        now += delay
    d = p.observe(st, now)
    assert d.action == GIVE_UP and "3 restart tries" in d.reason and "tmux could not create session" in d.reason


def test_a_container_outage_between_two_probes_of_one_crash_is_not_a_second_crash() -> None:
    p = policy(start_container=True, min_uptime=600)
    st = crashed(1, at=T0, lived=5)
    assert p.observe(st, T0).new
    p.observe(status("container-down", None, cause="stopped"), T0 + 1)
    d = p.observe(st, T0 + 30)  # the container is back; the same crashed attempt
    assert d.action == RESTART and not d.new


# ---------------------------------------------------------------------------------------------
# outages, humans, memory


def test_an_outage_never_restarts_and_the_planned_restart_waits_for_a_fresh_probe() -> None:
    p = policy(backoff=10)
    st = crashed(1, at=T0)
    p.observe(st, T0)
    d = p.observe(status("unreachable", None, cause="refused"), T0 + 20)
    assert (d.action, d.new) == (WAIT, True) and "not a crash" in d.reason
    d = p.observe(status("unreachable", None, cause="timeout"), T0 + 40)
    assert (d.action, d.new) == (WAIT, False)
    d = p.observe(st, T0 + 60)  # reconnected: the fresh probe still says crashed
    assert (d.action, d.delay, d.recovered_after) == (RESTART, 0.0, 40)


def test_a_run_started_by_hand_cancels_the_plan_and_resets_the_memory() -> None:
    p = policy(min_uptime=600)
    _, now = restart_now(p, crashed(1, at=T0), T0)
    p.observe(crashed(2, at=now + 5, fp="python-exception|E: other"), now + 5)
    assert p.pending is not None
    d = p.observe(status("running", 3), now + 8)  # someone ran `dflashctl start`
    assert d.cancelled and "attempt 3 appeared" in d.cancelled
    assert d.note and "crash-loop memory reset" in d.note
    assert p.pending is None and p.restarts == [] and p.streak == 0 and p.last_fingerprint is None
    # so its first crash is a first crash again
    assert p.observe(crashed(3, at=now + 20, fp="python-exception|E: other"), now + 20).action == RESTART


def test_attempt_numbers_going_back_are_a_new_run_history() -> None:
    # The run dir was moved aside (the demo does it) and a new attempt-1 crashes: a first crash,
    # not the same fingerprint again.
    p = policy(retry_oom=True, min_uptime=600)
    _, now = restart_now(p, crashed(1, at=T0, fp=OOM, cause="cuda-oom"), T0)
    mem = json.loads(json.dumps(p.memory()))
    q = policy(retry_oom=True, min_uptime=600)
    q.load(mem)
    d = q.observe(crashed(1, at=now + 30, lived=30, fp=OOM, cause="cuda-oom"), now + 30)
    assert d.action == RESTART and d.note and "attempts went back from 2" in d.note


def test_the_memory_survives_the_supervisor() -> None:
    p = policy(retry_oom=True)
    _, now = restart_now(p, crashed(1, at=T0, fp=OOM, cause="cuda-oom"), T0)
    mem = json.loads(json.dumps(p.memory()))
    q = policy(retry_oom=True)
    q.load(mem)
    # cron runs --once again: the restarted attempt OOMed at once, the same way
    d = q.observe(crashed(2, at=now + 30, lived=30, fp=OOM, cause="cuda-oom"), now + 30)
    assert d.action == GIVE_UP
    # but an attempt the memory does not know was started by hand
    r = policy(retry_oom=True)
    r.load(mem)
    assert r.observe(crashed(3, at=now + 30, lived=30, fp=OOM, cause="cuda-oom"), now + 30).action == RESTART


def test_a_state_already_announced_is_not_announced_again_by_the_next_once() -> None:
    oom = crashed(1, at=T0, fp=OOM, cause="cuda-oom")
    p = policy()
    assert p.observe(oom, T0).new
    q = policy()
    q.load(json.loads(json.dumps(p.memory())))  # the next cron run
    d = q.observe(oom, T0 + 300)
    assert d.action == WAIT and not d.new
    assert q.observe(status("stopped", 2), T0 + 600).new  # something else is news again


def test_a_damaged_memory_is_ignored() -> None:
    p = policy()
    p.load({"restarts": ["x", 5], "streak": -3, "last_fingerprint": 7, "last_started": "2", "seen": [[1], 2]})
    assert (p.restarts, p.streak, p.last_fingerprint, p.last_started, p.seen) == ([5.0], 0, None, None, None)


STATES = [
    "running",
    "stalled",
    "succeeded",
    "crashed",
    "lost",
    "not-started",
    "stopped",
    "container-down",
    "unreachable",
]


@settings(max_examples=200, deadline=None)
@given(
    hs.lists(
        hs.tuples(hs.sampled_from(STATES), hs.integers(1, 4), hs.floats(0, 2000), hs.booleans()),
        min_size=1,
        max_size=40,
    ),
    hs.booleans(),
    hs.booleans(),
    hs.booleans(),
)
def test_any_sequence_of_states_keeps_the_rules(
    seq: list[tuple[str, int, float, bool]], stalled: bool, container: bool, oom: bool
) -> None:
    o = dict(
        backoff=10,
        max_backoff=300,
        restart_stalled=stalled,
        start_container=container,
        retry_oom=oom,
        max_restarts=3,
        window=3600,
    )
    p = policy(**o)
    now = T0
    for state, attempt, dt, is_oom in seq:
        now += dt
        cause = "cuda-oom" if (state == "crashed" and is_oom) else "python-exception" if state == "crashed" else None
        fp = (OOM if is_oom else "python-exception|E") if state == "crashed" else None
        st = status(
            state,
            None if state in ("container-down", "unreachable", "not-started") else attempt,
            cause=cause or ("stopped" if state == "container-down" else None),
            fp=fp,
            started=now - 50,
            ended=now if state in ("crashed", "succeeded") else None,
        )
        d = p.observe(st, now)
        assert 0 <= d.delay <= 300
        if d.action in (RESTART, STOP_THEN_RESTART):
            assert state in ("crashed", "lost", "stalled")
            assert state != "stalled" or stalled
            assert not (state == "crashed" and is_oom and not oom)
            assert d.action == (STOP_THEN_RESTART if state == "stalled" else RESTART)
            if d.delay == 0:
                p.recovered(now, d.action, attempt=attempt + 1)
        elif d.action == START_CONTAINER:
            assert state == "container-down" and container
        elif d.action == GIVE_UP:
            assert state in ("crashed", "lost", "stalled") and "crash loop" in d.reason
            return
        elif d.action == DONE:
            assert state == "succeeded"
        assert len(p.restarts) <= 3


# ---------------------------------------------------------------------------------------------
# options, state dir, lock, incidents, hook


@pytest.mark.parametrize(
    "kw, where, text",
    [
        (dict(backoff=20, max_backoff=5), "--max-backoff", "must be >= --backoff (20), got 5"),
        (dict(interval=0), "--interval", "must be more than 0 seconds"),
        (dict(min_uptime=-1), "--min-uptime", "expected a number of seconds >= 0, got -1"),
        (dict(max_restarts=-2), "--max-restarts", "expected a whole number >= 0, got -2"),
    ],
)
def test_bad_options_name_the_option(kw: dict[str, t.Any], where: str, text: str) -> None:
    with pytest.raises(errors.ConfigError) as e:
        Options(**kw)
    assert e.value.path == where and text in str(e.value)


def test_default_state_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "dflashctl"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_state_dir() == tmp_path / "home" / ".local" / "state" / "dflashctl"


def test_one_lock_per_host_and_session(tmp_path: Path) -> None:
    path = tmp_path / "supervise" / "pve.dflash.lock"
    with Lock(path, "pve/dflash"):
        with pytest.raises(errors.SupervisorLocked) as e:
            Lock(path, "pve/dflash").acquire()
        import os

        assert f"restart-on-crash is already watching pve/dflash: pid {os.getpid()} since " in str(e.value)
        assert str(path) in str(e.value)
        Lock(tmp_path / "supervise" / "pve.other.lock", "pve/other").acquire().release()  # another session: fine
    Lock(path, "pve/dflash").acquire().release()  # released: free again


def test_a_second_watcher_between_the_firsts_lock_and_its_pid_waits_for_the_pid(tmp_path: Path) -> None:
    """The holder writes who it is just after taking the lock; a second restart-on-crash reading in between
    said "pid ?". It waits for it now (ops/far/lock.holder_json, shared with the host-side install lock)."""
    import fcntl
    import os
    import threading

    path = tmp_path / "supervise" / "pve.dflash.lock"
    path.parent.mkdir(mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        late = threading.Timer(0.3, lambda: os.pwrite(fd, b'{"pid": 4242, "since": "2026-12-03 07:00:00"}\n', 0))
        late.start()
        with pytest.raises(errors.SupervisorLocked) as e:
            Lock(path, "pve/dflash").acquire()
        late.join()
        assert "already watching pve/dflash: pid 4242 since 2026-12-03 07:00:00 holds" in str(e.value)
    finally:
        os.close(fd)


def test_incident_files_and_the_hook(tmp_path: Path) -> None:
    st = crashed(3, at=T0)
    st.tail = ["step 7 | loss 1.0", "Traceback (most recent call last):", "KeyError: 'x'"]
    st.evidence = ["exit.json: exit 1"]
    inc = incident_for(st, Decision(RESTART, "restart in 10s", delay=10.2, new=True), T0, restarts=1, opts=Options())
    log = IncidentLog(tmp_path / "state", "pve", "dflash")
    path = log.path_for(inc, T0)
    log.write(path, inc)
    saved = json.loads(path.read_text())
    assert path.parent == tmp_path / "state" / "incidents" and "pve-dflash-attempt3-crashed" in path.name
    assert (saved["state"], saved["attempt"], saved["action"], saved["outcome"]) == ("crashed", 3, "restart", "pending")
    assert saved["log_tail"][-1] == "KeyError: 'x'" and saved["evidence"] == ["exit.json: exit 1"]
    assert saved["time"] == iso(T0) and saved["next_attempt"] is None

    hook = tmp_path / "hook.py"
    out = tmp_path / "hook-out.json"
    hook.write_text(
        "import json, os, sys\n"
        f"json.dump({{'stdin': json.load(sys.stdin), 'env': {{k: v for k, v in os.environ.items() "
        f"if k.startswith('DFLASHCTL_')}}, 'argv': sys.argv[1:]}}, open({str(out)!r}, 'w'))\n"
    )
    argv = parse_hook(f"{sys.executable} {hook} 'two words'")
    res = run_hook(argv, saved, path)
    assert res == {"ok": True, "exit_code": 0, "error": None}
    got = json.loads(out.read_text())
    assert got["stdin"] == saved and got["argv"] == ["two words"]
    assert got["env"] == {
        "DFLASHCTL_STATE": "crashed",
        "DFLASHCTL_CAUSE": "python-exception",
        "DFLASHCTL_HOST": "pve",
        "DFLASHCTL_SESSION": "dflash",
        "DFLASHCTL_ACTION": "restart",
        "DFLASHCTL_ATTEMPT": "3",
        "DFLASHCTL_INCIDENT": str(path),
    }


def test_a_failing_hook_is_reported_never_raised(tmp_path: Path) -> None:
    inc = {"state": "crashed", "host": "pve", "session": "dflash", "action": "restart"}
    res = run_hook(["sh", "-c", "echo no webhook >&2; exit 4"], inc, None)
    assert res["ok"] is False and res["exit_code"] == 4 and res["error"].endswith("exit 4: no webhook")
    res = run_hook(["/nonexistent/notify"], inc, None)
    assert res["ok"] is False and res["exit_code"] == 127 and "/nonexistent/notify" in res["error"]


def test_parse_hook_errors_name_the_option() -> None:
    with pytest.raises(errors.ConfigError) as e:
        parse_hook("notify 'unclosed")
    assert e.value.path == "--on-event" and "cannot split" in str(e.value)
    with pytest.raises(errors.ConfigError):
        parse_hook("   ")
    assert parse_hook(None) is None


def test_once_restarts_now_and_says_so() -> None:
    p = policy(once=True, backoff=10)
    d = p.observe(crashed(1, at=T0), T0)
    assert (d.action, d.delay) == (RESTART, 0.0) and d.reason.startswith("restart now (--once)")


def test_supervise_status_of_a_mistyped_answer_names_each_bad_key_in_one_line() -> None:
    from ops import wire
    from ops.supervise import install

    answer = {
        "installed": True,
        "running": True,
        "pid": "123",  # a pid as a string: not shown as one
        "since": "2026-12-01 10:00:00",
        "service": {"mode": "tmux", "tmux_socket": "s"},
        "unit": {"tmux_session": "alive"},
        "incidents": {"count": 2, "newest": ["junk", {"time": "t1", "state": "lost", "action": "wait"}]},
        "log": "/x/supervisor.log",
    }
    lines = install.status_lines("pve", "dflash", wire.parse_supervisor_status(answer))
    assert lines[0] == "supervisor of pve/dflash on pve: running (tmux, pid None, since 2026-12-01 10:00:00)"
    assert "    t1  lost: wait None" in lines
    assert [x for x in lines if x.startswith("  unreadable:")] == [
        "  unreadable:  supervise status: pid: expected a whole number",
        "  unreadable:  supervise status.incidents: newest: expected a list of objects",
    ]


# ---------------------------------------------------------------------------------------------
# a run that diverged (dflash train exit 3): never restarted blindly

DIVERGED = "diverged at step 51: loss not finite; last finite checkpoint: /r/checkpoints/step-50 (step 50)"


def diverged(attempt: int, *, at: float) -> Status:
    return status("crashed", attempt, cause="diverged", fp="diverged|x", started=at - 900, ended=at, detail=DIVERGED)


def test_a_diverged_run_gives_up_by_default_naming_the_last_finite_checkpoint() -> None:
    d = policy().observe(diverged(1, at=T0), T0)
    assert (d.action, d.kind, d.new) == (GIVE_UP, "diverged", True)
    assert "last finite checkpoint (/r/checkpoints/step-50 (step 50))" in d.reason and DIVERGED in d.reason
    assert "--on-diverged resume-from-last-finite" in d.reason


def test_on_diverged_resumes_once_then_gives_up_and_the_memory_keeps_it() -> None:
    p = policy(on_diverged="resume-from-last-finite")
    d, now = restart_now(p, diverged(1, at=T0), T0)
    assert "resuming once from the last finite checkpoint (/r/checkpoints/step-50 (step 50))" in d.reason
    assert "the same data position replays" in d.reason
    q = policy(on_diverged="resume-from-last-finite")
    q.load(json.loads(json.dumps(p.memory())))  # a supervisor restarted in between
    again = q.observe(diverged(2, at=now + 900), now + 900)
    assert (again.action, again.kind) == (GIVE_UP, "diverged")
    assert again.reason.startswith("it diverged again after the one resume")


def test_on_diverged_is_checked() -> None:
    with pytest.raises(errors.ConfigError) as e:
        Options(on_diverged="retry")
    assert e.value.path == "--on-diverged"


def test_a_loss_spike_is_news_once_also_for_the_next_once() -> None:
    p = policy()
    assert [p.spike_news(1, s) for s in (40, 40, 30, 60)] == [True, False, False, True]
    q = policy()
    q.load(p.memory())
    assert (q.spike_news(1, 60), q.spike_news(2, 10)) == (False, True)
