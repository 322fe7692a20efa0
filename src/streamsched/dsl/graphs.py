"""Graphs: the slots, and each graph body (batch copies, forward and backward of the trained
model, clears, uploads, synchronize, alloc, op calls, the `after` clauses between its
statements) resolved into a `GraphInfo` of task templates; the result of all graphs is one
`Graphs` record.

Source: LANGUAGE.md ("Graphs", "Slots", "Uploads", "Optimizers", "after").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamsched.diagnostics import Label
from streamsched.dsl import ast as A
from streamsched.dsl.backward import SEED
from streamsched.dsl.collectives import ALLREDUCE, collective_call
from streamsched.dsl.kernels import kernel_as_op_help
from streamsched.dsl.lower import Lowerer
from streamsched.dsl.names import Streams
from streamsched.dsl.program import SLOT, GraphInfo, ModelInfo, TaskTemplate
from streamsched.dsl.scope import Buffers, Scope, _Abort
from streamsched.dsl.states import KNOWN_HOST_VALUES, host_value, upload_buffers
from streamsched.dsl.types import FLOAT_DTYPES, classify, const, type_dtype, type_shape, unify
from streamsched.interp.fixes import drop_ref
from streamsched.interp.ir import HOST, Site, Span, evolve

def assign_slots(scope: Scope, buffers: Buffers) -> None:
    """Set buffers.slots from the graphs that declare slots (all must declare the same ones:
    S009; a slot named twice: S002)."""
    for g in scope.graphs_ast.values():
        if g.slots:
            names = tuple(s.id for s in g.slots)
            if len(set(names)) != len(names):
                scope.sink.err("S002", f"graph `{g.name.id}` names a slot twice", g.span)
                if not buffers.slots:  # go on with each name once, so later passes still resolve
                    buffers.slots = tuple(dict.fromkeys(names))
            elif buffers.slots and names != buffers.slots:
                scope.sink.err("S009", f"graph `{g.name.id}` has slots {list(names)}, others have "
                               f"{list(buffers.slots)}", g.span)
            else:
                buffers.slots = names


def copies_inputs(scope: Scope) -> bool:
    """Whether a slotted graph copies the batch: then the model's inputs exist once per slot."""
    return any(isinstance(s, A.CopyStmt) and g.slots for g in scope.graphs_ast.values() for s in g.body)


@dataclass(frozen=True)
class Graphs:
    """Every graph that resolved, by name, and what they run: runs maps `ForwardStmt`,
    `BackwardStmt` and `optimizer` to the first statement of that kind (graph_runs: the same,
    per graph); loss_scale: the device scalar a `backward M * S` seeds the backward with."""

    infos: dict[str, GraphInfo]
    runs: dict[str, Span | None]
    graph_runs: dict[str, dict[str, Span | None]]
    loss_scale: str
    failed: frozenset = frozenset()
    """Graphs declared but left out for their mistakes (reported): the step's uses of them stay
    quiet, and what they would have run is unknown."""


def expand_graphs(scope: Scope, buffers: Buffers, streams: Streams, lower: Lowerer, model: ModelInfo | None,
                  bwd: list[TaskTemplate]) -> Graphs:
    """Resolve every graph of the files, in order (a graph with a mistake is left out, its
    diagnostics recorded); model: the trained model (None when there is none or it failed), bwd:
    its backward's templates."""
    ex = _GraphExpander(scope, buffers, streams, lower, model, bwd)
    infos: dict[str, GraphInfo] = {}
    failed: set[str] = set()
    for i, g in enumerate(scope.graphs_ast.values()):
        try:
            infos[g.name.id] = ex.graph(g, 10000 * (i + 1))
        except _Abort:
            failed.add(g.name.id)
            continue
    return Graphs(infos, ex.runs, ex.graph_runs, ex.loss_scale, frozenset(failed))


