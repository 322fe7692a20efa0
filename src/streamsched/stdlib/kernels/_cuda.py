"""What the CUDA twins of every family share: the calling convention and capture rules below, the
caches of compiled modules, streams, the dense helpers (column sums, row broadcasts) and the raw
CNN-kernel machinery.  Each family module's CUDA twins, `<kernel>_cuda`, are written so that they
can be captured into a CUDA graph, with the same semantics as its NumPy twins.

Calling convention: `fn(ctx, stream, ins, outs, attrs)`: ctx a
`streamsched.interp.cuda.device.DeviceContext`, stream a stream name (or CuPy stream), ins/outs
CuPy arrays (NumPy pinned arrays for host buffers of h2d/d2h), attrs with defaults filled in.
Outputs are preallocated; an output may be the very array of an input (in-place updates).

Capture rules kept here (CUDA_PITFALLS.md): GEMMs go through the context's per-stream cuBLAS
handle (rule 1), copies through cudaMemcpyAsync (rule 8), nothing allocates from a memory pool
(custom Elementwise/Reduction/Raw kernels with outputs given; no CUB; the one scratch, the
per-row losses of softmax_xent, is made before capture outside every pool: see loss's `_xent_rows`;
the convolutions' im2col / col2im temporaries are the exception: they come from the current
pool, under the executor the captured graph's own: see conv's `_conv2d_gemm`),
and step-varying scalars (lr, t, dloss) are read from device memory inside the kernels, never
turned into Python floats (rule 3).  Every reduction has a fixed order (no atomics): results are
bitwise the same from run to run.  Compile-time attributes (alpha, momentum, ...) are kernel
arguments and are frozen into a captured graph, as they should be.

CuPy is imported on first use; the kernel objects are built once and cached.
"""

from __future__ import annotations

from typing import Any

from streamsched.interp.env_choice import EnvChoice

_K: dict[str, Any] = {}


def _kernels() -> dict[str, Any]:
    """The shared caches and the two memory kernels any family may use (copy, fill), built once
    (compilation itself happens per dtype on first launch, which is why the executor warms every
    task up before capture); each family with elementwise kernels of its own builds them alike."""
    if _K:
        return _K
    import cupy as cp

    E = cp.ElementwiseKernel
    k = _K
    k["copy"] = E("T a", "T b", "b = a", "ss_copy")
    k["fill"] = E("float64 v", "T y", "y = (T)v", "ss_fill")
    k["_raw"] = {}  # RawModules by (kind, dtype[, label dtype])
    k["_fn"] = {}   # their kernels by (kind, dtype, label dtype, name)
    k["_sms"] = {}  # device id -> multiprocessor count
    return k


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

