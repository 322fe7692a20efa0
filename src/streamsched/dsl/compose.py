"""Composite ops and `repeat` (issue 15): an op whose body calls ops is a block of model lines,
inlined where a model line calls it, and `out = repeat N OP(x, ...)` chains N instances of an op
or a block, each with parameters of its own.  The result is an ordinary model (every inlined line
a model line), so types, the derived backward, evaluation forms, placement and the checker see
nothing new.

    op block(h, width = 64) -> r {               # an op body of op calls: a block
        n = layernorm(h)
        f = linear(n, width) on comp2             # `on` and `place block.f on S` as for any op
        r = add(h, f)
    }
    model m(...) { ...; y = block(x, width = 32); z = repeat 4 block(y) }

Naming (what checkpoints, plans and diagnostics show): a block statement `s` of the line
`y = block(x)` is the line `y.s`: its value `y.s`, its parameters and state `y.s.w`, except that
the value of the block's output is the calling line's own name `y` (its parameters still
`y.r.w`, its statement's name).  `z = repeat 4 block(y)` makes instances `z.1` .. `z.4` (lines
`z.i.s`), instance i's output `z.i`, the last one's `z`.  Inside a block, a name is an input, an
earlier statement, an attribute (a parameter with a literal default, given at the call by name,
or by position after the inputs), or `s.w`, a parameter of the block's own statement `s` (to tie
a weight); an `after NAME` on a body statement names an earlier statement or an input.

Streams, most specific first: `place y.s on S` (one instance's line), `place block.s on S`, the
statement's own `on`, the calling line's `on`, `place block on S`, the block header's `on`, the
stream of the op the statement calls.
Source: docs/language.md ("Composite ops and repeat").
"""

from __future__ import annotations

import difflib
from dataclasses import replace
from typing import Any

from streamsched.dsl import ast as A
from streamsched.dsl.scope import Scope, _Abort
from streamsched.interp.ir import AfterClause

MAX_DEPTH = 64
"""Blocks inside blocks, at most (a block that calls itself is reported as such at any depth)."""

MAX_INSTANCES = 1024
"""`repeat N` instances, at most: a typo such as `repeat 100000` stops at once."""


def composite_ops(scope: Scope) -> dict[str, A.OpDef]:
    """The ops whose bodies call ops: a statement calls a name that is an op and either no kernel,
    or a kernel whose outputs do not match the statement's targets (`y, m = dropout(x)` is the
    kernel; `y = dropout(x)` in a body of op calls is the op).  A body of kernel calls is an
    ordinary op, even where a kernel shares an op's name; a `kernel` form that failed to compile
    is still a kernel."""
    kernels = set(scope.kernels) | set(getattr(scope, "kernel_defs", {}))
    out = {}
    for name, op in scope.ops.items():
        if name in scope.stdlib_ops or not op.body:
            continue
        if any(_calls_op(scope, st, kernels) for st in op.body):
            out[name] = op
    return out


def _calls_op(scope: Scope, st, kernels: set[str]) -> bool:
    name = _callee(st)
    if name not in scope.ops:
        return False
    if name not in kernels:
        return True
    k = scope.kernels.get(name)
    n_out = len(getattr(k, "outputs", ()) or ())
    return bool(n_out) and len(st.targets) != n_out and len(st.targets) <= len(scope.ops[name].outs)


def _callee(st) -> str:
    e = getattr(st, "expr", None)
    return e.func.id if isinstance(e, A.Call) else ""


