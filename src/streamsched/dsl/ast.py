"""The `.sched` abstract syntax tree: one frozen dataclass per grammar rule, each with its
source span (excluded from equality), as produced by `streamsched.dsl.parse.parse`.

    File      = item*
    item      = Streams | OpDef | KernelDef | Place | ModelDef | GraphDef | StepDef | TrainBlock
              | Barriers | Include
    Expr      = Num | Str | Var | Call | BinOp | Neg | Transpose | Compare
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from streamsched.interp.ir import Span


def _span() -> Span | None:
    return field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Name:
    id: str
    span: Span | None = _span()


# ---- expressions ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Num:
    value: float | int
    span: Span | None = _span()


@dataclass(frozen=True)
class Str:
    value: str
    span: Span | None = _span()


@dataclass(frozen=True)
class Var:
    name: Name
    span: Span | None = _span()


@dataclass(frozen=True)
class KwArg:
    name: Name
    value: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class Call:
    func: Name
    args: tuple["Expr", ...] = ()
    kwargs: tuple[KwArg, ...] = ()
    span: Span | None = _span()


@dataclass(frozen=True)
class BinOp:
    op: str  # + - * /, and ** in kernel bodies
    left: "Expr"
    right: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class Neg:
    operand: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class Transpose:
    operand: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class Compare:
    """`a < b` (also <=, >, >=, ==, !=): only in kernel bodies, where it is 1 or 0 as a number
    and a condition in `where(c, a, b)`."""

    op: str
    left: "Expr"
    right: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class Dots:
    """`...` in a kernel parameter's type: any number of leading dimensions (`x : T[..., n]`)."""

    span: Span | None = _span()


Expr = Union[Num, Str, Var, Call, BinOp, Neg, Transpose, Compare]


@dataclass(frozen=True)
class TypeExpr:
    """`f32[batch, 64]`; dims are expressions over model parameters and dimension variables."""

    dtype: Name
    dims: tuple[Expr, ...] | None
    """None for a bare dtype (`state master : f32` in an optimizer op: the parameter's shape)."""
    span: Span | None = _span()


@dataclass(frozen=True)
class Ref:
    """A reference to a task, graph or launch: `dw`, `pass`, `prev.pass`, `load[next]`."""

    parts: tuple[Name, ...]
    index: Name | None = None
    span: Span | None = _span()

    @property
    def text(self) -> str:
        s = ".".join(p.id for p in self.parts)
        return f"{s}[{self.index.id}]" if self.index else s


@dataclass(frozen=True)
class Clauses:
    """The `on`, `into` and `after` clauses of a statement, with the spans a mechanical fix needs:
    `into_span` covers `into NAME`, `after_clauses` is each `after a, b` clause as written
    (interp.ir.AfterClause: its span and its refs' texts and spans), and `tail` is the
    empty span right after the statement's last token (before a `;` or a comment), where a new
    clause can be inserted.  Several `after` clauses are one list (`after a after b`)."""

    on: Name | None = None
    into: Name | None = None
    after: tuple[Ref, ...] = ()
    into_span: Span | None = _span()
    after_clauses: tuple = field(default=(), compare=False, repr=False)
    tail: Span | None = _span()


# ---- streams, ops, placement --------------------------------------------------------------
@dataclass(frozen=True)
class StreamDecl:
    name: Name
    role: Name
    span: Span | None = _span()