class _GraphExpander:
    """Resolves graph bodies against the trained model (its forward, backward, parameters)."""

    def __init__(self, scope: Scope, buffers: Buffers, streams: Streams, lower: Lowerer, model: ModelInfo | None,
                 bwd: list[TaskTemplate]):
        self.scope, self.buffers, self.streams, self.lower = scope, buffers, streams, lower
        self.sink = scope.sink
        self.err, self.fail = scope.sink.err, scope.sink.fail
        self.model_info = model
        self.model_name = model.name if model else ""
        self.fwd = list(model.forward) if model else []
        self.bwd = bwd
        self.runs: dict[str, Span | None] = {}  # ForwardStmt / BackwardStmt / optimizer -> a span
        self.graph_runs: dict[str, dict[str, Span | None]] = {}  # the same, per graph
        self.loss_scale = ""

    def graph(self, g: A.GraphDef, op_base: int) -> GraphInfo:
        """The GraphInfo of one graph; op_base numbers its op calls apart from other graphs'."""
        buffers, lower = self.buffers, self.lower
        home = self.streams.stream(g.stream, stdlib=False)
        out: list[TaskTemplate] = []
        slotted_graph = bool(g.slots)
        op_id = op_base
        spans_of: list[tuple[str, int, int]] = []  # (statement name, first template, end) per statement
        pending_after: list[tuple[int, int, A.CallStmt]] = []
        for gi, st in enumerate(g.body):
            start = len(out)
            try:
                if isinstance(st, A.CopyStmt):
                    if st.source.id != "batch":
                        self.fail("S007", f"unknown data source `{st.source.id}`", st.source.span,
                                  help="`copy batch -> x, y` copies the next batch of the train block's data")
                    for t in st.targets:
                        b = t.id + (f"[{SLOT}]" if slotted_graph else "")
                        if not buffers.has(b):
                            if self.scope.broken_models:
                                raise _Abort()
                            self.fail("S007", f"`{t.id}` is not an input of the model", t.span)
                        hb = f"{t.id}@host" + (f"[{SLOT}]" if slotted_graph else "")
                        shp, dt = buffers.btype(b)
                        for n in buffers.slotted(hb):
                            buffers.add(n, shp, dt, "staging", t.span, space="host")
                        out.append(TaskTemplate("stage", HOST, (), (hb,), (("field", t.id),), (), op_id, HOST,
                                                f"stage.{t.id}", f"{g.name.id}: stage {t.id}", t.span))
                        out.append(TaskTemplate("h2d", home, (hb,), (b,), (), (), op_id, home, t.id,
                                                f"{g.name.id}: copy {t.id}", t.span))
                    op_id += 1
                elif isinstance(st, (A.ForwardStmt, A.BackwardStmt)):
                    self.model_ref(st.model)
                    self.runs[type(st).__name__] = st.span
                    self.graph_runs.setdefault(g.name.id, {}).setdefault(type(st).__name__, st.span)
                    self.run_model(st, out, op_base, g.name.id)
                elif isinstance(st, A.ClearStmt):
                    for buf in self.clear_targets(st.call):
                        op = self.scope.ops["clear"]
                        first = len(out)
                        lower.expand_op(op, {"x": buf}, {}, out, op_id=op_id, prefix=f"clear.{buf}",
                                        label=f"{g.name.id}: clear@{buf}", call_span=st.span)
                        for i in range(first, len(out)):
                            out[i] = evolve(out[i], label=f"{g.name.id}: clear {buf}")
                        op_id += 1
                elif isinstance(st, A.UploadStmt):
                    stream = self.streams.stream(st.stream, False) if st.stream else home
                    self.upload(st.name, stream, out, op_id, g.name.id, per_slot=bool(g.slots))
                    op_id += 1
                elif isinstance(st, A.SyncStmt):
                    out.append(TaskTemplate("synchronize", home, (), (), (), (), op_id, home, "synchronize",
                                            f"{g.name.id}: synchronize", st.span))
                    op_id += 1
                elif isinstance(st, A.AllocStmt):
                    shape, dtype = type_shape(self.sink, st.type, {})
                    buffers.add(st.name.id, shape, dtype, "temp", st.span)
                    out.append(TaskTemplate("alloc", home, (), (st.name.id,), (("shape", shape), ("dtype", dtype)), (),
                                            op_id, home, st.name.id, f"{g.name.id}: alloc {st.name.id}", st.span))
                    op_id += 1
                elif isinstance(st, A.CallStmt):
                    if st.clauses.into is not None:
                        self.fail("S015", f"`into` on a graph statement: `{st.call.func.id}` writes the buffers it is "
                                  "given", st.clauses.into_span or st.clauses.into.span,
                                  help=f"drop `into {st.clauses.into.id}`; `into` belongs to a statement of an op body "
                                       "or a model line")
                    op_id = self.op_call(g, st, out, op_id)
                    if st.clauses.after:
                        pending_after.append((start, len(out), st))
            except _Abort:
                continue
            finally:
                gname = _graph_stmt_name(st)
                gtail = st.clauses.tail if isinstance(st, A.CallStmt) else None
                gafters = st.clauses.after_clauses if isinstance(st, A.CallStmt) else ()
                for i in range(start, len(out)):
                    out[i] = evolve(out[i], site=evolve(out[i].site or Site(), gstmt=gi, gname=gname, gtail=gtail,
                                                          g_afters=gafters))
                spans_of.append((gname, start, len(out)))
        self.order_afters(g, out, spans_of, pending_after)
        slotted = any(SLOT in n for t in out for n in t.args + t.outs)
        return GraphInfo(g.name.id, home, tuple(s.id for s in g.slots), tuple(out), slotted, g.span)

    def run_model(self, st: A.ForwardStmt | A.BackwardStmt, out: list[TaskTemplate], op_base: int,
                  graph: str) -> None:
        """Append the model's forward or backward (`forward M`, `backward M [* S]`) to `out`."""
        src = self.fwd if isinstance(st, A.ForwardStmt) else self.bwd
        if isinstance(st, A.BackwardStmt) and st.scale is not None:
            src = self.scaled_backward(st, self.bwd)
        base = len(out)
        derived = isinstance(st, A.BackwardStmt)
        # The backward is derived, so nobody can write its `after` clauses: its hazards
        # against earlier work of the graph (RAW, and the WAR/WAW an `into` in a backward
        # op makes) are ordered for the user under every policy, by storage.
        root = self.buffers.storage_root
        last_writer: dict[str, int] = {}
        readers: dict[str, list[int]] = {}
        for i, t in enumerate(out):
            self._note_access(t, i, last_writer, readers)
        for t in src:
            after = tuple(a + base for a in t.after)
            if derived:
                need = {last_writer[r] for r in map(root, t.args) if r in last_writer}
                for r in map(root, t.outs):
                    need |= set(readers.get(r, ())) | ({last_writer[r]} if r in last_writer else set())
                after = tuple(sorted(set(after) | need))
            site = evolve(t.site or Site(), derived=derived)
            out.append(evolve(t, op=t.op + op_base + 1000 * (1 + derived), after=after,
                               label=f"{graph}: {t.label}", site=site))
            self._note_access(out[-1], len(out) - 1, last_writer, readers)

    def order_afters(self, g: A.GraphDef, out: list[TaskTemplate], spans_of: list[tuple[str, int, int]],
                     pending_after: list[tuple[int, int, A.CallStmt]]) -> None:
        """`after NAME` on a graph statement: its tasks follow the last task on each stream of the
        latest earlier statement called NAME (a later one closes a cycle: R002 reports it)."""
        for start, end, st in pending_after:
            for r in st.clauses.after:
                pos = next((i for i, (nm, a, b) in enumerate(spans_of) if a == start and b == end), len(spans_of))
                named = [sp for sp in spans_of[:pos] if sp[0] == r.text][-1:]
                later = [i for i in range(pos, len(spans_of)) if spans_of[i][0] == r.text]
                if not named and later:
                    here = f"`{_graph_stmt_name(st)}(...)` ({_at(st.span)})"
                    there = g.body[later[0]]
                    self.err("R002", f"dependency cycle: {here} -[after]-> `{r.text}` ({_at(there.span)}) -[issued "
                             f"first]-> {here}" if later[0] != pos else f"dependency cycle: {here} is ordered after "
                             "itself", r.span,
                             labels=[Label(there.span, "issued here, later in the graph")] if later[0] != pos else [],
                             help=f"`after {r.text}` names a statement the graph issues later; move this statement "
                                  f"below it, or drop the clause", fixes=drop_ref(st.clauses.after_clauses, r.text))
                    continue
                if not named:
                    names = sorted({nm for nm, _, _ in spans_of[:pos]})
                    self.err("S007", f"`after {r.text}`: no statement `{r.text}` in graph `{g.name.id}` before this "
                             "one", r.span, help="`after` in a graph names an earlier statement of the graph: "
                                          + (", ".join(f"`{n}`" for n in names) if names else "there is none"))
                    continue
                _, a, b = named[0]
                sinks: dict[str, int] = {}
                for i in range(a, b):
                    sinks[out[i].stream] = i
                for i in range(start, end):
                    out[i] = evolve(out[i], after=tuple(sorted(set(out[i].after) | set(sinks.values()))))

    def _note_access(self, t: TaskTemplate, i: int, last_writer: dict, readers: dict) -> None:
        for r in map(self.buffers.storage_root, t.args):
            readers.setdefault(r, []).append(i)
        for r in map(self.buffers.storage_root, t.outs):
            last_writer[r] = i
            readers[r] = []

    def model_ref(self, m: A.Name) -> None:
        """A graph names the trained model; stay quiet when that model already failed (its own
        diagnostics say why) instead of repeating the mistake as "unknown model"."""
        model_name = self.model_name
        if m.id == model_name:
            return
        if m.id in self.scope.broken_models:
            raise _Abort()
        if m.id in self.scope.models:
            self.fail("S013", f"model `{m.id}` is not the one this file trains (`{model_name}`)", m.span,
                      help="the `train` block's `model` says which model the graphs run")
        self.fail("S013", f"unknown model `{m.id}`", m.span, help=f"models: {', '.join(self.scope.models) or 'none'}")

    def scaled_backward(self, st: A.BackwardStmt, bwd: list[TaskTemplate]) -> list[TaskTemplate]:
        """`backward M * S`: the backward with its gradient seed d(loss) read from the device
        scalar S (dynamic loss scaling: every gradient comes out multiplied by S) instead of 1."""
        buffers = self.buffers
        sname = st.scale
        if sname.id in self.scope.broken_states:
            raise _Abort()
        b = buffers.buffers.get(sname.id)
        if b is None or b.kind != "state":
            if sname.id in KNOWN_HOST_VALUES or (b is not None and b.kind == "scalar"):
                why, help_ = (f"`{sname.id}` is a host value, not a loss scale",
                              "the loss scale is a `state { }` buffer: `state { loss_scale : f32[] = 65536 }`")
            elif b is not None or any(f"{sname.id}[{s}]" in buffers.buffers for s in buffers.slots):
                why, help_ = (f"`{sname.id}` is a value of the model, not a loss scale",
                              "the loss scale is a `state { }` buffer: `state { loss_scale : f32[] = 65536 }`")
            else:
                why, help_ = (f"no device scalar `{sname.id}`",
                              f"declare it at the top level: `state {{ {sname.id} : f32[] = 65536 }}`")
            self.fail("S007", f"`backward {st.model.id} * {sname.id}`: {why}", sname.span, help=help_)
        have = buffers.btype(sname.id)
        seed = buffers.btype(SEED)
        if have[0] != ():
            self.fail("S003", f"the loss scale `{sname.id}` must be a scalar (shape []), not {list(have[0])}",
                      sname.span)
        if have[1] not in FLOAT_DTYPES:
            self.fail("S004", f"the loss scale `{sname.id}` is {have[1]}; it must be a float dtype (the loss is "
                      f"{seed[1]})", sname.span)
        init = buffers.inits.get(sname.id, "zeros")
        start = float(init[6:]) if init.startswith("const:") else (1.0 if init == "ones" else 0.0)
        if not start > 0:
            decl = self.scope.state_decls.get(sname.id)
            self.fail("S015", f"the loss scale `{sname.id}` starts at {start:g}; it must be positive", sname.span,
                      labels=[Label(decl.span, "declared here")] if decl is not None else [],
                      help="start it at a power of two, as GradScaler does: 65536")
        self.loss_scale = sname.id
        return [evolve(t, args=tuple(sname.id if a == SEED else a for a in t.args)) for t in bwd]

    def clear_targets(self, call: A.Call | A.Name) -> list[str]:
        """The buffers `clear grad(MODEL)` or `clear NAME` (a `state` buffer) zeroes."""
        if isinstance(call, A.Name):
            if call.id in self.scope.broken_states:
                raise _Abort()
            b = self.buffers.buffers.get(call.id)
            help_ = ("`clear grad(MODEL)` zeroes a model's gradients; `clear NAME` one buffer of a `state { }` "
                     "block (an overflow flag, a counter)")
            if b is None:
                self.fail("S007", f"`clear {call.id}`: no `state` buffer `{call.id}`", call.span, help=help_)
            if b.kind != "state" or b.name not in self.scope.state_decls:
                self.fail("S015", f"`clear {call.id}`: `{call.id}` is not a `state` buffer: clearing it would "
                          "overwrite what the step computes or loads", call.span, help=help_)
            return [call.id]
        if call.func.id != "grad" or len(call.args) != 1 or not isinstance(call.args[0], A.Var):
            self.fail("S015", "`clear` takes `grad(MODEL)`", call.span)
        self.model_ref(call.args[0].name)
        return list(self.model_info.grads) if self.model_info else []

    def upload(self, name: A.Name, stream: str, out, op_id, where: str, per_slot: bool = True) -> None:
        """An `upload` statement of a graph body.  per_slot: the graph has slots, so its pinned
        staging buffer exists once per slot; a graph without slots gets one (the host waits for
        the copy that last read it), so the upload does not make the graph need a slot (S017)."""
        host_value(self.scope, name)
        hb = upload_buffers(self.buffers, name, per_slot)
        out.append(TaskTemplate("set_scalar", HOST, (), (hb,), (("name", name.id),), (), op_id, HOST,
                                f"set.{name.id}", f"{where}: set {name.id}", name.span))
        out.append(TaskTemplate("h2d", stream, (hb,), (name.id,), (), (), op_id, stream, f"upload.{name.id}",
                                f"{where}: upload {name.id}", name.span))

    def device_scalar(self, v: A.Var) -> str:
        """The device buffer an op-call argument names: a buffer, or a host value some statement
        uploads (C002 when none does)."""
        buffers = self.buffers
        n = v.name.id
        if n in self.scope.broken_states:
            raise _Abort()
        if n in buffers.buffers and buffers.buffers[n].kind != "scalar":
            return n
        if n in buffers.uploads_planned:
            buffers.add(n, (), "f32", "scalar", v.span)
            return n
        if n in KNOWN_HOST_VALUES:
            where = "to the step" if self.scope.steps else "to a `step` block (the file has none yet)"
            self.fail("C002", f"host value `{n}` is read inside a captured graph, but never uploaded to the device",
                      v.span, help=f"add `upload {n} on trans` {where}: step-varying values live in device buffers")
        self.fail("S007", f"unknown buffer or value `{n}`", v.span)
        return n

    def op_call(self, g: A.GraphDef, st: A.CallStmt, out, op_id: int) -> int:
        """Append an op call of a graph body (an optimizer runs once per parameter of the model,
        in reverse layer order); return the next op id."""
        scope, buffers, sink = self.scope, self.buffers, self.sink
        model_name = self.model_name
        name = st.call.func
        if name.id == ALLREDUCE and name.id not in scope.ops:
            return collective_call(self, g, st, out, op_id)
        if name.id not in scope.ops:
            self.fail("S006", f"unknown op `{name.id}`", name.span,
                      help=kernel_as_op_help(scope, name.id) or "ops: " + ", ".join(sorted(scope.ops)))
        op = scope.ops[name.id]
        ins, prm, grads, states, attrs = classify(op)
        args = list(st.call.args)
        per_param = bool(prm or grads)
        if per_param:
            self.runs.setdefault("optimizer", st.span)
            self.graph_runs.setdefault(g.name.id, {}).setdefault("optimizer", st.span)
            if args and isinstance(args[0], A.Var):
                self.model_ref(args[0].name)
            if not args or not isinstance(args[0], A.Var) or args[0].name.id != model_name:
                self.fail("S015", f"`{op.name}` updates a model's parameters: its first argument is the model",
                          st.call.span)
            args = args[1:]
        # inputs may also be given by name (`sgd_amp(m, lr, scale = loss_scale, found_inf = f)`)
        in_names = [p.name.id for p in ins]
        kwargs = []
        by_name: dict[str, A.Expr] = {}
        for kw in st.call.kwargs:
            if kw.name.id in in_names:
                if kw.name.id in by_name or in_names.index(kw.name.id) < len(args):
                    self.fail("S002", f"input `{kw.name.id}` of `{op.name}` is given twice", kw.name.span)
                by_name[kw.name.id] = kw.value
            else:
                kwargs.append(kw)
        if len(args) > len(ins) or len(args) + len(by_name) != len(ins):
            missing = [n for n in in_names[len(args):] if n not in by_name]
            self.fail("S005", f"op `{op.name}` takes {len(ins) + per_param} argument(s) "
                      f"({'model, ' if per_param else ''}{', '.join(in_names)}); "
                      f"{len(args) + len(by_name) + per_param} given"
                      + (f" (missing: {', '.join(missing)})" if missing and len(args) <= len(ins) else ""),
                      st.call.span)
        args = args + [by_name[n] for n in in_names[len(args):]]
        attr_vals = {a.name.id: const(sink, a.default, {}) for a in attrs}
        layers: list[str] | None = None
        for kw in kwargs:
            if per_param and kw.name.id == "layers":
                # `layers = "c1 c2"`: update only these layers' parameters (the seed's LARS split
                # by layer group over three streams)
                v = const(sink, kw.value, {})
                if not isinstance(v, str) or not v.split():
                    self.fail("S015", "`layers` is a string of layer names: `layers = \"c1 c2\"`", kw.value.span)
                layers = v.split()
                known = {p.rsplit(".", 1)[0] for p in (self.model_info.params if self.model_info else ())}
                for lay in layers:
                    if lay not in known:
                        self.fail("S007", f"`{lay}` is not a layer with parameters", kw.value.span,
                                  help=f"layers: {', '.join(sorted(known))}")
                continue
            if kw.name.id not in attr_vals:
                self.fail("S015", f"op `{op.name}` has no attribute `{kw.name.id}`", kw.name.span,
                          help=f"attributes: {', '.join(attr_vals) or 'none'}")
            attr_vals[kw.name.id] = const(sink, kw.value, {})
        on = self.streams.stream(st.clauses.on, False) if st.clauses.on is not None else None
        base: dict[str, str] = {}
        dims: dict[str, Any] = {}  # dimension and dtype variables, shared by all the arguments
        for p, a in zip(ins, args):
            if not isinstance(a, A.Var):
                self.fail("S015", f"argument `{p.name.id}` of `{op.name}` must name a buffer", a.span)
            buf = self.device_scalar(a)
            if p.type is not None:
                unify(sink, p.type, buffers.btype(buf), dims, f"`{a.name.id}`", a.span, p.span)
            base[p.name.id] = buf
        # Per-parameter updates are issued in reverse layer order: the order in which the backward
        # finishes their gradients, so one stream's queue never waits on the last gradient first.
        params = list(reversed(self.model_info.params)) if (per_param and self.model_info) else [None]
        if layers is not None:
            params = [p for p in params if p.rsplit(".", 1)[0] in layers]
        for pbuf in params:
            bind = dict(base)
            if pbuf is not None:
                shp, dt = buffers.btype(pbuf)
                if prm:
                    bind[prm[0].name.id] = pbuf
                for gp in grads:
                    bind[gp.name.id] = f"grad.{pbuf}"
                for sp in states:
                    sname = f"{op.name}.{sp.name.id}.{pbuf}"
                    init = "zeros"
                    if isinstance(sp.default, A.Var) and sp.default.name.id == "copy":
                        init = f"copy:{pbuf}"  # starts as a copy of the parameter (an EMA, a master copy)
                    # `state master : f32`: the parameter's shape in its own dtype (f32 master
                    # weights of an f16 model)
                    sdt = type_dtype(sink, sp.type, {}) if sp.type is not None and sp.type.dims is None else dt
                    buffers.add(sname, shp, sdt, "state", sp.span, init=init)
                    bind[sp.name.id] = sname
            tag = pbuf or op.name
            self.lower.expand_op(op, bind, attr_vals, out, op_id=op_id, prefix=f"{op.name}.{tag}",
                                 label=f"{g.name.id}: {op.name}@{tag}", call_span=st.span, on=on)
            op_id += 1
        return op_id


def _graph_stmt_name(st) -> str:
    """How `after` in a graph body names a statement of it: an op call by its op (`nonfinite`),
    the others by their keyword (`forward`, `backward`, `clear`, `copy`), an upload as `upload.NAME`."""
    if isinstance(st, A.CallStmt):
        return st.call.func.id
    if isinstance(st, A.UploadStmt):
        return f"upload.{st.name.id}"
    return {A.CopyStmt: "copy", A.ClearStmt: "clear", A.ForwardStmt: "forward", A.BackwardStmt: "backward",
            A.SyncStmt: "synchronize", A.AllocStmt: "alloc"}.get(type(st), "")


def _at(span: Span | None) -> str:
    return f"{span.file}:{span.line}" if span is not None else "?"
