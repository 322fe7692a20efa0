"""Properties of barrier insertion and the race check on generated IR (STYLE.md, habit 8).

Schedules are generated directly as IR: 1-5 device streams plus the host, buffers in a small
arena so byte ranges overlap often (aliases share their root's range), capture units with forks
over several streams, random `after` edges to earlier tasks (and, for the cycle property, to
the task itself or later work), op groups, 1-3 unrolled steps over a period of 1 or 2 with keys
shared by slot; and deep eager dataflow over 3-5 streams for minimality.  Happens-before is
recomputed here by `hb_oracle`, written from ARCHITECTURE.md's definition, the required edges
by `scoreboard_edges` byte by byte from dependencies.py's definitions, and what chain and
explicit promise by `promised`, never by calling the code under test.

Properties: the required edges are exactly the scoreboard's; auto orders every required edge,
minimally, with no more waits than the pairwise rule or one wait per edge; chain and explicit
order exactly what the policy promises, and their races are exactly the unordered conflicting
pairs; an `after` naming later work is one R002 whose printed cycle is a real one; every plan
binds every wait to an earlier record on another stream (inside the same capture unit) and is
deterministic; every auto plan has a steady state, and the training loop's replay of it orders
a longer unrolling of the same step.

Run with CI=1 for the "ci" hypothesis profile (1,000 examples per test; tests/conftest.py); the
default profile's 100 examples catch a pairwise planner, chain without its own waits and a
dropped steady state (the generators above are aimed at them).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamsched.interp.barriers import insert_barriers, plan_segment, plan_segments
from streamsched.interp.dependencies import dependencies
from streamsched.interp.ir import HOST, Buffer, EventPlan, Schedule, Task, Unit
from streamsched.interp.validate import find_races, validate_plan, validate_schedule

DEV = ("s0", "s1", "s2", "s3", "s4")


# -- the oracle (independent of streamsched.interp) ------------------------------------------

def hb_oracle(plan: EventPlan) -> dict[int, int]:
    """before[t] = bitset of the tasks that happen before task t.  A lane is a stream, or
    (stream, unit) inside a capture unit; `begin` starts the unit's home lane from its stream,
    `end` makes the stream know every task of the unit; a wait adds what the latest record of
    its event issued before it had seen (none: nothing)."""
    cap = plan.schedule.capture != "none"
    know, rec, before, members = defaultdict(int), {}, {}, defaultdict(int)
    for ins in plan.instrs:
        lane = (ins.stream, ins.unit if cap and ins.unit >= 0 and ins.op != "end" else -1)
        if ins.op == "begin" and cap:
            know[lane] = know[(ins.stream, -1)]
        elif ins.op == "end" and cap:
            know[lane] |= members[ins.unit]
        elif ins.op == "launch":
            before[ins.task] = know[lane]
            know[lane] |= 1 << ins.task
            members[lane[1]] |= 1 << ins.task
        elif ins.op == "record":
            rec[ins.event] = know[lane]
        elif ins.op == "wait":
            know[lane] |= rec.get(ins.event, 0)
    return before


def lane_of(s: Schedule, t: Task) -> tuple[str, int]:
    return (t.stream, t.unit if s.capture != "none" and t.unit >= 0 else -1)


def conflicting(s: Schedule) -> set[tuple[int, int]]:
    """Pairs u < v touching a common byte, at least one writing (aliases share bytes)."""
    bm = s.buffer_map()

    def cells(names):
        return {(bm[n].space, x) for n in names for x in range(bm[n].offset, bm[n].offset + bm[n].nbytes)}

    acc = [(cells(t.reads), cells(t.writes)) for t in s.tasks]
    out = set()
    for v, (rv, wv) in enumerate(acc):
        for u in range(v):
            ru, wu = acc[u]
            if wu & (rv | wv) or ru & wv:
                out.add((u, v))
    return out


def required(s: Schedule) -> set[tuple[int, int]]:
    return conflicting(s) | {(u, t.id) for t in s.tasks for u in t.after}


def cells_of(s: Schedule) -> list[tuple[set, set]]:
    """Per task: the (space, byte) cells it reads and those it writes."""
    bm = s.buffer_map()

    def cells(names):
        return {(bm[n].space, x) for n in names for x in range(bm[n].offset, bm[n].offset + bm[n].nbytes)}

    return [(cells(t.reads), cells(t.writes)) for t in s.tasks]


def scoreboard_edges(s: Schedule) -> set[tuple[int, int, str]]:
    """The required edges as dependencies.py documents them, decided byte by byte from their
    definitions: RAW u -> v when v reads a byte whose last writer before v is u; WAW likewise
    when v writes it; WAR when v writes a byte u read (without writing it) after that byte's last
    write before v (an older reader is ordered through that write); AFTER for each earlier task
    named in `after`."""
    acc = cells_of(s)
    out = set()
    for v, (rv, wv) in enumerate(acc):
        for cell in rv | wv:
            writers = [u for u in range(v) if cell in acc[u][1]]
            last = writers[-1] if writers else -1
            if last >= 0:
                if cell in rv:
                    out.add((last, v, "RAW"))
                if cell in wv:
                    out.add((last, v, "WAW"))
            if cell in wv:
                out.update((u, v, "WAR") for u in range(last + 1, v)
                           if cell in acc[u][0] and cell not in acc[u][1])
    out.update((u, t.id, "AFTER") for t in s.tasks for u in t.after if u < t.id)
    return out


def _runs(tasks) -> dict[int, list[Task]]:
    """Task id -> its op call as chain sees one: a maximal run of consecutive device tasks of one
    op (host tasks are skipped, a task of no op is a call of its own)."""
    runs: list[list[Task]] = []
    for t in tasks:
        if t.stream == HOST:
            continue
        if runs and t.op >= 0 and runs[-1][-1].op == t.op:
            runs[-1].append(t)
        else:
            runs.append([t])
    return {t.id: r for r in runs for t in r}


def promised(s: Schedule, policy: str) -> dict[int, int]:
    """before[t] (bitset of tasks) that the chain or explicit policy promises, rebuilt from
    LANGUAGE.md's "Barrier policies" and barriers.py's contract, as happens-before on hb_oracle's
    lanes.  Both: the user's `after`, every edge touching the host, and capture units fork from
    and join back to their home (under capture = none as plain waits; else a unit is a graph:
    its lanes start from the fork, outside work is ordered before its begin and sees it whole after
    its end).  Chain adds the seed's orders: an op call's representative stream waits for the
    previous call's representative stream as that call ended, each other stream of a call waits
    for the call's start, and graph launches are ordered as op calls.

    Shared events (barriers.py): work with one `Task.key` (and the ends of one graph's instances
    of one slot) shares an event, so a wait for such work that the waiting lane does not know yet
    binds to the latest work of that key issued on its lane so far (where cudaStreamWaitEvent
    binds): the order promised is to that latest instance."""
    chain = policy == "chain"
    tasks = s.tasks
    preds: dict[int, list[int]] = defaultdict(list)
    for u, v, kind in scoreboard_edges(s):
        if kind == "AFTER" or HOST in (tasks[u].stream, tasks[v].stream):
            preds[v].append(u)
    units = {u.id: u for u in s.units}
    know: dict = defaultdict(int)
    before: dict[int, int] = {}
    after: dict[int, int] = {}
    latest: dict[tuple, int] = {}  # (share key, lane) -> what its latest instance knew
    lane_of_task: dict[int, tuple] = {}
    end_know: dict[int, int] = {}

    def launch(v: Task, lane, add: int) -> None:
        know[lane] |= add
        before[v.id] = know[lane]
        know[lane] |= 1 << v.id
        after[v.id] = know[lane]
        lane_of_task[v.id] = lane
        if v.key:
            latest[(v.key, v.stream, lane)] = after[v.id]

    def task_ref(u: int, lane) -> int:
        """What waiting on task u from `lane` adds: nothing if the lane knows u already."""
        if know[lane] >> u & 1:
            return 0
        t = tasks[u]
        return latest[(t.key, t.stream, lane_of_task[u])] if t.key else after[u]

    def end_ref(uid: int, lane) -> int:
        """What waiting on the end of unit instance uid adds (capture = graphs | step)."""
        if end_know[uid] & ~know[lane] == 0:
            return 0
        u = units[uid]
        return latest[("end", u.graph, u.slot, u.home)] if u.graph else end_know[uid]

    def coarse(u: int, lane) -> int:  # a graph's work is seen from outside only as the whole graph
        return end_ref(tasks[u].unit, lane) if tasks[u].unit >= 0 else task_ref(u, lane)

    if s.capture == "none":
        run_of = _runs(tasks) if chain else {}
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for t in tasks:
            if t.unit >= 0:
                first.setdefault(t.unit, t.id)
                last[t.unit] = t.id
        fork: dict[int, int] = {}
        entered: dict[int, set] = defaultdict(set)
        last_on: dict[int, dict] = defaultdict(dict)
        prev_unit_end = prev_out = opfork = 0
        op_seen: set = set()
        for v in tasks:
            add = 0
            unit = units.get(v.unit) if v.unit >= 0 else None
            if unit is not None:
                if v.id == first[v.unit]:
                    if chain:
                        know[unit.home] |= prev_unit_end
                    fork[v.unit] = know[unit.home]
                if v.stream != unit.home and v.stream not in entered[v.unit]:
                    entered[v.unit].add(v.stream)
                    add |= fork[v.unit]
            if v.id in run_of:
                run = run_of[v.id]
                rep = run[0].rep_stream or run[0].stream
                if v.id == run[0].id:
                    know[rep] |= prev_out
                    opfork, op_seen = know[rep], set()
                if v.stream != rep and v.stream not in op_seen:
                    op_seen.add(v.stream)
                    add |= opfork
            for u in preds[v.id]:
                add |= task_ref(u, v.stream)
            launch(v, v.stream, add)
            if v.id in run_of and v.id == run_of[v.id][-1].id:
                prev_out = know[rep]
            if unit is not None:
                last_on[v.unit][v.stream] = after[v.id]
                if v.id == last[v.unit]:
                    for stream, k in last_on[v.unit].items():
                        if stream != unit.home:
                            know[unit.home] |= k
                    prev_unit_end = know[unit.home]
        return before

    items: list[tuple[int, list[Task]]] = []
    for t in tasks:
        if t.unit >= 0 and items and items[-1][0] == t.unit:
            items[-1][1].append(t)
        else:
            items.append((t.unit, [t]))
    eager_run: dict[int, list[Task]] = {}
    if chain:  # eager tasks between two units are grouped into op calls
        i = 0
        while i < len(items):
            j = i
            while j < len(items) and items[j][0] < 0:
                j += 1
            eager_run.update(_runs([items[k][1][0] for k in range(i, j)]))
            i = j + 1
    prev_out = opfork = 0
    op_seen = set()
    for uid, ts in items:
        if uid < 0:
            v = ts[0]
            lane = (v.stream, -1)
            add = 0
            for u in preds[v.id]:
                add |= coarse(u, lane)
            if v.id in eager_run:
                run = eager_run[v.id]
                rep = (run[0].rep_stream or run[0].stream, -1)
                if v.id == run[0].id:
                    know[rep] |= prev_out
                    opfork, op_seen = know[rep], set()
                if v.stream != rep[0] and v.stream not in op_seen:
                    op_seen.add(v.stream)
                    add |= opfork
            launch(v, lane, add)
            if v.id in eager_run and v.id == eager_run[v.id][-1].id:
                prev_out = know[rep]
            continue
        unit = units[uid]
        home, hl = (unit.home, -1), (unit.home, uid)
        members = {t.id for t in ts}
        add = prev_out if chain else 0
        for t in ts:
            for u in preds[t.id]:
                if u not in members:
                    add |= coarse(u, home)
        know[home] |= add
        know[hl] = know[home]
        fork = know[hl]
        entered = {unit.home}

        def enter(stream: str) -> int:
            if stream in entered:
                return 0
            entered.add(stream)
            return fork

        run_of = _runs(ts) if chain else {}
        prev_op = 0
        for v in ts:
            lane = (v.stream, uid)
            add = enter(v.stream)
            if v.id in run_of:
                run = run_of[v.id]
                rep = (run[0].rep_stream or run[0].stream, uid)
                if v.id == run[0].id:
                    if rep == lane:
                        know[rep] |= add | prev_op
                        add = 0
                    else:
                        know[rep] |= enter(rep[0]) | prev_op
                    opfork, op_seen = know[rep], set()
                if v.stream != rep[0] and v.stream not in op_seen:
                    op_seen.add(v.stream)
                    add |= opfork
            for u in preds[v.id]:
                if u in members:
                    add |= task_ref(u, lane)
            launch(v, lane, add)
            if v.id in run_of and v.id == run_of[v.id][-1].id:
                prev_op = know[rep]
        for t in ts:  # `end`: the graph is done as a whole
            know[home] |= 1 << t.id
        end_know[uid] = prev_out = know[home]
        if unit.graph:
            latest[("end", unit.graph, unit.slot, unit.home)] = know[home]
    return before


def bound_record(plan: EventPlan, i: int) -> int | None:
    """Index of the latest record of wait i's event issued before it."""
    ev = plan.instrs[i].event
    for j in range(i - 1, -1, -1):
        if plan.instrs[j].op == "record" and plan.instrs[j].event == ev:
            return j
    return None


