"""Data-flow checks on the unrolled schedule that races cannot see: a buffer read before
anything wrote it (S022), and a computed value overwritten before anything read it (S023).
Both are schedules that run race-free and train nothing (a load that never copies the labels,
`zero_grad` launched between the backward and the optimizer).
"""

from __future__ import annotations

from streamsched.diagnostics import Diagnostic, Label
from streamsched.interp.ir import Schedule, Task


def _roots(schedule: Schedule) -> dict[str, str]:
    bufs = schedule.buffer_map()
    out = {}
    for name, b in bufs.items():
        r = b
        while r.alias_of and r.alias_of in bufs:
            r = bufs[r.alias_of]
        out[name] = r.name
    return out


def _base(name: str) -> str:
    """`x[a]` and `x[b]` are one buffer to a user."""
    return name.split("[")[0]


def lint_schedule(schedule: Schedule, initialized: set[str], host_read: set[str]) -> list[Diagnostic]:
    """S022 and S023 over the tasks in issue order.

    initialized: buffers that hold a value before the first step (parameters, optimizer state,
    constants); host_read: buffers the training loop reads after a step (the loss), whose
    overwrites are expected.  One diagnostic per source position and buffer.
    """
    roots = _roots(schedule)
    written: set[str] = {roots.get(n, n) for n in initialized}
    read_anywhere = {roots.get(a, a) for t in schedule.tasks for a in t.args}
    pending: dict[str, Task] = {}  # root -> last writer whose value no one has read yet
    seen: set[tuple] = set()
    out: list[Diagnostic] = []

    for t in schedule.tasks:
        for a in t.args:
            r = roots.get(a, a)
            if r not in written:
                key = ("S022", _base(a), t.span)
                if key not in seen:
                    seen.add(key)
                    help_ = ("copy it in the load graph: `copy batch -> ...`" if a.split("[")[0] in
                             _inputs(schedule) else "launch the work that computes it earlier in the step")
                    out.append(Diagnostic("S022", f"`{t.label or t.kernel}` reads `{_base(a)}`, which nothing "
                                          "has written before it", t.span, help=help_))
                written.add(r)  # report each buffer once
            pending.pop(r, None)
        for o in t.outs:
            r = roots.get(o, o)
            prev = pending.get(r)
            if (prev is not None and prev.id != t.id and prev.kernel != "fill" and r in read_anywhere
                    and r not in host_read and o not in t.args):
                key = ("S023", _base(o), prev.span, t.span)
                if key not in seen:
                    seen.add(key)
                    labels = (Label(t.span, f"overwritten here by `{t.label or t.kernel}`"),) if t.span else ()
                    out.append(Diagnostic(
                        "S023", f"the value of `{_base(o)}` written by `{prev.label or prev.kernel}` is overwritten "
                        f"by `{t.label or t.kernel}` before anything reads it", prev.span, labels=labels,
                        help="reorder the step so the value is used before it is replaced"))
            written.add(r)
            pending[r] = t
    return out


def _inputs(schedule: Schedule) -> set[str]:
    return {b.name.split("[")[0] for b in schedule.buffers if b.kind == "input"}
