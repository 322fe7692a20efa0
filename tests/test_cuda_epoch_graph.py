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


@pytest.mark.parametrize("unroll", ["1", "0"])
@pytest.mark.parametrize("how, launches", [("auto", 1), ("epoch", 3), ("2", 2)])
def test_the_epoch_graph_computes_bitwise_what_the_steps_one_by_one_compute(cp, monkeypatch, how, launches, unroll):
    """Epochs 2-4 (the first runs unrolled steps) in one launch (auto: several epochs, each
    one's end inside the loop), one launch each (epoch), or launches of at most two; a launch of
    several epochs with each epoch unrolled (unroll 1) or a loop over its steps (0)."""
    monkeypatch.setenv("STREAMSCHED_EPOCH_UNROLL", unroll)
    one, notes = _train(epochs=4, data_on="device", epoch_launch=how)
    steps, _ = _train(epochs=4, data_on="device", epoch_launch="step")
    assert one.data_on == steps.data_on == "device"
    assert one.epoch_launches == launches, notes
    assert steps.epoch_launches == 0
    assert one.eval_s > 0  # the evaluation timed on the device, inside the launch
    assert [r["epoch"] for r in one.history] == [1, 2, 3, 4]
    for a, b in zip(one.history, steps.history):
        assert a["train_loss"] == b["train_loss"] and a["test_acc"] == b["test_acc"]
    assert one.params.keys() == steps.params.keys()
    for n in one.params:
        assert np.array_equal(one.params[n], steps.params[n]), n


def test_the_epoch_graph_matches_the_host_staged_run(cp):
    dev, _ = _train(epochs=3, data_on="device")
    host, _ = _train(epochs=3, data_on="host")
    assert dev.epoch_launches == 1 and host.epoch_launches == 0
    for a, b in zip(dev.history, host.history):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["test_acc"] == pytest.approx(b["test_acc"], abs=1e-9)


@pytest.mark.parametrize("how", ["auto", "epoch", "step"])
def test_a_non_finite_loss_inside_the_epoch_graph_is_found_at_its_step(cp, how):
    """X010 names the step the CPU names, whether the divergence is read from a launch of
    several epochs (whose loop then stops on the device), of one, or from the steps."""
    with pytest.raises(StreamschedError) as cpu_err:
        from streamsched.interp.train import TrainOptions, train
        from streamsched.pipeline import compile_file

        c = compile_file(os.path.join(EXAMPLES, "mlp_digits.sched"))
        train(c, TrainOptions(backend="cpu", progress=False, epochs=3, lr=1e6), base_dir=EXAMPLES,
              echo=lambda s: None)
    with pytest.raises(StreamschedError) as gpu_err:
        _train(epochs=3, lr=1e6, data_on="device", epoch_launch=how)
    (a,), (b,) = cpu_err.value.diagnostics, gpu_err.value.diagnostics
    assert a.code == b.code == "X010"
    step_of = lambda d: d.message.split(" at step ")[1].split(" ")[0]  # noqa: E731
    assert step_of(a) == step_of(b)


@pytest.mark.parametrize("how, unroll", [("auto", "1"), ("auto", "0"), ("epoch", "1"), ("step", "1")])
def test_a_nan_in_a_later_epoch_of_a_launch_stops_at_the_cpus_step(cp, tmp_path, monkeypatch, how, unroll):
    """A learning rate that jumps a million-fold at step 40 makes the loss NaN inside epoch 4,
    in the middle of a launch of several epochs: X010 names the step the CPU names (the ring
    end reports it, the device loop stops after that epoch)."""
    import re

    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    src = open(os.path.join(EXAMPLES, "mlp_digits.sched")).read()
    path = tmp_path / "mlp_nan.sched"
    path.write_text(re.sub(r"lr\s*=\s*cosine\(0\.1, warmup = 50\)", "lr = step(0.1, every = 40, gamma = 1e6)", src))
    monkeypatch.setenv("STREAMSCHED_EPOCH_UNROLL", unroll)
    c = compile_file(str(path))
    msgs = []
    for backend, kw in (("cpu", {}), ("cuda", {"data_on": "device", "epoch_launch": how})):
        with pytest.raises(StreamschedError) as err:
            train(c, TrainOptions(backend=backend, progress=False, epochs=8, **kw), base_dir=EXAMPLES,
                  echo=lambda s: None)
        (d,) = err.value.diagnostics
        assert d.code == "X010"
        msgs.append(d.message.split(";")[0])
    assert msgs[0] == msgs[1] == "the loss became nan at step 43 (epoch 4/8)"


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


def test_ring_and_slot_ends_mixed_in_one_run_read_in_order(cp, monkeypatch):
    """Evaluating in NumPy every other epoch: those epochs end in slot ends (they need the
    parameters on the host), launched one epoch each; the others end in ring ends, launched
    together.  The records and parameters are bitwise the steps one by one, epoch by epoch."""
    monkeypatch.setenv("STREAMSCHED_EVAL", "host")
    one, notes = _train(epochs=7, data_on="device", epoch_launch="auto", eval_every=2)
    steps, _ = _train(epochs=7, data_on="device", epoch_launch="step", eval_every=2)
    assert one.epoch_launches > 1, notes
    assert [r["epoch"] for r in one.history] == list(range(1, 8))
    assert ["test_acc" in r for r in one.history] == [False, True, False, True, False, True, True]
    for a, b in zip(one.history, steps.history):
        assert a["train_loss"] == b["train_loss"] and a.get("test_loss") == b.get("test_loss")
    for n in one.params:
        assert np.array_equal(one.params[n], steps.params[n]), n
