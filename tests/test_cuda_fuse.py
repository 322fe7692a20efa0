"""The multi_tensor CUDA twin (stdlib/kernels/multi_tensor.py) against its NumPy twin (the parts'
NumPy twins in order) and against the parts' own CUDA twins, for every base kernel it fuses, tensors
of awkward sizes (1, a chunk exactly, a chunk and one, 0); the fused and unfused plans of the
examples trained on the GPU; and a captured fused step that replays without memory nodes.
Tolerance (stated): f32 results within 2 ulp-ish, rtol 2e-6 / atol 1e-7 per step, against the
NumPy twin (the multi-tensor kernels are built with FMA contraction off, as the CNN kernels are;
the ElementwiseKernel twins of sgd/adam/adamw contract, so they may differ from NumPy by an ulp);
f64 rtol 1e-12 (measured on the H200: 3.1e-13 where w - lr * update cancels); grad_sumsq's total rtol 1e-6 (a different, fixed, summation tree).
Needs CuPy and a GPU; skips itself otherwise (`pytest -m cuda`)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from streamsched.stdlib.kernels import KERNELS

pytestmark = pytest.mark.cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [(1,), (1024,), (4096,), (4097,), (33, 65), (0,), (784, 31)]  # 1024: a chunk exactly; 4097: four and one
_rng = np.random.default_rng(7)


def _f(shape, dt=np.float32, scale=1.0, pos=False):
    a = _rng.standard_normal(shape) * scale
    return np.asarray(np.abs(a) + 0.1 if pos else a, dtype=dt)


def _s(v, dt=np.float32):
    return np.array(v, dt).reshape(())


def _parts(base, dt):
    """[(ins, outs index map)] of one part per SIZES entry: inputs as NumPy arrays; outs given as
    indices of the inputs they update in place (shared scalars are one array for every part)."""
    lr, t = _s(0.05), _s(3.0)
    scale, found = _s(1024.0), _s(0.0)
    acc, clip = _s(0.25), _s(0.375)
    res = []
    for shp in SIZES:
        if base == "sgd_step":
            res.append(([_f(shp, dt), _f(shp, dt), _f(shp, dt), lr], (0, 2)))
        elif base in ("adam_step", "adamw_step"):
            res.append(([_f(shp, dt), _f(shp, dt), _f(shp, dt), _f(shp, dt, pos=True), lr, t], (0, 2, 3)))
        elif base == "lars_step":
            res.append(([_f(shp, dt), _f(shp, dt), _f(shp, dt), lr], (0, 2)))
        elif base in ("amp_sgd_step", "amp_lars_step"):
            res.append(([_f(shp, np.float16), _f(shp, np.float16, 100.0), _f(shp), _f(shp), lr, scale, found],
                        (0, 2, 3)))
        elif base == "fill":
            res.append(([], ()))
        elif base == "nonfinite_check":
            res.append(([_f(shp, dt), found], (1,)))
        elif base == "grad_sumsq":
            res.append(([_f(shp, dt), acc], (1,)))
        elif base == "scale_grad":
            res.append(([_f(shp, dt), clip], (0,)))
    return res


ATTRS = {"sgd_step": {"momentum": 0.9, "weight_decay": 0.01, "nesterov": True},
         "adam_step": {"weight_decay": 0.01}, "adamw_step": {"weight_decay": 0.1, "beta2": 0.99},
         "lars_step": {}, "amp_sgd_step": {"momentum": 0.9, "weight_decay": 1e-4}, "amp_lars_step": {},
         "fill": {"value": 0.0}, "nonfinite_check": {}, "grad_sumsq": {}, "scale_grad": {}}
CASES = [(b, np.float32) for b in ATTRS] + [("sgd_step", np.float64), ("adamw_step", np.float64)]


def _run(cp, ctx, base, dt, fused: bool, nonfinite_at: int | None = None):
    """Host copies of every part's outputs after one fused (or unfused) launch on the device."""
    from streamsched.stdlib.kernels.multi_tensor import multi_tensor_cuda, multi_tensor_prepare
    from streamsched.stdlib.kernels import cuda_twin

    global _rng
    _rng = np.random.default_rng(7)
    parts = _parts(base, dt)
    dev: dict[int, object] = {}

    def d(a):
        if id(a) not in dev:
            dev[id(a)] = cp.asarray(a)
        return dev[id(a)]

    ins, outs, pat = [], [], []
    for k, (pins, upd) in enumerate(parts):
        if nonfinite_at is not None and k == nonfinite_at and pins[0].size:
            pins[0].reshape(-1)[-1] = np.inf
        di = [d(a) for a in pins]
        if base == "fill":
            shp = SIZES[k]
            do = [cp.full(shp, 7.0, dt)]
            at = {"value": 0.0, "shape": shp, "dtype": "f32" if dt == np.float32 else "f64"}
        else:
            do = [di[i] for i in upd]
            at = ATTRS[base]
        ins += di
        outs += do
        pat.append((len(di), len(do), tuple(at.items())))
    rec = KERNELS["multi_tensor"]
    attrs = {**rec.attrs, "base": base, "parts": tuple(pat)}
    if fused:
        multi_tensor_prepare(ctx, "s0", ins, outs, attrs)
        multi_tensor_cuda(ctx, "s0", ins, outs, attrs)
    else:
        fn = cuda_twin(KERNELS[base])
        i = o = 0
        for nin, nout, at in pat:
            fn(ctx, "s0", ins[i:i + nin], outs[o:o + nout], {**KERNELS[base].attrs, **dict(at)})
            i, o = i + nin, o + nout
    ctx.stream("s0").synchronize()
    return [cp.asnumpy(a) for a in outs], parts, pat


