"""The layout's rules, read from the source: the far side (ops/far) is stdlib only and imports nothing of
the operator side; no package of ours (dflash, ops, testkit) has an import circle or imports another module's
private names; no module is over 1,000 lines."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import typing as t
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OPS = REPO / "ops"
FAR = OPS / "far"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PACKAGES = ("dflash", "ops", "testkit")
MODULES = {module_name(p): p for top in PACKAGES for p in sorted((REPO / top).rglob("*.py"))}


class Import(t.NamedTuple):
    line: int
    module: str  # what the statement names: "ops.far", "json"
    names: tuple[str, ...]  # the names of a `from` import; () for `import x`
    type_only: bool  # under `if TYPE_CHECKING:` (never runs)


def imports(path: Path) -> list[Import]:
    """Every import statement of a module, wherever it stands (module level, functions, branches)."""
    found: list[Import] = []

    def walk(node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(child.lineno, a.name, (), type_only) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{path}:{child.lineno}: relative import"
                names = tuple(a.name for a in child.names)
                found.append(Import(child.lineno, child.module or "", names, type_only))
            walk(child, type_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)))

    walk(ast.parse(path.read_text()), False)
    return found


def targets(imp: Import) -> list[str]:
    """The modules of ours an import runs: ``from ops.far import lock`` -> ops.far.lock."""
    if not imp.names:
        return [imp.module] if imp.module in MODULES else []
    subs = [f"{imp.module}.{n}" for n in imp.names if f"{imp.module}.{n}" in MODULES]
    rest = [n for n in imp.names if f"{imp.module}.{n}" not in MODULES]
    return subs + ([imp.module] if rest and imp.module in MODULES else [])


def test_the_far_side_imports_the_stdlib_and_itself_only() -> None:
    """Everything under ops/far runs in the container with whatever python is there (the agent with -I -S)."""
    bad = []
    for path in sorted(FAR.rglob("*.py")):
        for imp in imports(path):
            top = imp.module.split(".")[0]
            ok = (
                imp.module == "__future__"
                or top in sys.stdlib_module_names
                or imp.module == "ops.far"
                or imp.module.startswith("ops.far.")
            )
            if not ok:
                bad.append(f"{path.relative_to(REPO)}:{imp.line}: {imp.module}")
    assert bad == []
    assert {"agent.py", "runner.py", "tmux.py", "protocol.py", "release.py"} <= {p.name for p in FAR.glob("*.py")}


def test_the_agent_and_the_runner_load_nothing_but_the_stdlib_and_ops_far() -> None:
    """What the far side's entry points really load, run as the agent runs (-I -S: no site-packages)."""
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1])\n"
        "import ops.far.agent, ops.far.runner, ops.far.release, ops.far.tmux\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    p = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(REPO)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    loaded = json.loads(p.stdout)
    ours = [m for m in loaded if m.split(".")[0] not in sys.stdlib_module_names and m != "__main__"]
    assert ours and all(m in ("ops", "ops.far") or m.startswith("ops.far.") for m in ours), ours


def test_the_agent_does_not_load_pathlib_which_the_probe_does_not_use() -> None:
    """Every status pays the agent's imports: what the probe does not use stays unloaded (pathlib with
    urllib.parse and ipaddress was a fifth of them)."""
    code = "import sys, json; sys.path.insert(0, sys.argv[1])\nimport ops.far.agent\nprint(json.dumps(sorted(sys.modules)))"
    p = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(REPO)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    loaded = set(json.loads(p.stdout))
    assert not loaded & {"pathlib", "urllib.parse", "ipaddress"}, sorted(
        loaded & {"pathlib", "urllib.parse", "ipaddress"}
    )


def test_no_package_has_an_import_circle() -> None:
    """Imports that run (module level or inside a function; not TYPE_CHECKING ones) form no cycle."""
    edges = {
        name: {m for imp in imports(path) if not imp.type_only for m in targets(imp) if m != name}
        for name, path in MODULES.items()
    }
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [])
    assert [" -> ".join(c) for c in cycles] == []


def test_no_module_imports_another_modules_private_names() -> None:
    bad = []
    for name, path in MODULES.items():
        for imp in imports(path):
            if imp.module.split(".")[0] not in PACKAGES or imp.module == name:
                continue
            for n in imp.names:
                private = n.startswith("_") and not n.startswith("__")
                if private and f"{imp.module}.{n}" not in MODULES:  # a private module of a package is its own
                    bad.append(f"{path.relative_to(REPO)}:{imp.line}: {imp.module}.{n}")
    assert bad == []


GATE = 1000  # lines: a module past it is two concepts
NEAR = GATE * 95 // 100  # a module this close to the gate is one split away from being shaped by it


