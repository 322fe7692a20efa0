"""The primitive kernels against trusted references: every backward kernel against central
finite differences in float64, SGD and Adam against hand-written PyTorch formulas, in-place and
arena-view aliasing against fresh outputs, and the type rules' codes, arg indices and messages."""

from __future__ import annotations

import math
from pathlib import Path

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamsched.stdlib.kernel_record import KernelTypeError
from kernel_helpers import (alias_cases, assert_output_may_be_input, assert_runs_in_one_arena,  # noqa: F401
                            close, num_grad, run, run1)
from streamsched.stdlib.kernels import FAMILIES, KERNELS, infer_types, kernel, numpy_dtype

FAST = settings(max_examples=25, deadline=None)

















dims = st.integers(1, 4)
vals = st.floats(-2.0, 2.0, allow_nan=False, width=64)


def arr(shape):
    return hnp.arrays(np.float64, shape, elements=vals)


# ---------------------------------------------------------------------------------------------
# The registry


def test_every_kernel_is_complete_and_documented():
    doc = (Path(__file__).parents[1] / "docs" / "kernels.md").read_text()
    family = {name: f.module for f in FAMILIES for name in f.kernels}
    for name, k in KERNELS.items():
        assert k.name == name and k.doc, name
        assert k.cuda == f"{family[name]}:{name}_cuda"
        assert (k.cpu is None) == k.host, name
        assert f"`{name}" in doc, f"docs/kernels.md lacks {name}"


def test_host_and_uncapturable_kernels():
    assert kernel("stage").host and kernel("set_scalar").host
    assert not kernel("synchronize").capturable and not kernel("alloc").capturable
    assert all(k.capturable for n, k in KERNELS.items() if n not in ("synchronize", "alloc"))
    assert infer_types("stage", [], {"field": "y", "shape": [128], "dtype": "i32"}) == \
        [((128,), "i32")]
    assert infer_types("set_scalar", []) == [((), "f32")]
    assert infer_types("synchronize", []) == []
    out = np.ones((2, 3), np.float32)
    kernel("alloc").cpu([], [out], {"shape": (2, 3)})
    assert not out.any()
    kernel("synchronize").cpu([], [], {})


def test_unknown_kernel_names_the_closest():
    with pytest.raises(KeyError, match="did you mean matmul"):
        kernel("matmull")
    with pytest.raises(KeyError, match="known kernels"):
        kernel("zzz")


def test_bf16_types_check_but_cannot_run_on_cpu():
    assert infer_types("relu", [((3,), "bf16")]) == [((3,), "bf16")]
    with pytest.raises(NotImplementedError, match="bf16"):
        numpy_dtype("bf16")
    assert numpy_dtype("f16") == np.float16


# ---------------------------------------------------------------------------------------------
# Forward/backward pairs against central finite differences (float64)


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@FAST
@given(data=st.data(), m=dims, k=dims, n=dims)
def test_matmul_and_its_gradients(ta, tb, data, m, k, n):
    a = data.draw(arr((k, m) if ta else (m, k)))
    b = data.draw(arr((n, k) if tb else (k, n)))
    r = data.draw(arr((m, n)))  # upstream gradient dc of the loss sum(r * c)
    c = run1("matmul", [a, b], {"ta": ta, "tb": tb})
    close(c, (a.T if ta else a) @ (b.T if tb else b), 1e-12)
    # The backward as the stdlib writes it: matmuls with transposes.
    if not ta and not tb:
        da, db = run1("matmul", [r, b], {"tb": True}), run1("matmul", [a, r], {"ta": True})
    elif ta and not tb:
        da, db = run1("matmul", [b, r], {"tb": True}), run1("matmul", [a, r])
    elif not ta and tb:
        da, db = run1("matmul", [r, b]), run1("matmul", [r, a], {"ta": True})
    else:
        da = run1("matmul", [b, r], {"ta": True, "tb": True})
        db = run1("matmul", [r, a], {"ta": True, "tb": True})

    def loss():
        return float((r * run1("matmul", [a, b], {"ta": ta, "tb": tb})).sum())

    close(da, num_grad(loss, a))
    close(db, num_grad(loss, b))


