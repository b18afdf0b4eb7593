"""Operator side: a hostile or unlucky user against the real tools (real sshd, real files).

known_hosts as OpenSSH reads it, finite durations, one session-name rule, hosts.toml values that
would turn into ssh options, ProxyCommand tokens, a login shell that is not sh, secrets and modes
of restart-on-crash's state.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ops import errors
from ops.hosts import parse_inventory
from ops.transport import SSHTransport, scan_host_key
from testkit import PveHosts, Sshd
from testkit.hostsfile import dump_hosts
from testkit.hostsfile import ssh_host as make_host
from testkit.plugin import require
from testkit.runkit import RELAY

ECHO_ARGV = "import json, sys; print(json.dumps(sys.argv[1:]))"


def key_blob(sshd: Sshd) -> str:
    return sshd.host_key_pub.split()[1]


def no_traceback(r: t.Any) -> None:
    assert "Traceback" not in r.output, r.output


# --- item 1: known_hosts read line by line, like OpenSSH ------------------------------------------

# A CA key and an unrelated key: valid base64 of real keys, but not the server's host key.
OTHER_KEY = "AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"


def junk_lines(sshd: Sshd) -> list[str]:
    """Lines real known_hosts files have, none of which may break us."""
    return [
        "# a comment",
        f"@cert-authority *.example.com ssh-ed25519 {OTHER_KEY} ca@example",
        f"@revoked old.example.com ssh-ed25519 {OTHER_KEY}",
        "broken.example.com ssh-ed25519 AAAA!!!not-base64",
        f"weird.example.com ssh-foo {OTHER_KEY}",
        f"@future-marker x.example.com ssh-ed25519 {OTHER_KEY}",
        "only-a-name",
        f"rsa.example.com ssh-rsa {OTHER_KEY}",  # an ed25519 blob that says rsa
    ]


def test_markers_and_unreadable_lines_do_not_break_any_command(pve_hosts: PveHosts) -> None:
    sshd = pve_hosts.sshd
    kh = sshd.known_hosts
    kh.write_text("\n".join([*junk_lines(sshd), sshd.known_hosts_line]) + "\n")
    with SSHTransport.connect(pve_hosts.host()) as tr:
        assert tr.run(["true"]).ok
    scan = scan_host_key(pve_hosts.host())
    assert scan.verdict == "known" and "5 unreadable known_hosts line(s) skipped" in scan.note
    for args in (("status",), ("trust-host", "--yes"), ("deploy", "--dry-run")):
        r = pve_hosts.cli(*args)
        no_traceback(r)
        assert r.exit_code in (0, 7), (args, r.output)  # 7: status of a session never started
    # The same lines when the key is NOT known: the refusal says what was skipped.
    kh.write_text("\n".join(junk_lines(sshd)) + "\n")
    r = pve_hosts.cli("status", "--json")
    no_traceback(r)
    assert r.exit_code == 10 and r.json()["cause"] == "host-key"
    doctor = pve_hosts.cli("doctor")
    no_traceback(doctor)
    assert doctor.exit_code == 10 and "unreadable known_hosts line(s) skipped" in doctor.stdout


def test_revoked_key_is_refused_even_when_also_pinned(pve_hosts: PveHosts) -> None:
    sshd = pve_hosts.sshd
    kh = sshd.known_hosts
    revoked = f"@revoked * ssh-ed25519 {key_blob(sshd)}"
    kh.write_text(f"{sshd.known_hosts_line}\n{revoked}\n")
    with pytest.raises(errors.HostKeyRejected) as info:
        SSHTransport.connect(pve_hosts.host())
    assert info.value.cause == "host-key" and "REVOKED" in str(info.value) and f"{kh}:2" in str(info.value)
    st_ = pve_hosts.cli("status", "--json")
    assert st_.exit_code == 10 and st_.json()["state"] == "unreachable" and st_.json()["cause"] == "host-key"
    assert "revoked" in st_.json()["detail"].lower()
    before = kh.read_text()
    for args in (("trust-host", "--yes"), ("trust-host", "--yes", "--replace")):
        r = pve_hosts.cli(*args)
        no_traceback(r)
        assert r.exit_code == 10 and "REVOKED" in r.stderr and len(r.stderr.strip().splitlines()) <= 2
        assert kh.read_text() == before  # nothing recorded, the @revoked line kept
    doctor = pve_hosts.cli("doctor")
    assert doctor.exit_code == 10 and "REVOKED" in doctor.stdout


def test_a_cert_authority_key_is_not_a_host_key(sshd: Sshd) -> None:
    # The server's own key, but only as a CA: ssh would want a host certificate signed by it.
    sshd.known_hosts.write_text(f"@cert-authority [127.0.0.1]:* ssh-ed25519 {key_blob(sshd)}\n")
    with pytest.raises(errors.HostKeyRejected) as info:
        SSHTransport.connect(make_host(sshd))
    assert not info.value.changed and "@cert-authority" in str(info.value) and "not known" in str(info.value)


@pytest.mark.parametrize("pattern", ["[127.0.0.1]:*", "[127.0.0.?]:{port}", "*", "[127.0.0.1]:{port},[other]:1"])
def test_an_old_key_under_a_pattern_reads_as_changed(pve_hosts: PveHosts, tmp_path: Path, pattern: str) -> None:
    sshd = pve_hosts.sshd
    old_blob = key_blob(sshd)
    sshd.rotate_host_key()
    pattern = pattern.format(port=sshd.port)
    old_line = f"{pattern} ssh-ed25519 {old_blob}"
    sshd.known_hosts.write_text(old_line + "\n")
    with pytest.raises(errors.HostKeyRejected) as info:
        SSHTransport.connect(pve_hosts.host())
    assert info.value.changed and "HOST KEY CHANGED" in str(info.value)

    r = pve_hosts.cli("trust-host", "--yes")  # a changed key is never recorded without --replace
    assert r.exit_code == 10 and "--replace" in r.stderr
    assert sshd.known_hosts.read_text() == old_line + "\n"
    r = pve_hosts.cli("trust-host", "--yes", "--replace")
    assert r.exit_code == 0, r.output
    lines = sshd.known_hosts.read_text().splitlines()
    assert lines[-1] == sshd.known_hosts_line
    if pattern.startswith(f"[127.0.0.1]:{sshd.port}"):
        assert lines[0] == f"[other]:1 ssh-ed25519 {old_blob}"  # only our name was taken out of the list
    else:
        assert lines[0] == old_line and "left as they are" in r.stderr  # a pattern also covers other hosts
    with SSHTransport.connect(pve_hosts.host()) as tr:
        assert tr.run(["true"]).ok


def test_negated_pattern_excludes_the_host(sshd: Sshd) -> None:
    old_blob = key_blob(sshd)
    sshd.rotate_host_key()
    sshd.known_hosts.write_text(f"[127.0.0.1]:*,![127.0.0.1]:{sshd.port} ssh-ed25519 {old_blob}\n")
    with pytest.raises(errors.HostKeyRejected) as info:
        SSHTransport.connect(make_host(sshd))
    assert not info.value.changed and "not known" in str(info.value)


def test_hashed_entries_keep_working(sshd: Sshd, tmp_path: Path) -> None:
    hashed = tmp_path / "hashed_known_hosts"
    shutil.copy(sshd.known_hosts, hashed)
    subprocess.run(["ssh-keygen", "-H", "-f", str(hashed)], check=True, capture_output=True)
    assert hashed.read_text().startswith("|1|")
    with SSHTransport.connect(make_host(sshd, known_hosts=str(hashed))) as tr:
        assert tr.run(["true"]).ok
    sshd.rotate_host_key()
    with pytest.raises(errors.HostKeyRejected) as info:
        SSHTransport.connect(make_host(sshd, known_hosts=str(hashed)))
    assert info.value.changed


# --- item 13 (ssh half): the exec string does not depend on the remote login shell ----------------

HOSTILE_ARGS = [
    "it's",
    'say "hi"',
    "back\\slash \\\\ \\' \\n",
    "bang! !! !$",
    "$HOME ${x} $(id) `id`",
    "line1\nline2",
    "trailing newline\n",
    "tab\there",
    "ünïcødé ☃",
    "",
    "-n",
    "%p %h",
    "star * ? [a]",
    "x; rm -rf /tmp/nope & | >",
    "{a,b}",
    "~root",
    "#not a comment",
    "(subshell)",
    "a=b",
    "\\",
    "-$",
    "-n\n",
    "%s%d",
]


@pytest.fixture(params=["fish", "csh"])
def shell_sshd(request: pytest.FixtureRequest, tmp_path: Path, ssh_home: Path) -> t.Iterator[Sshd]:
    """A real sshd whose user's login shell is fish or csh (via a private copy of /etc/passwd)."""
    require("sshd")
    require("namespaces")
    require(request.param)
    server = Sshd(tmp_path / "sshd", login_shell=shutil.which(request.param))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_remote_argv_arrives_literally_whatever_the_login_shell(shell_sshd: Sshd) -> None:
    with SSHTransport.connect(make_host(shell_sshd)) as tr:
        assert tr.run(["getent", "passwd", "root"]).out.strip().endswith(str(shell_sshd.login_shell))
        r = tr.run([sys.executable, "-c", ECHO_ARGV, *HOSTILE_ARGS])
        assert r.ok, r.err
        assert json.loads(r.out) == HOSTILE_ARGS
        # Long words (deploy sends a 17 KB program with -c): csh refuses a word over ~8 KB.
        from ops.deploy import REMOTE_PROGRAM

        long = ["x" * 9000 + "'", "y" * 9000, REMOTE_PROGRAM]
        r = tr.run([sys.executable, "-c", ECHO_ARGV, *long])
        assert r.ok and json.loads(r.out) == long, r.err
        assert tr.run(["sh", "-c", "exit 3"]).exit_code == 3
        r = tr.run(["sh", "-c", "kill -KILL $$"])
        assert (r.exit_code, r.signal) == (None, 9)
        r = tr.run(["sleep", "30"], timeout=0.5)
        assert r.timed_out


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    argv=st.lists(
        st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12),
        min_size=1,
        max_size=4,
    )
)
@example(argv=["'\\'", "\\\\'", "!\n!"])
def test_any_text_survives_a_login_shell_that_is_not_sh(shell_sshd: Sshd, argv: list[str]) -> None:
    with SSHTransport.connect(make_host(shell_sshd)) as tr:
        r = tr.run([sys.executable, "-c", ECHO_ARGV, *argv])
        assert r.ok, r.err
        assert json.loads(r.out) == argv


