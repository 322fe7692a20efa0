"""Kernels written as expressions, compiled with SymPy into `Kernel` records: the `.sched`
`kernel` form (docs/language.md, "Kernels") after `streamsched.dsl.kernels` has checked it.

    ExprSpec   = params (inputs) + attrs + outputs + one expression per output
               + optionally one Reduction (kind, axis, map expression): y = post(reduce(map))
    ExprKernel = ExprSpec compiled: type rule, NumPy twin (SymPy's NumPy printer), CUDA twin
                 (SymPy's C printer inside a CuPy ElementwiseKernel / ReductionKernel, CuPy
                 imported only when the twin runs), gradient recipe (`sympy.diff`, `cse`)

Expressions are SymPy expressions over the symbols `a0, a1, ...` (the inputs, in order),
`p0, p1, ...` (the attributes), `s` (the reduced value, in a reduction's post expression) and
`cnt` (how many values each output reduces: a mean's divisor).  Printed code only ever holds
these names: nothing a user wrote reaches Python or C text but numbers.

Shapes: an elementwise kernel runs over the broadcast shape of all its inputs (NumPy rules; a row
`[n]` and a scalar `[]` broadcast), and every output has that shape.  A reduction runs its map
over the broadcast shape of its map inputs and reduces along `axis` (an int, or None for every
axis); the other inputs (post inputs) broadcast to the output shape.  Gradient kernels add two
internal forms: `axis = "like:i"` (sum down to the shape of input i: the gradient of a broadcast
operand) and `expand` (inputs that live in a reduction's output space, re-expanded along its
axis: the upstream gradient of a reduction).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np
import sympy as sp
from sympy.codegen.cfunctions import expm1, log1p
from sympy.printing.c import C99CodePrinter
from sympy.printing.numpy import NumPyPrinter

from streamsched.stdlib.kernel_record import GradArgs, KCall, Kernel, KernelTypeError, NotDifferentiable

FLOATS = ("f16", "bf16", "f32", "f64")
INTS = ("i8", "i16", "i32", "i64", "u8", "bool")

S = sp.Symbol("s", real=True)
"""The reduced value in a reduction kernel's post expression."""
CNT = sp.Symbol("cnt", positive=True)
"""How many values each output of a reduction reduces (a mean divides by it)."""


def a(i: int) -> sp.Symbol:
    """The symbol of input i."""
    return sp.Symbol(f"a{i}", real=True)


def p(j: int) -> sp.Symbol:
    """The symbol of attribute j."""
    return sp.Symbol(f"p{j}", real=True)


def is_dtype_var(name: str) -> bool:
    return len(name) == 1 and "A" <= name <= "Z"


# ---- functions a kernel body may call --------------------------------------------------------
class sigmoid(sp.Function):  # noqa: N801 (SymPy's naming: functions are lower case)
    """1 / (1 + e^-x), printed as an overflow-free helper."""

    nargs = 1

    def fdiff(self, argindex=1):
        y = sigmoid(self.args[0])
        return y * (1 - y)

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return 1 / (1 + sp.exp(-x))

    def _eval_evalf(self, prec):
        return self.rewrite(sp.exp)._eval_evalf(prec)


class softplus(sp.Function):  # noqa: N801
    """log(1 + e^x), printed as an overflow-free helper."""

    nargs = 1

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return sp.log(1 + sp.exp(x))

    def _eval_evalf(self, prec):
        return self.rewrite(sp.exp)._eval_evalf(prec)


def where(c, x, y):
    return sp.Piecewise((x, c), (y, True))


def _is_condition(e) -> bool:
    # (a SymPy Symbol is a Boolean too: test for what a comparison can produce)
    return isinstance(e, (sp.core.relational.Relational, sp.logic.boolalg.BooleanAtom,
                          sp.logic.boolalg.BooleanFunction))


def condition(e):
    """A value used as a condition: a comparison as it is, a number as `!= 0`."""
    return e if _is_condition(e) else sp.Ne(e, 0)


def number(e):
    """A comparison used as a number: 1 where it holds, else 0."""
    if _is_condition(e):
        return sp.Piecewise((sp.Integer(1), e), (sp.Integer(0), True))
    return e


def _max(x, y):
    # max(x, 0) is relu, and its gradient at the tie is 0 (the stdlib's relu_grad convention).
    return sp.Piecewise((x, sp.Gt(x, y)), (y, True))