def unbroadcast(g, shape):
    """The gradient of an operand broadcast to g.shape: g summed by the sum kernel."""
    while g.ndim > len(shape):
        g = run1("sum", [g], {"axis": 0})
    for ax, d in enumerate(shape):
        if d == 1 and g.shape[ax] != 1:
            g = run1("sum", [g], {"axis": ax}).reshape(shape)
    return g


PATTERNS = {  # (shape of a, shape of b) from (m, n)
    "same": lambda m, n: ((m, n), (m, n)),
    "row": lambda m, n: ((m, n), (n,)),  # bias row vector
    "scalar": lambda m, n: ((m, n), ()),
    "row_first": lambda m, n: ((n,), (m, n)),
    "column": lambda m, n: ((m, n), (m, 1)),
}


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@FAST
@given(data=st.data(), m=dims, n=dims)
def test_broadcast_arithmetic_and_its_gradients(op, pattern, data, m, n):
    sa, sb = PATTERNS[pattern](m, n)
    a, b = data.draw(arr(sa)), data.draw(arr(sb))
    c = run1(op, [a, b])
    ref = {"add": np.add, "sub": np.subtract, "mul": np.multiply}[op](a, b)
    assert c.shape == ref.shape == np.broadcast_shapes(sa, sb)
    close(c, ref, 1e-12)
    r = data.draw(arr(c.shape))
    if op == "add":
        ga, gb = r, r
    elif op == "sub":
        ga, gb = r, run1("scale", [r], {"alpha": -1.0})
    else:
        ga, gb = run1("mul", [r, b]), run1("mul", [r, a])
    da, db = unbroadcast(ga, sa), unbroadcast(gb, sb)

    def loss():
        return float((r * run1(op, [a, b])).sum())

    close(da, num_grad(loss, a))
    close(db, num_grad(loss, b))


@FAST
@given(data=st.data(), m=dims, n=dims)
def test_bias_add_and_its_gradients(data, m, n):
    x, b, r = data.draw(arr((m, n))), data.draw(arr((n,))), data.draw(arr((m, n)))
    close(run1("bias_add", [x, b]), x + b, 1e-12)

    def loss():
        return float((r * run1("bias_add", [x, b])).sum())

    close(r, num_grad(loss, x))
    close(run1("sum", [r], {"axis": 0}), num_grad(loss, b))


