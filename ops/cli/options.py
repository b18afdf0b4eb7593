"""What several commands share: --session (hosts.toml's rule for a session name, checked once, before anything
runs) and ``Seconds``, the one type of every duration option."""

from __future__ import annotations

import math
import typing as t

import click

MAX_SECONDS = 365 * 24 * 3600.0  # one year: longer than any wait we mean; time.sleep overflows near 1e300


class Seconds(click.ParamType[float]):
    """A finite number of seconds in ``[minimum, MAX_SECONDS]`` (``> minimum`` with ``min_open``).

    The one type of every duration option: click's FloatRange lets NaN and inf through (NaN
    compares false with every bound), and then waits end at once (``stop --grace nan`` sent
    Ctrl-C, TERM and KILL within 0.02 s) or never, or time.sleep raises OverflowError.
    """

    name = "seconds"

    def __init__(self, minimum: float = 0.0, *, min_open: bool = False) -> None:
        self.minimum = minimum
        self.min_open = min_open

    def convert(self, value: t.Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value)
        else:
            try:
                seconds = float(str(value))
            except ValueError:
                self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        if seconds < self.minimum or (self.min_open and seconds == self.minimum):
            self.fail(f"{value} is not {'>' if self.min_open else '>='} {self.minimum:g}", param, ctx)
        if seconds > MAX_SECONDS:
            self.fail(f"{value} is more than one year ({MAX_SECONDS:.0f} seconds)", param, ctx)
        return seconds


def check_session(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--session follows hosts.toml's rule for `session`, checked here once, before anything runs."""
    from ops.keypath import check_name

    return None if value is None else check_name(value, "--session")


session_option = click.option(
    "--session",
    metavar="NAME",
    callback=check_session,
    expose_value=True,
    help="tmux session / run name (default: the host's `session`).",
)
