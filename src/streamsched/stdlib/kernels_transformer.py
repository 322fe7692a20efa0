"""The transformer kernels (token and positional embeddings, layer norm, causal multi-head
attention, softmax, AdamW, gradient clipping by global norm), registered into the same table
`streamsched.stdlib.kernels.KERNELS` with the same conventions; their CUDA twins live in
`streamsched.stdlib.cuda_kernels_transformer`.

Everything in kernels.py's module docstring holds here: `cpu(ins, outs, attrs)` writes only through
`out[...] = ...` after computing into temporaries (outputs may be inputs or views into one arena);
type rules raise `KernelTypeError` S003 (shapes, arity, attributes) / S004 (dtypes) with the
offending input's index; step-varying scalars (lr, t, the clipping norm) are `[]` device buffers
read when the kernel runs.  f16 inputs are computed in f32 (f64 stays f64) and rounded once.

Layout.  A sequence model keeps its activations flat, `[n, d]` with n = b * t rows in (sequence,
position) order, so `linear` applies unchanged.  Attention splits d into `heads` heads of
dh = d / heads columns: head h of row r is columns h*dh .. h*dh+dh-1.  Scores and probabilities
are `[b, heads, t, t]`: s[b, h, i, j] is how much position i of sequence b attends to position j.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from streamsched.stdlib.kernel_record import KernelTypeError
from streamsched.stdlib.kernels import (FLOATS, INTS, KERNELS, NUMERIC, _acc, _attr_error, _dtype, _flag, _floats,
                                        _fmt, _loss_dtype, _number, _register, _same_shape, _scalar, _write)
from streamsched.stdlib.kernels_cnn import _int

_FIRST = len(KERNELS)
_CUDA = "streamsched.stdlib.cuda_kernels_transformer"


def _reg(*args, **kw) -> None:
    _register(*args, cuda_module=_CUDA, **kw)


# --------------------------------------------------------------------------------------------
# Type-rule helpers


def _rank2(k: str, t, names, i: int, what: str) -> tuple[int, int]:
    shape = t[i][0]
    if len(shape) != 2:
        raise KernelTypeError(f"{k}: {names[i]} must be 2-D {what}, got {_fmt(shape)}", arg=i)
    return shape


def _ids(k: str, t, names, i: int) -> int:
    """An integer id tensor of any shape with at least one dimension; returns its size."""
    shape, dt = t[i]
    if dt not in INTS:
        raise KernelTypeError(f"{k}: {names[i]} must be an integer dtype (i32, i64), got {dt}", arg=i, code="S004")
    if len(shape) < 1:
        raise KernelTypeError(f"{k}: {names[i]} must have at least 1 dimension, got []", arg=i)
    return math.prod(shape)


def _heads_of(k: str, at, d: int, arg: int | None) -> int:
    h = _int(k, at, "heads", 1, "the number of attention heads")
    if d % h:
        raise KernelTypeError(f"{k}: the width {d} does not split into {h} heads ({d} % {h} != 0)", arg=arg)
    return h


def _seq_of(k: str, at, n: int, arg: int | None) -> int:
    t = _int(k, at, "context", 1, "the sequence length: rows per sequence")
    if n % t:
        raise KernelTypeError(f"{k}: {n} rows do not split into sequences of context = {t} ({n} % {t} != 0)",
                              arg=arg)
    return t


def _probs(k: str, t, names, i: int) -> tuple[int, int, int]:
    """(b, heads, t) of a [b, heads, t, t] score or probability tensor."""
    shape = t[i][0]
    if len(shape) != 4 or shape[2] != shape[3]:
        raise KernelTypeError(f"{k}: {names[i]} must be [b, heads, t, t] (scores or probabilities), "
                              f"got {_fmt(shape)}", arg=i)
    return shape[0], shape[1], shape[2]


def _rows_fit(k: str, t, names, ip: int, ix: int) -> tuple[int, int]:
    """A [b, h, t, t] tensor (input ip) against a flat [b*t, d] activation (input ix)."""
    b, h, s = _probs(k, t, names, ip)
    n, d = _rank2(k, t, names, ix, "[n, d] (n = b * t rows)")
    if n != b * s:
        raise KernelTypeError(f"{k}: {names[ix]} {_fmt(t[ix][0])} has {n} rows, but {names[ip]} "
                              f"{_fmt(t[ip][0])} needs b * t = {b * s}", arg=ix)
    if d % h:
        raise KernelTypeError(f"{k}: the width {d} of {names[ix]} does not split into the {h} heads of "
                              f"{names[ip]} {_fmt(t[ip][0])}", arg=ix)
    return n, d


def _scale_of(d: int, h: int) -> float:
    """1 / sqrt(dh), the scaled dot product's factor (Vaswani et al., 2017)."""
    return 1.0 / math.sqrt(d // h)


# --------------------------------------------------------------------------------------------
# Token embedding


def _check_ids(k: str, ids: np.ndarray, rows: int) -> np.ndarray:
    flat = np.asarray(ids).reshape(-1)
    bad = (flat < 0) | (flat >= rows)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{k}: id {int(flat[i])} at index {i} is out of range for a table of {rows} rows "
                         f"(ids must be in 0..{rows - 1})")
    return flat.astype(np.intp, copy=False)


