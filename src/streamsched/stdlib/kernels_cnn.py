"""The CNN-step kernels (convolution, pooling, batch norm, dropout, LARS, EMA, loss scaling),
registered into the same table `streamsched.stdlib.kernels.KERNELS` with the same conventions.

Everything in kernels.py's module docstring holds here: `cpu(ins, outs, attrs)` writes only
through `out[...] = ...` after computing into temporaries (outputs may be inputs or views into one
arena); type rules raise `KernelTypeError` S003 (shapes, arity, attributes) / S004 (dtypes) with
the offending input's index; step-varying scalars are `[]` device buffers read at run time.
Image tensors are NHWC: x [n, h, w, c]; convolution weights are [kh, kw, c, k] (HWIO), so the
im2col matrix [n*oh*ow, kh*kw*c] multiplies w reshaped to [kh*kw*c, k] in one GEMM.
f16 inputs are computed in f32 (f64 stays f64) and rounded once into the output.

Attributes without a usable default (`in_h`, `in_w` of conv2d_grad_x, `kh`, `kw` of
conv2d_grad_w, `count` of batchnorm_stats_update) default to None and must be given: they are
shapes the inputs cannot recover (a strided convolution's output height fits several inputs).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from streamsched.stdlib.kernel_record import KernelTypeError
from streamsched.stdlib.kernels import (FLOATS, INTS, KERNELS, _acc, _attr_error, _dtype, _floats,
                                        _flag, _fmt, _number, _register, _same_shape, _scalar, _write)

_FIRST = len(KERNELS)

# --------------------------------------------------------------------------------------------
# Type-rule helpers


def _int(k: str, at: dict, key: str, lo: int, why: str = "") -> int:
    """An integer attribute >= lo; None (no default) is 'must be given'."""
    x = at[key]
    if x is None:
        raise _attr_error(k, f"attribute {key} must be given{f' ({why})' if why else ''}")
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)) \
            or x != int(x):
        raise _attr_error(k, f"attribute {key} must be an integer, got {x!r}")
    if x < lo:
        raise _attr_error(k, f"attribute {key} = {int(x)} is out of range (must be >= {lo})")
    return int(x)


def _rank(k: str, t, names, i: int, nd: int, layout: str) -> tuple[int, ...]:
    shape = t[i][0]
    if len(shape) != nd:
        raise KernelTypeError(f"{k}: {names[i]} must be {nd}-D {layout}, got {_fmt(shape)}", arg=i)
    return shape


def _image(k, t, names, i):
    return _rank(k, t, names, i, 4, "[n, h, w, c] (NHWC)")


def _channels_last(k, t, names, i) -> tuple[int, ...]:
    shape = t[i][0]
    if len(shape) < 2:
        raise KernelTypeError(f"{k}: {names[i]} must be [n, h, w, c] or [n, c] (channels last), "
                              f"got {_fmt(shape)}", arg=i)
    return shape


def _vector(k, t, names, i, c: int, of: str) -> None:
    if t[i][0] != (c,):
        raise KernelTypeError(f"{k}: {names[i]} must be [{c}], one value per channel of {of}, "
                              f"got {_fmt(t[i][0])}", arg=i)


def _out_size(size: int, win: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - win) // stride + 1


def _window_fits(k, t, names, i, kh, kw, pad, what) -> None:
    _, h, w, _ = t[i][0]
    if h + 2 * pad < kh or w + 2 * pad < kw:
        padded = f" padded by {pad} ({h + 2 * pad} x {w + 2 * pad})" if pad else ""
        raise KernelTypeError(f"{k}: the {kh} x {kw} {what} does not fit {names[i]} "
                              f"{_fmt(t[i][0])}{padded}", arg=i)


def _ints(at: dict, *keys: str) -> tuple[int, ...]:
    """Integer attributes as ints when the kernel runs (a .sched `2.0` is accepted as 2)."""
    return tuple(int(at[key]) for key in keys)


def _conv_attrs(k, at) -> tuple[int, int]:
    return _int(k, at, "stride", 1), _int(k, at, "pad", 0)


def _mixed(k, t, names, act: Sequence[int], par: Sequence[int]) -> tuple[str, str]:
    """Activation inputs `act` share one float dtype, parameter-like inputs `par` another (f16
    activations with f32 batch-norm parameters, as under mixed precision)."""
    return _floats(k, t, names, act), _floats(k, t, names, par)


# --------------------------------------------------------------------------------------------
# Shared NumPy pieces


def _pad(x: np.ndarray, p: int) -> np.ndarray:
    return np.pad(x, ((0, 0), (p, p), (p, p), (0, 0))) if p else x


def _windows(xp: np.ndarray, kh: int, kw: int, s: int) -> np.ndarray:
    """The [n, oh, ow, kh, kw, c] view of every window of the (padded) image xp."""
    v = sliding_window_view(xp, (kh, kw), axis=(1, 2))  # [n, H-kh+1, W-kw+1, c, kh, kw]
    return v[:, ::s, ::s].transpose(0, 1, 2, 4, 5, 3)


def _im2col(x: np.ndarray, kh: int, kw: int, s: int, p: int) -> np.ndarray:
    """[n*oh*ow, kh*kw*c], columns in (i, j, channel) order: w.reshape(kh*kw*c, k)'s rows."""
    win = _windows(_pad(_acc(x), p), kh, kw, s)
    n, oh, ow = win.shape[:3]
    return win.reshape(n * oh * ow, -1)


def _scatter_windows(dwin: np.ndarray, shape: tuple[int, ...], s: int) -> np.ndarray:
    """col2im: the sum, at every image position, of the window entries dwin [n, oh, ow, kh, kw, c]
    that cover it; shape is the (padded) image's.  One strided add per window position, so
    overlapping windows (stride < window) accumulate."""
    n, oh, ow, kh, kw, c = dwin.shape
    out = np.zeros(shape, dwin.dtype)
    for i in range(kh):
        for j in range(kw):
            out[:, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s, :] += dwin[:, :, :, i, j, :]
    return out


# --------------------------------------------------------------------------------------------
# Convolution