# --- item 8: one finite-number type for every duration option --------------------------------------

DURATIONS = [
    ("stop", "--grace"),
    ("status", "--watch"),
    ("tail", "--interval"),
    ("restart-on-crash", "--interval"),
    ("restart-on-crash", "--backoff"),
    ("restart-on-crash", "--max-backoff"),
    ("restart-on-crash", "--min-uptime"),
    ("restart-on-crash", "--window"),
]


@pytest.mark.parametrize("verb,option", DURATIONS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300", "NaN"])
def test_durations_refuse_nan_inf_and_huge_before_anything_runs(
    tmp_path: Path, verb: str, option: str, value: str
) -> None:
    from click.testing import CliRunner

    from ops.cli import cli

    # A host that cannot be reached: a value that got through would show as a connection error instead.
    hosts = tmp_path / "hosts.toml"
    hosts.write_text('[hosts.h]\naddress = "127.0.0.1"\nport = 1\ncommand = "true"\n')
    once = ["--once"] if verb == "restart-on-crash" else []  # a value that got through must not loop forever
    r = CliRunner().invoke(cli, ["--hosts", str(hosts), verb, f"{option}={value}", *once], standalone_mode=False)
    assert r.exception is not None and type(r.exception).__name__ == "BadParameter", r.output
    assert "finite" in str(r.exception) or "one year" in str(r.exception)


def test_duration_errors_exit_1_with_one_error_line(pve_hosts: PveHosts) -> None:
    r = pve_hosts.cli("stop", "--grace", "nan")
    assert r.exit_code == 1 and "Traceback" not in r.output
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert errs == ["Error: Invalid value for '--grace': 'nan' is not a finite number of seconds"]
    assert pve_hosts.cli("restart-on-crash", "--interval", "1e300", "--once").exit_code == 1


# --- item 12: one session-name rule, on the operator side --------------------------------------------

BAD_NAMES = ["-x", "--replace", "ünï", "a:b", "a.b", "", "x" * 65, "a b", "a/b", "a\nb", "=x", "日本"]


def test_bad_session_names_are_refused_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ops.cli import main

    # A host that cannot be reached: a name that got through would show as exit 10 instead.
    hosts = tmp_path / "hosts.toml"
    hosts.write_text('[hosts.h]\naddress = "127.0.0.1"\nport = 1\ncommand = "true"\n')
    for name in BAD_NAMES:
        for verb in ("start", "status", "stop", "tail", "attach", "restart-on-crash"):
            with pytest.raises(SystemExit) as exit_:
                main(
                    [
                        "--hosts",
                        str(hosts),
                        verb,
                        "--session",
                        name,
                        *(["--once"] if verb == "restart-on-crash" else []),
                    ]
                )
            err = capsys.readouterr().err
            assert exit_.value.code == 1, (name, verb, err)
            assert (
                err.startswith(
                    "dflashctl: --session: use letters, digits, '-', '_' only (ASCII, 1 to 64, not starting with '-'), got "
                )
                and len(err.splitlines()) == 1
            ), err


def test_a_dash_session_through_the_real_cli(pve_hosts: PveHosts) -> None:
    r = pve_hosts.cli("start", "--session", "-x")
    assert r.exit_code == 1 and r.stderr.startswith("dflashctl: --session:")
    assert not pve_hosts.run_dir.exists() or not any(pve_hosts.run_dir.iterdir())


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_session_names_in_hosts_toml_name_the_key(name: str) -> None:
    with pytest.raises(errors.ConfigError) as e:
        parse_inventory(
            dump_hosts(None, {"h": {"transport": "local", "command": "true", "session": name}}),
            path=None,
            base=Path("/"),
        )
    assert e.value.path in ("hosts.h.session",) or (name.strip() == "" and e.value.path == "hosts.h.session")


@pytest.mark.parametrize("name", ["dflash", "run_2", "exp-3", "A", "_x", "9", "x" * 64])
def test_todays_names_stay_valid(name: str) -> None:
    inv = parse_inventory(
        dump_hosts(None, {"h": {"transport": "local", "command": "true", "session": name, "tmux_socket": name}}),
        path=None,
        base=Path("/"),
    )
    assert inv.get().session == name


# --- item 14 (ops half): hosts.toml that is not UTF-8, nested too deeply, a huge command ------------


def run_hosts(path: Path) -> subprocess.CompletedProcess[str]:
    from testkit.hostsfile import dflashctl_argv

    return subprocess.run(
        [*dflashctl_argv(), "--hosts", str(path), "hosts"], capture_output=True, text=True, timeout=120
    )


def test_hosts_toml_not_utf8_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "hosts.toml"
    f.write_bytes('[hosts.x]\ntransport = "local"\ncommand = "caf\xe9"\n'.encode("latin-1"))
    r = run_hosts(f)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"dflashctl: {f}: not UTF-8 text (byte 44: b'\\xe9'); TOML files are UTF-8"
    ]


