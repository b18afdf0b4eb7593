"""Which pytest-xdist worker a test runs on (``--dist loadgroup``, as scripts/test runs it).

A test that uses a module-, class- or package-scoped fixture (a tiny model trained once, a served folder)
runs on the same worker as the rest of its module, so the fixture is built once per run, not once per
worker; the ``serial`` tests share one worker, one after another; every other test goes to whichever
worker is free.

pytest-xdist 3.8 tells its controller a test's group by appending ``@group`` to the test's node id, which
it writes into ``item._nodeid``; pytest 9.2 keeps a node's id in a structured ``item._id`` and no longer
reads ``_nodeid``, so the suffix is lost, and with it every group: module fixtures were built on each
worker, and ``serial`` tests ran side by side (pytest-dev/pytest-xdist#1386). Where the suffix did not
take, this plugin sets the id itself, after xdist's hook. Reports then carry ``NODEID@group``, as they
do on the pytest versions xdist was written for; :func:`plain` gives the id without it.
"""

from __future__ import annotations

import pytest


def plain(nodeid: str) -> str:
    """A node id without loadgroup's ``@group`` suffix (a parameter may itself hold an ``@``)."""
    at = nodeid.rfind("@")
    return nodeid[:at] if at > nodeid.rfind("]") else nodeid


def group_of(item: pytest.Item) -> str | None:
    """The group this test joins, or None: any worker may run it."""
    if item.get_closest_marker("serial") is not None:
        return "serial"
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if defs and defs[-1].scope in ("module", "class", "package"):
            return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        group = group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


# after pytest-xdist's hook has (or has not) renamed the items (a second impl of the hook: pytest registers
# only functions named pytest_*, specname says which hook)
@pytest.hookimpl(specname="pytest_collection_modifyitems", trylast=True)
def pytest_collection_modifyitems_after_xdist(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # set in xdist's workers under --dist loadgroup
        return
    for item in items:
        marks = item.iter_markers("xdist_group")
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
        if names and plain(item.nodeid) == item.nodeid:
            from _pytest.nodeid import NodeId  # pytest >= 9.2, whose structured id xdist 3.8 does not set

            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")