def _cpu(base, dt, nonfinite_at=None):
    global _rng
    _rng = np.random.default_rng(7)
    parts = _parts(base, dt)
    ins, outs, pat = [], [], []
    for k, (pins, upd) in enumerate(parts):
        if nonfinite_at is not None and k == nonfinite_at and pins[0].size:
            pins[0].reshape(-1)[-1] = np.inf
        if base == "fill":
            shp = SIZES[k]
            po = [np.full(shp, 7.0, dt)]
            at = {"value": 0.0, "shape": shp, "dtype": "f32" if dt == np.float32 else "f64"}
        else:
            po = [pins[i] for i in upd]
            at = ATTRS[base]
        ins += pins
        outs += po
        pat.append((len(pins), len(po), tuple(at.items())))
    KERNELS["multi_tensor"].cpu(ins, outs, {"base": base, "parts": tuple(pat)})
    return outs


def _close(got, want, base, dt):
    rtol = 1e-12 if dt == np.float64 else (1e-6 if base == "grad_sumsq" else 2e-6)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol,
                                   atol=0 if dt == np.float64 else 1e-7)


@pytest.mark.parametrize("base,dt", CASES, ids=lambda v: v if isinstance(v, str) else np.dtype(v).name)
def test_multi_tensor_cuda_matches_the_numpy_twin_and_the_unfused_twins(cp, ctx, base, dt):
    want = _cpu(base, dt)
    got, _, _ = _run(cp, ctx, base, dt, fused=True)
    _close(got, want, base, dt)
    unfused, _, _ = _run(cp, ctx, base, dt, fused=False)
    _close(got, unfused, base, dt)


@pytest.mark.parametrize("base", ["nonfinite_check", "amp_sgd_step"])
def test_an_inf_in_one_part_is_seen(cp, ctx, base):
    if base == "nonfinite_check":
        got, _, _ = _run(cp, ctx, base, np.float32, fused=True, nonfinite_at=3)
        assert float(got[-1]) == 1.0
        assert float(_cpu(base, np.float32, nonfinite_at=3)[-1]) == 1.0
    else:
        global _rng
        _rng = np.random.default_rng(7)
        parts = _parts(base, np.float32)
        parts[0][0][6][...] = 1.0  # found_inf set: every part skipped
        before = [a.copy() for p, _ in parts for a in p]
        ins = [cp.asarray(a) for p, _ in parts for a in p]
        # shared scalars: the first part's arrays stand for all
        n = 7
        for k in range(1, len(parts)):
            for j in (4, 5, 6):
                ins[k * n + j] = ins[j]
        outs = [ins[k * n + j] for k in range(len(parts)) for j in (0, 2, 3)]
        from streamsched.stdlib.kernels.multi_tensor import multi_tensor_cuda, multi_tensor_prepare

        pat = tuple((7, 3, tuple(ATTRS[base].items())) for _ in parts)
        at = {"base": base, "parts": pat}
        multi_tensor_prepare(ctx, "s0", ins, outs, at)
        multi_tensor_cuda(ctx, "s0", ins, outs, at)
        ctx.stream("s0").synchronize()
        for k in range(len(parts)):
            for j in (0, 2, 3):
                assert cp.asnumpy(ins[k * n + j]).tobytes() == before[k * n + j].tobytes()


