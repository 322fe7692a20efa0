"""The backward derived for ops without `NAME.backward` (streamsched.dsl.derive): it equals the
written one where both exist (the stdlib's ops copied without their backward: bitwise, since the
recipes are the written formulas; swish_mlp against a hand-written swish.backward: to 1e-12 in
f64), it is a gradient (central finite differences of the loss), a written backward wins, it
runs where the placement rules say, the checker sees its tasks, and a file's kernels are its own."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from streamsched.dsl.load import stdlib_file, stdlib_text
from streamsched.interp.cpu_backend import CpuExecutor
from streamsched.interp.memory import allocate_arrays
from streamsched.interp.train import TrainOptions, init_params, train
from streamsched.pipeline import compile_file
from streamsched.stdlib.kernels import KERNELS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWISH_MLP = os.path.join(ROOT, "examples", "swish_mlp.sched")
STREAMS = "streams { trans : copy  comp1 : compute  comp2 : compute  comp3 : compute  update : update }\n"
TAIL = """
graph load[a, b] on trans { copy batch -> x, y }
graph zero_grad on update { clear grad(m) }
graph pass on comp1 { forward m; backward m }
step train(slot) { zero_grad; pass(load[slot]); load[next] }
"""


def _compile(tmp_path, text, name="f.sched"):
    path = tmp_path / name
    path.write_text(text)
    c = compile_file(str(path), capture="none")
    assert c.ok, c.diagnostics
    return c


def _grads(c, xb, yb, params=None, seed=0):
    """The parameter gradients of one step on the batch (xb, yb), from `params` (default: the
    program's initial parameters for `seed`)."""
    prog = c.program
    params = params if params is not None else init_params(prog, seed)

    def host(task, arrays):
        if task.kernel == "set_scalar":
            arrays[task.outs[0]][...] = 0.05  # the learning rate (the optimizer runs after the backward)
        else:
            arrays[task.outs[0]][...] = xb if task.attr("field") == "x" else yb

    arrays = allocate_arrays(c.schedule.buffers)
    for k, v in params.items():
        arrays[k][...] = v
    ex = CpuExecutor(c.schedule, arrays, prog.kernels, interleave="random", seed=3)
    ex.run(c.segments.for_step(-1), host)
    ex.run(c.segments.for_step(0), host)
    assert ex.races == []
    return {p: arrays[f"grad.{p}"].copy() for p in prog.model.params}, params


def _loss(c, params, xb, yb):
    """The loss of the forward templates, evaluated directly with the program's kernels."""
    prog = c.program
    arrs: dict = {}
    for t in prog.model.forward:
        for n in t.args + t.outs:
            nm = n.replace("{slot}", "a")
            if nm not in arrs:
                b = next(b for b in c.schedule.buffers if b.name == nm)
                arrs[nm] = np.array(params[nm]) if nm in params else np.zeros(b.shape, _np(b.dtype))
            arrs[n] = arrs[nm]
    arrs["x[a]"][...] = xb
    arrs["y[a]"][...] = yb
    for t in prog.model.forward:
        k = prog.kernels[t.kernel]
        k.cpu([arrs[a] for a in t.args], [arrs[o] for o in t.outs], {**k.attrs, **dict(t.attrs)})
    return float(arrs[prog.model.loss])


def _np(dt):
    return {"f64": np.float64, "f32": np.float32, "i32": np.int32, "i64": np.int64, "u8": np.uint8}[dt]


def _directional_check(c, xb, yb, rtol=1e-6, trials=4):
    grads, params = _grads(c, xb, yb)
    assert any(np.abs(g).sum() > 0 for g in grads.values())
    rng = np.random.default_rng(1)
    for _ in range(trials):
        d = {p: rng.normal(size=grads[p].shape) for p in grads}
        norm = np.sqrt(sum((v ** 2).sum() for v in d.values()))
        eps = 1e-5
        plus = {**params, **{p: params[p] + eps * d[p] / norm for p in d}}
        minus = {**params, **{p: params[p] - eps * d[p] / norm for p in d}}
        numeric = (_loss(c, plus, xb, yb) - _loss(c, minus, xb, yb)) / (2 * eps)
        analytic = sum(float((grads[p] * d[p]).sum()) for p in d) / norm
        assert abs(numeric - analytic) <= rtol * max(abs(numeric), 1e-3), (numeric, analytic)


def _batch(shape, classes=3, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch,) + shape), rng.integers(0, classes, batch).astype(np.int32)


