"""The training loop computes the numbers it reports: a small perceptron trained by `train` on a
hand-made data set is retrained here by an independent NumPy loop (its own batch order,
forward, backward, SGD with momentum and learning-rate formula), and every parameter after every
step, every epoch's `train_loss`, `lr`, `test_loss` and `test_acc` must agree; the initial
weights follow the distributions `init_params` documents (moments and bounds, checked tightly on
large draws with a fixed seed).

What the independent loop follows, besides its own arithmetic: Batches' documented order (epoch
e permutes the training set with `np.random.default_rng([seed, e])`, drop_last), SGD as
torch.optim.SGD (v = mu v + g, w -= lr v) and the `step` schedule lr(t) = v * gamma ** (t // N).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from streamsched.interp.train import TrainOptions, init_params, train
from streamsched.pipeline import compile_file

SRC = """\
# values.sched: a two-layer perceptron whose training the tests recompute.
# Run it: streamsched run values.sched

streams {
    trans  : copy
    comp1  : compute
    comp2  : compute
    comp3  : compute
    update : update
}

model mlp(batch = 32, hidden = 16) {
    input x : f32[batch, 12]
    input y : i32[batch]
    h1     = linear(x, hidden)
    a1     = relu(h1)
    logits = linear(a1, 5)
    loss   = softmax_cross_entropy(logits, y)
}

graph load[a, b] on trans  { copy batch -> x, y }
graph zero_grad  on update { clear grad(mlp) }
graph pass       on comp1  { forward mlp; backward mlp }
graph optimize   on update { sgd(mlp, lr, momentum = MOMENTUM) }

step train(slot) {
    upload lr on trans
    zero_grad
    pass(load[slot])
    load[next]
    optimize
}

train {
    model    = mlp
    data     = npz("values.npz")
    epochs   = EPOCHS
    lr       = LR
    seed     = 3
    capture  = CAPTURE
}
"""

SEED = 3
BATCH = 32
N_TRAIN, N_TEST = 100, 50  # 3 steps per epoch (4 samples sit out); the test set pads its last chunk
LR_V, LR_GAMMA = 0.4, 0.8  # step(0.4, every = 1, gamma = 0.8): a new rate every step
MOMENTUM = 0.5


def _dataset(path) -> dict[str, np.ndarray]:
    """Five Gaussian classes in 12 dimensions, overlapping enough that the test set is not
    learned perfectly; the train and test sets differ (sizes and samples)."""
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(5, 12))

    def make(n):
        y = rng.integers(0, 5, n)
        return (centers[y] + rng.normal(size=(n, 12))).astype(np.float32), y.astype(np.int32)

    (xtr, ytr), (xte, yte) = make(N_TRAIN), make(N_TEST)
    np.savez(path, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    return {"x_train": xtr, "y_train": ytr, "x_test": xte, "y_test": yte}


def _compile(tmp_path, epochs=3, lr=f"step({LR_V}, every = 1, gamma = {LR_GAMMA})", capture="step",
             momentum=MOMENTUM):
    text = (SRC.replace("EPOCHS", str(epochs)).replace("LR", lr).replace("CAPTURE", capture)
            .replace("MOMENTUM", str(momentum)))
    path = tmp_path / "values.sched"
    path.write_text(text)
    data = _dataset(tmp_path / "values.npz")
    c = compile_file(str(path))
    assert c.ok, c.diagnostics
    return c, data


# -- the independent loop ----------------------------------------------------------------------

def _forward(p, x):
    """f32, in the kernels' order: h = x W1 + b1, a = relu(h), z = a W2 + b2."""
    h = x @ p["h1.w"] + p["h1.b"]
    a = np.maximum(h, np.float32(0))
    return h, a, a @ p["logits.w"] + p["logits.b"]


def _log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _eval(p, x, y):
    """Mean cross-entropy (in f64) and accuracy over the whole set, from the weights."""
    z = _forward({k: v.astype(np.float64) for k, v in p.items()}, x.astype(np.float64))[2]
    return float(-_log_softmax(z)[np.arange(len(y)), y].mean()), float((z.argmax(axis=1) == y).mean())