def inline_model(scope: Scope, m: A.ModelDef) -> A.ModelDef:
    """`m` with every line that calls a block (or `repeat`s an op) replaced by its lines,
    recursively.  Mistakes are S-diagnostics in scope.sink (the line is then dropped and its
    values poisoned, so their uses stay quiet); returns a new ModelDef."""
    comps = composite_ops(scope)
    if not comps and not any(getattr(st, "repeat", None) is not None for st in m.body):
        return m
    if not hasattr(scope, "poisoned_values"):
        scope.poisoned_values = set()
    defined: dict[str, A.Name] = {}  # the model's names so far: inputs and line targets
    body: list = []
    for st in m.body:
        if not isinstance(st, A.OpUse):
            if isinstance(st, A.InputDecl):
                defined.setdefault(st.name.id, st.name)
            body.append(st)
            continue
        try:
            if st.repeat is not None or st.call.func.id in comps:
                for t in st.targets:
                    if t.id in defined:
                        scope.sink.fail("S002", f"`{t.id}` is defined twice in model `{m.name.id}`", t.span,
                                        help=f"name this line's result otherwise (`{t.id}2 = ...`)")
            for t in st.targets:
                defined.setdefault(t.id, t)
            body.extend(_expand_line(scope, comps, st, m, (), None))
        except _Abort:  # reported: the line's values are poisoned, so their uses stay quiet
            scope.poisoned_values |= {t.id for t in st.targets}
    return replace(m, body=tuple(body))


def _expand_line(scope: Scope, comps: dict[str, A.OpDef], st: A.OpUse, m: A.ModelDef, chain: tuple[str, ...],
                 own: str | None) -> list:
    """The model lines of `st`: itself (with `own`, its name for parameters), a block's lines, or
    a `repeat`'s instances."""
    fail = scope.sink.fail
    rep = getattr(st, "repeat", None)
    name = st.call.func.id
    if rep is not None:
        if name not in scope.ops:
            guess = difflib.get_close_matches(name, list(scope.ops), n=1)
            fail("S006", f"unknown op `{name}`", st.call.func.span,
                 help=f"did you mean `{guess[0]}`?" if guess else "`repeat N OP(x, ...)` chains N instances of an op")
        op = scope.ops[name]
        n = _count(scope, rep, m)
        if len(st.targets) != 1:
            fail("S005", "`repeat` chains one value through its instances: give one target", st.span)
        if len(op.outs) != 1:
            fail("S005", f"`repeat` feeds each instance's output into the next one: `{name}` has "
                 f"{len(op.outs)} outputs, and `repeat` needs an op with one", st.call.func.span)
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
                          st.span, path=st.path or (("", target.id, st.clauses.tail),),
                          own=f"{target.id}.{i}")
            if name in comps:
                out.extend(_inline(scope, comps, one, m, chain, prefix=f"{target.id}.{i}"))
            else:
                out.append(one)
            prev = A.Var(A.Name(ti.id, target.span), target.span)
        return out
    if name in comps:
        if not st.path:
            st = replace(st, path=(("", st.targets[0].id, st.clauses.tail),))
        return _inline(scope, comps, st, m, chain, prefix=own or st.targets[0].id)
    return [st if own is None or st.own else replace(st, own=own)]


def _count(scope: Scope, e: A.Expr, m: A.ModelDef) -> int:
    from streamsched.dsl.types import const

    env: dict[str, Any] = {}
    for kw in m.params:
        env[kw.name.id] = const(scope.sink, kw.value, env)
    v = const(scope.sink, e, env)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        scope.sink.fail("S015", f"`repeat` needs a whole number of instances, at least 1, not {v!r}", e.span)
    if v > MAX_INSTANCES:
        scope.sink.fail("S015", f"`repeat {v}`: at most {MAX_INSTANCES} instances", e.span,
                        help=f"give a count of at most {MAX_INSTANCES}")
    return v


def _stream_of(scope: Scope, op: A.OpDef, st: A.OpUse, bst, prefix: str, local: dict[str, str]) -> A.Name | None:
    """The stream of block statement `bst` in this instance (the module docstring's order)."""
    stmt = bst.targets[0].id
    for key in (f"{prefix}.{stmt}", local[stmt]):
        if key in getattr(scope, "line_places", {}):
            scope.line_places_used.add(key)
            return scope.line_places[key].stream
    placed = scope.places.get(f"{op.name}.{stmt}")
    if placed is not None:
        return placed.stream
    if bst.clauses.on is not None:
        return bst.clauses.on
    if st.clauses.on is not None:
        return st.clauses.on
    if op.name in scope.places:
        return scope.places[op.name].stream
    return op.stream  # None: the called op's own stream


