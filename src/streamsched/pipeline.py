"""The pass order in one screen (ARCHITECTURE.md, "Pipeline"):

    text --parse--> AST --resolve--> Program --unroll (plan_memory)--> Schedule
         --fuse--> Schedule --dependencies--> Edges --validate--> Diagnostics
         --insert_barriers--> EventPlan --validate_plan--> Diagnostics

The lints and the lifetime check (user mistakes, reported in the user's terms) read the unfused
schedule; dependencies, validation and barriers read the fused one, so the checker proves the plan
that runs.  A fused schedule the checker finds fault with is planned again unfused, so the
diagnostics a wrong file gets never depend on fusion.

Every pass is a plain function; `compile_file` runs them all and returns what each produced.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass

from streamsched.diagnostics import Diagnostic, SourceCache, StreamschedError
from streamsched.dsl.program import Program
from streamsched.dsl.resolve import resolve
from streamsched.interp.barriers import Segments, insert_barriers, plan_segments
from streamsched.interp.collective_check import check_collective_order, check_collectives
from streamsched.interp.dependencies import dependencies
from streamsched.interp.fuse import fuse_tasks
from streamsched.interp.ir import Edge, EventPlan, Schedule
from streamsched.interp.lifetime import check_lifetimes
from streamsched.interp.lint import lint_launches, lint_precision, lint_schedule, lint_updates
from streamsched.interp.opcheck import check_op_bodies
from streamsched.interp.unroll import default_steps, unroll
from streamsched.interp.validate import validate_plan, validate_schedule, validate_step


@dataclass(frozen=True)
class Compiled:
    """Everything the passes produced for one file; `diagnostics` holds R and C findings (the P
    and S families stop `compile_file` earlier, by StreamschedError)."""

    program: Program
    schedule: Schedule
    edges: tuple[Edge, ...]
    plan: EventPlan | None
    diagnostics: tuple[Diagnostic, ...]
    segments: Segments | None = None
    fused: int = 0
    """Tasks the fusion pass folded away (0: unfused, by `fuse=False` or because nothing fuses)."""

    @property
    def ok(self) -> bool:
        return not any(d.severity == "error" for d in self.diagnostics)


def compile_file(path: str, text: str | None = None, *, policy: str | None = None, capture: str | None = None,
                 steps: int | None = None, sources: SourceCache | None = None, kernels=None,
                 fuse: bool = True) -> Compiled:
    """Parse, resolve, unroll, analyse and plan `path`.

    policy / capture override the file (command line wins over the `train` block, which wins
    over a top-level `barriers` line); kernels: the `--kernels` modules' records
    (`streamsched.kernel_api.load_kernel_modules`); fuse: run the fusion pass (interp/fuse.py:
    one multi_tensor launch per run of per-parameter tasks; the CLI's `--no-fuse` turns it off).
    Raises StreamschedError for P/S/C diagnostics found while
    resolving; returns R/C findings of the analysis in `Compiled.diagnostics`.
    """
    with _collector_paused():
        program = resolve(path, text, policy=policy, capture=capture, sources=sources, kernels=kernels)
        if steps is not None:
            return _plan(program, steps, fuse)
        # Unroll until the plan has a steady state the loop can repeat (two periods usually do).
        period = max(1, len(program.slots))
        first = default_steps(program)
        for n in (first, first + 2 * period, first + 4 * period):
            c = _plan(program, n, fuse)
            if not c.ok or c.plan is None or c.segments.period is not None:
                return c
        return c


@contextmanager
def _collector_paused():
    """Python's cycle collector off while the passes run: they allocate millions of small
    acyclic records (tasks, accesses, clocks), and each full collection walks all of them, which
    made compiling grow faster than the schedule (half the time of a 35,000-task plan).  Reference
    counting still frees them; cycles wait for the collector, which runs again afterwards.

    On the way out, what the passes made and return is moved to the oldest generation without a
    walk (`gc.freeze` then `gc.unfreeze`): otherwise the first young collection after the compile
    walks every record once more (a tenth of a 10,000-task compile), only to move them there.
    They are long-lived, and cycles among them (there should be none) still go with the next full
    collection, as those of any old object do.  A process that froze objects of its own
    (`gc.freeze` before a fork) keeps them frozen: the move is skipped then."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:  # (a caller's own frozen objects stay frozen)
            gc.freeze()
            gc.unfreeze()
        if was:
            gc.enable()


def _plan(program: Program, steps: int, fuse: bool = False) -> "Compiled":
    schedule = unroll(program, steps=steps)
    run = fuse_tasks(schedule, program.kernels) if fuse else schedule
    if run is not schedule:
        c = _plan_schedule(program, schedule, run)
        if c.ok:
            return c
    return _plan_schedule(program, schedule, schedule)


def _plan_schedule(program: Program, schedule: Schedule, run: Schedule) -> "Compiled":
    """Check `schedule` (lints, lifetimes) and plan `run` (schedule itself or its fused form)."""
    edges = dependencies(run)
    declared = {n for n, _ in program.streams}
    diags = check_op_bodies(list(program.user_ops), lambda nm: nm.id if nm is not None and nm.id in declared else None,
                            schedule.policy)
    diags += list(validate_step(schedule.launches))
    diags += list(validate_schedule(run, edges))
    host_read = {program.model.loss} if program.model else set()
    diags += lint_schedule(schedule, {n for n, _ in program.inits}, host_read)
    diags += lint_precision(schedule, program.loss_scale)
    diags += lint_updates(schedule, program.model.params if program.model else ())
    diags += lint_launches(program.graphs, program.step, bool(program.step))
    coll = check_collectives(schedule)
    early = {d.span for d in coll if d.code == "R006"} | {l.span for d in coll if d.code == "R007" for l in d.labels}
    diags = [d for d in diags if not (d.code == "S023" and d.span in early)]  # R006 says why
    diags += coll
    inits = tuple(n for n, _ in program.inits)
    diags += check_lifetimes(schedule, set(inits), after_step=tuple(host_read), at_end=inits, kernels=program.kernels)
    plan = None
    if not any(d.code == "R002" for d in diags):
        plan = insert_barriers(run, edges, run.policy)
        diags.extend(validate_plan(plan, edges))
        diags.extend(check_collective_order(plan))
    segments = plan_segments(plan) if plan is not None else None
    return Compiled(program, run, tuple(edges), plan, tuple(_dedupe(diags)), segments,
                    len(schedule.tasks) - len(run.tasks))


def _dedupe(diags) -> list[Diagnostic]:
    """The unrolled steps repeat each finding once per step: keep one per source position."""
    seen = set()
    out = []
    for d in diags:
        key = (d.code, d.span, d.message, tuple(l.span for l in d.labels))
        if key in seen:
            continue
        seen.add(key)
        out.append(d)
    return out


def check_file(path: str, *, policy: str | None = None, capture: str | None = None,
               sources: SourceCache | None = None, kernels=None, fuse: bool = True) -> tuple[Diagnostic, ...]:
    """All diagnostics for `path` (empty when it checks clean)."""
    try:
        return compile_file(path, policy=policy, capture=capture, sources=sources, kernels=kernels,
                            fuse=fuse).diagnostics
    except StreamschedError as e:
        return e.diagnostics