def _embedding_infer(k, names, t, at):
    n = _ids(k, t, names, 0)
    _, d = _rank2(k, t, names, 1, "[vocab, dim]")
    return [((n, d), _floats(k, t, names, (1,)))]


def _embedding_cpu(ins, outs, at):
    ids, table = ins
    _write(outs[0], table[_check_ids("embedding", ids, table.shape[0])])  # a fancy index copies


_reg("embedding", "ids table", "y", _embedding_infer, _embedding_cpu, inplace=False, doc="""
y[r] = table[ids[r]]: one row of the table per id, the ids taken in row-major order (ids [b, t]
gives rows b*t, sequence by sequence, the flat layout the transformer ops use).
ids: any shape, i32 or i64; table: [vocab, dim] float -> y: [size(ids), dim] in table's dtype.
An id outside 0..vocab-1 raises ValueError when the kernel runs.  Backward: embedding_grad.
""")


def segment_sum(values: np.ndarray, seg: np.ndarray, nseg: int) -> np.ndarray:
    """The reproducible scatter-add of embedding_grad: out[s] = sum of values[i] over the rows i
    with seg[i] == s, in float64, bitwise independent of the order of the rows.

    values: float [n, d]; seg: integer [n] in 0..nseg-1 -> float64 [nseg, d].  Each (segment,
    column) is summed exactly on a fixed-point grid: with L the segment's row count,
    kk = ceil(log2 L) and M = 2^e > the largest finite |value| (e from frexp), every value is
    truncated toward zero to a multiple of 2^g, g = e - 62 + kk, as an int64 (|q| < 2^(62-kk), so
    L of them sum below 2^62 exactly); the integer sum, converted to float64 (round to nearest
    even) and scaled by 2^g, is the result.  Integer addition is associative, so the order of
    the rows never matters (no float atomics on the GPU: the twin computes the same bits).  The
    truncation loses at most L * 2^g < 2^(2 kk - 61) M: nothing for f16 and f32 inputs whose values
    lie within 2^(38 - 2 kk) of the largest (f32 has 24 significant bits), and far less than
    float32 rounding otherwise.  A column holding NaN, or both +inf and -inf, sums to NaN; one
    holding only +inf (-inf) to +inf (-inf)."""
    v = np.asarray(values).astype(np.float64, copy=False)
    n, d = v.shape
    seg = np.asarray(seg).reshape(-1).astype(np.intp, copy=False)
    out = np.zeros((nseg, d), np.float64)
    if n == 0:
        return out
    order = np.argsort(seg, kind="stable")
    ss = seg[order]
    starts = np.flatnonzero(np.r_[True, ss[1:] != ss[:-1]])
    present = ss[starts]
    counts = np.diff(np.r_[starts, n])
    kk = np.frexp((counts - 1).astype(np.float64))[1]  # bit length of L - 1 = ceil(log2 L)
    vs = v[order]
    finite = np.isfinite(vs)
    clean = np.where(finite, vs, 0.0)
    mx = np.maximum.reduceat(np.abs(clean), starts, axis=0)
    g = np.frexp(mx)[1] - 62 + kk[:, None]                       # [segments, d]
    rows_g = np.repeat(g, counts, axis=0)
    q = np.trunc(np.ldexp(clean, -rows_g)).astype(np.int64)
    acc = np.add.reduceat(q, starts, axis=0)
    out[present] = np.ldexp(acc.astype(np.float64), g)
    if not finite.all():
        flags = np.where(np.isnan(vs), 4, np.where(vs == np.inf, 1, np.where(vs == -np.inf, 2, 0)))
        f = np.bitwise_or.reduceat(flags.astype(np.int64), starts, axis=0)
        sub = out[present]
        sub = np.where(f & 1, np.inf, sub)
        sub = np.where(f & 2, -np.inf, sub)
        sub = np.where(((f & 4) != 0) | ((f & 3) == 3), np.nan, sub)
        out[present] = sub
    return out


