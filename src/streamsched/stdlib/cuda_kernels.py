"""The CUDA twin of every kernel in `streamsched.stdlib.kernels.KERNELS`, same name, same
semantics, written so that it can be captured into a CUDA graph.

Calling convention: `fn(ctx, stream, ins, outs, attrs)`: ctx a
`streamsched.interp.cuda.device.DeviceContext`, stream a stream name (or CuPy stream), ins/outs
CuPy arrays (NumPy pinned arrays for host buffers of h2d/d2h), attrs with defaults filled in.
Outputs are preallocated; an output may be the very array of an input (in-place updates).

Capture rules kept here (CUDA_PITFALLS.md): GEMMs go through the context's per-stream cuBLAS
handle (rule 1), copies through cudaMemcpyAsync (rule 8), nothing allocates from a memory pool
(custom Elementwise/Reduction/Raw kernels with outputs given; no CUB; the one scratch, the
per-row losses of softmax_xent, is made before capture outside every pool: see `_xent_rows`;
the convolutions' im2col / col2im temporaries are the exception: they come from the current
pool, under the executor the captured graph's own: see `_conv2d_gemm`),
and step-varying scalars (lr, t, dloss) are read from device memory inside the kernels, never
turned into Python floats (rule 3).  Every reduction has a fixed order (no atomics): results are
bitwise the same from run to run.  Compile-time attributes (alpha, momentum, ...) are kernel arguments and are frozen
into a captured graph, as they should be.

CuPy is imported on first use; the kernel objects are built once and cached.
"""

from __future__ import annotations

import math
from typing import Any, Callable

_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715

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

    E, R = cp.ElementwiseKernel, cp.ReductionKernel
    k = _K
    k["add"] = E("T a, T b", "T c", "c = a + b", "ss_add")
    k["sub"] = E("T a, T b", "T c", "c = a - b", "ss_sub")
    k["mul"] = E("T a, T b", "T c", "c = a * b", "ss_mul")
    k["bias_add"] = E("T x, T b", "T y", "y = x + b", "ss_bias_add")
    k["scale"] = E("T a, float64 alpha", "T c", "c = a * (T)alpha", "ss_scale")
    k["copy"] = E("T a", "T b", "b = a", "ss_copy")
    k["fill"] = E("float64 v", "T y", "y = (T)v", "ss_fill")
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
    # In place: w, v are read and written (output params); lr is a 0-d device array broadcast
    # to every element, read when the kernel runs.
    k["sgd_step"] = E(
        "T g, L lr, float64 mu, float64 wd, bool nesterov", "T w, T v",
        """T gg = wd != 0.0 ? g + (T)wd * w : g;
        T vn = mu != 0.0 ? (T)mu * v + gg : gg;
        T st = nesterov ? gg + (T)mu * vn : vn;
        v = vn;
        w = w - (T)lr * st""",
        "ss_sgd_step")
    k["adam_step"] = E(
        "T g, L lr, S t, float64 b1, float64 b2, float64 eps, float64 wd", "T w, T m, T v",
        """T gg = wd != 0.0 ? g + (T)wd * w : g;
        T mn = m + (T)(1.0 - b1) * (gg - m);
        T vn = v * (T)b2 + (T)(1.0 - b2) * gg * gg;
        double tt = (double)t;
        T step_size = (T)((double)lr / (1.0 - pow(b1, tt)));
        T denom = sqrt(vn) / (T)sqrt(1.0 - pow(b2, tt)) + (T)eps;
        m = mn;
        v = vn;
        w = w - step_size * (mn / denom)""",
        "ss_adam_step")
    k["increment"] = E("float64 by", "T t", "t = (T)((double)t + by)", "ss_increment")
    k["sum"] = R("T x", "T y", "x", "a + b", "y = (T)a", "0", "ss_sum", reduce_type="double")
    k["mean"] = R("T x", "T y", "x", "a + b",
                  "y = (T)(a / (double)(_in_ind.size() / _out_ind.size()))", "0", "ss_mean",
                  reduce_type="double")
    k["isum"] = R("T x", "T y", "x", "a + b", "y = (T)a", "0", "ss_isum",
                  reduce_type="long long")
    k["_raw"] = {}  # RawModules by (kind, dtype[, label dtype])
    k["_fn"] = {}   # their kernels by (kind, dtype, label dtype, name)
    k["_sms"] = {}  # device id -> multiprocessor count
    return k


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