def structural(plan: EventPlan, i: int) -> bool:
    """A fork wait (its record follows a `begin`) or a join wait (only waits, then `end`, follow
    it on its lane): there because CUDA capture needs them, not for a required edge."""
    ins = plan.instrs[i]
    if plan.schedule.capture == "none" or ins.unit < 0:
        return False
    r = bound_record(plan, i)
    if r is not None and r > 0 and plan.instrs[r - 1].op == "begin":
        return True
    for nxt in plan.instrs[i + 1:]:
        if nxt.stream == ins.stream and nxt.unit == ins.unit:
            if nxt.op != "wait":
                return nxt.op == "end"
    return False


def pairwise_waits(s: Schedule, edges) -> int:
    """Waits of the pairwise "last event seen per stream" rule: before v on s, one wait per
    other stream holding a predecessor later than the last one s waited for there."""
    pos, count, seen, n = {}, defaultdict(int), defaultdict(int), 0
    preds = defaultdict(list)
    for e in edges:
        preds[e.v].append(e.u)
    for t in s.tasks:
        need: dict[str, int] = {}
        for u in preds[t.id]:
            su = s.tasks[u].stream
            if su != t.stream:
                need[su] = max(need.get(su, 0), pos[u])
        for su, p in need.items():
            if seen[(t.stream, su)] < p:
                n += 1
                seen[(t.stream, su)] = p
        count[t.stream] += 1
        pos[t.id] = count[t.stream]
    return n