def _embedding_grad_infer(k, names, t, at):
    vocab = _int(k, at, "vocab", 1, "the table's rows")
    n, d = _rank2(k, t, names, 0, "[n, dim]")
    dt = _floats(k, t, names, (0,))
    m = _ids(k, t, names, 1)
    if m != n:
        raise KernelTypeError(f"{k}: ids {_fmt(t[1][0])} hold {m} ids but dy {_fmt(t[0][0])} has {n} rows",
                              arg=1)
    return [((vocab, d), dt)]


def _embedding_grad_cpu(ins, outs, at):
    dy, ids = ins
    seg = _check_ids("embedding_grad", ids, int(at["vocab"]))
    with np.errstate(invalid="ignore", over="ignore"):
        _write(outs[0], segment_sum(dy, seg, int(at["vocab"])))


_reg("embedding_grad", "dy ids", "dtable", _embedding_grad_infer, _embedding_grad_cpu, {"vocab": None},
     inplace=False, doc="""
dtable[v] = sum of dy[r] over the rows r with ids[r] == v (0 for ids that do not occur): the
gradient of embedding, a scatter-add made reproducible: each (row, column) is summed exactly on a
fixed-point grid (`kernels_transformer.segment_sum`: values truncated to multiples of 2^g,
g = e - 62 + ceil(log2 L), M = 2^e above the largest |value| of the L values, summed as int64),
so the result is bitwise the same whatever the order of duplicate ids, on every backend (no
float atomics), and for f16/f32 gradients exact before the final rounding to dtable's dtype
(through float64).  NaN or +-inf in a column propagate as in a sum.
dy: [n, dim] float, ids: n ids of any shape, i32/i64 -> dtable: [vocab, dim] in dy's dtype.
vocab (required): the table's rows.
""")


# --------------------------------------------------------------------------------------------
# Learned positional embedding


def _pos_infer(k, names, t, at):
    n, d = _rank2(k, t, names, 0, "[n, dim] (n = b * t rows)")
    s, d2 = _rank2(k, t, names, 1, "[context, dim]")
    dt = _floats(k, t, names, (0, 1))
    if d2 != d:
        raise KernelTypeError(f"{k}: table {_fmt(t[1][0])} must have the width {d} of x {_fmt(t[0][0])}", arg=1)
    if n % s:
        raise KernelTypeError(f"{k}: x {_fmt(t[0][0])} has {n} rows, not a whole number of sequences of "
                              f"{s} (the table's rows)", arg=0)
    return [((n, d), dt)]


def _pos_cpu(ins, outs, at):
    x, table = ins
    s, d = table.shape
    _write(outs[0], (_acc(x).reshape(-1, s, d) + _acc(table)).reshape(x.shape))