def test_no_module_is_near_the_line_gate() -> None:
    """Files split where their concepts split; a module within 5% of the gate means the gate is shaping it."""
    sizes = {
        str(p.relative_to(REPO)): len(p.read_text().splitlines())
        for top in (*PACKAGES, "bench")
        for p in (REPO / top).rglob("*.py")
    }
    assert {p: n for p, n in sizes.items() if n > NEAR} == {}


def test_every_bench_runs_as_a_module_of_the_bench_package() -> None:
    """`python -m bench.NAME` from the repo root: the docstring says so, and nothing edits sys.path."""
    benches = sorted(p for p in (REPO / "bench").glob("*.py") if p.name != "__init__.py")
    assert benches and (REPO / "bench" / "__init__.py").is_file()
    for path in benches:
        text = path.read_text()
        assert f"python -m bench.{path.stem}" in (ast.get_docstring(ast.parse(text)) or ""), path.name
        assert "sys.path" not in text, path.name


def test_the_kinds_of_a_refusal_are_the_constants_both_ends_import() -> None:
    """An answer's ``error`` is said (the agent, the release program, the host's service) and told apart
    (the operator side) by ``ops.far.refusal``'s names, never by a string written twice."""
    from ops.far import refusal

    kinds = {v for k, v in vars(refusal).items() if k.isupper()}
    assert len(kinds) == len([k for k in vars(refusal) if k.isupper()]), "two names for one kind"

    def kind(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in kinds

    def error_of(node: ast.AST) -> bool:  # kind, or answer.get("error")
        return (isinstance(node, ast.Name) and node.id == "kind") or (
            isinstance(node, ast.Call) and bool(node.args) and ast.unparse(node).endswith('.get("error")')
        )

    found = []
    for rel in (
        "far/agent.py",
        "far/release.py",
        "supervise/service.py",
        "session.py",
        "deploy.py",
        "supervise/install.py",
    ):
        for node in ast.walk(ast.parse((OPS / rel).read_text())):
            said = (
                (
                    isinstance(node, ast.Call)
                    and ast.unparse(node.func) in ("Refused", "Failed")
                    and any(map(kind, node.args))
                )
                or (isinstance(node, ast.Call) and any(k.arg == "error" and kind(k.value) for k in node.keywords))
                or (
                    isinstance(node, ast.Dict)
                    and any(
                        isinstance(k, ast.Constant) and k.value == "error" and kind(v)
                        for k, v in zip(node.keys, node.values)
                    )
                )
                or (
                    isinstance(node, ast.Compare)
                    and error_of(node.left)
                    and any(kind(c) or (isinstance(c, ast.Tuple) and any(map(kind, c.elts))) for c in node.comparators)
                )
            )
            if said:
                found.append(f"ops/{rel}:{getattr(node, 'lineno', '?')}: {ast.unparse(node)[:80]}")
    assert not found, "\n".join(found)


def test_only_the_command_line_reaches_up_into_restart_on_crash() -> None:
    """ops.supervise builds on the operator's modules (probe, session, remote), never the other way: a helper
    both need lives below both (ops/state_dir.py, ops/times.py), and only ops/cli/, the top, imports ops.supervise."""
    bad = []
    for name, path in MODULES.items():
        if (
            not name.startswith("ops.")
            or name.startswith(("ops.supervise", "ops.far"))
            or name == "ops.cli"
            or name.startswith("ops.cli.")
        ):
            continue
        for imp in imports(path):
            if any(m == "ops.supervise" or m.startswith("ops.supervise.") for m in targets(imp)):
                bad.append(f"{path.relative_to(REPO)}:{imp.line}: {imp.module}")
    assert bad == []


def test_a_bench_run_by_its_path_says_the_module_form_in_one_line() -> None:
    """`python bench/NAME.py` cannot import bench or testkit (nothing edits sys.path): every bench with a
    __main__ says `python -m bench.NAME` before an import could fail; one is run by its path to prove it."""
    for path in sorted((REPO / "bench").glob("*.py")):
        text = path.read_text()
        if path.name == "__init__.py" or "__main__" not in text:
            continue
        tree = ast.parse(text)
        first = next(n for n in tree.body[1:] if not (isinstance(n, ast.ImportFrom) and n.module == "__future__"))
        assert isinstance(first, ast.If) and ast.unparse(first.test) == "not __package__", path.name
        assert f"python -m bench.{path.stem}" in ast.unparse(first.body[0]), path.name
    p = subprocess.run(
        [sys.executable, "bench/gpu_smoke.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert (p.returncode, p.stdout, p.stderr) == (1, "", "run it from the repo root as: python -m bench.gpu_smoke\n")
