"""Errors of dflash: one root, and the exit code each class carries.

Every exception dflash raises on purpose derives from ``DflashError``; a subclass lives next to what
raises it (``config.ConfigError``, ``store.StoreError``, ``distributed.PeerLost``, ...) and says two things:

- ``exit_code``: 2 for a user's mistake (bad config, arguments or input), 1 for a failure, 3 for a run
  that diverged (a non-finite loss, gradient norm or weights: ``dflash.train.divergence.Diverged``), 4 for
  a run whose last checkpoint the disk had no room for (``dflash.checkpoint.room.DiskFull``);
- ``traceback``: False for a message that names its cause (``dflash.__main__.main`` prints ``line()`` and
  returns the code: never a traceback for a user's mistake); True for a run's failure mid-training (a
  worker error, a lost peer, a checkpoint that could not be written), which leaves the process with its
  traceback: train.log keeps it, and dflashctl's crash report reads its last line (the class's full name,
  e.g. ``dflash.train.pipeline.InjectedFault``, so those classes keep their modules).

``dflash.__main__.main`` is the one place that turns these into a process's exit status.
"""

from __future__ import annotations

import typing as t

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2  # bad config, arguments or input; also click's usage errors
EXIT_DIVERGED = 3  # training stopped at a non-finite update, without a checkpoint (dflash.train.divergence)
EXIT_DISK_FULL = 4  # the run's last checkpoint could not be written for want of disk space (dflash.checkpoint.room)


class DflashError(Exception):
    """Root of every error dflash raises on purpose. By default a failure that ends with its traceback."""

    exit_code: t.ClassVar[int] = EXIT_FAILED
    traceback: t.ClassVar[bool] = True

    def line(self) -> str:
        """What ``main`` prints on stderr (one line) when the class does not end with its traceback."""
        return f"dflash: {self}"


class InputError(DflashError):
    """A user's mistake that the message names (a file, a line, a key): one line, exit 2."""

    exit_code = EXIT_CONFIG
    traceback = False


class DataError(InputError, ValueError):
    """A sample or the data file is unusable; the message names the file, line and key.

    Raised by dflash.data.samples, dflash.data.batching and chat.load_tokenizer (so it lives below them all: chat cannot
    import data, which opens token stores, which render chats)."""


class BadInput(InputError):
    """A command refuses its config, arguments or input: ``main`` prints the message as it is, exit 2."""

    def line(self) -> str:
        return str(self)


class Failed(DflashError):
    """A command's work failed: ``main`` prints the message (if any) as it is, exit 1."""

    traceback = False

    def line(self) -> str:
        return str(self)


__all__ = [
    "EXIT_CONFIG",
    "EXIT_DISK_FULL",
    "EXIT_DIVERGED",
    "EXIT_FAILED",
    "EXIT_OK",
    "BadInput",
    "DataError",
    "DflashError",
    "Failed",
    "InputError",
]
