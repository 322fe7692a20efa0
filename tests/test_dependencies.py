"""Hand-built schedules with exact expectations: the required edges (RAW, WAR, WAW, AFTER; byte
overlap, `into` aliases, host space), the seed's in-place hazard under each policy, and every
diagnostic the analysis passes emit (R001-R004, C003, C004); plus plan text, drawing and the
steady state the training loop replays."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from streamsched.diagnostics import InternalError, render
from streamsched.interp.barriers import insert_barriers, plan_segment, plan_segments, steady_period
from streamsched.interp.dependencies import conflicting_pairs, dependencies
from streamsched.interp.draw import plan_to_dot, write_graph
from streamsched.interp.ir import HOST, Buffer, Edge, EventPlan, Instr, Schedule, Span, Task, Unit
from streamsched.interp.plan_text import format_edges, format_plan
from streamsched.interp.validate import find_races, validate_plan, validate_schedule

F = "m.sched"


def buf(name: str, off: int, n: int = 16, space: str = "device", alias: str | None = None) -> Buffer:
    return Buffer(name, (n // 4,), "f32", space, "act", off, n, alias)


def task(i: int, stream: str, reads=(), writes=(), after=(), line: int | None = None, name: str = "", **kw) -> Task:
    span = Span(F, line, 5, line, 25) if line else None
    return Task(i, kw.pop("kernel", "k"), stream, tuple(reads), tuple(writes), after=tuple(after), span=span,
                label=name, stmt=name, **kw)


def sched(tasks, buffers, streams=("c1", "c2", "c3"), **kw) -> Schedule:
    return Schedule(tuple(streams) + (HOST,), tuple(buffers), tuple(tasks), **kw)


# -- dependencies ------------------------------------------------------------------------------

def test_a_later_write_takes_over_the_readers():
    """After a write, the readers before it are ordered through it (WAR then WAW): a later write
    gets WAW from the last writer and WAR only from the readers since that write."""
    s = sched([
        task(0, "c1", writes=["a"]),
        task(1, "c2", reads=["a"]),
        task(2, "c3", writes=["a"]),          # WAR from t1, WAW from t0
        task(3, "c1", reads=["a"]),
        task(4, "c2", writes=["a"]),          # WAR from t3 and WAW from t2 only: not from t1
        task(5, "c3", reads=["a"], writes=["a"]),
        task(6, "c1", writes=["a"]),          # WAW from t5; its own read is no extra WAR
    ], [buf("a", 0)])
    assert dependencies(s) == (
        Edge(0, 1, "RAW", "a"),
        Edge(0, 2, "WAW", "a"), Edge(1, 2, "WAR", "a"),
        Edge(2, 3, "RAW", "a"),
        Edge(2, 4, "WAW", "a"), Edge(3, 4, "WAR", "a"),
        Edge(4, 5, "RAW", "a"), Edge(4, 5, "WAW", "a"),
        Edge(5, 6, "WAW", "a"),
    )


def test_raw_war_waw_edges_are_exact():
    s = sched([
        task(0, "c1", writes=["a"]),
        task(1, "c2", reads=["a"], writes=["b"]),
        task(2, "c1", reads=["b"], writes=["a"]),
        task(3, "c2", writes=["b"]),
        task(4, HOST, reads=["a"]),
    ], [buf("a", 0), buf("b", 16)])
    assert dependencies(s) == (
        Edge(0, 1, "RAW", "a"),
        Edge(0, 2, "WAW", "a"),
        Edge(1, 2, "RAW", "b"),
        Edge(1, 2, "WAR", "a"),
        Edge(1, 3, "WAW", "b"),
        Edge(2, 3, "WAR", "b"),
        Edge(2, 4, "RAW", "a"),
    )


def test_overlap_is_by_bytes_aliases_share_their_root_and_spaces_never_meet():
    s = sched([
        task(0, "c1", reads=["x"]),
        task(1, "c3", writes=["dx"]),         # into x: the same bytes, reported as `x`
        task(2, "c1", writes=["p"]),
        task(3, "c2", reads=["q"]),           # q overlaps p's upper half
        task(4, "c3", writes=["r"]),          # r overlaps q, not p
        task(5, HOST, writes=["hx"]),         # host space, same offsets as x: no conflict
        task(6, "c1", reads=["empty"]),
        task(7, "c2", writes=["empty"]),      # a planned buffer of no bytes conflicts with nothing
    ], [buf("x", 0), buf("dx", 0, alias="x"), buf("p", 32), buf("q", 40), buf("r", 48),
        buf("hx", 0, space="host"), Buffer("empty", (0,), "f32", offset=64, nbytes=0)])
    assert dependencies(s) == (Edge(0, 1, "WAR", "x"), Edge(2, 3, "RAW", "q"), Edge(3, 4, "WAR", "r"))
    assert conflicting_pairs(s) == ((0, 1, "x"), (2, 3, "q"), (3, 4, "r"))


def test_unplanned_buffers_conflict_by_name_and_alias():
    s = sched([task(0, "c1", writes=["u"]), task(1, "c2", reads=["v"]), task(2, "c3", reads=["w"])],
              [Buffer("u", (4,), "f32"), Buffer("v", (4,), "f32", alias_of="u"), Buffer("w", (4,), "f32")])
    assert dependencies(s) == (Edge(0, 1, "RAW", "u"),)


def test_after_edges_and_same_stream_edges_are_kept():
    s = sched([task(0, "c1", writes=["a"]), task(1, "c1", reads=["a"]), task(2, "c2", after=[0, 1])],
              [buf("a", 0)])
    assert dependencies(s) == (Edge(0, 1, "RAW", "a"), Edge(0, 2, "AFTER", ""), Edge(1, 2, "AFTER", ""))


def test_internal_errors_name_the_pass():
    with pytest.raises(InternalError, match="dependencies: task 0 is ordered after task 7"):
        dependencies(sched([task(0, "c1", after=[7])], []))
    with pytest.raises(InternalError, match="dependencies: task at index 0 has id 3"):
        dependencies(sched([task(3, "c1")], []))


# -- the seed's in-place hazard (`dx = matmul(dy, w^T) on comp3 into x`) ------------------------

def inplace(after_dw: bool, policy: str, capture: str = "none") -> Schedule:
    bufs = [buf("x", 0), buf("dy", 16), buf("w", 32), buf("dw", 48), buf("db", 64), buf("dx", 0, alias="x")]
    return Schedule(("comp1", "comp2", "comp3", HOST), tuple(bufs), (
        task(0, "comp1", ["x", "dy"], ["dw"], line=10, name="dw", kernel="matmul", unit=0, op=0, rep_stream="comp3"),
        task(1, "comp2", ["dy"], ["db"], line=11, name="db", kernel="sum", unit=0, op=0, rep_stream="comp3"),
        task(2, "comp3", ["dy", "w"], ["dx"], after=[0] if after_dw else [], line=12, name="dx", kernel="matmul",
             unit=0, op=0, rep_stream="comp3"),
    ), (Unit(0, "bwd", "bwd", "comp3", span=Span(F, 9, 1, 9, 10)),), capture=capture, policy=policy)


def test_inplace_hazard_without_after_is_a_race_under_explicit():
    s = inplace(False, "explicit")
    edges = dependencies(s)
    assert Edge(0, 2, "WAR", "x") in edges
    diags = validate_plan(insert_barriers(s, edges), edges)
    assert len(diags) == 1
    d = diags[0]
    assert d.code == "R001"
    assert d.message == "race on buffer `x` (WAR): `dx` on comp3 is not ordered after `dw` on comp1"
    assert (d.span.line, d.labels[0].span.line) == (12, 10)
    assert d.labels[0].message == "reads `x` on comp1 (dw)"
    assert d.help == "add `after dw` to the later statement"
    text = render(d)
    assert " --> m.sched:12:5" in text and " ::: m.sched:10:5" in text
    assert "`dx` writes `dx`, which shares bytes with `x`" in text


@pytest.mark.parametrize("capture", ["none", "graphs", "step"])
def test_inplace_hazard_is_ordered_by_after_or_auto_and_chain_leaves_it(capture):
    for after_dw, policy in ((True, "explicit"), (False, "auto"), (True, "auto"), (True, "chain")):
        s = inplace(after_dw, policy, capture)
        edges = dependencies(s)
        assert validate_plan(insert_barriers(s, edges), edges) == (), (after_dw, policy)
    # The seed's chain forks dw and db from the representative stream comp3 but never orders dx
    # after dw: exactly the race the checker exists to catch.
    s = inplace(False, "chain", capture)
    races = find_races(insert_barriers(s, dependencies(s)))
    assert [(r.first, r.second, r.buffer) for r in races] == [(0, 2, "x")]


def test_inplace_plan_text_is_stable():
    s = inplace(True, "explicit")
    plan = insert_barriers(s, dependencies(s))
    assert format_plan(plan) == "\n".join([
        "plan: policy explicit, capture none, period 1, steps 1",
        " # | comp1                           | comp2                        | comp3",
        "---+---------------------------------+------------------------------+---------------------------------",
        "-- step 0 --",
        " 0 |                                 |                              | record e0",
        " 1 | wait e0                         |                              |",
        " 2 | launch t0 matmul dw  m.sched:10 |                              |",
        " 3 | record e1                       |                              |",
        " 4 |                                 | wait e0                      |",
        " 5 |                                 | launch t1 sum db  m.sched:11 |",
        " 6 |                                 | record e2                    |",
        " 7 |                                 |                              | wait e1",
        " 8 |                                 |                              | launch t2 matmul dx  m.sched:12",
        " 9 |                                 |                              | wait e2",
        "3 tasks, 3 events, 3 records, 4 waits, policy explicit",
    ])
    src = format_plan(plan, {F: "\n" * 9 + "    dw = matmul(x^T, dy) on comp1\n"})
    assert src.splitlines()[-4:] == ["sources:", "  m.sched:10: dw = matmul(x^T, dy) on comp1", "  m.sched:11:", "  m.sched:12:"]
    assert format_edges(s, dependencies(s)).splitlines() == [
        "t0 -> t2  WAR    x  comp1 -> comp3  m.sched:10 -> m.sched:12",
        "t0 -> t2  AFTER  -  comp1 -> comp3  m.sched:10 -> m.sched:12",
        "2 edges: RAW 0, WAR 1, WAW 0, AFTER 1",
    ]


def test_auto_capture_brackets_the_unit_and_joins_its_streams():
    s = inplace(False, "auto", "graphs")
    plan = insert_barriers(s, dependencies(s))
    ops = [(i.op, i.stream, i.task if i.op == "launch" else i.event) for i in plan.instrs]
    assert ops == [
        ("begin", "comp3", -1), ("record", "comp3", 0),            # fork
        ("wait", "comp1", 0), ("launch", "comp1", 0), ("record", "comp1", 1),
        ("wait", "comp2", 0), ("launch", "comp2", 1), ("record", "comp2", 2),
        ("wait", "comp3", 1), ("launch", "comp3", 2),                # the WAR on x
        ("wait", "comp3", 2), ("end", "comp3", -1),                  # join comp2 (comp1 is covered)
    ]
    assert all(i.unit == 0 for i in plan.instrs)


@pytest.mark.parametrize("policy", ["chain", "explicit"])
def test_the_host_is_ordered_under_every_policy(policy):
    # LANGUAGE.md, "The host": the host waits on the copy that last read a staging slot before
    # it writes it again, and a copy follows the staging write it reads; no `after` is written.
    ts = []
    for k in range(2):
        ts += [Task(2 * k, "stage", HOST, (), ("stg",), step=k), Task(2 * k + 1, "h2d", "trans", ("stg",), ("x",), step=k)]
    s = Schedule(("trans", HOST), (buf("stg", 0, space="host"), buf("x", 0)), tuple(ts), steps=2, policy=policy)
    plan = insert_barriers(s, dependencies(s))
    assert validate_plan(plan) == ()
    assert [(i.stream, i.task) for i in plan.instrs if i.op == "wait"] == [("trans", 1), (HOST, 2), ("trans", 3)]


def four_ops(policy: str) -> Schedule:
    """Graph f on c1: op call 0 (representative c1) forks `b` onto c2; op call 1 runs on c3.
    Graph g on c2: op call 2.  No task shares a byte with another: every wait is the policy's."""
    return Schedule(("c1", "c2", "c3", HOST), (buf("a", 0), buf("b", 16), buf("c", 32), buf("d", 48)), (
        task(0, "c1", writes=["a"], name="a", op=0, rep_stream="c1", unit=0),
        task(1, "c2", writes=["b"], name="b", op=0, rep_stream="c1", unit=0),
        task(2, "c3", writes=["c"], name="c", op=1, rep_stream="c3", unit=0),
        task(3, "c2", writes=["d"], name="d", op=2, rep_stream="c2", unit=1),
    ), (Unit(0, "f", "f", "c1"), Unit(1, "g", "g", "c2")), capture="none", policy=policy)


