"""Multi-tensor launches: `multi_tensor`, one task (one kernel launch on the device) that does the
work of several tasks of one per-parameter kernel (an optimizer step, a gradient clear, the
inf/NaN check) placed on one stream, made by the fusion pass (`streamsched.interp.fuse`).

The NumPy twin runs the part kernels' own NumPy twins in order, so a fused step is bitwise the
unfused one on the CPU.  The CUDA twin launches one kernel over a grid of (tensor, chunk) blocks
that reads a device table of the parts' pointers and sizes, built before capture (`prepare`) the
way NVIDIA Apex's and PyTorch's `multi_tensor_apply` / `_foreach_*` kernels do it; a base kernel
(or a dtype or layout) it has no multi-tensor kernel for runs its parts one by one.
"""

from __future__ import annotations

from typing import Any

import dataclasses

from streamsched.stdlib.kernels._base import STDLIB, DocRow, Family, _attr_error
from streamsched.stdlib.kernels._cuda import _CNN_SRC, _acc_of, _cnn_fn, _stream

FAMILY = Family(__name__, "Multi-tensor launches (made by the fusion pass)")
_register = FAMILY.register

FUSIBLE: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "sgd_step": ((3,), ()),
    "adam_step": ((4, 5), ()),
    "adamw_step": ((4, 5), ()),
    "lars_step": ((3,), ()),
    "amp_sgd_step": ((4, 5, 6), ()),
    "amp_lars_step": ((4, 5, 6), ()),
    "fill": ((), ()),
    "nonfinite_check": ((1,), (0,)),
    "grad_sumsq": ((1,), (0,)),
    "scale_grad": ((1,), ()),
}
"""Base kernel -> (indices of its inputs that every part of one fused task shares: the device
scalars lr, t, scale, found_inf; indices of its outputs that every part shares: found_inf, which
each part sets and none clears).  Every other input and output is the part's own tensor."""


def _parts(at) -> tuple[str, tuple]:
    base, parts = at.get("base"), at.get("parts")
    if base not in FUSIBLE:
        raise _attr_error("multi_tensor", f"base must be one of {', '.join(FUSIBLE)}, got {base!r}")
    if not parts:
        raise _attr_error("multi_tensor", "parts must list the fused tasks (nin, nout, attrs)")
    return base, parts


def split(ins, outs, at):
    """[(part ins, part outs, part attrs)] of a fused task, in part order."""
    base, parts = _parts(at)
    res, i, o = [], 0, 0
    for nin, nout, pat in parts:
        res.append((ins[i:i + nin], outs[o:o + nout], dict(pat)))
        i += nin
        o += nout
    if i != len(ins) or o != len(outs):
        raise ValueError(f"multi_tensor: parts take {i} inputs and {o} outputs, the task has "
                         f"{len(ins)} and {len(outs)}")
    return res


def _multi_infer(in_types, given=None):
    """The parts' type rules, each on its own inputs and attributes, outputs concatenated
    (KernelTypeError from the first part at fault)."""
    at = {"base": "", "parts": (), **(given or {})}
    base, parts = _parts(at)
    rec = STDLIB[base]
    res, i = [], 0
    for nin, nout, pat in parts:
        got = rec.infer(list(in_types[i:i + nin]), dict(pat))
        if len(got) != nout:
            raise _attr_error("multi_tensor", f"a part of {base} has {len(got)} outputs, parts says {nout}")
        res += got
        i += nin
    if i != len(in_types):
        raise _attr_error("multi_tensor", f"parts take {i} inputs, the call has {len(in_types)}")
    return res


def _multi_cpu(ins, outs, at):
    rec = STDLIB[at["base"]]
    for pins, pouts, pat in split(ins, outs, at):
        rec.cpu(pins, pouts, {**rec.attrs, **pat})


