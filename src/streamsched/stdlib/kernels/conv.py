"""Convolution on NHWC images with HWIO weights: `conv2d`, its two gradients and `sum_nhw` (the
bias gradient over N, H, W), as im2col GEMMs.

Image tensors are NHWC: x [n, h, w, c]; convolution weights are [kh, kw, c, k] (HWIO), so the
im2col matrix [n*oh*ow, kh*kw*c] multiplies w reshaped to [kh*kw*c, k] in one GEMM.
f16 inputs are computed in f32 (f64 stays f64) and rounded once into the output.

Attributes without a usable default (`in_h`, `in_w` of conv2d_grad_x, `kh`, `kw` of
conv2d_grad_w) default to None and must be given: they are shapes the inputs cannot recover (a
strided convolution's output height fits several inputs).
"""

from __future__ import annotations

import numpy as np

from streamsched.stdlib.kernel_record import KCall, KernelTypeError
from streamsched.stdlib.kernels._base import (DocRow, Family, GradArgs, _acc, _attr_error, _channels_last,
                                              _floats, _fmt, _image, _int, _ints, _out_size, _pad, _rank,
                                              _scatter_windows, _shape, _window_fits, _windows, _write)
from streamsched.stdlib.kernels._cuda import (_CLUSTER_PRE, _CNN_SRC, _acc_of, _cluster_tile, _cnn_fn, _colsum,
                                              _contiguous, _disjoint, _gemm, _go, _go_cluster, _grid, _i32, _stream)

FAMILY = Family(__name__, "Convolution")
_register = FAMILY.register


def _conv_attrs(k, at) -> tuple[int, int]:
    return _int(k, at, "stride", 1), _int(k, at, "pad", 0)


def _im2col(x: np.ndarray, kh: int, kw: int, s: int, p: int) -> np.ndarray:
    """[n*oh*ow, kh*kw*c], columns in (i, j, channel) order: w.reshape(kh*kw*c, k)'s rows."""
    win = _windows(_pad(_acc(x), p), kh, kw, s)
    n, oh, ow = win.shape[:3]
    return win.reshape(n * oh * ow, -1)


# --------------------------------------------------------------------------------------------
# conv2d and its gradients


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


def _conv2d_recipe(g: GradArgs):
    x, w = g.args
    (dy,) = g.douts
    (_, h, wd, _), (kh, kw, _, _) = _shape(g, x), _shape(g, w)
    s, p = ("stride", g.attrs.get("stride", 1)), ("pad", g.attrs.get("pad", 0))
    return [KCall("conv2d_grad_x", (dy, w), (s, p, ("in_h", h), ("in_w", wd))) if g.need[0] else None,
            KCall("conv2d_grad_w", (x, dy), (("kh", kh), ("kw", kw), s, p)) if g.need[1] else None]