def test_chain_without_capture_adds_the_seeds_op_and_graph_orders():
    """LANGUAGE.md, `chain`: each op's representative stream waits on the previous op's output
    stream, forked kernels on the op's start, graphs fork from and join their home and are
    ordered as ops; under capture = none all of it is plain waits, which explicit does not add."""
    s = four_ops("chain")
    plan = insert_barriers(s, dependencies(s))
    ops = [(i.op, i.stream, i.task if i.op == "launch" else i.event) for i in plan.instrs]
    assert ops == [
        ("record", "c1", 0),                                       # f's fork = op 0's start
        ("launch", "c1", 0), ("record", "c1", 1),                  # op 0's output on c1
        ("wait", "c2", 0), ("launch", "c2", 1), ("record", "c2", 2),   # b forked from op 0's start
        ("wait", "c3", 1), ("launch", "c3", 2), ("record", "c3", 3),   # op 1 after op 0's output
        ("wait", "c1", 2), ("wait", "c1", 3), ("record", "c1", 4),     # f joins c2, c3 and ends
        ("wait", "c2", 4), ("launch", "c2", 3),                    # graph g after graph f
    ]
    assert [(r.first, r.second) for r in find_races(plan)] == []
    # Explicit keeps only the fork and join: op 1 and graph g wait for nothing of op 0.
    e = four_ops("explicit")
    ops = [(i.op, i.stream, i.task if i.op == "launch" else i.event) for i in insert_barriers(e, dependencies(e)).instrs]
    assert ops == [
        ("record", "c1", 0), ("launch", "c1", 0),
        ("wait", "c2", 0), ("launch", "c2", 1), ("record", "c2", 1),
        ("wait", "c3", 0), ("launch", "c3", 2), ("record", "c3", 2),
        ("wait", "c1", 1), ("wait", "c1", 2),
        ("launch", "c2", 3),
    ]