# -- generated IR -------------------------------------------------------------------------------

@st.composite
def templates(draw, captures=("none", "graphs", "step"), policies=("auto", "chain", "explicit"),
              min_streams=1) -> dict:
    """One step's work, to unroll: streams, buffers, blocks (a capture unit or one eager task)."""
    dev = DEV[: draw(st.integers(min_streams, 5))]
    capture = draw(st.sampled_from(captures))
    period, steps = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    buffers: list[Buffer] = []
    for i in range(draw(st.integers(1, 6))):
        if buffers and draw(st.integers(0, 3)) == 0:
            r = draw(st.sampled_from(buffers))
            buffers.append(Buffer(f"b{i}", (r.nbytes,), "u8", r.space, "act", r.offset, r.nbytes, alias_of=r.name))
        else:
            size, off = draw(st.integers(1, 8)), draw(st.integers(0, 24))
            buffers.append(Buffer(f"b{i}", (size,), "u8", draw(st.sampled_from(["device", "device", "host"])), "act", off, size))
    names = [b.name for b in buffers]
    subset = st.lists(st.sampled_from(names), max_size=2, unique=True)
    blocks: list[tuple[str | None, list[dict]]] = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            home = draw(st.sampled_from(dev))
            specs = []
            op = 0
            for _ in range(draw(st.integers(1, 4))):
                op += draw(st.integers(0, 1))
                specs.append({"stream": draw(st.sampled_from(dev)), "op": op})
            blocks.append((home, specs))
        else:
            blocks.append((None, [{"stream": draw(st.sampled_from(dev + (HOST,))), "op": 0}]))
    if capture == "step":  # the whole step is one unit; host work stays outside, issued first
        specs = [sp for h, b in blocks for sp in b]
        host = [sp for sp in specs if sp["stream"] == HOST]
        devw = [sp for sp in specs if sp["stream"] != HOST]
        blocks = [(None, [sp]) for sp in host] + ([(dev[0], devw)] if devw else [])
    n_t = 0
    for _, specs in blocks:
        for sp in specs:
            sp["reads"], sp["writes"] = draw(subset), draw(subset)
            sp["after"] = draw(st.lists(st.integers(0, n_t - 1), max_size=2, unique=True)) if n_t and draw(st.integers(0, 3)) == 0 else []
            # `after prev.x`: the same or an earlier statement of the previous step
            sp["prev"] = draw(st.lists(st.integers(0, n_t), max_size=1)) if draw(st.integers(0, 5)) == 0 else []
            n_t += 1
    return {"dev": dev, "capture": capture, "period": period, "steps": steps, "buffers": tuple(buffers),
            "blocks": blocks, "size": n_t, "use_keys": draw(st.booleans()),
            "policy": draw(st.sampled_from(policies))}


