"""The primitive kernels the stdlib ops are built from, in one table `KERNELS`: each entry holds
its signature, type rule, NumPy CPU kernel and the name of its CUDA twin (STYLE.md, habit 5).

CPU calling convention (`Kernel.cpu(ins, outs, attrs)`): `outs` are preallocated arrays with the
types `infer` returned, possibly views into a shared arena, possibly the very arrays of `ins`
(`v = f(v, g)`).  Every kernel therefore writes only through `out[...] = ...` or
`np.ufunc(..., out=out)` (NumPy copies overlapping operands itself), and a kernel with several
outputs, or one that reads an input after writing, finishes computing into temporaries before
its first write.  Step-varying scalars (learning rate, step count, dloss) arrive as shape-()
arrays and are read when the kernel runs, never baked in (CUDA_PITFALLS.md, pitfall 3).

Type rules (`Kernel.infer(in_types, attrs)`) raise `KernelTypeError` with code S003 for shapes,
arity and attributes, S004 for dtypes; `arg` is the index of the offending input, so the caller
can point at the user's argument.  Messages use the kernel's own parameter names (`a`, `b`, ...).
`Kernel.infer` and `Kernel.cpu` both fill in attribute defaults, so `{}` is a valid `attrs`.
"""

from __future__ import annotations

import difflib
import functools
import math
from typing import Any, Callable, Sequence

import numpy as np

from streamsched.interp.ir import DTYPE_BYTES
from streamsched.stdlib.kernel_record import Kernel, KernelTypeError, TensorType

FLOATS = ("f16", "bf16", "f32", "f64")
INTS = ("i32", "i64")
NUMERIC = FLOATS + INTS

_NUMPY = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "i64": np.int64,
          "i32": np.int32, "u8": np.uint8, "bool": np.bool_}

KERNELS: dict[str, Kernel] = {}
"""Kernel name -> record, in registration order (the order of docs/kernels.md)."""


