"""The checker made to scale (issue 16) returns exactly what it returned before: `dependencies`,
`analyse_plan` (races with their buffers and kinds, unbound waits, unjoined units, unordered
`after`) and the steady-state replay check, compared with the pre-issue-16 code kept verbatim in
tests/checker_reference.py, on random schedules, on hand-edited plans (an instruction dropped)
and on a deep MLP under every policy; and a generated deep model compiles within a time and
memory budget that grows linearly with its tasks."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

from hypothesis import given, settings, strategies as st

import checker_reference as ref
from streamsched.interp import barriers as B
from streamsched.interp import validate as V
from streamsched.interp.dependencies import dependencies
from streamsched.interp.ir import EventPlan
from test_barriers_properties import schedules, templates, unroll

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _variants(plan: EventPlan, drops: list[int]) -> list[EventPlan]:
    """The plan, and the plan with each instruction at `drops` removed (a wait, a record, a
    begin or end): what a hand-edited plan looks like, with races and broken waits."""
    out = [plan]
    for i in drops:
        if i < len(plan.instrs) and plan.instrs[i].op != "launch":
            out.append(EventPlan(plan.schedule, plan.instrs[:i] + plan.instrs[i + 1:], plan.num_events, plan.policy))
    return out


def _same_analysis(plan: EventPlan) -> None:
    n = len(plan.schedule.tasks)
    for kw in ({}, {"races_from": n // 2}, {"first_race": True}, {"stop_from": n // 3}):
        got, want = V.analyse_plan(plan, **kw), ref.analyse_plan(plan, **kw)
        assert got == want, kw


@settings(max_examples=150, deadline=None)
@given(schedules(), st.sampled_from(["auto", "chain", "explicit"]), st.lists(st.integers(0, 400), max_size=4))
def test_dependencies_and_plan_analysis_equal_the_reference(s, policy, drops) -> None:
    edges = dependencies(s)
    assert edges == ref.dependencies(s)
    plan = B.insert_barriers(s, edges, policy)
    for p in _variants(plan, drops):
        _same_analysis(p)
        assert V.validate_plan(p, edges) == V.validate_plan(EventPlan(p.schedule, p.instrs, p.num_events, p.policy), edges)


@settings(max_examples=60, deadline=None)
@given(templates())
def test_replay_check_equals_the_reference(tp) -> None:
    tp = {**tp, "use_keys": True}
    s = unroll(tp, 4 * tp["period"])
    plan = B.insert_barriers(s, dependencies(s), "auto")
    for m in (tp["period"], 2 * tp["period"]):
        got, want = B._replay_check(plan, m), ref._replay_check(plan, m)
        assert got[0] == want[0]
        assert (got[1] is None) == (want[1] is None)
        if got[1] is not None:
            assert got[1][:4] == want[1][:4]


def test_deep_mlp_races_equal_the_reference() -> None:
    """A deep MLP (aliased `dx into x` buffers, forked backward) under every capture mode and
    policy: chain and explicit race a lot there, so names, kinds and merging are all exercised."""
    from plan_bench import mlp_schedule, step_unit

    raced = 0
    for capture in ("none", "graphs", "step"):
        base = mlp_schedule(4, 4, "none" if capture == "step" else capture)
        s = step_unit(base) if capture == "step" else base
        edges = dependencies(s)
        assert edges == ref.dependencies(s)
        for policy in ("auto", "chain", "explicit"):
            plan = B.insert_barriers(s, edges, policy)
            _same_analysis(plan)
            races = V.analyse_plan(plan).races
            assert policy != "auto" or not races
            raced += bool(races)
            for m in (2, 4):
                got, want = B._replay_check(plan, m), ref._replay_check(plan, m)
                assert got[0] == want[0] and got[1][:4] == want[1][:4]
    assert raced >= 3  # explicit races under every capture mode


def test_a_deep_model_compiles_in_linear_time_and_memory() -> None:
    """Compile time and peak memory per task of a generated deep model stay flat from 2,000 to
    8,000 tasks (a quadratic pass would quadruple the time per task), and the larger one stays
    within budgets far above what the pipeline needs (CI shares its cores)."""
    code = ("import sys, time, resource; sys.path.insert(0, sys.argv[1]); from plan_bench import deep_model_text;"
            "import streamsched.pipeline as P; open(sys.argv[3], 'w').write(deep_model_text(int(sys.argv[2])));"
            "t0 = time.process_time(); c = P.compile_file(sys.argv[3]); t = time.process_time() - t0;"
            "print(len(c.schedule.tasks), t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, c.ok)")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    figures = []
    for layers in (45, 180):
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ss_deep_{os.getpid()}_{layers}.sched")
        try:
            out = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "benchmarks"), str(layers), path],
                                 capture_output=True, text=True, env=env, check=True).stdout.split()
        finally:
            if os.path.exists(path):
                os.remove(path)
        tasks, cpu, rss, ok = int(out[0]), float(out[1]), float(out[2]), out[3] == "True"
        assert ok
        figures.append((tasks, cpu, rss))
    (n1, t1, m1), (n2, t2, m2) = figures
    assert n2 > 3.5 * n1
    assert t2 / n2 < 3.0 * t1 / n1, figures  # near-linear: a quadratic pass would make it 4x (CI shares cores)
    assert t2 < 6.0, figures                 # ~0.7 s of CPU on an idle core today
    assert m2 < 250, figures                 # ~100 MB today
