"""The CNN-step kernels (stdlib.kernels.CNN_KERNELS) against trusted references: convolution against a
naive 7-loop sum, every backward kernel against central finite differences in float64, batch
norm's running statistics and the optimizers and loss scaler against hand-written PyTorch/paper
formulas, Philox against Random123's known answers, in-place and arena aliasing, type rules."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import streamsched.stdlib.kernels.dropout as kc
from streamsched.stdlib.kernel_record import KernelTypeError
from kernel_helpers import (alias_cases, assert_output_may_be_input, assert_runs_in_one_arena,  # noqa: F401
                            close, num_grad, run, run1)
from streamsched.stdlib.kernels import CNN_KERNELS, FAMILIES, KERNELS, infer_types, kernel, numpy_dtype


















def _f(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


# ---------------------------------------------------------------------------------------------
# The registry


def test_every_cnn_kernel_is_registered_complete_and_documented():
    doc = (Path(__file__).parents[1] / "docs" / "kernels.md").read_text()
    family = {name: f.module for f in FAMILIES for name in f.kernels}
    assert len(CNN_KERNELS) == 29
    for name in CNN_KERNELS:
        k = KERNELS[name]
        assert k.name == name and k.doc and k.cpu is not None and not k.host, name
        assert k.capturable, name
        assert k.cuda == f"{family[name]}:{name}_cuda"
        assert f"`{name}`" in doc, f"docs/kernels.md lacks {name}"


def test_philox_matches_random123_known_answers():
    # Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter[4] key[2] -> out[4].
    kat = [((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
           ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
           ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
            (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]
    for ctr, key, want in kat:
        assert tuple(int(w) for w in kc.philox4x32_10(ctr, key)) == want


# ---------------------------------------------------------------------------------------------
# Convolution


def conv_ref(x, w, s, p):
    """The definition, seven loops deep."""
    n, h, wd, c = x.shape
    kh, kw, _, k = w.shape
    oh, ow = (h + 2 * p - kh) // s + 1, (wd + 2 * p - kw) // s + 1
    y = np.zeros((n, oh, ow, k))
    for b in range(n):
        for i in range(oh):
            for j in range(ow):
                for o in range(k):
                    acc = 0.0
                    for di in range(kh):
                        for dj in range(kw):
                            for ci in range(c):
                                r, q = i * s + di - p, j * s + dj - p
                                if 0 <= r < h and 0 <= q < wd:
                                    acc += x[b, r, q, ci] * w[di, dj, ci, o]
                    y[b, i, j, o] = acc
    return y


CONV_CASES = [  # x shape, w shape, stride, pad
    ((2, 5, 6, 2), (3, 2, 2, 3), 1, 0),
    ((2, 5, 6, 2), (3, 2, 2, 3), 2, 0),
    ((1, 6, 7, 2), (3, 2, 2, 2), 2, 0),   # the floor leaves the last row and column unread
    ((2, 5, 6, 2), (3, 2, 2, 3), 1, 1),
    ((1, 6, 5, 3), (3, 3, 3, 2), 2, 1),
    ((2, 4, 4, 2), (1, 1, 2, 3), 1, 0),   # 1x1: a matmul over channels
    ((1, 3, 4, 2), (3, 4, 2, 2), 1, 0),   # the kernel covers the whole image
]


@pytest.mark.parametrize("xs,ws,s,p", CONV_CASES)
def test_conv2d_matches_the_seven_loop_definition(xs, ws, s, p):
    x, w = _f(*xs), _f(*ws, seed=1)
    y = run1("conv2d", [x, w], {"stride": s, "pad": p})
    close(y, conv_ref(x, w, s, p), 1e-12)


@pytest.mark.parametrize("xs,ws,s,p", CONV_CASES)
def test_conv2d_gradients_match_finite_differences(xs, ws, s, p):
    x, w = _f(*xs), _f(*ws, seed=1)
    at = {"stride": s, "pad": p}
    r = _f(*run1("conv2d", [x, w], at).shape, seed=2)
    dx = run1("conv2d_grad_x", [r, w], {**at, "in_h": xs[1], "in_w": xs[2]})
    dw = run1("conv2d_grad_w", [x, r], {**at, "kh": ws[0], "kw": ws[1]})

    def loss():
        return float((r * run1("conv2d", [x, w], at)).sum())

    close(dx, num_grad(loss, x))
    close(dw, num_grad(loss, w))


def test_integer_attributes_written_as_floats_are_accepted():
    # A .sched literal `2.0` arrives as a float; integral values are taken as integers.
    x, w = _f(1, 5, 5, 2), _f(3, 3, 2, 2, seed=1)
    y = run1("conv2d", [x, w], {"stride": 2.0, "pad": 1.0})
    np.testing.assert_array_equal(y, run1("conv2d", [x, w], {"stride": 2, "pad": 1}))
    dx = run1("conv2d_grad_x", [y, w], {"stride": 2.0, "pad": 1.0, "in_h": 5.0, "in_w": 5.0})
    dw = run1("conv2d_grad_w", [x, y], {"stride": 2.0, "pad": 1.0, "kh": 3.0, "kw": 3.0})
    assert dx.shape == x.shape and dw.shape == w.shape
    for pool in ("maxpool2d", "avgpool2d"):
        p = run1(pool, [x], {"size": 2.0, "stride": 1.0})
        assert p.shape == (1, 4, 4, 2)
        assert run1(pool + "_grad", [p, x], {"size": 2.0, "stride": 1.0}).shape == x.shape
    _, m = run("dropout", [x, np.array(0, np.int64)], {"seed": 3.0})
    np.testing.assert_array_equal(m, run("dropout", [x, np.array(0, np.int64)], {"seed": 3})[1])


def test_conv2d_in_float32_and_float16_keeps_its_dtype():
    x, w = _f(2, 6, 6, 3), _f(3, 3, 3, 4, seed=1)
    want = conv_ref(x, w, 1, 1)
    for dt, tol in ((np.float32, 1e-5), (np.float16, 2e-2)):
        y = run1("conv2d", [x.astype(dt), w.astype(dt)], {"pad": 1})
        assert y.dtype == dt
        close(y.astype(np.float64), want, tol * np.abs(want).max())


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 5)])
def test_bias_add_on_nhwc_and_sum_nhw_is_its_gradient(shape):
    x, b, r = _f(*shape), _f(shape[-1], seed=1), _f(*shape, seed=2)
    close(run1("bias_add", [x, b]), x + b, 0)

    def loss():
        return float((r * run1("bias_add", [x, b])).sum())

    db = run1("sum_nhw", [r])
    assert db.shape == (shape[-1],)
    close(db, num_grad(loss, b))
    close(db, r.reshape(-1, shape[-1]).sum(axis=0), 1e-12)


# ---------------------------------------------------------------------------------------------
# Pooling


def pool_ref(x, size, s, fn):
    n, h, w, c = x.shape
    oh, ow = (h - size) // s + 1, (w - size) // s + 1
    y = np.zeros((n, oh, ow, c))
    for i in range(oh):
        for j in range(ow):
            y[:, i, j, :] = fn(x[:, i * s:i * s + size, j * s:j * s + size, :], axis=(1, 2))
    return y


POOL_CASES = [((2, 4, 6, 3), 2, 2), ((2, 5, 7, 2), 2, 2), ((1, 5, 6, 2), 3, 2),
              ((1, 4, 5, 2), 2, 1), ((1, 3, 3, 1), 3, 1)]


@pytest.mark.parametrize("pool,ref", [("maxpool2d", np.max), ("avgpool2d", np.mean)])
@pytest.mark.parametrize("xs,size,s", POOL_CASES)
def test_pools_and_their_gradients(pool, ref, xs, size, s):
    # A permutation keeps the values distinct, so no maximum is tied or swapped by +-eps.
    x = np.random.default_rng(3).permutation(math.prod(xs)).reshape(xs) / 7.0
    at = {"size": size, "stride": s}
    y = run1(pool, [x], at)
    close(y, pool_ref(x, size, s, ref), 1e-12)
    r = _f(*y.shape, seed=4)
    dx = run1(pool + "_grad", [r, x], at)

    def loss():
        return float((r * run1(pool, [x], at)).sum())

    close(dx, num_grad(loss, x))


def test_maxpool_gives_the_gradient_to_the_first_maximum_in_row_major_order():
    windows = {  # one 2x2 window -> where its gradient goes
        "all equal": ([[5.0, 5.0], [5.0, 5.0]], (0, 0)),
        "tie on the second row": ([[1.0, 2.0], [3.0, 3.0]], (1, 0)),
        "tie across rows": ([[1.0, 3.0], [3.0, 0.0]], (0, 1)),
        "a NaN wins": ([[9.0, 1.0], [np.nan, np.nan]], (1, 0)),
    }
    for what, (win, at) in windows.items():
        x = np.array(win).reshape(1, 2, 2, 1)
        y = run1("maxpool2d", [x])
        assert np.isnan(y).all() if np.isnan(x).any() else y.item() == x.max(), what
        dx = run1("maxpool2d_grad", [np.full((1, 1, 1, 1), 2.5), x])
        want = np.zeros((2, 2))
        want[at] = 2.5
        np.testing.assert_array_equal(dx[0, :, :, 0], want, err_msg=what)


def test_overlapping_maxpool_windows_sum_into_a_shared_maximum():
    x = np.array([[1.0, 2.0, 1.0], [1.0, 9.0, 1.0], [1.0, 2.0, 1.0]]).reshape(1, 3, 3, 1)
    dy = np.arange(1.0, 5.0).reshape(1, 2, 2, 1)
    dx = run1("maxpool2d_grad", [dy, x], {"size": 2, "stride": 1})
    assert dx[0, 1, 1, 0] == 10.0 and dx.sum() == 10.0


def test_global_avgpool_and_its_gradient():
    x, r = _f(2, 3, 5, 4), _f(2, 4, seed=1)
    close(run1("global_avgpool", [x]), x.mean(axis=(1, 2)), 1e-12)
    dx = run1("global_avgpool_grad", [r, x])

    def loss():
        return float((r * run1("global_avgpool", [x])).sum())

    close(dx, num_grad(loss, x))


# ---------------------------------------------------------------------------------------------
# Batch norm


@pytest.mark.parametrize("shape", [(3, 4, 5, 2), (6, 3)])
def test_batchnorm_train_and_its_gradients(shape):
    x = _f(*shape) * 2 + 0.5
    gamma, beta = _f(shape[-1], seed=1), _f(shape[-1], seed=2)
    r = _f(*shape, seed=3)
    y, mean, invstd = run("batchnorm_train", [x, gamma, beta])
    axes = tuple(range(len(shape) - 1))
    close(mean, x.mean(axis=axes), 1e-12)
    close(invstd, 1 / np.sqrt(x.var(axis=axes) + 1e-5), 1e-12)  # biased variance
    close(y, (x - x.mean(axis=axes)) / np.sqrt(x.var(axis=axes) + 1e-5) * gamma + beta, 1e-12)
    dx, dgamma, dbeta = run("batchnorm_grad", [r, x, gamma, mean, invstd])

    def loss():
        return float((r * run("batchnorm_train", [x, gamma, beta])[0]).sum())

    close(dx, num_grad(loss, x), 1e-5)
    close(dgamma, num_grad(loss, gamma), 1e-5)
    close(dbeta, num_grad(loss, beta), 1e-5)


def torch_bn_running(rm, rv, x, momentum):
    """torch.nn.BatchNorm2d in training mode: biased variance normalizes, the unbiased one
    enters running_var."""
    axes = tuple(range(x.ndim - 1))
    rm = (1 - momentum) * rm + momentum * x.mean(axis=axes)
    rv = (1 - momentum) * rv + momentum * x.var(axis=axes, ddof=1)
    return rm, rv


@pytest.mark.parametrize("shape,momentum", [((4, 3, 3, 2), 0.1), ((5, 3), 0.3)])
def test_batchnorm_running_stats_follow_pytorch_and_feed_inference(shape, momentum):
    c = shape[-1]
    gamma, beta = _f(c, seed=1), _f(c, seed=2)
    rm, rv = np.zeros(c), np.ones(c)  # PyTorch's initial running stats
    ref_rm, ref_rv = rm.copy(), rv.copy()
    count = math.prod(shape[:-1])
    for step in range(4):
        x = _f(*shape, seed=10 + step) * (step + 1) + step
        _, mean, invstd = run("batchnorm_train", [x, gamma, beta])
        kernel("batchnorm_stats_update").cpu([rm, rv, mean, invstd], [rm, rv],
                                             {"momentum": momentum, "count": count})
        ref_rm, ref_rv = torch_bn_running(ref_rm, ref_rv, x, momentum)
        close(rm, ref_rm, 1e-12)
        close(rv, ref_rv, 1e-10)
    xt = _f(*shape, seed=99)
    y = run1("batchnorm_infer", [xt, gamma, beta, rm, rv])
    close(y, (xt - ref_rm) / np.sqrt(ref_rv + 1e-5) * gamma + beta, 1e-10)


def test_batchnorm_mixed_precision_and_tiny_variance():
    x = _f(4, 3, 3, 2).astype(np.float16)
    g32, b32 = np.ones(2, np.float32), np.zeros(2, np.float32)
    y, mean, invstd = run("batchnorm_train", [x, g32, b32])
    assert (y.dtype, mean.dtype, invstd.dtype) == (np.float16, np.float32, np.float32)
    want = run("batchnorm_train", [a.astype(np.float64) for a in (x, g32, b32)])[0]
    close(y.astype(np.float64), want, 1e-2)
    # A constant channel: var = 0, recovered as exactly 0 (never negative) from an f32 invstd.
    xc = np.full((3, 2), 7.0, np.float32)
    _, mean, invstd = run("batchnorm_train", [xc, g32, b32])
    rm, rv = np.zeros(2, np.float32), np.zeros(2, np.float32)
    kernel("batchnorm_stats_update").cpu([rm, rv, mean, invstd], [rm, rv], {"count": 3})
    assert (rv >= 0).all() and np.abs(rv).max() < 1e-9
    close(rm, [0.7, 0.7], 1e-6)


# ---------------------------------------------------------------------------------------------
# Dropout


def _dropout(x, offset, **at):
    return run("dropout", [x, offset], at)


def test_dropout_bits_are_philox_words_laid_out_by_element_and_offset():
    # Element i: word i & 3 of the block (i >> 2); offset in counter words 2-3; seed is the key.
    np.testing.assert_array_equal(kc.dropout_bits(4, 0, 0),
                                  [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8])
    seed, off = (7 << 32) | 3, (1 << 32) + 5
    bits = kc.dropout_bits(11, seed, off)
    for i in (0, 5, 10):
        want = kc.philox4x32_10((i >> 2, 0, 5, 1), (3, 7))[i & 3]
        assert bits[i] == want
    big = kc.dropout_bits((1 << 20) + 3, 1, 2)  # the block index past 2^18
    assert big[-1] == kc.philox4x32_10(((1 << 18), 0, 2, 0), (1, 0))[2]


def test_dropout_is_a_pure_function_of_seed_offset_and_index():
    x = _f(40, 50)
    y1, m1 = _dropout(x, np.array(3, np.int64))
    y2, m2 = _dropout(x, np.array(3.0, np.float32))  # f32 and i64 counters agree
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(m1, m2)
    assert m1.dtype == np.uint8 and set(np.unique(m1)) <= {0, 1}
    _, m_next = _dropout(x, np.array(4, np.int64))
    _, m_seed = _dropout(x, np.array(3, np.int64), seed=1)
    assert (m_next != m1).any() and (m_seed != m1).any()
    # The mask depends on the flat index only, not on the shape.
    _, m_flat = _dropout(x.reshape(-1), np.array(3, np.int64))
    np.testing.assert_array_equal(m_flat, m1.reshape(-1))
    close(y1, np.where(m1 == 1, x / 0.9, 0.0), 1e-15)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_rate_and_scale(p):
    n = 100_000
    x = np.ones(n, np.float32)
    y, mask = _dropout(x, np.array(11, np.int64), p=p, seed=12345)
    rate = mask.mean()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n), rate
    assert y.dtype == np.float32
    assert set(np.unique(y)) == {np.float32(0), np.float32(1.0 / (1.0 - p))}


def test_dropout_edge_values_and_bad_offsets():
    x = np.array([1.0, np.inf, np.nan, -2.0] * 8)
    y, mask = _dropout(x, np.array(0, np.int64), p=0.0)
    assert mask.all()
    np.testing.assert_array_equal(y, x)
    y, mask = _dropout(x, np.array(0, np.int64), p=0.5)
    assert (y[mask == 0] == 0).all()  # inf and NaN are dropped to 0 as well
    for bad in (np.array(-1, np.int64), np.array(2.5, np.float32), np.array(np.inf)):
        with pytest.raises(ValueError, match="non-negative integer"):
            _dropout(x, bad)


@pytest.mark.parametrize("mask_dtype", ["u8", "f32"])
def test_dropout_gradient_uses_the_mask(mask_dtype):
    x, r = _f(6, 7), _f(6, 7, seed=1)
    off = np.array(5, np.int64)
    at = {"p": 0.3, "seed": 9, "mask": mask_dtype}
    y, mask = _dropout(x, off, **at)
    assert mask.dtype == numpy_dtype(mask_dtype)
    dx = run1("dropout_grad", [r, mask], {"p": 0.3})

    def loss():
        return float((r * _dropout(x, off, **at)[0]).sum())

    close(dx, num_grad(loss, x))
    close(dx, np.where(mask != 0, r / 0.7, 0.0), 1e-15)


def test_replays_advance_the_offset_and_draw_new_masks():
    x, off = np.ones(64), np.array(0, np.int64)
    masks = []
    for _ in range(3):  # the captured step: dropout, then offset_advance, replayed
        masks.append(_dropout(x, off)[1])
        kernel("offset_advance").cpu([off], [off], {})
    assert off == 3
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
    np.testing.assert_array_equal(_dropout(x, np.array(1, np.int64))[1], masks[1])
    f = np.array(7.0, np.float32)
    kernel("offset_advance").cpu([f], [f], {"by": 2})
    assert f == 9.0


# ---------------------------------------------------------------------------------------------
# LARS and EMA against hand references


def lars_ref(w, dw, v, lr, momentum, wd, trust, eps):
    """You et al. 2017, Algorithm 1, with the zero-norm fallback."""
    wn, gn = math.sqrt(float((w * w).sum())), math.sqrt(float((dw * dw).sum()))
    local = trust * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
    v = momentum * v + lr * local * (dw + wd * w)
    return w - v, v


@pytest.mark.parametrize("momentum,wd,trust", [(0.9, 0.0005, 0.001), (0.0, 0.0, 0.02),
                                               (0.5, 0.01, 1.0)])
def test_lars_matches_the_paper_over_several_steps(momentum, wd, trust):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 3))
    v = np.zeros_like(w)
    lr = np.array(0.0)
    ref_w, ref_v = w.copy(), v.copy()
    at = {"momentum": momentum, "weight_decay": wd, "trust": trust}
    for step_lr in (0.1, 0.5, 1.0, 0.2, 2.0):
        dw = rng.standard_normal(w.shape)
        lr[...] = step_lr
        kernel("lars_step").cpu([w, dw, v, lr], [w, v], at)
        ref_w, ref_v = lars_ref(ref_w, dw, ref_v, step_lr, momentum, wd, trust, 1e-9)
        close(w, ref_w, 1e-13)
        close(v, ref_v, 1e-13)


def test_lars_falls_back_to_a_local_rate_of_one_at_zero_norms():
    dw = np.full(3, 2.0)
    w2, v2 = run("lars_step", [np.zeros(3), dw, np.zeros(3), np.array(0.1)])
    close(v2, 0.1 * dw, 1e-15)  # ||w|| = 0: local = 1
    w = np.full(3, 1.0)
    w2, v2 = run("lars_step", [w, np.zeros(3), np.zeros(3), np.array(0.1)])
    close(v2, 0.1 * 0.0005 * w, 1e-15)  # ||dw|| = 0: local = 1, only weight decay moves w


def test_ema_matches_a_hand_reference():
    rng = np.random.default_rng(6)
    ema = rng.standard_normal(5)
    ref = ema.copy()
    for _ in range(4):
        w = rng.standard_normal(5)
        kernel("ema_update").cpu([ema, w], [ema], {"decay": 0.9})
        ref = 0.9 * ref + 0.1 * w
        close(ema, ref, 1e-14)


# ---------------------------------------------------------------------------------------------
# Mixed precision


def test_cast_rounds_to_nearest_even_and_overflows_to_inf():
    x = np.array([1.0, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 65504.0, 65519.0, 65520.0, -1e6, np.nan],
                 np.float32)
    y = run1("cast", [x])
    assert y.dtype == np.float16
    np.testing.assert_array_equal(
        y, np.array([1.0, 1.0, 1 + 2 ** -9, 65504.0, 65504.0, np.inf, -np.inf, np.nan], np.float16))
    back = run1("cast", [y[:4]], {"dtype": "f32"})
    assert back.dtype == np.float32 and back.tolist() == [1.0, 1.0, 1 + 2 ** -9, 65504.0]
    np.testing.assert_array_equal(run1("cast", [x], {"dtype": "f32"}), x)
    assert infer_types("cast", [((3,), "f32")], {"dtype": "bf16"}) == [((3,), "bf16")]
    with pytest.raises(NotImplementedError, match="bf16"):
        kernel("cast").cpu([x], [np.empty(8, np.float32)], {"dtype": "bf16"})


def test_scale_loss_and_unscale_check():
    scale = np.array(1024.0, np.float32)
    close(run1("scale_loss", [np.array(0.75, np.float32), scale]), 768.0, 0)
    found = np.array(0.0, np.float32)
    g = np.array([2048.0, -512.0, 3.0], np.float32)
    kernel("unscale_check").cpu([g, scale, found], [g, found], {})
    assert g.tolist() == [2.0, -0.5, 3.0 / 1024] and found == 0.0
    for bad in (np.inf, -np.inf, np.nan):
        found[...] = 0.0
        g = np.array([1.0, bad, 4.0], np.float32)
        kernel("unscale_check").cpu([g, scale, found], [g, found], {})
        assert found == 1.0 and g[0] == 1 / 1024
    g = np.ones(2, np.float32)  # a later finite gradient leaves the flag set
    kernel("unscale_check").cpu([g, scale, found], [g, found], {})
    assert found == 1.0
    g16 = np.array([1024.0, 65504.0], np.float16)
    out, flag = run("unscale_check", [g16, scale, np.array(0.0, np.float32)])
    assert out.dtype == np.float16 and out.tolist() == [1.0, 63.96875] and flag == 0.0


def torch_update_scale(scale, found_inf, tracker, growth, backoff, interval):
    """aten/src/ATen/native/cuda/AmpKernels.cu, amp_update_scale_cuda_kernel."""
    if found_inf:
        return np.float32(scale * backoff), 0
    successful = tracker + 1
    if successful == interval:
        new_scale = np.float32(scale * growth)
        return (new_scale if np.isfinite(new_scale) else scale), 0
    return scale, successful


def test_update_scale_backs_off_on_inf_and_grows_after_interval_good_steps():
    scale, found, good = np.array(65536.0, np.float32), np.array(0.0, np.float32), \
        np.array(0, np.int32)
    at = {"interval": 3}
    ref = (np.float32(65536.0), 0)
    history = []
    for inf in [0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0]:
        found[...] = inf
        kernel("update_scale").cpu([scale, found, good], [scale, good], at)
        ref = torch_update_scale(ref[0], inf, ref[1], 2.0, 0.5, 3)
        assert (float(scale), int(good)) == (float(ref[0]), ref[1])
        history.append(float(scale))
    assert history[:5] == [65536.0, 65536.0, 131072.0, 131072.0, 65536.0]
    assert good.dtype == np.int32
    big = np.array(3e38, np.float32)  # growth would overflow f32: the scale stays
    s2, g2 = run("update_scale", [big, np.array(0.0, np.float32), np.array(1999, np.int32)])
    assert s2 == big and g2 == 0


def test_nonfinite_check_sets_the_flag_and_never_clears_it():
    found = np.array(0.0, np.float32)
    g = np.array([1.0, 65504.0, -2.0], np.float16)
    kernel("nonfinite_check").cpu([g, found], [found], {})
    assert found == 0.0 and g.tolist() == [1.0, 65504.0, -2.0]  # the gradient is untouched
    for bad in (np.inf, -np.inf, np.nan):
        found[...] = 0.0
        kernel("nonfinite_check").cpu([np.array([1.0, bad], np.float16), found], [found], {})
        assert found == 1.0
    kernel("nonfinite_check").cpu([np.ones(3, np.float16), found], [found], {})
    assert found == 1.0


def test_amp_sgd_step_is_sgd_on_the_unscaled_gradient_of_the_master_weights():
    """Against the f32 SGD kernel on dw / scale: the master follows it exactly, w is its f16
    rounding; and an overflow anywhere (found_inf) leaves w, master and v untouched."""
    rng = np.random.default_rng(7)
    master = rng.standard_normal(50).astype(np.float32)
    w = master.astype(np.float16)
    v = (0.1 * rng.standard_normal(50)).astype(np.float32)
    scale = np.array(1024.0, np.float32)
    dw16 = (rng.standard_normal(50) * 1024).astype(np.float16)
    lr = np.array(0.05, np.float32)
    at = {"momentum": 0.9, "weight_decay": 1e-3, "nesterov": True}
    ref_w, ref_v = master.copy(), v.copy()
    kernel("sgd_step").cpu([ref_w, dw16.astype(np.float32) / np.float32(1024), ref_v, lr],
                           [ref_w, ref_v], at)
    w1, m1, v1 = run("amp_sgd_step", [w, dw16, master, v, lr, scale, np.array(0.0, np.float32)], at)
    np.testing.assert_array_equal(m1, ref_w)
    np.testing.assert_array_equal(v1, ref_v)
    assert w1.dtype == np.float16
    np.testing.assert_array_equal(w1, ref_w.astype(np.float16))
    assert not np.array_equal(m1, master)
    w2, m2, v2 = run("amp_sgd_step", [w, dw16, master, v, lr, scale, np.array(1.0, np.float32)], at)
    np.testing.assert_array_equal(w2, w)
    np.testing.assert_array_equal(m2, master)
    np.testing.assert_array_equal(v2, v)


def test_amp_lars_step_is_lars_on_the_unscaled_gradient_of_the_master_weights():
    rng = np.random.default_rng(8)
    master = rng.standard_normal(40).astype(np.float32)
    w, v = master.astype(np.float16), (0.01 * rng.standard_normal(40)).astype(np.float32)
    dw16 = (rng.standard_normal(40) * 256).astype(np.float16)
    lr, scale = np.array(2.0, np.float32), np.array(256.0, np.float32)
    at = {"momentum": 0.9, "weight_decay": 5e-4, "trust": 1e-3}
    ref_w, ref_v = master.copy(), v.copy()
    kernel("lars_step").cpu([ref_w, dw16.astype(np.float32) / np.float32(256), ref_v, lr], [ref_w, ref_v], at)
    w1, m1, v1 = run("amp_lars_step", [w, dw16, master, v, lr, scale, np.array(0.0, np.float32)], at)
    close(m1, ref_w, 1e-6)
    close(v1, ref_v, 1e-6)
    np.testing.assert_array_equal(w1, m1.astype(np.float16))
    w2, m2, v2 = run("amp_lars_step", [w, dw16, master, v, lr, scale, np.array(1.0, np.float32)], at)
    np.testing.assert_array_equal(w2, w)
    np.testing.assert_array_equal(m2, master)
    np.testing.assert_array_equal(v2, v)


def test_ema_of_an_f16_weight_is_kept_in_f32():
    ema = np.full(4, 1.0, np.float32)
    w = np.full(4, 1.5, np.float16)
    out = run1("ema_update", [ema, w], {"decay": 0.999})
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.float32(1.0) + np.float32(0.001) * np.float32(0.5))
    assert out[0] != 1.0  # an f16 average would have stayed at 1.0: the increment is below its ulp


def test_amp_sgd_step_types():
    t = infer_types("amp_sgd_step", [((3, 4), "f16"), ((3, 4), "f16"), ((3, 4), "f32"), ((3, 4), "f32"),
                                     ((), "f32"), ((), "f32"), ((), "f32")], {})
    assert t == [((3, 4), "f16"), ((3, 4), "f32"), ((3, 4), "f32")]
    with pytest.raises(KernelTypeError, match="dtypes differ"):  # the gradient is in w's dtype
        infer_types("amp_sgd_step", [((3,), "f16"), ((3,), "f32"), ((3,), "f32"), ((3,), "f32"),
                                     ((), "f32"), ((), "f32"), ((), "f32")], {})
    with pytest.raises(KernelTypeError, match="scalar"):
        infer_types("amp_sgd_step", [((3,), "f16"), ((3,), "f16"), ((3,), "f32"), ((3,), "f32"),
                                     ((), "f32"), ((3,), "f32"), ((), "f32")], {})


# ---------------------------------------------------------------------------------------------
# Aliasing: outputs that are inputs, and views into one shared byte arena

SAMPLES = {  # a valid float64 call of every kernel here
    "conv2d": ([_f(2, 4, 4, 3), _f(1, 1, 3, 3, seed=1)], {}),  # y has x's type: may alias
    "conv2d_grad_x": ([_f(2, 3, 3, 3), _f(2, 2, 3, 3, seed=1)],
                      {"stride": 2, "pad": 1, "in_h": 4, "in_w": 4}),
    "conv2d_grad_w": ([_f(2, 4, 4, 3), _f(2, 3, 3, 3, seed=1)], {"kh": 2, "kw": 2}),
    "sum_nhw": ([_f(2, 3, 3, 4)], {}),
    "maxpool2d": ([_f(2, 4, 4, 3)], {}),
    "maxpool2d_grad": ([_f(2, 3, 3, 3), _f(2, 4, 4, 3, seed=1)], {"stride": 1}),
    "avgpool2d": ([_f(2, 4, 4, 3)], {}),
    "avgpool2d_grad": ([_f(2, 3, 3, 3), _f(2, 4, 4, 3, seed=1)], {"stride": 1}),
    "global_avgpool": ([_f(2, 3, 3, 2)], {}),
    "global_avgpool_grad": ([_f(2, 2), _f(2, 3, 3, 2, seed=1)], {}),
    "batchnorm_train": ([_f(2, 3, 3, 2), _f(2, seed=1), _f(2, seed=2)], {}),
    "batchnorm_grad": ([_f(2, 3, 3, 2), _f(2, 3, 3, 2, seed=1), _f(2, seed=2), _f(2, seed=3),
                        np.abs(_f(2, seed=4)) + 0.5], {}),
    "batchnorm_stats_update": ([_f(2), np.abs(_f(2, seed=1)), _f(2, seed=2),
                                np.abs(_f(2, seed=3)) + 0.5], {"count": 18}),
    "batchnorm_infer": ([_f(2, 3, 3, 2), _f(2, seed=1), _f(2, seed=2), _f(2, seed=3),
                         np.abs(_f(2, seed=4))], {}),
    "batchnorm_train_relu": ([_f(2, 3, 3, 2), _f(2, seed=1), _f(2, seed=2)], {}),
    "batchnorm_train_add_relu": ([_f(2, 3, 3, 2), _f(2, seed=1), _f(2, seed=2), _f(2, 3, 3, 2, seed=3)], {}),
    "batchnorm_grad_relu": ([_f(2, 3, 3, 2), _f(2, 3, 3, 2, seed=5), _f(2, 3, 3, 2, seed=1), _f(2, seed=2),
                             _f(2, seed=3), np.abs(_f(2, seed=4)) + 0.5], {}),
    "dropout": ([_f(3, 4), np.array(2, np.int64)], {"p": 0.5, "mask": "f32"}),
    "dropout_grad": ([_f(3, 4), (_f(3, 4, seed=1) > 0).astype(np.float32)], {"p": 0.5}),
    "offset_advance": ([np.array(2, np.int64)], {}),
    "lars_step": ([_f(3, 4), _f(3, 4, seed=1), _f(3, 4, seed=2), np.array(0.1)], {}),
    "ema_update": ([_f(3, 4), _f(3, 4, seed=1)], {}),
    "cast": ([_f(3, 4)], {"dtype": "f64"}),
    "scale_loss": ([_f(3), np.array(8.0)], {}),
    "unscale_check": ([np.array([1.0, np.inf, 3.0]), np.array(8.0), np.array(0.0)], {}),
    "update_scale": ([np.array(8.0), np.array(0.0), np.array(1999.0)], {}),
    "nonfinite_check": ([np.array([1.0, np.nan, 3.0]), np.array(0.0)], {}),
    "amp_sgd_step": ([_f(3, 4), _f(3, 4, seed=1), _f(3, 4, seed=2), _f(3, 4, seed=3), np.array(0.1),
                      np.array(4.0), np.array(0.0)], {"weight_decay": 0.01}),
    "amp_lars_step": ([_f(3, 4), _f(3, 4, seed=1), _f(3, 4, seed=2), _f(3, 4, seed=3), np.array(0.1),
                       np.array(4.0), np.array(0.0)], {}),
}


def _sample(key):
    ins, attrs = SAMPLES[key]
    return key, [i.copy() for i in ins], attrs


def test_samples_cover_every_cnn_kernel():
    assert set(SAMPLES) == set(CNN_KERNELS)


@pytest.mark.parametrize("key,out,inp", alias_cases(SAMPLES))
def test_an_output_may_be_an_input(key, out, inp):
    name, ins, attrs = _sample(key)
    assert_output_may_be_input(name, ins, attrs, out, inp)


def test_in_place_updates_equal_fresh_outputs():
    """The updates as the stdlib will write them: every output into its like-named input."""
    for name in ("batchnorm_stats_update", "lars_step", "ema_update", "unscale_check",
                 "update_scale", "offset_advance", "nonfinite_check", "amp_sgd_step", "amp_lars_step"):
        k = kernel(name)
        _, ins, attrs = _sample(name)
        fresh = run(name, [i.copy() for i in ins], attrs)
        outs = [ins[k.inputs.index(o)] for o in k.outputs]
        k.cpu(ins, outs, attrs)
        for got, want in zip(outs, fresh):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("key", list(SAMPLES))
def test_arena_views_work_and_in_place_outputs_alias(key):
    """Inputs and outputs as views into one byte arena; where an output has an input's type it
    is that input's very view (the `into` case)."""
    name, ins, attrs = _sample(key)
    assert_runs_in_one_arena(name, ins, attrs)