def test_deeply_nested_toml_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "hosts.toml"
    f.write_text('[hosts.x]\ntransport = "local"\ncommand = "a"\nenv = ' + "[" * 50_000 + "]" * 50_000 + "\n")
    r = run_hosts(f)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"dflashctl: {f}: not valid TOML here: values nested too deeply"
    ]


def test_a_huge_command_is_refused_before_shlex_split(tmp_path: Path) -> None:
    f = tmp_path / "hosts.toml"
    f.write_text('[hosts.x]\ntransport = "local"\ncommand = "' + "a " * 5_000_000 + '"\n')  # 10 MB
    r = run_hosts(f)
    assert r.returncode == 1
    assert r.stderr.splitlines() == ["dflashctl: hosts.x.command: too long: 10000000 characters (at most 65536)"]
    long_list = dump_hosts(None, {"x": {"transport": "local", "command": ["a" * 70_000]}})
    with pytest.raises(errors.ConfigError, match=r"hosts\.x\.command: too long"):
        parse_inventory(long_list, path=None, base=Path("/"))


def test_bad_values_are_shown_short() -> None:
    with pytest.raises(errors.ConfigError) as e:
        parse_inventory(
            dump_hosts(None, {"x": {"transport": "local", "command": "a", "session": "-" * 100_000}}),
            path=None,
            base=Path("/"),
        )
    assert len(str(e.value)) < 400 and "(100002 characters)" in str(e.value)