# ---- the stdlib's own ops, re-derived ------------------------------------------------------------
def _stdlib_op_text(name: str) -> str:
    """The text of stdlib op `name` (its forward only), renamed `my_name`."""
    op = next(i for i in stdlib_file().items if getattr(i, "name", None) == name)
    lines = stdlib_text().splitlines()
    body = "\n".join(lines[op.span.line - 1:op.span.end_line])
    return re.sub(rf"^op {name}\(", f"op my_{name}(", body)


MLP = """
model m(batch = 8) {
    input x : f64[batch, 6]
    input y : i32[batch]
    h = LINEAR(x, 7)
    a = RELU(h)
    t = TANH(a)
    s = SIGMOID(h)
    u = ADD(t, s)
    g = GELU(u)
    logits = LINEAR(g, 3)
    loss = SOFTMAX_CROSS_ENTROPY(logits, y)
}
"""
CNN = """
model m(batch = 4) {
    input x : f64[batch, 6, 6, 1]
    input y : i32[batch]
    c = CONV2D(x, 3, 4, pad = 1)
    p = MAXPOOL(c)
    q = AVGPOOL(p, size = 1, stride = 1)
    d = DROPOUT(q, p = 0.25, seed = 3)
    g = GLOBAL_AVGPOOL(d)
    f = FLATTEN(q)
    logits = LINEAR(f, 3)
    loss = SOFTMAX_CROSS_ENTROPY(logits, y)
}
"""
CNN_G = CNN.replace("    f = FLATTEN(q)\n    logits = LINEAR(f, 3)", "    f = FLATTEN(q)\n    k = LINEAR(f, 4)\n"
                    "    s = ADD(k, g)\n    logits = LINEAR(s, 3)")


@pytest.mark.parametrize("model,ops,shape", [
    (MLP, ["linear", "relu", "tanh", "sigmoid", "add", "gelu", "softmax_cross_entropy"], (6,)),
    (CNN_G, ["conv2d", "maxpool", "avgpool", "dropout", "global_avgpool", "flatten", "linear", "add",
             "softmax_cross_entropy"], (6, 6, 1)),
], ids=["mlp", "cnn"])
def test_stdlib_ops_rederived_give_the_written_backwards_gradients_bitwise(tmp_path, model, ops, shape):
    written = model
    derived = model
    for op in set(ops):
        written = re.sub(rf"\b{op.upper()}\(", op + "(", written)
        derived = re.sub(rf"\b{op.upper()}\(", "my_" + op + "(", derived)
    defs = "\n".join(_stdlib_op_text(op) for op in sorted(set(ops)))
    cw = _compile(tmp_path, STREAMS + written + TAIL, "w.sched")
    cd = _compile(tmp_path, STREAMS + defs + derived + TAIL, "d.sched")
    assert not any(t.kernel.endswith(".dx") for g in cd.program.graphs for t in g.templates)
    xb, yb = _batch(shape, batch=8 if shape == (6,) else 4)
    gw, params = _grads(cw, xb, yb)  # parameters are named by model lines: the same in both files
    gd, _ = _grads(cd, xb, yb, params=params)
    assert set(gd) == set(gw)
    for p in gw:
        np.testing.assert_array_equal(gd[p], gw[p], err_msg=p)


def test_derived_gradient_of_stdlib_kernels_is_a_gradient(tmp_path):
    # x feeds sigmoid and mul (fan-out inside one op body), b is a broadcast row, s a scalar
    text = STREAMS + """
op f(x : T[n, k], param b : T[k] = ones, param s : T[] = ones) -> y on comp3 {
    y = x * sigmoid(x + b) * s - b
}
model m(batch = 8) {
    input x : f64[batch, 5]
    input y : i32[batch]
    h = linear(x, 4)
    z = f(h)
    logits = linear(z, 3)
    loss = softmax_cross_entropy(logits, y)
}
""" + TAIL
    c = _compile(tmp_path, text)
    _directional_check(c, *_batch((5,)))
    kernels = [t.kernel for t in c.program.graph("pass").templates]
    assert "accumulate" in kernels and "sigmoid_grad" in kernels


