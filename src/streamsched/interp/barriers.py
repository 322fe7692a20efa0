"""Barrier insertion: `insert_barriers(schedule, edges, policy)` turns a schedule and its required
edges into an EventPlan (launch / record / wait / begin / end in one global issue order) whose
happens-before order is exactly what the policy asks for.

Policies (LANGUAGE.md, "Barrier policies"):

    auto      every required edge across lanes becomes a wait unless the waiting lane's vector
              clock already covers it (ARCHITECTURE.md, "Semantics to hold on to"): minimal
    chain     the seed's policy (seed 000, sections 五 and 八): an op's representative stream
              waits on the previous op's output stream, forked kernels wait on the op's start,
              graphs fork from and join back to their home, graph launches are ordered as ops
    explicit  only the user's `after` clauses (plus the fork/join a capture unit needs)

Lanes and happens-before are those of `validate.py`: under capture = graphs | step each capture
unit is bracketed by begin/end on its home stream, forks to its secondary streams after `begin`
and joins them before `end`; every wait inside a unit binds to a record inside it, and edges that
cross units are coarsened to unit level (record after the producer's `end`, wait before the
consumer's `begin`).  Records are placed right after the work they mark and only where a wait
binds to them; events are shared by tasks with equal `Task.key` (periodic steps reuse events)
when that cannot change what any wait binds to.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from streamsched.diagnostics import InternalError
from streamsched.interp.ir import HOST, Edge, EventPlan, Instr, Schedule, Task

Lane = tuple[str, int]

POLICIES = ("auto", "chain", "explicit")
CAPTURES = ("none", "graphs", "step")


@dataclass
class _Anchor:
    """A point of a lane a wait can bind to: after a task's launch, after a unit's `end`, or a
    marked point (a fork).  `clock` is the lane's vector clock there; `idx` the index of the
    instruction a record for it follows; `share` the key of events it may share."""

    lane: Lane
    pos: int
    clock: dict[Lane, int]
    idx: int
    share: tuple | None
    step: int
    task: int


class _Planner:
    """One planning run; instructions are built with abstract events (anchor ids) and given
    concrete event numbers at the end (`_assemble`)."""

    def __init__(self, schedule: Schedule, edges, policy: str):
        self.s = schedule
        self.policy = policy
        self.tasks = schedule.tasks
        self.units = {u.id: u for u in schedule.units}
        self.rank = {s: i for i, s in enumerate(schedule.streams)}
        self.ins: list[list] = []  # [op, stream, task, anchor, unit, step]
        self.anchors: list[_Anchor] = []
        self.clock: dict[Lane, dict[Lane, int]] = {}
        self.pos: dict[Lane, int] = defaultdict(int)
        self.lane_last: dict[Lane, int] = {}
        self.task_anchor: dict[int, int] = {}
        self.unit_end: dict[int, int] = {}
        self.waited: set[int] = set()
        self.preds: dict[int, list[int]] = defaultdict(list)
        for e in edges:
            if e.u >= e.v:
                raise InternalError(f"insert_barriers: edge {e.u} -> {e.v} does not follow issue order (validate_schedule reports cycles first)")
            # The interpreter orders the host's own accesses under every policy (LANGUAGE.md,
            # "The host": it waits on the copy that last read a staging slot before rewriting
            # it); the user has no statement to write an `after` on a staging write.
            host = self.tasks[e.u].stream == HOST or self.tasks[e.v].stream == HOST
            if policy == "auto" or e.kind == "AFTER" or host:
                self.preds[e.v].append(e.u)

    # -- primitives -------------------------------------------------------------------------

    def _anchor(self, lane: Lane, share: tuple | None, step: int, task: int = -1) -> int:
        self.pos[lane] += 1
        c = self.clock.setdefault(lane, {})
        c[lane] = self.pos[lane]
        self.anchors.append(_Anchor(lane, self.pos[lane], dict(c), len(self.ins) - 1, share, step, task))
        aid = len(self.anchors) - 1
        self.lane_last[lane] = aid
        return aid

    def _launch(self, t: Task, lane: Lane) -> None:
        self.ins.append(["launch", t.stream, t.id, -1, lane[1], t.step])
        share = ("task", t.key, t.stream) if t.key else None
        self.task_anchor[t.id] = self._anchor(lane, share, t.step, t.id)

    def _mark(self, lane: Lane, share: tuple | None, step: int) -> int:
        """A point on `lane` that others may wait on (a fork); dropped unless a wait binds to it."""
        self.ins.append(["mark", lane[0], -1, -1, lane[1], step])
        aid = self._anchor(lane, share, step)
        self.ins[-1][3] = aid
        return aid

    def _sync(self, lane: Lane, aids, task: int, step: int) -> None:
        """Make `lane` wait for every anchor in `aids`, emitting as few waits as possible: skip
        anchors its clock covers, keep the latest per lane, drop any implied by another (the
        clock of a join covers an anchor iff one of the joined clocks does), and join."""
        c = self.clock.setdefault(lane, {})
        latest: dict[Lane, int] = {}
        for a in aids:
            if a is None:
                continue
            A = self.anchors[a]
            if c.get(A.lane, 0) >= A.pos:
                continue
            b = latest.get(A.lane)
            if b is None or self.anchors[b].pos < A.pos:
                latest[A.lane] = a
        cand = list(latest.values())
        keep = [
            a for a in cand
            if not any(b != a and self.anchors[b].clock.get(self.anchors[a].lane, 0) >= self.anchors[a].pos for b in cand)
        ]
        keep.sort(key=lambda a: (self.rank.get(self.anchors[a].lane[0], len(self.rank)), self.anchors[a].lane[1], a))
        for a in keep:
            self.ins.append(["wait", lane[0], task, a, lane[1], step])
            self.waited.add(a)
            for k, v in self.anchors[a].clock.items():
                if v > c.get(k, 0):
                    c[k] = v

    # -- shared pieces ----------------------------------------------------------------------

    def _unit_share(self, unit: int, role: str) -> tuple | None:
        u = self.units.get(unit)
        return (role, u.graph, u.slot, u.home) if u is not None and u.graph else None

    def _op_runs(self, tasks: list[Task]) -> list[list[Task]]:
        """Maximal runs of consecutive tasks of one op call (a task of no op is a run alone).
        Host tasks take no part in the chain: the host's accesses are ordered by their edges."""
        runs: list[list[Task]] = []
        for t in tasks:
            if t.stream == HOST:
                continue
            if runs and t.op >= 0 and runs[-1][-1].op == t.op:
                runs[-1].append(t)
            else:
                runs.append([t])
        return runs

    @staticmethod
    def _rep(run: list[Task]) -> str:
        return run[0].rep_stream or run[0].stream

    # -- capture = none -----------------------------------------------------------------------

    def plan_flat(self) -> None:
        """Every task stands alone on its stream's lane.  Units matter only to chain and explicit,
        whose fork/join then are ordinary waits (ir.Unit)."""
        tasks = list(self.tasks)
        use_units = self.policy != "auto"
        chain = self.policy == "chain"
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for t in tasks:
            if t.unit >= 0:
                first.setdefault(t.unit, t.id)
                last[t.unit] = t.id
        fork: dict[int, int | None] = {}
        entered: dict[int, set[str]] = defaultdict(set)
        last_on: dict[int, dict[str, int]] = defaultdict(dict)
        prev_unit_end: int | None = None
        run_of: dict[int, list[Task]] = {}
        for run in self._op_runs(tasks) if chain else ():
            for t in run:
                run_of[t.id] = run
        prev_out: int | None = None
        op_fork: int | None = None
        op_seen: set[str] = set()
        for v in tasks:
            lane = (v.stream, -1)
            aids: list[int | None] = []
            unit = self.units.get(v.unit) if use_units and v.unit >= 0 else None
            if unit is not None:
                home = (unit.home, -1)
                if v.id == first[v.unit]:
                    if chain:  # graph launches are ordered as ops
                        self._sync(home, [prev_unit_end], -1, unit.step)
                    secondary = any(t.stream != unit.home for t in tasks[first[v.unit]: last[v.unit] + 1] if t.unit == v.unit)
                    fork[v.unit] = self._mark(home, self._unit_share(v.unit, "fork"), unit.step) if secondary else None
                if v.stream != unit.home and v.stream not in entered[v.unit]:
                    entered[v.unit].add(v.stream)
                    aids.append(fork[v.unit])
            if v.id in run_of:
                run = run_of[v.id]
                rep = (self._rep(run), -1)
                if v is run[0]:
                    self._sync(rep, [prev_out], v.id, v.step)
                    forked = any(t.stream != rep[0] for t in run)
                    op_fork = self._mark(rep, ("opfork", v.key, rep[0]) if v.key else None, v.step) if forked else None
                    op_seen = set()
                if v.stream != rep[0] and v.stream not in op_seen:
                    op_seen.add(v.stream)
                    aids.append(op_fork)
            aids.extend(self.task_anchor[u] for u in self.preds.get(v.id, ()))
            self._sync(lane, aids, v.id, v.step)
            self._launch(v, lane)
            if v.id in run_of and v is run_of[v.id][-1]:
                prev_out = self.lane_last.get((self._rep(run_of[v.id]), -1))
            if unit is not None:
                last_on[v.unit][v.stream] = self.task_anchor[v.id]
                if v.id == last[v.unit]:
                    home = (unit.home, -1)
                    joins = [a for s, a in last_on[v.unit].items() if s != unit.home]
                    self._sync(home, joins, -1, unit.step)
                    prev_unit_end = self._mark(home, self._unit_share(v.unit, "end"), unit.step)

    # -- capture = graphs | step ------------------------------------------------------------

    def _coarse(self, u: int) -> int:
        """The anchor that stands for task u outside its capture unit: the unit's end."""
        t = self.tasks[u]
        if t.unit >= 0:
            return self.unit_end[t.unit]
        return self.task_anchor[u]

    def _blocks(self) -> list[tuple[int, list[Task]]]:
        blocks: list[tuple[int, list[Task]]] = []
        closed: set[int] = set()
        for t in self.tasks:
            if t.unit >= 0 and blocks and blocks[-1][0] == t.unit:
                blocks[-1][1].append(t)
                continue
            if t.unit >= 0:
                if t.unit in closed:
                    raise InternalError(f"insert_barriers: the tasks of capture unit {t.unit} are not contiguous in issue order (task {t.id})")
                if t.unit not in self.units:
                    raise InternalError(f"insert_barriers: task {t.id} names capture unit {t.unit}, which does not exist")
                closed.add(t.unit)
            blocks.append((t.unit, [t]))
        return blocks

    def plan_captured(self) -> None:
        chain = self.policy == "chain"
        prev_out: int | None = None  # output anchor of the previous top-level item (chain)
        eager_run: list[Task] = []
        blocks = self._blocks()
        # Eager tasks between units are grouped into op runs for chain.
        items: list[tuple[str, object]] = []
        for unit, ts in blocks:
            if unit >= 0:
                items.append(("unit", (unit, ts)))
            else:
                items.append(("task", ts[0]))
        eager_runs: dict[int, list[Task]] = {}
        i = 0
        while i < len(items) and chain:
            if items[i][0] == "task":
                j = i
                while j < len(items) and items[j][0] == "task":
                    j += 1
                for run in self._op_runs([items[k][1] for k in range(i, j)]):
                    for t in run:
                        eager_runs[t.id] = run
                i = j
            else:
                i += 1
        op_fork: int | None = None
        op_seen: set[str] = set()
        for kind, item in items:
            if kind == "task":
                v: Task = item  # type: ignore[assignment]
                lane = (v.stream, -1)
                aids: list[int | None] = [self._coarse(u) for u in self.preds.get(v.id, ())]
                if v.id in eager_runs:
                    eager_run = eager_runs[v.id]
                    rep = (self._rep(eager_run), -1)
                    if v is eager_run[0]:
                        self._sync(rep, [prev_out], v.id, v.step)
                        forked = any(t.stream != rep[0] for t in eager_run)
                        op_fork = self._mark(rep, ("opfork", v.key, rep[0]) if v.key else None, v.step) if forked else None
                        op_seen = set()
                    if v.stream != rep[0] and v.stream not in op_seen:
                        op_seen.add(v.stream)
                        aids.append(op_fork)
                self._sync(lane, aids, v.id, v.step)
                self._launch(v, lane)
                if v.id in eager_runs and v is eager_run[-1]:
                    prev_out = self.lane_last.get(rep)
            else:
                unit_id, ts = item  # type: ignore[misc]
                self._plan_unit(unit_id, ts, prev_out if chain else None)
                prev_out = self.unit_end[unit_id]

    def _plan_unit(self, uid: int, ts: list[Task], chain_prev: int | None) -> None:
        unit = self.units[uid]
        chain = self.policy == "chain"
        home, hl = (unit.home, -1), (unit.home, uid)
        members = {t.id for t in ts}
        outside = [self._coarse(u) for t in ts for u in self.preds.get(t.id, ()) if u not in members]
        self._sync(home, outside + [chain_prev], -1, unit.step)
        self.ins.append(["begin", unit.home, -1, -1, uid, unit.step])
        self.clock[hl] = dict(self.clock.get(home, {}))
        secondary = any(t.stream != unit.home for t in ts)
        fork = self._mark(hl, self._unit_share(uid, "fork"), unit.step) if secondary else None
        entered: set[str] = {unit.home}
        lanes: list[Lane] = []

        def enter(stream: str) -> list[int | None]:
            # A stream joins the capture only by waiting on an event recorded inside it
            # (CUDA_PITFALLS.md #14): the fork, before its first instruction in the unit.
            if stream in entered:
                return []
            entered.add(stream)
            lanes.append((stream, uid))
            return [fork]

        prev_op: int | None = None
        op_fork: int | None = None
        op_seen: set[str] = set()
        run_of: dict[int, list[Task]] = {}
        if chain:
            for run in self._op_runs(ts):
                for t in run:
                    run_of[t.id] = run
        for v in ts:
            lane = (v.stream, uid)
            aids: list[int | None] = enter(v.stream)
            if v.id in run_of:
                run = run_of[v.id]
                rep_s = self._rep(run)
                rep = (rep_s, uid)
                if v is run[0]:
                    req = enter(rep_s) if rep_s != v.stream else []
                    if rep_s == v.stream:
                        aids.append(prev_op)
                    else:
                        self._sync(rep, req + [prev_op], v.id, v.step)
                    forked = any(t.stream != rep_s for t in run)
                    if forked:
                        if rep_s == v.stream:
                            self._sync(rep, aids, v.id, v.step)
                            aids = []
                        op_fork = self._mark(rep, ("opfork", v.key, rep_s) if v.key else None, v.step)
                    else:
                        op_fork = None
                    op_seen = set()
                if v.stream != rep_s and v.stream not in op_seen:
                    op_seen.add(v.stream)
                    aids.append(op_fork)
            aids.extend(self.task_anchor[u] for u in self.preds.get(v.id, ()) if u in members)
            self._sync(lane, aids, v.id, v.step)
            self._launch(v, lane)
            if v.id in run_of and v is run_of[v.id][-1]:
                prev_op = self.lane_last.get((self._rep(run_of[v.id]), uid))
        # Join: home waits for the last point of every secondary lane it does not yet cover.
        self._sync(hl, [self.lane_last.get(l) for l in lanes], -1, unit.step)
        self.ins.append(["end", unit.home, -1, -1, uid, unit.step])
        self.unit_end[uid] = self._anchor(home, self._unit_share(uid, "end"), unit.step)
        for l in lanes + [hl]:
            self.clock.pop(l, None)

    # -- events ---------------------------------------------------------------------------------

    def assemble(self) -> tuple[tuple[Instr, ...], int]:
        """Drop unused marks, put a record right after every anchor a wait binds to, and number
        events: anchors with equal share keys take one event when their live ranges (record to
        last wait) do not overlap, so no wait can bind to another anchor's record; events are
        numbered in order of first record."""
        needed = set(self.waited)
        # Steady state: the runtime replays the last `period` steps (plan_segment_for).  A record
        # that step j - period made for step j - period + 1 must exist in step j too, or the
        # replayed wait would bind to a stale record.
        steps, period = self.s.steps, max(1, self.s.period)
        by_share_step = {(self.anchors[a].share, self.anchors[a].step) for a in needed if self.anchors[a].share is not None}
        for aid, A in enumerate(self.anchors):
            if A.share is not None and A.step >= max(0, steps - period) and (A.share, A.step - period) in by_share_step:
                needed.add(aid)
        after: dict[int, int] = {self.anchors[a].idx: a for a in needed}
        raw: list[list] = []
        rec_pos: dict[int, int] = {}
        for i, ins in enumerate(self.ins):
            if ins[0] != "mark":
                raw.append(ins)
            a = after.get(i)
            if a is not None:
                A = self.anchors[a]
                raw.append(["record", A.lane[0], A.task, a, A.lane[1], A.step])
                rec_pos[a] = len(raw) - 1
        last_wait: dict[int, int] = {}
        for p, ins in enumerate(raw):
            if ins[0] == "wait":
                last_wait[ins[3]] = p
        groups: dict[tuple, list[int]] = defaultdict(list)
        for a in needed:
            share = self.anchors[a].share
            groups[share if share is not None else ("anchor", a)].append(a)
        color: dict[int, tuple] = {}
        for g, aids in groups.items():
            aids.sort(key=rec_pos.__getitem__)
            ends: list[int] = []
            for a in aids:
                r = rec_pos[a]
                w = max(last_wait.get(a, r), r)
                for ci, e in enumerate(ends):
                    if e < r:
                        ends[ci] = w
                        break
                else:
                    ends.append(w)
                    ci = len(ends) - 1
                color[a] = (g, ci)
        first: dict[tuple, int] = {}
        for a in sorted(needed, key=rec_pos.__getitem__):
            first.setdefault(color[a], len(first))
        out = []
        for op, stream, task, a, unit, step in raw:
            event = first[color[a]] if op in ("record", "wait") else -1
            out.append(Instr(op, stream, task, event, unit, step))
        return tuple(out), len(first)


