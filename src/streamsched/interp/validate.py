"""Static checks that return diagnostics, never raise, for user mistakes: `validate_schedule`
(dependency cycles R002, uncapturable work C003/C004) and `validate_plan` (races R001, waits on
events never recorded or recorded only later R003, capture units whose streams do not rejoin
their home R004).

Happens-before (ARCHITECTURE.md, "Semantics to hold on to") is computed with vector clocks over
*lanes*.  A lane is a stream, except inside a capture unit (capture = graphs | step), where each
stream the unit uses is a lane of its own, (stream, unit): a captured graph's nodes depend only
on what was captured (CUDA_PITFALLS.md #13, #14), not on earlier work of the same stream.

    lane(instr)  = (stream, unit)  if capture != none and instr.unit >= 0  else (stream, -1)
    launch t     : the lane's position advances; t is ordered after what the lane has seen
    record e     : e takes the lane's clock          (the latest record of e wins:
    wait e       : the lane joins e's clock           cudaStreamWaitEvent semantics)
    begin U on h : lane (h, U) starts from lane (h, -1); other lanes of U start empty
    end U on h   : lane (h, -1) advances once; the whole graph is done when it is (a graph
                   launch completes as one operation on its stream)

A race is a pair of accesses to overlapping bytes, at least one a write, on different lanes, with
no happens-before path; only such pairs are ever enumerated (per segment and lane, the accesses
not covered by the clock are a suffix), so a race-free plan is checked in near-linear time.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import defaultdict, deque
from dataclasses import dataclass, replace

from streamsched.diagnostics import Diagnostic, InternalError, Label
from streamsched.interp.dependencies import alias_roots, report_name, task_accesses
from streamsched.interp.ir import Edge, EventPlan, Schedule, Task
from streamsched.interp.fixes import drop_ref
from streamsched.interp.races import race_diagnostic

Lane = tuple[str, int]

SYNC_KERNELS = {"synchronize"}
"""Kernels that block the host on the device: never inside a captured graph (C003)."""
ALLOC_KERNELS = {"alloc"}
"""Kernels that allocate device memory: never inside a captured graph (C004)."""


def lane_of(capture: str, stream: str, unit: int) -> Lane:
    """The happens-before lane of an instruction or task (see the module docstring)."""
    return (stream, unit) if capture != "none" and unit >= 0 else (stream, -1)


def task_name(task: Task) -> str:
    """How diagnostics name a task: its label, else its statement name, else its kernel."""
    return task.label or task.stmt or task.kernel


def _where(task: Task) -> str:
    return f"{task.span.file}:{task.span.line}" if task.span is not None else f"task {task.id}"


@dataclass(frozen=True)
class Race:
    """Tasks `first` < `second` (ids) on different lanes touch overlapping bytes of `buffer` (as
    `report_name` picks it), at least one writes, and no happens-before path orders them."""

    first: int
    second: int
    buffer: str
    first_writes: bool
    second_writes: bool


@dataclass(frozen=True)
class WaitProblem:
    """A wait (instruction index `index`) that binds to no usable record: kind "never" (event
    never recorded), "later" (recorded only after the wait, first at `record`), or "isolation"
    (the latest record lies in another capture unit or outside, `record` its index)."""

    index: int
    kind: str
    record: int = -1


@dataclass(frozen=True)
class Unjoined:
    """Capture unit `unit` ends while lane (stream, unit) has work (last task `task`) that its
    home lane has not waited for."""

    unit: int
    stream: str
    task: int


@dataclass(frozen=True)
class PlanAnalysis:
    """What one happens-before walk over a plan finds (all tuples sorted)."""

    races: tuple[Race, ...]
    waits: tuple[WaitProblem, ...]
    unjoined: tuple[Unjoined, ...]
    unordered_after: tuple[tuple[int, int], ...] = ()
    """(u, v) for each `after` of task v naming task u that the plan does not order (plans from
    insert_barriers honour them all; a plan edited by hand may not)."""


def analyse_plan(plan: EventPlan, races_from: int = 0, first_race: bool = False, *,
                 stop_from: int | None = None, accesses=None, roots=None, afters=None) -> PlanAnalysis:
    """Walk `plan.instrs` once with vector clocks (module docstring) and return every race, every
    wait that binds to no usable record and every unjoined capture unit.

    races_from: only races whose later task has an id >= races_from are looked for;
    first_race: stop the walk at the first race found (the rest of the analysis is then partial);
    stop_from: stop at the first race whose later task has an id >= stop_from (what comes before
    that task's launch is then complete: the replay check of barriers.py shares one walk with
    validate_plan that way); accesses / roots: `task_accesses` / `alias_roots` of the schedule,
    when the caller has them (a replayed schedule's are its original's, repeated); afters: per
    task id, its `after` (default: the schedule's tasks'), which also sets the number of tasks:
    barriers.py's replays give their copies ids past the schedule's own and no task records.

    Raises InternalError (a broken plan, never a user mistake) when a task is not launched
    exactly once."""
    sched = plan.schedule
    tasks = sched.tasks
    capture = sched.capture
    acc = accesses if accesses is not None else task_accesses(sched)
    roots = roots if roots is not None else alias_roots(sched)
    stopped = False

    first_record: dict[int, int] = {}
    for i, ins in enumerate(plan.instrs):
        if ins.op == "record":
            first_record.setdefault(ins.event, i)

    # Lanes are numbered as first met (`lanes[id]` is the (stream, unit) pair): clocks, positions
    # and the per-segment tables are keyed by the number, which hashes and compares for free.
    lane_ids: dict[Lane, int] = {}
    lanes: list[Lane] = []
    pos: list[int] = []  # by lane id: the lane's position (launches and ends so far)
    clock: dict[int, dict[int, int]] = {}  # lane id -> its vector clock (lane id -> position)

    def lane_id(lane: Lane) -> int:
        x = lane_ids.get(lane)
        if x is None:
            x = lane_ids[lane] = len(lanes)
            lanes.append(lane)
            pos.append(0)
        return x

    records: dict[int, tuple[int, int, dict[int, int]]] = {}  # event -> (index, unit, clock)
    # Accesses per segment and lane: [task ids of all accesses in lane order, position of the
    # last access, position of the last write (0: none)].  A write races with any access, a read
    # with writes; the lane's accesses are covered when its last one (or last write) is.  A
    # task's position is loc_pos[task] (positions ascend along the list); its names and access
    # kinds are read back from `acc` only for a race.
    n_segs = 1 + max((a[-1][0] for a in acc if a), default=-1)  # (a task's accesses are sorted by segment)
    segs: list[dict[int, list] | None] = [None] * n_segs  # by segment id: lane id -> entry
    unit_touched: dict[int, list[tuple[int, int]]] = defaultdict(list)  # (segment, lane id) entries made
    unit_tasks: dict[int, list[int]] = defaultdict(list)
    races: dict[tuple[int, int], Race] = {}
    unordered_after: list[tuple[int, int]] = []
    waits: list[WaitProblem] = []
    unjoined: list[Unjoined] = []

    def access_of(u: int, seg: int) -> tuple[bool, str]:
        for s_, rn, wn in acc[u]:
            if s_ == seg:
                return bool(wn), wn or rn
        raise InternalError(f"analyse_plan: task {u} has no access to segment {seg}")

    if afters is None:
        afters = [t.after for t in tasks]
    n_tasks = len(afters)
    cap = capture != "none"
    # task -> the lane (id) and position that cover it now (lists by task id: a dict of pairs
    # costs ten times the memory on large plans); lane -1: not launched yet
    loc_lane: list[int] = [-1] * n_tasks
    loc_pos: list[int] = [0] * n_tasks
    pos_of = loc_pos.__getitem__
    clock_get = clock.get
    for i, ins in enumerate(plan.instrs):
        op = ins.op
        if op == "launch":
            v = ins.task
            if not 0 <= v < n_tasks or loc_lane[v] >= 0:
                raise InternalError(f"insert_barriers: task {v} is launched twice or does not exist (instruction {i})")
            unit = ins.unit if cap and ins.unit >= 0 else -1  # lane_of
            lane = lane_ids.get((ins.stream, unit))
            if lane is None:
                lane = lane_id((ins.stream, unit))
            c = clock_get(lane)
            if c is None:
                c = clock[lane] = {}
            p = pos[lane] = pos[lane] + 1
            c[lane] = p
            cget = c.get
            for u in afters[v]:
                lu = loc_lane[u] if 0 <= u < n_tasks else -1
                if lu < 0 or (lu != lane and cget(lu, 0) < loc_pos[u]):
                    unordered_after.append((u, v))
            loc_lane[v] = lane
            loc_pos[v] = p
            raced = False
            check = v >= races_from
            in_unit = unit >= 0
            touched = unit_touched[unit] if in_unit else None
            for seg, rname, wname in acc[v]:
                by_lane = segs[seg]
                if by_lane is None:
                    segs[seg] = {lane: [[v], p, p if wname else 0]}
                    if in_unit:
                        touched.append((seg, lane))
                    continue
                mine = None
                if check:
                    k = 1 if wname else 2
                    for other, e in by_lane.items():
                        if other == lane:
                            mine = e  # program order
                        elif e[k] > cget(other, 0):
                            # not all covered: each access (write, for a read) after what v's lane has seen
                            seen = cget(other, 0)
                            vw, vname = bool(wname), wname or rname
                            ts = e[0]
                            for u in ts[bisect_right(ts, seen, key=pos_of):]:
                                if (u, v) not in races:
                                    uw, uname = access_of(u, seg)
                                    if uw or wname:
                                        races[(u, v)] = Race(u, v, report_name(uname, vname, roots), uw, vw)
                                        raced = True
                else:
                    mine = by_lane.get(lane)
                if mine is None:
                    by_lane[lane] = [[v], p, p if wname else 0]
                    if in_unit:
                        touched.append((seg, lane))
                else:
                    mine[0].append(v)
                    mine[1] = p
                    if wname:
                        mine[2] = p
            if in_unit:
                unit_tasks[unit].append(v)
            if first_race and races:
                stopped = True
                break
            if stop_from is not None and v >= stop_from and raced:
                stopped = True
                break
        elif op == "record":
            unit = ins.unit if cap and ins.unit >= 0 else -1  # (lane_of and lane_id, inline)
            lane = lane_ids.get((ins.stream, unit))
            if lane is None:
                lane = lane_id((ins.stream, unit))
            c = clock_get(lane)
            records[ins.event] = (i, unit, c.copy() if c is not None else {})
        elif op == "wait":
            unit = ins.unit if cap and ins.unit >= 0 else -1  # (lane_of and lane_id, inline)
            lane = lane_ids.get((ins.stream, unit))
            if lane is None:
                lane = lane_id((ins.stream, unit))
            bound = records.get(ins.event)
            if bound is None:
                later = first_record.get(ins.event)
                waits.append(WaitProblem(i, "never" if later is None else "later", -1 if later is None else later))
                continue
            if cap and bound[1] != unit:
                # CUDA refuses a capture-time wait on an event from outside the capture
                # (cudaErrorStreamCaptureIsolation): it orders nothing.
                waits.append(WaitProblem(i, "isolation", bound[0]))
                continue
            c = clock_get(lane)
            if c is None:
                c = clock[lane] = {}
            cget = c.get
            for k, val in bound[2].items():
                if val > cget(k, 0):
                    c[k] = val
        elif op == "begin" and cap:
            clock[lane_id((ins.stream, ins.unit))] = dict(clock.get(lane_id((ins.stream, -1)), {}))
        elif op == "end" and cap:
            u_id = ins.unit
            home = lane_id((ins.stream, ins.unit))
            hc = clock.get(home, {})
            members = unit_tasks.pop(u_id, ())
            last: dict[int, tuple[int, int]] = {}  # lane of the unit -> (position, task) of its last launch
            for t in members:
                last[loc_lane[t]] = (loc_pos[t], t)
            for lane, (p, t) in sorted(last.items(), key=lambda x: lanes[x[0]]):
                if lane != home and hc.get(lane, 0) < p:
                    unjoined.append(Unjoined(u_id, lanes[lane][0], t))
            eager = lane_id((ins.stream, -1))
            pos[eager] += 1
            e_pos = clock.setdefault(eager, {})[eager] = pos[eager]
            # After `end`, the unit's work is known outside only as a whole, through the end.
            for seg, lane in unit_touched.pop(u_id, ()):
                by_lane = segs[seg]
                moved = by_lane.pop(lane)
                e = by_lane.get(eager)
                if e is None:
                    moved[1] = e_pos
                    if moved[2]:
                        moved[2] = e_pos
                    by_lane[eager] = moved
                else:
                    e[0].extend(moved[0])
                    e[1] = e_pos
                    if moved[2]:
                        e[2] = e_pos
            for t in members:
                loc_lane[t] = eager
                loc_pos[t] = e_pos
            for lane in last:
                clock.pop(lane, None)
            clock.pop(home, None)
    missing = [t for t in range(n_tasks) if loc_lane[t] < 0]
    if missing and not stopped:
        raise InternalError(f"insert_barriers: tasks {missing[:5]} are never launched")
    return PlanAnalysis(
        tuple(sorted(races.values(), key=lambda r: (r.second, r.first))),
        tuple(waits),
        tuple(unjoined),
        tuple(unordered_after),
    )


def find_races(plan: EventPlan) -> tuple[Race, ...]:
    """Every unordered conflicting pair of the plan, one Race per pair, sorted by (second,
    first).  Exact: what `validate_plan` reports as R001 before merging repeats."""
    return analyse_plan(plan).races


def _access_view(task: Task, name: str, writes: bool) -> Task:
    """`task` as seen from one access: race_diagnostic names the access kind by whether the
    buffer is among the task's writes, so the view touches exactly `name`, read or written."""
    return replace(task, args=() if writes else (name,), outs=(name,) if writes else ())


