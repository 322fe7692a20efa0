"""The 16-byte elementwise kernel (stdlib/kernels/_cuda.py `ew4`, ss_ew4) behind add, sub, mul,
relu and relu_grad on f32: bitwise CuPy's ElementwiseKernel (the scalar path it replaces) on
values with NaN, infinities and signed zeros, in place and apart, and the cases it leaves to
CuPy.  Needs CuPy and a GPU (marker `cuda`)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import graph_us

pytestmark = pytest.mark.cuda

OPS = {"add": (2, lambda a, b: a + b), "sub": (2, lambda a, b: a - b), "mul": (2, lambda a, b: a * b),
       "relu_grad": (2, lambda dy, x: np.where(x > 0, dy, np.float32(0))),
       "relu": (1, lambda x: np.where(x < 0, np.float32(0), x))}


SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45]


def _values(rng, shape):
    v = rng.standard_normal(shape).astype(np.float32)
    flat = v.reshape(-1)
    flat[:min(6, flat.size)] = SPECIAL[:flat.size]
    return v


@pytest.mark.parametrize("shape", [(2048, 1024), (4,), (3, 8), (1000, 12)], ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_ew4_is_bitwise_the_scalar_kernel(cp, ctx, name, shape):
    from streamsched.stdlib.kernels import elementwise
    from streamsched.stdlib.kernels._cuda import ew4

    arity, ref = OPS[name]
    rng = np.random.default_rng(len(name) + shape[0])
    ins = [cp.asarray(_values(rng, shape)) for _ in range(arity)]
    fast, slow = cp.full(shape, 5, np.float32), cp.full(shape, 6, np.float32)
    cp.cuda.Device().synchronize()
    assert ew4(ctx, "s0", name, ins, fast)
    with ctx.stream("s0"):
        elementwise._kernels()[name](*ins, slow)
    ctx.synchronize()
    f, s = cp.asnumpy(fast), cp.asnumpy(slow)
    assert np.array_equal(f.view(np.uint32), s.view(np.uint32))
    # NumPy's answer where no input is subnormal: the GPU's kernels (CuPy's and this one alike,
    # bitwise, as asserted above) flush subnormal operands of arithmetic and comparisons to zero
    # (H200: 1e-45 + 1e-45 gave 0, and relu_grad gated dy out where x was 1e-45), NumPy does not
    host = [cp.asnumpy(x) for x in ins]
    want = ref(*host).astype(np.float32)
    normal = np.logical_and.reduce([~((x != 0) & (np.abs(x) < np.finfo(np.float32).tiny)) for x in host])
    assert normal.sum() >= normal.size - 1
    assert np.array_equal(f[normal], want[normal], equal_nan=True)
    # in place on its first input: the same bits
    first = ins[0].copy()
    cp.cuda.Device().synchronize()
    assert ew4(ctx, "s1", name, [first] + ins[1:], first)
    ctx.synchronize()
    assert np.array_equal(cp.asnumpy(first).view(np.uint32), f.view(np.uint32))


def test_ew4_leaves_what_it_does_not_cover_to_cupy(cp, ctx):
    from streamsched.stdlib.kernels._cuda import ew4

    a = cp.ones((8, 8), np.float32)
    assert not ew4(ctx, "s0", "add", [a[:, :6], a[:, :6]], cp.empty((8, 6), np.float32))  # not contiguous
    flat = cp.ones(33, np.float32)
    assert not ew4(ctx, "s0", "add", [flat[1:], flat[1:]], cp.empty(32, np.float32))  # 4 bytes off alignment
    assert not ew4(ctx, "s0", "add", [flat[:30], flat[:30]], cp.empty(30, np.float32))  # 30 % 4
    assert not ew4(ctx, "s0", "add", [a.astype(np.float64)] * 2, cp.empty((8, 8), np.float64))
    assert not ew4(ctx, "s0", "tanh", [a], cp.empty((8, 8), np.float32))
    assert not ew4(ctx, "s0", "add", [a, cp.ones(8, np.float32)], cp.empty((8, 8), np.float32))  # broadcast
    big = cp.ones(64, np.float32)
    assert not ew4(ctx, "s0", "add", [big[:32], big[:32]], big[4:36])  # a shifted overlap


def test_ew4_timing_against_cupy(cp, ctx):
    """Printed, not asserted: µs of relu_grad on 2048 x 1024 floats in a captured graph of 20."""
    from streamsched.stdlib.kernels import elementwise
    from streamsched.stdlib.kernels._cuda import ew4

    st = ctx.stream("s0")
    dy, x, out = (cp.ones((2048, 1024), np.float32) for _ in range(3))
    row = []
    for fast in (True, False):
        def once():
            if fast:
                assert ew4(ctx, "s0", "relu_grad", [dy, x], out)
            else:
                with ctx.stream("s0"):
                    elementwise._kernels()["relu_grad"](dy, x, out)
        row.append(graph_us(cp, st, once))
    print(f"relu_grad 2048x1024: ss_ew4 {row[0]:.2f} us, CuPy {row[1]:.2f} us")
