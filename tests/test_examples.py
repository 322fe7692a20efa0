"""Examples are tests (STYLE.md habit 7): every examples/*.sched parses, checks clean under its
own policy, is planned, and runs two training steps on the CPU with no race; the test loss and
accuracy it reports are recomputed here from its final weights by a NumPy forward pass written
from the example's model lines (in f64, also for the f16 examples, whose evaluation computes in
f32; the inference forms: batch norm on running statistics, dropout the identity; the GPT's in
tests/gpt_reference.py, per token), and every weight moved."""

from __future__ import annotations

import glob
import math
import os
import re

import numpy as np
import pytest

from gpt_reference import gpt_logits
from streamsched.interp.data import load_dataset
from streamsched.interp.train import TrainOptions, train
from streamsched.pipeline import compile_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.sched")))


def _relu(z):
    return np.maximum(z, 0.0)


def _mlp(act1, act2):
    """h1 = linear(x); a1 = act1(h1); h2 = linear(a1); a2 = act2(h2); logits = linear(a2)."""
    def forward(p, x):
        a1 = act1(x @ p["h1.w"] + p["h1.b"])
        a2 = act2(a1 @ p["h2.w"] + p["h2.b"])
        return a2 @ p["logits.w"] + p["logits.b"]
    return forward


def _swish(z):
    return z / (1.0 + np.exp(-z))


def _conv3x3(x, w, b):
    """NHWC x, HWIO w, stride 1, zero padding 1 (cross-correlation, as torch's conv2d)."""
    n, h, wd, _ = x.shape
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    y = sum(np.einsum("nhwc,ck->nhwk", xp[:, i:i + h, j:j + wd], w[i, j]) for i in range(3) for j in range(3))
    return y + b


def _bn(x, p, name, eps=1e-5):
    return (x - p[f"{name}.running_mean"]) / np.sqrt(p[f"{name}.running_var"] + eps) * p[f"{name}.gamma"] + p[f"{name}.beta"]


def _resnet(p, x):
    """c1-b1-r1, c2-b2-r2, c3-b3, s = b3 + r1, r3 = relu(s), 2x2 max pool, flatten, linear."""
    x = x.reshape(len(x), 8, 8, 1)
    r1 = _relu(_bn(_conv3x3(x, p["c1.w"], p["c1.b"]), p, "b1"))
    r2 = _relu(_bn(_conv3x3(r1, p["c2.w"], p["c2.b"]), p, "b2"))
    r3 = _relu(_bn(_conv3x3(r2, p["c3.w"], p["c3.b"]), p, "b3") + r1)
    n, h, w, c = r3.shape
    pooled = r3.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))
    return pooled.reshape(n, -1) @ p["logits.w"] + p["logits.b"]


FORWARD = {
    "explicit_mlp.sched": _mlp(_relu, _relu),
    "five_streams.sched": _mlp(np.tanh, _relu),
    "inplace_backward.sched": _mlp(_relu, _relu),
    "mlp_digits.sched": _mlp(_relu, _relu),
    "mlp_digits_dp.sched": _mlp(_relu, _relu),
    "resnet_digits.sched": _resnet,
    "resnet_digits_dp.sched": _resnet,
    "resnet_digits_amp.sched": _resnet,
    "resnet_lars.sched": _resnet,
    "seed_step.sched": _resnet,
    "swish_mlp.sched": _mlp(_swish, _swish),
    "gpt_text.sched": lambda p, x: np.concatenate([gpt_logits(p, x[i:i + 256]) for i in range(0, len(x), 256)]),
    # the same GPT through `op block` and `repeat`: `h.1.q.w` is gpt_text's `q1.w`
    "gpt_blocks.sched": lambda p, x: FORWARD["gpt_text.sched"](
        {re.sub(r"^h\.(\d+)\.([a-z])\.", r"\2\1.", k): v for k, v in p.items()}, x),
}
DATA = {  # the examples' `data = ...`, when it is not digits(test = 0.2, seed = 0)
    "gpt_text.sched": ("text", ("<python-stdlib>",), {"context": 64, "test": 0.02}),
    "gpt_blocks.sched": ("text", ("<python-stdlib>",), {"context": 64, "test": 0.02}),
}


def test_there_are_examples():
    names = {os.path.basename(p) for p in EXAMPLES}
    assert {"mlp_digits.sched", "five_streams.sched", "inplace_backward.sched"} <= names
    assert names == set(FORWARD)  # a new example gets its reference forward here


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_header_says_what_and_how(path):
    head = open(path, encoding="utf-8").read().splitlines()[:8]
    assert head[0].startswith("# ") and os.path.basename(path) in head[0]
    assert any("streamsched run" in l or "streamsched check" in l for l in head)


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_checks_clean_and_runs_two_steps(path):
    name = os.path.basename(path)
    c = compile_file(path)
    assert c.ok, c.diagnostics
    assert c.plan is not None and any(i.op == "wait" for i in c.plan.instrs)
    base = os.path.dirname(path)
    res = train(c, TrainOptions(backend="cpu", max_steps=2, progress=False), base_dir=base)
    assert res.steps == 2
    assert res.races == []
    (rec,) = res.history
    assert math.isfinite(rec["train_loss"])
    # The reported test loss and accuracy are those of the final weights on the test split.
    ds = load_dataset(*DATA.get(name, ("digits", (), {"test": 0.2, "seed": 0})), base_dir=base)
    p = {k: v.astype(np.float64) for k, v in res.params.items()}
    x = ds.x_test if ds.kind == "text" else ds.x_test.astype(np.float64)
    z = FORWARD[name](p, x)
    labels = ds.y_test.reshape(-1)  # one per row of z: a sample's, or every token's
    zs = z - z.max(axis=1, keepdims=True)
    want_loss = float((np.log(np.exp(zs).sum(axis=1)) - zs[np.arange(len(z)), labels]).mean())
    want_acc = float((z.argmax(axis=1) == labels).mean())
    assert rec["test_loss"] == pytest.approx(want_loss, rel=1e-6)
    assert rec["test_acc"] == want_acc
    if ds.kind == "text":
        assert rec["test_bpb"] == pytest.approx(want_loss / math.log(2), rel=1e-6)
    # The steps updated every weight (a weight with no gradient would sit still; a conv bias
    # before a batch norm may, its gradient is zero up to rounding).
    init = train(c, TrainOptions(backend="cpu", max_steps=0, progress=False), base_dir=base)
    still = [n for n in c.program.model.params
             if res.params[n].ndim >= 2 and np.array_equal(res.params[n], init.params[n])]
    assert still == []
