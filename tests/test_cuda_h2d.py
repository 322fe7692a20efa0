"""Host-to-device copies from page-locked staging (`DeviceContext.h2d`): up to H2D_KERNEL_MAX
bytes a zero-copy kernel reads the pinned source over the bus (a captured step then holds a
kernel node, cheaper to launch than a host memcpy node), larger ones and pageable sources go to
the copy engine.  Every byte arrives either way, captured or eager, aligned or not, and a run
that stages its batches is bitwise the same with the kernel as with cudaMemcpyAsync.  Needs
CuPy and a GPU (marker `cuda`)."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


@pytest.mark.parametrize("n", [1, 15, 16, 17, 4099, 1 << 20, (1 << 20) + 16])
@pytest.mark.parametrize("offset", [0, 1, 16])
def test_every_byte_arrives_eager_and_captured(cp, n, offset):
    from streamsched.interp.cuda.device import H2D_KERNEL_MAX, DeviceContext, graph_nodes_edges

    ctx = DeviceContext(["trans"])
    rng = np.random.default_rng(n + offset)
    src = ctx.pinned_zeros(n + offset)[offset:]
    src[:] = rng.integers(0, 256, n, dtype=np.uint8)
    base = cp.zeros(n + offset, dtype=cp.uint8)
    dst = base[offset:]
    ctx.h2d("trans", dst, src)
    ctx.synchronize()
    assert np.array_equal(cp.asnumpy(dst), src)
    # captured: a kernel node up to the limit, a memcpy node past it; replayed after the host rewrote src
    st = ctx.streams["trans"]
    dst[...] = 0
    g = None
    with st:
        st.begin_capture()
        ctx.h2d("trans", dst, src)
        g = st.end_capture()
    types, _ = graph_nodes_edges(g)
    assert types == (["Kernel"] if n <= H2D_KERNEL_MAX else ["Memcpy"]), types
    src[:] = 255 - src
    g.launch(st)
    st.synchronize()
    assert np.array_equal(cp.asnumpy(dst), src)
    ctx.close()


def test_a_pageable_source_goes_to_the_copy_engine(cp):
    from streamsched.interp.cuda.device import DeviceContext

    ctx = DeviceContext(["trans"])
    src = np.arange(1000, dtype=np.float32)  # pageable: a kernel could not read it
    dst = cp.zeros(1000, dtype=cp.float32)
    ctx.h2d("trans", dst, src)
    ctx.synchronize()
    assert np.array_equal(cp.asnumpy(dst), src)
    ctx.close()


def test_a_host_staged_run_is_bitwise_the_same_with_the_copy_engine(cp, monkeypatch):
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    def run():
        c = compile_file(os.path.join(EXAMPLES, "mlp_digits.sched"))
        return train(c, TrainOptions(backend="cuda", progress=False, epochs=3, data_on="host"), base_dir=EXAMPLES,
                     echo=lambda s: None)

    kernel = run()
    monkeypatch.setenv("STREAMSCHED_H2D_KERNEL_MAX", "0")
    engine = run()
    assert kernel.data_on == engine.data_on == "host"
    assert [r["train_loss"] for r in kernel.history] == [r["train_loss"] for r in engine.history]
    for n in kernel.params:
        assert np.array_equal(kernel.params[n], engine.params[n]), n
