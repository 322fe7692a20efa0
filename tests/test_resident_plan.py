"""Device-resident data, the plan side (interp/resident.py; no GPU needed): every host-to-device
copy of a staged batch or uploaded scalar becomes a gather, the host tasks and host waits go,
and the gather's counting rule (batch = step + executions * period + ahead) loads, at every
loop step, the very batch host staging loads there: replayed here over the real Segments with
an independent count of each task's executions."""

from __future__ import annotations

import os

import pytest

from streamsched.interp.barriers import plan_segments
from streamsched.interp.ir import HOST
from streamsched.interp.resident import resident_plan

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _compiled(name, capture=None):
    from streamsched.pipeline import compile_file

    return compile_file(os.path.join(EXAMPLES, f"{name}.sched"), capture=capture)


@pytest.mark.parametrize("name,capture", [("mlp_digits", "step"), ("mlp_digits", "none"), ("seed_step", "graphs"),
                                          ("five_streams", None), ("gpt_text", None)])
def test_each_gather_loads_the_batch_host_staging_loads(name, capture):
    c = _compiled(name, capture)
    rp = resident_plan(c.schedule, c.plan)
    assert rp.why_not == ""
    tasks = c.schedule.tasks
    staged = {o for t in tasks if t.kernel == "stage" for o in t.outs}
    copies = {t.id for t in tasks if t.kernel == "h2d" and t.args[0] in staged}
    assert copies and copies <= set(rp.gathers)
    assert rp.dropped == {t.id for t in tasks if t.stream == HOST}
    segs = plan_segments(c.plan)
    assert rp.period == (segs.period or 0)
    runs: dict[int, int] = {}  # task -> executions so far (the device counter, counted here)
    for k in range(-1, 3 * segs.steps + 5):
        instrs = segs.for_step(k)
        dev = rp.device_instrs(instrs)
        assert not [i for i in dev if i.stream == HOST and i.op in ("launch", "wait")]
        # host staging: the stage task of a copy's own step writes batch k + ahead (host_fn)
        host_batch = {}
        for i in instrs:
            if i.op == "launch" and tasks[i.task].kernel == "stage":
                st = tasks[i.task]
                host_batch[(st.step, st.outs[0])] = k + st.attr("ahead", 0)
        for i in dev:
            if i.op == "launch" and i.task in rp.gathers:
                g = rp.gathers[i.task]
                n = runs.get(i.task, 0)
                j = g.step + n * rp.period + g.ahead
                runs[i.task] = n + 1
                if g.kind == "field":
                    assert j == host_batch[(g.step, tasks[i.task].args[0])], (k, g)
                else:
                    assert j - g.ahead == max(k, -1) and g.ahead == 0  # a scalar is this step's value


def test_the_device_plan_keeps_every_device_instruction():
    c = _compiled("mlp_digits")
    rp = resident_plan(c.schedule, c.plan)
    host = [i for i in c.plan.instrs if i.stream == HOST and i.op in ("launch", "wait")]
    dev = rp.device_instrs(tuple(c.plan.instrs))
    assert host and len(dev) == len(c.plan.instrs) - len(host)
    assert [i for i in c.plan.instrs if i.stream != HOST or i.op not in ("launch", "wait")] == list(dev)


def test_other_host_work_keeps_the_data_on_the_host():
    from dataclasses import replace

    c = _compiled("mlp_digits")
    tasks = list(c.schedule.tasks)
    host = next(t for t in tasks if t.kernel == "set_scalar")
    tasks[host.id] = replace(host, kernel="d2h_log")
    rp = resident_plan(replace(c.schedule, tasks=tuple(tasks)), c.plan)
    assert rp.why_not.startswith("the host task") and not rp.gathers


def test_data_on_is_checked_and_the_cpu_says_it_stages(capsys):
    from streamsched.diagnostics import StreamschedError
    from streamsched.interp.train import TrainOptions, train

    c = _compiled("mlp_digits")
    with pytest.raises(StreamschedError) as err:
        train(c, TrainOptions(backend="cpu", epochs=1, progress=False, data_on="gpu"), base_dir=EXAMPLES)
    assert err.value.diagnostics[0].code == "X004" and "--data-on" in err.value.diagnostics[0].message
    lines = []
    res = train(c, TrainOptions(backend="cpu", epochs=1, progress=False, data_on="device"), base_dir=EXAMPLES,
                echo=lines.append)
    assert res.data_on == "host"
    assert "note: --data-on device: the CPU backend stages every batch from the host" in lines


def test_a_scalar_the_gather_cannot_copy_keeps_the_data_on_the_host():
    """Decided before any GPU work: `device` is X004 naming the scalar, `auto` stages."""
    from dataclasses import replace

    from streamsched.diagnostics import StreamschedError
    from streamsched.interp.training.data_path import DataPath
    from streamsched.interp.training.runners import _resident

    c = _compiled("mlp_digits")
    bufs = tuple(replace(b, dtype="f16") if b.name == "lr" else b for b in c.schedule.buffers)
    c2 = replace(c, schedule=replace(c.schedule, buffers=bufs))
    dp = DataPath(c.program, ("digits", (), {}), EXAMPLES, {}, 0, None)
    with pytest.raises(StreamschedError) as err:
        _resident(c2, "device", dp, 10, [])
    (d,) = err.value.diagnostics
    assert d.code == "X004" and "the scalar `lr` is float16, which the device gather does not copy" in d.message
    assert _resident(c2, "auto", dp, 10, []) is None
    assert _resident(c, "host", dp, 10, []) is None