# Registered with a variadic signature: the fusion pass builds its tasks (args and outs are the
# parts' in order), and the type rule refuses it in a .sched file.
_register("multi_tensor", "", "", lambda k, names, t, at: [], _multi_cpu,
          {"base": "", "parts": ()}, doc="""
One launch doing the work of several tasks of one per-parameter kernel `base` (sgd_step,
adam_step, adamw_step, lars_step, amp_sgd_step, amp_lars_step, fill, nonfinite_check,
grad_sumsq, scale_grad) placed on
one stream by one graph statement: made by the fusion pass (`--no-fuse` turns it off), never
written.  args / outs: the parts' inputs / outputs one part after another; parts: (number of
inputs, number of outputs, attributes) of each part.  The shared device scalars (lr, t, scale,
found_inf) are the same buffer in every part.  CPU: the base kernel's NumPy twin on each part in
order (bitwise the unfused step); CUDA: one kernel over (tensor, chunk) blocks reading a
pointer table built before capture.
""",
          row=DocRow("() -> ()", "update",
                     "the base kernel on every part in one launch (made by the fusion pass; args and outs: the parts' in order)"))


# The inputs and outputs are the parts': the record's type rule is theirs, not the fixed arity.
FAMILY.kernels["multi_tensor"] = dataclasses.replace(FAMILY.kernels["multi_tensor"], infer=_multi_infer)


# ============================================================================================
# CUDA twin.  The pointer table is one int64 device array per (task binding): [pointers of
# every part, role by role][sizes][block -> part][block -> first element], made by `prepare`
# outside any capture (CuPy refuses host-to-device copies while capturing, CUDA_PITFALLS rule 8)
# and kept alive by this module's cache as long as the arrays it points into.

_CHUNK = 1024
"""Elements per block (256 threads, 4 elements each).  4096 (16 each) left the GPT step's AdamW
over ~40 blocks, latency-bound: 17 us on the H200 for about 150,000 parameters."""

