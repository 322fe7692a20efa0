"""The CUDA backend inside the training loop, against the CPU backend, and the captured graphs'
shape.  Needs CuPy, nvmath-python, cuda-python and a GPU; skips itself otherwise
(`pytest -m cuda tests/test_cuda_training.py`).

- 50 steps of examples/mlp_digits.sched through `train(...)` on CUDA equal the CPU backend's
  (relative 1e-4, fp32) from the same seeded initial weights, in every capture mode, with the
  file's five streams and with everything folded onto one stream.
- The captured graph of examples/five_streams.sched keeps each linear backward's dW, dB and dX
  on independent branches (no path between them along the graph's edges), and has no
  memory-allocation nodes.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

ROOT = os.path.join(os.path.dirname(__file__), "..")
EXAMPLES = os.path.join(ROOT, "examples")


@pytest.fixture(scope="module")
def gpu(cp):  # `cp` (tests/conftest.py) skips without CuPy and a device
    return cp


def one_stream_text(text: str) -> str:
    """The file with its `streams { ... }` block replaced by `streams { main : compute }` and
    every explicit `on STREAM` placement moved onto `main` (the stdlib's placements fold onto
    the declared streams by role)."""
    names = re.findall(r"^\s*(\w+)\s*:\s*\w+", re.search(r"streams\s*\{([^}]*)\}", text).group(1),
                       flags=re.M)
    text = re.sub(r"streams\s*\{[^}]*\}", "streams { main : compute }", text, count=1)
    if names:
        text = re.sub(r"\bon\s+(" + "|".join(map(re.escape, names)) + r")\b", "on main", text)
    return text


def example_path(name: str, streams: str, tmp_path) -> str:
    src = os.path.join(EXAMPLES, name)
    if streams == "five":
        return src
    with open(src, encoding="utf-8") as f:
        text = one_stream_text(f.read())
    dst = os.path.join(str(tmp_path), name.replace(".sched", "_one_stream.sched"))
    with open(dst, "w", encoding="utf-8") as f:
        f.write(text)
    return dst


def compile_steady(path: str, capture: str, steps: int = 50):
    """compile_file(path, capture=...); unrolled further when the default unrolling has no
    steady state for the loop to repeat, and, if no unrolling up to 12 steps has one, unrolled
    past `steps` so that the loop never leaves the unrolled steps."""
    from streamsched.interp.barriers import steady_step
    from streamsched.pipeline import compile_file

    for n in (None, 6, 8, 12):
        c = compile_file(path, capture=capture, steps=n)
        try:
            steady_step(c.plan, c.schedule.steps + 3)
            return c
        except ValueError:
            continue
    return compile_file(path, capture=capture, steps=steps + 2)


def rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (the absolute difference for an all-zero `want`)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if not want.size:
        return 0.0
    scale = float(np.max(np.abs(want)))
    return float(np.max(np.abs(got - want))) / (scale if scale > 0 else 1.0)


@pytest.mark.parametrize("streams", ["five", "one"])
@pytest.mark.parametrize("capture", ["none", "graphs", "step"])
def test_mlp_digits_50_steps_match_cpu(gpu, tmp_path, capture, streams):
    from streamsched.interp.train import TrainOptions, train

    path = example_path("mlp_digits.sched", streams, tmp_path)
    results = {}
    for backend in ("cpu", "cuda"):
        c = compile_steady(path, capture)
        assert c.ok, [d.code for d in c.diagnostics]
        if streams == "one":
            assert [s for s in c.schedule.streams if s != "host"] == ["main"]
        results[backend] = train(c, TrainOptions(backend=backend, max_steps=50, progress=False, lr=0.05),
                                 base_dir=EXAMPLES)
    cpu, cuda = results["cpu"], results["cuda"]
    assert cuda.backend == "cuda" and cpu.backend == "cpu"
    assert cpu.steps == cuda.steps == 50
    assert set(cpu.params) == set(cuda.params) and cpu.params
    worst = {n: rel_diff(cuda.params[n], cpu.params[n]) for n in cpu.params}
    bad = {n: d for n, d in worst.items() if not d <= 1e-4}
    assert not bad, f"relative differences above 1e-4: {bad} (all: {worst})"
    # the loop's own records agree too: train loss per epoch and test accuracy
    for a, b in zip(cpu.history, cuda.history):
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-4 * max(1.0, abs(a["train_loss"]))
        if "test_acc" in a:
            assert abs(a["test_acc"] - b["test_acc"]) <= 0.005


def _backward_parts(schedule, task_ids):
    """layer -> {"dw"|"db"|"dx": task id} for the linear backward tasks among `task_ids`."""
    parts: dict[str, dict[str, int]] = {}
    for tid in task_ids:
        m = re.search(r"linear\.backward@(\S+)\.(dw|db|dx)(?: \+\w+)*$", schedule.tasks[tid].label or "")
        if m:
            parts.setdefault(m.group(1), {})[m.group(2)] = tid
    return parts


@pytest.mark.parametrize("capture", ["graphs", "step"])
def test_five_streams_backward_fork_is_independent_in_the_captured_graph(gpu, capture):
    from streamsched.interp.cuda import CudaExecutor
    from streamsched.interp.cuda.capture_dot import captured_program_dot, graph_structure, reachable
    from streamsched.pipeline import compile_file

    c = compile_file(os.path.join(EXAMPLES, "five_streams.sched"), capture=capture)
    assert c.ok
    ex = CudaExecutor(c.schedule, c.plan, capture=capture)
    try:
        checked_layers = set()
        for cu in ex.graphs.values():
            handles, types, edges = graph_structure(cu.graph)
            assert not [t for t in types if t in ("MemAlloc", "MemFree")], types
            node_set = set(handles)
            # every captured task was mapped to the node(s) it ended with, inside this graph
            for tid in cu.tasks:
                assert cu.task_nodes.get(tid), f"task {c.schedule.tasks[tid].label} has no node"
                assert set(cu.task_nodes[tid]) <= node_set
            assert set(cu.node_task) == node_set, "every node was created by some task"
            owned: dict[int, set[int]] = {}
            for node, tid in cu.node_task.items():
                owned.setdefault(tid, set()).add(node)
            for layer, part in _backward_parts(c.schedule, cu.tasks).items():
                names = sorted(part)
                for i, a in enumerate(names):
                    for b in names[i + 1:]:
                        na, nb = owned[part[a]], owned[part[b]]
                        ea, eb = set(cu.task_nodes[part[a]]), set(cu.task_nodes[part[b]])
                        assert ea <= na and eb <= nb
                        assert not (reachable(edges, na) & nb), f"{layer}: a path {a} -> {b}"
                        assert not (reachable(edges, nb) & na), f"{layer}: a path {b} -> {a}"
                if len(part) == 3:
                    checked_layers.add(layer)
        # h1 has no dX (its input needs no gradient); h2 and logits fork three ways
        assert {"h2", "logits"} <= checked_layers, checked_layers
        dot = captured_program_dot(ex)
        assert dot.startswith("digraph") and "linear.backward@logits.dw" in dot
    finally:
        ex.close()


def test_write_captured_dot(gpu, tmp_path):
    from streamsched.interp.cuda.capture_dot import write_captured_dot
    from streamsched.pipeline import compile_file

    c = compile_file(os.path.join(EXAMPLES, "mlp_digits.sched"), capture="step", fuse=False)  # named kernels
    out = os.path.join(str(tmp_path), "captured.dot")
    text = write_captured_dot(c, out)
    with open(out, encoding="utf-8") as f:
        assert f.read() == text
    assert text.count("subgraph cluster_g") >= 1
    assert "sgd_step" in text and "->" in text


def _amp_text(scale: str | None = None) -> str:
    with open(os.path.join(EXAMPLES, "resnet_digits_amp.sched"), encoding="utf-8") as f:
        text = f.read()
    if scale is not None:
        text = text.replace("loss_scale : f32[] = 65536", f"loss_scale : f32[] = {scale}")
    return text


def test_mixed_precision_on_cuda_follows_the_cpu(gpu):
    """examples/resnet_digits_amp.sched, 20 captured steps: the same steps are skipped (the loss
    scale and its growth tracker agree exactly) and the f16 model stays close to the CPU's (f16
    rounding in a different summation order: relative 5e-2 on the weights)."""
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    path = os.path.join(EXAMPLES, "resnet_digits_amp.sched")
    res = {}
    for backend in ("cpu", "cuda"):
        c = compile_file(path, _amp_text(), capture="step")
        res[backend] = train(c, TrainOptions(backend=backend, max_steps=20, progress=False), base_dir=EXAMPLES)
    cpu, cuda = res["cpu"], res["cuda"]
    assert float(cuda.params["loss_scale"]) == float(cpu.params["loss_scale"])
    assert int(cuda.params["good_steps"]) == int(cpu.params["good_steps"])
    assert cuda.params["c1.w"].dtype == np.float16 and cuda.params["sgd_amp.master.c1.w"].dtype == np.float32
    np.testing.assert_array_equal(cuda.params["c1.w"], cuda.params["sgd_amp.master.c1.w"].astype(np.float16))
    # Weights (f16) and their f32 masters within 5e-2 (measured on the H200: at most 1e-2).  The
    # momentum is a running sum of unscaled f16 gradients, each rounded after a different
    # summation order (cuBLAS GEMMs against NumPy's), so it drifts more: within 1.5e-1 (measured:
    # at most 0.09, on `c2.w`).  Conv biases ahead of a batch norm get a gradient of about zero,
    # so their relative differences mean nothing and are not compared.
    worst = {n: rel_diff(cuda.params[n], cpu.params[n]) for n in cpu.params if ".w" in n or "gamma" in n}
    bad = {n: d for n, d in worst.items() if not d <= (1.5e-1 if n.startswith("sgd_amp.v.") else 5e-2)}
    assert not bad, f"relative differences above the tolerance: {bad}"
    a, b = cpu.history[-1]["train_loss"], cuda.history[-1]["train_loss"]
    assert abs(a - b) <= 2e-2 * max(1.0, abs(a))


def test_mixed_precision_on_cuda_skips_overflowing_steps(gpu):
    """A loss scale of 2^100 overflows every f16 gradient: three captured steps change no weight,
    no master weight and no momentum, and halve the scale three times."""
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    path = os.path.join(EXAMPLES, "resnet_digits_amp.sched")
    text = _amp_text("1267650600228229401496703205376")
    init = train(compile_file(path, text), TrainOptions(backend="cpu", max_steps=0, progress=False),
                 base_dir=EXAMPLES).params
    res = train(compile_file(path, text, capture="step"),
                TrainOptions(backend="cuda", max_steps=3, progress=False), base_dir=EXAMPLES)
    assert float(res.params["loss_scale"]) == 2.0 ** 97
    for n in ("c1.w", "c3.w", "logits.w", "b2.gamma", "sgd_amp.master.c2.w", "sgd_amp.v.logits.w"):
        np.testing.assert_array_equal(res.params[n], init[n])


@pytest.mark.parametrize("variant", ["gpt_blocks", "tied"])
def test_composed_and_tied_gpt_on_cuda_follow_the_cpu(gpu, tmp_path, variant):
    """examples/gpt_blocks.sched (blocks and `repeat`) and gpt_text with its output projection
    tied to the token embedding: 20 steps on CUDA equal the CPU backend's (relative 1e-3 in
    fp32, from the same initial weights and batches)."""
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    if variant == "gpt_blocks":
        path = os.path.join(EXAMPLES, "gpt_blocks.sched")
    else:
        with open(os.path.join(EXAMPLES, "gpt_text.sched"), encoding="utf-8") as f:
            text = f.read()
        assert "    logits = linear(nf, 256)" in text
        path = str(tmp_path / "gpt_tied.sched")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace("    logits = linear(nf, 256)", "    logits = unembed(nf, table = tok.table)"))
    results = {}
    for backend in ("cpu", "cuda"):
        c = compile_file(path)
        assert c.ok, [d.code for d in c.diagnostics]
        results[backend] = train(c, TrainOptions(backend=backend, max_steps=20, progress=False, eval_every=1000),
                                 base_dir=EXAMPLES)
    cpu, cuda = results["cpu"], results["cuda"]
    assert cuda.backend == "cuda" and cpu.steps == cuda.steps == 20
    # (a key projection's bias adds the same q.b to every score of a query row, which softmax
    # ignores: its gradient is zero but for rounding, which AdamW's normalisation turns into
    # lr-sized steps of either sign; those biases are compared by the loss they leave alone)
    worst = {n: rel_diff(cuda.params[n], cpu.params[n]) for n in cpu.params
             if not re.search(r"(^|\.)k\d*\.b$", n)}
    # (the biases and their AdamW moments: 3 arrays per layer)
    assert "tok.table" in worst and len(worst) >= len(cpu.params) - 6 and max(worst.values()) <= 1e-3, worst
    assert abs(cpu.history[0]["train_loss"] - cuda.history[0]["train_loss"]) <= 1e-3 * abs(cpu.history[0]["train_loss"])