def numpy_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype the CPU backend stores `dtype` in; bf16 has none (NotImplementedError)."""
    if dtype == "bf16":
        raise NotImplementedError(
            "bf16 buffers cannot run on the CPU backend (NumPy has no bfloat16); "
            "use f32 or f16 there, or the CUDA backend")
    if dtype not in _NUMPY:
        raise KeyError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return np.dtype(_NUMPY[dtype])


# --------------------------------------------------------------------------------------------
# Type-rule helpers: each check names the kernel, the parameter and the shapes involved.


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _dtype(k: str, types, i: int, names, allowed: tuple[str, ...], what: str) -> str:
    dt = types[i][1]
    if dt not in allowed:
        raise KernelTypeError(f"{k}: {names[i]} must be {what} ({', '.join(allowed)}), got {dt}",
                              arg=i, code="S004")
    return dt


def _floats(k: str, types, names, idx: Sequence[int]) -> str:
    """All of `idx` are floats of one dtype (the first one's); returns it."""
    first = _dtype(k, types, idx[0], names, FLOATS, "a float dtype")
    for i in idx[1:]:
        _dtype(k, types, i, names, FLOATS, "a float dtype")
        if types[i][1] != first:
            raise KernelTypeError(
                f"{k}: dtypes differ: {names[idx[0]]} is {first}, {names[i]} is {types[i][1]}",
                arg=i, code="S004")
    return first


def _same_shape(k: str, types, names, idx: Sequence[int]) -> tuple[int, ...]:
    first = types[idx[0]][0]
    for i in idx[1:]:
        if types[i][0] != first:
            raise KernelTypeError(
                f"{k}: shapes differ: {names[idx[0]]} is {_fmt(first)}, "
                f"{names[i]} is {_fmt(types[i][0])}", arg=i)
    return first


def _scalar(k: str, types, names, i: int, allowed: tuple[str, ...] = FLOATS) -> None:
    shape, dt = types[i]
    if shape != ():
        raise KernelTypeError(
            f"{k}: {names[i]} must be a scalar (shape []), got {_fmt(shape)}", arg=i)
    _dtype(k, types, i, names, allowed, "a scalar of dtype")


def _attr_error(k: str, msg: str) -> KernelTypeError:
    return KernelTypeError(f"{k}: {msg}", arg=None, code="S003")


def _number(k: str, attrs: dict, key: str, lo: float | None = None, hi: float | None = None,
            hi_open: bool = False) -> float:
    x = attrs[key]
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise _attr_error(k, f"attribute {key} must be a number, got {x!r}")
    if (lo is not None and x < lo) or (hi is not None and (x >= hi if hi_open else x > hi)):
        rng = f"[{lo}, {hi})" if hi_open else (f"[{lo}, {hi}]" if hi is not None else f">= {lo}")
        raise _attr_error(k, f"attribute {key} = {x} is out of range (must be {rng})")
    return float(x)


def _flag(k: str, attrs: dict, key: str) -> bool:
    x = attrs[key]
    if not isinstance(x, (bool, np.bool_)):
        raise _attr_error(k, f"attribute {key} must be true or false, got {x!r}")
    return bool(x)


def _type_attrs(k: str, attrs: dict) -> TensorType:
    """The (shape, dtype) a kernel with no inputs was told to produce."""
    shape, dt = attrs["shape"], attrs["dtype"]
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        shape = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise _attr_error(k, f"attribute shape must be a list of sizes, got {shape!r}") from None
    if any(d < 0 for d in shape):
        raise _attr_error(k, f"attribute shape {_fmt(shape)} has a negative size")
    if dt not in DTYPE_BYTES:
        raise _attr_error(k, f"attribute dtype {dt!r} is not a dtype ({', '.join(DTYPE_BYTES)})")
    return shape, dt


# --------------------------------------------------------------------------------------------
# Registration: wraps each rule with the arity check and attribute defaults.


def _register(name: str, inputs: str, outputs: str, infer: Callable, cpu: Callable | None,
              attrs: dict[str, Any] | None = None, *, doc: str, host: bool = False,
              capturable: bool = True, inplace: bool = True) -> None:
    ins = tuple(inputs.split())
    outs = tuple(outputs.split())
    defaults = dict(attrs or {})

    def merged(given: dict[str, Any] | None) -> dict[str, Any]:
        return {**defaults, **given} if given else defaults

    def checked_infer(in_types: Sequence[TensorType], given: dict[str, Any] | None = None):
        if len(in_types) != len(ins):
            want = f"{len(ins)} input{'s' if len(ins) != 1 else ''} ({', '.join(ins)})" if ins \
                else "no inputs"
            raise KernelTypeError(f"{name}: takes {want}, got {len(in_types)}")
        unknown = sorted(set(given or ()) - set(defaults))
        if unknown:
            takes = f"takes {', '.join(defaults)}" if defaults else "takes no attributes"
            raise _attr_error(name, f"unknown attribute {unknown[0]!r}; {name} {takes}")
        types = [(tuple(int(d) for d in s), dt) for s, dt in in_types]
        return [(tuple(s), dt) for s, dt in infer(name, ins, types, merged(given))]

    run = None
    if cpu is not None:
        @functools.wraps(cpu)
        def run(ins_: Sequence[Any], outs_: Sequence[Any], given: dict[str, Any] | None = None):
            cpu(ins_, outs_, merged(given))

    KERNELS[name] = Kernel(name=name, inputs=ins, outputs=outs, infer=checked_infer, cpu=run,
                           attrs=defaults, cuda=f"streamsched.stdlib.cuda_kernels:{name}",
                           host=host, capturable=capturable, doc=doc.strip(), inplace=inplace)


def _acc(x: np.ndarray) -> np.ndarray:
    """x in at least float32, so that f16 activations and losses are computed accurately."""
    return x.astype(np.promote_types(x.dtype, np.float32), copy=False)


def _write(out: np.ndarray, value: Any) -> None:
    out[...] = value


# --------------------------------------------------------------------------------------------
# GEMM


def _matmul_infer(k, names, t, at):
    ta, tb = _flag(k, at, "ta"), _flag(k, at, "tb")
    for i in (0, 1):
        if len(t[i][0]) != 2:
            raise KernelTypeError(f"{k}: {names[i]} must be 2-D, got {_fmt(t[i][0])}", arg=i)
    dt = _floats(k, t, names, (0, 1))
    (sa, _), (sb, _) = t
    ea, eb = (sa[::-1] if ta else sa), (sb[::-1] if tb else sb)
    if ea[1] != eb[0]:
        na, nb = names[0] + ("^T" if ta else ""), names[1] + ("^T" if tb else "")
        raise KernelTypeError(f"{k}: inner dimensions differ: {na} is {_fmt(ea)}, "
                              f"{nb} is {_fmt(eb)} ({ea[1]} != {eb[0]})", arg=1)
    return [((ea[0], eb[1]), dt)]


def _matmul_cpu(ins, outs, at):
    a, b = ins
    np.matmul(a.T if at["ta"] else a, b.T if at["tb"] else b, out=outs[0])


_register("matmul", "a b", "c", _matmul_infer, _matmul_cpu, {"ta": False, "tb": False}, doc="""
c = op(a) @ op(b), op(z) = z^T when the flag (ta for a, tb for b) is set.
a: [m, k] (or [k, m] with ta), b: [k, n] (or [n, k] with tb) -> c: [m, n]; a, b one float dtype.
Backward of c = a @ b: da = matmul(dc, b, tb=True), db = matmul(a, dc, ta=True).
""")


# --------------------------------------------------------------------------------------------
# Elementwise arithmetic


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


_BROADCAST_DOC = """
c = a {op} b, elementwise with NumPy broadcasting: b may be a row vector [n] against a [m, n],
or a scalar []; c has shape np.broadcast_shapes(a, b).  a, b one float dtype.
Backward: the gradient of a broadcast operand is the upstream gradient summed over the
broadcast dimensions (sum(dc, axis=0) for a row vector, sum(dc) for a scalar).
"""
_register("add", "a b", "c", _broadcast_infer, _binary(np.add),
          doc=_BROADCAST_DOC.format(op="+"))
_register("sub", "a b", "c", _broadcast_infer, _binary(np.subtract),
          doc=_BROADCAST_DOC.format(op="-"))
_register("mul", "a b", "c", _broadcast_infer, _binary(np.multiply),
          doc=_BROADCAST_DOC.format(op="*"))


def _unary_float_infer(k, names, t, at):
    return [(t[0][0], _floats(k, t, names, (0,)))]


def _scale_infer(k, names, t, at):
    _number(k, at, "alpha")
    return _unary_float_infer(k, names, t, at)


def _scale_cpu(ins, outs, at):
    np.multiply(ins[0], at["alpha"], out=outs[0])


_register("scale", "a", "c", _scale_infer, _scale_cpu, {"alpha": 1.0}, doc="""
c = alpha * a; alpha is a compile-time number (a step-varying factor belongs in a device
scalar and `mul`).  a: any shape, float -> c: same type.
""")


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


_register("bias_add", "x b", "y", _bias_add_infer, _binary(np.add), doc="""
y = x + b, b: [n] added to every row of x: [..., n] -> y: [..., n]; one float dtype.
The fused pass for `matmul(x, w) + b`.  Backward: dx = dy, db = sum(dy, axis=0) (2-D x).
""")


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
""")


# --------------------------------------------------------------------------------------------
# Reductions


def _axis(k, names, t, at) -> int | None:
    axis, nd = at["axis"], len(t[0][0])
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise _attr_error(k, f"attribute axis must be an integer or none, got {axis!r}")
    if not -nd <= axis < nd:
        raise KernelTypeError(f"{k}: axis {axis} is out of range for {names[0]} "
                              f"{_fmt(t[0][0])} ({nd}-D)", arg=0)
    return int(axis) % nd


def _reduce_infer(allowed: tuple[str, ...], what: str):
    def infer(k, names, t, at):
        dt = _dtype(k, t, 0, names, allowed, what)
        axis = _axis(k, names, t, at)
        shape = () if axis is None else t[0][0][:axis] + t[0][0][axis + 1:]
        return [(shape, dt)]
    return infer


def _sum_cpu(ins, outs, at):
    np.sum(ins[0], axis=at["axis"], out=outs[0])


def _mean_cpu(ins, outs, at):
    np.mean(ins[0], axis=at["axis"], out=outs[0])


_register("sum", "a", "c", _reduce_infer(NUMERIC, "a numeric dtype"), _sum_cpu, {"axis": None},
          doc="""
c = sum of a over `axis` (an int, negative counts from the end), or over everything when axis
is none (c is then a scalar []).  a: float or integer -> c: a's dtype, the axis removed.
The bias gradient: db = sum(dy, axis=0).
""")
_register("mean", "a", "c", _reduce_infer(FLOATS, "a float dtype"), _mean_cpu, {"axis": None},
          doc="""
c = mean of a over `axis` (int or none = everything -> scalar []).  a: float -> c: a's dtype.
""")


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
""")
_register("relu_grad", "dy x", "dx", _grad_infer, _relu_grad_cpu, doc="""
dx = dy where x > 0, else 0 (PyTorch's threshold_backward: the gradient at 0 is 0).
x may be the pre-activation or relu's output: the sign test is the same.
dy, x: one shape and float dtype -> dx: same type.
""")


