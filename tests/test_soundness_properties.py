"""Soundness properties of issue 11 ("a schedule that checks clean computes what the same program
without streams computes"), on programs generated as users write them (tests/sched_gen.py) and
on every example.  The oracle is a bitwise comparison of results across variants of one program
(metamorphic), and, for plans with a wait removed, happens-before recomputed over lanes in the
test (tests/lane_oracle.py).

1. Removing every `into` from a program that checks clean never changes its CPU results, over
   several interleavings: `into` is an optimisation, never a change of meaning.
2. A program that checks clean under `explicit` gives bitwise the results it gives under `auto`.
3. Random interleavings spanning steps give bitwise-identical parameters after 2 epochs, and no
   run-time race report: every example, and generated clean programs.
4. A clean program's plan with one wait removed (the check bypassed: the EventPlan edited and run
   on the CPU executor directly): the run-time detector reports a race exactly when the oracle
   finds a conflicting pair left unordered, in every interleaving, and that happens in most cases
   (the rate is asserted above a floor; see `test_dropped_wait_is_seen_in_most_cases`).

Results are the final parameters and optimizer state and the per-epoch losses and accuracy
(`train`), or the parameters and per-step losses (direct runs).  Example counts follow the
hypothesis profile (tests/conftest.py): "dev" runs 20 programs per property, "ci" (CI=1) 100
(and 25 / 200 trials of property 4).  `pytest --hypothesis-show-statistics` shows how many generated programs were clean
and how many of those had an `into`.
"""

from __future__ import annotations

import functools
import glob
import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, assume, event, given, settings
from hypothesis import strategies as st

from lane_oracle import conflicting_pairs, lane_hb, unordered
from sched_gen import programs, strip_into
from streamsched.diagnostics import StreamschedError
from streamsched.interp.cpu_backend import CpuExecutor
from streamsched.interp.data import digits_train_samples
from streamsched.interp.ir import EventPlan
from streamsched.interp.memory import allocate_arrays
from streamsched.interp.train import TrainOptions, init_params, train
from streamsched.pipeline import Compiled, compile_file
from streamsched.stdlib.kernels import KERNELS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.sched")))