@pytest.mark.parametrize("example", ["mlp_digits.sched", "resnet_digits_amp.sched", "resnet_lars.sched",
                                     "gpt_text.sched"])
def test_fused_and_unfused_steps_train_alike_on_the_gpu(cp, example):
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    path = os.path.join(ROOT, "examples", example)
    res = {}
    for fuse in (True, False):
        c = compile_file(path, fuse=fuse)
        assert c.ok and (c.fused > 0) == fuse
        res[fuse] = train(c, TrainOptions(backend="cuda", max_steps=10, progress=False),
                          base_dir=os.path.join(ROOT, "examples"))
    a, b = res[True], res[False]
    assert a.backend == b.backend == "cuda" and a.steps == b.steps == 10
    # SGD and LARS: 1e-5 of the largest |value| (cuBLASLt's GEMM and the FMA-free update kernels
    # round differently from cuBLAS and the ElementwiseKernel twins); AdamW divides by sqrt(v), so a
    # gradient near zero can take a step of lr either way: 2e-3 (lr 3e-3 at most ten times)
    tol = 2e-3 if example == "gpt_text.sched" else 1e-5
    for n in b.params:
        x, y = a.params[n].astype(np.float64), b.params[n].astype(np.float64)
        scale = max(1.0, float(np.max(np.abs(y)))) if y.size else 1.0
        assert float(np.max(np.abs(x - y), initial=0.0)) <= tol * scale, n


def test_a_captured_fused_step_has_no_memory_nodes_and_replays(cp):
    from streamsched.interp.cuda import CudaExecutor, graph_nodes_edges
    from streamsched.pipeline import compile_file

    c = compile_file(os.path.join(ROOT, "examples", "mlp_digits.sched"), capture="step")
    assert c.fused > 0
    ex = CudaExecutor(c.schedule, c.plan, c.program.kernels, capture="step")
    try:
        n_multi = 0
        for uid in {u.id for u in c.schedule.units}:
            types, _ = graph_nodes_edges(ex.graph_of(uid))
            assert "MemAlloc" not in types and "MemFree" not in types, types
        for t in c.schedule.tasks:
            n_multi += t.kernel == "multi_tensor"
        assert n_multi >= c.schedule.steps  # the update of every step (its clear is dead: fuse.py, "Dead clears")
        ex.run(host_fn=lambda task, arrays: None)  # staging and scalars: the slots' zeros will do
        ex.synchronize()
        ex.run(host_fn=lambda task, arrays: None)
        ex.synchronize()
    finally:
        ex.close()


XENT = [((128, 10), (128,), np.float32), ((1024, 256), (16, 64), np.float32), ((64, 10), (64,), np.float16),
        ((7, 1000), (7,), np.float64), ((33, 37), (3, 11), np.float32),
        # one block (loss.XENT_ONE_BLOCK): 1024 lanes in one pass; then just past it
        ((64, 10), (64,), np.float32), ((256, 4), (256,), np.float32), ((1024, 4), (1024,), np.float32),
        ((65, 16), (65,), np.float32), ((300, 10), (300,), np.float32)]


