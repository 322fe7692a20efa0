"""The CUDA twins of the CNN-step kernels (stdlib.kernels.CNN_KERNELS) against their NumPy twins, run to
run bitwise determinism, Philox masks against `dropout_bits`, and a captured conv2d +
batchnorm_train + dropout + offset_advance graph whose replays draw new masks and allocate
nothing.  Needs CuPy and a GPU; skips itself otherwise (`pytest -m cuda`)."""

from __future__ import annotations

import numpy as np
import pytest

import streamsched.stdlib.kernels.dropout as kc
from streamsched.stdlib.kernels import CNN_KERNELS, KERNELS, infer_types, numpy_dtype

pytestmark = pytest.mark.cuda


# fixtures `cp` (CuPy on a usable device, else skip) and `ctx` live in tests/conftest.py


_DT = {np.dtype(np.float64): "f64", np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
       np.dtype(np.int32): "i32", np.dtype(np.int64): "i64", np.dtype(np.uint8): "u8"}
_rng = np.random.default_rng(4321)


def _f(*shape, scale=1.0, dt=np.float32):
    return np.asarray(_rng.standard_normal(shape) * scale, dtype=dt)


def _pos(*shape, dt=np.float32):
    return np.asarray(np.abs(_rng.standard_normal(shape)) + 0.5, dtype=dt)


def _s(v, dt=np.float32):
    return np.array(v, dtype=dt).reshape(())


def _ties():
    """A pooling input with ties and NaNs inside windows."""
    x = np.round(_f(2, 6, 6, 3) * 2) / 2  # many equal values
    x[0, 1, 1, 0] = np.nan
    x[1, 4, 3, 2] = np.nan
    x[1, 0, 0, 1] = np.nan
    x[1, 0, 1, 1] = np.nan
    return x.astype(np.float32)


