"""A stream timeline of a few training steps on the GPU: a CUDA event pair around every task,
written as a Chrome / Perfetto trace (one track per stream, events named by task label) and,
optionally, as a matplotlib picture (one lane per stream).

    trace(compiled, out_json, png=None, steps=3)       (`streamsched trace FILE -o trace.json
                                                        [--png timeline.png]`)

The steps run eagerly (capture none), whatever the file's capture mode, with timing-enabled
events (only here: the executor's own events have timing off).  By default each traced step is
issued behind a *gate*: a sleep kernel on a private stream that every stream of the step waits
on, long enough for the host to issue the whole step.  The device then runs the step as fast
as its dependencies allow, as it does when the step is a captured graph, so the picture shows
the concurrency the schedule permits rather than the host's issue rate (`gate=False` shows the
eager reality: kernels spaced by Python's launch cost).  Timestamps are microseconds from the
opening of the gate (from the step's first instruction without a gate).

The pure parts (`chrome_trace`, `plot_timeline`, `summarize`) take plain records and need no GPU.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Iterable, Sequence

__all__ = ["trace", "chrome_trace", "plot_timeline", "summarize", "short_label", "category"]

_GATE_SRC = r"""
extern "C" __global__ void ss_trace_gate(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""

_FORK = re.compile(r"linear\.backward@(\S+)\.(dw|db|dx)(?: \+\w+)*$")  # a fused task: " +relu_grad"

# colour per kernel category
COLOURS = {
    "gemm": "#4e79a7", "reduce": "#f28e2b", "elementwise": "#59a14f", "copy": "#9c755f",
    "optimizer": "#e15759", "fill": "#bab0ac", "loss": "#b07aa1", "other": "#76b7b2",
}


def category(kernel: str) -> str:
    if kernel == "matmul" or kernel.startswith("gemm_"):
        return "gemm"
    if kernel in ("sum", "mean"):
        return "reduce"
    if kernel in ("h2d", "d2h", "copy"):
        return "copy"
    if kernel in ("sgd_step", "adam_step", "increment", "multi_tensor"):
        return "optimizer"
    if kernel in ("fill", "alloc"):
        return "fill"
    if kernel.startswith("softmax_xent"):
        return "loss"
    if kernel in ("add", "sub", "mul", "scale", "bias_add", "accumulate", "relu", "relu_grad", "tanh",
                  "tanh_grad", "gelu", "gelu_grad", "sigmoid", "sigmoid_grad"):
        return "elementwise"
    return "other"


def short_label(label: str, kernel: str = "") -> str:
    """A bar's text: 'pass[b]: linear.backward@logits.dw' -> 'logits.dw', 'pass[b]: linear@h1'
    -> 'matmul h1', 'optimize: sgd@h1.w.w' -> 'sgd_step h1.w.w'; the kernel name without a label."""
    if not label:
        return kernel
    body = label.split(": ", 1)[-1]
    m = _FORK.search(body)
    if m:
        return f"{m.group(1)}.{m.group(2)}"
    _, _, rest = body.partition("@")
    return f"{kernel} {rest}" if rest else body


# -- pure parts -------------------------------------------------------------------------------

def chrome_trace(records: Sequence[dict], streams: Sequence[str], host_records: Sequence[dict] = (),
                 meta: dict | None = None, gap_us: float = 20.0) -> dict:
    """A Chrome / Perfetto trace ("traceEvents") of `records` (dicts with step, stream, label,
    kernel, start_us, end_us; times relative to the step's start).  Steps are laid one after
    another on the time axis, `gap_us` apart; one track (tid) per stream in `streams` order,
    process 0 "device"; host_records (host clock, same keys) go to process 1 "host (issue)"."""
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "device streams (CUDA events)"}},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "host (issue, host clock)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 0, "args": {"name": "host"}},
    ]
    order = list(streams)
    for r in records:
        if r["stream"] not in order:
            order.append(r["stream"])
    for i, s in enumerate(order):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": s}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": i, "args": {"sort_index": i}})
    offsets = _step_offsets(records, gap_us)
    for r in records:
        off = offsets.get(r["step"], 0.0)
        events.append({
            "ph": "X", "pid": 0, "tid": order.index(r["stream"]), "name": r["label"] or r["kernel"],
            "cat": category(r["kernel"]), "ts": round(off + r["start_us"], 3),
            "dur": round(max(r["end_us"] - r["start_us"], 0.0), 3),
            "args": {"step": r["step"], "kernel": r["kernel"], "task": r.get("task", -1),
                     "stream": r["stream"]},
        })
    host_off = _step_offsets(host_records, gap_us)
    for r in host_records:
        off = host_off.get(r["step"], 0.0)
        events.append({"ph": "X", "pid": 1, "tid": 0, "name": r["label"] or r["kernel"], "cat": "host",
                       "ts": round(off + r["start_us"], 3), "dur": round(max(r["end_us"] - r["start_us"], 0.0), 3),
                       "args": {"step": r["step"], "kernel": r["kernel"]}})
    out = {"traceEvents": events, "displayTimeUnit": "ns"}
    if meta:
        out["otherData"] = meta
    return out


