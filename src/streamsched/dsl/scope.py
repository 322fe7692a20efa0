"""The state one resolution run shares between its passes: the diagnostic sink (`Sink`), the
declarations of the files by name (`Scope`) and the buffer table (`Buffers`).

Every pass reports a user's mistake through `Sink.err` (record, go on) or `Sink.fail` (record,
then raise `_Abort` to stop expanding the one construct at hand; its caller catches it and goes
on with the next construct), so that every mistake of a file is reported in one run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from streamsched.diagnostics import Diagnostic
from streamsched.dsl import ast as A
from streamsched.dsl.program import SLOT
from streamsched.interp.ir import DTYPE_BYTES, Buffer, Span

INITS = ("zeros", "ones", "glorot", "he", "normal", "uniform")


class _Abort(Exception):
    """Stops expanding one construct after a diagnostic was recorded."""


class Sink:
    """The diagnostics of one resolution run, in the order they were found (the renderer sorts
    them by position); a diagnostic seen twice is kept once."""

    def __init__(self) -> None:
        self.diags: list[Diagnostic] = []

    def err(self, code: str, msg: str, span: Span | None, help: str = "", labels=(), notes=(), fixes=()) -> None:
        """Record a diagnostic (code: its stable code, docs/errors.md) and go on."""
        d = Diagnostic(code, msg, span, help=help, labels=tuple(labels), notes=tuple(notes), fixes=tuple(fixes))
        if d not in self.diags:  # one mistake seen from two places (its definition and a use) once
            self.diags.append(d)

    def fail(self, code: str, msg: str, span: Span | None, help: str = "", labels=()) -> None:
        """Record a diagnostic, then raise _Abort: the construct at hand cannot be expanded."""
        self.err(code, msg, span, help, labels)
        raise _Abort()


def stdlib_kernels() -> dict[str, Any]:
    """The stdlib's kernel table, imported when a run starts (importing the front end loads no
    kernel family)."""
    from streamsched.stdlib.kernels import KERNELS

    return KERNELS


class Scope:
    """What the files of one run declare, by name, filled by `names.collect`: streams (name ->
    (role, span)), ops (the stdlib's, shadowed by the user's), placements, models, graphs, the
    step, the train block, `state` declarations and `kernel` forms; the program's kernel table;
    and the constructs whose mistakes were reported (so that their uses stay quiet)."""

    def __init__(self, files: list[A.File], kernels=None):
        self.files = files
        self.sink = Sink()
        # This program's kernels: the stdlib's, the `--kernels` modules' and the file's `kernel`
        # forms (and the gradient kernels derived from them), never shared with another file.
        self.kernels: dict[str, Any] = {**stdlib_kernels(), **dict(kernels or {})}
        self.kernel_origins: dict[str, str] = dict(getattr(kernels, "origins", {}) or {})
        self.kernel_defs: dict[str, A.KernelDef] = {}
        self.kernel_sources: dict[str, Any] = {}  # user kernel -> dsl.kernels.KernelSource
        self.streams: dict[str, tuple[str, Span | None]] = {}
        self.ops: dict[str, A.OpDef] = {}
        self.stdlib_ops: set[str] = set()
        self.derived_ops: set[str] = set()  # synthesized NAME.backward ops (lines nobody can edit)
        self.places: dict[str, A.Place] = {}
        self.line_places: dict[str, A.Place] = {}  # `place h.2.k on S`: a block instance's line
        self.line_places_used: set[str] = set()
        self.models: dict[str, A.ModelDef] = {}
        self.graphs_ast: dict[str, A.GraphDef] = {}
        self.steps: list[A.StepDef] = []
        self.train: A.TrainBlock | None = None
        self.barriers: A.Barriers | None = None
        self.state_decls: dict[str, A.StateDecl] = {}  # `state { NAME : TYPE = INIT }`
        self.broken_models: set[str] = set()  # models whose mistakes were reported; no follow-ups
        self.broken_states: set[str] = set()  # `state` declarations that failed (reported once)

    @property
    def diags(self) -> list[Diagnostic]:
        return self.sink.diags

    def stdlib_like(self, op_name: str) -> bool:
        """Whether the lines of op `op_name` are not the user's to edit (a stdlib op, or a backward
        derived for an op without one): its tasks point at the user's line that called it."""
        return op_name in self.stdlib_ops or op_name in self.derived_ops


