"""GEMMs through cuBLASLt with the algorithm chosen by timing (interp/cuda/gemm_tune.py): results
against NumPy (float64 reference; fp32 rtol 2e-5 of the largest entry, fp64 1e-12), the choice
the rule says given the recorded times, nothing the program holds written while tuning (plain
GEMMs and the epilogues), one problem one algorithm on every stream (bitwise), and no timing
inside a capture.  Needs CuPy, nvmath-python and a GPU (marker `cuda`)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

# (m, n, k, ta, tb): the MLP 784-1024-1024-10 step's problems at batch 128 and some awkward ones
PROBLEMS = [(128, 1024, 784, False, False), (128, 10, 1024, False, False), (1024, 10, 128, True, False),
            (128, 1024, 10, False, True), (784, 1024, 128, True, False), (2048, 1024, 10, False, True),
            (33, 7, 65, True, True), (1, 1, 1, False, False), (64, 144, 576, False, False)]


@pytest.fixture
def lt():
    return pytest.importorskip("nvmath.bindings.cublasLt")


@pytest.fixture
def fresh(monkeypatch):
    from streamsched.interp.cuda import gemm_tune

    monkeypatch.setenv("STREAMSCHED_GEMM_TUNE", "all")  # plain GEMMs are timed too
    gemm_tune.forget()
    yield gemm_tune
    gemm_tune.forget()


def _operands(cp, m, n, k, ta, tb, dt, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(dt)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(dt)
    want = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
    return cp.asarray(a), cp.asarray(b), want


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("m,n,k,ta,tb", PROBLEMS)
def test_a_tuned_gemm_is_the_product_and_accumulates_into_c(cp, lt, fresh, m, n, k, ta, tb, dt):
    from streamsched.interp.cuda.device import DeviceContext

    ctx = DeviceContext(["comp1"])
    ctx.init_blas()
    a, b, want = _operands(cp, m, n, k, ta, tb, dt, m * n + k)
    c0 = np.random.default_rng(1).standard_normal((m, n)).astype(dt)
    c = cp.asarray(c0)
    # beta = 1: c must still hold c0 when the GEMM runs, so tuning (which happens on this first
    # call) must not have written into c
    ctx.gemm("comp1", a, b, c, ta, tb, alpha=1.0, beta=1.0)
    ctx.synchronize()
    tol = 2e-5 if dt == np.float32 else 1e-12
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(cp.asnumpy(c), want + c0, rtol=0, atol=tol * scale)
    keys = [key for key in fresh.timings() if key[1] == "plain" and key[4:7] == (m, n, k)]
    assert len(keys) == 1 and any(t is not None for _, t in fresh.timings()[keys[0]])
    ctx.close()


def test_the_choice_is_what_the_rule_says_of_the_recorded_times(cp, lt, fresh):
    from streamsched.interp.cuda.device import DeviceContext

    ctx = DeviceContext(["comp1"])
    ctx.init_blas()
    for (m, n, k, ta, tb) in PROBLEMS:
        a, b, _ = _operands(cp, m, n, k, ta, tb, np.float32, 3)
        ctx.gemm("comp1", a, b, cp.empty((m, n), cp.float32), ta, tb)
    ctx.synchronize()
    for key, times in fresh.timings().items():
        plan = next(p for p in ctx._lt_gemms.values() if p and p[-1] == key)
        cands = plan[5]
        ok = [(i, t) for i, t in times if t is not None]
        best = min(t for _, t in ok)
        want = next(i for i, t in ok if t <= best * (1 + fresh.MARGIN))
        assert np.array_equal(fresh._CHOICES[key], cands[want]), key
    ctx.close()


def test_one_problem_is_one_algorithm_on_every_stream_bitwise(cp, lt, fresh):
    from streamsched.interp.cuda.device import DeviceContext

    ctx = DeviceContext(["comp1", "comp2", "comp3"])
    ctx.init_blas()
    a, b, _ = _operands(cp, 128, 1024, 1024, False, True, np.float32, 5)
    outs = {s: cp.empty((128, 1024), cp.float32) for s in ctx.names}
    for s in ctx.names:
        ctx.gemm(s, a, b, outs[s], False, True)
    ctx.synchronize()
    ref = cp.asnumpy(outs["comp1"])
    for s in ctx.names:
        assert cp.asnumpy(outs[s]).tobytes() == ref.tobytes(), s
    assert len([k for k in fresh.timings() if k[1] == "plain"]) == 1
    ctx.close()


def test_a_problem_first_met_in_a_capture_takes_the_heuristic_choice_untimed(cp, lt, fresh):
    from streamsched.interp.cuda.device import DeviceContext

    ctx = DeviceContext(["comp1"])
    ctx.init_blas()
    a, b, want = _operands(cp, 128, 10, 1024, False, False, np.float32, 9)
    c = cp.zeros((128, 10), cp.float32)
    st = ctx.streams["comp1"]
    with st:
        st.begin_capture()
        ctx.gemm("comp1", a, b, c)
        g = st.end_capture()
    g.launch(st)
    ctx.synchronize()
    np.testing.assert_allclose(cp.asnumpy(c), want, rtol=0, atol=2e-5 * float(np.abs(want).max()))
    assert fresh.timings() == {}
    (plan,) = [p for p in ctx._lt_gemms.values() if p]
    assert np.array_equal(fresh._CHOICES[plan[-1]], plan[5][0])
    ctx.close()


def test_turned_off_every_problem_takes_the_heuristic_choice(cp, lt, fresh, monkeypatch):
    from streamsched.interp.cuda.device import DeviceContext

    monkeypatch.setenv("STREAMSCHED_GEMM_TUNE", "0")
    ctx = DeviceContext(["comp1"])
    ctx.init_blas()
    a, b, _ = _operands(cp, 2048, 1024, 10, False, True, np.float32, 2)
    ctx.gemm("comp1", a, b, cp.empty((2048, 1024), cp.float32), False, True)
    ctx.synchronize()
    assert fresh.timings() == {}
    (plan,) = [p for p in ctx._lt_gemms.values() if p]
    assert np.array_equal(fresh._CHOICES[plan[-1]], plan[5][0])
    ctx.close()


@pytest.mark.parametrize("act", ["relu", "relu_aux", "gelu", "drelu", "dgelu"])
def test_tuning_an_epilogue_writes_none_of_the_programs_buffers(cp, lt, fresh, act, monkeypatch):
    """Binding (prepare) times the candidates on scratch outputs: the bound D, aux and bias
    gradient keep the sentinel they held; the run afterwards writes what the CPU twin does."""
    from streamsched.interp.cuda.device import DeviceContext
    from streamsched.stdlib.kernels import KERNELS, gemm

    monkeypatch.delenv("STREAMSCHED_GEMM_TUNE")  # the default times the epilogues
    ctx = DeviceContext(["comp1"])
    ctx.init_blas()
    rng = np.random.default_rng(4)
    m, k, n = 128, 256, 512
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    if act in ("relu", "relu_aux", "gelu"):
        ins = [f(m, k), f(k, n), f(n)]
        outs = {"relu": [np.full((m, n), 7, np.float32)],
                "relu_aux": [np.full((m, n), 7, np.float32), np.full((m, gemm._mask_ld(n) // 8), 7, np.uint8)],
                "gelu": [np.full((m, n), 7, np.float32), np.full((m, n), 7, np.float32)]}[act]
        name = {"relu": "gemm_bias_relu", "relu_aux": "gemm_bias_relu_aux", "gelu": "gemm_bias_gelu"}[act]
    else:
        y = np.maximum(f(m, n), 0)
        ins = [f(m, k), f(n, k), y] + ([np.zeros((m, gemm._mask_ld(n) // 8), np.uint8)] if act == "drelu" else [])
        if act == "dgelu":
            ins[2] = f(m, n)
        outs = [np.full((m, n), 7, np.float32), np.full((n,), 7, np.float32)]
        name = f"gemm_{act}_bgrad"
    attrs = {"ta": False, "tb": True} if act in ("drelu", "dgelu") else {}
    dins = [cp.asarray(x) for x in ins]
    douts = [cp.asarray(x) for x in outs]
    fn = getattr(gemm, f"{name}_cuda")
    fn.prepare(ctx, "comp1", dins, douts, attrs)
    ctx.device_synchronize()
    for d, h in zip(douts, outs):
        assert cp.asnumpy(d).tobytes() == h.tobytes()
    assert [k_ for k_ in fresh.timings() if k_[1] == act], "the epilogue was not timed"
    if act in ("drelu", "dgelu"):
        return  # their results: tests/test_cuda_fuse.py (the backward epilogues are off by default)
    fn(ctx, "comp1", dins, douts, attrs)
    ctx.synchronize()
    want = [np.empty_like(o) for o in outs]
    KERNELS[name].cpu(ins, want, attrs)
    for d, w in zip(douts, want):
        if w.dtype == np.uint8:
            assert cp.asnumpy(d).tobytes() == w.tobytes()
        else:
            np.testing.assert_allclose(cp.asnumpy(d), w, rtol=0, atol=1e-4 * max(1.0, float(np.abs(w).max())))
    ctx.close()


def test_by_default_plain_gemms_are_not_timed(cp, lt, fresh, monkeypatch):
    from streamsched.interp.cuda.device import DeviceContext

    monkeypatch.delenv("STREAMSCHED_GEMM_TUNE")
    ctx = DeviceContext(["comp1"])
    ctx.init_blas()
    a, b, want = _operands(cp, 2048, 1024, 10, False, True, np.float32, 2)
    c = cp.empty((2048, 1024), cp.float32)
    ctx.gemm("comp1", a, b, c, False, True)
    ctx.synchronize()
    assert fresh.timings() == {}
    np.testing.assert_allclose(cp.asnumpy(c), want, rtol=0, atol=2e-5 * float(np.abs(want).max()))
    ctx.close()
