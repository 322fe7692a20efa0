"""Parse + resolve time of a generated schedule with about 10,000 tasks (issue: front end).

A deep MLP on the seed's five streams: every layer is a linear (2 tasks forward, 3 forked
backward tasks), an activation (1 + 1), a zero-grad fill and an SGD update per parameter; the
program's task templates are counted after resolve.  Also reports the whole pipeline (unroll over
the A/B period, dependencies, validate, insert_barriers) on the same file.

    python benchmarks/frontend_bench.py [--tasks 10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from streamsched.diagnostics import SourceCache  # noqa: E402
from streamsched.dsl.parse import parse  # noqa: E402
from streamsched.dsl.resolve import resolve  # noqa: E402
from streamsched.interp.barriers import insert_barriers  # noqa: E402
from streamsched.interp.dependencies import dependencies  # noqa: E402
from streamsched.interp.unroll import unroll  # noqa: E402
from streamsched.interp.validate import validate_plan, validate_schedule  # noqa: E402

HEAD = """streams {
    trans : copy
    comp1 : compute
    comp2 : compute
    comp3 : compute
    update : update
}
"""


def generate(layers: int) -> str:
    lines = [HEAD, "model deep(batch = 8, width = 16) {", "    input x : f32[batch, 16]", "    input y : i32[batch]"]
    prev = "x"
    for i in range(layers):
        lines.append(f"    h{i} = linear({prev}, width)")
        lines.append(f"    a{i} = {'relu' if i % 2 else 'tanh'}(h{i})")
        prev = f"a{i}"
    lines += [f"    logits = linear({prev}, 10)", "    loss = softmax_cross_entropy(logits, y)", "}",
              "graph load[a, b] on trans { copy batch -> x, y }",
              "graph zero_grad on update { clear grad(deep) }",
              "graph pass on comp1 { forward deep; backward deep }",
              "graph optimize on update { sgd(deep, lr, momentum = 0.9) }",
              "step train(slot) {", "    upload lr on trans", "    zero_grad", "    pass(load[slot])",
              "    load[next]", "    optimize", "}"]
    return "\n".join(lines) + "\n"


def count(program) -> int:
    return sum(len(g.templates) for g in program.graphs) + sum(2 for l in program.step if l.kind == "upload")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    layers = max(1, args.tasks // 13)
    text = generate(layers)
    while count(resolve("gen.sched", text)) < args.tasks:
        layers += max(1, layers // 20)
        text = generate(layers)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "deep.sched")
        with open(path, "w") as f:
            f.write(text)
        best = {"parse": 1e9, "resolve": 1e9, "pipeline": 1e9}
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            parse(text, path)
            t1 = time.perf_counter()
            prog = resolve(path, sources=SourceCache())
            t2 = time.perf_counter()
            sched = unroll(prog, steps=2)
            edges = dependencies(sched)
            validate_schedule(sched, edges)
            plan = insert_barriers(sched, edges, "auto")
            validate_plan(plan, edges)
            t3 = time.perf_counter()
            best["parse"] = min(best["parse"], t1 - t0)
            best["resolve"] = min(best["resolve"], t2 - t1)
            best["pipeline"] = min(best["pipeline"], t3 - t2)
    n = count(prog)
    print(f"generated: {layers} layers, {len(text.splitlines())} lines, {n} tasks per step "
          f"({len(sched.tasks)} unrolled over 2 steps + prologue)")
    print(f"parse            {best['parse']:.3f} s")
    print(f"resolve          {best['resolve'] - 0:.3f} s  (includes its own parse)")
    print(f"parse + resolve  {best['resolve']:.3f} s   target < 2 s")
    print(f"unroll + dependencies + validate + insert_barriers + validate_plan: {best['pipeline']:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
