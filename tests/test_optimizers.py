"""Optimizer ops as a user writes them: a weight EMA starts at the weights and tracks them;
LARS trains the digits MLP; state is checkpointed like parameters."""

from __future__ import annotations

import os

import numpy as np

from streamsched.interp.train import TrainOptions, init_params, train
from streamsched.pipeline import compile_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = open(os.path.join(ROOT, "examples", "mlp_digits.sched")).read()


def _compile(tmp_path, optimize: str):
    text = SRC.replace("graph optimize   on update { sgd(mlp, lr, momentum = 0.9) }",
                       f"graph optimize   on update {{ {optimize} }}")
    assert optimize in text
    p = tmp_path / "opt.sched"
    p.write_text(text)
    c = compile_file(str(p))
    assert c.ok, c.diagnostics
    return c


def test_ema_starts_at_the_weights_and_follows_them(tmp_path):
    c = _compile(tmp_path, "sgd(mlp, lr, momentum = 0.0); ema(mlp, decay = 0.5)")
    names = dict(c.program.inits)
    assert names["ema.e.h1.w"] == "copy:h1.w"
    w0 = init_params(c.program, 0)
    assert np.array_equal(w0["ema.e.h1.w"], w0["h1.w"])
    res = train(c, TrainOptions(backend="cpu", max_steps=1, progress=False, lr=0.1), base_dir=str(tmp_path))
    w1 = res.params["h1.w"]
    assert not np.array_equal(w1, w0["h1.w"])
    # the EMA update runs after sgd in the same graph: e = 0.5 * w0 + 0.5 * w1
    np.testing.assert_allclose(res.params["ema.e.h1.w"], 0.5 * w0["h1.w"] + 0.5 * w1, rtol=1e-6, atol=1e-7)


def test_lars_trains_the_digits_mlp(tmp_path):
    c = _compile(tmp_path, "lars(mlp, lr, momentum = 0.9, trust = 0.02)")
    res = train(c, TrainOptions(backend="cpu", epochs=8, progress=False, lr=0.5), base_dir=str(tmp_path))
    assert res.history[-1]["test_acc"] > 0.9
