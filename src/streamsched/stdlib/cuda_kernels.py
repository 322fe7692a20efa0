"""The CUDA twin of every kernel in `streamsched.stdlib.kernels.KERNELS`, same name, same
semantics, written so that it can be captured into a CUDA graph.

Calling convention: `fn(ctx, stream, ins, outs, attrs)`: ctx a
`streamsched.interp.cuda.device.DeviceContext`, stream a stream name (or CuPy stream), ins/outs
CuPy arrays (NumPy pinned arrays for host buffers of h2d/d2h), attrs with defaults filled in.
Outputs are preallocated; an output may be the very array of an input (in-place updates).

Capture rules kept here (CUDA_PITFALLS.md): GEMMs go through the context's per-stream cuBLAS
handle (rule 1), copies through cudaMemcpyAsync (rule 8), nothing allocates (custom
Elementwise/Reduction/Raw kernels with outputs given; no CUB), and step-varying scalars (lr, t,
dloss) are read from device memory inside the kernels, never turned into Python floats
(rule 3).  Compile-time attributes (alpha, momentum, ...) are kernel arguments and are frozen
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
    k["_raw"] = {}
    return k


# -- softmax cross-entropy: raw kernels, one warp per row ------------------------------------

_XENT_SRC = r"""
__device__ __forceinline__ float ss_exp(float x) { return expf(x); }
__device__ __forceinline__ double ss_exp(double x) { return exp(x); }
__device__ __forceinline__ float ss_log(float x) { return logf(x); }
__device__ __forceinline__ double ss_log(double x) { return log(x); }
__device__ __forceinline__ float ss_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double ss_max(double a, double b) { return fmax(a, b); }

// max and log-sum-exp of one row, computed by the 32 lanes of a warp.
__device__ __forceinline__ void ss_row_stats(const T_t* row, int c, int lane, A_t& mx, A_t& lse) {
    A_t m = -(A_t)SS_INF;
    for (int j = lane; j < c; j += 32) m = ss_max(m, (A_t)row[j]);
    for (int o = 16; o > 0; o >>= 1) m = ss_max(m, __shfl_xor_sync(0xffffffffu, m, o));
    A_t s = 0;
    for (int j = lane; j < c; j += 32) s += ss_exp((A_t)row[j] - m);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    mx = m;
    lse = ss_log(s);
}

// loss = mean_i (lse_i - (z_i[label_i] - max_i)); one block, a warp per row; deterministic.
extern "C" __global__ void ss_xent_fwd(const T_t* logits, const L_t* labels, T_t* loss,
                                       int n, int c) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    double acc = 0.0;
    for (int i = warp; i < n; i += nw) {
        const T_t* row = logits + (long long)i * c;
        A_t mx, lse;
        ss_row_stats(row, c, lane, mx, lse);
        if (lane == 0) {
            long long y = (long long)labels[i];
            if (y < 0 || y >= c) acc += CUDART_NAN;   // NumPy raises; here the loss shows NaN
            else acc += (double)(lse - ((A_t)row[y] - mx));
        }
    }
    __shared__ double part[32];
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int w = 0; w < nw; ++w) t += part[w];
        loss[0] = (T_t)(t / n);
    }
}

// dlogits = dloss * (softmax(z) - onehot(label)) / n; a warp per row, 8 rows per block.
extern "C" __global__ void ss_xent_bwd(const T_t* dloss, const T_t* logits, const L_t* labels,
                                       T_t* dlogits, int n, int c) {
    int lane = threadIdx.x & 31;
    long long i = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= n) return;
    const T_t* row = logits + i * c;
    A_t mx, lse;
    ss_row_stats(row, c, lane, mx, lse);
    A_t scale = (A_t)dloss[0] / (A_t)n;
    long long y = (long long)labels[i];
    bool bad = y < 0 || y >= c;
    for (int j = lane; j < c; j += 32) {
        A_t p = ss_exp((A_t)row[j] - mx - lse);
        if (j == y) p -= (A_t)1;
        dlogits[i * c + j] = (T_t)(bad ? (A_t)CUDART_NAN : p * scale);
    }
}
"""

_CTYPES = {"float32": ("float", "float"), "float64": ("double", "double"),
           "float16": ("__half", "float")}
_LTYPES = {"int32": "int", "int64": "long long"}


def _xent_module(dtype, ltype):
    import cupy as cp

    cache = _kernels()["_raw"]
    key = (str(dtype), str(ltype))
    mod = cache.get(key)
    if mod is None:
        try:
            t, a = _CTYPES[str(dtype)]
            lt = _LTYPES[str(ltype)]
        except KeyError:
            raise NotImplementedError(f"softmax_xent: dtypes {dtype}/{ltype} not supported") from None
        head = "#include <cuda_fp16.h>\n" if t == "__half" else ""
        head += "#define CUDART_NAN __int_as_float(0x7fffffff)\n#define SS_INF __int_as_float(0x7f800000)\n"
        src = head + f"typedef {t} T_t;\ntypedef {a} A_t;\ntypedef {lt} L_t;\n" + _XENT_SRC
        mod = cp.RawModule(code=src, options=("-std=c++17",))
        cache[key] = mod
    return mod


# -- helpers ---------------------------------------------------------------------------------


def _stream(ctx, stream):
    return ctx.stream(stream) if ctx is not None else _null_ctx()


class _null_ctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _same_or_copy(src, dst) -> None:
    """Make dst hold src before an in-place kernel runs on dst (outs given apart from ins)."""
    if dst is not src:
        _kernels()["copy"](src, dst)


# -- the twins -------------------------------------------------------------------------------


def _matmul(ctx, stream, ins, outs, attrs):
    a, b = ins
    ctx.gemm(stream, a, b, outs[0], bool(attrs.get("ta", False)), bool(attrs.get("tb", False)))


def _binary(name: str) -> Callable:
    def fn(ctx, stream, ins, outs, attrs):
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
        k = _kernels()
        kern = k[kind]
        if kind == "sum" and x.dtype.kind in "iu":
            kern = k["isum"]
        with _stream(ctx, stream):
            kern(x, out, axis=axis)
    fn.__name__ = kind
    return fn


def _softmax_xent(ctx, stream, ins, outs, attrs):
    logits, labels = ins
    n, c = logits.shape
    mod = _xent_module(logits.dtype, labels.dtype)
    f = mod.get_function("ss_xent_fwd")
    import numpy as np

    with _stream(ctx, stream):
        f((1,), (1024,), (logits, labels, outs[0], np.int32(n), np.int32(c)))


def _softmax_xent_grad(ctx, stream, ins, outs, attrs):
    dloss, logits, labels = ins
    n, c = logits.shape
    if dloss.dtype != logits.dtype:
        raise ValueError("softmax_xent_grad: dloss and logits dtypes differ")
    mod = _xent_module(logits.dtype, labels.dtype)
    f = mod.get_function("ss_xent_bwd")
    import numpy as np

    rows = 8
    with _stream(ctx, stream):
        f(((n + rows - 1) // rows,), (32 * rows,),
          (dloss, logits, labels, outs[0], np.int32(n), np.int32(c)))


def _fill(ctx, stream, ins, outs, attrs):
    with _stream(ctx, stream):
        _kernels()["fill"](float(attrs.get("value", 0.0)), outs[0])


def _copy(ctx, stream, ins, outs, attrs):
    if outs[0] is ins[0]:
        return
    with _stream(ctx, stream):
        _kernels()["copy"](ins[0], outs[0])


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
