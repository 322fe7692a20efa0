"""Composite ops and `repeat` (issue 15): an op whose body calls ops is a block of model lines,
inlined where a model line calls it, and `out = repeat N block(x, ...)` chains N instances of a
block, each with parameters of its own.  The result is an ordinary model (every inlined line a
model line), so types, the derived backward, evaluation forms, placement and the checker see
nothing new.

    op block(h, width = 64) -> r on comp1 {      # an op body of op calls: a composite op
        n = layernorm(h)
        f = linear(n, width) on comp2             # `on` and `place block.f on S` as for any op
        r = add(h, f)
    }
    model m(...) { ...; y = block(x, width = 32); z = repeat 4 block(y) }

Naming (what checkpoints and diagnostics show): the line `y = block(x)` makes values `y.n`,
`y.f` (parameters `y.f.w`, `y.f.b`) and `y` itself for the block's output; `z = repeat 4
block(y)` makes instances `z.1` .. `z.4`, instance i's values `z.i.n` ..., its output `z.i`, the
last one's output `z`.  Inside a block, a name is an input of the block, an earlier statement of
it, or an attribute (a parameter with a literal default, given at the call by name or position
after the inputs); an `after NAME` on a body statement names an earlier statement of the body.
Source: docs/language.md ("Composite ops and repeat").
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from streamsched.dsl import ast as A
from streamsched.dsl.scope import Scope, _Abort
from streamsched.interp.ir import AfterClause

MAX_DEPTH = 16
"""Blocks inside blocks, at most (a deeper nesting is a block that calls itself)."""


def composite_ops(scope: Scope) -> dict[str, A.OpDef]:
    """The ops whose bodies call ops (at least one statement calls a name that is an op and not
    a kernel; a body of kernel calls is an ordinary op, even where a kernel shares an op's name)."""
    # (a `kernel` form that failed to compile is still a kernel: its op is no block)
    kernels = set(scope.kernels) | set(getattr(scope, "kernel_defs", {}))
    out = {}
    for name, op in scope.ops.items():
        if op.body and any(_callee(st) in scope.ops and _callee(st) not in kernels for st in op.body):
            out[name] = op
    return out


def _callee(st) -> str:
    e = getattr(st, "expr", None)
    return e.func.id if isinstance(e, A.Call) else ""


def inline_model(scope: Scope, m: A.ModelDef) -> A.ModelDef:
    """`m` with every line that calls a composite op (or `repeat`s one) replaced by the block's
    lines, recursively.  Mistakes are S-diagnostics in scope.sink (the line is then dropped and
    its values poisoned by the model expander's usual rules); returns a new ModelDef."""
    comps = composite_ops(scope)
    if not comps and not any(getattr(st, "repeat", None) is not None for st in m.body):
        return m
    if not hasattr(scope, "poisoned_values"):
        scope.poisoned_values = set()
    env: dict[str, Any] = {}
    for kw in m.params:
        env[kw.name.id] = kw.value
    body: list = []
    for st in m.body:
        if not isinstance(st, A.OpUse):
            body.append(st)
            continue
        try:
            body.extend(_expand_line(scope, comps, st, m, 0))
        except _Abort:  # reported: the line's values are poisoned, so their uses stay quiet
            scope.poisoned_values |= {t.id for t in st.targets}
    return replace(m, body=tuple(body))


def _expand_line(scope: Scope, comps: dict[str, A.OpDef], st: A.OpUse, m: A.ModelDef, depth: int) -> list:
    fail = scope.sink.fail
    rep = getattr(st, "repeat", None)
    name = st.call.func.id
    if rep is not None:
        if name not in comps:
            fail("S015", f"`repeat` instantiates a block: `{name}` is not an op whose body calls ops",
                 st.call.func.span, help="write the block as an op whose statements call ops "
                                         "(`op block(h) -> r on comp1 { ... }`), then `repeat N block(...)`")
        n = _count(scope, rep, m)
        if len(st.targets) != 1:
            fail("S005", "`repeat` chains one value through the block: give one target", st.span)
        target = st.targets[0]
        if not st.call.args or not isinstance(st.call.args[0], A.Var):
            fail("S005", f"`repeat {n} {name}(...)` feeds each instance's output into the next one's first input: "
                 "give that input first", st.call.span)
        prev = st.call.args[0]
        out: list = []
        for i in range(1, n + 1):
            ti = A.Name(target.id if i == n else f"{target.id}.{i}", target.span)
            call = replace(st.call, args=(prev,) + tuple(st.call.args[1:]))
            one = A.OpUse((ti,), call, st.clauses if i == 1 else replace(st.clauses, after=(), after_clauses=()),
                          st.span, path=st.path or (("", target.id, st.clauses.tail),))
            out.extend(_inline(scope, comps, one, m, depth, prefix=f"{target.id}.{i}"))
            prev = A.Var(A.Name(ti.id, target.span), target.span)
        return out
    if name in comps:
        if not st.path:
            st = replace(st, path=(("", st.targets[0].id, st.clauses.tail),))
        return _inline(scope, comps, st, m, depth, prefix=st.targets[0].id)
    return [st]


def _count(scope: Scope, e: A.Expr, m: A.ModelDef) -> int:
    from streamsched.dsl.types import const

    env: dict[str, Any] = {}
    for kw in m.params:
        env[kw.name.id] = const(scope.sink, kw.value, env)
    v = const(scope.sink, e, env)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        scope.sink.fail("S015", f"`repeat` needs a whole number of instances, at least 1, not {v!r}", e.span)
    return v


def _inline(scope: Scope, comps: dict[str, A.OpDef], st: A.OpUse, m: A.ModelDef, depth: int,
            prefix: str) -> list:
    """The lines of one call of composite op `st.call.func` with its values named `prefix.NAME`
    and its outputs named by st's targets."""
    fail = scope.sink.fail
    op = comps[st.call.func.id]
    if depth >= MAX_DEPTH:
        fail("S015", f"blocks nested more than {MAX_DEPTH} deep: `{op.name}` calls itself, directly or through "
             "another block", st.call.span)
    inputs = [p for p in op.params if not (p.default is not None and p.type is None and p.modifier is None)]
    attrs = [p for p in op.params if p.default is not None and p.type is None and p.modifier is None]
    if any(p.modifier is not None for p in op.params):
        bad = next(p for p in op.params if p.modifier is not None)
        fail("S015", f"a block (an op whose body calls ops) has no `{bad.modifier}` inputs: its parameters belong "
             "to the ops it calls", bad.span)
    pos = list(st.call.args)
    slots = [p.name.id for p in inputs] + [a.name.id for a in attrs]
    if len(pos) < len(inputs) or len(pos) > len(slots):
        fail("S005", f"op `{op.name}` takes {len(inputs)} input(s) ({', '.join(p.name.id for p in inputs)}); "
             f"{len(pos)} argument(s) given", st.call.span)
    given: dict[str, A.Expr] = dict(zip(slots, pos))
    for kw in st.call.kwargs:
        if kw.name.id not in slots:
            fail("S015", f"op `{op.name}` has no parameter `{kw.name.id}`", kw.name.span,
                 help=f"parameters: {', '.join(slots)}")
        given[kw.name.id] = kw.value
    subst: dict[str, A.Expr] = {}
    for p in inputs:
        a = given.get(p.name.id)
        if not isinstance(a, A.Var):
            fail("S015", f"input `{p.name.id}` of `{op.name}` must name a value of the model", (a or st.call).span)
        subst[p.name.id] = a
    for a in attrs:
        subst[a.name.id] = given.get(a.name.id, a.default)
    if len(st.targets) > len(op.outs):
        fail("S005", f"op `{op.name}` produces {len(op.outs)} value(s); {len(st.targets)} target(s) given", st.span)
    outs = {o.name.id: t.id for o, t in zip(op.outs, st.targets)}
    local: dict[str, str] = {}  # body target -> model value name
    lines: list = []
    for bst in op.body:
        call = bst.expr
        if not isinstance(call, A.Call) or call.func.id not in scope.ops:
            what = call.func.id if isinstance(call, A.Call) else "an expression"
            fail("S015", f"a block's statements call ops, and `{what}` is not one", bst.span,
                 help="put kernel calls in an op of their own and call that op from the block")
        targets = []
        for t in bst.targets:
            new = outs.get(t.id, f"{prefix}.{t.id}")
            local[t.id] = new
            targets.append(A.Name(new, t.span))

        def rename(e: A.Expr) -> A.Expr:
            if isinstance(e, A.Var):
                n = e.name.id
                if n in local:
                    return A.Var(A.Name(local[n], e.name.span), e.span)
                if n in subst:
                    return subst[n]
                return e  # a model parameter or a name the model expander reports
            if isinstance(e, A.Call):
                return replace(e, args=tuple(rename(x) for x in e.args),
                               kwargs=tuple(replace(k, value=rename(k.value)) for k in e.kwargs))
            if isinstance(e, A.BinOp):
                return replace(e, left=rename(e.left), right=rename(e.right))
            if isinstance(e, (A.Neg, A.Transpose)):
                return replace(e, operand=rename(e.operand))
            return e

        for a in call.args:
            if isinstance(a, A.Var) and a.name.id not in local and a.name.id not in subst:
                raise _Abort()  # (names.check_ops reports an unknown name in an op body where it is written)
        c = bst.clauses

        def ref_value(name: str) -> str:
            # an earlier statement of the block, or an input: after the line that made its value
            if name in local:
                return local[name]
            a = subst.get(name)
            return a.name.id if isinstance(a, A.Var) else name

        after = tuple(replace(r, parts=(A.Name(ref_value(r.text), r.span),), index=None) for r in c.after)
        for r in c.after:
            if (r.text not in local and r.text not in {p.name.id for p in inputs}) or \
                    r.text in {t.id for t in bst.targets}:
                fail("S007", f"`after {r.text}`: no earlier statement or input `{r.text}` in op `{op.name}`", r.span,
                     help="`after` in a block names an earlier statement of it, or one of its inputs (then the "
                          "line that made that input's value)")
        after = after + tuple(st.clauses.after)  # the calling line's own order applies to all of it
        on = c.on
        placed = scope.places.get(f"{op.name}.{bst.targets[0].id}")
        if on is None and placed is not None:
            on = placed.stream
        # `place y.k on S` / `place h.2.k on S`: one instance's line, the most specific placement
        for key in (f"{prefix}.{bst.targets[0].id}", local[bst.targets[0].id]):
            if key in getattr(scope, "line_places", {}):
                on = scope.line_places[key].stream
                scope.line_places_used.add(key)
                break
        into = c.into
        if into is not None:
            into = A.Name(local.get(into.id, subst[into.id].name.id if isinstance(subst.get(into.id), A.Var)
                                    else into.id), into.span)
        clauses = replace(c, on=on, after=after, into=into,
                          after_clauses=tuple(AfterClause(x.span, tuple((local.get(t, t), s) for t, s in x.refs))
                                              for x in c.after_clauses))
        path = (st.path or (("", st.targets[0].id, st.clauses.tail),)) + ((prefix, bst.targets[0].id, c.tail),)
        one = A.OpUse(tuple(targets), rename(call), clauses, bst.span, path=path)
        lines.extend(_expand_line(scope, comps, one, m, depth + 1))
    missing = [o for o in outs if o not in local]
    if missing:
        fail("S007", f"op `{op.name}` never assigns its output `{missing[0]}`", st.span)
    return lines


def check_line_places(scope: Scope) -> None:
    """S006 for each `place NAME on S` left for a block instance's line (names.check_places defers
    a target whose first segment is no op) that no inlined line matched."""
    for key, pl in getattr(scope, "line_places", {}).items():
        if key not in scope.line_places_used:
            try:
                scope.sink.fail(
                    "S006", f"`place {key}`: no op `{key}`, and no line of a block instance named `{key}`",
                    pl.target_span,
                    help="place an op (`place relu on comp1`), one statement of it (`place linear.backward.db "
                         "on comp3`), or one line of a block instance (`place h.2.k on comp1`)")
            except _Abort:
                continue


def check_block_backwards(scope: Scope) -> None:
    """S015 for a hand-written `NAME.backward` of a block: a block is inlined as the lines of the
    ops it calls, each differentiated by its own backward, so a backward written for the block
    as a whole would never run; saying so beats ignoring the user's code."""
    for name in composite_ops(scope):
        bop = scope.ops.get(name + ".backward")
        if bop is None:
            continue
        try:
            scope.sink.fail(
                "S015", f"op `{name}` is a block (its body calls ops): its backward is derived from the ops it "
                f"calls, so `{name}.backward` would never run", bop.name_span or bop.span,
                help=f"remove `{name}.backward`, or write `{name}`'s body with kernels (an op of kernel calls "
                     "may have a backward of its own)")
        except _Abort:
            continue
