"""Benchmark `dflashctl deploy` against a plain `tar -c | ssh 'pct exec 200 -- tar -x'` of the same files.

Real parts only: a real sshd on 127.0.0.1 and the fake Proxmox host (container 200 is a real pid+mount
namespace), as in the tests. Prints figures and ratios; asserts nothing about time.

    .venv/bin/python -m bench.deploy [--runs 5] [--files 400] [--file-kb 20]

Figures:
- full deploy (fresh workdir and a fresh operator cache, as a first deploy: connect, bundle+hash, one
  install call that looks first, then uploads, verifies and switches) vs the plain pipe, median of --runs,
  for this checkout and for a synthetic checkout of --files files of --file-kb KB;
- the same through the real CLI (adds the interpreter start and imports of dflashctl);
- bytes uploaded by a no-change redeploy and by a one-file-change redeploy.
"""

from __future__ import annotations

if not __package__:  # `python bench/deploy.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.deploy")

import argparse
import os
import random
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from ops import deploy as deploy_mod
from ops.bundle import Bundle, build_bundle, source_root
from ops.remote import connect
from testkit import FakePve, PveHosts, Sshd, missing_requirement


def synthetic_checkout(root: Path, files: int, file_kb: int) -> Path:
    rng = random.Random(7)
    (root / "pyproject.toml").parent.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text('[project]\nname = "dflash"\n')
    words = [f"tok{i}" for i in range(5000)]
    for i in range(files):
        pkg = "ops" if i % 4 == 0 else "dflash"
        path = root / pkg / f"sub{i % 10}" / f"m{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = " ".join(rng.choice(words) for _ in range(file_kb * 1024 // 8))  # source-like, compressible
        path.write_text(text[: file_kb * 1024])
    for pkg in ("ops", "dflash"):
        (root / pkg / "__init__.py").write_text("")
    return root


def snapshot(dest: Path) -> Path:
    """A copy of what this checkout bundles, so edits made meanwhile do not disturb the runs."""
    root = source_root()
    if root is None:
        raise SystemExit("run from a checkout")
    for f in build_bundle(root).files:
        (dest / f.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f.path, dest / f.path)
    return dest


def plain_pipe(sshd: Sshd, pve: FakePve, bundle: Bundle, dest: Path) -> float:
    """tar -c <files> | ssh ... 'pct exec 200 -- tar -x -C dest' (OpenSSH client, the same key and pin)."""
    dest.mkdir(parents=True)
    remote = shlex.join([str(pve.pct), "exec", "200", "--", "tar", "-x", "-C", str(dest)])
    ssh = [
        "ssh",
        "-p",
        str(sshd.port),
        "-i",
        str(sshd.client_key),
        "-o",
        f"UserKnownHostsFile={sshd.known_hosts}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        f"{sshd.user}@127.0.0.1",
        remote,
    ]
    started = time.perf_counter()
    tar = subprocess.Popen(
        ["tar", "-C", str(bundle.root), "-cf", "-", *[f.path for f in bundle.files]], stdout=subprocess.PIPE
    )
    proc = subprocess.run(ssh, stdin=tar.stdout, capture_output=True, timeout=300)
    tar.wait()
    took = time.perf_counter() - started
    if proc.returncode != 0 or tar.returncode != 0:
        raise SystemExit(f"plain pipe failed: {proc.stderr.decode(errors='replace')}")
    return took


PHASES: dict[str, list[float]] = {}
CALLS: list[int] = []  # far-side calls per API deploy


def api_deploy(hosts: PveHosts, source: Path) -> tuple[float, deploy_mod.Outcome]:
    host = hosts.host("pve")
    started = time.perf_counter()
    remote = connect(host)
    run = remote.run

    def timed(argv, **kw):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return run(argv, **kw)
        finally:
            verb = next((a for a in argv if a in ("inspect", "install")), "other")
            PHASES.setdefault(verb, []).append(time.perf_counter() - t0)
            CALLS[-1] += 1

    remote.run = timed  # type: ignore[method-assign]
    CALLS.append(0)
    try:
        outcome = deploy_mod.deploy(remote, host, source=str(source), echo=lambda s: None)
    finally:
        remote.close()
    return time.perf_counter() - started, outcome


def round_trip(hosts: PveHosts) -> float:
    """One `pct exec 200 -- true` over an open connection: the fixed cost of each far-side call."""
    remote = connect(hosts.host("pve"))
    try:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            remote.run(["true"])
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        remote.close()