def test_a_wait_covered_through_other_streams_is_not_emitted():
    """ARCHITECTURE.md, minimality: a wait is skipped when the waiting stream already knows the
    work through any chain of waits, however long.  Pairwise "last event seen per stream" rules
    wait again here (t2 and t3 each need t0 as well as their direct producer)."""
    s = sched([task(0, "c1", writes=["a"]),
               task(1, "c2", reads=["a"], writes=["b"]),
               task(2, "c3", reads=["a", "b"], writes=["c"]),  # t1 covers t0: one wait
               task(3, "c4", reads=["a", "c"]),                # t2 covers t1 and t0: one wait
               task(4, "c1", reads=["c"]),                     # t2, through c3's wait on t1
               task(5, "c2", reads=["d"]),
               task(6, "c4", writes=["d"])],                   # WAR on d: t5 is news to c4
              [buf("a", 0), buf("b", 16), buf("c", 32), buf("d", 48)], streams=("c1", "c2", "c3", "c4"))
    plan = insert_barriers(s, dependencies(s))
    assert validate_plan(plan) == ()
    assert [(i.stream, i.task) for i in plan.instrs if i.op == "wait"] == \
        [("c2", 1), ("c3", 2), ("c4", 3), ("c1", 4), ("c4", 6)]


# -- cycles, waits, joins, capture rules ----------------------------------------------------------

