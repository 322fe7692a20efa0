"""The scheduling IR shared by every pass after `resolve`: buffers, tasks, capture units, the
unrolled `Schedule`, and the `EventPlan` the backends run.

Stages (ARCHITECTURE.md, "Pipeline")::

    Schedule    = streams, buffers (with planned byte ranges), tasks in issue order, units
    Edge        = (u, v, kind, buffer)      kind in RAW | WAR | WAW | AFTER
    EventPlan   = instrs in global issue order: launch t | record e | wait e | begin U | end U

All records are frozen; spans never take part in equality.  Nothing here imports CuPy.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from operator import attrgetter
from typing import Any

HOST = "host"
"""The implicit stream of the CPU thread (LANGUAGE.md, "The host")."""

DTYPE_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "u8": 1, "bool": 1}


def _quick_init(cls: type) -> type:
    """Give a frozen slots dataclass an `__init__` that stores each field through its slot
    descriptor, the same values the generated one stores through `object.__setattr__` (which
    looks each name up again): half the cost of making a Task, Edge or Instr, of which a large
    plan makes millions.  Same signature and defaults; the instances stay frozen (`__setattr__`
    still raises FrozenInstanceError)."""
    env: dict[str, Any] = {"__builtins__": {}}
    params, body = [], []
    for f in fields(cls):
        if not f.init or f.default_factory is not MISSING:
            raise TypeError(f"_quick_init: {cls.__name__}.{f.name} needs the generated __init__")
        env[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        if f.default is MISSING:
            params.append(f.name)
        else:
            env[f"_def_{f.name}"] = f.default
            params.append(f"{f.name}=_def_{f.name}")
        body.append(f"    _set_{f.name}(self, {f.name})")
    exec(f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body) + "\n", env)
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init
    return cls


@dataclass(frozen=True, slots=True)
class Span:
    """A source range; 1-based lines and columns, end exclusive (lark's convention)."""

    file: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Buffer:
    """One planned memory region.

    shape: dimensions in elements; dtype: a key of `DTYPE_BYTES`; space: "device" or "host"
    (pinned staging); kind: input | param | grad | state | act | temp | scalar | staging.
    offset/nbytes: the byte range in its space's arena, fixed before anything runs
    (plan_memory); buffers made by `into` share the range of `alias_of`.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    space: str = "device"
    kind: str = "act"
    offset: int = -1
    nbytes: int = 0
    alias_of: str | None = None
    span: Span | None = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def overlaps(self, other: "Buffer") -> bool:
        """True when both live in one space and their byte ranges intersect."""
        if self.space != other.space:
            return False
        if self.nbytes == 0 or other.nbytes == 0:
            return False
        return self.offset < other.offset + other.nbytes and other.offset < self.offset + self.nbytes


@dataclass(frozen=True)
class AfterClause:
    """One `after a, b` clause as written: the clause's span and each ref's text and span (what a
    fix that drops one ref needs)."""

    span: Span
    refs: tuple[tuple[str, Span], ...]


@dataclass(frozen=True)
class Site:
    """Where a task came from, level by level, so a diagnostic can say where an `after` (or the
    removal of an `into`) fixes it, in syntax that is valid there.

    op / op_tail: the task's statement name in a *user* op body and the insertion point after its
    last token ("" / None inside a stdlib op, whose lines the user cannot edit); line / line_tail:
    the model value of the model line whose call made the task ("" for derived backward work and
    graph statements); gstmt / gname / gtail: the index of its graph statement, the name another
    statement of that graph body orders after it with (`after nonfinite`, `after backward`), and
    the insertion point on it (None when the statement takes no clauses); into_span: the `into X`
    clause that placed the task's output (None when it has none); derived: the task belongs to
    the derived backward (nobody writes `after` on it); op_afters / g_afters: the `after` clauses
    of its op-body statement / graph statement as written."""

    op: str = ""
    op_tail: Span | None = None
    line: str = ""
    line_tail: Span | None = None
    gstmt: int = -1
    gname: str = ""
    gtail: Span | None = None
    into_span: Span | None = None
    derived: bool = False
    op_afters: tuple[AfterClause, ...] = ()
    g_afters: tuple[AfterClause, ...] = ()
    placed: bool = False
    """The user chose the task's stream (an `on` on its line or statement, or a `place`): the
    fusion pass never moves it to another stream."""
    line_path: tuple = ()
    """Where the task's model line sits, outermost first: (scope, the name an `after` uses in that
    scope, the insertion point on that statement); one entry for a line of the model, more for a
    line inlined from a block (dsl/compose.py: scope "" is the model, "y" the block called as
    `y = block(...)`)."""


@_quick_init
@dataclass(frozen=True, slots=True)
class Task:
    """One kernel launch (or one host action) in issue order.

    kernel: a name in `streamsched.stdlib.kernels.KERNELS`; stream: a declared stream or HOST;
    args: input buffer names in kernel argument order; outs: output buffer names;
    attrs: compile-time kernel attributes; after: ids of tasks the user ordered before this one
    (`after` clauses, resolved); unit: index into Schedule.units, -1 for work outside any capture
    unit (host work); op: id of the op call this task belongs to (-1 for none) and rep_stream that
    op's representative stream (the chain policy needs both); step: -1 for the prologue, else the
    unrolled step index; stmt: the name a user writes in `after` to order work after this task
    (a kernel's output name inside an op body, a graph name for a launch); slot: the step's slot name ("a"/"b"/""); key: identity of the task modulo
    the slot period (tasks with equal keys are the same work in different steps of one slot, so
    they share events); label: human-readable origin, e.g. "pass[a] linear.backward@h3 .dw".
    """

    id: int
    kernel: str
    stream: str
    args: tuple[str, ...] = ()
    outs: tuple[str, ...] = ()
    attrs: tuple[tuple[str, Any], ...] = ()
    after: tuple[int, ...] = ()
    unit: int = -1
    op: int = -1
    rep_stream: str = ""
    step: int = 0
    slot: str = ""
    key: str = ""
    label: str = ""
    stmt: str = ""
    span: Span | None = field(default=None, compare=False, repr=False)
    launch: int = -1
    """Index of the step statement (Schedule.launches) that issued the task; -1 for none."""
    site: Site | None = field(default=None, compare=False, repr=False)

    @property
    def reads(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.args))

    @property
    def writes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.outs))

    def attr(self, name: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == name:
                return v
        return default


_INIT_FIELDS: dict[type, tuple[dict[str, int], Any, bool]] = {}
"""class -> (init field -> index, getter of them all, copied by its `__dict__`)."""


def evolve(obj: Any, **changes: Any) -> Any:
    """`dataclasses.replace(obj, **changes)` without its per-call introspection: the passes copy
    every task of a large schedule at least once (the front end's templates and sites, unroll,
    fusion).  A frozen record without `__slots__` and without `__post_init__` (Site,
    TaskTemplate) is copied by its `__dict__` (what `replace` would rebuild field by field); any
    other (Task) is made again through its `__init__`.  Raises TypeError, as `replace` does, for a
    name that is not an init field."""
    cls = type(obj)
    known = _INIT_FIELDS.get(cls)
    if known is None:
        names = tuple(f.name for f in fields(cls) if f.init)
        by_dict = not hasattr(cls, "__slots__") and not hasattr(cls, "__post_init__") and len(names) == len(fields(cls))
        known = _INIT_FIELDS[cls] = ({n: i for i, n in enumerate(names)}, attrgetter(*names), by_dict)
    index, getter, by_dict = known
    if not changes.keys() <= index.keys():  # (one set comparison; the name is looked for only then)
        bad = next(n for n in changes if n not in index)
        raise TypeError(f"evolve: {cls.__name__} has no init field {bad!r}")
    if by_dict:
        new = object.__new__(cls)
        d = new.__dict__
        d.update(obj.__dict__)
        d.update(changes)
        return new
    vals = list(getter(obj)) if len(index) > 1 else [getter(obj)]
    for n, x in changes.items():
        vals[index[n]] = x
    return cls(*vals)


_BEFORE_AFTER = attrgetter("kernel", "stream", "args", "outs", "attrs")
_PAST_AFTER = attrgetter("unit", "op", "rep_stream", "step", "slot", "key", "label", "stmt", "span", "launch", "site")


if tuple(f.name for f in fields(Task)) != ("id", "kernel", "stream", "args", "outs", "attrs", "after", "unit", "op",
                                           "rep_stream", "step", "slot", "key", "label", "stmt", "span", "launch",
                                           "site"):
    raise ImportError("ir.renumbered lists Task's fields in order: update it with Task")


def renumbered(task: Task, id: int, after: tuple[int, ...]) -> Task:  # noqa: A002 (the field's name)
    """`evolve(task, id=id, after=after)`, the copy every renumbering pass makes of each task
    (fusion), made without evolve's per-call bookkeeping."""
    return Task(id, *_BEFORE_AFTER(task), after, *_PAST_AFTER(task))


@dataclass(frozen=True)
class Unit:
    """A capture-unit instance: one launch of `graph` (for one slot) with home stream `home`.

    Under capture = step the whole step is one unit; under capture = none units still group
    tasks (their fork/join is then ordinary waits).
    """

    id: int
    name: str
    graph: str
    home: str
    slot: str = ""
    step: int = 0
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Schedule:
    """The unrolled task list that dependency analysis and barrier insertion work on.

    streams: declared streams in declaration order, then HOST; tasks: in issue order with
    task.id == index; period: slots per cycle (1 or 2); steps: number of unrolled steps
    (task.step in -1..steps-1); capture: none | graphs | step; policy: auto | chain | explicit.
    """

    streams: tuple[str, ...]
    buffers: tuple[Buffer, ...]
    tasks: tuple[Task, ...]
    units: tuple[Unit, ...] = ()
    period: int = 1
    steps: int = 1
    capture: str = "none"
    policy: str = "auto"
    launches: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    """The step's statements (dsl.program.Launch records: graph name, span, source text), indexed
    by Task.launch; empty for schedules built by hand."""

    def buffer_map(self) -> dict[str, Buffer]:
        return {b.name: b for b in self.buffers}


@_quick_init
@dataclass(frozen=True, slots=True)
class Edge:
    """A required ordering u -> v between tasks (u issued before v)."""

    u: int
    v: int
    kind: str  # RAW | WAR | WAW | AFTER
    buffer: str = ""


@_quick_init
@dataclass(frozen=True, slots=True)
class Instr:
    """One instruction of the EventPlan, issued on `stream`.

    op: "launch" (task), "record" (event), "wait" (event), "begin"/"end" (unit: capture-unit
    boundaries, on the unit's home stream; a no-op for eager execution).  step: the unrolled step
    the instruction belongs to (-1 for the prologue), so the runtime can issue one step at a time.
    """

    op: str
    stream: str
    task: int = -1
    event: int = -1
    unit: int = -1
    step: int = 0


@dataclass(frozen=True)
class EventPlan:
    """Per-stream launch / record / wait lists, kept in one global issue order.

    A wait binds to the latest record of its event issued before it (CUDA's
    cudaStreamWaitEvent semantics); a wait on an event with no earlier record waits for nothing.
    Events are numbered 0..num_events-1 and created before capture.
    """

    schedule: Schedule
    instrs: tuple[Instr, ...]
    num_events: int
    policy: str = "auto"
    steady: int | None = field(default=-1, compare=False, repr=False)
    """The steady period insert_barriers found (barriers.steady_period), None for none, -1 when
    unknown (a plan built or edited by hand: computed when asked)."""
    analysis: Any = field(default=None, compare=False, repr=False)
    """validate.analyse_plan of this plan followed by two replays of its steady steps, kept by
    insert_barriers so validate_plan need not walk the plan again (None: walk it).  Both caches
    name the instrs and schedule they belong to, so a plan edited with `replace` ignores them."""

    def per_stream(self) -> dict[str, list[Instr]]:
        out: dict[str, list[Instr]] = {s: [] for s in self.schedule.streams}
        for ins in self.instrs:
            out.setdefault(ins.stream, []).append(ins)
        return out