# Each kernel's body is the unfused CUDA twin's formula, in the same dtype (T_t: the tensor's,
# computed in it as the ElementwiseKernel twins do; A_t where those twins widen), FMA off.
_MULTI_SRC = r"""
#define SS_CHUNK 1024
#define SS_PER 4  // SS_CHUNK / 256 threads: the elements of one thread, loaded before any store
#define SS_EACH(u, i) for (int u = 0; u < SS_PER; ++u) \
    for (long long i = s0 + threadIdx.x + (long long)u * blockDim.x; i < s1; i = s1)
#define SS_PART \
    int b = blockIdx.x; int ti = btens[b]; long long s0 = bstart[b]; \
    long long s1 = s0 + SS_CHUNK < sizes[ti] ? s0 + SS_CHUNK : sizes[ti];

extern "C" __global__ void ss_multi_fill(const long long* ptrs, const long long* sizes,
                                         const int* btens, const long long* bstart, int n, double value) {
    SS_PART
    X_t* y = (X_t*)ptrs[ti];
    X_t v = (X_t)value;
    for (long long i = s0 + threadIdx.x; i < s1; i += blockDim.x) y[i] = v;
}

extern "C" __global__ void ss_multi_nonfinite(const long long* ptrs, const long long* sizes,
                                              const int* btens, const long long* bstart, int n,
                                              F_t* found) {
    SS_PART
    const X_t* g = (const X_t*)ptrs[ti];
    for (long long i = s0 + threadIdx.x; i < s1; i += blockDim.x)
        if (!ss_finite(SS_LD(g[i]))) ss_put(found, 1.0);
}

extern "C" __global__ void ss_multi_sgd(const long long* ptrs, const long long* sizes,
                                        const int* btens, const long long* bstart, int n,
                                        const L_t* lr, double mu, double wd, int nesterov) {
    SS_PART
    X_t* w = (X_t*)ptrs[ti];
    const X_t* dw = (const X_t*)ptrs[n + ti];
    X_t* v = (X_t*)ptrs[2 * n + ti];
    X_t lrv = (X_t)lr[0];
    X_t g[SS_PER], ww[SS_PER], vv[SS_PER];
#pragma unroll
    SS_EACH(u, i) { g[u] = dw[i]; ww[u] = w[i]; vv[u] = mu != 0.0 ? v[i] : (X_t)0; }
#pragma unroll
    SS_EACH(u, i) {
        X_t gg = wd != 0.0 ? g[u] + (X_t)wd * ww[u] : g[u];
        X_t vn = mu != 0.0 ? (X_t)mu * vv[u] + gg : gg;
        X_t st = nesterov ? gg + (X_t)mu * vn : vn;
        v[i] = vn;
        w[i] = ww[u] - lrv * st;
    }
}

// adam (decoupled = 0: L2 decay added to the gradient) and adamw (decoupled = 1: w (1 - lr wd)).
extern "C" __global__ void ss_multi_adam(const long long* ptrs, const long long* sizes,
                                         const int* btens, const long long* bstart, int n,
                                         const L_t* lr, const S_t* tp, double b1, double b2, double eps,
                                         double wd, int decoupled) {
    SS_PART
    X_t* w = (X_t*)ptrs[ti];
    const X_t* dw = (const X_t*)ptrs[n + ti];
    X_t* m = (X_t*)ptrs[2 * n + ti];
    X_t* v = (X_t*)ptrs[3 * n + ti];
    double lrd = (double)lr[0];
    double tt = (double)tp[0];
    X_t step_size = (X_t)(lrd / (1.0 - pow(b1, tt)));
    X_t bc2 = (X_t)sqrt(1.0 - pow(b2, tt));
    X_t dec = (X_t)(1.0 - lrd * wd);
    X_t ga[SS_PER], wa[SS_PER], ma[SS_PER], va[SS_PER];
#pragma unroll
    SS_EACH(u, i) { ga[u] = dw[i]; wa[u] = w[i]; ma[u] = m[i]; va[u] = v[i]; }
#pragma unroll
    SS_EACH(u, i) {
        X_t g = ga[u], ww = wa[u], mm = ma[u], vv = va[u];
        X_t gg = g;
        if (wd != 0.0) {
            if (decoupled) ww = ww * dec;
            else gg = g + (X_t)wd * ww;
        }
        X_t mn = mm + (X_t)(1.0 - b1) * (gg - mm);
        X_t vn = vv * (X_t)b2 + (X_t)(1.0 - b2) * gg * gg;
        X_t denom = sqrt(vn) / bc2 + (X_t)eps;
        m[i] = mn;
        v[i] = vn;
        w[i] = ww - step_size * (mn / denom);
    }
}

// SGD on f32 master weights from a scaled f16/f32 gradient (amp_sgd_step's formula, M_t).
extern "C" __global__ void ss_multi_amp_sgd(const long long* ptrs, const long long* sizes,
                                            const int* btens, const long long* bstart, int n,
                                            const S_t* lr, const S_t* scale, const F_t* found,
                                            double mu_d, double wd_d, int nesterov) {
    if (ss_wide(found[0]) != 0.0) return;
    SS_PART
    W_t* w = (W_t*)ptrs[ti];
    const W_t* dw = (const W_t*)ptrs[n + ti];
    M_t* master = (M_t*)ptrs[2 * n + ti];
    M_t* v = (M_t*)ptrs[3 * n + ti];
    M_t inv = (M_t)(1.0 / ss_wide(scale[0]));
    M_t lrv = (M_t)ss_wide(lr[0]);
    M_t mu = (M_t)mu_d, wd = (M_t)wd_d;
    for (long long i = s0 + threadIdx.x; i < s1; i += blockDim.x) {
        M_t g = (M_t)ss_wide(dw[i]) * inv;
        M_t mm = master[i];
        if (wd_d != 0.0) g = g + wd * mm;
        M_t vn = g;
        if (mu_d != 0.0) vn = mu * v[i] + g;
        M_t st = nesterov ? g + mu * vn : vn;
        mm = mm - lrv * st;
        v[i] = vn;
        master[i] = mm;
        ss_put(w + i, mm);
    }
}

// LARS: one block per tensor (the norms need the whole tensor), lars_step's body.
extern "C" __global__ void ss_multi_lars(const long long* ptrs, const long long* sizes, int n,
                                         const L_t* lr, double mom, double wd, double trust, double eps) {
    __shared__ double sh[SS_B];
    int ti = blockIdx.x;
    long long size = sizes[ti];
    X_t* w = (X_t*)ptrs[ti];
    const X_t* dw = (const X_t*)ptrs[n + ti];
    X_t* v = (X_t*)ptrs[2 * n + ti];
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
        ss_put(v + i, vn);
        ss_put(w + i, wn2);
    }
}

// amp_lars_step: one block per tensor, its body (norms of master and the unscaled gradient).
extern "C" __global__ void ss_multi_amp_lars(const long long* ptrs, const long long* sizes, int n,
                                             const S_t* lr, const S_t* scale, const F_t* found,
                                             double mom, double wd, double trust, double eps) {
    if (ss_wide(found[0]) != 0.0) return;
    __shared__ double sh[SS_B];
    int ti = blockIdx.x;
    long long size = sizes[ti];
    W_t* w = (W_t*)ptrs[ti];
    const W_t* dw = (const W_t*)ptrs[n + ti];
    M_t* master = (M_t*)ptrs[2 * n + ti];
    M_t* v = (M_t*)ptrs[3 * n + ti];
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

// g = g * scale (scale_grad), scale rounded to the compute dtype first.
extern "C" __global__ void ss_multi_scale(const long long* ptrs, const long long* sizes,
                                          const int* btens, const long long* bstart, int n,
                                          const S_t* scale) {
    SS_PART
    X_t* g = (X_t*)ptrs[ti];
    A_t k = (A_t)ss_wide(scale[0]);
    for (long long i = s0 + threadIdx.x; i < s1; i += blockDim.x) ss_put(g + i, SS_LD(g[i]) * k);
}

// grad_sumsq, phase 1: each block's share of its tensor's sum of squares, in double, by the
// fixed tree, into part[block].
extern "C" __global__ void ss_multi_sumsq_part(const long long* ptrs, const long long* sizes,
                                               const int* btens, const long long* bstart, int n,
                                               double* part) {
    __shared__ double sh[SS_B];
    SS_PART
    const X_t* g = (const X_t*)ptrs[ti];
    double s = 0.0;
    for (long long i = s0 + threadIdx.x; i < s1; i += blockDim.x) { double v = ss_wide(g[i]); s += v * v; }
    s = ss_block_sum(s, sh);
    if (threadIdx.x == 0) part[b] = s;
}

// Phase 2, one block of SS_B threads, SS_B tensors at a time: thread by tensor, the tensor's
// ceil(size / SS_CHUNK) block sums (adjacent from first[ti], -1 for an empty tensor) added in
// chunk order into shared memory; then thread 0, tensor by tensor, adds each to the running
// total, rounded to S_t, as the parts one after another do.
extern "C" __global__ void ss_multi_sumsq_total(const long long* sizes, const double* part, const int* first,
                                                int n, const S_t* acc, S_t* out) {
    __shared__ double sh[SS_B];
    __shared__ int ok[SS_B];
    S_t a = acc[0];
    for (int t0 = 0; t0 < n; t0 += SS_B) {
        int ti = t0 + threadIdx.x;
        if (ti < n) {
            int k = first[ti];
            double s = 0.0;
            if (k >= 0) {
                int nb = (int)((sizes[ti] + SS_CHUNK - 1) / SS_CHUNK);
#pragma unroll 8
                for (int kk = 0; kk < nb; ++kk) s += part[k + kk];
            }
            sh[threadIdx.x] = s;
            ok[threadIdx.x] = k >= 0;
        }
        __syncthreads();
        if (threadIdx.x == 0)
            for (int u = 0; u < SS_B && t0 + u < n; ++u)
                if (ok[u]) ss_put(&a, ss_wide(a) + sh[u]);
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = a;
}
"""



