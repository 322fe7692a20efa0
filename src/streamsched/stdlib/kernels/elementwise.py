"""Elementwise kernels: broadcasting arithmetic (add, sub, mul, scale, bias_add, accumulate) and
the activations next to their gradients (relu, tanh, gelu, sigmoid)."""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from streamsched.stdlib.kernel_record import KCall, KernelTypeError, NotDifferentiable
from streamsched.stdlib.kernels._base import (NUMERIC, DocRow, Family, GradArgs, _acc, _dtype, _floats, _fmt,
                                              _from_input, _from_output, _number, _passthrough, _same_shape,
                                              _shape, _write)
from streamsched.stdlib.kernels._cuda import _rowbcast, _stream, ew4

FAMILY = Family(__name__, "Elementwise arithmetic and activations")
_register = FAMILY.register


# --------------------------------------------------------------------------------------------
# Arithmetic with broadcasting


def _broadcast_infer(k, names, t, at):
    dt = _floats(k, t, names, (0, 1))
    try:
        shape = np.broadcast_shapes(t[0][0], t[1][0])
    except ValueError:
        raise KernelTypeError(
            f"{k}: shapes do not broadcast: {names[0]} is {_fmt(t[0][0])}, {names[1]} is "
            f"{_fmt(t[1][0])} (trailing dimensions must be equal or 1)", arg=1) from None
    return [(shape, dt)]


def _binary(ufunc):
    def cpu(ins, outs, at):
        ufunc(ins[0], ins[1], out=outs[0])
    cpu.__name__ = f"_{ufunc.__name__}_cpu"
    return cpu


def _unbroadcast(kernel: str, grad, src: tuple[int, ...], dst: tuple[int, ...]):
    """The gradient of an operand of shape dst broadcast to src: grad summed over the broadcast
    dimensions (leading ones, or everything for a scalar)."""
    if src == dst:
        return grad
    if dst == ():
        return KCall("sum", (grad,))
    lead = len(src) - len(dst)
    if lead > 0 and src[lead:] == dst:
        if lead == 3 and len(src) == 4 and len(dst) == 1:
            return KCall("sum_nhw", (grad,))
        for _ in range(lead):
            grad = KCall("sum", (grad,), (("axis", 0),))
        return grad
    raise NotDifferentiable(f"`{kernel}` broadcast a {list(dst)} operand to {list(src)}: only a row (leading "
                            "dimensions) or a scalar is summed back")


def _binary_recipe(kind: str) -> Callable:
    def recipe(g: GradArgs):
        a, b = g.args
        (dc,) = g.douts
        out = _shape(g, g.outs[0])
        ga = {"add": dc, "sub": dc, "mul": KCall("mul", (dc, b))}[kind]
        gb = {"add": dc, "sub": KCall("scale", (dc,), (("alpha", -1.0),)), "mul": KCall("mul", (dc, a))}[kind]
        return [_unbroadcast(kind, ga, out, _shape(g, a)) if g.need[0] else None,
                _unbroadcast(kind, gb, out, _shape(g, b)) if g.need[1] else None]
    return recipe


_BROADCAST_DOC = """
c = a {op} b, elementwise with NumPy broadcasting: b may be a row vector [n] against a [m, n],
or a scalar []; c has shape np.broadcast_shapes(a, b).  a, b one float dtype.
Backward: the gradient of a broadcast operand is the upstream gradient summed over the
broadcast dimensions (sum(dc, axis=0) for a row vector, sum(dc) for a scalar).
"""


_register("add", "a b", "c", _broadcast_infer, _binary(np.add),
          doc=_BROADCAST_DOC.format(op="+"), grad=_binary_recipe("add"),
          row=DocRow("a, b -> c", "comp3",
                     "c = a + b, NumPy broadcasting (b a row [n] or a scalar []), c: broadcast shape; one float "
                     "dtype"))

_register("sub", "a b", "c", _broadcast_infer, _binary(np.subtract),
          doc=_BROADCAST_DOC.format(op="-"), grad=_binary_recipe("sub"),
          row=DocRow("a, b -> c", "comp3", "c = a - b, broadcasting as `add`"))