def cli_deploy(hosts: PveHosts, source: Path) -> float:
    started = time.perf_counter()
    r = hosts.cli("deploy", "--source", str(source), timeout=300)
    took = time.perf_counter() - started
    if r.exit_code != 0:
        raise SystemExit(f"dflashctl deploy failed: {r.stderr}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--files", type=int, default=400)
    ap.add_argument("--file-kb", type=int, default=20)
    args = ap.parse_args()
    for need in ("sshd", "namespaces"):
        if (why := missing_requirement(need)) is not None:
            raise SystemExit(f"cannot run: {why}")

    tmp = Path(tempfile.mkdtemp(prefix="dflash-bench-deploy-"))
    home = tmp / "home"
    (home / ".ssh").mkdir(parents=True)
    os.environ["HOME"] = str(home)
    os.environ.pop("SSH_AUTH_SOCK", None)
    state = tmp / "state"  # dflashctl's deploy cache: wiped with the workdir, so each full deploy is a first one
    os.environ["XDG_STATE_HOME"] = str(state)
    sshd = Sshd(tmp / "sshd").start()
    pve = FakePve()
    try:
        pve.create(200, start=True)
        hosts = PveHosts(tmp / "inventory", sshd=sshd, pve=pve, home=home)
        workdir = hosts.workdir
        checkout = snapshot(tmp / "checkout")
        payloads = [
            ("this checkout", checkout),
            (
                f"synthetic {args.files} x {args.file_kb} KB",
                synthetic_checkout(tmp / "synth", args.files, args.file_kb),
            ),
        ]
        print(f"deploy benchmark: sshd 127.0.0.1:{sshd.port}, fake pve ct 200, {args.runs} runs each, medians")
        for label, source in payloads:
            bundle = build_bundle(source)
            ours, plain, cli = [], [], []
            PHASES.clear()
            CALLS.clear()
            for i in range(args.runs):
                for fresh in (workdir, state):
                    shutil.rmtree(fresh, ignore_errors=True)
                took, outcome = api_deploy(hosts, source)
                ours.append(took)
                sent = outcome.bytes_sent
                for fresh in (workdir, state):
                    shutil.rmtree(fresh, ignore_errors=True)
                cli.append(cli_deploy(hosts, source))
                dest = pve.fs / "plain" / str(i)
                plain.append(plain_pipe(sshd, pve, bundle, dest))
                shutil.rmtree(dest, ignore_errors=True)
            m_ours, m_plain, m_cli = statistics.median(ours), statistics.median(plain), statistics.median(cli)
            print(
                f"\n[{label}] {len(bundle.files)} files, {bundle.size / 1e6:.2f} MB; first deploy sent {sent / 1e6:.2f} MB"
            )
            print(f"  full deploy (API: connect+bundle+one install call): {m_ours * 1000:7.0f} ms")
            print(f"  full deploy (real CLI process):                     {m_cli * 1000:7.0f} ms")
            print(f"  plain tar | ssh 'pct exec 200 -- tar -x':           {m_plain * 1000:7.0f} ms")
            print(f"  ratio deploy/plain: API {m_ours / m_plain:.2f}x, CLI {m_cli / m_plain:.2f}x (goal <= 1.3x)")
            calls = ", ".join(
                f"{verb} {len(ts)}x {statistics.median(ts) * 1000:.0f} ms" for verb, ts in sorted(PHASES.items())
            )
            print(
                f"  of the API deploy: far-side calls per deploy {statistics.median(CALLS):.0f} ({calls}); "
                f"one bare `pct exec 200 -- true` round trip {round_trip(hosts) * 1000:.0f} ms"
            )
            print(
                f"  all runs (ms): API {' '.join(f'{x * 1000:.0f}' for x in ours)}; plain {' '.join(f'{x * 1000:.0f}' for x in plain)}"
            )

            # Redeploys onto the release that the last CLI run left in place.
            _, same = api_deploy(hosts, source)
            target = next(f for f in bundle.files if f.path.startswith("dflash/") and f.size > 1000)
            path = source / target.path
            original = path.read_bytes()
            path.write_bytes(original.replace(original[:8], b"# edit\n ", 1))
            try:
                took, one = api_deploy(hosts, source)
            finally:
                path.write_bytes(original)
            print(f"  no-change redeploy: {same.bytes_sent} B sent ({same.action}), {CALLS[-2]} far-side call(s)")
            print(
                f"  one-file-change redeploy: {one.bytes_sent} B sent for {target.path} ({path.stat().st_size} B) "
                f"+ manifest; {one.bytes_sent / max(bundle.size, 1) * 100:.2f}% of the bundle, {took * 1000:.0f} ms"
            )
    finally:
        pve.close()
        sshd.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