// loss = sum(rowloss) / n: one block (a power of two of threads, <= 1024); thread t adds rows
// t, t + B, ... in that order, then a fixed tree in shared memory: bitwise deterministic.
extern "C" __global__ void ss_xent_mean(const double* rowloss, D_t* loss, int n) {
    __shared__ double part[1024];
    int t = threadIdx.x, B = blockDim.x;
    double acc = 0.0;
    int i = t;
    for (; i + 3 * B < n; i += 4 * B) {
        double a0 = rowloss[i], a1 = rowloss[i + B], a2 = rowloss[i + 2 * B], a3 = rowloss[i + 3 * B];
        acc += a0; acc += a1; acc += a2; acc += a3;
    }
    for (; i < n; i += B) acc += rowloss[i];
    part[t] = acc;
    __syncthreads();
    for (int s = B >> 1; s > 0; s >>= 1) {
        if (t < s) part[t] += part[t + s];
        __syncthreads();
    }
    if (t == 0) loss[0] = (D_t)(A_t)(part[0] / n);
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

# -- dense helpers: column sums (reduction over a non-last axis) and row-broadcast binaries ----

_DENSE_SRC = r"""
// y[o, k] = (sum over r of x[o, r, k]) / div for a C-contiguous x: [outer, rows, inner].
// Block (tx, ty), tx and ty powers of two; block (bx, o) owns columns bx*tx .. bx*tx+tx-1 of
// outer index o; thread (i, j) adds rows j, j+ty, j+2ty, ... of its column in double, in that
// order (8 loads in flight per batch), then the ty partial sums of a column are added by a
// fixed tree in shared memory.  No atomics, no scratch: bitwise deterministic, and every
// warp reads whole 32-byte sectors (tx >= 8) of a row.
extern "C" __global__ void ss_colsum(const T_t* x, T_t* y, long long rows, long long inner,
                                     double div) {
    __shared__ double part[1024];
    int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x, by = blockDim.y;
    long long col = (long long)blockIdx.x * bx + tx;
    long long o = blockIdx.y;
    double acc = 0.0;
    if (col < inner) {
        const T_t* p = x + o * rows * inner + col;
        long long k = ty;
        for (; k + 7 * (long long)by < rows; k += 8 * (long long)by) {
            double a[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) a[u] = (double)(A_t)p[(k + (long long)u * by) * inner];
#pragma unroll
            for (int u = 0; u < 8; ++u) acc += a[u];
        }
        for (; k < rows; k += by) acc += (double)(A_t)p[k * inner];
    }
    int t = ty * bx + tx;
    part[t] = acc;
    __syncthreads();
    for (int s = by >> 1; s > 0; s >>= 1) {
        if (ty < s) part[t] += part[t + s * bx];
        __syncthreads();
    }
    if (ty == 0 && col < inner) y[o * inner + col] = (T_t)(A_t)(part[tx] / div);
}

__device__ __forceinline__ A_t ss_op(A_t a, A_t b, int op) {
    return op == 0 ? a + b : (op == 1 ? a - b : a * b);
}

// c[r, k] = a[r, k] OP b[k] (OP: 0 +, 1 -, 2 *) for C-contiguous a, c: [rows, cols], b: [cols];
// c is a itself or does not overlap a or b.  Thread k of block (bx, by) does column k of rows
// by*rpb .. by*rpb+rpb-1, 8 loads in flight before their stores.
extern "C" __global__ void ss_rowbcast(const T_t* a, const T_t* b, T_t* c, long long rows,
                                       long long cols, int rpb, int op) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= cols) return;
    A_t bv = (A_t)b[k];
    long long r = (long long)blockIdx.y * rpb;
    long long r1 = r + rpb < rows ? r + rpb : rows;
    for (; r + 8 <= r1; r += 8) {
        A_t v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = (A_t)a[(r + u) * cols + k];
#pragma unroll
        for (int u = 0; u < 8; ++u) c[(r + u) * cols + k] = (T_t)ss_op(v[u], bv, op);
    }
    for (; r < r1; ++r) c[r * cols + k] = (T_t)ss_op((A_t)a[r * cols + k], bv, op);
}

#ifdef SS_F32
__device__ __forceinline__ float4 ss_op4(float4 a, float4 b, int op) {
    float4 r;
    r.x = ss_op(a.x, b.x, op); r.y = ss_op(a.y, b.y, op);
    r.z = ss_op(a.z, b.z, op); r.w = ss_op(a.w, b.w, op);
    return r;
}

// The same with 16-byte accesses: cols4 = cols / 4, every row start 16-byte aligned.
extern "C" __global__ void ss_rowbcast4(const float4* a, const float4* b, float4* c, long long rows,
                                        long long cols4, int rpb, int op) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= cols4) return;
    float4 bv = b[k];
    long long r = (long long)blockIdx.y * rpb;
    long long r1 = r + rpb < rows ? r + rpb : rows;
    for (; r + 8 <= r1; r += 8) {
        float4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = a[(r + u) * cols4 + k];
#pragma unroll
        for (int u = 0; u < 8; ++u) c[(r + u) * cols4 + k] = ss_op4(v[u], bv, op);
    }
    for (; r < r1; ++r) c[r * cols4 + k] = ss_op4(a[r * cols4 + k], bv, op);
}
#endif
"""

_CTYPES = {"float32": ("float", "float"), "float64": ("double", "double"),
           "float16": ("__half", "float")}
_LTYPES = {"int32": "int", "int64": "long long"}
_DENSE = ("float32", "float64")  # ss_colsum / ss_rowbcast; f16 stays on CuPy's kernels
_HEAD = ("#define CUDART_NAN __int_as_float(0x7fffffff)\n"
         "#define SS_INF __int_as_float(0x7f800000)\n")


def _module(key: tuple, src: str, defines: str = ""):
    import cupy as cp

    cache = _kernels()["_raw"]
    mod = cache.get(key)
    if mod is None:
        t, a = _CTYPES[key[1]]
        head = "#include <cuda_fp16.h>\n" if t == "__half" else ""
        head += _HEAD + defines + f"typedef {t} T_t;\ntypedef {a} A_t;\n"
        mod = cp.RawModule(code=head + src, options=("-std=c++17",))
        cache[key] = mod
    return mod


def _xent_module(dtype, ltype, dltype):
    """The softmax_xent module for logits `dtype` (T_t), labels `ltype` (L_t) and loss/dloss
    `dltype` (D_t: f32 for f16 logits under mixed precision)."""
    dt, lt, dl = str(dtype), str(ltype), str(dltype)
    if dt not in _CTYPES or lt not in _LTYPES or dl not in _CTYPES:
        raise NotImplementedError(f"softmax_xent: dtypes {dtype}/{ltype}/{dltype} not supported")
    return _module(("xent", dt, lt, dl), _XENT_SRC,
                   f"typedef {_LTYPES[lt]} L_t;\ntypedef {_CTYPES[dl][0]} D_t;\n")


def _function(kind: str, dtype, ltype, name: str, dltype=None):
    """A kernel of the xent or dense module, cached by (module, dtype(s), name)."""
    fns = _kernels()["_fn"]
    key = (kind, str(dtype), str(ltype), name, str(dltype))
    f = fns.get(key)
    if f is None:
        if kind == "xent":
            mod = _xent_module(dtype, ltype, dltype if dltype is not None else dtype)
        else:
            dt = str(dtype)
            mod = _module(("dense", dt), _DENSE_SRC, "#define SS_F32 1\n" if dt == "float32" else "")
        f = fns[key] = mod.get_function(name)
    return f


def _pow2_at_least(v: int) -> int:
    p = 1
    while p < v:
        p *= 2
    return p


def _sm_count(device_id: int) -> int:
    sms = _kernels()["_sms"]
    v = sms.get(device_id)
    if v is None:
        import cupy as cp

        v = sms[device_id] = int(cp.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])
    return v


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


# -- helpers ---------------------------------------------------------------------------------


def _stream(ctx, stream):
    return ctx.stream(stream) if ctx is not None else _null_ctx()


class _null_ctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cupy_stream(ctx, stream):
    if ctx is not None:
        return ctx.stream(stream)
    import cupy as cp

    return cp.cuda.get_current_stream()


def _overlap(p0: int, n0: int, p1: int, n1: int) -> bool:
    return p0 < p1 + n1 and p1 < p0 + n0


def _prod(dims) -> int:
    v = 1
    for d in dims:
        v *= int(d)
    return v