# name, inputs, attrs, exact (bitwise equal to the NumPy twin)
CASES = [
    ("conv2d", [_f(4, 8, 8, 16), _f(3, 3, 16, 16, scale=0.2)], {"pad": 1}, False),
    ("conv2d", [_f(2, 5, 6, 2), _f(3, 2, 2, 3)], {"stride": 2}, False),
    ("conv2d", [_f(1, 6, 5, 3), _f(3, 3, 3, 2)], {"stride": 2, "pad": 1}, False),
    ("conv2d", [_f(2, 4, 4, 2), _f(1, 1, 2, 3)], {}, False),
    ("conv2d", [_f(2, 5, 6, 2, dt=np.float64), _f(3, 2, 2, 3, dt=np.float64)], {"pad": 1}, False),
    ("conv2d_grad_x", [_f(4, 8, 8, 16), _f(3, 3, 16, 16, scale=0.2)],
     {"pad": 1, "in_h": 8, "in_w": 8}, False),
    ("conv2d_grad_x", [_f(2, 3, 3, 3), _f(2, 2, 3, 3)], {"stride": 2, "pad": 1, "in_h": 4, "in_w": 4},
     False),
    ("conv2d_grad_x", [_f(1, 2, 3, 2), _f(3, 2, 2, 2)], {"stride": 2, "in_h": 6, "in_w": 7}, False),
    ("conv2d_grad_w", [_f(4, 8, 8, 16), _f(4, 8, 8, 16)], {"kh": 3, "kw": 3, "pad": 1}, False),
    ("conv2d_grad_w", [_f(2, 5, 6, 2), _f(2, 2, 3, 3)], {"kh": 3, "kw": 2, "stride": 2}, False),
    ("conv2d_grad_w", [_f(1, 6, 5, 3), _f(1, 3, 3, 2)], {"kh": 3, "kw": 3, "stride": 2, "pad": 1}, False),
    ("conv2d_grad_x", [_f(2, 4, 4, 3), _f(1, 1, 2, 3)], {"in_h": 4, "in_w": 4}, False),
    ("conv2d_grad_w", [_f(2, 4, 4, 2), _f(2, 4, 4, 3)], {"kh": 1, "kw": 1}, False),
    ("conv2d_grad_x", [_f(2, 5, 7, 3, dt=np.float64), _f(3, 2, 2, 3, dt=np.float64)],
     {"pad": 1, "in_h": 5, "in_w": 6}, False),
    ("conv2d_grad_w", [_f(2, 5, 6, 2, dt=np.float64), _f(2, 5, 7, 3, dt=np.float64)],
     {"kh": 3, "kw": 2, "pad": 1}, False),
    ("sum_nhw", [_f(4, 8, 8, 16)], {}, False),
    ("sum_nhw", [_f(300, 7)], {}, False),
    # sizes for the cluster kernels (sm_90+): exactly SS_U rows a thread, rows past the registers,
    # two channel tiles with idle lanes, f64
    ("sum_nhw", [_f(100000, 3)], {}, False),
    ("sum_nhw", [_f(64, 8, 8, 48, dt=np.float64)], {}, False),
    ("sum_nhw", [_f(2, 16, 8, 160)], {}, False),  # >= 128 channels: ss_colsum
    ("maxpool2d", [_f(4, 8, 8, 16)], {}, True),
    ("maxpool2d", [_ties()], {"size": 3, "stride": 1}, True),
    ("maxpool2d", [_ties()], {}, True),
    ("maxpool2d_grad", [_f(4, 4, 4, 16), _f(4, 8, 8, 16)], {}, True),
    ("maxpool2d_grad", [_f(2, 4, 4, 3), _ties()], {"size": 3, "stride": 1}, True),
    ("maxpool2d_grad", [_f(2, 2, 2, 3), _ties()], {"size": 3, "stride": 2}, True),
    ("avgpool2d", [_f(4, 8, 8, 16)], {}, False),
    ("avgpool2d", [_f(2, 7, 6, 3)], {"size": 3, "stride": 2}, False),
    ("avgpool2d_grad", [_f(4, 4, 4, 16), _f(4, 8, 8, 16)], {}, True),
    ("avgpool2d_grad", [_f(2, 3, 2, 3), _f(2, 7, 6, 3)], {"size": 3, "stride": 2}, True),
    ("global_avgpool", [_f(4, 8, 8, 16)], {}, False),
    ("global_avgpool_grad", [_f(4, 16), _f(4, 8, 8, 16)], {}, True),
    ("batchnorm_train", [_f(16, 8, 8, 16, scale=2) + 1, _f(16), _f(16)], {}, False),
    ("batchnorm_train", [_f(300, 5), _f(5), _f(5)], {"eps": 1e-3}, False),
    ("batchnorm_train", [_f(4, 3, 3, 2, dt=np.float16), _pos(2), _f(2)], {}, False),
    ("batchnorm_train", [_f(64, 8, 8, 16, scale=3) + 2, _f(16), _f(16)], {}, False),
    ("batchnorm_train", [_f(100000, 3) + 5, _pos(3), _f(3)], {}, False),
    ("batchnorm_train", [_f(40, 48, dt=np.float64), _f(48, dt=np.float64), _f(48, dt=np.float64)], {}, False),
    ("batchnorm_train", [_f(64, 8, 8, 16, dt=np.float16), _pos(16), _f(16)], {}, False),
    ("batchnorm_grad", [_f(16, 8, 8, 16), _f(16, 8, 8, 16), _f(16), _f(16, scale=0.1), _pos(16)], {},
     False),
    ("batchnorm_grad", [_f(300, 5), _f(300, 5), _f(5), _f(5), _pos(5)], {}, False),
    ("batchnorm_grad", [_f(64, 8, 8, 16), _f(64, 8, 8, 16, scale=3) + 2, _f(16), _f(16, scale=0.1), _pos(16)],
     {}, False),
    ("batchnorm_grad", [_f(100000, 3), _f(100000, 3), _f(3), _f(3), _pos(3)], {}, False),
    ("batchnorm_grad", [_f(40, 48, dt=np.float64), _f(40, 48, dt=np.float64), _f(48, dt=np.float64),
                        _f(48, dt=np.float64), _pos(48, dt=np.float64)], {}, False),
    ("batchnorm_grad", [_f(64, 8, 8, 16, dt=np.float16), _f(64, 8, 8, 16, dt=np.float16), _pos(16), _f(16, scale=0.1),
                        _pos(16)], {}, False),
    ("batchnorm_stats_update", [_f(16), _pos(16), _f(16), _pos(16)], {"count": 1024}, False),
    ("batchnorm_stats_update", [_f(5), _pos(5), _f(5), _pos(5)], {"count": 3, "momentum": 0.3},
     False),
    ("batchnorm_infer", [_f(4, 8, 8, 16), _f(16), _f(16), _f(16), _pos(16)], {}, False),
    ("batchnorm_train_relu", [_f(64, 8, 8, 16, scale=3) + 2, _f(16), _f(16)], {}, False),
    ("batchnorm_train_relu", [_f(300, 5), _f(5), _f(5)], {"eps": 1e-3}, False),
    ("batchnorm_train_add_relu", [_f(64, 8, 8, 16, scale=3) + 2, _f(16), _f(16), _f(64, 8, 8, 16)], {}, False),
    ("batchnorm_train_add_relu", [_f(4, 3, 3, 2, dt=np.float16), _pos(2), _f(2), _f(4, 3, 3, 2, dt=np.float16)], {},
     False),
    ("batchnorm_grad_relu", [_f(64, 8, 8, 16), _f(64, 8, 8, 16), _f(64, 8, 8, 16, scale=3) + 2, _f(16),
                             _f(16, scale=0.1), _pos(16)], {}, False),
    ("batchnorm_grad_relu", [_f(300, 5), _f(300, 5), _f(300, 5), _f(5), _f(5), _pos(5)], {}, False),
    ("batchnorm_infer", [_f(4, 3, 3, 2, dt=np.float16), _f(2), _f(2), _f(2), _pos(2)], {}, False),
    ("dropout", [_f(4, 8, 8, 16), _s(3, np.int64)], {"p": 0.1, "seed": 7}, False),
    ("dropout", [_f(37, 3), _s(5, np.int32)], {"p": 0.5, "seed": (9 << 32) | 11, "mask": "f32"},
     False),
    ("dropout", [_f(1001), _s(2.0, np.float32)], {"p": 0.3, "seed": 1}, False),
    ("dropout", [_f(64), _s((1 << 32) + 6, np.int64)], {"p": 0.25, "seed": 2}, False),
    ("dropout", [_f(40, 3, dt=np.float64), _s(1.0, np.float64)], {"p": 0.5, "seed": 4}, False),
    ("dropout_grad", [_f(4, 8, 8, 16), (_f(4, 8, 8, 16) > 0).astype(np.uint8)], {"p": 0.1}, True),
    ("dropout_grad", [_f(37, 3), (_f(37, 3) > 0).astype(np.float32)], {"p": 0.5}, True),
    ("offset_advance", [_s(3, np.int64)], {}, True),
    ("offset_advance", [_s(7, np.int32)], {"by": 2}, True),
    ("offset_advance", [_s(7.0, np.float32)], {"by": 2}, True),
    ("offset_advance", [_s(7.0, np.float64)], {}, True),
    ("lars_step", [_f(3, 3, 16, 16), _f(3, 3, 16, 16, scale=0.01), _f(3, 3, 16, 16, scale=0.01),
                   _s(0.1)], {}, False),
    ("lars_step", [_f(1000), _f(1000), np.zeros(1000, np.float32), _s(0.5)],
     {"momentum": 0.5, "weight_decay": 0.01, "trust": 1.0}, False),
    ("lars_step", [np.zeros(7, np.float32), _f(7), _f(7), _s(0.1)], {}, False),
    ("ema_update", [_f(3, 3, 16, 16), _f(3, 3, 16, 16)], {"decay": 0.9}, False),
    ("cast", [np.array([1.0, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 65504.0, 65519.0, 65520.0, -1e6,
                        np.nan, 1e-8, -0.0], np.float32)], {"dtype": "f16"}, True),
    ("cast", [_f(1000, scale=100)], {"dtype": "f16"}, True),
    ("cast", [_f(1000, scale=100).astype(np.float16)], {"dtype": "f32"}, True),
    ("cast", [_f(1000, dt=np.float64)], {"dtype": "f32"}, True),
    ("cast", [_f(1000)], {"dtype": "f64"}, True),
    ("cast", [_f(1000, scale=100, dt=np.float64)], {"dtype": "f16"}, True),
    ("cast", [_f(10)], {"dtype": "f32"}, True),
    ("scale_loss", [_s(0.75), _s(1024.0)], {}, True),
    ("scale_loss", [_f(5), _s(8.0)], {}, True),
    ("unscale_check", [_f(3, 3, 16, 16, scale=1024), _s(1024.0), _s(0.0)], {}, True),
    ("unscale_check", [np.array([1.0, np.inf, 4.0, np.nan], np.float32), _s(1024.0), _s(0.0)], {},
     True),
    ("unscale_check", [_f(9), _s(3.0), _s(1.0)], {}, True),
    ("unscale_check", [np.array([1024.0, 65504.0], np.float16), _s(1024.0), _s(0.0)], {}, True),
    ("update_scale", [_s(65536.0), _s(0.0), _s(0, np.int32)], {"interval": 3}, True),
    ("update_scale", [_s(65536.0), _s(0.0), _s(2, np.int32)], {"interval": 3}, True),
    ("update_scale", [_s(65536.0), _s(1.0), _s(2, np.int32)], {"interval": 3}, True),
    ("update_scale", [_s(3e38), _s(0.0), _s(1999, np.int32)], {}, True),
    ("update_scale", [_s(8.0, np.float64), _s(0.0, np.float64), _s(1999.0, np.float64)], {}, True),
    ("update_scale", [_s(8.0), _s(np.nan), _s(5, np.int64)], {}, True),
    ("nonfinite_check", [_f(3, 3, 16, 16, scale=1000, dt=np.float16), _s(0.0)], {}, True),
    ("nonfinite_check", [np.array([1.0, np.inf, 4.0], np.float16), _s(0.0)], {}, True),
    ("nonfinite_check", [np.array([1.0, 2.0, np.nan], np.float32), _s(0.0)], {}, True),
    ("nonfinite_check", [_f(7), _s(1.0)], {}, True),
    # f16 model copy and scaled gradient, f32 master and momentum (mixed precision)
    ("amp_sgd_step", [_f(3, 3, 16, 16, dt=np.float16), _f(3, 3, 16, 16, scale=512, dt=np.float16),
                      _f(3, 3, 16, 16), _f(3, 3, 16, 16, scale=0.1), _s(0.05), _s(1024.0), _s(0.0)],
     {"weight_decay": 1e-4}, True),
    ("amp_sgd_step", [_f(100, dt=np.float16), _f(100, dt=np.float16), _f(100), _f(100), _s(0.1),
                      _s(8.0), _s(0.0)], {"momentum": 0.5, "nesterov": True}, True),
    ("amp_sgd_step", [_f(10), _f(10), _f(10), _f(10), _s(0.1), _s(1.0), _s(0.0)], {"momentum": 0.0}, True),
    ("amp_sgd_step", [_f(64, dt=np.float16), _f(64, dt=np.float16), _f(64), _f(64), _s(0.1), _s(2.0),
                      _s(1.0)], {}, True),  # found_inf set: the step is skipped
    ("amp_lars_step", [_f(3, 3, 16, 16, dt=np.float16), _f(3, 3, 16, 16, scale=512, dt=np.float16),
                       _f(3, 3, 16, 16), _f(3, 3, 16, 16, scale=0.01), _s(2.0), _s(1024.0), _s(0.0)], {}, False),
    ("amp_lars_step", [_f(1000, dt=np.float16), _f(1000, dt=np.float16), _f(1000), np.zeros(1000, np.float32),
                       _s(0.5), _s(4.0), _s(0.0)], {"momentum": 0.5, "weight_decay": 0.01, "trust": 1.0}, False),
    ("amp_lars_step", [_f(64, dt=np.float16), _f(64, dt=np.float16), _f(64), _f(64), _s(0.1), _s(2.0),
                       _s(1.0)], {}, True),  # found_inf set: the step is skipped
    ("ema_update", [_f(3, 3, 16, 16), _f(3, 3, 16, 16, dt=np.float16)], {"decay": 0.999}, False),
]