_reg("pos_embedding", "x table", "y", _pos_infer, _pos_cpu, doc="""
y[r] = x[r] + table[r % t]: the learned position embedding of row r's position in its sequence,
added to the flat [b*t, dim] activations (the table repeated per sequence).
x: [n, dim], table: [t, dim], one float dtype, n a multiple of t -> y: x's type.  Backward:
dx = dy (the op copies it), dtable = pos_embedding_grad(dy).
""")


def _pos_grad_infer(k, names, t, at):
    n, d = _rank2(k, t, names, 0, "[n, dim] (n = b * t rows)")
    s = _seq_of(k, at, n, 0)
    return [((s, d), _floats(k, t, names, (0,)))]


def _pos_grad_cpu(ins, outs, at):
    dy = ins[0]
    s = int(at["context"])
    seqs = dy.reshape(-1, s, dy.shape[1])
    acc = np.zeros(seqs.shape[1:], np.float64)
    for piece in seqs:  # sequence by sequence: the order the CUDA twin adds in (bitwise equal)
        acc += piece
    _write(outs[0], acc)


_reg("pos_embedding_grad", "dy", "dtable", _pos_grad_infer, _pos_grad_cpu, {"context": None}, inplace=False,
     doc="""
dtable[j] = sum over the sequences b of dy[b*t + j]: the gradient of pos_embedding's table, added
in float64 sequence by sequence (b = 0, 1, ...), rounded once.
dy: [n, dim] float -> dtable: [context, dim] in dy's dtype; context (required) = t, dividing n.
""")


# --------------------------------------------------------------------------------------------
# Layer norm (Ba, Kiros, Hinton, 2016), as torch.nn.LayerNorm over the last axis


def _ln_rows(k, t, names, i) -> tuple[int, ...]:
    shape = t[i][0]
    if len(shape) < 1 or shape[-1] < 1:
        raise KernelTypeError(f"{k}: {names[i]} must have a last axis to normalize, got {_fmt(shape)}", arg=i)
    return shape


def _ln_vec(k, t, names, i, d, of) -> None:
    if t[i][0] != (d,):
        raise KernelTypeError(f"{k}: {names[i]} must be [{d}], one value per column of {of}, got "
                              f"{_fmt(t[i][0])}", arg=i)


def _ln_stats(k, t, names, i, rows, of) -> None:
    if t[i][0] != rows:
        raise KernelTypeError(f"{k}: {names[i]} must be {_fmt(rows)}, one value per row of {of}, got "
                              f"{_fmt(t[i][0])}", arg=i)


def _ln_infer(k, names, t, at):
    _number(k, at, "eps", lo=0.0)
    shape = _ln_rows(k, t, names, 0)
    for i in (1, 2):
        _ln_vec(k, t, names, i, shape[-1], f"x {_fmt(shape)}")
    dt = _floats(k, t, names, (0, 1, 2))
    sdt = _loss_dtype(dt)
    return [(shape, dt), (shape[:-1], sdt), (shape[:-1], sdt)]


def _ln_cpu(ins, outs, at):
    x, gamma, beta = ins
    xa = _acc(x)
    mean = xa.mean(axis=-1)
    xc = xa - mean[..., None]
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1) + xa.dtype.type(at["eps"]))
    y = xc * rstd[..., None] * _acc(gamma) + _acc(beta)
    _write(outs[1], mean)
    _write(outs[2], rstd)
    _write(outs[0], y)


_reg("layernorm", "x gamma beta", "y mean rstd", _ln_infer, _ln_cpu, {"eps": 1e-5}, inplace=False, doc="""
Layer norm over the last axis (Ba et al., 2016; torch.nn.LayerNorm(d, eps)): per row,
mean = sum(x) / d;  var = sum((x - mean)^2) / d (biased, two-pass);  rstd = 1 / sqrt(var + eps);
y = (x - mean) * rstd * gamma + beta.
x: [..., d] float; gamma, beta: [d], x's dtype -> y: x's type, mean, rstd: x.shape[:-1] in x's
dtype (f32 for f16 x), kept for the backward.  f16 computed in f32.
Backward: layernorm_grad_x (dx), layernorm_grad_gamma (dgamma), sum(dy, axis=0) (dbeta).
""")


