"""Interrupts that arrive while a checkpoint and its log line are written take effect after both
(`_signals_deferred`); NumPy's overflow warnings are off while the kernels run (`_quiet_numpy`:
the loss catches overflow as X010)."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

import numpy as np


class SignalInterrupt(KeyboardInterrupt):
    """An interrupt by signal `signum` (SIGINT, SIGTERM or SIGHUP) that `raise_if_swallowed`
    raised again: the run ends on it as on the CLI's own (cli.Terminated, also with `signum`)."""

    def __init__(self, signum: int | None = None):
        super().__init__()
        self.signum = int(signal.SIGTERM if signum is None else signum)


_CAUGHT: list[int] = []
"""The terminating signals the CLI's handlers raised an interrupt for in this command, in order."""


def note_caught(signum: int) -> None:
    """Record that a handler is about to raise the interrupt for `signum` (`raise_if_swallowed`)."""
    _CAUGHT.append(int(signum))


def clear_caught() -> None:
    """Forget the recorded signals (a command's start and end: `cli.main` runs many in a process)."""
    _CAUGHT.clear()


def raise_if_swallowed() -> None:
    """Raise SignalInterrupt for a signal whose interrupt was raised but never reached the run.

    CPython runs a Python signal handler in the main thread at the next bytecode boundary,
    wherever that is.  When it is inside a `__del__` method or a weakref or GC callback, the
    interpreter prints "Exception ignored in ..." and goes on, and the interrupt is lost
    (tests/test_run_signals_swallowed.py makes it happen).  The training loop calls this after
    every step and launch, so such a signal still ends the run, one step late at most.  A no-op
    when nothing was recorded."""
    if _CAUGHT:
        raise SignalInterrupt(_CAUGHT[0])


_DEFERRED = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


@contextmanager
def _signals_deferred():
    """SIGINT and SIGTERM that arrive during the block take effect when it is done (their handlers
    are swapped for ones that only note them, then restored and called).  Blocking the signals
    in the kernel would not do: another thread (BLAS's) would take them, and Python would run the
    handler in the main thread inside the block all the same.  A no-op outside the main thread."""
    got: list[int] = []
    old = {}
    try:
        for sig in _DEFERRED:
            old[sig] = signal.signal(sig, lambda signum, frame: got.append(signum))
    except ValueError:  # not the main thread
        for sig, h in old.items():
            signal.signal(sig, h)
        yield
        return
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        if got:
            h = old[got[0]]
            if callable(h):
                h(got[0], None)
            elif h == signal.SIG_DFL:
                os.kill(os.getpid(), got[0])


@contextmanager
def _quiet_numpy():
    """Overflow and NaN in the kernels are caught as X010, by the loss: no NumPy warnings."""
    old = np.seterr(over="ignore", invalid="ignore", divide="ignore")
    try:
        yield
    finally:
        np.seterr(**old)