def _ids():
    return [f"{i}-{c[0]}" for i, c in enumerate(CASES)]


def test_cases_cover_every_cnn_kernel(cp):
    assert {c[0] for c in CASES} == set(CNN_KERNELS)


def test_every_cnn_kernel_has_its_cuda_twin(cp):
    import importlib

    from streamsched.stdlib.kernels import CUDA_KERNELS

    for name in CNN_KERNELS:
        mod, _, attr = KERNELS[name].cuda.partition(":")
        assert mod.startswith("streamsched.stdlib.kernels.") and attr == f"{name}_cuda"
        assert getattr(importlib.import_module(mod), attr) is CUDA_KERNELS[name], name


def _numpy(name, ins, attrs):
    types = [(a.shape, _DT[a.dtype]) for a in ins]
    outs = [np.zeros(s, numpy_dtype(d)) for s, d in infer_types(name, types, attrs)]
    KERNELS[name].cpu([a.copy() for a in ins], outs, attrs)
    return outs


def _device(cp, ctx, name, ins, attrs, stream="s1", in_place=True):
    """Run the CUDA twin on fresh device copies; outputs named like an input are that input's
    array (in place, as the executor passes them) unless in_place is False."""
    from streamsched.stdlib.kernels import CUDA_KERNELS

    rec = KERNELS[name]
    full = {**rec.attrs, **attrs}
    g_ins = [cp.asarray(np.array(a, order="C")) for a in ins]
    types = [(a.shape, _DT[a.dtype]) for a in ins]
    g_outs = []
    for j, (s, d) in enumerate(infer_types(name, types, attrs)):
        oname = rec.outputs[j]
        if in_place and oname in rec.inputs:
            g_outs.append(g_ins[rec.inputs.index(oname)])
        else:
            g_outs.append(cp.full(s, 77, dtype=numpy_dtype(d)))
    cp.cuda.runtime.deviceSynchronize()  # the copies ran on the legacy stream
    CUDA_KERNELS[name](ctx, stream, g_ins, g_outs, full)
    ctx.synchronize()
    return [cp.asnumpy(o) for o in g_outs]