_register("conv2d", "x w", "y", _conv2d_infer, _conv2d_cpu, {"stride": 1, "pad": 0}, doc="""
y[b, i, j, o] = sum over (di, dj, ci) of xp[b, i*stride + di, j*stride + dj, ci] * w[di, dj, ci, o],
xp = x zero-padded by `pad` on each side of h and w; oh = (h + 2 pad - kh) // stride + 1 (floor:
trailing rows/columns no window reaches are ignored, as torch.nn.functional.conv2d), ow alike.
x: [n, h, w, c] (NHWC), w: [kh, kw, c, k] (HWIO), one float dtype -> y: [n, oh, ow, k].
Computed as im2col [n*oh*ow, kh*kw*c] (columns in (di, dj, ci) order) @ w.reshape(kh*kw*c, k),
one GEMM; f16 in f32.  Backward: conv2d_grad_x (dx), conv2d_grad_w (dw).
""", inplace=False, grad=_conv2d_recipe,
          row=DocRow("x [n,h,w,c], w [kh,kw,c,k] -> y [n,oh,ow,k]", "comp1",
                     "y = im2col(pad(x)) [n·oh·ow, kh·kw·c] @ w.reshape(kh·kw·c, k); oh = (h + 2 pad - kh) // "
                     "stride + 1 (floor)"))


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
""", inplace=False,
          row=DocRow("dy [n,oh,ow,k], w -> dx [n,in_h,in_w,c]", "comp3",
                     "col2im(dy @ w^T), padding cropped; unreached positions 0", required=("in_h", "in_w")))


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
""", inplace=False,
          row=DocRow("x, dy -> dw [kh,kw,c,k]", "comp1", "im2col(pad(x))^T @ dy", required=("kh", "kw")))


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
""", inplace=False,
          row=DocRow("dy [n,h,w,c] or [n,c] -> db [c]", "comp2",
                     "sum over every axis but the last: the bias gradient of `bias_add` on NHWC"))


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.


# x [n, h, w, c] NHWC, w [kh, kw, c, k] HWIO, y [n, oh, ow, k]; products summed in double in the
# order (di, dj, ci).
_CNN_SRC["conv"] = r"""
extern "C" __global__ void ss_conv2d(const X_t* x, const X_t* w, X_t* y, int n, int h, int wd,
                                     int c, int kh, int kw, int k, int oh, int ow, int s, int p) {
    long long total = (long long)n * oh * ow * k;
    SS_LOOP(t, total) {
        int o = (int)(t % k);
        long long r = t / k;
        int j = (int)(r % ow); r /= ow;
        int i = (int)(r % oh);
        long long b = r / oh;
        double acc = 0.0;
        for (int di = 0; di < kh; ++di) {
            int hr = i * s + di - p;
            if (hr < 0 || hr >= h) continue;
            for (int dj = 0; dj < kw; ++dj) {
                int wq = j * s + dj - p;
                if (wq < 0 || wq >= wd) continue;
                const X_t* xp = x + ((b * h + hr) * wd + wq) * c;
                const X_t* wp = w + (long long)(di * kw + dj) * c * k + o;
                for (int ci = 0; ci < c; ++ci) acc += ss_wide(xp[ci]) * ss_wide(wp[(long long)ci * k]);
            }
        }
        ss_put(y + t, acc);
    }
}

// dx[b, r, q, ci] = sum over (di, dj, o), in that order, of dy[b, i, j, o] w[di, dj, ci, o] for
// the outputs (i, j) whose window puts (di, dj) on (r, q): i*s + di = r + p.  Gather, no atomics.
extern "C" __global__ void ss_conv2d_grad_x(const X_t* dy, const X_t* w, X_t* dx, int n, int h,
                                            int wd, int c, int kh, int kw, int k, int oh, int ow,
                                            int s, int p) {
    long long total = (long long)n * h * wd * c;
    SS_LOOP(t, total) {
        int ci = (int)(t % c);
        long long r = t / c;
        int q = (int)(r % wd); r /= wd;
        int hr = (int)(r % h);
        long long b = r / h;
        double acc = 0.0;
        for (int di = 0; di < kh; ++di) {
            int ti = hr + p - di;
            if (ti < 0 || ti % s != 0) continue;
            int i = ti / s;
            if (i >= oh) continue;
            for (int dj = 0; dj < kw; ++dj) {
                int tj = q + p - dj;
                if (tj < 0 || tj % s != 0) continue;
                int j = tj / s;
                if (j >= ow) continue;
                const X_t* dp = dy + ((b * oh + i) * ow + j) * k;
                const X_t* wp = w + ((long long)(di * kw + dj) * c + ci) * k;
                for (int o = 0; o < k; ++o) acc += ss_wide(dp[o]) * ss_wide(wp[o]);
            }
        }
        ss_put(dx + t, acc);
    }
}

