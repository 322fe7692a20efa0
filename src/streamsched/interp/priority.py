"""Critical-path priorities for the kernels of a capture unit: which of two ready kernels the GPU
should start first.

A captured unit is a DAG: each stream's launches in issue order, plus an edge from the launch
before each `record e` to the launch after each `wait e` that binds to it (the graph CUDA builds
from the capture, ARCHITECTURE.md "events").  Where two streams' kernels are ready at once, the
hardware fills free SMs from both; a long compute-bound GEMM off the critical path (a weight
gradient, needed only by the optimizer at the end of the step) then takes SMs and bandwidth from
the short kernels of the critical path (the input-gradient chain dX -> dReLU -> next dX), and
the step gets longer.  CUDA lets a kernel node carry a priority (cudaLaunchAttributePriority,
honoured when the graph is instantiated with cudaGraphInstantiateFlagUseNodePriority; CUDA
Runtime API, "Graph Management"): the block scheduler then starts pending blocks of higher
priority first.

This module is the pure part: a per-task cost estimate and the slack of every task on the DAG.

    unit_dag(instrs)                      -> (task ids in issue order, {task: predecessors})
    task_cost_us(task, shapes, dtypes)    -> estimated device µs of one launch
    slack_levels(order, preds, cost, n)   -> {task: level}, 0 = most critical, n - 1 = least

The estimate is a roofline: a launch costs LAUNCH_US plus the larger of its flops at FLOP_RATE
and its bytes (each distinct buffer it reads or writes, once) at BYTE_RATE.  It only has to
rank work, not predict it: a GEMM's weight gradient is hundreds of times an elementwise kernel
either way.  Slack is the classic list-scheduling measure (the critical path method, Kelley and
Walker 1959): slack(t) = CP - (head(t) + tail(t)), head the longest path to t's start, tail the
longest from t's start to the unit's end (t's own cost included), CP the longest path in all.
Tasks with no slack are the critical path.  Nothing here imports CuPy.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from streamsched.interp.env_choice import EnvChoice

LAUNCH_US = 2.0
"""Fixed cost of one kernel in a replayed graph, µs (H200: ~1.1 µs launch, ~1 µs tail)."""
FLOP_RATE = 40e6
"""Sustained fp32 flops per µs of a large GEMM (H200 SIMT fp32: ~50 TFLOP/s measured)."""
BYTE_RATE = 2.5e6
"""Sustained bytes per µs of a memory-bound kernel (H200: ~3-4 TB/s peak)."""

_GEMM_PREFIXES = ("matmul", "gemm")

ENV = "STREAMSCHED_PRIORITIES"
PRIORITIES = EnvChoice(ENV, ("off", "slack"), "off")
"""`slack`: every captured kernel carries its task's slack level as its CUDA priority (the graphs
instantiated with cudaGraphInstantiateFlagUseNodePriority); `off` (the default, also empty):
none does.  Case and surrounding spaces are ignored; any other value is refused (X004)."""


def mode() -> str:
    """STREAMSCHED_PRIORITIES as "off" or "slack" (unset or empty: "off"); ValueError for another."""
    return PRIORITIES.get()


def unit_dag(instrs: Sequence) -> tuple[list[int], dict[int, set[int]]]:
    """The happens-before DAG of one unit's launches from its instructions (Instr records with
    op in launch/record/wait, .stream, .task, .event), in the order they are issued: stream
    order, plus record -> wait.  A wait on an event not recorded in the list binds to work
    before the unit and adds no edge.  Returns (launched task ids in issue order, task ->
    the set of its direct predecessors)."""
    last_on: dict[str, int] = {}
    pending: dict[str, set[int]] = {}  # stream -> tasks its next launch must follow (from waits)
    at_record: dict[int, int | None] = {}
    order: list[int] = []
    preds: dict[int, set[int]] = {}
    for ins in instrs:
        if ins.op == "launch":
            p = set(pending.pop(ins.stream, ()))
            if ins.stream in last_on:
                p.add(last_on[ins.stream])
            preds[ins.task] = p
            order.append(ins.task)
            last_on[ins.stream] = ins.task
        elif ins.op == "record":
            at_record[ins.event] = last_on.get(ins.stream)
        elif ins.op == "wait":
            t = at_record.get(ins.event)
            if t is not None:
                pending.setdefault(ins.stream, set()).add(t)
    return order, preds


def _gemm_flops(task, shapes: Mapping[str, tuple]) -> float:
    a, c = shapes.get(task.args[0]) if task.args else None, shapes.get(task.outs[0]) if task.outs else None
    if not a or not c:
        return 0.0
    k = a[-2] if task.attr("ta", False) and len(a) >= 2 else a[-1]
    return 2.0 * math.prod(c) * k


def task_flops(task, shapes: Mapping[str, tuple]) -> float:
    """Floating-point operations of one launch, where the kernel is a product: matmul and the
    fused GEMM epilogues (gemm_*: c = op(a) @ op(b), k = a's contracted dimension), conv2d and
    its gradients as their im2col products, attention's kernels (attn_*: q, k, v of shape [n, d],
    n = b * t, t the context) as 2 n d t per [t, t] x [t, dh] product over all sequences and
    heads: one for attn_scores, attn_apply and each attn_grad_*, two for attn_fused, five for
    attn_fused_grad (dv, dp, dk, dq and the recomputed scores); 0 for everything else (bytes
    decide those)."""
    kn = task.kernel
    try:
        if kn.startswith(_GEMM_PREFIXES):
            return _gemm_flops(task, shapes)
        if kn in ("conv2d", "conv2d_grad_x"):
            yd = shapes[task.outs[0]] if kn == "conv2d" else shapes[task.args[0]]
            return 2.0 * math.prod(yd) * math.prod(shapes[task.args[1]][:-1])
        if kn == "conv2d_grad_w":
            return 2.0 * math.prod(shapes[task.args[1]]) * math.prod(shapes[task.outs[0]][:-1])
        if kn.startswith("attn_"):
            args = [shapes[a] for a in task.args]
            nd = next(x for x in args if len(x) == 2)  # q, k, v, y or their gradients: [n, d]
            ctx = task.attr("context", None) or next(x[-1] for x in args if len(x) == 4)  # p: [b, h, t, t]
            one = 2.0 * nd[0] * nd[1] * ctx  # one [t, t] x [t, dh] product per sequence and head
            return {"attn_fused": 2, "attn_fused_grad": 5}.get(kn, 1) * one
    except (KeyError, IndexError, TypeError, StopIteration):
        return 0.0
    return 0.0


def task_cost_us(task, shapes: Mapping[str, tuple], nbytes: Mapping[str, int]) -> float:
    """Estimated device µs of one launch of `task` (module docstring: LAUNCH_US plus the larger
    of flops / FLOP_RATE and bytes / BYTE_RATE).  shapes: buffer name -> shape in elements;
    nbytes: buffer name -> size in bytes.  Unknown buffers count as empty."""
    moved = sum(nbytes.get(b, 0) for b in dict.fromkeys(tuple(task.args) + tuple(task.outs)))
    return LAUNCH_US + max(task_flops(task, shapes) / FLOP_RATE, moved / BYTE_RATE)


def slack_levels(order: Sequence[int], preds: Mapping[int, set[int]], cost: Mapping[int, float],
                 levels: int, bands: Sequence[float] = (0.02, 0.10, 0.25)) -> dict[int, int]:
    """Each task's level, 0 for the most critical: its slack as a fraction of the critical path
    CP, cut at `bands` (slack <= 2 % of CP -> 0, <= 10 % -> 1, <= 25 % -> 2, else 3), capped at
    `levels` - 1.  order: the tasks in a topological order (issue order is one); preds: each
    task's direct predecessors; cost: µs per task.  Raises ValueError if `order` is not
    topological for `preds` (a predecessor after its successor, or outside `order`)."""
    if levels < 1:
        raise ValueError("slack_levels needs at least one level")
    pos = {t: i for i, t in enumerate(order)}
    head: dict[int, float] = {}
    succs: dict[int, list[int]] = {t: [] for t in order}
    for t in order:
        h = 0.0
        for p in preds.get(t, ()):
            if pos.get(p, len(order)) >= pos[t]:
                raise ValueError(f"task {p} precedes task {t} but is not before it in the order")
            h = max(h, head[p] + cost[p])
            succs[p].append(t)
        head[t] = h
    tail: dict[int, float] = {}
    for t in reversed(order):
        tail[t] = cost[t] + max((tail[s] for s in succs[t]), default=0.0)
    cp = max((head[t] + tail[t] for t in order), default=0.0)
    out: dict[int, int] = {}
    for t in order:
        frac = (cp - head[t] - tail[t]) / cp if cp > 0 else 0.0
        lv = next((i for i, b in enumerate(bands) if frac <= b + 1e-12), len(bands))
        out[t] = min(lv, levels - 1)
    return out