@pytest.mark.parametrize("lanes", [1024, 4096])
def test_softmax_xent_fused_in_one_block_is_bitwise_the_two_kernels(cp, ctx, monkeypatch, lanes):
    """ss_xent_fused1 (one block, several passes where the rows take more lanes than a block has
    threads) against ss_xent_fwdbwd + ss_xent_mean: bitwise, loss and dlogits."""
    from streamsched.stdlib.kernels import loss as L

    rng = np.random.default_rng(5)
    for shape in ((128, 10), (33, 37), (1000, 4), (7, 1000)):
        logits = cp.asarray((rng.standard_normal(shape) * 3).astype(np.float32))
        labels = cp.asarray(rng.integers(0, shape[1], shape[0]).astype(np.int32))
        dloss = cp.asarray(np.array(0.7, np.float32))  # not a power of two: scale rounds
        got = []
        for one in (lanes, 0):
            monkeypatch.setattr(L, "XENT_ONE_BLOCK", one)
            loss, dl = cp.empty((), np.float32), cp.empty(shape, np.float32)
            L.softmax_xent_fused_cuda(ctx, "s0", [logits, labels, dloss], [loss, dl], {})
            ctx.stream("s0").synchronize()
            got.append((cp.asnumpy(loss).tobytes(), cp.asnumpy(dl).tobytes()))
        assert got[0] == got[1], shape


@pytest.mark.parametrize("shape,lshape,dt", XENT, ids=lambda v: str(v))
def test_softmax_xent_fused_matches_the_numpy_twin_and_the_unfused_pair(cp, ctx, shape, lshape, dt):
    """Loss and dlogits of the fused kernel against the NumPy twin (the pair's NumPy twins) within
    rtol 1e-6 (f32), 1e-12 (f64), 2e-3 (f16 logits, f32 loss), and against the unfused CUDA twins
    bitwise (same row statistics, same mean kernel)."""
    from streamsched.stdlib.kernels.loss import (softmax_xent_cuda, softmax_xent_fused_cuda,
                                                 softmax_xent_grad_cuda)

    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(shape) * 3).astype(dt)
    labels = rng.integers(0, shape[1], lshape).astype(np.int32)
    ldt = np.float32 if dt == np.float16 else dt
    dloss = np.array(0.75 if dt != np.float16 else 1024.0, ldt)
    want_loss, want_d = np.empty((), ldt), np.empty(shape, dt)
    KERNELS["softmax_xent_fused"].cpu([logits, labels, dloss], [want_loss, want_d], {})
    L, Y, D = cp.asarray(logits), cp.asarray(labels), cp.asarray(dloss)
    loss, dl = cp.empty((), ldt), cp.empty(shape, dt)
    softmax_xent_fused_cuda(ctx, "s0", [L, Y, D], [loss, dl], {})
    loss2, dl2 = cp.empty((), ldt), cp.empty(shape, dt)
    softmax_xent_cuda(ctx, "s0", [L, Y], [loss2], {})
    softmax_xent_grad_cuda(ctx, "s0", [D, L, Y], [dl2], {})
    ctx.stream("s0").synchronize()
    rtol = {np.float32: 1e-6, np.float64: 1e-12, np.float16: 2e-3}[dt]
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=rtol)
    np.testing.assert_allclose(cp.asnumpy(dl).astype(np.float64), want_d.astype(np.float64), rtol=rtol,
                               atol=rtol * float(np.abs(want_d).max()))
    assert cp.asnumpy(loss).tobytes() == cp.asnumpy(loss2).tobytes()
    assert cp.asnumpy(dl).tobytes() == cp.asnumpy(dl2).tobytes()


GEMMS = [(128, 784, 1024), (2048, 1024, 1024), (128, 1024, 10), (1024, 64, 256), (5, 3, 8)]