def _gelu_ref(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


ACTIVATIONS = {  # forward, its gradient kernel, whether the gradient reads the output, reference
    "relu": ("relu_grad", False, lambda x: np.maximum(x, 0)),
    "tanh": ("tanh_grad", True, np.tanh),
    "gelu": ("gelu_grad", False, _gelu_ref),
    "sigmoid": ("sigmoid_grad", True, lambda x: 1 / (1 + np.exp(-x))),
}


@pytest.mark.parametrize("fwd", list(ACTIVATIONS))
@FAST
@given(data=st.data(), m=dims, n=dims)
def test_activations_and_their_gradients(fwd, data, m, n):
    grad, from_output, ref = ACTIVATIONS[fwd]
    x, r = data.draw(arr((m, n))), data.draw(arr((m, n)))
    x = np.where(np.abs(x) < 1e-3, 0.5, x)  # keep relu's kink out of the difference quotient
    y = run1(fwd, [x])
    close(y, ref(x), 1e-12)
    dx = run1(grad, [r, y if from_output else x])

    def loss():
        return float((r * run1(fwd, [x])).sum())

    close(dx, num_grad(loss, x))


def test_relu_grad_accepts_the_output_too():
    x = np.array([-2.0, -0.5, 0.0, 0.5, 3.0])
    dy = np.arange(1.0, 6.0)
    want = np.array([0.0, 0.0, 0.0, 4.0, 5.0])
    close(run1("relu_grad", [dy, x]), want, 0)
    close(run1("relu_grad", [dy, run1("relu", [x])]), want, 0)


def test_gelu_matches_pytorch_tanh_values_and_sigmoid_is_stable():
    # The tanh formula evaluated with mpmath at 40 digits (PyTorch's approximate="tanh").
    close(run1("gelu", [np.array([1.0, -1.0, 3.0, -3.0])]),
          [0.8411919906082767, -0.1588080093917233, 2.996362607918227, -0.003637392081773019],
          1e-12)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        s = run1("sigmoid", [np.array([-800.0, -40.0, 0.0, 40.0, 800.0])])
    close(s, [0.0, 4.248354255291589e-18, 0.5, 1.0, 1.0], 1e-12)
    close(run1("sigmoid", [np.array([-40.0])])[0] / 4.248354255291589e-18, 1.0, 1e-12)


@FAST
@given(data=st.data(), n=dims, c=st.integers(2, 5), label_dtype=st.sampled_from(["i32", "i64"]))
def test_softmax_xent_and_its_gradient(data, n, c, label_dtype):
    logits = data.draw(arr((n, c)))
    labels = data.draw(hnp.arrays(numpy_dtype(label_dtype), (n,), elements=st.integers(0, c - 1)))
    dloss = np.array(data.draw(st.floats(0.1, 3.0)))
    loss = run1("softmax_xent", [logits, labels])
    assert loss.shape == ()
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    close(loss, -np.log(p[np.arange(n), labels]).mean(), 1e-12)
    dlogits = run1("softmax_xent_grad", [dloss, logits, labels])
    close(dlogits, num_grad(lambda: float(dloss) * float(run1("softmax_xent", [logits, labels])),
                            logits))


def test_softmax_xent_is_stable_and_checks_labels():
    logits = np.array([[1000.0, 0.0, -1000.0], [-1000.0, 1000.0, 999.0]], np.float32)
    labels = np.array([0, 2], np.int32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        loss = run1("softmax_xent", [logits, labels])
        g = run1("softmax_xent_grad", [np.array(1.0, np.float32), logits, labels])
    close(loss, (0.0 + (1.0 + math.log1p(math.exp(-1.0)))) / 2, 1e-6)
    assert np.isfinite(g).all()
    with pytest.raises(ValueError, match=r"label 3 in row 1 is out of range for 3 classes"):
        run1("softmax_xent", [logits, np.array([0, 3], np.int32)])
    with pytest.raises(ValueError, match="out of range"):
        run1("softmax_xent_grad", [np.array(1.0, np.float32), logits, np.array([-1, 0])])


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_sum_and_mean(axis):
    a = np.arange(12.0).reshape(3, 4)
    s, m = run1("sum", [a], {"axis": axis}), run1("mean", [a], {"axis": axis})
    close(s, a.sum(axis=axis), 0)
    close(m, a.mean(axis=axis), 1e-15)
    assert s.shape == (() if axis is None else a.sum(axis=axis).shape)
    assert run1("sum", [np.arange(5, dtype=np.int32)]) == 10


def test_small_kernels():
    a, b = np.array([1.0, 2.0]), np.array([10.0, 20.0])
    close(run1("scale", [a], {"alpha": 3.0}), [3.0, 6.0], 0)
    close(run1("accumulate", [a, b]), [11.0, 22.0], 0)
    for name in ("copy", "h2d", "d2h"):
        close(run1(name, [a]), a, 0)
    assert run1("fill", [], {"value": 2.5, "shape": [2, 3], "dtype": "f64"}).tolist() == \
        [[2.5] * 3] * 2
    assert run1("fill", [], {"shape": (4,), "dtype": "i32"}).tolist() == [0] * 4
    t = np.array(3.0, np.float32)
    kernel("increment").cpu([t], [t], {})
    assert t == 4.0
    ti = np.array(7, np.int32)
    kernel("increment").cpu([ti], [ti], {"by": 2})
    assert ti == 9


# ---------------------------------------------------------------------------------------------
# Optimizers against hand-written references of PyTorch's formulas
# (torch/optim/sgd.py _single_tensor_sgd and torch/optim/adam.py _single_tensor_adam)


def torch_sgd(params, grads, bufs, lr, momentum, weight_decay, nesterov):
    for i, (p, d_p) in enumerate(zip(params, grads)):
        if weight_decay != 0:
            d_p = d_p + weight_decay * p
        if momentum != 0:
            if bufs[i] is None:
                bufs[i] = d_p.copy()
            else:
                bufs[i] = bufs[i] * momentum + d_p  # dampening 0
            d_p = d_p + momentum * bufs[i] if nesterov else bufs[i]
        p -= lr * d_p


def torch_adam(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    if weight_decay != 0:
        grad = grad + weight_decay * param
    exp_avg += (grad - exp_avg) * (1 - beta1)
    exp_avg_sq *= beta2
    exp_avg_sq += (1 - beta2) * grad * grad
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    denom = np.sqrt(exp_avg_sq) / math.sqrt(bias_correction2) + eps
    param -= step_size * exp_avg / denom


LRS = [0.1, 0.05, 0.2, 0.01, 0.1]  # a schedule: lr changes between steps


@pytest.mark.parametrize("momentum,weight_decay,nesterov", [
    (0.0, 0.0, False), (0.0, 0.1, False), (0.9, 0.0, False), (0.5, 0.01, False),
    (0.9, 0.0, True), (0.8, 0.05, True)])
def test_sgd_matches_pytorch(momentum, weight_decay, nesterov):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4))
    v = np.zeros_like(w)
    lr = np.array(0.0)  # the device scalar, rewritten by the host every step
    ref_w, ref_bufs = w.copy(), [None]
    attrs = {"momentum": momentum, "weight_decay": weight_decay, "nesterov": nesterov}
    for step_lr in LRS:
        dw = rng.standard_normal(w.shape)
        lr[...] = step_lr
        kernel("sgd_step").cpu([w, dw, v, lr], [w, v], attrs)
        torch_sgd([ref_w], [dw], ref_bufs, step_lr, momentum, weight_decay, nesterov)
        close(w, ref_w, 1e-13)


@pytest.mark.parametrize("beta1,beta2,eps,weight_decay", [
    (0.9, 0.999, 1e-8, 0.0), (0.9, 0.999, 1e-8, 0.1), (0.5, 0.9, 1e-3, 0.01)])
def test_adam_matches_pytorch(beta1, beta2, eps, weight_decay):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 5))
    m, v = np.zeros_like(w), np.zeros_like(w)
    lr, t = np.array(0.0), np.array(0.0, np.float32)
    ref = [w.copy(), np.zeros_like(w), np.zeros_like(w)]
    attrs = {"beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    for step, step_lr in enumerate(LRS, start=1):
        dw = rng.standard_normal(w.shape)
        lr[...] = step_lr
        kernel("increment").cpu([t], [t], {})
        kernel("adam_step").cpu([w, dw, m, v, lr, t], [w, m, v], attrs)
        torch_adam(ref[0], dw, ref[1], ref[2], step, step_lr, beta1, beta2, eps, weight_decay)
        close(w, ref[0], 1e-12)
        close(m, ref[1], 1e-12)
        close(v, ref[2], 1e-12)


def test_adam_rejects_an_unincremented_step_count():
    w = np.ones(3)
    with pytest.raises(ValueError, match="increment"):
        run("adam_step", [w, w, w, w, np.array(0.1), np.array(0.0)])


def test_sgd_in_float32():
    rng = np.random.default_rng(2)
    w = rng.standard_normal(8).astype(np.float32)
    dw = rng.standard_normal(8).astype(np.float32)
    v = np.zeros(8, np.float32)
    ref_w = w.astype(np.float64)
    w2, v2 = run("sgd_step", [w, dw, v, np.array(0.1, np.float32)])
    torch_sgd([ref_w], [dw.astype(np.float64)], [None], 0.1, 0.9, 0.0, False)
    assert w2.dtype == v2.dtype == np.float32
    close(w2, ref_w, 1e-6)


# ---------------------------------------------------------------------------------------------
# Aliasing: outputs that are inputs, and views into one shared byte arena


def _f(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


SAMPLES = {  # a valid call of every kernel with a CPU kernel (float64 so results compare exactly)
    "matmul": ([_f(3, 3), _f(3, 3, seed=1)], {}),
    "matmul_t": ([_f(3, 3), _f(3, 3, seed=1)], {"ta": True, "tb": True}),
    "gemm_bias": ([_f(3, 5), _f(5, 4, seed=1), _f(4, seed=2)], {}),
    "gemm_bias_relu": ([_f(3, 5), _f(5, 4, seed=1), _f(4, seed=2)], {}),
    "gemm_bias_gelu": ([_f(3, 5), _f(5, 4, seed=1), _f(4, seed=2)], {}),
    "gemm_bias_relu_aux": ([_f(3, 5), _f(5, 4, seed=1), _f(4, seed=2)], {}),
    "gemm_dgelu_bgrad": ([_f(3, 5), _f(4, 5, seed=1), _f(3, 4, seed=2)], {"tb": True}),
    "gemm_drelu_bgrad": ([_f(3, 5), _f(4, 5, seed=1), _f(3, 4, seed=2),
                          np.packbits(np.pad(_f(3, 4, seed=2) > 0, ((0, 0), (0, 124))), axis=1, bitorder="little")],
                         {"tb": True}),
    "gemm_relu_grad": ([_f(3, 5), _f(4, 5, seed=1), _f(3, 4, seed=2)], {"tb": True}),
    "gemm_drelu": ([_f(3, 5), _f(4, 5, seed=1), _f(3, 4, seed=2),
                    np.packbits(np.pad(_f(3, 4, seed=2) > 0, ((0, 0), (0, 124))), axis=1, bitorder="little")],
                   {"tb": True}),
    "add": ([_f(3, 4), _f(4, seed=1)], {}),
    "sub": ([_f(3, 4), _f(3, 4, seed=1)], {}),
    "mul": ([_f(3, 4), np.array(2.0)], {}),
    "scale": ([_f(3, 4)], {"alpha": -0.5}),
    "bias_add": ([_f(3, 4), _f(4, seed=1)], {}),
    "accumulate": ([_f(3, 4), _f(3, 4, seed=1)], {}),
    "sum": ([_f(3, 4)], {"axis": 0}),
    "mean": ([_f(3, 4)], {}),
    "relu": ([_f(3, 4)], {}),
    "relu_grad": ([_f(3, 4), _f(3, 4, seed=1)], {}),
    "tanh": ([_f(3, 4)], {}),
    "tanh_grad": ([_f(3, 4), np.tanh(_f(3, 4, seed=1))], {}),
    "gelu": ([_f(3, 4)], {}),
    "gelu_grad": ([_f(3, 4), _f(3, 4, seed=1)], {}),
    "sigmoid": ([_f(3, 4)], {}),
    "sigmoid_grad": ([_f(3, 4), 1 / (1 + np.exp(-_f(3, 4, seed=1)))], {}),
    "softmax_xent": ([_f(3, 4), np.array([0, 3, 1], np.int32)], {}),
    "softmax_xent_grad": ([np.array(1.5), _f(3, 4), np.array([0, 3, 1], np.int32)], {}),
    "softmax_xent_fused": ([_f(3, 4), np.array([0, 3, 1], np.int32), np.array(1.5)], {}),
    "fill": ([], {"value": 1.5, "shape": (3, 4), "dtype": "f64"}),
    "copy": ([_f(3, 4)], {}),
    "flatten": ([_f(2, 3, 3, 2)], {}),
    "unflatten": ([_f(2, 18), _f(2, 3, 3, 2, seed=1)], {}),
    "h2d": ([_f(3, 4)], {}),
    "d2h": ([_f(3, 4)], {}),
    "sgd_step": ([_f(3, 4), _f(3, 4, seed=1), _f(3, 4, seed=2), np.array(0.1)],
                 {"nesterov": True, "weight_decay": 0.01}),
    "adam_step": ([_f(3, 4), _f(3, 4, seed=1), _f(3, 4, seed=2), np.abs(_f(3, 4, seed=3)),
                   np.array(0.1), np.array(3.0)], {"weight_decay": 0.01}),
    "increment": ([np.array(2.0)], {}),
    "alloc": ([], {"shape": (3,), "dtype": "f64"}),
    "synchronize": ([], {}),
    "allreduce_mean": ([_f(3, 4)], {"bucket": "grad:x"}),  # one rank: the mean is the value
    "multi_tensor": ([_f(3, 4), _f(3, 4, seed=1), _f(3, 4, seed=2), np.array(0.1), _f(5), _f(5, seed=1), _f(5, seed=2),
                      np.array(0.1)], {"base": "sgd_step", "parts": ((4, 2, (("momentum", 0.5),)),
                                                                       (4, 2, (("momentum", 0.5),)))}),
}


def _sample(key):
    ins, attrs = SAMPLES[key]
    return ("matmul" if key == "matmul_t" else key), [i.copy() for i in ins], attrs


def test_samples_cover_every_cpu_kernel():
    from streamsched.stdlib.kernels import CNN_KERNELS  # covered by tests/test_kernels_cnn.py
    from streamsched.stdlib.kernels.transformer import TRANSFORMER_KERNELS  # tests/test_kernels_transformer.py

    assert {_sample(k)[0] for k in SAMPLES} == {n for n, k in KERNELS.items()
                                                if k.cpu and n not in CNN_KERNELS + TRANSFORMER_KERNELS}


@pytest.mark.parametrize("key,out,inp", alias_cases(SAMPLES, lambda k: "matmul" if k == "matmul_t" else k))
def test_an_output_may_be_an_input(key, out, inp):
    name, ins, attrs = _sample(key)
    assert_output_may_be_input(name, ins, attrs, out, inp)


def test_optimizer_outputs_in_place_equal_fresh_outputs():
    for name in ("sgd_step", "adam_step"):
        _, ins, attrs = _sample(name)
        fresh = run(name, [i.copy() for i in ins], attrs)
        state = ins[:1] + ins[2:len(fresh) + 1]  # w, then v (sgd) or m, v (adam)
        kernel(name).cpu(ins, state, attrs)
        for got, want in zip(state, fresh):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 2e-2)])