def test_after_naming_a_later_task_is_a_cycle_printed_edge_by_edge():
    s = sched([task(0, "c1", ["x"], ["a"], after=[1], line=10, name="f.a"),
               task(1, "c2", ["a"], ["b"], line=11, name="f.b")], [buf("x", 0), buf("a", 16), buf("b", 32)])
    edges = dependencies(s)
    assert edges == (Edge(0, 1, "RAW", "a"),)
    (d,) = validate_schedule(s, edges)
    assert d.code == "R002"
    assert d.message == ("dependency cycle: `f.a` (m.sched:10) -[RAW on `a`]-> `f.b` (m.sched:11) "
                         "-[after]-> `f.a` (m.sched:10)")
    assert d.span.line == 10
    assert [(l.span.line, l.message) for l in d.labels] == [(11, "must run after `f.a` (RAW on `a`)")]
    assert d.notes == ("`f.a` (m.sched:10) -> `f.b` (m.sched:11): RAW on `a`",
                       "`f.b` (m.sched:11) -> `f.a` (m.sched:10): after")


def test_after_a_later_task_with_no_data_path_closes_the_cycle_through_issue_order():
    s = sched([task(0, "c1", after=[1], line=3, name="p"), task(1, "c2", line=4, name="q"),
               task(2, "c3", after=[2], line=5, name="r")], [])
    d1, d2 = validate_schedule(s, dependencies(s))
    assert d1.message == "dependency cycle: `p` (m.sched:3) -[issued first]-> `q` (m.sched:4) -[after]-> `p` (m.sched:3)"
    assert d2.message == "dependency cycle: `r` (m.sched:5) -[after]-> `r` (m.sched:5)"


