"""paramiko, imported without its start-up imports of `invoke` and `importlib.metadata` (every module here
imports paramiko from this one)."""

from __future__ import annotations

import os
import sys
import types
import typing as t


class _InvokeOnDemand:
    """Stands in for the `invoke` module inside paramiko.config until a `Match exec` line needs it."""

    def __getattr__(self, name: str) -> t.Any:
        import invoke
        import paramiko.config

        paramiko.config.invoke = invoke
        return getattr(invoke, name)


class _MetadataOnDemand(types.ModuleType):
    """Stands in for `importlib.metadata` while paramiko imports: paramiko's `__init__` asks it only for its own
    version (the SSH banner's), and the real module (email, zipfile, csv, then a scan of every sys.path entry's
    distributions) was ~20-70 ms of every `dflashctl status` (bench/status_vs_raw.py). The version is read from
    the name of paramiko's .dist-info folder; anything else, or no such folder, goes to the real module."""

    def __init__(self, site: str) -> None:
        super().__init__("importlib.metadata")
        self._site = site

    def version(self, name: str) -> str:
        prefix = f"{name}-"
        for entry in os.listdir(self._site):
            if entry.startswith(prefix) and entry.endswith(".dist-info"):
                return entry[len(prefix) : -len(".dist-info")]
        return str(self._real().version(name))

    def __getattr__(self, name: str) -> t.Any:
        return getattr(self._real(), name)

    @staticmethod
    def _real() -> t.Any:
        import importlib

        if isinstance(sys.modules.get("importlib.metadata"), _MetadataOnDemand):
            del sys.modules["importlib.metadata"]
            if isinstance(getattr(importlib, "metadata", None), _MetadataOnDemand):
                del importlib.metadata
        return importlib.import_module("importlib.metadata")


def _import_paramiko_without_invoke() -> None:
    """paramiko imports `invoke` at start-up only to run ssh_config `Match exec` lines; that import is a
    third of paramiko's (~120 ms of every `dflashctl status`, bench/status_vs_raw.py). Import paramiko
    without it, and hand paramiko.config a stand-in that imports invoke on first use."""
    if "paramiko" in sys.modules or "invoke" in sys.modules:
        return
    import importlib.util

    if importlib.util.find_spec("invoke") is None:
        return
    spec = importlib.util.find_spec("paramiko")
    stub = None
    if "importlib.metadata" not in sys.modules and spec is not None and spec.origin:
        stub = _MetadataOnDemand(os.path.dirname(os.path.dirname(spec.origin)))
        sys.modules["importlib.metadata"] = stub
    sys.modules["invoke"] = None  # type: ignore[assignment]  # `import invoke` raises ImportError
    try:
        import paramiko.config
    finally:
        del sys.modules["invoke"]
        if stub is not None and sys.modules.get("importlib.metadata") is stub:
            del sys.modules["importlib.metadata"]
            import importlib

            if getattr(importlib, "metadata", None) is stub:
                del importlib.metadata
    paramiko.config.invoke = _InvokeOnDemand()
    paramiko.config.invoke_import_error = None


_import_paramiko_without_invoke()
import paramiko as paramiko  # noqa: E402  (after the invoke stand-in above)