// Skinny GEMMs, which are bound by memory, not by arithmetic (cuBLAS's heuristics tile them
// like square ones: the classifier's input gradient [2048, 10] @ [10, 1024] took 34 us on the
// H200, its memory traffic 3).  A(i, kk) = a[i * sa_i + kk * sa_k], B(kk, j) = b[kk * sb_k +
// j * sb_j] (the strides say the transposes); c: C-contiguous [m, n]; each sum in kk order,
// fused multiply-adds in A_t: bitwise the same from run to run.
//
// ss_gemm_smallk (k <= 32): a block of 32 x 8 threads owns a tile of 32 rows and 32 * un
// columns (un <= 4) of c, stepping over the rows' tiles by gridDim.y.  It copies B's k x 32un
// tile into shared memory once (Bs[kk * bs + jj], bs = 32un + 1) and each tile of A (32 x k,
// As[kk * 33 + r]) before computing it, both read in memory order (coalesced) whichever of the
// strides is 1, both padded so that the fills hit distinct banks; thread (x, y) then adds the
// k products of its 4 x un outputs c[i0 + y + 8v, j0 + x + 32u] (A's value a broadcast, B's
// consecutive banks) and stores each row's 32 consecutive floats.  The work a thread has in
// flight is 4un outputs, not one: the one-output-per-thread kernel this replaces was latency
// bound (51 us for [2048, 10] @ [10, 1024] on the H200, cuBLAS 29).  g, when not null, gates
// the result as relu_grad does: c = g > 0 ? sum : 0 (g like c).
extern "C" __global__ void ss_gemm_smallk(const T_t* a, const T_t* b, T_t* c, const T_t* g,
                                          long long m, long long n, int k, long long sa_i,
                                          long long sa_k, long long sb_k, long long sb_j, int un) {
    extern __shared__ unsigned char ss_smem[];
    int cn = 32 * un, bs = cn + 1;
    T_t* Bs = reinterpret_cast<T_t*>(ss_smem);
    T_t* As = Bs + k * bs;
    int x = threadIdx.x, y = threadIdx.y, t = y * 32 + x;
    long long j0 = (long long)blockIdx.x * cn;
    for (int e = t; e < k * cn; e += 256) {
        int kk, jj;
        if (sb_k == 1) { jj = e / k; kk = e - jj * k; } else { kk = e / cn; jj = e - kk * cn; }
        Bs[kk * bs + jj] = j0 + jj < n ? b[kk * sb_k + (j0 + jj) * sb_j] : (T_t)0;
    }
    for (long long i0 = (long long)blockIdx.y * 32; i0 < m; i0 += (long long)gridDim.y * 32) {
        __syncthreads();  // Bs filled; the previous tile's As read
        for (int e = t; e < 32 * k; e += 256) {
            int kk, r;
            if (sa_k == 1) { r = e / k; kk = e - r * k; } else { kk = e / 32; r = e - kk * 32; }
            As[kk * 33 + r] = i0 + r < m ? a[(i0 + r) * sa_i + kk * sa_k] : (T_t)0;
        }
        __syncthreads();
        // The gate's values are loaded here, all 4un at once, before the products: loaded
        // next to each store they were 4un dependent round trips to memory a tile (c and g
        // may alias as far as the compiler knows), 11.6 us for the gated [128, 10] @ [10, 1024]
        // in the batch-128 step where the ungated product takes 3.5.
        bool keep[4][4];
#pragma unroll
        for (int v = 0; v < 4; ++v)
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                long long i = i0 + y + 8 * v, j = j0 + x + 32 * u;
                keep[v][u] = g == nullptr || (u < un && i < m && j < n && (A_t)g[i * n + j] > (A_t)0);
            }
        A_t acc[4][4];
#pragma unroll
        for (int v = 0; v < 4; ++v)
#pragma unroll
            for (int u = 0; u < 4; ++u) acc[v][u] = (A_t)0;
        for (int kk = 0; kk < k; ++kk) {
            A_t bv[4], av[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) bv[u] = u < un ? (A_t)Bs[kk * bs + x + 32 * u] : (A_t)0;
#pragma unroll
            for (int v = 0; v < 4; ++v) av[v] = (A_t)As[kk * 33 + y + 8 * v];
#pragma unroll
            for (int v = 0; v < 4; ++v)
#pragma unroll
                for (int u = 0; u < 4; ++u) acc[v][u] = fma(av[v], bv[u], acc[v][u]);
        }
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            long long i = i0 + y + 8 * v;
            if (i >= m) continue;
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                long long j = j0 + x + 32 * u;
                if (u >= un || j >= n) continue;
                c[i * n + j] = keep[v][u] ? (T_t)acc[v][u] : (T_t)0;
            }
        }
    }
}

