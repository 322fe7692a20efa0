"""Examples are tests (STYLE.md habit 7): every examples/*.sched parses, checks clean under its
own policy, is planned, and runs two training steps on the CPU with finite loss and no race."""

from __future__ import annotations

import glob
import math
import os

import numpy as np
import pytest

from streamsched.interp.train import TrainOptions, train
from streamsched.pipeline import compile_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.sched")))


def test_there_are_examples():
    names = {os.path.basename(p) for p in EXAMPLES}
    assert {"mlp_digits.sched", "five_streams.sched", "inplace_backward.sched"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_header_says_what_and_how(path):
    head = open(path, encoding="utf-8").read().splitlines()[:8]
    assert head[0].startswith("# ") and os.path.basename(path) in head[0]
    assert any("streamsched run" in l or "streamsched check" in l for l in head)


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_checks_clean_and_runs_two_steps(path):
    c = compile_file(path)
    assert c.ok, c.diagnostics
    assert c.plan is not None and any(i.op == "wait" for i in c.plan.instrs)
    res = train(c, TrainOptions(backend="cpu", max_steps=2, progress=False),
                base_dir=os.path.dirname(path))
    assert res.steps == 2
    assert res.races == []
    assert math.isfinite(res.history[-1]["train_loss"])
    assert 0.0 <= res.history[-1]["test_acc"] <= 1.0
    # parameters moved away from their initial values
    init = train(c, TrainOptions(backend="cpu", max_steps=0, progress=False), base_dir=os.path.dirname(path))
    moved = [n for n in res.params if not np.array_equal(res.params[n], init.params[n])]
    assert moved, "two SGD steps changed no parameter"