def _ln_grad_common(k, names, t, ix: int, istat: int) -> tuple[tuple[int, ...], str]:
    shape = _same_shape(k, t, names, (0, ix))
    _ln_rows(k, t, names, ix)
    dt = _floats(k, t, names, (0, ix))
    for i in (istat, istat + 1):
        _ln_stats(k, t, names, i, shape[:-1], f"x {_fmt(shape)}")
        _dtype(k, t, i, names, FLOATS, "a float dtype")
    return shape, dt


def _ln_gx_infer(k, names, t, at):
    shape, dt = _ln_grad_common(k, names, t, 1, 3)
    _ln_vec(k, t, names, 2, shape[-1], f"x {_fmt(shape)}")
    _floats(k, t, names, (0, 2))
    return [(shape, dt)]


def _xhat(x, mean, rstd):
    return (_acc(x) - mean[..., None]) * rstd[..., None]


def _ln_gx_cpu(ins, outs, at):
    dy, x, gamma, mean, rstd = ins
    xa = _acc(x)
    mean, rstd = mean.astype(xa.dtype, copy=False), rstd.astype(xa.dtype, copy=False)
    xhat = (xa - mean[..., None]) * rstd[..., None]
    g = _acc(dy) * _acc(gamma)
    dx = rstd[..., None] * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    _write(outs[0], dx)


_reg("layernorm_grad_x", "dy x gamma mean rstd", "dx", _ln_gx_infer, _ln_gx_cpu, inplace=False, doc="""
The input gradient of layernorm, from its forward input x and saved mean, rstd (per row, means
over the last axis):  xhat = (x - mean) * rstd;  g = dy * gamma;
dx = rstd * (g - mean(g) - xhat * mean(g * xhat))  (PyTorch's layer_norm_backward).
dy, x: [..., d], one float dtype; gamma: [d] of it; mean, rstd: x.shape[:-1] float -> dx: x's type.
""")


def _ln_gg_infer(k, names, t, at):
    shape, dt = _ln_grad_common(k, names, t, 1, 2)
    return [((shape[-1],), dt)]


def _ln_gg_cpu(ins, outs, at):
    dy, x, mean, rstd = ins
    xa = _acc(x)
    xhat = (xa - mean.astype(xa.dtype)[..., None]) * rstd.astype(xa.dtype)[..., None]
    _write(outs[0], (_acc(dy) * xhat).reshape(-1, x.shape[-1]).sum(axis=0))


_reg("layernorm_grad_gamma", "dy x mean rstd", "dgamma", _ln_gg_infer, _ln_gg_cpu, inplace=False, doc="""
dgamma = sum over the rows of dy * xhat, xhat = (x - mean) * rstd: layernorm's scale gradient (a
column reduction; dbeta is sum(dy, axis=0), so the two and dx can run on three streams).
dy, x: [..., d], one float dtype; mean, rstd: x.shape[:-1] -> dgamma: [d] in dy's dtype.
""")


# --------------------------------------------------------------------------------------------
# Softmax over the last axis


def _softmax_infer(k, names, t, at):
    shape = t[0][0]
    if len(shape) < 1 or shape[-1] < 1:
        raise KernelTypeError(f"{k}: {names[0]} must have a non-empty last axis, got {_fmt(shape)}", arg=0)
    return [(shape, _floats(k, t, names, (0,)))]


def _softmax_cpu(ins, outs, at):
    z = _acc(ins[0])
    with np.errstate(invalid="ignore"):
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        _write(outs[0], e / e.sum(axis=-1, keepdims=True))


_reg("softmax", "x", "y", _softmax_infer, _softmax_cpu, inplace=False, doc="""
y = exp(x - max) / sum(exp(x - max)) over the last axis (torch.softmax(x, -1)); -inf entries (a
causal mask) get 0; a row of only -inf gives NaN, as PyTorch.  x: [..., c] float -> y: same type
(f16 in f32).  Backward: softmax_grad(dy, y).
""")


def _softmax_grad_infer(k, names, t, at):
    shape = _same_shape(k, t, names, (0, 1))
    _softmax_infer(k, names, t[1:], at)
    return [(shape, _floats(k, t, names, (0, 1)))]


