"""Host groups: one run on several hosts (docs/design.md section 13).

``[groups.NAME]`` in hosts.toml names hosts that train as one ``torchrun`` job: one ``dflash train``
process per host, a c10d rendezvous at ``rdzv``. ``dflashctl --group NAME <verb>`` does the verb on every
host at once (a thread and a connection each) and prints one line per host, then the group's verdict:
``running`` only when every node runs, else the worst node's state, naming the node and why.
"""

from __future__ import annotations

import dataclasses
import typing as t

from ops import keypath
from ops.errors import ConfigError

if t.TYPE_CHECKING:
    from ops.hosts import Host

DEFAULT_RDZV_PORT = 29400  # torchrun's own default for the c10d rendezvous
DEFAULT_MAX_RESTARTS = 0  # restart-on-crash restarts the group; torchrun's own restarts are opt-in

# Worst first. A group is as bad as its worst node: a crashed node ends the run for all; a node still
# running beside a finished one means the job is finishing (torchrun nodes end together).
SEVERITY: tuple[str, ...] = (
    "crashed",
    "lost",
    "container-down",
    "unreachable",
    "stalled",
    "stopped",
    "not-started",
    "running",
    "succeeded",
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """Hosts that run one job together; ``command`` is the per-node command (torchrun around the run)."""

    name: str
    hosts: tuple[str, ...]
    rdzv: str
    nproc_per_node: int = 1
    max_restarts: int = DEFAULT_MAX_RESTARTS
    command: tuple[str, ...] | None = None  # None: torchrun around each host's own `python -m ...` command
    # the host whose torchrun serves the rendezvous store: the first whose address is rdzv's host. Said
    # explicitly: torchrun's own guess makes EVERY node on one machine (or one loopback) try to serve it,
    # and two stores on one port split the rendezvous, which then waits forever (seen with two containers)
    store_host: str | None = None
    # torchrun --local-addr per host (hosts.toml `local_addrs`): how the other nodes reach this one, and half
    # of its identity in the rendezvous, (address, pid). Left to torchrun, the address is the machine's FQDN:
    # two containers with one hostname whose agents got the same pid (fresh pid namespaces started alike)
    # are ONE node to the rendezvous, which then waits forever for the second (seen: both agents pid 16).
    # On one loopback every node gets its own 127.0.0.N by default.
    local_addrs: t.Mapping[str, str] = dataclasses.field(default_factory=dict)

    def node_env(self, host: Host) -> dict[str, str]:
        """What ``host`` runs its node with: its own env, and a fresh worker store every rendezvous round."""
        return {**host.env, **NODE_ENV}

    def node_command(self, host: Host) -> tuple[str, ...]:
        """What ``host`` runs as its node of the group."""
        if self.command is not None:
            return self.command
        return torchrun_around(
            host.command,
            nnodes=len(self.hosts),
            nproc_per_node=self.nproc_per_node,
            rdzv=self.rdzv,
            run_id=self.name,
            max_restarts=self.max_restarts,
            where=f"groups.{self.name}.command",
            is_host=None if self.store_host is None else host.name == self.store_host,
            local_addr=self.local_addrs.get(host.name),
        )


# torchrun keeps the store its workers meet in (the "shared rendezvous TCP store") across rendezvous rounds:
# after a restart (--max-restarts) the new round's workers can read the previous round's addresses from it
# and time out connecting to dead ones ("Gloo connectFullMesh failed ... Connection refused"). With this,
# rank 0 of each round serves a fresh store. dflash train refuses restarts without it (dflash.train.distributed).
NODE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_around(
    command: t.Sequence[str],
    *,
    nnodes: int,
    nproc_per_node: int,
    rdzv: str,
    run_id: str,
    max_restarts: int,
    where: str,
    is_host: bool | None = None,
    local_addr: str | None = None,
) -> tuple[str, ...]:
    """``python -m MOD ARGS`` -> ``python -m torch.distributed.run <rendezvous> -m MOD ARGS``: torchrun from
    the same interpreter (no second install to find on PATH), c10d rendezvous, one process per node."""
    if len(command) < 3 or command[1] != "-m":
        raise ConfigError(
            where,
            f"the hosts' command must be `<python> -m <module> ...` to wrap it in torchrun "
            f"(got {' '.join(command)[:80]!r}); or set {where} yourself",
        )
    python, _, module, *args = command
    conf = () if is_host is None else ("--rdzv-conf", f"is_host={'true' if is_host else 'false'}")
    addr = () if local_addr is None else ("--local-addr", local_addr)
    return (
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        rdzv,
        "--rdzv-id",
        run_id,
        *conf,
        *addr,
        "--max-restarts",
        str(max_restarts),
        "-m",
        module,
        *args,
    )


def parse_groups(raw: t.Any, hosts: t.Mapping[str, Host]) -> dict[str, Group]:
    """``[groups.*]`` of hosts.toml; every error names its key path (``groups.big.hosts[1]``)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError("groups", "expected tables [groups.<name>]")
    out: dict[str, Group] = {}
    for name, table in raw.items():
        p = f"groups.{name}"
        keypath.check_name(name, p)
        if name in hosts:
            raise ConfigError(p, f'"{name}" is also a host: a group needs a name of its own')
        if not isinstance(table, dict):
            raise ConfigError(p, "expected a table")
        keypath.only_keys(table, {"hosts", "rdzv", "nproc_per_node", "max_restarts", "command", "local_addrs"}, p)
        members = table.get("hosts")
        if not isinstance(members, list) or not members:
            raise ConfigError(f"{p}.hosts", "expected a list of host names, at least one")
        names: list[str] = []
        for i, m in enumerate(members):
            h = keypath.string(m, f"{p}.hosts[{i}]", nonempty=True)
            if h not in hosts:
                raise ConfigError(f"{p}.hosts[{i}]", f'no such host: "{h}" (known: {", ".join(sorted(hosts))})')
            if h in names:
                raise ConfigError(f"{p}.hosts[{i}]", f'"{h}" is listed twice')
            names.append(h)
        rdzv = (
            keypath.string(table["rdzv"], f"{p}.rdzv", nonempty=True)
            if "rdzv" in table
            else _default_rdzv(hosts[names[0]])
        )
        host_part, sep, port = rdzv.rpartition(":")
        if not sep or not host_part or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{p}.rdzv", f'expected "HOST:PORT", got "{rdzv}"')
        nproc = keypath.integer(table.get("nproc_per_node", 1), f"{p}.nproc_per_node", minimum=1, maximum=64)
        restarts = keypath.integer(
            table.get("max_restarts", DEFAULT_MAX_RESTARTS), f"{p}.max_restarts", minimum=0, maximum=1000
        )
        command = keypath.argv(table["command"], f"{p}.command") if "command" in table else None
        store = next((h for h in names if _address(hosts[h]) == host_part), None)
        local_addrs = _local_addrs(table.get("local_addrs"), names, host_part, f"{p}.local_addrs")
        group = Group(
            name=name,
            hosts=tuple(names),
            rdzv=rdzv,
            nproc_per_node=nproc,
            max_restarts=restarts,
            command=command,
            store_host=store,
            local_addrs=local_addrs,
        )
        for h in names:  # a default command that cannot be built is an error now, not at start
            group.node_command(hosts[h])
        out[name] = group
    return out


def _local_addrs(raw: t.Any, names: t.Sequence[str], rdzv_host: str, p: str) -> dict[str, str]:
    """``local_addrs = {host = "ADDR"}``; by default, on one loopback, 127.0.0.1, 127.0.0.2, ... in order."""
    if raw is None:
        loopback = rdzv_host == "localhost" or rdzv_host.startswith("127.")
        return {h: f"127.0.0.{i + 1}" for i, h in enumerate(names)} if loopback else {}
    if not isinstance(raw, dict):
        raise ConfigError(p, 'expected a table such as {pve1 = "10.0.0.21"}')
    out: dict[str, str] = {}
    for h, addr in raw.items():
        if h not in names:
            raise ConfigError(f"{p}.{h}", f'"{h}" is not a host of this group ({", ".join(names)})')
        out[h] = keypath.string(addr, f"{p}.{h}", nonempty=True)
    if len(set(out.values())) < len(out):
        raise ConfigError(p, "two hosts have the same address: each node needs its own")
    return out


def _address(host: Host) -> str:
    return "127.0.0.1" if host.is_local or not host.address else host.address


def _default_rdzv(first: Host) -> str:
    return f"{_address(first)}:{DEFAULT_RDZV_PORT}"


# --------------------------------------------------------------------------------------------
# Doing a verb on every host at once

T = t.TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome(t.Generic[T]):
    """One host's result of a fan-out: ``value`` or the error it raised (never both)."""

    host: str
    value: T | None = None
    error: BaseException | None = None


def fan_out(hosts: t.Sequence[Host], fn: t.Callable[[Host], T], *, max_workers: int = 32) -> list[Outcome[T]]:
    """``fn(host)`` for every host in parallel threads; outcomes in the order of ``hosts``. The wall time is
    the slowest host's, not the sum. An exception is an outcome, never raised: one down host must not hide
    the others."""
    if not hosts:
        return []

    def one(h: Host) -> Outcome[T]:
        try:
            return Outcome(h.name, value=fn(h))
        except Exception as e:  # reported per host by the caller
            return Outcome(h.name, error=e)

    import concurrent.futures as cf  # here: hosts.toml's parse (every command's start-up) imports this module

    with cf.ThreadPoolExecutor(max_workers=min(max_workers, len(hosts)), thread_name_prefix="group") as pool:
        return list(pool.map(one, hosts))


class NodeState(t.Protocol):
    @property
    def state(self) -> str: ...

    @property
    def host(self) -> str: ...

    def headline(self) -> str: ...


# every node in one of these states: the group is in it, no node to name
_UNIFORM_NEEDS_NO_NODE = ("running", "succeeded", "stopped", "not-started")


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """The group's state: the worst node's (``running`` only when all run), the node and why."""

    state: str
    node: str | None
    why: str | None

    def line(self) -> str:
        if self.node is None:
            return self.state
        return f"{self.state}: {self.node}: {self.why}" if self.why else f"{self.state}: {self.node}"


def verdict(nodes: t.Sequence[NodeState]) -> Verdict:
    """The worst state of ``nodes`` (SEVERITY order), naming the first node in that state (one whose cause
    is not ``peer-lost`` when there is one)."""
    if not nodes:
        return Verdict("not-started", None, "the group has no hosts")
    rank = {s: i for i, s in enumerate(SEVERITY)}
    # among the worst, a node that lost its peers is a consequence: name the one that took them down
    worst = min(nodes, key=lambda n: (rank.get(n.state, -1), getattr(n, "cause", None) == "peer-lost"))
    if all(n.state == worst.state for n in nodes) and worst.state in _UNIFORM_NEEDS_NO_NODE:
        return Verdict(worst.state, None, None)
    return Verdict(worst.state, worst.host, _why(worst))


def _why(node: NodeState) -> str:
    head = node.headline()
    # the headline starts with the state itself ("crashed: CUDA out of memory ...", "unreachable (refused):
    # ..."): the verdict line names the state once
    for sep in (":", " ("):
        if head.startswith(node.state + sep):
            return head[len(node.state) :].removeprefix(":").strip()
    return head