// ss_gemm_smalln (n <= 32, A's rows contiguous: sa_k == 1): warp w of block owns rows
// blockIdx.x * 8 + w, stepping by gridDim.x * 8; B is brought into shared memory kc_max rows of
// k at a time (Bs[r * ns + j], ns = n | 1 so that lanes reading row r, r + 1, ... hit distinct
// banks); lane l adds the products of kk = l, l + 32, ... of each chunk for every column j (n
// partial sums in registers), and each column's 32 partials are added by a fixed butterfly.
extern "C" __global__ void ss_gemm_smalln(const T_t* a, const T_t* b, T_t* c, long long m, int n,
                                          long long k, long long sa_i, long long sb_k,
                                          long long sb_j, int kc_max) {
    extern __shared__ unsigned char ss_smem[];
    T_t* Bs = reinterpret_cast<T_t*>(ss_smem);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nt = blockDim.x;
    int ns = n | 1;
    for (long long i0 = (long long)blockIdx.x * 8; i0 < m; i0 += (long long)gridDim.x * 8) {
        long long i = i0 + w;
        A_t acc[32];
#pragma unroll
        for (int jj = 0; jj < 32; ++jj) acc[jj] = (A_t)0;
        for (long long k0 = 0; k0 < k; k0 += kc_max) {
            int kc = (int)(k - k0 < kc_max ? k - k0 : kc_max);
            __syncthreads();
            for (int e = threadIdx.x; e < kc * n; e += nt) {
                int r = e / n, jj = e - r * n;
                Bs[r * ns + jj] = b[(k0 + r) * sb_k + jj * sb_j];
            }
            __syncthreads();
            if (i < m) {
                const T_t* pa = a + i * sa_i + k0;
                for (int r = lane; r < kc; r += 32) {
                    A_t av = (A_t)pa[r];
                    const T_t* pb = Bs + r * ns;
#pragma unroll
                    for (int jj = 0; jj < 32; ++jj)
                        if (jj < n) acc[jj] = fma(av, (A_t)pb[jj], acc[jj]);
                }
            }
        }
        if (i < m) {
            A_t mine = (A_t)0;
#pragma unroll
            for (int jj = 0; jj < 32; ++jj) {
                if (jj < n) {
                    A_t v = acc[jj];
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                    if (lane == jj) mine = v;
                }
            }
            if (lane < n) c[i * n + lane] = (T_t)mine;
        }
    }
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

// ss_ew4: c = a OP b element by element over n4 float4s (f32, every operand 16-byte aligned, c
// a itself or apart): OP 0 +, 1 -, 2 * (ss_op), 3 relu_grad (b > 0 ? a : 0, a = dy, b = the
// forward's output), 4 relu (a < 0 ? 0 : a; b unused).  Each component is the scalar
// ElementwiseKernel's expression, so results are bitwise CuPy's; the 16-byte accesses move
// the bytes at a bandwidth CuPy's 4-byte ones do not reach (relu_grad of 2048 x 1024 floats on
// the H200: 11.2 us by CuPy's kernel, 4.0 by this one, in a captured graph of 20).
__device__ __forceinline__ float ss_ew(float a, float b, int op) {
    return op < 3 ? ss_op(a, b, op) : (op == 3 ? (b > 0.f ? a : 0.f) : (a < 0.f ? 0.f : a));
}
extern "C" __global__ void ss_ew4(const float4* a, const float4* b, float4* c, long long n4, int op) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (long long)gridDim.x * blockDim.x) {
        float4 x = a[i], y = op == 4 ? x : b[i], r;
        r.x = ss_ew(x.x, y.x, op); r.y = ss_ew(x.y, y.y, op);
        r.z = ss_ew(x.z, y.z, op); r.w = ss_ew(x.w, y.w, op);
        c[i] = r;
    }
}
#endif
"""


_CTYPES = {"float32": ("float", "float"), "float64": ("double", "double"),
           "float16": ("__half", "float")}

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


def _function(kind: str, dtype, ltype, name: str, dltype=None):
    """A kernel of the dense module (kind "dense"), cached by (module, dtype(s), name); the loss
    family caches its xent module's kernels in the same table."""
    fns = _kernels()["_fn"]
    key = (kind, str(dtype), str(ltype), name, str(dltype))
    f = fns.get(key)
    if f is None:
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


# -- helpers ---------------------------------------------------------------------------------

def _cublas():
    """nvmath-python's cuBLAS bindings (`interp.cuda.device.cublas`), imported on first use, for
    twins that call cuBLAS themselves on the stream's own handle `ctx.handle(name)` (the
    transformer's strided-batched attention GEMMs); DeviceContext.gemm covers the plain GEMMs."""
    from streamsched.interp.cuda.device import cublas

    return cublas()


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


