"""The typed program `resolve` produces: streams with roles, buffers with shapes and dtypes,
task templates for every graph (ops expanded, the backward derived), the step's launch list and
the training configuration.  `streamsched.interp.unroll` turns it into a `Schedule`.

A template's buffer names may hold the placeholder `{slot}`, filled per slot instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamsched.interp.ir import Buffer, Site, Span

SLOT = "{slot}"


@dataclass(frozen=True)
class TaskTemplate:
    """One kernel launch of a graph, before unrolling.  after: indices of earlier-or-later
    templates of the same graph (resolved `after` clauses); op: op-call index within the graph."""

    kernel: str
    stream: str
    args: tuple[str, ...]
    outs: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...] = ()
    after: tuple[int, ...] = ()
    op: int = -1
    rep_stream: str = ""
    stmt: str = ""
    label: str = ""
    span: Span | None = field(default=None, compare=False, repr=False)
    site: Site | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class GraphInfo:
    """A capture unit: home stream, slots ("a", "b") or (), templates, and whether its tasks touch
    per-slot buffers (then every launch must say which slot)."""

    name: str
    home: str
    slots: tuple[str, ...]
    templates: tuple[TaskTemplate, ...]
    slotted: bool
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class AfterRef:
    """`after pass` or `after prev.pass` on a step statement."""

    graph: str
    prev: bool
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Launch:
    """One statement of the step: a graph launch (slot: "slot" | "next" | a slot name | ""),
    an upload of a host value, or a synchronize.  A launch bound to another graph's slot
    (`pass(load[slot])`) is ordered after the latest launch of that graph on that slot, under
    every policy: the binding says which buffers it reads."""

    kind: str  # graph | upload | sync
    graph: str = ""
    slot: str = ""
    name: str = ""  # upload: host value name
    stream: str = ""  # upload: copy stream
    after: tuple[AfterRef, ...] = ()
    binds: tuple[str, ...] = ()  # `pass(load[slot])`: ordered after that slot's latest `load`
    span: Span | None = field(default=None, compare=False, repr=False)
    tail: Span | None = field(default=None, compare=False, repr=False)
    """Where a new clause goes on the statement: right after its last token, before any `;`."""
    ref: str = ""
    """How an `after` on another step statement names this launch: `pass`, `upload.lr`."""
    after_clauses: tuple = field(default=(), compare=False, repr=False)
    """The statement's `after` clauses as written (interp.ir.AfterClause)."""
    text: str = ""
    """The statement as a user writes it, without its clauses: `load[next]`, `pass(load[slot])`."""


@dataclass(frozen=True)
class CallValue:
    """A call written as a value in the `train` block: `digits(test = 0.2)`, `cosine(0.1)`."""

    name: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    span: Span | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What the training loop needs to know of the trained model.

    inputs: (name, shape, dtype) of each `input`, shape including the batch dimension;
    params: parameter buffer names; loss: the scalar loss buffer; logits/labels: the first two
    arguments of the final loss op (for accuracy), or "" if it has none."""

    name: str
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]
    params: tuple[str, ...]
    grads: tuple[str, ...]
    loss: str
    logits: str
    labels: str
    batch: int
    forward: tuple[TaskTemplate, ...] = ()
    eval_forward: tuple[TaskTemplate, ...] = ()  # the forward as evaluation runs it (`NAME.eval` ops)


@dataclass(frozen=True)
class Program:
    """The resolved program.  buffers: every buffer (slotted ones once per slot, named `x[a]`);
    inits: buffer -> init spec ("zeros" | "ones" | "glorot" | "normal" ...); train: the `train`
    block's evaluated items (numbers, strings, names, CallValue) plus their spans; host_values:
    the host scalars uploaded each step; loss_scale: the device scalar seeding the backward
    (`backward M * S`), "" when unscaled; kernels: kernel name -> Kernel record of this program
    (the stdlib's, `--kernels` modules', the file's `kernel` forms and their gradient kernels):
    what the backends run tasks with."""

    path: str
    streams: tuple[tuple[str, str], ...]
    buffers: tuple[Buffer, ...]
    inits: tuple[tuple[str, str], ...]
    graphs: tuple[GraphInfo, ...]
    step: tuple[Launch, ...]
    slots: tuple[str, ...]
    model: ModelInfo | None
    train: tuple[tuple[str, Any], ...]
    train_spans: tuple[tuple[str, Span | None], ...]
    policy: str
    capture: str
    host_values: tuple[str, ...] = ()
    text_hash: str = ""
    loss_scale: str = ""
    user_ops: tuple = field(default=(), compare=False, repr=False)
    kernels: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.kernels is None:
            from streamsched.stdlib.kernels import KERNELS

            object.__setattr__(self, "kernels", KERNELS)

    def graph(self, name: str) -> GraphInfo:
        for g in self.graphs:
            if g.name == name:
                return g
        raise KeyError(name)

    def train_value(self, key: str, default: Any = None) -> Any:
        for k, v in self.train:
            if k == key:
                return v
        return default

    def train_span(self, key: str) -> Span | None:
        for k, s in self.train_spans:
            if k == key:
                return s
        return None
