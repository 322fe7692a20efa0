"""Stable text dumps for `streamsched lower` and golden files: `format_plan` prints an EventPlan
with one column per stream, one row per instruction in global issue order; `format_edges`
prints required edges one per line.

    plan: policy auto, capture graphs, period 2, steps 4
      # | comp1                         | comp3             | host
    ----+-------------------------------+-------------------+-----
    -- step 0 [a] --
      0 | launch t3 matmul dw  m.sched:12 |                 |
      1 | record e0                     |                   |
      2 |                               | wait e0           |
    ...
    12 tasks, 3 events, 3 records, 3 waits, policy auto

Output depends only on the plan (and `sources` for the source-line footer); lines carry no
trailing blanks, so golden diffs stay clean.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Mapping

from streamsched.diagnostics import SourceCache
from streamsched.interp.ir import Edge, EventPlan, Instr, Schedule, Task


def _loc(task: Task) -> str:
    # The file's base name keeps columns narrow; a plan comes from one file and its includes.
    return f"{os.path.basename(task.span.file)}:{task.span.line}" if task.span is not None else ""


def _cell(plan: EventPlan, ins: Instr) -> str:
    s = plan.schedule
    if ins.op == "launch":
        t = s.tasks[ins.task]
        parts = [f"launch t{t.id}", t.kernel]
        if t.label:
            parts.append(t.label)
        loc = _loc(t)
        return " ".join(parts) + (f"  {loc}" if loc else "")
    if ins.op in ("record", "wait"):
        return f"{ins.op} e{ins.event}"
    if ins.op in ("begin", "end"):
        units = s.units
        name = units[ins.unit].name if 0 <= ins.unit < len(units) and units[ins.unit].id == ins.unit else f"U{ins.unit}"
        return f"{ins.op} {name}"
    return ins.op


def _step_title(step: int) -> str:
    return "-- prologue --" if step < 0 else f"-- step {step} --"


def plan_summary(plan: EventPlan) -> str:
    """One line: '<n> tasks, <n> events, <n> records, <n> waits, policy <p>'."""
    c = Counter(i.op for i in plan.instrs)
    return (f"{len(plan.schedule.tasks)} tasks, {plan.num_events} events, {c['record']} records, "
            f"{c['wait']} waits, policy {plan.policy}")


def format_plan(plan: EventPlan, sources: SourceCache | Mapping[str, str] | None = None) -> str:
    """The plan as a table: a header line (policy, capture, period, steps), one column per
    stream (declared order, then host, then any other stream the plan uses), one row per
    instruction in issue order with a separator row where the unrolled step changes, then the
    summary line (`plan_summary`).  Launch cells read `launch t<id> <kernel> <label>  file:line` (the
    file's base name).

    sources: a SourceCache or a file -> text mapping; when given, a footer lists the text of
    every source line a launch came from, so a golden file shows what each line was."""
    s = plan.schedule
    streams = list(s.streams)
    for ins in plan.instrs:
        if ins.stream not in streams:
            streams.append(ins.stream)
    used = [st for st in streams if any(ins.stream == st for ins in plan.instrs)] or streams
    cells = [_cell(plan, ins) for ins in plan.instrs]
    width = {st: len(st) for st in used}
    for ins, c in zip(plan.instrs, cells):
        width[ins.stream] = max(width[ins.stream], len(c))
    num_w = max(1, len(str(max(0, len(plan.instrs) - 1))))

    def row(first: str, by_stream: dict[str, str]) -> str:
        return (first.rjust(num_w + 1) + " | " + " | ".join(by_stream.get(st, "").ljust(width[st]) for st in used)).rstrip()

    out = [f"plan: policy {plan.policy}, capture {s.capture}, period {s.period}, steps {s.steps}"]
    out.append(row("#", {st: st for st in used}))
    out.append("-" * (num_w + 2) + "+" + "+".join("-" * (width[st] + 2) for st in used).rstrip("+"))
    step = None
    for i, (ins, c) in enumerate(zip(plan.instrs, cells)):
        if ins.step != step:
            step = ins.step
            out.append(_step_title(step))
        out.append(row(str(i), {ins.stream: c}))
    out.append(plan_summary(plan))
    if sources is not None:
        lines = sorted({(t.span.file, t.span.line) for t in s.tasks if t.span is not None})
        if lines:
            out.append("sources:")
            for f, ln in lines:
                if isinstance(sources, SourceCache):
                    text = sources.line(f, ln)
                else:
                    all_lines = sources.get(f, "").splitlines()
                    text = all_lines[ln - 1] if 1 <= ln <= len(all_lines) else None
                out.append(f"  {f}:{ln}: {text.strip() if text else ''}".rstrip())
    return "\n".join(out)


def format_edges(schedule: Schedule, edges: tuple[Edge, ...] | list[Edge]) -> str:
    """Required edges, one per line in the given order, then a count per kind:

        t3 -> t7  WAR  x  comp1 -> comp3  m.sched:12 -> m.sched:14
    """
    tasks = schedule.tasks
    rows = []
    for e in edges:
        u, v = tasks[e.u], tasks[e.v]
        rows.append((f"t{e.u} -> t{e.v}", e.kind, e.buffer or "-", f"{u.stream} -> {v.stream}",
                     f"{_loc(u) or '?'} -> {_loc(v) or '?'}"))
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(5)]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    kinds = Counter(e.kind for e in edges)
    out.append(f"{len(edges)} edges: " + ", ".join(f"{k} {kinds[k]}" for k in ("RAW", "WAR", "WAW", "AFTER")))
    return "\n".join(out)
