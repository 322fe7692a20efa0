"""Interrupts that arrive while a checkpoint and its log line are written take effect after both
(`_signals_deferred`); NumPy's overflow warnings are off while the kernels run (`_quiet_numpy`:
the loss catches overflow as X010)."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

import numpy as np


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