def _tanh_cpu(ins, outs, at):
    np.tanh(ins[0], out=outs[0])


def _tanh_grad_cpu(ins, outs, at):
    dy, y = ins
    _write(outs[0], dy * (1 - y * y))


_register("tanh", "x", "y", _unary_float_infer, _tanh_cpu, doc="""
y = tanh(x).  x: any shape, float -> y: same type.
""")
_register("tanh_grad", "dy y", "dx", _grad_infer, _tanh_grad_cpu, doc="""
dx = dy * (1 - y^2), from tanh's forward *output* y (not x).
dy, y: one shape and float dtype -> dx: same type.
""")

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
""")
_register("gelu_grad", "dy x", "dx", _grad_infer, _gelu_grad_cpu, doc="""
dx = dy * (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)),
u = sqrt(2/pi) (x + 0.044715 x^3); from the forward *input* x.
dy, x: one shape and float dtype -> dx: same type.
""")


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
""")
_register("sigmoid_grad", "dy y", "dx", _grad_infer, _sigmoid_grad_cpu, doc="""
dx = dy * y * (1 - y), from sigmoid's forward *output* y.
dy, y: one shape and float dtype -> dx: same type.
""")


# --------------------------------------------------------------------------------------------
# Loss


def _xent_check(k, names, t, il: int, ilab: int) -> str:
    (sl, _), (sy, _) = t[il], t[ilab]
    if len(sl) != 2:
        raise KernelTypeError(f"{k}: {names[il]} must be 2-D [batch, classes], got {_fmt(sl)}",
                              arg=il)
    if sl[0] == 0 or sl[1] == 0:
        raise KernelTypeError(f"{k}: {names[il]} {_fmt(sl)} is empty", arg=il)
    dt = _floats(k, t, names, (il,))
    if len(sy) != 1 or sy[0] != sl[0]:
        raise KernelTypeError(f"{k}: {names[ilab]} must be [{sl[0]}], one class index per row of "
                              f"{names[il]} {_fmt(sl)}, got {_fmt(sy)}", arg=ilab)
    if t[ilab][1] not in INTS:
        raise KernelTypeError(f"{k}: {names[ilab]} must be an integer dtype (i32), "
                              f"got {t[ilab][1]}", arg=ilab, code="S004")
    return dt


