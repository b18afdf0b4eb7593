"""paramiko, imported without its start-up import of `invoke` (every module here imports paramiko from this one)."""

from __future__ import annotations

import sys
import typing as t


class _InvokeOnDemand:
    """Stands in for the `invoke` module inside paramiko.config until a `Match exec` line needs it."""

    def __getattr__(self, name: str) -> t.Any:
        import invoke
        import paramiko.config

        paramiko.config.invoke = invoke
        return getattr(invoke, name)


def _import_paramiko_without_invoke() -> None:
    """paramiko imports `invoke` at start-up only to run ssh_config `Match exec` lines; that import is a
    third of paramiko's (~120 ms of every `dflashctl status`, bench/status_vs_raw.py). Import paramiko
    without it, and hand paramiko.config a stand-in that imports invoke on first use."""
    if "paramiko" in sys.modules or "invoke" in sys.modules:
        return
    import importlib.util

    if importlib.util.find_spec("invoke") is None:
        return
    sys.modules["invoke"] = None  # type: ignore[assignment]  # `import invoke` raises ImportError
    try:
        import paramiko.config
    finally:
        del sys.modules["invoke"]
    paramiko.config.invoke = _InvokeOnDemand()
    paramiko.config.invoke_import_error = None


_import_paramiko_without_invoke()
import paramiko as paramiko  # noqa: E402  (after the invoke stand-in above)
