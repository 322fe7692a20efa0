"""Reductions along one axis or over everything: `sum` (float or integer) and `mean`."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from streamsched.stdlib.kernel_record import KCall, KernelTypeError
from streamsched.stdlib.kernels._base import (FLOATS, NUMERIC, DocRow, Family, GradArgs, _attr_error, _dtype,
                                              _fmt)
from streamsched.stdlib.kernels._cuda import _colsum, _stream

FAMILY = Family(__name__, "Reductions")
_register = FAMILY.register


def _axis(k, names, t, at) -> int | None:
    axis, nd = at["axis"], len(t[0][0])
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise _attr_error(k, f"attribute axis must be an integer or none, got {axis!r}")
    if not -nd <= axis < nd:
        raise KernelTypeError(f"{k}: axis {axis} is out of range for {names[0]} "
                              f"{_fmt(t[0][0])} ({nd}-D)", arg=0)
    return int(axis) % nd


def _reduce_infer(allowed: tuple[str, ...], what: str):
    def infer(k, names, t, at):
        dt = _dtype(k, t, 0, names, allowed, what)
        axis = _axis(k, names, t, at)
        shape = () if axis is None else t[0][0][:axis] + t[0][0][axis + 1:]
        return [(shape, dt)]
    return infer


def _sum_cpu(ins, outs, at):
    np.sum(ins[0], axis=at["axis"], out=outs[0])


def _mean_cpu(ins, outs, at):
    np.mean(ins[0], axis=at["axis"], out=outs[0])


def _reduction_recipe(kind: str) -> Callable:
    def recipe(g: GradArgs):
        (x,) = g.args
        if g.types[x][1] not in FLOATS:
            return [None]
        from streamsched.stdlib import kernel_lang as L  # SymPy, only when a gradient needs it

        axis = g.attrs.get("axis")
        name = f"{kind}.da" + ("" if axis is None else f"@axis{int(axis)}")
        spec = L.ExprSpec(name, (L.Param("dc", "T", expanded=True), L.Param("a", "T")), (),
                          (L.Output("da", "T"),), (L.S,),
                          L.Reduction("sum", "like:1", L.a(0) / L.CNT if kind == "mean" else L.a(0), (0, 1)),
                          expand=("all",) if axis is None else ("axis", int(axis)),
                          doc=f"the gradient of {kind}: dc broadcast back along the reduced axes", grad_of=kind)
        k = L.compiled(spec)
        if name not in g.kernels:
            g.define(k.record)
        return [KCall(name, (g.douts[0], x))]
    return recipe


_register("sum", "a", "c", _reduce_infer(NUMERIC, "a numeric dtype"), _sum_cpu, {"axis": None},
          doc="""
c = sum of a over `axis` (an int, negative counts from the end), or over everything when axis
is none (c is then a scalar []).  a: float or integer -> c: a's dtype, the axis removed.
The bias gradient: db = sum(dy, axis=0).
""", inplace=False, grad=_reduction_recipe("sum"),
          row=DocRow("a -> c", "comp2", "sum over `axis` (none: everything, c is []); float or integer"))

_register("mean", "a", "c", _reduce_infer(FLOATS, "a float dtype"), _mean_cpu, {"axis": None},
          doc="""
c = mean of a over `axis` (int or none = everything -> scalar []).  a: float -> c: a's dtype.
""", inplace=False, grad=_reduction_recipe("mean"),
          row=DocRow("a -> c", "comp2", "mean over `axis`; float"))


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.


_K: dict[str, Any] = {}


def _kernels() -> dict[str, Any]:
    """Build the CuPy kernel objects once (compilation itself happens per dtype on first
    launch, which is why the executor warms every task up before capture)."""
    if _K:
        return _K
    import cupy as cp

    R = cp.ReductionKernel
    k = _K
    k["sum"] = R("T x", "T y", "x", "a + b", "y = (T)a", "0", "ss_sum", reduce_type="double")
    k["mean"] = R("T x", "T y", "x", "a + b",
                  "y = (T)(a / (double)(_in_ind.size() / _out_ind.size()))", "0", "ss_mean",
                  reduce_type="double")
    k["isum"] = R("T x", "T y", "x", "a + b", "y = (T)a", "0", "ss_isum",
                  reduce_type="long long")
    return k


def _reduce_cuda(kind: str) -> Callable:
    def fn(ctx, stream, ins, outs, attrs):
        x, out = ins[0], outs[0]
        axis = attrs.get("axis", None)
        if axis is not None and _colsum(ctx, stream, x, out, int(axis), kind == "mean"):
            return
        k = _kernels()
        kern = k[kind]
        if kind == "sum" and x.dtype.kind in "iu":
            kern = k["isum"]
        with _stream(ctx, stream):
            kern(x, out, axis=axis)
    fn.__name__ = kind
    return fn


sum_cuda = _reduce_cuda("sum")
mean_cuda = _reduce_cuda("mean")
