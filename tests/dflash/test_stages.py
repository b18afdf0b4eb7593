"""dflash/ reads in stages (docs/design.md section 17): a module imports only its own stage and those below it,
never a circle; the one arrow back up is type-only and listed here."""

from __future__ import annotations

import ast
from pathlib import Path

from dflash import config
from dflash.eval import suites

ROOT = Path(__file__).resolve().parents[2] / "dflash"

# bottom first: what every stage reads, then the stages as the data flows, then the command line
STAGES = {
    "base": 0,  # dflash.errors, inputs, outputs, dtypes, config
    "model": 1,
    "data": 2,
    "checkpoint": 3,
    "models": 4,  # the one builder from a RunConfig (target, drafter spec, warm start): train and eval share it
    "eval": 5,
    "train": 6,
    "serve": 7,
    "main": 8,
}
BASE = {"errors", "inputs", "outputs", "dtypes", "config"}
# (importer, imported): type-only imports (under TYPE_CHECKING) that point up a stage
TYPE_ONLY_UP: set[tuple[str, str]] = set()


def stage(module: str) -> str:
    parts = module.split(".")[1:]
    if parts[0] in STAGES and len(parts) > 1:
        return parts[0]
    if parts[0] == "__main__":
        return "main"
    if parts[0] == "models":
        return "models"
    assert parts[0] in BASE or parts[0] == "__init__", f"{module}: a top-level module that is no base module"
    return "base"


def module_of(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, type-only) for every dflash import of the file, lazy ones included."""
    tree = ast.parse(path.read_text())
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dflash":
            names = [node.module + "." + a.name for a in node.names]
            names = [
                n
                if (ROOT.parent / n.replace(".", "/")).exists()
                or (ROOT.parent / (n.replace(".", "/") + ".py")).exists()
                else node.module
                for n in names
            ]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "dflash"]
        out += [(n, id(node) in type_only) for n in names if n != "dflash"]
    return out


def graph() -> dict[str, list[tuple[str, bool]]]:
    return {module_of(p): imports(p) for p in sorted(ROOT.rglob("*.py"))}


def test_every_import_points_down_a_stage_or_within_it() -> None:
    up = []
    for mod, deps in graph().items():
        for dep, type_only in deps:
            if STAGES[stage(dep)] > STAGES[stage(mod)] and not (type_only and (mod, dep) in TYPE_ONLY_UP):
                up.append(f"{mod} -> {dep}" + (" (type-only)" if type_only else ""))
    assert up == []


def test_no_import_circle_between_modules() -> None:
    g = {m: {d for d, type_only in deps if not type_only} for m, deps in graph().items()}
    seen: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(m: str, path: list[str]) -> list[str] | None:
        seen[m] = 1
        for d in sorted(g.get(m, set())):
            if seen.get(d) == 1:
                return [*path, m, d]
            if d not in seen:
                found = visit(d, [*path, m])
                if found:
                    return found
        seen[m] = 2
        return None

    for m in sorted(g):
        if m not in seen:
            assert visit(m, []) is None


def test_the_config_knows_every_suite_by_name() -> None:
    """config.py reads suite names as data (importing dflash.eval.suites would put eval under the config)."""
    assert config.SUITES == tuple(suites.SUITES)