def _inline(scope: Scope, comps: dict[str, A.OpDef], st: A.OpUse, m: A.ModelDef, chain: tuple[str, ...],
            prefix: str) -> list:
    """The lines of one call of block `st.call.func` with its lines named `prefix.NAME` and its
    outputs named by st's targets."""
    fail = scope.sink.fail
    op = comps[st.call.func.id]
    if op.name in chain:
        fail("S015", f"block `{op.name}` calls itself" + (f" (through {', '.join(f'`{c}`' for c in chain[chain.index(op.name) + 1:])})"
                                                         if chain[-1] != op.name else ""), st.call.span,
             help="a block is written out where it is called, so it cannot call itself; use `repeat N` to stack it")
    if len(chain) >= MAX_DEPTH:
        fail("S015", f"blocks nested more than {MAX_DEPTH} deep", st.call.span)
    chain = chain + (op.name,)
    if st.clauses.into is not None:
        fail("S015", f"`into` on a line that calls block `{op.name}`: its lines make values of their own",
             st.clauses.into_span or st.clauses.into.span,
             help=f"remove `into {st.clauses.into.id}`; a line of the block may reuse storage with its own `into`")
    inputs = [p for p in op.params if not (p.default is not None and p.type is None and p.modifier is None)]
    attrs = [p for p in op.params if p.default is not None and p.type is None and p.modifier is None]
    if any(p.modifier is not None for p in op.params):
        bad = next(p for p in op.params if p.modifier is not None)
        fail("S015", f"a block (an op whose body calls ops) has no `{bad.modifier}` inputs: its parameters belong "
             "to the ops it calls", bad.span)
    pos = list(st.call.args)
    slots = [p.name.id for p in inputs] + [a.name.id for a in attrs]
    if len(pos) > len(slots):
        fail("S005", f"op `{op.name}` takes {len(inputs)} input(s) ({', '.join(p.name.id for p in inputs)}) and "
             f"{len(attrs)} attribute(s); {len(pos)} positional argument(s) given", st.call.span)
    given: dict[str, A.Expr] = dict(zip(slots, pos))
    for kw in st.call.kwargs:
        if kw.name.id not in slots:
            guess = difflib.get_close_matches(kw.name.id, slots, n=1)
            fail("S015", f"op `{op.name}` has no parameter `{kw.name.id}`", kw.name.span,
                 help=(f"did you mean `{guess[0]}`? " if guess else "") + f"parameters: {', '.join(slots)}")
        if kw.name.id in given:
            fail("S015", f"`{kw.name.id}` of `{op.name}` is given twice", kw.name.span,
                 help=f"give `{kw.name.id}` once")
        given[kw.name.id] = kw.value
    missing = [p.name.id for p in inputs if p.name.id not in given]
    if missing:
        fail("S005", f"op `{op.name}` needs its input `{missing[0]}` "
             f"({len(inputs)} input(s): {', '.join(p.name.id for p in inputs)})", st.call.span)
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
    group = f"{prefix}@{op.name}"  # one instance: its inputs' and outputs' types share dimensions
    checks = [(subst[p.name.id].name.id, p.type, subst[p.name.id].span, p.span, group)
              for p in inputs if p.type is not None]
    local: dict[str, str] = {}  # body target -> model value name
    reserved = {p.name.id: "an input" for p in inputs} | {a.name.id: "an attribute" for a in attrs}
    lines: list = []
    for bst in op.body:
        call = bst.expr
        if not isinstance(call, A.Call) or call.func.id not in scope.ops:
            if isinstance(call, A.Call):
                guess = difflib.get_close_matches(call.func.id, list(scope.ops), n=1)
                fail("S006", f"unknown op `{call.func.id}` in block `{op.name}`", call.func.span,
                     help=f"did you mean `{guess[0]}`?" if guess else
                     "a block's statements call ops; put kernel calls in an op of their own and call that op")
            fail("S015", f"a block's statements call ops, and this statement of `{op.name}` is an expression",
                 bst.span, help="put the expression in an op of kernel calls and call that op from the block")
        for t in bst.targets:
            if t.id in reserved:
                fail("S002", f"`{t.id}` is {reserved[t.id]} of block `{op.name}`: a statement cannot rebind it",
                     t.span, help=f"name the statement otherwise (`{t.id}2 = ...`)")
        targets = []
        for t in bst.targets:
            new = outs.get(t.id, f"{prefix}.{t.id}")
            local[t.id] = new
            targets.append(A.Name(new, t.span))
        own = f"{prefix}.{bst.targets[0].id}"

        def rename(e: A.Expr) -> A.Expr:
            if isinstance(e, A.Var):
                n = e.name.id
                if "." in n:  # `s.w`: a parameter of the block's own statement s (weight tying)
                    head, rest = n.split(".", 1)
                    if head not in local or head in subst:
                        raise _Abort()  # (names.check_ops reports it where it is written)
                    return A.Var(A.Name(f"{prefix}.{head}.{rest}", e.name.span), e.span)
                if n in local:
                    return A.Var(A.Name(local[n], e.name.span), e.span)
                if n in subst:
                    return subst[n]
                raise _Abort()  # an unknown name: names.check_ops reports it where it is written
            if isinstance(e, A.Call):
                return replace(e, args=tuple(rename(x) for x in e.args),
                               kwargs=tuple(replace(k, value=rename(k.value)) for k in e.kwargs))
            if isinstance(e, A.BinOp):
                return replace(e, left=rename(e.left), right=rename(e.right))
            if isinstance(e, (A.Neg, A.Transpose)):
                return replace(e, operand=rename(e.operand))
            return e

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
        on = _stream_of(scope, op, st, bst, prefix, local)
        into = c.into
        if into is not None:
            into = A.Name(local.get(into.id, subst[into.id].name.id if isinstance(subst.get(into.id), A.Var)
                                    else into.id), into.span)
        clauses = replace(c, on=on, after=after, into=into,
                          after_clauses=tuple(AfterClause(x.span, tuple((local.get(t, t), s) for t, s in x.refs))
                                              for x in c.after_clauses))
        # (scope, name an `after` uses there, insertion point, the block's inputs: value -> input name)
        fed = tuple((a.name.id, n) for n, a in subst.items() if isinstance(a, A.Var) and n in reserved
                    and reserved[n] == "an input")
        path = (st.path or (("", st.targets[0].id, st.clauses.tail),)) + ((prefix, bst.targets[0].id, c.tail, fed),)
        line_checks = tuple((local[o.name.id], o.type, st.span, o.span, group)
                            for o in op.outs if o.type is not None and o.name.id in {t.id for t in bst.targets})
        if not lines:
            line_checks = tuple(checks) + line_checks
        one = A.OpUse(tuple(targets), rename(call), clauses, bst.span, path=path, own=own, checks=line_checks)
        lines.extend(_expand_line(scope, comps, one, m, chain, own))
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