assert f"#define SS_CHUNK {_CHUNK}\n" in _MULTI_SRC and _CHUNK == 4 * 256  # SS_PER elements a thread


def _split_kernels(src: str) -> dict[str, str]:
    """Each kernel of `src` as its own source (the leading #defines before each), so that it is
    compiled with only the typedefs it uses."""
    head, *rest = src.split('extern "C" __global__ void ')
    return {body.split("(", 1)[0]: head + 'extern "C" __global__ void ' + body for body in rest}


for _name, _src in _split_kernels(_MULTI_SRC).items():
    _CNN_SRC["multi:" + _name] = _src


# base -> (kernel, tensor roles: (input index or None, output index) of each per-part pointer,
# in the order the kernel reads ptrs; the output is the one written, the input must be that
# very array (in place) or the role is read-only (output index None)).
_ROLES: dict[str, tuple[str, tuple[tuple[int | None, int | None], ...]]] = {
    "fill": ("ss_multi_fill", ((None, 0),)),
    "nonfinite_check": ("ss_multi_nonfinite", ((0, None),)),
    "sgd_step": ("ss_multi_sgd", ((0, 0), (1, None), (2, 1))),
    "adam_step": ("ss_multi_adam", ((0, 0), (1, None), (2, 1), (3, 2))),
    "adamw_step": ("ss_multi_adam", ((0, 0), (1, None), (2, 1), (3, 2))),
    "lars_step": ("ss_multi_lars", ((0, 0), (1, None), (2, 1))),
    "amp_sgd_step": ("ss_multi_amp_sgd", ((0, 0), (1, None), (2, 1), (3, 2))),
    "amp_lars_step": ("ss_multi_amp_lars", ((0, 0), (1, None), (2, 1), (3, 2))),
    "scale_grad": ("ss_multi_scale", ((0, 0),)),
    "grad_sumsq": ("ss_multi_sumsq_part", ((0, None),)),
}