def _colsum_config(outer: int, rows: int, inner: int, sms: int) -> tuple[int, int, int]:
    """(tx, ty, grid x) of ss_colsum: the widest column tile (32, 16 or 8 columns) that still
    gives about a block per multiprocessor, narrower only for fewer columns; then as many
    row threads as the grid is small (256..1024 threads), never more than the rows."""
    tx = 32
    while tx > 8 and -(-inner // tx) * outer < sms:
        tx //= 2
    while tx > 1 and tx // 2 >= inner:
        tx //= 2
    gx = -(-inner // tx)
    blocks = gx * outer
    threads = 1024 if blocks < sms // 2 else (512 if blocks < 2 * sms else 256)
    cap = 1
    while cap * 2 <= rows:
        cap *= 2
    ty = max(1, min(threads // tx, cap))
    return tx, ty, gx


def _colsum(ctx, stream, x, out, axis: int, mean: bool) -> bool:
    """sum/mean over a non-last axis of a C-contiguous float array with ss_colsum (coalesced
    reads, double accumulation, no atomics); False when the case is not one it covers."""
    import numpy as np

    dt = str(x.dtype)
    if dt not in _DENSE or out.dtype != x.dtype or x.ndim == 0 or x.size == 0:
        return False
    axis %= x.ndim
    shape = x.shape
    rows, inner, outer = int(shape[axis]), _prod(shape[axis + 1:]), _prod(shape[:axis])
    if inner < 2 or outer > 65535 or out.size != outer * inner:
        return False
    if not (x.flags.c_contiguous and out.flags.c_contiguous):
        return False
    tx, ty, gx = _colsum_config(outer, rows, inner, _sm_count(x.data.device_id))
    f = _function("dense", x.dtype, None, "ss_colsum")
    with _stream(ctx, stream):
        f((gx, outer, 1), (tx, ty, 1),
          (x, out, np.int64(rows), np.int64(inner), np.float64(rows if mean else 1.0)))
    return True


def _rowbcast(ctx, stream, a, b, out, op: int) -> bool:
    """c = a OP b for a C-contiguous a: [..., n] and b: [n] (the bias add) with ss_rowbcast
    (16-byte accesses for f32 when n % 4 == 0); False when the case is not one it covers
    (CuPy's elementwise kernel then does it)."""
    import numpy as np

    if a.ndim < 2 or b.ndim != 1 or out.shape != a.shape:
        return False
    cols = int(a.shape[-1])
    dt = a.dtype
    if b.shape[0] != cols or b.dtype != dt or out.dtype != dt or str(dt) not in _DENSE or a.size == 0:
        return False
    if not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous):
        return False
    pa, pb, pc = a.data.ptr, b.data.ptr, out.data.ptr
    if _overlap(pc, out.nbytes, pb, b.nbytes) or (pc != pa and _overlap(pc, out.nbytes, pa, a.nbytes)):
        return False
    rows = a.size // cols
    vec = str(dt) == "float32" and cols % 4 == 0 and (pa | pb | pc) % 16 == 0
    width = cols // 4 if vec else cols
    bx = min(256, max(32, _pow2_at_least(width)))
    gx = -(-width // bx)
    sms = _sm_count(out.data.device_id)
    rpb = max(1, min(8, -(-rows * gx // (2 * sms))), -(-rows // 65535))
    gy = -(-rows // rpb)
    f = _function("dense", dt, None, "ss_rowbcast4" if vec else "ss_rowbcast")
    with _stream(ctx, stream):
        f((gx, gy, 1), (bx, 1, 1), (a, b, out, np.int64(rows), np.int64(width), np.int32(rpb), np.int32(op)))
    return True


def _same_or_copy(src, dst) -> None:
    """Make dst hold src before an in-place kernel runs on dst (outs given apart from ins)."""
    if dst is not src:
        _kernels()["copy"](src, dst)


# -- the twins -------------------------------------------------------------------------------


def _matmul(ctx, stream, ins, outs, attrs):
    a, b = ins
    ctx.gemm(stream, a, b, outs[0], bool(attrs.get("ta", False)), bool(attrs.get("tb", False)))


_OPS = {"add": 0, "sub": 1, "mul": 2, "bias_add": 0}


def _binary(name: str) -> Callable:
    op = _OPS.get(name)

    def fn(ctx, stream, ins, outs, attrs):
        if op is not None and _rowbcast(ctx, stream, ins[0], ins[1], outs[0], op):
            return
        with _stream(ctx, stream):
            _kernels()[name](ins[0], ins[1], outs[0])
    fn.__name__ = name
    return fn


def _unary(name: str) -> Callable:
    def fn(ctx, stream, ins, outs, attrs):
        with _stream(ctx, stream):
            _kernels()[name](ins[0], outs[0])
    fn.__name__ = name
    return fn


def _scale(ctx, stream, ins, outs, attrs):
    with _stream(ctx, stream):
        _kernels()["scale"](ins[0], float(attrs.get("alpha", 1.0)), outs[0])


def _reduce(kind: str) -> Callable:
    def fn(ctx, stream, ins, outs, attrs):
        x, out = ins[0], outs[0]
        axis = attrs.get("axis", None)
        if axis is not None and _colsum(ctx, stream, x, out, int(axis), kind == "mean"):
            return
        k = _kernels()
        kern = k[kind]
        if kind == "sum" and x.dtype.kind in "iu":
            kern = k["isum"]
        with _stream(ctx, stream):
            kern(x, out, axis=axis)
    fn.__name__ = kind
    return fn


def _softmax_xent(ctx, stream, ins, outs, attrs):
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


def _softmax_xent_grad(ctx, stream, ins, outs, attrs):
    import numpy as np

    dloss, logits, labels = ins
    n, c = logits.shape
    f = _function("xent", logits.dtype, labels.dtype, "ss_xent_bwd", dloss.dtype)
    g, lg = _row_group(c)
    threads = n * g
    with _stream(ctx, stream):
        f(((threads + 127) // 128,), (128,),
          (dloss, logits, labels, outs[0], np.int32(n), np.int32(c), np.int32(g), np.int32(lg)))


def _fill(ctx, stream, ins, outs, attrs):
    with _stream(ctx, stream):
        _kernels()["fill"](float(attrs.get("value", 0.0)), outs[0])


def _copy(ctx, stream, ins, outs, attrs):
    if outs[0] is ins[0]:
        return
    with _stream(ctx, stream):
        _kernels()["copy"](ins[0], outs[0])


def _reshape(ctx, stream, ins, outs, attrs):
    with _stream(ctx, stream):
        _kernels()["copy"](ins[0].reshape(outs[0].shape), outs[0])


def _h2d(ctx, stream, ins, outs, attrs):
    ctx.memcpy(stream, outs[0], ins[0])


def _d2h(ctx, stream, ins, outs, attrs):
    ctx.memcpy(stream, outs[0], ins[0])


def _alloc(ctx, stream, ins, outs, attrs):
    # Memory is planned up front; on the device `alloc` only zero-fills its planned buffer.
    with _stream(ctx, stream):
        _kernels()["fill"](0.0, outs[0])


def _synchronize(ctx, stream, ins, outs, attrs):
    ctx.device_synchronize()


def _sgd_step(ctx, stream, ins, outs, attrs):
    w, dw, v, lr = ins
    w_out, v_out = outs
    with _stream(ctx, stream):
        _same_or_copy(w, w_out)
        _same_or_copy(v, v_out)
        _kernels()["sgd_step"](dw, lr, float(attrs.get("momentum", 0.9)),
                               float(attrs.get("weight_decay", 0.0)),
                               bool(attrs.get("nesterov", False)), w_out, v_out)


def _adam_step(ctx, stream, ins, outs, attrs):
    w, dw, m, v, lr, t = ins
    w_out, m_out, v_out = outs
    with _stream(ctx, stream):
        _same_or_copy(w, w_out)
        _same_or_copy(m, m_out)
        _same_or_copy(v, v_out)
        _kernels()["adam_step"](dw, lr, t, float(attrs.get("beta1", 0.9)),
                                float(attrs.get("beta2", 0.999)), float(attrs.get("eps", 1e-8)),
                                float(attrs.get("weight_decay", 0.0)), w_out, m_out, v_out)


def _increment(ctx, stream, ins, outs, attrs):
    with _stream(ctx, stream):
        _same_or_copy(ins[0], outs[0])
        _kernels()["increment"](float(attrs.get("by", 1.0)), outs[0])


def _host_only(name: str) -> Callable:
    def fn(ctx, stream, ins, outs, attrs):
        raise RuntimeError(f"{name} is host work: the training loop runs it (host_fn), "
                           f"never a device stream")
    fn.__name__ = name
    return fn


# -- CNN-step kernels (stdlib/kernels_cnn.py): raw kernels, simple and deterministic -------------
#
# Every kernel here is a RawModule kernel compiled per dtype combination (typedefs X_t: the
# activation dtype, P_t: batch-norm parameters, A_t: the compute dtype, at least f32 as in the
# NumPy twins, ...), with FMA contraction off (--fmad=false) so that elementwise formulas round
# like NumPy's.  Sums are fixed-order: a thread adds its indices t, t + 256, ... in double, then
# a fixed shared-memory tree (`ss_block_sum`); no atomics, no scratch, nothing allocated.
# Pools are direct gather kernels (one thread, or one block, per output element): the backward
# passes never scatter, so there is nothing to accumulate atomically.  Convolutions are im2col /
# col2im gathers around cuBLAS GEMMs (the one temporary, cols, is the exception to "nothing
# allocated": see _conv2d); their direct kernels remain as the fallback.

_CNN_PRE = r"""
#define SS_B 256
__device__ __forceinline__ double ss_wide(float v) { return (double)v; }
__device__ __forceinline__ double ss_wide(double v) { return v; }
__device__ __forceinline__ double ss_wide(unsigned char v) { return (double)v; }
__device__ __forceinline__ double ss_wide(int v) { return (double)v; }
__device__ __forceinline__ double ss_wide(long long v) { return (double)v; }
__device__ __forceinline__ void ss_put(float* p, float v) { *p = v; }
__device__ __forceinline__ void ss_put(float* p, double v) { *p = (float)v; }
__device__ __forceinline__ void ss_put(double* p, float v) { *p = (double)v; }
__device__ __forceinline__ void ss_put(double* p, double v) { *p = v; }
__device__ __forceinline__ void ss_put(unsigned char* p, double v) { *p = (unsigned char)v; }
__device__ __forceinline__ void ss_put(int* p, double v) { *p = (int)v; }
__device__ __forceinline__ void ss_put(long long* p, double v) { *p = (long long)v; }
#ifdef SS_HALF
__device__ __forceinline__ double ss_wide(__half v) { return (double)__half2float(v); }
__device__ __forceinline__ void ss_put(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void ss_put(__half* p, double v) { *p = __double2half(v); }
#endif
#define SS_LD(v) ((A_t)ss_wide(v))
__device__ __forceinline__ float ss_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double ss_sqrt(double v) { return sqrt(v); }
__device__ __forceinline__ bool ss_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}
__device__ __forceinline__ bool ss_finite(double v) {
    return (__double_as_longlong(v) & 0x7ff0000000000000LL) != 0x7ff0000000000000LL;
}
__device__ __forceinline__ bool ss_isnan(float v) { return v != v; }
__device__ __forceinline__ bool ss_isnan(double v) { return v != v; }
__device__ __forceinline__ unsigned long long ss_u64(int v) { return (unsigned long long)(long long)v; }
__device__ __forceinline__ unsigned long long ss_u64(long long v) { return (unsigned long long)v; }
__device__ __forceinline__ unsigned long long ss_u64(float v) { return (unsigned long long)v; }
__device__ __forceinline__ unsigned long long ss_u64(double v) { return (unsigned long long)v; }

// The sum of every thread's v over a block of exactly SS_B threads, by a fixed tree; every
// thread gets it.  Ends with a barrier, so sh may be reused at once.
__device__ __forceinline__ double ss_block_sum(double v, double* sh) {
    int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = SS_B >> 1; s > 0; s >>= 1) {
        if (t < s) sh[t] += sh[t + s];
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}
#define SS_LOOP(i, total) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (total); \
         i += (long long)gridDim.x * blockDim.x)
"""

_CNN_SRC: dict[str, str] = {}

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

# The gathers around the convolution GEMMs (see _conv2d): cols [n*oh*ow, kh*kw*c], rows in
# (b, i, j) order, columns in (di, dj, ci) order, as kernels_cnn's _im2col.
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

# Pools: x [n, h, w, c], y / dy [n, oh, ow, c], no padding.  The maximum follows kernels_cnn's
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

# Batch norm over x [m, c] (channels last): one block of SS_B threads per channel.  Parameters
# are read before the first barrier and the [c] outputs written by thread 0 after it; every
# element of x/dy is read and then written (y, dx) by the same thread: in place is safe.
_CNN_SRC["bn"] = r"""
extern "C" __global__ void ss_bn_train(const X_t* x, const P_t* gamma, const P_t* beta, X_t* y,
                                       P_t* mean, P_t* invstd, long long m, int c, double eps) {
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
        ss_put(y + i, d * inv * g + bt);
    }
}

extern "C" __global__ void ss_bn_grad(const X_t* dy, const X_t* x, const P_t* gamma,
                                      const P_t* mean, const P_t* invstd, X_t* dx, P_t* dgamma,
                                      P_t* dbeta, long long m, int c) {
    __shared__ double sh[SS_B];
    int ch = blockIdx.x, t = threadIdx.x;
    A_t g = SS_LD(gamma[ch]), mu = SS_LD(mean[ch]), inv = SS_LD(invstd[ch]);
    double sb = 0.0, sg = 0.0;
    for (long long r = t; r < m; r += SS_B) {
        long long i = r * c + ch;
        A_t d = SS_LD(dy[i]);
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
        A_t d = SS_LD(dy[i]);
        A_t xh = (SS_LD(x[i]) - mu) * inv;
        ss_put(dx + i, (d - k1 - xh * k2) * sc);
    }
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

# Philox-4x32-10 exactly as kernels_cnn.philox4x32_10; thread g draws block g: the words of
# elements 4g .. 4g+3.  The offset is read from the device counter when the kernel runs.
_CNN_SRC["drop"] = r"""
__device__ __forceinline__ void ss_philox(unsigned int* c, unsigned int k0, unsigned int k1) {
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        unsigned long long p0 = 0xD2511F53ull * (unsigned long long)c[0];
        unsigned long long p1 = 0xCD9E8D57ull * (unsigned long long)c[2];
        unsigned int n0 = (unsigned int)(p1 >> 32) ^ c[1] ^ k0;
        unsigned int n1 = (unsigned int)(p1 & 0xffffffffull);
        unsigned int n2 = (unsigned int)(p0 >> 32) ^ c[3] ^ k1;
        unsigned int n3 = (unsigned int)(p0 & 0xffffffffull);
        c[0] = n0; c[1] = n1; c[2] = n2; c[3] = n3;
    }
}

extern "C" __global__ void ss_dropout(const X_t* x, const O_t* offset, X_t* y, M_t* mask,
                                      long long size, unsigned int k0, unsigned int k1,
                                      unsigned long long thr, double scale) {
    unsigned long long off = ss_u64(offset[0]);
    A_t sc = (A_t)scale;
    long long nb = (size + 3) >> 2;
    SS_LOOP(blk, nb) {
        unsigned long long ub = (unsigned long long)blk;
        unsigned int c[4];
        c[0] = (unsigned int)(ub & 0xffffffffull);
        c[1] = (unsigned int)(ub >> 32);
        c[2] = (unsigned int)(off & 0xffffffffull);
        c[3] = (unsigned int)(off >> 32);
        ss_philox(c, k0, k1);
        for (int u = 0; u < 4; ++u) {
            long long i = blk * 4 + u;
            if (i >= size) break;
            bool keep = (unsigned long long)c[u] >= thr;
            A_t v = keep ? SS_LD(x[i]) * sc : (A_t)0;
            ss_put(y + i, v);
            ss_put(mask + i, keep ? 1.0 : 0.0);
        }
    }
}

extern "C" __global__ void ss_dropout_grad(const X_t* dy, const M_t* mask, X_t* dx,
                                           long long size, double scale) {
    A_t sc = (A_t)scale;
    SS_LOOP(i, size) {
        A_t v = ss_wide(mask[i]) != 0.0 ? SS_LD(dy[i]) * sc : (A_t)0;
        ss_put(dx + i, v);
    }
}
"""

_CNN_SRC["offs"] = r"""
extern "C" __global__ void ss_offset_advance(const O_t* in, O_t* out, long long by) {
    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = (O_t)(in[0] + (O_t)by);
}
"""

# LARS in one block: both norms (squares in A_t, as NumPy, summed in double by the fixed tree),
# the trust ratio in double, then the elementwise update by the same block.  No scratch.
_CNN_SRC["lars"] = r"""
extern "C" __global__ void ss_lars(const X_t* w, const X_t* dw, const X_t* v, const L_t* lr,
                                   X_t* w_out, X_t* v_out, long long size, double mom, double wd,
                                   double trust, double eps) {
    __shared__ double sh[SS_B];
    int t = threadIdx.x;
    double sw = 0.0, sg = 0.0;
    for (long long i = t; i < size; i += SS_B) {
        A_t a = SS_LD(w[i]), g = SS_LD(dw[i]);
        sw += (double)(a * a);
        sg += (double)(g * g);
    }
    sw = ss_block_sum(sw, sh);
    sg = ss_block_sum(sg, sh);
    double wn = sqrt(sw), gn = sqrt(sg);
    double local = (wn > 0.0 && gn > 0.0) ? trust * wn / (gn + wd * wn + eps) : 1.0;
    A_t coef = (A_t)(ss_wide(lr[0]) * local);
    A_t am = (A_t)mom, awd = (A_t)wd;
    for (long long i = t; i < size; i += SS_B) {
        A_t a = SS_LD(w[i]), g = SS_LD(dw[i]), vv = SS_LD(v[i]);
        A_t vn = am * vv + coef * (g + awd * a);
        A_t wn2 = a - vn;
        ss_put(v_out + i, vn);
        ss_put(w_out + i, wn2);
    }
}
"""

# One block: the two norms (master, unscaled gradient) by ss_block_sum in double, then the
# update of master and v in M_t (A_t) and w = master rounded to W_t.  Skipped when found_inf.
_CNN_SRC["amplars"] = r"""
extern "C" __global__ void ss_amp_lars(const W_t* dw, M_t* master, M_t* v, W_t* w, const S_t* lr,
                                       const S_t* scale, const F_t* found, long long size,
                                       double mom, double wd, double trust, double eps) {
    if (ss_wide(found[0]) != 0.0) return;
    __shared__ double sh[SS_B];
    int t = threadIdx.x;
    A_t inv = (A_t)(1.0 / ss_wide(scale[0]));
    double sw = 0.0, sg = 0.0;
    for (long long i = t; i < size; i += SS_B) {
        A_t a = (A_t)master[i], g = (A_t)ss_wide(dw[i]) * inv;
        sw += (double)a * (double)a;
        sg += (double)g * (double)g;
    }
    sw = ss_block_sum(sw, sh);
    sg = ss_block_sum(sg, sh);
    double wn = sqrt(sw), gn = sqrt(sg);
    double local = (wn > 0.0 && gn > 0.0) ? trust * wn / (gn + wd * wn + eps) : 1.0;
    A_t coef = (A_t)(ss_wide(lr[0]) * local);
    A_t am = (A_t)mom, awd = (A_t)wd;
    for (long long i = t; i < size; i += SS_B) {
        A_t a = (A_t)master[i], g = (A_t)ss_wide(dw[i]) * inv;
        A_t vn = am * (A_t)v[i] + coef * (g + awd * a);
        A_t m = a - vn;
        v[i] = (M_t)vn;
        master[i] = (M_t)m;
        ss_put(w + i, m);
    }
}
"""

_CNN_SRC["ema"] = r"""
extern "C" __global__ void ss_ema(const X_t* ema, const W_t* w, X_t* out, long long size,
                                  double omd) {
    A_t k = (A_t)omd;
    SS_LOOP(i, size) {
        A_t e = SS_LD(ema[i]);
        ss_put(out + i, e + k * (SS_LD(w[i]) - e));
    }
}
"""

# Through double: exact, then one round-to-nearest-even into Y_t (__double2half for f16).
_CNN_SRC["cast"] = r"""
extern "C" __global__ void ss_cast(const X_t* x, Y_t* y, long long size) {
    SS_LOOP(i, size) ss_put(y + i, ss_wide(x[i]));
}
"""

_CNN_SRC["sloss"] = r"""
extern "C" __global__ void ss_scale_loss(const X_t* loss, const S_t* scale, X_t* out,
                                         long long size) {
    A_t sc = SS_LD(scale[0]);
    SS_LOOP(i, size) ss_put(out + i, SS_LD(loss[i]) * sc);
}
"""

# found is only ever set to 1 (every thread that sees a non-finite value stores the same 1; no
# atomics needed); a found_inf output apart from its input is first copied by ss_copy1.
_CNN_SRC["unscale"] = r"""
extern "C" __global__ void ss_copy1(const F_t* in, F_t* out) {
    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = in[0];
}

extern "C" __global__ void ss_unscale(const X_t* g, const S_t* scale, F_t* found, X_t* out,
                                      long long size) {
    A_t inv = (A_t)(1.0 / ss_wide(scale[0]));
    SS_LOOP(i, size) {
        A_t v = SS_LD(g[i]);
        if (!ss_finite(v)) ss_put(found, 1.0);
        ss_put(out + i, v * inv);
    }
}
"""

_CNN_SRC["upd"] = r"""
extern "C" __global__ void ss_update_scale(const S_t* scale, const F_t* found, const G_t* good,
                                           S_t* scale_out, G_t* good_out, double growth,
                                           double backoff, double interval) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    S_t s0 = scale[0];
    double s = ss_wide(s0), f = ss_wide(found[0]), st = ss_wide(good[0]);
    if (f != 0.0) {
        ss_put(scale_out, s * backoff);
        ss_put(good_out, 0.0);
    } else if (st + 1.0 == interval) {
        S_t grown;
        ss_put(&grown, s * growth);
        if (ss_finite(ss_wide(grown))) *scale_out = grown; else *scale_out = s0;
        ss_put(good_out, 0.0);
    } else {
        *scale_out = s0;
        ss_put(good_out, st + 1.0);
    }
}
"""

# found is only ever set to 1 (as ss_unscale); the gradient is left as it is.
_CNN_SRC["nonfinite"] = r"""
extern "C" __global__ void ss_nonfinite(const X_t* g, F_t* found, long long size) {
    SS_LOOP(i, size) {
        if (!ss_finite(SS_LD(g[i]))) ss_put(found, 1.0);
    }
}
"""

# SGD on the master weights (M_t, computed in M_t as the NumPy twin) from a scaled gradient
# (W_t), skipped entirely when found_inf is set; w = master rounded to W_t.
_CNN_SRC["ampsgd"] = r"""
extern "C" __global__ void ss_amp_sgd(const W_t* dw, M_t* master, M_t* v, W_t* w,
                                      const S_t* lr, const S_t* scale, const F_t* found,
                                      long long size, double mu_d, double wd_d, int nesterov) {
    if (ss_wide(found[0]) != 0.0) return;
    M_t inv = (M_t)(1.0 / ss_wide(scale[0]));
    M_t lrv = (M_t)ss_wide(lr[0]);
    M_t mu = (M_t)mu_d, wd = (M_t)wd_d;
    SS_LOOP(i, size) {
        M_t g = (M_t)ss_wide(dw[i]) * inv;
        M_t m = master[i];
        if (wd_d != 0.0) g = g + wd * m;
        M_t vn = g;
        if (mu_d != 0.0) vn = mu * v[i] + g;
        M_t st = nesterov ? g + mu * vn : vn;
        m = m - lrv * st;
        v[i] = vn;
        master[i] = m;
        ss_put(w + i, m);
    }
}
"""

_CNN_CT = {"float16": "__half", "float32": "float", "float64": "double", "uint8": "unsigned char",
           "int32": "int", "int64": "long long"}


def _acc_of(*dtypes) -> str:
    """The compute dtype of the NumPy twins: f64 if any operand is f64, else f32."""
    return "float64" if any(str(d) == "float64" for d in dtypes) else "float32"


def _cnn_fn(group: str, name: str, **types):
    """Kernel `name` of _CNN_SRC[group] compiled with the typedefs `types` (typedef name ->
    dtype); module and function cached by (group, typedefs)."""
    import cupy as cp

    k = _kernels()
    tkey = tuple(sorted((t, str(d)) for t, d in types.items()))
    fkey = ("cnn", group, tkey, name)
    f = k["_fn"].get(fkey)
    if f is not None:
        return f
    for t, d in tkey:
        if d not in _CNN_CT:
            raise NotImplementedError(f"{name}: dtype {d} ({t}) is not supported on the device")
    mkey = ("cnn", group, tkey)
    mod = k["_raw"].get(mkey)
    if mod is None:
        half = any(d == "float16" for _, d in tkey)
        head = "#include <cuda_fp16.h>\n#define SS_HALF 1\n" if half else ""
        head += _HEAD + "".join(f"typedef {_CNN_CT[d]} {t};\n" for t, d in tkey)
        mod = cp.RawModule(code=head + _CNN_PRE + _CNN_SRC[group],
                           options=("-std=c++17", "--fmad=false"))
        k["_raw"][mkey] = mod
    f = k["_fn"][fkey] = mod.get_function(name)
    return f


_BLOCK = 256  # SS_B


def _grid(total: int) -> tuple[int]:
    """Blocks of 256 threads for a grid-stride loop over `total` items (capped; the loop covers
    the rest)."""
    return (max(1, min(-(-int(total) // _BLOCK), 1 << 16)),)


def _go(ctx, stream, f, grid, args) -> None:
    with _stream(ctx, stream):
        f(grid, (_BLOCK,), args)


def _contiguous(name: str, arrays) -> None:
    for a in arrays:
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: operands must be C-contiguous")


def _disjoint(name: str, ins, outs) -> None:
    """Gather kernels read inputs other threads' outputs may overwrite: refuse overlap."""
    for o in outs:
        for a in ins:
            if o.size and a.size and _overlap(o.data.ptr, o.nbytes, a.data.ptr, a.nbytes):
                raise ValueError(f"{name}: an output shares memory with an input (not supported "
                                 f"on the device)")


def _i32(*vals):
    import numpy as np

    return tuple(np.int32(int(v)) for v in vals)


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


def _im2col(ctx, stream, x, kh, kw, oh, ow, s, p):
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


def _conv2d(ctx, stream, ins, outs, attrs):
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
    cols = _im2col(ctx, stream, x, kh, kw, oh, ow, s, p)
    ctx.gemm(stream, cols, w.reshape(kh * kw * c, k), y.reshape(n * oh * ow, k))


def _conv2d_grad_x(ctx, stream, ins, outs, attrs):
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
        ctx.gemm(stream, dy2, w2, dx.reshape(n * h * wd, c), tb=True)
        return
    import cupy as cp

    with _stream(ctx, stream):
        dcols = cp.empty((n * oh * ow, kh * kw * c), dtype=dy.dtype)
    ctx.gemm(stream, dy2, w2, dcols, tb=True)
    name = "ss_col2im_3x3" if (kh, kw) == (3, 3) else "ss_col2im"
    _go(ctx, stream, _cnn_fn("col", name, X_t=dy.dtype), _grid(dx.size),
        (dcols, dx) + _i32(n, h, wd, c, kh, kw, oh, ow, s, p))


def _conv2d_grad_w(ctx, stream, ins, outs, attrs):
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
    cols = _im2col(ctx, stream, x, kh, kw, oh, ow, s, p)
    ctx.gemm(stream, cols, dy.reshape(n * oh * ow, k), dw.reshape(kh * kw * c, k), ta=True)


def _sum_nhw(ctx, stream, ins, outs, attrs):
    import numpy as np

    dy, db = ins[0], outs[0]
    _contiguous("sum_nhw", (dy, db))
    _disjoint("sum_nhw", ins, outs)
    c = int(dy.shape[-1])
    if c == 0:
        return
    f = _cnn_fn("conv", "ss_sum_nhw", X_t=dy.dtype)
    _go(ctx, stream, f, (c,), (dy, db, np.int64(dy.size // c), np.int32(c)))


def _pool_dims(attrs):
    return int(attrs.get("size", 2)), int(attrs.get("stride", 2))


def _pool(kind: str) -> Callable:
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


def _pool_grad(kind: str) -> Callable:
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


def _global_avgpool(ctx, stream, ins, outs, attrs):
    import numpy as np

    x, y = ins[0], outs[0]
    _contiguous("global_avgpool", (x, y))
    _disjoint("global_avgpool", ins, outs)
    n, h, wd, c = x.shape
    if y.size == 0:
        return
    f = _cnn_fn("pool", "ss_global_avgpool", X_t=x.dtype, A_t=_acc_of(x.dtype))
    _go(ctx, stream, f, _grid(y.size), (x, y, np.int32(n), np.int64(h * wd), np.int32(c)))


def _global_avgpool_grad(ctx, stream, ins, outs, attrs):
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


def _batchnorm_train(ctx, stream, ins, outs, attrs):
    import numpy as np

    x, gamma, beta = ins
    y, mean, invstd = outs
    _contiguous("batchnorm_train", list(ins) + list(outs))
    c = int(x.shape[-1])
    f = _cnn_fn("bn", "ss_bn_train", X_t=x.dtype, P_t=gamma.dtype, A_t=_acc_of(x.dtype, gamma.dtype))
    _go(ctx, stream, f, (c,), (x, gamma, beta, y, mean, invstd, np.int64(x.size // c), np.int32(c),
                               np.float64(attrs.get("eps", 1e-5))))


def _batchnorm_grad(ctx, stream, ins, outs, attrs):
    import numpy as np

    dy, x, gamma, mean, invstd = ins
    dx, dgamma, dbeta = outs
    _contiguous("batchnorm_grad", list(ins) + list(outs))
    c = int(x.shape[-1])
    f = _cnn_fn("bn", "ss_bn_grad", X_t=x.dtype, P_t=gamma.dtype, A_t=_acc_of(x.dtype, gamma.dtype))
    _go(ctx, stream, f, (c,), (dy, x, gamma, mean, invstd, dx, dgamma, dbeta,
                               np.int64(x.size // c), np.int32(c)))


def _batchnorm_stats_update(ctx, stream, ins, outs, attrs):
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


def _batchnorm_infer(ctx, stream, ins, outs, attrs):
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


def _dropout(ctx, stream, ins, outs, attrs):
    import numpy as np

    x, offset = ins
    y, mask = outs
    _contiguous("dropout", (x, y, mask))
    p = float(attrs.get("p", 0.1))
    seed = int(attrs.get("seed", 0))
    thr = int(math.floor(p * 4294967296.0))  # kernels_cnn.dropout_threshold
    if x.size == 0:
        return
    f = _cnn_fn("drop", "ss_dropout", X_t=x.dtype, O_t=offset.dtype, M_t=mask.dtype,
                A_t=_acc_of(x.dtype))
    _go(ctx, stream, f, _grid((x.size + 3) // 4),
        (x, offset, y, mask, np.int64(x.size), np.uint32(seed & 0xFFFFFFFF),
         np.uint32((seed >> 32) & 0xFFFFFFFF), np.uint64(thr), np.float64(1.0 / (1.0 - p))))


def _dropout_grad(ctx, stream, ins, outs, attrs):
    import numpy as np

    dy, mask = ins
    dx = outs[0]
    _contiguous("dropout_grad", (dy, mask, dx))
    p = float(attrs.get("p", 0.1))
    if dx.size == 0:
        return
    f = _cnn_fn("drop", "ss_dropout_grad", X_t=dy.dtype, M_t=mask.dtype, O_t="int64",
                A_t=_acc_of(dy.dtype))
    _go(ctx, stream, f, _grid(dx.size), (dy, mask, dx, np.int64(dx.size), np.float64(1.0 / (1.0 - p))))


def _offset_advance(ctx, stream, ins, outs, attrs):
    import numpy as np

    f = _cnn_fn("offs", "ss_offset_advance", O_t=ins[0].dtype)
    _go(ctx, stream, f, (1,), (ins[0], outs[0], np.int64(int(attrs.get("by", 1)))))


def _lars_step(ctx, stream, ins, outs, attrs):
    import numpy as np

    w, dw, v, lr = ins
    w_out, v_out = outs
    _contiguous("lars_step", (w, dw, v, w_out, v_out))
    f = _cnn_fn("lars", "ss_lars", X_t=w.dtype, L_t=lr.dtype, A_t=_acc_of(w.dtype))
    _go(ctx, stream, f, (1,), (w, dw, v, lr, w_out, v_out, np.int64(w.size),
                               np.float64(attrs.get("momentum", 0.9)),
                               np.float64(attrs.get("weight_decay", 0.0005)),
                               np.float64(attrs.get("trust", 0.001)),
                               np.float64(attrs.get("eps", 1e-9))))


def _ema_update(ctx, stream, ins, outs, attrs):
    import numpy as np

    ema, w = ins
    out = outs[0]
    _contiguous("ema_update", (ema, w, out))
    if out.size == 0:
        return
    f = _cnn_fn("ema", "ss_ema", X_t=ema.dtype, W_t=w.dtype, A_t=_acc_of(ema.dtype))
    _go(ctx, stream, f, _grid(out.size),
        (ema, w, out, np.int64(out.size), np.float64(1.0 - float(attrs.get("decay", 0.999)))))


def _cast(ctx, stream, ins, outs, attrs):
    import numpy as np

    x, y = ins[0], outs[0]
    _contiguous("cast", (x, y))
    if y.size == 0 or (y.dtype == x.dtype and y.data.ptr == x.data.ptr):
        return
    f = _cnn_fn("cast", "ss_cast", X_t=x.dtype, Y_t=y.dtype)
    _go(ctx, stream, f, _grid(y.size), (x, y, np.int64(y.size)))


def _scale_loss(ctx, stream, ins, outs, attrs):
    import numpy as np

    loss, scale = ins
    out = outs[0]
    _contiguous("scale_loss", (loss, out))
    if out.size == 0:
        return
    f = _cnn_fn("sloss", "ss_scale_loss", X_t=loss.dtype, S_t=scale.dtype,
                A_t=_acc_of(loss.dtype, scale.dtype))
    _go(ctx, stream, f, _grid(out.size), (loss, scale, out, np.int64(out.size)))


def _unscale_check(ctx, stream, ins, outs, attrs):
    import numpy as np

    g, scale, found = ins
    g_out, found_out = outs
    _contiguous("unscale_check", (g, g_out))
    types = dict(X_t=g.dtype, S_t=scale.dtype, F_t=found.dtype, A_t=_acc_of(g.dtype))
    if found_out.data.ptr != found.data.ptr:
        _go(ctx, stream, _cnn_fn("unscale", "ss_copy1", **types), (1,), (found, found_out))
    if g.size == 0:
        return
    f = _cnn_fn("unscale", "ss_unscale", **types)
    _go(ctx, stream, f, _grid(g.size), (g, scale, found_out, g_out, np.int64(g.size)))


def _update_scale(ctx, stream, ins, outs, attrs):
    import numpy as np

    scale, found, good = ins
    scale_out, good_out = outs
    f = _cnn_fn("upd", "ss_update_scale", S_t=scale.dtype, F_t=found.dtype, G_t=good.dtype)
    _go(ctx, stream, f, (1,), (scale, found, good, scale_out, good_out,
                               np.float64(attrs.get("growth", 2.0)),
                               np.float64(attrs.get("backoff", 0.5)),
                               np.float64(int(attrs.get("interval", 2000)))))


def _nonfinite_check(ctx, stream, ins, outs, attrs):
    import numpy as np

    g, found = ins
    found_out = outs[0]
    types = dict(X_t=g.dtype, F_t=found.dtype)
    if found_out.data.ptr != found.data.ptr:
        _go(ctx, stream, _cnn_fn("unscale", "ss_copy1", X_t=g.dtype, S_t=found.dtype, F_t=found.dtype,
                                 A_t=_acc_of(g.dtype)), (1,), (found, found_out))
    if g.size == 0:
        return
    _contiguous("nonfinite_check", (g,))
    f = _cnn_fn("nonfinite", "ss_nonfinite", A_t=_acc_of(g.dtype), **types)
    _go(ctx, stream, f, _grid(g.size), (g, found_out, np.int64(g.size)))


def _amp_update(ctx, stream, ins, outs, name: str, group: str, fn: str, grid, extra: tuple) -> None:
    """The twins of amp_sgd_step / amp_lars_step: (w, dw, master, v, lr, scale, found_inf) ->
    (w, master, v), in place (outputs given apart from inputs get copies first); the kernel
    skips everything when found_inf is set.  extra: the kernel's attribute arguments."""
    import numpy as np

    w, dw, master, v, lr, scale, found = ins
    w_out, m_out, v_out = outs
    with _stream(ctx, stream):
        for a, b in ((w, w_out), (master, m_out), (v, v_out)):
            _same_or_copy(a, b)
    _contiguous(name, (dw, w_out, m_out, v_out))
    if lr.dtype != scale.dtype:
        raise ValueError(f"{name}: lr and scale must share a dtype on the device")
    if w.size == 0:
        return
    f = _cnn_fn(group, fn, W_t=w.dtype, M_t=master.dtype, S_t=scale.dtype, F_t=found.dtype,
                A_t=_acc_of(master.dtype))
    _go(ctx, stream, f, grid, (dw, m_out, v_out, w_out, lr, scale, found, np.int64(w.size)) + extra)


def _amp_sgd_step(ctx, stream, ins, outs, attrs):
    import numpy as np

    _amp_update(ctx, stream, ins, outs, "amp_sgd_step", "ampsgd", "ss_amp_sgd", _grid(ins[0].size),
                (np.float64(float(attrs.get("momentum", 0.9))), np.float64(float(attrs.get("weight_decay", 0.0))),
                 np.int32(1 if attrs.get("nesterov", False) else 0)))


def _amp_lars_step(ctx, stream, ins, outs, attrs):
    import numpy as np

    _amp_update(ctx, stream, ins, outs, "amp_lars_step", "amplars", "ss_amp_lars", (1,),
                (np.float64(attrs.get("momentum", 0.9)), np.float64(attrs.get("weight_decay", 0.0005)),
                 np.float64(attrs.get("trust", 0.001)), np.float64(attrs.get("eps", 1e-9))))


_CNN_TWINS: dict[str, Callable] = {
    "conv2d": _conv2d,
    "conv2d_grad_x": _conv2d_grad_x,
    "conv2d_grad_w": _conv2d_grad_w,
    "sum_nhw": _sum_nhw,
    "maxpool2d": _pool("maxpool2d"),
    "maxpool2d_grad": _pool_grad("maxpool2d_grad"),
    "avgpool2d": _pool("avgpool2d"),
    "avgpool2d_grad": _pool_grad("avgpool2d_grad"),
    "global_avgpool": _global_avgpool,
    "global_avgpool_grad": _global_avgpool_grad,
    "batchnorm_train": _batchnorm_train,
    "batchnorm_grad": _batchnorm_grad,
    "batchnorm_stats_update": _batchnorm_stats_update,
    "batchnorm_infer": _batchnorm_infer,
    "dropout": _dropout,
    "dropout_grad": _dropout_grad,
    "offset_advance": _offset_advance,
    "lars_step": _lars_step,
    "ema_update": _ema_update,
    "cast": _cast,
    "scale_loss": _scale_loss,
    "unscale_check": _unscale_check,
    "update_scale": _update_scale,
    "nonfinite_check": _nonfinite_check,
    "amp_sgd_step": _amp_sgd_step,
    "amp_lars_step": _amp_lars_step,
}


CUDA_KERNELS: dict[str, Callable] = {
    "matmul": _matmul,
    "add": _binary("add"),
    "sub": _binary("sub"),
    "mul": _binary("mul"),
    "scale": _scale,
    "bias_add": _binary("bias_add"),
    "accumulate": _binary("add"),
    "sum": _reduce("sum"),
    "mean": _reduce("mean"),
    "relu": _unary("relu"),
    "relu_grad": _binary("relu_grad"),
    "tanh": _unary("tanh"),
    "tanh_grad": _binary("tanh_grad"),
    "gelu": _unary("gelu"),
    "gelu_grad": _binary("gelu_grad"),
    "sigmoid": _unary("sigmoid"),
    "sigmoid_grad": _binary("sigmoid_grad"),
    "softmax_xent": _softmax_xent,
    "softmax_xent_grad": _softmax_xent_grad,
    "fill": _fill,
    "copy": _copy,
    "flatten": _reshape,
    "unflatten": _reshape,
    "h2d": _h2d,
    "d2h": _d2h,
    "alloc": _alloc,
    "synchronize": _synchronize,
    "sgd_step": _sgd_step,
    "adam_step": _adam_step,
    "increment": _increment,
    "stage": _host_only("stage"),
    "set_scalar": _host_only("set_scalar"),
    **_CNN_TWINS,
}
"""Kernel name -> CUDA twin; `Kernel.cuda` ("streamsched.stdlib.cuda_kernels:NAME") resolves
to the module attribute of the same name, set below."""

# Module attributes named like the kernels (`sum`, `copy`, ... shadow builtins only as
# attributes of this module; nothing below this line uses those builtins).
for _name, _fn in CUDA_KERNELS.items():
    globals()[_name] = _fn
del _name, _fn