def unroll(tp: dict, steps: int) -> Schedule:
    """The template's step issued `steps` times; slots alternate a, b when the period is 2; keys
    name a task by slot and position, so equal keys are the same work (ir.Task.key)."""
    tasks: list[Task] = []
    units: list[Unit] = []
    op_id = 0
    n_t = tp["size"]
    for k in range(steps):
        slot = "ab"[k % tp["period"]]
        base = len(tasks)
        ti = 0
        for bi, (home, specs) in enumerate(tp["blocks"]):
            uid = -1
            if home is not None:
                uid = len(units)
                units.append(Unit(uid, f"g{bi}[{slot}]", f"g{bi}", home, slot, k))
            ops: dict[int, int] = {}
            for sp in specs:
                if sp["op"] not in ops:
                    ops[sp["op"]] = op_id
                    op_id += 1
                rep = next(s2["stream"] for s2 in specs if s2["op"] == sp["op"])
                after = [base + a for a in sp["after"]]
                if k > 0:
                    after += [base - n_t + a for a in sp["prev"]]
                tasks.append(Task(len(tasks), "k", sp["stream"], tuple(sp["reads"]), tuple(sp["writes"]),
                                  after=tuple(sorted(set(after))), unit=uid if sp["stream"] != HOST else -1,
                                  op=ops[sp["op"]], rep_stream=rep, step=k, slot=slot,
                                  key=f"{slot}|{ti}" if tp["use_keys"] else "", label=f"t{ti}"))
                ti += 1
    return Schedule(tp["dev"] + (HOST,), tp["buffers"], tuple(tasks), tuple(units), tp["period"], steps,
                    tp["capture"], tp["policy"])


