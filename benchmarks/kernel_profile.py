"""Per-kernel device time of a training step, from CUPTI through torch.profiler: what a
timeline shows, as a table, for streamsched's variants and PyTorch's alike.

    kernel_profile(step, steps, path, label)   -> the table (also written to `path` as JSON)

`step()` issues one training step (a graph replay, or streamsched's executor running one step
program); it is called `steps` times inside `torch.profiler.profile(activities=[CUDA])`, with
the device synchronized before and after.  CUPTI records every kernel the process launches on
the device, whatever issued it (CuPy, cuBLAS, cuBLASLt, Triton, a CUDA graph's kernel nodes),
so one table format serves both frameworks.  The table: per kernel name, launches per step,
device µs per step (the sum of its launches' durations over the steps, divided by `steps`) and
mean µs per launch; sorted by time.  Kernel durations overlap when streams run concurrently, so
the sum is the device's busy time, not the step time; `busy_us_per_step` says it, and
`span_us_per_step` (first start to last end over the steps, divided by `steps`) is the
profiled step time, which the profiler's own overhead lengthens a little.

Used by `benchmarks/step_time.py --profile-dir DIR` (the environment variable
`SS_BENCH_PROFILE_DIR` carries it into the peer processes).  Needs torch with CUDA; the GPU
machine has it.
"""

from __future__ import annotations

import json
import os
import tempfile

ENV = "SS_BENCH_PROFILE_DIR"


def profile_dir() -> str:
    """The folder the variants write their tables to ('' when profiling is off)."""
    return os.environ.get(ENV, "")


def kernel_table(events: list[dict], steps: int) -> dict:
    """The table of `kernel_profile` from Chrome-trace events (dicts with cat, name, ts, dur in
    µs); only events of category "kernel" count.  Pure: no GPU needed."""
    ks = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    by: dict[str, list[float]] = {}
    for e in ks:
        by.setdefault(e["name"], []).append(float(e["dur"]))
    rows = sorted(({"kernel": n, "launches_per_step": round(len(d) / steps, 2),
                    "us_per_step": round(sum(d) / steps, 2), "us_per_launch": round(sum(d) / len(d), 2)}
                   for n, d in by.items()), key=lambda r: -r["us_per_step"])
    span = (max(e["ts"] + e["dur"] for e in ks) - min(e["ts"] for e in ks)) / steps if ks else 0.0
    return {"steps": steps, "kernels_per_step": round(len(ks) / steps, 2),
            "busy_us_per_step": round(sum(r["us_per_step"] for r in rows), 2),
            "span_us_per_step": round(span, 2), "kernels": rows}


def timeline(events: list[dict], steps: int, keep: int = 2) -> list[list]:
    """The kernels of the last `keep` of `steps` profiled steps, in start order, as
    [start µs from the first of them, duration µs, stream, name] rows: what a timeline shows,
    small enough to commit.  The steps are cut by count (kernels per step = total / steps), so
    they are whole steps when every step launches the same kernels.  Pure: no GPU needed."""
    ks = sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: float(e["ts"]))
    if not ks or steps <= 0:
        return []
    per = len(ks) // steps
    tail = ks[len(ks) - per * min(keep, steps):]
    t0 = float(tail[0]["ts"])
    return [[round(float(e["ts"]) - t0, 2), round(float(e["dur"]), 2),
             (e.get("args") or {}).get("stream", e.get("tid")), e["name"][:80]] for e in tail]


def kernel_profile(step, steps: int, path: str, label: str = "") -> dict:
    """Profile `steps` calls of `step()` (module docstring); write the table to `path` (JSON,
    with `label`) and return it.  Raises ImportError without torch."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        with open(tmp, encoding="utf-8") as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(tmp)
    table = dict(kernel_table(events, steps), label=label, timeline=timeline(events, steps))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1)
    return table
