"""Data parallel on one GPU: a world-size-1 NCCL communicator's all-reduce captured inside the
step's graph, read back with cuda-python, and training with it against training without it.
Needs CuPy (with NCCL), nvmath-python, cuda-python and a GPU; skips itself otherwise
(`pytest -m cuda tests/test_cuda_data_parallel.py`).

- Every bucket of examples/mlp_digits_dp.sched is captured as NCCL kernel node(s) of the step's
  graph (capture = step: one graph per slot); each bucket's nodes are reachable from the nodes of
  every task that writes one of its gradients, they reach every optimizer node that reads one,
  and the first bucket (logits, h2) is NOT reachable from the first layer's dW: it overlaps the
  rest of the backward, as the plan says.
- 50 steps of the example on CUDA equal the CPU backend's (relative 1e-4, fp32), and 10 epochs
  reach the accuracy the same file reaches with the all-reduce taken out (within 1 point).
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

ROOT = os.path.join(os.path.dirname(__file__), "..")
EXAMPLE = os.path.join(ROOT, "examples", "mlp_digits_dp.sched")


@pytest.fixture(scope="module")
def nccl(cp):  # `cp` (tests/conftest.py) skips without CuPy and a device
    mod = pytest.importorskip("cupy.cuda.nccl")
    if not getattr(mod, "available", True):
        pytest.skip("CuPy was built without NCCL")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    return mod


def _without_allreduce(text: str) -> str:
    text = re.sub(r"^graph reduce .*\n", "", text, flags=re.M)
    return re.sub(r"^\s*reduce\b.*\n", "", text, flags=re.M)


def test_allreduce_is_captured_where_the_plan_says(nccl):
    from streamsched.interp.cuda import CudaExecutor
    from streamsched.interp.cuda.capture_dot import graph_structure, reachable
    from streamsched.pipeline import compile_file

    c = compile_file(EXAMPLE, capture="step")
    assert c.ok, c.diagnostics
    tasks = c.schedule.tasks
    ex = CudaExecutor(c.schedule, c.plan, capture="step")
    try:
        ex.run(host_fn=lambda task, arrays: None)  # staging and scalars: the slots' zeros will do
        ex.synchronize()
        seen_buckets = 0
        for cu in ex.graphs.values():
            reduces = [tid for tid in cu.tasks if tasks[tid].kernel == "allreduce_mean"]
            if not reduces:
                continue
            handles, types, edges = graph_structure(cu.graph)
            kind = dict(zip(handles, types))
            owned: dict[int, set[int]] = {}
            for node, tid in cu.node_task.items():
                owned.setdefault(tid, set()).add(node)
            in_unit = set(cu.tasks)
            for a in reduces:
                ta = tasks[a]
                mine = owned.get(a, set())
                assert mine, f"{ta.label}: the all-reduce created no node in the captured graph"
                assert "Kernel" in {kind[n] for n in mine}, {kind[n] for n in mine}
                writers = [t.id for t in tasks if t.id in in_unit and t.id < a and set(t.outs) & set(ta.outs)
                           and t.kernel != "allreduce_mean"]
                readers = [t.id for t in tasks if t.id in in_unit and t.id > a
                           and (t.kernel == "sgd_step" or t.attr("base") == "sgd_step")  # fused: multi_tensor
                           and set(t.args) & set(ta.outs)]
                assert writers and readers, ta.label
                for w in writers:
                    assert reachable(edges, owned[w]) & mine, f"{tasks[w].label} does not reach {ta.label}"
                for r in readers:
                    assert reachable(edges, mine) & owned[r], f"{ta.label} does not reach {tasks[r].label}"
                seen_buckets += 1
            first = min(reduces)
            assert "logits" in tasks[first].label and "h1" not in tasks[first].label
            h1_dw = next(t.id for t in tasks if t.id in in_unit and "grad.h1.w" in t.outs and t.kernel == "matmul")
            assert not (reachable(edges, owned[h1_dw]) & owned[first]), \
                "the first bucket waits for the first layer's dW: it should overlap it"
        assert seen_buckets >= 2
    finally:
        ex.close()


def test_fifty_steps_match_the_cpu_backend(nccl):
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    c = compile_file(EXAMPLE)
    res = {b: train(c, TrainOptions(backend=b, max_steps=50, progress=False, lr=0.05), base_dir=ROOT)
           for b in ("cpu", "cuda")}
    assert res["cuda"].backend == "cuda" and res["cuda"].steps == res["cpu"].steps == 50
    for n, want in res["cpu"].params.items():
        got = res["cuda"].params[n]
        rel = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-12))
        assert rel <= 1e-4, (n, rel)


def test_training_reaches_the_accuracy_it_reaches_without_the_allreduce(nccl, tmp_path):
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    with open(EXAMPLE, encoding="utf-8") as f:
        text = f.read()
    plain = tmp_path / "mlp_digits_plain.sched"
    plain.write_text(_without_allreduce(text), encoding="utf-8")
    accs = {}
    for name, path in (("dp", EXAMPLE), ("plain", str(plain))):
        c = compile_file(path)
        assert c.ok, c.diagnostics
        assert (name == "dp") == any(t.kernel == "allreduce_mean" for t in c.schedule.tasks)
        r = train(c, TrainOptions(backend="cuda", epochs=10, progress=False), base_dir=ROOT)
        accs[name] = r.history[-1]["test_acc"]
    assert accs["dp"] >= 0.9, accs
    assert abs(accs["dp"] - accs["plain"]) <= 0.01, accs
