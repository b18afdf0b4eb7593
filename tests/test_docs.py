"""README.md and docs/ stay true to the code and to each other.

- The demo's summary: the README's summary block is what ``scripts/demo``'s own summary printer (the
  Python program at its end) prints for the figures the block quotes, line for line, and the figures the
  README and docs/ quote elsewhere (the eval, prepare-data and resume transcripts) are the summary's.
- The two set-up commands: the README's are exactly ``scripts/demo`` and ``scripts/test``, and no other
  code block of the README installs anything.
- Every relative link of README.md and docs/*.md points at a file (and a heading) that exists.
- The tables are the code's: states and exit codes, causes, hosts.toml keys, run-config keys, commands.
- The hosts.toml examples parse (the README's local host is the shipped one).

Cheap: no demo run, no network; the summary printer runs on records written from the README's figures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import typing as t
from pathlib import Path

import click
import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
DEMO = REPO / "scripts" / "demo"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## `` heading."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"no section '## {heading}'"
    return m.group(1)


def _fences(text: str, lang: str | None = None) -> list[str]:
    """The fenced code blocks of ``text`` (``lang``: only those opened with ```lang)."""
    blocks = re.findall(r"^```([a-z]*)\n(.*?)^```$", text, re.S | re.M)
    return [body for tag, body in blocks if lang is None or tag == lang]


# --------------------------------------------------------------------------------------------
# The demo's summary


def _demo_summary_program() -> str:
    """The Python program ``scripts/demo`` ends with: it prints the summary (``python - ROOT TOTAL TRAIN``)."""
    m = re.search(r"<<'EOF'\n(.*?)^EOF$", _read(DEMO), re.S | re.M)
    assert m and "== summary" in m.group(1), "scripts/demo no longer prints its summary from one heredoc program"
    return m.group(1)


def _readme_summary() -> list[str]:
    blocks = [b for b in _fences(_read(README), "") if b.startswith("== summary\n")]
    assert len(blocks) == 1, "the README shows the demo's summary once"
    return blocks[0].rstrip("\n").split("\n")


SUMMARY = {
    "before": r"^tau before training \(untrained drafter\): (?P<before>\d+\.\d+) tokens per target forward$",
    "after": r"^tau after training \((?P<step>step-\d+)\): +(?P<after>\d+\.\d+) tokens per target forward \(\d+\.\dx\)$",
    "equal": r"^output identical to the target's greedy decoding: (?P<equal>\d+)/(?P<prompts>\d+) prompts "
    r"\(\d+ held-out prompts, up to (?P<max_new>\d+) tokens each, stop at EOS, block (?P<block>\d+)\)$",
    "data": r"^data: .* store: (?P<records>\d+) conversations, (?P<sequences>\d+) sequences, (?P<tokens>\d+) "
    r"tokens \((?P<pct>\d+)% the target's own answers\)$",
    "attempts": r"^attempts: \d+ \((?P<attempts>[^)]*)\); dflash\.train: (?P<resume>resuming from "
    r"(?P<root>/\S+?)/\.dflash/runs/dflash/checkpoints/step-(?P<resumed>\d+) at step \d+ \(run \S+\))$",
    "time": r"^time: (?P<total>\d+)s in all \((?P<train>\d+)s until the run succeeded\)$",
}


def _summary_figures(lines: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, pattern in SUMMARY.items():
        hits = [m for m in map(re.compile(pattern).match, lines) if m]
        assert len(hits) == 1, f"the README's summary has no (or more than one) {name} line matching {pattern}"
        out.update(hits[0].groupdict())
    return out


def _write_demo_records(root: Path, f: dict[str, str]) -> None:
    """What the summary program reads, as a demo run with the README's figures leaves it."""
    dflash = root / ".dflash"
    (dflash / "tiny" / "store").mkdir(parents=True)
    before = {"tau": float(f["before"]), "drafter": "untrained"}
    after = {
        "tau": float(f["after"]),
        "drafter": f".dflash/runs/dflash/checkpoints/{f['step']}",
        "target_equal": int(f["equal"]),
        "num_prompts": int(f["prompts"]),
        "max_new_tokens": int(f["max_new"]),
        "block_size": int(f["block"]),
        "protocol": {"stop_at_eos": True},
    }
    (dflash / "eval-before.json").write_text(json.dumps(before))
    (dflash / "eval-after.json").write_text(json.dumps(after))
    tokens = int(f["tokens"])
    counts = {
        "records": int(f["records"]),
        "sequences": int(f["sequences"]),
        "tokens": tokens,
        "supervised": round(int(f["pct"]) * tokens / 100),
    }
    (dflash / "tiny" / "store" / "meta.json").write_text(json.dumps({"counts": counts}))
    names = f["attempts"].split(", ")
    for name in names:
        log = dflash / "runs" / "dflash" / name / "train.log"
        log.parent.mkdir(parents=True)
        lines = ["step 50 | loss 5.027 | acc 0.03"]
        if name == names[-1]:
            lines.insert(0, f"2026-11-30T16:58:40 INFO dflash.train: {f['resume']}")
        log.write_text("\n".join(lines) + "\n")


def test_the_readme_summary_is_what_the_demo_prints(tmp_path: Path) -> None:
    """The demo's own summary program, fed the README's figures, prints the README's block exactly: a label,
    a line, the order, a number's format or a figure derived from others (the x ratio, the % share) that
    changes on one side only fails here."""
    shown = _readme_summary()
    figures = _summary_figures(shown)
    root = tmp_path / "clone"
    _write_demo_records(root, figures)
    res = subprocess.run(
        [sys.executable, "-", str(root), figures["total"], figures["train"]],
        input=_demo_summary_program(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    printed = ANSI.sub("", res.stdout).replace(str(root), figures["root"]).strip("\n").split("\n")
    assert printed == shown


def test_the_figures_the_docs_quote_are_the_summary_s() -> None:
    f = _summary_figures(_readme_summary())
    readme = _read(README)
    training = _read(REPO / "docs" / "training.md")
    # the eval transcripts are the same runs as the summary's tau before / after
    assert re.search(rf"^drafter: \S+/{f['step']} \(step \d+\)\n(?:.*\n){{2}}tau {f['after']} ", training, re.M)
    assert re.search(rf"^drafter: untrained .*\n(?:.*\n){{2}}tau {f['before']} ", training, re.M)
    ident = f"output identical to plain greedy decoding: yes ({f['equal']}/{f['prompts']} prompts)"
    assert training.count(ident) == 2
    assert f"up to {f['max_new']} new tokens each (stop at EOS), block size {f['block']}" in training
    # the README's words about it
    assert f"{f['after']} of a possible\n{f['block']} (block size {f['block']})" in readme
    assert f"about {round(int(f['total']) / 60)} minutes" in _section(readme, "Two commands")
    # the store the summary describes is the one prepare-data printed (README and training.md)
    store = (
        f"prepare-data: {f['records']} records -> {f['sequences']} sequences, {f['tokens']} tokens "
        f"({f['pct']}% supervised)"
    )
    assert store in readme and store in training
    # the demo resumed where its first attempt checkpointed
    assert f"checkpoint step {f['resumed']} written to" in _read(REPO / "docs" / "monitoring.md")
    assert f["resume"] in training


def test_the_data_commands_the_readme_shows_are_the_demo_s() -> None:
    shown = re.findall(r'^\s*show "(dflash (?:regen|prepare-data) [^"]*)"$', _read(DEMO), re.M)
    assert len(shown) == 2
    readme = re.findall(r"^\$ (dflash (?:regen|prepare-data) .*)$", _section(_read(README), "What the demo does"), re.M)
    assert readme == shown


def test_the_summary_names_files_that_exist() -> None:
    for line in _readme_summary():
        for path in re.findall(r"\b((?:docs/)?[\w-]+\.md)\b", line):
            assert (REPO / path).is_file(), f"the demo's summary names {path}"


# --------------------------------------------------------------------------------------------
# The two set-up commands


def test_the_readme_s_two_commands_are_the_only_set_up_commands() -> None:
    readme = _read(README)
    blocks = _fences(_section(readme, "Two commands"), "sh")
    assert len(blocks) == 1
    commands = [line.split("#", 1)[0].strip() for line in blocks[0].splitlines() if line.strip()]
    assert commands == ["scripts/demo", "scripts/test"]
    for c in commands:
        assert os.access(REPO / c, os.X_OK), f"{c} is not an executable file"
    demo, test = _read(REPO / "scripts/demo"), _read(REPO / "scripts/test")
    # the demo sets up first; the tests install what they need, then run pytest
    first = next(line for line in demo.splitlines() if line.startswith("scripts/"))
    assert first.startswith("scripts/bootstrap ") or first == "scripts/bootstrap"
    assert re.search(r"^scripts/bootstrap --test$", test, re.M) and re.search(r"^\s*scripts/floor-venv\b", test, re.M)
    assert re.search(r"^(\S+ )?\.venv/bin/python -m pytest ", test, re.M)  # then the floor venv's run of its tests
    # nothing else in the README sets up: no install line in any of its code blocks
    for block in _fences(readme):
        assert not re.search(r"pip install|apt-get|apt install|scripts/bootstrap|curl ", block), block


# --------------------------------------------------------------------------------------------
# Links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```$", "", _read(path), flags=re.S | re.M)  # a '#' in a code block is no heading
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```$", "", _read(path), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_at_something_that_exists(page: Path) -> None:
    links = _links(page)
    assert links, f"{page.name} links nowhere"
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto: not ours to check
        target, _, anchor = link.partition("#")
        dest = (page.parent / target).resolve() if target else page
        assert dest.exists(), f"{page.name}: {link}: no such file"
        if anchor:
            assert dest.suffix == ".md", f"{page.name}: {link}: an anchor into a file that has no headings"
            assert anchor in _anchors(dest), f"{page.name}: {link}: no heading '#{anchor}' in {dest.name}"


def test_the_readme_links_every_docs_page() -> None:
    linked = {(README.parent / link).resolve() for link in _links(README)}
    assert {p.resolve() for p in DOCS} <= linked


def test_every_design_section_the_code_cites_exists() -> None:
    """Code cites "docs/design.md section N" (or "sections 5-7", "6 and 8"); the numbers never change."""
    have = {int(n) for n in re.findall(r"^## (\d+)\. ", _read(REPO / "docs" / "design.md"), re.M)}
    assert have == set(range(1, max(have) + 1)), "design.md's sections are numbered 1..N without a gap"
    cited: set[int] = set()
    for folder in ("dflash", "ops", "bench", "tests", "testkit", "scripts"):
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", "") and "__pycache__" not in path.parts:
                text = path.read_text(encoding="utf-8", errors="replace")
                for m in re.finditer(r"design\.md sections? (\d+)(?:(?:-| and |, )(\d+))?", text, re.I):
                    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
                    cited |= set(range(lo, hi + 1))
    assert cited and cited <= have, sorted(cited - have)


# --------------------------------------------------------------------------------------------
# Tables and examples: the code's


def _state_rows(text: str) -> dict[str, tuple[int, str]]:
    return {s: (int(code), rest) for s, code, rest in re.findall(r"^\| `([a-z-]+)` \| (\d+) \| (.*) \|$", text, re.M)}


@pytest.mark.parametrize("page", ["README.md", "docs/status.md", "docs/design.md"])
def test_the_state_tables_are_the_cli_s(page: str) -> None:
    from ops.exit_codes import STATE_EXIT
    from ops.states import CAUSES, State

    rows = _state_rows(_read(REPO / page))
    assert {s: code for s, (code, _) in rows.items()} == {str(k): int(v) for k, v in STATE_EXIT.items()}
    if page == "docs/design.md":
        return  # the design lists the causes under its table
    for state, (_, meaning) in rows.items():
        said = set(re.findall(r"`([a-z-]+)`", meaning.split("cause", 1)[1])) - {"gpu"} if "cause" in meaning else set()
        assert said == {str(c) for c in CAUSES.get(State(state), ())}, f"{page}: the causes of {state}"


def _give_up_codes() -> set[int]:
    """The exit codes that are no state's, nor an error or usage: restart-on-crash giving up."""
    from ops.exit_codes import STATE_EXIT, ExitCode

    return {int(c) for c in ExitCode if c not in STATE_EXIT.values() and c > ExitCode.USAGE}


@pytest.mark.parametrize("page", ["README.md", "docs/status.md", "docs/design.md"])
def test_the_pages_name_every_give_up_exit_code(page: str) -> None:
    """The codes that are no state's (restart-on-crash giving up) are said beside the state table."""
    text = " ".join(_read(REPO / page).split())
    said = re.search(r"[^.]*\b11 when it gave up[^.]*", text)
    assert said, f"{page}: no sentence gives restart-on-crash's exit codes"
    give_ups = _give_up_codes()
    assert give_ups == {11, 12, 13}
    assert {n for n in give_ups if re.search(rf"\b{n}\b", said.group(0))} == give_ups, said.group(0)


def test_restart_on_crash_s_reference_names_every_give_up_exit_code() -> None:
    text = " ".join(_read(REPO / "docs" / "commands.md").split())
    give_ups = _give_up_codes()
    assert {n for n in give_ups if re.search(rf"\bexit {n}\b", text)} == give_ups


def test_the_design_names_every_cause() -> None:
    from ops.states import Cause

    section = _section(_read(REPO / "docs" / "design.md"), "6. Status: states, causes, evidence, exit codes")
    for cause in Cause:
        assert f"`{cause}`" in section, cause


def _table_keys(text: str) -> set[str]:
    """The keys of the first column of every table row (a cell may hold several: `a`, `b`)."""
    keys: set[str] = set()
    for cell in re.findall(r"^\| ([^|]*) \|", text, re.M):
        keys.update(re.findall(r"`([a-z_.]+)`", cell))
    return keys


def _fields(cls: type, drop: t.Iterable[str] = ()) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - set(drop)


def test_hosts_md_documents_every_key_and_no_other() -> None:
    from ops.group import Group
    from ops.hosts import Host, ProxmoxApi, SupervisePlace

    text = _read(REPO / "docs" / "hosts.md")
    hosts = (
        _section(text, "`[hosts.NAME]`: every host")
        + _section(text, "`[hosts.NAME]`: ssh hosts only")
        + _section(text, "`[hosts.NAME]`: a Proxmox container (ssh, or local on the Proxmox host itself)")
    )
    assert _table_keys(hosts) == _fields(Host, drop={"name"})
    supervise = _section(text, "`[hosts.NAME.supervise]`: the supervisor on the Proxmox host")
    assert _table_keys(supervise) == _fields(SupervisePlace)
    proxmox = _section(text, "`[hosts.NAME.proxmox]`: container status and start through the Proxmox API")
    assert _table_keys(proxmox) == _fields(ProxmoxApi)
    assert _table_keys(_section(text, "`[groups.NAME]`")) == _fields(Group, drop={"name", "store_host"})


def test_training_md_documents_every_run_config_key_and_no_other() -> None:
    import dflash.config as config

    keys: set[str] = set()
    for name, hint in t.get_type_hints(config.RunConfig).items():
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a [section]; `target.tiny` stays a key
            keys |= {f"{name}.{g.name}" for g in dataclasses.fields(hint)}
        else:
            keys.add(name)
    assert _table_keys(_section(_read(REPO / "docs" / "training.md"), "The run config")) == keys


def test_every_command_has_its_line_and_its_reference() -> None:
    import dflash.__main__ as dflash_main
    import ops.cli

    readme = _section(_read(README), "Commands")
    listed = set(re.findall(r"^\| `((?:dflashctl|dflash) [a-z-]+)", readme, re.M))

    def names(group: click.Group) -> list[str]:  # dflashctl's commands are imported on first use
        return group.list_commands(click.Context(group))

    assert listed == {f"dflashctl {c}" for c in names(ops.cli.cli)} | {f"dflash {c}" for c in names(dflash_main.cli)}
    for page, group in (("commands.md", ops.cli.cli), ("training.md", dflash_main.cli)):
        headings = re.findall(r"^##+ (.+)$", _read(REPO / "docs" / page), re.M)
        for name in names(group):
            said = re.compile(rf"(?:^|, )(?:dflash )?{re.escape(name)}(?=[:, ]|$)")
            assert any(said.search(h) for h in headings), f"docs/{page} has no heading for {name}"


def test_the_hosts_toml_examples_parse() -> None:
    from ops.hosts import parse_inventory

    blocks = [b for b in _fences(_read(README), "toml") if "[hosts." in b]
    assert len(blocks) == 2
    inv = parse_inventory(blocks[0], path=None, base=REPO)
    shipped = parse_inventory(_read(REPO / "hosts.toml"), path=None, base=REPO)
    assert inv.get("local") == shipped.get("local"), "the README shows the shipped local host"
    pve = parse_inventory(blocks[1], path=None, base=REPO).get("pve")
    assert pve.container == 200 and pve.address == "pve.example.internal" and pve.proxmox is not None
    both = [b for b in _fences(_read(REPO / "docs" / "hosts.md"), "toml")]
    assert sorted(parse_inventory(both[0], path=None, base=REPO).hosts) == ["local", "pve"]
    (group,) = [b for b in _fences(_read(REPO / "docs" / "gpu.md"), "toml") if "[groups." in b]
    big = parse_inventory(group, path=None, base=REPO)  # "More than one box": a two-host group
    assert big.group("big").hosts == ("pve1", "pve2") and big.group("big").rdzv == "10.0.0.11:29400"
    assert big.group("big").node_command(big.get("pve2"))[:3] == ("python", "-m", "torch.distributed.run")


def test_no_page_carries_the_test_harness_s_paths() -> None:
    """Transcripts come from the demo or use neutral paths: no pytest temp dirs, harness folders or ports."""
    harness = re.compile(r"/tmp/pytest-|/var/tmp/dflash-pve-|127\.0\.0\.1:[1-9]\d{4}\b|/tmp/demo|/work/")
    for page in PAGES:
        for n, line in enumerate(_read(page).splitlines(), 1):
            assert not harness.search(line), f"{page.name}:{n}: {line[:120]}"
