"""examples/gpt_text.sched as numbers: its losses are those of an independent NumPy GPT
(tests/gpt_reference.py) on the very batches the run drew, its whole backward pass (every fork,
every fan-out sum) is the gradient of that GPT by central finite differences, clipping by global
norm scales every gradient by one factor to the global norm asked, and the step forks as the
issue asks (the Q, K, V GEMMs independent, attention one fused launch each way, layer norm's
dgamma, dbeta, dx on three streams; attention in pieces forks its backward); attention written as its three pieces with dropout on the
probabilities trains as the fused op at p = 0 and evaluates without dropout.  A slow test (`pytest -m slow`) trains the example for its configured
run and compares its test bits per byte with a byte-bigram model counted here."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from gpt_reference import gpt_loss
from streamsched.interp.data import Batches, load_dataset
from streamsched.interp.train import TrainOptions, init_params, train
from streamsched.pipeline import compile_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "gpt_text.sched")
SRC = open(EXAMPLE, encoding="utf-8").read()
OPTIMIZE = SRC[SRC.index("graph optimize"):SRC.index("step train")]
DATA = ("text", ("<python-stdlib>",), {"context": 64, "test": 0.02})
BATCH = 16


@pytest.fixture(scope="module")
def ds():
    return load_dataset(*DATA, base_dir=ROOT)


def _batch(ds, k, seed=0, batch=BATCH):
    """The windows step k (from 0) of epoch 1 trains on, as the run draws them."""
    b = Batches(ds.x_train, ds.y_train, batch, seed, epoch_samples=ds.epoch_samples)
    sel = b.order(0)[k * batch:(k + 1) * batch]
    return ds.x_train[sel], ds.y_train[sel]


def _f64(params):
    return {k: v.astype(np.float64) for k, v in params.items()}


HEADER = "model gpt(batch = 16, context = 64, width = 64, heads = 4, hidden = 256)"
SMALL = "model gpt(batch = 2, context = 16, width = 16, heads = 2, hidden = 32)"


def _small(tmp_path, optimize: str):
    """The example's very model lines and step at a small size (so that finite differences over
    the whole model are quick), with another optimizer graph."""
    assert HEADER in SRC and 'context = 64, test = 0.02' in SRC
    text = SRC.replace(OPTIMIZE, optimize + "\n\n").replace(HEADER, SMALL)
    p = tmp_path / "gpt_small.sched"
    p.write_text(text.replace("context = 64, test = 0.02", "context = 16, test = 0.02"))
    c = compile_file(str(p))
    assert c.ok, c.diagnostics
    return c


def _run(c, steps, base, **kw):
    return train(c, TrainOptions(backend="cpu", max_steps=steps, progress=False, eval_every=1000, **kw),
                 base_dir=base)


def test_the_example_checks_clean():
    assert OPTIMIZE.count("adamw(") == 1 and "clip_grad_norm" in OPTIMIZE
    c = compile_file(EXAMPLE)
    assert c.ok, c.diagnostics


def test_step_losses_are_those_of_an_independent_gpt_on_the_drawn_batches(ds):
    """Step k's loss is computed from the parameters after k - 1 AdamW steps (with clipping) on
    batch k: both recomputed here, the parameters by the run itself, the loss independently."""
    c = compile_file(EXAMPLE)
    base = os.path.dirname(EXAMPLE)
    p0 = _f64(init_params(c.program, 0))
    r1 = _run(c, 1, base)
    x, y = _batch(ds, 0)
    assert r1.history[0]["train_loss"] == pytest.approx(gpt_loss(p0, x, y), rel=1e-6)
    r3, r4 = _run(c, 3, base), _run(c, 4, base)
    loss4 = 4 * r4.history[0]["train_loss"] - 3 * r3.history[0]["train_loss"]
    x, y = _batch(ds, 3)
    assert loss4 == pytest.approx(gpt_loss(_f64(r3.params), x, y), rel=1e-5)
    assert loss4 < r1.history[0]["train_loss"]  # it learns


def _sgd_gradient(tmp_path, optimize):
    """The gradient the run applied in its first step, recovered from one SGD step at lr 1
    (g = w0 - w1; f32 rounding of w0 - g leaves an error of at most an ulp of w)."""
    c = _small(tmp_path, optimize)
    w0 = init_params(c.program, 0)
    w1 = _run(c, 1, str(tmp_path), lr=1.0).params
    return {n: w0[n].astype(np.float64) - w1[n].astype(np.float64) for n in c.program.model.params}, w0


def test_the_whole_backward_is_the_gradient_of_an_independent_gpt(tmp_path):
    g, w0 = _sgd_gradient(tmp_path, "graph optimize on update { sgd(gpt, lr, momentum = 0.0) }")
    p = _f64(w0)
    x, y = _batch(load_dataset("text", ("<python-stdlib>",), {"context": 16, "test": 0.02}, base_dir=ROOT),
                  0, batch=2)
    rng = np.random.default_rng(5)
    checked = 0
    for name in g:  # six coordinates of every parameter, by central differences in float64
        flat = p[name].reshape(-1)
        for i in rng.choice(flat.size, min(6, flat.size), replace=False):
            if name == "tok.table":  # a row of a byte the batch holds
                d = p[name].shape[1]
                i = int(rng.choice(x.reshape(-1))) * d + int(rng.integers(d))
            old, eps = flat[i], 1e-5  # the layer norms of tiny embeddings curve sharply
            flat[i] = old + eps
            lp = gpt_loss(p, x, y, heads=2)
            flat[i] = old - eps
            lm = gpt_loss(p, x, y, heads=2)
            flat[i] = old
            want = (lp - lm) / (2 * eps)
            got = g[name].reshape(-1)[i]
            assert got == pytest.approx(want, rel=2e-3, abs=2e-6 + 2e-7 * abs(float(old))), (name, i)
            checked += 1
    assert checked == 6 * len(g)
    # a byte no window of the batch holds gets no gradient, and nothing else moved it
    unseen = np.setdiff1d(np.arange(256), x)
    assert not g["tok.table"][unseen].any()


def test_weight_tying_trains_one_table_with_the_sum_of_both_gradients(tmp_path):
    """`logits = unembed(nf, table = tok.table)`: one parameter (no `logits.*`), its gradient that
    of the tied GPT by central differences, rows of unseen bytes included (the output
    projection reaches every row); one SGD step moves the embedding and the projection as one."""
    sgd = "graph optimize on update { sgd(gpt, lr, momentum = 0.0) }"
    text = SRC.replace(OPTIMIZE, sgd + "\n\n").replace(HEADER, SMALL)
    text = text.replace("    logits = linear(nf, 256)", "    logits = unembed(nf, table = tok.table)")
    assert "unembed" in text
    path = tmp_path / "tied.sched"
    path.write_text(text.replace("context = 64, test = 0.02", "context = 16, test = 0.02"))
    c = compile_file(str(path))
    assert c.ok, c.diagnostics
    assert "tok.table" in c.program.model.params and not any(n.startswith("logits") for n in c.program.model.params)
    w0 = init_params(c.program, 0)
    w1 = _run(c, 1, str(tmp_path), lr=1.0).params
    g = w0["tok.table"].astype(np.float64) - w1["tok.table"].astype(np.float64)
    p = _f64(w0)
    x, y = _batch(load_dataset("text", ("<python-stdlib>",), {"context": 16, "test": 0.02}, base_dir=ROOT),
                  0, batch=2)
    unseen = np.setdiff1d(np.arange(256), x)
    rng = np.random.default_rng(7)
    d = p["tok.table"].shape[1]
    rows = list(rng.choice(x.reshape(-1), 4)) + list(rng.choice(unseen, 4))
    flat = p["tok.table"].reshape(-1)
    for r in rows:
        i = int(r) * d + int(rng.integers(d))
        old, eps = flat[i], 1e-5
        flat[i] = old + eps
        lp = gpt_loss(p, x, y, heads=2)
        flat[i] = old - eps
        lm = gpt_loss(p, x, y, heads=2)
        flat[i] = old
        want = (lp - lm) / (2 * eps)
        assert g.reshape(-1)[i] == pytest.approx(want, rel=2e-3, abs=2e-6 + 2e-7 * abs(float(old))), (r, i)
    assert np.abs(g[unseen]).max() > 0  # the projection's share reaches bytes the input never saw


def test_clipping_scales_every_gradient_by_one_factor_to_the_global_norm(tmp_path):
    g, _ = _sgd_gradient(tmp_path, "graph optimize on update { sgd(gpt, lr, momentum = 0.0) }")
    clipped, _ = _sgd_gradient(tmp_path, """graph optimize on update {
    clear gnorm
    grad_sumsq(gpt, gnorm)
    clip_scale(gnorm, clip, max_norm = 0.01)
    clip_grad_norm(gpt, clip)
    sgd(gpt, lr, momentum = 0.0)
}""")
    norm = math.sqrt(sum(float((v * v).sum()) for v in g.values()))
    assert norm > 0.01  # so the clipping acts
    factor = 0.01 / (norm + 1e-6)
    for name in g:
        np.testing.assert_allclose(clipped[name], g[name] * factor, rtol=1e-3,
                                   atol=1e-7 * max(1.0, float(np.abs(g[name]).max())))
    total = math.sqrt(sum(float((v * v).sum()) for v in clipped.values()))
    assert total == pytest.approx(0.01, rel=1e-3)


def _reaches(edges, n):
    """reach[u] = the tasks ordered after task u (the transitive closure of the edges)."""
    succ = [[] for _ in range(n)]
    for e in edges:
        succ[e.u].append(e.v)
    reach = [set() for _ in range(n)]
    for u in reversed(range(n)):  # edges go from earlier to later tasks
        for v in succ[u]:
            reach[u] |= {v} | reach[v]
    return reach


def test_the_step_forks_as_a_transformer_step_should():
    c = compile_file(EXAMPLE, fuse=False)  # the tasks as written (the fused plan: below)
    tasks = c.schedule.tasks
    assert [t.id for t in tasks] == list(range(len(tasks)))
    reach = _reaches(c.edges, len(tasks))

    def one(label):
        (t,) = [t for t in tasks if t.step == 0 and t.label == f"pass[a]: {label}"]
        return t

    for i in (1, 2):
        # the Q, K, V projections: three GEMMs of one input on three streams, none ordered
        # after another, so they can run at once
        proj = [one(f"linear@{x}{i}") for x in "qkv"]
        assert {t.kernel for t in proj} == {"matmul"} and len({t.stream for t in proj}) == 3
        assert not any(b.id in reach[a.id] for a in proj for b in proj)
        # attention: one fused launch forward (y and p), one backward (dq, dk and dv)
        fwd, bwd = one(f"attention@a{i}.y"), one(f"attention.backward@a{i}.dq")
        assert (fwd.kernel, bwd.kernel) == ("attn_fused", "attn_fused_grad") and len(bwd.outs) == 3
        for ln in (f"n{i}", f"m{i}"):  # layer norm's backward: dx, dgamma, dbeta on three streams
            parts = [one(f"layernorm.backward@{ln}.{o}") for o in ("dx", "dgamma", "dbeta")]
            assert len({t.stream for t in parts}) == 3
            assert not any(b.id in reach[a.id] for a in parts for b in parts)
    # clipping on the update stream, in order: every squared norm, the factor, every scaling,
    # then every AdamW update
    opt = [t for t in tasks if t.step == 0 and t.label.startswith("optimize:")]
    kinds = [t.kernel for t in opt if t.kernel != "fill"]
    n = len(c.program.model.params)
    assert kinds == ["grad_sumsq"] * n + ["clip_scale"] + ["scale_grad"] * n + ["adamw_step"] * n
    assert {t.stream for t in opt} == {"update"}
    # fused, the same order in four launches after the clear: one per run of per-parameter tasks
    f = compile_file(EXAMPLE)
    fk = [(t.kernel, t.attr("base"), len(t.attr("parts") or ())) for t in f.schedule.tasks
          if t.step == 0 and t.label.startswith("optimize:") and t.kernel != "fill"]
    assert fk == [("multi_tensor", "grad_sumsq", n), ("clip_scale", None, 0), ("multi_tensor", "scale_grad", n),
                  ("multi_tensor", "adamw_step", n)]


@pytest.mark.slow
def test_training_beats_a_byte_bigram_model(ds):
    """The example's configured run (its two epochs, a few minutes on a CPU): the test bits per
    byte well below a byte-bigram model's, counted here from the training bytes (add-0.1
    smoothing) and scored on the same test windows."""
    c = compile_file(EXAMPLE)
    res = train(c, TrainOptions(backend="cpu", progress=False), base_dir=os.path.dirname(EXAMPLE))
    bpb = res.history[-1]["test_bpb"]
    train_bytes = np.concatenate([ds.x_train[0], ds.y_train[:, -1]])
    counts = np.zeros((256, 256))
    np.add.at(counts, (train_bytes[:-1], train_bytes[1:]), 1.0)
    prob = (counts + 0.1) / (counts.sum(axis=1, keepdims=True) + 25.6)
    bigram = float(-np.log2(prob[ds.x_test.reshape(-1), ds.y_test.reshape(-1)]).mean())
    print(f"\ngpt_text: test {bpb:.4f} bits per byte after {res.steps} steps in {res.wall_s:.0f} s; "
          f"byte bigram {bigram:.4f}")
    assert bpb < bigram - 0.5


FUSED = "    a1     = attention(q1, k1, v1, heads = heads, context = context)\n"
PIECES = """    s1     = attention_scores(q1, k1, heads = heads, context = context)
    w1     = softmax(s1)
    d1     = dropout(w1, p = P)
    a1     = attention_apply(d1, v1)
