"""The transformer kernels (stdlib/kernels/transformer.py) against trusted references: every
backward kernel against central finite differences in float64, attention against a per-head loop
written from the definition, AdamW and clipping against hand-written PyTorch formulas, the
embedding scatter-add against an exact sum (math.fsum) and for bitwise independence of the order
of duplicate ids, in-place and arena aliasing, type rules."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streamsched.stdlib.kernels.transformer as kt
from kernel_helpers import (alias_cases, assert_output_may_be_input, assert_runs_in_one_arena,  # noqa: F401
                            close, num_grad, run, run1)
from streamsched.stdlib.kernel_record import KernelTypeError
from streamsched.stdlib.kernels import FAMILIES, KERNELS, infer_types, kernel


def _f(*shape, seed=0, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape) * scale


def _ids(n, vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def _loss(out, r):
    """sum(r * out) over the finite entries (the masked -inf scores carry no gradient)."""
    fin = np.isfinite(out)
    return float(np.where(fin, out * r, 0.0).sum())


# ---------------------------------------------------------------------------------------------
# The registry


def test_every_transformer_kernel_is_registered_complete_and_documented():
    doc = (Path(__file__).parents[1] / "docs" / "kernels.md").read_text()
    assert len(kt.TRANSFORMER_KERNELS) == 21
    for name in kt.TRANSFORMER_KERNELS:
        k = KERNELS[name]
        assert k.name == name and k.doc and k.cpu is not None and not k.host and k.capturable, name
        assert k.cuda == f"streamsched.stdlib.kernels.transformer:{name}_cuda"
        assert k is kt.FAMILY.kernels[name]
        assert f"| `{name}` |" in doc, f"docs/kernels.md lacks a row for {name}"
    assert kt.TRANSFORMER_KERNELS == tuple(kt.FAMILY.kernels)
    assert kt.FAMILY in FAMILIES


def test_every_transformer_kernel_names_a_cuda_twin_without_importing_cupy():
    from streamsched.stdlib.kernels import cuda_twin

    had = "cupy" in sys.modules
    for name in kt.TRANSFORMER_KERNELS:
        assert cuda_twin(KERNELS[name]) is getattr(kt, f"{name}_cuda"), name
    assert {n[:-len("_cuda")] for n in vars(kt) if n.endswith("_cuda") and callable(getattr(kt, n))} \
        == set(kt.TRANSFORMER_KERNELS)
    assert had or "cupy" not in sys.modules


# ---------------------------------------------------------------------------------------------
# Embeddings


def test_embedding_gathers_rows_and_its_gradient_matches_finite_differences():
    table = _f(7, 3)
    ids = np.array([[1, 4, 1], [0, 6, 4]], np.int32)  # duplicates, a [b, t] shape
    y = run1("embedding", [ids, table])
    np.testing.assert_array_equal(y, table[ids.reshape(-1)])
    r = _f(6, 3, seed=1)
    dt = run1("embedding_grad", [r, ids], {"vocab": 7})
    close(dt, num_grad(lambda: _loss(run1("embedding", [ids, table]), r), table))
    assert not dt[[2, 3, 5]].any()  # rows no id names get nothing


def test_embedding_rejects_ids_outside_the_table():
    with pytest.raises(ValueError, match=r"id 9 at index 1 is out of range for a table of 7 rows"):
        run1("embedding", [np.array([0, 9], np.int32), _f(7, 3)])
    with pytest.raises(ValueError, match=r"id -1"):
        run1("embedding_grad", [_f(2, 3), np.array([-1, 0], np.int64)], {"vocab": 7})


def test_embedding_grad_is_the_exact_sum_rounded_once():
    """For f32 gradients the fixed-point sum is exact: the result is the float64 rounding of the
    exact sum (math.fsum is correctly rounded), then f32's."""
    rng = np.random.default_rng(3)
    n, vocab, d = 300, 5, 4
    ids = rng.integers(0, vocab, n).astype(np.int32)
    dy = (rng.standard_normal((n, d)) * np.exp(rng.uniform(-8, 8, (n, 1)))).astype(np.float32)
    got = run1("embedding_grad", [dy, ids], {"vocab": vocab})
    assert got.dtype == np.float32
    for v in range(vocab):
        for c in range(d):
            want = np.float32(math.fsum(float(a) for a in dy[ids == v, c]))
            assert got[v, c] == want, (v, c)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 60), st.integers(1, 6), st.integers(0, 2**32 - 1), st.sampled_from([np.float32, np.float64]))
