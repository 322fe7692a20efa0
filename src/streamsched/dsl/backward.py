"""The backward pass of a model, derived in reverse mode from its `Forward`: gradients flow from
the seed d(loss) = 1 through each call's `NAME.backward` op (written by hand, else synthesized by
dsl/derive.py from the body's kernels' gradient recipes) in reverse line order; a value used by
several calls gets one partial per use, summed.

Source: LANGUAGE.md ("Backward"), docs/language.md ("Derived backward").
"""

from __future__ import annotations

from streamsched.diagnostics import Label
from streamsched.dsl.derive import derive_op_backward
from streamsched.dsl.lower import Lowerer, Lowering
from streamsched.dsl.model import Forward
from streamsched.dsl.names import Streams
from streamsched.dsl.program import TaskTemplate
from streamsched.dsl.scope import Buffers, Scope


def grad_name(buf: str) -> str:
    """The buffer holding the gradient of activation `buf`: `d(h1)`.  Parentheses never occur in a
    name a user writes (`value` or `value.output`), so these never collide with the user's."""
    return f"d({buf})"


SEED = grad_name("loss")
"""The backward's seed d(loss) = 1 (a constant buffer), or the loss scale under `backward M * S`."""


def derive_backward(scope: Scope, buffers: Buffers, streams: Streams, lower: Lowerer,
                    forward: Forward) -> list[TaskTemplate]:
    """The templates of the backward of `forward`'s model; creates the seed, the activation
    gradients d(x) and the parameter gradients grad.P.  Fails (_Abort) with S007 (a backward op's
    name that names nothing of its forward op), S019 (a gradient a backward op does not produce),
    S020 (a parameter no gradient reaches) and derive.py's S012/S029."""
    fail = scope.sink.fail
    m, calls, params = forward.model, forward.calls, forward.info.params
    loss = forward.info.loss
    needs: set[str] = set(params)
    for c in calls:
        if any(c.bind[n] in needs for n in c.inputs + c.params):
            needs.update(c.bind[o] for o in c.outs)
    uses: dict[str, int] = {}
    for c in calls:
        for n in c.inputs:
            if c.bind[n] in needs:
                uses[c.bind[n]] = uses.get(c.bind[n], 0) + 1
    # A parameter tied into several lines (weight tying) gets one partial gradient per line,
    # summed into grad.P once the last (in backward order) is made.
    tied_uses: dict[str, int] = {}
    for c in calls:
        for n in c.params:
            tied_uses[c.bind[n]] = tied_uses.get(c.bind[n], 0) + 1
    tied_partials: dict[str, list[str]] = {}
    seed = SEED
    buffers.add(seed, (), buffers.btype(loss)[1], "const", init="ones")
    partials: dict[str, list[str]] = {loss: [seed]}
    bwd: list[TaskTemplate] = []
    op_id = len(calls)
    for c in reversed(calls):
        if not any(c.bind[n] in needs for n in c.inputs + c.params):
            continue
        outs_g = {o: partials.get(c.bind[o], []) for o in c.outs}
        if not any(outs_g.values()):
            continue
        bop = scope.ops.get(c.op.name + ".backward")
        bind: dict[str, str] = {}
        if bop is None:  # derived from the body's kernels' gradient recipes (S012 when one has none)
            want = {x for x in c.inputs + c.params if c.bind[x] in needs}
            bop, bind = derive_op_backward(scope, buffers, m, c, want, {o for o, ps in outs_g.items() if ps})
        for o, ps in outs_g.items():
            gname = grad_name(c.bind[o])
            if not ps:
                continue
            if len(ps) == 1:
                gname = ps[0]
            else:
                stream = streams.placed(bop.name, streams.stream(bop.stream, bop.name in scope.stdlib_ops))
                _sum_partials(lower, bwd, ps, gname, gname, stream, op_id, f"sum@{c.bind[o]}", c.span)
            bind["d" + o] = gname
        produced = {od.name.id[1:] for od in bop.outs if od.name.id.startswith("d")}
        for x in c.inputs + c.params:
            if c.bind[x] in needs and x not in produced:
                fail("S019", f"`{bop.name}` produces no `d{x}`, the gradient of `{x}`, which "
                     f"`{c.bind[x]}` needs to train what feeds it", c.span,
                     labels=[Label(bop.name_span, f"add an output `d{x}` here")] if bop.name_span else [])
        need_outs = set()
        out_bind: dict[str, str] = {}
        for od in bop.outs:
            x = od.name.id[1:] if od.name.id.startswith("d") else None
            if x is None or (x not in c.inputs and x not in c.params):
                fail("S007", f"backward output `{od.name.id}` names no input of `{c.op.name}`", od.span,
                     help="outputs of NAME.backward are named d<input>")
            buf = c.bind[x]
            if buf not in needs:
                continue
            if x in c.params and tied_uses.get(buf, 1) > 1:
                lst = tied_partials.setdefault(buf, [])
                target = f"{grad_name(buf)}#{len(lst) + 1}"
                lst.append(target)
            elif x in c.params:
                target = f"grad.{buf}"
            else:
                lst = partials.setdefault(buf, [])
                target = grad_name(buf) if uses.get(buf, 1) == 1 else f"{grad_name(buf)}#{len(lst) + 1}"
                lst.append(target)
            out_bind[od.name.id] = target
            need_outs.add(od.name.id)
        for p in bop.params:
            n = p.name.id
            if n in bind:
                continue
            if n in c.bind:
                bind[n] = c.bind[n]
            elif n.startswith("d") and n[1:] in c.outs:
                fail("S007", f"`{n}`: no gradient reaches `{n[1:]}` of `{c.op.name}`", p.span)
            else:
                fail("S007", f"backward parameter `{n}` names nothing of `{c.op.name}`", p.span,
                     help=f"it may name {', '.join(['d' + o for o in c.outs] + list(c.bind))}")
        env = {**bind, **out_bind}
        for od_name, target in out_bind.items():
            if target.startswith("grad."):
                shp, dt = buffers.btype(target[5:])
                buffers.add(target, shp, dt, "grad")
        value = c.label.split('@')[-1]
        lower.expand_op(bop, env, c.attrs, bwd, op_id=op_id, prefix=f"{value}.bwd", label=f"{bop.name}@{value}",
                        call_span=c.span, need=need_outs)
        op_id += 1
        for buf, parts in tied_partials.items():
            if len(parts) == tied_uses[buf] and f"grad.{buf}" not in buffers.buffers:
                # every partial made: sum them in backward order on the last one's stream
                shp, dt = buffers.btype(buf)
                buffers.add(f"grad.{buf}", shp, dt, "grad")
                stream = streams.placed(bop.name, streams.stream(bop.stream, bop.name in scope.stdlib_ops))
                _sum_partials(lower, bwd, parts, f"grad.{buf}", grad_name(buf), stream, op_id, f"sum@{buf}", c.span)
    for c in calls:
        for pn in c.params:
            if f"grad.{c.bind[pn]}" not in buffers.buffers:
                fail("S020", f"parameter `{c.bind[pn]}` gets no gradient: `{c.outs and c.bind[c.outs[0]]}` "
                     f"does not reach the loss", c.span,
                     help="use its result on the way to the loss, or remove the line")
    return bwd


def _sum_partials(lower: Lowerer, bwd: list[TaskTemplate], parts: list[str], dst: str, tmp: str, stream: str,
                  op_id: int, label: str, span) -> None:
    """Emit into `bwd` the chain of `accumulate` tasks summing the partial gradients `parts` (at
    least two buffer names, in backward order) into `dst`, the running sums in `tmp.sum0`, ...,
    on `stream`: a value used by several lines, or a parameter tied into several."""
    acc = parts[0]
    for i, p in enumerate(parts[1:]):
        out = dst if i == len(parts) - 2 else f"{tmp}.sum{i}"
        sums = Lowering(stream=stream, rep=stream, op_id=op_id, label=label, out=bwd)
        lower.emit(sums, "accumulate", (acc, p), (out,), (), "", span, kind="grad")
        acc = out