def _compare(got, want, exact, name):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        if exact or w.dtype.kind in "iu":
            np.testing.assert_array_equal(g, w)
            continue
        if w.dtype == np.float16:
            rtol, atol = 2e-3, 2e-3 * max(1.0, float(np.nanmax(np.abs(w.astype(np.float32)))))
        else:
            rtol = 1e-5
            finite = np.abs(w[np.isfinite(w)])
            atol = 1e-5 * max(1.0, float(finite.max())) if finite.size else 0.0
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", range(len(CASES)), ids=_ids())
def test_cuda_twin_matches_numpy(cp, ctx, case):
    name, ins, attrs, exact = CASES[case]
    want = _numpy(name, ins, attrs)
    got = _device(cp, ctx, name, ins, attrs)
    if name == "dropout":  # the mask exactly; y within rounding (f32 product) of the twin
        np.testing.assert_array_equal(got[1], want[1])
    _compare(got, want, exact, name)


@pytest.mark.parametrize("path", ["gemm", "direct"])
@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES) if c[0].startswith("conv2d")],
                         ids=lambda i: f"{i}-{CASES[i][0]}")
def test_both_conv_paths_match_numpy_and_are_deterministic(cp, ctx, monkeypatch, case, path):
    """conv2d[_grad_x|_grad_w] take im2col/col2im + cuBLAS or, for small problems, the direct
    kernels: each path alone against the NumPy twin, and bitwise the same on both streams."""
    from streamsched.stdlib.kernels import CUDA_KERNELS, conv

    name, ins, attrs, _ = CASES[case]
    monkeypatch.setitem(CUDA_KERNELS, name, getattr(conv, f"_{name}_{path}"))
    got = _device(cp, ctx, name, ins, attrs, stream="s0")
    _compare(got, _numpy(name, ins, attrs), False, name)
    again = _device(cp, ctx, name, ins, attrs, stream="s1")
    assert got[0].tobytes() == again[0].tobytes(), name


