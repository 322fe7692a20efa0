"""The checked form of a `kernel` (stdlib.kernel_lang's input): the SymPy symbols and
functions a kernel body is built from, the `ExprSpec` records, and the shapes of a launch.  See
stdlib.kernel_lang for the whole picture.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np
import sympy as sp
from sympy.codegen.cfunctions import expm1, log1p

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
