"""The CUDA twin of every kernel in `streamsched.stdlib.kernels.KERNELS`, same name, same
semantics, written so that it can be captured into a CUDA graph.

Calling convention: `fn(ctx, stream, ins, outs, attrs)`: ctx a
`streamsched.interp.cuda.device.DeviceContext`, stream a stream name (or CuPy stream), ins/outs
CuPy arrays (NumPy pinned arrays for host buffers of h2d/d2h), attrs with defaults filled in.
Outputs are preallocated; an output may be the very array of an input (in-place updates).

Capture rules kept here (CUDA_PITFALLS.md): GEMMs go through the context's per-stream cuBLAS
handle (rule 1), copies through cudaMemcpyAsync (rule 8), nothing allocates from a memory pool
(custom Elementwise/Reduction/Raw kernels with outputs given; no CUB; the one scratch, the
per-row losses of softmax_xent, is made before capture outside every pool: see `_xent_rows`),
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
extern "C" __global__ void ss_xent_mean(const double* rowloss, T_t* loss, int n) {
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
    if (t == 0) loss[0] = (T_t)(A_t)(part[0] / n);
}

// dlogits = dloss * (softmax(z) - onehot(label)) / n; g lanes per row, softmax recomputed.
extern "C" __global__ void ss_xent_bwd(const T_t* dloss, const T_t* logits, const L_t* labels,
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


def _xent_module(dtype, ltype):
    dt, lt = str(dtype), str(ltype)
    if dt not in _CTYPES or lt not in _LTYPES:
        raise NotImplementedError(f"softmax_xent: dtypes {dtype}/{ltype} not supported")
    return _module(("xent", dt, lt), _XENT_SRC, f"typedef {_LTYPES[lt]} L_t;\n")


def _function(kind: str, dtype, ltype, name: str):
    """A kernel of the xent or dense module, cached by (module, dtype(s), name)."""
    fns = _kernels()["_fn"]
    key = (kind, str(dtype), str(ltype), name)
    f = fns.get(key)
    if f is None:
        if kind == "xent":
            mod = _xent_module(dtype, ltype)
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
    rows_fn = _function("xent", logits.dtype, labels.dtype, "ss_xent_rows")
    mean_fn = _function("xent", logits.dtype, labels.dtype, "ss_xent_mean")
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
    if dloss.dtype != logits.dtype:
        raise ValueError("softmax_xent_grad: dloss and logits dtypes differ")
    f = _function("xent", logits.dtype, labels.dtype, "ss_xent_bwd")
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
}
"""Kernel name -> CUDA twin; `Kernel.cuda` ("streamsched.stdlib.cuda_kernels:NAME") resolves
to the module attribute of the same name, set below."""

# Module attributes named like the kernels (`sum`, `copy`, ... shadow builtins only as
# attributes of this module; nothing below this line uses those builtins).
for _name, _fn in CUDA_KERNELS.items():
    globals()[_name] = _fn
del _name, _fn
