"""A signal whose interrupt CPython swallows still ends the run (interp/training/signals.py
`raise_if_swallowed`).  CPython runs a Python signal handler at the next bytecode boundary of the
main thread; when that falls inside a `__del__`, the handler's KeyboardInterrupt is printed as
"Exception ignored in ..." and lost.  The test makes that happen on purpose, in a real process: in the third epoch an object is dropped whose
`__del__` sends the signal to its own process and sleeps, so the handler runs (and raises)
inside `__del__`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from safety_helpers import project

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))

DRIVER = r"""
import os, signal, sys, time
from streamsched import cli
from streamsched.interp.training import loop

SIG = getattr(signal, sys.argv[1])
real = loop.Run.after_step


class Bomb:
    def __del__(self):
        os.kill(os.getpid(), SIG)
        time.sleep(0.2)  # interrupted by the signal: its handler runs here, inside __del__


def after_step(self, k):
    real(self, k)
    if k == 9:  # in epoch 3 (4 steps an epoch): two epochs saved
        Bomb()  # dropped at once: __del__ runs now


loop.Run.after_step = after_step
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
@pytest.mark.parametrize("sig,status", [("SIGHUP", 129), ("SIGTERM", 143), ("SIGINT", 130)])
def test_an_interrupt_swallowed_by_a_del_still_ends_the_run(tmp_path, sig, status):
    project(tmp_path)
    p = subprocess.run([sys.executable, "-c", DRIVER, sig, "run", "tiny.sched", "--backend", "cpu", "--epochs", "400",
                        "--save", "ck.npz"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # even under nohup
    assert "Exception ignored in" in p.stderr  # the interrupt was swallowed, as the test means it to be
    assert p.returncode == status, p.stderr[-2000:]
    assert f"interrupted by {sig} in epoch" in p.stderr and "resume with:" in p.stderr
    assert "epoch 400/" not in p.stderr  # ended at once, not after its 400 epochs
