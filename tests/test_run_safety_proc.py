"""What only a real process shows: SIGINT and SIGTERM end a run with its checkpoint, its log and
the exact command that resumes it (and that command works); a second process on the same
checkpoint or log is refused with X009 naming the first one's pid; SIGKILL leaves a checkpoint
that resumes and a lock the next run takes over."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from safety_helpers import project

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))


def _start(cwd, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "streamsched", *map(str, args)], cwd=cwd, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_epoch(p: subprocess.Popen, n: int, timeout: float = 60) -> list[str]:
    """Read stderr until the line of epoch n: the run has saved n epochs."""
    lines = []
    t = time.time()
    while time.time() - t < timeout:
        line = p.stderr.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(f"epoch {n}/"):
            return lines
    p.kill()
    pytest.fail("no epoch line: " + "".join(lines))


def _run(cwd, *args, timeout=120) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "streamsched", *map(str, args)], cwd=cwd, env=ENV,
                       capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    return p


LONG = ("run", "tiny.sched", "--backend", "cpu", "--epochs", "100000", "--save", "ck.npz", "--log", "run.jsonl")


@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_prints_the_resume_command_and_it_resumes(tmp_path, sig, status):
    project(tmp_path)
    p = _start(tmp_path, *LONG)
    _wait_for_epoch(p, 2)
    # a second run on the same checkpoint and log, while the first holds them
    other = _run(tmp_path, "run", "tiny.sched", "--backend", "cpu", "-q", "--save", "ck.npz")
    assert other.returncode == 1 and "error[X009]" in other.stderr and f"pid {p.pid}" in other.stderr
    other = _run(tmp_path, "run", "tiny.sched", "--backend", "cpu", "-q", "--log", "run.jsonl")
    assert other.returncode == 1 and "error[X009]" in other.stderr and f"pid {p.pid}" in other.stderr
    p.send_signal(sig)
    err = p.stderr.read()
    assert p.wait(timeout=60) == status
    assert "Traceback" not in err, err
    assert f"interrupted by {sig.name} in epoch" in err
    lines = err.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.endswith("; resume with:"))
    held = int(lines[i].split("holds epoch ")[1].split(";")[0])
    cmd = shlex.split(lines[i + 1])
    assert cmd[:2] == ["streamsched", "run"] and cmd[-2:] == ["--resume", "ck.npz"]
    assert cmd[2:-2] == list(LONG[1:])
    recs = [json.loads(ln) for ln in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert recs[-1]["epoch"] >= held and not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    # the printed command resumes (a few epochs more, for the test's sake)
    cmd[cmd.index("--epochs") + 1] = str(held + 2)
    again = _run(tmp_path, *cmd[1:], "-q")
    assert again.returncode == 0, again.stderr
    assert f"resumed from `ck.npz` after epoch {held}" in again.stderr and f"epoch {held + 2}:" in again.stdout


def test_sigkill_leaves_a_checkpoint_that_resumes_and_a_lock_that_is_taken_over(tmp_path):
    project(tmp_path)
    p = _start(tmp_path, *LONG)
    _wait_for_epoch(p, 2)
    p.kill()
    p.wait(timeout=60)
    assert (tmp_path / ".ck.npz.streamsched-lock").exists()  # left behind, but no longer held
    again = _run(tmp_path, "run", "tiny.sched", "--backend", "cpu", "-q", "--resume", "ck.npz", "--save", "ck.npz",
                 "--epochs", "3", "--log", "run.jsonl")
    assert again.returncode == 0 and "resumed from `ck.npz`" in again.stderr, again.stderr
    assert not (tmp_path / ".ck.npz.streamsched-lock").exists()
