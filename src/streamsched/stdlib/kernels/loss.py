"""Loss: softmax cross-entropy over integer class labels (mean over the rows of the logits: the batch, or
every token of a sequence batch) and its gradient."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from streamsched.stdlib.kernel_record import KCall, KernelTypeError
from streamsched.stdlib.kernels._base import (INTS, DocRow, Family, GradArgs, _acc, _floats, _fmt, _loss_dtype,
                                              _scalar, _write)
from streamsched.stdlib.kernels._cuda import _CTYPES, _cupy_stream, _kernels, _module, _pow2_at_least, _stream

FAMILY = Family(__name__, "Loss")
_register = FAMILY.register


def _xent_check(k, names, t, il: int, ilab: int) -> str:
    (sl, _), (sy, _) = t[il], t[ilab]
    if len(sl) != 2:
        raise KernelTypeError(f"{k}: {names[il]} must be 2-D [batch, classes], got {_fmt(sl)}",
                              arg=il)
    if sl[0] == 0 or sl[1] == 0:
        raise KernelTypeError(f"{k}: {names[il]} {_fmt(sl)} is empty", arg=il)
    dt = _floats(k, t, names, (il,))
    # [n], or any shape holding n labels in row-major order: [b, t] next-token labels for the
    # [b*t, c] logits of a sequence model.
    if len(sy) < 1 or math.prod(sy) != sl[0]:
        raise KernelTypeError(f"{k}: {names[ilab]} must be [{sl[0]}] (or hold {sl[0]} labels, row-major), "
                              f"one class index per row of {names[il]} {_fmt(sl)}, got {_fmt(sy)}", arg=ilab)
    if t[ilab][1] not in INTS:
        raise KernelTypeError(f"{k}: {names[ilab]} must be an integer dtype (i32), "
                              f"got {t[ilab][1]}", arg=ilab, code="S004")
    return dt


def _xent_infer(k, names, t, at):
    return [((), _loss_dtype(_xent_check(k, names, t, 0, 1)))]


def _xent_grad_infer(k, names, t, at):
    dt = _xent_check(k, names, t, 1, 2)
    _scalar(k, t, names, 0)
    return [(t[1][0], dt)]


def _labels(k: str, labels: np.ndarray, c: int) -> np.ndarray:
    lab = np.asarray(labels).reshape(-1).astype(np.int64, copy=False)
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


def _softmax_xent_recipe(g: GradArgs):
    logits, labels = g.args
    return [KCall("softmax_xent_grad", (g.douts[0], logits, labels)) if g.need[0] else None, None]


_register("softmax_xent", "logits labels", "loss", _xent_infer, _xent_cpu, doc="""
loss = mean over the batch of -log softmax(logits)[label] = mean_i(logsumexp(logits_i) -
logits_i[labels_i]), computed after subtracting each row's max (f16 in f32); as PyTorch's
torch.nn.functional.cross_entropy with reduction="mean".
logits: [n, c] float, labels: [n] i32 or i64 (or any shape of n labels, row-major: [b, t] for
the [b*t, c] logits of a sequence) -> loss: [] in logits' dtype, f32 for f16 logits.
A label outside 0..c-1 raises ValueError when the kernel runs.
""", inplace=False, grad=_softmax_xent_recipe,
          row=DocRow("logits [n,c], labels [n] or [b,t] i32/i64 -> loss []", "comp3",
                     "mean_i(logsumexp(logits_i) - logits_i[labels_i]), max subtracted first"))

_register("softmax_xent_grad", "dloss logits labels", "dlogits", _xent_grad_infer, _xent_grad_cpu,
          doc="""