def _conv2d_infer(k, names, t, at):
    s, p = _conv_attrs(k, at)
    (n, h, w, c), (kh, kw, wc, ko) = _image(k, t, names, 0), \
        _rank(k, t, names, 1, 4, "[kh, kw, c, k] (HWIO)")
    dt = _floats(k, t, names, (0, 1))
    if wc != c:
        raise KernelTypeError(f"{k}: channels differ: x {_fmt(t[0][0])} has c = {c}, w "
                              f"{_fmt(t[1][0])} ([kh, kw, c, k]) expects c = {wc}", arg=1)
    _window_fits(k, t, names, 0, kh, kw, p, "kernel")
    return [((n, _out_size(h, kh, s, p), _out_size(w, kw, s, p), ko), dt)]


def _conv2d_cpu(ins, outs, at):
    x, w = ins
    kh, kw, c, ko = w.shape
    n = x.shape[0]
    y = _im2col(x, kh, kw, *_ints(at, "stride", "pad")) @ _acc(w).reshape(kh * kw * c, ko)
    _write(outs[0], y.reshape(n, -1, outs[0].shape[2], ko))


_register("conv2d", "x w", "y", _conv2d_infer, _conv2d_cpu, {"stride": 1, "pad": 0}, doc="""
y[b, i, j, o] = sum over (di, dj, ci) of xp[b, i*stride + di, j*stride + dj, ci] * w[di, dj, ci, o],
xp = x zero-padded by `pad` on each side of h and w; oh = (h + 2 pad - kh) // stride + 1 (floor:
trailing rows/columns no window reaches are ignored, as torch.nn.functional.conv2d), ow alike.
x: [n, h, w, c] (NHWC), w: [kh, kw, c, k] (HWIO), one float dtype -> y: [n, oh, ow, k].
Computed as im2col [n*oh*ow, kh*kw*c] (columns in (di, dj, ci) order) @ w.reshape(kh*kw*c, k),
one GEMM; f16 in f32.  Backward: conv2d_grad_x (dx), conv2d_grad_w (dw).
""")


def _conv2d_grad_x_infer(k, names, t, at):
    s, p = _conv_attrs(k, at)
    ih = _int(k, at, "in_h", 1, "the forward input's height")
    iw = _int(k, at, "in_w", 1, "the forward input's width")
    (n, oh, ow, ko), (kh, kw, c, wk) = _image(k, t, names, 0), \
        _rank(k, t, names, 1, 4, "[kh, kw, c, k] (HWIO)")
    dt = _floats(k, t, names, (0, 1))
    if wk != ko:
        raise KernelTypeError(f"{k}: channels differ: dy {_fmt(t[0][0])} has k = {ko}, w "
                              f"{_fmt(t[1][0])} ([kh, kw, c, k]) produces k = {wk}", arg=1)
    if ih + 2 * p < kh or iw + 2 * p < kw:
        raise _attr_error(k, f"the {kh} x {kw} kernel does not fit an input of in_h = {ih}, "
                          f"in_w = {iw} padded by {p}")
    want = (n, _out_size(ih, kh, s, p), _out_size(iw, kw, s, p), ko)
    if (oh, ow) != want[1:3]:
        raise KernelTypeError(
            f"{k}: dy is {_fmt(t[0][0])} but conv2d of an input [{n}, {ih}, {iw}, {c}] with w "
            f"{_fmt(t[1][0])}, stride {s}, pad {p} gives {_fmt(want)}", arg=0)
    return [((n, ih, iw, c), dt)]


def _conv2d_grad_x_cpu(ins, outs, at):
    dy, w = ins
    s, p, ih, iw = _ints(at, "stride", "pad", "in_h", "in_w")
    n, oh, ow, ko = dy.shape
    kh, kw, c, _ = w.shape
    dcols = _acc(dy).reshape(-1, ko) @ _acc(w).reshape(kh * kw * c, ko).T
    dxp = _scatter_windows(dcols.reshape(n, oh, ow, kh, kw, c), (n, ih + 2 * p, iw + 2 * p, c), s)
    _write(outs[0], dxp[:, p:p + ih, p:p + iw, :])


_register("conv2d_grad_x", "dy w", "dx", _conv2d_grad_x_infer, _conv2d_grad_x_cpu,
          {"stride": 1, "pad": 0, "in_h": None, "in_w": None}, doc="""
dx = the gradient of conv2d with respect to x: dcols = dy.reshape(n*oh*ow, k) @
w.reshape(kh*kw*c, k)^T, then col2im: every window's entries summed back onto the padded image,
padding cropped.  Positions no window reaches (the floor remainder) get 0.
dy: [n, oh, ow, k], w: [kh, kw, c, k], one float dtype -> dx: [n, in_h, in_w, c].
Attributes stride, pad as the forward; in_h, in_w (required: the forward input's h and w, which
oh, ow do not determine when stride > 1).
""")


def _conv2d_grad_w_infer(k, names, t, at):
    s, p = _conv_attrs(k, at)
    kh, kw = _int(k, at, "kh", 1, "the kernel height"), _int(k, at, "kw", 1, "the kernel width")
    (n, h, w, c), (dn, oh, ow, ko) = _image(k, t, names, 0), _image(k, t, names, 1)
    dt = _floats(k, t, names, (0, 1))
    if dn != n:
        raise KernelTypeError(f"{k}: batch sizes differ: x is {_fmt(t[0][0])}, dy is "
                              f"{_fmt(t[1][0])}", arg=1)
    _window_fits(k, t, names, 0, kh, kw, p, "kernel")
    want = (n, _out_size(h, kh, s, p), _out_size(w, kw, s, p), ko)
    if (oh, ow) != want[1:3]:
        raise KernelTypeError(
            f"{k}: dy is {_fmt(t[1][0])} but conv2d of x {_fmt(t[0][0])} with a {kh} x {kw} "
            f"kernel, stride {s}, pad {p} gives {_fmt(want)}", arg=1)
    return [((kh, kw, c, ko), dt)]


def _conv2d_grad_w_cpu(ins, outs, at):
    x, dy = ins
    kh, kw, s, p = _ints(at, "kh", "kw", "stride", "pad")
    ko = dy.shape[3]
    dw = _im2col(x, kh, kw, s, p).T @ _acc(dy).reshape(-1, ko)
    _write(outs[0], dw.reshape(kh, kw, x.shape[3], ko))