_register("mul", "a b", "c", _broadcast_infer, _binary(np.multiply),
          doc=_BROADCAST_DOC.format(op="*"), grad=_binary_recipe("mul"),
          row=DocRow("a, b -> c", "comp3", "c = a * b, broadcasting as `add`"))


def _unary_float_infer(k, names, t, at):
    return [(t[0][0], _floats(k, t, names, (0,)))]


def _scale_infer(k, names, t, at):
    _number(k, at, "alpha")
    return _unary_float_infer(k, names, t, at)


def _scale_cpu(ins, outs, at):
    np.multiply(ins[0], at["alpha"], out=outs[0])


def _scale_recipe(g: GradArgs):
    return [KCall("scale", (g.douts[0],), (("alpha", float(g.attrs.get("alpha", 1.0))),))]


_register("scale", "a", "c", _scale_infer, _scale_cpu, {"alpha": 1.0}, doc="""
c = alpha * a; alpha is a compile-time number (a step-varying factor belongs in a device
scalar and `mul`).  a: any shape, float -> c: same type.
""", grad=_scale_recipe,
          row=DocRow("a -> c", "comp3", "c = alpha * a (alpha fixed at compile time)"))


def _bias_add_infer(k, names, t, at):
    dt = _floats(k, t, names, (0, 1))
    (sx, _), (sb, _) = t
    if len(sx) < 1:
        raise KernelTypeError(f"{k}: {names[0]} must have at least 1 dimension, got []", arg=0)
    if len(sb) != 1 or sb[0] != sx[-1]:
        raise KernelTypeError(
            f"{k}: {names[1]} must be [{sx[-1]}] to match the last dimension of "
            f"{names[0]} {_fmt(sx)}, got {_fmt(sb)}", arg=1)
    return [(sx, dt)]


def _bias_add_recipe(g: GradArgs):
    x, b = g.args
    (dy,) = g.douts
    return [dy if g.need[0] else None,
            _unbroadcast("bias_add", dy, _shape(g, x), _shape(g, b)) if g.need[1] else None]


_register("bias_add", "x b", "y", _bias_add_infer, _binary(np.add), doc="""
y = x + b, b: [n] added to every row of x: [..., n] -> y: [..., n]; one float dtype.
The fused pass for `matmul(x, w) + b`.  Backward: dx = dy, db = sum(dy, axis=0) (2-D x).
""", grad=_bias_add_recipe,
          row=DocRow("x [..., n], b [n] -> y", "comp1 (with its GEMM)", "y = x + b (the fused `matmul(x, w) + b`)"))


def _accumulate_infer(k, names, t, at):
    shape = _same_shape(k, t, names, (0, 1))
    dt = _dtype(k, t, 0, names, NUMERIC, "a numeric dtype")
    if t[1][1] != dt:
        raise KernelTypeError(f"{k}: dtypes differ: {names[0]} is {dt}, {names[1]} is {t[1][1]}",
                              arg=1, code="S004")
    return [(shape, dt)]


_register("accumulate", "a b", "c", _accumulate_infer, _binary(np.add), doc="""
c = a + b with identical shapes and dtypes (no broadcasting): the gradient sum where a value
feeds several consumers (fan-out).  Usually in place: c is a.
""", grad=_passthrough,
          row=DocRow("a, b -> c", "comp3", "c = a + b, same shape and dtype: the gradient sum at fan-out"))


# --------------------------------------------------------------------------------------------
# Activations and their gradients (forward next to backward)


def _grad_infer(k, names, t, at):
    shape = _same_shape(k, t, names, (0, 1))
    return [(shape, _floats(k, t, names, (0, 1)))]


def _relu_cpu(ins, outs, at):
    np.maximum(ins[0], 0, out=outs[0])


def _relu_grad_cpu(ins, outs, at):
    dy, x = ins
    _write(outs[0], np.where(x > 0, dy, 0))


_register("relu", "x", "y", _unary_float_infer, _relu_cpu, doc="""
y = max(x, 0).  x: any shape, float -> y: same type.
""", grad=_from_output("relu_grad"),
          row=DocRow("x -> y", "comp3", "y = max(x, 0)"))

_register("relu_grad", "dy x", "dx", _grad_infer, _relu_grad_cpu, doc="""
dx = dy where x > 0, else 0 (PyTorch's threshold_backward: the gradient at 0 is 0).
x may be the pre-activation or relu's output: the sign test is the same.
dy, x: one shape and float dtype -> dx: same type.
""",
          row=DocRow("dy, x -> dx", "comp3", "dx = dy where x > 0 else 0; x may be the input or the output"))