dlogits = dloss * (softmax(logits) - onehot(labels)) / n, the gradient of softmax_xent.
dloss: [] any float (a device scalar read at run time: 1, or the loss scale under mixed
precision), logits: [n, c] float, labels: [n] i32/i64 (or any shape of n labels, as softmax_xent)
-> dlogits: [n, c] in logits' dtype.
""", inplace=False,
          row=DocRow("dloss [], logits [n,c], labels [n] or [b,t] -> dlogits [n,c]", "comp3",
                     "dloss (softmax(logits) - onehot(labels)) / n"))


def _xent_fused_infer(k, names, t, at):
    dt = _xent_check(k, names, t, 0, 1)
    _scalar(k, t, names, 2)
    return [((), _loss_dtype(dt)), (t[0][0], dt)]


def _xent_fused_cpu(ins, outs, at):
    logits, labels, dloss = ins
    dloss = np.array(dloss, copy=True)  # read before the loss is written (an output may be its storage)
    loss = np.empty_like(outs[0])
    _xent_cpu([logits, labels], [loss], at)  # the loss first: dlogits may be the logits' storage
    _xent_grad_cpu([dloss, logits, labels], [outs[1]], at)
    _write(outs[0], loss)


_register("softmax_xent_fused", "logits labels dloss", "loss dlogits", _xent_fused_infer, _xent_fused_cpu,
          doc="""
softmax_xent and softmax_xent_grad in one task: loss = softmax_xent(logits, labels), dlogits =
softmax_xent_grad(dloss, logits, labels), each row's softmax computed once.  Made by the fusion
pass where the gradient task follows the loss task on one stream (`--no-fuse` keeps them apart),
never written.  dloss: [] float device scalar (1, or the loss scale), read when the kernel runs
(it must not be the loss itself).  CPU: the two NumPy twins in order (bitwise the unfused pair);
CUDA: one kernel writes each row's loss and its gradient row, one block takes the mean (where
the rows take at most 1024 lanes, one block does both).
""", inplace=False,
          row=DocRow("logits [n,c], labels [n] or [b,t], dloss [] -> loss [], dlogits [n,c]", "comp1",
                     "softmax_xent and softmax_xent_grad from one softmax per row (made by the fusion pass)"))


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.


# -- softmax cross-entropy: raw kernels, a group of g lanes per row -------------------------


_XENT_SRC = r"""
__device__ __forceinline__ float ss_exp(float x) { return expf(x); }
__device__ __forceinline__ double ss_exp(double x) { return exp(x); }
__device__ __forceinline__ float ss_log(float x) { return logf(x); }
__device__ __forceinline__ double ss_log(double x) { return log(x); }
__device__ __forceinline__ float ss_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double ss_max(double a, double b) { return fmax(a, b); }

// Max and log-sum-exp of one row, computed by an aligned group of g lanes (g a power of two,
// 1..32; lane `sub` of the group reads columns sub, sub+g, ...).  Every lane of the warp calls
// it (the shuffles use the full mask); a group past the last row passes ok = false.  The xor
// butterfly gives every lane of the group bitwise the same result.
__device__ __forceinline__ void ss_row_stats(const T_t* row, int c, int sub, int g, bool ok,
                                             A_t& mx, A_t& lse) {
    A_t m = -(A_t)SS_INF;
    if (ok) for (int j = sub; j < c; j += g) m = ss_max(m, (A_t)row[j]);
    for (int o = g >> 1; o > 0; o >>= 1) m = ss_max(m, __shfl_xor_sync(0xffffffffu, m, o));
    A_t s = 0;
    if (ok) for (int j = sub; j < c; j += g) s += ss_exp((A_t)row[j] - m);
    for (int o = g >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    mx = m;
    lse = ss_log(s);
}

// rowloss[i] = lse_i - (z_i[label_i] - max_i), in double; g lanes per row, any grid
// (n * g threads, blocks a multiple of 32 threads).
extern "C" __global__ void ss_xent_rows(const T_t* logits, const L_t* labels, double* rowloss,
                                        int n, int c, int g, int lg) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long i = t >> lg;
    int sub = (int)(t & (long long)(g - 1));
    bool ok = i < n;
    long long y = ok ? (long long)labels[i] : 0;
    const T_t* row = logits + (ok ? i : 0) * (long long)c;
    A_t mx, lse;
    ss_row_stats(row, c, sub, g, ok, mx, lse);
    if (ok && sub == 0) {
        double v;
        if (y < 0 || y >= c) v = (double)CUDART_NAN;   // NumPy raises; here the loss shows NaN
        else v = (double)(lse - ((A_t)row[y] - mx));
        rowloss[i] = v;
    }
}

