"""Critical-path kernel priorities (interp/priority.py, STREAMSCHED_PRIORITIES=slack): the
captured kernel nodes carry their task's priority, and a run with them trains bitwise what a
run without them trains (a priority changes only which ready block starts first, never what a
kernel computes).  Needs CuPy and a GPU (marker `cuda`)."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _train(name, epochs=2, **kw):
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    c = compile_file(os.path.join(EXAMPLES, f"{name}.sched"))
    return train(c, TrainOptions(backend="cuda", progress=False, epochs=epochs, **kw), base_dir=EXAMPLES,
                 echo=lambda s: None)


@pytest.mark.parametrize("name", ["mlp_digits", "resnet_digits"])
@pytest.mark.parametrize("data_on, launch", [("device", "auto"), ("host", "step")])
def test_priorities_train_bitwise_what_no_priorities_train(cp, monkeypatch, name, data_on, launch):
    monkeypatch.setenv("STREAMSCHED_PRIORITIES", "slack")
    on = _train(name, data_on=data_on, epoch_launch=launch)
    monkeypatch.setenv("STREAMSCHED_PRIORITIES", "off")
    off = _train(name, data_on=data_on, epoch_launch=launch)
    assert [r["train_loss"] for r in on.history] == [r["train_loss"] for r in off.history]
    assert on.params.keys() == off.params.keys()
    for n in on.params:
        assert np.array_equal(on.params[n], off.params[n]), n


def test_the_captured_kernels_carry_their_tasks_priorities(cp, monkeypatch):
    """The MLP step's kernel nodes: the weight gradient of the first hidden layer's successor
    (off the critical path) is given a lower priority than the input-gradient chain, and every
    kernel node a task created reads back the priority the executor gave that task."""
    from cuda.bindings import runtime as rt

    from streamsched.interp.cuda import CudaExecutor
    from streamsched.interp.cuda.device import check, priority_range
    from streamsched.pipeline import compile_file

    monkeypatch.setenv("STREAMSCHED_PRIORITIES", "slack")
    # unfused: with relu_grad fused into the dX GEMMs (gated products) the dX chain of this small
    # model is no longer than the dW branches, and every GEMM is critical (one level)
    c = compile_file(os.path.join(EXAMPLES, "mlp_digits.sched"), capture="step", fuse=False)
    ex = CudaExecutor(c.schedule, c.plan, capture="step")
    try:
        assert ex.task_priority, "no priorities were set"
        least, greatest = priority_range()
        assert set(ex.task_priority.values()) <= set(range(greatest, least + 1))
        assert len(set(ex.task_priority.values())) >= 2
        from streamsched.interp.cuda.device import _priority_attr_forms

        attrs = list(dict.fromkeys(a for a, _ in _priority_attr_forms(rt)))
        kernel = rt.cudaGraphNodeType.cudaGraphNodeTypeKernel
        seen = 0
        for cu in ex.graphs.values():
            for node, task in cu.node_task.items():
                if check(rt.cudaGraphNodeGetType(node)) != kernel:
                    continue
                v = None
                for attr in attrs:
                    try:
                        v = check(rt.cudaGraphKernelNodeGetAttribute(node, attr))
                        break
                    except TypeError:
                        continue
                assert v.priority == ex.task_priority[task], (c.schedule.tasks[task].label, v.priority)
                seen += 1
        assert seen > 10
        tasks = c.schedule.tasks
        dx = [t for t in ex.task_priority if tasks[t].kernel.startswith(("matmul", "gemm")) and "dx" in tasks[t].label]
        dw = [t for t in ex.task_priority if tasks[t].kernel.startswith(("matmul", "gemm")) and ".dw" in tasks[t].label]
        assert dx and dw
        # numerically lower is more urgent: some dW waits behind every dX
        assert max(ex.task_priority[t] for t in dw) > min(ex.task_priority[t] for t in dx)
    finally:
        ex.close()
