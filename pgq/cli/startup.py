"""Stop signals that arrive before a command has handlers of its own.

Python's default for SIGTERM and SIGHUP ends the process at once (exit -15, -1),
and its SIGINT raises `KeyboardInterrupt` wherever the main thread is, halfway
through an import too (a traceback). `pgq` spends about half a second importing
SQLAlchemy, psycopg and its own modules before a command runs, and `pgq consume`
longer (the handler's module, the first connections), so a service manager that
stopped a member it had just started killed it (issue 21).

`hold()` is the first thing `pgq.cli.main` does, before those imports (`pgq` and
`pgq.cli` import nothing heavy at the top): each of these signals then raises
`Stopped` in the main thread, which unwinds what was started (an engine is
disposed, a transaction rolls back) and `main` ends with one line. `pgq consume`
replaces these handlers with its graceful ones before it claims anything, and
`pgq web` and `pgq demo` with theirs while they serve.

The exit code of such a stop: 0 before any command began (nothing was done) and
in `pgq consume` (DESIGN §7: stopped by a signal after a clean shutdown is 0,
and nothing had been claimed yet); 1 in any other command, which was cut short
and did not do what it was asked.

This module imports nothing but the standard library's `signal`.
"""

from __future__ import annotations

import signal
from types import FrameType

__all__ = ["STOP_SIGNALS", "Stopped", "command_began", "hold", "stop_is_clean"]

STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGINT") if hasattr(signal, name)
)
"""The signals that stop pgq (SIGHUP too: a closed terminal or a service manager)."""

_exit_code = 0


class Stopped(BaseException):
    """A stop signal arrived before the command had handlers of its own.

    A `BaseException`, so that no `except Exception` on the way swallows it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        """The signal's name: `SIGTERM`."""
        return signal.Signals(self.signum).name

    @property
    def line(self) -> str:
        """The one line `pgq` ends with."""
        return f"pgq: stopped by {self.name}"

    @property
    def exit_code(self) -> int:
        """0 if nothing was cut short, else 1 (see the module's docstring)."""
        return _exit_code


def _stop(signum: int, frame: FrameType | None) -> None:
    for s in STOP_SIGNALS:  # a second signal acts at once
        signal.signal(s, signal.SIG_DFL)
    raise Stopped(signum)


def hold() -> None:
    """Turn each stop signal into `Stopped` (call it in the main thread, first)."""
    for s in STOP_SIGNALS:
        signal.signal(s, _stop)


def command_began() -> None:
    """A command is running: a stop from now on cuts it short (exit 1)."""
    global _exit_code
    _exit_code = 1


def stop_is_clean() -> None:
    """Nothing this command does is cut short by a stop (exit 0): `pgq consume`
    before its graceful handlers are in place."""
    global _exit_code
    _exit_code = 0
