"""The text of a kernel's twins, printed by SymPy from an `ExprSpec` (stdlib.kernel_spec): the
Python of the NumPy twin (SymPy's NumPy printer) and the CuPy ElementwiseKernel /
ReductionKernel text of the CUDA twin (SymPy's C printer), both after `cse`.  Only the spec's own
symbols (`a0`, `p0`, `s`, `cnt`, temporaries) and numbers are printed: nothing a user wrote.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import sympy as sp
from sympy.printing.c import C99CodePrinter
from sympy.printing.numpy import NumPyPrinter

from streamsched.stdlib.kernel_spec import ExprSpec, post_inputs

def _num(v) -> str:
    """A number exactly as Python and C read it back (a binary64 literal)."""
    f = float(v)
    if math.isinf(f) or math.isnan(f):
        raise ValueError(f"not a finite number: {v}")
    if f == int(f) and abs(f) < 2 ** 53:
        return f"{int(f)}.0"
    return repr(f)


class _NumPy(NumPyPrinter):
    """SymPy's NumPy printer with exact literals, `numpy.where` for Piecewise, and the overflow-free
    helpers for sigmoid, softplus and erf (module `_ss` of the generated code)."""

    def __init__(self):
        super().__init__({"fully_qualified_modules": True, "allow_unknown_functions": False})

    def _print_Float(self, e):
        return _num(e)

    def _print_Rational(self, e):
        return _num(e)

    def _print_Integer(self, e):
        return str(int(e))

    def _print_Pow(self, e, rational=False):
        b, x = e.args
        base = self.parenthesize(b, 60)
        if x == -1:
            return f"(1.0/{base})"
        if x == sp.Rational(1, 2):
            return f"numpy.sqrt({self._print(b)})"
        if x == -sp.Rational(1, 2):
            return f"(1.0/numpy.sqrt({self._print(b)}))"
        if x.is_Integer:
            return f"{base}**{int(x)}"
        return f"numpy.power({self._print(b)}, {self._print(x)})"

    def _print_Piecewise(self, e):
        out = "numpy.nan"
        for val, cond in reversed(e.args):
            if cond == sp.true:
                out = self._print(val)
            else:
                out = f"numpy.where({self._print(cond)}, {self._print(val)}, {out})"
        return out

    def _print_And(self, e):
        return self._fold("numpy.logical_and", e.args)

    def _print_Or(self, e):
        return self._fold("numpy.logical_or", e.args)

    def _fold(self, fn, args):
        # binary calls (SymPy prints `logical_and.reduce((a, b))`, which cannot broadcast a row)
        out = self._print(args[0])
        for x in args[1:]:
            out = f"{fn}({out}, {self._print(x)})"
        return out

    def _print_sigmoid(self, e):
        return f"_ss.sigmoid({self._print(e.args[0])})"

    def _print_softplus(self, e):
        return f"_ss.softplus({self._print(e.args[0])})"

    def _print_erf(self, e):
        return f"_ss.erf({self._print(e.args[0])})"

    def _print_NumberSymbol(self, e):
        return _num(float(e))

    _print_Exp1 = _print_NumberSymbol
    _print_Pi = _print_NumberSymbol

    def _print_BooleanTrue(self, e):
        return "True"

    def _print_BooleanFalse(self, e):
        return "False"


class _C(C99CodePrinter):
    """SymPy's C printer for one compute type `A` (float or double): every literal cast to A (no
    silent double arithmetic in float kernels), small integer powers multiplied out, Piecewise as
    `?:`, symbols as the kernel's local copies `_a0`, `_p0`, `_s`, `_cnt`."""

    def __init__(self, ctype: str):
        super().__init__({"math_macros": {}})
        self.ctype = ctype

    def _print_Symbol(self, e):
        return "_" + e.name

    def _print_Float(self, e):
        return f"(({self.ctype}){_num(e)})"

    def _print_Rational(self, e):
        return f"(({self.ctype}){_num(e)})"

    def _print_Integer(self, e):
        return f"(({self.ctype}){int(e)})"

    def _print_Pow(self, e, rational=False):
        b, x = e.args
        base = f"({self._print(b)})"
        if x.is_Integer and 1 <= abs(int(x)) <= 4:
            prod = "*".join([base] * abs(int(x)))
            return f"({prod})" if x > 0 else f"((({self.ctype})1)/({prod}))"
        if x == sp.Rational(1, 2):
            return f"sqrt({self._print(b)})"
        if x == -sp.Rational(1, 2):
            return f"((({self.ctype})1)/sqrt({self._print(b)}))"
        return f"pow({self._print(b)}, ({self.ctype})({self._print(x)}))"

    def _print_NumberSymbol(self, e):  # pi, E: their binary64 value, not a macro
        return f"(({self.ctype}){_num(float(e))})"

    _print_Exp1 = _print_NumberSymbol
    _print_Pi = _print_NumberSymbol

    def _print_Piecewise(self, e):
        out = f"(({self.ctype})__longlong_as_double(0x7ff8000000000000LL))"  # NaN where no piece holds
        for val, cond in reversed(e.args):
            if cond == sp.true:
                out = self._print(val)
            else:
                out = f"(({self._print(cond)}) ? ({self._print(val)}) : ({out}))"
        return out

    def _print_sigmoid(self, e):
        return f"ss_sigmoid({self._print(e.args[0])})"

    def _print_softplus(self, e):
        return f"ss_softplus({self._print(e.args[0])})"

    def _print_sign(self, e):
        x = self._print(e.args[0])
        return f"(({self.ctype})(({x} > 0) - ({x} < 0)))"

    def _print_BooleanTrue(self, e):
        return "true"

    def _print_BooleanFalse(self, e):
        return "false"