def _race_diagnostics(sched: Schedule, races: tuple[Race, ...]) -> list[Diagnostic]:
    tasks = sched.tasks
    groups: dict[tuple, list[Race]] = {}
    for r in races:
        a, b = tasks[r.first], tasks[r.second]
        if a.span is not None and b.span is not None:
            # The same two source lines racing in every unrolled step, slot or op call are one
            # mistake to fix: report it once.
            key = (a.span, b.span, a.stream, b.stream, r.first_writes, r.second_writes, _base(r.buffer))
        else:
            key = (r.first, r.second)
        groups.setdefault(key, []).append(r)
    out = []
    for rs in groups.values():
        r = rs[0]
        a, b = tasks[r.first], tasks[r.second]
        d = race_diagnostic(sched, _access_view(a, r.buffer, r.first_writes), _access_view(b, r.buffer, r.second_writes), r.buffer)
        notes = list(d.notes)
        for t, w in ((a, r.first_writes), (b, r.second_writes)):
            used = t.writes if w else t.reads
            if r.buffer not in used and used:
                notes.append(f"`{task_name(t)}` {'writes' if w else 'reads'} `{used[0]}`, which shares bytes with `{r.buffer}`")
        if len(rs) > 1:
            notes.append(f"the same race occurs {len(rs) - 1} more time{'s' if len(rs) > 2 else ''} in the unrolled schedule (other steps, slots or op calls)")
        out.append(replace(d, notes=tuple(notes)))
    return out