_WIDE = ("float32", "float64")

_TABLES: dict[tuple, Any] = {}
"""Pointer tables by (base, the parts' pointers and sizes): built once per binding, before capture."""


def _tensors(base: str, parts) -> list[list[Any]] | None:
    """The per-part arrays role by role, or None when the parts do not fit one multi-tensor
    kernel (a role not in place, mixed dtypes, not C-contiguous)."""
    _, roles = _ROLES[base]
    cols: list[list[Any]] = [[] for _ in roles]
    for pins, pouts, _ in parts:
        for r, (i, o) in enumerate(roles):
            a = pouts[o] if o is not None else pins[i]
            if i is not None and o is not None and pins[i] is not pouts[o] and \
                    pins[i].data.ptr != pouts[o].data.ptr:
                return None
            cols[r].append(a)
    for col in cols:
        if any(a.dtype != col[0].dtype or not a.flags.c_contiguous for a in col):
            return None
    if base not in ("fill", "nonfinite_check", "amp_sgd_step", "amp_lars_step", "scale_grad", "grad_sumsq") \
            and str(cols[0][0].dtype) not in _WIDE:
        return None  # f16 tensors outside the AMP step keep their own twins
    sizes = [a.size for a in cols[0]]
    if any([a.size for a in col] != sizes for col in cols):
        return None
    return cols


def _table(base: str, cols) -> tuple | None:
    """(ptrs, sizes, btens, bstart, nblocks) device views for these arrays, from the cache; None
    when not built yet."""
    key = (base,) + tuple(tuple((a.data.ptr, a.size) for a in col) for col in cols)
    return _TABLES.get(key), key