def _cse(exprs: Sequence[Any]) -> tuple[list[tuple[Any, Any]], list[Any]]:
    reps, reduced = sp.cse(list(exprs), symbols=sp.numbered_symbols("t"), optimizations=None)
    return reps, reduced


def _args(spec: ExprSpec) -> list[str]:
    return [f"a{i}" for i in range(len(spec.params))] + [f"p{j}" for j in range(len(spec.attrs))] + ["s", "cnt"]


def numpy_source(spec: ExprSpec) -> str:
    """The Python source of the NumPy twin's expression functions: `_out(a0, ..., p0, ..., s, cnt)`
    returning a tuple (one value per output; for a reduction, the post expressions in `s`) and,
    for a reduction, `_map(...)` returning the mapped values.  Printed by SymPy from `spec`."""
    pr = _NumPy()
    sig = ", ".join(_args(spec))
    lines = []
    groups = [("_out", list(spec.exprs))]
    if spec.reduction is not None:
        groups.insert(0, ("_map", [spec.reduction.map]))
    for fname, exprs in groups:
        reps, reduced = _cse(exprs)
        lines.append(f"def {fname}({sig}):")
        for sym, e in reps:
            lines.append(f"    {sym.name} = {pr.doprint(e)}")
        lines.append(f"    return ({', '.join(pr.doprint(e) for e in reduced)},)")
        lines.append("")
    return "\n".join(lines)


def _np_helpers():
    class _ss:  # noqa: N801 (a namespace for the generated code)
        @staticmethod
        def sigmoid(x):
            # e^min(x, 0) / (1 + e^-|x|): neither exp overflows, both branches keep full relative
            # accuracy, and no data-dependent select (slow on random signs) is needed.
            return np.exp(np.minimum(x, 0)) / (1 + np.exp(-np.abs(x)))

        @staticmethod
        def softplus(x):
            return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))

        @staticmethod
        def erf(x):
            try:
                from scipy.special import erf
            except ImportError:  # pragma: no cover (scikit-learn brings SciPy)
                return np.vectorize(math.erf, otypes=[np.result_type(x, np.float32)])(x)
            return erf(x)

    return _ss


