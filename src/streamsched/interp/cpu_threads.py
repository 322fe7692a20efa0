"""How many BLAS threads a run uses: never more than the cores this process may run on, and by
default only as many as its matrix products can keep busy, so that a busy machine does not turn
NumPy's spinning worker threads into a slowdown of 3x to 50x.

The rule (docs/performance.md, "The CPU backend on a busy machine")::

    usable   = len(os.sched_getaffinity(0)), lowered to ceil(quota / period) of the cgroup's
               cpu.max (v2) or cpu.cfs_quota_us / cpu.cfs_period_us (v1) when one is set
    auto     = clamp(largest_product_flops // FLOPS_PER_THREAD, 1, usable)
    --threads N:   min(N, usable)

where largest_product_flops is 2*m*n*k of the largest matrix product a step runs (matmul, and
the im2col products of conv2d and its gradients).  Why: the CPU backend issues one small kernel
at a time from one Python thread; OpenBLAS's worker threads spin between calls and wait on each
other at every call, which is nearly free on an idle machine and ruinous when other processes
hold the cores (mlp_digits: 1.2 s with one thread whether idle or not; 3 to 6 s with two threads
when two other processes run, see benchmarks/cpu_busy.py).  A product of 2^27 flops (128 x 1024
x 512) is about where a second thread pays for itself.  The count depends on the machine and the
program, never on the load, so a run's numbers do not change with what else the machine does
(BLAS results depend on the thread count).
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from typing import Iterator

FLOPS_PER_THREAD = 2**27


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, lowered by a cgroup CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        n = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def _cgroup_quota() -> float | None:
    """The cgroup's CPU quota in cores, None when there is none (or no cgroup file to read)."""
    for path in ("/sys/fs/cgroup/cpu.max",):
        try:
            with open(path, encoding="ascii") as f:
                quota, period = f.read().split()[:2]
            if quota != "max" and float(period) > 0:
                return float(quota) / float(period)
            return None
        except (OSError, ValueError):
            pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", encoding="ascii") as f:
            quota = float(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us", encoding="ascii") as f:
            period = float(f.read())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def largest_product_flops(schedule) -> int:
    """2*m*n*k of the largest matrix product among the schedule's tasks (0 when there is none):
    matmul (c = op(a) @ op(b): m*n = c's size, k = a's contracted dimension), and conv2d,
    conv2d_grad_x and conv2d_grad_w as the im2col products they compute ([n*oh*ow, kh*kw*c] by
    [kh*kw*c, k])."""
    shapes = {b.name: tuple(b.shape) for b in schedule.buffers}
    best = 0
    for t in schedule.tasks:
        try:
            if t.kernel == "matmul":
                a, c = shapes[t.args[0]], shapes[t.outs[0]]
                k = a[-2] if t.attr("ta", False) else a[-1]
                flops = 2 * math.prod(c) * k
            elif t.kernel in ("conv2d", "conv2d_grad_x"):
                y_or_dy, w = (shapes[t.outs[0]], shapes[t.args[1]]) if t.kernel == "conv2d" else \
                    (shapes[t.args[0]], shapes[t.args[1]])
                flops = 2 * math.prod(y_or_dy) * math.prod(w[:-1])
            elif t.kernel == "conv2d_grad_w":
                dy, dw = shapes[t.args[1]], shapes[t.outs[0]]
                flops = 2 * math.prod(dy) * math.prod(dw[:-1])
            else:
                continue
        except (KeyError, IndexError, TypeError):
            continue
        best = max(best, int(flops))
    return best


def choose_threads(requested: int | None, schedule) -> tuple[int, str]:
    """(BLAS threads for the run, a note for the user or ""): `requested` (from --threads) capped
    at usable_cores(), else the automatic rule of the module docstring."""
    usable = usable_cores()
    auto = max(1, min(usable, largest_product_flops(schedule) // FLOPS_PER_THREAD))
    if requested is not None:
        n = max(1, min(int(requested), usable))
        notes = []
        if requested > usable:
            notes.append(f"--threads {requested}: this process may use {usable} core{'s' if usable != 1 else ''}; "
                         f"using {n} BLAS thread{'s' if n != 1 else ''}")
        if n > auto:
            notes.append(f"{'' if notes else f'--threads {requested}: '}more BLAS threads than the {auto} this program's "
                         "matrix products can keep busy: the threads wait on each other at every product, which "
                         "is slower, and many times slower when other processes share the cores "
                         "(docs/performance.md)")
        return n, "; ".join(notes)
    return auto, ""


@contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """Limit NumPy's BLAS to n threads for the block (threadpoolctl), restoring it after; a no-op
    where threadpoolctl is missing."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover
        yield
        return
    with threadpool_limits(limits=int(n), user_api="blas"):
        yield