def _loss_dtype(dt: str) -> str:
    """The loss of `dt` logits: at least f32, so f16 logits under mixed precision give an f32
    loss (and an f32 gradient seed, the loss scale)."""
    return "f32" if dt in ("f16", "bf16") else dt


def _xent_infer(k, names, t, at):
    return [((), _loss_dtype(_xent_check(k, names, t, 0, 1)))]


def _xent_grad_infer(k, names, t, at):
    dt = _xent_check(k, names, t, 1, 2)
    _scalar(k, t, names, 0)
    return [(t[1][0], dt)]


def _labels(k: str, labels: np.ndarray, c: int) -> np.ndarray:
    lab = np.asarray(labels).astype(np.int64, copy=False)
    bad = (lab < 0) | (lab >= c)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{k}: label {int(lab[i])} in row {i} is out of range for {c} classes "
                         f"(labels must be in 0..{c - 1})")
    return lab


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = _acc(logits)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _xent_cpu(ins, outs, at):
    logits, labels = ins
    lab = _labels("softmax_xent", labels, logits.shape[1])
    lp = _log_softmax(logits)
    _write(outs[0], -lp[np.arange(len(lab)), lab].mean())


def _xent_grad_cpu(ins, outs, at):
    dloss, logits, labels = ins
    lab = _labels("softmax_xent_grad", labels, logits.shape[1])
    p = np.exp(_log_softmax(logits))
    p[np.arange(len(lab)), lab] -= 1.0
    _write(outs[0], p * (float(dloss) / len(lab)))