# ---- swish_mlp: derived against written ----------------------------------------------------------
HAND_SWISH = """
kernel swish_grad(dy : T[...], x : T[...]) -> dx : T[...] {
    s = sigmoid(x)
    dx = dy * (s + x * s * (1 - s))
}
op swish.backward(dy, x) -> dx on comp3 {
    dx = swish_grad(dy, x)
}
"""
HAND_DENSE = """
kernel bias_swish_grad(dy : T[..., n], h : T[..., n], b : T[n]) -> dz : T[..., n] {
    z = h + b
    s = sigmoid(z)
    dz = dy * (s + z * s * (1 - s))
}
op dense_swish.backward(dy, x, w, h, b) -> (dx, dw, db) on comp1 {
    dz = bias_swish_grad(dy, h, b)
    dw = matmul(x^T, dz)
    db = sum(dz, axis = 0) on comp2
    dx = matmul(dz, w^T)
}
"""


def _swish_variants(tmp_path):
    src = open(SWISH_MLP, encoding="utf-8").read().replace("f32[batch, 64]", "f64[batch, 64]")
    keep = src.replace("""        -> y : T[n, units] on comp1 {
    y = bias_swish(matmul(x, w), b)
}""", """        -> (y : T[n, units], h) on comp1 {
    h = matmul(x, w)
    y = bias_swish(h, b)
}""")
    assert keep != src
    derived = _compile(tmp_path, src, "derived.sched")
    hand_swish = _compile(tmp_path, src + HAND_SWISH, "hand_swish.sched")
    hand_all = _compile(tmp_path, keep + HAND_SWISH + HAND_DENSE, "hand_all.sched")
    return derived, hand_swish, hand_all


def test_swish_mlp_derived_backward_equals_a_hand_written_one(tmp_path):
    derived, hand_swish, hand_all = _swish_variants(tmp_path)
    kd = {t.kernel for t in derived.program.graph("pass").templates}
    assert {"swish.dx", "bias_swish.dx", "bias_swish.db"} <= kd
    kh = {t.kernel for t in hand_swish.program.graph("pass").templates}
    assert "swish_grad" in kh and "swish.dx" not in kh  # the written backward ran
    kh2 = {t.kernel for t in hand_all.program.graph("pass").templates}
    assert "bias_swish_grad" in kh2 and "bias_swish.dx" not in kh2
    rng = np.random.default_rng(5)
    xb = rng.normal(size=(128, 64))
    yb = rng.integers(0, 10, 128).astype(np.int32)
    gd, params = _grads(derived, xb, yb)
    for other in (hand_swish, hand_all):
        go, _ = _grads(other, xb, yb, params=params)
        for p in gd:
            np.testing.assert_allclose(go[p], gd[p], rtol=1e-12, atol=1e-12 * np.abs(gd[p]).max(), err_msg=p)


def test_swish_mlp_trains_the_same_with_either_backward(tmp_path):
    derived, hand_swish, _ = _swish_variants(tmp_path)
    runs = [train(c, TrainOptions(backend="cpu", max_steps=3, progress=False), base_dir=os.path.dirname(SWISH_MLP))
            for c in (derived, hand_swish)]
    for p in runs[0].params:
        np.testing.assert_allclose(runs[1].params[p], runs[0].params[p], rtol=1e-12, atol=1e-13, err_msg=p)


def test_swish_mlp_derived_backward_is_a_gradient(tmp_path):
    derived, _, _ = _swish_variants(tmp_path)
    rng = np.random.default_rng(6)
    _directional_check(derived, rng.normal(size=(128, 64)), rng.integers(0, 10, 128).astype(np.int32), trials=2)


# ---- placement, precedence, checking, isolation ----------------------------------------------------
def _streams_of(c, prefix):
    return {t.stmt: t.stream for t in c.program.graph("pass").templates if t.label.split(": ")[-1].startswith(prefix)}


def test_derived_backward_runs_on_the_op_stream_with_on_and_place(tmp_path):
    src = open(SWISH_MLP, encoding="utf-8").read()
    c = _compile(tmp_path, src, "a.sched")
    bwd = [t for t in c.program.graph("pass").templates if t.label.split(": ")[-1].startswith("dense_swish.backward")]
    assert bwd and {t.stream for t in bwd} == {"comp1"}  # the op's representative stream
    assert {t.stream for t in c.program.graph("pass").templates if t.kernel == "swish.dx"} == {"comp3"}
    placed = src.replace("model mlp", "place dense_swish.backward.dw on comp2\nplace swish.backward on comp1\nmodel mlp")
    c2 = _compile(tmp_path, placed, "b.sched")
    tmpl = c2.program.graph("pass").templates
    dw = [t for t in tmpl if t.stmt == "dw" and "dense_swish.backward" in t.label]
    assert dw and {t.stream for t in dw} == {"comp2"}
    assert {t.stream for t in tmpl if t.kernel == "swish.dx"} == {"comp1"}
    # the gradient work of a forward statement with `on S` runs on S
    forked = src.replace("    y = bias_swish(matmul(x, w), b)\n", "    y = bias_swish(matmul(x, w), b) on comp3\n")
    c3 = _compile(tmp_path, forked, "c.sched")
    tmpl = c3.program.graph("pass").templates
    assert {t.stream for t in tmpl if t.kernel in ("bias_swish.dx", "bias_swish.db")} == {"comp3"}
    # a wrong placement is still an error
    bad = src.replace("model mlp", "place dense_swish.backward.dq on comp2\nmodel mlp")
    (tmp_path / "d.sched").write_text(bad)
    from streamsched.pipeline import check_file

    assert [d.code for d in check_file(str(tmp_path / "d.sched"))] == ["S006"]