def _retrain(p0, data, steps, lr_of, momentum):
    """Parameters after each step, and each step's training loss; p0: initial parameters."""
    x, y = data["x_train"], data["y_train"]
    spe = len(x) // BATCH
    p = {k: p0[k].copy() for k in ("h1.w", "h1.b", "logits.w", "logits.b")}
    v = {k: np.zeros_like(w) for k, w in p.items()}
    after, losses = [], []
    for t in range(steps):
        e, i = divmod(t, spe)
        sel = np.random.default_rng([SEED, e]).permutation(len(x))[i * BATCH:(i + 1) * BATCH]
        xb, yb = x[sel], y[sel]
        h, a, z = _forward(p, xb)
        lp = _log_softmax(z)
        losses.append(float(-lp[np.arange(BATCH), yb].mean()))
        dz = np.exp(lp)
        dz[np.arange(BATCH), yb] -= 1
        dz = dz * np.float32(1.0 / BATCH)
        g = {"logits.w": a.T @ dz, "logits.b": dz.sum(axis=0)}
        dh = (dz @ p["logits.w"].T) * (h > 0)
        g["h1.w"], g["h1.b"] = xb.T @ dh, dh.sum(axis=0)
        lr = float(np.float32(lr_of(t)))  # the rate lives in an f32 device scalar
        for k in p:
            v[k] = (momentum * v[k] + g[k]).astype(np.float32) if momentum else g[k]
            p[k] = (p[k] - lr * v[k]).astype(np.float32)
        after.append({k: w.copy() for k, w in p.items()})
    return after, losses


def _lr(t: int) -> float:
    return LR_V * LR_GAMMA ** t


def _close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=what)


# -- the tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("capture,interleave", [("step", "fixed"), ("none", "random"), ("graphs", "random")])
def test_every_step_uses_its_own_learning_rate_and_the_report_is_recomputed(tmp_path, capture, interleave):
    c, data = _compile(tmp_path, capture=capture)
    run = lambda **kw: train(c, TrainOptions(backend="cpu", progress=False, interleave=interleave,
                                             interleave_seed=5, **kw), base_dir=str(tmp_path))
    p0 = run(max_steps=0).params
    spe, epochs = N_TRAIN // BATCH, 3
    want, losses = _retrain(p0, data, spe * epochs, _lr, MOMENTUM)
    # The parameters after each of the first steps: step k must use lr(k), not lr(k +- 1).
    for k in (1, 2, 4):
        got = run(max_steps=k)
        assert got.races == []
        for name, w in want[k - 1].items():
            _close(got.params[name], w, f"{name} after {k} steps")
    res = run()
    assert res.races == [] and res.steps == spe * epochs
    for name, w in want[-1].items():
        _close(res.params[name], w, f"{name} after training")
    assert len(res.history) == epochs  # one record per epoch, in order
    for e, rec in enumerate(res.history):
        assert rec["train_loss"] == pytest.approx(np.mean(losses[e * spe:(e + 1) * spe]), rel=1e-5), e
        assert rec["lr"] == pytest.approx(_lr((e + 1) * spe - 1), rel=1e-12), e  # the epoch's last step
        # Evaluated on the test split, from the weights at the end of the epoch.
        tl, acc = _eval(want[(e + 1) * spe - 1], data["x_test"], data["y_test"])
        assert rec["test_loss"] == pytest.approx(tl, rel=1e-5), e
        assert rec["test_acc"] == acc, e
    tl, acc = _eval(res.params, data["x_test"], data["y_test"])
    assert (res.history[-1]["test_loss"], res.final_accuracy) == (pytest.approx(tl, rel=1e-6), acc)
    # ...which is not what the training split gives (so evaluating the wrong split shows).
    tl_train, acc_train = _eval(res.params, data["x_train"], data["y_train"])
    assert abs(tl_train - tl) > 1e-2


