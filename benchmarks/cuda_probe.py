"""Time the CUDA backend on one linear layer's backward (dW, dB, dX), MLP-sized (batch 128,
1024 -> 1024, fp32): eager vs captured, three forked streams vs one stream.

    python benchmarks/cuda_probe.py [--iters 500] [--json out.json]

Prints microseconds per backward (wall time over many back-to-back runs, one sync at the end)
and the host time spent issuing one run.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from streamsched.interp.ir import HOST, Buffer, EventPlan, Instr, Schedule, Task, Unit
from streamsched.interp.memory import plan_memory

I = Instr


def linear_backward(n: int, k: int, m: int, forked: bool, capture: str):
    bufs = plan_memory((
        Buffer("x", (n, k), "f32"), Buffer("w", (k, m), "f32"), Buffer("dy", (n, m), "f32"),
        Buffer("dw", (k, m), "f32"), Buffer("db", (m,), "f32"), Buffer("dx", (n, k), "f32"),
    ))
    s1, s2, s3 = ("comp1", "comp2", "comp3") if forked else ("comp3",) * 3
    tasks = (
        Task(0, "matmul", s1, ("x", "dy"), ("dw",), (("ta", True),), unit=0),
        Task(1, "sum", s2, ("dy",), ("db",), (("axis", 0),), unit=0),
        Task(2, "matmul", s3, ("dy", "w"), ("dx",), (("tb", True),), unit=0),
    )
    sched = Schedule(("comp1", "comp2", "comp3", HOST), bufs, tasks,
                     (Unit(0, "bwd", "bwd", "comp3"),), capture=capture)
    if forked:
        body = (I("record", "comp3", event=0), I("wait", "comp1", event=0),
                I("wait", "comp2", event=0),
                I("launch", "comp1", task=0), I("launch", "comp2", task=1),
                I("launch", "comp3", task=2),
                I("record", "comp1", event=1), I("record", "comp2", event=2),
                I("wait", "comp3", event=1), I("wait", "comp3", event=2))
    else:
        body = tuple(I("launch", "comp3", task=i) for i in range(3))
    instrs = (I("begin", "comp3", unit=0),) + body + (I("end", "comp3", unit=0),)
    return sched, EventPlan(sched, instrs, 3)


def measure(n, k, m, forked, capture, iters, dot=""):
    from streamsched.interp.cuda import CudaExecutor, captured_dot, graph_nodes_edges

    sched, plan = linear_backward(n, k, m, forked, capture)
    ex = CudaExecutor(sched, plan, capture=capture)
    nodes = None
    if capture != "none":
        types, edges = graph_nodes_edges(ex.graph_of(0))
        nodes = {"types": types, "edges": edges}
        if dot and forked:
            captured_dot(ex.graph_of(0), dot)
    rng = np.random.default_rng(0)
    for nm in ("x", "w", "dy"):
        b = ex._buf[nm]
        ex.set(nm, rng.standard_normal(b.shape).astype(np.float32))
    prog = ex.compile()
    for _ in range(20):
        ex.run(prog)
    ex.synchronize()
    t0 = time.perf_counter()
    issue = 0.0
    for _ in range(iters):
        a = time.perf_counter()
        ex.run(prog)
        issue += time.perf_counter() - a
    ex.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1e6
    ex.close()
    return {"forked": forked, "capture": capture, "us_per_run": round(wall, 2),
            "host_us_per_run": round(issue / iters * 1e6, 2), "graph": nodes}


def measure_sched(path: str, capture: str, steps: int) -> dict:
    """Per-step wall time of a compiled .sched file's training step (random data, constant lr),
    steady state, with the plan's own host waits; plus what was captured."""
    from streamsched.interp.barriers import plan_segment, plan_segment_for
    from streamsched.interp.cuda import CudaExecutor, graph_nodes_edges
    from streamsched.interp.train import init_params
    from streamsched.pipeline import compile_file

    c = compile_file(path, capture=capture)
    plan, prog = c.plan, c.program
    ex = CudaExecutor(c.schedule, plan, capture=capture)
    for n, v in init_params(prog, 0).items():
        ex.set(n, v)
    classes = dict((b.name, b.shape) for b in prog.buffers)[prog.model.logits][-1]
    rng = np.random.default_rng(0)

    def host_fn(task, arrays):
        out = arrays[task.outs[0]]
        if task.kernel == "stage":
            if np.issubdtype(out.dtype, np.integer):
                out[...] = rng.integers(0, classes, out.shape)
            else:
                out[...] = rng.standard_normal(out.shape)
        else:
            out[...] = 0.01

    ex.run(plan_segment(plan, -1), host_fn)
    for k in range(20):
        ex.run(plan_segment_for(plan, k), host_fn)
    ex.synchronize()
    t0 = time.perf_counter()
    for k in range(20, 20 + steps):
        ex.run(plan_segment_for(plan, k), host_fn)
    ex.synchronize()
    us = (time.perf_counter() - t0) / steps * 1e6
    kinds: dict[str, int] = {}
    for cu in ex.graphs.values():
        for t in graph_nodes_edges(cu.graph)[0]:
            kinds[t] = kinds.get(t, 0) + 1
    loss = float(ex.get(prog.model.loss))
    n_graphs, n_units = len(ex.graphs), len(ex.unit_graph)
    ex.close()
    return {"sched": path, "capture": capture, "us_per_step": round(us, 1), "graphs": n_graphs,
            "units": n_units,
            "graph_node_types": kinds, "loss": loss}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--m", type=int, default=1024)
    ap.add_argument("--json", default="")
    ap.add_argument("--sched", default="", help="also time this .sched file's step, each capture mode")
    ap.add_argument("--dot", default="", help="write the forked captured graph's Graphviz here")
    a = ap.parse_args()
    rows = []
    for capture in ("none", "graphs"):
        for forked in (True, False):
            r = measure(a.n, a.k, a.m, forked, capture, a.iters, a.dot)
            rows.append(r)
            print(json.dumps(r), flush=True)
    sched_rows = []
    if a.sched:
        for capture in ("none", "graphs", "step"):
            r = measure_sched(a.sched, capture, a.iters)
            sched_rows.append(r)
            print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"n": a.n, "k": a.k, "m": a.m, "iters": a.iters, "rows": rows,
                       "sched": sched_rows}, f, indent=1)


if __name__ == "__main__":
    main()
