"""Batch norm over every axis but the channel (last) one: training statistics, their gradient,
the running statistics and inference, with f16 activations beside f32 parameters.  `count` of
batchnorm_stats_update defaults to None and must be given: mean and invstd do not carry the
batch size."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from streamsched.stdlib.kernel_record import KernelTypeError
from streamsched.stdlib.kernels._base import (DocRow, Family, current_group, _acc, _bn_acc, _channels_last, _floats, _fmt, _int,
                                              _ints, _number, _same_shape, _write)
from streamsched.stdlib.kernels._cuda import (_CLUSTER_PRE, _CNN_SRC, _acc_of, _cluster_tile, _cnn_fn, _contiguous,
                                              _go, _go_cluster, _grid)

FAMILY = Family(__name__, "Batch norm")
_register = FAMILY.register


def _vector(k, t, names, i, c: int, of: str) -> None:
    if t[i][0] != (c,):
        raise KernelTypeError(f"{k}: {names[i]} must be [{c}], one value per channel of {of}, "
                              f"got {_fmt(t[i][0])}", arg=i)


def _mixed(k, t, names, act: Sequence[int], par: Sequence[int]) -> tuple[str, str]:
    """Activation inputs `act` share one float dtype, parameter-like inputs `par` another (f16
    activations with f32 batch-norm parameters, as under mixed precision)."""
    return _floats(k, t, names, act), _floats(k, t, names, par)


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


def _bn_axes(x: np.ndarray) -> tuple[int, ...]:
    return tuple(range(x.ndim - 1))


def _synced(at) -> object | None:
    """The rank group a `sync = true` batch norm averages its statistics over (None: one rank)."""
    g = current_group() if at.get("sync") else None
    return g if g is not None and g.size > 1 else None


def _bn_train_cpu(ins, outs, at):
    x, gamma, beta = ins
    xa = _bn_acc(x, gamma)
    group = _synced(at)
    mean = xa.mean(axis=_bn_axes(x))
    if group is not None:  # the global batch's mean, then its variance about it: two-pass, as one rank
        mean = np.array(mean)
        group.allreduce_mean(("bn.mean", x.shape), [mean])
    xc = xa - mean
    var = (xc * xc).mean(axis=_bn_axes(x))
    if group is not None:
        var = np.array(var)
        group.allreduce_mean(("bn.var", x.shape), [var])
    invstd = 1.0 / np.sqrt(var + at["eps"])
    y = xc * invstd * gamma + beta
    _write(outs[1], mean)
    _write(outs[2], invstd)
    _write(outs[0], y)


_register("batchnorm_train", "x gamma beta", "y mean invstd", _bn_train_infer, _bn_train_cpu,
          {"eps": 1e-5, "sync": False}, doc="""
Training-mode batch norm over every axis but the channel (last) one: N, H, W for x [n, h, w, c],
N for x [n, c].  With m = n*h*w values per channel:  mean = sum(x) / m;
var = sum((x - mean)^2) / m (biased, two-pass; PyTorch normalizes with the biased variance);
invstd = 1 / sqrt(var + eps);  y = (x - mean) * invstd * gamma + beta.
x: float, gamma, beta: [c] of one float dtype that may differ from x's (f16 activations with
f32 parameters) -> y: x's type, mean, invstd: [c] in gamma's dtype (kept for batchnorm_grad and
batchnorm_stats_update).  Computed in the wider of the two dtypes, at least f32.  m must be >= 2.
sync = true (synchronized batch norm, data parallel): mean and var are those of the global batch,
each the mean over the ranks of the ranks' own (equal shards), so N ranks normalize as one rank
at N times the batch; a collective (every rank issues it in one order).  CPU only for now.
""", inplace=False,
          row=DocRow("x [..., c], gamma [c], beta [c] -> y, mean [c], invstd [c]", "comp2",
                     "batch stats over all axes but the last; biased var; invstd = 1/sqrt(var + eps); y = (x - "
                     "mean) invstd gamma + beta"))


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
    m1, m2 = dbeta / m, dgamma / m
    group = _synced(at)
    if group is not None:  # the global batch's means of dy and dy * xhat (dgamma, dbeta stay local)
        m1, m2 = np.array(m1), np.array(m2)
        group.allreduce_mean(("bn.grad", x.shape), [m1, m2])
    dx = (dya - m1 - xhat * m2) * (invstd * gamma)
    _write(outs[1], dgamma)
    _write(outs[2], dbeta)
    _write(outs[0], dx)


_register("batchnorm_grad", "dy x gamma mean invstd", "dx dgamma dbeta", _bn_grad_infer,
          _bn_grad_cpu, {"sync": False}, doc="""
