"""benchmarks/gpt_twin.py, the GPT of examples/gpt_text.sched beside PyTorch, on the CPU: its
reading of the file (sizes, each layer norm's eps, AdamW's settings for every parameter, the
clipping; a changed file changes them, a file the twin cannot follow is refused), its per-step
harness (the losses and parameters of the training loop itself, step 0 the independent NumPy
GPT's loss on the run's first batch), the fork overlaps it reports from a timeline, the pieces
of benchmarks/step_time.py's `gpt_text` row that need no GPU, and, where torch is installed, the
PyTorch twin trained on the CPU against streamsched's CPU backend.  tests/test_cuda_gpt_torch.py
is the GPU comparison."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

from gpt_reference import gpt_loss
from streamsched.interp.cpu_threads import blas_threads, choose_threads
from streamsched.interp.data import Batches, load_dataset
from streamsched.interp.train import CpuRunner, TrainOptions, init_params, train
from streamsched.pipeline import compile_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpt_twin as gt  # noqa: E402
import step_time  # noqa: E402

EXAMPLES = os.path.join(ROOT, "examples")
EXAMPLE = os.path.join(EXAMPLES, "gpt_text.sched")
SRC = open(EXAMPLE, encoding="utf-8").read()
HEADER = "model gpt(batch = 16, context = 64, width = 64, heads = 4, hidden = 256)"
ADAMW = "adamw(gpt, lr, step, weight_decay = 0.1, beta2 = 0.99)"
CLIP = "clip_scale(gnorm, clip, max_norm = 1.0)"
FUSED = "    a1     = attention(q1, k1, v1, heads = heads, context = context)\n"
PIECES = """    s1     = attention_scores(q1, k1, heads = heads, context = context)
    w1     = softmax(s1)
    d1     = dropout(w1, p = P)
    a1     = attention_apply(d1, v1)