@pytest.mark.parametrize("act", ["bias", "relu", "gelu"])
@pytest.mark.parametrize("m,k,n", GEMMS, ids=str)
def test_gemm_epilogue_matches_the_numpy_twin_and_the_unfused_kernels(cp, ctx, act, m, k, n):
    """gemm_bias / gemm_bias_relu / gemm_bias_gelu through cuBLASLt (or its unfused fallback, said once on
    stderr) against the NumPy twin: f32, rtol 1e-5 of the largest |value| (the GEMM's summation
    order differs from NumPy's, and cuBLASLt's GELU is the tanh form in its own arithmetic); the
    GELU's aux output (the pre-activation) too."""
    from streamsched.stdlib.kernels.gemm import _LT_PLANS, gemm_bias_cuda, gemm_bias_gelu_cuda, gemm_bias_relu_cuda

    rng = np.random.default_rng(11)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    name = "gemm_bias" if act == "bias" else f"gemm_bias_{act}"
    want = [np.empty((m, n), np.float32) for _ in KERNELS[name].outputs]
    KERNELS[name].cpu([x, w, b], want, {})
    X, W, B = cp.asarray(x), cp.asarray(w), cp.asarray(b)
    outs = [cp.zeros((m, n), cp.float32) for _ in want]
    fn = {"bias": gemm_bias_cuda, "relu": gemm_bias_relu_cuda, "gelu": gemm_bias_gelu_cuda}[act]
    fn.prepare(ctx, "s0", [X, W, B], outs, {})
    fn(ctx, "s0", [X, W, B], outs, {})
    fn(ctx, "s0", [X, W, B], outs, {})  # twice: the plan is reused, the result the same
    ctx.stream("s0").synchronize()
    for g, wv in zip(outs, want):
        got = cp.asnumpy(g)
        np.testing.assert_allclose(got, wv, rtol=0, atol=1e-5 * max(1.0, float(np.abs(wv).max())))
    plan = next((p for kk, p in _LT_PLANS.items() if kk[1] == act and kk[4] == (k, n) and kk[3] == (m, k)), None)
    print(f"{name} {m}x{k}x{n}: {'cuBLASLt' if plan else 'unfused fallback'}")


def test_gemm_epilogues_run_through_cublaslt_on_the_h200(cp, ctx):
    """On the H200 the f32 cases of the MLP and GPT steps are cuBLASLt launches, not the fallback."""
    from streamsched.stdlib.kernels.gemm import _lt_plan

    for act, (m, k, n) in (("relu", (128, 784, 1024)), ("gelu", (1024, 64, 256)), ("bias", (1024, 64, 192)),
                           ("bias", (128, 1024, 10))):
        X, W, B = cp.zeros((m, k), cp.float32), cp.zeros((k, n), cp.float32), cp.zeros((n,), cp.float32)
        outs = [cp.zeros((m, n), cp.float32) for _ in (range(2) if act == "gelu" else range(1))]
        assert _lt_plan(ctx, "s0", [X, W, B], outs, act) is not None, act


# backward epilogues: the dX GEMM of a linear, dz [m, p] @ w^T (w [n, p]), its activation
# gradient and the bias gradient; the MLP's (784-1024-1024-10 at 128 and 2048, digits' 256 wide),
# the GPT's FFN (n = 4d) and an odd case cuBLASLt may refuse (the fallback, said once)
BWD = [(128, 1024, 1024), (2048, 1024, 1024), (128, 10, 1024), (128, 10, 256), (1024, 64, 256), (5, 3, 8)]