def schedules(**kw):
    return templates(**kw).map(lambda tp: unroll(tp, tp["steps"]))


def check_structure(plan: EventPlan) -> None:
    """Shape rules every plan keeps, whatever its policy."""
    s = plan.schedule
    cap = s.capture != "none"
    launched = [i.task for i in plan.instrs if i.op == "launch"]
    assert launched == list(range(len(s.tasks)))  # every task once, in issue order
    steps = [i.step for i in plan.instrs]
    assert steps == sorted(steps)  # segments partition the plan
    assert sum(len(plan_segment(plan, k)) for k in range(-1, s.steps)) == len(plan.instrs)
    used_events = {i.event for i in plan.instrs if i.op in ("record", "wait")}
    assert used_events == set(range(plan.num_events))
    # No wait precedes its record or waits on its own stream; inside a capture unit every wait
    # binds to a record of the same unit.  (A wait binds to the latest record issued *before* it,
    # so once every wait binds, stream order plus waits is acyclic by construction: a cycle can
    # only be in what the schedule asks for, an `after` naming later work, which validate_schedule
    # must refuse before planning: test_after_naming_later_work_is_a_cycle_with_a_real_path.)
    for i, ins in enumerate(plan.instrs):
        if ins.op != "wait":
            continue
        r = bound_record(plan, i)
        assert r is not None, f"wait {i} binds to no earlier record"
        assert plan.instrs[r].stream != ins.stream
        if cap:
            assert plan.instrs[r].unit == ins.unit