@pytest.mark.parametrize("key", [k for k in SAMPLES if k not in ("offset_advance", "cast")])
def test_float32_runs_and_keeps_its_dtype(key):
    name, ins, attrs = _sample(key)
    want = run(name, ins, attrs)
    low = [i.astype(np.float32) if i.dtype == np.float64 else i for i in ins]
    got = run(name, low, attrs)
    for g, w in zip(got, want):
        assert g.dtype == (np.float32 if w.dtype == np.float64 else w.dtype)
        close(g.astype(np.float64), w, 1e-5 * max(1.0, float(np.abs(w[np.isfinite(w)]).max())))


# ---------------------------------------------------------------------------------------------
# Type rules: codes, argument indices, messages naming the shapes

F = "f32"
IMG = ((2, 8, 8, 3), F)


@pytest.mark.parametrize("name,types,attrs,code,arg,words", [
    ("conv2d", [((2, 8, 8), F), ((3, 3, 3, 4), F)], {}, "S003", 0,
     ["x must be 4-D [n, h, w, c] (NHWC)", "got [2, 8, 8]"]),
    ("conv2d", [IMG, ((3, 3, 4, 8), F)], {}, "S003", 1,
     ["channels differ", "x [2, 8, 8, 3] has c = 3", "w [3, 3, 4, 8]", "expects c = 4"]),
    ("conv2d", [((1, 2, 2, 3), F), ((3, 3, 3, 4), F)], {}, "S003", 0,
     ["3 x 3 kernel does not fit x [1, 2, 2, 3]"]),
    ("conv2d", [IMG, ((3, 3, 3, 4), "f16")], {}, "S004", 1, ["x is f32", "w is f16"]),
    ("conv2d", [IMG, ((3, 3, 3, 4), F)], {"stride": 0}, "S003", None, ["stride = 0", ">= 1"]),
    ("conv2d", [IMG, ((3, 3, 3, 4), F)], {"pad": 1.5}, "S003", None, ["pad must be an integer"]),
    ("conv2d_grad_x", [((2, 6, 6, 4), F), ((3, 3, 3, 4), F)], {"in_w": 8}, "S003", None,
     ["in_h must be given"]),
    ("conv2d_grad_x", [((2, 5, 6, 4), F), ((3, 3, 3, 4), F)], {"in_h": 8, "in_w": 8}, "S003", 0,
     ["dy is [2, 5, 6, 4]", "gives [2, 6, 6, 4]"]),
    ("conv2d_grad_x", [((2, 6, 6, 5), F), ((3, 3, 3, 4), F)], {"in_h": 8, "in_w": 8}, "S003", 1,
     ["dy [2, 6, 6, 5] has k = 5", "produces k = 4"]),
    ("conv2d_grad_w", [IMG, ((2, 6, 6, 4), F)], {"kh": 3}, "S003", None, ["kw must be given"]),
    ("conv2d_grad_w", [IMG, ((3, 6, 6, 4), F)], {"kh": 3, "kw": 3}, "S003", 1,
     ["batch sizes differ", "[3, 6, 6, 4]"]),
    ("conv2d_grad_w", [IMG, ((2, 4, 4, 4), F)], {"kh": 3, "kw": 3}, "S003", 1,
     ["dy is [2, 4, 4, 4]", "gives [2, 6, 6, 4]"]),
    ("sum_nhw", [((5,), F)], {}, "S003", 0, ["[n, h, w, c] or [n, c]", "got [5]"]),
    ("maxpool2d", [((2, 8, 8), F)], {}, "S003", 0, ["4-D"]),
    ("maxpool2d", [((2, 1, 8, 3), F)], {}, "S003", 0, ["2 x 2 window does not fit x [2, 1, 8, 3]"]),
    ("maxpool2d", [((2, 4, 4, 3), "i32")], {}, "S004", 0, ["float"]),
    ("maxpool2d_grad", [((2, 3, 4, 3), F), IMG], {}, "S003", 0,
     ["dy is [2, 3, 4, 3]", "maxpool2d of x [2, 8, 8, 3]", "gives [2, 4, 4, 3]"]),
    ("avgpool2d_grad", [((2, 4, 4, 3), "f64"), IMG], {}, "S004", 1, ["dtypes differ"]),
    ("global_avgpool_grad", [((2, 4), F), IMG], {}, "S003", 0, ["dy must be [2, 3]", "got [2, 4]"]),
    ("batchnorm_train", [IMG, ((4,), F), ((3,), F)], {}, "S003", 1,
     ["gamma must be [3]", "x [2, 8, 8, 3]", "got [4]"]),
    ("batchnorm_train", [((1, 3), F), ((3,), F), ((3,), F)], {}, "S003", 0,
     ["1 value per channel", "at least 2"]),
    ("batchnorm_train", [IMG, ((3,), F), ((3,), "f16")], {}, "S004", 2,
     ["gamma is f32", "beta is f16"]),
    ("batchnorm_grad", [((2, 8, 8, 3), F), ((2, 8, 4, 3), F)] + [((3,), F)] * 3, {}, "S003", 1,
     ["dy is [2, 8, 8, 3]", "x is [2, 8, 4, 3]"]),
    ("batchnorm_grad", [IMG, IMG, ((3,), F), ((2,), F), ((3,), F)], {}, "S003", 3,
     ["mean must be [3]"]),
    ("batchnorm_stats_update", [((3,), F)] * 4, {}, "S003", None, ["count must be given"]),
    ("batchnorm_stats_update", [((3,), F)] * 4, {"count": 1}, "S003", None, ["count = 1"]),
    ("batchnorm_stats_update", [((3,), F)] * 3 + [((4,), F)], {"count": 8}, "S003", 3,
     ["running_mean is [3]", "invstd is [4]"]),
    ("batchnorm_stats_update", [((3,), F)] * 4, {"count": 8, "momentum": 1.5}, "S003", None,
     ["momentum"]),
    ("batchnorm_infer", [IMG] + [((3,), F)] * 3 + [((3, 1), F)], {}, "S003", 4,
     ["running_var must be [3]"]),
    ("dropout", [((4, 5), F), ((1,), "i64")], {}, "S003", 1, ["offset must be a scalar"]),
    ("dropout", [((4, 5), F), ((), "f16")], {}, "S004", 1, ["offset", "i32, i64, f32, f64"]),
    ("dropout", [((4, 5), F), ((), "i64")], {"p": 1.0}, "S003", None, ["p = 1.0", "[0.0, 1.0)"]),
    ("dropout", [((4, 5), F), ((), "i64")], {"mask": "bool"}, "S003", None, ["mask must be u8"]),
    ("dropout", [((4, 5), F), ((), "i64")], {"seed": -1}, "S003", None, ["seed = -1"]),
    ("dropout", [((4, 5), "i32"), ((), "i64")], {}, "S004", 0, ["x must be a float"]),
    ("dropout_grad", [((4, 5), F), ((4, 5), "i32")], {}, "S004", 1, ["mask", "u8, f32"]),
    ("dropout_grad", [((4, 5), F), ((5, 4), "u8")], {}, "S003", 1, ["[4, 5]", "[5, 4]"]),
    ("offset_advance", [((2,), "i64")], {}, "S003", 0, ["offset must be a scalar"]),
    ("offset_advance", [((), "i64")], {"by": 0.5}, "S003", None, ["by must be an integer"]),
    ("lars_step", [((3, 4), F), ((3, 4), F), ((4, 3), F), ((), F)], {}, "S003", 2,
     ["w is [3, 4]", "v is [4, 3]"]),
    ("lars_step", [((3,), F)] * 3 + [((1,), F)], {}, "S003", 3, ["lr must be a scalar"]),
    ("lars_step", [((3,), F)] * 3 + [((), F)], {"trust": -1.0}, "S003", None, ["trust"]),
    ("ema_update", [((3,), F), ((3,), "i32")], {}, "S004", 1, ["w", "i32"]),
    ("ema_update", [((3,), F), ((3,), F)], {"decay": 2.0}, "S003", None, ["decay"]),
    ("cast", [((3,), F)], {"dtype": "i32"}, "S003", None, ["dtype must be a float dtype"]),
    ("cast", [((3,), "i32")], {}, "S004", 0, ["x must be a float"]),
    ("scale_loss", [((), F), ((1,), F)], {}, "S003", 1, ["scale must be a scalar"]),
    ("unscale_check", [((3,), F), ((), F), ((3,), F)], {}, "S003", 2,
     ["found_inf must be a scalar"]),
    ("update_scale", [((), F), ((), F), ((), "f16")], {}, "S004", 2, ["good_steps"]),
    ("update_scale", [((), F), ((), F), ((), "i32")], {"interval": 0}, "S003", None,
     ["interval = 0"]),
    ("update_scale", [((), F), ((), F), ((), "i32")], {"backoff": 2.0}, "S003", None,
     ["backoff"]),
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
    ("conv2d", [((8, 32, 32, 3), F), ((3, 3, 3, 16), F)], {"pad": 1}, [((8, 32, 32, 16), F)]),
    ("conv2d", [((8, 32, 31, 3), F), ((3, 3, 3, 16), F)], {"stride": 2}, [((8, 15, 15, 16), F)]),
    ("conv2d_grad_x", [((8, 15, 15, 16), F), ((3, 3, 3, 16), F)],
     {"stride": 2, "in_h": 32, "in_w": 31}, [((8, 32, 31, 3), F)]),
    ("conv2d_grad_x", [((8, 15, 15, 16), F), ((3, 3, 3, 16), F)],
     {"stride": 2, "in_h": 31, "in_w": 32}, [((8, 31, 32, 3), F)]),
    ("conv2d_grad_w", [((8, 32, 32, 3), "f16"), ((8, 32, 32, 16), "f16")],
     {"kh": 3, "kw": 3, "pad": 1}, [((3, 3, 3, 16), "f16")]),
    ("bias_add", [((8, 32, 32, 16), F), ((16,), F)], {}, [((8, 32, 32, 16), F)]),
    ("sum_nhw", [((8, 32, 32, 16), F)], {}, [((16,), F)]),
    ("sum_nhw", [((8, 16), "f64")], {}, [((16,), "f64")]),
    ("maxpool2d", [((8, 33, 32, 16), F)], {}, [((8, 16, 16, 16), F)]),
    ("maxpool2d", [((8, 32, 32, 16), F)], {"size": 3, "stride": 2}, [((8, 15, 15, 16), F)]),
    ("avgpool2d_grad", [((8, 16, 16, 4), F), ((8, 33, 32, 4), F)], {}, [((8, 33, 32, 4), F)]),
    ("global_avgpool", [((8, 4, 4, 64), F)], {}, [((8, 64), F)]),
    ("global_avgpool_grad", [((8, 64), F), ((8, 4, 4, 64), F)], {}, [((8, 4, 4, 64), F)]),
    ("batchnorm_train", [((8, 4, 4, 64), "f16"), ((64,), F), ((64,), F)], {},
     [((8, 4, 4, 64), "f16"), ((64,), F), ((64,), F)]),
    ("batchnorm_train", [((8, 64), F), ((64,), F), ((64,), F)], {},
     [((8, 64), F), ((64,), F), ((64,), F)]),
    ("batchnorm_grad", [((8, 4, 4, 64), "f16")] * 2 + [((64,), F)] * 3, {},
     [((8, 4, 4, 64), "f16"), ((64,), F), ((64,), F)]),
    ("batchnorm_stats_update", [((64,), F)] * 4, {"count": 128}, [((64,), F)] * 2),
    ("batchnorm_infer", [((8, 4, 4, 64), F)] + [((64,), F)] * 4, {}, [((8, 4, 4, 64), F)]),
    ("dropout", [((8, 64), "f16"), ((), "f32")], {}, [((8, 64), "f16"), ((8, 64), "u8")]),
    ("dropout", [((8, 64), F), ((), "i64")], {"mask": "f32", "seed": 2 ** 63},
     [((8, 64), F), ((8, 64), F)]),
    ("dropout_grad", [((8, 64), F), ((8, 64), "u8")], {}, [((8, 64), F)]),
    ("offset_advance", [((), "f32")], {}, [((), "f32")]),
    ("lars_step", [((3, 3, 3, 16), F)] * 3 + [((), F)], {}, [((3, 3, 3, 16), F)] * 2),
    ("ema_update", [((16,), F)] * 2, {}, [((16,), F)]),
    ("cast", [((16,), F)], {}, [((16,), "f16")]),
    ("cast", [((16,), "f16")], {"dtype": "f32"}, [((16,), F)]),
    ("scale_loss", [((), F), ((), F)], {}, [((), F)]),
    ("unscale_check", [((16,), "f16"), ((), F), ((), F)], {}, [((16,), "f16"), ((), F)]),
    ("update_scale", [((), F), ((), F), ((), "i32")], {}, [((), F), ((), "i32")]),
])
def test_type_rules_accept(name, types, attrs, want):
    assert infer_types(name, types, attrs) == want