_register("softmax_xent", "logits labels", "loss", _xent_infer, _xent_cpu, doc="""
loss = mean over the batch of -log softmax(logits)[label] = mean_i(logsumexp(logits_i) -
logits_i[labels_i]), computed after subtracting each row's max (f16 in f32); as PyTorch's
torch.nn.functional.cross_entropy with reduction="mean".
logits: [n, c] float, labels: [n] i32 or i64 -> loss: [] in logits' dtype, f32 for f16 logits.
A label outside 0..c-1 raises ValueError when the kernel runs.
""")
_register("softmax_xent_grad", "dloss logits labels", "dlogits", _xent_grad_infer, _xent_grad_cpu,
          doc="""
dlogits = dloss * (softmax(logits) - onehot(labels)) / n, the gradient of softmax_xent.
dloss: [] any float (a device scalar read at run time: 1, or the loss scale under mixed
precision), logits: [n, c] float, labels: [n] i32/i64 -> dlogits: [n, c] in logits' dtype.
""")


# --------------------------------------------------------------------------------------------
# Memory: fill, copies, allocation


def _fill_infer(k, names, t, at):
    _number(k, at, "value")
    return [_type_attrs(k, at)]


def _fill_cpu(ins, outs, at):
    _write(outs[0], at["value"])


_register("fill", "", "out", _fill_infer, _fill_cpu, {"value": 0.0, "shape": (), "dtype": "f32"},
          doc="""
out = value everywhere; no inputs, so the output's shape and dtype come from the attributes
(the caller passes the target buffer's type).  Zeroes gradient buffers (`clear grad(m)`).
""")


def _same_infer(k, names, t, at):
    return [t[0]]


def _copy_cpu(ins, outs, at):
    _write(outs[0], ins[0])


_register("copy", "a", "b", _same_infer, _copy_cpu, doc="""
b = a, device to device; any shape and dtype, b has a's type.
""")
def _flatten_infer(name, ins, types, at):
    (shape, dt), = types[:1]
    if len(shape) < 2:
        raise KernelTypeError(f"{name}: x must have a batch dimension and at least one more, got {list(shape)}", 0)
    if name == "flatten":
        n = 1
        for d in shape[1:]:
            n *= d
        return [((shape[0], n), dt)]
    dy, x = types
    if dy[0] != (x[0][0], int(np.prod(x[0][1:]))):
        raise KernelTypeError(f"{name}: dy is {list(dy[0])}, but x {list(x[0])} flattens to "
                              f"[{x[0][0]}, {int(np.prod(x[0][1:]))}]", 0)
    return [(x[0], dy[1])]


def _reshape_cpu(ins, outs, at):
    outs[0][...] = np.asarray(ins[0]).reshape(outs[0].shape)


_register("flatten", "x", "y", _flatten_infer, _reshape_cpu, doc="""
y[n, h*w*c] = x[n, h, w, c] reshaped row-major (a copy; NHWC order is kept).
""")
_register("unflatten", "dy x", "dx", lambda name, ins, types, at: _flatten_infer(name, ins, types, at),
          lambda ins, outs, at: _reshape_cpu(ins[:1], outs, at), doc="""
dx = dy reshaped to x's shape (x is read for its shape only): the gradient of `flatten`.
""")
_register("h2d", "a", "b", _same_infer, _copy_cpu, doc="""
b = a, host (pinned staging) to device; on the CUDA backend a cudaMemcpyAsync on the copy
stream, which reads the host buffer when it runs, not at launch.  Any shape and dtype.
""")
_register("d2h", "a", "b", _same_infer, _copy_cpu, doc="""
b = a, device to host (pinned); any shape and dtype.  The host reads b only after waiting on
the copy's event.
""")


def _alloc_infer(k, names, t, at):
    return [_type_attrs(k, at)]


def _alloc_cpu(ins, outs, at):
    _write(outs[0], 0)


def _synchronize_cpu(ins, outs, at):
    pass