def _base(buffer: str) -> str:
    """`x[a]` and `x[b]` are one buffer to the user: repeats of a race in the other slot merge."""
    return re.sub(r"\[[A-Za-z_][A-Za-z0-9_]*\]", "", buffer)


def _dedupe(diags: list[Diagnostic]) -> list[Diagnostic]:
    """Drop repeats of a finding at the same source position (unrolled steps repeat work);
    findings without a position are all kept, and so are races, which `_race_diagnostics` has
    already merged per source lines, buffer and kind (two races at one position on different
    buffers or of different kinds are two findings)."""
    seen, out = set(), []
    for d in diags:
        if d.span is not None and d.code != "R001":
            key = (d.code, d.span, tuple(l.span for l in d.labels))
            if key in seen:
                continue
            seen.add(key)
        out.append(d)
    return out


def _own_analysis(plan: EventPlan) -> PlanAnalysis:
    """The analysis of the plan itself: the part of insert_barriers' replay walk that covers the
    plan's own instructions (a walk is causal: what follows changes nothing before it), else a
    walk of its own."""
    kept = plan.analysis
    if kept is None or kept[4] is not plan.instrs or kept[5] is not plan.schedule:
        return analyse_plan(plan)  # (none kept, or the plan was edited: `replace` copies the field)
    an, n_tasks, n_instrs, n_units = kept[:4]
    return PlanAnalysis(
        tuple(r for r in an.races if r.second < n_tasks),
        tuple(w for w in an.waits if w.index < n_instrs),
        tuple(u for u in an.unjoined if u.unit < n_units),
        tuple((u, v) for u, v in an.unordered_after if v < n_tasks),
    )


