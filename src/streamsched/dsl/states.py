"""Device state outside the model: the top-level `state { NAME : TYPE = INIT }` buffers (a loss
scale, an overflow flag) and the host values the training loop sets each step (`lr`, `step`),
which live on the device only where a statement uploads them.

Source: LANGUAGE.md ("State", "Uploads").
"""

from __future__ import annotations

from streamsched.dsl import ast as A
from streamsched.dsl.program import SLOT
from streamsched.dsl.scope import INITS, Buffers, Scope, _Abort
from streamsched.dsl.types import DTYPE_RANGE, FLOAT_DTYPES, const, type_shape

KNOWN_HOST_VALUES = ("lr", "step")


def plan_uploads(scope: Scope, buffers: Buffers) -> None:
    """Fill buffers.uploads_planned with the host values the step or a graph uploads (a graph
    may read `lr` only if one does)."""
    buffers.uploads_planned = {st.name.id for s in scope.steps for st in s.body if isinstance(st, A.UploadStmt)}
    buffers.uploads_planned |= {st.name.id for g in scope.graphs_ast.values() for st in g.body
                                if isinstance(st, A.UploadStmt)}


def declare_states(scope: Scope, buffers: Buffers) -> None:
    """`state { NAME : TYPE = INIT }`: device buffers outside every model (the loss
    scale, an overflow flag), initialized once, checkpointed.  A declaration that fails is
    remembered (scope.broken_states), so its uses stay quiet instead of repeating the mistake
    as S007."""
    sink = scope.sink
    fail = sink.fail
    for name, d in scope.state_decls.items():
        try:
            taken = name in buffers.buffers or any(f"{name}[{s}]" in buffers.buffers for s in buffers.slots)
            if taken or name in KNOWN_HOST_VALUES:
                what = "a host value" if name in KNOWN_HOST_VALUES else "already a buffer of the model"
                fail("S002", f"`state {name}`: `{name}` is {what}", d.name.span, help="give the state another name")
            if name.startswith("__"):
                fail("S015", f"`state {name}`: names starting with `__` are reserved", d.name.span)
            shape, dtype = type_shape(sink, d.type, {})
            init = "zeros"
            if isinstance(d.init, A.Var) and d.init.name.id in ("zeros", "ones"):
                init = d.init.name.id
            elif isinstance(d.init, A.Var) and d.init.name.id in INITS:
                fail("S015", f"`state {name}` starts as a number, `zeros` or `ones`; "
                     f"`{d.init.name.id}` initializes weights", d.init.span)
            elif d.init is not None:
                v = const(sink, d.init, {})
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    shown = ("true" if v else "false") if isinstance(v, bool) else \
                        (f'"{v}"' if isinstance(v, str) else str(v))
                    fail("S015", f"`state {name}` starts as a number, `zeros` or `ones`, not {shown}", d.init.span)
                if dtype not in FLOAT_DTYPES and float(v) != int(v):
                    fail("S004", f"`state {name}` is {dtype}, but its initial value {v} is not an integer",
                         d.init.span)
                lo, hi = DTYPE_RANGE.get(dtype, (None, None))
                if hi is not None and not lo <= v <= hi:
                    fail("S004", f"`state {name}` is {dtype}, which cannot hold {v} (range {lo:g} to {hi:g})",
                         d.init.span)
                init = f"const:{v!r}"
            buffers.add(name, shape, dtype, "state", d.span, init=init)
        except _Abort:
            scope.broken_states.add(name)
            continue


def host_value(scope: Scope, name: A.Name) -> None:
    """A host value a statement uploads must be one the training loop sets (S007)."""
    if name.id not in KNOWN_HOST_VALUES:
        scope.sink.fail("S007", f"unknown host value `{name.id}`", name.span,
                        help="the training loop uploads `lr` (the scheduled learning rate) and `step` (the step count, "
                             "from 1)")


def upload_buffers(buffers: Buffers, name: A.Name, per_slot: bool) -> str:
    """Create the buffers an upload of host value `name` writes: its pinned staging buffer
    (`lr@host`, once per slot when the program has slots and per_slot) and the device scalar
    (`lr`); record the upload; return the staging buffer's template name."""
    hb = f"{name.id}@host" + (f"[{SLOT}]" if buffers.slots and per_slot else "")
    for n in buffers.slotted(hb):
        buffers.add(n, (), "f32", "staging", name.span, space="host")
    buffers.add(name.id, (), "f32", "scalar", name.span)
    buffers.uploads.add(name.id)
    return hb