def test_wait_on_an_event_never_recorded_or_recorded_later_or_outside_the_graph():
    s = sched([task(0, "c1", line=1), task(1, "c2", line=2, unit=0)], [], units=(Unit(0, "g", "g", "c2"),),
              capture="graphs")
    never = EventPlan(s, (Instr("launch", "c1", 0), Instr("wait", "c2", 1, 0), Instr("launch", "c2", 1)), 1)
    later = EventPlan(s, (Instr("wait", "c2", 1, 0), Instr("launch", "c1", 0), Instr("record", "c1", 0, 0),
                          Instr("launch", "c2", 1)), 1)
    outside = EventPlan(s, (Instr("launch", "c1", 0), Instr("record", "c1", 0, 0), Instr("begin", "c2", unit=0),
                            Instr("wait", "c2", 1, 0, unit=0), Instr("launch", "c2", 1, unit=0),
                            Instr("end", "c2", unit=0)), 1)
    msgs = [[(d.code, d.span.line, d.message) for d in validate_plan(p)] for p in (never, later, outside)]
    assert msgs == [
        [("R003", 2, "wait on event e0 on c2 (before `k`) waits for nothing: the event is never recorded")],
        [("R003", 2, "wait on event e0 on c2 (before `k`) waits for nothing: the event is recorded only later, at instruction 2")],
        [("R003", 2, "wait on event e0 on c2 (before `k`) crosses a capture boundary: the event is recorded outside the wait's graph")],
    ]


def test_unit_whose_secondary_stream_does_not_rejoin_home_is_r004():
    s = inplace(True, "auto", "graphs")
    plan = insert_barriers(s, dependencies(s))
    join = max(i for i, ins in enumerate(plan.instrs) if ins.op == "wait")  # comp3 waits for comp2
    assert plan.instrs[join].stream == "comp3" and plan.instrs[join + 1].op == "end"
    broken = EventPlan(s, plan.instrs[:join] + plan.instrs[join + 1:], plan.num_events, plan.policy)
    (d,) = validate_plan(broken)
    assert (d.code, d.message, d.span.line) == ("R004", "capture unit `bwd` ends while comp2 has not rejoined comp3", 9)
    assert d.labels[0].span.line == 11


