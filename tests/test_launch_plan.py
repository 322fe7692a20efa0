"""Which whole epochs the epoch graph runs in one launch (issue 13, `Run.launch_plan`): epochs
that evaluate and snapshot alike and end in ring ends share a launch, up to `--epoch-launch N`
or the automatic size (about STEPS_PER_LAUNCH steps, at most MAX_EPOCHS_PER_LAUNCH epochs);
an epoch that must snapshot (a checkpoint, a NumPy evaluation) is a launch of its own.  Pure
bookkeeping: checked on the CPU against a plan recomputed here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from streamsched.interp.training.loop import Run
from streamsched.interp.training.options import MAX_EPOCHS_PER_LAUNCH, STEPS_PER_LAUNCH, TrainOptions


class _Runner:
    def ring_ends(self, snapshot: bool) -> bool:
        return not snapshot


def _run(epochs: int, spe: int, start: int = 0, save: bool = False, where: str = "device", **opts) -> Run:
    r = Run.__new__(Run)
    r.opts = TrainOptions(**opts)
    r.spe, r.start_epoch, r.epochs, r.rank = spe, start, epochs, 0
    r.ck = SimpleNamespace(save=object() if save else None)
    r.evaluator = SimpleNamespace(where=where)
    r.resident = None
    return r


def _oracle(epochs, spe, first, start, cap, flags, ring, max_steps=None):
    """The plan, recomputed: eligible epochs grouped greedily by equal flags."""
    out, cur = [], None
    for i in range(epochs - start):
        k0 = i * spe
        if k0 < first or (max_steps is not None and k0 + spe > max_steps):
            cur = None
            continue
        f = flags(start + i)
        if cur is not None and cur[3] == f and cur[1] < cap and ring(f):
            cur[1] += 1
            continue
        cur = [start + i, 1, None, f]
        out.append(cur)
    return [(e, n, f[0], f[1]) for e, n, _, f in out]


@pytest.mark.parametrize("epochs, spe, first, how", [(40, 11, 2, "auto"), (40, 11, 2, "epoch"), (40, 11, 2, "3"),
                                                     (30, 22, 2, "auto"), (5, 1000, 2, "auto"), (3, 7, 20, "auto"),
                                                     (100, 1, 2, "auto"), (40, 11, 2, "99")])
def test_epochs_that_end_alike_share_a_launch_up_to_its_size(epochs, spe, first, how):
    r = _run(epochs, spe, epoch_launch=how)
    plan = r.launch_plan(_Runner(), first)
    cap = {"epoch": 1, "auto": max(1, min(MAX_EPOCHS_PER_LAUNCH, -(-STEPS_PER_LAUNCH // spe)))}.get(
        how, min(int(how), MAX_EPOCHS_PER_LAUNCH) if how.isdigit() else None)
    assert plan == _oracle(epochs, spe, first, 0, cap, lambda e: (True, False), lambda f: not f[1])
    covered = [e + j for e, n, _, _ in plan for j in range(n)]
    assert covered == sorted(set(covered))  # every eligible epoch once, in order
    assert all(n <= cap for _, n, _, _ in plan)


def test_an_epoch_that_evaluates_differently_starts_a_new_launch():
    r = _run(12, 11, eval_every=4)
    plan = r.launch_plan(_Runner(), 2)
    # epoch e (from 0) evaluates when (e + 1) % 4 == 0 or it is the last
    assert plan == [(1, 2, False, False), (3, 1, True, False), (4, 3, False, False), (7, 1, True, False),
                    (8, 3, False, False), (11, 1, True, False)]


def test_an_epoch_that_snapshots_is_a_launch_of_its_own():
    assert r_plan(save=True) == [(e, 1, True, True) for e in range(1, 6)]
    assert r_plan(where="host") == [(e, 1, True, True) for e in range(1, 6)]  # a NumPy evaluation


def r_plan(**kw):
    return _run(6, 11, **kw).launch_plan(_Runner(), 2)


def test_steps_that_cut_an_epoch_leave_it_out_and_a_resume_starts_later():
    r = _run(10, 11, max_steps=60)
    assert r.launch_plan(_Runner(), 2) == [(1, 4, True, False)]  # epochs 2-5 end by step 55; 6 is cut
    r = _run(10, 11, start=4)
    assert r.launch_plan(_Runner(), 2) == [(5, 5, True, False)]


@pytest.mark.parametrize("capture", ["step", "graphs"])
def test_only_events_waited_across_units_are_recorded_again_after_a_graph_launch(tmp_path, capture):
    """`events_bound_outside`: mlp_digits' units (capture = step: one per step; graphs: one per
    graph) fork and join their streams through events recorded and waited inside them (edges of
    their graphs), and what crosses units is recorded outside them: no event recorded in a unit
    is recorded again after its launch (each would cost the host a call per step).  Recomputed
    here from the plan: a wait binds to the latest earlier record of its event."""
    import os

    from streamsched.interp.cuda.executor import events_bound_outside
    from streamsched.pipeline import compile_file

    src = open(os.path.join(os.path.dirname(__file__), "..", "examples", "mlp_digits.sched")).read()
    path = tmp_path / "m.sched"
    path.write_text(src.replace("capture  = step", f"capture  = {capture}"))
    c = compile_file(str(path))
    assert c.ok
    got = events_bound_outside(c.plan.instrs)
    across = set()
    for n, w in enumerate(c.plan.instrs):
        if w.op != "wait":
            continue
        recs = [r for r in c.plan.instrs[:n] if r.op == "record" and r.event == w.event]
        if recs and recs[-1].unit != w.unit:
            across.add(w.event)
    assert got == across
    in_units = {i.event for i in c.plan.instrs if i.op == "record" and i.unit >= 0}
    assert in_units and not (got & in_units)  # the planner records what crosses units outside them
    # a wait on an in-unit event from outside the unit (as a hand-written plan could have) binds across
    from dataclasses import replace

    rec = next(i for i in c.plan.instrs if i.op == "record" and i.unit >= 0)
    extra = replace(rec, op="wait", unit=-1, stream="host")
    instrs = list(c.plan.instrs)
    instrs.insert(instrs.index(rec) + 1, extra)
    assert events_bound_outside(instrs) == got | {rec.event}
