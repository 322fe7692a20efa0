"""Plans hypothesis once found wrong, kept as fixed cases (the property tests in
test_barriers_properties.py draw new schedules every run)."""

from __future__ import annotations

from streamsched.interp.barriers import insert_barriers
from streamsched.interp.dependencies import dependencies
from streamsched.interp.ir import Buffer, Schedule, Task, Unit


def _hb(plan) -> dict[int, set[int]]:
    """Task -> tasks that happen before it: stream order plus record -> wait (capture = none),
    recomputed here independently of the planner."""
    seen: dict[str, set[int]] = {}
    rec: dict[int, set[int]] = {}
    before: dict[int, set[int]] = {}
    for ins in plan.instrs:
        cur = seen.setdefault(ins.stream, set())
        if ins.op == "launch":
            before[ins.task] = set(cur)
            cur.add(ins.task)
        elif ins.op == "record":
            rec[ins.event] = set(cur)
        elif ins.op == "wait":
            cur |= rec.get(ins.event, set())
    return before


def test_a_wait_on_a_shared_key_event_is_not_kept_when_another_wait_implies_it():
    """Task 8 must follow task 0 (`after`) and task 5 (WAW on b0); task 5 follows task 4, which
    follows task 0 on s1.  The planner used to move the wait for task 0 to the latest anchor of its
    key (task 7) before deciding what was implied, so it kept a redundant wait on task 7."""
    bufs = [Buffer("b0", (1,), "u8", offset=0, nbytes=1)] + \
        [Buffer(f"b{i}", (1,), "u8", offset=0, nbytes=1, alias_of="b0") for i in range(1, 6)]
    rows = [(0, "s1", (), -1, 0, "s1", 0, "a|0"), (1, "s0", ("b0",), 0, 1, "s0", 0, "a|1"),
            (2, "s0", (), 0, 1, "s0", 0, "a|2"), (3, "s0", (), 0, 1, "s0", 0, "a|3"),
            (4, "s1", ("b0",), 0, 1, "s0", 0, "a|4"), (5, "host", ("b0",), -1, 2, "host", 0, "a|5"),
            (6, "s0", (), -1, 3, "s0", 0, "a|6"), (7, "s1", (), -1, 4, "s1", 1, "a|0"),
            (8, "s0", ("b0",), 1, 5, "s0", 1, "a|1"), (9, "s0", (), 1, 5, "s0", 1, "a|2"),
            (10, "s0", (), 1, 5, "s0", 1, "a|3"), (11, "s1", ("b0",), 1, 5, "s0", 1, "a|4"),
            (12, "host", ("b0",), -1, 6, "host", 1, "a|5"), (13, "s0", (), -1, 7, "s0", 1, "a|6")]
    tasks = tuple(Task(i, "k", s, (), w, (), (0,) if i == 8 else (), u, op, rep, step, "", key)
                  for i, s, w, u, op, rep, step, key in rows)
    units = (Unit(0, "g1[a]", "g1", "s0", "a", 0), Unit(1, "g1[a]", "g1", "s0", "a", 1))
    s = Schedule(("s0", "s1", "host"), tuple(bufs), tasks, units, 1, 2, "none", "auto")
    plan = insert_barriers(s, dependencies(s), "auto")
    hb = _hb(plan)
    assert 0 in hb[8] and 5 in hb[8]
    waits_before_8 = [i for i in plan.instrs if i.op == "wait" and i.task == 8]
    assert len(waits_before_8) == 1, waits_before_8