def _step_offsets(records: Iterable[dict], gap_us: float) -> dict[int, float]:
    spans: dict[int, float] = {}
    for r in records:
        spans[r["step"]] = max(spans.get(r["step"], 0.0), r["end_us"])
    offsets, t = {}, 0.0
    for k in sorted(spans):
        offsets[k] = t
        t += spans[k] + gap_us
    return offsets


def summarize(records: Sequence[dict]) -> dict:
    """Per step: span (first start to last end), busy time per stream, and for every linear
    backward fork (dw / db / dx of one layer) how long each pair ran at the same time."""
    out: dict[str, Any] = {"steps": {}}
    by_step: dict[int, list[dict]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)
    for k, rs in sorted(by_step.items()):
        span = max(r["end_us"] for r in rs) - min(r["start_us"] for r in rs)
        busy: dict[str, float] = {}
        for r in rs:
            busy[r["stream"]] = busy.get(r["stream"], 0.0) + max(r["end_us"] - r["start_us"], 0.0)
        forks: dict[str, dict[str, float]] = {}
        parts: dict[str, dict[str, dict]] = {}
        for r in rs:
            m = _FORK.search(r["label"] or "")
            if m:
                parts.setdefault(m.group(1), {})[m.group(2)] = r
        for layer, p in parts.items():
            names = sorted(p)
            ov = {}
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    lo = max(p[a]["start_us"], p[b]["start_us"])
                    hi = min(p[a]["end_us"], p[b]["end_us"])
                    ov[f"{a}|{b}"] = round(max(0.0, hi - lo), 3)
            forks[layer] = ov
        out["steps"][str(k)] = {"span_us": round(span, 3), "tasks": len(rs),
                                "busy_us": {s: round(v, 3) for s, v in busy.items()},
                                "fork_overlap_us": forks}
    return out