def test_embedding_grad_is_bitwise_independent_of_the_order_of_duplicates(n, vocab, seed, dtype):
    """Metamorphic: permuting the rows of (dy, ids) together never changes a bit, over values
    of wildly different magnitudes (where float addition is far from associative)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, n).astype(np.int64)
    dy = (rng.standard_normal((n, 3)) * 10.0 ** rng.integers(-12, 12, (n, 3))).astype(dtype)
    perm = rng.permutation(n)
    a = run1("embedding_grad", [dy, ids], {"vocab": vocab})
    b = run1("embedding_grad", [dy[perm].copy(), ids[perm].copy()], {"vocab": vocab})
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    # and it is the sum, to float64 accuracy relative to the largest term
    ref = np.zeros((vocab, 3))
    np.add.at(ref, ids, dy.astype(np.float64))
    big = np.zeros((vocab, 3))
    np.maximum.at(big, ids, np.abs(dy.astype(np.float64)))
    assert np.all(np.abs(a - ref) <= big * 2.0 ** -20 + np.abs(ref) * np.finfo(dtype).eps)


def test_embedding_grad_propagates_nonfinite_values_like_a_sum():
    dy = np.array([[1.0, np.inf, np.nan, np.inf], [2.0, 1.0, 1.0, -np.inf], [4.0, 0.0, 0.0, 0.0]])
    ids = np.array([0, 0, 1])
    got = run1("embedding_grad", [dy, ids], {"vocab": 2})
    np.testing.assert_array_equal(got[0], [3.0, np.inf, np.nan, np.nan])
    np.testing.assert_array_equal(got[1], [4.0, 0.0, 0.0, 0.0])


def test_segment_sum_of_signed_zeros_and_single_values_is_exact():
    v = np.array([[-0.0], [-0.0], [5e-324], [1e300]])
    got = kt.segment_sum(v, np.array([0, 0, 1, 2]), 4)
    assert np.signbit(got[0, 0]) is np.False_ or got[0, 0] == 0.0  # -0 + -0: a zero either way
    assert got[1, 0] == 5e-324 and got[2, 0] == 1e300 and got[3, 0] == 0.0


def test_pos_embedding_adds_the_table_per_sequence_and_its_gradient_sums_the_batch():
    x, table = _f(6, 4), _f(3, 4, seed=1)
    y = run1("pos_embedding", [x, table])
    close(y, x + np.tile(table, (2, 1)), 0)
    r = _f(6, 4, seed=2)
    dt = run1("pos_embedding_grad", [r], {"context": 3})
    close(dt, num_grad(lambda: _loss(run1("pos_embedding", [x, table]), r), table))
    close(r, num_grad(lambda: _loss(run1("pos_embedding", [x, table]), r), x))  # dx = dy
    # summed sequence by sequence in float64, rounded once
    r32 = r.astype(np.float32)
    want = ((r32[:3].astype(np.float64) + r32[3:].astype(np.float64))).astype(np.float32)
    np.testing.assert_array_equal(run1("pos_embedding_grad", [r32], {"context": 3}), want)


# ---------------------------------------------------------------------------------------------
# Layer norm


def test_layernorm_matches_its_definition_and_its_gradients_finite_differences():
    x, gamma, beta = _f(5, 6) * 3 + 1, _f(6, seed=1), _f(6, seed=2)
    y, mean, rstd = run("layernorm", [x, gamma, beta])
    m = x.mean(axis=1, keepdims=True)
    v = ((x - m) ** 2).mean(axis=1, keepdims=True)
    close(y, (x - m) / np.sqrt(v + 1e-5) * gamma + beta, 1e-12)
    close(mean, m[:, 0], 1e-12)
    close(rstd, 1 / np.sqrt(v[:, 0] + 1e-5), 1e-12)
    r = _f(5, 6, seed=3)

    def f():
        return _loss(run("layernorm", [x, gamma, beta])[0], r)
    close(run1("layernorm_grad_x", [r, x, gamma, mean, rstd]), num_grad(f, x), 1e-6)
    close(run1("layernorm_grad_gamma", [r, x, mean, rstd]), num_grad(f, gamma), 1e-6)
    close(run1("sum", [r], {"axis": 0}), num_grad(f, beta), 1e-6)


def test_layernorm_in_f16_keeps_f32_statistics():
    x = _f(4, 8).astype(np.float16)
    y, mean, rstd = run("layernorm", [x, np.ones(8, np.float16), np.zeros(8, np.float16)])
    assert (y.dtype, mean.dtype, rstd.dtype) == (np.float16, np.float32, np.float32)
    want = run("layernorm", [x.astype(np.float64), np.ones(8), np.zeros(8)])[0]
    close(y.astype(np.float64), want, 2e-3)


# ---------------------------------------------------------------------------------------------
# Softmax and attention


def test_softmax_and_its_gradient():
    x = _f(2, 3, 5) * 3
    x[0, 1, 2] = -np.inf
    y = run1("softmax", [x])
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    close(y, e / e.sum(axis=-1, keepdims=True), 1e-15)
    assert y[0, 1, 2] == 0.0
    r = _f(2, 3, 5, seed=1)
    x[0, 1, 2] = 0.0
    y = run1("softmax", [x])
    close(run1("softmax_grad", [r, y]), num_grad(lambda: _loss(run1("softmax", [x]), r), x))


def attention_ref(q, k, v, heads, t, causal=True):
    """Scaled dot-product attention written from its definition, one sequence and head at a
    time: s = q_h k_h^T / sqrt(dh), masked above the diagonal, p = softmax(s), o_h = p v_h."""
    n, d = q.shape
    dh = d // heads
    o = np.zeros_like(q)
    ps = np.zeros((n // t, heads, t, t))
    for b in range(n // t):
        rows = slice(b * t, b * t + t)
        for h in range(heads):
            cols = slice(h * dh, h * dh + dh)
            s = q[rows, cols] @ k[rows, cols].T / math.sqrt(dh)
            if causal:
                s = np.where(np.tril(np.ones((t, t))) > 0, s, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            ps[b, h] = p
            o[rows, cols] = p @ v[rows, cols]
    return o, ps


@pytest.mark.parametrize("heads,t,causal", [(2, 3, True), (1, 4, True), (3, 2, False)])
def test_attention_forward_matches_a_per_head_loop(heads, t, causal):
    n, d = 2 * t, 6
    q, k, v = _f(n, d), _f(n, d, seed=1), _f(n, d, seed=2)
    at = {"heads": heads, "context": t, "causal": causal}
    s = run1("attn_scores", [q, k], at)
    assert s.shape == (n // t, heads, t, t)
    p = run1("softmax", [s])
    o = run1("attn_apply", [p, v])
    want_o, want_p = attention_ref(q, k, v, heads, t, causal)
    close(p, want_p, 1e-13)
    close(o, want_o, 1e-13)
    if causal:
        assert np.isneginf(s[..., np.triu_indices(t, 1)[0], np.triu_indices(t, 1)[1]]).all()


def test_attention_backward_kernels_match_finite_differences():
    heads, t, n, d = 2, 3, 6, 4
    q, k, v = _f(n, d), _f(n, d, seed=1), _f(n, d, seed=2)
    r = _f(n, d, seed=3)
    at = {"heads": heads, "context": t}

    def f():
        p = run1("softmax", [run1("attn_scores", [q, k], at)])
        return _loss(run1("attn_apply", [p, v]), r)
    p = run1("softmax", [run1("attn_scores", [q, k], at)])
    dp = run1("attn_grad_p", [r, v], at)
    dv = run1("attn_grad_v", [p, r])
    ds = run1("softmax_grad", [dp, p])
    dq = run1("attn_grad_q", [ds, k])
    dk = run1("attn_grad_k", [ds, q])
    close(dq, num_grad(f, q), 1e-6)
    close(dk, num_grad(f, k), 1e-6)
    close(dv, num_grad(f, v), 1e-6)
    assert not ds[..., 0, 1:].any()  # masked scores get no gradient


def test_each_attention_kernel_alone_matches_finite_differences():
    heads, t, n, d = 2, 3, 6, 4
    q, k, v = _f(n, d), _f(n, d, seed=1), _f(n, d, seed=2)
    at = {"heads": heads, "context": t}
    rs = _f(2, heads, t, t, seed=4)
    f_s = lambda: _loss(run1("attn_scores", [q, k], at), rs)  # noqa: E731
    masked = np.where(np.isfinite(run1("attn_scores", [q, k], at)), rs, 0.0)
    close(run1("attn_grad_q", [masked, k]), num_grad(f_s, q))
    close(run1("attn_grad_k", [masked, q]), num_grad(f_s, k))
    p = np.abs(_f(2, heads, t, t, seed=5))
    r = _f(n, d, seed=6)
    f_o = lambda: _loss(run1("attn_apply", [p, v]), r)  # noqa: E731
    close(run1("attn_grad_p", [r, v], at), num_grad(f_o, p))
    close(run1("attn_grad_v", [p, r]), num_grad(f_o, v))


@pytest.mark.parametrize("dt", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("heads,t,causal", [(2, 3, True), (1, 4, True), (3, 2, False), (2, 5, True)])
def test_fused_attention_is_its_three_kernels_bitwise(heads, t, causal, dt):
    """attn_fused = attn_scores, softmax, attn_apply (the scores and probabilities rounded to the
    dtype as those write them), bitwise, and the per-head loop within rounding."""
    n, d = 2 * t, 6
    q, k, v = (_f(n, d, seed=i).astype(dt) for i in range(3))
    at = {"heads": heads, "context": t, "causal": causal}
    y, p = run("attn_fused", [q, k, v], at)
    want_p = run1("softmax", [run1("attn_scores", [q, k], at)])
    assert p.dtype == y.dtype == dt and p.tobytes() == want_p.tobytes()
    assert y.tobytes() == run1("attn_apply", [want_p, v]).tobytes()
    ref_o, ref_p = attention_ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), heads, t, causal)
    tol = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 2e-2}[dt]
    close(p.astype(np.float64), ref_p, tol)
    close(y.astype(np.float64), ref_o, tol)


@pytest.mark.parametrize("dt", [np.float64, np.float32, np.float16])
def test_fused_attention_grad_is_its_five_kernels_bitwise(dt):
    heads, t, n, d = 2, 4, 8, 6
    dy, q, k, v = (_f(n, d, seed=i).astype(dt) for i in range(4))
    at = {"heads": heads, "context": t}
    p = run1("softmax", [run1("attn_scores", [q, k], at)])
    dq, dk, dv = run("attn_fused_grad", [dy, q, k, v, p], at)
    ds = run1("softmax_grad", [run1("attn_grad_p", [dy, v], at), p])
    assert dq.tobytes() == run1("attn_grad_q", [ds, k]).tobytes()
    assert dk.tobytes() == run1("attn_grad_k", [ds, q]).tobytes()
    assert dv.tobytes() == run1("attn_grad_v", [p, dy]).tobytes()


def test_fused_attention_grad_matches_finite_differences():
    heads, t, n, d = 2, 3, 6, 4
    q, k, v = _f(n, d), _f(n, d, seed=1), _f(n, d, seed=2)
    r = _f(n, d, seed=3)
    at = {"heads": heads, "context": t}
    f = lambda: _loss(run("attn_fused", [q, k, v], at)[0], r)  # noqa: E731
    p = run("attn_fused", [q, k, v], at)[1]
    dq, dk, dv = run("attn_fused_grad", [r, q, k, v, p], at)
    close(dq, num_grad(f, q), 1e-6)
    close(dk, num_grad(f, k), 1e-6)
    close(dv, num_grad(f, v), 1e-6)


def test_token_labels_of_any_shape_give_the_flat_cross_entropy():
    logits = _f(6, 5)
    labels = np.array([[0, 4, 1], [2, 2, 3]], np.int32)
    flat = labels.reshape(-1).copy()
    assert run1("softmax_xent", [logits, labels]) == run1("softmax_xent", [logits, flat])
    np.testing.assert_array_equal(run1("softmax_xent_grad", [np.array(1.0), logits, labels]),
                                  run1("softmax_xent_grad", [np.array(1.0), logits, flat]))


# ---------------------------------------------------------------------------------------------
# AdamW and clipping against PyTorch's formulas
# (torch/optim/adamw.py, _single_tensor_adam with decoupled_weight_decay; torch/nn/utils/clip_grad.py)


def torch_adamw(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    param *= 1 - lr * weight_decay
    exp_avg += (grad - exp_avg) * (1 - beta1)
    exp_avg_sq *= beta2
    exp_avg_sq += (1 - beta2) * grad * grad
    step_size = lr / (1 - beta1 ** step)
    denom = np.sqrt(exp_avg_sq) / math.sqrt(1 - beta2 ** step) + eps
    param -= step_size * exp_avg / denom


@pytest.mark.parametrize("beta1,beta2,eps,weight_decay", [
    (0.9, 0.999, 1e-8, 0.01), (0.9, 0.95, 1e-8, 0.1), (0.5, 0.9, 1e-3, 0.0)])
def test_adamw_matches_pytorch(beta1, beta2, eps, weight_decay):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 5))
    m, v = np.zeros_like(w), np.zeros_like(w)
    lr, t = np.array(0.0), np.array(0.0, np.float32)
    ref = [w.copy(), np.zeros_like(w), np.zeros_like(w)]
    attrs = {"beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    for step, step_lr in enumerate([0.1, 0.05, 0.2, 0.01, 0.1], start=1):
        dw = rng.standard_normal(w.shape)
        lr[...] = step_lr
        kernel("increment").cpu([t], [t], {})
        kernel("adamw_step").cpu([w, dw, m, v, lr, t], [w, m, v], attrs)
        torch_adamw(ref[0], dw, ref[1], ref[2], step, step_lr, beta1, beta2, eps, weight_decay)
        for got, want in zip((w, m, v), ref):
            close(got, want, 1e-12)


def test_adamw_differs_from_adam_with_l2_decay_and_checks_t():
    w, dw = _f(4), _f(4, seed=1)
    a = run("adamw_step", [w, dw, np.zeros(4), np.zeros(4), np.array(0.1), np.array(1.0)], {"weight_decay": 0.5})
    b = run("adam_step", [w, dw, np.zeros(4), np.zeros(4), np.array(0.1), np.array(1.0)], {"weight_decay": 0.5})
    assert not np.allclose(a[0], b[0])
    with pytest.raises(ValueError, match="increment"):
        run("adamw_step", [w, dw, w, w, np.array(0.1), np.array(0.0)])


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_by_global_norm_follows_clip_grad_norm(max_norm):
    grads = [_f(3, 4), _f(5, seed=1) * 10, _f(2, 2, seed=2)]
    acc = np.array(0.0, np.float32)
    for g in grads:
        kernel("grad_sumsq").cpu([g, acc], [acc], {})
    total = math.sqrt(sum(float((g * g).sum()) for g in grads))
    assert acc == pytest.approx(total ** 2, rel=1e-6)
    scale = np.array(0.0, np.float32)
    kernel("clip_scale").cpu([acc], [scale], {"max_norm": max_norm})
    coef = min(1.0, max_norm / (total + 1e-6))  # torch: clip_coef_clamped
    assert scale == pytest.approx(coef, rel=1e-6)
    for g in grads:
        want = g * float(scale)
        kernel("scale_grad").cpu([g, scale], [g], {})
        close(g, want, 0)
    clipped = math.sqrt(sum(float((g * g).sum()) for g in grads))
    assert clipped == pytest.approx(min(total, max_norm), rel=1e-5)


def test_clip_scale_of_nonfinite_norms():
    out = run1("clip_scale", [np.array(np.nan, np.float32)])
    assert np.isnan(out)
    assert run1("clip_scale", [np.array(np.inf)]) == 0.0
    assert run1("clip_scale", [np.array(0.0)]) == 1.0


# ---------------------------------------------------------------------------------------------
# Aliasing: outputs that are inputs, and views into one shared byte arena

_P = np.abs(_f(2, 2, 3, 3, seed=9))
SAMPLES = {  # a valid float64 call of every kernel here
    "embedding": ([np.array([[1, 0, 1]], np.int32), _f(4, 3)], {}),
    "embedding_grad": ([_f(3, 2), np.array([2, 0, 2], np.int64)], {"vocab": 3}),
    "pos_embedding": ([_f(6, 4), _f(3, 4, seed=1)], {}),
    "pos_embedding_grad": ([_f(6, 4)], {"context": 3}),
    "layernorm": ([_f(3, 4), _f(4, seed=1), _f(4, seed=2)], {}),
    "layernorm_grad_x": ([_f(3, 4), _f(3, 4, seed=1), _f(4, seed=2), _f(3, seed=3), np.abs(_f(3, seed=4))], {}),
    "layernorm_grad_gamma": ([_f(3, 4), _f(3, 4, seed=1), _f(3, seed=3), np.abs(_f(3, seed=4))], {}),
    "softmax": ([_f(3, 4)], {}),
    "softmax_grad": ([_f(3, 4), np.abs(_f(3, 4, seed=1))], {}),
    "attn_scores": ([_f(6, 4), _f(6, 4, seed=1)], {"heads": 2, "context": 3}),
    "attn_apply": ([_P, _f(6, 4)], {}),
    "attn_grad_p": ([_f(6, 4), _f(6, 4, seed=1)], {"heads": 2, "context": 3}),
    "attn_grad_v": ([_P, _f(6, 4)], {}),
    "attn_grad_q": ([_P, _f(6, 4)], {}),
    "attn_grad_k": ([_P, _f(6, 4)], {}),
    "attn_fused": ([_f(6, 4), _f(6, 4, seed=1), _f(6, 4, seed=2)], {"heads": 2, "context": 3}),
    "attn_fused_grad": ([_f(6, 4), _f(6, 4, seed=1), _f(6, 4, seed=2), _f(6, 4, seed=3), _P],
                        {"heads": 2, "context": 3}),
    "adamw_step": ([_f(3, 4), _f(3, 4, seed=1), _f(3, 4, seed=2), np.abs(_f(3, 4, seed=3)), np.array(0.1),
                    np.array(3.0)], {}),
    "grad_sumsq": ([_f(3, 4), np.array(2.0)], {}),
    "clip_scale": ([np.array(9.0)], {"max_norm": 2.0}),
    "scale_grad": ([_f(3, 4), np.array(0.5)], {}),
}


def _sample(key):
    ins, attrs = SAMPLES[key]
    return key, [i.copy() for i in ins], attrs


def test_samples_cover_every_transformer_kernel():
    assert set(SAMPLES) == set(kt.TRANSFORMER_KERNELS)


@pytest.mark.parametrize("key,out,inp", alias_cases(SAMPLES))
def test_an_output_may_be_an_input(key, out, inp):
    name, ins, attrs = _sample(key)
    assert_output_may_be_input(name, ins, attrs, out, inp)


def test_in_place_updates_equal_fresh_outputs():
    """The updates as the stdlib writes them: every output into its like-named input."""
    for name in ("adamw_step", "grad_sumsq", "scale_grad"):
        k = kernel(name)
        _, ins, attrs = _sample(name)
        fresh = run(name, [i.copy() for i in ins], attrs)
        outs = [ins[k.inputs.index(o)] for o in k.outputs]
        k.cpu(ins, outs, attrs)
        for got, want in zip(outs, fresh):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("key", list(SAMPLES))
def test_arena_views_work_and_in_place_outputs_alias(key):
    name, ins, attrs = _sample(key)
    assert_runs_in_one_arena(name, ins, attrs)


def test_gathers_reductions_and_gemms_may_not_write_over_their_inputs():
    elementwise = {"pos_embedding", "adamw_step", "grad_sumsq", "clip_scale", "scale_grad"}
    for name in kt.TRANSFORMER_KERNELS:
        assert KERNELS[name].inplace == (name in elementwise), name


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 2e-2)])
@pytest.mark.parametrize("key", list(SAMPLES))
def test_lower_precision_runs_and_keeps_its_dtype(key, dtype, tol):
    name, ins, attrs = _sample(key)
    want = run(name, ins, attrs)
    low = [i.astype(dtype) if i.dtype == np.float64 else i for i in ins]
    got = run(name, low, attrs)
    for g, w in zip(got, want):
        expect = dtype if w.dtype == np.float64 else w.dtype
        if name == "layernorm" and g.ndim == 1 and dtype == np.float16:
            expect = np.float32  # the statistics of f16 activations are f32
        assert g.dtype == expect, (name, g.dtype)
        fin = np.isfinite(w)
        close(g.astype(np.float64)[fin], w[fin], tol * max(1.0, float(np.abs(w[fin]).max())))


# ---------------------------------------------------------------------------------------------
# Type rules: codes, argument indices, messages naming the shapes

F = "f32"
Q = ((8, 6), F)


@pytest.mark.parametrize("name,types,attrs,code,arg,words", [
    ("embedding", [((4,), F), ((10, 3), F)], {}, "S004", 0, ["ids must be an integer dtype", "got f32"]),
    ("embedding", [((4,), "i32"), ((10,), F)], {}, "S003", 1, ["table must be 2-D [vocab, dim]"]),
    ("embedding", [((), "i32"), ((10, 3), F)], {}, "S003", 0, ["at least 1 dimension"]),
    ("embedding_grad", [((4, 3), F), ((4,), "i32")], {}, "S003", None, ["vocab must be given"]),
    ("embedding_grad", [((4, 3), F), ((2, 3), "i32")], {"vocab": 9}, "S003", 1, ["hold 6 ids", "has 4 rows"]),
    ("pos_embedding", [((8, 4), F), ((3, 4), F)], {}, "S003", 0, ["8 rows", "sequences of 3"]),
    ("pos_embedding", [((8, 4), F), ((4, 5), F)], {}, "S003", 1, ["width 4"]),
    ("pos_embedding_grad", [((8, 4), F)], {}, "S003", None, ["context must be given"]),
    ("pos_embedding_grad", [((8, 4), F)], {"context": 3}, "S003", 0, ["do not split into sequences of context = 3"]),
    ("layernorm", [((3, 4), F), ((5,), F), ((4,), F)], {}, "S003", 1, ["gamma must be [4]"]),
    ("layernorm", [((3, 4), F), ((4,), "f16"), ((4,), F)], {}, "S004", 1, ["x is f32", "gamma is f16"]),
    ("layernorm_grad_x", [((3, 4), F), ((3, 4), F), ((4,), F), ((4,), F), ((3,), F)], {}, "S003", 3,
     ["mean must be [3]"]),
    ("softmax", [((), F)], {}, "S003", 0, ["non-empty last axis"]),
    ("attn_scores", [Q, Q], {"context": 4}, "S003", None, ["heads must be given"]),
    ("attn_scores", [Q, Q], {"heads": 4, "context": 4}, "S003", None, ["width 6 does not split into 4 heads"]),
    ("attn_scores", [Q, Q], {"heads": 2, "context": 3}, "S003", 0, ["8 rows do not split into sequences"]),
    ("attn_scores", [Q, ((8, 4), F)], {"heads": 2, "context": 4}, "S003", 1, ["shapes differ"]),
    ("attn_scores", [Q, ((8, 6), "f16")], {"heads": 2, "context": 4}, "S004", 1, ["dtypes differ"]),
    ("attn_apply", [((2, 2, 4, 3), F), Q], {}, "S003", 0, ["[b, heads, t, t]"]),
    ("attn_apply", [((2, 2, 3, 3), F), Q], {}, "S003", 1, ["has 8 rows", "needs b * t = 6"]),
    ("attn_apply", [((2, 4, 4, 4), F), ((8, 6), F)], {}, "S003", 1, ["does not split into the 4 heads"]),
    ("adamw_step", [((3,), F)] * 4 + [((1,), F), ((), F)], {}, "S003", 4, ["lr must be a scalar"]),
    ("adamw_step", [((3,), F)] * 4 + [((), F)] * 2, {"beta2": 1.0}, "S003", None, ["beta2"]),
    ("grad_sumsq", [((3,), F), ((1,), F)], {}, "S003", 1, ["sumsq must be a scalar"]),
    ("clip_scale", [((), F)], {"max_norm": -1.0}, "S003", None, ["max_norm"]),
    ("scale_grad", [((3,), "i32"), ((), F)], {}, "S004", 0, ["g must be a float"]),
    ("softmax_xent", [((6, 5), F), ((2, 2), "i32")], {}, "S003", 1, ["hold 6 labels", "got [2, 2]"]),
])
def test_type_errors(name, types, attrs, code, arg, words):
    with pytest.raises(KernelTypeError) as e:
        infer_types(name, types, attrs)
    err = e.value
    assert (err.code, err.arg) == (code, arg), err.message
    assert err.message.startswith(name + ":")
    for w in words:
        assert w in err.message, err.message


@pytest.mark.parametrize("name,types,attrs,want", [
    ("embedding", [((4, 8), "i32"), ((256, 16), F)], {}, [((32, 16), F)]),
    ("embedding_grad", [((32, 16), F), ((4, 8), "i64")], {"vocab": 256}, [((256, 16), F)]),
    ("pos_embedding_grad", [((32, 16), "f16")], {"context": 8}, [((8, 16), "f16")]),
    ("layernorm", [((32, 16), "f16"), ((16,), "f16"), ((16,), "f16")], {},
     [((32, 16), "f16"), ((32,), F), ((32,), F)]),
    ("layernorm_grad_gamma", [((32, 16), F)] * 2 + [((32,), F)] * 2, {}, [((16,), F)]),
    ("attn_scores", [((32, 16), F)] * 2, {"heads": 4, "context": 8}, [((4, 4, 8, 8), F)]),
    ("attn_grad_p", [((32, 16), F)] * 2, {"heads": 4, "context": 8}, [((4, 4, 8, 8), F)]),
    ("attn_grad_q", [((4, 4, 8, 8), F), ((32, 16), F)], {}, [((32, 16), F)]),
    ("softmax_xent", [((32, 256), F), ((4, 8), "i32")], {}, [((), F)]),
    ("clip_scale", [((), "f64")], {}, [((), "f64")]),
    ("scale_grad", [((3, 3), "f16"), ((), F)], {}, [((3, 3), "f16")]),
])
def test_type_rules_accept(name, types, attrs, want):
    assert infer_types(name, types, attrs) == want