def test_a_written_backward_wins(tmp_path):
    src = open(SWISH_MLP, encoding="utf-8").read()
    c = _compile(tmp_path, src + "\nop swish.backward(dy) -> dx on comp3 {\n    dx = scale(dy, alpha = 2.0)\n}\n")
    kernels = [t.kernel for t in c.program.graph("pass").templates]
    assert "swish.dx" not in kernels and "scale" in kernels


def test_derived_backward_reads_are_checked_by_the_lifetime_analysis(tmp_path):
    text = STREAMS + """
kernel swish(x : T[...]) -> y : T[...] { y = x * sigmoid(x) }
op f(x : T[n, k], param w : T[k, u] = glorot) -> y on comp1 {
    h = matmul(x, w)
    y = swish(h) into h
}
model m(batch = 8) {
    input x : f32[batch, 5]
    input y : i32[batch]
    z = f(x, 4)
    logits = linear(z, 3)
    loss = softmax_cross_entropy(logits, y)
}
""" + TAIL
    path = tmp_path / "r.sched"
    path.write_text(text)
    c = compile_file(str(path), capture="none")
    r005 = [d for d in c.diagnostics if d.code == "R005"]
    line = text.splitlines().index("    y = swish(h) into h") + 1
    assert r005 and r005[0].span.line == line  # swish.dx reads h after `into h` overwrote it
    ok = compile_file(str(path), text.replace(" into h", ""), capture="none")
    assert ok.ok, ok.diagnostics


def test_a_files_kernels_are_its_own(tmp_path):
    a = _compile(tmp_path, STREAMS + "kernel act(x : T[...]) -> y : T[...] { y = 2 * x }\n", "a.sched")
    b = _compile(tmp_path, STREAMS + "kernel act(x : T[...]) -> y : T[...] { y = 3 * x }\n", "b.sched")
    x = np.ones(4)
    ya, yb = np.zeros(4), np.zeros(4)
    a.program.kernels["act"].cpu([x], [ya], {})
    b.program.kernels["act"].cpu([x], [yb], {})
    assert (ya == 2).all() and (yb == 3).all()
    assert "act" not in KERNELS and "act" not in compile_file(SWISH_MLP).program.kernels


def test_kernel_and_op_names_are_apart_and_a_kernel_used_twice(tmp_path):
    text = STREAMS + """
kernel swish(x : T[...]) -> y : T[...] { y = x * sigmoid(x) }
op swish(x) -> y on comp3 { y = swish(x) }
model m(batch = 8) {
    input x : f64[batch, 5]
    input y : i32[batch]
    h = linear(x, 4)
    a = swish(h)
    b = swish(a)
    logits = linear(b, 3)
    loss = softmax_cross_entropy(logits, y)
}
""" + TAIL
    c = _compile(tmp_path, text)
    assert [t.kernel for t in c.program.graph("pass").templates].count("swish.dx") == 2
    _directional_check(c, *_batch((5,)))


def test_a_kernel_with_two_outputs_and_a_reduction_in_one_op(tmp_path):
    text = STREAMS + """
kernel two(x : T[...], y : T[...]) -> (s : T[...], d : T[...]) { s = x + y; d = x * y }
kernel colnorm(x : T[n, k], eps = 0.5) -> y : T[k] { y = sqrt(sum(x * x, axis = 0) + eps) }
op f(a : T[n, k], b : T[n, k]) -> y on comp3 {
    (s, d) = two(a, b)
    y = s * d
}
op g(a : T[n, k], param v : T[k] = ones) -> y on comp3 {
    y = colnorm(a * v, eps = 0.25)
}
op addrow(w : T[n, c], r : T[c]) -> y on comp3 {
    y = w + r
}
model m(batch = 8) {
    input x : f64[batch, 5]
    input y : i32[batch]
    h = linear(x, 3)
    k = linear(x, 3)
    z = f(h, k)
    n = g(z)
    logits = addrow(z, n)
    loss = softmax_cross_entropy(logits, y)
}
""" + TAIL
    c = _compile(tmp_path, text)
    kernels = {t.kernel for t in c.program.graph("pass").templates}
    assert {"two.dx", "two.dy", "colnorm.dx", "colnorm.s", "accumulate"} <= kernels
    _directional_check(c, *_batch((5,)))