@pytest.mark.parametrize("key", [k for k in SAMPLES if k not in ("fill", "alloc", "synchronize")])
def test_lower_precision_runs_and_keeps_its_dtype(key, dtype, tol):
    name, ins, attrs = _sample(key)
    want = run(name, ins, attrs)
    low = [i.astype(dtype) if i.dtype == np.float64 else i for i in ins]
    got = run(name, low, attrs)
    for g, w in zip(got, want):
        expect = dtype if w.dtype == np.float64 else w.dtype
        if name in ("softmax_xent", "softmax_xent_fused") and dtype == np.float16 and g.ndim == 0:
            expect = np.float32  # the loss of f16 logits is f32 (the loss-scale seed is f32)
        assert g.dtype == expect
        close(g.astype(np.float64), w, tol * max(1.0, float(np.abs(w).max())))


@pytest.mark.parametrize("key", list(SAMPLES))
def test_arena_views_work_and_in_place_outputs_alias(key):
    """Inputs and outputs as views into one byte arena; where an output has an input's type it
    is that input's very view (the `into` case)."""
    name, ins, attrs = _sample(key)
    assert_runs_in_one_arena(name, ins, attrs)


# ---------------------------------------------------------------------------------------------
# Type rules: codes, argument indices, messages naming the shapes