def _softmax_grad_cpu(ins, outs, at):
    dy, y = _acc(ins[0]), _acc(ins[1])
    _write(outs[0], y * (dy - (dy * y).sum(axis=-1, keepdims=True)))


_reg("softmax_grad", "dy y", "dx", _softmax_grad_infer, _softmax_grad_cpu, inplace=False, doc="""
dx = y * (dy - sum(dy * y)) over the last axis: the gradient of softmax from its *output* y
(entries with y = 0, a masked score, get 0).  dy, y: one shape and float dtype -> dx: same type.
""")


# --------------------------------------------------------------------------------------------
# Causal multi-head self-attention on flat [b*t, d] activations


def _split(x: np.ndarray, t: int, h: int) -> np.ndarray:
    """[b*t, d] -> the [b, h, t, dh] view of its heads."""
    n, d = x.shape
    return x.reshape(n // t, t, h, d // h).transpose(0, 2, 1, 3)


def _merge(o: np.ndarray) -> np.ndarray:
    """[b, h, t, dh] -> [b*t, h*dh]."""
    b, h, t, dh = o.shape
    return o.transpose(0, 2, 1, 3).reshape(b * t, h * dh)


def _qk_infer(k, names, t, at):
    """(q, k) or (do, v): two [n, d] activations -> [b, heads, t, t]."""
    n, d = _rank2(k, t, names, 0, "[n, d] (n = b * t rows)")
    _same_shape(k, t, names, (0, 1))
    dt = _floats(k, t, names, (0, 1))
    h = _heads_of(k, at, d, None)
    s = _seq_of(k, at, n, 0)
    return [((n // s, h, s, s), dt)]


def _scores_infer(k, names, t, at):
    _flag(k, at, "causal")
    return _qk_infer(k, names, t, at)


def _scores_cpu(ins, outs, at):
    q, kk = ins
    h, s = int(at["heads"]), int(at["context"])
    qa, ka = _acc(q), _acc(kk)
    sc = np.matmul(_split(qa, s, h), _split(ka, s, h).transpose(0, 1, 3, 2))
    sc *= qa.dtype.type(_scale_of(q.shape[1], h))
    if at["causal"]:
        sc[..., np.triu(np.ones((s, s), bool), 1)] = -np.inf
    _write(outs[0], sc)


_reg("attn_scores", "q k", "s", _scores_infer, _scores_cpu, {"heads": None, "context": None, "causal": True},
     inplace=False, doc="""
s[b, h, i, j] = (q_h[b, i] . k_h[b, j]) / sqrt(dh), per sequence b and head h (q_h: columns
h*dh .. h*dh+dh-1, dh = d / heads), and -inf where j > i when causal (each position attends to
itself and earlier ones): scaled dot-product attention's scores (Vaswani et al., 2017), as
torch.nn.functional.scaled_dot_product_attention(is_causal=True) computes them.
q, k: [n, d], one float dtype, n = b * context -> s: [b, heads, context, context].
heads, context (required); causal=true.  On the GPU: one cuBLAS strided-batched GEMM per head.
""")


def _pv_infer(k, names, t, at):
    """(p, v) and the like: [b, h, t, t] with [b*t, d] -> [b*t, d]."""
    n, d = _rows_fit(k, t, names, 0, 1)
    return [((n, d), _floats(k, t, names, (0, 1)))]


def _apply_cpu(ins, outs, at):
    p, v = _acc(ins[0]), _acc(ins[1])
    _write(outs[0], _merge(np.matmul(p, _split(v, p.shape[2], p.shape[1]))))


_reg("attn_apply", "p v", "o", _pv_infer, _apply_cpu, inplace=False, doc="""
o_h[b, i] = sum_j p[b, h, i, j] v_h[b, j]: the attention-weighted sum of the values, heads
concatenated back into columns (o = p v per head).
p: [b, heads, t, t], v: [b*t, d], one float dtype -> o: [b*t, d].
""")


def _grad_p_cpu(ins, outs, at):
    do, v = _acc(ins[0]), _acc(ins[1])
    h, s = int(at["heads"]), int(at["context"])
    _write(outs[0], np.matmul(_split(do, s, h), _split(v, s, h).transpose(0, 1, 3, 2)))


_reg("attn_grad_p", "do v", "dp", _qk_infer, _grad_p_cpu, {"heads": None, "context": None}, inplace=False,
     doc="""
dp[b, h] = do_h[b] v_h[b]^T: the gradient of attn_apply with respect to the probabilities (no
scale, no mask: masked entries get values that softmax_grad multiplies by p = 0).
do, v: [n, d], one float dtype -> dp: [b, heads, context, context]; heads, context (required).
""")


def _grad_v_cpu(ins, outs, at):
    p, do = _acc(ins[0]), _acc(ins[1])
    _write(outs[0], _merge(np.matmul(p.transpose(0, 1, 3, 2), _split(do, p.shape[2], p.shape[1]))))


_reg("attn_grad_v", "p do", "dv", _pv_infer, _grad_v_cpu, inplace=False, doc="""
dv_h[b] = p[b, h]^T do_h[b]: the gradient of attn_apply with respect to the values.
p: [b, heads, t, t], do: [b*t, d], one float dtype -> dv: [b*t, d].
""")


def _grad_q_cpu(ins, outs, at):
    ds, kk = _acc(ins[0]), _acc(ins[1])
    h, s = ds.shape[1], ds.shape[2]
    r = _merge(np.matmul(ds, _split(kk, s, h)))
    _write(outs[0], r * r.dtype.type(_scale_of(kk.shape[1], h)))


_reg("attn_grad_q", "ds k", "dq", _pv_infer, _grad_q_cpu, inplace=False, doc="""
dq_h[b] = ds[b, h] k_h[b] / sqrt(dh): the gradient of attn_scores with respect to q, from the
score gradient ds = softmax_grad(dp, p) (zero where the causal mask was).
ds: [b, heads, t, t], k: [b*t, d], one float dtype -> dq: [b*t, d].
""")


def _grad_k_cpu(ins, outs, at):
    ds, q = _acc(ins[0]), _acc(ins[1])
    h, s = ds.shape[1], ds.shape[2]
    r = _merge(np.matmul(ds.transpose(0, 1, 3, 2), _split(q, s, h)))
    _write(outs[0], r * r.dtype.type(_scale_of(q.shape[1], h)))


_reg("attn_grad_k", "ds q", "dk", _pv_infer, _grad_k_cpu, inplace=False, doc="""
dk_h[b] = ds[b, h]^T q_h[b] / sqrt(dh): the gradient of attn_scores with respect to k.
ds: [b, heads, t, t], q: [b*t, d], one float dtype -> dk: [b*t, d].
""")


# --------------------------------------------------------------------------------------------
# AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019)


def _adamw_infer(k, names, t, at):
    _number(k, at, "beta1", lo=0.0, hi=1.0, hi_open=True)
    _number(k, at, "beta2", lo=0.0, hi=1.0, hi_open=True)
    _number(k, at, "eps", lo=0.0)
    _number(k, at, "weight_decay", lo=0.0)
    shape = _same_shape(k, t, names, (0, 1, 2, 3))
    dt = _floats(k, t, names, (0, 1, 2, 3))
    _scalar(k, t, names, 4)
    _scalar(k, t, names, 5, NUMERIC)
    return [(shape, dt), (shape, dt), (shape, dt)]


def _adamw_cpu(ins, outs, at):
    w, dw, m, v, lr_buf, t_buf = ins
    b1, b2, eps, wd = at["beta1"], at["beta2"], at["eps"], at["weight_decay"]
    lr, t = float(lr_buf), float(t_buf)
    if t < 1:
        raise ValueError(f"adamw_step: step count t is {t:g}; increment it (1-based) before the update")
    w_dec = w * (1 - lr * wd) if wd else w  # PyTorch's param.mul_(1 - lr * weight_decay), first
    m_new = m + (1 - b1) * (dw - m)
    v_new = v * b2 + (1 - b2) * dw * dw
    step_size = lr / (1 - b1 ** t)
    denom = np.sqrt(v_new) / math.sqrt(1 - b2 ** t) + eps
    w_new = w_dec - step_size * (m_new / denom)
    _write(outs[1], m_new)
    _write(outs[2], v_new)
    _write(outs[0], w_new)


_reg("adamw_step", "w dw m v lr t", "w m v", _adamw_infer, _adamw_cpu,
     {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}, doc="""
PyTorch's AdamW (torch.optim.AdamW, amsgrad off; https://pytorch.org/docs/stable/generated/
torch.optim.AdamW.html): decoupled weight decay, applied to the weight before the Adam step:
w = w (1 - lr weight_decay);  m = m + (1 - beta1)(dw - m);  v = beta2 v + (1 - beta2) dw^2;
w = w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps).
w, dw, m, v: one shape and float dtype; lr: [] float, t: [] step count (1 on the first step),
both device scalars read when the kernel runs -> (w, m, v), in place.
""")


# --------------------------------------------------------------------------------------------
# Gradient clipping by global norm (torch.nn.utils.clip_grad_norm_), on the device


def _sumsq_infer(k, names, t, at):
    _floats(k, t, names, (0,))
    _scalar(k, t, names, 1)
    return [t[1]]


def _sumsq_cpu(ins, outs, at):
    g, acc = ins
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        _write(outs[0], float(acc) + float((g64 * g64).sum()))


_reg("grad_sumsq", "g sumsq", "sumsq", _sumsq_infer, _sumsq_cpu, doc="""
sumsq = sumsq + sum(g^2): one gradient's share of the global squared norm, squares summed in
float64 and added to the device scalar (rounded once to its dtype).  Zero sumsq once per step
(`clear`) and call it on every gradient; clip_scale then reads it on the device.
g: float, any shape; sumsq: [] float -> sumsq, in place.
""")


def _clip_scale_infer(k, names, t, at):
    _number(k, at, "max_norm", lo=0.0)
    _number(k, at, "eps", lo=0.0)
    _scalar(k, t, names, 0)
    return [t[0]]


def _clip_scale_cpu(ins, outs, at):
    norm = math.sqrt(float(ins[0])) if float(ins[0]) >= 0 else float("nan")
    with np.errstate(invalid="ignore", divide="ignore"):
        _write(outs[0], np.minimum(1.0, at["max_norm"] / (norm + at["eps"])))


_reg("clip_scale", "sumsq", "scale", _clip_scale_infer, _clip_scale_cpu, {"max_norm": 1.0, "eps": 1e-6}, doc="""
scale = min(1, max_norm / (sqrt(sumsq) + eps)), in float64 rounded to sumsq's dtype: the
clipping factor of torch.nn.utils.clip_grad_norm_ (total_norm = sqrt(sumsq), eps = 1e-6 as
PyTorch's), computed on the device from grad_sumsq's scalar, never read by the host.  A NaN norm
gives NaN (as torch.clamp), an infinite one 0.  sumsq: [] float -> scale: [] of its dtype.
""")


def _scale_grad_infer(k, names, t, at):
    dt = _floats(k, t, names, (0,))
    _scalar(k, t, names, 1)
    return [(t[0][0], dt)]


def _scale_grad_cpu(ins, outs, at):
    g, scale = ins
    ga = _acc(g)
    with np.errstate(invalid="ignore", over="ignore"):
        _write(outs[0], ga * np.asarray(float(scale), ga.dtype))


_reg("scale_grad", "g scale", "g", _scale_grad_infer, _scale_grad_cpu, doc="""
g = g * scale, scale a [] device scalar (clip_scale's factor) rounded to g's compute dtype (f32
for f16/f32 g): the clipping itself, in place.  g: float, any shape; scale: [] float -> g.
""")


TRANSFORMER_KERNELS: tuple[str, ...] = tuple(list(KERNELS)[_FIRST:])
"""The kernels this module registered, in registration order (the order of its docs section)."""
