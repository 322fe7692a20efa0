"""examples/gpt_text.sched on the GPU against PyTorch (issue 15): from the same initial weights
(init_params, seed 0) and the same batches (the first 50 a run of the file trains on, in its
order), 50 steps of the file on the CUDA backend, in its own capture mode (step) on its five
streams, track the PyTorch twin of benchmarks/gpt_twin.py (nn.Embedding, nn.LayerNorm(eps=1e-5),
nn.Linear with streamsched's [in, out] weights transposed, F.scaled_dot_product_attention(
is_causal=True) or the same attention written out, F.gelu(approximate="tanh"), F.cross_entropy,
clip_grad_norm_(max_norm=1.0), torch.optim.AdamW(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
over every parameter, the file's cosine learning rate per step): the loss within 1e-3 relative at
every step, fp32, TF32 off on both sides.  Dropout is off (the example has none; a file with
dropout p > 0 is refused by gpt_twin.gpt_spec rather than compared).

The training loop reads the losses once per epoch; the per-step losses here come from
gpt_twin.step_losses, which issues the compiled plan's steps through the CUDA runner staging
what the loop stages and reads the loss after each step.  That they are the loop's own steps is
checked too: train(..., backend="cuda", max_steps=50) has the same mean loss and parameters.
Needs CuPy, a device and torch with CUDA; skips otherwise.

    python3 -m pytest -q -s -m cuda tests/test_cuda_gpt_torch.py

With STREAMSCHED_GPT_TORCH_OUT=FILE.json the per-step losses of both sides are written there.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from streamsched.interp.train import TrainOptions, init_params, train
from streamsched.pipeline import compile_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpt_twin as gt  # noqa: E402
from step_time import dropout_text  # noqa: E402

pytestmark = pytest.mark.cuda

EXAMPLES = os.path.join(ROOT, "examples")
EXAMPLE = os.path.join(EXAMPLES, "gpt_text.sched")
STEPS = 50
TOL = 1e-3  # relative, every step (the bound)


@pytest.fixture(scope="module")
def torch_cuda(cp):  # `cp` (tests/conftest.py) skips without CuPy and a device
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # the legacy flags, as benchmarks/step_time.py
    torch.backends.cudnn.allow_tf32 = False
    return torch


@pytest.fixture(scope="module")
def gpu_run(cp):
    """The file (dropout p rewritten to 0 wherever it is given) compiled, its twin spec, the run's
    batches and learning rates, and 50 steps on the CUDA backend: the loss of every step and the
    parameters after the last."""
    from streamsched.interp.cuda.runner import CudaRunner

    with open(EXAMPLE, encoding="utf-8") as f:
        text = dropout_text(f.read(), 0.0)
    c = compile_file(EXAMPLE, text)
    assert c.ok, c.diagnostics
    spec = gt.gpt_spec(c)  # raises on dropout p > 0 (a `dropout(x)` without p is 0.1)
    batches, spe = gt.run_batches(c, EXAMPLES, STEPS + 1)
    lr = gt.run_lr(c, spe)
    init = init_params(c.program, 0)
    runner = CudaRunner(c)
    assert runner.ex.capture == c.schedule.capture == "step"
    try:
        losses = gt.step_losses(c, runner, init, batches, lr, STEPS)
        params = {p: runner.read(p) for p in c.program.model.params}
    finally:
        runner.ex.close()
    return SimpleNamespace(c=c, spec=spec, batches=batches, lr=lr, init=init, losses=losses, params=params)


def test_the_per_step_losses_are_the_training_loop_s(gpu_run):
    r = train(gpu_run.c, TrainOptions(backend="cuda", max_steps=STEPS, progress=False, eval_every=1000),
              base_dir=EXAMPLES)
    assert r.backend == "cuda" and r.steps == STEPS
    assert r.history[0]["train_loss"] == pytest.approx(sum(gpu_run.losses) / STEPS, rel=1e-5)
    assert r.history[0]["lr"] == pytest.approx(gpu_run.lr(STEPS - 1))
    # The key biases k{i}.b are left out: softmax over j is blind to q_i . b_k, the same for every
    # j, so their gradient is zero but for rounding, and AdamW turns that noise into steps of
    # about lr; any change of summation order (BLAS threads, atomics) moves them arbitrarily.
    # Nor do they change any loss.
    for p, v in gpu_run.params.items():
        if re.fullmatch(r"k\d+\.b", p):
            continue
        np.testing.assert_allclose(v, r.params[p], rtol=1e-4, atol=1e-6, err_msg=p)


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_fifty_steps_track_pytorch(gpu_run, torch_cuda, attention):
    ss = gpu_run.losses
    pt = gt.torch_losses(gpu_run.spec, gpu_run.init, gpu_run.batches, gpu_run.lr, STEPS, "cuda", attention)
    assert all(math.isfinite(v) for v in ss + pt)
    rel = [abs(a - b) / abs(b) for a, b in zip(ss, pt)]
    worst = int(np.argmax(rel))
    print(f"\ngpt_text, {STEPS} steps on the GPU against PyTorch ({attention} attention), fp32, TF32 off:")
    print(f"{'step':>5} {'streamsched':>12} {'pytorch':>12} {'rel diff':>9}")
    for k in sorted(set(range(0, STEPS, 5)) | {STEPS - 1, worst}):
        print(f"{k + 1:5d} {ss[k]:12.7f} {pt[k]:12.7f} {rel[k]:9.2e}")
    print(f"max relative difference {rel[worst]:.3e} at step {worst + 1}")
    out = os.environ.get("STREAMSCHED_GPT_TORCH_OUT")
    if out:
        old = {}
        if os.path.exists(out):
            with open(out, encoding="utf-8") as f:
                old = json.load(f)
        old[attention] = {"streamsched": ss, "pytorch": pt, "max_rel_diff": rel[worst], "at_step": worst + 1,
                          "steps": STEPS, "tolerance": TOL}
        with open(out, "w", encoding="utf-8") as f:
            json.dump(old, f, indent=1)
    assert rel[worst] < TOL, f"step {worst + 1}: streamsched {ss[worst]}, pytorch {pt[worst]}"
    assert ss[-1] < ss[0] - 1.0  # it learns (the CPU run: 5.65 -> 3.15 nats), so the check is not of a stall