F32 = "f32"


@pytest.mark.parametrize("name,types,attrs,code,arg,words", [
    ("matmul", [((128, 64), F32), ((32, 10), F32)], {}, "S003", 1,
     ["inner dimensions differ", "a is [128, 64]", "b is [32, 10]"]),
    ("matmul", [((64, 128), F32), ((10, 64), F32)], {"ta": True}, "S003", 1,
     ["a^T is [128, 64]", "b is [10, 64]"]),
    ("matmul", [((128, 64), F32), ((10, 32), F32)], {"tb": True}, "S003", 1, ["b^T is [32, 10]"]),
    ("matmul", [((2, 3, 4), F32), ((4, 5), F32)], {}, "S003", 0, ["a must be 2-D", "[2, 3, 4]"]),
    ("matmul", [((2, 3), F32), ((3, 4), "f64")], {}, "S004", 1, ["a is f32", "b is f64"]),
    ("matmul", [((2, 3), "i32"), ((3, 4), "i32")], {}, "S004", 0, ["float", "got i32"]),
    ("matmul", [((2, 3), F32)], {}, "S003", None, ["takes 2 inputs (a, b), got 1"]),
    ("matmul", [((2, 3), F32), ((3, 4), F32)], {"ta": 1}, "S003", None, ["ta", "true or false"]),
    ("add", [((4, 3), F32), ((5,), F32)], {}, "S003", 1, ["do not broadcast", "[4, 3]", "[5]"]),
    ("mul", [((4, 3), F32), ((3,), "f16")], {}, "S004", 1, ["dtypes differ", "f16"]),
    ("sub", [((4, 3), "i64"), ((3,), "i64")], {}, "S004", 0, ["float"]),
    ("bias_add", [((4, 3), F32), ((4,), F32)], {}, "S003", 1, ["[3]", "[4, 3]", "got [4]"]),
    ("bias_add", [((4, 3), F32), ((1, 3), F32)], {}, "S003", 1, ["got [1, 3]"]),
    ("accumulate", [((4, 3), F32), ((3,), F32)], {}, "S003", 1, ["[4, 3]", "[3]"]),
    ("sum", [((4, 3), F32)], {"axis": 2}, "S003", 0, ["axis 2", "[4, 3]"]),
    ("sum", [((4, 3), F32)], {"axsi": 0}, "S003", None, ["unknown attribute 'axsi'", "axis"]),
    ("mean", [((4,), "i32")], {}, "S004", 0, ["float"]),
    ("relu", [((4,), "i32")], {}, "S004", 0, ["x must be a float dtype", "got i32"]),
    ("relu_grad", [((4, 3), F32), ((3, 4), F32)], {}, "S003", 1, ["dy is [4, 3]", "x is [3, 4]"]),
    ("tanh_grad", [((4,), F32), ((4,), "f64")], {}, "S004", 1, ["dtypes differ"]),
    ("softmax_xent", [((4, 10), F32), ((4,), F32)], {}, "S004", 1,
     ["labels must be an integer dtype (i32), got f32"]),
    ("softmax_xent", [((4, 10), F32), ((5,), "i32")], {}, "S003", 1, ["[4]", "[4, 10]", "[5]"]),
    ("softmax_xent", [((4, 10, 2), F32), ((4,), "i32")], {}, "S003", 0, ["2-D", "[4, 10, 2]"]),
    ("softmax_xent", [((4, 10), "i32"), ((4,), "i32")], {}, "S004", 0, ["float"]),
    ("softmax_xent_grad", [((1,), F32), ((4, 10), F32), ((4,), "i32")], {}, "S003", 0,
     ["dloss must be a scalar", "got [1]"]),
    ("softmax_xent_grad", [((), "i32"), ((4, 10), F32), ((4,), "i32")], {}, "S004", 0,
     ["dloss", "i32"]),
    ("sgd_step", [((4, 3), F32), ((4, 3), F32), ((4, 3), F32), ((1,), F32)], {}, "S003", 3,
     ["lr must be a scalar", "got [1]"]),
    ("sgd_step", [((4, 3), F32), ((4, 3), F32), ((3, 4), F32), ((), F32)], {}, "S003", 2,
     ["w is [4, 3]", "v is [3, 4]"]),
    ("sgd_step", [((4, 3), F32), ((4, 3), "f64"), ((4, 3), F32), ((), F32)], {}, "S004", 1,
     ["w is f32", "dw is f64"]),
    ("sgd_step", [((3,), F32), ((3,), F32), ((3,), F32), ((), "i32")], {}, "S004", 3, ["lr"]),
    ("sgd_step", [((3,), F32), ((3,), F32), ((3,), F32), ((), F32)],
     {"momentum": 0.0, "nesterov": True}, "S003", None, ["nesterov", "momentum"]),
    ("adam_step", [((3,), F32)] * 4 + [((), F32), ((2,), F32)], {}, "S003", 5,
     ["t must be a scalar"]),
    ("adam_step", [((3,), F32)] * 4 + [((), F32), ((), F32)], {"beta2": 1.0}, "S003", None,
     ["beta2"]),
    ("increment", [((2,), F32)], {}, "S003", 0, ["t must be a scalar"]),
    ("fill", [], {"dtype": "f17"}, "S003", None, ["dtype 'f17'"]),
    ("fill", [((3,), F32)], {}, "S003", None, ["takes no inputs, got 1"]),
])
def test_type_errors(name, types, attrs, code, arg, words):
    with pytest.raises(KernelTypeError) as e:
        infer_types(name, types, attrs)
    err = e.value
    assert (err.code, err.arg) == (code, arg), err.message
    assert err.message.startswith(name + ":")
    for w in words:
        assert w in err.message, err.message