BASE = settings().max_examples  # 100 under "dev", 1000 under "ci"
PROGRAMS = max(20, BASE // 10)
PROPERTY = settings(max_examples=PROGRAMS, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
INTERLEAVINGS = (1, 2)  # random seeds tried besides the fixed order


def compile_text(text: str, **kw) -> Compiled | None:
    """The compiled program, or None when a P/S diagnostic stops it."""
    try:
        return compile_file("gen.sched", text, **kw)
    except StreamschedError:
        return None


def clean(c: Compiled | None) -> bool:
    return c is not None and c.ok


def outcome(c: Compiled, interleave: str = "fixed", seed: int = 0, **kw) -> tuple:
    """What a run computes, as bytes: parameters and state, per-epoch losses and accuracy, and
    the run-time race reports; a run that stops with a diagnostic is its codes."""
    try:
        r = train(c, TrainOptions(backend="cpu", progress=False, interleave=interleave, interleave_seed=seed, **kw),
                  base_dir=os.path.join(ROOT, "examples"))
    except StreamschedError as e:
        return ("stopped", tuple(d.code for d in e.diagnostics)), ()
    hist = tuple(np.float64(h.get(k, np.nan)).tobytes() for h in r.history
                 for k in ("train_loss", "test_loss", "test_acc"))
    values = (tuple(sorted((n, a.dtype.str, a.tobytes()) for n, a in r.params.items())), hist, r.steps)
    return values, tuple(d.message for d in r.races)


def differ(got: tuple, want: tuple) -> str:
    """A short account of how two outcomes' values differ (for assertion messages)."""
    if got[0] != want[0] and "stopped" in (got[0][0], want[0][0]):
        return f"{got[0]} vs {want[0]}"
    names = [n for (n, _, a), (_, _, b) in zip(got[0], want[0]) if a != b]
    losses = [float(np.frombuffer(x)[0]) for x in got[1]], [float(np.frombuffer(x)[0]) for x in want[1]]
    return f"buffers {names[:6]}{'...' if len(names) > 6 else ''} differ; history {losses[0]} vs {losses[1]}"


def interleavings(c: Compiled, **kw):
    yield "fixed", outcome(c, **kw)
    for seed in INTERLEAVINGS:
        yield f"random {seed}", outcome(c, "random", seed, **kw)


# ---------------------------------------------------------------------------------------------
# 1. `into` never changes meaning


@settings(PROPERTY)
@given(programs())
def test_removing_into_never_changes_results(g):
    c = compile_text(g.text)
    event(f"clean: {clean(c)}")
    assume(g.has_into and clean(c))
    event("clean, with into")
    bare = compile_text(strip_into(g.text))
    assert clean(bare), "removing `into` only removes hazards"
    want, _ = outcome(bare)
    for how, (got, races) in interleavings(c):
        assert races == (), how
        assert got == want, f"{how}: results differ with and without `into` {g.intos}: {differ(got, want)}"


@settings(PROPERTY)
@given(programs())
def test_removing_legal_into_never_changes_results(g):
    # The intos the generator made legal (the statement is the value's last reader): holds today
    # and after the lifetime analysis, which must keep accepting them (see the next test).
    assume(g.has_into and g.all_into_legal)
    c = compile_text(g.text)
    assume(clean(c))
    event("clean, with legal into")
    want, _ = outcome(compile_text(strip_into(g.text)))
    for how, (got, races) in interleavings(c):
        assert races == (), how
        assert got == want, f"{how}: {differ(got, want)}"


def test_generator_makes_plenty_of_legal_into():
    """Property 1 is not vacuous: a good share of generated programs check clean with an `into`
    that the statement's own read is the last read of (so it survives a lifetime analysis), and
    the illegal ones are plenty too (a lifetime analysis has something to reject)."""
    seen: Counter = Counter()

    @settings(max_examples=100, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(programs())
    def tally(g):
        c = compile_text(g.text)
        seen["programs"] += 1
        seen["clean"] += clean(c)
        if g.has_into:
            seen["with into"] += 1
            if g.all_into_legal:
                seen["legal into, clean"] += clean(c)
            else:
                seen["illegal into"] += 1

    tally()
    print(f"\ngenerated programs: {dict(seen)}")
    assert seen["programs"] == 100
    assert seen["legal into, clean"] >= 25, seen
    assert seen["illegal into"] >= 15, seen
    assert seen["clean"] >= 60, seen


# ---------------------------------------------------------------------------------------------
# 2. explicit == auto


@settings(PROPERTY)
@given(programs(policy="explicit"))
def test_explicit_gives_the_results_of_auto(g):
    c = compile_text(g.text)
    event(f"explicit clean: {clean(c)}")
    assume(clean(c))
    auto = compile_text(g.text, policy="auto")
    assert clean(auto), "a file that checks under explicit checks under auto"
    assert auto.plan.policy == "auto" and c.plan.policy == "explicit"
    want, _ = outcome(auto)
    for how, (got, races) in interleavings(c):
        assert races == (), how
        assert got == want, f"{how}: explicit and auto differ: {differ(got, want)}"


# ---------------------------------------------------------------------------------------------
# 3. interleavings spanning steps: bitwise-identical, race-free


def _two_epochs(c: Compiled) -> tuple[int, int]:
    """(steps, epoch records) of the run to compare: two epochs of a digits example; five steps
    of a text example (its epoch is thousands of steps; five span the slot period twice and the
    CPU backend's two steps in flight)."""
    data = dict(c.program.train).get("data")
    if data.name == "text":
        return 5, 1
    test = dict(zip(("test", "seed"), data.args)).get("test", dict(data.kwargs).get("test", 0.2))
    return 2 * (digits_train_samples(test) // c.program.model.batch), 2


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_interleavings_spanning_steps_are_bitwise_identical(path):
    c = compile_file(path)
    assert c.ok, c.diagnostics
    # The file's own epochs and lr schedule, stopped after two epochs (--steps).
    steps, epochs = _two_epochs(c)
    runs = dict(interleavings(c, max_steps=steps))
    (want, races) = runs.pop("fixed")
    assert races == () and want[2] == steps and len(want[1]) == 3 * epochs
    for how, (got, races) in runs.items():
        assert races == (), how
        assert got == want, f"{how}: {differ(got, want)}"


@settings(PROPERTY)
@given(programs())
def test_generated_interleavings_spanning_steps_are_bitwise_identical(g):
    c = compile_text(g.text)
    event(f"clean: {clean(c)}")
    assume(clean(c))
    runs = dict(interleavings(c))
    want, races = runs.pop("fixed")
    assert races == () and want[2] == 2 * g.steps_per_epoch
    for how, (got, races) in runs.items():
        assert races == (), how
        assert got == want, f"{how}: {differ(got, want)}"


# ---------------------------------------------------------------------------------------------
# 4. one wait removed from a plan


def direct_run(c: Compiled, instrs, interleave: str, seed: int) -> tuple:
    """Run the prologue and every unrolled step of c's plan (with `instrs` in place of its
    instructions) on the CPU executor, all issued before any runs (the most overlap), with
    deterministic batches; returns (parameters and state, per-step losses) as bytes, and how
    many races the run-time detector reported."""
    s = c.schedule
    program = c.program
    arrays = allocate_arrays(s.buffers)
    for n, v in init_params(program, 0).items():
        arrays[n][...] = v
    losses: dict[int, bytes] = {}
    loss = program.model.loss

    def done(task, step):
        if loss in task.outs:
            losses[step] = arrays[loss].tobytes()

    rng = np.random.default_rng(0)
    batch = program.model.batch
    xs = rng.normal(0, 1, (s.steps + 2, batch, 64)).astype(np.float32)
    ys = rng.integers(0, 10, (s.steps + 2, batch)).astype(np.int32)

    def host(task, arrs, step):
        if task.kernel == "stage":
            j = step + task.attr("ahead", 0)
            arrs[task.outs[0]][...] = xs[j] if task.attr("field") == "x" else ys[j]
        elif task.kernel == "set_scalar":
            arrs[task.outs[0]][...] = 0.05 if task.attr("name") == "lr" else float(max(step, 0) + 1)

    ex = CpuExecutor(s, arrays, KERNELS, interleave=interleave, seed=seed, on_task_done=done)
    for k in range(-1, s.steps):
        ex.issue([i for i in instrs if i.step == k], functools.partial(host, step=k), tag=k)
    ex.drain()
    values = tuple(sorted((n, arrays[n].tobytes()) for n, _ in program.inits)), tuple(sorted(losses.items()))
    return values, len(ex.races)


def drop_trial(c: Compiled, which: int) -> dict:
    """Remove the `which`-th wait of c's plan and compare: the oracle's unordered conflicting
    pairs, the detector's reports and the results of the fixed order and a few random
    interleavings against the whole plan's results."""
    plan = c.plan
    waits = [i for i, ins in enumerate(plan.instrs) if ins.op == "wait"]
    gone = waits[which % len(waits)]
    instrs = plan.instrs[:gone] + plan.instrs[gone + 1:]
    pairs = conflicting_pairs(plan.schedule)
    assert not unordered(pairs, lane_hb(plan.schedule.capture, plan.instrs)), "the whole plan is race-free"
    before = lane_hb(plan.schedule.capture, instrs)
    racy = unordered(pairs, before)
    want, races = direct_run(c, plan.instrs, "fixed", 0)
    assert races == 0
    runs = [direct_run(c, instrs, "fixed", 0)] + [direct_run(c, instrs, "random", k) for k in (1, 2, 3)]
    return {"racy": bool(racy), "reported": [r for _, r in runs], "changed": any(v != want for v, _ in runs),
            "wait": plan.instrs[gone], "why": "" if racy else _why_unseen(plan, gone, before)}


def _why_unseen(plan: EventPlan, gone: int, before: dict[int, int]) -> str:
    """Why removing wait `gone` leaves every conflicting pair ordered: it joined a secondary
    stream to its home right before the unit's `end` (which completes only when every lane is
    done: R004's business, not a race); it was a unit's fork for a lane whose work conflicts
    with nothing issued before the unit (the first step's zero_grad: no gradient was touched
    yet); it was another unit-level fork or join (chain and explicit order graphs by them under
    capture = none too) that no conflicting pair needs; it ordered only an `after` between
    tasks that share no bytes (a host staging task that inherits its launch's `after`); or every
    pair it ordered is ordered by another path too."""
    s = plan.schedule
    ins = plan.instrs[gone]
    rest = [i for i in plan.instrs[gone + 1:] if i.stream == ins.stream and i.unit == ins.unit]
    nxt = next((i for i in rest if i.op != "wait"), None)
    if s.capture != "none" and ins.unit >= 0 and nxt is not None and nxt.op == "end":
        return "join before end"
    rec = max((j for j in range(gone) if plan.instrs[j].op == "record" and plan.instrs[j].event == ins.event),
              default=-1)
    if s.capture != "none" and rec > 0 and plan.instrs[rec - 1].op == "begin":
        return "fork of a lane with nothing earlier to follow"
    if ins.task < 0:
        return "a unit's fork or join no data needs"
    if any(not before[t.id] >> u & 1 for t in s.tasks for u in t.after):
        return "an `after` with no shared bytes"
    return "ordered another way"


def test_dropped_wait_is_seen_in_most_cases():
    """Property 4: the rate at which a plan with one wait removed shows it (a run-time race
    report, or results that differ from the whole plan's in some interleaving) over generated
    clean programs, with the detector exact against the oracle in every trial: it reports in
    every interleaving when some conflicting pair is left unordered, and never otherwise (then
    the results are bitwise those of the whole plan)."""
    trials: list[dict] = []

    @settings(max_examples=max(25, BASE // 5), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(programs(), st.integers(0, 10 ** 6))
    def trial(g, which):
        c = compile_text(g.text)
        assume(clean(c) and any(i.op == "wait" for i in c.plan.instrs))
        t = drop_trial(c, which)
        if t["racy"]:
            assert all(t["reported"]), t
        else:
            assert not any(t["reported"]) and not t["changed"], t
        trials.append(t)

    trial()
    seen = sum(1 for t in trials if any(t["reported"]) or t["changed"])
    rate = seen / len(trials)
    changed = sum(t["changed"] for t in trials)
    misses = Counter(t["why"] for t in trials if not t["racy"])
    print(f"\nproperty 4: {seen}/{len(trials)} = {rate:.2f} of plans with one wait removed were seen "
          f"(values changed in {changed}); unseen: {dict(misses)}")
    assert len(trials) >= 10
    # Measured 0.94 over the 200 trials of CI=1 (0.92 over the 25 of "dev"); every miss was a
    # wait no conflicting pair needs (`_why_unseen`: joins before `end`, first-step forks, unit
    # joins under capture = none, a host staging task's inherited `after`).
    assert rate >= 0.75, (rate, [t["wait"] for t in trials if not t["racy"]])