def validate_plan(plan: EventPlan, edges: tuple[Edge, ...] | list[Edge] = ()) -> tuple[Diagnostic, ...]:
    """Diagnostics of an EventPlan: R003 for each wait that binds to no record issued before it
    (never recorded, recorded only later, or recorded outside the wait's capture unit), R004
    for each capture unit that ends with a secondary stream not joined to its home, and R001 for
    each unordered conflicting pair (via `race_diagnostic`; pairs repeated at the same source
    lines in other steps are merged into one with a note).

    `edges` (from `dependencies`) is accepted so the pipeline reads pass to pass; races are
    found from byte overlaps directly, which is exact, so the plan alone decides.  Plans edited
    by hand (a wait removed) are checked like any other.  Follows ARCHITECTURE.md "Semantics to
    hold on to" and CUDA's cudaStreamWaitEvent rule (a wait binds to the latest record issued
    before it; none means it waits for nothing)."""
    sched = plan.schedule
    an = _own_analysis(plan)
    units = {u.id: u for u in sched.units}
    diags: list[Diagnostic] = []
    for w in an.waits:
        ins = plan.instrs[w.index]
        task = sched.tasks[ins.task] if 0 <= ins.task < len(sched.tasks) else None
        unit = units.get(ins.unit)
        span = task.span if task is not None else (unit.span if unit is not None else None)
        who = f"`{task_name(task)}`" if task is not None else (f"unit `{unit.name}`" if unit else f"instruction {w.index}")
        if w.kind == "never":
            msg = f"wait on event e{ins.event} on {ins.stream} (before {who}) waits for nothing: the event is never recorded"
        elif w.kind == "later":
            msg = f"wait on event e{ins.event} on {ins.stream} (before {who}) waits for nothing: the event is recorded only later, at instruction {w.record}"
        else:
            msg = f"wait on event e{ins.event} on {ins.stream} (before {who}) crosses a capture boundary: the event is recorded outside the wait's graph"
        diags.append(Diagnostic("R003", msg, span, help="a wait binds to the latest record issued before it; record the event earlier, in the same graph"))
    for uj in an.unjoined:
        unit = units.get(uj.unit)
        last = sched.tasks[uj.task]
        name = unit.name if unit is not None else f"U{uj.unit}"
        home = unit.home if unit is not None else "its home stream"
        labels = (Label(last.span, f"last work on {uj.stream} in `{name}`"),) if last.span is not None else ()
        diags.append(
            Diagnostic(
                "R004",
                f"capture unit `{name}` ends while {uj.stream} has not rejoined {home}",
                unit.span if unit is not None and unit.span is not None else last.span,
                help=f"{home} must wait on an event recorded after the last work on {uj.stream} before the graph ends",
                labels=labels,
            )
        )
    diags.extend(_race_diagnostics(sched, an.races))
    return tuple(_dedupe(diags))


