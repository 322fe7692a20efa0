"""The loop's epoch ends read later (issue 13): an end the backend reports as not ready yet is
read after the next epoch was issued (polled after each step, forced at the end of the next
epoch), and the run records, stops and saves exactly what reading every end at once does.  On
the CPU every end is ready at once; a runner whose ends lag (as the GPU's do) is simulated here
around the CPU backend."""

from __future__ import annotations

import os

import numpy as np
import pytest

from streamsched.diagnostics import StreamschedError
from streamsched.interp.train import TrainOptions, train
from streamsched.interp.training import runners as runners_mod
from streamsched.interp.training.loop import SyncEnd
from streamsched.pipeline import compile_file

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


class LateEnd:
    """A SyncEnd whose `ready()` says no `lag` times (the device has not got there yet)."""

    def __init__(self, runner, saved, loss_scale, lag: int, log: list):
        self.inner = SyncEnd(runner, saved, loss_scale)
        self.values = []
        self.lag = lag
        self.log = log

    def ready(self) -> bool:
        if self.lag > 0:
            self.lag -= 1
            return False
        return True

    def result(self):
        self.log.append("read")
        return self.inner


def _late_runner(lag: int, log: list):
    base = runners_mod.CpuRunner

    class LateRunner(base):
        ends = True  # the loop asks this runner for its own ends

        def end_epoch(self, evaluate, snapshot, order=None):
            log.append("end")
            return LateEnd(self, self._saved, self._loss_scale, lag, log)

    return LateRunner


def _run(monkeypatch, lag: int | None, **kw):
    log: list = []
    c = compile_file(os.path.join(EXAMPLES, "mlp_digits.sched"))
    if lag is not None:
        cls = _late_runner(lag, log)
        saved = None

        def make(compiled, opts, data=None, steps=0, notes=None):
            r = cls(compiled, opts.interleave, opts.interleave_seed, opts.detect_races)
            return r

        monkeypatch.setattr("streamsched.interp.training.loop.make_runner", make)
        real_prepare = __import__("streamsched.interp.training.loop", fromlist=["Run"]).Run.prepare

        def prepare(self):
            real_prepare(self)
            self.runner._saved = list(self.ck.saved)
            self.runner._loss_scale = self.program.loss_scale

        monkeypatch.setattr("streamsched.interp.training.loop.Run.prepare", prepare)
    res = train(c, TrainOptions(backend="cpu", progress=False, **kw), base_dir=EXAMPLES, echo=lambda s: None)
    return res, log


def _same(a, b):
    assert len(a.history) == len(b.history)
    for x, y in zip(a.history, b.history):
        for k in ("epoch", "step", "train_loss", "test_loss", "test_acc", "lr"):
            assert x.get(k) == y.get(k), k
    for n in a.params:
        assert np.array_equal(a.params[n], b.params[n]), n


@pytest.mark.parametrize("lag", [0, 3, 100])
def test_late_epoch_ends_record_what_prompt_ones_do(monkeypatch, lag):
    prompt, _ = _run(monkeypatch, None, epochs=4)
    late, log = _run(monkeypatch, lag, epochs=4)
    _same(prompt, late)
    assert log.count("end") == log.count("read") == 4
    if lag >= 100:  # never ready when polled: each end is read after the next epoch's end is issued
        assert log == ["end", "end", "read", "end", "read", "end", "read", "read"]


def test_a_late_end_still_stops_a_diverging_run_at_its_step(monkeypatch):
    with pytest.raises(StreamschedError) as a:
        _run(monkeypatch, None, epochs=3, lr=1e6)
    with pytest.raises(StreamschedError) as b:
        _run(monkeypatch, 100, epochs=3, lr=1e6)
    (da,), (db,) = a.value.diagnostics, b.value.diagnostics
    assert da.code == db.code == "X010"
    assert da.message == db.message


def test_a_late_end_writes_the_checkpoint_of_its_own_epoch(monkeypatch, tmp_path):
    _, _ = _run(monkeypatch, 100, epochs=3, save=str(tmp_path / "late.npz"))
    prompt, _ = _run(monkeypatch, None, epochs=3, save=str(tmp_path / "prompt.npz"))
    with np.load(tmp_path / "late.npz") as z1, np.load(tmp_path / "prompt.npz") as z2:
        for n in prompt.params:
            assert np.array_equal(z1[n], z2[n]), n


def test_the_steady_state_is_measured_over_every_epoch_but_the_first(monkeypatch):
    res, _ = _run(monkeypatch, None, epochs=3)
    steps, wall, cpu = res.steady
    assert steps == 2 * 11 and wall > 0 and cpu > 0
    assert res.steady_us_per_step == pytest.approx(1e6 * wall / steps)
    one, _ = _run(monkeypatch, None, epochs=1)
    assert one.steady is None and one.steady_us_per_step > 0


def test_order_rows_hold_every_epoch_when_they_fit():
    from streamsched.interp.cuda.resident import ORDERS_BYTES, order_rows

    assert order_rows(11, 128, 440) == 40  # mlp_digits: 40 epochs of 1,408 samples
    assert order_rows(11, 128, 22) == 2  # two epochs: the two rows it always had
    big = ORDERS_BYTES // (4 * 1000 * 100) + 1  # one epoch more than fits
    assert order_rows(1000, 100, 1000 * big) == 2
    assert order_rows(1000, 100, 1000 * (big - 1)) == big - 1


@pytest.mark.parametrize("launch", ["auto", "epoch", "step", "1", "3", "016", "99999999999999999999",
                                    pytest.param("9" * 5000, id="5000-digits")])
def test_the_cli_takes_epoch_launch(capsys, launch):
    from streamsched.cli import main

    rc = main(["run", os.path.join(EXAMPLES, "mlp_digits.sched"), "--backend", "cpu", "--epochs", "1", "-q",
               "--epoch-launch", launch])
    out = capsys.readouterr().out
    assert rc == 0 and "cpu: 11 steps" in out


@pytest.mark.parametrize("launch", ["graph", "0", "000", "-3", "2.5", " 4 ", "EPOCH", "", "+3", "1e3", "\u00b2",
                                    "\u0663"])
def test_the_cli_refuses_an_unknown_epoch_launch(capsys, launch):
    from streamsched.cli import main

    rc = main(["run", os.path.join(EXAMPLES, "mlp_digits.sched"), "--epoch-launch", launch])
    err = capsys.readouterr().err
    assert rc == 1 and "error[X004]" in err and "--epoch-launch" in err
    assert "Traceback" not in err and "_epoch_launch" not in err
    if launch:
        assert f"`{launch}` is not auto, epoch, step or a number of epochs (1 or more)" in err


@pytest.mark.parametrize("launch", ["often", "0", 3, None])
def test_train_refuses_an_unknown_epoch_launch(launch):
    """The API checks what the CLI checks (X004 before any work)."""
    c = compile_file(os.path.join(EXAMPLES, "mlp_digits.sched"))
    with pytest.raises(StreamschedError) as err:
        train(c, TrainOptions(backend="cpu", progress=False, epochs=1, epoch_launch=launch), base_dir=EXAMPLES,
              echo=lambda s: None)
    (d,) = err.value.diagnostics
    assert d.code == "X004" and "--epoch-launch" in d.message
