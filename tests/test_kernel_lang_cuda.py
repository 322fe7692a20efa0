"""The CUDA twins of `kernel` forms (CuPy ElementwiseKernel / ReductionKernel printed by SymPy)
against their NumPy twins on random inputs, gradient kernels included, and swish_mlp trained on
the GPU.  Needs CuPy and a GPU (`pytest -m cuda tests/test_kernel_lang_cuda.py`); skipped
elsewhere.  They have not been run on a GPU yet: the session that wrote them had none."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_lang_helpers import compile_kernels, gradients, run
from test_kernel_lang import SWISH, text, trees

pytestmark = pytest.mark.cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = {np.float64: (1e-12, 1e-12), np.float32: (2e-6, 2e-6), np.float16: (2e-3, 2e-3)}


@pytest.fixture(scope="module")
def K():
    return compile_kernels(SWISH)


def _on_gpu(cp, ctx, rec, ins, attrs, inplace=None):
    """rec's CUDA twin on copies of `ins` (outputs preallocated as the executor does; `inplace`:
    output index -> input index sharing its array)."""
    # (np.ascontiguousarray makes a 0-d value 1-d: keep each input's own shape, as the arena does)
    g_ins = [cp.asarray(np.ascontiguousarray(a).reshape(np.shape(a))) for a in ins]
    outs = []
    ref = run(rec, ins, attrs)
    for k, r in enumerate(ref):
        if inplace and k in inplace:
            outs.append(g_ins[inplace[k]])
        else:
            outs.append(cp.full(r.shape, 77, dtype=r.dtype))
    rec.cuda(ctx, "s1", g_ins, outs, {**rec.attrs, **(attrs or {})})
    ctx.synchronize()
    return [cp.asnumpy(o) for o in outs], ref


def _close(got, want, dtype):
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * max(1.0, float(np.abs(want).max(initial=0))))


CASES = [("swish", [(64, 33)], {}), ("bias_swish", [(64, 33), (33,)], {}), ("bias_swish", [(2, 5, 7), (7,)], {}),
         ("leaky", [(1000,)], {"slope": 0.2}), ("rms", [(17, 40)], {"eps": 0.1}), ("colsum", [(31, 9)], {}),
         ("total", [(8, 6), (6,)], {}), ("two", [(16, 4), (16, 1)], {}), ("scaled_mean", [(12, 10), (12,)], {})]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("name,shapes,attrs", CASES)
def test_cuda_twin_matches_numpy(cp, ctx, K, name, shapes, attrs, dtype):
    rng = np.random.default_rng(0)
    ins = [rng.normal(size=s).astype(dtype) for s in shapes]
    got, want = _on_gpu(cp, ctx, K[name], ins, attrs)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        _close(g, w, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name,shapes,attrs", CASES)
def test_cuda_gradient_kernels_match_numpy(cp, ctx, K, name, shapes, attrs, dtype):
    """Every gradient kernel a recipe generates (NAME.dX, NAME.s, broadcast rows summed back,
    reductions re-expanded), launched on the GPU on the recipe's own arguments."""
    rng = np.random.default_rng(1)
    ins = [rng.normal(size=s).astype(dtype) for s in shapes]
    douts = [rng.normal(size=o.shape).astype(dtype) for o in run(K[name], ins, attrs)]
    _, parts = gradients(K, name, ins, douts, attrs)
    env = {f"in{i}": a for i, a in enumerate(ins)}
    env.update({f"dout{k}": d for k, d in enumerate(douts)})

    def check(call):
        args = [env[a] if isinstance(a, str) else check(a) for a in call.args]
        got, want = _on_gpu(cp, ctx, K[call.kernel], args, dict(call.attrs))
        _close(got[0], want[0], dtype)
        return want[0]

    for p in parts:
        if p is not None and not isinstance(p, str):
            check(p)


def test_cuda_elementwise_twin_in_place(cp, ctx, K):
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(40, 3)), rng.normal(size=(40, 3))
    got, want = _on_gpu(cp, ctx, K["two"], [x, y], {}, inplace={0: 0, 1: 1})
    for g, w in zip(got, want):
        _close(g, w, np.float64)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(trees(3), st.integers(0, 2 ** 32 - 1))
def test_cuda_twin_of_random_trees_matches_numpy(cp, ctx, t, seed):
    rng = np.random.default_rng(seed)
    x, b = rng.uniform(-1.5, 1.5, size=(9, 4)), rng.uniform(-1.5, 1.5, size=4)
    K = compile_kernels(f"kernel f(x : T[..., n], b : T[n]) -> y : T[..., n] {{ y = {text(t)} }}")
    got, want = _on_gpu(cp, ctx, K["f"], [x, b], {})
    finite = np.isfinite(want[0])
    np.testing.assert_allclose(got[0][finite], want[0][finite], rtol=1e-9,
                               atol=1e-9 * max(1.0, float(np.abs(want[0][finite]).max(initial=0))))
    (gx, gb), parts = gradients(K, "f", [x, b], [np.ones_like(x)])
    for p, want_g in zip(parts, (gx, gb)):
        args = [{"dout0": np.ones_like(x), "in0": x, "in1": b}[a] for a in p.args]
        g, w = _on_gpu(cp, ctx, K[p.kernel], args, {})
        ok = np.isfinite(w[0])
        np.testing.assert_allclose(g[0][ok], w[0][ok], rtol=1e-9,
                                   atol=1e-9 * max(1.0, float(np.abs(w[0][ok]).max(initial=0))))


def test_swish_mlp_trains_on_the_gpu(cp):
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    path = os.path.join(ROOT, "examples", "swish_mlp.sched")
    res = train(compile_file(path), TrainOptions(backend="cuda", progress=False), base_dir=os.path.dirname(path))
    assert res.history[-1]["test_acc"] >= 0.96, res.history[-1]