def without(plan: EventPlan, i: int) -> EventPlan:
    return EventPlan(plan.schedule, plan.instrs[:i] + plan.instrs[i + 1:], plan.num_events, plan.policy)


def assert_minimal(plan: EventPlan, req: set[tuple[int, int]]) -> None:
    """Removing any wait (but the fork/join capture needs) leaves a required edge unordered."""
    waits = [i for i, ins in enumerate(plan.instrs) if ins.op == "wait" and not structural(plan, i)]
    for i in waits:
        b2 = hb_oracle(without(plan, i))
        assert any(not b2[v] >> u & 1 for u, v in req), f"wait {i} is redundant"


@given(schedules())
def test_auto_orders_every_required_edge_minimally(s: Schedule) -> None:
    edges = dependencies(s)
    plan = insert_barriers(s, edges, "auto")
    check_structure(plan)
    before = hb_oracle(plan)
    req = required(s)
    unordered = [(u, v) for u, v in req if not before[v] >> u & 1]
    assert not unordered
    assert find_races(plan) == ()
    assert validate_plan(plan, edges) == ()
    assert_minimal(plan, req)
    if s.capture == "none":
        n_auto = sum(1 for ins in plan.instrs if ins.op == "wait")
        cross = {(e.u, e.v) for e in edges if s.tasks[e.u].stream != s.tasks[e.v].stream}
        assert n_auto <= pairwise_waits(s, edges)
        assert n_auto <= len(cross)
    # Deterministic: the same input, rebuilt, plans to the same instructions and events.
    s2 = Schedule(tuple(s.streams), tuple(list(s.buffers)), tuple(list(s.tasks)), tuple(s.units), s.period,
                  s.steps, s.capture, s.policy)
    assert insert_barriers(s2, list(dependencies(s2)), "auto") == EventPlan(s2, plan.instrs, plan.num_events, "auto")


@given(schedules(), st.sampled_from(["chain", "explicit"]))
def test_chain_and_explicit_races_are_exactly_the_unordered_pairs(s: Schedule, policy: str) -> None:
    edges = dependencies(s)
    plan = insert_barriers(s, edges, policy)
    check_structure(plan)
    before = hb_oracle(plan)
    # The user's `after` clauses are always honoured.
    assert all(before[t.id] >> u & 1 for t in s.tasks for u in t.after)
    expected = {(u, v) for u, v in conflicting(s)
                if lane_of(s, s.tasks[u]) != lane_of(s, s.tasks[v]) and not before[v] >> u & 1}
    races = find_races(plan)
    assert {(r.first, r.second) for r in races} == expected
    diags = validate_plan(plan, edges)
    assert [d.code for d in diags] == ["R001"] * len(expected)  # no spans: nothing merged
    assert insert_barriers(s, edges, policy) == plan


