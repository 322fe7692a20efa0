"""The CPU backend as the oracle: random stream interleavings agree bitwise with the fixed
order; a missing wait is caught at run time on the buffer and tasks the static checker names;
a resumed run continues bit for bit; a diverging run stops with X010."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

from streamsched.diagnostics import StreamschedError
from streamsched.interp.barriers import plan_segment
from streamsched.interp.cpu_backend import CpuExecutor
from streamsched.interp.memory import allocate_arrays
from streamsched.interp.train import TrainOptions, train
from streamsched.interp.validate import validate_plan
from streamsched.pipeline import compile_file
from streamsched.stdlib.kernels import KERNELS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "examples")


def _train(name, **kw):
    c = compile_file(os.path.join(EX, name), **{k: kw.pop(k) for k in ("policy", "capture") if k in kw})
    return train(c, TrainOptions(backend="cpu", progress=False, **kw), base_dir=EX)


@pytest.mark.parametrize("name", ["mlp_digits.sched", "five_streams.sched"])
def test_random_interleavings_are_bitwise_identical(name):
    ref = _train(name, max_steps=3)
    assert ref.races == []
    for seed in range(20):
        got = _train(name, max_steps=3, interleave="random", interleave_seed=seed)
        assert got.races == []
        for k, v in ref.params.items():
            assert np.array_equal(v, got.params[k]), (seed, k)


def _stage(task, arrays):
    out = arrays[task.outs[0]]
    if task.kernel == "stage":
        rng = np.random.default_rng(task.step + 7)
        out[...] = rng.integers(0, 10, out.shape) if out.dtype.kind == "i" else rng.random(out.shape)
    else:
        out[...] = 0.01


def test_removed_wait_is_caught_at_run_time_as_the_checker_says():
    c = compile_file(os.path.join(EX, "explicit_mlp.sched"))
    assert c.ok
    plan = c.plan
    # Remove, one at a time, the waits of step 0 until one removal leaves a race on the device.
    for i, ins in enumerate(plan.instrs):
        if ins.op != "wait" or ins.step != 0 or ins.stream == "host":
            continue
        broken = replace(plan, instrs=plan.instrs[:i] + plan.instrs[i + 1:])
        static = [d for d in validate_plan(broken, c.edges) if d.code == "R001" and " on host" not in d.message]
        if static:  # (a race of the host's staging is the first found otherwise)
            break
    else:
        pytest.fail("no single wait of step 0 guards a race")
    want = {(d.message) for d in static}
    for seed in (0, 1, 2):
        arrays = allocate_arrays(c.schedule.buffers)
        ex = CpuExecutor(c.schedule, arrays, KERNELS, interleave="random", seed=seed)
        for step in range(-1, 3):
            ex.run(plan_segment(broken, step), _stage)
        runtime = {d.message for d in ex.races}
        assert runtime, "the run-time detector missed the race"
        assert runtime & want, (runtime, want)
        # same buffer, same two tasks
        d = next(d for d in ex.races if d.message in want)
        s = next(s for s in static if s.message == d.message)
        assert d.span == s.span and [l.span for l in d.labels] == [l.span for l in s.labels]


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = _train("mlp_digits.sched", epochs=4, lr=0.05)
    ck = str(tmp_path / "ck.npz")
    part = _train("mlp_digits.sched", epochs=4, lr=0.05, save=ck, max_steps=2 * 11)
    assert len(part.history) == 2 and os.path.exists(ck)
    resumed = _train("mlp_digits.sched", epochs=4, lr=0.05, resume=ck)
    assert resumed.history[-1]["epoch"] == 4  # epochs counted from 1
    for k, v in full.params.items():
        assert np.array_equal(v, resumed.params[k]), k
    assert resumed.history[-1]["test_acc"] == full.history[-1]["test_acc"]


def test_resume_refuses_a_program_whose_arrays_differ(tmp_path):
    ck = str(tmp_path / "ck.npz")
    _train("mlp_digits.sched", epochs=1, lr=0.05, save=ck)
    with pytest.raises(StreamschedError) as e:
        _train("five_streams.sched", epochs=2, resume=ck)
    assert {d.code for d in e.value.diagnostics} == {"X007"}


def test_divergence_stops_with_x010_and_keeps_the_checkpoint(tmp_path):
    ck = str(tmp_path / "ck.npz")
    _train("mlp_digits.sched", epochs=1, lr=0.05, save=ck)
    before = open(ck, "rb").read()
    with pytest.raises(StreamschedError) as e:
        _train("mlp_digits.sched", epochs=3, lr=1e30, save=ck, overwrite=True)  # a new run onto it, on purpose
    d = e.value.diagnostics[0]
    assert d.code == "X010" and ("nan" in d.message or "inf" in d.message)
    assert open(ck, "rb").read() == before
