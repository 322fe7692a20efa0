"""The checker's analyses as they were before issue 16 made them scale (git main at 3225a58),
kept verbatim as a reference: tests/test_checker_scale.py checks that the faster versions
return exactly what these did, on random schedules and plans.  Not used by streamsched."""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import replace

from streamsched.diagnostics import InternalError
from streamsched.interp.dependencies import KIND_ORDER, _check_ids, alias_roots, report_name, task_accesses
from streamsched.interp.ir import Edge, EventPlan, Schedule
from streamsched.interp.validate import PlanAnalysis, Race, Unjoined, WaitProblem, lane_of


def analyse_plan(plan: EventPlan, races_from: int = 0, first_race: bool = False, *,
                 stop_from: int | None = None, accesses=None, roots=None) -> PlanAnalysis:
    """Walk `plan.instrs` once with vector clocks (module docstring) and return every race, every
    wait that binds to no usable record and every unjoined capture unit.

    races_from: only races whose later task has an id >= races_from are looked for;
    first_race: stop the walk at the first race found (the rest of the analysis is then partial);
    stop_from: stop at the first race whose later task has an id >= stop_from (what comes before
    that task's launch is then complete: the replay check of barriers.py shares one walk with
    validate_plan that way); accesses / roots: `task_accesses` / `alias_roots` of the schedule,
    when the caller has them (a replayed schedule's are its original's, repeated).

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

    clock: dict[Lane, dict[Lane, int]] = {}
    pos: dict[Lane, int] = defaultdict(int)
    records: dict[int, tuple[int, int, dict[Lane, int]]] = {}  # event -> (index, unit, clock)
    loc: dict[int, tuple[Lane, int]] = {}  # task -> the (lane, position) that covers it now
    # Accesses per segment and lane: (positions, entries), all accesses and writes only.
    seg_all: dict[int, dict[Lane, tuple[list[int], list[tuple[int, bool, str]]]]] = defaultdict(dict)
    seg_w: dict[int, dict[Lane, tuple[list[int], list[tuple[int, bool, str]]]]] = defaultdict(dict)
    unit_touched: dict[int, set[tuple[int, Lane]]] = defaultdict(set)
    unit_last: dict[int, dict[Lane, tuple[int, int]]] = defaultdict(dict)
    unit_tasks: dict[int, list[int]] = defaultdict(list)
    races: dict[tuple[int, int], Race] = {}
    unordered_after: list[tuple[int, int]] = []
    waits: list[WaitProblem] = []
    unjoined: list[Unjoined] = []

    for i, ins in enumerate(plan.instrs):
        if ins.op == "launch":
            v = ins.task
            if not 0 <= v < len(tasks) or v in loc:
                raise InternalError(f"insert_barriers: task {v} is launched twice or does not exist (instruction {i})")
            lane = lane_of(capture, ins.stream, ins.unit)
            c = clock.setdefault(lane, {})
            pos[lane] += 1
            p = c[lane] = pos[lane]
            for u in tasks[v].after:
                lu, pu = loc.get(u, (None, 0))
                if lu is None or (lu != lane and c.get(lu, 0) < pu):
                    unordered_after.append((u, v))
            loc[v] = (lane, p)
            raced = False
            for seg, rname, wname in acc[v]:
                vw = bool(wname)
                vname = wname or rname
                table = seg_all[seg] if vw else seg_w[seg]
                for other, (ps, es) in table.items() if v >= races_from else ():
                    if other == lane:
                        continue  # program order
                    for u, uw, uname in es[bisect_right(ps, c.get(other, 0)):]:
                        if (u, v) not in races:
                            races[(u, v)] = Race(u, v, report_name(uname, vname, roots), uw, vw)
                            raced = True
                entry = (v, vw, vname)
                ps, es = seg_all[seg].setdefault(lane, ([], []))
                ps.append(p)
                es.append(entry)
                if vw:
                    ps, es = seg_w[seg].setdefault(lane, ([], []))
                    ps.append(p)
                    es.append(entry)
                if lane[1] >= 0:
                    unit_touched[lane[1]].add((seg, lane))
            if lane[1] >= 0:
                unit_last[lane[1]][lane] = (p, v)
                unit_tasks[lane[1]].append(v)
            if first_race and races:
                stopped = True
                break
            if stop_from is not None and v >= stop_from and raced:
                stopped = True
                break
        elif ins.op == "record":
            lane = lane_of(capture, ins.stream, ins.unit)
            records[ins.event] = (i, lane[1], dict(clock.get(lane, {})))
        elif ins.op == "wait":
            lane = lane_of(capture, ins.stream, ins.unit)
            bound = records.get(ins.event)
            if bound is None:
                later = first_record.get(ins.event)
                waits.append(WaitProblem(i, "never" if later is None else "later", -1 if later is None else later))
                continue
            if capture != "none" and bound[1] != lane[1]:
                # CUDA refuses a capture-time wait on an event from outside the capture
                # (cudaErrorStreamCaptureIsolation): it orders nothing.
                waits.append(WaitProblem(i, "isolation", bound[0]))
                continue
            c = clock.setdefault(lane, {})
            for k, val in bound[2].items():
                if val > c.get(k, 0):
                    c[k] = val
        elif ins.op == "begin" and capture != "none":
            clock[(ins.stream, ins.unit)] = dict(clock.get((ins.stream, -1), {}))
        elif ins.op == "end" and capture != "none":
            u_id, home = ins.unit, (ins.stream, ins.unit)
            hc = clock.get(home, {})
            for lane, (p, t) in sorted(unit_last.get(u_id, {}).items()):
                if lane != home and hc.get(lane, 0) < p:
                    unjoined.append(Unjoined(u_id, lane[0], t))
            eager = (ins.stream, -1)
            pos[eager] += 1
            e_pos = clock.setdefault(eager, {})[eager] = pos[eager]
            # After `end`, the unit's work is known outside only as a whole, through the end.
            for seg, lane in sorted(unit_touched.pop(u_id, ())):
                for table in (seg_all[seg], seg_w[seg]):
                    moved = table.pop(lane, None)
                    if moved:
                        ps, es = table.setdefault(eager, ([], []))
                        ps.extend([e_pos] * len(moved[1]))
                        es.extend(moved[1])
            for t in unit_tasks.pop(u_id, ()):
                loc[t] = (eager, e_pos)
            for lane in unit_last.pop(u_id, {}):
                clock.pop(lane, None)
            clock.pop(home, None)
    missing = [t.id for t in tasks if t.id not in loc]
    if missing and not stopped:
        raise InternalError(f"insert_barriers: tasks {missing[:5]} are never launched")
    return PlanAnalysis(
        tuple(sorted(races.values(), key=lambda r: (r.second, r.first))),
        tuple(waits),
        tuple(unjoined),
        tuple(unordered_after),
    )


def dependencies(schedule: Schedule) -> tuple[Edge, ...]:
    """Required edges u -> v (u.id < v.id) of `schedule`, sorted by (v, u, kind, buffer).

    RAW: v reads bytes whose last writer is u.  WAW: v writes bytes whose last writer is u.
    WAR: v writes bytes u read since their last write.  AFTER: u in v.after with u < v (an
    `after` naming a later task is a cycle: `validate_schedule` reports it, R002, and it yields no
    edge here).  Same-stream edges are included; barrier insertion skips them as covered by stream
    order.  The closure of these edges orders every pair of conflicting accesses (each later
    writer of a segment follows the previous one by WAW), which is what barrier insertion needs.

    Cost: O(sum of segments per access + edges).  Raises InternalError (never a user mistake) if
    task ids are not 0..n-1 in issue order or an `after` names a task that does not exist.
    """
    _check_ids(schedule)
    roots = alias_roots(schedule)
    acc = task_accesses(schedule)
    last_w: dict[int, tuple[int, str]] = {}
    readers: dict[int, list[tuple[int, str]]] = {}
    seen: dict[tuple[int, int, str, str], Edge] = {}

    def add(u: int, v: int, kind: str, buf: str) -> None:
        key = (u, v, kind, buf)
        if key not in seen:
            seen[key] = Edge(u, v, kind, buf)

    for t in schedule.tasks:
        v = t.id
        for seg, rname, wname in acc[v]:
            w = last_w.get(seg)
            if rname and w is not None and w[0] != v:
                add(w[0], v, "RAW", report_name(w[1], rname, roots))
            if wname:
                if w is not None and w[0] != v:
                    add(w[0], v, "WAW", report_name(w[1], wname, roots))
                for r, rn in readers.get(seg, ()):
                    if r != v:
                        add(r, v, "WAR", report_name(rn, wname, roots))
                last_w[seg] = (v, wname)
                readers[seg] = []
            else:
                lst = readers.setdefault(seg, [])
                if not lst or lst[-1][0] != v:
                    lst.append((v, rname))
        for a in t.after:
            if a < v:
                add(a, v, "AFTER", "")
    return tuple(sorted(seen.values(), key=lambda e: (e.v, e.u, KIND_ORDER[e.kind], e.buffer)))


def _replayed(plan: EventPlan, m: int, copies: int) -> tuple[EventPlan, dict[int, tuple[int, int]]] | None:
    """The plan followed by `copies` more issues of its last m steps, as the training loop
    issues them: each copy's tasks and units get new ids (and steps m later), its `after` names
    the copies or unrolled tasks m steps later than the original's.  Also returns, per copied
    task id, (original task id, copy number).  None when a task has no key (tasks are matched
    across steps by `Task.key`)."""
    s = plan.schedule
    steps, n, nu = s.steps, len(s.tasks), len(s.units)
    if any(not t.key for t in s.tasks if t.step >= 0):
        return None
    at = {(t.step, t.key): t.id for t in s.tasks}
    block = [t for t in s.tasks if t.step >= steps - m]
    index = {t.id: i for i, t in enumerate(block)}
    bunits = sorted({t.unit for t in block if t.unit >= 0} | {i.unit for i in plan.instrs if i.step >= steps - m and i.unit >= 0})
    uindex = {u: i for i, u in enumerate(bunits)}
    units = {u.id: u for u in s.units}

    def copy_id(tid: int, rep: int) -> int:
        return n + (rep - 1) * len(block) + index[tid]

    def later(tid: int, k: int) -> int | None:
        """Task tid issued k steps later: unrolled, or in a copy."""
        t = s.tasks[tid]
        st = t.step + k
        if st < steps:
            return at.get((st, t.key))
        rep = (st - steps) // m + 1
        orig = at.get((st - rep * m, t.key))
        return copy_id(orig, rep) if orig is not None and orig in index else None

    tasks = list(s.tasks)
    new_units = list(s.units)
    origin: dict[int, tuple[int, int]] = {}
    for rep in range(1, copies + 1):
        for t in block:
            after = tuple(x for x in (later(a, rep * m) for a in t.after) if x is not None)
            unit = nu + (rep - 1) * len(bunits) + uindex[t.unit] if t.unit >= 0 else -1
            tasks.append(replace(t, id=copy_id(t.id, rep), step=t.step + rep * m, unit=unit, after=after))
            origin[copy_id(t.id, rep)] = (t.id, rep)
        for u in bunits:
            new_units.append(replace(units[u], id=nu + (rep - 1) * len(bunits) + uindex[u], step=units[u].step + rep * m))
    instrs = list(plan.instrs)
    for rep in range(1, copies + 1):
        for ins in plan.instrs:
            if ins.step >= steps - m:
                instrs.append(replace(
                    ins, task=copy_id(ins.task, rep) if ins.task >= 0 else -1, step=ins.step + rep * m,
                    unit=nu + (rep - 1) * len(bunits) + uindex[ins.unit] if ins.unit >= 0 else -1))
    ext = replace(s, tasks=tuple(tasks), units=tuple(new_units), steps=steps + copies * m)
    return EventPlan(ext, tuple(instrs), plan.num_events, plan.policy), origin


def _replay_check(plan: EventPlan, m: int, copies: int = 2):
    """(`_replay_ok`, what validate_plan may reuse): one walk over the plan and its replays that
    stops at the first race of a replay; its part over the plan itself is complete, kept as
    (analysis, tasks, instructions, units of the plan) for EventPlan.analysis (None when the
    tasks have no keys and nothing was walked)."""
    built = _replayed(plan, m, copies)
    if built is None:
        return False, None
    ext, origin = built
    s = plan.schedule
    n = len(s.tasks)
    acc = task_accesses(s)
    ext_acc = acc + tuple(acc[origin[i][0]] for i in range(n, len(ext.schedule.tasks)))
    an = analyse_plan(ext, stop_from=n, accesses=ext_acc, roots=alias_roots(s))
    ok = not any(r.second >= n for r in an.races) and not any(w.index >= len(plan.instrs) for w in an.waits) \
        and not any(v >= n for _, v in an.unordered_after)
    return ok, (an, n, len(plan.instrs), len(s.units), plan.instrs, s)
