"""restart-on-crash for a host group: one policy for the whole run, whose nodes restart together.

A torchrun job is one run on several hosts: when a node crashes or is lost, the survivors cannot go on
alone (their collectives wait for it, then fail), so the group is restarted as a whole: the survivors are
stopped first, then every node starts a new attempt at once. The policy (backoff, crash-loop guard,
"never restart this"), the incidents, the memory and the lock are ``Supervisor``'s; what differs is what
a probe is (every node at once, reduced to the worst node's status by ``ops.group.verdict``) and what a
recovery does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import typing as t
from pathlib import Path

from ops import errors
from ops import session as run
from ops.group import Group, fan_out, verdict
from ops.hosts import Host
from ops.probe import Status, iso
from ops.redaction import Scrubber, scrubbed_status, secret_values
from ops.states import Action, Cause, State
from ops.supervise.loop import Supervisor, save_stack
from ops.supervise.policy import Decision, Options
from ops.supervise.state import IncidentLog, Lock, slug

if t.TYPE_CHECKING:
    from ops.notify import Notifier
    from ops.remote import Remote

logger = logging.getLogger(__name__)

STOP_GRACE = 30.0  # seconds per step (Ctrl-C, TERM) when the survivors of a crashed group are stopped
_LIVE = (State.RUNNING, State.STALLED)


@dataclasses.dataclass
class GroupStatus(Status):
    """The group's status: the worst node's, its headline naming the node (``pve2: crashed: ...``)."""

    node: str | None = None

    def headline(self) -> str:
        head = super().headline()
        return f"{self.node}: {head}" if self.node else head


class GroupSupervisor(Supervisor):
    """The restart-on-crash loop for every host of one group (one connection per host, kept)."""

    def __init__(
        self,
        group: Group,
        members: t.Sequence[Host],
        session: str | None,
        opts: Options,
        *,
        state_dir: Path | None = None,
        on_event: t.Sequence[str] | None = None,
        emit: t.Callable[[str], None] = print,
        hide_env: t.Sequence[str] = (),
        notifier: Notifier | None = None,
    ) -> None:
        secrets = [name for h in members for name in h.secret_env]
        super().__init__(
            members[0],
            session,
            opts,
            state_dir=state_dir,
            on_event=on_event,
            emit=emit,
            hide_env=[*secrets, *hide_env],
            notifier=notifier,
        )
        self.group = group
        self.members = list(members)
        # every node's secrets, not only the first's
        self.scrub = Scrubber([*secret_values(members, os.environ), *(notifier.scrub.secrets if notifier else ())])
        self.label = f"group {group.name}"
        name = f"group-{group.name}"  # never a host's name: hosts.toml refuses a group named like a host
        self.incidents = IncidentLog(self.state_dir, name, self.session)
        base = f"{slug(name)}.{slug(self.session)}"
        self.lock = Lock(self.state_dir / "supervise" / f"{base}.lock", f"{name}/{self.session}")
        self.memory_path = self.state_dir / "supervise" / f"{base}.json"
        self._remotes: dict[str, Remote] = {}
        self._remotes_lock = threading.Lock()
        self._last: list[Status] = []

    def emit(self, text: str) -> None:
        self._emit(self.scrub(f"{time.strftime('%Y-%m-%d %H:%M:%S')} group {self.group.name}/{self.session}: {text}"))

    def _remote_of(self, host: Host) -> Remote:
        with self._remotes_lock:
            remote = self._remotes.get(host.name)
        if remote is None:
            remote = self._connect_fn(host)
            with self._remotes_lock:
                self._remotes[host.name] = remote
        return remote

    def _drop(self) -> None:
        with self._remotes_lock:
            remotes, self._remotes = list(self._remotes.values()), {}
        for r in remotes:
            try:
                r.close()
            except Exception:  # closing a broken connection must not end supervision
                logger.debug("closing a connection failed", exc_info=True)

    def _drop_host(self, name: str) -> None:
        with self._remotes_lock:
            remote = self._remotes.pop(name, None)
        if remote is not None:
            try:
                remote.close()
            except Exception:
                logger.debug("closing a connection failed", exc_info=True)

    def probe(self) -> Status:
        """Every node at once; the group's status is the worst node's (the node named in the headline),
        or, when all run, the first node's; its attempt is the highest of the nodes'."""

        def one(host: Host) -> Status:
            st = run.status(host, self.session, lambda: self._remote_of(host))
            if st.state in (State.UNREACHABLE, State.CONTAINER_DOWN):
                self._drop_host(host.name)
            return st

        outcomes = fan_out(self.members, one)
        nodes: list[Status] = []
        for o in outcomes:
            if o.value is not None:
                nodes.append(o.value)
            else:  # a bug or an untyped library error must not end an overnight watch
                self._drop_host(o.host)
                nodes.append(
                    Status(
                        host=o.host,
                        session=self.session,
                        state=State.UNREACHABLE,
                        cause=Cause.UNKNOWN,
                        detail=f"the probe failed: {type(o.error).__name__}: {o.error}",
                        checked_at=iso(self.clock()),
                    )
                )
        self._last = nodes
        v = verdict(nodes)
        attempt = max((n.attempt for n in nodes if n.attempt is not None), default=None)
        worst = next((n for n in nodes if n.host == v.node), nodes[0])
        fields = {f.name: getattr(worst, f.name) for f in dataclasses.fields(worst)}
        fields.update(
            host=f"group {self.group.name}",
            attempt=attempt,
            node=v.node,
            evidence=[f"{n.host}: {n.headline()}" for n in nodes] + list(worst.evidence),
        )
        st = scrubbed_status(GroupStatus(**fields), self.scrub)
        logger.info("probe group %s/%s: %s", self.group.name, self.session, v.line())
        return st

    def _act(self, st: Status, d: Decision, inc: dict[str, t.Any]) -> int | None:
        """Stop the nodes still alive, then start every node (a new attempt each; the highest is returned);
        or start the stopped container of the node that is down."""
        hosts = {h.name: h for h in self.members}
        if d.action == Action.START_CONTAINER:
            for node in self._last:
                if node.state == State.CONTAINER_DOWN:
                    remote = self._remote_of(hosts[node.host])
                    if remote.container is None:
                        raise errors.OpsError(f"{hosts[node.host].label} has no container to start")
                    remote.container.start()
                    self.emit(f"{node.host}: container {remote.container.vmid} started; re-probing")
            return None
        if d.action == Action.STOP_THEN_RESTART:
            for node in self._last:
                if node.state == State.STALLED:
                    inc.setdefault("stacks", {})[node.host] = save_stack(self._remote_of(hosts[node.host]), node)
        # the survivors, and what a node's dead keeper left running (a start refuses beside it)
        live = [hosts[n.host] for n in self._last if n.state in _LIVE or n.cause == Cause.ORPHANS_LEFT]
        for o in fan_out(live, lambda h: run.stop(self._remote_of(h), self.session, grace=STOP_GRACE)):
            if o.error is not None:
                raise o.error
            self.emit(f"{o.host}: stopped the survivor ({(o.value or {}).get('how')})")
        by = self.started_by(st, d, inc)
        started = fan_out(self.members, lambda h: run.start(self._remote_of(h), self.session, started_by=by))
        attempt = None
        for o in started:
            if o.value is not None:
                self.emit(
                    f"{o.host}: restarted: attempt {o.value.get('attempt')} started "
                    f"(command pid {o.value.get('child_pid')}); log {o.value.get('log')}"
                )
                attempt = max(attempt or 0, int(o.value.get("attempt") or 0)) or None
        failed = [o for o in started if o.error is not None]
        if failed:
            raise failed[0].error or errors.OpsError("start failed")
        return attempt

    def _drops_after(self, e: Exception) -> bool:
        return True  # one node's failure may have left any of the connections half-used: reconnect them all