def _cycle_path(schedule: Schedule, edges: tuple[Edge, ...] | list[Edge], src: int, dst: int) -> list[tuple[int, int, str]] | None:
    """Shortest chain of required edges or same-stream program order from task `src` to task
    `dst` (src < dst), as (u, v, description) triples; None when there is none."""
    succ: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for e in edges:
        if src <= e.u < e.v <= dst:
            desc = "after" if e.kind == "AFTER" else f"{e.kind} on `{e.buffer}`"
            succ[e.u].append((e.v, desc))
    last: dict[str, int] = {}
    for t in schedule.tasks[src: dst + 1]:
        if t.stream in last:
            succ[last[t.stream]].append((t.id, f"stream order on {t.stream}"))
        last[t.stream] = t.id
    parent: dict[int, tuple[int, str]] = {}
    queue = deque([src])
    seen = {src}
    while queue:
        x = queue.popleft()
        if x == dst:
            path = []
            while x != src:
                p, desc = parent[x]
                path.append((p, x, desc))
                x = p
            return path[::-1]
        for y, desc in sorted(succ.get(x, ())):
            if y not in seen:
                seen.add(y)
                parent[y] = (x, desc)
                queue.append(y)
    return None


def validate_step(launches) -> tuple[Diagnostic, ...]:
    """R002 for a step statement ordered `after` a launch that the step issues later, or after
    itself: a wait binds only to a record issued before it, so that order can never hold (two
    launches naming each other are the same mistake on the earlier one).  `launches` are the
    step's statements (dsl.program.Launch, as Schedule.launches holds them); `after prev.G` is
    always fine.  The fix offered is `after prev.G`, the previous step's launch."""
    from streamsched.interp.fixes import replace_ref

    def where(ln) -> str:
        return f"{ln.span.file}:{ln.span.line}" if ln.span is not None else "the step"

    out: list[Diagnostic] = []
    for li, ln in enumerate(launches):
        for r in ln.after:
            if r.prev:
                continue
            js = [j for j, other in enumerate(launches) if other.ref == r.graph]
            if not js or any(j < li for j in js):
                continue
            target = launches[js[0]]
            if js[0] == li:
                msg = f"dependency cycle: `{ln.text}` ({where(ln)}) is ordered after itself"
                labels: tuple[Label, ...] = ()
            else:
                back = any(not x.prev and x.graph == ln.ref for x in target.after)
                msg = (f"dependency cycle: `{ln.text}` ({where(ln)}) -[after]-> `{target.text}` ({where(target)}) "
                       f"-[{'after' if back else 'issued first'}]-> `{ln.text}`")
                labels = (Label(target.span, "issued here, later in the step" + (f", and ordered after `{ln.text}`"
                                                                                 if back else "")),) \
                    if target.span is not None else ()
            fixes = replace_ref(ln.after_clauses, r.graph, f"prev.{r.graph}")
            move = f", or move it below `{target.text}`" if js[0] != li else ""
            out.append(Diagnostic(
                "R002", msg, r.span, labels=labels, fixes=fixes,
                help=f"`after {r.graph}` names {'this very launch' if js[0] == li else 'a launch the step issues later'}; "
                     f"write `after prev.{r.graph}` to order `{ln.text}` after the previous step's `{r.graph}`{move}"))
    return tuple(out)