@pytest.mark.parametrize("capture,expect", [("graphs", ["C003", "C004"]), ("step", ["C003", "C004"]), ("none", [])])
def test_synchronize_and_alloc_inside_a_graph(capture, expect):
    s = sched([task(0, "c1", line=3, kernel="synchronize", unit=0), task(1, "c1", line=4, kernel="alloc", unit=0),
               task(2, HOST, line=5, kernel="synchronize")], [], units=(Unit(0, "g", "g", "c1"),), capture=capture)
    diags = validate_schedule(s, dependencies(s))
    assert [(d.code, d.span.line) for d in diags] == [(c, ln) for c, ln in zip(expect, (3, 4))]
    if expect:
        assert diags[0].message == "`synchronize` inside captured graph `g`: a CUDA graph cannot synchronize with the host"


def test_repeated_races_at_the_same_lines_are_reported_once_with_a_count():
    ts = []
    for k in range(3):
        ts += [task(2 * k, "c1", writes=["a"], line=4, name="w", step=k), task(2 * k + 1, "c2", reads=["a"], line=5, name="r", step=k)]
    s = sched(ts, [buf("a", 0)], steps=3, policy="explicit")
    plan = insert_barriers(s, dependencies(s))
    assert len(find_races(plan)) == 9  # every write races every read (and WAR across steps)
    diags = validate_plan(plan)
    assert [(d.code, d.span.line, d.labels[0].span.line) for d in diags] == [("R001", 5, 4), ("R001", 4, 5)]
    assert diags[0].notes[-1] == "the same race occurs 5 more times in the unrolled schedule (other steps, slots or op calls)"


# -- insert_barriers input checks ------------------------------------------------------------------

def test_insert_barriers_rejects_bad_input():
    s = sched([task(0, "c1", unit=0), task(1, "c2"), task(2, "c1", unit=0)], [], units=(Unit(0, "g", "g", "c1"),),
              capture="graphs")
    with pytest.raises(InternalError, match="capture unit 0 are not contiguous"):
        insert_barriers(s, ())
    with pytest.raises(ValueError, match="unknown barrier policy 'fast'"):
        insert_barriers(s, (), "fast")
    with pytest.raises(InternalError, match="edge 1 -> 0 does not follow issue order"):
        insert_barriers(sched([task(0, "c1"), task(1, "c2")], []), (Edge(1, 0, "AFTER"),))


# -- events and the steady state -------------------------------------------------------------------

def ab_schedule(steps: int) -> Schedule:
    """A/B slots: the host stages x[slot], trans copies it, comp1 computes from it and the
    weights, update writes the weights; the next slot's copy overlaps this step's compute."""
    bufs = [buf("stg_a", 0, space="host"), buf("stg_b", 16, space="host"), buf("x_a", 0), buf("x_b", 16),
            buf("w", 32), buf("h", 48)]
    ts: list[Task] = []
    for k in range(steps):
        s, n = "ab"[k % 2], "ab"[(k + 1) % 2]
        for i, (stream, r, w) in enumerate([(HOST, [], [f"stg_{n}"]), ("trans", [f"stg_{n}"], [f"x_{n}"]),
                                            ("comp1", [f"x_{s}", "w"], ["h"]), ("update", ["h"], ["w"])]):
            ts.append(Task(len(ts), "k", stream, tuple(r), tuple(w), step=k, slot=s, key=f"{s}|{i}"))
    return Schedule(("trans", "comp1", "update", HOST), tuple(bufs), tuple(ts), period=2, steps=steps)


