"""`dflashctl --group NAME start`: every node at once, and a Ctrl-C that leaves nothing half-started.

A group's nodes meet in one rendezvous: a node started alone waits there for the others until torchrun's
rendezvous timeout. So when the start is interrupted (Ctrl-C), it does not wait for the slowest host:
it says what each host got (started / not started / interrupted while starting) and stops what THIS
call started, by the start's own id (``start_id``): a host whose start was still in flight is asked to
stop that start only, and if the start had not reached it yet, it never runs (the agent keeps a mark and
refuses it). Nothing another start made is touched.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import typing as t

from ops import errors
from ops import session as run

if t.TYPE_CHECKING:
    from ops.hosts import Host
    from ops.remote import Remote

STOP_GRACE = 10.0  # seconds per step when the interrupted call stops what it started (it just started)
WAIT = 0.1  # the main thread waits in slices, so that Ctrl-C reaches it at once

CONNECTING, STARTING, STARTED, FAILED, NOT_STARTED = "connecting", "starting", "started", "failed", "not started"


@dataclasses.dataclass
class Node:
    host: Host
    phase: str = CONNECTING
    out: dict[str, t.Any] | None = None
    error: Exception | None = None
    remote: Remote | None = None


class GroupStart:
    """One ``--group start``: ``run()`` starts every node (daemon threads: an interrupted call never waits
    for them to end); after a KeyboardInterrupt, ``abort()`` stops what this call started."""

    def __init__(
        self,
        hosts: t.Sequence[Host],
        session: str | None,
        *,
        replace: bool,
        connect: t.Callable[[Host], Remote],
    ) -> None:
        self.nodes = [Node(h) for h in hosts]
        self.session = session
        self.replace = replace
        self.connect = connect
        self.start_id = os.urandom(8).hex()
        self._lock = threading.Lock()
        self._aborted = False

    def run(self) -> list[Node]:
        threads = [threading.Thread(target=self._one, args=(n,), daemon=True, name="group-start") for n in self.nodes]
        for th in threads:
            th.start()
        for th in threads:
            while th.is_alive():
                th.join(WAIT)
        return self.nodes

    def _one(self, node: Node) -> None:
        try:
            remote = self.connect(node.host)
        except Exception as e:  # reported per host
            with self._lock:
                node.phase, node.error = (NOT_STARTED if self._aborted else FAILED), e
            return
        with self._lock:
            node.remote = remote
            if self._aborted:
                node.phase = NOT_STARTED
                remote.close()
                return
            node.phase = STARTING
        try:
            out = run.start(remote, self.session, replace=self.replace, start_id=self.start_id)
            with self._lock:
                node.out = out
                if node.phase == STARTING:
                    node.phase = STARTED
        except Exception as e:
            with self._lock:
                node.error = e
                if node.phase == STARTING:
                    node.phase = FAILED
        finally:
            remote.close()

    def abort(self, say: t.Callable[[str, str], None]) -> bool:
        """Ctrl-C: what each node got, as it was at that moment; cut the calls in flight; then stop, on
        every node a start was sent to, the run this start made (nothing else). ``say(host, line)``.
        True when nothing this start made is left running."""
        with self._lock:
            self._aborted = True
            seen = {id(n): n.phase for n in self.nodes}
            for n in self.nodes:
                if n.phase == STARTING and n.remote is not None:
                    try:
                        n.remote.close()  # cut the call: we stop waiting for the slowest host
                    except Exception:  # closing a connection must not end the abort
                        pass
        for n in self.nodes:
            phase = seen[id(n)]
            if phase == STARTED:
                say(
                    n.host.name,
                    f"started attempt {(n.out or {}).get('attempt')}; stopping it (this start was interrupted)",
                )
            elif phase == STARTING:
                say(n.host.name, "interrupted while starting; stopping whatever this start made there")
            elif phase == FAILED:
                say(n.host.name, f"not started: {n.error}")
            else:
                say(n.host.name, "not started")
        due = [n for n in self.nodes if seen[id(n)] in (STARTED, STARTING)]
        results: dict[str, str] = {}
        failed: list[str] = []

        def stop(node: Node) -> None:
            try:
                remote = self.connect(node.host)
                try:
                    out = run.stop(remote, self.session, grace=STOP_GRACE, start_id=self.start_id)
                finally:
                    remote.close()
                if out.get("cancelled"):
                    results[node.host.name] = "its start never ran (cancelled)"
                elif out.get("stopped"):
                    results[node.host.name] = f"stopped attempt {out.get('attempt')} by {out.get('how')}"
                elif "ended" in out:  # a stop was tried and the run outlived it
                    results[node.host.name] = f"attempt {out.get('attempt')} did not end: `dflashctl stop` it"
                    failed.append(node.host.name)
                else:
                    results[node.host.name] = f"nothing to stop: {out.get('reason')}"
            except errors.OpsError as e:
                results[node.host.name] = f"could not stop it: {e}"
                failed.append(node.host.name)

        threads = [threading.Thread(target=stop, args=(n,), daemon=True, name="group-stop") for n in due]
        for th in threads:
            th.start()
        try:
            for th in threads:
                while th.is_alive():
                    th.join(WAIT)
        except KeyboardInterrupt:
            for n in due:
                if n.host.name not in results:
                    say(n.host.name, "left as it is (interrupted again): check it with `dflashctl status`")
            raise
        for n in due:
            say(n.host.name, results.get(n.host.name, "could not stop it"))
        return not failed and all(n.host.name in results for n in due)