@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES)
                                  if any(o in KERNELS[c[0]].inputs for o in KERNELS[c[0]].outputs)],
                         ids=lambda i: f"{i}-{CASES[i][0]}")
def test_separate_outputs_equal_in_place(cp, ctx, case):
    name, ins, attrs, _ = CASES[case]
    a = _device(cp, ctx, name, ins, attrs, in_place=True)
    b = _device(cp, ctx, name, ins, attrs, in_place=False)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes(), name


@pytest.mark.parametrize("case", range(len(CASES)), ids=_ids())
def test_cuda_twin_is_bitwise_deterministic(cp, ctx, case):
    name, ins, attrs, _ = CASES[case]
    first = _device(cp, ctx, name, ins, attrs, stream="s0")
    for stream in ("s0", "s1"):
        again = _device(cp, ctx, name, ins, attrs, stream=stream)
        for x, y in zip(first, again):
            assert x.tobytes() == y.tobytes(), name


_CHANNEL_SUMS = [i for i, c in enumerate(CASES) if c[0] in ("batchnorm_train", "batchnorm_grad", "sum_nhw",
                                                             "batchnorm_train_relu", "batchnorm_train_add_relu",
                                                             "batchnorm_grad_relu")]


@pytest.mark.parametrize("case", _CHANNEL_SUMS, ids=lambda i: f"{i}-{CASES[i][0]}")
def test_cluster_and_block_channel_sums_agree(cp, ctx, monkeypatch, case):
    """batch norm and sum_nhw take the thread-block-cluster kernels on sm_90+ and the
    one-block-per-channel kernels elsewhere: both within rounding of each other (their sums add
    in different orders), and the cluster kernels are the ones that run on this device when it
    is sm_90+."""
    from streamsched.stdlib.kernels import _cuda as choice

    name, ins, attrs, _ = CASES[case]
    cc = int(cp.cuda.Device().compute_capability)
    monkeypatch.setattr(choice, "CLUSTER_ROWS", {"batchnorm": 0, "sum_nhw": 0})  # every size
    assert (choice._cluster_tile(cp.zeros((4, 3), cp.float32)) is not None) == (cc >= 90)
    fast = _device(cp, ctx, name, ins, attrs)
    monkeypatch.setattr(choice, "CLUSTER", False)
    assert choice._cluster_tile(cp.zeros((4, 3), cp.float32)) is None
    block = _device(cp, ctx, name, ins, attrs)
    _compare(fast, block, False, name)