@dataclass(frozen=True)
class Streams:
    decls: tuple[StreamDecl, ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class OpParam:
    """`x`, `x : f32[n, k]`, `param w : f32[k, units] = glorot`, `state v`, `momentum = 0.9`."""

    modifier: str | None  # None | param | grad | state
    name: Name
    type: TypeExpr | None = None
    default: Expr | None = None
    span: Span | None = _span()


@dataclass(frozen=True)
class OutDecl:
    name: Name
    type: TypeExpr | None = None
    span: Span | None = _span()


@dataclass(frozen=True)
class KernelStmt:
    targets: tuple[Name, ...]
    expr: Expr
    clauses: Clauses
    span: Span | None = _span()


@dataclass(frozen=True)
class OpDef:
    name: str
    name_span: Span | None
    params: tuple[OpParam, ...]
    outs: tuple[OutDecl, ...]
    stream: Name
    body: tuple[KernelStmt, ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class KernelParam:
    """`x : T[...]` (an input tensor) or `alpha = 0.5` (a compile-time attribute)."""

    name: Name
    type: TypeExpr | None = None
    default: Expr | None = None
    span: Span | None = _span()


@dataclass(frozen=True)
class KernelAssign:
    """`y = x * sigmoid(x)`: one line of a kernel body (a local value or an output)."""

    target: Name
    expr: Expr
    span: Span | None = _span()


@dataclass(frozen=True)
class KernelDef:
    """`kernel NAME(params) -> outs { assignments }`: one launch written as an expression
    (docs/language.md, "Kernels")."""

    name: Name
    params: tuple[KernelParam, ...]
    outs: tuple[OutDecl, ...]
    body: tuple[KernelAssign, ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class Place:
    target: str
    target_span: Span | None
    stream: Name
    span: Span | None = _span()


# ---- models --------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputDecl:
    name: Name
    type: TypeExpr
    span: Span | None = _span()


@dataclass(frozen=True)
class OpUse:
    """A model line `targets = call clauses`; `repeat` (`out = repeat N block(x)`) the number of
    chained instances of a block, None for a plain line; `path` where an inlined block line came
    from, outermost first: (scope, name an `after` uses there, insertion point), empty for a
    line the user wrote in the model (dsl/compose.py)."""

    targets: tuple[Name, ...]
    call: Call
    clauses: Clauses
    span: Span | None = _span()
    repeat: Expr | None = None
    path: tuple = field(default=(), compare=False, repr=False)
    # an inlined block line's own name (`y.s`), which names its parameters and state where it
    # differs from its target (the block's output line is the calling line's name `y`)
    own: str | None = field(default=None, compare=False, repr=False)
    # types a block declares for its inputs and outputs, checked on this line:
    # (value name, TypeExpr, caret span, declaration span, instance key)
    checks: tuple = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class ModelDef:
    name: Name
    params: tuple[KwArg, ...]
    body: tuple[Union[InputDecl, OpUse], ...]
    span: Span | None = _span()


# ---- graphs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CopyStmt:
    source: Name
    targets: tuple[Name, ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class ClearStmt:
    """`clear grad(m)` (every gradient of m) or `clear NAME` (one device buffer, e.g. a state)."""

    call: Call | Name
    span: Span | None = _span()


@dataclass(frozen=True)
class ForwardStmt:
    model: Name
    span: Span | None = _span()


@dataclass(frozen=True)
class BackwardStmt:
    """`backward m` or `backward m * s`: the derived backward, its gradient seed d(loss) the
    device scalar `s` (the dynamic loss scale) instead of 1."""

    model: Name
    span: Span | None = _span()
    scale: Name | None = None


@dataclass(frozen=True)
class UploadStmt:
    name: Name
    stream: Name | None = None
    clauses: Clauses = Clauses()
    span: Span | None = _span()


@dataclass(frozen=True)
class SyncStmt:
    span: Span | None = _span()


@dataclass(frozen=True)
class AllocStmt:
    name: Name
    type: TypeExpr
    span: Span | None = _span()


@dataclass(frozen=True)
class CallStmt:
    call: Call
    clauses: Clauses
    span: Span | None = _span()


GraphStmt = Union[CopyStmt, ClearStmt, ForwardStmt, BackwardStmt, UploadStmt, SyncStmt, AllocStmt, CallStmt]


@dataclass(frozen=True)
class GraphDef:
    name: Name
    slots: tuple[Name, ...]
    stream: Name
    body: tuple[GraphStmt, ...]
    span: Span | None = _span()


# ---- steps, training -----------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchStmt:
    ref: Ref
    binds: tuple[Ref, ...] | None
    clauses: Clauses
    span: Span | None = _span()


StepStmt = Union[LaunchStmt, UploadStmt, SyncStmt]


@dataclass(frozen=True)
class StepDef:
    name: Name
    param: Name | None
    body: tuple[StepStmt, ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class TrainItem:
    key: Name
    value: Expr
    span: Span | None = _span()


@dataclass(frozen=True)
class TrainBlock:
    name: Name
    items: tuple[TrainItem, ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class Barriers:
    policy: Name
    span: Span | None = _span()


@dataclass(frozen=True)
class StateDecl:
    """`loss_scale : f32[] = 65536` in a `state { }` block: a device buffer of the file, outside every model,
    initialized once (a number, or an init name such as zeros), checkpointed, read and written by
    graph statements."""

    name: Name
    type: TypeExpr
    init: Expr | None
    span: Span | None = _span()


@dataclass(frozen=True)
class StateBlock:
    """`state { NAME : TYPE = INIT ... }`."""

    decls: tuple[StateDecl, ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class Include:
    path: str
    span: Span | None = _span()


Item = Union[Streams, OpDef, KernelDef, Place, ModelDef, GraphDef, StepDef, TrainBlock, Barriers, Include, StateBlock]


@dataclass(frozen=True)
class File:
    path: str
    items: tuple[Item, ...]