def _tanh_cpu(ins, outs, at):
    np.tanh(ins[0], out=outs[0])


def _tanh_grad_cpu(ins, outs, at):
    dy, y = ins
    _write(outs[0], dy * (1 - y * y))


_register("tanh", "x", "y", _unary_float_infer, _tanh_cpu, doc="""
y = tanh(x).  x: any shape, float -> y: same type.
""", grad=_from_output("tanh_grad"),
          row=DocRow("x -> y", "comp3", "y = tanh x"))

_register("tanh_grad", "dy y", "dx", _grad_infer, _tanh_grad_cpu, doc="""
dx = dy * (1 - y^2), from tanh's forward *output* y (not x).
dy, y: one shape and float dtype -> dx: same type.
""",
          row=DocRow("dy, y -> dx", "comp3", "dx = dy (1 - y^2), from the **output** y"))


_GELU_K = math.sqrt(2.0 / math.pi)

_GELU_C = 0.044715


def _gelu_cpu(ins, outs, at):
    x = _acc(ins[0])
    _write(outs[0], 0.5 * x * (1.0 + np.tanh(_GELU_K * (x + _GELU_C * x * x * x))))


def _gelu_grad_cpu(ins, outs, at):
    dy, x = ins[0], _acc(ins[1])
    th = np.tanh(_GELU_K * (x + _GELU_C * x * x * x))
    d = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * _GELU_K * (1.0 + 3.0 * _GELU_C * x * x)
    _write(outs[0], dy * d)


_register("gelu", "x", "y", _unary_float_infer, _gelu_cpu, doc="""
y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): the tanh approximation, as PyTorch's
torch.nn.GELU(approximate="tanh") (https://pytorch.org/docs/stable/generated/torch.nn.GELU.html).
x: any shape, float -> y: same type (f16 computed in f32).
""", grad=_from_input("gelu_grad"),
          row=DocRow("x -> y", "comp3",
                     'y = 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3))), PyTorch `approximate="tanh"`'))

_register("gelu_grad", "dy x", "dx", _grad_infer, _gelu_grad_cpu, doc="""
dx = dy * (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)),
u = sqrt(2/pi) (x + 0.044715 x^3); from the forward *input* x.
dy, x: one shape and float dtype -> dx: same type.
""",
          row=DocRow("dy, x -> dx", "comp3", "dx = dy d/dx gelu(x), from the **input** x"))


def _sigmoid_cpu(ins, outs, at):
    x = _acc(ins[0])
    e = np.exp(-np.abs(x))  # never overflows; both branches keep full relative accuracy
    _write(outs[0], np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)))


def _sigmoid_grad_cpu(ins, outs, at):
    dy, y = ins
    _write(outs[0], dy * y * (1 - y))


_register("sigmoid", "x", "y", _unary_float_infer, _sigmoid_cpu, doc="""
y = 1 / (1 + exp(-x)), computed without overflow for large |x|.
x: any shape, float -> y: same type.
""", grad=_from_output("sigmoid_grad"),
          row=DocRow("x -> y", "comp3", "y = 1 / (1 + e^-x), no overflow"))

_register("sigmoid_grad", "dy y", "dx", _grad_infer, _sigmoid_grad_cpu, doc="""
dx = dy * y * (1 - y), from sigmoid's forward *output* y.
dy, y: one shape and float dtype -> dx: same type.
""",
          row=DocRow("dy, y -> dx", "comp3", "dx = dy y (1 - y), from the **output** y"))


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.


_PREAMBLE = r"""
template <typename T> struct ss_acc { typedef float type; };
template <> struct ss_acc<double> { typedef double type; };
"""


_K: dict[str, Any] = {}