"""


def _pieces(tmp_path, p: float, name: str):
    assert FUSED in SRC
    text = SRC.replace(OPTIMIZE, "graph optimize on update { sgd(gpt, lr, momentum = 0.0) }\n\n")
    text = text.replace(HEADER, SMALL).replace("context = 64, test = 0.02", "context = 16, test = 0.02")
    path = tmp_path / name
    path.write_text(text.replace(FUSED, PIECES.replace("P", repr(p))) if p is not None else text)
    c = compile_file(str(path))
    assert c.ok, c.diagnostics
    return c


def test_attention_in_pieces_with_dropout_on_the_probabilities(tmp_path):
    """The three attention ops with dropout between softmax and the weighted sum: with p = 0 they
    train exactly as the fused `attention` op; with p = 0.5 the mask changes the step, and
    evaluation (dropout the identity) sees the weights alone."""
    fused = _pieces(tmp_path, None, "fused.sched")
    zero = _pieces(tmp_path, 0.0, "zero.sched")
    half = _pieces(tmp_path, 0.5, "half.sched")
    a, b = _run(fused, 2, str(tmp_path), lr=0.1), _run(zero, 2, str(tmp_path), lr=0.1)
    assert a.history[0]["train_loss"] == b.history[0]["train_loss"]
    for n in fused.program.model.params:
        np.testing.assert_array_equal(a.params[n], b.params[n])
    r = train(half, TrainOptions(backend="cpu", max_steps=2, progress=False, lr=0.1), base_dir=str(tmp_path))
    assert r.history[0]["train_loss"] != a.history[0]["train_loss"]
    assert not np.array_equal(r.params["q1.w"], a.params["q1.w"])
    ds16 = load_dataset("text", ("<python-stdlib>",), {"context": 16, "test": 0.02}, base_dir=ROOT)
    from gpt_reference import cross_entropy_sum, gpt_logits
    p = _f64(r.params)
    z = np.concatenate([gpt_logits(p, ds16.x_test[i:i + 256], heads=2) for i in range(0, len(ds16.x_test), 256)])
    want = cross_entropy_sum(z, ds16.y_test.reshape(-1)) / ds16.y_test.size
    assert r.history[0]["test_loss"] == pytest.approx(want, rel=1e-6)


def test_attention_in_pieces_forks_its_backward(tmp_path):
    """Written as its three ops, attention's backward forks: dv (comp2) beside dp (comp1), then
    dk (comp1) beside dq (comp3), neither of a pair ordered after the other."""
    c = _pieces(tmp_path, 0.0, "pieces.sched")
    tasks = c.schedule.tasks
    reach = _reaches(c.edges, len(tasks))

    def one(label):
        (t,) = [t for t in tasks if t.step == 0 and t.label == f"pass[a]: {label}"]
        return t

    for pair in (("attention_apply.backward@a1.dv", "attention_apply.backward@a1.dp"),
                 ("attention_scores.backward@s1.dk", "attention_scores.backward@s1.dq")):
        a, b = (one(x) for x in pair)
        assert a.stream != b.stream and a.id not in reach[b.id] and b.id not in reach[a.id], pair


def test_attention_needs_its_heads_and_context(tmp_path):
    from streamsched.diagnostics import StreamschedError

    p = tmp_path / "no_heads.sched"
    p.write_text(SRC.replace(FUSED, "    a1     = attention(q1, k1, v1, context = context)\n"))
    with pytest.raises(StreamschedError) as e:
        compile_file(str(p))
    (d,) = e.value.diagnostics
    assert d.code == "S005" and "needs the dimension `heads`" in d.message
    p.write_text(SRC.replace(FUSED, "    a1     = attention(q1, k1, v1, heads = 3, context = context)\n"))
    with pytest.raises(StreamschedError) as e:
        compile_file(str(p))
    (d,) = e.value.diagnostics
    assert d.code == "S003" and "64 does not split into 3 heads" in d.message and d.span.line == SRC[:SRC.index(FUSED)].count("\n") + 1
