"""The derived backward pass is a gradient: for a model whose value fans out (h feeds relu and
tanh, summed by `add`), the gradients the plan computes match central finite differences of the
loss along random directions (f32 arithmetic, so a directional check with a loose tolerance)."""

from __future__ import annotations

import numpy as np

from streamsched.interp.cpu_backend import CpuExecutor
from streamsched.interp.memory import allocate_arrays
from streamsched.interp.train import init_params
from streamsched.pipeline import compile_file
from streamsched.stdlib.kernels import KERNELS

SRC = """
streams { trans : copy  comp1 : compute  comp2 : compute  comp3 : compute  update : update }
model m(batch = 16) {
    input x : f32[batch, 12]
    input y : i32[batch]
    h = linear(x, 8)
    a = tanh(h)
    b = sigmoid(h)
    s = add(a, b)
    g = gelu(s)
    logits = linear(g, 5)
    loss = softmax_cross_entropy(logits, y)
}
graph load[a, b] on trans { copy batch -> x, y }
graph zero_grad on update { clear grad(m) }
graph pass on comp1 { forward m; backward m }
step train(slot) { zero_grad; pass(load[slot]); load[next] }
"""


def test_fan_out_gradients_match_finite_differences(tmp_path):
    path = tmp_path / "fan.sched"
    path.write_text(SRC)
    c = compile_file(str(path), capture="none")
    assert c.ok, c.diagnostics
    prog = c.program
    rng = np.random.default_rng(0)
    xb = rng.normal(size=(16, 12)).astype(np.float32)
    yb = rng.integers(0, 5, 16).astype(np.int32)

    def host(task, arrays):
        arrays[task.outs[0]][...] = xb if task.attr("field") == "x" else yb

    params0 = init_params(prog, 0)
    arrays = allocate_arrays(c.schedule.buffers)
    for k, v in params0.items():
        arrays[k][...] = v
    ex = CpuExecutor(c.schedule, arrays, KERNELS, interleave="random", seed=3)
    ex.run(c.segments.for_step(-1), host)
    ex.run(c.segments.for_step(0), host)
    assert ex.races == []
    grads = {p: arrays[f"grad.{p}"].astype(np.float64).copy() for p in prog.model.params}
    assert any(np.abs(g).sum() > 0 for g in grads.values())

    def loss(params):
        arrs = {}
        for t in prog.model.forward:
            for n in t.args + t.outs:
                nm = n.replace("{slot}", "a")
                if nm not in arrs:
                    arrs[nm] = np.array(params[nm]) if nm in params else np.zeros_like(arrays[nm])
                arrs[n] = arrs[nm]
        arrs["x[a]"][...] = xb
        arrs["y[a]"][...] = yb
        for t in prog.model.forward:
            kern = KERNELS[t.kernel]
            kern.cpu([arrs[a] for a in t.args], [arrs[o] for o in t.outs], {**kern.attrs, **dict(t.attrs)})
        return float(arrs[prog.model.loss])

    for trial in range(5):
        d = {p: rng.normal(size=v.shape) for p, v in params0.items() if p in grads}
        norm = np.sqrt(sum((v ** 2).sum() for v in d.values()))
        d = {p: v / norm for p, v in d.items()}
        eps = 1e-2
        plus = {**params0, **{p: (params0[p] + eps * d[p]).astype(np.float32) for p in d}}
        minus = {**params0, **{p: (params0[p] - eps * d[p]).astype(np.float32) for p in d}}
        numeric = (loss(plus) - loss(minus)) / (2 * eps)
        analytic = sum((grads[p] * d[p]).sum() for p in d)
        assert abs(numeric - analytic) <= 2e-2 * max(abs(numeric), 1e-2), (trial, numeric, analytic)