def test_cluster_kernels_run_from_their_row_counts(cp):
    """Which kernel a size takes (_cuda.CLUSTER_ROWS): the cluster kernels from 2048 rows
    per channel for batch norm and 8192 for sum_nhw, on sm_90+ only; the tile is the smallest
    power of two >= c, at most 32."""
    from streamsched.stdlib.kernels import _cuda as choice

    hopper = int(cp.cuda.Device().compute_capability) >= 90
    tile = choice._cluster_tile
    assert tile(cp.zeros((2047, 16), cp.float32)) is None
    assert tile(cp.zeros((2048, 16), cp.float32)) == (16 if hopper else None)
    assert tile(cp.zeros((32, 8, 8, 3), cp.float32)) == (4 if hopper else None)
    assert tile(cp.zeros((4096, 48), cp.float32)) == (32 if hopper else None)
    assert tile(cp.zeros((4096, 16), cp.float32), "sum_nhw") is None
    assert tile(cp.zeros((8192, 1), cp.float32), "sum_nhw") == (1 if hopper else None)


@pytest.mark.parametrize("seed,offset,size", [(0, 0, 4), (7, 3, 1001), ((7 << 32) | 3, (1 << 32) + 5, 11),
                                              (12345, 11, 4096), ((1 << 64) - 1, 99, 37)])
@pytest.mark.parametrize("odt", [np.int64, np.float64])
def test_dropout_mask_is_philox_bit_for_bit(cp, ctx, seed, offset, size, odt):
    if odt is np.float64 and offset >= 1 << 53:
        pytest.skip("offset not exact in f64")
    p = 0.37
    x = _f(size)
    y, mask = _device(cp, ctx, "dropout", [x, _s(offset, odt)], {"p": p, "seed": seed})
    bits = kc.dropout_bits(size, seed, offset)
    keep = bits >= np.uint32(kc.dropout_threshold(p))
    np.testing.assert_array_equal(mask, keep.astype(np.uint8))
    np.testing.assert_array_equal(y, np.where(keep, x * np.float32(1.0 / (1.0 - p)), np.float32(0)))


def test_fp16_activations_through_dropout_and_batchnorm(cp, ctx):
    x = _f(8, 4, 4, 6, dt=np.float16)
    for name, ins, attrs in (("dropout", [x, _s(4, np.int64)], {"p": 0.2, "seed": 3}),
                             ("batchnorm_train", [x, _pos(6), _f(6)], {}),
                             ("maxpool2d", [x], {}),
                             ("conv2d", [x, _f(3, 3, 6, 4, dt=np.float16)], {"pad": 1}),
                             ("conv2d_grad_x", [_f(8, 4, 4, 5, dt=np.float16), _f(3, 3, 6, 5, dt=np.float16)],
                              {"pad": 1, "in_h": 4, "in_w": 4}),
                             ("conv2d_grad_w", [x, _f(8, 2, 2, 5, dt=np.float16)],
                              {"kh": 3, "kw": 3, "stride": 2, "pad": 1})):
        want = _numpy(name, ins, attrs)
        got = _device(cp, ctx, name, ins, attrs)
        _compare(got, want, name == "maxpool2d", name)