SKINNY_K = 32
"""ss_gemm_smallk takes products whose contracted dimension is at most this."""
SKINNY_N = 32
"""ss_gemm_smalln takes products with at most this many output columns (and m >= SKINNY_ROWS)."""
SKINNY_ROWS = 256
SKINNY_MAX_OUT = 1 << 18
"""ss_gemm_smallk takes outputs of at most this many elements, and larger ones only where its
tile is 128 columns wide (`_smallk_columns(n) == 4`: 4 columns a thread) and k <= SKINNY_WIDE_K.  Measured on the H200 (session 12,
docs/performance.md; µs of one product, the kernel against cuBLAS): [128, 10] @ [10, 1024] 3.5 /
7.4 and [2048, 10] @ [10, 1024] 6.4 / 28.5 (the batch-2048 MLP step 543 -> 522 us), but
[4096, 32] @ [32, 512] 12.5 / 7.9, [50176, 16] @ [16, 144] 64 / 17 and [50176, 9] @ [9, 16]
12.1 / 4.6: where cuBLAS tiles the product well, the kernel loses."""
SKINNY_WIDE_K = 16


SKINNY_ENV = "STREAMSCHED_SKINNY_GEMM"
SKINNY = EnvChoice(SKINNY_ENV, ("1", "all", "0"), "1")
"""`1` (the default, also empty): products with k <= SKINNY_K run ss_gemm_smallk; `all`: products
with n <= SKINNY_N run ss_gemm_smalln too; `0`: every product runs cuBLAS.  Case and spaces are
ignored; any other value is refused (X004)."""


SMALLK_BLOCKS_PER_SM = 16
"""ss_gemm_smallk's grid has at most this many blocks per SM (each then steps over row tiles)."""


