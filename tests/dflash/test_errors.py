"""One error root for dflash (``dflash.errors``): every exception class derives from ``DflashError`` and
carries its exit code; ``dflash.__main__.main`` maps them in one ``except``."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil

import pytest

import dflash
import dflash.__main__ as entry
from dflash.errors import EXIT_CONFIG, EXIT_DISK_FULL, EXIT_DIVERGED, EXIT_FAILED, DflashError


def dflash_exceptions() -> list[type[BaseException]]:
    out = []
    for info in pkgutil.walk_packages(dflash.__path__, "dflash."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                out.append(obj)
    return out


def test_every_exception_class_of_dflash_derives_from_the_root_and_carries_its_exit_code() -> None:
    classes = dflash_exceptions()
    assert len(classes) >= 21  # the classes counted when the root was made, and the root's own
    # the drafter module is also served remote code that imports nothing of dflash: its error cannot
    strays = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, DflashError)]
    assert strays == ["dflash.model.drafter.CompileMissError"]
    ours = [c for c in classes if issubclass(c, DflashError)]
    # two classes have their own code: a run that diverged (dflashctl's restart-on-crash reads it), a run
    # whose last checkpoint found no room on disk (dflashctl's cause disk-full)
    assert {c.__qualname__: c.exit_code for c in ours if c.exit_code not in (EXIT_FAILED, EXIT_CONFIG)} == {
        "Diverged": EXIT_DIVERGED,
        "DiskFull": EXIT_DISK_FULL,
    }


@pytest.mark.parametrize(
    "name, code, traceback",
    [
        ("dflash.config.ConfigError", EXIT_CONFIG, False),
        ("dflash.data.store.StoreError", EXIT_CONFIG, False),
        ("dflash.eval.plot.PlotError", EXIT_FAILED, False),
        ("dflash.eval.suites.SuiteError", EXIT_CONFIG, False),  # a suite named or laid out wrong: one line
        ("dflash.train.pipeline.InjectedFault", EXIT_FAILED, True),  # crash reports read its traceback's last line
        ("dflash.train.distributed.PeerLost", EXIT_FAILED, True),
        ("dflash.checkpoint.checkpoints.CheckpointWriteError", EXIT_FAILED, True),
        ("dflash.checkpoint.room.DiskFull", EXIT_DISK_FULL, False),  # one line: the disk and what stays
    ],
)
def test_a_class_says_its_exit_code_and_whether_it_ends_with_a_traceback(name: str, code: int, traceback: bool) -> None:
    module, _, cls_name = name.rpartition(".")
    cls = getattr(importlib.import_module(module), cls_name)
    assert (cls.exit_code, cls.traceback) == (code, traceback)


def test_main_maps_dflash_errors_in_one_except() -> None:
    tree = ast.parse(inspect.getsource(entry))
    main_fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    caught = [ast.unparse(h.type) for h in ast.walk(main_fn) if isinstance(h, ast.ExceptHandler) and h.type]
    assert [c for c in caught if not c.startswith(("SystemExit", "click."))] == ["DflashError"]