def test_unscale_check_never_clears_found_inf(cp, ctx):
    g = np.ones(5, np.float32)
    _, flag = _device(cp, ctx, "unscale_check", [g, _s(2.0), _s(1.0)], {})
    assert flag == 1.0
    _, flag = _device(cp, ctx, "unscale_check", [g, _s(2.0), _s(0.0)], {})
    assert flag == 0.0


def _graph_types(graph):
    from streamsched.interp.cuda import graph_nodes_edges

    types, _ = graph_nodes_edges(graph)
    return types


def test_captured_conv_bn_dropout_replays_draw_new_masks_without_allocating(cp, ctx):
    """conv2d -> batchnorm_train -> dropout -> offset_advance captured in one graph on s0: each
    replay reads the advanced device offset (a new mask, the one dropout_bits gives for that
    offset), the rest is bitwise the same every replay, and the graph has no memory nodes."""
    from streamsched.stdlib.kernels import CUDA_KERNELS as K

    n, h, w, c, k = 8, 8, 8, 16, 16
    x_h, w_h = _f(n, h, w, c), _f(3, 3, c, k, scale=0.2)
    g_h, b_h = _pos(k), _f(k)
    p, seed = 0.2, 5
    x, wt, gamma, beta = (cp.asarray(a) for a in (x_h, w_h, g_h, b_h))
    off = cp.asarray(_s(10, np.int64))
    conv = cp.zeros((n, h, w, k), cp.float32)
    bn = cp.zeros((n, h, w, k), cp.float32)
    mean, invstd = cp.zeros(k, cp.float32), cp.zeros(k, cp.float32)
    y, mask = cp.zeros((n, h, w, k), cp.float32), cp.zeros((n, h, w, k), cp.uint8)
    cp.cuda.runtime.deviceSynchronize()

    def step():
        K["conv2d"](ctx, "s0", [x, wt], [conv], {"stride": 1, "pad": 1})
        K["batchnorm_train"](ctx, "s0", [conv, gamma, beta], [bn, mean, invstd], {"eps": 1e-5})
        K["dropout"](ctx, "s0", [bn, off], [y, mask], {"p": p, "seed": seed, "mask": "u8"})
        K["offset_advance"](ctx, "s0", [off], [off], {"by": 1})

    step()  # warm-up: compiles every kernel before capture
    ctx.synchronize()
    assert int(cp.asnumpy(off)) == 11
    st = ctx.streams["s0"]
    import gc

    gc.collect()
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc):
        st.begin_capture()
        try:
            step()
        finally:
            graph = st.end_capture()
    # conv2d's im2col temporary comes from the capture's private pool and is back in it when the
    # capture ends (owned by the graph, never handed to an eager array); nothing else allocates.
    assert pool.used_bytes() == 0
    types = _graph_types(graph)
    assert types.count("Kernel") >= 5, types  # conv2d: im2col + the cuBLAS GEMM kernel(s)
    assert not [t for t in types if t.startswith("Mem") and t not in ("Memcpy", "Memset")], types

    ref = _numpy("conv2d", [x_h, w_h], {"pad": 1})[0]
    ref_bn = _numpy("batchnorm_train", [ref, g_h, b_h], {})
    masks, bns = [], []
    for r in range(3):
        graph.launch(st)
        st.synchronize()
        masks.append(cp.asnumpy(mask))
        bns.append(cp.asnumpy(bn))
        assert int(cp.asnumpy(off)) == 12 + r
        bits = kc.dropout_bits(mask.size, seed, 11 + r)
        want = (bits >= np.uint32(kc.dropout_threshold(p))).astype(np.uint8).reshape(mask.shape)
        np.testing.assert_array_equal(masks[-1], want)
        np.testing.assert_array_equal(cp.asnumpy(y), np.where(want == 1, bns[-1] * np.float32(1 / (1 - p)),
                                                              np.float32(0)))
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
    assert bns[0].tobytes() == bns[1].tobytes() == bns[2].tobytes()
    _compare([bns[0], cp.asnumpy(mean), cp.asnumpy(invstd)], ref_bn, False, "batchnorm_train")