def _bwd_case(cp, ctx, act, m, p, n, ta=False, tb=True):
    """Device inputs of one backward epilogue (the relu mask made by the device forward) and the
    NumPy twin's outputs on the same y / pre."""
    from streamsched.stdlib.kernels.gemm import _mask_ld, gemm_bias_relu_aux_cuda

    rng = np.random.default_rng(13)
    dz = rng.standard_normal((p, m) if ta else (m, p)).astype(np.float32)
    w = (rng.standard_normal((n, p) if tb else (p, n)) / np.sqrt(p)).astype(np.float32)
    if act == "relu":
        x = rng.standard_normal((m, 16)).astype(np.float32)
        wf = (rng.standard_normal((16, n)) / 4).astype(np.float32)
        bf = rng.standard_normal(n).astype(np.float32)
        X, WF, BF = cp.asarray(x), cp.asarray(wf), cp.asarray(bf)
        Y, MASK = cp.zeros((m, n), cp.float32), cp.zeros((m, _mask_ld(n) // 8), cp.uint8)
        gemm_bias_relu_aux_cuda.prepare(ctx, "s0", [X, WF, BF], [Y, MASK], {})
        gemm_bias_relu_aux_cuda(ctx, "s0", [X, WF, BF], [Y, MASK], {})
        ctx.stream("s0").synchronize()
        y = cp.asnumpy(Y)
        bits = np.zeros((m, _mask_ld(n)), bool)
        bits[:, :n] = y > 0
        mask = np.packbits(bits, axis=1, bitorder="little")  # the CPU twin's layout, from the device's y
        ins, dev = [dz, w, y, mask], [cp.asarray(dz), cp.asarray(w), Y, MASK]
    else:
        pre = (rng.standard_normal((m, n)) * 2).astype(np.float32)
        ins = [dz, w, pre]
        dev = [cp.asarray(a) for a in ins]
    want = [np.empty((m, n), np.float32), np.empty(n, np.float32)]
    KERNELS[f"gemm_d{act}_bgrad"].cpu(ins, want, {"ta": ta, "tb": tb})
    return dev, want


def _bwd_close(got, want):
    """dpre within 1e-5 of its largest |value|; db within 1e-5 of its column's sum of |dpre|
    (a sum's rounding grows with the magnitude summed, not with the result)."""
    d, db = (cp_asnumpy(g) for g in got)
    wd, wdb = want
    np.testing.assert_allclose(d, wd, rtol=0, atol=1e-5 * max(1.0, float(np.abs(wd).max())))
    np.testing.assert_allclose(db, wdb, rtol=0, atol=1e-5 * np.maximum(1.0, np.abs(wd).sum(axis=0)))


def cp_asnumpy(a):
    import cupy

    return cupy.asnumpy(a)


@pytest.mark.xfail(reason="H200, 2026-12-02: the bias gradient of the DRELU_BGRAD / DGELU_BGRAD epilogues fell outside "
                          "its tolerance (128x1024x1024 and others); the backward epilogues are off by default "
                          "(interp/fuse.backward_epilogues)", strict=False)
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("m,p,n", BWD, ids=str)
def test_backward_epilogue_matches_the_numpy_twin_and_the_unfused_kernels(cp, ctx, act, m, p, n):
    """gemm_drelu_bgrad / gemm_dgelu_bgrad through cuBLASLt (DRELU_BGRAD on the device forward's
    RELU_AUX_BIAS mask, DGELU_BGRAD on pre) or the unfused fallback, against the NumPy twin and
    against the three unfused CUDA twins, within the tolerances of _bwd_close (f32)."""
    from streamsched.stdlib.kernels.gemm import _LT_PLANS, _bwd_unfused, gemm_dgelu_bgrad_cuda, gemm_drelu_bgrad_cuda

    dev, want = _bwd_case(cp, ctx, act, m, p, n)
    fn = gemm_drelu_bgrad_cuda if act == "relu" else gemm_dgelu_bgrad_cuda
    at = {"ta": False, "tb": True}
    outs = [cp.full((m, n), 7, cp.float32), cp.full((n,), 7, cp.float32)]
    fn.prepare(ctx, "s0", dev, outs, at)
    fn(ctx, "s0", dev, outs, at)
    fn(ctx, "s0", dev, outs, at)  # twice: the plan is reused, the result the same
    plain = [cp.full((m, n), 7, cp.float32), cp.full((n,), 7, cp.float32)]
    _bwd_unfused(ctx, "s0", dev, plain, "d" + act, at)
    ctx.stream("s0").synchronize()
    _bwd_close(outs, want)
    _bwd_close(plain, want)
    plan = next((q for kk, q in _LT_PLANS.items() if kk[1] == "d" + act and kk[3] == (m, p) and kk[4] == (n, p)), None)
    print(f"gemm_d{act}_bgrad {m}x{p}x{n}: {'cuBLASLt' if plan else 'unfused fallback'}")


@pytest.mark.xfail(reason="H200, 2026-12-02: the bias gradient of the DRELU_BGRAD / DGELU_BGRAD epilogues fell outside "
                          "its tolerance (128x1024x1024 and others); the backward epilogues are off by default "
                          "(interp/fuse.backward_epilogues)", strict=False)
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (True, True)])
def test_backward_epilogue_takes_every_transpose(cp, ctx, act, ta, tb):
    from streamsched.stdlib.kernels.gemm import gemm_dgelu_bgrad_cuda, gemm_drelu_bgrad_cuda

    m, p, n = 256, 128, 512
    dev, want = _bwd_case(cp, ctx, act, m, p, n, ta, tb)
    fn = gemm_drelu_bgrad_cuda if act == "relu" else gemm_dgelu_bgrad_cuda
    outs = [cp.zeros((m, n), cp.float32), cp.zeros((n,), cp.float32)]
    fn.prepare(ctx, "s0", dev, outs, {"ta": ta, "tb": tb})
    fn(ctx, "s0", dev, outs, {"ta": ta, "tb": tb})
    ctx.stream("s0").synchronize()
    _bwd_close(outs, want)


