"""The step and the train block: the `train` block's settings evaluated (`TrainSettings`), the
trained model chosen, the step's statements resolved into `Launch`es (graph launches with their
slots and bindings, uploads, synchronize, the `after` clauses between them), what the launched
graphs run checked (S021), and the barrier policy and capture mode settled.

Source: LANGUAGE.md ("Step", "Slots", "Train block", "Barrier policies", "Capture").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from streamsched.diagnostics import Label
from streamsched.dsl import ast as A
from streamsched.dsl.graphs import Graphs
from streamsched.dsl.names import Streams
from streamsched.dsl.program import AfterRef, CallValue, GraphInfo, Launch
from streamsched.dsl.scope import Buffers, Scope, _Abort
from streamsched.dsl.states import host_value, upload_buffers
from streamsched.dsl.types import const
from streamsched.interp.ir import Span

TRAIN_KEYS = ("model", "data", "epochs", "lr", "capture", "barriers", "seed", "log")
POLICIES = ("auto", "chain", "explicit")
CAPTURES = ("none", "graphs", "step")


@dataclass(frozen=True)
class TrainSettings:
    """The `train` block's settings that evaluated, in order (Program.train, Program.train_spans):
    values are numbers, strings, names (as str) and CallValue."""

    values: tuple[tuple[str, Any], ...] = ()
    spans: tuple[tuple[str, Span | None], ...] = ()

    def __contains__(self, key: str) -> bool:
        return any(k == key for k, _ in self.values)

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.values).get(key, default)

    def span(self, key: str) -> Span | None:
        return dict(self.spans).get(key)


def train_settings(scope: Scope) -> TrainSettings:
    """Evaluate the `train` block (none: no settings); an unknown or repeated setting is S015 /
    S002, a value that is not a constant, a name or a call is left out after its diagnostic."""
    if scope.train is None:
        return TrainSettings()
    err = scope.sink.err
    vals, spans = [], []
    seen: dict[str, Span | None] = {}
    for it in scope.train.items:
        k = it.key.id
        if k not in TRAIN_KEYS:
            err("S015", f"unknown train setting `{k}`", it.key.span, help=f"settings: {', '.join(TRAIN_KEYS)}")
            continue
        if k in seen:
            err("S002", f"train setting `{k}` is given twice", it.key.span, labels=[Label(seen[k], "first given here")])
            continue
        seen[k] = it.span
        try:
            vals.append((k, _train_value(scope, it.value)))
            spans.append((k, it.value.span))
        except _Abort:
            continue
    return TrainSettings(tuple(vals), tuple(spans))


def _train_value(scope: Scope, e: A.Expr) -> Any:
    if isinstance(e, A.Call):
        args = tuple(_train_value(scope, a) for a in e.args)
        kws = tuple((k.name.id, _train_value(scope, k.value)) for k in e.kwargs)
        return CallValue(e.func.id, args, kws, e.span)
    if isinstance(e, A.Var):
        return e.name.id
    return const(scope.sink, e, {})


def trained_model(scope: Scope, train: TrainSettings) -> A.ModelDef | None:
    """The trained model: the train block's `model`, else the first one of the files; None when
    there is none, or `model` names none (S013, S015: then every model counts as broken, so
    that the graphs naming one stay quiet)."""
    err = scope.sink.err
    if "model" in train:
        name = train.get("model")
        if not isinstance(name, str):
            err("S015", "`model` names a model: `model = NAME`", train.span("model"),
                help="model parameters are set in the model's header: `model mlp(hidden = 32)`")
            scope.broken_models |= set(scope.models)
        elif name not in scope.models:
            err("S013", f"unknown model `{name}`", train.span("model"),
                help=f"models: {', '.join(scope.models) or 'none'}")
            scope.broken_models |= set(scope.models) | {name}
        else:
            return scope.models[name]
        return None
    if scope.models:
        return next(iter(scope.models.values()))
    return None


def resolve_step(scope: Scope, buffers: Buffers, streams: Streams, graphs: dict[str, GraphInfo],
                 failed: frozenset = frozenset()) -> tuple[Launch, ...]:
    """The launches of the file's step (none without one); a statement with a mistake is left
    out after its diagnostics (S007, S008, S009, S015, S017).  failed: graphs declared but left
    out for mistakes already reported; a statement naming one is left out quietly."""
    if not scope.steps:
        return ()
    return _StepResolver(scope, buffers, streams, graphs, failed).run(scope.steps[0])


class _StepResolver:
    """Resolves one step's statements against the graphs that resolved."""

    def __init__(self, scope: Scope, buffers: Buffers, streams: Streams, graphs: dict[str, GraphInfo],
                 failed: frozenset = frozenset()):
        self.scope, self.buffers, self.streams, self.graphs = scope, buffers, streams, graphs
        self.failed = failed
        self.fail = scope.sink.fail

    def _known(self, name: str) -> bool:
        """Whether `name` is a graph; a rejected one (its mistake reported) aborts the statement
        quietly rather than calling it unknown."""
        if name in self.failed:
            raise _Abort()
        return name in self.graphs

    def run(self, s: A.StepDef) -> tuple[Launch, ...]:
        buffers = self.buffers
        slot_param = s.param.id if s.param else ""
        out = []
        launched = {".".join(p.id for p in st.ref.parts) for st in s.body if isinstance(st, A.LaunchStmt)}
        launched |= {f"upload.{st.name.id}" for st in s.body if isinstance(st, A.UploadStmt)}
        for st in s.body:
            try:
                clauses = getattr(st, "clauses", None)
                after = tuple(self.after_ref(r) for r in clauses.after) if clauses else ()
                for r, ar in zip(clauses.after if clauses else (), after):
                    if ar.graph not in launched:
                        what = (f"the step does not upload `{ar.graph[7:]}` (a graph does: order after that graph)"
                                if ar.graph.startswith("upload.") else f"the step never launches `{ar.graph}`")
                        self.fail("S008", f"`after {r.text}`: {what}", r.span,
                                  help="`after` in the step names another statement of the step: "
                                       + ", ".join(f"`{n}`" for n in sorted(launched)))
                if clauses is not None and isinstance(st, A.UploadStmt) and clauses.into is not None:
                    self.fail("S015", f"`into` on an upload: `upload {st.name.id}` writes the device scalar "
                              f"`{st.name.id}`", clauses.into_span or clauses.into.span,
                              help=f"drop `into {clauses.into.id}`")
                if clauses is not None and isinstance(st, A.LaunchStmt) and (clauses.on or clauses.into):
                    bad = clauses.on or clauses.into
                    kw = "on" if clauses.on else "into"
                    self.fail("S015", f"`{kw}` on a launch: graph `{st.ref.text}` runs on its home stream and writes "
                              "its own buffers", bad.span,
                              help=f"drop `{kw} {bad.id}`; a graph's home stream is set where it is defined "
                                   "(`graph NAME on STREAM`), a kernel's with `on` in an op body")
                if isinstance(st, A.UploadStmt):
                    host_value(self.scope, st.name)
                    stream = self.streams.stream(st.stream, False) if st.stream else self.streams.fold("trans")
                    upload_buffers(buffers, st.name, per_slot=True)
                    out.append(Launch("upload", name=st.name.id, stream=stream, after=after, span=st.span,
                                      tail=st.clauses.tail, ref=f"upload.{st.name.id}",
                                      after_clauses=st.clauses.after_clauses,
                                      text=f"upload {st.name.id}" + (f" on {st.stream.id}" if st.stream else "")))
                elif isinstance(st, A.SyncStmt):
                    out.append(Launch("sync", span=st.span, ref="synchronize"))
                else:
                    ln = self.launch(st, slot_param, after)
                    text = st.ref.text + (f"({', '.join(b.text for b in st.binds)})" if st.binds is not None else "")
                    out.append(replace(ln, tail=st.clauses.tail, ref=ln.graph, after_clauses=st.clauses.after_clauses,
                                       text=text))
            except _Abort:
                continue
        return tuple(out)

    def after_ref(self, r: A.Ref) -> AfterRef:
        """`after G`, `after prev.G` or `after upload.NAME` on a step statement."""
        parts = [p.id for p in r.parts]
        prev = False
        if len(parts) >= 2 and parts[0] == "prev":
            prev, parts = True, parts[1:]
        if len(parts) == 2 and parts[0] == "upload":
            if parts[1] not in self.buffers.uploads_planned:
                self.fail("S007", f"`after {r.text}`: the step does not upload `{parts[1]}`", r.span)
            return AfterRef(f"upload.{parts[1]}", prev, r.span)
        if len(parts) != 1 or not self._known(parts[0]):
            self.fail("S008", f"unknown graph `{r.text}` in `after`", r.span,
                      help=f"graphs: {', '.join(self.graphs)}; `prev.NAME` names the previous step's launch; "
                           "`upload.NAME` an upload")
        return AfterRef(parts[0], prev, r.span)

    def slot_of(self, idx: A.Name, slot_param: str) -> str:
        if idx.id == slot_param:
            return "slot"
        if idx.id == "next":
            return "next"
        if idx.id in self.buffers.slots:
            return idx.id
        self.fail("S009", f"unknown slot `{idx.id}`", idx.span,
                  help=f"use `{slot_param or 'slot'}` (this step's slot), `next`, or one of "
                       f"{', '.join(self.buffers.slots) or 'no slots'}")
        return ""

    def launch(self, st: A.LaunchStmt, slot_param: str, after) -> Launch:
        """A graph launch `G`, `G[slot]` or `G(load[slot])`: which slot it runs on."""
        graphs = self.graphs
        r = st.ref
        gname = ".".join(p.id for p in r.parts)
        if not self._known(gname):
            self.fail("S008", f"unknown graph `{gname}`", r.span, help=f"graphs: {', '.join(graphs) or 'none'}")
        g = graphs[gname]
        slot = ""
        if r.index is not None:
            if not g.slots:
                self.fail("S009", f"graph `{gname}` has no slots", r.index.span,
                          help=f"declare them: `graph {gname}[a, b] on ...`")
            slot = self.slot_of(r.index, slot_param)
        for b in st.binds or ():
            bg = ".".join(p.id for p in b.parts)
            if not self._known(bg):
                self.fail("S008", f"unknown graph `{bg}`", b.span)
            if b.index is None:
                if not graphs[bg].slots:
                    self.fail("S009", f"graph `{bg}` has no slots to bind", b.span,
                              help="a launch binds a slotted graph's slot, e.g. "
                                   f"`{gname}(load[{slot_param or 'slot'}])`")
                self.fail("S009", f"`{bg}` needs a slot here: `{bg}[{slot_param or 'slot'}]`", b.span)
            if not graphs[bg].slots:
                self.fail("S009", f"graph `{bg}` has no slots", b.index.span)
            slot = self.slot_of(b.index, slot_param)
        if g.slotted and not slot:
            sp = slot_param or "slot"
            # Only forms valid here: `G[slot]` needs G to declare slots; a binding names a slotted graph.
            binder = next((n for n, gi in graphs.items() if gi.slots and n != gname), "load")
            forms = [f"`{gname}({binder}[{sp}])`"] + ([f"`{gname}[{sp}]`"] if g.slots else [])
            self.fail("S017", f"graph `{gname}` uses per-slot buffers; say which slot it runs on",
                      r.span, help=f"write {' or '.join(forms)}")
        binds = tuple(".".join(p.id for p in b.parts) for b in st.binds or ())
        return Launch("graph", graph=gname, slot=slot, after=after, binds=binds, span=st.span)


