"""The training loop on the GPU reads the losses once per epoch (issue 13): they are summed on
the device, in the step's graph, and the epoch's mean and its first non-finite step are what the
CPU backend reports from each step's value.  Needs CuPy and a GPU (marker `cuda`)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from streamsched.diagnostics import StreamschedError

pytestmark = pytest.mark.cuda

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


@pytest.fixture(scope="module")
def gpu(cp):
    return cp


def _train(backend, capture, **kw):
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    c = compile_file(os.path.join(EXAMPLES, "mlp_digits.sched"), capture=capture)
    return train(c, TrainOptions(backend=backend, progress=False, **kw), base_dir=EXAMPLES, echo=lambda s: None)


@pytest.mark.parametrize("capture", ["none", "graphs", "step"])
def test_epoch_losses_summed_on_the_device_equal_the_cpu_ones(gpu, capture):
    cpu, cuda = _train("cpu", capture, epochs=3), _train("cuda", capture, epochs=3)
    for a, b in zip(cpu.history, cuda.history):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
    assert [n for n, _ in cuda.epoch_steps] == [11, 11, 11]
    assert cuda.steady_us_per_step > 0


def test_a_non_finite_loss_is_found_on_the_device_at_its_step(gpu):
    with pytest.raises(StreamschedError) as cpu_err:
        _train("cpu", "step", epochs=2, lr=1e6)
    with pytest.raises(StreamschedError) as cuda_err:
        _train("cuda", "step", epochs=2, lr=1e6)
    (a,), (b,) = cpu_err.value.diagnostics, cuda_err.value.diagnostics
    assert a.code == b.code == "X010"
    step_of = lambda d: d.message.split(" at step ")[1].split(" ")[0]  # noqa: E731
    assert step_of(a) == step_of(b)


def test_the_accumulator_is_a_node_of_the_captured_step(gpu):
    from streamsched.interp.cuda.executor import CudaExecutor
    from streamsched.interp.cuda.device import graph_nodes_edges
    from streamsched.pipeline import compile_file

    c = compile_file(os.path.join(EXAMPLES, "mlp_digits.sched"), capture="step")
    loss = c.program.model.loss
    kernels = {}
    for acc in (None, loss):
        ex = CudaExecutor(c.schedule, c.plan, capture="step", accumulate=acc)
        try:
            kernels[acc] = {k: sum(1 for t in graph_nodes_edges(cu.graph)[0] if t == "Kernel")
                            for k, cu in ex.graphs.items()}
            with_loss = {k for k, cu in ex.graphs.items()
                         if any(loss in c.schedule.tasks[t].outs for t in cu.tasks)}
            if acc is not None:
                total, steps, bad, _ = ex.accumulator.take(ex.ctx.streams[ex.ctx.names[0]])
                assert (total, steps, bad) == (0.0, 0, -1)
        finally:
            ex.close()
    assert with_loss
    for k, n in kernels[None].items():  # one more kernel node exactly where the loss is computed
        assert kernels[loss][k] == n + (1 if k in with_loss else 0)
    assert np.isfinite(float(len(with_loss)))
