"""`kernel` forms to `Kernel` records for the program being resolved: each definition's names,
arity, dtypes and shapes are checked with diagnostics (S002, S003, S004, S005, S007, S015, S027,
S028, S030), its body is turned into SymPy expressions and `streamsched.stdlib.kernel_lang`
compiles them (NumPy twin, CUDA twin, gradient recipe).  SymPy is imported only when a file has
a `kernel` form.  Source: docs/language.md, "Kernels".
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping

from streamsched.diagnostics import Label
from streamsched.dsl import ast as A
from streamsched.dsl.scope import Scope, _Abort
from streamsched.dsl.types import FLOAT_DTYPES, const, is_dtype_var
from streamsched.interp.ir import DTYPE_BYTES, Span

FUNCTION_NAMES = ("exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "tanh", "sigmoid", "softplus", "erf", "sin",
                  "cos", "abs", "sign", "floor", "ceil", "max", "min", "pow", "where")
REDUCTIONS = ("sum", "mean", "max", "min")
_CMP = {"<": "Lt", "<=": "Le", ">": "Gt", ">=": "Ge", "==": "Eq", "!=": "Ne"}


class _Stop(Exception):
    """Stops compiling one kernel definition after its diagnostic was recorded."""


@dataclass
class KernelSource:
    """Where the constructs of a compiled user kernel are, for diagnostics raised later (a
    gradient that cannot be derived points at the `floor(...)` that prevents it)."""

    definition: A.KernelDef
    constructs: dict[str, Span | None] = field(default_factory=dict)


def compile_kernel_defs(scope: Scope, defs: list[A.KernelDef], builtin: Mapping[str, Any],
                        extra: Mapping[str, str]) -> dict:
    """Kernel records of the user's `kernel` forms, by name (definitions with mistakes are left
    out, their diagnostics recorded in `scope.sink`).  builtin: the stdlib table; extra: kernel
    name -> the `--kernels` module that registered it.  Fills `scope.kernel_sources`."""
    if not defs:
        return {}
    from streamsched.stdlib import kernel_lang as L

    out: dict[str, Any] = {}
    for kd in defs:
        name = kd.name.id
        if name in builtin and name not in extra:
            scope.sink.err("S028", f"kernel `{name}` is already a stdlib kernel", kd.name.span,
                           help=f"give yours another name (`my_{name}`); an op may keep the name `{name}`, kernels "
                                "and ops are named apart")
            continue
        if name in extra:
            scope.sink.err("S028", f"kernel `{name}` is already defined by the kernel module `{extra[name]}`",
                           kd.name.span, help="give one of the two another name")
            continue
        try:
            spec, src = _KernelCompiler(scope, kd, L).run()
        except _Stop:
            continue
        out[name] = L.compiled(spec).record
        scope.kernel_sources[name] = src
    return out


class _KernelCompiler:
    """One `kernel` definition to an ExprSpec."""

    def __init__(self, scope: Scope, kd: A.KernelDef, L):
        self.scope, self.kd, self.L = scope, kd, L
        self.sp = L.sp
        self.name = kd.name.id
        self.src = KernelSource(kd)
        self.values: dict[str, Any] = {}  # name -> SymPy value
        self.kinds: dict[str, str] = {}  # name -> input | attr | local | output
        self.reductions: dict[Any, tuple] = {}  # placeholder symbol -> (kind, axis, map, span)
        self.dims: set[str] = set()
        self.reads_of: dict[str, set[int]] = {}  # name -> the inputs it reads, as written
        self.reading: list[set[int]] = []  # the inputs each open reduction reads, as written

    def fail(self, code: str, msg: str, span: Span | None, help: str = "", labels=()) -> None:
        self.scope.sink.err(code, msg, span, help=help, labels=labels)
        raise _Stop()

    # ---- signature
    def run(self):
        L, kd = self.L, self.kd
        params, attrs = [], []
        seen: dict[str, Span | None] = {}
        for prm in kd.params:
            n = prm.name.id
            if n in seen:
                self.fail("S002", f"`{n}` is a parameter of kernel `{self.name}` twice", prm.name.span,
                          labels=[Label(seen[n], "first here")])
            seen[n] = prm.name.span
            if prm.type is not None:
                dims = self.pattern(prm.type, bind=True)
                dt = self.dtype(prm.type, inputs=True)
                self.values[n] = L.a(len(params))
                self.reads_of[n] = {len(params)}
                self.kinds[n] = "input"
                params.append(L.Param(n, dt, dims))
            else:
                v = self.const_value(prm.default)
                if isinstance(v, bool):
                    v = float(v)
                if not isinstance(v, (int, float)):
                    self.fail("S015", f"attribute `{n}` of kernel `{self.name}` must default to a number",
                              prm.default.span, help=f"write `{n} = 1.0`; a tensor input takes a type: `{n} : T[...]`")
                self.values[n] = L.p(len(attrs))
                self.kinds[n] = "attr"
                attrs.append((n, float(v)))
        if not params:
            self.fail("S005", f"kernel `{self.name}` takes no input tensor", kd.name.span,
                      help="a kernel runs over the shape of its inputs: give it one (`x : T[...]`)")
        self.in_dtypes = {p.dtype for p in params}
        outs = []
        for o in kd.outs:
            n = o.name.id
            if n in seen:
                self.fail("S002", f"`{n}` is both a parameter and an output of kernel `{self.name}`", o.name.span)
            seen[n] = o.name.span
            if o.type is not None:
                dims = self.pattern(o.type, bind=False)
                dt = self.dtype(o.type, inputs=False)
            else:
                dims = None
                float_ins = {p.dtype for p in params if is_dtype_var(p.dtype) or p.dtype in FLOAT_DTYPES}
                if len(float_ins) != 1:
                    self.fail("S004", f"output `{n}` of kernel `{self.name}` needs a type: its inputs have "
                              + ("no float dtype" if not float_ins else f"several dtypes ({', '.join(sorted(float_ins))})"),
                              o.name.span, help=f"write `{n} : T[...]` with the dtype of the inputs it follows")
                dt = next(iter(float_ins))
            outs.append(L.Output(n, dt, dims))
        # ---- body
        assigned: dict[str, Span | None] = {}
        out_names = {o.name for o in outs}
        for st in kd.body:
            t = st.target.id
            if self.kinds.get(t) in ("input", "attr"):
                self.fail("S002", f"`{t}` is a parameter of kernel `{self.name}` and cannot be assigned",
                          st.target.span, help="assign a new name")
            if t in assigned:
                self.fail("S002", f"`{t}` is assigned twice in kernel `{self.name}`", st.target.span,
                          labels=[Label(assigned[t], "first assigned here")])
            self.reading.append(set())
            v = self.value(st.expr, in_reduction=None)
            self.reads_of[t] = self.reading.pop()
            if self.nonfinite(v):
                self.fail("S015", f"`{t}` is not finite for any input (a division by zero, or a log of 0)", st.expr.span)
            assigned[t] = st.target.span
            self.values[t] = v
            self.kinds[t] = "output" if t in out_names else "local"
        for o in kd.outs:
            if o.name.id not in assigned:
                self.fail("S007", f"kernel `{self.name}` never assigns its output `{o.name.id}`", o.name.span,
                          help=f"add a line `{o.name.id} = ...` to its body")
        exprs = [L.number(self.values[o.name]) for o in outs]
        used = [r for r in self.reductions if any(r in e.free_symbols for e in exprs)]
        if len(used) > 1:
            second = self.reductions[used[1]][3]
            self.fail("S030", f"kernel `{self.name}` reduces twice: one kernel is one launch, with at most one "
                      "reduction", second, help="split it into two kernels (a reduction and what uses its result)")
        reduction = None
        if used:
            r = used[0]
            kind, axis, mapped, span, axis_span, written = self.reductions[r]
            if len(outs) > 1:
                self.fail("S030", f"kernel `{self.name}` has a reduction and several outputs: a reduction kernel "
                          "has one output", span, help="give the reduction a kernel of its own")
            exprs = [exprs[0].xreplace({r: L.S})]
            # the inputs the reduced expression reads as written (`x - x` still runs over x's shape)
            map_ins = tuple(i for i in range(len(params)) if L.a(i) in mapped.free_symbols or i in written)
            post_ins = {i for i in range(len(params)) if L.a(i) in exprs[0].free_symbols}
            if not map_ins:
                self.fail("S030", f"`{kind}(...)` in kernel `{self.name}` reduces no input", span,
                          help="the reduced expression must read an input tensor")
            both = sorted(post_ins & set(map_ins))
            if both:
                self.fail("S030", f"`{params[both[0]].name}` is read both inside and outside `{kind}(...)` in kernel "
                          f"`{self.name}`", span, help="an input is either reduced or of the result's shape: pass "
                          "the value twice, as two inputs")
            reduction = L.Reduction(kind, axis, mapped, map_ins)
            self.check_reduction_shapes(params, outs, reduction, axis_span)
        else:
            self.check_elementwise_shapes(params, outs)
        doc = self.formula(params, attrs, outs, exprs, reduction)
        if kd.span is not None:
            doc += f" (the `kernel` form of {kd.span.file}:{kd.span.line})"
        spec = L.ExprSpec(self.name, tuple(params), tuple(attrs), tuple(outs), tuple(exprs), reduction, doc=doc)
        return spec, self.src

    def formula(self, params, attrs, outs, exprs, reduction) -> str:
        """The doc row's formula: each output's expression in the kernel's own names."""
        L, sp = self.L, self.sp
        names = {L.a(i): sp.Symbol(prm.name) for i, prm in enumerate(params)}
        names.update({L.p(j): sp.Symbol(n) for j, (n, _) in enumerate(attrs)})
        if reduction is not None:
            axis = "" if reduction.axis is None else f", axis={reduction.axis}"
            names[L.S] = sp.Symbol(f"{reduction.kind}({reduction.map.xreplace(names)}{axis})")
        return "; ".join(f"{o.name} = {e.xreplace(names)}" for o, e in zip(outs, exprs))

    def const_value(self, e: A.Expr):
        try:
            return const(self.scope.sink, e, {})
        except _Abort:
            raise _Stop() from None

    def dtype(self, t: A.TypeExpr, inputs: bool) -> str:
        d = t.dtype.id
        if is_dtype_var(d):
            if not inputs and d not in self.in_dtypes:
                self.fail("S004", f"the dtype variable `{d}` is not bound by any input of kernel `{self.name}`",
                          t.dtype.span, help="a dtype variable takes the dtype of the inputs it is written on")
            return d
        if d not in DTYPE_BYTES:
            self.fail("S015", f"unknown dtype `{d}`", t.dtype.span,
                      help=f"dtypes: {', '.join(DTYPE_BYTES)}; a single capital letter (`T`) is a dtype variable")
        if not inputs and d not in FLOAT_DTYPES:
            self.fail("S004", f"kernel outputs are float; `{d}` is not", t.dtype.span,
                      help=f"use one of {', '.join(FLOAT_DTYPES)} (a comparison is 1.0 or 0.0)")
        return d

    def pattern(self, t: A.TypeExpr, bind: bool) -> tuple | None:
        if t.dims is None:
            self.fail("S015", f"`{t.dtype.id}` needs a shape: `{t.dtype.id}[...]` for any shape", t.span)
        out: list = []
        for k, d in enumerate(t.dims):
            if isinstance(d, A.Dots):
                if k != 0:
                    self.fail("S015", "`...` stands for the leading dimensions: it comes first (`T[..., n]`)", d.span)
                out.append("...")
            elif isinstance(d, A.Var):
                if not bind and d.name.id not in self.dims:
                    self.fail("S003", f"`{d.name.id}` is not a dimension of any input of kernel `{self.name}`", d.span,
                              help="an output's dimensions are named by its inputs' types")
                self.dims.add(d.name.id)
                out.append(d.name.id)
            elif isinstance(d, A.Num) and isinstance(d.value, int) and d.value > 0:
                out.append(int(d.value))
            else:
                self.fail("S015", "a dimension of a kernel type is a name, a positive integer or `...`", d.span)
        return tuple(out)

    # ---- expressions
    def nonfinite(self, v) -> bool:
        sp = self.sp
        return bool(getattr(v, "has", None)) and v.has(sp.zoo, sp.oo, -sp.oo, sp.nan)

    def num(self, v):
        return self.L.number(v)

    def value(self, e: A.Expr, in_reduction):
        L, sp = self.L, self.sp
        if isinstance(e, A.Num):
            return sp.Integer(e.value) if isinstance(e.value, int) else sp.Rational(e.value)
        if isinstance(e, A.Var):
            n = e.name.id
            if n in self.values:
                for r in self.reading:
                    r |= self.reads_of.get(n, set())
                return self.values[n]
            if n in ("true", "false"):
                return sp.Integer(1 if n == "true" else 0)
            known = [k for k in self.values]
            if n in self.dims:
                self.fail("S007", f"`{n}` is a dimension of kernel `{self.name}`, not a value of its body", e.span,
                          help="sizes are not values in a kernel body; `mean(...)` divides by the count itself")
            guess = difflib.get_close_matches(n, known, n=1)
            self.fail("S007", f"unknown name `{n}` in kernel `{self.name}`", e.span,
                      help=(f"did you mean `{guess[0]}`? " if guess else "") +
                      ("known here: " + ", ".join(f"`{k}`" for k in known) if known else ""))
        if isinstance(e, A.Neg):
            return -self.num(self.value(e.operand, in_reduction))
        if isinstance(e, A.BinOp):
            x = self.num(self.value(e.left, in_reduction))
            y = self.num(self.value(e.right, in_reduction))
            return {"+": lambda: x + y, "-": lambda: x - y, "*": lambda: x * y, "/": lambda: x / y,
                    "**": lambda: x ** y}[e.op]()
        if isinstance(e, A.Compare):
            x = self.num(self.value(e.left, in_reduction))
            y = self.num(self.value(e.right, in_reduction))
            try:
                return getattr(sp, _CMP[e.op])(x, y)
            except TypeError:  # SymPy orders real values only: I, zoo (a complex infinity), ...
                self.fail("S015", f"`{e.op}` compares a value that is not a real number (a root or "
                          "fractional power of a negative number, or a division by zero)", e.span)
        if isinstance(e, A.Call):
            return self.call(e, in_reduction)
        self.fail("S015", "this is not an expression of a kernel body", getattr(e, "span", None))

    def call(self, e: A.Call, in_reduction):
        L, sp = self.L, self.sp
        f = e.func.id
        self.src.constructs.setdefault(f, e.func.span)
        if f in ("sum", "mean") or (f in ("max", "min") and (e.kwargs or len(e.args) == 1)):
            return self.reduction(e, in_reduction)
        if f not in L.FUNCTIONS:
            kernels = getattr(self.scope, "kernels", {})
            guess = difflib.get_close_matches(f, list(FUNCTION_NAMES) + list(REDUCTIONS), n=1)
            if f in kernels or f in getattr(self.scope, "kernel_defs_by_name", {}):
                why = f"`{f}` is a kernel: kernels are launched from op bodies, a kernel body calls functions"
            else:
                why = f"unknown function `{f}` in kernel `{self.name}`"
            self.fail("S027", why, e.func.span,
                      help=(f"did you mean `{guess[0]}`? " if guess else "") + "functions: " +
                      ", ".join(FUNCTION_NAMES) + "; reductions: sum, mean, max, min (`sum(x, axis = 1)`)")
        arity, build = L.FUNCTIONS[f]
        if e.kwargs:
            self.fail("S015", f"`{f}` takes no named arguments", e.kwargs[0].name.span)
        if len(e.args) != arity:
            self.fail("S005", f"`{f}` takes {arity} argument{'s' if arity != 1 else ''}, {len(e.args)} given", e.span)
        args = [self.value(x, in_reduction) for x in e.args]
        if f == "where":
            return build(L.condition(args[0]), self.num(args[1]), self.num(args[2]))
        return build(*[self.num(x) for x in args])

    def reduction(self, e: A.Call, in_reduction):
        sp = self.sp
        f = e.func.id
        if in_reduction is not None:
            self.fail("S030", f"`{f}(...)` inside `{in_reduction}(...)`: one kernel has at most one reduction",
                      e.span, help="reduce in two kernels")
        if len(e.args) != 1:
            self.fail("S005", f"`{f}` takes one expression and `axis = N`, {len(e.args)} positional arguments given",
                      e.span)
        axis = None
        for kw in e.kwargs:
            if kw.name.id != "axis":
                self.fail("S015", f"`{f}` has no attribute `{kw.name.id}`", kw.name.span,
                          help=f"`{f}(EXPR, axis = N)`; without `axis` it reduces every axis")
            v = self.const_value(kw.value)
            if isinstance(v, bool) or not isinstance(v, int):
                self.fail("S015", f"`axis` of `{f}` must be an integer", kw.value.span)
            axis = v
        self.reading.append(set())
        mapped = self.num(self.value(e.args[0], f))
        written = self.reading.pop()
        ph = sp.Symbol(f"_r{len(self.reductions)}", real=True)
        self.reductions[ph] = (f, axis, mapped, e.span, next((kw.value.span for kw in e.kwargs), e.span), written)
        return ph

    # ---- shapes known at the definition
    @staticmethod
    def _rank(dims) -> int | None:
        if dims is None or (dims and dims[0] == "..."):
            return None
        return len(dims)

    def check_elementwise_shapes(self, params, outs) -> None:
        ranks = [self._rank(p.dims) for p in params]
        if any(r is None for r in ranks):
            return
        rank = max(ranks)
        for o, od in zip(outs, self.kd.outs):
            r = self._rank(o.dims)
            if r is not None and r != rank:
                self.fail("S003", f"output `{o.name}` of kernel `{self.name}` is {r}-D, but the kernel runs over the "
                          f"{rank}-D broadcast of its inputs", od.type.span,
                          help="an elementwise kernel's outputs have the broadcast shape of its inputs; "
                               "reduce with `sum(..., axis = N)` for fewer dimensions")

    def check_reduction_shapes(self, params, outs, red, axis_span) -> None:
        ranks = [self._rank(params[i].dims) for i in red.inputs]
        if any(r is None for r in ranks):
            return
        rank = max(ranks)
        if red.axis is not None and not -rank <= red.axis < rank:
            self.fail("S003", f"axis {red.axis} is out of range: `{red.kind}` reduces a {rank}-D value", axis_span,
                      help=f"axes of a {rank}-D value are 0..{rank - 1} (or -{rank}..-1)")
        want = 0 if red.axis is None else rank - 1
        r = self._rank(outs[0].dims)
        if r is not None and r != want:
            od = self.kd.outs[0]
            self.fail("S003", f"output `{outs[0].name}` of kernel `{self.name}` is {r}-D, but `{red.kind}` over "
                      + (f"axis {red.axis}" if red.axis is not None else "every axis") + f" of a {rank}-D value is "
                      f"{want}-D", od.type.span)


def kernel_as_op_help(scope: Scope, name: str) -> str:
    """The help for a model or graph line that calls a kernel of this program (not an op): the
    op that launches it, written out ("" when `name` is no such kernel)."""
    from streamsched.stdlib.kernels import KERNELS

    k = scope.kernels.get(name)
    if k is None or (name in KERNELS and name not in scope.kernel_defs):
        return ""
    compute = [s for s, (role, _) in scope.streams.items() if role == "compute"] or list(scope.streams)
    if not compute:
        return ""
    ins = ", ".join(k.inputs)
    outs = k.outputs[0] if len(k.outputs) == 1 else "(" + ", ".join(k.outputs) + ")"
    params = ", ".join(list(k.inputs) + [f"{a} = {_literal(v)}" for a, v in k.attrs.items()])
    args = ", ".join(list(k.inputs) + [f"{a} = {a}" for a in k.attrs])
    return (f"`{name}` is a kernel, and a model line calls an op: define one that launches it, "
            f"`op {name}({params}) -> {outs} on {compute[0]} {{ {outs} = {name}({args}) }}`")


def _literal(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v == int(v) and abs(v) < 1e15:
        return f"{v:.1f}"
    return repr(v)