_register("alloc", "", "out", _alloc_infer, _alloc_cpu, {"shape": (), "dtype": "f32"},
          capturable=False, doc="""
Allocates out (shape and dtype from the attributes); zero-filled on the CPU.  Not capturable:
memory is planned before capture, so an allocation inside a graph is rejected (C family).
""")


def _synchronize_infer(k, names, t, at):
    return []


_register("synchronize", "", "", _synchronize_infer, _synchronize_cpu,
          capturable=False, doc="""
Waits for the whole device (cudaDeviceSynchronize); no inputs, no outputs; a no-op on the CPU.
Not capturable: a synchronize inside a graph is rejected (C family).
""")


# --------------------------------------------------------------------------------------------
# Optimizers and device counters


def _param_state_infer(k, names, t, n: int) -> tuple[tuple[int, ...], str]:
    """Inputs 0..n-1 (parameter, gradient, state buffers) share one shape and float dtype."""
    shape = _same_shape(k, t, names, tuple(range(n)))
    return shape, _floats(k, t, names, tuple(range(n)))


def _sgd_infer(k, names, t, at):
    momentum = _number(k, at, "momentum", lo=0.0)
    _number(k, at, "weight_decay", lo=0.0)
    if _flag(k, at, "nesterov") and momentum <= 0:
        raise _attr_error(k, "nesterov=true needs momentum > 0 (as torch.optim.SGD)")
    shape, dt = _param_state_infer(k, names, t, 3)
    _scalar(k, t, names, 3)
    return [(shape, dt), (shape, dt)]


def _sgd_cpu(ins, outs, at):
    w, dw, v, lr_buf = ins
    mu, wd = at["momentum"], at["weight_decay"]
    lr = float(lr_buf)
    g = dw + wd * w if wd else dw
    v_new = mu * v + g if mu else g
    step = g + mu * v_new if at["nesterov"] else v_new
    w_new = w - lr * step
    _write(outs[1], v_new)
    _write(outs[0], w_new)


_register("sgd_step", "w dw v lr", "w v", _sgd_infer, _sgd_cpu,
          {"momentum": 0.9, "weight_decay": 0.0, "nesterov": False}, doc="""
PyTorch's SGD (torch.optim.SGD, dampening 0; https://pytorch.org/docs/stable/generated/
torch.optim.SGD.html):  g = dw + weight_decay * w;  v = momentum * v + g (v = g when momentum is
0);  w = w - lr * (g + momentum * v if nesterov else v).  v starts at zero, which equals
PyTorch's first step (buf = g).
w, dw, v: one shape and float dtype; lr: [] float device scalar, read when the kernel runs
-> (w, v), normally in place.
""")


def _adam_infer(k, names, t, at):
    _number(k, at, "beta1", lo=0.0, hi=1.0, hi_open=True)
    _number(k, at, "beta2", lo=0.0, hi=1.0, hi_open=True)
    _number(k, at, "eps", lo=0.0)
    _number(k, at, "weight_decay", lo=0.0)
    shape, dt = _param_state_infer(k, names, t, 4)
    _scalar(k, t, names, 4)
    _scalar(k, t, names, 5, NUMERIC)
    return [(shape, dt), (shape, dt), (shape, dt)]


def _adam_cpu(ins, outs, at):
    w, dw, m, v, lr_buf, t_buf = ins
    b1, b2, eps, wd = at["beta1"], at["beta2"], at["eps"], at["weight_decay"]
    lr, t = float(lr_buf), float(t_buf)
    if t < 1:
        raise ValueError(f"adam_step: step count t is {t:g}; increment it (1-based) before "
                         f"the update")
    g = dw + wd * w if wd else dw
    m_new = m + (1 - b1) * (g - m)  # PyTorch's exp_avg.lerp_(grad, 1 - beta1)
    v_new = v * b2 + (1 - b2) * g * g
    step_size = lr / (1 - b1 ** t)
    denom = np.sqrt(v_new) / math.sqrt(1 - b2 ** t) + eps
    w_new = w - step_size * (m_new / denom)
    _write(outs[1], m_new)
    _write(outs[2], v_new)
    _write(outs[0], w_new)