def _min(x, y):
    return sp.Piecewise((x, sp.Lt(x, y)), (y, True))


FUNCTIONS: dict[str, tuple[int, Callable]] = {
    "exp": (1, sp.exp), "log": (1, sp.log), "log1p": (1, log1p), "expm1": (1, expm1),
    "sqrt": (1, sp.sqrt), "rsqrt": (1, lambda x: 1 / sp.sqrt(x)), "tanh": (1, sp.tanh),
    "sigmoid": (1, sigmoid), "softplus": (1, softplus), "erf": (1, sp.erf), "sin": (1, sp.sin),
    "cos": (1, sp.cos), "abs": (1, sp.Abs), "sign": (1, sp.sign), "floor": (1, sp.floor),
    "ceil": (1, sp.ceiling), "max": (2, _max), "min": (2, _min), "pow": (2, lambda x, y: x ** y),
    "where": (3, where),
}
"""name -> (arity, builder on SymPy values); `where`'s first argument is a condition."""

REDUCTIONS = ("sum", "mean", "max", "min")
NOT_DIFFERENTIABLE = {"sign": "sign", "floor": "floor", "ceiling": "ceil"}
"""SymPy function -> the kernel-language name: their derivative is zero almost everywhere and
undefined at the jumps, so training through them would silently learn nothing."""