def _smallk_columns(n: int) -> int:
    """ss_gemm_smallk's columns per thread, un in 1..4 (a block's tile is 32 * un wide): the one
    that wastes the fewest threads on columns past n, the widest of equals."""
    return min(range(4, 0, -1), key=lambda u: -(-n // (32 * u)) * 32 * u - n)


def _smallk_launch_columns(m: int, n: int, sms: int) -> int:
    """The columns per thread ss_gemm_smallk launches with: `_smallk_columns(n)`, or a narrower
    tile where that one's grid (tiles of 32 rows by 32 * un columns) would leave SMs idle: of the
    narrower ones whose grid has at least `sms` blocks, the one that wastes the fewest threads on
    columns past n (the widest of equals), else 1.  [128, 10] @ [10, 1024]:
    8 x 4 = 32 blocks with un = 4 for 132 SMs, 128 with un = 1.  Each output's sum is the same
    whatever the tile, so the choice never changes a bit of the result."""
    tiles = -(-m // 32)
    fills = [u for u in range(_smallk_columns(n), 0, -1) if -(-n // (32 * u)) * tiles >= sms]
    return min(fills, key=lambda u: -(-n // (32 * u)) * 32 * u - n) if fills else 1  # (the widest: first)


def _skinny_on() -> bool:
    return SKINNY.get() != "0"


def _smalln_on() -> bool:
    return SKINNY.get() == "all"


def _skinny_case(a, b, c, ta: bool = False, tb: bool = False, gate=None):
    """Which skinny kernel takes c = op(a) @ op(b) (`_skinny_gemm`'s rule): "smallk", "smalln" or
    None (cuBLAS does it)."""
    if not _skinny_on() or a.ndim != 2 or b.ndim != 2 or c.ndim != 2:
        return None
    dt = str(c.dtype)
    if dt not in _DENSE or a.dtype != c.dtype or b.dtype != c.dtype:
        return None
    if not (a.flags.c_contiguous and b.flags.c_contiguous and c.flags.c_contiguous):
        return None
    if gate is not None and (gate.shape != c.shape or gate.dtype != c.dtype or not gate.flags.c_contiguous):
        return None
    m, k = (a.shape[1], a.shape[0]) if ta else a.shape
    k2, n = (b.shape[1], b.shape[0]) if tb else b.shape
    if k != k2 or c.shape != (m, n) or m == 0 or n == 0 or k == 0:
        return None
    if k <= SKINNY_K and (m * n <= SKINNY_MAX_OUT or (_smallk_columns(n) == 4 and k <= SKINNY_WIDE_K)):
        return "smallk"
    if gate is None and n <= SKINNY_N and m >= SKINNY_ROWS and not ta and _smalln_on():
        return "smalln"
    return None


EW4_OPS = {"add": 0, "sub": 1, "mul": 2, "relu_grad": 3, "relu": 4}
"""The elementwise kernels ss_ew4 takes (`ew4`), by their op code (accumulate runs add's twin)."""


def ew4(ctx, stream, name: str, ins, out) -> bool:
    """out = name(*ins) by ss_ew4 (16-byte loads and stores) for f32 C-contiguous operands of one
    shape whose element count is a multiple of 4, every pointer 16-byte aligned, out each input
    itself or apart from it; False (nothing launched) for any other case, or a kernel it does not
    take (EW4_OPS).  Bitwise the ElementwiseKernel's result (the same expression per element)."""
    import numpy as np

    op = EW4_OPS.get(name)
    if op is None or out.dtype != np.float32 or not out.flags.c_contiguous or out.size % 4 or out.size == 0:
        return False
    for x in ins:
        if x.dtype != np.float32 or x.shape != out.shape or not x.flags.c_contiguous or x.data.ptr % 16:
            return False
        if x.data.ptr != out.data.ptr and _overlap(x.data.ptr, x.nbytes, out.data.ptr, out.nbytes):
            return False
    if out.data.ptr % 16:
        return False
    n4 = out.size // 4
    blocks = max(1, min(-(-n4 // 256), 16 * _sm_count(out.data.device_id)))
    f = _function("dense", out.dtype, None, "ss_ew4")
    b = ins[1] if len(ins) > 1 else ins[0]
    with _stream(ctx, stream):
        f((blocks, 1, 1), (256, 1, 1), (ins[0], b, out, np.int64(n4), np.int32(op)))
    return True


def _skinny_gemm(ctx, stream, a, b, c, ta: bool = False, tb: bool = False, gate=None) -> bool:
    """c = op(a) @ op(b) (gated by relu_grad's rule, c = gate > 0 ? c : 0, when `gate` is given)
    for f32 / f64 C-contiguous 2-D arrays when the product is skinny: k <= SKINNY_K
    and m * n <= SKINNY_MAX_OUT, or a 128-column tile and k <= SKINNY_WIDE_K (ss_gemm_smallk),
    or, with STREAMSCHED_SKINNY_GEMM=all, n <= SKINNY_N with m >= SKINNY_ROWS and A's rows
    contiguous (ss_gemm_smalln, not ta; never gated).  False when the case is not one it covers
    (cuBLAS then does it; STREAMSCHED_SKINNY_GEMM=0 sends every product there).  c must not
    overlap a, b or gate (ValueError, as DeviceContext.gemm)."""
    import numpy as np

    case = _skinny_case(a, b, c, ta, tb, gate)
    if case is None:
        return False
    for x in (a, b) + ((gate,) if gate is not None else ()):
        if _overlap(c.data.ptr, c.nbytes, x.data.ptr, x.nbytes):
            raise ValueError("gemm: the output shares memory with an input")
    m, k = (a.shape[1], a.shape[0]) if ta else a.shape
    n = b.shape[0] if tb else b.shape[1]
    sa_i, sa_k = (1, m) if ta else (k, 1)
    sb_k, sb_j = (1, k) if tb else (n, 1)
    sms = _sm_count(c.data.device_id)
    item = c.dtype.itemsize
    if case == "smallk":
        f = _function("dense", c.dtype, None, "ss_gemm_smallk")
        un = _smallk_launch_columns(m, n, sms)
        gx = -(-n // (32 * un))
        gy = max(1, min(-(-m // 32), 65535, -(-SMALLK_BLOCKS_PER_SM * sms // gx)))
        with _stream(ctx, stream):
            f((gx, gy, 1), (32, 8, 1), (a, b, c, np.uint64(0) if gate is None else gate, np.int64(m), np.int64(n),
                                        np.int32(k), np.int64(sa_i), np.int64(sa_k), np.int64(sb_k), np.int64(sb_j),
                                        np.int32(un)),
              shared_mem=(k * (32 * un + 1) + 33 * k) * item)
        return True
    f = _function("dense", c.dtype, None, "ss_gemm_smalln")
    blocks = max(1, min(-(-m // 8), 8 * sms))  # 8 warps a block, a warp per row
    kc = max(32, min(256, (32 << 10) // ((n | 1) * item)))  # B's chunk: at most 32 KiB
    with _stream(ctx, stream):
        f((blocks, 1, 1), (256, 1, 1), (a, b, c, np.int64(m), np.int32(n), np.int64(k),
                                         np.int64(sa_i), np.int64(sb_k), np.int64(sb_j), np.int32(kc)),
          shared_mem=kc * (n | 1) * item)
    return True


def _gemm(ctx, stream, a, b, c, ta: bool = False, tb: bool = False) -> None:
    """c = op(a) @ op(b) for 2-D row-major arrays: `_skinny_gemm` where it applies, else the
    stream's cuBLAS / cuBLASLt GEMM (`DeviceContext.gemm`, which raises ValueError on shapes
    that do not fit or an output that overlaps an input)."""
    if ctx is not None and _skinny_gemm(ctx, stream, a, b, c, ta, tb):
        return
    ctx.gemm(stream, a, b, c, ta, tb)


def _same_or_copy(src, dst) -> None:
    """Make dst hold src before an in-place kernel runs on dst (outs given apart from ins)."""
    if dst is not src:
        _kernels()["copy"](src, dst)


# -- the raw kernels of conv, pooling, normalization, dropout, LARS/EMA/AMP and mixed precision -----
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
"""Raw CUDA source by group; each family module adds its own groups (`_CNN_SRC["pool"] = ...`)."""


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


# Sums over the rows of a channels-last x [m, c] (batch norm's statistics and gradient, conv2d's
# bias gradient) for Hopper and later (sm_90+):
# one thread-block cluster of SS_K blocks per tile of w channels (w a power of two <= 32, the
# fewest that covers c), SS_T threads a block as (row lane lr, channel lane lc), t = lr*w + lc.
# A warp reads 32/w whole rows of the tile: coalesced, where the one-block-per-channel kernels
# read one float in every c.  Cluster rank q owns rows q*nr + lr, stepping SS_K*nr (nr = SS_T/w);
# a thread keeps its first SS_U rows in registers, so the later passes re-read only the rest.
# A sum over rows: each thread's rows in order in double, fixed shuffle trees over the row
# lanes of a warp and over the warps, then the SS_K blocks' partials read through distributed
# shared memory in rank order; every block of the cluster gets the same total, bitwise, and the
# result is deterministic (the order depends on c and the dtype, not on the run).  No atomics, no scratch.  Source: CUDA C++
# Programming Guide, "Thread Block Clusters" and "Distributed Shared Memory"; PTX ISA
# (barrier.cluster, mapa, ld.shared::cluster).
_CLUSTER_PRE = r"""
#define SS_K 8
#define SS_U 8
// 1024 threads a block, 512 when the compute type is double (its register arrays are twice
// as wide); every kernel below is launched with exactly SS_T threads.
constexpr int SS_T = sizeof(A_t) == 8 ? 512 : 1024;
constexpr int SS_NW = SS_T / 32;
__device__ __forceinline__ unsigned ss_cl_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void ss_cl_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
                 ::: "memory");
}
__device__ __forceinline__ void ss_cl_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void ss_cl_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The generic address of *p in the shared memory of cluster block `rank`.
__device__ __forceinline__ const double* ss_cl_at(const double* p, unsigned rank) {
    const double* r;
    asm volatile("mapa.u64 %0, %1, %2;" : "=l"(r) : "l"(p), "r"(rank));
    return r;
}
// Where a cluster kernel's thread works (grid (SS_K, channel tiles), SS_T threads, w channels a
// tile): thread t is row lane t / w and channel lane lc of cluster rank q; its channel ch (on:
// ch < c); its rows r0, r0 + step, ... (the first SS_U in registers, then chunks of big rows).
#define SS_CL_HEAD \
    int t = threadIdx.x, lc = t % w, nr = SS_T / w; \
    unsigned q = ss_cl_rank(); \
    int ch = blockIdx.y * w + lc; \
    bool on = ch < c; \
    long long r0 = (long long)q * nr + t / w, step = (long long)SS_K * nr, big = SS_U * step;
// Totals over the cluster of v[0..NV) for this thread's channel lane (t % w), in one fixed
// order: a thread's rows in order, the row lanes of a warp by a shuffle tree, the SS_NW warps by
// a second shuffle tree (warp j sums channels j, j + SS_NW, ...), then ranks 0..SS_K-1 in order from distributed
// shared memory.  cl: this reduction's [NV*32] partials, read by the other blocks until they pass
// the next cluster barrier (the caller's next ss_cl_total, or its final ss_cl_wait after
// ss_cl_arrive): a kernel alternates two cl buffers and ends with arrive ... wait.
template <int NV>
__device__ __forceinline__ void ss_cl_total(double* v, int w, double* sh, double* cl, double* tot) {
    int t = threadIdx.x, lane = t & 31, wid = t >> 5;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        for (int off = 16; off >= w; off >>= 1) v[j] += __shfl_down_sync(0xffffffffu, v[j], off);
        if (lane < w) sh[j * 1024 + wid * w + lane] = v[j];
    }
    __syncthreads();
    for (int cj = wid; cj < w; cj += SS_NW) {
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            double a = lane < SS_NW ? sh[j * 1024 + lane * w + cj] : 0.0;
            for (int off = 16; off > 0; off >>= 1) a += __shfl_down_sync(0xffffffffu, a, off);
            if (lane == 0) cl[j * 32 + cj] = a;
        }
    }
    ss_cl_sync();
    if (t < w) {
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            double a[SS_K];
#pragma unroll
            for (int q = 0; q < SS_K; ++q) a[q] = *ss_cl_at(cl + j * 32 + t, q);
            double s = 0.0;
#pragma unroll
            for (int q = 0; q < SS_K; ++q) s += a[q];
            tot[j * 32 + t] = s;
        }
    }
    __syncthreads();
    int lc = t % w;
#pragma unroll
    for (int j = 0; j < NV; ++j) v[j] = tot[j * 32 + lc];
}

"""


CLUSTER = True
"""Use the cluster kernels (ss_bn_train_cl, ss_bn_grad_cl, ss_sum_nhw_cl) on devices of compute
capability 9.0 and later; False keeps the one-block-per-channel kernels everywhere (tests turn
it off to check one against the other)."""

_CL_K = 8  # SS_K


CLUSTER_ROWS = {"batchnorm": 2048, "sum_nhw": 8192}
"""The fewest rows per channel (x.size / c) for which the cluster kernels run: below them the
one-block-per-channel kernels are faster.  Measured on the H200 (us per launch in a graph, block
/ cluster): batch norm forward at 1024 rows x 16 channels 3.8 / 5.9, at 4096 9.5 / 6.4; sum_nhw
at 4096 x 16 2.6 / 3.4, at 25088 x 64 15.1 / 12.3.  The cluster kernels take about 3 us however
small the problem (their barriers and exchanges; an empty kernel takes 0.7 us)."""


def _cluster_tile(x, kind: str = "batchnorm") -> int | None:
    """The channel-tile width w of the cluster kernels for x [..., c] on its device, or None
    where they do not run (CLUSTER off, a device before sm_90, no channels, fewer rows per
    channel than CLUSTER_ROWS[kind], more than 65535 tiles)."""
    if not CLUSTER or x.ndim == 0 or int(x.shape[-1]) == 0:
        return None
    if x.size // int(x.shape[-1]) < CLUSTER_ROWS[kind]:
        return None
    caps = _kernels().setdefault("_cc", {})
    dev = x.data.device_id
    cc = caps.get(dev)
    if cc is None:
        import cupy as cp

        cc = caps[dev] = int(cp.cuda.Device(dev).compute_capability)
    if cc < 90:
        return None
    c, w = int(x.shape[-1]), 1
    while w < c and w < 32:
        w *= 2
    if -(-c // w) > 65535:  # the tiles are gridDim.y
        return None
    return w


def _go_cluster(ctx, stream, f, c: int, w: int, acc: str, args) -> None:
    """Launch a cluster kernel: SS_K blocks (one cluster) per tile of w channels, SS_T threads
    (512 when the compute type `acc` is float64, else 1024)."""
    with _stream(ctx, stream):
        f((_CL_K, -(-c // w), 1), (512 if acc == "float64" else 1024, 1, 1), args)