# --- item 15: address/user never become ssh options; attach quotes paths like ssh_config ------------


@pytest.mark.parametrize(
    "key,value",
    [
        ("address", "-oProxyCommand=x"),
        ("user", "-oProxyCommand=x"),
        ("user", "-lroot"),
        ("address", "-p1"),
        ("user", "ro ot"),
        ("user", "root\n"),
        ("address", "host\x00"),
        ("address", "a\tb"),
        ("known_hosts", "/a\nb"),
        ("identity_file", "/k/${HOME}/id"),
    ],
)
def test_values_that_would_be_ssh_options_are_refused(key: str, value: str) -> None:
    table = {"address": "127.0.0.1", "command": "true", key: value}
    with pytest.raises(errors.ConfigError) as e:
        parse_inventory(dump_hosts(None, {"pve": table}), path=None, base=Path("/"))
    assert e.value.path == f"hosts.pve.{key}" and "\n" not in str(e.value)


def test_attach_argv_ends_options_and_quotes_known_hosts_like_ssh_config(sshd: Sshd, tmp_path: Path) -> None:
    from ops.attach import attach_argv

    odd = tmp_path / 'dir with "quotes" and 50%'
    odd.mkdir()
    kh = odd / "known hosts"
    shutil.copy(sshd.known_hosts, kh)
    key = odd / "id %d"
    shutil.copy(sshd.client_key, key)
    key.chmod(0o600)
    host = make_host(sshd, known_hosts=str(kh), identity_file=str(key))
    argv = attach_argv(host, "dflash")
    dd = argv.index("--")
    assert argv[dd + 1] == "root@127.0.0.1" and all(not a.startswith("-") for a in argv[dd + 1 :])
    # The real OpenSSH client reads our options: known_hosts path with spaces/quotes/% and the key.
    probe = [argv[0], "-F", "/dev/null", "-o", "BatchMode=yes", *argv[1:dd], "-T", "--", argv[dd + 1], "echo attached"]
    probe.remove("-t")
    r = subprocess.run(probe, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and r.stdout == "attached\n", r.stderr


def test_attach_remote_command_survives_a_fish_login_shell(tmp_path: Path, ssh_home: Path) -> None:
    require("sshd")
    require("namespaces")
    require("fish")
    from ops.attach import attach_argv

    with Sshd(tmp_path / "sshd", login_shell=shutil.which("fish")) as server:
        argv = attach_argv(make_host(server), "dflash")
        # The remote command it builds, with `tmux attach` swapped for an echo of its argv:
        from ops.transport import remote_command

        assert argv[-1] == remote_command(["tmux", "-L", "dflash", "attach-session", "-t", "=dflash"])
        r = subprocess.run(
            [*argv[:-1], remote_command([sys.executable, "-c", ECHO_ARGV, "it's", "a\\b", "!x"])],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0 and json.loads(r.stdout) == ["it's", "a\\b", "!x"], r.stderr


# --- item 16: ProxyCommand %p/%r get hosts.toml's port and user ------------------------------------


def test_proxy_command_tokens_use_the_port_and_user_of_hosts_toml(sshd: Sshd, ssh_home: Path, tmp_path: Path) -> None:
    relay = tmp_path / "relay.py"
    relay.write_text(RELAY)
    seen = tmp_path / "seen"
    # No Port/User in the config: paramiko alone would hand the ProxyCommand 22 and the local user.
    (ssh_home / ".ssh" / "config").write_text(
        f"Host viacmd\n  HostName 127.0.0.1\n  ProxyCommand {sys.executable} {relay} %h %p %r {seen} %%\n"
    )
    host = make_host(sshd, address="viacmd", port=sshd.port, user="root")
    with SSHTransport.connect(host) as tr:
        assert tr.run(["echo", "relayed"]).out == "relayed\n"
        assert tr.target.proxy_command is not None and tr.target.proxy_command.endswith(f"{seen} %")
    assert seen.read_text() == f"127.0.0.1 {sshd.port} root"


def test_proxy_command_with_an_unknown_token_is_a_config_error(sshd: Sshd, ssh_home: Path) -> None:
    (ssh_home / ".ssh" / "config").write_text("Host viacmd\n  ProxyCommand nc %h %Z\n")
    with pytest.raises(errors.ConfigError, match="unknown token %Z"):
        SSHTransport.connect(make_host(sshd, address="viacmd"))


# --- item 5 (operator half): restart-on-crash keeps its state private, hooks get no API token --------


def test_state_files_are_private_and_the_hook_gets_no_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ops.hosts import load_inventory
    from ops.supervise import Options, Supervisor, default_state_dir

    hook_out = tmp_path / "hook.json"
    hook = tmp_path / "hook.py"
    hook.write_text(f"import json, os, sys\njson.dump(dict(os.environ), open({str(hook_out)!r}, 'w'))\n")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(
        dump_hosts(
            "h",
            {
                "h": {
                    "transport": "local",
                    "workdir": str(tmp_path / "w"),
                    "run_dir": str(tmp_path / "runs"),
                    "command": "true",
                    "tmux_socket": "dflash-h1-none",
                },
                "pve": {
                    "address": "127.0.0.1",
                    "command": "true",
                    "proxmox": {"node": "pve", "token_name": "t", "token_value_env": "PVE_TOKEN"},
                },
                "other": {
                    "address": "127.0.0.1",
                    "command": "true",
                    "proxmox": {"node": "pve", "token_name": "t", "token_value_env": "OTHER_SECRET"},
                },
            },
        )
    )
    monkeypatch.setenv("PVE_TOKEN", "s3cret")
    monkeypatch.setenv("OTHER_SECRET", "s3cret2")
    monkeypatch.setenv("KEEP_ME", "fine")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    state = default_state_dir()
    state.mkdir(parents=True, mode=0o755)  # left open by an older dflashctl
    state.chmod(0o755)
    inv = load_inventory(hosts)
    assert inv.secret_env == ("PVE_TOKEN", "OTHER_SECRET")
    sup = Supervisor(
        inv.get("h"),
        None,
        Options(once=True),
        on_event=[sys.executable, str(hook)],
        emit=lambda _: None,
        hide_env=inv.secret_env,
    )
    sup.run()  # not started: an incident is noted and announced
    env = json.loads(hook_out.read_text())
    assert "PVE_TOKEN" not in env and "OTHER_SECRET" not in env and env["KEEP_ME"] == "fine"
    assert env["DFLASHCTL_HOST"] == "h"
    modes = {p.relative_to(state).as_posix(): oct(p.stat().st_mode & 0o777) for p in [state, *state.rglob("*")]}
    assert modes.pop(".") == "0o700" and modes.pop("incidents") == "0o700" and modes.pop("supervise") == "0o700"
    assert modes and set(modes.values()) == {"0o600"}, modes
    assert any(k.startswith("incidents/") for k in modes) and any(k.endswith(".lock") for k in modes)