# ---- the spec ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """One input: dtype is a dtype key or a dtype variable ("T"); dims the declared pattern
    (ints, dimension names, "..." first for any leading dims; None: any shape); expanded: the input
    lives in the reduced space of `ExprSpec.expand` (gradient kernels of reductions)."""

    name: str
    dtype: str
    dims: tuple[str | int, ...] | None = None
    expanded: bool = False


@dataclass(frozen=True)
class Output:
    name: str
    dtype: str
    dims: tuple[str | int, ...] | None = None


@dataclass(frozen=True)
class Reduction:
    """y = post(kind over axis of map); inputs: indices of the inputs the map reads (the rest are
    post inputs, of the output's shape)."""

    kind: str
    axis: int | str | None
    map: Any
    inputs: tuple[int, ...]


@dataclass(frozen=True)
class ExprSpec:
    """What a `kernel` form says, checked (see the module docstring for the symbols)."""

    name: str
    params: tuple[Param, ...]
    attrs: tuple[tuple[str, float], ...]
    outputs: tuple[Output, ...]
    exprs: tuple[Any, ...]
    reduction: Reduction | None = None
    expand: tuple = ()
    """() none; ("axis", k): expanded inputs are the output space of a reduction along axis k of
    the index space; ("all",): of a reduction over every axis."""
    doc: str = ""
    grad_of: str = ""
    """The kernel this one is a gradient kernel of ("" for a user's kernel)."""


# ---- shapes ----------------------------------------------------------------------------------
def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _pattern(p) -> str:
    if p.dims is None:
        return f"{p.dtype}[...]"
    return f"{p.dtype}[{', '.join(str(d) for d in p.dims)}]"


@dataclass(frozen=True)
class Plan:
    """The shapes of one launch: index (the space the expressions run over); axes, reduced, out:
    the reduction's axes of index, index without them, and the output shape (a `like` reduction
    reshapes reduced to its target; elementwise: out is index); espace, eaxis: the space expanded
    inputs live in (index reduced along `expand`) and the axis they are re-expanded along (None:
    every axis, so they are scalars); cnt: values per output of the reduction, or per value of
    espace for an `expand` kernel (what a mean divides by)."""

    index: tuple[int, ...]
    axes: tuple[int, ...]
    reduced: tuple[int, ...]
    out: tuple[int, ...]
    espace: tuple[int, ...]
    eaxis: int | None
    cnt: int


def _broadcast(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    return tuple(np.broadcast_shapes(*shapes)) if shapes else ()


def _reduce_axes(index: tuple[int, ...], axis) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(axes, reduced shape) of a reduction along `axis` (int, None) of `index`."""
    if axis is None or not index:
        return tuple(range(len(index))), ()
    k = axis % len(index)
    return (k,), index[:k] + index[k + 1:]


def _like_axes(index: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, ...] | None:
    """The axes of `index` that summing down to `target` removes, or None when `target` does not
    broadcast to `index` (right-aligned, each dimension equal or 1)."""
    lead = len(index) - len(target)
    if lead < 0:
        return None
    axes = list(range(lead))
    for j, d in enumerate(target):
        if d == index[lead + j]:
            continue
        if d != 1:
            return None
        axes.append(lead + j)
    return tuple(axes)


def _count(index, axes) -> int:
    return int(np.prod([index[k] for k in axes], dtype=np.int64)) if axes else 1


def plan(spec: ExprSpec, shapes: Sequence[tuple[int, ...]]) -> Plan:
    """The shapes of a launch on inputs of `shapes` (already type-checked by `infer`)."""
    red = spec.reduction
    space = range(len(spec.params)) if red is None else red.inputs
    index = _broadcast([tuple(shapes[i]) for i in space if not spec.params[i].expanded])
    espace, eaxis, cnt = index, None, 1
    if spec.expand:
        eaxes, espace = _reduce_axes(index, spec.expand[1] if spec.expand[0] == "axis" else None)
        eaxis = eaxes[0] if spec.expand[0] == "axis" and eaxes else None
        cnt = _count(index, eaxes)
    axes, reduced, out = (), index, index
    if red is not None:
        if isinstance(red.axis, str):
            out = tuple(shapes[int(red.axis[5:])])
            axes = _like_axes(index, out) or ()
            reduced = tuple(d for k, d in enumerate(index) if k not in axes)
        else:
            axes, reduced = _reduce_axes(index, red.axis)
            out = reduced
        if not spec.expand:
            cnt = _count(index, axes)
    return Plan(index, axes, reduced, out, espace, eaxis, cnt)


# ---- printing ----------------------------------------------------------------------------------
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


def post_inputs(spec: ExprSpec) -> list[int]:
    """The inputs a reduction's post expression reads (of the result's shape); an input read
    nowhere constrains no shape."""
    red = spec.reduction
    used = set().union(*(sp.sympify(e).free_symbols for e in spec.exprs))
    return [i for i in range(len(spec.params)) if i not in red.inputs and a(i) in used]


def elementwise_twin(spec: ExprSpec) -> ExprSpec:
    """A `like` gradient kernel when no axis is summed (the operand was not broadcast): the same
    map, written elementwise."""
    red = spec.reduction
    return replace(spec, reduction=None, exprs=tuple(e.xreplace({S: red.map}) for e in spec.exprs))


# ---- the compiled kernel -----------------------------------------------------------------------
def _acc_dtype(arrays) -> np.dtype:
    return np.dtype(np.float64) if any(getattr(x, "dtype", None) == np.float64 for x in arrays) else np.dtype(np.float32)


class ExprKernel:
    """A compiled `ExprSpec`: `record` is its `Kernel` (type rule, NumPy twin, CUDA twin, gradient
    recipe).  Built once per spec (`compiled`)."""

    def __init__(self, spec: ExprSpec):
        self.spec = spec
        self._np: dict[str, Callable] | None = None
        self._cuda: dict[tuple, Any] = {}
        self.record = Kernel(
            name=spec.name, inputs=tuple(pp.name for pp in spec.params), outputs=tuple(o.name for o in spec.outputs),
            infer=self.infer, cpu=self.cpu, attrs=dict(spec.attrs), cuda=self.cuda, doc=spec.doc,
            inplace=spec.reduction is None and not spec.expand,
            grad=None if spec.grad_of else self.grad)

    # -- type rule
    def infer(self, in_types, attrs=None) -> list[tuple[tuple[int, ...], str]]:
        """Output types on inputs `in_types` [(shape, dtype)]; KernelTypeError S003 (arity, shapes,
        attributes) or S004 (dtypes), `arg` the offending input."""
        spec, k = self.spec, self.spec.name
        names = [pp.name for pp in spec.params]
        if len(in_types) != len(spec.params):
            raise KernelTypeError(f"{k}: takes {len(names)} input{'s' if len(names) != 1 else ''} "
                                  f"({', '.join(names)}), got {len(in_types)}")
        attrs = attrs or {}
        known = dict(spec.attrs)
        for key, v in attrs.items():
            if key not in known:
                takes = f"takes {', '.join(known)}" if known else "takes no attributes"
                raise KernelTypeError(f"{k}: unknown attribute {key!r}; {k} {takes}")
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise KernelTypeError(f"{k}: attribute {key} must be a number, got {v!r}")
        env: dict[str, Any] = {}
        shapes = []
        for i, (pp, (shape, dt)) in enumerate(zip(spec.params, in_types)):
            shape = tuple(int(d) for d in shape)
            shapes.append(shape)
            if is_dtype_var(pp.dtype):
                if dt not in FLOATS:
                    raise KernelTypeError(f"{k}: {pp.name} must be a float dtype ({', '.join(FLOATS)}) for "
                                          f"`{pp.dtype}`, got {dt}", arg=i, code="S004")
                have = env.setdefault("$" + pp.dtype, (dt, pp.name))
                if have[0] != dt:
                    raise KernelTypeError(f"{k}: dtypes differ: {have[1]} is {have[0]}, {pp.name} is {dt} "
                                          f"(both `{pp.dtype}`)", arg=i, code="S004")
            elif pp.dtype != dt:
                raise KernelTypeError(f"{k}: {pp.name} must be {pp.dtype}, got {dt}", arg=i, code="S004")
            if pp.dims is not None:
                self._match(pp.name, pp.dims, shape, env, i, _pattern(pp))
        red = spec.reduction
        space = range(len(spec.params)) if red is None else red.inputs
        plain = [i for i in space if not spec.params[i].expanded]
        try:
            index = _broadcast([shapes[i] for i in plain])
        except ValueError:
            raise KernelTypeError(f"{k}: shapes do not broadcast: " + ", ".join(
                f"{names[i]} is {_fmt(shapes[i])}" for i in plain) + " (trailing dimensions must be equal or 1)",
                arg=plain[-1]) from None
        if red is not None and isinstance(red.axis, int) and not -len(index) <= red.axis < max(len(index), 1):
            raise KernelTypeError(f"{k}: axis {red.axis} is out of range for the {len(index)}-D "
                                  f"{_fmt(index)} it reduces", arg=plain[0] if plain else None)
        if red is not None and isinstance(red.axis, int) and not index:
            raise KernelTypeError(f"{k}: axis {red.axis} is out of range for the 0-D [] it reduces",
                                  arg=plain[0] if plain else None)
        pl = plan(spec, shapes)
        for i, pp in enumerate(spec.params):
            if pp.expanded and not _broadcast_to(shapes[i], pl.espace):
                raise KernelTypeError(f"{k}: {pp.name} is {_fmt(shapes[i])}, which does not broadcast to "
                                      f"{_fmt(pl.espace)}", arg=i)
        if red is not None:
            if isinstance(red.axis, str):
                t = int(red.axis[5:])
                if _like_axes(index, shapes[t]) is None:
                    raise KernelTypeError(f"{k}: {names[t]} {_fmt(shapes[t])} does not broadcast to "
                                          f"{_fmt(index)}", arg=t)
            post = post_inputs(spec)
            for i in range(len(spec.params)):
                if i in post and not _broadcast_to(shapes[i], pl.out):
                    raise KernelTypeError(f"{k}: {names[i]} is {_fmt(shapes[i])}, but outside the reduction it "
                                          f"must broadcast to the result's {_fmt(pl.out)}", arg=i)
        out = []
        for o in spec.outputs:
            dt = env["$" + o.dtype][0] if is_dtype_var(o.dtype) else o.dtype
            if o.dims is not None:
                self._match(o.name, o.dims, pl.out, env, None, f"{o.dtype}[{', '.join(map(str, o.dims))}]",
                            what="the result")
            out.append((pl.out, dt))
        return out

    def _match(self, name, dims, shape, env, arg, pattern, what=None) -> None:
        k = self.spec.name
        who = what or name
        rest = list(dims)
        lead = bool(rest) and rest[0] == "..."
        if lead:
            rest = rest[1:]
        if (len(shape) < len(rest)) if lead else (len(shape) != len(rest)):
            need = f"at least {len(rest)}" if lead else f"{len(rest)}"
            raise KernelTypeError(f"{k}: {who} has shape {_fmt(shape)}, but `{name} : {pattern}` needs {need} "
                                  f"dimension{'s' if len(rest) != 1 else ''}", arg=arg)
        for d, actual in zip(rest, shape[len(shape) - len(rest):]):
            if isinstance(d, int):
                if d != actual:
                    raise KernelTypeError(f"{k}: {who} has shape {_fmt(shape)}, but `{name} : {pattern}` needs "
                                          f"{d}, not {actual}", arg=arg)
                continue
            have = env.setdefault(d, (actual, name))
            if have[0] != actual:
                raise KernelTypeError(f"{k}: {who} has shape {_fmt(shape)}, but `{name} : {pattern}` does not fit: "
                                      f"`{d}` is {have[0]} (bound by {have[1]}), not {actual}", arg=arg)

    # -- CPU
    def _fns(self) -> dict[str, Callable]:
        if self._np is None:
            self._np = _compile_numpy(self.spec)
        return self._np

    def _values(self, attrs) -> list[float]:
        given = attrs or {}
        return [float(given.get(nm, d)) for nm, d in self.spec.attrs]

    def cpu(self, ins, outs, attrs=None) -> None:
        """The NumPy twin (Kernel.cpu's convention): every result computed before the first write,
        in float32 (f16 and integer inputs widened) or float64 when an array is f64."""
        spec = self.spec
        fns = self._fns()
        ins = [np.asarray(x) for x in ins]
        pl = plan(spec, [x.shape for x in ins])
        ct = _acc_dtype(list(ins) + list(outs))
        arrs = [x if x.dtype == ct else x.astype(ct) for x in ins]
        arrs = [_expand_np(x, pl) if pp.expanded else x for x, pp in zip(arrs, spec.params)]
        vals = self._values(attrs)
        red = spec.reduction
        with np.errstate(all="ignore"):
            if red is None:
                res = fns["_out"](*arrs, *vals, 0.0, float(pl.cnt))
            else:
                (m,) = fns["_map"](*arrs, *vals, 0.0, float(pl.cnt))
                m = np.broadcast_to(np.asarray(m, dtype=ct), pl.index)
                if pl.axes:
                    r = {"sum": np.sum, "mean": np.sum, "max": np.max, "min": np.min}[red.kind](m, axis=pl.axes)
                else:
                    r = m
                if red.kind == "mean":
                    r = r / ct.type(pl.cnt)
                r = np.reshape(r, pl.out)
                res = fns["_out"](*arrs, *vals, r, float(pl.cnt))
            res = [np.asarray(v, dtype=ct) for v in res]
        for o, v in zip(outs, res):
            o[...] = v

    # -- CUDA
    def cuda_source(self, in_dtypes, out_dtypes) -> CudaSource:
        return cuda_source(self.spec, in_dtypes, out_dtypes)

    def cuda(self, ctx, stream, ins, outs, attrs=None) -> None:
        """The CUDA twin (cuda_kernels' convention `fn(ctx, stream, ins, outs, attrs)`): one CuPy
        ElementwiseKernel or ReductionKernel launch on `stream` (a reduction whose post expression
        reads arrays adds one in-place elementwise launch); outputs given, so nothing allocates."""
        import cupy as cp

        from streamsched.stdlib.cuda_kernels import _stream

        spec = self.spec
        pl = plan(spec, [tuple(x.shape) for x in ins])
        use = spec
        if spec.reduction is not None and not pl.axes:  # nothing to reduce (an operand not broadcast)
            use = elementwise_twin(spec)
        key = (use is spec, tuple(str(x.dtype) for x in ins), tuple(str(o.dtype) for o in outs))
        if key not in self._cuda:
            src = cuda_source(use, [_NP_TO_KEY[str(x.dtype)] for x in ins], [_NP_TO_KEY[str(o.dtype)] for o in outs])
            if src.kind == "elementwise":
                kern = (src, cp.ElementwiseKernel(src.in_params, src.out_params, src.operation, src.name,
                                                  preamble=src.preamble), None)
            else:
                post = None
                if src.post is not None:
                    post = cp.ElementwiseKernel(src.post[0], src.post[1], src.post[2], src.name + "_post",
                                                preamble=src.preamble)
                kern = (src, cp.ReductionKernel(src.in_params, src.out_params, src.map_expr, src.reduce_expr,
                                                src.post_map_expr, src.identity, src.name,
                                                reduce_type=src.reduce_type, preamble=src.preamble), post)
            self._cuda[key] = kern
        src, kern, post = self._cuda[key]
        arrs = [_expand_cp(cp, x, pl) if pp.expanded else x for x, pp in zip(ins, spec.params)]
        vals = self._values(attrs) + [float(pl.cnt)]
        with _stream(ctx, stream):
            if src.kind == "elementwise":
                kern(*[arrs[i] for i in src.inputs], *vals, *outs)
                return
            out = outs[0].reshape(pl.reduced) if outs[0].shape != tuple(pl.reduced) else outs[0]
            kern(*[arrs[i] for i in src.inputs], *vals, out, axis=pl.axes)
            if post is not None:
                post_ins = post_inputs(spec)
                post(*[arrs[i] for i in post_ins], *vals, outs[0])

    # -- gradients
    def grad(self, g: GradArgs) -> list[KCall | None]:
        """The gradient recipe: for each wanted float input, one generated kernel (`NAME.dX`) that
        computes sum_k dy_k * d f_k / dX, summed down to X's shape where X was broadcast; for a
        reduction, the upstream gradient re-expanded along its axis (and, when the post
        expression's slope depends on the reduced value, `NAME.s` recomputes it)."""
        spec = self.spec
        present = tuple(k for k, d in enumerate(g.douts) if d is not None)
        out: list[KCall | None] = []
        attrs = tuple(sorted((nm, g.attrs.get(nm, d)) for nm, d in spec.attrs))
        for i, pp in enumerate(spec.params):
            if not g.need[i] or not (is_dtype_var(pp.dtype) or pp.dtype in FLOATS):
                out.append(None)
                continue
            gspec, argnames = (self._grad_elementwise(i, present, g) if spec.reduction is None
                               else self._grad_reduction(i, g))
            gk = compiled(gspec)
            if gk.spec.name not in g.kernels:
                g.define(gk.record)
            out.append(KCall(gk.spec.name, tuple(argnames), attrs))
        return out

    def _grad_elementwise(self, i: int, present: tuple[int, ...], g: GradArgs):
        spec = self.spec
        gs = [sp.Symbol(f"g{k}", real=True) for k in present]
        total = sum((gs[n] * sp.diff(spec.exprs[k], a(i)) for n, k in enumerate(present)), sp.Integer(0))
        _check_differentiable(total, spec.name)
        used = [j for j in range(len(spec.params)) if a(j) in total.free_symbols or j == i]
        params = [Param(f"d{spec.outputs[k].name}", spec.outputs[k].dtype) for k in present]
        params += [replace(spec.params[j], dims=None) for j in used]
        subs = {gs[n]: a(n) for n in range(len(present))}
        subs.update({a(j): a(len(present) + n) for n, j in enumerate(used)})
        total = total.xreplace(subs)
        like = len(present) + used.index(i)
        suffix = "" if len(present) == len(spec.outputs) else "@" + "+".join(spec.outputs[k].name for k in present)
        gspec = ExprSpec(f"{spec.name}.d{spec.params[i].name}{suffix}", tuple(params), spec.attrs,
                         (Output(f"d{spec.params[i].name}", spec.params[i].dtype),), (S,),
                         Reduction("sum", f"like:{like}", total, tuple(range(len(params)))),
                         doc=f"gradient of {spec.name} with respect to {spec.params[i].name}", grad_of=spec.name)
        names = [g.douts[k] for k in present] + [g.args[j] for j in used]
        return gspec, names

    def _s_kernel(self) -> ExprKernel:
        spec, red = self.spec, self.spec.reduction
        keep = list(red.inputs)
        subs = {a(j): a(n) for n, j in enumerate(keep)}
        return compiled(ExprSpec(f"{spec.name}.s", tuple(spec.params[j] for j in keep), spec.attrs,
                                 (Output("s", spec.outputs[0].dtype),), (S,),
                                 Reduction(red.kind, red.axis, red.map.xreplace(subs), tuple(range(len(keep)))),
                                 doc=f"the reduced value of {spec.name}, recomputed for its gradient",
                                 grad_of=spec.name))

    def _grad_reduction(self, i: int, g: GradArgs):
        spec, red = self.spec, self.spec.reduction
        post = spec.exprs[0]
        gy = sp.Symbol("g0", real=True)
        post_ins = post_inputs(spec)
        if i not in red.inputs and i not in post_ins:  # read nowhere: a zero gradient of its shape
            zspec = ExprSpec(f"{spec.name}.d{spec.params[i].name}", (replace(spec.params[i], dims=None),), spec.attrs,
                             (Output(f"d{spec.params[i].name}", spec.params[i].dtype),), (sp.Integer(0),),
                             doc=f"gradient of {spec.name} with respect to {spec.params[i].name} (zero)",
                             grad_of=spec.name)
            return zspec, [g.args[i]]
        if i in red.inputs:
            if red.kind in ("max", "min"):
                raise NotDifferentiable(f"the gradient of a {red.kind} reduction is not derived (ties have no "
                                        f"single answer)", red.kind)
            factor = sp.diff(post, S) * (1 / CNT if red.kind == "mean" else 1)
            d_map = sp.diff(red.map, a(i))
            total = gy * factor * d_map
        else:
            total = gy * sp.diff(post, a(i))
        _check_differentiable(total, spec.name)
        needs_s = S in total.free_symbols
        params: list[Param] = [Param(f"d{spec.outputs[0].name}", spec.outputs[0].dtype, expanded=i in red.inputs)]
        names: list[str] = [g.douts[0]]
        subs: dict = {gy: a(0)}
        if needs_s:
            sk = self._s_kernel()
            if sk.spec.name not in g.kernels:
                g.define(sk.record)
            subs[S] = a(len(params))
            params.append(Param("s", spec.outputs[0].dtype, expanded=i in red.inputs))
            names.append(KCall(sk.spec.name, tuple(g.args[j] for j in red.inputs),
                               tuple(sorted((nm, g.attrs.get(nm, d)) for nm, d in spec.attrs))))
        if i in red.inputs:
            for j in post_ins:
                if a(j) in total.free_symbols:
                    subs[a(j)] = a(len(params))
                    params.append(replace(spec.params[j], dims=None, expanded=True))
                    names.append(g.args[j])
            space = list(red.inputs)
        else:
            space = [j for j in post_ins if a(j) in total.free_symbols and j != i] + [i]
        for j in space:
            subs[a(j)] = a(len(params))
            params.append(replace(spec.params[j], dims=None))
            names.append(g.args[j])
        total = total.xreplace(subs)
        like = len(params) - len(space) + space.index(i)
        expand = (("all",) if red.axis is None else ("axis", red.axis)) if i in red.inputs else ()
        gspec = ExprSpec(f"{spec.name}.d{spec.params[i].name}", tuple(params), spec.attrs,
                         (Output(f"d{spec.params[i].name}", spec.params[i].dtype),), (S,),
                         Reduction("sum", f"like:{like}", total, tuple(range(len(params)))), expand=expand,
                         doc=f"gradient of {spec.name} with respect to {spec.params[i].name}", grad_of=spec.name)
        return gspec, names


def _check_differentiable(e, kernel: str) -> None:
    """NotDifferentiable when a derivative SymPy gives is not a function we can run: floor and
    ceil stay unevaluated `Derivative`s, sign becomes DiracDelta."""
    bad = e.atoms(sp.Derivative, sp.Subs, sp.DiracDelta, sp.Heaviside)
    if not bad:
        return
    culprit = ""
    for f in bad:
        inner = [x.func.__name__ for x in f.atoms(sp.Function) if x.func.__name__ in NOT_DIFFERENTIABLE]
        if isinstance(f, (sp.DiracDelta, sp.Heaviside)):
            inner = inner or ["sign"]
        if inner:
            culprit = NOT_DIFFERENTIABLE.get(inner[0], inner[0])
            break
    what = f"`{culprit}`" if culprit else "a function of its body"
    raise NotDifferentiable(f"{what} has no derivative to train with (zero almost everywhere, undefined at "
                            "its jumps)", culprit)


def _broadcast_to(shape, target) -> bool:
    try:
        return tuple(np.broadcast_shapes(tuple(shape), tuple(target))) == tuple(target)
    except ValueError:
        return False


def _expand_np(x, pl: Plan):
    x = np.broadcast_to(x, pl.espace)
    return np.expand_dims(x, pl.eaxis) if pl.eaxis is not None else x


def _expand_cp(cp, x, pl: Plan):
    x = cp.broadcast_to(x, pl.espace)
    return cp.expand_dims(x, pl.eaxis) if pl.eaxis is not None else x


def expr_kernel(record: Kernel) -> ExprKernel | None:
    """The ExprKernel a record was compiled from (None for a stdlib or Python kernel): its
    `spec`, `cuda_source(in_dtypes, out_dtypes)` and `numpy_source(spec)` show what runs."""
    owner = getattr(record.cpu, "__self__", None)
    return owner if isinstance(owner, ExprKernel) else None


@lru_cache(maxsize=1024)
def compiled(spec: ExprSpec) -> ExprKernel:
    """The ExprKernel of `spec`, built once (SymPy's printing is the slow part)."""
    return ExprKernel(spec)
