"""The `allreduce` graph statement resolved into one `allreduce_mean` task per bucket: the
gradients (`grad(M)`) or batch-norm running statistics (`stats(M)`) of the trained model,
grouped by the layers the user names (`buckets = "c1 b1 | c2 c3 | logits"`) or by size
(`bucket_kib = 256`), each task reading and writing every buffer of its bucket.

    allreduce(grad(M))                          one bucket: every gradient
    allreduce(grad(M), buckets = "h2 logits | h1")   one bucket per `|`-separated group of layers
    allreduce(grad(M), bucket_kib = 64)         buckets of at least 64 KiB, in backward order
    allreduce(stats(M), buckets = "b1 b2 b3")   the running statistics of those layers

Buckets are formed in the order the backward finishes the gradients (last layer first), so the
planner, which waits only on each bucket's own last writer, starts the first bucket while the
backward still runs (the seed's per-region all-reduce graphs; PyTorch DDP's buckets).

Source: LANGUAGE.md ("Graphs"); docs/language.md ("Data parallel").
"""

from __future__ import annotations

from streamsched.dsl import ast as A
from streamsched.dsl.program import TaskTemplate
from streamsched.dsl.types import FLOAT_DTYPES, const
from streamsched.interp.ir import DTYPE_BYTES

ALLREDUCE = "allreduce"
"""The statement's name (a user op of that name takes precedence, as every user op does)."""

_FORMS = "`allreduce(grad(m))`, `allreduce(grad(m), buckets = \"h1 | logits\")` or `allreduce(stats(m))`"


def collective_call(ex, g: A.GraphDef, st: A.CallStmt, out: list[TaskTemplate], op_id: int) -> int:
    """Append the tasks of `allreduce(...)` (graph `g`, statement `st`) to `out`; return the next
    op id.  ex: the graph expander (dsl/graphs.py `_GraphExpander`): its sink, scope, buffers,
    streams and trained model.  Diagnostics: S005 (arguments), S015 (a bad form or value), S007
    (a layer without gradients or statistics)."""
    call = st.call
    fail = ex.fail
    if len(call.args) != 1:
        fail("S005", f"`allreduce` takes one argument, `grad(MODEL)` or `stats(MODEL)`; {len(call.args)} given",
             call.span, help=f"write {_FORMS}")
    what = call.args[0]
    if not (isinstance(what, A.Call) and what.func.id in ("grad", "stats") and len(what.args) == 1
            and isinstance(what.args[0], A.Var) and not what.kwargs):
        fail("S015", "`allreduce` reduces a model's gradients, `grad(MODEL)`, or its batch-norm statistics, "
             "`stats(MODEL)`", what.span, help=f"write {_FORMS}")
    ex.model_ref(what.args[0].name)
    info = ex.model_info
    if info is None:
        return op_id
    kind = what.func.id
    bufs = _reduced_buffers(ex, info, kind)
    if not bufs:
        fail("S015", f"model `{info.name}` has no {'parameters' if kind == 'grad' else 'running statistics'} "
             "to all-reduce", what.span,
             help="`stats(MODEL)` is the running statistics of `batchnorm` lines; reduce `grad(MODEL)`"
             if kind == "stats" else "")
    layer_of = {b: _layer(b, kind) for b in bufs}
    known = list(dict.fromkeys(layer_of.values()))
    buckets: list[list[str]] | None = None
    cap: int | None = None
    for kw in call.kwargs:
        name = kw.name.id
        if name == "buckets":
            v = const(ex.sink, kw.value, {})
            if not isinstance(v, str) or not v.replace("|", " ").split():
                fail("S015", "`buckets` is a string of layer names, buckets separated by `|`: "
                     "`buckets = \"h2 logits | h1\"`", kw.value.span)
            groups = [grp.split() for grp in v.split("|")]
            if any(not grp for grp in groups):
                fail("S015", "`buckets` has an empty bucket (two `|` in a row, or one at an end)", kw.value.span,
                     help=f"buckets = \"{' | '.join(' '.join(grp) for grp in groups if grp)}\"")
            seen: set[str] = set()
            for grp in groups:
                for lay in grp:
                    if lay not in known:
                        what_ = "gradients" if kind == "grad" else "running statistics"
                        fail("S007", f"`{lay}` is not a layer with {what_}", kw.value.span,
                             help=f"layers: {', '.join(sorted(known))}")
                    if lay in seen:
                        fail("S015", f"layer `{lay}` is in two buckets of one all-reduce", kw.value.span,
                             help="name each layer in one bucket")
                    seen.add(lay)
            buckets = groups
        elif name == "bucket_kib":
            v = const(ex.sink, kw.value, {})
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                fail("S015", "`bucket_kib` is a positive size in KiB: `bucket_kib = 256`", kw.value.span)
            cap = int(v * 1024)
        else:
            fail("S015", f"`allreduce` has no attribute `{name}`", kw.name.span,
                 help="attributes: buckets (layer groups), bucket_kib (a size)")
    if buckets is not None and cap is not None:
        fail("S015", "`allreduce` takes `buckets` (layer groups) or `bucket_kib` (a size), not both", call.span,
             help="drop one of them")
    # the backward's finishing order: the last layer first
    order = [b for b in reversed(bufs)]
    if buckets is not None:
        groups_bufs = [[b for b in order if layer_of[b] in set(grp)] for grp in buckets]
    elif cap is not None:
        groups_bufs, cur, size = [], [], 0
        for b in order:
            cur.append(b)
            shp, dt = ex.buffers.btype(b)
            n = 1
            for d in shp:
                n *= int(d)
            size += n * DTYPE_BYTES[dt]
            if size >= cap:
                groups_bufs.append(cur)
                cur, size = [], 0
        if cur:
            groups_bufs.append(cur)
    else:
        groups_bufs = [order]
    stream = ex.streams.stream(st.clauses.on, False) if st.clauses.on is not None else ex.streams.stream(g.stream,
                                                                                                           stdlib=False)
    for bucket in groups_bufs:
        layers = list(dict.fromkeys(layer_of[b] for b in bucket))
        key = f"{kind}:{','.join(bucket)}"
        out.append(TaskTemplate("allreduce_mean", stream, tuple(bucket), tuple(bucket), (("bucket", key),), (),
                                op_id, stream, f"allreduce.{kind}.{'.'.join(layers)}",
                                f"{g.name.id}: allreduce {kind}({' '.join(layers)})", st.span))
        op_id += 1
    return op_id


def _reduced_buffers(ex, info, kind: str) -> list[str]:
    """The buffers `grad(M)` or `stats(M)` names, in the model's layer order: the gradients of
    its parameters, or the floating-point state its forward writes (running statistics; RNG
    offsets are integers and advance alike on every rank)."""
    if kind == "grad":
        return list(info.grads)
    buffers = ex.buffers.buffers
    seen: dict[str, None] = {}
    for t in info.forward:
        for o in t.outs:
            b = buffers.get(o)
            if b is not None and b.kind == "state" and b.dtype in FLOAT_DTYPES:
                seen.setdefault(o)
    return list(seen)


def _layer(buf: str, kind: str) -> str:
    """The model line a buffer belongs to: `grad.h1.w` -> h1, `b1.running_mean` -> b1."""
    name = buf[len("grad."):] if kind == "grad" and buf.startswith("grad.") else buf
    return name.rsplit(".", 1)[0]