_register("conv2d_grad_w", "x dy", "dw", _conv2d_grad_w_infer, _conv2d_grad_w_cpu,
          {"kh": None, "kw": None, "stride": 1, "pad": 0}, doc="""
dw = the gradient of conv2d with respect to w: im2col(x)^T @ dy.reshape(n*oh*ow, k), reshaped
to [kh, kw, c, k]; one GEMM.
x: [n, h, w, c], dy: [n, oh, ow, k], one float dtype -> dw: [kh, kw, c, k].
Attributes stride, pad as the forward; kh, kw (required: the kernel's size).
""")


def _sum_nhw_infer(k, names, t, at):
    shape = _channels_last(k, t, names, 0)
    return [((shape[-1],), _floats(k, t, names, (0,)))]


def _sum_nhw_cpu(ins, outs, at):
    dy = ins[0]
    _write(outs[0], _acc(dy).sum(axis=tuple(range(dy.ndim - 1))))


_register("sum_nhw", "dy", "db", _sum_nhw_infer, _sum_nhw_cpu, doc="""
db[c] = sum of dy over every axis but the last: over N, H, W for dy [n, h, w, c], over N for
[n, c].  The bias gradient of `bias_add(x, b)` on an NHWC x.  dy: float -> db: [c], dy's dtype
(f16 summed in f32).
""")


# --------------------------------------------------------------------------------------------
# Pooling


def _pool_attrs(k, at) -> tuple[int, int]:
    return _int(k, at, "size", 1), _int(k, at, "stride", 1)


def _pool_shape(k, t, names, i, at) -> tuple[int, ...]:
    size, s = _pool_attrs(k, at)
    n, h, w, c = _image(k, t, names, i)
    _window_fits(k, t, names, i, size, size, 0, "window")
    return n, _out_size(h, size, s, 0), _out_size(w, size, s, 0), c


def _pool_infer(k, names, t, at):
    return [(_pool_shape(k, t, names, 0, at), _floats(k, t, names, (0,)))]


def _pool_grad_infer(k, names, t, at):
    _image(k, t, names, 0)
    want = _pool_shape(k, t, names, 1, at)
    dt = _floats(k, t, names, (0, 1))
    if t[0][0] != want:
        fwd = k.removesuffix("_grad")
        raise KernelTypeError(f"{k}: dy is {_fmt(t[0][0])} but {fwd} of x {_fmt(t[1][0])} "
                              f"(size {at['size']}, stride {at['stride']}) gives {_fmt(want)}",
                              arg=0)
    return [(t[1][0], dt)]


def _pool_windows(x, at) -> np.ndarray:
    """[n, oh, ow, size*size, c]: every window, entries in row-major window order."""
    size, s = _ints(at, "size", "stride")
    win = _windows(_acc(x), size, size, s)
    return win.reshape(win.shape[:3] + (size * size, win.shape[-1]))


def _maxpool2d_cpu(ins, outs, at):
    _write(outs[0], _pool_windows(ins[0], at).max(axis=3))


def _maxpool2d_grad_cpu(ins, outs, at):
    dy, x = ins
    size, s = _ints(at, "size", "stride")
    first = np.argmax(_pool_windows(x, at), axis=3)  # first maximum; a NaN counts as the maximum
    dy = _acc(dy)
    dwin = np.stack([np.where(first == q, dy, 0) for q in range(size * size)], axis=3)
    dwin = dwin.reshape(dy.shape[:3] + (size, size, dy.shape[3]))
    _write(outs[0], _scatter_windows(dwin, x.shape, s))


_MAXPOOL_RULE = """
The maximum of a window is taken in row-major window order (di, then dj): the first entry that
is strictly greater than every earlier one wins, so among equal maxima the first in that order
is the argmax; a NaN counts as greater than everything and the first NaN wins (the maximum
propagates NaN, as PyTorch's max_pool2d).  A CUDA twin: m = win[0], a = 0; for q = 1..size^2-1:
if isnan(m) break; if (win[q] > m || isnan(win[q])) { m = win[q]; a = q; }.
"""
_register("maxpool2d", "x", "y", _pool_infer, _maxpool2d_cpu, {"size": 2, "stride": 2},
          doc="""
y[b, i, j, ch] = max over di, dj < size of x[b, i*stride + di, j*stride + dj, ch]; no padding,
oh = (h - size) // stride + 1 (floor), ow alike.  x: [n, h, w, c] float -> y: [n, oh, ow, c].
""" + _MAXPOOL_RULE)
_register("maxpool2d_grad", "dy x", "dx", _pool_grad_infer, _maxpool2d_grad_cpu,
          {"size": 2, "stride": 2}, doc="""
dx = dy routed to each window's argmax in x (zero elsewhere); where windows overlap (stride <
size) an entry that is the argmax of several windows receives the sum.  Rows/columns no window
reaches get 0.  dy: [n, oh, ow, c], x: [n, h, w, c] (the forward input), one float dtype
-> dx: x's type.  size, stride as the forward.
""" + _MAXPOOL_RULE)


def _avgpool2d_cpu(ins, outs, at):
    _write(outs[0], _pool_windows(ins[0], at).mean(axis=3))


def _avgpool2d_grad_cpu(ins, outs, at):
    dy, x = ins
    size, s = _ints(at, "size", "stride")
    share = _acc(dy) / (size * size)
    dwin = np.broadcast_to(share[:, :, :, None, None, :], dy.shape[:3] + (size, size, dy.shape[3]))
    _write(outs[0], _scatter_windows(dwin, x.shape, s))


_register("avgpool2d", "x", "y", _pool_infer, _avgpool2d_cpu, {"size": 2, "stride": 2}, doc="""
y[b, i, j, ch] = mean over di, dj < size of x[b, i*stride + di, j*stride + dj, ch]; no padding,
floor output size as maxpool2d.  x: [n, h, w, c] float -> y: [n, oh, ow, c].
""")
_register("avgpool2d_grad", "dy x", "dx", _pool_grad_infer, _avgpool2d_grad_cpu,
          {"size": 2, "stride": 2}, doc="""
dx[b, r, q, ch] = sum over the windows covering (r, q) of dy[window] / size^2 (0 where no
window reaches).  dy: [n, oh, ow, c], x: [n, h, w, c] (read only for its shape), one float
dtype -> dx: x's type.  size, stride as the forward.
""")