The gradient of batchnorm_train (batch statistics, so dx includes the paths through mean and
var), from its forward input x and its saved mean, invstd:  xhat = (x - mean) * invstd;
dbeta = sum(dy);  dgamma = sum(dy * xhat)  (sums over every axis but the last);
dx = gamma * invstd * (dy - dbeta / m - xhat * dgamma / m),  m = values per channel
(PyTorch's batch_norm_backward).  dy, x: one shape and float dtype; gamma, mean, invstd: [c] of
one float dtype -> dx: x's type, dgamma, dbeta: [c] in gamma's dtype.  sync = true: dbeta / m and
dgamma / m in dx are the global batch's (means over the ranks); dgamma, dbeta stay this rank's
(the gradient all-reduce averages them).  CPU only for now.
""", inplace=False,
          row=DocRow("dy, x, gamma, mean, invstd -> dx, dgamma, dbeta", "comp2",
                     "xhat = (x - mean) invstd; dbeta = Σdy; dgamma = Σdy·xhat; dx = gamma invstd (dy - dbeta/m "
                     "- xhat dgamma/m)"))


# -- fused by the pass (fuse.py, "Batch norm epilogues"), never written: each is its parts in order


def _bn_train_relu_infer(k, names, t, at):
    out = _bn_train_infer(k, names[:3], t[:3], at)
    if len(t) > 3:
        if t[3] != t[0]:
            raise KernelTypeError(f"{k}: {names[3]} must be x's type {_fmt(t[0][0])} {t[0][1]}, got "
                                  f"{_fmt(t[3][0])} {t[3][1]}", arg=3)
    return out


def _bn_train_relu_cpu(ins, outs, at):
    y = np.empty_like(outs[0])
    _bn_train_cpu(list(ins[:3]), [y, outs[1], outs[2]], at)
    if len(ins) > 3:
        y = (y + ins[3]).astype(y.dtype, copy=False)
    _write(outs[0], np.maximum(y, 0))


def _bn_grad_relu_infer(k, names, t, at):
    _same_shape(k, t, names, (0, 1))
    return _bn_grad_infer(k, (names[0],) + tuple(names[2:]), [t[0]] + list(t[2:]), at)


def _bn_grad_relu_cpu(ins, outs, at):
    dy, gate = ins[:2]
    d = np.where(gate > 0, dy, 0).astype(dy.dtype, copy=False)
    _bn_grad_cpu([d] + list(ins[2:]), outs, at)


_register("batchnorm_train_relu", "x gamma beta", "y mean invstd", _bn_train_relu_infer, _bn_train_relu_cpu,
          {"eps": 1e-5}, doc="""
batchnorm_train then relu of its y in one task: y = max(batchnorm_train(x, gamma, beta).y, 0),
mean and invstd as batchnorm_train's.  Made by the fusion pass where relu is the only reader of
the batch norm's y (`--no-fuse` keeps them apart), never written.  CPU: the two NumPy twins in
order (bitwise the unfused pair); CUDA: relu in the batch-norm kernel's stores, bitwise the two
kernels.
""", inplace=False,
          row=DocRow("x [..., c], gamma [c], beta [c] -> y, mean [c], invstd [c]", "comp2",
                     "relu(batchnorm_train(x)) in one kernel (made by the fusion pass)"))

_register("batchnorm_train_add_relu", "x gamma beta r", "y mean invstd", _bn_train_relu_infer, _bn_train_relu_cpu,
          {"eps": 1e-5}, doc="""
batchnorm_train, then add of r (a residual, x's type and shape), then relu, in one task:
y = max(batchnorm_train(x, gamma, beta).y + r, 0), the sum rounded to x's dtype as add does;
mean and invstd as batchnorm_train's.  Made by the fusion pass where the add and then the relu
are the only readers of each intermediate (`--no-fuse` keeps them apart), never written.  CPU:
the three NumPy twins in order (bitwise the unfused tasks); CUDA: the add and relu in the
batch-norm kernel's stores, bitwise the three kernels.
""", inplace=False,
          row=DocRow("x [..., c], gamma [c], beta [c], r [..., c] -> y, mean [c], invstd [c]", "comp2",
                     "relu(batchnorm_train(x) + r) in one kernel (made by the fusion pass)"))

_register("batchnorm_grad_relu", "dy y x gamma mean invstd", "dx dgamma dbeta", _bn_grad_relu_infer,
          _bn_grad_relu_cpu, {}, doc="""
relu_grad then batchnorm_grad in one task: batchnorm_grad(relu_grad(dy, y), x, gamma, mean,
invstd), where y is the relu's output (or input: the sign test is the same).  Made by the fusion
pass where batchnorm_grad is the only reader of the relu gradient (`--no-fuse` keeps them
apart), never written.  CPU: the two NumPy twins in order (bitwise the unfused pair); CUDA: the
batch-norm gradient kernel reads dy through relu_grad's rule, bitwise the two kernels.
""", inplace=False,
          row=DocRow("dy, y, x, gamma, mean, invstd -> dx, dgamma, dbeta", "comp2",
                     "batchnorm_grad(relu_grad(dy, y), ...) in one kernel (made by the fusion pass)"))


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
""",
          row=DocRow("running_mean, running_var, mean, invstd -> running_mean, running_var", "update",
                     "var = max(1/invstd² - eps, 0); rm = (1-mom) rm + mom mean; rv = (1-mom) rv + mom "
                     "var·count/(count-1)", required=("count",)))


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
""",
          row=DocRow("x, gamma, beta, running_mean, running_var -> y", "comp2",
                     "y = (x - rm) / sqrt(rv + eps) gamma + beta"))


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.


_BN_EPI = r"""
// The fused epilogues (fuse.py: batchnorm_train_relu, batchnorm_train_add_relu,
// batchnorm_grad_relu).  A forward output is rounded to X_t first, then res is added in X_t's
// arithmetic (as the add kernel does), then relu (y < 0 ? 0 : y, as the relu kernel): bitwise the
// unfused kernels.  A backward dy is read as relu_grad's rule gives it: dy where gate > 0, else 0.
__device__ __forceinline__ A_t ss_rnd(const float*, A_t v) { return (A_t)(float)v; }
__device__ __forceinline__ A_t ss_rnd(const double*, A_t v) { return (A_t)(double)v; }
__device__ __forceinline__ A_t ss_addx(const float*, A_t a, A_t b) { return (A_t)((float)a + (float)b); }
__device__ __forceinline__ A_t ss_addx(const double*, A_t a, A_t b) { return (A_t)((double)a + (double)b); }
#ifdef SS_HALF
__device__ __forceinline__ A_t ss_rnd(const __half*, A_t v) { __half h; ss_put(&h, v); return SS_LD(h); }
__device__ __forceinline__ A_t ss_addx(const __half*, A_t a, A_t b) {
    __half h; ss_put(&h, (float)a + (float)b); return SS_LD(h);
}
#endif
__device__ __forceinline__ void ss_bn_put(X_t* y, const X_t* res, int relu, long long i, A_t v) {
    if (res != nullptr || relu) {
        v = ss_rnd(y, v);
        if (res != nullptr) v = ss_addx(y, v, SS_LD(res[i]));
        if (relu && v < (A_t)0) v = (A_t)0;
    }
    ss_put(y + i, v);
}
__device__ __forceinline__ A_t ss_bn_dy(const X_t* dy, const X_t* gate, long long i) {
    A_t d = SS_LD(dy[i]);
    return (gate != nullptr && !(SS_LD(gate[i]) > (A_t)0)) ? (A_t)0 : d;
}
"""


# Batch norm over x [m, c] (channels last): one block of SS_B threads per channel.  Parameters
# are read before the first barrier and the [c] outputs written by thread 0 after it; every
# element of x/dy is read and then written (y, dx) by the same thread: in place is safe.
_CNN_SRC["bn"] = _BN_EPI + r"""
extern "C" __global__ void ss_bn_train(const X_t* x, const P_t* gamma, const P_t* beta, X_t* y,
                                       P_t* mean, P_t* invstd, long long m, int c, double eps,
                                       const X_t* res, int relu) {
    __shared__ double sh[SS_B];
    int ch = blockIdx.x, t = threadIdx.x;
    A_t g = SS_LD(gamma[ch]), bt = SS_LD(beta[ch]);
    double s1 = 0.0;
    for (long long r = t; r < m; r += SS_B) s1 += ss_wide(x[r * c + ch]);
    s1 = ss_block_sum(s1, sh);
    A_t mu = (A_t)(s1 / (double)m);
    double s2 = 0.0;
    for (long long r = t; r < m; r += SS_B) {
        A_t d = SS_LD(x[r * c + ch]) - mu;
        s2 += (double)(d * d);
    }
    s2 = ss_block_sum(s2, sh);
    A_t var = (A_t)(s2 / (double)m);
    A_t inv = (A_t)1 / ss_sqrt(var + (A_t)eps);
    if (t == 0) { ss_put(mean + ch, mu); ss_put(invstd + ch, inv); }
    for (long long r = t; r < m; r += SS_B) {
        long long i = r * c + ch;
        A_t d = SS_LD(x[i]) - mu;
        ss_bn_put(y, res, relu, i, d * inv * g + bt);
    }
}

extern "C" __global__ void ss_bn_grad(const X_t* dy, const X_t* x, const P_t* gamma,
                                      const P_t* mean, const P_t* invstd, X_t* dx, P_t* dgamma,
                                      P_t* dbeta, long long m, int c, const X_t* gate) {
    __shared__ double sh[SS_B];
    int ch = blockIdx.x, t = threadIdx.x;
    A_t g = SS_LD(gamma[ch]), mu = SS_LD(mean[ch]), inv = SS_LD(invstd[ch]);
    double sb = 0.0, sg = 0.0;
    for (long long r = t; r < m; r += SS_B) {
        long long i = r * c + ch;
        A_t d = ss_bn_dy(dy, gate, i);
        A_t xh = (SS_LD(x[i]) - mu) * inv;
        sb += (double)d;
        sg += (double)(d * xh);
    }
    sb = ss_block_sum(sb, sh);
    sg = ss_block_sum(sg, sh);
    A_t db = (A_t)sb, dg = (A_t)sg;
    if (t == 0) { ss_put(dgamma + ch, dg); ss_put(dbeta + ch, db); }
    A_t am = (A_t)m;
    A_t k1 = db / am, k2 = dg / am, sc = inv * g;
    for (long long r = t; r < m; r += SS_B) {
        long long i = r * c + ch;
        A_t d = ss_bn_dy(dy, gate, i);
        A_t xh = (SS_LD(x[i]) - mu) * inv;
        ss_put(dx + i, (d - k1 - xh * k2) * sc);
    }
}
"""


# Batch norm for Hopper and later (sm_90+): the thread-block-cluster kernels of _cuda.py's
# _CLUSTER_PRE (layout, sums and their order described there), two passes over rows kept in
# registers (forward: the mean, then the variance about it; backward: dbeta and dgamma
# together), then y / dx.  Chosen by _cluster_tile (CLUSTER, CLUSTER_ROWS).
_CNN_SRC["bncl"] = _CLUSTER_PRE + _BN_EPI + r"""
extern "C" __global__ void __cluster_dims__(SS_K, 1, 1) __launch_bounds__(SS_T)
ss_bn_train_cl(const X_t* x, const P_t* gamma, const P_t* beta, X_t* y, P_t* mean, P_t* invstd,
               long long m, int c, int w, double eps, const X_t* res, int relu) {
    __shared__ double sh[1024];
    __shared__ double cl[2][32], tot[2][32];
    SS_CL_HEAD
    A_t g = on ? SS_LD(gamma[ch]) : (A_t)0, bt = on ? SS_LD(beta[ch]) : (A_t)0;  // before any output
    A_t keep[SS_U];
    double v[1] = {0.0};
#pragma unroll
    for (int u = 0; u < SS_U; ++u) {
        long long r = r0 + u * step;
        keep[u] = (on && r < m) ? SS_LD(x[r * c + ch]) : (A_t)0;
    }
#pragma unroll
    for (int u = 0; u < SS_U; ++u) v[0] += (double)keep[u];
    long long r = r0 + big;
    if (on) {
        for (; r + big - step < m; r += big) {
            A_t a[SS_U];
#pragma unroll
            for (int u = 0; u < SS_U; ++u) a[u] = SS_LD(x[(r + u * step) * c + ch]);
#pragma unroll
            for (int u = 0; u < SS_U; ++u) v[0] += (double)a[u];
        }
        for (; r < m; r += step) v[0] += ss_wide(x[r * c + ch]);
    }
    ss_cl_total<1>(v, w, sh, cl[0], tot[0]);
    A_t mu = (A_t)(v[0] / (double)m);
    v[0] = 0.0;
#pragma unroll
    for (int u = 0; u < SS_U; ++u) {
        if (on && r0 + u * step < m) {
            A_t d = keep[u] - mu;
            v[0] += (double)(d * d);
        }
    }
    r = r0 + big;
    if (on) {
        for (; r + big - step < m; r += big) {
            A_t a[SS_U];
#pragma unroll
            for (int u = 0; u < SS_U; ++u) a[u] = SS_LD(x[(r + u * step) * c + ch]) - mu;
#pragma unroll
            for (int u = 0; u < SS_U; ++u) v[0] += (double)(a[u] * a[u]);
        }
        for (; r < m; r += step) {
            A_t d = SS_LD(x[r * c + ch]) - mu;
            v[0] += (double)(d * d);
        }
    }
    ss_cl_total<1>(v, w, sh, cl[1], tot[1]);
    ss_cl_arrive();
    if (on) {
        A_t var = (A_t)(v[0] / (double)m);
        A_t inv = (A_t)1 / ss_sqrt(var + (A_t)eps);
        if (q == 0 && t < w) { ss_put(mean + ch, mu); ss_put(invstd + ch, inv); }
#pragma unroll
        for (int u = 0; u < SS_U; ++u) {
            long long rr = r0 + u * step;
            if (rr < m) ss_bn_put(y, res, relu, rr * c + ch, (keep[u] - mu) * inv * g + bt);
        }
        for (r = r0 + big; r + big - step < m; r += big) {
            A_t a[SS_U];
#pragma unroll
            for (int u = 0; u < SS_U; ++u) a[u] = SS_LD(x[(r + u * step) * c + ch]);
#pragma unroll
            for (int u = 0; u < SS_U; ++u) ss_bn_put(y, res, relu, (r + u * step) * c + ch, (a[u] - mu) * inv * g + bt);
        }
        for (; r < m; r += step) {
            long long i = r * c + ch;
            A_t d = SS_LD(x[i]) - mu;
            ss_bn_put(y, res, relu, i, d * inv * g + bt);
        }
    }
    ss_cl_wait();
}

extern "C" __global__ void __cluster_dims__(SS_K, 1, 1) __launch_bounds__(SS_T)
ss_bn_grad_cl(const X_t* dy, const X_t* x, const P_t* gamma, const P_t* mean, const P_t* invstd,
              X_t* dx, P_t* dgamma, P_t* dbeta, long long m, int c, int w, const X_t* gate) {
    __shared__ double sh[2048];
    __shared__ double cl[64], tot[64];
    SS_CL_HEAD
    A_t mu = on ? SS_LD(mean[ch]) : (A_t)0, inv = on ? SS_LD(invstd[ch]) : (A_t)0;
    A_t g = on ? SS_LD(gamma[ch]) : (A_t)0;  // every input of [c] read before any output
    A_t kd[SS_U], kx[SS_U];
    double v[2] = {0.0, 0.0};
#pragma unroll
    for (int u = 0; u < SS_U; ++u) {
        long long r = r0 + u * step;
        bool ok = on && r < m;
        kd[u] = ok ? ss_bn_dy(dy, gate, r * c + ch) : (A_t)0;
        kx[u] = ok ? (SS_LD(x[r * c + ch]) - mu) * inv : (A_t)0;
    }
#pragma unroll
    for (int u = 0; u < SS_U; ++u) {
        v[0] += (double)kd[u];
        v[1] += (double)(kd[u] * kx[u]);
    }
    long long r = r0 + big;
    if (on) {
        for (; r + big - step < m; r += big) {
            A_t d[SS_U], xh[SS_U];
#pragma unroll
            for (int u = 0; u < SS_U; ++u) {
                long long i = (r + u * step) * c + ch;
                d[u] = ss_bn_dy(dy, gate, i);
                xh[u] = SS_LD(x[i]);
            }
#pragma unroll
            for (int u = 0; u < SS_U; ++u) {
                A_t h = (xh[u] - mu) * inv;
                v[0] += (double)d[u];
                v[1] += (double)(d[u] * h);
            }
        }
        for (; r < m; r += step) {
            long long i = r * c + ch;
            A_t d = ss_bn_dy(dy, gate, i);
            A_t xh = (SS_LD(x[i]) - mu) * inv;
            v[0] += (double)d;
            v[1] += (double)(d * xh);
        }
    }
    ss_cl_total<2>(v, w, sh, cl, tot);
    ss_cl_arrive();
    if (on) {
        A_t db = (A_t)v[0], dg = (A_t)v[1];
        if (q == 0 && t < w) { ss_put(dgamma + ch, dg); ss_put(dbeta + ch, db); }
        A_t am = (A_t)m;
        A_t k1 = db / am, k2 = dg / am, sc = inv * g;
#pragma unroll
        for (int u = 0; u < SS_U; ++u) {
            long long rr = r0 + u * step;
            if (rr < m) ss_put(dx + rr * c + ch, (kd[u] - k1 - kx[u] * k2) * sc);
        }
        for (r = r0 + big; r + big - step < m; r += big) {
            A_t d[SS_U], xh[SS_U];
#pragma unroll
            for (int u = 0; u < SS_U; ++u) {
                long long i = (r + u * step) * c + ch;
                d[u] = ss_bn_dy(dy, gate, i);
                xh[u] = SS_LD(x[i]);
            }
#pragma unroll
            for (int u = 0; u < SS_U; ++u) {
                A_t h = (xh[u] - mu) * inv;
                ss_put(dx + (r + u * step) * c + ch, (d[u] - k1 - h * k2) * sc);
            }
        }
        for (; r < m; r += step) {
            long long i = r * c + ch;
            A_t d = ss_bn_dy(dy, gate, i);
            A_t xh = (SS_LD(x[i]) - mu) * inv;
            ss_put(dx + i, (d - k1 - xh * k2) * sc);
        }
    }
    ss_cl_wait();
}

"""


# Running statistics, one thread per channel, rounded like the NumPy twin: the mean update in
# A_t, the variance recovered from invstd in double, (1 - momentum) * running_var in A_t plus
# momentum * unbiased var in double.
_CNN_SRC["bnstat"] = r"""
extern "C" __global__ void ss_bn_stats(const P_t* rm, const P_t* rv, const P_t* mean,
                                       const P_t* invstd, P_t* rm_out, P_t* rv_out, int c,
                                       double om, double mom, double eps, double ratio) {
    SS_LOOP(i, (long long)c) {
        double a = ss_wide(invstd[i]);
        double var = 1.0 / (a * a) - eps;
        if (var < 0.0) var = 0.0;
        double unb = var * ratio;
        A_t aom = (A_t)om, amom = (A_t)mom;
        A_t nm = aom * SS_LD(rm[i]) + amom * SS_LD(mean[i]);
        double nv = (double)(aom * SS_LD(rv[i])) + mom * unb;
        ss_put(rm_out + i, nm);
        ss_put(rv_out + i, nv);
    }
}
"""


# B_t: the parameters' compute dtype (invstd is computed in it, as the NumPy twin does).
_CNN_SRC["bninf"] = r"""
extern "C" __global__ void ss_bn_infer(const X_t* x, const P_t* gamma, const P_t* beta,
                                       const P_t* rm, const P_t* rv, X_t* y, long long total,
                                       int c, double eps) {
    SS_LOOP(i, total) {
        int ch = (int)(i % c);
        B_t inv = (B_t)1 / ss_sqrt((B_t)ss_wide(rv[ch]) + (B_t)eps);
        A_t v = (SS_LD(x[i]) - SS_LD(rm[ch])) * (A_t)inv * SS_LD(gamma[ch]) + SS_LD(beta[ch]);
        ss_put(y + i, v);
    }
}
"""


def _no_sync_on_gpu(k, attrs):
    from streamsched.stdlib.kernels._base import dp_rank

    if attrs.get("sync") and dp_rank()[1] > 1:
        raise NotImplementedError(f"{k}: batchnorm(..., sync = true) across GPUs is not written yet (the CPU "
                                  "backend simulates it); use sync = false")


def batchnorm_train_cuda(ctx, stream, ins, outs, attrs):
    _bn_train(ctx, stream, ins, outs, attrs)


def _bn_train(ctx, stream, ins, outs, attrs, res=None, relu: bool = False) -> None:
    """batchnorm_train on the device; with `res` and/or `relu` (the fused batchnorm_train_relu and
    batchnorm_train_add_relu), y = relu(y + res) in the same kernel's stores (_BN_EPI)."""
    import numpy as np

    _no_sync_on_gpu("batchnorm_train", attrs)

    x, gamma, beta = ins
    y, mean, invstd = outs
    _contiguous("batchnorm_train", list(ins) + list(outs) + ([res] if res is not None else []))
    c = int(x.shape[-1])
    acc = _acc_of(x.dtype, gamma.dtype)
    epi = (res if res is not None else np.uint64(0), np.int32(1 if relu else 0))
    head = (x, gamma, beta, y, mean, invstd, np.int64(x.size // c), np.int32(c))
    eps = np.float64(attrs.get("eps", 1e-5))
    w = _cluster_tile(x)
    if w is not None:
        f = _cnn_fn("bncl", "ss_bn_train_cl", X_t=x.dtype, P_t=gamma.dtype, A_t=acc)
        _go_cluster(ctx, stream, f, c, w, acc, head + (np.int32(w), eps) + epi)
        return
    f = _cnn_fn("bn", "ss_bn_train", X_t=x.dtype, P_t=gamma.dtype, A_t=acc)
    _go(ctx, stream, f, (c,), head + (eps,) + epi)


def batchnorm_grad_cuda(ctx, stream, ins, outs, attrs):
    _bn_grad(ctx, stream, ins, outs, attrs)


def _bn_grad(ctx, stream, ins, outs, attrs, gate=None) -> None:
    """batchnorm_grad on the device; with `gate` (the fused batchnorm_grad_relu), of dy where
    gate > 0, else 0 (relu_grad's rule) as the kernel reads dy (_BN_EPI)."""
    import numpy as np

    _no_sync_on_gpu("batchnorm_grad", attrs)

    dy, x, gamma, mean, invstd = ins
    dx, dgamma, dbeta = outs
    _contiguous("batchnorm_grad", list(ins) + list(outs) + ([gate] if gate is not None else []))
    c = int(x.shape[-1])
    acc = _acc_of(x.dtype, gamma.dtype)
    head = (dy, x, gamma, mean, invstd, dx, dgamma, dbeta, np.int64(x.size // c), np.int32(c))
    g = (gate if gate is not None else np.uint64(0),)
    w = _cluster_tile(x)
    if w is not None:
        f = _cnn_fn("bncl", "ss_bn_grad_cl", X_t=x.dtype, P_t=gamma.dtype, A_t=acc)
        _go_cluster(ctx, stream, f, c, w, acc, head + (np.int32(w),) + g)
        return
    f = _cnn_fn("bn", "ss_bn_grad", X_t=x.dtype, P_t=gamma.dtype, A_t=acc)
    _go(ctx, stream, f, (c,), head + g)


def batchnorm_train_relu_cuda(ctx, stream, ins, outs, attrs):
    _bn_train(ctx, stream, ins, outs, attrs, relu=True)


def batchnorm_train_add_relu_cuda(ctx, stream, ins, outs, attrs):
    _bn_train(ctx, stream, ins[:3], outs, attrs, res=ins[3], relu=True)


def batchnorm_grad_relu_cuda(ctx, stream, ins, outs, attrs):
    dy, gate = ins[:2]
    _bn_grad(ctx, stream, [dy] + list(ins[2:]), outs, attrs, gate=gate)


def batchnorm_stats_update_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    rm, rv, mean, invstd = ins
    rm_out, rv_out = outs
    _contiguous("batchnorm_stats_update", list(ins) + list(outs))
    c = int(rm.size)
    mom = float(attrs.get("momentum", 0.1))
    count = attrs.get("count")
    if count is None:
        raise ValueError("batchnorm_stats_update: attribute count must be given")
    count = int(count)
    f = _cnn_fn("bnstat", "ss_bn_stats", P_t=rm.dtype, A_t=_acc_of(rm.dtype))
    _go(ctx, stream, f, _grid(c), (rm, rv, mean, invstd, rm_out, rv_out, np.int32(c),
                                   np.float64(1 - mom), np.float64(mom),
                                   np.float64(attrs.get("eps", 1e-5)),
                                   np.float64(count / (count - 1))))


def batchnorm_infer_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    x, gamma, beta, rm, rv = ins
    y = outs[0]
    _contiguous("batchnorm_infer", list(ins) + [y])
    c = int(x.shape[-1])
    if y.size == 0:
        return
    f = _cnn_fn("bninf", "ss_bn_infer", X_t=x.dtype, P_t=gamma.dtype,
                A_t=_acc_of(x.dtype, gamma.dtype), B_t=_acc_of(gamma.dtype))
    _go(ctx, stream, f, _grid(y.size), (x, gamma, beta, rm, rv, y, np.int64(y.size), np.int32(c),
                                        np.float64(attrs.get("eps", 1e-5))))