def _build(base: str, cols):
    import cupy as cp
    import numpy as np

    found, key = _table(base, cols)
    if found is not None:
        return found
    n = len(cols[0])
    sizes = np.array([a.size for a in cols[0]], np.int64)
    ptrs = np.array([a.data.ptr for col in cols for a in col], np.int64)
    bt, bs = [], []
    first = np.full(n, -1, np.int32)  # each tensor's first block (-1: empty), for grad_sumsq
    for ti, s in enumerate(sizes):
        if s > 0:
            first[ti] = len(bt)
        for st in range(0, int(s), _CHUNK):
            bt.append(ti)
            bs.append(st)
    host = np.concatenate([ptrs, sizes, np.array(bs, np.int64)])
    dev = cp.asarray(host)
    btens = cp.asarray(np.array(bt, np.int32))
    k = len(ptrs)
    part = None
    if base == "grad_sumsq":  # phase-1 sums, and each tensor's first block
        part = (cp.zeros(max(1, len(bt)), cp.float64), cp.asarray(first))
    entry = (dev[:k], dev[k:k + n], btens, dev[k + n:], len(bt), n, part)
    cur = cp.cuda.get_current_stream()
    if not cur.is_capturing():  # the uploads finished before a kernel on another stream reads them
        cur.synchronize()
    _TABLES[key] = entry
    return entry


def _fallback(ctx, stream, parts, base: str) -> None:
    """The base kernel's own CUDA twin on each part (a case the multi-tensor kernels do not cover)."""
    import importlib

    rec = STDLIB[base]
    mod, _, attr = rec.cuda.partition(":")
    fn = getattr(importlib.import_module(mod), attr)
    for pins, pouts, pat in parts:
        fn(ctx, stream, pins, pouts, {**rec.attrs, **pat})


def _common(parts, idx: int, outs: bool = False):
    a = (parts[0][1] if outs else parts[0][0])[idx]
    for pins, pouts, _ in parts:
        b = (pouts if outs else pins)[idx]
        if b is not a and b.data.ptr != a.data.ptr:
            return None
    return a


def multi_tensor_prepare(ctx, stream, ins, outs, attrs) -> None:
    """Build the pointer table of this binding (outside capture: the executor calls it when it
    binds a task), synchronizing the stream so the table is in place before any launch."""
    parts = split(ins, outs, attrs)
    base = attrs["base"]
    if base not in _ROLES:
        return
    cols = _tensors(base, parts)
    if cols is None or not cols[0]:
        return
    st = ctx.stream(stream) if ctx is not None else None
    with _stream(ctx, stream):
        _build(base, cols)
    if st is not None:
        st.synchronize()