def _gap_infer(k, names, t, at):
    n, _, _, c = _image(k, t, names, 0)
    return [((n, c), _floats(k, t, names, (0,)))]


def _gap_grad_infer(k, names, t, at):
    n, _, _, c = _image(k, t, names, 1)
    _rank(k, t, names, 0, 2, "[n, c]")
    dt = _floats(k, t, names, (0, 1))
    if t[0][0] != (n, c):
        raise KernelTypeError(f"{k}: dy must be [{n}, {c}] to match x {_fmt(t[1][0])}, got "
                              f"{_fmt(t[0][0])}", arg=0)
    return [(t[1][0], dt)]


def _gap_cpu(ins, outs, at):
    _write(outs[0], _acc(ins[0]).mean(axis=(1, 2)))


def _gap_grad_cpu(ins, outs, at):
    dy, x = ins
    _write(outs[0], (_acc(dy) / (x.shape[1] * x.shape[2]))[:, None, None, :])


_register("global_avgpool", "x", "y", _gap_infer, _gap_cpu, doc="""
y[b, ch] = mean over h, w of x[b, :, :, ch].  x: [n, h, w, c] float -> y: [n, c].
""")
_register("global_avgpool_grad", "dy x", "dx", _gap_grad_infer, _gap_grad_cpu, doc="""
dx[b, r, q, ch] = dy[b, ch] / (h w).  dy: [n, c], x: [n, h, w, c] (read only for its shape),
one float dtype -> dx: x's type.
""")


# --------------------------------------------------------------------------------------------
# Batch norm


def _bn_count(k, t, names, i) -> int:
    shape = _channels_last(k, t, names, i)
    count = math.prod(shape[:-1])
    if count < 2:
        raise KernelTypeError(f"{k}: {names[i]} {_fmt(shape)} has {count} value per channel; "
                              f"batch statistics need at least 2 (as PyTorch)", arg=i)
    return count


def _bn_train_infer(k, names, t, at):
    _number(k, at, "eps", lo=0.0)
    _bn_count(k, t, names, 0)
    c = t[0][0][-1]
    for i in (1, 2):
        _vector(k, t, names, i, c, f"x {_fmt(t[0][0])}")
    xdt, pdt = _mixed(k, t, names, (0,), (1, 2))
    return [(t[0][0], xdt), ((c,), pdt), ((c,), pdt)]


def _bn_acc(x: np.ndarray, p: np.ndarray) -> np.ndarray:
    """x in the wider of its own and the parameters' precision, at least f32."""
    return x.astype(np.promote_types(np.promote_types(x.dtype, p.dtype), np.float32), copy=False)


def _bn_axes(x: np.ndarray) -> tuple[int, ...]:
    return tuple(range(x.ndim - 1))


def _bn_train_cpu(ins, outs, at):
    x, gamma, beta = ins
    xa = _bn_acc(x, gamma)
    mean = xa.mean(axis=_bn_axes(x))
    xc = xa - mean
    invstd = 1.0 / np.sqrt((xc * xc).mean(axis=_bn_axes(x)) + at["eps"])
    y = xc * invstd * gamma + beta
    _write(outs[1], mean)
    _write(outs[2], invstd)
    _write(outs[0], y)


_register("batchnorm_train", "x gamma beta", "y mean invstd", _bn_train_infer, _bn_train_cpu,
          {"eps": 1e-5}, doc="""
Training-mode batch norm over every axis but the channel (last) one: N, H, W for x [n, h, w, c],
N for x [n, c].  With m = n*h*w values per channel:  mean = sum(x) / m;
var = sum((x - mean)^2) / m (biased, two-pass; PyTorch normalizes with the biased variance);
invstd = 1 / sqrt(var + eps);  y = (x - mean) * invstd * gamma + beta.
x: float, gamma, beta: [c] of one float dtype that may differ from x's (f16 activations with
f32 parameters) -> y: x's type, mean, invstd: [c] in gamma's dtype (kept for batchnorm_grad and
batchnorm_stats_update).  Computed in the wider of the two dtypes, at least f32.  m must be >= 2.
""")


def _bn_grad_infer(k, names, t, at):
    _same_shape(k, t, names, (0, 1))
    _bn_count(k, t, names, 1)
    c = t[1][0][-1]
    for i in (2, 3, 4):
        _vector(k, t, names, i, c, f"x {_fmt(t[1][0])}")
    xdt, pdt = _mixed(k, t, names, (0, 1), (2, 3, 4))
    return [(t[1][0], xdt), ((c,), pdt), ((c,), pdt)]


def _bn_grad_cpu(ins, outs, at):
    dy, x, gamma, mean, invstd = ins
    axes = _bn_axes(x)
    dya, xa = _bn_acc(dy, gamma), _bn_acc(x, gamma)
    xhat = (xa - mean) * invstd
    dbeta = dya.sum(axis=axes)
    dgamma = (dya * xhat).sum(axis=axes)
    m = xa.size // xa.shape[-1]
    dx = (dya - dbeta / m - xhat * (dgamma / m)) * (invstd * gamma)
    _write(outs[1], dgamma)
    _write(outs[2], dbeta)
    _write(outs[0], dx)


_register("batchnorm_grad", "dy x gamma mean invstd", "dx dgamma dbeta", _bn_grad_infer,
          _bn_grad_cpu, doc="""
The gradient of batchnorm_train (batch statistics, so dx includes the paths through mean and
var), from its forward input x and its saved mean, invstd:  xhat = (x - mean) * invstd;
dbeta = sum(dy);  dgamma = sum(dy * xhat)  (sums over every axis but the last);
dx = gamma * invstd * (dy - dbeta / m - xhat * dgamma / m),  m = values per channel
(PyTorch's batch_norm_backward).  dy, x: one shape and float dtype; gamma, mean, invstd: [c] of
one float dtype -> dx: x's type, dgamma, dbeta: [c] in gamma's dtype.
""")


def _bn_stats_infer(k, names, t, at):
    _number(k, at, "momentum", lo=0.0, hi=1.0)
    _number(k, at, "eps", lo=0.0)
    _int(k, at, "count", 2, "values per channel of the batch, n*h*w")
    shape = _same_shape(k, t, names, (0, 1, 2, 3))
    if len(shape) != 1:
        raise KernelTypeError(f"{k}: {names[0]} must be 1-D [c], got {_fmt(shape)}", arg=0)
    dt = _floats(k, t, names, (0, 1, 2, 3))
    return [(shape, dt), (shape, dt)]


