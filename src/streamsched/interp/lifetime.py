"""Value lifetimes (R005): storage reused by `into` must hold no value that is still needed.

`into` makes a result share the bytes of another buffer (ARCHITECTURE.md, "plan_memory"); the
race checks then order the accesses, but ordering cannot bring back a value that was
overwritten.  The rule this pass proves, over the unrolled schedule in issue order (which is the
order the program means: a race-free plan makes every execution agree with it):

    every read of a buffer `v` finds `v`'s own last write in all the bytes it reads

where "last write" counts the forward, the derived backward, the optimizer, the next steps'
work, and the training loop's own reads (the loss after each step, parameters and state at the
end, for evaluation and checkpoints).  A read whose bytes were last written under another name
(`y = gelu(x) into x`, then `gelu.backward` reads `x`) is an error naming the value, the
statement that overwrote it and the reader that still needs it.  Also: a kernel whose output
overlaps one of its own inputs must be an elementwise kernel writing exactly that input's
storage (Kernel.inplace): a GEMM or a reduction writing into what it reads computes garbage.

Removing every `into` from a program that passes this check (and the race check) never changes
its results: that is the meaning of `into` (LANGUAGE.md, "Ops").
"""

from __future__ import annotations

from dataclasses import dataclass

from streamsched.diagnostics import Diagnostic, Label
from streamsched.interp.dependencies import storage_segments
from streamsched.interp.fixes import drop_clause
from streamsched.interp.ir import Buffer, Schedule, Task


def _shown(name: str) -> str:
    """`x[a]` -> `x`: a user writes one name for both slots."""
    return name.split("[")[0] if name.endswith("]") and "(" not in name else name


def _who(t: Task) -> str:
    return t.label or t.stmt or t.kernel


@dataclass(frozen=True)
class _Reader:
    """A read that is not a task: the training loop reading a buffer after a step or the run."""

    what: str


def _into_span(t: Task):
    return t.site.into_span if t.site is not None else None