def insert_barriers(schedule: Schedule, edges: tuple[Edge, ...] | list[Edge], policy: str | None = None) -> EventPlan:
    """The EventPlan of `schedule` under `policy` (default `schedule.policy`).

    edges: the required edges of `dependencies(schedule)` (all used by auto; only AFTER edges by
    chain and explicit).  Returns a new frozen EventPlan; deterministic for equal inputs.
    Under auto every required edge u -> v is ordered (u happens before v) and removing any one
    task-level or unit-level wait breaks some required edge; the fork and join waits of capture
    units are there because CUDA capture needs them.  Whatever chain and explicit leave unordered
    is for `validate_plan` to report.

    Raises ValueError for an unknown policy or capture mode and InternalError when the input
    breaks an invariant of earlier passes (an edge against issue order, a capture unit whose
    tasks are not contiguous under capture)."""
    policy = policy or schedule.policy
    if policy not in POLICIES:
        raise ValueError(f"unknown barrier policy {policy!r} (expected one of {', '.join(POLICIES)})")
    if schedule.capture not in CAPTURES:
        raise ValueError(f"unknown capture mode {schedule.capture!r} (expected one of {', '.join(CAPTURES)})")
    p = _Planner(schedule, edges, policy)
    if schedule.capture == "none":
        p.plan_flat()
    else:
        p.plan_captured()
    instrs, n = p.assemble()
    return EventPlan(schedule, instrs, n, policy)