def check_model_runs(scope: Scope, graphs: Graphs, step: tuple[Launch, ...], exact: bool, model: str) -> None:
    """What the launched graphs run must train `model`: an optimizer needs a `backward`, a
    `backward` a `forward` (S021).  exact: the step resolved without mistakes, so its launches
    are the graphs that run; else (or in a file without a step) every graph counts."""
    err = scope.sink.err
    launched = {ln.graph for ln in step if ln.kind == "graph"} if exact else set(graphs.graph_runs)
    runs: dict[str, Span | None] = {}
    for gname, kinds in graphs.graph_runs.items():
        if gname in launched:
            for kind, span in kinds.items():
                runs.setdefault(kind, span)
    m = model
    unlaunched = " (the graph that does is never launched by the step)"
    if "optimizer" in runs and "BackwardStmt" not in runs:
        why = unlaunched if "BackwardStmt" in graphs.runs else ""
        err("S021", f"the optimizer updates `{m}`, but no graph runs `backward {m}`{why}: "
            "its gradients are never computed", runs["optimizer"],
            help=("launch that graph in the step" if why else
                  f"add `backward {m}` after `forward {m}` in the graph that runs the model"))
    if "BackwardStmt" in runs and "ForwardStmt" not in runs:
        why = unlaunched if "ForwardStmt" in graphs.runs else ""
        err("S021", f"`backward {m}` runs, but no graph runs `forward {m}` first{why}",
            runs["BackwardStmt"], help=f"write `forward {m}; backward {m}`")


def settle_policy(scope: Scope, train: TrainSettings, policy: str | None, capture: str | None) -> tuple[str, str]:
    """(barrier policy, capture mode): the command line's, else the train block's, else the
    top-level `barriers` line's (policy) or `step` (capture); an unknown one is S015."""
    err = scope.sink.err
    barriers = scope.barriers
    pol = policy or (train.get("barriers") if isinstance(train.get("barriers"), str) else None) or \
        (barriers.policy.id if barriers else "auto")
    if pol not in POLICIES:
        span = train.span("barriers") or (barriers.policy.span if barriers else None)
        err("S015", f"unknown barrier policy `{pol}`", span, help=f"policies: {', '.join(POLICIES)}")
    cap = capture or train.get("capture", "step")
    if cap not in CAPTURES:
        err("S015", f"unknown capture mode `{cap}`", train.span("capture"), help=f"modes: {', '.join(CAPTURES)}")
    return pol, cap