def _bn_stats_cpu(ins, outs, at):
    rmean, rvar, mean, invstd = ins
    mom, (count,) = at["momentum"], _ints(at, "count")
    a = invstd.astype(np.float64)  # the recovery subtracts eps: done in double
    var = np.maximum(1.0 / (a * a) - at["eps"], 0.0)
    unbiased = var * (count / (count - 1))
    new_mean = (1 - mom) * _acc(rmean) + mom * _acc(mean)
    new_var = (1 - mom) * _acc(rvar) + mom * unbiased
    _write(outs[0], new_mean)
    _write(outs[1], new_var)


_register("batchnorm_stats_update", "running_mean running_var mean invstd",
          "running_mean running_var", _bn_stats_infer, _bn_stats_cpu,
          {"momentum": 0.1, "count": None, "eps": 1e-5}, doc="""
PyTorch's running statistics (torch.nn.BatchNorm2d, training mode): the batch variance is
recovered from invstd as var = max(1 / invstd^2 - eps, 0) in double (eps must be
batchnorm_train's; the recovery is exact up to rounding relative to var + eps), made
unbiased, var_u = var * count / (count - 1), and
running_mean = (1 - momentum) running_mean + momentum mean;
running_var = (1 - momentum) running_var + momentum var_u.
count (required) is the values per channel, n*h*w (n for [n, c] input), >= 2.
All four: [c], one float dtype -> (running_mean, running_var), normally in place.
""")


def _bn_infer_infer(k, names, t, at):
    _number(k, at, "eps", lo=0.0)
    c = _channels_last(k, t, names, 0)[-1]
    for i in (1, 2, 3, 4):
        _vector(k, t, names, i, c, f"x {_fmt(t[0][0])}")
    xdt, _ = _mixed(k, t, names, (0,), (1, 2, 3, 4))
    return [(t[0][0], xdt)]


def _bn_infer_cpu(ins, outs, at):
    x, gamma, beta, rmean, rvar = ins
    invstd = 1.0 / np.sqrt(_acc(rvar) + at["eps"])
    _write(outs[0], (_bn_acc(x, gamma) - rmean) * invstd * gamma + beta)


_register("batchnorm_infer", "x gamma beta running_mean running_var", "y", _bn_infer_infer,
          _bn_infer_cpu, {"eps": 1e-5}, doc="""
Inference-mode batch norm: y = (x - running_mean) / sqrt(running_var + eps) * gamma + beta,
per channel (the last axis).  x: [..., c] float; gamma, beta, running_mean, running_var: [c] of
one float dtype -> y: x's type.
""")


# --------------------------------------------------------------------------------------------
# Dropout with a counter-based RNG (Philox-4x32-10)

_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_LO32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
_OFFSET_DTYPES = ("i32", "i64", "f32", "f64")
_MASK_DTYPES = ("u8", "f32")


def philox4x32_10(ctr: Sequence[Any], key: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Philox-4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3",
    SC'11; Random123's philox4x32 with 10 rounds): ctr is four uint32 words (arrays or ints, the
    counter), key two uint32 ints; returns the four uint32 output words.  Checked against
    Random123's tests/kat_vectors."""
    c0, c1, c2, c3 = (np.asarray(w, np.uint64) & _LO32 for w in ctr)
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for r in range(10):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & 0xFFFFFFFF, (k1 + _PHILOX_W[1]) & 0xFFFFFFFF
        p0, p1 = _PHILOX_M[0] * c0, _PHILOX_M[1] * c2  # 32 x 32 -> 64 bits: exact in uint64
        c0, c1, c2, c3 = ((p1 >> _SHIFT32) ^ c1 ^ np.uint64(k0), p1 & _LO32,
                          (p0 >> _SHIFT32) ^ c3 ^ np.uint64(k1), p0 & _LO32)
    return tuple(w.astype(np.uint32) for w in (c0, c1, c2, c3))


def dropout_threshold(p: float) -> int:
    """The uint32 threshold t = floor(p * 2^32): element i is kept iff its word is >= t."""
    return int(math.floor(float(p) * 4294967296.0))


def site_seed(model: str, target: str) -> int:
    """The `seed` attribute of a model line that does not give one (`d = dropout(f, p = 0.1)` in
    model `net`): the first 8 bytes of sha256("net.d"), big-endian, as an integer < 2^63 (the
    Philox key of that site's mask stream).  Distinct sites get distinct keys, the same site the
    same key on every run."""
    return int.from_bytes(hashlib.sha256(f"{model}.{target}".encode()).digest()[:8], "big") >> 1