// loss[0] = sum(rowloss[0..n)) / n by threads t < B of one block (B a power of two, <= 1024):
// thread t adds rows t, t + B, ... in that order, then a fixed tree over part[0..B) in shared
// memory: bitwise deterministic.  Every thread of the block calls it (its barriers).
__device__ __forceinline__ void ss_mean_rows(const double* rowloss, D_t* loss, int n, int B, double* part) {
    int t = threadIdx.x;
    if (t < B) {
        double acc = 0.0;
        int i = t;
        for (; i + 3 * B < n; i += 4 * B) {
            double a0 = rowloss[i], a1 = rowloss[i + B], a2 = rowloss[i + 2 * B], a3 = rowloss[i + 3 * B];
            acc += a0; acc += a1; acc += a2; acc += a3;
        }
        for (; i < n; i += B) acc += rowloss[i];
        part[t] = acc;
    }
    __syncthreads();
    for (int s = B >> 1; s > 0; s >>= 1) {
        if (t < s) part[t] += part[t + s];
        __syncthreads();
    }
    if (t == 0) loss[0] = (D_t)(A_t)(part[0] / n);
}

// loss = sum(rowloss) / n: one block (a power of two of threads, <= 1024), ss_mean_rows.
extern "C" __global__ void ss_xent_mean(const double* rowloss, D_t* loss, int n) {
    __shared__ double part[1024];
    ss_mean_rows(rowloss, loss, n, blockDim.x, part);
}

// Row i's loss into rowloss[i] (lane 0 of its group) and its gradient row, from the row's
// statistics (the group's lanes called ss_row_stats); the loss and the gradient of a bad label
// are NaN.  scale: dloss / n.
__device__ __forceinline__ void ss_row_loss_grad(const T_t* row, long long y, int c, int sub, int g, A_t mx,
                                                 A_t lse, A_t scale, double* rowloss, long long i,
                                                 T_t* dlogits) {
    bool bad = y < 0 || y >= c;
    if (sub == 0) rowloss[i] = bad ? (double)CUDART_NAN : (double)(lse - ((A_t)row[y] - mx));
    T_t* drow = dlogits + i * (long long)c;
    for (int j = sub; j < c; j += g) {
        A_t p = ss_exp((A_t)row[j] - mx - lse);
        if (j == y) p -= (A_t)1;
        drow[j] = (T_t)(bad ? (A_t)CUDART_NAN : p * scale);
    }
}

// The loss rows and the gradient together (softmax_xent_fused): one pass of row statistics, then
// rowloss[i] (lane 0 of the group) and dlogits row i; the mean is ss_xent_mean's.
extern "C" __global__ void ss_xent_fwdbwd(const T_t* logits, const L_t* labels, const D_t* dloss,
                                          double* rowloss, T_t* dlogits, int n, int c, int g, int lg) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long i = t >> lg;
    int sub = (int)(t & (long long)(g - 1));
    bool ok = i < n;
    long long y = ok ? (long long)labels[i] : 0;
    const T_t* row = logits + (ok ? i : 0) * (long long)c;
    A_t mx, lse;
    ss_row_stats(row, c, sub, g, ok, mx, lse);
    if (!ok) return;
    ss_row_loss_grad(row, y, c, sub, g, mx, lse, (A_t)dloss[0] / (A_t)n, rowloss, i, dlogits);
}

// The pair in one block where the rows are few (softmax_xent_fused, XENT_ONE_BLOCK): the groups
// of g lanes take rows i, i + blockDim/g, ... (ss_row_stats and ss_row_loss_grad, as
// ss_xent_fwdbwd), the row losses go to shared memory, and ss_mean_rows adds them with B
// threads, as ss_xent_mean does.  Bitwise the two kernels, in one launch: the backward that
// waits for dlogits no longer waits for a second kernel too.  n <= 1024; blockDim a multiple of
// g and of 32, >= B.
extern "C" __global__ void ss_xent_fused1(const T_t* logits, const L_t* labels, const D_t* dloss,
                                          T_t* dlogits, D_t* loss, int n, int c, int g, int lg,
                                          int B) {
    __shared__ double rl[1024];
    __shared__ double part[1024];
    int t = threadIdx.x;
    int sub = t & (g - 1);
    int per = blockDim.x >> lg;
    A_t scale = (A_t)dloss[0] / (A_t)n;
    for (int base = 0; base < n; base += per) {
        long long i = base + (t >> lg);
        bool ok = i < n;
        long long y = ok ? (long long)labels[i] : 0;
        const T_t* row = logits + (ok ? i : 0) * (long long)c;
        A_t mx, lse;
        ss_row_stats(row, c, sub, g, ok, mx, lse);
        if (ok) ss_row_loss_grad(row, y, c, sub, g, mx, lse, scale, rl, i, dlogits);
    }
    __syncthreads();
    ss_mean_rows(rl, loss, n, B, part);
}