// One block of SS_B threads per dw[di, dj, ci, o]: thread t adds the (b, i, j) positions
// e = t, t + SS_B, ... (row-major) in double, then the fixed tree.
extern "C" __global__ void ss_conv2d_grad_w(const X_t* x, const X_t* dy, X_t* dw, int n, int h,
                                            int wd, int c, int kh, int kw, int k, int oh, int ow,
                                            int s, int p) {
    __shared__ double sh[SS_B];
    long long e0 = blockIdx.x;
    int o = (int)(e0 % k);
    long long r0 = e0 / k;
    int ci = (int)(r0 % c); r0 /= c;
    int dj = (int)(r0 % kw);
    int di = (int)(r0 / kw);
    long long m = (long long)n * oh * ow;
    double acc = 0.0;
    for (long long e = threadIdx.x; e < m; e += SS_B) {
        int j = (int)(e % ow);
        long long r = e / ow;
        int i = (int)(r % oh);
        long long b = r / oh;
        int hr = i * s + di - p, wq = j * s + dj - p;
        if (hr < 0 || hr >= h || wq < 0 || wq >= wd) continue;
        acc += ss_wide(x[((b * h + hr) * wd + wq) * c + ci]) * ss_wide(dy[e * k + o]);
    }
    acc = ss_block_sum(acc, sh);
    if (threadIdx.x == 0) ss_put(dw + e0, acc);
}

// db[ch] = sum over the m rows of dy [m, c]: one block per channel.
extern "C" __global__ void ss_sum_nhw(const X_t* dy, X_t* db, long long m, int c) {
    __shared__ double sh[SS_B];
    int ch = blockIdx.x;
    double acc = 0.0;
    for (long long r = threadIdx.x; r < m; r += SS_B) acc += ss_wide(dy[r * c + ch]);
    acc = ss_block_sum(acc, sh);
    if (threadIdx.x == 0) ss_put(db + ch, acc);
}
"""


# conv2d's bias gradient for Hopper and later: one pass, the cluster sum of _cuda._CLUSTER_PRE.
_CNN_SRC["sumcl"] = _CLUSTER_PRE + r"""
extern "C" __global__ void __cluster_dims__(SS_K, 1, 1) __launch_bounds__(SS_T)
ss_sum_nhw_cl(const X_t* dy, X_t* db, long long m, int c, int w) {
    __shared__ double sh[1024];
    __shared__ double cl[32], tot[32];
    SS_CL_HEAD
    double v[1] = {0.0};
    if (on) {
        long long r = r0;
        for (; r + big - step < m; r += big) {
            double a[SS_U];
#pragma unroll
            for (int u = 0; u < SS_U; ++u) a[u] = ss_wide(dy[(r + u * step) * c + ch]);
#pragma unroll
            for (int u = 0; u < SS_U; ++u) v[0] += a[u];
        }
        for (; r < m; r += step) v[0] += ss_wide(dy[r * c + ch]);
    }
    ss_cl_total<1>(v, w, sh, cl, tot);
    ss_cl_arrive();
    if (on && q == 0 && t < w) ss_put(db + ch, v[0]);
    ss_cl_wait();
}
"""


# The gathers around the convolution GEMMs (see _conv2d): cols [n*oh*ow, kh*kw*c], rows in
# (b, i, j) order, columns in (di, dj, ci) order, as the NumPy twin's _im2col.
_CNN_SRC["col"] = r"""
// cols[(b, i, j), (di, dj, ci)] = x[b, i*s + di - p, j*s + dj - p, ci], 0 outside x, copied in
// units U of 2, 4, 8 or 16 bytes (cu units per pixel, c channels): one thread per unit,
// consecutive threads along (di, dj, unit), so the writes and the reads of a pixel are coalesced.
// I: the index type, 32-bit when everything fits (integer division is most of the cost).
template <typename U, typename I>
__device__ __forceinline__ void ss_im2col_at(const U* x, U* cols, I t, I kk, int h, int wd,
                                             int cu, int kw, int oh, int ow, int s, int p) {
    I row = t / kk;
    int col = (int)(t - row * kk);
    int e = col % cu, r = col / cu;
    int dj = r % kw, di = r / kw;
    I rr = row / (I)ow;
    int j = (int)(row - rr * (I)ow);
    I b = rr / (I)oh;
    int i = (int)(rr - b * (I)oh);
    int hr = i * s + di - p, wq = j * s + dj - p;
    if (hr >= 0 && hr < h && wq >= 0 && wq < wd)
        cols[t] = x[(((long long)b * h + hr) * wd + wq) * cu + e];
    else
        cols[t] = U();
}

