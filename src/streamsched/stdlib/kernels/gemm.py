"""GEMM: `matmul` (c = op(a) @ op(b)), the one kernel that is cuBLAS alone; the convolutions reach
cuBLAS through the same context glue (`ctx.gemm`, the stream's own handle); and the GEMMs with a
fused epilogue the fusion pass makes, `gemm_bias_relu` and `gemm_bias_gelu`, which run through
cuBLASLt's RELU_BIAS / GELU_AUX_BIAS epilogues (nvmath-python's cublasLt bindings) on the device."""

from __future__ import annotations

from typing import Any

import numpy as np

from streamsched.stdlib.kernel_record import KCall, KernelTypeError
from streamsched.stdlib.kernels._base import STDLIB, DocRow, Family, GradArgs, _flag, _floats, _fmt

FAMILY = Family(__name__, "GEMM")
_register = FAMILY.register


def _matmul_infer(k, names, t, at):
    ta, tb = _flag(k, at, "ta"), _flag(k, at, "tb")
    for i in (0, 1):
        if len(t[i][0]) != 2:
            raise KernelTypeError(f"{k}: {names[i]} must be 2-D, got {_fmt(t[i][0])}", arg=i)
    dt = _floats(k, t, names, (0, 1))
    (sa, _), (sb, _) = t
    ea, eb = (sa[::-1] if ta else sa), (sb[::-1] if tb else sb)
    if ea[1] != eb[0]:
        na, nb = names[0] + ("^T" if ta else ""), names[1] + ("^T" if tb else "")
        raise KernelTypeError(f"{k}: inner dimensions differ: {na} is {_fmt(ea)}, "
                              f"{nb} is {_fmt(eb)} ({ea[1]} != {eb[0]})", arg=1)
    return [((ea[0], eb[1]), dt)]


def _matmul_cpu(ins, outs, at):
    a, b = ins
    np.matmul(a.T if at["ta"] else a, b.T if at["tb"] else b, out=outs[0])


def _matmul_recipe(g: GradArgs):
    a, b = g.args
    (dc,) = g.douts
    ta, tb = bool(g.attrs.get("ta")), bool(g.attrs.get("tb"))
    if not ta and not tb:     # c = a b
        da, db = KCall("matmul", (dc, b), (("tb", True),)), KCall("matmul", (a, dc), (("ta", True),))
    elif ta and not tb:       # c = a^T b
        da, db = KCall("matmul", (b, dc), (("tb", True),)), KCall("matmul", (a, dc))
    elif not ta and tb:       # c = a b^T
        da, db = KCall("matmul", (dc, b)), KCall("matmul", (dc, a), (("ta", True),))
    else:                     # c = a^T b^T
        da = KCall("matmul", (b, dc), (("ta", True), ("tb", True)))
        db = KCall("matmul", (dc, a), (("ta", True), ("tb", True)))
    return [da if g.need[0] else None, db if g.need[1] else None]


_register("matmul", "a b", "c", _matmul_infer, _matmul_cpu, {"ta": False, "tb": False}, doc="""
c = op(a) @ op(b), op(z) = z^T when the flag (ta for a, tb for b) is set.
a: [m, k] (or [k, m] with ta), b: [k, n] (or [n, k] with tb) -> c: [m, n]; a, b one float dtype.
Backward of c = a @ b: da = matmul(dc, b, tb=True), db = matmul(a, dc, ta=True).
""", inplace=False, grad=_matmul_recipe,
          row=DocRow("a [m,k], b [k,n] -> c [m,n]", "comp1",
                     "c = op(a) @ op(b), op = transpose when the flag is set; one float dtype"))


# --------------------------------------------------------------------------------------------
# GEMM + bias + activation, made by the fusion pass from matmul(x, w) -> add(_, b) -> relu / gelu