def test_the_arithmetic_recipes_are_gradients(tmp_path):
    # scale (`* 0.5`, unary -), sub, bias_add, copy, accumulate, mul and add with a row and a
    # scalar broadcast, sum and mean along an axis and over everything, matmul with ta/tb
    text = STREAMS + """
op f(x : T[n, k], param b : T[k] = ones, param c : T[k] = ones, param m : T[k, k] = glorot) -> y on comp3 {
    u = bias_add(x, b) * 0.5 - c
    v = -u + copy(x)
    w = accumulate(u, v)
    r = sum(x * x, axis = 0)
    y = w * r + mean(w) + mean(x, axis = 0) + matmul(w, m^T) + matmul(x, matmul(w^T, x)^T)
}
model m(batch = 8) {
    input x : f64[batch, 5]
    input y : i32[batch]
    h = linear(x, 5)
    z = f(h)
    logits = linear(z, 3)
    loss = softmax_cross_entropy(logits, y)
}
""" + TAIL
    c = _compile(tmp_path, text)
    kernels = {t.kernel for t in c.program.graph("pass").templates}
    assert {"scale", "sum", "sum.da@axis0", "mean.da", "mean.da@axis0", "accumulate"} <= kernels
    _directional_check(c, *_batch((5,)))


def test_cast_and_other_recipes_give_the_stdlib_formulas():
    from streamsched.stdlib.kernels import RECIPES
    from streamsched.stdlib.kernel_record import GradArgs, KCall

    g = GradArgs("cast", ("x",), ("y",), ("dy",), (True,), {"dtype": "f16"}, {"x": ((4,), "f32"), "y": ((4,), "f16")})
    assert RECIPES["cast"](g) == [KCall("cast", ("dy",), (("dtype", "f32"),))]
    g = GradArgs("dropout", ("x", "off"), ("y", "mask"), ("dy", None), (True, False), {"p": 0.25},
                 {"x": ((4,), "f32")})
    assert RECIPES["dropout"](g) == [KCall("dropout_grad", ("dy", "mask"), (("p", 0.25),)), None]
    assert KERNELS["batchnorm_train"].grad is None and KERNELS["sgd_step"].grad is None
    assert KERNELS["matmul"].grad is RECIPES["matmul"]


def test_calling_a_kernel_from_a_model_line_suggests_the_op_that_fixes_it(tmp_path):
    text = STREAMS + """
kernel leaky(x : T[...], slope = 0.01) -> y : T[...] { y = where(x > 0, x, slope * x) }
model m(batch = 8) {
    input x : f64[batch, 5]
    input y : i32[batch]
    h = linear(x, 4)
    a = leaky(h)
    logits = linear(a, 3)
    loss = softmax_cross_entropy(logits, y)
}
""" + TAIL
    from streamsched.pipeline import check_file

    path = tmp_path / "k.sched"
    path.write_text(text)
    (d,) = check_file(str(path))
    assert d.code == "S006"
    fix = re.search(r"`(op leaky\(.*\})`", d.help).group(1)
    c = _compile(tmp_path, text.replace("model m", fix + "\nmodel m"), "fixed.sched")
    assert "leaky.dx" in {t.kernel for t in c.program.graph("pass").templates}
    _directional_check(c, *_batch((5,)))


def test_a_broken_kernel_is_reported_once_not_at_every_use(tmp_path):
    from streamsched.pipeline import check_file

    text = STREAMS + """
kernel leaky(x : T[...], slope = 0.01) -> y : T[...] { y = where(x > 0, x, slope * q) }
op leaky(x) -> y on comp3 { y = leaky(x) }
model m(batch = 8) {
    input x : f32[batch, 4]
    input y : i32[batch]
    h = linear(x, 3)
    a = leaky(h)
    loss = softmax_cross_entropy(a, y)
}
""" + TAIL
    path = tmp_path / "b.sched"
    path.write_text(text)
    assert [(d.code, d.span.line) for d in check_file(str(path))] == [("S007", 3)]