"""


@pytest.fixture(scope="module")
def compiled():
    c = compile_file(EXAMPLE)
    assert c.ok, c.diagnostics
    return c


def _variant(text: str):
    c = compile_file(EXAMPLE, text)  # the example's folder: the same data line
    assert c.ok, c.diagnostics
    return c


def test_the_spec_of_the_example(compiled):
    s = gt.gpt_spec(compiled)
    params = list(compiled.program.model.params)
    assert (s["batch"], s["context"], s["vocab"], s["width"], s["heads"], s["layers"], s["hidden"],
            s["classes"]) == (16, 64, 256, 64, 4, 2, 256, 256)
    assert s["ln_eps"] == {n: 1e-5 for n in ("n1", "m1", "n2", "m2", "nf")}
    # one AdamW call over the whole model: every parameter decays, biases, norms and tables too
    assert s["adamw"] == [{"params": params, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}]
    assert s["clip"] == {"max_norm": 1.0, "eps": 1e-6} and gt.TORCH_EPS == 1e-6
    assert s["lr"] == {"name": "cosine", "args": [0.003], "kwargs": {"warmup": 100, "min": 0.0003}}
    assert (s["lr_peak"], s["epochs"], s["seed"]) == (0.003, 2, 0)
    keys = gt.torch_keys(s)
    assert sorted(k for k, _, _ in keys) == sorted(params)
    assert len({t for _, t, _ in keys}) == len(keys)  # no two parameters share a PyTorch name
    # exactly the linear weights ([in, out] in streamsched, [out, in] in nn.Linear) are transposed
    assert {k for k, _, tr in keys if tr} == {p for p in params if p.endswith(".w")}
    shapes = {b.name: tuple(b.shape) for b in compiled.program.buffers}
    assert all(len(shapes[k]) == 2 for k, _, tr in keys if tr)


def test_the_spec_follows_the_file():
    text = (SRC.replace(HEADER, HEADER.replace("heads = 4", "heads = 2"))
            .replace(ADAMW, "adamw(gpt, lr, step, weight_decay = 0.05, beta2 = 0.95, eps = 0.0001)")
            .replace(CLIP, "clip_scale(gnorm, clip, max_norm = 0.5, eps = 0.001)")
            .replace("    m2     = layernorm(r2)\n", "    m2     = layernorm(r2, eps = 0.001)\n")
            .replace("epochs  = 2", "epochs  = 3\n    seed    = 7"))
    assert text.count("heads = 2") == 1 and "eps = 0.001)\n" in text
    s = gt.gpt_spec(_variant(text))
    assert s["heads"] == 2
    assert s["ln_eps"] == {"n1": 1e-5, "m1": 1e-5, "n2": 1e-5, "m2": 1e-3, "nf": 1e-5}
    assert [(g["beta1"], g["beta2"], g["eps"], g["weight_decay"], len(g["params"])) for g in s["adamw"]] == \
        [(0.9, 0.95, 1e-4, 0.05, 38)]
    assert s["clip"] == {"max_norm": 0.5, "eps": 1e-3}
    assert (s["epochs"], s["seed"]) == (3, 7)
    # no clipping at all: clip is None
    opt = SRC[SRC.index("graph optimize"):SRC.index("step train")]
    s = gt.gpt_spec(_variant(SRC.replace(opt, f"graph optimize on update {{ {ADAMW} }}\n\n")))
    assert s["clip"] is None
    # attention in pieces with dropout p = 0 is the same GPT; with p > 0 it is refused
    assert gt.gpt_spec(_variant(SRC.replace(FUSED, PIECES.replace("P", "0.0"))))["heads"] == 4
    with pytest.raises(ValueError, match="dropout p = 0.1"):
        gt.gpt_spec(_variant(SRC.replace(FUSED, PIECES.replace("P", "0.1"))))


def test_a_file_the_twin_cannot_follow_is_refused():
    opt = SRC[SRC.index("graph optimize"):SRC.index("step train")]
    with pytest.raises(ValueError, match="AdamW"):
        gt.gpt_spec(_variant(SRC.replace(opt, "graph optimize on update { sgd(gpt, lr, momentum = 0.9) }\n\n")))
    # a GPT whose parameters are not the example's model lines
    tied = SRC.replace("    logits = linear(nf, 256)\n", "    logits = linear(nf, 256)\n    extra  = linear(logits, 256)\n") \
        .replace("token_cross_entropy(logits, y)", "token_cross_entropy(extra, y)")
    with pytest.raises(ValueError, match="extra"):
        gt.gpt_spec(_variant(tied))


def test_the_run_s_batches_and_learning_rates(compiled):
    batches, spe = gt.run_batches(compiled, EXAMPLES, 3)
    ds = load_dataset("text", ("<python-stdlib>",), {"context": 64, "test": 0.02}, base_dir=ROOT)
    b = Batches(ds.x_train, ds.y_train, 16, 0, epoch_samples=ds.epoch_samples)
    assert spe == b.steps_per_epoch == ds.epoch_samples // 16
    for k, (x, y) in enumerate(batches):
        sel = b.order(0)[k * 16:(k + 1) * 16]
        np.testing.assert_array_equal(x, ds.x_train[sel])
        np.testing.assert_array_equal(y, ds.y_train[sel])
    # past an epoch: the next epoch's permutation
    more, _ = gt.run_batches(compiled, EXAMPLES, spe + 1)
    np.testing.assert_array_equal(more[spe][0], ds.x_train[b.order(1)[:16]])
    lr = gt.run_lr(compiled, spe)
    total = 2 * spe  # cosine(0.003, warmup = 100, min = 0.0003) over both epochs
    assert lr(0) == pytest.approx(0.003 / 100) and lr(99) == pytest.approx(0.003)
    t = total // 2
    assert lr(t) == pytest.approx(0.0003 + 0.0027 * (1 + math.cos(math.pi * (t - 100) / (total - 100))) / 2)


def test_the_harness_steps_are_the_training_loop_s(compiled):
    """Per-step losses through a runner, staged as the loop stages: their mean is the loop's
    train loss over the same steps, the parameters after them the loop's, bit for bit, and step
    0's loss is the independent NumPy GPT's on the run's first batch."""
    n = 5
    batches, spe = gt.run_batches(compiled, EXAMPLES, n + 1)
    lr = gt.run_lr(compiled, spe)
    init = init_params(compiled.program, 0)
    runner = CpuRunner(compiled, "fixed", 0, False)
    with blas_threads(choose_threads(None, compiled.schedule)[0]):  # the loop's BLAS threads: the same sums
        losses = gt.step_losses(compiled, runner, init, batches, lr, n)
    params = {p: runner.read(p) for p in compiled.program.model.params}
    r = train(compiled, TrainOptions(backend="cpu", max_steps=n, progress=False, eval_every=1000), base_dir=EXAMPLES)
    assert r.steps == n and len(losses) == n
    assert r.history[0]["train_loss"] == pytest.approx(sum(losses) / n, rel=1e-12)
    assert r.history[0]["lr"] == pytest.approx(lr(n - 1))
    for p in params:
        np.testing.assert_array_equal(params[p], r.params[p])
    p0 = {k: v.astype(np.float64) for k, v in init.items()}
    assert losses[0] == pytest.approx(gpt_loss(p0, *batches[0]), rel=1e-6)
    assert len(set(losses)) == n and losses[-1] < losses[0]  # a new batch and new weights every step


def test_fork_overlaps():
    def rec(label, stream, a, b, kernel="matmul", step=2):
        return {"label": label, "stream": stream, "start_us": a, "end_us": b, "kernel": kernel, "step": step}

    records = [
        rec("pass[a]: linear@q1", "comp1", 0, 10), rec("pass[a]: linear@k1", "comp2", 2, 12),
        rec("pass[a]: linear@v1", "comp3", 20, 30),
        rec("pass[a]: linear@q1", "comp1", 40, 50, kernel="add"),  # the bias add is not the GEMM
        rec("pass[a]: attention.backward@a1.dv", "comp2", 100, 110, "attn_grad_v"),
        rec("pass[a]: attention.backward@a1.dp", "comp1", 105, 120, "attn_grad_p"),
        rec("pass[a]: layernorm.backward@n1.dx", "comp3", 200, 210, "layernorm_grad_x"),
        rec("pass[a]: layernorm.backward@n1.dbeta", "comp1", 200, 210, "sum"),
        rec("pass[a]: attention.backward@a1.dq", "comp3", 0, 1, "attn_grad_q", step=1),  # another step
    ]
    ov = gt.fork_overlaps(records)
    assert ov == {"qkv1": {"k|q": 8.0, "k|v": 0.0, "q|v": 0.0, "streams": 3},
                  "a1": {"dp|dv": 5.0, "streams": 2},
                  "n1": {"dbeta|dx": 10.0, "streams": 2}}
    assert gt.fork_overlaps(records, step=1) == {"a1": {"streams": 1}}
    assert gt.fork_overlaps([]) == {}