def _gemm_bias_types(k, names, t):
    (sx, dx), (sw, dw), (sb, db) = t
    if len(sx) != 2 or len(sw) != 2:
        raise KernelTypeError(f"{k}: x and w must be 2-D, got {_fmt(sx)} and {_fmt(sw)}", arg=0 if len(sx) != 2 else 1)
    if sx[1] != sw[0]:
        raise KernelTypeError(f"{k}: inner dimensions differ: x is {_fmt(sx)}, w is {_fmt(sw)}", arg=1)
    if tuple(sb) != (sw[1],):
        raise KernelTypeError(f"{k}: b must be [{sw[1]}], got {_fmt(sb)}", arg=2)
    dt = _floats(k, t, names, (0, 1, 2))
    return (sx[0], sw[1]), dt


def _gemm_bias_relu_infer(k, names, t, at):
    shape, dt = _gemm_bias_types(k, names, t)
    return [(shape, dt)]


def _gemm_bias_gelu_infer(k, names, t, at):
    shape, dt = _gemm_bias_types(k, names, t)
    return [(shape, dt), (shape, dt)]


def _pre_cpu(x, w, b):
    """matmul then add, by their own NumPy twins (so the fused result is bitwise the pair's)."""
    m = np.empty((x.shape[0], w.shape[1]), x.dtype)
    STDLIB["matmul"].cpu([x, w], [m], {})
    h = np.empty_like(m)
    STDLIB["add"].cpu([m, b], [h], {})
    return h


def _gemm_bias_relu_cpu(ins, outs, at):
    h = _pre_cpu(*ins)
    STDLIB["relu"].cpu([h], [outs[0]], {})


def _gemm_bias_gelu_cpu(ins, outs, at):
    h = _pre_cpu(*ins)
    STDLIB["gelu"].cpu([h], [outs[1]], {})
    outs[0][...] = h


_register("gemm_bias_relu", "x w b", "y", _gemm_bias_relu_infer, _gemm_bias_relu_cpu, doc="""
y = relu(x @ w + b) in one launch: made by the fusion pass from matmul(x, w) -> t, add(t, b) -> h,
relu(h) -> y where nothing else reads t or h (`--no-fuse` keeps them apart), never written.
x: [m, k], w: [k, n], b: [n], one float dtype -> y: [m, n].  CPU: the three NumPy twins in order
(bitwise the unfused tasks); CUDA: cuBLASLt's RELU_BIAS epilogue (f32, f64), the three twins
where cuBLASLt is missing or refuses (a one-line notice).
""", inplace=False, row=DocRow("x [m,k], w [k,n], b [n] -> y [m,n]", "comp1",
                               "y = relu(x w + b): cuBLASLt RELU_BIAS (made by the fusion pass)"))

_register("gemm_bias_gelu", "x w b", "pre y", _gemm_bias_gelu_infer, _gemm_bias_gelu_cpu, doc="""
pre = x @ w + b and y = gelu(pre) (tanh form) in one launch: made by the fusion pass from
matmul(x, w) -> t, add(t, b) -> pre, gelu(pre) -> y where nothing else reads t (pre is kept: the
backward's gelu_grad reads it), never written.  x: [m, k], w: [k, n], b: [n], one float dtype ->
pre, y: [m, n].  CPU: the three NumPy twins in order (bitwise); CUDA: cuBLASLt's GELU_AUX_BIAS
epilogue (pre is its auxiliary output), the three twins where cuBLASLt is missing or refuses.
""", inplace=False, row=DocRow("x [m,k], w [k,n], b [n] -> pre [m,n], y [m,n]", "comp1",
                               "pre = x w + b; y = gelu(pre): cuBLASLt GELU_AUX_BIAS (made by the fusion pass)"))


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.


def matmul_cuda(ctx, stream, ins, outs, attrs):
    a, b = ins
    ctx.gemm(stream, a, b, outs[0], bool(attrs.get("ta", False)), bool(attrs.get("tb", False)))


# -- cuBLASLt epilogues ------------------------------------------------------------------------
# Row-major y [m, n] = x [m, k] @ w [k, n] is column-major y^T [n, m] = w^T [n, k] @ x^T [k, m]:
# A = w (column-major [n, k], ld n), B = x ([k, m], ld k), D = y ([n, m], ld n); the bias has one
# entry per row of D (n), as the epilogue wants; GELU_AUX_BIAS's aux (the pre-activation) is laid
# out like D.  A descriptor names the bias and aux pointers, so one is built per binding, when
# the executor binds the task (before any capture: `prepare`), with its heuristic algorithm.