_register("adam_step", "w dw m v lr t", "w m v", _adam_infer, _adam_cpu,
          {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}, doc="""
PyTorch's Adam (torch.optim.Adam, amsgrad off; https://pytorch.org/docs/stable/generated/
torch.optim.Adam.html), L2 weight decay added to the gradient:  g = dw + weight_decay * w;
m = m + (1 - beta1)(g - m);  v = beta2 v + (1 - beta2) g^2;
w = w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps).
w, dw, m, v: one shape and float dtype; lr: [] float, t: [] step count (already incremented
for this step, so 1 on the first), both device scalars read when the kernel runs -> (w, m, v).
""")


def _increment_infer(k, names, t, at):
    _number(k, at, "by")
    _scalar(k, t, names, 0, NUMERIC)
    return [t[0]]


def _increment_cpu(ins, outs, at):
    np.add(ins[0], at["by"], out=outs[0], casting="unsafe")


_register("increment", "t", "t", _increment_infer, _increment_cpu, {"by": 1.0}, doc="""
t = t + by: a device scalar counter (Adam's step count), so a captured graph advances it.
t: [] float or integer -> t, in place.
""")


# --------------------------------------------------------------------------------------------
# Host work: filled by the training loop, present so the plan sees the host's writes


def _stage_infer(k, names, t, at):
    if not isinstance(at["field"], str):
        raise _attr_error(k, f"attribute field must be a name, got {at['field']!r}")
    return [_type_attrs(k, at)]


_register("stage", "", "out", _stage_infer, None, {"field": "x", "shape": (), "dtype": "f32"},
          host=True, doc="""
A host write of the next batch's `field` (a model input such as x or y) into a pinned staging
buffer of shape/dtype from the attributes.  There is no CPU kernel: the training loop fills the
buffer itself, after waiting on the event of the copy that last read that slot; the task exists
so the dependency analysis and race checker see the host's write.
""")


def _set_scalar_infer(k, names, t, at):
    if not isinstance(at["name"], str):
        raise _attr_error(k, f"attribute name must be a name, got {at['name']!r}")
    return [_type_attrs(k, {"shape": (), "dtype": at["dtype"]})]


_register("set_scalar", "", "out", _set_scalar_infer, None, {"name": "lr", "dtype": "f32"},
          host=True, doc="""
A host write of the scalar `name` (the learning rate from the schedule, ...) into a pinned
buffer of shape []; `upload` then copies it to the device.  No CPU kernel: the training loop
writes it.
""")


# --------------------------------------------------------------------------------------------
# Lookup


def kernel(name: str) -> Kernel:
    """The kernel called `name`; KeyError naming the closest known kernels otherwise."""
    try:
        return KERNELS[name]
    except KeyError:
        close = difflib.get_close_matches(name, KERNELS, n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else \
            f"; known kernels: {', '.join(KERNELS)}"
        raise KeyError(f"unknown kernel {name!r}{hint}") from None


def infer_types(name: str, in_types: Sequence[TensorType],
                attrs: dict[str, Any] | None = None) -> list[TensorType]:
    """Output types of kernel `name` on inputs `in_types`, attribute defaults filled in;
    raises KernelTypeError (S003 shapes/arity/attributes, S004 dtypes)."""
    return kernel(name).infer(in_types, attrs or {})

from dataclasses import replace as _dc_replace  # noqa: E402
import streamsched.stdlib.kernels_cnn  # noqa: E402,F401  (registers the CNN, batch-norm, dropout and AMP kernels)

# Kernels that read other elements than the one they write: none of their outputs may share
# storage with an input (Kernel.inplace; the CUDA twins of the convolutions and pools refuse
# overlap outright, cuBLAS gives wrong results when C aliases A or B).
NOT_IN_PLACE = ("matmul", "sum", "mean", "conv2d", "conv2d_grad_x", "conv2d_grad_w", "sum_nhw", "maxpool2d",
                "maxpool2d_grad", "avgpool2d", "avgpool2d_grad", "global_avgpool", "global_avgpool_grad",
                "batchnorm_train", "batchnorm_grad", "softmax_xent", "softmax_xent_grad")
for _name in NOT_IN_PLACE:
    KERNELS[_name] = _dc_replace(KERNELS[_name], inplace=False)

# Gradient recipes (Kernel.grad), kept beside the hand-written backward ops they mirror: an op
# without `NAME.backward` built on these kernels gets its backward derived.
from streamsched.stdlib.grad_recipes import attach as _attach_recipes  # noqa: E402

_attach_recipes(KERNELS)
