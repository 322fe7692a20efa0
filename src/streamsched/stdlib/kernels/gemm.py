"""GEMM: `matmul` (c = op(a) @ op(b)), the one kernel that is cuBLAS alone; the convolutions reach
cuBLAS through the same context glue (`ctx.gemm`, the stream's own handle); and the GEMMs with a
fused epilogue the fusion pass makes, forward `gemm_bias`, `gemm_bias_relu`, `gemm_bias_relu_aux`
and `gemm_bias_gelu` (cuBLASLt's BIAS / RELU_BIAS / RELU_AUX_BIAS / GELU_AUX_BIAS) and backward
`gemm_drelu_bgrad` and `gemm_dgelu_bgrad` (DRELU_BGRAD / DGELU_BGRAD), through nvmath-python's
cublasLt bindings on the device, and `gemm_relu_grad` (the skinny product's relu gate)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np

from streamsched.stdlib.kernel_record import KCall, KernelTypeError
from streamsched.stdlib.kernels._base import STDLIB, DocRow, Family, GradArgs, _flag, _floats, _fmt
from streamsched.stdlib.kernels._cuda import _gemm

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


def _gemm_bias_cpu(ins, outs, at):
    outs[0][...] = _pre_cpu(*ins)


_register("gemm_bias", "x w b", "y", _gemm_bias_relu_infer, _gemm_bias_cpu, doc="""
y = x @ w + b in one launch: made by the fusion pass from matmul(x, w) -> t and add(t, b) -> y
where no activation the GEMM's epilogue takes follows and nothing else reads t, never written.
x: [m, k], w: [k, n], b: [n], one float dtype -> y: [m, n].  CPU: matmul's and add's NumPy twins
in order (bitwise the unfused tasks); CUDA: cuBLASLt's BIAS epilogue (f32, f64), the two twins
where cuBLASLt is missing or refuses (a one-line notice).
""", inplace=False, row=DocRow("x [m,k], w [k,n], b [n] -> y [m,n]", "comp1",
                               "y = x w + b: cuBLASLt BIAS (made by the fusion pass)"))

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


def _mask_ld(n: int) -> int:
    """The relu bitmask's leading dimension in bits (cuBLASLt: a multiple of 128, at least n)."""
    return -(-n // 128) * 128


def _gemm_bias_relu_aux_infer(k, names, t, at):
    shape, dt = _gemm_bias_types(k, names, t)
    return [(shape, dt), ((shape[0], _mask_ld(shape[1]) // 8), "u8")]


def _gemm_bias_relu_aux_cpu(ins, outs, at):
    _gemm_bias_relu_cpu(ins, outs[:1], at)
    y, mask = outs
    bits = np.zeros((y.shape[0], _mask_ld(y.shape[1])), bool)
    bits[:, :y.shape[1]] = y > 0
    mask[...] = np.packbits(bits, axis=1, bitorder="little")


_register("gemm_bias_relu_aux", "x w b", "y mask", _gemm_bias_relu_aux_infer, _gemm_bias_relu_aux_cpu, doc="""
y = relu(x @ w + b) and its relu bitmask in one launch: gemm_bias_relu where the fusion pass also
fuses the backward (gemm_drelu_bgrad reads the mask), never written.  x: [m, k], w: [k, n],
b: [n], one float dtype -> y: [m, n], mask: u8 [m, ceil(n/128)*16] (row r: bits r*ld .. r*ld+n-1,
ld = ceil(n/128)*128, set where y > 0).  CPU: the three twins in order, then the mask packed
little-endian; CUDA: cuBLASLt's RELU_AUX_BIAS epilogue (the mask in cuBLASLt's own bit layout,
read by nothing but cuBLASLt's DRELU_BGRAD), the three twins where cuBLASLt refuses (the mask is
then not written, and the backward that reads it runs unfused from y).
""", inplace=False, row=DocRow("x [m,k], w [k,n], b [n] -> y [m,n], mask u8 [m,ceil(n/128)*16]", "comp1",
                               "y = relu(x w + b) and its bitmask: cuBLASLt RELU_AUX_BIAS (made by the fusion pass)"))


def _gemm_bgrad_types(k, names, t, at, aux_arity):
    (shape, dt), = _matmul_infer(k, names[:2], t[:2], at)
    aux = t[2]
    if tuple(aux[0]) != shape or aux[1] != dt:
        raise KernelTypeError(f"{k}: {names[2]} must be {dt}{_fmt(shape)} like the product, "
                              f"got {aux[1]}{_fmt(aux[0])}", arg=2)
    if aux_arity == 2:
        want = (shape[0], _mask_ld(shape[1]) // 8)
        if tuple(t[3][0]) != want or t[3][1] != "u8":
            raise KernelTypeError(f"{k}: mask must be u8{_fmt(want)}, got {t[3][1]}{_fmt(t[3][0])}", arg=3)
    return [(shape, dt), ((shape[1],), dt)]


def _product(dz, w, at):
    """op(dz) @ op(w) by matmul's own twin (so the fused result is bitwise the unfused tasks')."""
    m = dz.shape[1] if at["ta"] else dz.shape[0]
    n = w.shape[0] if at["tb"] else w.shape[1]
    t = np.empty((m, n), dz.dtype)
    STDLIB["matmul"].cpu([dz, w], [t], {"ta": at["ta"], "tb": at["tb"]})
    return t


def _gemm_dgelu_bgrad_cpu(ins, outs, at):
    dz, w, pre = ins
    STDLIB["gelu_grad"].cpu([_product(dz, w, at), pre], [outs[0]], {})
    STDLIB["sum"].cpu([outs[0]], [outs[1]], {"axis": 0})


def _gemm_drelu_bgrad_cpu(ins, outs, at):
    _gemm_drelu_cpu(ins, outs[:1], at)
    STDLIB["sum"].cpu([outs[0]], [outs[1]], {"axis": 0})


_register("gemm_dgelu_bgrad", "dz w pre", "dpre db", lambda k, n, t, at: _gemm_bgrad_types(k, n, t, at, 1),
          _gemm_dgelu_bgrad_cpu, {"ta": False, "tb": False}, doc="""
dpre = gelu_grad(op(dz) @ op(w), pre) and db = sum(dpre, axis=0) in one launch: made by the fusion
pass from a linear's input-gradient GEMM matmul(dz, w) -> dy, gelu_grad(dy, pre) -> dpre and the
bias gradient sum(dpre, axis=0) -> db where nothing else reads dy, never written.  dz, w as
matmul's a, b (ta, tb its flags) with op(dz) @ op(w): [m, n]; pre: [m, n] (the forward's
GELU_AUX_BIAS output) -> dpre: [m, n], db: [n]; one float dtype.  CPU: matmul, gelu_grad and sum's
twins in order (bitwise the unfused tasks); CUDA: cuBLASLt's DGELU_BGRAD epilogue (aux = pre), the
three twins where cuBLASLt is missing or refuses (a one-line notice).
""", inplace=False, row=DocRow("dz, w, pre [m,n] -> dpre [m,n], db [n]", "comp3",
                               "dpre = gelu'(pre) (op(dz) op(w)); db = sum(dpre, 0): cuBLASLt DGELU_BGRAD "
                               "(made by the fusion pass)"))

_register("gemm_drelu_bgrad", "dz w y mask", "dpre db", lambda k, n, t, at: _gemm_bgrad_types(k, n, t, at, 2),
          _gemm_drelu_bgrad_cpu, {"ta": False, "tb": False}, doc="""
dpre = relu_grad(op(dz) @ op(w), y) and db = sum(dpre, axis=0) in one launch: made by the fusion
pass from matmul(dz, w) -> dy, relu_grad(dy, y) -> dpre and sum(dpre, axis=0) -> db where nothing
else reads dy and every writer of y is a gemm_bias_relu (made gemm_bias_relu_aux, so that it
writes the mask beside y), never written.  dz, w as matmul's a, b (ta, tb its flags); y: [m, n],
the forward's relu output; mask: its gemm_bias_relu_aux bitmask -> dpre: [m, n], db: [n]; one
float dtype.  CPU: matmul's twin, relu_grad's on the unpacked mask (its bits are y > 0), sum's
(bitwise the unfused tasks); CUDA: cuBLASLt's DRELU_BGRAD epilogue (aux = the mask), the three
twins on y where cuBLASLt refuses either epilogue (a one-line notice).
""", inplace=False, row=DocRow("dz, w, y [m,n], mask -> dpre [m,n], db [n]", "comp3",
                               "dpre = (op(dz) op(w)) where y > 0; db = sum(dpre, 0): cuBLASLt DRELU_BGRAD "
                               "(made by the fusion pass)"))


def _gemm_relu_grad_infer(k, names, t, at):
    (shape, dt), = _matmul_infer(k, names[:2], t[:2], at)
    if tuple(t[2][0]) != shape or t[2][1] != dt:
        raise KernelTypeError(f"{k}: {names[2]} must be {dt}{_fmt(shape)} like the product, "
                              f"got {t[2][1]}{_fmt(t[2][0])}", arg=2)
    return [(shape, dt)]


def _gemm_relu_grad_cpu(ins, outs, at):
    dz, w, y = ins
    STDLIB["relu_grad"].cpu([_product(dz, w, at), y], [outs[0]], {})


_register("gemm_relu_grad", "dz w y", "dpre", _gemm_relu_grad_infer, _gemm_relu_grad_cpu,
          {"ta": False, "tb": False}, doc="""
dpre = relu_grad(op(dz) @ op(w), y) in one launch where the product is skinny: made by the fusion
pass from a linear's input-gradient GEMM matmul(dz, w) -> dy followed at once by relu_grad(dy, y)
-> dpre where nothing else reads dy (the bias gradient stays its own sum), never written.  dz, w as
matmul's a, b (ta, tb its flags) with op(dz) @ op(w): [m, n]; y: [m, n], the forward's relu output
-> dpre: [m, n]; one float dtype.  CPU: matmul's and relu_grad's twins in order; CUDA: the skinny
product (contracted dimension <= 32) with the relu gate applied before its store, otherwise
matmul's and relu_grad's twins (relu_grad in place on dpre).  Both are bitwise the unfused tasks.
""", inplace=False, row=DocRow("dz, w, y [m,n] -> dpre [m,n]", "comp3",
                               "dpre = (op(dz) op(w)) where y > 0: the skinny GEMM's relu gate "
                               "(made by the fusion pass)"))


def _gemm_drelu_infer(k, names, t, at):
    out = _gemm_bgrad_types(k, names, t, at, 2)
    return out[:1]


def _gemm_drelu_cpu(ins, outs, at):
    dz, w, y, mask = ins
    keep = np.unpackbits(mask, axis=1, count=y.shape[1], bitorder="little").astype(bool)
    STDLIB["relu_grad"].cpu([_product(dz, w, at), keep], [outs[0]], {})


_register("gemm_drelu", "dz w y mask", "dpre", _gemm_drelu_infer, _gemm_drelu_cpu, {"ta": False, "tb": False}, doc="""
dpre = relu_grad(op(dz) @ op(w), y) in one launch: gemm_relu_grad where every writer of y is a
fused forward GEMM (made gemm_bias_relu_aux, so that it writes y's relu bitmask beside it), made by
the fusion pass, never written.  dz, w as matmul's a, b (ta, tb its flags); y: [m, n], the
forward's relu output; mask: its gemm_bias_relu_aux bitmask -> dpre: [m, n]; one float dtype.
CPU: matmul's twin, relu_grad's on the unpacked mask (its bits are y > 0; bitwise the unfused
pair); CUDA: cuBLASLt's DRELU epilogue on the mask (the pass makes it for products that are not
skinny only: k > 32), the two twins on y where cuBLASLt refuses (a one-line notice).
""", inplace=False, row=DocRow("dz, w, y [m,n], mask -> dpre [m,n]", "comp3",
                               "dpre = (op(dz) op(w)) where y > 0: cuBLASLt DRELU (made by the fusion pass)"))


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.


def matmul_cuda(ctx, stream, ins, outs, attrs):
    a, b = ins
    _gemm(ctx, stream, a, b, outs[0], bool(attrs.get("ta", False)), bool(attrs.get("tb", False)))


def gemm_relu_grad_cuda(ctx, stream, ins, outs, attrs):
    """dpre = relu_grad(op(dz) @ op(w), y): `_skinny_gemm` with the gate, or matmul's twin and
    relu_grad's in place (bitwise the unfused pair either way: the gated kernel is the one matmul
    would run, gated before its store)."""
    from streamsched.stdlib.kernels._cuda import _skinny_gemm

    dz, w, y = ins
    ta, tb = _flags(attrs)
    if ctx is not None and _skinny_gemm(ctx, stream, dz, w, outs[0], ta, tb, gate=y):
        return
    _gemm(ctx, stream, dz, w, outs[0], ta, tb)
    _twin("relu_grad")(ctx, stream, [outs[0], y], [outs[0]], {})


# -- cuBLASLt epilogues ------------------------------------------------------------------------
# Row-major y [m, n] = x [m, k] @ w [k, n] is column-major y^T [n, m] = w^T [n, k] @ x^T [k, m]:
# A = w (column-major [n, k], ld n), B = x ([k, m], ld k), D = y ([n, m], ld n); the bias has one
# entry per row of D (n), as the epilogue wants; GELU_AUX_BIAS's aux (the pre-activation) is laid
# out like D, RELU_AUX_BIAS's bitmask too with a leading dimension of _mask_ld(n) bits.  The
# backward t [m, n] = op(dz) @ op(w) is t^T = op(w)^T op(dz)^T: a row-major buffer is its own
# transpose column-major, so A = w transposed exactly when tb is set, B = dz exactly when ta is;
# DRELU_BGRAD / DGELU_BGRAD write the bias gradient (one entry per row of D: the sum over the m
# columns, sum(dpre, axis=0)) to the bias pointer.  A descriptor names the bias and aux pointers,
# so one is built per binding, when the executor binds the task (before any capture: `prepare`),
# with its heuristic algorithm.

_LT_PLANS: dict[tuple, Any] = {}
_LT_NOTICE: list = []
_LT_MASKS: dict[int, bool] = {}
"""relu bitmask pointer -> whether every forward binding that writes it runs RELU_AUX_BIAS: a forward
that fell back to the three kernels writes no mask, and the backward reading it must then fall
back as well (False sticks: a stale entry only ever costs the fused launch, never a wrong mask)."""
_CUDA_R = {"float32": 0, "float64": 1}
_COMPUTE = {"float32": 68, "float64": 70}  # CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F
_EPILOGUE = {"bias": ("BIAS", 4), "relu": ("RELU_BIAS", 6), "relu_aux": ("RELU_AUX_BIAS", 134), "gelu": ("GELU_AUX_BIAS", 164),
             "drelu": ("DRELU_BGRAD", 152), "dgelu": ("DGELU_BGRAD", 208), "drelu_only": ("DRELU", 136)}
"""act -> (cublasLtEpilogue_t name, value in cublasLt.h); the bindings' own Epilogue enum wins."""
_FWD = ("bias", "relu", "relu_aux", "gelu")


def _lt_notice(why: str) -> None:
    if not _LT_NOTICE:
        import sys

        _LT_NOTICE.append(why)
        print(f"note: GEMM epilogues run unfused on the device ({why})", file=sys.stderr)


def _flags(attrs) -> tuple[bool, bool]:
    return bool((attrs or {}).get("ta", False)), bool((attrs or {}).get("tb", False))


def _lt_key(stream, ins, outs, act, attrs=None, ctx=None):
    x, w = ins[0], ins[1]
    # the context too: a plan names its context's handle and workspace, which die with it (a later
    # executor's arrays may sit at the same addresses)
    return (str(stream), act, str(x.dtype), x.shape, w.shape) + tuple(a.data.ptr for a in ins) \
        + tuple(o.data.ptr for o in outs) + _flags(attrs) + (id(ctx),)


def forget_context(ctx) -> None:
    """Drop the plans of a closing context (DeviceContext.close): its handles and workspaces go."""
    for key in [k for k in _LT_PLANS if k[-1] == id(ctx)]:
        del _LT_PLANS[key]


def _lt_plan(ctx, stream, ins, outs, act, attrs=None):
    """The descriptor, layouts and algorithm of this binding, built once; None (and a notice)
    when cuBLASLt is missing or refuses the case: the twins then run the three unfused kernels."""
    key = _lt_key(stream, ins, outs, act, attrs, ctx)
    if key in _LT_PLANS:
        plan = _LT_PLANS[key]
    else:
        plan = None
        try:
            plan = _lt_build(ctx, stream, _lt_spec(ins, outs, act, attrs))
        except ImportError as exc:
            _lt_notice(f"nvmath-python's cublasLt bindings are missing: {exc}")
        except Exception as exc:  # a refused layout or epilogue: unfused, said once
            _lt_notice(f"cuBLASLt refused {_EPILOGUE[act][0]} for {ins[0].shape} @ {ins[1].shape}: "
                       f"{type(exc).__name__}: {exc}")
        _LT_PLANS[key] = plan
        hooks = getattr(ctx, "close_hooks", None)
        if hooks is not None and forget_context not in hooks:
            hooks.append(forget_context)
    if act == "relu_aux":
        ptr = outs[1].data.ptr
        _LT_MASKS[ptr] = _LT_MASKS.get(ptr, True) and plan is not None
    return plan


def _lt_spec(ins, outs, act, attrs) -> dict:
    """What one cuBLASLt call of `act` multiplies and where its epilogue reads and writes (the
    layout comment above), with the operands whose dtype, contiguity and alignment it needs."""
    if act in _FWD:
        x, w, b = ins
        m, k = x.shape
        n = w.shape[1]
        y = outs[0] if act == "relu_aux" else outs[-1]
        aux = outs[1] if act == "relu_aux" else outs[0] if act == "gelu" else None
        a, ta, b_, tb_ = w, False, x, False
        floats, bias = (x, w, b, y) + ((aux,) if act == "gelu" else ()), b
        kk = k
    else:
        dz, w = ins[0], ins[1]
        ta_, tb = _flags(attrs)
        m = dz.shape[1] if ta_ else dz.shape[0]
        n = w.shape[0] if tb else w.shape[1]
        y, bias = (outs[0], None) if act == "drelu_only" else outs
        aux = ins[2] if act == "dgelu" else ins[3]
        a, ta, b_, tb_ = w, tb, dz, ta_
        floats = (dz, w, y) + ((bias,) if bias is not None else ()) + ((aux,) if act == "dgelu" else ())
        kk = dz.shape[0] if ta_ else dz.shape[1]
    if act in ("gelu", "dgelu") and n % 8:
        raise ValueError("the GELU aux matrix needs n % 8 == 0")
    aux_ld = n if act in ("gelu", "dgelu") else _mask_ld(n) if aux is not None else 0
    return {"act": act, "dt": str(floats[0].dtype), "floats": floats, "all": floats + ((aux,) if aux is not None else ()),
            "A": a, "transa": ta, "B": b_, "transb": tb_, "D": y, "m": m, "n": n, "k": kk, "bias": bias, "aux": aux,
            "aux_ld": aux_ld}


def _lt_desc(lt, sp, bias_ptr: int, aux_ptr: int | None):
    """The matmul descriptor of spec `sp` with its epilogue reading / writing these pointers."""
    name, value = _EPILOGUE[sp["act"]]
    enum = getattr(lt, "Epilogue", None)
    epilogue = int(getattr(enum, name)) if enum is not None and hasattr(enum, name) else value
    r = _CUDA_R[sp["dt"]]
    desc = lt.matmul_desc_create(_COMPUTE[sp["dt"]], r)
    try:
        def put(attr, value, dtype):
            get = getattr(lt, "get_matmul_desc_attribute_dtype", None)
            buf = np.array([value], dtype=get(attr) if get is not None else dtype)
            lt.matmul_desc_set_attribute(desc, int(attr), buf.ctypes.data, buf.itemsize)

        At = lt.MatmulDescAttribute
        put(At.TRANSA, 1 if sp["transa"] else 0, np.int32)  # CUBLAS_OP_T / CUBLAS_OP_N
        put(At.TRANSB, 1 if sp["transb"] else 0, np.int32)
        put(At.EPILOGUE, epilogue, np.uint32)
        if bias_ptr is not None:
            put(At.BIAS_POINTER, bias_ptr, np.uint64)
        if aux_ptr is not None:
            put(At.EPILOGUE_AUX_POINTER, aux_ptr, np.uint64)
            put(At.EPILOGUE_AUX_LD, sp["aux_ld"], np.int64)
    except BaseException:
        lt.matmul_desc_destroy(desc)
        raise
    return desc


def _lt_build(ctx, stream, sp):
    from nvmath.bindings import cublasLt as lt

    dt = sp["dt"]
    if dt not in _CUDA_R or any(str(a.dtype) != dt for a in sp["floats"]):
        raise ValueError(f"dtype {dt} has no cuBLASLt epilogue here")
    for a in sp["all"]:
        if not a.flags.c_contiguous or a.data.ptr % 16:
            raise ValueError("operands must be C-contiguous and 16-byte aligned")
    A, B, D, m, n = sp["A"], sp["B"], sp["D"], sp["m"], sp["n"]
    sname = stream if isinstance(stream, str) else ctx._name_of(stream)
    handle, ws_ptr, ws_bytes = ctx.lt_handle(sname)
    r = _CUDA_R[dt]
    aux = sp["aux"]
    desc = _lt_desc(lt, sp, None if sp["bias"] is None else sp["bias"].data.ptr,
                    None if aux is None else aux.data.ptr)
    made = {"desc": desc, "layouts": []}
    try:
        # a row-major [r, c] buffer is a column-major [c, r] matrix with ld c (op applied by TRANS*)
        la = lt.matrix_layout_create(r, A.shape[1], A.shape[0], A.shape[1])
        lb = lt.matrix_layout_create(r, B.shape[1], B.shape[0], B.shape[1])
        ld = lt.matrix_layout_create(r, n, m, n)
        made["layouts"] = [la, lb, ld]
        cands = ctx.lt_candidates(lt, handle, desc, la, lb, ld, ws_bytes)
        one = np.array([1.0], dtype=dt)
        zero = np.array([0.0], dtype=dt)
        key = ctx.lt_problem_key(sp["act"], dt, _COMPUTE[dt], m, n, sp["k"], sp["transa"], sp["transb"],
                                 sp["aux_ld"], ws_bytes)
        algo = ctx.lt_algo(key, cands, stream, ws_bytes,
                           lambda: _lt_scratch_run(ctx, lt, sp, handle, (la, lb, ld), one, zero))
        return {"lt": lt, "handle": handle, "desc": desc, "la": la, "lb": lb, "ld": ld, "algo": algo,
                "alpha": one, "beta": zero, "ws": ws_ptr, "ws_bytes": ws_bytes,
                "a": A.data.ptr, "b": B.data.ptr, "d": D.data.ptr}
    except BaseException:
        for h in made["layouts"]:
            lt.matrix_layout_destroy(h)
        lt.matmul_desc_destroy(desc)
        raise


def _lt_scratch_run(ctx, lt, sp, handle, layouts, one, zero):
    """(run, release) for timing an epilogue problem's candidates (ctx.lt_algo): run issues the
    call on scratch copies of everything it writes (D; the aux output of a forward; the bias
    gradient of a backward), so tuning at bind time never touches the program's buffers; release
    drops the scratch arrays and destroys the descriptor naming them, once the timing is done."""
    cp = ctx.cp
    fwd = sp["act"] in _FWD
    aux = sp["aux"]
    d = cp.empty_like(sp["D"])
    bias = sp["bias"] if fwd or sp["bias"] is None else cp.empty_like(sp["bias"])
    aux_s = None if aux is None else (cp.empty_like(aux) if fwd else aux)
    desc = _lt_desc(lt, sp, None if bias is None else bias.data.ptr, None if aux_s is None else aux_s.data.ptr)
    la, lb, ld = layouts
    a_ptr, b_ptr, d_ptr = sp["A"].data.ptr, sp["B"].data.ptr, d.data.ptr

    def run(algo, stream_ptr, wp, wb):
        lt.matmul(handle, desc, one.ctypes.data, a_ptr, la, b_ptr, lb, zero.ctypes.data, d_ptr, ld,
                  d_ptr, ld, algo.ctypes.data, wp, wb, stream_ptr)

    held = [d, bias, aux_s]

    def release():
        held.clear()
        lt.matmul_desc_destroy(desc)

    return run, release


def _lt_run(ctx, stream, plan) -> None:
    p = plan
    p["lt"].matmul(p["handle"], p["desc"], p["alpha"].ctypes.data, p["a"], p["la"], p["b"], p["lb"],
                   p["beta"].ctypes.data, p["d"], p["ld"], p["d"], p["ld"], p["algo"].ctypes.data,
                   p["ws"], p["ws_bytes"], ctx.stream_ptr(stream))


def _twin(name):
    import importlib

    mod, _, attr = STDLIB[name].cuda.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _unfused(ctx, stream, ins, outs, act) -> None:
    """matmul, add and the activation by their own twins (the temporaries from the current pool:
    under the executor the captured graph's own, as conv's im2col); relu_aux writes no mask."""
    import cupy as cp

    x, w, b = ins
    y = outs[0] if act == "relu_aux" else outs[-1]
    with ctx.stream(stream) if ctx is not None else nullcontext():
        m = cp.empty((x.shape[0], w.shape[1]), x.dtype)
        h = outs[0] if act == "gelu" else cp.empty_like(m)
    _twin("matmul")(ctx, stream, [x, w], [m], dict(STDLIB["matmul"].attrs))
    if act == "bias":
        _twin("add")(ctx, stream, [m, b], [y], {})
        return
    _twin("add")(ctx, stream, [m, b], [h], {})
    _twin("gelu" if act == "gelu" else "relu")(ctx, stream, [h], [y], {})


def _bwd_unfused(ctx, stream, ins, outs, act, attrs) -> None:
    """matmul, relu_grad / gelu_grad (on y / pre, never the mask) and sum by their own twins."""
    import cupy as cp

    dz, w = ins[0], ins[1]
    ta, tb = _flags(attrs)
    with ctx.stream(stream) if ctx is not None else nullcontext():
        t = cp.empty(((dz.shape[1] if ta else dz.shape[0]), (w.shape[0] if tb else w.shape[1])), dz.dtype)
    _twin("matmul")(ctx, stream, [dz, w], [t], {"ta": ta, "tb": tb})
    _twin("gelu_grad" if act == "dgelu" else "relu_grad")(ctx, stream, [t, ins[2]], [outs[0]], {})
    if act != "drelu_only":
        _twin("sum")(ctx, stream, [outs[0]], [outs[1]], {"axis": 0})


def _gemm_act_cuda(act):
    def run(ctx, stream, ins, outs, attrs):
        plan = _lt_plan(ctx, stream, ins, outs, act, attrs) if ctx is not None else None
        if plan is not None and act in ("drelu", "drelu_only") and not _LT_MASKS.get(ins[3].data.ptr, False):
            plan = None  # the forward fell back and wrote no mask: the three kernels, on y
        if plan is None:
            if act in ("drelu", "dgelu", "drelu_only"):
                _bwd_unfused(ctx, stream, ins, outs, act, attrs)
            else:
                _unfused(ctx, stream, ins, outs, act)
        else:
            _lt_run(ctx, stream, plan)

    def prepare(ctx, stream, ins, outs, attrs):
        if ctx is not None:
            _lt_plan(ctx, stream, ins, outs, act, attrs)

    run.prepare = prepare
    return run


gemm_bias_cuda = _gemm_act_cuda("bias")
gemm_bias_relu_cuda = _gemm_act_cuda("relu")
gemm_bias_relu_aux_cuda = _gemm_act_cuda("relu_aux")
gemm_bias_gelu_cuda = _gemm_act_cuda("gelu")
gemm_drelu_bgrad_cuda = _gemm_act_cuda("drelu")
gemm_dgelu_bgrad_cuda = _gemm_act_cuda("dgelu")
gemm_drelu_cuda = _gemm_act_cuda("drelu_only")