def test_backward_epilogues_run_through_cublaslt_on_the_h200(cp, ctx, monkeypatch):
    monkeypatch.setenv("STREAMSCHED_BWD_EPILOGUES", "1")  # (off by default: interp/fuse.backward_epilogues)
    """On the H200 every backward epilogue of the MLP and GPT examples' plans (their buffers'
    shapes, f32) is a cuBLASLt launch, not the fallback: the forward writes the relu mask
    (RELU_AUX_BIAS planned) and DRELU_BGRAD / DGELU_BGRAD are planned."""
    from streamsched.pipeline import compile_file
    from streamsched.stdlib.kernels.gemm import _LT_MASKS, _lt_plan

    seen = set()
    for ex in ("mlp_digits.sched", "gpt_text.sched"):
        c = compile_file(os.path.join(ROOT, "examples", ex))
        bufs = c.schedule.buffer_map()

        def arr(name):
            b = bufs[name]
            return cp.zeros(b.shape, cp.uint8 if b.dtype == "u8" else cp.float32)

        arrays = {}
        for t in c.schedule.tasks:
            if t.step != 0 or t.kernel not in ("gemm_bias_relu_aux", "gemm_drelu_bgrad", "gemm_dgelu_bgrad"):
                continue
            ins = [arrays.setdefault(a, arr(a)) for a in t.args]
            outs = [arrays.setdefault(o, arr(o)) for o in t.outs]
            act = {"gemm_bias_relu_aux": "relu_aux", "gemm_drelu_bgrad": "drelu", "gemm_dgelu_bgrad": "dgelu"}[t.kernel]
            assert _lt_plan(ctx, "s0", ins, outs, act, dict(t.attrs)) is not None, (ex, t.label)
            if act == "relu_aux":
                assert _LT_MASKS[outs[1].data.ptr] is True
            seen.add(act)
    assert seen == {"relu_aux", "drelu", "dgelu"}


@pytest.mark.parametrize("m,p,n", BWD, ids=str)
def test_gemm_drelu_matches_the_numpy_twin(cp, ctx, m, p, n):
    """gemm_drelu (the gated product where the forward wrote y's mask): cuBLASLt's DRELU epilogue,
    or the skinny gate for p <= 32, against the NumPy twin (dpre within 1e-5 of its largest
    |value|); on the H200 the f32 MLP case is a cuBLASLt launch, not the fallback."""
    from streamsched.stdlib.kernels.gemm import _lt_plan, gemm_drelu_cuda

    dev, want = _bwd_case(cp, ctx, "relu", m, p, n)
    out = cp.zeros((m, n), cp.float32)
    at = {"ta": False, "tb": True}
    gemm_drelu_cuda.prepare(ctx, "s0", dev, [out], at)
    gemm_drelu_cuda(ctx, "s0", dev, [out], at)
    ctx.stream("s0").synchronize()
    np.testing.assert_allclose(cp.asnumpy(out), want[0], rtol=0, atol=1e-5 * max(1.0, float(np.abs(want[0]).max())))
    if (m, p, n) == (2048, 1024, 1024):
        assert _lt_plan(ctx, "s0", dev, [out], "drelu_only", at) is not None


BN_SHAPES = [((64, 8, 8, 16), np.float32, np.float32), ((4096, 16), np.float64, np.float64),
             ((300, 7), np.float32, np.float32), ((16, 4, 4, 48), np.float16, np.float32),
             ((2, 5), np.float32, np.float64)]


