"""Properties of barrier insertion and the race check on generated IR (STYLE.md, habit 8).

Schedules are generated directly as IR: 1-5 device streams plus the host, buffers in a small
arena so byte ranges overlap often (aliases share their root's range), capture units with forks
over several streams, random `after` edges to earlier tasks, op groups, 1-3 unrolled steps over
a period of 1 or 2 with keys shared by slot.  Happens-before is recomputed here by `hb_oracle`,
written from ARCHITECTURE.md's definition, never by calling the code under test.

Properties: auto orders every required edge, minimally, with no more waits than the pairwise
rule or one wait per edge; chain and explicit races are exactly the unordered conflicting pairs;
every plan is acyclic, binds every wait to an earlier record on another stream (inside the same
capture unit), and is deterministic; the training loop's replay of the steady steps orders a
longer unrolling of the same step.

Run with CI=1 for the "ci" hypothesis profile (1,000 examples per test; tests/conftest.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from hypothesis import assume, given
from hypothesis import strategies as st

from streamsched.interp.barriers import insert_barriers, plan_segment, plan_segments
from streamsched.interp.dependencies import dependencies
from streamsched.interp.ir import HOST, Buffer, EventPlan, Schedule, Task, Unit
from streamsched.interp.validate import find_races, validate_plan

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
def templates(draw) -> dict:
    """One step's work, to unroll: streams, buffers, blocks (a capture unit or one eager task)."""
    dev = DEV[: draw(st.integers(1, 5))]
    capture = draw(st.sampled_from(["none", "graphs", "step"]))
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
            "policy": draw(st.sampled_from(["auto", "chain", "explicit"]))}


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


def schedules():
    return templates().map(lambda tp: unroll(tp, tp["steps"]))


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
    # Stream order plus record -> wait is acyclic; no wait precedes its record or waits on its
    # own stream; inside a capture unit every wait binds to a record of the same unit.
    for i, ins in enumerate(plan.instrs):
        if ins.op != "wait":
            continue
        r = bound_record(plan, i)
        assert r is not None, f"wait {i} binds to no earlier record"
        assert plan.instrs[r].stream != ins.stream
        if cap:
            assert plan.instrs[r].unit == ins.unit
    succ = defaultdict(set)
    last: dict[str, int] = {}
    for i, ins in enumerate(plan.instrs):
        if ins.stream in last:
            succ[last[ins.stream]].add(i)
        last[ins.stream] = i
        if ins.op == "wait":
            succ[bound_record(plan, i)].add(i)
    indeg = defaultdict(int)
    for a in succ:
        for b in succ[a]:
            indeg[b] += 1
    ready = [i for i in range(len(plan.instrs)) if indeg[i] == 0]
    seen = 0
    while ready:
        a = ready.pop()
        seen += 1
        for b in succ[a]:
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    assert seen == len(plan.instrs), "stream order plus waits has a cycle"


def without(plan: EventPlan, i: int) -> EventPlan:
    return EventPlan(plan.schedule, plan.instrs[:i] + plan.instrs[i + 1:], plan.num_events, plan.policy)


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
    # Minimal: removing any wait (but the fork/join capture needs) breaks a required edge.
    waits = [i for i, ins in enumerate(plan.instrs) if ins.op == "wait" and not structural(plan, i)]
    for i in waits:
        b2 = hb_oracle(without(plan, i))
        assert any(not b2[v] >> u & 1 for u, v in req), f"wait {i} is redundant"
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
    """What the training loop issues (Segments.for_step k, forever) orders every required edge of
    the same step unrolled further, whenever the plan has a steady state."""
    tp = {**tp, "use_keys": True}
    unrolled = 4 * tp["period"]
    s = unroll(tp, unrolled)
    plan = insert_barriers(s, dependencies(s), "auto")
    segs = plan_segments(plan)
    assume(segs.period is not None)
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