def plot_timeline(records: Sequence[dict], streams: Sequence[str], png: str, *, step: int | None = None,
                  title: str | None = None) -> str:
    """Draw one step of `records` (default: the last) as a timeline, one lane per stream, bars
    coloured by kernel category and labelled with the task; each linear backward's dW / dB / dX
    window is shaded across the lanes.  Returns `png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not records:
        raise ValueError("no records to draw")
    if step is None:
        step = max(r["step"] for r in records)
    rs = [r for r in records if r["step"] == step]
    order = [s for s in streams if any(r["stream"] == s for r in rs)]
    for r in rs:
        if r["stream"] not in order:
            order.append(r["stream"])
    lane = {s: i for i, s in enumerate(order)}
    t_end = max(r["end_us"] for r in rs)
    t0 = min(r["start_us"] for r in rs)
    width = t_end - t0 if t_end > t0 else 1.0
    fig_h = 1.0 + 0.9 * len(order)
    fig, ax = plt.subplots(figsize=(16, fig_h))
    # fork windows
    parts: dict[str, list[dict]] = {}
    for r in rs:
        m = _FORK.search(r["label"] or "")
        if m:
            parts.setdefault(m.group(1), []).append(r)
    for layer, ps in parts.items():
        lo = min(p["start_us"] for p in ps)
        hi = max(p["end_us"] for p in ps)
        ax.axvspan(lo, hi, color="#ffe9a8", alpha=0.45, zorder=0)
        ax.text((lo + hi) / 2, len(order) - 0.35, f"{layer} backward", ha="center", va="bottom",
                fontsize=8, color="#7a5c00")
    for r in rs:
        y = len(order) - 1 - lane[r["stream"]]
        dur = max(r["end_us"] - r["start_us"], width * 0.0015)
        fork = _FORK.search(r["label"] or "")
        ax.broken_barh([(r["start_us"], dur)], (y - 0.38, 0.76), facecolors=COLOURS[category(r["kernel"])],
                       edgecolors="black" if fork else "none", linewidth=1.2 if fork else 0, zorder=2)
        text = short_label(r["label"], r["kernel"])
        if fork or dur >= width * 0.035:
            ax.text(r["start_us"] + dur / 2, y, text, ha="center", va="center", fontsize=7,
                    rotation=90 if dur < width * 0.035 else 0, zorder=3,
                    color="black")
    ax.set_yticks([len(order) - 1 - i for i in range(len(order))])
    ax.set_yticklabels(order)
    ax.set_ylim(-0.6, len(order) - 0.1 + 0.5)
    ax.set_xlim(t0 - width * 0.01, t_end + width * 0.01)
    ax.set_xlabel("microseconds from the start of the step")
    ax.grid(axis="x", alpha=0.3)
    used = sorted({category(r["kernel"]) for r in rs})
    ax.legend(handles=[Patch(color=COLOURS[c], label=c) for c in used]
              + [Patch(facecolor="#ffe9a8", alpha=0.45, label="linear backward\n(dW | dB | dX)")],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, framealpha=0.9)
    ax.set_title(title or f"step {step}")
    fig.tight_layout()
    fig.savefig(png, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return png


# -- the GPU part ----------------------------------------------------------------------------

def trace(compiled, out_json: str, png: str | None = None, steps: int = 3, *, gate: bool = True,
          lr: float = 0.01, seed: int = 0, title: str | None = None) -> dict:
    """Run the prologue, two untimed warm-up steps and `steps` traced steps of `compiled` eagerly
    on the GPU, an event pair around every task; write the Chrome trace to `out_json` and, if
    `png`, the last traced step's timeline.  Data are random (fixed seed), the learning rate
    constant.  Returns {"records", "host_records", "summary", "gate_us"}."""
    import numpy as np

    from streamsched.interp.barriers import plan_segment, steady_step
    from streamsched.interp.cuda.executor import CudaExecutor, Program
    from streamsched.interp.train import init_params

    if compiled.plan is None:
        raise ValueError("the program has no event plan (it does not check)")
    if steps < 1:
        raise ValueError("steps must be at least 1")
    sched, plan, program = compiled.schedule, compiled.plan, compiled.program
    ex = CudaExecutor(sched, plan, capture="none")
    cp = ex.cp
    try:
        if program.model is not None:
            for n, v in init_params(program, seed).items():
                ex.set(n, v)
            classes = dict((b.name, b.shape) for b in program.buffers)[program.model.logits][-1]
        else:
            classes = 2
        def segment(k: int):
            try:
                return plan_segment(plan, steady_step(plan, k))
            except ValueError:  # no steady state past the unrolled steps: stay inside them
                n, p = sched.steps, max(1, sched.period)
                return plan_segment(plan, k if k < n else n - p + (k - n) % p)

        cur = {"k": -1}
        host_records: list[dict] = []
        host_t0 = {"t": 0.0}

        def host_fn(task, arrays):
            a = time.perf_counter()
            out = arrays[task.outs[0]]
            if task.kernel == "stage":
                j = cur["k"] + int(task.attr("ahead", 0))
                g = np.random.default_rng([seed, max(j, 0), 1 if np.issubdtype(out.dtype, np.integer) else 0])
                if np.issubdtype(out.dtype, np.integer):
                    out[...] = g.integers(0, classes, out.shape)
                else:
                    out[...] = g.standard_normal(out.shape)
            elif task.kernel == "set_scalar":
                out[...] = lr if task.attr("name") == "lr" else float(max(cur["k"], 0) + 1)
            b = time.perf_counter()
            if cur.get("timed"):
                host_records.append({"step": cur["k"] - 1, "stream": "host", "label": task.label,
                                     "kernel": task.kernel, "task": task.id,
                                     "start_us": (a - host_t0["t"]) * 1e6, "end_us": (b - host_t0["t"]) * 1e6})

        ex.run(plan_segment(plan, -1), host_fn)
        ex.synchronize()
        # two warm-up steps: the first compiles every kernel, the second's issue time sizes
        # the gate
        cur["k"] = 0
        ex.run(segment(0), host_fn)
        ex.synchronize()
        cur["k"] = 1
        a = time.perf_counter()
        ex.run(segment(1), host_fn)
        issue = time.perf_counter() - a
        ex.synchronize()

        gate_stream = cp.cuda.Stream(non_blocking=True)
        gate_kernel = cp.RawKernel(_GATE_SRC, "ss_trace_gate")
        # the timed step issues three times as many operations (two records per task)
        gate_ns = int(min(max(3 * issue * 1e9 + 500_000, 1_000_000), 200_000_000))
        with gate_stream:
            gate_kernel((1,), (1,), (np.uint64(1000),))  # compile and load before timing
        gate_stream.synchronize()

        records: list[dict] = []
        for i in range(1, steps + 1):  # traced step i is loop step k = i + 1
            k = i + 1
            cur["k"] = k
            prog = ex.compile(segment(k))
            ops, pairs = [], []
            for kind, x, y in prog.ops:
                if kind == "launch":
                    st = ex.ctx.streams[x.task.stream]
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    ops += [("record", e0, st), (kind, x, y), ("record", e1, st)]
                    pairs.append((x.task, e0, e1))
                else:
                    ops.append((kind, x, y))
            timed = Program(ops, prog.n_instrs)
            ref = cp.cuda.Event()
            ex.synchronize()
            if gate:
                with gate_stream:
                    gate_kernel((1,), (1,), (np.uint64(gate_ns),))
                ref.record(gate_stream)
                for st in ex.ctx.streams.values():
                    st.wait_event(ref)
            else:
                ref.record(ex.ctx.streams[ex.ctx.names[0]])
            cur["timed"] = True
            host_t0["t"] = time.perf_counter()
            ex.run(timed, host_fn)
            cur["timed"] = False
            ex.synchronize()
            gate_stream.synchronize()
            for task, e0, e1 in pairs:
                records.append({
                    "step": i, "stream": task.stream, "label": task.label, "kernel": task.kernel,
                    "task": task.id,
                    "start_us": round(cp.cuda.get_elapsed_time(ref, e0) * 1e3, 3),
                    "end_us": round(cp.cuda.get_elapsed_time(ref, e1) * 1e3, 3),
                })
        streams = [s for s in sched.streams if s != "host"]
        summary = summarize(records)
        meta = {"gate": gate, "gate_us": gate_ns / 1e3 if gate else 0.0, "steps": steps,
                "capture_of_file": sched.capture, "note": "times in microseconds from the step's "
                "gate opening; eager launches with an event pair around every task"}
        with open(out_json, "w", encoding="utf-8") as f:
            json.dump(chrome_trace(records, streams, host_records, meta={**meta, "summary": summary}), f)
        if png:
            name = program.model.name if program.model is not None else "program"
            plot_timeline(records, streams, png, title=title or (
                f"{name}: step {steps} on {len(streams)} streams "
                f"({'gated issue: device-side concurrency' if gate else 'eager issue'})"))
        return {"records": records, "host_records": host_records, "summary": summary,
                "gate_us": meta["gate_us"]}
    finally:
        ex.close()
