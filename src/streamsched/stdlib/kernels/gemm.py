"""GEMM: `matmul` (c = op(a) @ op(b)), the one kernel that is cuBLAS alone; the convolutions reach
cuBLAS through the same context glue (`ctx.gemm`, the stream's own handle)."""

from __future__ import annotations

import numpy as np

from streamsched.stdlib.kernel_record import KCall, KernelTypeError
from streamsched.stdlib.kernels._base import DocRow, Family, GradArgs, _flag, _floats, _fmt

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


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.


def matmul_cuda(ctx, stream, ins, outs, attrs):
    a, b = ins
    ctx.gemm(stream, a, b, outs[0], bool(attrs.get("ta", False)), bool(attrs.get("tb", False)))