def _compile_numpy(spec: ExprSpec) -> dict[str, Callable]:
    # The source is printed from SymPy expressions over our own symbols (module docstring):
    # executing it runs no text of the user's.
    src = numpy_source(spec)
    ns: dict[str, Any] = {"numpy": np, "_ss": _np_helpers()}
    exec(compile(src, f"<streamsched kernel {spec.name}>", "exec"), ns)  # noqa: S102
    return {k: ns[k] for k in ("_map", "_out") if k in ns}


_CTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64", "i8": "int8",
           "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8", "bool": "bool"}
_CCAST = {"f16": "float16", "bf16": "bfloat16", "f32": "float", "f64": "double", "i8": "signed char",
          "i16": "short", "i32": "int", "i64": "long long", "u8": "unsigned char", "bool": "bool"}
"""C types for casts inside kernel text (CuPy's parameter types are NumPy names; `float16` is
CuPy's half type in kernel code as well)."""
_NP_TO_KEY = {"float16": "f16", "float32": "f32", "float64": "f64", "int8": "i8", "int16": "i16",
              "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "bool"}

_PREAMBLE = r"""
__device__ __forceinline__ float ss_sigmoid(float v) { float e = expf(-fabsf(v)); return v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e); }
__device__ __forceinline__ double ss_sigmoid(double v) { double e = exp(-fabs(v)); return v >= 0.0 ? 1.0 / (1.0 + e) : e / (1.0 + e); }
__device__ __forceinline__ float ss_softplus(float v) { return fmaxf(v, 0.0f) + log1pf(expf(-fabsf(v))); }
__device__ __forceinline__ double ss_softplus(double v) { return fmax(v, 0.0) + log1p(exp(-fabs(v))); }
__device__ __forceinline__ double ss_inf() { return __longlong_as_double(0x7ff0000000000000LL); }
"""


@dataclass(frozen=True)
class CudaSource:
    """The CuPy kernels of one launch signature.  kind "elementwise": `cp.ElementwiseKernel(
    in_params, out_params, operation, name, preamble=preamble)`; kind "reduction":
    `cp.ReductionKernel(in_params, out_params, map_expr, reduce_expr, post_map_expr, identity, name,
    reduce_type=reduce_type, preamble=preamble)`, then, when `post` is not None, the in-place
    elementwise kernel `post` (in_params, out_params, operation) that applies the post expression
    with its array inputs.  `inputs`: the spec's input indices passed, in order, before the
    scalars (attributes, then cnt) and the output."""

    kind: str
    name: str
    in_params: str
    out_params: str
    preamble: str
    inputs: tuple[int, ...]
    operation: str = ""
    map_expr: str = ""
    reduce_expr: str = ""
    post_map_expr: str = ""
    identity: str = ""
    reduce_type: str = ""
    post: tuple[str, str, str] | None = None


def _c_block(pr: _C, exprs: Sequence[Any], targets: Sequence[str], casts: Sequence[str], indent: str) -> str:
    reps, reduced = _cse(exprs)
    lines = [f"{indent}const {pr.ctype} _{sym.name} = {pr.doprint(e)};" for sym, e in reps]
    lines += [f"{indent}{t} = ({c})({pr.doprint(e)});" for t, c, e in zip(targets, casts, reduced)]
    return "\n".join(lines)


def _uses(exprs, sym) -> bool:
    return any(sym in sp.sympify(e).free_symbols for e in exprs)


def cuda_source(spec: ExprSpec, in_dtypes: Sequence[str], out_dtypes: Sequence[str]) -> CudaSource:
    """The CuPy kernel text of `spec` for inputs and outputs of these dtype keys ("f32", ...):
    computed in double when any of them is f64, else in float (f16 values widened), literals
    cast to that type."""
    ctype = "double" if "f64" in tuple(in_dtypes) + tuple(out_dtypes) else "float"
    pr = _C(ctype)
    red = spec.reduction
    nattrs = len(spec.attrs)
    scal = [f"float64 p{j}" for j in range(nattrs)] + ["float64 cnt"]
    loads = [f"const {ctype} _p{j} = ({ctype})p{j};" for j in range(nattrs)] + [f"const {ctype} _cnt = ({ctype})cnt;"]
    outs = [f"{_CTYPES[d]} y{k}" for k, d in enumerate(out_dtypes)]
    casts = [_CCAST[d] for d in out_dtypes]
    digest = hashlib.sha256(repr((spec, tuple(in_dtypes), tuple(out_dtypes))).encode()).hexdigest()[:10]
    name = "ss_" + re.sub(r"[^A-Za-z0-9_]", "_", spec.name) + "_" + digest
    if red is None:
        ins = list(range(len(spec.params)))
        body = [f"const {ctype} _a{i} = ({ctype})a{i};" for i in ins] + loads
        body.append(_c_block(pr, spec.exprs, [f"y{k}" for k in range(len(spec.outputs))], casts, ""))
        return CudaSource("elementwise", name, ", ".join([f"{_CTYPES[in_dtypes[i]]} a{i}" for i in ins] + scal),
                          ", ".join(outs), _PREAMBLE, tuple(ins), operation="\n".join(body))
    ins = list(red.inputs)
    post_ins = post_inputs(spec)
    margs = ", ".join([f"const {ctype} _a{i}" for i in ins] + [f"const {ctype} _p{j}" for j in range(nattrs)]
                      + [f"const {ctype} _cnt"])
    reps, (mapped,) = _cse([red.map])
    fn = [f"__device__ __forceinline__ {ctype} {name}_map({margs}) {{"]
    fn += [f"    const {ctype} _{sym.name} = {pr.doprint(e)};" for sym, e in reps]
    fn += [f"    return {pr.doprint(mapped)};", "}"]
    call = ", ".join([f"({ctype})a{i}" for i in ins] + [f"({ctype})p{j}" for j in range(nattrs)] + [f"({ctype})cnt"])
    map_expr = f"{name}_map({call})"
    summing = red.kind in ("sum", "mean")
    reduce_expr = {"sum": "a + b", "mean": "a + b", "max": "(isnan(a) || a > b) ? a : b",
                   "min": "(isnan(a) || a < b) ? a : b"}[red.kind]
    identity = "0" if summing else ("-ss_inf()" if red.kind == "max" else "ss_inf()")
    reduced = f"(({ctype})(a / cnt))" if red.kind == "mean" else f"(({ctype})a)"
    post = None
    if post_ins:  # the post expression reads arrays: reduce into y0, then apply it in place
        post_map = f"y0 = ({casts[0]}){reduced}"
        pbody = [f"const {ctype} _s = ({ctype})y0;"] + [f"const {ctype} _a{i} = ({ctype})a{i};" for i in post_ins]
        pbody += loads
        pbody.append(_c_block(pr, spec.exprs, ["y0"], casts, ""))
        post = (", ".join([f"{_CTYPES[in_dtypes[i]]} a{i}" for i in post_ins] + scal), outs[0], "\n".join(pbody))
    else:
        pargs = ", ".join([f"const {ctype} _s"] + [f"const {ctype} _p{j}" for j in range(nattrs)] + [f"const {ctype} _cnt"])
        preps, (pe,) = _cse(list(spec.exprs))
        fn += [f"__device__ __forceinline__ {ctype} {name}_post({pargs}) {{"]
        fn += [f"    const {ctype} _{sym.name} = {pr.doprint(e)};" for sym, e in preps]
        fn += [f"    return {pr.doprint(pe)};", "}"]
        pcall = ", ".join([reduced] + [f"({ctype})p{j}" for j in range(nattrs)] + [f"({ctype})cnt"])
        post_map = f"y0 = ({casts[0]})({name}_post({pcall}))"
    return CudaSource("reduction", name, ", ".join([f"{_CTYPES[in_dtypes[i]]} a{i}" for i in ins] + scal),
                      outs[0], _PREAMBLE + "\n".join(fn) + "\n", tuple(ins), map_expr=map_expr,
                      reduce_expr=reduce_expr, post_map_expr=post_map, identity=identity,
                      reduce_type="double" if summing else ctype, post=post)