def check_blocks(scope: Scope) -> None:
    """S015 for what a block cannot have: a hand-written `NAME.backward` or `NAME.eval` (a block
    is inlined as the lines of the ops it calls, each differentiated and evaluated by its own op,
    so a backward or eval form written for the block as a whole would never run), and a `place`
    of its backward (it has none); saying so beats ignoring the user's code."""
    comps = composite_ops(scope)
    for name in comps:
        for form in ("backward", "eval"):
            bop = scope.ops.get(f"{name}.{form}")
            if bop is None:
                continue
            try:
                scope.sink.fail(
                    "S015", f"op `{name}` is a block (its body calls ops): its {form} is that of the ops it "
                    f"calls, so `{name}.{form}` would never run", bop.name_span or bop.span,
                    help=f"remove `{name}.{form}`, or write `{name}`'s body with kernels (an op of kernel calls "
                         f"may have a {form} of its own)")
            except _Abort:
                continue
    for target, pl in scope.places.items():
        head, _, rest = target.partition(".")
        if head in comps and (rest == "backward" or rest.startswith("backward.")):
            try:
                scope.sink.fail("S006", f"`place {target}`: block `{head}` has no backward of its own (each of "
                                "its lines has its op's)", pl.target_span,
                                help=f"place one of its ops' backward (`place linear.backward.db on {pl.stream.id}`)")
            except _Abort:
                continue