def test_warmup_rates_reach_the_weights(tmp_path):
    """cosine with warmup: the first steps' rates are v/W, 2v/W, ...; a rate one step ahead or
    behind changes the first update by a factor of 2 or more."""
    c, data = _compile(tmp_path, epochs=2, lr="cosine(0.3, warmup = 4)", momentum=0.0)
    total = 2 * (N_TRAIN // BATCH)

    def lr(t):
        if t < 4:
            return 0.3 * (t + 1) / 4
        return 0.3 * (1 + math.cos(math.pi * min(1.0, (t - 4) / (total - 4)))) / 2

    p0 = train(c, TrainOptions(backend="cpu", progress=False, max_steps=0), base_dir=str(tmp_path)).params
    want, _ = _retrain(p0, data, total, lr, 0.0)
    res = train(c, TrainOptions(backend="cpu", progress=False), base_dir=str(tmp_path))
    for name, w in want[-1].items():
        _close(res.params[name], w, name)
    assert [r["lr"] for r in res.history] == [pytest.approx(lr(2)), pytest.approx(lr(5), abs=1e-12)]


# -- initial weights -------------------------------------------------------------------------------

INIT_SRC = """\
streams { comp1 : compute  update : update }
op dense_INIT(x : f32[n, k], param w : f32[k, units] = INIT) -> y on comp1 {
    y = matmul(x, w)
}
op dense_INIT.backward(dy, x, w) -> (dx, dw) on comp1 {
    dw = matmul(x^T, dy)
    dx = matmul(dy, w^T)
}
"""


def _program(tmp_path, init: str, k: int, units: int):
    """A model with one weight f32[k, units] initialised by `init` (the stdlib's linear for
    glorot, a user op for the others)."""
    if init == "glorot":
        ops, line = "", f"h = linear(x, {units})"
    else:
        ops, line = INIT_SRC.replace("INIT", init), f"h = dense_{init}(x, {units})"
    text = (ops if ops else "streams { comp1 : compute  update : update }\n") + f"""
model m(batch = 4) {{
    input x : f32[batch, {k}]
    input y : i32[batch]
    {line}
    loss = softmax_cross_entropy(h, y)
}}
"""
    path = tmp_path / f"{init}.sched"
    path.write_text(text)
    c = compile_file(str(path))
    assert c.ok, c.diagnostics
    return c.program


# fan_in = k = 400 rows, fan_out = units = 500 columns: swapping them, or a limit off by sqrt(2),
# moves every statistic far outside its tolerance (200,000 draws: the sample moments are within
# a fraction of a percent of the truth; the seed is fixed, so the test is deterministic).
K, UNITS = 400, 500
CASES = {
    # init: (distribution, scale) with scale the std of a normal, the half-width of a uniform
    "glorot": ("uniform", math.sqrt(6.0 / (K + UNITS))),
    "uniform": ("uniform", math.sqrt(6.0 / (K + UNITS))),
    "he": ("normal", math.sqrt(2.0 / K)),
    "normal": ("normal", 0.01),
}


@pytest.mark.parametrize("init", list(CASES))
def test_initial_weights_follow_the_documented_distribution(tmp_path, init):
    prog = _program(tmp_path, init, K, UNITS)
    name = next(n for n, i in prog.inits if i == init)
    w = init_params(prog, 0)[name]
    assert w.shape == (K, UNITS) and w.dtype == np.float32
    w = w.astype(np.float64).ravel()
    dist, scale = CASES[init]
    std = w.std()
    kurt = float(((w - w.mean()) ** 4).mean() / std ** 4) - 3.0  # excess kurtosis
    assert abs(w.mean()) < 0.01 * scale
    if dist == "uniform":
        # U(-l, l): std l / sqrt(3), excess kurtosis -1.2, every draw inside (-l, l), the extremes
        # within a hair of the bounds.
        assert std == pytest.approx(scale / math.sqrt(3.0), rel=0.01)
        assert kurt == pytest.approx(-1.2, abs=0.03)
        assert np.abs(w).max() <= scale * (1 + 1e-6)
        assert np.abs(w).max() >= scale * 0.999
    else:
        # N(0, s): std s, excess kurtosis 0, tails past 4 s (about 13 of 200,000 draws beyond).
        assert std == pytest.approx(scale, rel=0.01)
        assert kurt == pytest.approx(0.0, abs=0.05)
        assert np.abs(w).max() > 4 * scale
    # Deterministic in the seed, different across seeds.
    assert np.array_equal(init_params(prog, 0)[name], init_params(prog, 0)[name])
    assert not np.array_equal(init_params(prog, 0)[name], init_params(prog, 1)[name])


def test_biases_and_zero_init_are_zero_and_named_state_starts_where_declared(tmp_path):
    prog = _program(tmp_path, "glorot", 6, 3)
    p = init_params(prog, 0)
    assert np.array_equal(p["h.b"], np.zeros(3, np.float32))
    assert float(p["d(loss)"]) == 1.0  # the backward's seed


def test_he_for_a_conv_weight_uses_the_receptive_field_fan_in(tmp_path):
    path = tmp_path / "conv.sched"
    path.write_text("""\
streams { comp1 : compute  comp2 : compute  comp3 : compute  update : update }
model m(batch = 2) {
    input x : f32[batch, 8, 8, 64]
    input y : i32[batch]
    c = conv2d(x, size = 3, k = 256, pad = 1)
    f = flatten(c)
    logits = linear(f, 10)
    loss = softmax_cross_entropy(logits, y)
}
""")
    c = compile_file(str(path))
    assert c.ok, c.diagnostics
    w = init_params(c.program, 0)["c.w"]
    assert w.shape == (3, 3, 64, 256)
    assert w.std() == pytest.approx(math.sqrt(2.0 / (3 * 3 * 64)), rel=0.01)