def validate_schedule(schedule: Schedule, edges: tuple[Edge, ...] | list[Edge]) -> tuple[Diagnostic, ...]:
    """Diagnostics of a schedule before planning.

    R002: an `after` naming a task issued at or after its own task; with the required edges and
    program order it closes a cycle, printed edge by edge with source lines (a wait can only bind
    to an earlier record, so issue order itself closes the cycle when nothing else does).
    C003 / C004: a `synchronize` / an `alloc` task inside a capture unit when capture is graphs or
    step (a CUDA graph can hold neither: CUDA_PITFALLS.md #4, #17).  `edges` are those of
    `dependencies(schedule)`.  Never raises for user mistakes."""
    tasks = schedule.tasks
    units = {u.id: u for u in schedule.units}
    diags: list[Diagnostic] = []
    for t in tasks:
        for a in t.after:
            if not t.id <= a < len(tasks):
                continue
            target = tasks[a]
            if a == t.id:
                cycle = [(a, a, "after")]
            else:
                path = _cycle_path(schedule, edges, t.id, a)
                if path is None:
                    path = [(t.id, a, "issued first")]
                cycle = path + [(a, t.id, "after")]
            parts = [f"`{task_name(tasks[cycle[0][0]])}` ({_where(tasks[cycle[0][0]])})"]
            labels = []
            notes = []
            for u, v, desc in cycle:
                parts.append(f"-[{desc}]-> `{task_name(tasks[v])}` ({_where(tasks[v])})")
                notes.append(f"`{task_name(tasks[u])}` ({_where(tasks[u])}) -> `{task_name(tasks[v])}` ({_where(tasks[v])}): {desc}")
                if tasks[v].span is not None and v != t.id:
                    labels.append(Label(tasks[v].span, f"must run after `{task_name(tasks[u])}` ({desc})"))
            ref = (target.site.op if target.site is not None and target.site.op else target.stmt) or task_name(target)
            fixes = drop_ref(t.site.op_afters, ref) if t.site is not None else ()
            diags.append(
                Diagnostic(
                    "R002",
                    "dependency cycle: " + " ".join(parts),
                    t.span,
                    help=f"`after {ref}` names work issued later; reorder the statements or drop the clause",
                    labels=tuple(labels),
                    notes=tuple(notes),
                    fixes=fixes,
                )
            )
    if schedule.capture == "step":
        rewrites: dict = {}  # step statement's span -> (first host task, its buffers): one finding each
        for t in tasks:
            waited = t.attr("waits_in_step_graph")
            if waited:
                launches = schedule.launches
                at = launches[t.launch].span if 0 <= t.launch < len(launches) and launches[t.launch].span else t.span
                first, bufs = rewrites.setdefault(at, (t, []))
                bufs.extend(b for b in map(_base, t.outs) if b not in bufs)  # the slots are one name
        for at, (t, bufs) in rewrites.items():
            copy = tasks[t.attr("waits_in_step_graph")[0]]
            shown = ", ".join(f"`{b}`" for b in bufs) or "a staging buffer"
            labels = (Label(copy.span, f"`{task_name(copy)}` reads the first value here"),) \
                if copy.span is not None and copy.span != at else ()
            diags.append(Diagnostic(
                "C003", f"`{task_name(t)}` rewrites the pinned buffer{'s' if len(bufs) > 1 else ''} {shown} in a "
                        f"step that already copies {'them' if len(bufs) > 1 else 'it'}: under capture = step the "
                        f"whole step is one CUDA graph, so the host would have to wait inside that graph for "
                        f"`{task_name(copy)}` before writing again", at, labels=labels,
                help="run with `capture = graphs` (the host waits between graph launches), or "
                     + ("upload it once per step" if t.kernel == "set_scalar" else
                        "give the graph slots (`graph NAME[a, b]`) so that each copy has a staging buffer "
                        "of its own")))
        for t in tasks:
            if t.kernel in SYNC_KERNELS and t.attr("in_step_graph"):
                diags.append(Diagnostic("C003", "`synchronize` in the step under capture = step: the whole step is "
                                        "one CUDA graph, which cannot synchronize with the host", t.span,
                                        help="run with `capture = graphs` (one graph per launch, the host "
                                             "synchronizes between them), or drop the `synchronize`"))
    if schedule.capture != "none":
        for t in tasks:
            if t.unit < 0 or t.kernel not in SYNC_KERNELS | ALLOC_KERNELS:
                continue
            unit = units.get(t.unit)
            gname = unit.graph or unit.name if unit is not None else f"U{t.unit}"
            if t.kernel in SYNC_KERNELS:
                diags.append(Diagnostic("C003", f"`{t.kernel}` inside captured graph `{gname}`: a CUDA graph cannot synchronize with the host", t.span,
                                        help="move it out of the graph, or run with capture = none"))
            else:
                diags.append(Diagnostic("C004", f"`{t.kernel}` inside captured graph `{gname}`: a CUDA graph cannot allocate memory", t.span,
                                        help="plan the buffer before capture (it then needs no allocation), or run with capture = none"))
    return tuple(_dedupe(diags))
