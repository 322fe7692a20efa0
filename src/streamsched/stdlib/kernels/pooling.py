"""Pooling on NHWC images: max and average windows (no padding, floor output size) and the
global average, each with its gradient."""

from __future__ import annotations

from typing import Callable

import numpy as np

from streamsched.stdlib.kernel_record import KCall, KernelTypeError
from streamsched.stdlib.kernels._base import (DocRow, Family, GradArgs, _acc, _floats, _fmt, _from_input, _image,
                                              _int, _ints, _out_size, _rank, _scatter_windows, _window_fits,
                                              _windows, _write)
from streamsched.stdlib.kernels._cuda import _CNN_SRC, _acc_of, _cnn_fn, _contiguous, _disjoint, _go, _grid, _i32

FAMILY = Family(__name__, "Pooling")
_register = FAMILY.register


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


def _pool_recipe(grad_kernel: str) -> Callable:
    def recipe(g: GradArgs):
        attrs = tuple((k, g.attrs[k]) for k in ("size", "stride") if k in g.attrs)
        return [KCall(grad_kernel, (g.douts[0], g.args[0]), attrs)]
    return recipe


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
""" + _MAXPOOL_RULE, inplace=False, grad=_pool_recipe("maxpool2d_grad"),
          row=DocRow("x [n,h,w,c] -> y [n,oh,ow,c]", "comp2",
                     "window max, no padding, oh = (h - size) // stride + 1; NaN propagates"))

_register("maxpool2d_grad", "dy x", "dx", _pool_grad_infer, _maxpool2d_grad_cpu,
          {"size": 2, "stride": 2}, doc="""
dx = dy routed to each window's argmax in x (zero elsewhere); where windows overlap (stride <
size) an entry that is the argmax of several windows receives the sum.  Rows/columns no window
reaches get 0.  dy: [n, oh, ow, c], x: [n, h, w, c] (the forward input), one float dtype
-> dx: x's type.  size, stride as the forward.
""" + _MAXPOOL_RULE, inplace=False,
          row=DocRow("dy, x -> dx", "comp2",
                     "dy to each window's **first** maximum in row-major window order (a NaN counts as the "
                     "maximum); overlapping windows sum"))


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
""", inplace=False, grad=_pool_recipe("avgpool2d_grad"),
          row=DocRow("x -> y", "comp2", "window mean, no padding"))

_register("avgpool2d_grad", "dy x", "dx", _pool_grad_infer, _avgpool2d_grad_cpu,
          {"size": 2, "stride": 2}, doc="""
dx[b, r, q, ch] = sum over the windows covering (r, q) of dy[window] / size^2 (0 where no
window reaches).  dy: [n, oh, ow, c], x: [n, h, w, c] (read only for its shape), one float
dtype -> dx: x's type.  size, stride as the forward.
""", inplace=False,
          row=DocRow("dy, x -> dx", "comp2", "dy / size² onto every window entry (x only for its shape)"))


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
""", inplace=False, grad=_from_input("global_avgpool_grad"),
          row=DocRow("x [n,h,w,c] -> y [n,c]", "comp2", "mean over h, w"))

_register("global_avgpool_grad", "dy x", "dx", _gap_grad_infer, _gap_grad_cpu, doc="""
dx[b, r, q, ch] = dy[b, ch] / (h w).  dy: [n, c], x: [n, h, w, c] (read only for its shape),
one float dtype -> dx: x's type.
""", inplace=False,
          row=DocRow("dy [n,c], x -> dx", "comp2", "dy / (h w) everywhere (x only for its shape)"))


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.


# Pools: x [n, h, w, c], y / dy [n, oh, ow, c], no padding.  The maximum follows the NumPy twin's
# rule: the first strictly greater entry in row-major window order wins, the first NaN wins.
_CNN_SRC["pool"] = r"""
__device__ __forceinline__ int ss_argmax(const X_t* base, int wd, int c, int size, A_t* out) {
    A_t m = SS_LD(base[0]);
    int a = 0;
    for (int q = 1; q < size * size; ++q) {
        if (ss_isnan(m)) break;
        int di = q / size, dj = q % size;
        A_t v = SS_LD(base[((long long)di * wd + dj) * c]);
        if (v > m || ss_isnan(v)) { m = v; a = q; }
    }
    *out = m;
    return a;
}

extern "C" __global__ void ss_maxpool2d(const X_t* x, X_t* y, int n, int h, int wd, int c,
                                        int oh, int ow, int size, int s) {
    long long total = (long long)n * oh * ow * c;
    SS_LOOP(t, total) {
        int ch = (int)(t % c);
        long long r = t / c;
        int j = (int)(r % ow); r /= ow;
        int i = (int)(r % oh);
        long long b = r / oh;
        A_t m;
        ss_argmax(x + ((b * h + (long long)i * s) * wd + (long long)j * s) * c + ch, wd, c, size, &m);
        ss_put(y + t, m);
    }
}

extern "C" __global__ void ss_avgpool2d(const X_t* x, X_t* y, int n, int h, int wd, int c,
                                        int oh, int ow, int size, int s) {
    long long total = (long long)n * oh * ow * c;
    SS_LOOP(t, total) {
        int ch = (int)(t % c);
        long long r = t / c;
        int j = (int)(r % ow); r /= ow;
        int i = (int)(r % oh);
        long long b = r / oh;
        const X_t* base = x + ((b * h + (long long)i * s) * wd + (long long)j * s) * c + ch;
        A_t acc = (A_t)0;
        for (int di = 0; di < size; ++di)
            for (int dj = 0; dj < size; ++dj) acc += SS_LD(base[((long long)di * wd + dj) * c]);
        ss_put(y + t, acc / (A_t)(size * size));
    }
}

