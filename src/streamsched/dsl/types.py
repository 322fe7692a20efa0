"""Types and shapes: compile-time constants, an op's parameters by kind, a written type checked
against a buffer's (shape, dtype) with its dimension and dtype variables bound on the way
(`unify`), and a written type turned into a concrete (shape, dtype) (`type_shape`).

Each function takes the run's `Sink` and reports a mistake there, raising `_Abort` (S003 shape,
S004 dtype, S007 unknown name, S015 not a constant or an unknown dtype).
Source: LANGUAGE.md ("Types", "Ops").
"""

from __future__ import annotations

from typing import Any

from streamsched.diagnostics import Label
from streamsched.dsl import ast as A
from streamsched.dsl.parse import NUMBER_RANGE, number_in_range
from streamsched.dsl.scope import Sink
from streamsched.interp.ir import DTYPE_BYTES, Span

FLOAT_DTYPES = ("f16", "bf16", "f32", "f64")

# The values an integer or float state can start at (finite; f16's largest is 65504).
DTYPE_RANGE = {"i8": (-2 ** 7, 2 ** 7 - 1), "u8": (0, 2 ** 8 - 1), "i16": (-2 ** 15, 2 ** 15 - 1),
               "i32": (-2 ** 31, 2 ** 31 - 1), "i64": (-2 ** 63, 2 ** 63 - 1),
               "f16": (-65504.0, 65504.0), "bf16": (-3.38e38, 3.38e38), "f32": (-3.4028234e38, 3.4028234e38)}


def is_dtype_var(name: str) -> bool:
    """A dtype variable in an op signature is a single capital letter (`x : T[n, k]`): it binds to
    the dtype of the first typed input it appears in, as dimension variables bind to sizes."""
    return len(name) == 1 and "A" <= name <= "Z"


def const(sink: Sink, e: A.Expr, env: dict[str, Any]) -> Any:
    """The value of a constant expression (numbers, strings, `true`/`false`, names of `env`,
    + - * / and negation); fails S007 (unknown name) or S015 (not a constant)."""
    if isinstance(e, A.Num):
        return e.value
    if isinstance(e, A.Str):
        return e.value
    if isinstance(e, A.Var):
        if e.name.id in env:
            return env[e.name.id]
        if e.name.id in ("true", "false"):
            return e.name.id == "true"
        sink.fail("S007", f"unknown name `{e.name.id}`", e.name.span,
                  help=("known here: " + ", ".join(sorted(env))) if env else "")
    if isinstance(e, A.Neg):
        v = const(sink, e.operand, env)
        if isinstance(v, str):
            sink.fail("S015", "this expression is not a constant", e.span)
        return -v
    if isinstance(e, A.BinOp):
        a, b = const(sink, e.left, env), const(sink, e.right, env)
        try:
            if e.op != "/":
                v = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b}[e.op]()
            # an exact integer quotient stays an integer (a dimension `n / 2`)
            elif isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and a % b == 0:
                v = a // b
            else:
                v = a / b
        except (TypeError, ZeroDivisionError, OverflowError, MemoryError):
            sink.fail("S015", "this expression is not a constant", e.span)
        if isinstance(v, (int, float)) and not number_in_range(v):
            sink.fail("S015", f"the value of this expression is out of range: {NUMBER_RANGE}", e.span)
        return v
    sink.fail("S015", "a constant is expected here", e.span)


def classify(op: A.OpDef):
    """(inputs, params, grads, states, attrs) of an op, each a list of OpParam."""
    ins, params, grads, states, attrs = [], [], [], [], []
    for p in op.params:
        if p.modifier == "param":
            params.append(p)
        elif p.modifier == "grad":
            grads.append(p)
        elif p.modifier == "state":
            states.append(p)
        elif p.default is not None and p.type is None:
            attrs.append(p)
        else:
            ins.append(p)
    return ins, params, grads, states, attrs