def test_events_are_shared_by_key_and_the_steady_state_repeats():
    plan = insert_barriers(ab_schedule(6), dependencies(ab_schedule(6)))
    assert validate_plan(plan) == ()
    rec = {}
    for ins in plan.instrs:
        if ins.op == "record":
            rec.setdefault(plan.schedule.tasks[ins.task].key, set()).add(ins.event)
    assert all(len(evs) == 1 for evs in rec.values())  # one event per key, reused every period
    assert plan.num_events == len(rec) < sum(1 for i in plan.instrs if i.op == "record")
    assert steady_period(plan) == 2
    segs = plan_segments(plan)
    assert [segs.step_for(k) for k in (-1, 0, 5, 6, 7, 8, 9)] == [-1, 0, 5, 4, 5, 4, 5]
    assert segs.for_step(8) == plan_segment(plan, 4)
    # The last step records what the (replayed) next step waits for, though no unrolled step does.
    last = plan_segment(plan, 5)
    assert [plan.schedule.tasks[i.task].key for i in last if i.op == "record"] == \
           [plan.schedule.tasks[i.task].key for i in plan_segment(plan, 3) if i.op == "record"]
    # Four steps suffice here: step 0 has no previous step to wait for, but replaying steps
    # 2 and 3 twice more adds no race and binds every wait.
    assert steady_period(insert_barriers(ab_schedule(4), dependencies(ab_schedule(4)))) == 2
    short = plan_segments(insert_barriers(ab_schedule(2), dependencies(ab_schedule(2))))
    assert short.period is None  # one period is too few to prove anything
    with pytest.raises(ValueError, match="no steady state within its 2 unrolled steps"):
        short.for_step(2)
    with pytest.raises(ValueError, match="step -2 does not exist"):
        short.step_for(-2)
    keyless = ab_schedule(6)
    keyless = Schedule(keyless.streams, keyless.buffers, tuple(replace(t, key="") for t in keyless.tasks),
                       period=2, steps=6)
    assert steady_period(insert_barriers(keyless, dependencies(keyless))) is None


def test_a_wait_on_a_shared_event_binds_to_the_latest_work_of_that_key():
    # Period 1: the host's `after prev.a` in step k is issued after step k's own `a` (same key,
    # same event): the wait binds to that latest record, which covers the older one, so each key
    # keeps one event and the plan repeats.
    ts = []
    for k in range(5):
        ts += [Task(2 * k, "k", "c1", step=k, key="a"),
               Task(2 * k + 1, "k", HOST, after=(2 * k - 2,) if k else (), step=k, key="h")]
    s = sched(ts, [], steps=5)
    plan = insert_barriers(s, dependencies(s))
    assert plan.num_events == 1
    waits = [(i, ins) for i, ins in enumerate(plan.instrs) if ins.op == "wait"]
    assert [ins.task for _, ins in waits] == [3, 7]  # steps 1 and 3; steps 2 and 4 are covered
    first = waits[0][0]
    bound = max(j for j in range(first) if plan.instrs[j].op == "record")
    assert plan.instrs[bound - 1] == Instr("launch", "c1", 2, step=1)  # step 1's `a`, not step 0's
    assert steady_period(plan) == 2


# -- drawing ---------------------------------------------------------------------------------------

def test_dot_has_a_lane_per_stream_and_an_edge_per_wait(tmp_path):
    s = inplace(True, "explicit")
    plan = insert_barriers(s, dependencies(s))
    dot = plan_to_dot(plan)
    assert dot.count("subgraph cluster_") == 3
    assert 'n2 [label="t0 matmul\\ndw\\nm.sched:10"];' in dot
    # waits: the fork (no node precedes its record), dw -> dx, the join (no node follows it)
    assert '  n2 -> n8 [style=dashed, color=red, fontcolor=red, label="e1", constraint=false];' in dot
    assert dot.count("style=dashed") == 1
    p = tmp_path / "plan.dot"
    assert write_graph(plan, str(p)) == "text" and p.read_text() == dot
    with pytest.raises(ValueError, match=r"cannot write a graph as \.txt"):
        write_graph(plan, str(tmp_path / "plan.txt"))
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.svg"
    assert write_graph(plan, str(out)) in ("dot", "matplotlib")
    assert os.path.getsize(out) > 1000