def _kernels() -> dict[str, Any]:
    """Build the CuPy kernel objects once (compilation itself happens per dtype on first
    launch, which is why the executor warms every task up before capture)."""
    if _K:
        return _K
    import cupy as cp

    E = cp.ElementwiseKernel
    k = _K
    k["add"] = E("T a, T b", "T c", "c = a + b", "ss_add")
    k["sub"] = E("T a, T b", "T c", "c = a - b", "ss_sub")
    k["mul"] = E("T a, T b", "T c", "c = a * b", "ss_mul")
    k["bias_add"] = E("T x, T b", "T y", "y = x + b", "ss_bias_add")
    k["scale"] = E("T a, float64 alpha", "T c", "c = a * (T)alpha", "ss_scale")
    k["relu"] = E("T x", "T y", "y = x < (T)0 ? (T)0 : x", "ss_relu")
    k["relu_grad"] = E("T dy, T x", "T dx", "dx = x > (T)0 ? dy : (T)0", "ss_relu_grad")
    k["tanh"] = E("T x", "T y", "typedef typename ss_acc<T>::type A; y = (T)tanh((A)x)",
                  "ss_tanh", preamble=_PREAMBLE)
    k["tanh_grad"] = E("T dy, T y", "T dx", "dx = dy * ((T)1 - y * y)", "ss_tanh_grad")
    k["gelu"] = E(
        "T x", "T y",
        f"""typedef typename ss_acc<T>::type A;
        A v = (A)x;
        A u = (A){_GELU_K!r} * (v + (A){_GELU_C!r} * v * v * v);
        y = (T)((A)0.5 * v * ((A)1 + tanh(u)))""",
        "ss_gelu", preamble=_PREAMBLE)
    k["gelu_grad"] = E(
        "T dy, T x", "T dx",
        f"""typedef typename ss_acc<T>::type A;
        A v = (A)x;
        A th = tanh((A){_GELU_K!r} * (v + (A){_GELU_C!r} * v * v * v));
        A d = (A)0.5 * ((A)1 + th)
            + (A)0.5 * v * ((A)1 - th * th) * (A){_GELU_K!r} * ((A)1 + (A){3 * _GELU_C!r} * v * v);
        dx = (T)((A)dy * d)""",
        "ss_gelu_grad", preamble=_PREAMBLE)
    k["sigmoid"] = E(
        "T x", "T y",
        """typedef typename ss_acc<T>::type A;
        A v = (A)x;
        A e = exp(-fabs(v));
        y = (T)(v >= (A)0 ? (A)1 / ((A)1 + e) : e / ((A)1 + e))""",
        "ss_sigmoid", preamble=_PREAMBLE)
    k["sigmoid_grad"] = E("T dy, T y", "T dx", "dx = dy * y * ((T)1 - y)", "ss_sigmoid_grad")
    return k


_OPS = {"add": 0, "sub": 1, "mul": 2, "bias_add": 0}


def _binary_cuda(name: str) -> Callable:
    op = _OPS.get(name)

    def fn(ctx, stream, ins, outs, attrs):
        if op is not None and _rowbcast(ctx, stream, ins[0], ins[1], outs[0], op):
            return
        if ew4(ctx, stream, name, ins[:2], outs[0]):
            return
        with _stream(ctx, stream):
            _kernels()[name](ins[0], ins[1], outs[0])
    fn.__name__ = name
    return fn


def _unary_cuda(name: str) -> Callable:
    def fn(ctx, stream, ins, outs, attrs):
        if ew4(ctx, stream, name, ins[:1], outs[0]):
            return
        with _stream(ctx, stream):
            _kernels()[name](ins[0], outs[0])
    fn.__name__ = name
    return fn


def scale_cuda(ctx, stream, ins, outs, attrs):
    with _stream(ctx, stream):
        _kernels()["scale"](ins[0], float(attrs.get("alpha", 1.0)), outs[0])


add_cuda = _binary_cuda("add")
sub_cuda = _binary_cuda("sub")
mul_cuda = _binary_cuda("mul")
bias_add_cuda = _binary_cuda("bias_add")
accumulate_cuda = _binary_cuda("add")
relu_cuda = _unary_cuda("relu")
relu_grad_cuda = _binary_cuda("relu_grad")
tanh_cuda = _unary_cuda("tanh")
tanh_grad_cuda = _binary_cuda("tanh_grad")
gelu_cuda = _unary_cuda("gelu")
gelu_grad_cuda = _binary_cuda("gelu_grad")
sigmoid_cuda = _unary_cuda("sigmoid")
sigmoid_grad_cuda = _binary_cuda("sigmoid_grad")
