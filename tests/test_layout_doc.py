"""DEVELOPING.md's layout is the code's: every module of dflash/ and ops/ has its line there, and the list of
what the Proxmox host loads is what the installed supervisor really imports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "DEVELOPING.md"


def layout_block() -> str:
    text = DOC.read_text()
    start = text.index("## Layout")
    block = text[start:].split("```")[1]
    return block


def listed_modules(block: str) -> set[str]:
    """Paths the layout names, read by indentation: a `name/` line opens a folder, a `name.py` line under it
    (two spaces deeper) is one of its modules."""
    found: set[str] = set()
    folders: list[str] = []
    for line in block.splitlines():
        m = re.match(r"( *)(\S+)", line)
        if not m:
            continue
        depth, token = len(m.group(1)) // 2, m.group(2)
        if len(m.group(1)) % 2 or depth > len(folders):
            continue  # a continuation line of the text beside a module
        del folders[depth:]
        if token.endswith("/"):
            folders.append(token)
        elif token.endswith(".py"):
            found.add("".join(folders) + token)
    return found


def modules(*tops: str) -> set[str]:
    return {
        str(p.relative_to(REPO))
        for top in tops
        for p in (REPO / top).rglob("*.py")
        if p.name != "__init__.py" and "hf_remote" not in p.parts
    }


def test_every_module_of_dflash_and_ops_has_its_line_in_developing_md() -> None:
    listed = listed_modules(layout_block())
    assert sorted(modules("dflash", "ops") - listed) == []
    assert (
        sorted(p for p in listed - modules("dflash", "ops", "testkit", "bench") if p.startswith(("dflash", "ops")))
        == []
    )


def host_side() -> set[str]:
    """The modules of ours the installed supervisor loads on the Proxmox host (no site-packages: -I -S)."""
    code = "import sys, json; sys.path.insert(0, sys.argv[1])\nimport ops.supervise.service\nprint(json.dumps(sorted(sys.modules)))"
    p = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(REPO)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    loaded = [m for m in json.loads(p.stdout) if m == "ops" or m.startswith("ops.")]
    paths = set()
    for m in loaded:
        path = REPO.joinpath(*m.split("."))
        if path.with_suffix(".py").is_file():
            paths.add(str(path.with_suffix(".py").relative_to(REPO)))
    return paths


def test_the_layout_names_what_runs_on_the_proxmox_host() -> None:
    """The rule of the three places: the container runs ops/far/ (tests/ops/test_layout.py), the Proxmox host
    runs what ops.supervise.service imports (stdlib only), the operator's machine the rest; DEVELOPING.md lists
    the host's modules, and this keeps the list true."""
    text = DOC.read_text()
    m = re.search(r"<!-- host-side -->\n(.*?)<!-- /host-side -->", text, re.S)
    assert m, "DEVELOPING.md: the host-side list (<!-- host-side --> ... <!-- /host-side -->) is gone"
    written = set(re.findall(r"`((?:ops)/[\w/]+\.py)`", m.group(1)))
    assert sorted(written ^ host_side()) == []


def test_every_dflash_module_has_its_stage_in_the_design() -> None:
    """docs/design.md section 17 maps dflash/ by stage: each module in exactly one row."""
    text = (REPO / "docs" / "design.md").read_text()
    table = text[text.index("dflash/'s packages by the stage") : text.index("Decisions, where this differs")]
    named = re.findall(r"`([\w]+\.py)`", table)
    assert sorted(n for n in set(named) if named.count(n) > 1) == []
    files = {p.name for p in (REPO / "dflash").rglob("*.py") if "hf_remote" not in p.parts}
    assert sorted(set(named) ^ files - {"__init__.py"}) == []


def test_no_comment_or_docstring_points_at_an_issue_number() -> None:
    """The repository has no tracker: an issue number, or a finding label such as H2 or M8, means nothing to a reader."""
    pointer = re.compile(r"\bissues? #?\d+|^\s*(?:\"\"\"|#|-)\s*[HM]\d+\b", re.I | re.M)
    bad = []
    for top in ("dflash", "ops", "testkit", "tests", "bench", "scripts"):
        for path in sorted((REPO / top).rglob("*")):
            if path.suffix in (".py", ".sh") or (path.parent.name == "scripts" and not path.suffix):
                for m in pointer.finditer(path.read_text(errors="replace")):
                    bad.append(f"{path.relative_to(REPO)}: {m.group(0).strip()}")
    assert bad == []