@given(templates())
def test_steady_state_replay_orders_a_longer_run(tp: dict) -> None:
    """Every auto plan of keyed work unrolled over four slot periods has a steady state (one or
    two slot periods: barriers.steady_period), and what the training loop issues from it
    (Segments.for_step k, forever) orders every required edge of the same step unrolled further."""
    tp = {**tp, "use_keys": True}
    unrolled = 4 * tp["period"]
    s = unroll(tp, unrolled)
    plan = insert_barriers(s, dependencies(s), "auto")
    segs = plan_segments(plan)
    assert segs.period in (tp["period"], 2 * tp["period"])
    n = unrolled + 3 * segs.period
    long = unroll(tp, n)
    task_at = {(t.step, t.key): t.id for t in long.tasks}
    unit_at = {(u.step, u.name): u.id for u in long.units}
    instrs = []
    for k in range(n):
        for ins in segs.for_step(k):
            task = task_at[(k, s.tasks[ins.task].key)] if ins.task >= 0 else -1
            unit = unit_at[(k, s.units[ins.unit].name)] if ins.unit >= 0 else -1
            instrs.append(replace(ins, task=task, unit=unit, step=k))
    before = hb_oracle(EventPlan(long, tuple(instrs), plan.num_events, "auto"))
    assert sorted(before) == list(range(len(long.tasks)))
    assert [(u, v) for u, v in sorted(required(long)) if not before[v] >> u & 1] == []


@given(schedules())
def test_dependencies_are_exactly_the_scoreboard_edges(s: Schedule) -> None:
    """Every edge `dependencies` returns is one its definition requires, and none is missing (a
    WAR to a writer that an older write already orders, say, is not an edge)."""
    got = {(e.u, e.v, e.kind) for e in dependencies(s)}
    assert got == scoreboard_edges(s)


@pytest.mark.parametrize("capture", ["none", "graphs", "step"])
@pytest.mark.parametrize("policy", ["chain", "explicit"])
@given(data=st.data())
def test_chain_and_explicit_order_exactly_what_the_policy_promises(policy: str, capture: str, data) -> None:
    """Happens-before of the plan equals what the policy promises (`promised`): no order of its
    own missing (chain without its op-to-op or fork/join waits), none added (a chain plan that
    orders more than the seed's would hide the races `check` must report)."""
    s = data.draw(schedules(captures=(capture,), policies=(policy,), min_streams=2))
    plan = insert_barriers(s, dependencies(s), policy)
    got, want = hb_oracle(plan), promised(s, policy)
    diff = {t: (bin(got[t]), bin(want[t])) for t in want if got[t] != want[t]}
    assert not diff, diff


@st.composite
def dataflow(draw) -> Schedule:
    """Deep fork/join dataflow over 3-5 streams, eager: each task reads the outputs of one to
    three earlier tasks and writes a buffer of its own (now and then an earlier one).  Chains of
    waits through third streams are the rule here, so a planner that tracks only the last event
    it waited for per stream (a pairwise rule) emits a redundant wait in most examples."""
    dev = DEV[: draw(st.integers(3, 5))]
    n = draw(st.integers(5, 12))
    buffers = tuple(Buffer(f"o{i}", (1,), "u8", "device", "act", i, 1) for i in range(n))
    tasks = []
    for v in range(n):
        reads = draw(st.lists(st.integers(0, v - 1), min_size=1, max_size=3, unique=True)) if v else []
        out = draw(st.integers(0, v - 1)) if v and draw(st.integers(0, 4)) == 0 else v
        tasks.append(Task(v, "k", draw(st.sampled_from(dev)), tuple(f"o{r}" for r in reads), (f"o{out}",)))
    return Schedule(dev + (HOST,), buffers, tuple(tasks))