@pytest.mark.parametrize("cluster", [True, False])
@pytest.mark.parametrize("shape,xdt,pdt", BN_SHAPES, ids=str)
def test_batchnorm_epilogues_are_bitwise_the_unfused_kernels(cp, ctx, monkeypatch, shape, xdt, pdt, cluster):
    """batchnorm_train_relu, batchnorm_train_add_relu and batchnorm_grad_relu (the fusion pass's
    batch-norm epilogues) against their parts run as the unfused CUDA kernels one after the other:
    bitwise, on the cluster kernels (sm_90+, forced at every size) and the one-block-per-channel
    ones; and within rounding of the NumPy twins."""
    from streamsched.stdlib.kernels import _cuda as choice
    from streamsched.stdlib.kernels.elementwise import add_cuda, relu_cuda, relu_grad_cuda
    from streamsched.stdlib.kernels.normalization import (batchnorm_grad_cuda, batchnorm_grad_relu_cuda,
                                                          batchnorm_train_add_relu_cuda, batchnorm_train_cuda,
                                                          batchnorm_train_relu_cuda)

    if cluster:
        if int(cp.cuda.Device().compute_capability) < 90:
            pytest.skip("cluster kernels need sm_90")
        monkeypatch.setattr(choice, "CLUSTER_ROWS", {"batchnorm": 0, "sum_nhw": 0})
    else:
        monkeypatch.setattr(choice, "CLUSTER", False)
    rng = np.random.default_rng(7)
    c = shape[-1]
    x = (rng.standard_normal(shape) * 2 + 0.3).astype(xdt)
    r = rng.standard_normal(shape).astype(xdt)
    dy = rng.standard_normal(shape).astype(xdt)
    g, b = rng.standard_normal(c).astype(pdt), rng.standard_normal(c).astype(pdt)
    X, R, DY, G, B = map(cp.asarray, (x, r, dy, g, b))
    at = {"eps": 1e-5}

    def outs():
        return [cp.empty(shape, xdt), cp.empty(c, pdt), cp.empty(c, pdt)]

    plain = outs()
    batchnorm_train_cuda(ctx, "s0", [X, G, B], plain, at)
    want_relu, want_res = cp.empty(shape, xdt), cp.empty(shape, xdt)
    relu_cuda(ctx, "s0", [plain[0]], [want_relu], {})
    add_cuda(ctx, "s0", [plain[0], R], [want_res], {})
    relu_cuda(ctx, "s0", [want_res], [want_res], {})
    got_relu, got_res = outs(), outs()
    batchnorm_train_relu_cuda(ctx, "s0", [X, G, B], got_relu, at)
    batchnorm_train_add_relu_cuda(ctx, "s0", [X, G, B, R], got_res, at)
    gate = want_relu
    d = cp.empty(shape, xdt)
    relu_grad_cuda(ctx, "s0", [DY, gate], [d], {})
    want_g = outs()
    batchnorm_grad_cuda(ctx, "s0", [d, X, G, plain[1], plain[2]], want_g, {})
    got_g = outs()
    batchnorm_grad_relu_cuda(ctx, "s0", [DY, gate, X, G, plain[1], plain[2]], got_g, {})
    ctx.stream("s0").synchronize()
    same = cp.asnumpy
    assert same(got_relu[0]).tobytes() == same(want_relu).tobytes()
    assert same(got_res[0]).tobytes() == same(want_res).tobytes()
    for o in (got_relu, got_res):
        assert same(o[1]).tobytes() == same(plain[1]).tobytes() and same(o[2]).tobytes() == same(plain[2]).tobytes()
    for u, v in zip(got_g, want_g):
        assert same(u).tobytes() == same(v).tobytes()
    assert (same(got_res[0]) >= 0).all() and (same(got_relu[0]) >= 0).all()
    # and the NumPy twins of the fused records
    tw = [np.empty(shape, xdt), np.empty(c, pdt), np.empty(c, pdt)]
    KERNELS["batchnorm_train_add_relu"].cpu([x, g, b, r], tw, at)
    tol = 2e-3 if xdt == np.float16 else 1e-5
    np.testing.assert_allclose(same(got_res[0]).astype(np.float64), tw[0].astype(np.float64), rtol=tol, atol=tol * 4)
    tg = [np.empty(shape, xdt), np.empty(c, pdt), np.empty(c, pdt)]
    KERNELS["batchnorm_grad_relu"].cpu([dy, same(gate), x, g, same(plain[1]), same(plain[2])], tg, {})
    for u, v in zip(got_g, tg):
        np.testing.assert_allclose(same(u).astype(np.float64), v.astype(np.float64), rtol=tol * 10,
                                   atol=tol * 10 * max(1.0, float(np.abs(v).max())))
