"""The training loop's parts (interp/training/): evaluation behind one interface on every
backend (the CPU's HostEvaluator is NumPy's `evaluate`; a runner with a device evaluator is
asked first, and one that cannot evaluate falls back to the host with a note), and the public
names still importable from `streamsched.interp.train`."""

from __future__ import annotations

import os

import numpy as np
import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


@pytest.fixture(scope="module")
def mlp():
    from streamsched.interp.train import TrainOptions, make_runner
    from streamsched.pipeline import compile_file

    c = compile_file(os.path.join(EXAMPLES, "mlp_digits.sched"))
    runner = make_runner(c, TrainOptions(backend="cpu"))
    return c, runner


def _split(prog):
    from streamsched.interp.data import load_dataset

    return load_dataset("digits", (), {"test": 0.2, "seed": 0}, base_dir=EXAMPLES)


def test_the_host_evaluator_is_numpy_evaluate_on_the_runners_state(mlp):
    from streamsched.interp.train import HostEvaluator, evaluate, init_params, make_evaluator

    c, runner = mlp
    prog = c.program
    state = init_params(prog, 3)
    for n, v in state.items():
        runner.write(n, v)
    ds = _split(prog)
    names = [n for n, _ in prog.inits]
    ev = make_evaluator(runner, prog, ds.x_test, ds.y_test, names)
    assert isinstance(ev, HostEvaluator) and ev.where == "host"
    want = evaluate(prog, state, ds.x_test, ds.y_test)
    assert ev(runner) == want
    # independent oracle: the MLP's forward written out in NumPy
    x = ds.x_test.astype(np.float32)
    a1 = np.maximum(x @ state["h1.w"] + state["h1.b"], 0)
    a2 = np.maximum(a1 @ state["h2.w"] + state["h2.b"], 0)
    z = (a2 @ state["logits.w"] + state["logits.b"]).astype(np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    assert want[0] == pytest.approx(float(np.mean(lse - z[np.arange(len(z)), ds.y_test])), rel=1e-5)
    assert want[1] == pytest.approx(float(np.mean(z.argmax(1) == ds.y_test)))


def test_a_runner_that_cannot_evaluate_on_its_device_falls_back_with_a_note(mlp):
    from streamsched.interp.train import HostEvaluator, make_evaluator

    c, runner = mlp
    asked = []

    class NoDevice:
        def device_evaluator(self, program, x, y):
            asked.append(len(x))
            raise NotImplementedError("`stage` is host work")

        read = runner.read

    class Device:
        def device_evaluator(self, program, x, y):
            return "device evaluator"

    ds = _split(c.program)
    lines = []
    ev = make_evaluator(NoDevice(), c.program, ds.x_test, ds.y_test, ["h1.w"], echo=lines.append)
    assert isinstance(ev, HostEvaluator) and asked == [len(ds.x_test)]
    assert lines == ["note: evaluating on the host: `stage` is host work"]
    assert make_evaluator(Device(), c.program, ds.x_test, ds.y_test, []) == "device evaluator"


def test_a_cpu_run_evaluates_on_the_host_each_epoch():
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    c = compile_file(os.path.join(EXAMPLES, "mlp_digits.sched"))
    res = train(c, TrainOptions(backend="cpu", epochs=2, progress=False), base_dir=EXAMPLES, echo=lambda s: None)
    assert res.eval_on == "host"
    assert [("test_acc" in r, "test_loss" in r) for r in res.history] == [(True, True)] * 2


def test_the_public_names_are_the_parts_own():
    import streamsched.interp.train as train_mod
    from streamsched.interp.training import checkpoints, data_path, evaluation, loop, losses, runners, settings

    assert train_mod.train is loop.train and train_mod._Run is loop.Run
    assert train_mod.evaluate is evaluation.evaluate and train_mod.CpuRunner is runners.CpuRunner
    assert train_mod.EpochLosses is losses.EpochLosses and train_mod.TaskFailedError is losses.TaskFailedError
    assert train_mod.init_params is settings.init_params and train_mod.DataPath is data_path.DataPath
    assert train_mod.Checkpoints is checkpoints.Checkpoints


def test_the_device_evaluator_module_imports_without_cupy():
    import importlib

    mod = importlib.import_module("streamsched.interp.cuda.evaluate")
    assert "ss_eval_rows_f32_i32" in mod._SOURCE and mod.DeviceEvaluator.where == "device"