// dx[b, r, q, ch]: the windows (i, j) covering (r, q), visited in the NumPy twin's order of window
// offsets (di, then dj), adding dy (max: only where (di, dj) is the window's argmax) or
// dy / size^2 (avg) to an accumulator starting at 0.  kind 0: max, 1: avg.
extern "C" __global__ void ss_pool2d_grad(const X_t* dy, const X_t* x, X_t* dx, int n, int h,
                                          int wd, int c, int oh, int ow, int size, int s,
                                          int kind) {
    long long total = (long long)n * h * wd * c;
    A_t area = (A_t)(size * size);
    SS_LOOP(t, total) {
        int ch = (int)(t % c);
        long long r = t / c;
        int q = (int)(r % wd); r /= wd;
        int hr = (int)(r % h);
        long long b = r / h;
        A_t acc = (A_t)0;
        for (int di = 0; di < size; ++di) {
            int ti = hr - di;
            if (ti < 0 || ti % s != 0) continue;
            int i = ti / s;
            if (i >= oh) continue;
            for (int dj = 0; dj < size; ++dj) {
                int tj = q - dj;
                if (tj < 0 || tj % s != 0) continue;
                int j = tj / s;
                if (j >= ow) continue;
                A_t g = SS_LD(dy[((b * oh + i) * ow + j) * c + ch]);
                if (kind == 0) {
                    A_t m;
                    int a = ss_argmax(x + ((b * h + (long long)i * s) * wd + (long long)j * s) * c + ch,
                                      wd, c, size, &m);
                    if (a == di * size + dj) acc += g;
                } else {
                    acc += g / area;
                }
            }
        }
        ss_put(dx + t, acc);
    }
}

// y[b, ch] = mean over hw = h*w positions of x [n, hw, c], summed in double.
extern "C" __global__ void ss_global_avgpool(const X_t* x, X_t* y, int n, long long hw, int c) {
    long long total = (long long)n * c;
    SS_LOOP(t, total) {
        int ch = (int)(t % c);
        long long b = t / c;
        const X_t* base = x + b * hw * c + ch;
        double acc = 0.0;
        for (long long e = 0; e < hw; ++e) acc += ss_wide(base[e * c]);
        ss_put(y + t, acc / (double)hw);
    }
}

extern "C" __global__ void ss_global_avgpool_grad(const X_t* dy, X_t* dx, int n, long long hw,
                                                  int c) {
    long long total = (long long)n * hw * c;
    A_t area = (A_t)hw;
    SS_LOOP(t, total) {
        int ch = (int)(t % c);
        long long b = t / (hw * c);
        ss_put(dx + t, SS_LD(dy[b * c + ch]) / area);
    }
}
"""


def _pool_dims(attrs):
    return int(attrs.get("size", 2)), int(attrs.get("stride", 2))


def _pool_cuda(kind: str) -> Callable:
    def fn(ctx, stream, ins, outs, attrs):
        x, y = ins[0], outs[0]
        _contiguous(kind, (x, y))
        _disjoint(kind, ins, outs)
        n, h, wd, c = x.shape
        _, oh, ow, _ = y.shape
        size, s = _pool_dims(attrs)
        if y.size == 0:
            return
        f = _cnn_fn("pool", "ss_" + kind, X_t=x.dtype, A_t=_acc_of(x.dtype))
        _go(ctx, stream, f, _grid(y.size), (x, y) + _i32(n, h, wd, c, oh, ow, size, s))
    fn.__name__ = kind
    return fn


def _pool_grad_cuda(kind: str) -> Callable:
    def fn(ctx, stream, ins, outs, attrs):
        dy, x = ins
        dx = outs[0]
        _contiguous(kind, (dy, x, dx))
        _disjoint(kind, ins, outs)
        n, h, wd, c = x.shape
        _, oh, ow, _ = dy.shape
        size, s = _pool_dims(attrs)
        if dx.size == 0:
            return
        f = _cnn_fn("pool", "ss_pool2d_grad", X_t=dy.dtype, A_t=_acc_of(dy.dtype))
        _go(ctx, stream, f, _grid(dx.size),
            (dy, x, dx) + _i32(n, h, wd, c, oh, ow, size, s, 0 if kind.startswith("max") else 1))
    fn.__name__ = kind
    return fn


def global_avgpool_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    x, y = ins[0], outs[0]
    _contiguous("global_avgpool", (x, y))
    _disjoint("global_avgpool", ins, outs)
    n, h, wd, c = x.shape
    if y.size == 0:
        return
    f = _cnn_fn("pool", "ss_global_avgpool", X_t=x.dtype, A_t=_acc_of(x.dtype))
    _go(ctx, stream, f, _grid(y.size), (x, y, np.int32(n), np.int64(h * wd), np.int32(c)))


def global_avgpool_grad_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    dy, x = ins
    dx = outs[0]
    _contiguous("global_avgpool_grad", (dy, dx))
    _disjoint("global_avgpool_grad", (dy,), outs)
    n, h, wd, c = x.shape
    if dx.size == 0:
        return
    f = _cnn_fn("pool", "ss_global_avgpool_grad", X_t=dy.dtype, A_t=_acc_of(dy.dtype))
    _go(ctx, stream, f, _grid(dx.size), (dy, dx, np.int32(n), np.int64(h * wd), np.int32(c)))


maxpool2d_cuda = _pool_cuda("maxpool2d")
maxpool2d_grad_cuda = _pool_grad_cuda("maxpool2d_grad")
avgpool2d_cuda = _pool_cuda("avgpool2d")
avgpool2d_grad_cuda = _pool_grad_cuda("avgpool2d_grad")
