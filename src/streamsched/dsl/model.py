"""A model's forward: its `input` lines become input buffers and each line's op call is bound
(inputs, free dimensions, attributes, parameters, state), type-checked and expanded into task
templates, also in the form evaluation runs (`NAME.eval` ops); the result is a `Forward`
record (the ModelInfo and the calls the backward derivation reads).

Source: LANGUAGE.md ("Models", "Random sites", "into", "after").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamsched.diagnostics import Label
from streamsched.dsl import ast as A
from streamsched.dsl.kernels import kernel_as_op_help
from streamsched.dsl.load import STDLIB_PATH
from streamsched.dsl.lower import Lowerer
from streamsched.dsl.names import Streams
from streamsched.dsl.program import SLOT, ModelInfo, TaskTemplate
from streamsched.dsl.scope import INITS, Buffers, Scope, _Abort
from streamsched.dsl.types import classify, const, type_shape, unify
from streamsched.interp.ir import Site, Span, evolve


@dataclass
class ForwardCall:
    """One forward op call of a model (kept for the backward derivation)."""

    op: A.OpDef
    bind: dict[str, str]  # op param/out name -> buffer
    attrs: dict[str, Any]
    inputs: tuple[str, ...]  # op names of buffer inputs (not params)
    params: tuple[str, ...]  # op names of parameter inputs
    outs: tuple[str, ...]
    span: Span | None
    label: str
    inner_env: dict[str, str] = field(default_factory=dict)  # body statement targets -> buffers
    inner_nodes: dict[int, str] = field(default_factory=dict)  # id(nested AST call) -> its temporary


@dataclass(frozen=True)
class Forward:
    """A model's expanded forward: what the training loop needs (`info`, its templates in
    info.forward and info.eval_forward) and the calls in line order, for the backward."""

    model: A.ModelDef
    info: ModelInfo
    calls: tuple[ForwardCall, ...]


def expand_model(scope: Scope, buffers: Buffers, streams: Streams, lower: Lowerer, m: A.ModelDef,
                 slot_inputs: bool) -> Forward:
    """The Forward of model `m` (its input, parameter, state and activation buffers created);
    slot_inputs: its inputs exist once per slot (a slotted graph copies the batch).  Raises
    _Abort when any line failed (each mistake recorded) or the model does not end in a scalar
    loss (S018)."""
    return _ModelExpander(scope, buffers, streams, lower, m, slot_inputs).run()


class _ModelExpander:
    """Expands the forward of one model (`run`); its tables are that model's values by name."""

    def __init__(self, scope: Scope, buffers: Buffers, streams: Streams, lower: Lowerer, m: A.ModelDef,
                 slot_inputs: bool):
        self.scope, self.buffers, self.streams, self.lower = scope, buffers, streams, lower
        self.sink = scope.sink
        self.fail = scope.sink.fail
        self.m, self.slot_inputs = m, slot_inputs
        self.env: dict[str, Any] = {}  # the model's parameters (`model mlp(hidden = 32)`), constants
        self.values: dict[str, str] = {}  # model value name -> buffer name
        # values a failed line would have made (here, or while its block was inlined): their uses stay quiet
        self.poisoned: set[str] = set(getattr(scope, "poisoned_values", ()))
        self.params: list[str] = []  # parameter buffers, in line order
        self.block_dims: dict[str, dict[str, Any]] = {}  # a block instance's dimension variables
        self.evals: list[TaskTemplate] = []  # the forward as evaluation runs it (NAME.eval ops)

    def run(self) -> Forward:
        m, env, values = self.m, self.env, self.values
        for kw in m.params:
            env[kw.name.id] = const(self.sink, kw.value, env)
        producers: dict[str, list[int]] = {}  # model value name -> templates of the call making it
        had_error = False
        inputs = []
        fwd: list[TaskTemplate] = []
        calls: list[ForwardCall] = []
        for st in m.body:
            try:
                if isinstance(st, A.InputDecl):
                    shape, dtype = type_shape(self.sink, st.type, env)
                    bname = f"{st.name.id}[{SLOT}]" if self.slot_inputs else st.name.id
                    if st.name.id in values:
                        self.fail("S002", f"`{st.name.id}` is defined twice in model `{m.name.id}`", st.name.span)
                    for n in self.buffers.slotted(bname):
                        self.buffers.add(n, shape, dtype, "input", st.span)
                    values[st.name.id] = bname
                    inputs.append((st.name.id, shape, dtype))
                    continue
                first = len(fwd)
                calls.append(self.call(st, fwd, len(calls)))
                self.block_types(st)
                # `after` on model lines names model values: tasks answer to their value's name
                opname = st.call.func.id
                placed = st.clauses.on is not None or opname in self.scope.places or \
                    any(k.startswith(opname + ".") and not (k + ".").startswith(opname + ".backward.")
                        for k in self.scope.places)  # a `place` of the op's backward leaves its forward
                for i in range(first, len(fwd)):
                    path = st.path or (("", st.targets[0].id, st.clauses.tail),)
                    site = evolve(fwd[i].site or Site(), line=st.targets[0].id, line_tail=st.clauses.tail,
                                   line_path=path, placed=placed or (fwd[i].site or Site()).placed)
                    fwd[i] = evolve(fwd[i], stmt=st.targets[0].id, site=site)
                self.eval_form(calls[-1], fwd[first:])
                deps: list[int] = []
                for r in st.clauses.after:
                    if r.text in {t.id for t in st.targets}:
                        self.fail("S007", f"`after {r.text}`: this statement computes `{r.text}` itself", r.span,
                                  help="`after` names an earlier line of the model")
                    if r.text not in values:
                        later = any(isinstance(o, A.OpUse) and r.text in {t.id for t in o.targets} for o in m.body)
                        self.fail("S007", f"`after {r.text}`: " + (f"`{r.text}` is computed by a later line"
                                  if later else f"no value `{r.text}` in model `{m.name.id}`"), r.span,
                                  help="`after` names an earlier line of the model")
                    deps.extend(producers.get(r.text, []))
                for i in range(first, len(fwd)):
                    fwd[i] = evolve(fwd[i], after=tuple(sorted(set(fwd[i].after) | set(deps))))
                for t in st.targets:
                    producers[t.id] = list(range(first, len(fwd)))
            except _Abort:
                had_error = True
                # Values this statement would have made are poisoned: later uses stay quiet
                # instead of repeating the one mistake as "unknown value".
                if isinstance(st, A.OpUse):
                    for t in st.targets:
                        values.pop(t.id, None)
                        self.poisoned.add(t.id)
                elif isinstance(st, A.InputDecl):
                    self.poisoned.add(st.name.id)
                continue
        if not calls or had_error:
            raise _Abort()
        last = calls[-1]
        loss = last.bind[last.outs[0]]
        shp, dt = self.buffers.btype(loss)
        if shp != () or dt not in ("f32", "f64", "f16", "bf16"):
            # the model's own name for the value (its statement's target), not the op's output name
            shown = next((k for k, v in values.items() if v == loss), last.outs[0])
            self.fail("S018", f"model `{m.name.id}` must end in a scalar loss; `{shown}` is {dt}{list(shp)}",
                      last.span, help="end the model with a loss op such as softmax_cross_entropy")
        logits = last.bind.get(last.inputs[0], "") if last.inputs else ""
        labels = last.bind.get(last.inputs[1], "") if len(last.inputs) > 1 else ""
        label_input = next((k for k, v in values.items() if v == labels), "")
        batch = int(env.get("batch", inputs[0][1][0] if inputs and inputs[0][1] else 1))
        params = self.params
        info = ModelInfo(m.name.id, tuple(inputs), tuple(params), tuple(f"grad.{p}" for p in params), loss,
                         logits, label_input, batch, tuple(fwd), tuple(self.evals))
        return Forward(m, info, tuple(calls))

    def call(self, st: A.OpUse, fwd: list[TaskTemplate], op_id: int) -> ForwardCall:
        """Bind, check and expand (into `fwd`) the op call of one model line: its inputs, free
        dimensions and attributes, then its parameters and state, its results, its body."""
        name = st.call.func
        if name.id not in self.scope.ops:
            self.fail("S006", f"unknown op `{name.id}`", name.span,
                      help=kernel_as_op_help(self.scope, name.id)
                      or "ops come from stdlib/ops.sched or an `op` block of this file")
        op = self.scope.ops[name.id]
        ins, prm, grads, states, attrs = classify(op)
        if grads:
            self.fail("S015", f"`{op.name}` is an optimizer op; call it in a graph body on a model", name.span)
        free = _free_dims(op, ins, prm + states)
        given = self.arguments(st, op, ins, free, attrs, prm + states)
        bind: dict[str, str] = {}  # op param/out name -> buffer
        dims: dict[str, Any] = {}  # dimension and dtype variables
        self.bind_inputs(st, op, ins, given, bind, dims)
        self.tie(st, op, prm + states, given, bind, dims)
        for d in free:
            if d in dims and d not in given:
                continue  # bound by a tied parameter's type
            if d in given:
                v = const(self.sink, given[d], self.env)
                if not isinstance(v, int) or v <= 0:
                    self.fail("S003", f"dimension `{d}` must be a positive integer, got {v!r}", given[d].span)
                if d in dims and dims[d] != v:
                    tied = next((given[p.name.id] for p in prm if p.name.id in given), None)
                    self.fail("S003", f"`{d} = {v}`, but the tied parameter "
                              f"`{getattr(getattr(tied, 'name', None), 'id', '?')}` makes `{d}` {dims[d]}",
                              given[d].span, help=f"leave out `{d} = {v}`: the tied parameter decides it")
                dims[d] = v
            else:
                self.fail("S005", f"op `{op.name}` needs the dimension `{d}`", st.call.span)
        attr_vals = {a.name.id: const(self.sink, a.default, {}) for a in attrs}
        for a in attrs:
            if a.name.id in given:
                attr_vals[a.name.id] = const(self.sink, given[a.name.id], self.env)
        target0 = st.targets[0].id
        if "seed" in attr_vals and "seed" not in given:
            # An RNG key the line does not give is derived from the site, so that two same-shaped
            # dropout sites draw different masks (docs/language.md, "Random sites").
            from streamsched.stdlib.kernels.dropout import site_seed

            attr_vals["seed"] = site_seed(self.m.name.id, target0)
        self.weights(op, prm + states, st.own or target0, dims, bind)
        into = self.results(st, op, ins, dims, bind)
        attr_vals = {**dims, **attr_vals}  # dimension variables are constants in the body too
        label = f"{op.name}@{target0}"
        on = self.streams.stream(st.clauses.on, False) if st.clauses.on is not None else None
        first = len(fwd)
        cx = self.lower.expand_op(op, bind, attr_vals, fwd, op_id=op_id, prefix=target0, label=label,
                                  call_span=st.span, on=on)
        inner_env = {k: v for k, v in cx.env.items() if k not in bind}
        if into is not None:
            results = {bind[o.name.id] for o in op.outs[:len(st.targets)]}
            self.buffers.alias_into([bind[o.name.id] for o in op.outs[:len(st.targets)]], into, st.span)
            # The call's last task writing a result carries the clause (a fix drops it there).
            for i in reversed(range(first, len(fwd))):
                if set(fwd[i].outs) & results:
                    site = fwd[i].site or Site()
                    fwd[i] = evolve(fwd[i], site=evolve(site, into_span=st.clauses.into_span))
                    break
        return ForwardCall(op, bind, attr_vals, tuple(p.name.id for p in ins), tuple(p.name.id for p in prm),
                           tuple(o.name.id for o in op.outs), st.span, label, inner_env, dict(cx.nested))

    def block_types(self, st: A.OpUse) -> None:
        """The types a block declares for its inputs and outputs (`op blk(h : f32[n, 32]) -> out :
        f32[n, 16]`), checked against the values of this instance (its dimensions shared by the
        instance's inputs and outputs); S003/S004 at the calling line's argument or line."""
        for value, t, at, decl, group in st.checks:
            buf = self.values.get(value)
            if buf is None:
                continue
            unify(self.sink, t, self.buffers.btype(buf), self.block_dims.setdefault(group, {}), f"`{value}`",
                  at, decl)

    def arguments(self, st: A.OpUse, op: A.OpDef, ins, free: list[str], attrs, weights=()) -> dict[str, A.Expr]:
        """The line's arguments by parameter name: positional ones fill the inputs, then the free
        dimensions, then the attributes; named ones any of them, or a `param` tied to another
        line's parameter (`table = tok.table`) (S005, S015)."""
        slots_ = [p.name.id for p in ins] + free + [a.name.id for a in attrs]
        named = slots_ + [p.name.id for p in weights]
        pos = list(st.call.args)
        if len(pos) > len(slots_) or len(pos) < len(ins):
            need = f"{len(ins)} input(s) ({', '.join(p.name.id for p in ins)})"
            if free:
                need += f" and the dimension(s) {', '.join(free)}"
            user_op = op.name_span and op.name_span.file != STDLIB_PATH
            self.fail("S005", f"op `{op.name}` takes {need}; {len(pos)} argument(s) given", st.call.span,
                      labels=[Label(op.name_span, "defined here")] if user_op else [])
        given: dict[str, A.Expr] = dict(zip(slots_, pos))
        for kw in st.call.kwargs:
            if kw.name.id not in named:
                self.fail("S015", f"op `{op.name}` has no parameter `{kw.name.id}`", kw.name.span,
                          help=f"parameters: {', '.join(named)}")
            if kw.name.id in given:
                self.fail("S015", f"`{kw.name.id}` of `{op.name}` is given twice", kw.name.span,
                          help=f"give `{kw.name.id}` once")
            given[kw.name.id] = kw.value
        return given

    def tie(self, st: A.OpUse, op: A.OpDef, weights, given: dict[str, A.Expr], bind: dict[str, str],
            dims: dict[str, Any]) -> None:
        """Weight tying: `logits = unembed(nf, table = tok.table)` binds the line's `param table`
        to the parameter `tok.table` an earlier line made, unifying its written type with that
        buffer's (binding its dimensions).  Both lines then read and train one buffer; the
        backward sums their gradients (dsl/backward.py).  S015 for a state or a name that is no
        earlier line's parameter; S003 for a type that does not match.  Source: Press & Wolf,
        "Using the Output Embedding to Improve Language Models" (2017)."""
        for p in weights:
            a = given.get(p.name.id)
            if a is None:
                continue
            if p.modifier != "param":
                self.fail("S015", f"`{p.name.id}` of op `{op.name}` is state: only a `param` can be tied to "
                          "another line's parameter", a.span)
            if not isinstance(a, A.Var) or a.name.id not in self.params:
                have = ", ".join(self.params) if self.params else "none yet"
                self.fail("S015", f"`{p.name.id} = ...` ties a parameter: it must name a parameter of an earlier "
                          f"line (`LINE.NAME`), not `{getattr(getattr(a, 'name', None), 'id', 'an expression')}`",
                          a.span, help=f"parameters so far: {have}")
            if p.type is not None:
                unify(self.sink, p.type, self.buffers.btype(a.name.id), dims, f"`{a.name.id}`", a.span, p.span)
            bind[p.name.id] = a.name.id

    def bind_inputs(self, st: A.OpUse, op: A.OpDef, ins, given: dict[str, A.Expr], bind: dict[str, str],
                    dims: dict[str, Any]) -> None:
        """Bind each input to the model value it names, unifying its type with the value's
        (binding dims); a value a failed line would have made aborts quietly."""
        m, values = self.m, self.values
        for p in ins:
            a = given.get(p.name.id)
            if a is None:
                self.fail("S005", f"op `{op.name}` needs its input `{p.name.id}`", st.call.span)
            if not isinstance(a, A.Var):
                self.fail("S015", f"input `{p.name.id}` of `{op.name}` must name a value of the model", a.span)
            if a.name.id in self.poisoned:
                raise _Abort()
            if a.name.id not in values:
                self.fail("S007", f"unknown value `{a.name.id}` in model `{m.name.id}`", a.name.span,
                          help=("values so far: " + ", ".join(values)) if values else "declare it with `input`")
            bind[p.name.id] = values[a.name.id]
            if p.type is not None:
                unify(self.sink, p.type, self.buffers.btype(values[a.name.id]), dims, f"`{a.name.id}`", a.span,
                      p.span)

    def weights(self, op: A.OpDef, prm_states, target0: str, dims: dict[str, Any], bind: dict[str, str]) -> None:
        """Create the line's parameter and state buffers (`h1.w`, `bn.mean`) and bind them."""
        for p in prm_states:
            # Parameters are trained; state (running statistics, RNG offsets) is created per use
            # the same way, checkpointed, and never differentiated.
            if p.name.id in bind:
                continue  # tied to an earlier line's parameter (self.tie)
            if p.type is None:
                self.fail("S015", f"`{p.name.id}` of op `{op.name}` needs a type", p.span)
            shape, dtype = type_shape(self.sink, p.type, dims)
            init = "glorot" if p.modifier == "param" else "zeros"
            if isinstance(p.default, A.Var):
                init = p.default.name.id
                if init not in INITS:
                    self.fail("S015", f"unknown init `{init}`", p.default.span, help=f"inits: {', '.join(INITS)}")
            bname = f"{target0}.{p.name.id}"
            self.buffers.add(bname, shape, dtype, "param" if p.modifier == "param" else "state", p.span, init=init)
            if p.modifier == "param":
                self.params.append(bname)
            bind[p.name.id] = bname

    def results(self, st: A.OpUse, op: A.OpDef, ins, dims: dict[str, Any], bind: dict[str, str]) -> str | None:
        """Bind the op's outputs to the line's targets (new model values, their buffers created
        where the output is typed) and the outputs past them to buffers kept for the backward;
        return the buffer the line's `into V` names (None without one)."""
        m, values, buffers = self.m, self.values, self.buffers
        target0 = st.targets[0].id
        if not 1 <= len(st.targets) <= len(op.outs):
            self.fail("S005", f"op `{op.name}` produces {len(op.outs)} value(s); {len(st.targets)} target(s) given",
                      st.span)
        # `into V` on the model line: the line's results reuse the storage of the model value V.
        into = None
        if st.clauses.into is not None:
            iv = st.clauses.into.id
            if iv in self.poisoned:
                raise _Abort()
            if iv not in values:
                self.fail("S007", f"`into {iv}`: no value `{iv}` in model `{m.name.id}`", st.clauses.into.span,
                          help="`into` names an earlier value of the model whose storage this line's result reuses")
            into = values[iv]
        # Results an op body writes `into` a per-slot buffer (the model's input) exist per slot too.
        per_slot = {p.name.id for p in ins if SLOT in bind.get(p.name.id, "")}
        for kst in op.body:
            if kst.clauses.into is not None and kst.clauses.into.id in per_slot:
                per_slot.update(t.id for t in kst.targets)
        sfx = f"[{SLOT}]"
        # Outputs past the targets are kept for the backward (batch statistics, dropout masks).
        for o in op.outs[len(st.targets):]:
            bind[o.name.id] = f"{target0}.{o.name.id}" + (sfx if o.name.id in per_slot else "")
        for t, o in zip(st.targets, op.outs):
            if t.id in values:
                self.fail("S002", f"`{t.id}` is defined twice in model `{m.name.id}`", t.span)
            slotted = o.name.id in per_slot or (into is not None and SLOT in into)
            bname = t.id + (sfx if slotted else "")
            bind[o.name.id] = bname
            if o.type is not None:
                shape, dtype = type_shape(self.sink, o.type, dims)
                for n in buffers.slotted(bname):
                    buffers.add(n, shape, dtype, "act", t.span)
            values[t.id] = bname
        return into

    def eval_form(self, c: ForwardCall, trained: list[TaskTemplate]) -> None:
        """Append the evaluation form of one forward call: `NAME.eval` bound by name (as a
        backward is: NAME's inputs, parameters, state and outputs), else the training form."""
        eop = self.scope.ops.get(c.op.name + ".eval")
        if eop is None:
            self.evals.extend(trained)
            return
        bind: dict[str, str] = {}
        for p in eop.params:
            if p.default is not None and p.type is None and p.modifier is None:
                continue
            if p.name.id not in c.bind:
                self.fail("S007", f"`{p.name.id}` of `{eop.name}` names nothing of `{c.op.name}`", p.span,
                          help=f"it may name {', '.join(c.bind)}")
            bind[p.name.id] = c.bind[p.name.id]
        for o in eop.outs:
            if o.name.id not in c.bind:
                self.fail("S007", f"output `{o.name.id}` of `{eop.name}` is not an output of `{c.op.name}`", o.span)
            bind[o.name.id] = c.bind[o.name.id]
        value = c.label.split('@')[-1]
        self.lower.expand_op(eop, bind, c.attrs, self.evals, op_id=-1, prefix=f"{value}.eval",
                             label=f"{eop.name}@{value}", call_span=c.span)


def _free_dims(op: A.OpDef, ins, prm_states) -> list[str]:
    """An op's free dimensions: named in its parameter, state or output types but in no input
    type, so the model line gives them (`linear(x, 5)`), in order of first appearance."""
    in_dims = {d.name.id for p in ins if p.type for d in (p.type.dims or ()) if isinstance(d, A.Var)}
    free: list[str] = []
    for t in [p.type for p in prm_states] + [o.type for o in op.outs]:
        if t is None:
            continue
        for d in t.dims or ():
            if isinstance(d, A.Var) and d.name.id not in in_dims and d.name.id not in free:
                free.append(d.name.id)
    return free
