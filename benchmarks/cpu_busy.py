"""How the CPU backend fares on a busy machine: times `streamsched run examples/mlp_digits.sched
--backend cpu` (its training wall time, as the run reports it) on an idle machine, then while
another process keeps every core this process may use busy, and prints the ratio (the target:
at most 1.5x; with one core's worth of fair share taken by each busy worker, about 1.5x is the
floor for a single-threaded run).

    python benchmarks/cpu_busy.py                 # the default BLAS threads (cpu_threads' rule)
    python benchmarks/cpu_busy.py --threads 2     # what two BLAS threads do on the same machine
    python benchmarks/cpu_busy.py --repeat 3      # best of three for each

    python benchmarks/cpu_busy.py --same-session  # the busy process in the run's own session

Measure on a quiet machine: other users' work counts as "idle" load here.  Where the kernel's
autogroup scheduling is on (/proc/sys/kernel/sched_autogroup_enabled), each session gets its share
of the cores: by default the busy process is started in a session of its own, like another user's
job; `--same-session` puts it in the run's session, where the run competes with every busy worker
directly (3 runnable threads on 2 cores: a single-threaded run gets 2/3 of a core, 1.5x at best).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spin(stop) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


def _busy_process(cores: int, stop, own_session: bool) -> None:
    """One process that keeps `cores` cores busy (one spinning worker per core) until `stop`, in
    a session of its own (as another user's job would be) unless own_session is False."""
    if own_session:
        os.setsid()
    workers = [mp.Process(target=_spin, args=(stop,)) for _ in range(cores)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def train_seconds(args) -> tuple[float, str]:
    """The training time the run reports (`cpu: N steps in S s`) and its summary line."""
    cmd = [sys.executable, "-m", "streamsched", "run", os.path.join(ROOT, "examples", "mlp_digits.sched"),
           "--backend", "cpu", "-q", "--epochs", str(args.epochs)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"the run failed ({p.returncode}):\n{p.stderr}")
    m = re.search(r"steps in ([0-9.]+) s", p.stdout)
    return float(m.group(1)), p.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--threads", type=int, help="pass --threads to the run (default: its own rule)")
    ap.add_argument("--repeat", type=int, default=1, help="best of N for each condition")
    ap.add_argument("--same-session", action="store_true",
                    help="start the busy process in this session (Linux's autogroup scheduling then shares "
                         "one group's time among it and the run, instead of giving each session its share)")
    args = ap.parse_args()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    idle = min(train_seconds(args)[0] for _ in range(args.repeat))
    busy_times = []
    for _ in range(args.repeat):
        stop = mp.Event()
        hog = mp.Process(target=_busy_process, args=(cores, stop, not args.same_session))
        hog.start()
        time.sleep(0.5)  # let the workers take the cores
        try:
            busy_times.append(train_seconds(args)[0])
        finally:
            stop.set()
            hog.join()
    busy = min(busy_times)
    print(f"mlp_digits, {args.epochs} epochs, --threads {args.threads or 'default'}, {cores} usable cores, busy "
          f"process in {'this' if args.same_session else 'its own'} session")
    print(f"idle: {idle:.2f} s   busy ({cores} cores kept busy by another process): {busy:.2f} s   "
          f"ratio {busy / idle:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
    main()