def test_the_step_time_row_pieces(tmp_path):
    specs = step_time.prepare_models(["gpt_text"], str(tmp_path))
    s = specs["gpt_text"]
    c = compile_file(EXAMPLE)
    (x, y), = gt.run_batches(c, EXAMPLES, 1)[0]
    assert s["x"].dtype == s["y"].dtype == np.int32 and s["x"].shape == s["y"].shape == (16, 64)
    np.testing.assert_array_equal(s["x"], x)
    np.testing.assert_array_equal(s["y"], y)
    assert (s["kind"], s["lr"], s["batch"], s["classes"]) == ("gpt", 0.003, 16, 256)
    assert s["gpt"] == gt.gpt_spec(c)
    one = step_time.compile_steady(s["one"], "step")
    assert one.ok and {t.stream for t in one.schedule.tasks} <= {"main", "host"}
    assert one.segments.period is not None
    # AdamW's step count is a host upload: a replay without host tasks has a stale t, and its
    # loss is kept out of the loss check (and said so)
    row = {"variants": {"torch_eager": {"loss_after_check": 2.0, "gpu_us": 100.0, "host_us": 1.0},
                        "torch_compile_graph": {"loss_after_check": 2.0, "gpu_us": 50.0, "host_us": 1.0},
                        "ss_step_five": {"loss_after_check": 2.002, "gpu_us": 40.0, "host_us": 1.0},
                        "ss_step_five_replay": {"loss_after_check": 3.0, "gpu_us": 30.0, "host_us": 1.0,
                                                "loss_not_compared": "stale t"}}}
    step_time.summarize_model("gpt_text", row, 20)
    assert row["loss_check"]["max_rel_diff"] == pytest.approx(1e-3)
    assert "ss_step_five_replay" not in row["loss_check"]["losses"]
    assert row["loss_check"]["not_compared"] == {"ss_step_five_replay": "stale t"}
    assert row["ratios"]["ss_step_five"]["vs_strongest"] == pytest.approx(0.8)
    assert row["strongest_torch"] == "torch_compile_graph"
    assert "torch_compile_graph" in step_time.markdown({"models": {"gpt_text": {**row, "batch": 16, "layers": []}}})


def test_the_twin_tracks_the_cpu_run_when_torch_is_here(compiled):
    """With torch installed (not in CI): the PyTorch twin trained on the CPU from streamsched's
    initial weights and the run's batches tracks streamsched's CPU backend step by step, with
    both forms of attention."""
    pytest.importorskip("torch")
    n = 8
    spec = gt.gpt_spec(compiled)
    batches, spe = gt.run_batches(compiled, EXAMPLES, n + 1)
    lr = gt.run_lr(compiled, spe)
    init = init_params(compiled.program, 0)
    ss = gt.step_losses(compiled, CpuRunner(compiled, "fixed", 0, False), init, batches, lr, n)
    for attention in ("sdpa", "explicit"):
        pt = gt.torch_losses(spec, init, batches, lr, n, "cpu", attention)
        rel = max(abs(a - b) / abs(b) for a, b in zip(ss, pt))
        print(f"\n{attention}: max relative difference {rel:.2e} over {n} steps")
        assert rel < 1e-6, (attention, ss, pt)  # (erf GELU instead of tanh: 9e-6)


def test_the_benchmark_s_eager_twin_on_the_static_batch_when_torch_is_here(compiled, tmp_path):
    """With torch installed: step_time's gpt_text loss check on the CPU, without timing: the
    twin's eager variant after n steps on the static batch at the constant peak rate is
    streamsched's loss after n steps of the same (AdamW's t = step + 1)."""
    torch = pytest.importorskip("torch")
    n = 6
    s = step_time.prepare_models(["gpt_text"], str(tmp_path))["gpt_text"]
    init = init_params(compiled.program, 0)
    batch = [(s["x"], s["y"])] * (n + 1)
    ss = gt.step_losses(compiled, CpuRunner(compiled, "fixed", 0, False), init, batch, lambda k: s["lr"], n)
    x, y = (torch.from_numpy(a.astype(np.int64)) for a in (s["x"], s["y"]))
    res = gt.torch_eager(s["gpt"], init, x, y, s["lr"], steps=0, reps=0, warmup=0, check_steps=n, device="cpu",
                         check_only=True)
    assert res["loss_after_check"] == pytest.approx(ss[-1], rel=1e-6)
    assert ss[-1] < ss[0] - 0.5  # the one batch is being learnt
