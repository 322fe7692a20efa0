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

Under every policy the host's own accesses are ordered from their edges (LANGUAGE.md, "The
host"), and `after` clauses are honoured.

Lanes and happens-before are those of `validate.py`.  Under capture = graphs | step a capture
unit is bracketed by begin/end on its home stream; a secondary stream enters it by waiting on
the fork (recorded on the home right after `begin`) before its first task, unless its first
wait already binds to a record inside the unit, which implies the fork; before `end` the home
joins every secondary stream it does not already cover.  Every wait inside a unit binds to a
record inside it (CUDA_PITFALLS.md #13); edges that cross units are coarsened to unit level
(record after the producer's `end`, wait before the consumer's `begin`).

Records follow the work they mark and exist only where a wait binds to them, and, in the last
unrolled steps, where the training loop's replay of those steps will bind (`assemble`).  Tasks
with equal `Task.key` share one event; a wait on such an event waits on the latest work of that
key already issued on the lane, which is where cudaStreamWaitEvent binds anyway.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from streamsched.diagnostics import InternalError
from streamsched.interp.ir import HOST, Edge, EventPlan, Instr, Schedule, Task, evolve

Lane = tuple[str, int]

POLICIES = ("auto", "chain", "explicit")
CAPTURES = ("none", "graphs", "step")


@dataclass(slots=True)
class _Anchor:
    """A point of a lane a wait can bind to: after a task's launch, after a unit's `end`, or a
    marked point (a fork).  `clock` is the lane's vector clock there; `idx` the index of the
    instruction a record for it follows; `share` the key of events it may share."""

    lane: Lane
    pos: int
    clock: dict[Lane, int] | None
    idx: int
    share: tuple | None
    step: int
    task: int


class _Planner:
    """One planning run; instructions are built with abstract events (anchor ids) and given
    concrete event numbers at the end (`assemble`)."""

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
        self.share_last: dict[tuple, int] = {}  # (share key, lane) -> latest anchor
        self.task_anchor: dict[int, int] = {}
        self.unit_end: dict[int, int] = {}
        self.waited: set[int] = set()
        self.preds: dict[int, list[int]] = defaultdict(list)
        every = policy == "auto"
        host_ids = {t.id for t in self.tasks if t.stream == HOST}
        preds = self.preds
        for e in edges:
            u, v = e.u, e.v
            if u >= v:
                raise InternalError(f"insert_barriers: edge {u} -> {v} does not follow issue order (validate_schedule reports cycles first)")
            # The interpreter orders the host's own accesses under every policy (LANGUAGE.md,
            # "The host": it waits on the copy that last read a staging slot before rewriting
            # it); the user has no statement to write an `after` on a staging write.
            if every or e.kind == "AFTER" or u in host_ids or v in host_ids:
                lst = preds[v]
                if not lst or lst[-1] != u:  # (edges of one pair, on several buffers or kinds, are adjacent)
                    lst.append(u)

    # -- primitives -------------------------------------------------------------------------

    def _anchor(self, lane: Lane, share: tuple | None, step: int, task: int = -1) -> int:
        p = self.pos[lane] = self.pos[lane] + 1
        c = self.clock.get(lane)
        if c is None:  # (not setdefault: it would build a dict at every call)
            c = self.clock[lane] = {}
        c[lane] = p
        anchors = self.anchors
        aid = len(anchors)
        anchors.append(_Anchor(lane, p, c.copy(), len(self.ins) - 1, share, step, task))
        self.lane_last[lane] = aid
        if share is not None:
            self.share_last[(share, lane)] = aid
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
        c = self.clock.get(lane)
        if c is None:  # (not setdefault: it would build a dict at every call)
            c = self.clock[lane] = {}
        anchors = self.anchors
        cget = c.get
        needed = [a for a in aids if a is not None and cget(anchors[a].lane, 0) < anchors[a].pos]
        if not needed:
            return  # the lane already knows them all (most tasks): no wait

        def minimal(cands: list[int]) -> list[int]:
            """The latest anchor per lane, then those no other one implies (the clock of a join
            covers an anchor iff one of the joined clocks does)."""
            latest: dict[Lane, int] = {}
            for a in cands:
                A = anchors[a]
                b = latest.get(A.lane)
                if b is None or anchors[b].pos < A.pos:
                    latest[A.lane] = a
            cand = list(latest.values())
            if len(cand) == 1:
                return cand  # (nothing else to imply it)
            return [a for a in cand
                    if not any(b != a and anchors[b].clock.get(anchors[a].lane, 0) >= anchors[a].pos
                               for b in cand)]

        def moved(cands: list[int]) -> list[int]:
            # A wait binds to the latest record of its event, and anchors with one share key share
            # an event: a wait for an anchor is a wait on the latest such anchor of its lane issued
            # so far.  It covers the original (same lane, later), no record inserted later can
            # move the binding, and the events stay periodic (one per key): the steady state.
            return [self.share_last[(self.anchors[a].share, self.anchors[a].lane)]
                    if self.anchors[a].share is not None else a for a in cands]

        if self.policy == "auto":
            # auto chooses its waits: what is needed is decided on the anchors themselves, and
            # only the waits it keeps are moved (moving first can hide that another wait implies
            # one); moving can make one wait imply another: those are dropped too.
            keep = minimal(moved(minimal(needed)))
        else:
            # chain and explicit wait where the policy says, and such a wait binds as on the GPU
            keep = minimal(moved(needed))
        keep.sort(key=lambda a: (self.rank.get(self.anchors[a].lane[0], len(self.rank)), self.anchors[a].lane[1], a))
        for a in keep:
            self.ins.append(["wait", lane[0], task, a, lane[1], step])
            self.waited.add(a)
            for k, v in self.anchors[a].clock.items():
                if v > c.get(k, 0):
                    c[k] = v

    # -- shared pieces ----------------------------------------------------------------------

    def _unit_share(self, unit: int, role: str) -> tuple | None:
        """Event share key of a unit's fork or end: instances of one graph and slot share."""
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
        """Issue order cut into capture units (unit id, tasks) and single eager tasks (-1, [t]);
        a unit must be contiguous, since a capture cannot be interrupted by other work."""
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
        """capture = graphs | step: eager tasks plan task by task on their stream's lane; each
        unit plans as one item at top level (`_plan_unit`)."""
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
        """Waits before `begin` for the unit's outside predecessors (and, under chain, the
        previous top-level item); then begin, fork, the tasks on their unit lanes, join, end."""
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
        """The final instructions and the number of events.

        Steady state: the training loop replays the last m unrolled steps forever
        (`plan_segments`).  A replayed wait binds to what the previous replay recorded, so the
        last m steps must record what the m steps before them recorded for the steps after
        them, though no unrolled step waits there.  m is the smallest multiple of the period for
        which that closure makes the replay sound (`steady_period`); when none does, the closure
        of one period is kept and `steady_period` says None."""
        steps, period = self.s.steps, max(1, self.s.period)
        # Planning is over: its clocks and indexes are dropped before the replay walk, which
        # holds a large analysis of its own (on a 130,000-task plan the clocks alone are
        # ~60 MB); what is left (anchors' places, shares, the waits) is all events need.
        for A in self.anchors:
            A.clock = None
        self.clock, self.preds, self.task_anchor, self.lane_last, self.share_last = {}, {}, {}, {}, {}
        fallback = None
        self.steady, self.analysis = -1, None
        for m in range(period, min(steps, STEADY_PERIODS * period + 1), period):
            built = self._build(self._closure(m))
            ok, kept = _replay_check(EventPlan(self.s, built[0], built[1], self.policy), m)
            if ok:
                # the smallest period tried first: steady_period would find this very m
                self.steady = m if m == period else -1
                self.analysis = kept
                return built
            if fallback is None:
                fallback = built
                self.analysis = kept
        return fallback if fallback is not None else self._build(self._closure(period))

    def _closure(self, m: int) -> set[int]:
        """Anchors needing a record: those a wait binds to, plus, in the last m steps, those
        whose same-key anchor m steps earlier has one."""
        needed = set(self.waited)
        earlier = {(self.anchors[a].share, self.anchors[a].step) for a in needed if self.anchors[a].share is not None}
        last = self.s.steps - m
        for aid, A in enumerate(self.anchors):
            if A.share is not None and A.step >= max(0, last) and (A.share, A.step - m) in earlier:
                needed.add(aid)
        return needed

    def _build(self, needed: set[int]) -> tuple[tuple[Instr, ...], int]:
        """Drop unused marks, put a record right after every needed anchor, and number events:
        anchors with equal share keys take one event when their live ranges (record to last
        wait) do not overlap, so no wait binds to another anchor's record (`_sync` already
        waits on the latest anchor of a key, so this only splits what cannot share); events are
        numbered in order of first record."""
        after: dict[int, int] = {self.anchors[a].idx: a for a in needed}
        raw: list[list] = []
        rec_pos: dict[int, int] = {}
        last_wait: dict[int, int] = {}
        append = raw.append
        for i, ins in enumerate(self.ins):
            op = ins[0]
            if op == "wait":
                last_wait[ins[3]] = len(raw)
                append(ins)
            elif op != "mark":
                append(ins)
            if i in after:
                a = after[i]
                A = self.anchors[a]
                rec_pos[a] = len(raw)
                append(["record", A.lane[0], A.task, a, A.lane[1], A.step])
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
        event_of = {a: first[c] for a, c in color.items()}
        out = tuple([Instr(op, stream, task, event_of[a] if op == "record" or op == "wait" else -1, unit, step)
                     for op, stream, task, a, unit, step in raw])
        return out, len(first)


def insert_barriers(schedule: Schedule, edges: tuple[Edge, ...] | list[Edge], policy: str | None = None) -> EventPlan:
    """The EventPlan of `schedule` under `policy` (default `schedule.policy`).

    edges: the required edges of `dependencies(schedule)` (all used by auto; chain and explicit
    use the AFTER edges and the edges touching the host).  Returns a new frozen EventPlan;
    deterministic for equal inputs.  Instr.task of a wait is the task it precedes (-1 at unit
    level), of a record the task it follows (-1 after a fork or an `end`); Instr.unit is the
    capture unit an instruction lies in (-1 outside one, and everywhere under capture = none).
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
    return EventPlan(schedule, instrs, n, policy, steady=p.steady, analysis=p.analysis)


def plan_segment(plan: EventPlan, step: int) -> tuple[Instr, ...]:
    """The instructions of unrolled step `step` (-1: the prologue), in issue order."""
    return tuple(i for i in plan.instrs if i.step == step)


def _replayed(plan: EventPlan, m: int, copies: int):
    """The plan followed by `copies` more issues of its last m steps, as the training loop
    issues them: each copy's tasks and units get new ids (and steps m later), its `after` names
    the copies or unrolled tasks m steps later than the original's.  Returns (instructions of
    the plan and its copies, `after` of every task id, original task id per task id), or None
    when a task has no key (tasks are matched across steps by `Task.key`).  The copies exist
    only as ids: the race walk needs their instructions, `after` and accesses (the original's),
    not task records."""
    s = plan.schedule
    steps, n, nu = s.steps, len(s.tasks), len(s.units)
    if any(not t.key for t in s.tasks if t.step >= 0):
        return None
    at = {(t.step, t.key): t.id for t in s.tasks}
    block = [t for t in s.tasks if t.step >= steps - m]
    index = {t.id: i for i, t in enumerate(block)}
    bunits = sorted({t.unit for t in block if t.unit >= 0} | {i.unit for i in plan.instrs if i.step >= steps - m and i.unit >= 0})
    uindex = {u: i for i, u in enumerate(bunits)}

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

    afters = [t.after for t in s.tasks]
    origin = list(range(n))
    block_ids = [t.id for t in block]
    for rep in range(1, copies + 1):
        for t in block:
            afters.append(tuple(x for x in (later(a, rep * m) for a in t.after) if x is not None) if t.after else ())
        origin.extend(block_ids)
    instrs = list(plan.instrs)
    tail = [ins for ins in plan.instrs if ins.step >= steps - m]
    nb, nbu = len(block), len(bunits)
    for rep in range(1, copies + 1):
        tbase, ubase, dstep = n + (rep - 1) * nb, nu + (rep - 1) * nbu, rep * m  # (copy_id, inline)
        instrs.extend([Instr(ins.op, ins.stream, tbase + index[ins.task] if ins.task >= 0 else -1, ins.event,
                             ubase + uindex[ins.unit] if ins.unit >= 0 else -1, ins.step + dstep) for ins in tail])
    return tuple(instrs), afters, origin


def _replay_ok(plan: EventPlan, m: int, copies: int = 2) -> bool:
    """Whether issuing the last m steps again, twice, is sound: every wait of a copy binds to a
    record issued before it, every `after` of a copy is ordered, and no task of a copy races
    (a plan that races already has no steady state to run).  Checked with the exact race
    analysis of validate.py."""
    return _replay_check(plan, m, copies)[0]


def _replay_check(plan: EventPlan, m: int, copies: int = 2):
    """(`_replay_ok`, what validate_plan may reuse): one walk over the plan and its replays that
    stops at the first race of a replay; its part over the plan itself is complete, kept as
    (analysis, tasks, instructions, units of the plan) for EventPlan.analysis (None when the
    tasks have no keys and nothing was walked)."""
    from streamsched.interp.dependencies import alias_roots, task_accesses
    from streamsched.interp.validate import analyse_plan  # validate does not import barriers

    built = _replayed(plan, m, copies)
    if built is None:
        return False, None
    instrs, afters, origin = built
    s = plan.schedule
    n = len(s.tasks)
    acc = task_accesses(s)
    ext_acc = acc + tuple(acc[origin[i]] for i in range(n, len(afters)))
    an = analyse_plan(EventPlan(s, instrs, plan.num_events, plan.policy), stop_from=n, accesses=ext_acc,
                      roots=alias_roots(s), afters=afters)
    ok = not any(r.second >= n for r in an.races) and not any(w.index >= len(plan.instrs) for w in an.waits) \
        and not any(v >= n for _, v in an.unordered_after)
    return ok, (an, n, len(plan.instrs), len(s.units), plan.instrs, s)


STEADY_PERIODS = 2
"""A steady state repeats 1 or 2 slot periods (a wait every other step is a pattern of 2)."""


def steady_period(plan: EventPlan) -> int | None:
    """The smallest m, one or two slot periods and fewer than `schedule.steps`, such that the
    training loop may issue the last m unrolled steps over and over (`_replay_ok`: two more
    issues of them bind every wait, order every `after` and race nowhere).  m can exceed the slot
    period (a wait every other step is a pattern of period 2).  None when no such m exists
    (unroll more steps; a plan with races never has one) or when tasks have no keys."""
    kept = plan.analysis
    if plan.steady != -1 and kept is not None and kept[4] is plan.instrs and kept[5] is plan.schedule:
        return plan.steady  # what insert_barriers found for this very plan
    period = max(1, plan.schedule.period)
    for m in range(period, min(plan.schedule.steps, STEADY_PERIODS * period + 1), period):
        if _replay_ok(plan, m):
            return m
    return None


def plan_is_periodic(plan: EventPlan) -> bool:
    """True when the plan has a steady state (`steady_period` is not None)."""
    return steady_period(plan) is not None


@dataclass(frozen=True)
class Segments:
    """An EventPlan cut by step for the training loop: `by_step[k + 1]` holds step k's
    instructions (k = -1 the prologue), and `period` is `steady_period(plan)`."""

    by_step: tuple[tuple[Instr, ...], ...]
    steps: int
    period: int | None

    def step_for(self, k: int) -> int:
        """The unrolled step whose instructions run as step k of the loop: k while k < steps,
        then the last `period` steps in turn.  Raises ValueError for k < -1, or for k >= steps
        when the plan has no steady state (unroll more steps: `steady_period`)."""
        if k < -1:
            raise ValueError(f"step {k} does not exist (the prologue is -1)")
        if k < self.steps:
            return k
        if self.period is None:
            raise ValueError(f"the plan has no steady state within its {self.steps} unrolled steps; "
                             "unroll more steps before running past them")
        return self.steps - self.period + (k - self.steps) % self.period

    def for_step(self, k: int) -> tuple[Instr, ...]:
        """The instructions to issue as step k of the training loop."""
        return self.by_step[self.step_for(k) + 1]


def plan_segments(plan: EventPlan) -> Segments:
    """Cut `plan` by step once (O(plan)), for a loop that asks for every step."""
    by_step: list[list[Instr]] = [[] for _ in range(plan.schedule.steps + 1)]
    for ins in plan.instrs:
        by_step[ins.step + 1].append(ins)
    return Segments(tuple(tuple(b) for b in by_step), plan.schedule.steps, steady_period(plan))


def steady_step(plan: EventPlan, k: int) -> int:
    """`plan_segments(plan).step_for(k)`."""
    return plan_segments(plan).step_for(k)


def plan_segment_for(plan: EventPlan, k: int) -> tuple[Instr, ...]:
    """The instructions the training loop issues as step k (`Segments.for_step`); O(plan) per
    call, so a loop should call `plan_segments` once."""
    return plan_segments(plan).for_step(k)
