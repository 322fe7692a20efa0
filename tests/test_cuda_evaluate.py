"""Evaluation on the device (issue 13): the eval forward captured as one graph per batch of the
test set, the loss and accuracy reduced on the device and read once, give what the NumPy
`evaluate` gives.  Needs CuPy and a GPU (marker `cuda`).

Tolerance: for f32 models the mean loss within 1e-4 relative (the CUDA twins' float32
arithmetic against NumPy's, then the same f64 log-sum-exp) and the accuracy within 2 test
samples (a logit row whose two largest entries are within float32 rounding of each other may
pick another class); for the f16 model (seed_step), whose NumPy evaluation runs in f32 while the
device runs its f16 kernels, the loss within 2e-2 relative and the accuracy within 1 % of the
test samples."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _setup(name: str):
    from streamsched.dsl.resolve import CallValue
    from streamsched.interp.cuda.runner import CudaRunner
    from streamsched.interp.data import load_dataset
    from streamsched.interp.train import _call, _fit_samples, _input_names, init_params
    from streamsched.pipeline import compile_file

    c = compile_file(os.path.join(EXAMPLES, f"{name}.sched"))
    prog = c.program
    m = prog.model
    dname, dargs, dkw = _call(dict(prog.train).get("data", CallValue("digits", (), ())), "digits")
    ds = load_dataset(dname, dargs, dkw, base_dir=EXAMPLES)
    feat, _ = _input_names(prog)
    ds = _fit_samples(ds, next(s for n, s, _ in m.inputs if n == feat))
    runner = CudaRunner(c)
    state = init_params(prog, 0)
    rng = np.random.default_rng(1)
    for n, v in state.items():  # running statistics away from 0 and 1, so eval mode matters
        if n.endswith("running_mean"):
            v = rng.normal(0.0, 0.3, v.shape).astype(v.dtype)
        elif n.endswith("running_var"):
            v = rng.uniform(0.5, 2.0, v.shape).astype(v.dtype)
        state[n] = v
        runner.write(n, v)
    return c, prog, ds, runner, state


@pytest.mark.parametrize("name", ["mlp_digits", "resnet_digits", "seed_step"])
def test_device_evaluation_equals_numpy_evaluate(cp, name):
    from streamsched.interp.cuda.evaluate import DeviceEvaluator
    from streamsched.interp.train import evaluate

    c, prog, ds, runner, state = _setup(name)
    params = {n: runner.read(n) for n, _ in prog.inits}
    host_loss, host_acc = evaluate(prog, params, ds.x_test, ds.y_test)
    ev = DeviceEvaluator(runner.ex, prog, ds.x_test, ds.y_test)
    assert ev.graph is not None  # captured, not the eager fallback
    loss, acc = ev(runner)
    f16 = name == "seed_step"
    assert loss == pytest.approx(host_loss, rel=2e-2 if f16 else 1e-4)
    assert abs(acc - host_acc) <= (max(2, 0.01 * len(ds.x_test)) if f16 else 2) / len(ds.x_test)
    # a second call (the counter reset, the same graph) gives the very same sums
    assert ev(runner) == (loss, acc)
    # eager launches of the same work give the same sums, bitwise
    eager = DeviceEvaluator(runner.ex, prog, ds.x_test, ds.y_test, capture=False)
    assert eager(runner) == (loss, acc)
    # evaluation changed no training state
    for n in params:
        np.testing.assert_array_equal(runner.read(n), params[n])


def test_a_run_evaluates_on_the_device_as_on_the_host(cp, monkeypatch):
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    def run():
        c = compile_file(os.path.join(EXAMPLES, "mlp_digits.sched"))
        return train(c, TrainOptions(backend="cuda", epochs=3, progress=False), base_dir=EXAMPLES,
                     echo=lambda s: None)

    dev = run()
    monkeypatch.setenv("STREAMSCHED_EVAL", "host")
    host = run()
    assert (dev.eval_on, host.eval_on) == ("device", "host")
    for a, b in zip(dev.history, host.history):
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-4)
        assert abs(a["test_acc"] - b["test_acc"]) <= 2 / 360