def check_lifetimes(schedule: Schedule, initialized: set[str] = frozenset(), after_step: tuple[str, ...] = (),
                    at_end: tuple[str, ...] = (), kernels=None) -> list[Diagnostic]:
    """R005 diagnostics of `schedule` (module docstring), one per (value, overwriting statement,
    reader) source position.

    initialized: buffers that hold a value before the first step (parameters, optimizer state,
    constants: `Program.inits`); after_step: buffers the training loop reads after every step
    (the loss); at_end: buffers it reads after the run (parameters and state); kernels: the
    program's kernel table (Program.kernels; default the stdlib's).  Never raises for user
    mistakes."""
    from streamsched.stdlib.kernels import KERNELS

    KERNELS = kernels if kernels is not None else KERNELS  # noqa: N806

    segs = storage_segments(schedule)
    segs_get = segs.get
    bufs = schedule.buffer_map()
    tasks = schedule.tasks
    owner: dict[int, tuple[str, int]] = {}  # segment -> (buffer whose value it holds, writer task; -1: initial)
    for b in schedule.buffers:
        if b.alias_of is None:
            for s in segs.get(b.name, ()):
                owner[s] = (b.name, -1)
    owner_get = owner.get
    produced: set[str] = {n for n in initialized if n in bufs}  # values that exist (written or initial)
    writer: dict[str, int] = {}  # buffer -> its latest writer
    seen: set[tuple] = set()
    out: list[Diagnostic] = []

    def destroyed(name: str) -> tuple[str, int] | None:
        for s in segs.get(name, ()):
            o = owner.get(s)
            if o is not None and o[0] != name:
                return o
        return None

    found: dict[tuple, dict] = {}  # (value, overwriting statement) -> what the diagnostic says

    def report(name: str, by: tuple[str, int], reader: Task | _Reader) -> None:
        w = tasks[by[1]] if by[1] >= 0 else None
        key = (_shown(name), w.span if w is not None else by[0])
        rname = _who(reader) if isinstance(reader, Task) else reader.what
        entry = found.get(key)
        if entry is None:
            entry = found[key] = {"name": name, "by": by, "w": w, "readers": [], "made": writer.get(name)}
        rspan = reader.span if isinstance(reader, Task) else None
        if all((r[0] != rname and (rspan is None or r[1] != rspan)) for r in entry["readers"]):
            derived = isinstance(reader, Task) and reader.site is not None and reader.site.derived
            entry["readers"].append((rname, rspan, derived))

    def emit() -> None:
        for entry in found.values():
            name, by, w, readers = entry["name"], entry["by"], entry["w"], entry["readers"]
            value, other = _shown(name), _shown(by[0])
            wname = _who(w) if w is not None else f"the initial value of `{other}`"
            rname = readers[0][0]
            labels = []
            for rn, rspan, derived in readers:
                if rspan is not None and len(labels) < 4:
                    labels.append(Label(rspan, f"`{rn}`{' (derived backward)' if derived else ''} still reads "
                                               f"`{value}` here"))
            made = entry["made"]
            shown = {lab.span for lab in labels}
            if made is not None and tasks[made].span is not None and (w is None or tasks[made].span != w.span) \
                    and tasks[made].span not in shown:
                labels.append(Label(tasks[made].span, f"`{value}` is computed here"))
            notes = tuple(f"`{rn}` also reads `{value}` after it is overwritten" for rn, sp, _ in readers[1:]
                          if sp is None or sp not in shown)
            fix = _into_span(w) if w is not None else None
            where = "" if w is None or w.span is None else f" ({w.span.file}:{w.span.line})"
            if fix is not None:
                help_ = (f"drop `into` here, so `{other}` gets storage of its own, or reorder the work so that "
                         f"nothing reads `{value}` after it is overwritten")
            else:
                help_ = (f"give `{other}` storage of its own (drop the `into` that places it in `{value}`), or "
                         "reorder the work")
            primary = w.span if w is not None and w.span is not None else next((r[1] for r in readers if r[1]), None)
            out.append(Diagnostic(
                "R005", f"`{value}` is overwritten while it is still needed: `{wname}`{where} writes `{other}` into "
                        f"its storage, and `{rname}` reads `{value}` later",
                primary, help=help_, labels=tuple(labels), notes=notes,
                fixes=(drop_clause(fix),) if fix is not None else ()))

    apart: set[tuple] = set()  # (args, outs) whose outputs share no byte with another input

    def self_overlap(t: Task) -> None:
        """An output sharing bytes with an input of the same kernel under another name."""
        names = (t.args, t.outs)
        if names in apart:
            return  # the same names in another step (unroll shares them): nothing overlaps
        if not any(a != o and not set(segs.get(o, ())).isdisjoint(segs.get(a, ())) for o in t.writes for a in t.reads):
            apart.add(names)
            return
        k = KERNELS.get(t.kernel)
        for o in t.writes:
            so = set(segs.get(o, ()))
            for a in t.reads:
                if a == o or not so & set(segs.get(a, ())):
                    continue
                bo, ba = bufs.get(o), bufs.get(a)
                exact = bo is not None and ba is not None and (bo.offset, bo.nbytes, bo.dtype, bo.shape) == \
                    (ba.offset, ba.nbytes, ba.dtype, ba.shape)
                if exact and (k is None or k.inplace):
                    continue
                key = ("self", t.span, _shown(o), _shown(a))
                if key in seen:
                    continue
                seen.add(key)
                why = (f"`{t.kernel}` reads other elements of its input than the one it writes"
                       if exact else f"`{_shown(o)}` is {_type(bo)} and `{_shown(a)}` {_type(ba)}: they overlap "
                       "without being the same array")
                fix = _into_span(t)
                out.append(Diagnostic(
                    "R005", f"`{_who(t)}` writes `{_shown(o)}` into the storage of its own input `{_shown(a)}` "
                            f"while it reads it: {why}", t.span,
                    help="drop `into` here, so the result gets storage of its own" if fix is not None else
                    "give the result storage of its own (drop the `into` that places it there)",
                    fixes=(drop_clause(fix),) if fix is not None else ()))

    def loop_reads(names, what: str) -> None:
        for n in names:
            if n in produced:
                by = destroyed(n)
                if by is not None:
                    report(n, by, _Reader(what.format(value=_shown(n))))

    prev_step = None
    for t in tasks:
        if prev_step is not None and t.step != prev_step and prev_step >= 0:
            loop_reads(after_step, "the training loop (it reads `{value}` after every step)")
        prev_step = t.step
        for a in t.args:  # (a name read twice reports once: `report` merges the same reader)
            if a in produced:
                for sg in segs_get(a, ()):  # (destroyed, inline: every task reads)
                    by = owner_get(sg)
                    if by is not None and by[0] != a:
                        report(a, by, t)
                        break
        if (t.args, t.outs) not in apart:  # (self_overlap's first test, inline: most tasks stop there)
            self_overlap(t)
        for o in t.outs:
            mark = (o, t.id)
            for s in segs_get(o, ()):
                owner[s] = mark
            produced.add(o)
            writer[o] = t.id
    if prev_step is not None and prev_step >= 0:
        loop_reads(after_step, "the training loop (it reads `{value}` after every step)")
    loop_reads(at_end, "the training loop (it saves and evaluates `{value}` after the run)")
    emit()
    return out


def _type(b: Buffer | None) -> str:
    if b is None:
        return "unplanned"
    return f"{b.dtype}[{', '.join(str(d) for d in b.shape)}]"
