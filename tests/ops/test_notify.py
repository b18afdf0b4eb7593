"""restart-on-crash --notify: messages through the real apprise to a real HTTP server
on 127.0.0.1 (``json://``), one that is down and one that hangs; never a secret in a message.

The notifier alone first (real apprise, real server), then the real dflashctl supervising a run in the
fake Proxmox container over the test sshd.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest

from ops import errors
from ops.hosts import Host, ProxmoxApi
from ops.notify import REDACTED, Message, Notifier, Scrubber, label, message_for, secret_values
from testkit import PveHosts, free_port, retry_until
from testkit.faultrig import FAST, K, Rig
from testkit.runkit import LEAKY_TOKEN, leaked, leaky_command
from testkit.webhook import Webhook

pytest.importorskip("apprise")

HF_TOKEN = "hf_Zq8secretTOKENvalue42"
API_TOKEN = "pve-api-4c1d-secret-9e77"
SAID: list[str] = []


def incident(**kw: t.Any) -> dict[str, t.Any]:
    base: dict[str, t.Any] = {
        "time": "2026-11-29T23:40:03Z",
        "host": "pve",
        "session": "dflash",
        "attempt": 3,
        "state": "crashed",
        "cause": "cuda-oom",
        "detail": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5",
        "exit_code": 1,
        "signal": None,
        "gpu": 5,
        "progress": {"step": 1200, "loss": 2.31, "ktok_s": 19.4, "at": "2026-11-29T23:39:58Z"},
        "evidence": ["exit.json: exit 1 at 2026-11-29T23:40:02Z"],
        "log": "/runs/dflash/attempt-3/train.log",
        "log_tail": [f"line {i}" for i in range(30)] + ["torch.OutOfMemoryError: CUDA out of memory."],
        "action": "restart",
        "reason": "restart in 12s (restart 1 of at most 5 within 60m)",
        "outcome": "pending",
        "next_attempt": None,
        "error": None,
        "supervisor_pid": 4242,
    }
    base.update(kw)
    return base


def test_a_message_per_incident_kind_with_host_session_attempt_step_and_the_tails_last_lines() -> None:
    m = message_for(incident())
    assert m.kind == "crashed" and m.level == "failure"
    assert (
        m.title
        == "dflash pve/dflash: crashed (cuda-oom), attempt 3: restart in 12s (restart 1 of at most 5 within 60m)"
    )
    body = m.body.splitlines()
    assert body[0] == "host pve, session dflash, attempt 3"
    assert "last step 1200 (loss 2.31, at 2026-11-29T23:39:58Z)" in body and "exit 1" in body
    assert body[body.index("last 10 lines of /runs/dflash/attempt-3/train.log:") + 10] == (
        "  torch.OutOfMemoryError: CUDA out of memory."
    )
    assert "  line 20" not in body and "  line 21" in body  # the last 10 lines only
    kinds = {
        "restarted": incident(outcome="done", next_attempt=4),
        "restart-failed": incident(outcome="failed", error="tmux could not create session"),
        "gave-up": incident(action="give-up", outcome="noted", reason="crash loop: 5 restarts within --window 60m"),
        "succeeded": incident(state="succeeded", cause=None, action="done", outcome="noted"),
        "container-down": incident(state="container-down", cause="stopped", action="start-container"),
        "container-started": incident(
            state="container-down", cause="stopped", action="start-container", outcome="done"
        ),
        "lost": incident(state="lost", cause="tmux-server-killed", action="wait", outcome="noted"),
        "stopped": incident(state="stopped", cause=None, action="wait", outcome="noted"),
        "unreachable": incident(state="unreachable", cause="refused", action="wait", outcome="pending"),
        "reachable": incident(
            state="unreachable", cause="refused", action="wait", outcome="recovered", outage_seconds=9
        ),
    }
    for kind, inc in kinds.items():
        assert message_for(inc).kind == kind, (kind, message_for(inc))
    assert message_for(kinds["restarted"]).title == (
        "dflash pve/dflash: restarted: attempt 4 started after crashed (cuda-oom), attempt 3"
    )
    assert message_for(kinds["gave-up"]).title.endswith("gave up: crash loop: 5 restarts within --window 60m")


def test_secrets_are_scrubbed_host_env_values_and_the_api_token() -> None:
    host = Host(
        name="pve",
        transport="ssh",
        workdir="/w",
        run_dir="/w/runs",
        address="127.0.0.1",
        command=("python",),
        env={"HF_TOKEN": HF_TOKEN, "CUDA_VISIBLE_DEVICES": "0", "NCCL_DEBUG": "WARN"},
        proxmox=ProxmoxApi(node="pve", api_host="127.0.0.1", token_name="dflashctl", token_value_env="PVE_TOKEN"),
    )
    secrets = secret_values([host], {"PVE_TOKEN": API_TOKEN, "OTHER": "nope"})
    assert set(secrets) == {HF_TOKEN, "0", "WARN", API_TOKEN}
    scrub = Scrubber(secrets)
    assert scrub(f"token={HF_TOKEN} api {API_TOKEN} on GPU 0 NCCL WARN") == (
        f"token={REDACTED} api {REDACTED} on GPU 0 NCCL {REDACTED}"
    ), "values under 4 characters are no secrets: digits stay"
    assert Scrubber(["abcd", "abcdefgh"])("xabcdefghx abcd") == f"x{REDACTED}x {REDACTED}", "the longest first"
    # a URL's label never shows its token; a webhook's host and port are no secret
    assert label("slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7F", 2) == "--notify #2 (slack://...)"
    assert label("json://127.0.0.1:8080/hook?token=x", 1) == "--notify #1 (json://127.0.0.1:8080)"


def test_every_form_of_a_secret_and_a_cut_ones_head_or_tail_is_scrubbed() -> None:
    import urllib.parse

    from ops.courier import ERROR_CHARS, _Words
    from ops.redaction import url_secrets

    tok = LEAKY_TOKEN
    scrub = Scrubber([tok])
    shown = {
        "plain": tok,
        "percent": urllib.parse.quote(tok, safe=""),
        "plus": urllib.parse.quote_plus(tok),
        "lower hex": urllib.parse.quote(tok, safe="").replace("%2F", "%2f"),
        "json": json.dumps({"t": tok}),
        "repr": repr({"t": tok}),
        "json in a query": urllib.parse.quote(json.dumps(tok)),
    }
    for what, text in shown.items():
        assert leaked(scrub(f"said: {text} !")) == [], what
    head, tail = tok[:17], tok[9:]
    assert scrub(f"ValueError: {head}...") == f"ValueError: {REDACTED}..."
    assert scrub(f"log: {head}\nnext") == f"log: {REDACTED}\nnext", "a line's end is a cut"
    assert scrub(f"...{tail} was refused") == f"...{REDACTED} was refused"
    assert scrub("GPU 0 NCCL WARN hf_h5 fine") == "GPU 0 NCCL WARN hf_h5 fine", "5 characters are no head"
    # a --notify URL's token, in apprise's words cut to ERROR_CHARS by the delivery process: scrubbed first
    url = "slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7F"
    words = _Words(Scrubber(url_secrets(url)))
    words.said("x" * (ERROR_CHARS - 12) + " token TIiajkdnlazkcOXrIdevi7F refused")
    assert "TIiajk" not in words.last and len(words.last) <= ERROR_CHARS


def test_delivered_scrubbed_from_a_thread_of_its_own() -> None:
    with Webhook() as hook:
        n = Notifier([hook.url], secrets=[HF_TOKEN], say=SAID.append)
        for k in range(3):
            n.incident(incident(attempt=k, detail=f"KeyError: {HF_TOKEN}", log_tail=[f"export HF_TOKEN={HF_TOKEN}"]))
        n.close(10)
    assert n.sent == 3 and n.dropped == n.failed == 0
    assert [m["title"].split(": ")[1] for m in hook.messages] == [f"crashed (cuda-oom), attempt {k}" for k in range(3)]
    first = hook.messages[0]
    assert first["type"] == "failure" and "crashed (cuda-oom), attempt 0: KeyError: [redacted]" in first["message"]
    assert f"  export HF_TOKEN={REDACTED}" in first["message"].splitlines()
    assert HF_TOKEN not in hook.texts()


def test_a_hanging_server_holds_only_its_own_queue_and_a_full_queue_drops_counted() -> None:
    said: list[str] = []
    with Webhook() as slow:
        slow.hang()
        n = Notifier([slow.url + "?rto=120"], say=said.append, queue_size=2)
        n.send(Message("x", "first", "body"))
        retry_until(lambda: slow.held == 1, 30)  # taken by the server, never answered
        for k in range(4):
            n.send(Message("x", f"then {k}", "body"))  # returns at once: 2 wait, 2 are dropped
        assert n.dropped == 2 and n.sent == 0
        drops = [x for x in said if "dropped" in x]
        assert drops == [
            f"notify: --notify #1 (json://127.0.0.1:{slow.port}): 2 messages wait already: dropped 'then {k}' "
            f"({k - 1} dropped so far)"
            for k in (2, 3)
        ]
        slow.release()
        retry_until(lambda: len(slow.messages) == 3, 30)
        n.close(10)
    assert slow.titles() == ["first", "then 0", "then 1"] and n.sent == 3 and n.dropped == 2


def test_a_server_that_is_down_is_retried_with_backoff_until_it_is_up() -> None:
    said: list[str] = []
    hook = Webhook()  # not listening yet
    n = Notifier([hook.url], say=said.append, first_retry=0.2, max_retry=0.5, tries=40)
    n.incident(incident())
    retry_until(lambda: any("not delivered; retrying with backoff" in x for x in said), 30)
    assert n.sent == 0
    with hook.start():
        retry_until(lambda: hook.messages, 30)
        n.close(5)
    assert n.sent == 1 and n.failed == 0
    assert any(
        x.startswith("notify: --notify #1 (json://127.0.0.1:") and "delivered" in x and "on try" in x for x in said
    )
    # a server that stays down: given up after `tries`, counted, said
    down = Notifier([f"json://127.0.0.1:{free_port()}/"], say=said.append, first_retry=0.01, tries=3)
    down.incident(incident())
    retry_until(lambda: down.failed == 1, 30)
    assert any("gave up on" in x and "after 3 tries (1 failed so far)" in x for x in said)
    down.close(1)


def test_an_unknown_url_is_one_line_naming_it_without_its_token() -> None:
    with pytest.raises(errors.ConfigError) as e:
        Notifier(["nosuchservice://s3cretTOKEN@x"])
    assert str(e.value).startswith("--notify #1 (nosuchservice://...): apprise does not understand this URL")
    assert "s3cretTOKEN" not in str(e.value)


def test_without_apprise_the_cli_names_the_extra_in_one_line(tmp_path: Path) -> None:
    # apprise made unimportable for this interpreter: what a user without the extra sees
    shadow = tmp_path / "shadow" / "apprise"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named apprise')\n")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(
        f'[hosts.box]\ntransport = "local"\nworkdir = "{tmp_path}/w"\nrun_dir = "{tmp_path}/r"\ncommand = "true"\n'
    )
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    env.pop("DFLASHCTL_HOSTS", None)
    p = subprocess.run(
        [sys.executable, "-m", "ops.cli", "--hosts", str(hosts), "restart-on-crash", "--once", "--notify", "json://x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr == "dflashctl: --notify: needs the apprise package: pip install 'dflash[notify]'\n"


# ---------------------------------------------------------------------------------------------
# The real supervisor: sshd + fake Proxmox container, real tmux, the fake trainer


@pytest.fixture
def rig(pve_hosts: PveHosts, tmp_path: Path) -> t.Iterator[Rig]:
    r = Rig(pve_hosts, tmp_path)
    yield r
    r.close()


def test_notifications_arrive_with_no_secret_in_them(rig: Rig, pve_hosts: PveHosts, fake_pve_api: t.Any) -> None:
    api_token = "s3cret-" + API_TOKEN  # what the fake API accepts, held in the operator's environment
    fake_pve_api.auth = f"PVEAPIToken=root@pam!dflashctl={api_token}"
    rig.configure(
        env={"HF_TOKEN": HF_TOKEN},
        proxmox={
            "node": "pve",
            "api_host": "127.0.0.1",
            "port": fake_pve_api.port,
            "token_name": "dflashctl",
            "token_value_env": "PVE_TOKEN_TEST",
            "verify_ssl": False,
        },
    )
    # the run prints both secrets (a careless script): they reach the log tail, never a message
    cmd = list(t.cast(list[str], pve_hosts.pve_table["command"]))
    pve_hosts.write(command=["sh", "-c", f'echo "HF_TOKEN=$HF_TOKEN api={api_token}"; exec "$@"', "sh", *cmd])
    rig.start(steps=K + 2)
    with Webhook() as hook:
        sup = rig.supervise(*FAST, "--notify", hook.url, env={"PVE_TOKEN_TEST": api_token})
        rig.fault("once:exception")
        sup.event(r"restarted: attempt 2 started")
        rig.assert_resumed(1, 2)
        rig.finish.touch()
        assert sup.wait(60) == 0, sup.text
        retry_until(lambda: len(hook.messages) >= 5, 30)
    titles = hook.titles()
    host = os.uname().nodename
    assert titles[0].startswith(f"dflash pve/dflash: supervisor started on {host} (pid {sup.proc.pid})")
    assert titles[1].startswith("dflash pve/dflash: crashed (python-exception), attempt 1: restart in ")
    assert titles[2] == "dflash pve/dflash: restarted: attempt 2 started after crashed (python-exception), attempt 1"
    assert titles[3] == "dflash pve/dflash: succeeded (succeeded, attempt 2)"
    assert titles[4].startswith(f"dflash pve/dflash: supervisor stopped on {host}") and len(titles) == 5
    crash = hook.messages[1]["message"].splitlines()
    assert crash[0] == "host pve, session dflash, attempt 1"
    assert crash[1] == "crashed (python-exception), attempt 1: KeyError: 'missing_key'"
    assert f"last step {rig.steps(1)[-1]}" in crash[3], crash
    assert crash[-2] == "  KeyError: 'missing_key'", "the tail's last line"
    assert "the run succeeded" in hook.messages[4]["message"]
    text = hook.texts()
    assert HF_TOKEN in rig.log(1) and api_token in rig.log(1), "the secrets are in the log..."
    assert HF_TOKEN not in text and api_token not in text, "... and in no message"
    assert f"HF_TOKEN={REDACTED} api={REDACTED}" in text


def test_a_secret_in_every_form_and_cut_by_the_evidence_reaches_no_message_record_or_line(
    rig: Rig, pve_hosts: PveHosts
) -> None:
    """The run prints HF_TOKEN percent-encoded, JSON- and repr-escaped, then crashes with it straddling the
    evidence's 200-character cut: restart-on-crash's messages, its output, its incidents, the next attempt's
    run.json (why it was started) and `dflashctl history` carry no form of it, nor its head."""
    rig.configure(env={"HF_TOKEN": LEAKY_TOKEN})
    cmd = list(t.cast(list[str], pve_hosts.pve_table["command"]))
    pve_hosts.write(command=leaky_command(cmd))
    rig.start(steps=K + 2)
    with Webhook() as hook:
        sup = rig.supervise(*FAST, "--notify", hook.url)
        rig.fault("once:exception")
        sup.event(r"restarted: attempt 2 started")
        retry_until(lambda: any(x.startswith("dflash pve/dflash: restarted") for x in hook.titles()), 30)
        sup.stop()
    log = rig.log(1)
    assert "huggingface.co/api/whoami?token=hf_h5%2FSecret%2BToken%3DZq8%22w%5C9" in log, "percent-encoded..."
    assert 'config: {"token": "hf_h5/Secret+Token=Zq8\\"w\\\\9"}' in log, "... JSON- and repr-escaped in the log"
    crash = next(m["message"] for m in hook.messages if ": crashed (" in m["title"])
    assert f"{REDACTED} was refused by the hub" in crash, crash
    history = rig.cli("history", "--json", "--state-dir", str(rig.state_dir))
    assert history.exit_code == 0, history.output
    incidents = "".join(p.read_text() for p in (rig.state_dir / "incidents").glob("*.json"))
    said = {
        "messages": hook.texts(),
        "supervisor output": sup.text,
        "incidents": incidents,
        "run.json of attempt 2": json.dumps(rig.run_json(2)),
        "history": history.stdout,
    }
    assert {where: leaked(text) for where, text in said.items()} == dict.fromkeys(said, [])
    assert REDACTED in said["incidents"] and REDACTED in said["run.json of attempt 2"]


def test_a_down_and_a_hanging_server_never_hold_up_the_supervisor(rig: Rig) -> None:
    rig.configure()
    rig.start()
    down, slow = Webhook(), Webhook().start()
    slow.hang()
    try:
        sup = rig.supervise(*FAST, "--notify", down.url, "--notify", slow.url + "?rto=120")
        retry_until(lambda: slow.held == 1, 30)  # "supervisor started" is stuck in the hanging server
        retry_until(lambda: len(rig.steps(1)) >= K + 2, 30)
        rig.fault("once:exception")
        sup.event(r"crashed: KeyError")
        sup.event(r"restarted: attempt 2 started")
        sup.more_probes(4)  # the loop goes on, probe after probe, while a message hangs
        assert slow.held == 1 and slow.messages == [] and down.messages == []
        assert sup.events(r"notify: --notify #1 \(json://127\.0\.0\.1:\d+\): .* not delivered; retrying with backoff")
        rig.assert_resumed(1, 2)
        down.start()  # the service comes back: the retries get through
        retry_until(lambda: any("restarted: attempt 2" in x for x in down.titles()), 60)
        slow.release()
        retry_until(lambda: any("restarted: attempt 2" in x for x in slow.titles()), 60)
        assert sup.stop() == 0
        for hook in (down, slow):
            assert any("supervisor stopped" in x for x in hook.titles()), hook.titles()
    finally:
        down.stop()
        slow.stop()


def test_ops_imports_apprise_only_when_a_notifier_is_made() -> None:
    """restart-on-crash without --notify needs no extra: importing dflashctl loads no apprise."""
    code = "import sys, ops.notify, ops.supervise, ops.cli, ops.history; print('apprise' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "False", p.stderr


# ---------------------------------------------------------------------------------------------
# Misbehaving services: an answer with no end, a huge one, one that trickles

MEMORY_LIMIT = 3 << 30  # the supervisor runs under this address-space limit (prlimit --as): never the machine's
RSS_BOUND = 400 << 20  # what the supervisor and its delivery workers may hold together, well above their ~100 MB


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def _rss(pids: t.Iterable[int]) -> int:
    total = 0
    for p in pids:
        try:
            line = next(x for x in Path(f"/proc/{p}/status").read_text().splitlines() if x.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        total += int(line.split()[1]) * 1024
    return total


def test_endless_huge_and_trickling_answers_are_cut_and_never_hold_up_the_exit(rig: Rig) -> None:
    import signal
    import time

    from testkit import pid_alive

    rig.configure()
    rig.start()
    hooks = [Webhook().start() for _ in range(3)]
    for hook, mode in zip(hooks, ("endless", "huge", "trickle")):
        hook.answer(mode)
    try:
        urls = [a for h in hooks for a in ("--notify", h.url)]
        sup = rig.supervise(*FAST, *urls, wrap=["prlimit", f"--as={MEMORY_LIMIT}", "--"])
        # "supervisor started" reaches each; each answer is read a few KiB, then its connection is closed
        retry_until(lambda: all(h.messages for h in hooks), 60)
        retry_until(lambda: all(h.cut >= 1 for h in hooks), 60)
        rss = _rss(_tree(sup.proc.pid))
        print(f"supervisor + workers: {rss / 2**20:.0f} MiB RSS; streamed {[h.streamed for h in hooks]} bytes")
        assert rss < RSS_BOUND, rss
        assert sup.proc.poll() is None and not sup.events(r"MemoryError")
        # the deliveries counted as delivered (the services took them and said 200): the next message goes too
        retry_until(lambda: len(rig.steps(1)) >= K + 2, 30)
        rig.fault("once:exception")
        sup.event(r"restarted: attempt 2 started")
        retry_until(lambda: all(any("restarted: attempt 2" in x for x in h.titles()) for h in hooks), 90)
        # a delivery stuck in a trickle when the supervisor is asked to stop: the exit does not wait on it
        for hook in hooks:
            hook.answer("trickle", every=2.0)
        workers = [p for p in _tree(sup.proc.pid) if b"ops.courier" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 3, workers  # one delivery process per URL
        started = time.monotonic()
        sup.proc.send_signal(signal.SIGINT)
        assert sup.wait(60) == 0, sup.text
        print(f"exit {time.monotonic() - started:.1f}s after SIGINT, stuck deliveries: {[h.streaming for h in hooks]}")
        assert not [p for p in workers if pid_alive(p)], "no delivery process outlives the supervisor"
        # a trickle outlasts the exit's 2 s for its last words: each URL's were given up, and said so
        for n in (1, 2, 3):
            assert sup.events(rf"notify: --notify #{n} .*: not delivered within 2s of the supervisor's end"), sup.text
    finally:
        for hook in hooks:
            hook.stop()


def test_the_delivery_process_imports_apprise_from_where_the_supervisor_did(tmp_path: Path) -> None:
    """apprise found through PYTHONPATH (or a user site) only: the worker, started with -I, still finds it."""
    import shutil
    import sysconfig

    base = shutil.which("python3", path="/usr/bin:/bin")
    if base is None or subprocess.run([base, "-c", "import apprise"], capture_output=True).returncode == 0:
        pytest.skip("needs a python3 outside this venv that cannot import apprise by itself")
    repo = str(Path(__file__).resolve().parents[2])
    code = (
        "import sys\n"
        "from ops.notify import Notifier, Message\n"
        "n = Notifier([sys.argv[1]], say=print)\n"
        "n.send(Message('x', 'via PYTHONPATH', 'body'))\n"
        "import time; end = time.monotonic() + 60\n"
        "while n.sent + n.failed == 0 and time.monotonic() < end: time.sleep(0.1)\n"
        "n.close(); print('sent', n.sent)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{repo}:{sysconfig.get_paths()['purelib']}"}
    with Webhook() as hook:
        p = subprocess.run([base, "-c", code, hook.url], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0 and "sent 1" in p.stdout, p.stdout + p.stderr
        assert hook.titles() == ["via PYTHONPATH"]


def test_a_loss_spike_is_told_once_and_a_diverged_run_s_give_up_names_it(rig: Rig) -> None:
    rig.configure()
    rig.start(steps=K + 2)
    with Webhook() as hook:
        sup = rig.supervise(*FAST, "--notify", hook.url)
        rig.fault("once:spike")
        line = sup.event(r"loss spike at step")
        assert "(a warning: the run goes on)" in line
        sup.more_probes(3)
        assert len(sup.events(r"loss spike at step")) == 1, "told once, though later probes see it again"
        rig.fault("once:diverged")
        assert sup.wait(60) == 12, sup.text
        retry_until(lambda: len(hook.messages) >= 4, 30)
    titles = hook.titles()
    spikes = [x for x in titles if "loss spike at step" in x]
    assert len(spikes) == 1 and spikes[0].startswith("dflash pve/dflash: loss spike at step"), titles
    [gave_up] = [x for x in titles if "gave up" in x]
    assert gave_up.startswith("dflash pve/dflash: gave up: training diverged: diverged at step"), gave_up
    body = next(m["message"] for m in hook.messages if m["title"] == gave_up)
    assert "crashed (diverged), attempt 1" in body and "last finite checkpoint" in body


def test_status_in_every_form_shows_no_secret_the_run_printed(rig: Rig, pve_hosts: PveHosts) -> None:
    """status, status --json and status --facts of a run that crashed printing HF_TOKEN in every form: the
    evidence says the crash, with the token redacted (what the supervisor's messages may say, status says)."""
    rig.configure(env={"HF_TOKEN": LEAKY_TOKEN})
    cmd = list(t.cast(list[str], pve_hosts.pve_table["command"]))
    pve_hosts.write(command=leaky_command(cmd))
    rig.start()
    retry_until(lambda: len(rig.steps(1)) >= K + 2, 30)
    rig.fault("once:exception")
    retry_until(lambda: rig.cli("status").exit_code not in (0, 3), 60, interval=0.5)
    said = {
        form: rig.cli("status", *extra)
        for form, extra in (("text", ()), ("json", ("--json",)), ("facts", ("--facts",)))
    }
    assert "was refused by the hub" in said["text"].stdout, said["text"].output
    assert {form: leaked(r.output) for form, r in said.items()} == dict.fromkeys(said, [])
    assert REDACTED in said["text"].stdout and REDACTED in said["facts"].stdout