def unify(sink: Sink, t: A.TypeExpr, actual: tuple[tuple[int, ...], str], dims: dict[str, int], what: str,
          at: Span | None, decl: Span | None, code_shape="S003") -> None:
    """Check the (shape, dtype) `actual` of `what` against the written type `t`, binding the
    dimension variables (`dims[name]`) and dtype variables (`dims["$T"]`) it meets first; fails
    S004 (dtype) or code_shape (rank, size) at `at`, labelling the declaration `decl`."""
    shape, dtype = actual
    if is_dtype_var(t.dtype.id):
        key = "$" + t.dtype.id
        if key not in dims:
            if dtype not in FLOAT_DTYPES:
                sink.fail("S004", f"{what} has dtype {dtype}, but the dtype variable `{t.dtype.id}` stands "
                          f"for a float dtype ({', '.join(FLOAT_DTYPES)})", at,
                          labels=[Label(decl, "required here")] if decl else [])
            dims[key] = dtype
        elif dims[key] != dtype:
            sink.fail("S004", f"{what} has dtype {dtype}, but `{t.dtype.id}` is {dims[key]} (bound by an "
                      f"earlier argument)", at, labels=[Label(decl, "required here")] if decl else [])
    elif t.dtype.id not in DTYPE_BYTES:
        type_dtype(sink, t, dims)  # S015: unknown dtype
    elif t.dtype.id != dtype:
        sink.fail("S004", f"{what} has dtype {dtype}, but `{t.dtype.id}` is required",
                  at, labels=[Label(decl, "required here")] if decl else [],
                  help="labels are integer class indices (i32)" if t.dtype.id.startswith("i") else "")
    if t.dims is None:
        return
    if len(t.dims) != len(shape):
        sink.fail(code_shape, f"{what} has shape {list(shape)}, but {len(t.dims)} dimensions are required",
                  at, labels=[Label(decl, "declared here")] if decl else [])
    for d, actual_d in zip(t.dims, shape):
        if isinstance(d, A.Var) and d.name.id not in dims:
            dims[d.name.id] = actual_d
            continue
        want = const(sink, d, dims)
        if want != actual_d:
            why = (f"`{d.name.id}` is {want} (bound by an earlier argument)" if isinstance(d, A.Var)
                   else f"it needs {want}")
            sink.fail(code_shape, f"{what} has shape {list(shape)}, but `{type_text(t)}` does not fit: "
                      f"{why}, not {actual_d}", at,
                      labels=[Label(decl, "declared here")] if decl else [])


def type_dtype(sink: Sink, t: A.TypeExpr, dims: dict[str, Any]) -> str:
    """The dtype of `t`: a known dtype, or a dtype variable (`T`) bound in `dims`; fails S004
    (unbound variable, bf16) or S015 (unknown dtype)."""
    if is_dtype_var(t.dtype.id):
        if "$" + t.dtype.id not in dims:
            sink.fail("S004", f"the dtype variable `{t.dtype.id}` is not bound by any input", t.dtype.span,
                      help="a dtype variable takes the dtype of the typed input it first appears in")
        return dims["$" + t.dtype.id]
    if t.dtype.id not in DTYPE_BYTES:
        sink.fail("S015", f"unknown dtype `{t.dtype.id}`", t.dtype.span,
                  help=f"dtypes: {', '.join(DTYPE_BYTES)}; a single capital letter (`T`) is a dtype variable")
    if t.dtype.id == "bf16":
        sink.fail("S004", "bf16 buffers cannot run: neither backend has a bfloat16 array type (NumPy, CuPy)",
                  t.dtype.span, help="use f16 for mixed precision")
    return t.dtype.id


def type_shape(sink: Sink, t: A.TypeExpr, dims: dict[str, Any]) -> tuple[tuple[int, ...], str]:
    """(shape, dtype) of a written type whose dimensions are constants under `dims`; fails S015
    (no shape) or S003 (a dimension that is not a positive integer)."""
    dtype = type_dtype(sink, t, dims)
    if t.dims is None:
        sink.fail("S015", f"`{t.dtype.id}` needs a shape here: `{t.dtype.id}[...]` (`{t.dtype.id}[]` for a scalar)",
                  t.span)
    shape = []
    for d in t.dims:
        v = const(sink, d, dims)
        if not isinstance(v, int) or v <= 0:
            sink.fail("S003", f"dimension must be a positive integer, got {v!r}", d.span)
        shape.append(v)
    return tuple(shape), dtype


def type_text(t: A.TypeExpr) -> str:
    """A written type as text: `T[n, 4]`."""
    def d(e):
        if isinstance(e, A.Var):
            return e.name.id
        if isinstance(e, A.Num):
            return str(e.value)
        return "?"

    if t.dims is None:
        return t.dtype.id
    return f"{t.dtype.id}[{', '.join(d(x) for x in t.dims)}]"