@given(dataflow())
def test_auto_is_minimal_on_deep_dataflow(s: Schedule) -> None:
    edges = dependencies(s)
    plan = insert_barriers(s, edges, "auto")
    before, req = hb_oracle(plan), required(s)
    assert [(u, v) for u, v in req if not before[v] >> u & 1] == []
    assert_minimal(plan, req)
    assert sum(1 for ins in plan.instrs if ins.op == "wait") <= pairwise_waits(s, edges)


@st.composite
def with_back_edges(draw) -> tuple[Schedule, list[tuple[int, int]]]:
    """A generated schedule whose `after` clauses also name later work: one to three tasks v get
    `after a` with a >= v (a later task of the run, or v itself)."""
    s = draw(schedules())
    n = len(s.tasks)
    picks = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), min_size=1, max_size=3))
    back = sorted({(min(v, a), max(v, a)) for v, a in picks})
    extra: dict[int, set[int]] = defaultdict(set)
    for v, a in back:
        extra[v].add(a)
    tasks = tuple(replace(t, after=tuple(sorted(set(t.after) | extra[t.id]))) for t in s.tasks)
    return replace(s, tasks=tasks), back


NOTE = re.compile(r"^`[^`]*` \(task (\d+)\) -> `[^`]*` \(task (\d+)\): (.*)$")


def shortest_path(s: Schedule, src: int, dst: int) -> int | None:
    """Hops of the shortest chain from src to dst of required edges and stream order (the
    scoreboard's edges, not dependencies'), None when there is none."""
    succ: dict[int, set[int]] = defaultdict(set)
    for u, v, _ in scoreboard_edges(s):
        succ[u].add(v)
    last: dict[str, int] = {}
    for t in s.tasks:
        if t.stream in last:
            succ[last[t.stream]].add(t.id)
        last[t.stream] = t.id
    dist, frontier = {src: 0}, [src]
    while frontier:
        nxt = []
        for x in frontier:
            for y in succ[x]:
                if y <= dst and y not in dist:
                    dist[y] = dist[x] + 1
                    nxt.append(y)
        frontier = nxt
    return dist.get(dst)


@given(with_back_edges())
def test_after_naming_later_work_is_a_cycle_with_a_real_path(case) -> None:
    """Each `after` naming the task itself or later work is one R002 whose path is a real cycle:
    the shortest chain of required edges and stream order from the task to the work it names
    (issue order itself when there is none), then the `after` back; and none of it reaches the
    planner as an edge."""
    s, back = case
    edges = dependencies(s)
    assert all(e.u < e.v for e in edges)
    cycles = []
    for d in validate_schedule(s, edges):
        if d.code != "R002":
            continue
        hops = []
        for note in d.notes:
            m = NOTE.match(note)
            assert m, note
            hops.append((int(m[1]), int(m[2]), m[3]))
        cycles.append(hops)
    assert sorted((h[-1][1], h[-1][0]) for h in cycles) == back
    kinds: dict[tuple[int, int], set[str]] = defaultdict(set)
    for u, w, k in scoreboard_edges(s):
        kinds[(u, w)].add(k)
    for hops in cycles:
        (a, v, last) = hops[-1]
        assert last == "after" and hops[0][0] == v
        assert all(x[1] == y[0] for x, y in zip(hops, hops[1:]))  # a closed walk
        path = hops[:-1]
        want = None if a == v else shortest_path(s, v, a)
        if a == v:
            assert path == []
        elif want is None:
            assert path == [(v, a, "issued first")]
        else:
            assert len(path) == want
            for u, w, desc in path:
                if desc.startswith("stream order on "):
                    assert s.tasks[u].stream == s.tasks[w].stream == desc[len("stream order on "):] and u < w
                elif desc == "after":
                    assert u in s.tasks[w].after and u < w
                else:  # "RAW on `b`" and the like: a required edge
                    assert desc.split(" on ")[0] in kinds[(u, w)], (u, w, desc)