class Buffers:
    """The buffer table of one run: every buffer by name (a per-slot buffer once per slot, `x[a]`),
    their inits, the slots, and the host values uploaded.  A template name with the placeholder
    `{slot}` stands for one buffer per slot (`slotted`)."""

    def __init__(self, sink: Sink):
        self.sink = sink
        self.buffers: dict[str, Buffer] = {}
        self.inits: dict[str, str] = {}
        self.slots: tuple[str, ...] = ()
        self.uploads: set[str] = set()  # host values some statement uploads (Program.host_values)
        self.uploads_planned: set[str] = set()  # the same, known before the graphs are expanded

    def add(self, name: str, shape, dtype: str, kind: str, span=None, space="device", init=None) -> Buffer:
        """The buffer `name`, created (shape in elements, dtype a key of DTYPE_BYTES) unless it
        exists; init: its init spec (`zeros`, `glorot`, `const:1.0`, `copy:P`)."""
        if name in self.buffers:
            return self.buffers[name]
        b = Buffer(name, tuple(int(d) for d in shape), dtype, space=space, kind=kind, span=span)
        self.buffers[name] = b
        if init:
            self.inits[name] = init
        return b

    def slotted(self, name: str) -> list[str]:
        """The concrete buffer names a (possibly slotted) template name stands for."""
        if SLOT in name:
            return [name.replace(SLOT, s) for s in self.slots]
        return [name]

    def has(self, name: str) -> bool:
        names = self.slotted(name)
        return bool(names) and names[0] in self.buffers

    def btype(self, name: str, span: Span | None = None) -> tuple[tuple[int, ...], str]:
        """(shape, dtype) of a template name; raises _Abort when it has no buffer (S007 unless an
        earlier mistake, already reported, failed to produce it)."""
        b = self.buffers.get((self.slotted(name) or [""])[0])
        if b is None:
            # A value an earlier mistake failed to produce (that mistake was reported).
            if not self.sink.diags:
                self.sink.err("S007", f"`{name}` has no value here", span)
            raise _Abort()
        return b.shape, b.dtype

    def storage_root(self, name: str) -> str:
        """The buffer whose storage a (template) name uses: the end of its `into` chain."""
        b = self.buffers.get((self.slotted(name) or [""])[0])
        seen = set()
        while b is not None and b.alias_of and b.alias_of not in seen:
            seen.add(b.alias_of)
            b = self.buffers.get(b.alias_of)
        return b.name.split("[")[0] if b is not None else name

    def alias_into(self, outs, into: str, span: Span | None, call_span: Span | None = None) -> None:
        """Make every buffer of `outs` reuse the storage of `into` (its alias root), slot by slot:
        `x[a]`'s result lives in `x[a]`, `x[b]`'s in `x[b]` (LANGUAGE.md, `into`).  Fails (S003,
        S015) at call_span, else span, when a result cannot live there."""
        at = call_span or span
        fail = self.sink.fail
        for o in outs:
            if SLOT in into and SLOT not in o:
                fail("S003", f"`into {shown(into)}`: `{shown(into)}` has one buffer per slot "
                     f"({', '.join(self.slots)}), but `{shown(o)}` has one for all slots", at,
                     help=f"drop `into {shown(into)}`")
            pairs = [(o.replace(SLOT, sl), into.replace(SLOT, sl)) for sl in self.slots] if SLOT in o else [(o, into)]
            for name, target in pairs:
                if target not in self.buffers or name not in self.buffers:
                    # e.g. an op's backward placing dW into dx, which this backward writes later
                    fail("S007", "`into` names a value that has no storage yet where this runs "
                         "(it is written later, or not at all)", at)  # a backstop: lower.expand_op says it first
                root_b = self.buffers[target]
                while root_b.alias_of:
                    root_b = self.buffers[root_b.alias_of]
                b = self.buffers[name]
                if b.name == root_b.name:
                    continue  # a value placed into itself
                if b.alias_of and b.alias_of != root_b.name:
                    fail("S015", f"`into {shown(into)}`: `{shown(o)}` already reuses the storage of "
                         f"`{shown(b.alias_of)}`", at, help=f"drop `into {shown(into)}`")
                if b.size * DTYPE_BYTES[b.dtype] > root_b.size * DTYPE_BYTES[root_b.dtype]:
                    fail("S003", f"`into {shown(into)}`: `{shown(o)}` does not fit in the storage of "
                         f"`{shown(into)}`", at)
                self.buffers[name] = replace(b, alias_of=root_b.name)


def shown(name: str) -> str:
    """A buffer name as the user wrote it: `x[{slot}]` -> `x`."""
    return name.replace(f"[{SLOT}]", "")