def dropout_bits(size: int, seed: int, offset: int) -> np.ndarray:
    """The uint32 random word of each of `size` elements (flat, row-major index i): word i & 3 of
    philox4x32_10(ctr = (lo32(i >> 2), hi32(i >> 2), lo32(offset), hi32(offset)),
    key = (lo32(seed), hi32(seed)))."""
    blocks = np.arange((size + 3) // 4, dtype=np.uint64)
    off = np.uint64(offset)
    words = philox4x32_10((blocks & _LO32, blocks >> _SHIFT32, off & _LO32, off >> _SHIFT32),
                          (seed & 0xFFFFFFFF, seed >> 32))
    return np.stack(words, axis=1).reshape(-1)[:size]


def _offset_value(k: str, offset: np.ndarray) -> int:
    v = offset.item()
    if not (isinstance(v, int) or (math.isfinite(v) and v == int(v))) or v < 0:
        raise ValueError(f"{k}: offset {v!r} is not a non-negative integer; the dropout offset "
                         f"counts steps (offset_advance adds 1 per step)")
    return int(v)


def _acc_dtype(x: np.ndarray) -> np.dtype:
    return np.promote_types(x.dtype, np.float32)


def _keep_scale(x: np.ndarray, p: float) -> np.ndarray:
    """1 / (1 - p) computed in double, rounded to x's compute dtype (f32 for f16/f32)."""
    return np.asarray(1.0 / (1.0 - p), _acc_dtype(x))


def _dropout_infer(k, names, t, at):
    _number(k, at, "p", lo=0.0, hi=1.0, hi_open=True)
    seed = _int(k, at, "seed", 0)
    if seed >= 1 << 64:
        raise _attr_error(k, f"attribute seed = {seed} does not fit 64 bits")
    if at["mask"] not in _MASK_DTYPES:
        raise _attr_error(k, f"attribute mask must be u8 or f32 (the mask's dtype), "
                          f"got {at['mask']!r}")
    dt = _floats(k, t, names, (0,))
    _scalar(k, t, names, 1, _OFFSET_DTYPES)
    return [(t[0][0], dt), (t[0][0], at["mask"])]


def _dropout_cpu(ins, outs, at):
    x, offset = ins
    bits = dropout_bits(x.size, *_ints(at, "seed"), _offset_value("dropout", offset))
    keep = (bits >= np.uint32(dropout_threshold(at["p"]))).reshape(x.shape)
    y = np.where(keep, _acc(x) * _keep_scale(x, at["p"]), 0)
    _write(outs[1], keep)
    _write(outs[0], y)


_register("dropout", "x offset", "y mask", _dropout_infer, _dropout_cpu,
          {"p": 0.1, "seed": 0, "mask": "u8"}, doc="""
Inverted dropout with a counter-based RNG, so the mask is a pure function of (seed, offset, i)
and reproducible bit for bit on the GPU.  For element i (flat row-major index of x):
r_i = word (i & 3) of Philox-4x32-10 (Salmon et al., SC'11) with counter
(lo32(i >> 2), hi32(i >> 2), lo32(offset), hi32(offset)) and key (lo32(seed), hi32(seed));
keep_i = r_i >= floor(p * 2^32)  (so P(keep) = 1 - p up to 2^-32);
y_i = keep_i ? x_i * s : 0,  s = 1 / (1 - p) in double rounded to the compute dtype (f32 for
f16/f32 x, f64 for f64), the product rounded to x's dtype;  mask_i = keep_i (1 or 0).
x: float, offset: [] i32/i64/f32/f64 device counter (a non-negative integer value, read when the
kernel runs; an f32 counter is exact up to 2^24) -> y: x's type, mask: x's shape in the `mask`
dtype (u8 or f32).  p in [0, 1); seed an integer < 2^64, fixed at compile time (two sites with
one seed and one offset draw the same bits: a model line that gives none gets its site's own).
Each step advances offset with offset_advance, so every replay of a captured graph draws a new
mask.  A dropped element is 0 even when x is inf or NaN.
""")


def _dropout_grad_infer(k, names, t, at):
    _number(k, at, "p", lo=0.0, hi=1.0, hi_open=True)
    shape = _same_shape(k, t, names, (0, 1))
    dt = _floats(k, t, names, (0,))
    _dtype(k, t, 1, names, _MASK_DTYPES, "the dropout mask's dtype")
    return [(shape, dt)]


def _dropout_grad_cpu(ins, outs, at):
    dy, mask = ins
    _write(outs[0], np.where(mask != 0, _acc(dy) * _keep_scale(dy, at["p"]), 0))


_register("dropout_grad", "dy mask", "dx", _dropout_grad_infer, _dropout_grad_cpu, {"p": 0.1},
          doc="""
dx = mask ? dy * s : 0,  s = 1 / (1 - p) as in dropout (p must be the forward's).
dy: float, mask: same shape, u8 or f32 (dropout's mask) -> dx: dy's type.
""")


def _offset_advance_infer(k, names, t, at):
    _int(k, at, "by", 0)
    _scalar(k, t, names, 0, _OFFSET_DTYPES)
    return [t[0]]


def _offset_advance_cpu(ins, outs, at):
    np.add(ins[0], *_ints(at, "by"), out=outs[0], casting="unsafe")


_register("offset_advance", "offset", "offset", _offset_advance_infer, _offset_advance_cpu,
          {"by": 1}, doc="""
offset = offset + by: advances dropout's device counter once per step (by = 1 is enough: the
offset fills counter words 2-3, the element index words 0-1, so consecutive offsets never share
a Philox block).  offset: [] i32/i64/f32/f64 -> offset, in place; by a non-negative integer.
""")


# --------------------------------------------------------------------------------------------
# Optimizers: LARS, EMA


def _lars_infer(k, names, t, at):
    _number(k, at, "momentum", lo=0.0)
    _number(k, at, "weight_decay", lo=0.0)
    _number(k, at, "trust", lo=0.0)
    _number(k, at, "eps", lo=0.0)
    shape = _same_shape(k, t, names, (0, 1, 2))
    dt = _floats(k, t, names, (0, 1, 2))
    _scalar(k, t, names, 3)
    return [(shape, dt), (shape, dt)]


def _lars_cpu(ins, outs, at):
    w, dw, v, lr_buf = ins
    wd = at["weight_decay"]
    wa, ga = _acc(w), _acc(dw)
    wn, gn = float(np.sqrt((wa * wa).sum())), float(np.sqrt((ga * ga).sum()))
    local = at["trust"] * wn / (gn + wd * wn + at["eps"]) if wn > 0 and gn > 0 else 1.0
    v_new = at["momentum"] * _acc(v) + (float(lr_buf) * local) * (ga + wd * wa)
    w_new = wa - v_new
    _write(outs[1], v_new)
    _write(outs[0], w_new)


_register("lars_step", "w dw v lr", "w v", _lars_infer, _lars_cpu,
          {"momentum": 0.9, "weight_decay": 0.0005, "trust": 0.001, "eps": 1e-9}, doc="""
LARS, layer-wise adaptive rate scaling (You, Gitman, Ginsburg, "Large Batch Training of
Convolutional Networks", arXiv:1708.03888, Algorithm 1), one layer (one tensor) per call:
local = trust * ||w|| / (||dw|| + weight_decay * ||w|| + eps), or 1 when ||w|| or ||dw|| is 0;
v = momentum * v + lr * local * (dw + weight_decay * w);  w = w - v.
Norms are L2 over the whole tensor (f16 in f32).  As in the paper the global lr is inside the
momentum buffer (torchlars/LARC apply lr outside it; the two agree while lr is constant).
w, dw, v: one shape and float dtype; lr: [] float device scalar read when the kernel runs
-> (w, v), normally in place.  Biases and batch-norm parameters usually take sgd_step instead.
""")


def _ema_infer(k, names, t, at):
    _number(k, at, "decay", lo=0.0, hi=1.0)
    shape = _same_shape(k, t, names, (0, 1))
    _floats(k, t, names, (1,))
    return [(shape, _floats(k, t, names, (0,)))]


def _ema_cpu(ins, outs, at):
    ema = _acc(ins[0])
    w = ins[1].astype(ema.dtype, copy=False)  # computed in the average's precision
    _write(outs[0], ema + ema.dtype.type(1.0 - at["decay"]) * (w - ema))


_register("ema_update", "ema w", "ema", _ema_infer, _ema_cpu, {"decay": 0.999}, doc="""
ema = ema + (1 - decay) (w - ema), i.e. decay * ema + (1 - decay) * w written as a lerp, as
torch.optim.swa_utils.get_ema_multi_avg_fn (torch._foreach_lerp_(ema, w, 1 - decay)).
ema, w: one shape, float dtypes (w may be narrower: the f32 average of an f16 weight) -> ema, in
place; computed in ema's dtype (at least f32).
""")


# --------------------------------------------------------------------------------------------
# Mixed precision: casts and dynamic loss scaling (torch.amp.GradScaler)


def _cast_infer(k, names, t, at):
    if at["dtype"] not in FLOATS:
        raise _attr_error(k, f"attribute dtype must be a float dtype ({', '.join(FLOATS)}), "
                          f"got {at['dtype']!r}")
    _floats(k, t, names, (0,))
    return [(t[0][0], at["dtype"])]


def _cast_cpu(ins, outs, at):
    if "bf16" in (at["dtype"], str(ins[0].dtype)):
        raise NotImplementedError("cast: bf16 cannot run on the CPU backend (NumPy has no "
                                  "bfloat16); use the CUDA backend")
    with np.errstate(over="ignore"):
        _write(outs[0], ins[0])


_register("cast", "x", "y", _cast_infer, _cast_cpu, {"dtype": "f16"}, doc="""
y = x converted to `dtype` with round-to-nearest-even (CUDA's __float2half_rn); values beyond
f16's range (|x| >= 65520) become inf, NaN stays NaN.  Any float to any float: f32 -> f16 (the
f16 weight copy), f16 -> f32 (gradients for the f32 master weights), f32 -> f32 is a copy.
bf16 type-checks but raises NotImplementedError on the CPU backend.
x: float -> y: x's shape in `dtype`.
""")


def _scale_loss_infer(k, names, t, at):
    dt = _floats(k, t, names, (0,))
    _scalar(k, t, names, 1)
    return [(t[0][0], dt)]


def _scale_loss_cpu(ins, outs, at):
    loss, scale = ins
    _write(outs[0], _bn_acc(loss, scale) * scale)


_register("scale_loss", "loss scale", "scaled", _scale_loss_infer, _scale_loss_cpu, doc="""
scaled = loss * scale, scale a [] device scalar (the dynamic loss scale, read when the kernel
runs).  loss: float, any shape (usually []) -> scaled: loss's type.  Since softmax_xent_grad takes
dloss as a device scalar, passing the scale itself as dloss starts the backward pass scaled.
""")


def _unscale_infer(k, names, t, at):
    dt = _floats(k, t, names, (0,))
    _scalar(k, t, names, 1)
    _scalar(k, t, names, 2)
    return [(t[0][0], dt), t[2]]


def _unscale_cpu(ins, outs, at):
    g, scale, found = ins
    bad = not bool(np.isfinite(g).all())
    flag = 1.0 if bad else found.item()
    inv = np.asarray(1.0 / float(scale), _acc_dtype(g))
    with np.errstate(over="ignore", invalid="ignore"):
        g_new = _acc(g) * inv
    _write(outs[0], g_new)
    _write(outs[1], flag)


_register("unscale_check", "g scale found_inf", "g found_inf", _unscale_infer, _unscale_cpu,
          doc="""
PyTorch's _amp_foreach_non_finite_check_and_unscale_ for one gradient:
g = g * inv_scale, inv_scale = 1 / scale computed in double and rounded to the compute dtype (f32
for f16/f32 g; equal to g / scale whenever scale is a power of two, as GradScaler's always is);
found_inf = 1.0 if any element of the *incoming* g is inf or NaN, else found_inf unchanged.
So zero found_inf once per step (fill) and call this on every gradient.
g: float -> g (in place); scale, found_inf: [] float device scalars -> found_inf (in place).
""")


def _update_scale_infer(k, names, t, at):
    _number(k, at, "growth", lo=1.0)
    _number(k, at, "backoff", lo=0.0, hi=1.0)
    _int(k, at, "interval", 1)
    _scalar(k, t, names, 0)
    _scalar(k, t, names, 1)
    _scalar(k, t, names, 2, INTS + ("f32", "f64"))
    return [t[0], t[2]]


def _update_scale_cpu(ins, outs, at):
    scale, found, good = ins
    s, steps = scale.item(), good.item()
    if found.item() != 0:
        s, steps = s * at["backoff"], 0
    elif steps + 1 == int(at["interval"]):
        with np.errstate(over="ignore"):
            grown = np.asarray(s * at["growth"], scale.dtype)  # rounded to the scale's dtype
        s, steps = (grown if np.isfinite(grown) else s), 0
    else:
        steps += 1
    _write(outs[0], s)
    _write(outs[1], steps)


_register("update_scale", "scale found_inf good_steps", "scale good_steps", _update_scale_infer,
          _update_scale_cpu, {"growth": 2.0, "backoff": 0.5, "interval": 2000}, doc="""
PyTorch's _amp_update_scale_ (torch.amp.GradScaler.update): if found_inf != 0:
scale = scale * backoff, good_steps = 0; else if good_steps + 1 == interval: scale = scale *
growth unless that overflows the scale's dtype (then unchanged), good_steps = 0; else
good_steps += 1.  scale, found_inf: [] float, good_steps: [] i32/i64/f32/f64 (PyTorch's growth
tracker is i32) -> (scale, good_steps), in place.
""")

def _nonfinite_infer(k, names, t, at):
    _floats(k, t, names, (0,))
    _scalar(k, t, names, 1)
    return [t[1]]


def _nonfinite_cpu(ins, outs, at):
    g, found = ins
    _write(outs[0], 1.0 if not bool(np.isfinite(g).all()) else found.item())


_register("nonfinite_check", "g found_inf", "found_inf", _nonfinite_infer, _nonfinite_cpu, doc="""
found_inf = 1.0 if any element of g is inf or NaN, else found_inf unchanged: the check half of
PyTorch's _amp_foreach_non_finite_check_and_unscale_, on a (scaled, usually f16) gradient that
is left untouched.  Zero found_inf once per step and call this on every gradient; then
amp_sgd_step skips the whole step when it is set.
g: float, any shape; found_inf: [] float device scalar -> found_inf (in place).
""")


def _amp_types(k, names, t):
    """(w, dw, master, v, lr, scale, found_inf) -> types of (w, master, v): w and dw share a shape
    and float dtype (f16), master and v that shape in their own float dtype (f32); the rest are
    float scalars."""
    shape = _same_shape(k, t, names, (0, 1, 2, 3))
    wdt = _floats(k, t, names, (0, 1))
    mdt = _floats(k, t, names, (2, 3))
    for i in (4, 5, 6):
        _scalar(k, t, names, i)
    return [(shape, wdt), (shape, mdt), (shape, mdt)]


def _amp_skipped(found, state, outs) -> bool:
    """An inf/NaN gradient somewhere (found_inf != 0): the whole step is skipped, every output
    keeps its input's value (copied first: outputs may alias inputs).  True when skipped."""
    if found.item() == 0:
        return False
    keep = [np.array(i, copy=True) for i in state]
    for o, i in zip(outs, keep):
        _write(o, i)
    return True


def _amp_sgd_infer(k, names, t, at):
    momentum = _number(k, at, "momentum", lo=0.0)
    _number(k, at, "weight_decay", lo=0.0)
    if _flag(k, at, "nesterov") and momentum <= 0:
        raise _attr_error(k, "nesterov=true needs momentum > 0 (as torch.optim.SGD)")
    return _amp_types(k, names, t)


def _amp_sgd_cpu(ins, outs, at):
    w, dw, master, v, lr_buf, scale, found = ins
    if _amp_skipped(found, (w, master, v), outs):
        return
    acc = master.dtype
    mu, wd = at["momentum"], at["weight_decay"]
    inv = np.asarray(1.0 / float(scale), acc)
    g = dw.astype(acc) * inv
    if wd:
        g = g + np.asarray(wd, acc) * master
    v_new = np.asarray(mu, acc) * v + g if mu else g
    step = g + np.asarray(mu, acc) * v_new if at["nesterov"] else v_new
    m_new = master - np.asarray(float(lr_buf), acc) * step
    _write(outs[2], v_new)
    _write(outs[1], m_new)
    _write(outs[0], m_new)  # the master-to-half cast (round to nearest even)


_register("amp_sgd_step", "w dw master v lr scale found_inf", "w master v", _amp_sgd_infer,
          _amp_sgd_cpu, {"momentum": 0.9, "weight_decay": 0.0, "nesterov": False}, doc="""
SGD with momentum on f32 master weights under dynamic loss scaling (Micikevicius et al., 2018,
"Mixed Precision Training"; torch.amp.GradScaler.step around torch.optim.SGD): if found_inf != 0
nothing changes (the step is skipped); else g = dw / scale (dw widened to the master's dtype,
times 1 / scale computed in double and rounded to that dtype), g = g + weight_decay * master,
v = momentum * v + g, master = master - lr * (g + momentum * v if nesterov else v), and
w = master rounded to w's dtype (the master-to-half cast, round to nearest even).
w, dw: one shape, one float dtype (f16: the model's copy and its scaled gradient); master, v:
same shape, one float dtype (f32); lr, scale, found_inf: [] float device scalars read when the
kernel runs -> (w, master, v), in place.
""")

def _amp_lars_infer(k, names, t, at):
    for a in ("momentum", "weight_decay", "trust", "eps"):
        _number(k, at, a, lo=0.0)
    return _amp_types(k, names, t)


def _amp_lars_cpu(ins, outs, at):
    w, dw, master, v, lr_buf, scale, found = ins
    if _amp_skipped(found, (w, master, v), outs):
        return
    acc = _acc_dtype(master)
    wd = at["weight_decay"]
    inv = np.asarray(1.0 / float(scale), acc)
    ma = master.astype(acc)
    ga = dw.astype(acc) * inv
    m64, g64 = ma.astype(np.float64), ga.astype(np.float64)
    wn, gn = float(np.sqrt((m64 * m64).sum())), float(np.sqrt((g64 * g64).sum()))
    local = at["trust"] * wn / (gn + wd * wn + at["eps"]) if wn > 0 and gn > 0 else 1.0
    coef = np.asarray(float(lr_buf) * local, acc)
    v_new = np.asarray(at["momentum"], acc) * v.astype(acc) + coef * (ga + np.asarray(wd, acc) * ma)
    m_new = ma - v_new
    _write(outs[2], v_new)
    _write(outs[1], m_new)
    _write(outs[0], m_new)  # the master-to-half cast


_register("amp_lars_step", "w dw master v lr scale found_inf", "w master v", _amp_lars_infer,
          _amp_lars_cpu, {"momentum": 0.9, "weight_decay": 0.0005, "trust": 0.001, "eps": 1e-9},
          doc="""
lars_step on f32 master weights under dynamic loss scaling: if found_inf != 0 nothing changes
(the step is skipped); else g = dw / scale (dw widened to the master's compute dtype),
local = trust * ||master|| / (||g|| + weight_decay * ||master|| + eps) (1 if a norm is 0; norms
summed in double), v = momentum * v + lr * local * (g + weight_decay * master),
master = master - v, and w = master rounded to w's dtype (the master-to-half cast).
w, dw: one shape and float dtype (f16); master, v: same shape, one float dtype (f32); lr, scale,
found_inf: [] float device scalars -> (w, master, v), in place.
""")

CNN_KERNELS: tuple[str, ...] = tuple(list(KERNELS)[_FIRST:])
"""The kernels this module registered, in registration order (the order of its docs section)."""
