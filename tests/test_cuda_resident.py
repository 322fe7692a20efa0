"""Device-resident data on the GPU (issue 13): the training set uploaded once, each step's batch
and learning rate gathered on the device by the captured step itself, no host work per step,
trains exactly as host staging does: the same batches in the same order and the same rates, so
with the backend's deterministic kernels the same losses, accuracies and weights, bitwise.
Needs CuPy and a GPU (marker `cuda`)."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _train(name, data_on, capture=None, **kw):
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    c = compile_file(os.path.join(EXAMPLES, f"{name}.sched"), capture=capture)
    return train(c, TrainOptions(backend="cuda", progress=False, data_on=data_on, **kw), base_dir=EXAMPLES,
                 echo=lambda s: None)


@pytest.mark.parametrize("name,capture", [("mlp_digits", "step"), ("mlp_digits", "graphs"), ("mlp_digits", "none"),
                                          ("seed_step", None)])
def test_device_resident_data_trains_bitwise_as_host_staging(cp, name, capture):
    host = _train(name, "host", capture, epochs=3)
    dev = _train(name, "device", capture, epochs=3)
    assert (host.data_on, dev.data_on) == ("host", "device")
    keys = ("train_loss", "test_loss", "test_acc")
    assert [[r[k] for k in keys] for r in dev.history] == [[r[k] for k in keys] for r in host.history]
    for n, v in host.params.items():
        np.testing.assert_array_equal(dev.params[n], v, err_msg=n)


def test_auto_holds_the_digits_on_the_device_and_a_stop_inside_an_epoch_is_the_same(cp):
    auto = _train("mlp_digits", "auto", epochs=2, max_steps=15)
    host = _train("mlp_digits", "host", epochs=2, max_steps=15)
    assert auto.data_on == "device" and auto.steps == host.steps == 15
    assert [r["train_loss"] for r in auto.history] == [r["train_loss"] for r in host.history]