@pytest.mark.parametrize("name,types,attrs,want", [
    ("matmul", [((5, 3), F32), ((4, 3), F32)], {"tb": True}, [((5, 4), F32)]),
    ("matmul", [((3, 5), "f64"), ((3, 4), "f64")], {"ta": True}, [((5, 4), "f64")]),
    ("add", [((4, 3), F32), ((3,), F32)], {}, [((4, 3), F32)]),
    ("mul", [((), "f16"), ((2, 3), "f16")], {}, [((2, 3), "f16")]),
    ("sub", [((4, 1), F32), ((1, 3), F32)], {}, [((4, 3), F32)]),
    ("bias_add", [((2, 4, 3), F32), ((3,), F32)], {}, [((2, 4, 3), F32)]),
    ("sum", [((4, 3), F32)], {}, [((), F32)]),
    ("sum", [((4, 3), F32)], {"axis": -2}, [((3,), F32)]),
    ("mean", [((4, 3, 2), F32)], {"axis": 1}, [((4, 2), F32)]),
    ("softmax_xent", [((4, 10), F32), ((4,), "i64")], {}, [((), F32)]),
    ("softmax_xent_grad", [((), F32), ((4, 10), F32), ((4,), "i32")], {}, [((4, 10), F32)]),
    ("fill", [], {"shape": [128, 10], "dtype": "f32"}, [((128, 10), F32)]),
    ("sgd_step", [((3,), F32)] * 3 + [((), F32)], {}, [((3,), F32)] * 2),
    ("adam_step", [((3,), F32)] * 4 + [((), F32), ((), "i64")], {}, [((3,), F32)] * 3),
    ("h2d", [((128, 64), "u8")], {}, [((128, 64), "u8")]),
    ("increment", [((), "i64")], {}, [((), "i64")]),
])
def test_type_rules_accept(name, types, attrs, want):
    assert infer_types(name, types, attrs) == want
    assert kernel(name).infer(types, attrs) == want  # the record's rule fills defaults too


def test_flatten_round_trip_and_gradient():
    x = _f(2, 3, 3, 2)
    y = np.empty((2, 18))
    KERNELS["flatten"].cpu([x], [y], {})
    assert np.array_equal(y, x.reshape(2, 18))
    dx = np.empty_like(x)
    KERNELS["unflatten"].cpu([y, x], [dx], {})
    assert np.array_equal(dx, x)  # a reshape's gradient is the inverse reshape
    with pytest.raises(KernelTypeError):
        KERNELS["unflatten"].infer([((2, 17), "f64"), ((2, 3, 3, 2), "f64")], {})
