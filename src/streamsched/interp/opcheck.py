"""Op bodies are checked where they are defined, used or not (LANGUAGE.md, "Barrier
policies"): each user op becomes a one-op schedule whose parameters are distinct buffers (an
`into` makes an alias), planned under the file's policy, so a hazard inside the body (the
seed's in-place dX over X while dW still reads X) is reported at the op's own lines.
"""

from __future__ import annotations

from streamsched.diagnostics import Diagnostic
from streamsched.dsl import ast as A
from streamsched.interp.ir import HOST, Buffer, Schedule, Site, Task, Unit
from streamsched.interp.memory import plan_memory


def _names(e: A.Expr) -> list[str]:
    if isinstance(e, A.Var):
        return [e.name.id]
    if isinstance(e, A.Call):
        return [n for a in e.args for n in _names(a)]
    if isinstance(e, A.BinOp):
        return _names(e.left) + _names(e.right)
    if isinstance(e, (A.Neg, A.Transpose)):
        return _names(e.operand)
    return []


def op_schedule(op: A.OpDef, stream_of, policy: str) -> Schedule | None:
    """The one-op schedule of `op`: one task per kernel statement, each buffer one element wide
    (only identity and aliasing matter here).  stream_of(Name | None) -> declared stream name, or
    None when the name is unknown (the resolver reports that)."""
    rep = stream_of(op.stream)
    if rep is None:
        return None
    buffers: dict[str, Buffer] = {}

    def buf(name: str, alias: str | None = None) -> str:
        if name not in buffers or alias:
            buffers[name] = Buffer(name, (1,), "f32", alias_of=alias)
        return name

    for p in op.params:
        if not (p.default is not None and p.type is None and p.modifier is None):
            buf(p.name.id)
    tasks: list[Task] = []
    # statement names first, so an `after` may name a later statement (a cycle to report)
    index: dict[str, int] = {t.id: i for i, st in enumerate(op.body) for t in st.targets}
    streams: list[str] = [rep]
    for st in op.body:
        stream = stream_of(st.clauses.on) if st.clauses.on is not None else rep
        if stream is None:
            return None
        if stream not in streams:
            streams.append(stream)
        args = tuple(buf(n) for n in _names(st.expr) if n in buffers)
        outs = []
        for t in st.targets:
            alias = None
            if st.clauses.into is not None and st.clauses.into.id in buffers:
                alias = st.clauses.into.id
                while buffers[alias].alias_of:
                    alias = buffers[alias].alias_of
            outs.append(buf(t.id, alias) if t.id not in op.params or alias else t.id)
        after = tuple(index[r.text] for r in st.clauses.after if r.text in index)
        site = Site(op=st.targets[0].id, op_tail=st.clauses.tail, into_span=st.clauses.into_span,
                    op_afters=st.clauses.after_clauses)
        tasks.append(Task(len(tasks), "op", stream, args, tuple(outs), (), after, 0, 0, rep, 0, "", str(len(tasks)),
                          f"{op.name}.{st.targets[0].id}", st.targets[0].id, st.span, site=site))
    if len(streams) < 2:
        return None
    units = (Unit(0, op.name, op.name, rep, "", 0, op.span),)
    return Schedule(tuple(streams) + (HOST,), plan_memory(list(buffers.values())), tuple(tasks), units, 1, 1,
                    "none", policy)


def check_op_bodies(ops: list[A.OpDef], stream_of, policy: str) -> list[Diagnostic]:
    """R-family diagnostics for every op body that forks onto several streams."""
    from streamsched.interp.barriers import insert_barriers
    from streamsched.interp.dependencies import dependencies
    from streamsched.interp.validate import validate_plan, validate_schedule

    out: list[Diagnostic] = []
    for op in ops:
        sched = op_schedule(op, stream_of, policy)
        if sched is None:
            continue
        edges = dependencies(sched)
        diags = list(validate_schedule(sched, edges))
        if not any(d.code == "R002" for d in diags):
            plan = insert_barriers(sched, edges, policy)
            diags.extend(validate_plan(plan, edges))
        out.extend(d for d in diags if d.code.startswith("R"))
    return out
