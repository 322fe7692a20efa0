"""The CUDA twins of the transformer kernels (stdlib/kernels_transformer.py), same names and
semantics, written like cuda_kernels.py so that they can be captured into a CUDA graph.

Calling convention and capture rules are cuda_kernels.py's: `fn(ctx, stream, ins, outs, attrs)`
with CuPy arrays (outputs preallocated, an output may be an input for the elementwise kernels);
GEMMs on the stream's own cuBLAS handle; step-varying scalars (lr, t, the clipping norm and
scale) read from device memory inside the kernels; nothing allocated but the embedding
backward's scratch, a temporary of the call from the current pool (under the executor the
private pool of the graph being captured), as the convolutions' im2col columns are.  Raw kernels
are compiled with FMA contraction off and the typedefs of cuda_kernels' CNN kernels (X_t data,
A_t compute: f32 for f16/f32, f64 for f64).  Every reduction has a fixed order: a warp per row
adding lane by lane then a fixed xor butterfly (softmax, layer norm), a block per column with a
fixed tree (dgamma, the squared norm), a serial loop (the position gradient, bitwise equal to the
NumPy twin).  The embedding backward is a scatter-add with integer atomics only: each value is
truncated onto a fixed-point grid chosen from its (row, column)'s largest magnitude and count
(`kernels_transformer.segment_sum`), the int64 sums are exact and order-free, so the result is
bitwise the NumPy twin's whatever order the atomics land in.

Attention runs on flat [b*t, d] activations: for head h the [t, dh] block of sequence b starts at
element b*t*d + h*dh with row stride d, so the b blocks of one head are a strided batch (stride
t*d) and each attention GEMM is one cuBLAS strided-batched GEMM per head (`_gemm_heads`), batched
over the sequences; scores and probabilities [b, heads, t, t] have stride heads*t*t between
sequences.

CuPy and nvmath are imported on first use.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from streamsched.stdlib.cuda_kernels import (_CNN_CT, _CNN_PRE, _HEAD, _acc_of, _contiguous, _disjoint, _go, _grid,
                                             _kernels, _overlap, _same_or_copy, _stream)

# -- raw kernels ---------------------------------------------------------------------------------

_SRC: dict[str, str] = {}

_ROW_PRE = r"""
__device__ __forceinline__ float ss_e(float v) { return expf(v); }
__device__ __forceinline__ double ss_e(double v) { return exp(v); }
__device__ __forceinline__ double ss_warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// max that propagates NaN (as NumPy's max): the warp's lanes all get the same value.
__device__ __forceinline__ A_t ss_nmax(A_t a, A_t b) { return (a != a) ? a : ((b != b || b > a) ? b : a); }
__device__ __forceinline__ A_t ss_warp_max(A_t v) {
    for (int o = 16; o > 0; o >>= 1) v = ss_nmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// One warp per row: row r of block b is b * (blockDim.x / 32) + warp; lanes past the last row
// still take part in the shuffles.
#define SS_ROW long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); \
    int lane = threadIdx.x & 31; bool ok = r < rows;
"""

# ids (I_t) index the rows of table (X_t); an id outside the table gives a NaN row (the NumPy
# twin raises).
_SRC["emb"] = r"""
extern "C" __global__ void ss_embedding(const I_t* ids, const X_t* table, X_t* y, long long n, int d,
                                        long long rows) {
    SS_LOOP(t, n * d) {
        long long r = t / d;
        int c = (int)(t - r * d);
        long long v = (long long)ids[r];
        if (v < 0 || v >= rows) ss_put(y + t, (A_t)CUDART_NAN);
        else y[t] = table[v * d + c];
    }
}

extern "C" __global__ void ss_zero_u64(unsigned long long* p, long long size) {
    SS_LOOP(i, size) p[i] = 0ull;
}

// The grid exponent g of one (row, column): 2^e > its largest finite |value| (frexp), kk =
// ceil(log2 count) bits of headroom, so count values below 2^(62 - kk) each sum below 2^62.
__device__ __forceinline__ int ss_grid_exp(unsigned long long mxbits, unsigned long long count) {
    int e;
    frexp(__longlong_as_double((long long)mxbits), &e);
    int kk = count > 1ull ? 64 - __clzll((long long)(count - 1ull)) : 0;
    return e - 62 + kk;
}

// Pass 1: the count of each id, the largest finite |dy| of each (id, column) (atomicMax on the
// bits of a non-negative double, which order like its value) and its specials (1 +inf, 2 -inf,
// 4 NaN).  Integer atomics: the result does not depend on their order.
extern "C" __global__ void ss_emb_grad_scan(const X_t* dy, const I_t* ids, unsigned long long* cnt,
                                            unsigned long long* mx, unsigned long long* flg, long long n,
                                            int d, long long rows) {
    SS_LOOP(t, n * d) {
        long long r = t / d;
        int c = (int)(t - r * d);
        long long v = (long long)ids[r];
        if (v < 0 || v >= rows) continue;
        double x = ss_wide(dy[t]);
        long long o = v * d + c;
        if (c == 0) atomicAdd(cnt + v, 1ull);
        if (ss_finite(x)) atomicMax(mx + o, (unsigned long long)__double_as_longlong(fabs(x)));
        else atomicOr(flg + o, x != x ? 4ull : (x > 0.0 ? 1ull : 2ull));
    }
}

// Pass 2: every finite value truncated to a multiple of 2^g, added as an int64 (exact).
extern "C" __global__ void ss_emb_grad_add(const X_t* dy, const I_t* ids, const unsigned long long* cnt,
                                           const unsigned long long* mx, unsigned long long* acc,
                                           long long n, int d, long long rows) {
    SS_LOOP(t, n * d) {
        long long r = t / d;
        int c = (int)(t - r * d);
        long long v = (long long)ids[r];
        if (v < 0 || v >= rows) continue;
        double x = ss_wide(dy[t]);
        if (!ss_finite(x)) continue;
        long long o = v * d + c;
        long long q = (long long)trunc(ldexp(x, -ss_grid_exp(mx[o], cnt[v])));
        atomicAdd(acc + o, (unsigned long long)q);
    }
}

// Pass 3: the sum, converted to double (round to nearest even), scaled back, rounded to X_t.
extern "C" __global__ void ss_emb_grad_out(const unsigned long long* cnt, const unsigned long long* mx,
                                           const unsigned long long* flg, const unsigned long long* acc,
                                           X_t* out, long long rows, int d) {
    SS_LOOP(o, rows * (long long)d) {
        long long v = o / d;
        unsigned long long f = flg[o];
        double r;
        if (cnt[v] == 0ull) r = 0.0;
        else if ((f & 4ull) || (f & 3ull) == 3ull) r = (double)CUDART_NAN;
        else if (f & 1ull) r = (double)SS_INF;
        else if (f & 2ull) r = -(double)SS_INF;
        else r = ldexp((double)(long long)acc[o], ss_grid_exp(mx[o], cnt[v]));
        ss_put(out + o, r);
    }
}
"""

_SRC["pos"] = r"""
// y[i] = x[i] + table[i % (t * d)]: the row's position in its sequence is (i / d) % t.
extern "C" __global__ void ss_pos_add(const X_t* x, const X_t* table, X_t* y, long long size,
                                      long long period) {
    SS_LOOP(i, size) ss_put(y + i, SS_LD(x[i]) + SS_LD(table[i % period]));
}

// dtable[j] = sum over the sequences b, in order, in double, of dy[b * period + j].
extern "C" __global__ void ss_pos_grad(const X_t* dy, X_t* dt, long long seqs, long long period) {
    SS_LOOP(j, period) {
        double acc = 0.0;
        for (long long b = 0; b < seqs; ++b) acc += ss_wide(dy[b * period + j]);
        ss_put(dt + j, acc);
    }
}
"""

_SRC["ln"] = _ROW_PRE + r"""
// One warp per row of x [rows, d]; sums in double; mean, rstd in S_t.
extern "C" __global__ void ss_layernorm(const X_t* x, const X_t* gamma, const X_t* beta, X_t* y, S_t* mean,
                                        S_t* rstd, long long rows, int d, double eps) {
    SS_ROW
    const X_t* xr = x + (ok ? r : 0) * (long long)d;
    double s = 0.0;
    if (ok) for (int j = lane; j < d; j += 32) s += ss_wide(xr[j]);
    s = ss_warp_sum(s);
    A_t mu = (A_t)(s / (double)d);
    double s2 = 0.0;
    if (ok) for (int j = lane; j < d; j += 32) { A_t c = SS_LD(xr[j]) - mu; s2 += (double)(c * c); }
    s2 = ss_warp_sum(s2);
    A_t inv = (A_t)1 / ss_sqrt((A_t)(s2 / (double)d) + (A_t)eps);
    if (!ok) return;
    if (lane == 0) { ss_put(mean + r, mu); ss_put(rstd + r, inv); }
    X_t* yr = y + r * (long long)d;
    for (int j = lane; j < d; j += 32)
        ss_put(yr + j, (SS_LD(xr[j]) - mu) * inv * SS_LD(gamma[j]) + SS_LD(beta[j]));
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy gamma; one warp per row.
extern "C" __global__ void ss_layernorm_grad_x(const X_t* dy, const X_t* x, const X_t* gamma, const S_t* mean,
                                               const S_t* rstd, X_t* dx, long long rows, int d) {
    SS_ROW
    long long base = (ok ? r : 0) * (long long)d;
    A_t mu = SS_LD(mean[ok ? r : 0]), inv = SS_LD(rstd[ok ? r : 0]);
    double sg = 0.0, sgx = 0.0;
    if (ok) for (int j = lane; j < d; j += 32) {
        A_t xh = (SS_LD(x[base + j]) - mu) * inv;
        A_t g = SS_LD(dy[base + j]) * SS_LD(gamma[j]);
        sg += (double)g;
        sgx += (double)(g * xh);
    }
    sg = ss_warp_sum(sg);
    sgx = ss_warp_sum(sgx);
    if (!ok) return;
    A_t mg = (A_t)(sg / (double)d), mgx = (A_t)(sgx / (double)d);
    for (int j = lane; j < d; j += 32) {
        A_t xh = (SS_LD(x[base + j]) - mu) * inv;
        A_t g = SS_LD(dy[base + j]) * SS_LD(gamma[j]);
        ss_put(dx + base + j, inv * (g - mg - xh * mgx));
    }
}

// dgamma[c] = sum over rows of dy xhat: one block of SS_B threads per column, a fixed tree.
extern "C" __global__ void ss_layernorm_grad_gamma(const X_t* dy, const X_t* x, const S_t* mean,
                                                   const S_t* rstd, X_t* dg, long long rows, int d) {
    __shared__ double sh[SS_B];
    int c = blockIdx.x;
    double acc = 0.0;
    for (long long r = threadIdx.x; r < rows; r += SS_B) {
        A_t xh = (SS_LD(x[r * d + c]) - SS_LD(mean[r])) * SS_LD(rstd[r]);
        acc += (double)(SS_LD(dy[r * d + c]) * xh);
    }
    acc = ss_block_sum(acc, sh);
    if (threadIdx.x == 0) ss_put(dg + c, acc);
}
"""

_SRC["softmax"] = _ROW_PRE + r"""
// y = exp(x - max) / sum exp(x - max) over rows of c; one warp per row, the sum in double.
extern "C" __global__ void ss_softmax(const X_t* x, X_t* y, long long rows, int c) {
    SS_ROW
    const X_t* xr = x + (ok ? r : 0) * (long long)c;
    A_t m = -(A_t)SS_INF;
    if (ok) for (int j = lane; j < c; j += 32) m = ss_nmax(m, SS_LD(xr[j]));
    m = ss_warp_max(m);
    double s = 0.0;
    if (ok) for (int j = lane; j < c; j += 32) s += (double)ss_e(SS_LD(xr[j]) - m);
    s = ss_warp_sum(s);
    if (!ok) return;
    A_t den = (A_t)s;
    X_t* yr = y + r * (long long)c;
    for (int j = lane; j < c; j += 32) ss_put(yr + j, ss_e(SS_LD(xr[j]) - m) / den);
}

// dx = y (dy - sum(dy y)) over rows of c.
extern "C" __global__ void ss_softmax_grad(const X_t* dy, const X_t* y, X_t* dx, long long rows, int c) {
    SS_ROW
    long long base = (ok ? r : 0) * (long long)c;
    double s = 0.0;
    if (ok) for (int j = lane; j < c; j += 32) s += (double)(SS_LD(dy[base + j]) * SS_LD(y[base + j]));
    s = ss_warp_sum(s);
    if (!ok) return;
    A_t dot = (A_t)s;
    for (int j = lane; j < c; j += 32) ss_put(dx + base + j, SS_LD(y[base + j]) * (SS_LD(dy[base + j]) - dot));
}

// s[..., i, j] = -inf where j > i (the causal mask), s [b, h, t, t].
extern "C" __global__ void ss_causal_mask(X_t* s, long long size, int t) {
    SS_LOOP(i, size) {
        long long q = i / t;
        int j = (int)(i - q * t);
        int row = (int)(q % t);
        if (j > row) ss_put(s + i, -(A_t)SS_INF);
    }
}
"""

_SRC["clip"] = r"""
// sumsq = sumsq + sum(g^2): one block, thread t adds i = t, t + SS_B, ... in double, a fixed tree.
extern "C" __global__ void ss_grad_sumsq(const X_t* g, const S_t* acc, S_t* out, long long size) {
    __shared__ double sh[SS_B];
    double s = 0.0;
    for (long long i = threadIdx.x; i < size; i += SS_B) { double v = ss_wide(g[i]); s += v * v; }
    s = ss_block_sum(s, sh);
    if (threadIdx.x == 0) ss_put(out, ss_wide(acc[0]) + s);
}

// scale = min(1, max_norm / (sqrt(sumsq) + eps)) in double, NaN propagating (torch.clamp).
extern "C" __global__ void ss_clip_scale(const S_t* sumsq, S_t* scale, double max_norm, double eps) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double s = ss_wide(sumsq[0]);
    double norm = s >= 0.0 ? sqrt(s) : (double)CUDART_NAN;
    double coef = max_norm / (norm + eps);
    ss_put(scale, (coef != coef || coef < 1.0) ? coef : 1.0);
}

// g = g * scale, scale rounded to the compute dtype first (in place).
extern "C" __global__ void ss_scale_grad(const X_t* g, const S_t* scale, X_t* out, long long size) {
    A_t k = (A_t)ss_wide(scale[0]);
    SS_LOOP(i, size) ss_put(out + i, SS_LD(g[i]) * k);
}
"""


def _fn(group: str, name: str, **types):
    """Kernel `name` of _SRC[group] compiled with the typedefs `types` (typedef name -> dtype),
    on cuda_kernels' CNN preamble; module and function cached by (group, typedefs)."""
    import cupy as cp

    k = _kernels()
    tkey = tuple(sorted((t, str(d)) for t, d in types.items()))
    fkey = ("tf", group, tkey, name)
    f = k["_fn"].get(fkey)
    if f is not None:
        return f
    for t, d in tkey:
        if d not in _CNN_CT:
            raise NotImplementedError(f"{name}: dtype {d} ({t}) is not supported on the device")
    mkey = ("tf", group, tkey)
    mod = k["_raw"].get(mkey)
    if mod is None:
        half = any(d == "float16" for _, d in tkey)
        head = "#include <cuda_fp16.h>\n#define SS_HALF 1\n" if half else ""
        head += _HEAD + "".join(f"typedef {_CNN_CT[d]} {t};\n" for t, d in tkey)
        mod = cp.RawModule(code=head + _CNN_PRE + _SRC[group], options=("-std=c++17", "--fmad=false"))
        k["_raw"][mkey] = mod
    f = k["_fn"][fkey] = mod.get_function(name)
    return f


_WARPS = 8  # rows per block of the warp-per-row kernels (256 threads)


def _rows_grid(rows: int) -> tuple[int]:
    return (max(1, -(-int(rows) // _WARPS)),)


def _np():
    import numpy as np

    return np


# -- strided-batched GEMMs on the stream's cuBLAS handle ----------------------------------------

_CONSTS: dict[tuple[str, float], Any] = {}  # host alpha/beta, kept alive (host pointer mode)
_CUDA_R_16F, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT = 2, 68, -1


def _const(dtype: str, value: float) -> int:
    """Host pointer to a constant alpha or beta (frozen into a captured graph, as it should be:
    the factors here are compile-time constants, 1 and 1/sqrt(dh), never per-step values)."""
    np = _np()
    key = (dtype, float(value))
    arr = _CONSTS.get(key)
    if arr is None:
        arr = _CONSTS[key] = np.array([value], dtype=dtype)
    return int(arr.ctypes.data)


def _gemm_heads(ctx, stream, heads: int, seqs: int, m: int, n: int, k: int, alpha: float,
                a, a_off, lda, a_head, a_seq, ta: bool,
                b, b_off, ldb, b_head, b_seq, tb: bool,
                c, c_off, ldc, c_head, c_seq) -> None:
    """For every head h and sequence s: row-major C[h, s] = alpha op(A[h, s]) op(B[h, s]), one
    cuBLAS strided-batched GEMM per head (batched over the `seqs` sequences), on `stream`'s own
    handle (ctx.handle: the stream and the fixed workspace set, so capture allocates nothing).

    X[h, s] is the matrix starting at element X_off + h * X_head + s * X_seq of the CuPy array x
    with row stride ldx; op transposes when ta / tb is set; C is m x n, op(A) m x k, op(B) k x n.
    Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, so cuBLAS gets (B, A) swapped
    with their leading dimensions, as DeviceContext.gemm does.  f32, f64; f16 with f32 compute."""
    from streamsched.interp.cuda.device import cublas

    cb = cublas()
    name = stream if isinstance(stream, str) else ctx._name_of(stream)
    h = ctx.handle(name)
    opa = int(cb.Operation.T if ta else cb.Operation.N)
    opb = int(cb.Operation.T if tb else cb.Operation.N)
    dt = str(a.dtype)
    if not (dt == str(b.dtype) == str(c.dtype)):
        raise ValueError(f"gemm_heads: dtypes differ: {a.dtype} {b.dtype} {c.dtype}")
    size = a.itemsize
    for hd in range(heads):
        pa = a.data.ptr + (a_off + hd * a_head) * size
        pb = b.data.ptr + (b_off + hd * b_head) * size
        pc = c.data.ptr + (c_off + hd * c_head) * size
        if dt == "float32":
            cb.sgemm_strided_batched(h, opb, opa, n, m, k, _const("float32", alpha), pb, ldb, b_seq, pa, lda, a_seq,
                                     _const("float32", 0.0), pc, ldc, c_seq, seqs)
        elif dt == "float64":
            cb.dgemm_strided_batched(h, opb, opa, n, m, k, _const("float64", alpha), pb, ldb, b_seq, pa, lda, a_seq,
                                     _const("float64", 0.0), pc, ldc, c_seq, seqs)
        elif dt == "float16":
            cb.gemm_strided_batched_ex(h, opb, opa, n, m, k, _const("float32", alpha), pb, _CUDA_R_16F, ldb, b_seq,
                                       pa, _CUDA_R_16F, lda, a_seq, _const("float32", 0.0), pc, _CUDA_R_16F, ldc,
                                       c_seq, seqs, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
        else:
            raise NotImplementedError(f"attention: dtype {dt} is not supported on the device")


def _flat_dims(x, heads: int, t: int) -> tuple[int, int, int, int]:
    """(b, n, d, dh) of a flat [b*t, d] activation split into heads."""
    n, d = (int(v) for v in x.shape)
    return n // t, n, d, d // heads


def _checked(name: str, ins, outs) -> None:
    _contiguous(name, tuple(ins) + tuple(outs))
    _disjoint(name, ins, outs)  # cuBLAS reads while it writes


# -- the twins -----------------------------------------------------------------------------------


def _embedding(ctx, stream, ins, outs, attrs):
    np = _np()
    ids, table = ins
    y = outs[0]
    _contiguous("embedding", (ids, table, y))
    _disjoint("embedding", (table,), outs)
    if y.size == 0:
        return
    n, d = int(y.shape[0]), int(y.shape[1])
    f = _fn("emb", "ss_embedding", I_t=ids.dtype, X_t=table.dtype, A_t=_acc_of(table.dtype))
    _go(ctx, stream, f, _grid(y.size), (ids, table, y, np.int64(n), np.int32(d), np.int64(table.shape[0])))


def _embedding_grad(ctx, stream, ins, outs, attrs):
    """Three passes over a zeroed uint64 scratch [vocab + 3 vocab d] (counts, largest
    magnitudes, specials, sums), integer atomics only: bitwise the NumPy twin's result."""
    import cupy as cp

    np = _np()
    dy, ids = ins
    out = outs[0]
    _contiguous("embedding_grad", (dy, ids, out))
    _disjoint("embedding_grad", ins, outs)
    rows, d = int(out.shape[0]), int(out.shape[1])
    n = int(dy.shape[0])
    if out.size == 0:
        return
    with _stream(ctx, stream):
        scratch = cp.empty((rows + 3 * rows * d,), dtype=cp.uint64)
    cnt, mx = scratch[:rows], scratch[rows:rows + rows * d]
    flg, acc = scratch[rows + rows * d:rows + 2 * rows * d], scratch[rows + 2 * rows * d:]
    types = dict(X_t=dy.dtype, I_t=ids.dtype, A_t=_acc_of(dy.dtype))
    _go(ctx, stream, _fn("emb", "ss_zero_u64", **types), _grid(scratch.size), (scratch, np.int64(scratch.size)))
    if n and d:
        args = (dy, ids, cnt, mx, flg, np.int64(n), np.int32(d), np.int64(rows))
        _go(ctx, stream, _fn("emb", "ss_emb_grad_scan", **types), _grid(n * d), args)
        args = (dy, ids, cnt, mx, acc, np.int64(n), np.int32(d), np.int64(rows))
        _go(ctx, stream, _fn("emb", "ss_emb_grad_add", **types), _grid(n * d), args)
    _go(ctx, stream, _fn("emb", "ss_emb_grad_out", **types), _grid(out.size),
        (cnt, mx, flg, acc, out, np.int64(rows), np.int32(d)))


def _pos_embedding(ctx, stream, ins, outs, attrs):
    np = _np()
    x, table = ins
    y = outs[0]
    _contiguous("pos_embedding", (x, table, y))
    _disjoint("pos_embedding", (table,), outs)
    if y.size == 0:
        return
    f = _fn("pos", "ss_pos_add", X_t=x.dtype, A_t=_acc_of(x.dtype))
    _go(ctx, stream, f, _grid(y.size), (x, table, y, np.int64(y.size), np.int64(table.size)))


def _pos_embedding_grad(ctx, stream, ins, outs, attrs):
    np = _np()
    dy, dt = ins[0], outs[0]
    _contiguous("pos_embedding_grad", (dy, dt))
    _disjoint("pos_embedding_grad", ins, outs)
    if dt.size == 0:
        return
    f = _fn("pos", "ss_pos_grad", X_t=dy.dtype, A_t=_acc_of(dy.dtype))
    _go(ctx, stream, f, _grid(dt.size), (dy, dt, np.int64(dy.size // dt.size), np.int64(dt.size)))


def _layernorm(ctx, stream, ins, outs, attrs):
    np = _np()
    x, gamma, beta = ins
    y, mean, rstd = outs
    _contiguous("layernorm", list(ins) + list(outs))
    _disjoint("layernorm", ins, outs)
    d = int(x.shape[-1])
    rows = x.size // d if d else 0
    if rows == 0:
        return
    f = _fn("ln", "ss_layernorm", X_t=x.dtype, S_t=mean.dtype, A_t=_acc_of(x.dtype))
    _go(ctx, stream, f, _rows_grid(rows), (x, gamma, beta, y, mean, rstd, np.int64(rows), np.int32(d),
                                           np.float64(attrs.get("eps", 1e-5))))


def _layernorm_grad_x(ctx, stream, ins, outs, attrs):
    np = _np()
    dy, x, gamma, mean, rstd = ins
    dx = outs[0]
    _contiguous("layernorm_grad_x", list(ins) + [dx])
    _disjoint("layernorm_grad_x", ins, outs)
    d = int(x.shape[-1])
    rows = x.size // d if d else 0
    if rows == 0:
        return
    f = _fn("ln", "ss_layernorm_grad_x", X_t=x.dtype, S_t=mean.dtype, A_t=_acc_of(x.dtype))
    _go(ctx, stream, f, _rows_grid(rows), (dy, x, gamma, mean, rstd, dx, np.int64(rows), np.int32(d)))


def _layernorm_grad_gamma(ctx, stream, ins, outs, attrs):
    np = _np()
    dy, x, mean, rstd = ins
    dg = outs[0]
    _contiguous("layernorm_grad_gamma", list(ins) + [dg])
    _disjoint("layernorm_grad_gamma", ins, outs)
    d = int(x.shape[-1])
    if d == 0:
        return
    f = _fn("ln", "ss_layernorm_grad_gamma", X_t=x.dtype, S_t=mean.dtype, A_t=_acc_of(x.dtype))
    _go(ctx, stream, f, (d,), (dy, x, mean, rstd, dg, np.int64(x.size // d), np.int32(d)))


def _softmax(ctx, stream, ins, outs, attrs):
    np = _np()
    x, y = ins[0], outs[0]
    _contiguous("softmax", (x, y))
    _disjoint("softmax", ins, outs)
    c = int(x.shape[-1])
    rows = x.size // c if c else 0
    if rows == 0:
        return
    f = _fn("softmax", "ss_softmax", X_t=x.dtype, A_t=_acc_of(x.dtype))
    _go(ctx, stream, f, _rows_grid(rows), (x, y, np.int64(rows), np.int32(c)))


def _softmax_grad(ctx, stream, ins, outs, attrs):
    np = _np()
    dy, y = ins
    dx = outs[0]
    _contiguous("softmax_grad", (dy, y, dx))
    _disjoint("softmax_grad", ins, outs)
    c = int(y.shape[-1])
    rows = y.size // c if c else 0
    if rows == 0:
        return
    f = _fn("softmax", "ss_softmax_grad", X_t=y.dtype, A_t=_acc_of(y.dtype))
    _go(ctx, stream, f, _rows_grid(rows), (dy, y, dx, np.int64(rows), np.int32(c)))


def _attn_scores(ctx, stream, ins, outs, attrs):
    """s[b, h] = q_h k_h^T / sqrt(dh), then the causal mask."""
    np = _np()
    q, k = ins
    s = outs[0]
    _checked("attn_scores", ins, outs)
    heads, t = int(attrs["heads"]), int(attrs["context"])
    b, n, d, dh = _flat_dims(q, heads, t)
    if s.size == 0:
        return
    _gemm_heads(ctx, stream, heads, b, t, t, dh, 1.0 / math.sqrt(dh),
                q, 0, d, dh, t * d, False,
                k, 0, d, dh, t * d, True,
                s, 0, t, t * t, heads * t * t)
    if attrs.get("causal", True):
        f = _fn("softmax", "ss_causal_mask", X_t=s.dtype, A_t=_acc_of(s.dtype))
        _go(ctx, stream, f, _grid(s.size), (s, np.int64(s.size), np.int32(t)))


def _pv_dims(p, x):
    b, heads, t = int(p.shape[0]), int(p.shape[1]), int(p.shape[2])
    _, n, d, dh = _flat_dims(x, heads, t)
    return b, heads, t, d, dh


def _attn_apply(ctx, stream, ins, outs, attrs):
    """o_h = p v_h."""
    p, v = ins
    o = outs[0]
    _checked("attn_apply", ins, outs)
    b, heads, t, d, dh = _pv_dims(p, v)
    if o.size == 0:
        return
    _gemm_heads(ctx, stream, heads, b, t, dh, t, 1.0,
                p, 0, t, t * t, heads * t * t, False,
                v, 0, d, dh, t * d, False,
                o, 0, d, dh, t * d)


def _attn_grad_p(ctx, stream, ins, outs, attrs):
    """dp = do_h v_h^T."""
    do, v = ins
    dp = outs[0]
    _checked("attn_grad_p", ins, outs)
    heads, t = int(attrs["heads"]), int(attrs["context"])
    b, n, d, dh = _flat_dims(do, heads, t)
    if dp.size == 0:
        return
    _gemm_heads(ctx, stream, heads, b, t, t, dh, 1.0,
                do, 0, d, dh, t * d, False,
                v, 0, d, dh, t * d, True,
                dp, 0, t, t * t, heads * t * t)


def _attn_grad_v(ctx, stream, ins, outs, attrs):
    """dv_h = p^T do_h."""
    p, do = ins
    dv = outs[0]
    _checked("attn_grad_v", ins, outs)
    b, heads, t, d, dh = _pv_dims(p, do)
    if dv.size == 0:
        return
    _gemm_heads(ctx, stream, heads, b, t, dh, t, 1.0,
                p, 0, t, t * t, heads * t * t, True,
                do, 0, d, dh, t * d, False,
                dv, 0, d, dh, t * d)


def _attn_grad_q(ctx, stream, ins, outs, attrs):
    """dq_h = ds k_h / sqrt(dh)."""
    ds, k = ins
    dq = outs[0]
    _checked("attn_grad_q", ins, outs)
    b, heads, t, d, dh = _pv_dims(ds, k)
    if dq.size == 0:
        return
    _gemm_heads(ctx, stream, heads, b, t, dh, t, 1.0 / math.sqrt(dh),
                ds, 0, t, t * t, heads * t * t, False,
                k, 0, d, dh, t * d, False,
                dq, 0, d, dh, t * d)


def _attn_grad_k(ctx, stream, ins, outs, attrs):
    """dk_h = ds^T q_h / sqrt(dh)."""
    ds, q = ins
    dk = outs[0]
    _checked("attn_grad_k", ins, outs)
    b, heads, t, d, dh = _pv_dims(ds, q)
    if dk.size == 0:
        return
    _gemm_heads(ctx, stream, heads, b, t, dh, t, 1.0 / math.sqrt(dh),
                ds, 0, t, t * t, heads * t * t, True,
                q, 0, d, dh, t * d, False,
                dk, 0, d, dh, t * d)


_ADAMW: list = []


def _adamw_kernel():
    if not _ADAMW:
        import cupy as cp

        _ADAMW.append(cp.ElementwiseKernel(
            "T g, L lr, S t, float64 b1, float64 b2, float64 eps, float64 wd", "T w, T m, T v",
            """T wdec = wd != 0.0 ? w * (T)(1.0 - (double)lr * wd) : w;
            T mn = m + (T)(1.0 - b1) * (g - m);
            T vn = v * (T)b2 + (T)(1.0 - b2) * g * g;
            double tt = (double)t;
            T step_size = (T)((double)lr / (1.0 - pow(b1, tt)));
            T denom = sqrt(vn) / (T)sqrt(1.0 - pow(b2, tt)) + (T)eps;
            m = mn;
            v = vn;
            w = wdec - step_size * (mn / denom)""",
            "ss_adamw_step"))
    return _ADAMW[0]


def _adamw_step(ctx, stream, ins, outs, attrs):
    w, dw, m, v, lr, t = ins
    w_out, m_out, v_out = outs
    with _stream(ctx, stream):
        _same_or_copy(w, w_out)
        _same_or_copy(m, m_out)
        _same_or_copy(v, v_out)
        _adamw_kernel()(dw, lr, t, float(attrs.get("beta1", 0.9)), float(attrs.get("beta2", 0.999)),
                        float(attrs.get("eps", 1e-8)), float(attrs.get("weight_decay", 0.01)), w_out, m_out, v_out)


def _grad_sumsq(ctx, stream, ins, outs, attrs):
    np = _np()
    g, acc = ins
    out = outs[0]
    _contiguous("grad_sumsq", (g,))
    f = _fn("clip", "ss_grad_sumsq", X_t=g.dtype, S_t=acc.dtype, A_t=_acc_of(g.dtype))
    _go(ctx, stream, f, (1,), (g, acc, out, np.int64(g.size)))


def _clip_scale(ctx, stream, ins, outs, attrs):
    np = _np()
    f = _fn("clip", "ss_clip_scale", X_t=ins[0].dtype, S_t=ins[0].dtype, A_t=_acc_of(ins[0].dtype))
    _go(ctx, stream, f, (1,), (ins[0], outs[0], np.float64(attrs.get("max_norm", 1.0)),
                               np.float64(attrs.get("eps", 1e-6))))


def _scale_grad(ctx, stream, ins, outs, attrs):
    np = _np()
    g, scale = ins
    out = outs[0]
    _contiguous("scale_grad", (g, out))
    if out.size == 0:
        return
    if out.data.ptr != g.data.ptr and _overlap(out.data.ptr, out.nbytes, g.data.ptr, g.nbytes):
        raise ValueError("scale_grad: the output partly overlaps the gradient")
    f = _fn("clip", "ss_scale_grad", X_t=g.dtype, S_t=scale.dtype, A_t=_acc_of(g.dtype))
    _go(ctx, stream, f, _grid(out.size), (g, scale, out, np.int64(out.size)))


CUDA_KERNELS: dict[str, Callable] = {
    "embedding": _embedding,
    "embedding_grad": _embedding_grad,
    "pos_embedding": _pos_embedding,
    "pos_embedding_grad": _pos_embedding_grad,
    "layernorm": _layernorm,
    "layernorm_grad_x": _layernorm_grad_x,
    "layernorm_grad_gamma": _layernorm_grad_gamma,
    "softmax": _softmax,
    "softmax_grad": _softmax_grad,
    "attn_scores": _attn_scores,
    "attn_apply": _attn_apply,
    "attn_grad_p": _attn_grad_p,
    "attn_grad_v": _attn_grad_v,
    "attn_grad_q": _attn_grad_q,
    "attn_grad_k": _attn_grad_k,
    "adamw_step": _adamw_step,
    "grad_sumsq": _grad_sumsq,
    "clip_scale": _clip_scale,
    "scale_grad": _scale_grad,
}
"""Kernel name -> CUDA twin; `Kernel.cuda` ("streamsched.stdlib.cuda_kernels_transformer:NAME")
resolves to the module attribute of the same name, set below."""

for _name, _f in CUDA_KERNELS.items():
    globals()[_name] = _f
del _name, _f
