"""The epoch in one launch and the epoch ends read later (issue 13, cuda/epoch.py): a whole epoch
of a device-resident run is one launch of the epoch graph (the captured steps inside a CUDA
conditional WHILE node), and computes bitwise what the same steps launched one by one compute;
an epoch's end (losses, evaluation, state check, snapshot) is issued on the device and read
later, and reports what a synchronous read reports.  Needs CuPy and a GPU (marker `cuda`)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from streamsched.diagnostics import StreamschedError

pytestmark = pytest.mark.cuda

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _train(name="mlp_digits", **kw):
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    notes: list[str] = []
    c = compile_file(os.path.join(EXAMPLES, f"{name}.sched"))
    res = train(c, TrainOptions(backend="cuda", progress=False, **kw), base_dir=EXAMPLES, echo=notes.append)
    return res, notes


def test_the_epoch_graph_computes_bitwise_what_the_steps_one_by_one_compute(cp):
    one, notes = _train(epochs=4, data_on="device", epoch_launch="auto")
    steps, _ = _train(epochs=4, data_on="device", epoch_launch="step")
    assert one.data_on == steps.data_on == "device"
    assert one.epoch_launches == 3, notes  # the first epoch runs unrolled steps; the others in one launch
    assert steps.epoch_launches == 0
    for a, b in zip(one.history, steps.history):
        assert a["train_loss"] == b["train_loss"] and a["test_acc"] == b["test_acc"]
    assert one.params.keys() == steps.params.keys()
    for n in one.params:
        assert np.array_equal(one.params[n], steps.params[n]), n


def test_the_epoch_graph_matches_the_host_staged_run(cp):
    dev, _ = _train(epochs=3, data_on="device")
    host, _ = _train(epochs=3, data_on="host")
    assert dev.epoch_launches == 2 and host.epoch_launches == 0
    for a, b in zip(dev.history, host.history):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["test_acc"] == pytest.approx(b["test_acc"], abs=1e-9)


def test_a_non_finite_loss_inside_the_epoch_graph_is_found_at_its_step(cp):
    with pytest.raises(StreamschedError) as cpu_err:
        from streamsched.interp.train import TrainOptions, train
        from streamsched.pipeline import compile_file

        c = compile_file(os.path.join(EXAMPLES, "mlp_digits.sched"))
        train(c, TrainOptions(backend="cpu", progress=False, epochs=3, lr=1e6), base_dir=EXAMPLES,
              echo=lambda s: None)
    with pytest.raises(StreamschedError) as gpu_err:
        _train(epochs=3, lr=1e6, data_on="device")
    (a,), (b,) = cpu_err.value.diagnostics, gpu_err.value.diagnostics
    assert a.code == b.code == "X010"
    step_of = lambda d: d.message.split(" at step ")[1].split(" ")[0]  # noqa: E731
    assert step_of(a) == step_of(b)


@pytest.mark.parametrize("data_on", ["host", "device"])
def test_a_checkpoint_from_an_epoch_end_snapshot_holds_that_epochs_parameters(cp, tmp_path, data_on):
    save = str(tmp_path / "ck.npz")
    res, _ = _train(epochs=3, data_on=data_on, save=save)
    with np.load(save) as z:
        for n, v in res.params.items():
            assert np.array_equal(z[n], v), n


def test_the_state_check_flags_a_non_finite_parameter(cp):
    """The end's inf/NaN check (a device flag), against a parameter poisoned before the run's
    end is issued: the record says the state diverged, naming the array."""
    from streamsched.interp.cuda.epoch import EpochEnds
    from streamsched.interp.cuda.runner import CudaRunner
    from streamsched.pipeline import compile_file

    c = compile_file(os.path.join(EXAMPLES, "mlp_digits.sched"))
    r = CudaRunner(c)
    names = [p for p in c.program.model.params]
    r.setup_epoch_ends(names, names, [])
    assert isinstance(r.ends, EpochEnds)
    clean = r.end_epoch(False, False).result()
    assert clean.state_bad is False
    w = r.ex.arrays[names[0]]
    w.ravel()[3] = np.nan
    r.sync()
    bad = r.end_epoch(False, True).result()
    assert bad.state_bad is True
    assert np.isnan(bad.params[names[0]].ravel()[3])
    again = r.end_epoch(False, False).result()  # the other slot, still poisoned
    assert again.state_bad is True


def test_seed_step_runs_its_epochs_in_one_launch(cp):
    res, notes = _train("seed_step", epochs=2, data_on="device")
    assert res.epoch_launches >= 1, notes
    assert res.history[-1]["test_acc"] > 0.5


def test_an_epoch_graph_built_during_the_run_runs_the_right_slots(cp, monkeypatch):
    """With evaluation in NumPy the loop launches variants of the epoch graph it did not build
    before the run (built at their first launch): they take the same slot for each loop step,
    so the run is bitwise the steps one by one.  (Planted: the loop once overwrote the graph's
    slot base after building, and such a variant ran the other slot's step.)"""
    monkeypatch.setenv("STREAMSCHED_EVAL", "host")
    one, notes = _train(epochs=4, data_on="device", epoch_launch="auto")
    steps, _ = _train(epochs=4, data_on="device", epoch_launch="step")
    assert one.eval_on == "host" and one.epoch_launches == 3, notes
    for n in one.params:
        assert np.array_equal(one.params[n], steps.params[n]), n
    for a, b in zip(one.history, steps.history):
        assert a["test_loss"] == b["test_loss"]