_LT_PLANS: dict[tuple, Any] = {}
_LT_NOTICE: list = []
_CUDA_R = {"float32": 0, "float64": 1}
_COMPUTE = {"float32": 68, "float64": 70}  # CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F
_EPILOGUE = {"relu": 6, "gelu": 164}       # CUBLASLT_EPILOGUE_RELU_BIAS, _GELU_AUX_BIAS


def _lt_notice(why: str) -> None:
    if not _LT_NOTICE:
        import sys

        _LT_NOTICE.append(why)
        print(f"note: GEMM epilogues run unfused on the device ({why})", file=sys.stderr)


def _lt_key(stream, ins, outs, act):
    x, w, b = ins
    aux = outs[0] if act == "gelu" else None
    return (str(stream), act, str(x.dtype), x.shape, w.shape, x.data.ptr, w.data.ptr, b.data.ptr,
            outs[-1].data.ptr, aux.data.ptr if aux is not None else 0)


def _lt_plan(ctx, stream, ins, outs, act):
    """The descriptor, layouts and algorithm of this binding, built once; None (and a notice)
    when cuBLASLt is missing or refuses the case: the twins then run the three unfused kernels."""
    key = _lt_key(stream, ins, outs, act)
    if key in _LT_PLANS:
        return _LT_PLANS[key]
    plan = None
    try:
        plan = _lt_build(ctx, stream, ins, outs, act)
    except ImportError as exc:
        _lt_notice(f"nvmath-python's cublasLt bindings are missing: {exc}")
    except Exception as exc:  # a refused layout or epilogue: unfused, said once
        _lt_notice(f"cuBLASLt refused {act} for {ins[0].shape} @ {ins[1].shape}: {type(exc).__name__}: {exc}")
    _LT_PLANS[key] = plan
    return plan


def _lt_build(ctx, stream, ins, outs, act):
    from nvmath.bindings import cublasLt as lt

    x, w, b = ins
    y = outs[-1]
    dt = str(x.dtype)
    if dt not in _CUDA_R or w.dtype != x.dtype or b.dtype != x.dtype or y.dtype != x.dtype:
        raise ValueError(f"dtype {dt} has no cuBLASLt epilogue here")
    for a in (x, w, b, y) + ((outs[0],) if act == "gelu" else ()):
        if not a.flags.c_contiguous or a.data.ptr % 16:
            raise ValueError("operands must be C-contiguous and 16-byte aligned")
    m, k = x.shape
    n = w.shape[1]
    if act == "gelu" and n % 8:
        raise ValueError("the GELU aux output needs n % 8 == 0")
    handle, ws_ptr, ws_bytes = ctx.lt_handle(stream if isinstance(stream, str) else ctx._name_of(stream))
    r = _CUDA_R[dt]
    desc = lt.matmul_desc_create(_COMPUTE[dt], r)
    made = {"desc": desc, "layouts": [], "pref": None}
    try:
        def put(attr, value, dtype):
            get = getattr(lt, "get_matmul_desc_attribute_dtype", None)
            buf = np.array([value], dtype=get(attr) if get is not None else dtype)
            lt.matmul_desc_set_attribute(desc, int(attr), buf.ctypes.data, buf.itemsize)

        A = lt.MatmulDescAttribute
        put(A.TRANSA, 0, np.int32)  # CUBLAS_OP_N
        put(A.TRANSB, 0, np.int32)
        put(A.EPILOGUE, _EPILOGUE[act], np.uint32)
        put(A.BIAS_POINTER, b.data.ptr, np.uint64)
        if act == "gelu":
            put(A.EPILOGUE_AUX_POINTER, outs[0].data.ptr, np.uint64)
            put(A.EPILOGUE_AUX_LD, n, np.int64)
        la = lt.matrix_layout_create(r, n, k, n)
        lb = lt.matrix_layout_create(r, k, m, k)
        ld = lt.matrix_layout_create(r, n, m, n)
        made["layouts"] = [la, lb, ld]
        pref = lt.matmul_preference_create()
        made["pref"] = pref
        P = lt.MatmulPreferenceAttribute

        def pref_put(attr, value):
            get = getattr(lt, "get_matmul_preference_attribute_dtype", None)
            buf = np.array([value], dtype=get(attr) if get is not None else np.uint64)
            lt.matmul_preference_set_attribute(pref, int(attr), buf.ctypes.data, buf.itemsize)

        pref_put(P.MAX_WORKSPACE_BYTES, ws_bytes)
        # the heuristic assumes 256-byte aligned operands unless told: tell it what they are
        for attr, arr in (("MIN_ALIGNMENT_A_BYTES", w), ("MIN_ALIGNMENT_B_BYTES", x), ("MIN_ALIGNMENT_C_BYTES", y),
                          ("MIN_ALIGNMENT_D_BYTES", y)):
            if hasattr(P, attr):
                pref_put(getattr(P, attr), _alignment(arr.data.ptr))
        res = np.zeros((1,), dtype=np.dtype([("algo", np.uint64, (8,)), ("workspace_size", np.uint64),
                                             ("state", np.int32), ("waves", np.float32),
                                             ("reserved", np.int32, (4,))]))
        count = np.zeros((1,), np.int32)
        lt.matmul_algo_get_heuristic(handle, desc, la, lb, ld, ld, pref, 1, res.ctypes.data, count.ctypes.data)
        if count[0] < 1 or res[0]["state"] != 0:
            raise RuntimeError("no algorithm for this epilogue")
        algo = np.ascontiguousarray(res[0]["algo"])
        one = np.array([1.0], dtype=dt)
        zero = np.array([0.0], dtype=dt)
        return {"lt": lt, "handle": handle, "desc": desc, "la": la, "lb": lb, "ld": ld, "algo": algo,
                "alpha": one, "beta": zero, "ws": ws_ptr, "ws_bytes": ws_bytes, "pref": pref}
    except BaseException:
        for h in made["layouts"]:
            lt.matrix_layout_destroy(h)
        if made["pref"] is not None:
            lt.matmul_preference_destroy(made["pref"])
        lt.matmul_desc_destroy(desc)
        raise