#define SS_IM2COL(NAME, U)                                                                        \
extern "C" __global__ void NAME(const U* x, U* cols, int n, int h, int wd, int cu, int kh,       \
                                int kw, int oh, int ow, int s, int p) {                          \
    long long kk = (long long)kh * kw * cu;                                                       \
    long long total = (long long)n * oh * ow * kk;                                                \
    if (total <= 0x7fffffffLL) {                                                                  \
        for (unsigned t = blockIdx.x * blockDim.x + threadIdx.x; t < (unsigned)total;             \
             t += gridDim.x * blockDim.x)                                                         \
            ss_im2col_at<U, unsigned>(x, cols, t, (unsigned)kk, h, wd, cu, kw, oh, ow, s, p);     \
    } else {                                                                                      \
        SS_LOOP(t, total) ss_im2col_at<U, long long>(x, cols, t, kk, h, wd, cu, kw, oh, ow, s, p);\
    }                                                                                             \
}
SS_IM2COL(ss_im2col_2, unsigned short)
SS_IM2COL(ss_im2col_4, unsigned int)
SS_IM2COL(ss_im2col_8, uint2)
SS_IM2COL(ss_im2col_16, uint4)

// col2im as a gather: dx[b, r, q, ci] = the sum over (di, dj), in that order, in double, of
// dcols[(b, i, j), (di, dj, ci)] for the outputs (i, j) whose window puts (di, dj) on (r, q):
// i*s + di = r + p, j*s + dj = q + p.  One thread per dx entry, no atomics: the same bits every
// run.  KH, KW: the kernel size at compile time (0: the arguments), so that the common 3x3 loop
// unrolls and its loads are issued together instead of one latency after another.
template <int KH, int KW, typename I>
__device__ __forceinline__ void ss_col2im_at(const X_t* dcols, X_t* dx, I t, int h, int wd, int c,
                                             int kh_, int kw_, int oh, int ow, int s, int p) {
    const int kh = KH ? KH : kh_, kw = KW ? KW : kw_;
    I r = t / (I)c;
    int ci = (int)(t - r * (I)c);
    I r2 = r / (I)wd;
    int q = (int)(r - r2 * (I)wd);
    I b = r2 / (I)h;
    int hr = (int)(r2 - b * (I)h);
    long long kk = (long long)kh * kw * c;
    const X_t* base = dcols + (long long)b * oh * ow * kk + ci;
    double acc = 0.0;
#pragma unroll
    for (int di = 0; di < kh; ++di) {
        int ti = hr + p - di;
        int i = ti / s;
        bool vi = ti >= 0 && i * s == ti && i < oh;
#pragma unroll
        for (int dj = 0; dj < kw; ++dj) {
            int tj = q + p - dj;
            int j = tj / s;
            if (vi && tj >= 0 && j * s == tj && j < ow)
                acc += ss_wide(base[((long long)i * ow + j) * kk + (di * kw + dj) * c]);
        }
    }
    ss_put(dx + t, acc);
}