def plan_segment(plan: EventPlan, step: int) -> tuple[Instr, ...]:
    """The instructions of unrolled step `step` (-1: the prologue), in issue order."""
    return tuple(i for i in plan.instrs if i.step == step)


def steady_step(plan: EventPlan, k: int) -> int:
    """The unrolled step whose instructions run as step k of the training loop: k itself while
    k < schedule.steps, then the last `period` unrolled steps in turn, matched by k mod period
    (the steady state).  Raises ValueError for k < -1 or when fewer than `period` steps are
    unrolled."""
    steps, period = plan.schedule.steps, max(1, plan.schedule.period)
    if k < -1:
        raise ValueError(f"step {k} does not exist (the prologue is -1)")
    if k < steps:
        return k
    if steps < period:
        raise ValueError(f"{steps} unrolled steps cannot repeat a period of {period}")
    return steps - period + (k - steps) % period


def plan_segment_for(plan: EventPlan, k: int) -> tuple[Instr, ...]:
    """The instructions the runtime issues for step k: `plan_segment(plan, steady_step(plan, k))`."""
    return plan_segment(plan, steady_step(plan, k))


def plan_is_periodic(plan: EventPlan) -> bool:
    """True when the last `period` unrolled steps repeat the `period` steps before them (same
    instructions on the same streams, same events, tasks matched by `Task.key`), so replaying
    them forever (`plan_segment_for`) issues what a longer unrolling would.  False when fewer
    than 2 * period steps are unrolled."""
    s = plan.schedule
    steps, period = s.steps, max(1, s.period)
    if steps < 2 * period:
        return False
    units = {u.id: u for u in s.units}

    def sig(ins: Instr) -> tuple:
        key = s.tasks[ins.task].key if 0 <= ins.task < len(s.tasks) else None
        u = units.get(ins.unit)
        return (ins.op, ins.stream, key, ins.event, (u.graph, u.slot) if u is not None else None)

    for i in range(period):
        a = [sig(x) for x in plan_segment(plan, steps - period + i)]
        b = [sig(x) for x in plan_segment(plan, steps - 2 * period + i)]
        if a != b:
            return False
    return True
