"""The backward of an op that has no `NAME.backward`, derived from its body: reverse mode over the
body's kernel launches, each launch's input gradients given by its kernel's gradient recipe
(`Kernel.grad`), synthesized as the AST of a `NAME.backward` op.  The resolver expands it like a
hand-written one, so the checker sees its tasks like any other; a user's `NAME.backward` always
wins.  Source: docs/language.md, "Derived backward".

Placement follows the hand-written rules: the backward runs on the op's representative stream
(`place NAME.backward on S` moves it); the gradient work of a body statement with `on S` runs on
S too; `place NAME.backward.dX on S` moves the statement computing dX.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamsched.diagnostics import Label
from streamsched.dsl import ast as A
from streamsched.dsl.lower import as_call
from streamsched.dsl.scope import Buffers, Scope
from streamsched.dsl.types import const
from streamsched.interp.ir import Span
from streamsched.stdlib.kernel_record import GradArgs, KCall, NotDifferentiable


@dataclass
class _Node:
    """One launch of the forward body: outs = kernel(args, attrs)."""

    kernel: str
    args: list[str]
    attrs: dict
    outs: list[str]
    stmt: A.KernelStmt
    span: Span | None


def derive_op_backward(scope: Scope, buffers: Buffers, model: A.ModelDef, c, want: set[str],
                       flowing: set[str]) -> tuple[A.OpDef, dict[str, str]]:
    """The synthesized `NAME.backward` of the forward call `c` (a model.ForwardCall of `model`)
    and the bindings of the forward values it reads (body statements' results and nested calls'
    temporaries); registers it in scope.derived_ops and the gradient kernels it defines in
    scope.kernels.

    want: c's inputs and parameters whose gradients are needed; flowing: c's outputs a gradient
    reaches.  Fails (scope.sink.fail: S012, S029) when a launch's kernel has no recipe or cannot
    give a wanted gradient."""
    op = c.op
    fail = scope.sink.fail
    d = _Deriver(scope, buffers, model, c)
    # A state input updated in place (dropout's RNG offset) is never differentiated; an input that
    # carries a gradient and is overwritten has two values under one name.
    moving = {p.name.id for p in op.params if p.modifier != "state"}
    for st in op.body:
        for t in st.targets:
            if t.id in moving:
                fail("S012", f"op `{op.name}` has no backward, and none is derived for it: `{t.id}` is written in "
                     f"place", c.span, labels=[Label(st.span, "here")],
                     help=f"define `op {op.name}.backward(...)`")
        d.statement(st)
    return d.backward(want, flowing)


class _Deriver:
    """Reverse mode over one forward call's body: its launches (`statement`), then their
    gradients in reverse (`backward`), as the statements of a synthesized op."""

    def __init__(self, scope: Scope, buffers: Buffers, model: A.ModelDef, c):
        self.scope, self.buffers, self.model, self.c = scope, buffers, model, c
        self.nodes: list[_Node] = []
        self.bufs: dict[str, str] = {}  # forward value name -> buffer
        self.extra: dict[str, str] = {}  # names the backward reads that c.bind does not hold
        self.n = 0
        self.local_names: dict[str, str] = {}  # body-local name -> its name in the backward
        for k, v in c.bind.items():
            self.bufs[k] = v

    def fresh(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}~{self.n}"

    # ---- the forward body as launches
    def statement(self, st: A.KernelStmt) -> None:
        outs = []
        for t in st.targets:
            buf = self.c.bind.get(t.id) or self.c.inner_env.get(t.id)
            if t.id in self.c.bind:
                name = t.id
            else:  # a body-local value: bound under a name no written backward can use
                name = self.fresh(t.id)
                self.extra[name] = buf
            self.bufs[name] = buf
            self.local_names[t.id] = name
            outs.append(name)
        self.launch(st.expr, outs, st)

    def launch(self, e: A.Expr, outs: list[str], st: A.KernelStmt) -> None:
        scope = self.scope
        if isinstance(e, A.Var):
            e = A.Call(A.Name("copy", e.span), (e,), (), e.span)
        call = e if isinstance(e, A.Call) else as_call(scope.sink, e)
        k = scope.kernels[call.func.id]
        attrs: dict = {}
        args = []
        for i, a in enumerate(call.args):
            if isinstance(a, A.Transpose):
                attrs["ta" if i == 0 else "tb"] = True
                a = a.operand
            args.append(self.value(a, st))
        for kw in call.kwargs:
            attrs[kw.name.id] = const(scope.sink, kw.value, self.c.attrs)
        self.nodes.append(_Node(k.name, args, {**k.attrs, **attrs}, outs, st, call.span))

    def value(self, a: A.Expr, st: A.KernelStmt) -> str:
        if isinstance(a, A.Var):
            n = a.name.id
            return self.local_names.get(n, n)
        name = self.fresh("t")
        buf = self.c.inner_nodes[id(a)]
        self.extra[name] = buf
        self.bufs[name] = buf
        self.launch(a, [name], st)
        return name

    def types(self, names) -> dict:
        out = {}
        for n in names:
            if n is not None and n in self.bufs:
                out[n] = self.buffers.btype(self.bufs[n])
        return out

    # ---- reverse mode
    def backward(self, want: set[str], flowing: set[str]) -> tuple[A.OpDef, dict[str, str]]:
        scope, c, op = self.scope, self.c, self.c.op
        dep = {x: True for x in want}
        for nd in self.nodes:
            if any(dep.get(a) for a in nd.args):
                for o in nd.outs:
                    dep[o] = True
        grads: dict[str, list] = {}
        for o in c.outs:
            if o in flowing:
                grads.setdefault(o, []).append("d" + o)
                self.bufs["d" + o] = f"{c.bind[o]}"  # the seed has the output's type
        self.stmts: list[A.KernelStmt] = []
        self.totals: dict[str, str | None] = {}
        for nd in reversed(self.nodes):
            need = tuple(bool(dep.get(a)) for a in nd.args)
            if not any(need):
                continue
            douts = tuple(self.total(o, grads, nd.stmt) for o in nd.outs)
            if all(x is None for x in douts):
                continue
            k = scope.kernels[nd.kernel]
            if k.grad is None:
                scope.sink.fail("S012", f"op `{op.name}` has no backward, and none can be derived: kernel "
                                f"`{nd.kernel}` has no gradient recipe", c.span,
                                labels=[Label(nd.span, f"`{nd.kernel}` here")],
                                help=f"define `op {op.name}.backward(...)` (docs/language.md, \"Ops\")")
            types = self.types(list(nd.args) + list(nd.outs))
            for o, g in zip(nd.outs, douts):
                if g is not None:
                    types[g] = types[o]
            table = scope.kernels
            g = GradArgs(nd.kernel, tuple(nd.args), tuple(nd.outs), douts, need, dict(nd.attrs), types,
                         define=lambda rec: table.setdefault(rec.name, rec), kernels=table)
            try:
                parts = k.grad(g)
            except NotDifferentiable as exc:
                self.not_differentiable(exc, nd)
            for a, part, nd_need in zip(nd.args, parts, need):
                if part is not None and nd_need:
                    grads.setdefault(a, []).append((part, nd.stmt))
        outs = []
        for x in c.inputs + c.params:
            if x not in want:
                continue
            t = self.total(x, grads, None, final="d" + x)
            if t is None:
                continue
            outs.append(A.OutDecl(A.Name("d" + x)))
        produced = {s.targets[0].id for s in self.stmts}
        read = set()
        for s in self.stmts:
            read |= _names(s.expr)
        params = [A.OpParam(None, A.Name(n)) for n in sorted(read - produced)]
        bop = A.OpDef(f"{op.name}.backward", op.name_span, tuple(params), tuple(outs), op.stream,
                      tuple(self.stmts), op.span)
        scope.derived_ops.add(bop.name)
        return bop, dict(self.extra)

    def total(self, v: str, grads: dict, stmt, final: str | None = None) -> str | None:
        """The name of v's whole gradient: its partials materialized as statements and summed
        (`accumulate`); `final` names the last statement (a backward output dX)."""
        if final is None and v in self.totals:
            return self.totals[v]
        parts = grads.get(v, [])
        if not parts:
            self.totals[v] = None
            return None
        only = len(parts) == 1
        names = []
        for part in parts:
            expr, where = part if isinstance(part, tuple) else (part, None)
            if isinstance(expr, str) and not (final and only):
                names.append(expr)  # the gradient is a buffer already (dy passed through)
                continue
            target = final if (final and only) else self.fresh("d")
            self.emit(target, KCall("copy", (expr,)) if isinstance(expr, str) else expr, where)
            names.append(target)
        acc = names[0]
        for k, q in enumerate(names[1:]):
            target = final if (final and k == len(names) - 2) else self.fresh("d")
            self.emit(target, KCall("accumulate", (acc, q)), None)
            acc = target
        self.totals[v] = acc
        return acc

    def emit(self, target: str, expr: KCall, where: A.KernelStmt | None) -> None:
        on = where.clauses.on if where is not None else None
        span = where.span if where is not None else self.c.op.span
        clauses = A.Clauses(on=on)
        self.stmts.append(A.KernelStmt((A.Name(target, span),), _ast(expr, span), clauses, span))

    def not_differentiable(self, exc: NotDifferentiable, nd: _Node) -> None:
        c = self.c
        src = self.scope.kernel_sources.get(nd.kernel)
        at = src.constructs.get(exc.construct) if src is not None and exc.construct else None
        labels = [Label(c.span, f"model `{self.model.name.id}` is trained through it here")]
        if at is None:
            at = nd.span
        else:
            labels.append(Label(nd.span, f"`{nd.kernel}` used here"))
        self.scope.sink.fail("S029", f"no gradient through kernel `{nd.kernel}`: {exc.message}", at, labels=labels,
                             help=f"write `op {c.op.name}.backward(...)` by hand, or train no parameter through "
                                  f"`{c.op.name}`")


def _ast(e, span) -> A.Expr:
    """A recipe's expression as the AST an op body would have."""
    if isinstance(e, str):
        return A.Var(A.Name(e, span), span)
    kws = []
    for k, v in e.attrs:
        if v is None:
            continue
        if isinstance(v, bool):
            val: A.Expr = A.Var(A.Name("true" if v else "false", span), span)
        elif isinstance(v, str):
            val = A.Str(v, span)
        else:
            val = A.Num(v, span)
        kws.append(A.KwArg(A.Name(k, span), val, span))
    return A.Call(A.Name(e.kernel, span), tuple(_ast(a, span) for a in e.args), tuple(kws), span)


def _names(e) -> set[str]:
    if isinstance(e, A.Var):
        return {e.name.id}
    if isinstance(e, A.Call):
        out: set[str] = set()
        for a in e.args:
            out |= _names(a)
        return out
    return set()