def _alignment(ptr: int) -> int:
    a = 1
    while a < 256 and ptr % (2 * a) == 0:
        a *= 2
    return a


def _lt_run(ctx, stream, plan, ins, outs) -> None:
    x, w, b = ins
    y = outs[-1]
    p = plan
    p["lt"].matmul(p["handle"], p["desc"], p["alpha"].ctypes.data, w.data.ptr, p["la"], x.data.ptr, p["lb"],
                   p["beta"].ctypes.data, y.data.ptr, p["ld"], y.data.ptr, p["ld"], p["algo"].ctypes.data,
                   p["ws"], p["ws_bytes"], ctx.stream_ptr(stream))


def _unfused(ctx, stream, ins, outs, act) -> None:
    """matmul, add and the activation by their own twins (the temporaries from the current pool:
    under the executor the captured graph's own, as conv's im2col)."""
    import importlib

    import cupy as cp

    x, w, b = ins

    def twin(name):
        mod, _, attr = STDLIB[name].cuda.partition(":")
        return getattr(importlib.import_module(mod), attr)

    with ctx.stream(stream) if ctx is not None else _nullcontext():
        m = cp.empty((x.shape[0], w.shape[1]), x.dtype)
        h = outs[0] if act == "gelu" else cp.empty_like(m)
    twin("matmul")(ctx, stream, [x, w], [m], dict(STDLIB["matmul"].attrs))
    twin("add")(ctx, stream, [m, b], [h], {})
    twin(act)(ctx, stream, [h], [outs[-1]], {})


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _gemm_act_cuda(act):
    def run(ctx, stream, ins, outs, attrs):
        plan = _lt_plan(ctx, stream, ins, outs, act) if ctx is not None else None
        if plan is None:
            _unfused(ctx, stream, ins, outs, act)
        else:
            _lt_run(ctx, stream, plan, ins, outs)

    def prepare(ctx, stream, ins, outs, attrs):
        if ctx is not None:
            _lt_plan(ctx, stream, ins, outs, act)

    run.prepare = prepare
    return run


gemm_bias_relu_cuda = _gemm_act_cuda("relu")
gemm_bias_gelu_cuda = _gemm_act_cuda("gelu")