def multi_tensor_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    base = attrs["base"]
    parts = split(ins, outs, attrs)
    cols = _tensors(base, parts) if base in _ROLES else None
    if cols is None:
        _fallback(ctx, stream, parts, base)
        return
    pat = parts[0][2]
    at = {**_defaults(base), **pat}
    if any(p[2] != pat for p in parts) and base != "fill":
        _fallback(ctx, stream, parts, base)
        return
    entry, _ = _table(base, cols)
    if entry is None:  # eager, or a binding nobody prepared: build it now (never while capturing)
        with _stream(ctx, stream):
            entry = _build(base, cols)
    ptrs, sizes, btens, bstart, nblocks, n, part = entry
    if nblocks == 0 and base not in ("grad_sumsq",):
        return
    fname, _ = _ROLES[base]
    x = cols[0][0].dtype
    head = (ptrs, sizes, btens, bstart, np.int32(n))
    if base == "fill":
        if any(dict(p[2]).get("value", 0.0) != at.get("value", 0.0) for p in parts):
            _fallback(ctx, stream, parts, base)
            return
        f = _cnn_fn("multi:" + fname, fname, X_t=x, A_t=_acc_of(x))
        args, grid = head + (np.float64(at.get("value", 0.0)),), nblocks
    elif base == "nonfinite_check":
        found = _common(parts, 1)
        fo = _common(parts, 0, outs=True)
        if found is None or fo is None or fo.data.ptr != found.data.ptr:
            _fallback(ctx, stream, parts, base)
            return
        f = _cnn_fn("multi:" + fname, fname, X_t=x, F_t=found.dtype, A_t=_acc_of(x))
        args, grid = head + (fo,), nblocks
    elif base == "sgd_step":
        lr = _common(parts, 3)
        if lr is None:
            _fallback(ctx, stream, parts, base)
            return
        f = _cnn_fn("multi:" + fname, fname, X_t=x, L_t=lr.dtype, A_t=_acc_of(x))
        args, grid = head + (lr, np.float64(at["momentum"]), np.float64(at["weight_decay"]),
                             np.int32(1 if at["nesterov"] else 0)), nblocks
    elif base in ("adam_step", "adamw_step"):
        lr, t = _common(parts, 4), _common(parts, 5)
        if lr is None or t is None:
            _fallback(ctx, stream, parts, base)
            return
        f = _cnn_fn("multi:" + fname, fname, X_t=x, L_t=lr.dtype, S_t=t.dtype, A_t=_acc_of(x))
        args, grid = head + (lr, t, np.float64(at["beta1"]), np.float64(at["beta2"]), np.float64(at["eps"]),
                             np.float64(at["weight_decay"]),
                             np.int32(1 if base == "adamw_step" else 0)), nblocks
    elif base == "amp_sgd_step":
        lr, scale, found = _common(parts, 4), _common(parts, 5), _common(parts, 6)
        if lr is None or scale is None or found is None or lr.dtype != scale.dtype:
            _fallback(ctx, stream, parts, base)
            return
        f = _cnn_fn("multi:" + fname, fname, W_t=x, M_t=cols[2][0].dtype, S_t=scale.dtype, F_t=found.dtype,
                    A_t=_acc_of(cols[2][0].dtype))
        args, grid = head + (lr, scale, found, np.float64(at["momentum"]), np.float64(at["weight_decay"]),
                             np.int32(1 if at["nesterov"] else 0)), nblocks
    elif base == "scale_grad":
        scale = _common(parts, 1)
        if scale is None:
            _fallback(ctx, stream, parts, base)
            return
        f = _cnn_fn("multi:" + fname, fname, X_t=x, S_t=scale.dtype, A_t=_acc_of(x))
        args, grid = head + (scale,), nblocks
    elif base == "grad_sumsq":
        acc, out = _common(parts, 1), _common(parts, 0, outs=True)
        if acc is None or out is None or acc.dtype != out.dtype or acc.data.ptr != out.data.ptr:
            _fallback(ctx, stream, parts, base)
            return
        total = _cnn_fn("multi:ss_multi_sumsq_total", "ss_multi_sumsq_total", X_t=x, S_t=acc.dtype, A_t=_acc_of(x))
        sums, first = part
        with _stream(ctx, stream):
            if nblocks:
                _cnn_fn("multi:" + fname, fname, X_t=x, S_t=acc.dtype, A_t=_acc_of(x))((nblocks,), (256,), head + (sums,))
            total((1,), (256,), (sizes, sums, first, np.int32(n), acc, out))
        return
    elif base == "amp_lars_step":
        lr, scale, found = _common(parts, 4), _common(parts, 5), _common(parts, 6)
        if lr is None or scale is None or found is None or lr.dtype != scale.dtype:
            _fallback(ctx, stream, parts, base)
            return
        f = _cnn_fn("multi:" + fname, fname, W_t=x, M_t=cols[2][0].dtype, S_t=scale.dtype, F_t=found.dtype,
                    A_t=_acc_of(cols[2][0].dtype))
        args, grid = (ptrs, sizes, np.int32(n), lr, scale, found, np.float64(at["momentum"]),
                      np.float64(at["weight_decay"]), np.float64(at["trust"]), np.float64(at["eps"])), n
    else:  # lars_step: one block per tensor
        lr = _common(parts, 3)
        if lr is None:
            _fallback(ctx, stream, parts, base)
            return
        f = _cnn_fn("multi:" + fname, fname, X_t=x, L_t=lr.dtype, A_t=_acc_of(x))
        args, grid = (ptrs, sizes, np.int32(n), lr, np.float64(at["momentum"]), np.float64(at["weight_decay"]),
                      np.float64(at["trust"]), np.float64(at["eps"])), n
    with _stream(ctx, stream):
        f((grid,), (256,), args)


multi_tensor_cuda.prepare = multi_tensor_prepare


def _defaults(base: str) -> dict[str, Any]:
    return dict(STDLIB[base].attrs)
