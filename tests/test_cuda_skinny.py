"""The skinny GEMMs (stdlib/kernels/_cuda.py `_skinny_gemm`: ss_gemm_smallk for k <= 32,
ss_gemm_smalln for n <= 32): every transpose against NumPy in float64, the relu gate, bitwise
the same on every run, within rounding of cuBLAS, and which products take them.  Needs CuPy and
a GPU (marker `cuda`)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import graph_us

pytestmark = pytest.mark.cuda

SHAPES = [(2048, 10, 1024), (1, 1, 1), (300, 32, 17), (50176, 16, 144), (5, 7, 3), (2048, 1024, 10),
          (50176, 144, 16), (257, 33, 32), (4096, 2000, 1)]


def _operands(rng, m, k, n, ta, tb, dt):
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(dt)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(dt)
    want = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
    scale = np.abs(a.T if ta else a).astype(np.float64) @ np.abs(b.T if tb else b).astype(np.float64)
    return a, b, want, scale


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("m,k,n", SHAPES, ids=str)
@pytest.mark.parametrize("smalln", [False, True], ids=["default", "all"])
def test_skinny_products_match_numpy_and_repeat_bitwise(cp, ctx, monkeypatch, m, k, n, ta, tb, dt, smalln):
    monkeypatch.setenv("STREAMSCHED_SKINNY_GEMM", "all" if smalln else "1")
    from streamsched.stdlib.kernels import _cuda
    from streamsched.stdlib.kernels._cuda import SKINNY_K, SKINNY_N, SKINNY_ROWS, _skinny_gemm

    monkeypatch.setattr(_cuda, "SKINNY_MAX_OUT", 1 << 30)  # every size through the kernels here

    rng = np.random.default_rng(m * 7 + k * 3 + n + 2 * ta + tb)
    a, b, want, scale = _operands(rng, m, k, n, ta, tb, dt)
    da, db = cp.asarray(a), cp.asarray(b)
    c1, c2 = cp.full((m, n), 7, dt), cp.full((m, n), -3, dt)
    cp.cuda.Device().synchronize()  # the fills ran on the legacy stream, which s0 / s1 do not wait for
    took = _skinny_gemm(ctx, "s0", da, db, c1, ta, tb)
    assert took == (k <= SKINNY_K or (smalln and n <= SKINNY_N and m >= SKINNY_ROWS and not ta))
    if not smalln:  # the default's size cap: larger outputs stay on cuBLAS
        monkeypatch.setattr(_cuda, "SKINNY_MAX_OUT", 1 << 18)
        wide = _cuda._smallk_columns(n) == 4 and k <= 16  # a 128-column tile and a short sum
        assert _skinny_gemm(ctx, "s1", da, db, c2, ta, tb) == (k <= SKINNY_K and (m * n <= 1 << 18 or wide))
        monkeypatch.setattr(_cuda, "SKINNY_MAX_OUT", 1 << 30)
    if not took:
        return
    assert _skinny_gemm(ctx, "s1", da, db, c2, ta, tb)
    ctx.synchronize()
    got = cp.asnumpy(c1)
    eps = 2e-6 if dt == np.float32 else 1e-14
    assert np.all(np.abs(got - want) <= eps * (scale + 1e-30) * max(1.0, np.sqrt(k)))
    assert np.array_equal(got, cp.asnumpy(c2))  # the same sums in the same order, on any stream


@pytest.mark.parametrize("ta,tb", [(False, True), (True, False)])
def test_the_gate_is_relu_grads_rule(cp, ctx, ta, tb):
    from streamsched.stdlib.kernels._cuda import _skinny_gemm

    rng = np.random.default_rng(5)
    m, k, n = 333, 10, 130
    a, b, want, scale = _operands(rng, m, k, n, ta, tb, np.float32)
    y = rng.standard_normal((m, n)).astype(np.float32)
    y[0, :5] = [0.0, -0.0, np.nan, np.inf, -np.inf]
    c = cp.zeros((m, n), np.float32)
    cp.cuda.Device().synchronize()
    assert _skinny_gemm(ctx, "s0", cp.asarray(a), cp.asarray(b), c, ta, tb, gate=cp.asarray(y))
    ctx.synchronize()
    got = cp.asnumpy(c)
    keep = y > 0  # NaN > 0 is false: relu_grad's NumPy twin gates it out too
    assert np.all(got[~keep] == 0)
    assert np.all(np.abs(got[keep] - want[keep]) <= 2e-6 * (scale[keep] + 1e-30) * np.sqrt(k))


def test_skinny_and_cublas_agree_within_rounding(cp, ctx, monkeypatch):
    from streamsched.stdlib.kernels import _cuda
    from streamsched.stdlib.kernels.gemm import matmul_cuda

    monkeypatch.setattr(_cuda, "SKINNY_MAX_OUT", 1 << 30)

    rng = np.random.default_rng(1)
    for (m, k, n, ta, tb) in [(2048, 10, 1024, False, True), (2048, 1024, 10, False, False),
                              (50176, 16, 144, False, True)]:
        a, b, want, scale = _operands(rng, m, k, n, ta, tb, np.float32)
        outs = []
        for on in ("all", "0"):
            monkeypatch.setenv("STREAMSCHED_SKINNY_GEMM", on)
            c = cp.zeros((m, n), np.float32)
            cp.cuda.Device().synchronize()
            matmul_cuda(ctx, "s0", [cp.asarray(a), cp.asarray(b)], [c], {"ta": ta, "tb": tb})
            ctx.synchronize()
            outs.append(cp.asnumpy(c))
        assert np.all(np.abs(outs[0] - outs[1]) <= 4e-6 * scale * np.sqrt(k)), (m, k, n)


def test_an_overlapping_output_is_refused(cp, ctx):
    from streamsched.stdlib.kernels._cuda import _skinny_gemm

    buf = cp.zeros((64, 64), np.float32)
    with pytest.raises(ValueError, match="shares memory"):
        _skinny_gemm(ctx, "s0", buf[:, :8].copy(), buf[:8, :], buf[:64, :], False, False)
    with pytest.raises(ValueError, match="shares memory"):
        _skinny_gemm(ctx, "s0", buf[:32].reshape(64, 32)[:, :8].copy(), cp.zeros((8, 64), np.float32),
                     buf, False, False, gate=buf)


def test_skinny_timing_against_cublas(cp, ctx, monkeypatch):
    """Printed, not asserted (speed lives in benchmarks): µs of each product in a captured
    graph of 20, the skinny kernel against cuBLAS."""
    from streamsched.stdlib.kernels import _cuda
    from streamsched.stdlib.kernels.gemm import matmul_cuda

    monkeypatch.setattr(_cuda, "SKINNY_MAX_OUT", 1 << 30)

    rng = np.random.default_rng(2)
    st = ctx.stream("s0")
    for (m, k, n, ta, tb) in [(2048, 10, 1024, False, True), (2048, 1024, 10, False, False),
                              (128, 10, 1024, False, True), (128, 1024, 10, False, False),
                              (50176, 16, 144, False, True), (50176, 144, 16, False, False),
                              (50176, 9, 16, False, False), (50176, 16, 144, True, False),
                              (4096, 32, 512, False, True), (2048, 16, 1024, False, True),
                              (2048, 32, 1024, False, True), (8192, 10, 1024, False, True),
                              (4096, 10, 256, False, True), (1024, 64, 10, False, False)]:
        a, b, _, _ = _operands(rng, m, k, n, ta, tb, np.float32)
        da, db = cp.asarray(a), cp.asarray(b)
        row = []
        for on in ("all", "0"):
            monkeypatch.setenv("STREAMSCHED_SKINNY_GEMM", on)
            c = cp.zeros((m, n), np.float32)
            row.append(graph_us(cp, st, lambda: matmul_cuda(ctx, "s0", [da, db], [c], {"ta": ta, "tb": tb})))
        print(f"skinny {m}x{k}x{n} ta={ta} tb={tb}: {row[0]:.2f} us, cuBLAS {row[1]:.2f} us")


@pytest.mark.parametrize("cap", [1 << 18, 1 << 30], ids=["cap", "nocap"])
@pytest.mark.parametrize("m,k,n,ta,tb", [(2048, 10, 1024, False, True), (128, 10, 1024, False, True),
                                         (300, 32, 17, True, False), (128, 256, 256, False, True),
                                         (64, 33, 40, True, True)], ids=str)
def test_gemm_relu_grad_is_bitwise_matmul_then_relu_grad(cp, ctx, monkeypatch, cap, m, k, n, ta, tb):
    """The fusion pass's gated product (gemm_relu_grad) against the pair it replaces, run by
    their own CUDA twins: bitwise, whether the skinny kernel gates it or cuBLAS and relu_grad run."""
    from streamsched.stdlib.kernels import _cuda
    from streamsched.stdlib.kernels.elementwise import relu_grad_cuda
    from streamsched.stdlib.kernels.gemm import gemm_relu_grad_cuda, matmul_cuda

    monkeypatch.setattr(_cuda, "SKINNY_MAX_OUT", cap)
    rng = np.random.default_rng(m + k + n)
    a, b, want, scale = _operands(rng, m, k, n, ta, tb, np.float32)
    y = rng.standard_normal((m, n)).astype(np.float32)
    y[0, :4] = [0.0, -0.0, np.nan, -1.0]
    da, db, dy = cp.asarray(a), cp.asarray(b), cp.asarray(y)
    t, ref, got = cp.full((m, n), 5, np.float32), cp.full((m, n), 6, np.float32), cp.full((m, n), 7, np.float32)
    cp.cuda.Device().synchronize()
    at = {"ta": ta, "tb": tb}
    matmul_cuda(ctx, "s0", [da, db], [t], at)
    relu_grad_cuda(ctx, "s0", [t, dy], [ref], {})
    gemm_relu_grad_cuda(ctx, "s1", [da, db, dy], [got], at)
    ctx.synchronize()
    g, r = cp.asnumpy(got), cp.asnumpy(ref)
    assert np.array_equal(g.view(np.uint32), r.view(np.uint32))
    keep = y > 0
    assert np.all(g[~keep] == 0) and np.all(np.abs(g[keep] - want[keep]) <= 2e-6 * (scale[keep] + 1e-30) * np.sqrt(k))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m,k,n", [(128, 10, 1024), (2048, 10, 1024), (333, 7, 130), (31, 3, 1000)], ids=str)
def test_the_smallk_tile_never_changes_a_bit(cp, ctx, monkeypatch, m, k, n, gated):
    """ss_gemm_smallk at every tile width (un = 1..4 columns a thread, `_smallk_launch_columns`
    forced): bitwise the same output, gated by relu_grad's rule or not, and the gate's zeros
    where the NumPy mask says."""
    from streamsched.stdlib.kernels import _cuda

    monkeypatch.setattr(_cuda, "SKINNY_MAX_OUT", 1 << 30)
    rng = np.random.default_rng(m + n)
    a, b, want, scale = _operands(rng, m, k, n, False, True, np.float32)
    y = rng.standard_normal((m, n)).astype(np.float32)
    y[0, :4] = [0.0, -0.0, np.nan, -1.0]
    da, db, dy = cp.asarray(a), cp.asarray(b), cp.asarray(y)
    outs = []
    for un in (1, 2, 3, 4):
        monkeypatch.setattr(_cuda, "_smallk_launch_columns", lambda m_, n_, s_, un=un: un)
        c = cp.full((m, n), 9, np.float32)
        cp.cuda.Device().synchronize()
        assert _cuda._skinny_gemm(ctx, "s0", da, db, c, False, True, gate=dy if gated else None)
        ctx.synchronize()
        outs.append(cp.asnumpy(c))
    for o in outs[1:]:
        assert np.array_equal(o.view(np.uint32), outs[0].view(np.uint32))
    keep = y > 0 if gated else np.ones_like(y, bool)
    assert np.all(outs[0][~keep] == 0)
    assert np.all(np.abs(outs[0][keep] - want[keep]) <= 2e-6 * (scale[keep] + 1e-30) * np.sqrt(k))


def test_gated_smallk_timing(cp, ctx):
    """Printed, not asserted: µs of the gated classifier input gradient (the fusion pass's
    gemm_relu_grad) in a captured graph of 20, against the product and relu_grad apart."""
    from streamsched.stdlib.kernels.elementwise import relu_grad_cuda
    from streamsched.stdlib.kernels.gemm import gemm_relu_grad_cuda, matmul_cuda

    rng = np.random.default_rng(3)
    st = ctx.stream("s0")
    for m in (128, 2048):
        a, b, _, _ = _operands(rng, m, 10, 1024, False, True, np.float32)
        da, db = cp.asarray(a), cp.asarray(b)
        dy = cp.asarray(rng.standard_normal((m, 1024)).astype(np.float32))
        t, c = cp.zeros((m, 1024), np.float32), cp.zeros((m, 1024), np.float32)
        cp.cuda.Device().synchronize()
        row = []
        for fused in (True, False):
            def once():
                if fused:
                    gemm_relu_grad_cuda(ctx, "s0", [da, db, dy], [c], {"ta": False, "tb": True})
                else:
                    matmul_cuda(ctx, "s0", [da, db], [t], {"ta": False, "tb": True})
                    relu_grad_cuda(ctx, "s0", [t, dy], [c], {})
            row.append(graph_us(cp, st, once))
        print(f"gated smallk {m}x10x1024: {row[0]:.2f} us, apart {row[1]:.2f} us")
