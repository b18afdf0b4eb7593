"""``dflashctl attach``: the command line that attaches this terminal to the run's tmux pane (tmux here,
``ssh -t`` to a host, ``pct exec`` into its container). It is exec'ed, not run through a Transport: it
needs the terminal."""

from __future__ import annotations

import os

from ops.far import tmux
from ops.hosts import Host
from ops.session import session_name


def attach_argv(host: Host, session: str | None = None) -> list[str]:
    """The command that attaches an interactive terminal to the session's pane."""
    session = session_name(host, session)
    inner = tmux.attach_argv(host.tmux_socket, session)
    if host.is_local:
        return ["env", "-u", "TMUX", *inner]
    if host.container is not None:
        inner = [*host.pct, "exec", str(host.container), "--", *inner]
    from ops.transport import remote_command, ssh_config_word  # here: paramiko, for ssh hosts only

    ssh = ["ssh", "-t", "-o", "StrictHostKeyChecking=yes"]
    if host.port:
        ssh += ["-p", str(host.port)]
    if host.identity_file:
        key = os.path.expanduser(host.identity_file)
        # ssh expands %-tokens in key file names, but `-i` checks the file before it expands them:
        # a name with % goes as an ssh_config line, with %% for each %.
        ssh += ["-i", key] if "%" not in key else ["-o", f"IdentityFile={ssh_config_word(key)}"]
    if host.known_hosts:
        # One ssh_config line: a path with spaces or quotes must be quoted the ssh_config way.
        ssh += ["-o", f"UserKnownHostsFile={ssh_config_word(os.path.expanduser(host.known_hosts))} ~/.ssh/known_hosts"]
    target = f"{host.user}@{host.address}" if host.user else str(host.address)
    # `--`: the destination is never read as an option. ssh hands the remote login shell (sh, fish,
    # csh...) ONE string: remote_command quotes the remote argv once, for any of them.
    return [*ssh, "--", target, remote_command(inner)]