// dlogits = dloss * (softmax(z) - onehot(label)) / n; g lanes per row, softmax recomputed.
extern "C" __global__ void ss_xent_bwd(const D_t* dloss, const T_t* logits, const L_t* labels,
                                       T_t* dlogits, int n, int c, int g, int lg) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long i = t >> lg;
    int sub = (int)(t & (long long)(g - 1));
    bool ok = i < n;
    long long y = ok ? (long long)labels[i] : 0;
    const T_t* row = logits + (ok ? i : 0) * (long long)c;
    A_t mx, lse;
    ss_row_stats(row, c, sub, g, ok, mx, lse);
    if (!ok) return;
    A_t scale = (A_t)dloss[0] / (A_t)n;
    bool bad = y < 0 || y >= c;
    T_t* drow = dlogits + i * (long long)c;
    for (int j = sub; j < c; j += g) {
        A_t p = ss_exp((A_t)row[j] - mx - lse);
        if (j == y) p -= (A_t)1;
        drow[j] = (T_t)(bad ? (A_t)CUDART_NAN : p * scale);
    }
}
"""


_LTYPES = {"int32": "int", "int64": "long long"}


def _xent_module(dtype, ltype, dltype):
    """The softmax_xent module for logits `dtype` (T_t), labels `ltype` (L_t) and loss/dloss
    `dltype` (D_t: f32 for f16 logits under mixed precision)."""
    dt, lt, dl = str(dtype), str(ltype), str(dltype)
    if dt not in _CTYPES or lt not in _LTYPES or dl not in _CTYPES:
        raise NotImplementedError(f"softmax_xent: dtypes {dtype}/{ltype}/{dltype} not supported")
    return _module(("xent", dt, lt, dl), _XENT_SRC,
                   f"typedef {_LTYPES[lt]} L_t;\ntypedef {_CTYPES[dl][0]} D_t;\n")


def _function(kind: str, dtype, ltype, name: str, dltype=None):
    """A kernel of the xent module (kind "xent"), cached by (module, dtype(s), name) in the shared
    table (`_cuda._function` is the dense module's)."""
    fns = _kernels()["_fn"]
    key = (kind, str(dtype), str(ltype), name, str(dltype))
    f = fns.get(key)
    if f is None:
        mod = _xent_module(dtype, ltype, dltype if dltype is not None else dtype)
        f = fns[key] = mod.get_function(name)
    return f


def _row_group(c: int) -> tuple[int, int]:
    """(g, log2 g): the lanes that share one row of c classes, one class per lane up to 32."""
    g = min(32, _pow2_at_least(c))
    return g, g.bit_length() - 1


# Per-row losses of softmax_xent live in scratch outside every memory pool (cudaMalloc through
# cupy.cuda.Memory, never freed, so a graph that captured a pointer can never see it reused):
# one scratch per (device, output pointer, rows).  Two softmax_xent that run at the same time
# write different loss buffers, so they never share scratch.  The executor warms every task up
# eagerly (on a scratch copy of the arenas: other pointers) before it captures it, so each
# eager call that finds no spare makes one, and a capture takes a spare instead of allocating;
# only a capture with no warm-up before it allocates (cudaMalloc, which CuPy's relaxed capture
# mode tolerates; it puts no node into the graph).
_SCRATCH: dict[tuple[int, int, int], Any] = {}

_SPARE: dict[tuple[int, int], list] = {}


def _new_rows(n: int):
    import cupy as cp

    mem = cp.cuda.Memory(n * 8)
    return cp.ndarray((n,), dtype=cp.float64, memptr=cp.cuda.MemoryPointer(mem, 0))


def _xent_rows(out, n: int, st):
    dev = out.data.device_id
    key = (dev, out.data.ptr, n)
    buf = _SCRATCH.get(key)
    spares = _SPARE.setdefault((dev, n), [])
    if buf is None:
        capturing = st is not None and st.is_capturing()
        if capturing and spares:
            buf = spares.pop()
        else:
            buf = _new_rows(n)
            if not capturing:
                spares.append(_new_rows(n))
        _SCRATCH[key] = buf
    elif not spares and not (st is not None and st.is_capturing()):
        spares.append(_new_rows(n))
    return buf


def softmax_xent_cuda(ctx, stream, ins, outs, attrs):
    """Two kernels: a grid of g-lane groups writes each row's loss (double) into scratch, then
    one block adds those rows in a fixed order and divides by n (deterministic)."""
    import numpy as np

    logits, labels = ins
    out = outs[0]
    n, c = logits.shape
    rows_fn = _function("xent", logits.dtype, labels.dtype, "ss_xent_rows", out.dtype)
    mean_fn = _function("xent", logits.dtype, labels.dtype, "ss_xent_mean", out.dtype)
    g, lg = _row_group(c)
    rows = _xent_rows(out, n, _cupy_stream(ctx, stream))
    threads = n * g
    fin = min(1024, max(32, _pow2_at_least(n)))
    with _stream(ctx, stream):
        rows_fn(((threads + 127) // 128,), (128,),
                (logits, labels, rows, np.int32(n), np.int32(c), np.int32(g), np.int32(lg)))
        mean_fn((1,), (fin,), (rows, out, np.int32(n)))


def softmax_xent_grad_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    dloss, logits, labels = ins
    n, c = logits.shape
    f = _function("xent", logits.dtype, labels.dtype, "ss_xent_bwd", dloss.dtype)
    g, lg = _row_group(c)
    threads = n * g
    with _stream(ctx, stream):
        f(((threads + 127) // 128,), (128,),
          (dloss, logits, labels, outs[0], np.int32(n), np.int32(c), np.int32(g), np.int32(lg)))


XENT_ONE_BLOCK = 1024
"""softmax_xent_fused runs as one block (ss_xent_fused1) when its rows take at most this many
lanes (n * g, g lanes per row) and n <= 1024: one pass of a 1024-thread block instead of a
second launch the backward would wait for (resnet_digits, batch 64 of 10 classes: 1024 lanes;
3.5 us in its step on the H100).  At batch 128 (2048 lanes, two passes) the one block took 5.4
us against the two kernels' 2.8 + 1.5 (H100, 2026-12-05), so larger cases keep two kernels."""


def softmax_xent_fused_cuda(ctx, stream, ins, outs, attrs):
    """One block for few rows (ss_xent_fused1, XENT_ONE_BLOCK); else two kernels for the pair:
    ss_xent_fwdbwd (each row's loss into scratch and its gradient row), then ss_xent_mean; the
    unfused twins one after the other when the loss and dloss dtypes differ.  All three are
    bitwise the same."""
    import numpy as np

    logits, labels, dloss = ins
    out, dlogits = outs
    if out.dtype != dloss.dtype:
        softmax_xent_cuda(ctx, stream, [logits, labels], [out], attrs)
        softmax_xent_grad_cuda(ctx, stream, [dloss, logits, labels], [dlogits], attrs)
        return
    n, c = logits.shape
    g, lg = _row_group(c)
    threads = n * g
    fin = min(1024, max(32, _pow2_at_least(n)))
    if n <= 1024 and threads <= XENT_ONE_BLOCK:
        f1 = _function("xent", logits.dtype, labels.dtype, "ss_xent_fused1", out.dtype)
        block = max(fin, min(1024, -(-threads // 32) * 32))
        with _stream(ctx, stream):
            f1((1,), (block,), (logits, labels, dloss, dlogits, out, np.int32(n), np.int32(c), np.int32(g),
                                np.int32(lg), np.int32(fin)))
        return
    f = _function("xent", logits.dtype, labels.dtype, "ss_xent_fwdbwd", out.dtype)
    mean_fn = _function("xent", logits.dtype, labels.dtype, "ss_xent_mean", out.dtype)
    rows = _xent_rows(out, n, _cupy_stream(ctx, stream))
    with _stream(ctx, stream):
        f(((threads + 127) // 128,), (128,),
          (logits, labels, dloss, rows, dlogits, np.int32(n), np.int32(c), np.int32(g), np.int32(lg)))
        mean_fn((1,), (fin,), (rows, out, np.int32(n)))