#define SS_COL2IM(NAME, KH, KW)                                                                   \
extern "C" __global__ void NAME(const X_t* dcols, X_t* dx, int n, int h, int wd, int c, int kh,  \
                                int kw, int oh, int ow, int s, int p) {                          \
    long long total = (long long)n * h * wd * c;                                                  \
    if (total <= 0x7fffffffLL) {                                                                  \
        for (unsigned t = blockIdx.x * blockDim.x + threadIdx.x; t < (unsigned)total;             \
             t += gridDim.x * blockDim.x)                                                         \
            ss_col2im_at<KH, KW, unsigned>(dcols, dx, t, h, wd, c, kh, kw, oh, ow, s, p);         \
    } else {                                                                                      \
        SS_LOOP(t, total) ss_col2im_at<KH, KW, long long>(dcols, dx, t, h, wd, c, kh, kw, oh, ow, \
                                                          s, p);                                  \
    }                                                                                             \
}
SS_COL2IM(ss_col2im, 0, 0)
SS_COL2IM(ss_col2im_3x3, 3, 3)
"""


def _conv2d_direct(ctx, stream, ins, outs, attrs):
    x, w = ins
    y = outs[0]
    n, h, wd, c, kh, kw, k, oh, ow, s, p = _conv_checked("conv2d", ins, outs, attrs, x.shape, w.shape, y.shape)
    if y.size == 0:
        return
    f = _cnn_fn("conv", "ss_conv2d", X_t=x.dtype)
    _go(ctx, stream, f, _grid(y.size), (x, w, y) + _i32(n, h, wd, c, kh, kw, k, oh, ow, s, p))


def _conv2d_grad_x_direct(ctx, stream, ins, outs, attrs):
    dy, w = ins
    dx = outs[0]
    n, h, wd, c, kh, kw, k, oh, ow, s, p = _conv_checked("conv2d_grad_x", ins, outs, attrs, dx.shape, w.shape,
                                                         dy.shape)
    if dx.size == 0:
        return
    f = _cnn_fn("conv", "ss_conv2d_grad_x", X_t=dy.dtype)
    _go(ctx, stream, f, _grid(dx.size), (dy, w, dx) + _i32(n, h, wd, c, kh, kw, k, oh, ow, s, p))


def _conv2d_grad_w_direct(ctx, stream, ins, outs, attrs):
    x, dy = ins
    dw = outs[0]
    n, h, wd, c, kh, kw, k, oh, ow, s, p = _conv_checked("conv2d_grad_w", ins, outs, attrs, x.shape, dw.shape,
                                                         dy.shape)
    if dw.size == 0:
        return
    f = _cnn_fn("conv", "ss_conv2d_grad_w", X_t=x.dtype)
    _go(ctx, stream, f, (int(dw.size),), (x, dy, dw) + _i32(n, h, wd, c, kh, kw, k, oh, ow, s, p))


# The convolutions as GEMMs on the stream's cuBLAS handle (ctx.gemm: f32, f64, and f16 operands
# with f32 compute), around two gather kernels:
#   forward  y[n*oh*ow, k]     = cols @ w[kh*kw*c, k],   cols = im2col(x) [n*oh*ow, kh*kw*c]
#   dW       dw[kh*kw*c, k]    = cols^T @ dy[n*oh*ow, k]
#   dX       dcols             = dy @ w^T,  dx = col2im(dcols) (a gather, fixed order, no atomics)
# A 1x1 kernel with stride 1 and no padding needs no gather (cols is x itself, dx is dcols).
# cols / dcols is a temporary of the call: cupy.empty on the task's stream from the current
# allocator (under the executor, the private pool of the graph being captured, pre-grown by its
# warm-up).  It returns to that pool's arena of that stream when the twin returns, so only later
# work of the same stream, ordered after this task's GEMM, can reuse it; nothing is cached across
# calls, so no two graphs or streams ever share it, and a captured graph gets no memory node.
# Other dtypes, and small problems whose direct kernel measured faster, take the direct kernels
# above (_conv_direct; both paths are deterministic, their roundings differ: products summed in
# double there, in f32 (f64 for f64) by cuBLAS here).
_CONV_GEMM_DTYPES = frozenset(("float16", "float32", "float64"))
# H200, fp32, each call replayed in a CUDA graph: the direct forward and dX kernels run one
# thread per output over a serial loop of kh*kw*c (dX: kh*kw*k) products, so they win only when
# that loop is short and the outputs few (3x3, c = 1 -> 16, batch 64 of 8x8: direct 4.7 us, GEMM
# 6.4 us; batch 256 of 28x28: direct 100 us, GEMM 28 us; c = 2: a tie, 6.8 / 7.1 us); the direct
# dW (one block per weight, n*oh*ow products each) wins up to about 2^20 products in all (3x3,
# c = 1 -> 16, batch 8 of 8x8: 3.0 / 6.2 us; batch 64: a tie, 10.1 / 9.9 us; c = 16 batch 16,
# 2.4M: 17.8 / 8.3 us).
_DIRECT_MAX_LOOP = 16
_DIRECT_MAX_OUT = 1 << 17
_DIRECT_MAX_DW = 1 << 20


def _conv_direct(kind: str, dtypes, n, h, wd, c, kh, kw, k, oh, ow) -> bool:
    """Whether conv2d[_grad_x|_grad_w] (kind "y", "dx", "dw") takes its direct kernel."""
    if any(str(d) not in _CONV_GEMM_DTYPES for d in dtypes) or len({str(d) for d in dtypes}) != 1:
        return True
    if kind == "y":
        return kh * kw * c <= _DIRECT_MAX_LOOP and n * oh * ow * k <= _DIRECT_MAX_OUT
    if kind == "dx":
        return kh * kw * k <= _DIRECT_MAX_LOOP and n * h * wd * c <= _DIRECT_MAX_OUT
    return kh * kw * c * k * n * oh * ow <= _DIRECT_MAX_DW


def _conv_shapes(x_shape, w_shape, y_shape):
    """(n, h, wd, c, kh, kw, k, oh, ow) from x [n, h, wd, c], w [kh, kw, c, k], y [n, oh, ow, k]."""
    n, h, wd, c = (int(v) for v in x_shape)
    kh, kw, k = int(w_shape[0]), int(w_shape[1]), int(w_shape[3])
    oh, ow = int(y_shape[1]), int(y_shape[2])
    return n, h, wd, c, kh, kw, k, oh, ow


def _is_pointwise(kh, kw, s, p) -> bool:
    return kh == 1 and kw == 1 and s == 1 and p == 0


def _im2col_cuda(ctx, stream, x, kh, kw, oh, ow, s, p):
    """cols [n*oh*ow, kh*kw*c] of x [n, h, wd, c], a fresh temporary (or x itself, reshaped, for
    a pointwise kernel)."""
    import cupy as cp

    n, h, wd, c = x.shape
    if _is_pointwise(kh, kw, s, p):
        return x.reshape(n * h * wd, c)
    with _stream(ctx, stream):
        cols = cp.empty((n * oh * ow, kh * kw * c), dtype=x.dtype)
    if cols.size:
        pix = c * x.itemsize  # bytes per pixel: copied in the widest unit that divides it
        u = next(u for u in (16, 8, 4, 2, 1) if pix % u == 0 and x.data.ptr % u == 0)
        if u == 1:  # not reached for float dtypes (pixels of 2, 4 or 8-byte entries)
            raise NotImplementedError(f"conv2d: dtype {x.dtype} is not supported on the device")
        f = _cnn_fn("col", f"ss_im2col_{u}", X_t=x.dtype)
        cu = pix // u
        _go(ctx, stream, f, _grid(cols.size * x.itemsize // u),
            (x, cols) + _i32(n, h, wd, cu, kh, kw, oh, ow, s, p))
    return cols


def conv2d_cuda(ctx, stream, ins, outs, attrs):
    x, w, y = ins[0], ins[1], outs[0]
    if _conv_direct("y", (x.dtype, w.dtype, y.dtype), *_conv_shapes(x.shape, w.shape, y.shape)):
        return _conv2d_direct(ctx, stream, ins, outs, attrs)
    return _conv2d_gemm(ctx, stream, ins, outs, attrs)


def _conv_checked(name: str, ins, outs, attrs, x_shape, w_shape, y_shape):
    """The checks every GEMM convolution twin makes (C-contiguous, outputs apart from inputs),
    then (n, h, w, c, kh, kw, k, oh, ow, stride, pad)."""
    _contiguous(name, tuple(ins) + tuple(outs))
    _disjoint(name, ins, outs)
    return _conv_shapes(x_shape, w_shape, y_shape) + (int(attrs.get("stride", 1)), int(attrs.get("pad", 0)))


def _conv2d_gemm(ctx, stream, ins, outs, attrs):
    x, w = ins
    y = outs[0]
    n, h, wd, c, kh, kw, k, oh, ow, s, p = _conv_checked("conv2d", ins, outs, attrs, x.shape, w.shape, y.shape)
    if y.size == 0:
        return
    cols = _im2col_cuda(ctx, stream, x, kh, kw, oh, ow, s, p)
    _gemm(ctx, stream, cols, w.reshape(kh * kw * c, k), y.reshape(n * oh * ow, k))


def conv2d_grad_x_cuda(ctx, stream, ins, outs, attrs):
    dy, w, dx = ins[0], ins[1], outs[0]
    if _conv_direct("dx", (dy.dtype, w.dtype, dx.dtype), *_conv_shapes(dx.shape, w.shape, dy.shape)):
        return _conv2d_grad_x_direct(ctx, stream, ins, outs, attrs)
    return _conv2d_grad_x_gemm(ctx, stream, ins, outs, attrs)


def _conv2d_grad_x_gemm(ctx, stream, ins, outs, attrs):
    dy, w = ins
    dx = outs[0]
    n, h, wd, c, kh, kw, k, oh, ow, s, p = _conv_checked("conv2d_grad_x", ins, outs, attrs, dx.shape, w.shape,
                                                         dy.shape)
    if dx.size == 0:
        return
    dy2, w2 = dy.reshape(n * oh * ow, k), w.reshape(kh * kw * c, k)
    if _is_pointwise(kh, kw, s, p):
        _gemm(ctx, stream, dy2, w2, dx.reshape(n * h * wd, c), tb=True)
        return
    import cupy as cp

    with _stream(ctx, stream):
        dcols = cp.empty((n * oh * ow, kh * kw * c), dtype=dy.dtype)
    _gemm(ctx, stream, dy2, w2, dcols, tb=True)
    name = "ss_col2im_3x3" if (kh, kw) == (3, 3) else "ss_col2im"
    _go(ctx, stream, _cnn_fn("col", name, X_t=dy.dtype), _grid(dx.size),
        (dcols, dx) + _i32(n, h, wd, c, kh, kw, oh, ow, s, p))


def conv2d_grad_w_cuda(ctx, stream, ins, outs, attrs):
    x, dy, dw = ins[0], ins[1], outs[0]
    if _conv_direct("dw", (x.dtype, dy.dtype, dw.dtype), *_conv_shapes(x.shape, dw.shape, dy.shape)):
        return _conv2d_grad_w_direct(ctx, stream, ins, outs, attrs)
    return _conv2d_grad_w_gemm(ctx, stream, ins, outs, attrs)


def _conv2d_grad_w_gemm(ctx, stream, ins, outs, attrs):
    x, dy = ins
    dw = outs[0]
    n, h, wd, c, kh, kw, k, oh, ow, s, p = _conv_checked("conv2d_grad_w", ins, outs, attrs, x.shape, dw.shape,
                                                         dy.shape)
    if dw.size == 0:
        return
    cols = _im2col_cuda(ctx, stream, x, kh, kw, oh, ow, s, p)
    _gemm(ctx, stream, cols, dy.reshape(n * oh * ow, k), dw.reshape(kh * kw * c, k), ta=True)


_COLSUM_CHANNELS = 128
"""From this many channels, sum_nhw below the cluster kernels' rows is ss_colsum (coalesced row
reads, 8 loads in flight) rather than one block per channel: on the H200, 1024 rows x 256
channels 2.7 against 3.4 us, 2048 x 1024 3.8 against 14.6 us; at 64 channels ss_sum_nhw is
faster (2.2 against 2.7 us)."""


def sum_nhw_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    dy, db = ins[0], outs[0]
    _contiguous("sum_nhw", (dy, db))
    _disjoint("sum_nhw", ins, outs)
    c = int(dy.shape[-1])
    if c == 0:
        return
    w = _cluster_tile(dy, "sum_nhw")
    if w is not None:
        acc = _acc_of(dy.dtype)
        f = _cnn_fn("sumcl", "ss_sum_nhw_cl", X_t=dy.dtype, A_t=acc)
        _go_cluster(ctx, stream, f, c, w, acc, (dy, db, np.int64(dy.size // c), np.int32(c), np.int32(w)))
        return
    if c >= _COLSUM_CHANNELS and _colsum(ctx, stream, dy.reshape(-1, c), db, 0, False):
        return
    f = _cnn_fn("conv", "ss_sum_nhw", X_t=dy.dtype)
    _go(ctx, stream, f, (c,), (dy, db, np.int64(dy.size // c), np.int32(c)))
