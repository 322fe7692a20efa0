"""The transformer family: token and positional embeddings, layer norm, softmax, causal multi-head
attention, AdamW and gradient clipping by global norm (a GPT step's kernels), each record with its
NumPy twin, its CUDA twin `<name>_cuda` and its row of docs/kernels.md.

Everything in `_base`'s module docstring holds here: `cpu(ins, outs, attrs)` writes only through
`out[...] = ...` after computing into temporaries (outputs may be inputs or views into one arena);
type rules raise `KernelTypeError` S003 (shapes, arity, attributes) / S004 (dtypes) with the
offending input's index; step-varying scalars (lr, t, the clipping norm) are `[]` device buffers
read when the kernel runs.  f16 inputs are computed in f32 (f64 stays f64) and rounded once.

Layout.  A sequence model keeps its activations flat, `[n, d]` with n = b * t rows in (sequence,
position) order, so `linear` applies unchanged.  Attention splits d into `heads` heads of
dh = d / heads columns: head h of row r is columns h*dh .. h*dh+dh-1.  Scores and probabilities
are `[b, heads, t, t]`: s[b, h, i, j] is how much position i of sequence b attends to position j.
Softmax cross-entropy over `[b, t]` next-token labels is the loss family's `softmax_xent` (labels of
any shape holding one label per row).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from streamsched.stdlib.kernel_record import KernelTypeError
from streamsched.stdlib.kernels._base import (FLOATS, INTS, NUMERIC, DocRow, Family, _acc, _dtype, _flag, _floats, _fmt,
                                              _int, _loss_dtype, _number, _same_shape, _scalar, _write)
from streamsched.stdlib.kernels._cuda import (_CNN_CT, _CNN_PRE, _HEAD, _acc_of, _contiguous, _cublas, _disjoint, _go,
                                              _grid, _kernels, _overlap, _same_or_copy, _stream)

FAMILY = Family(__name__, "Transformer")
_register = FAMILY.register


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


_register("embedding", "ids table", "y", _embedding_infer, _embedding_cpu, inplace=False, doc="""
y[r] = table[ids[r]]: one row of the table per id, the ids taken in row-major order (ids [b, t]
gives rows b*t, sequence by sequence, the flat layout the transformer ops use).
ids: any shape, i32 or i64; table: [vocab, dim] float -> y: [size(ids), dim] in table's dtype.
An id outside 0..vocab-1 raises ValueError when the kernel runs.  Backward: embedding_grad.
""",
          row=DocRow("ids [...] i32/i64, table [V,D] -> y [size(ids),D]", "comp3",
                     "y[r] = table[ids[r]], ids row-major; an id outside 0..V-1 raises `ValueError`"))


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


_register("embedding_grad", "dy ids", "dtable", _embedding_grad_infer, _embedding_grad_cpu, {"vocab": None},
          inplace=False, doc="""
dtable[v] = sum of dy[r] over the rows r with ids[r] == v (0 for ids that do not occur): the
gradient of embedding, a scatter-add made reproducible: each (row, column) is summed exactly on a
fixed-point grid (`kernels.transformer.segment_sum`: values truncated to multiples of 2^g,
g = e - 62 + ceil(log2 L), M = 2^e above the largest |value| of the L values, summed as int64),
so the result is bitwise the same whatever the order of duplicate ids, on every backend (no
float atomics), and for f16/f32 gradients exact before the final rounding to dtable's dtype
(through float64).  NaN or +-inf in a column propagate as in a sum.
dy: [n, dim] float, ids: n ids of any shape, i32/i64 -> dtable: [vocab, dim] in dy's dtype.
vocab (required): the table's rows.
""",
          row=DocRow("dy [n,D], ids (n of them) -> dtable [V,D]", "comp2",
                     "dtable[v] = Σ dy[r] over ids[r] = v, summed exactly on a fixed-point grid (below): bitwise "
                     "independent of the order of duplicate ids", required=("vocab",)))


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


_register("pos_embedding", "x table", "y", _pos_infer, _pos_cpu, doc="""
y[r] = x[r] + table[r % t]: the learned position embedding of row r's position in its sequence,
added to the flat [b*t, dim] activations (the table repeated per sequence).
x: [n, dim], table: [t, dim], one float dtype, n a multiple of t -> y: x's type.  Backward:
dx = dy (the op copies it), dtable = pos_embedding_grad(dy).
""",
          row=DocRow("x [n,D], table [t,D] -> y [n,D]", "comp3",
                     "y[r] = x[r] + table[r mod t]; one float dtype, t divides n"))


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


_register("pos_embedding_grad", "dy", "dtable", _pos_grad_infer, _pos_grad_cpu, {"context": None}, inplace=False,
          doc="""
dtable[j] = sum over the sequences b of dy[b*t + j]: the gradient of pos_embedding's table, added
in float64 sequence by sequence (b = 0, 1, ...), rounded once.
dy: [n, dim] float -> dtable: [context, dim] in dy's dtype; context (required) = t, dividing n.
""",
          row=DocRow("dy [n,D] -> dtable [t,D]", "comp2",
                     "dtable[j] = Σ_b dy[b·t + j], in f64, sequence by sequence", required=("context",)))


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


_register("layernorm", "x gamma beta", "y mean rstd", _ln_infer, _ln_cpu, {"eps": 1e-5}, inplace=False, doc="""
Layer norm over the last axis (Ba et al., 2016; torch.nn.LayerNorm(d, eps)): per row,
mean = sum(x) / d;  var = sum((x - mean)^2) / d (biased, two-pass);  rstd = 1 / sqrt(var + eps);
y = (x - mean) * rstd * gamma + beta.
x: [..., d] float; gamma, beta: [d], x's dtype -> y: x's type, mean, rstd: x.shape[:-1] in x's
dtype (f32 for f16 x), kept for the backward.  f16 computed in f32.
Backward: layernorm_grad_x (dx), layernorm_grad_gamma (dgamma), sum(dy, axis=0) (dbeta).
""",
          row=DocRow("x [...,d], gamma [d], beta [d] -> y, mean [...], rstd [...]", "comp2",
                     "per row: mean, biased var (two-pass), rstd = 1/sqrt(var + eps), y = (x - mean) rstd gamma + "
                     "beta; stats f32 for f16 x"))


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


_register("layernorm_grad_x", "dy x gamma mean rstd", "dx", _ln_gx_infer, _ln_gx_cpu, inplace=False, doc="""
The input gradient of layernorm, from its forward input x and saved mean, rstd (per row, means
over the last axis):  xhat = (x - mean) * rstd;  g = dy * gamma;
dx = rstd * (g - mean(g) - xhat * mean(g * xhat))  (PyTorch's layer_norm_backward).
dy, x: [..., d], one float dtype; gamma: [d] of it; mean, rstd: x.shape[:-1] float -> dx: x's type.
""",
          row=DocRow("dy, x, gamma, mean, rstd -> dx", "comp3",
                     "xhat = (x - mean) rstd, g = dy gamma, dx = rstd (g - mean(g) - xhat mean(g xhat)) (row "
                     "means)"))


def _ln_gg_infer(k, names, t, at):
    shape, dt = _ln_grad_common(k, names, t, 1, 2)
    return [((shape[-1],), dt)]


def _ln_gg_cpu(ins, outs, at):
    dy, x, mean, rstd = ins
    xa = _acc(x)
    xhat = (xa - mean.astype(xa.dtype)[..., None]) * rstd.astype(xa.dtype)[..., None]
    _write(outs[0], (_acc(dy) * xhat).reshape(-1, x.shape[-1]).sum(axis=0))


_register("layernorm_grad_gamma", "dy x mean rstd", "dgamma", _ln_gg_infer, _ln_gg_cpu, inplace=False, doc="""
dgamma = sum over the rows of dy * xhat, xhat = (x - mean) * rstd: layernorm's scale gradient (a
column reduction; dbeta is sum(dy, axis=0), so the two and dx can run on three streams).
dy, x: [..., d], one float dtype; mean, rstd: x.shape[:-1] -> dgamma: [d] in dy's dtype.
""",
          row=DocRow("dy, x, mean, rstd -> dgamma [d]", "comp2",
                     "dgamma = Σ_rows dy xhat (dbeta is `sum(dy, axis=0)`)"))


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


_register("softmax", "x", "y", _softmax_infer, _softmax_cpu, inplace=False, doc="""
y = exp(x - max) / sum(exp(x - max)) over the last axis (torch.softmax(x, -1)); -inf entries (a
causal mask) get 0; a row of only -inf gives NaN, as PyTorch.  x: [..., c] float -> y: same type
(f16 in f32).  Backward: softmax_grad(dy, y).
""",
          row=DocRow("x [...,c] -> y", "comp2",
                     "y = exp(x - max) / Σ exp(x - max) over the last axis; -inf gives 0, a row of only -inf NaN"))


def _softmax_grad_infer(k, names, t, at):
    shape = _same_shape(k, t, names, (0, 1))
    _softmax_infer(k, names, t[1:], at)
    return [(shape, _floats(k, t, names, (0, 1)))]


def _softmax_grad_cpu(ins, outs, at):
    dy, y = _acc(ins[0]), _acc(ins[1])
    _write(outs[0], y * (dy - (dy * y).sum(axis=-1, keepdims=True)))


_register("softmax_grad", "dy y", "dx", _softmax_grad_infer, _softmax_grad_cpu, inplace=False, doc="""
dx = y * (dy - sum(dy * y)) over the last axis: the gradient of softmax from its *output* y
(entries with y = 0, a masked score, get 0).  dy, y: one shape and float dtype -> dx: same type.
""",
          row=DocRow("dy, y -> dx", "comp3",
                     "dx = y (dy - Σ dy y) over the last axis, from the **output** y"))


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


_register("attn_scores", "q k", "s", _scores_infer, _scores_cpu, {"heads": None, "context": None, "causal": True},
          inplace=False, doc="""
s[b, h, i, j] = (q_h[b, i] . k_h[b, j]) / sqrt(dh), per sequence b and head h (q_h: columns
h*dh .. h*dh+dh-1, dh = d / heads), and -inf where j > i when causal (each position attends to
itself and earlier ones): scaled dot-product attention's scores (Vaswani et al., 2017), as
torch.nn.functional.scaled_dot_product_attention(is_causal=True) computes them.
q, k: [n, d], one float dtype, n = b * context -> s: [b, heads, context, context].
heads, context (required); causal=true.  On the GPU: one cuBLAS strided-batched GEMM per head.
""",
          row=DocRow("q [n,d], k [n,d] -> s [b,heads,t,t]", "comp1",
                     "s = q_h k_h^T / sqrt(dh) per sequence and head; -inf where j > i when causal",
                     required=("heads", "context")))


def _pv_infer(k, names, t, at):
    """(p, v) and the like: [b, h, t, t] with [b*t, d] -> [b*t, d]."""
    n, d = _rows_fit(k, t, names, 0, 1)
    return [((n, d), _floats(k, t, names, (0, 1)))]


def _apply_cpu(ins, outs, at):
    p, v = _acc(ins[0]), _acc(ins[1])
    _write(outs[0], _merge(np.matmul(p, _split(v, p.shape[2], p.shape[1]))))


_register("attn_apply", "p v", "o", _pv_infer, _apply_cpu, inplace=False, doc="""
o_h[b, i] = sum_j p[b, h, i, j] v_h[b, j]: the attention-weighted sum of the values, heads
concatenated back into columns (o = p v per head).
p: [b, heads, t, t], v: [b*t, d], one float dtype -> o: [b*t, d].
""",
          row=DocRow("p [b,heads,t,t], v [n,d] -> o [n,d]", "comp1",
                     "o_h = p v_h, heads concatenated into columns"))


def _grad_p_cpu(ins, outs, at):
    do, v = _acc(ins[0]), _acc(ins[1])
    h, s = int(at["heads"]), int(at["context"])
    _write(outs[0], np.matmul(_split(do, s, h), _split(v, s, h).transpose(0, 1, 3, 2)))


_register("attn_grad_p", "do v", "dp", _qk_infer, _grad_p_cpu, {"heads": None, "context": None}, inplace=False,
          doc="""
dp[b, h] = do_h[b] v_h[b]^T: the gradient of attn_apply with respect to the probabilities (no
scale, no mask: masked entries get values that softmax_grad multiplies by p = 0).
do, v: [n, d], one float dtype -> dp: [b, heads, context, context]; heads, context (required).
""",
          row=DocRow("do [n,d], v [n,d] -> dp [b,heads,t,t]", "comp1",
                     "dp = do_h v_h^T (no mask: softmax_grad multiplies it by p = 0 there)",
                     required=("heads", "context")))


def _grad_v_cpu(ins, outs, at):
    p, do = _acc(ins[0]), _acc(ins[1])
    _write(outs[0], _merge(np.matmul(p.transpose(0, 1, 3, 2), _split(do, p.shape[2], p.shape[1]))))


_register("attn_grad_v", "p do", "dv", _pv_infer, _grad_v_cpu, inplace=False, doc="""
dv_h[b] = p[b, h]^T do_h[b]: the gradient of attn_apply with respect to the values.
p: [b, heads, t, t], do: [b*t, d], one float dtype -> dv: [b*t, d].
""",
          row=DocRow("p, do [n,d] -> dv [n,d]", "comp2",
                     "dv_h = p^T do_h"))


def _grad_q_cpu(ins, outs, at):
    ds, kk = _acc(ins[0]), _acc(ins[1])
    h, s = ds.shape[1], ds.shape[2]
    r = _merge(np.matmul(ds, _split(kk, s, h)))
    _write(outs[0], r * r.dtype.type(_scale_of(kk.shape[1], h)))


_register("attn_grad_q", "ds k", "dq", _pv_infer, _grad_q_cpu, inplace=False, doc="""
dq_h[b] = ds[b, h] k_h[b] / sqrt(dh): the gradient of attn_scores with respect to q, from the
score gradient ds = softmax_grad(dp, p) (zero where the causal mask was).
ds: [b, heads, t, t], k: [b*t, d], one float dtype -> dq: [b*t, d].
""",
          row=DocRow("ds, k [n,d] -> dq [n,d]", "comp3",
                     "dq_h = ds k_h / sqrt(dh)"))


def _grad_k_cpu(ins, outs, at):
    ds, q = _acc(ins[0]), _acc(ins[1])
    h, s = ds.shape[1], ds.shape[2]
    r = _merge(np.matmul(ds.transpose(0, 1, 3, 2), _split(q, s, h)))
    _write(outs[0], r * r.dtype.type(_scale_of(q.shape[1], h)))


_register("attn_grad_k", "ds q", "dk", _pv_infer, _grad_k_cpu, inplace=False, doc="""
dk_h[b] = ds[b, h]^T q_h[b] / sqrt(dh): the gradient of attn_scores with respect to k.
ds: [b, heads, t, t], q: [b*t, d], one float dtype -> dk: [b*t, d].
""",
          row=DocRow("ds, q [n,d] -> dk [n,d]", "comp1",
                     "dk_h = ds^T q_h / sqrt(dh)"))


# --------------------------------------------------------------------------------------------
# Fused attention: the five kernels above in one forward and one backward launch


def _attn_fused_infer(k, names, t, at):
    _flag(k, at, "causal")
    (s, dt), = _qk_infer(k, names, t[:2], at)
    _same_shape(k, t, names, (0, 1, 2))
    return [(t[0][0], _floats(k, t, names, (0, 1, 2))), (s, dt)]


def _tmp(shape, dtype) -> np.ndarray:
    return np.empty(shape, dtype)


def _attn_fused_cpu(ins, outs, at):
    q, kk, v = ins
    y, p = outs
    s = _tmp(p.shape, p.dtype)  # the scores, in the output dtype, as attn_scores writes them
    _scores_cpu([q, kk], [s], at)
    pp = _tmp(p.shape, p.dtype)
    _softmax_cpu([s], [pp], at)
    yy = _tmp(y.shape, y.dtype)
    _apply_cpu([pp, v], [yy], at)
    p[...] = pp
    y[...] = yy


_register("attn_fused", "q k v", "y p", _attn_fused_infer, _attn_fused_cpu,
          {"heads": None, "context": None, "causal": True}, inplace=False, doc="""
Causal multi-head scaled dot-product attention in one launch (Vaswani et al., 2017):
p = softmax(attn_scores(q, k)) and y = attn_apply(p, v), per sequence b and head h, with the
values each of those kernels writes (the scores and probabilities rounded to the output dtype):
on the CPU it *is* attn_scores, softmax and attn_apply in turn.  q, k, v: [n, d], one float
dtype, n = b * context -> y: [n, d], p: [b, heads, context, context] (kept for the backward).
heads, context (required); causal=true.  On the GPU: one block per sequence, head and 8 query
rows (a warp each), K and V of the head staged in shared memory when they fit in 48 KiB (else a
slower kernel of any size reads them through the L1 cache); the scores never leave the block.
""",
          row=DocRow("q, k, v [n,d] -> y [n,d], p [b,heads,t,t]", "comp1",
                     "p = softmax(q_h k_h^T / sqrt(dh), causal), y_h = p v_h, in one launch",
                     required=("heads", "context")))


def _attn_fused_grad_infer(k, names, t, at):
    _rank2(k, t, names, 0, "[n, d] (n = b * t rows)")
    _same_shape(k, t, names, (0, 1, 2, 3))
    n, d = _rows_fit(k, t, names, 4, 0)
    b, h, s = _probs(k, t, names, 4)
    if _heads_of(k, at, d, 0) != h or _seq_of(k, at, n, 0) != s:
        raise KernelTypeError(f"{k}: p {_fmt(t[4][0])} does not match heads = {at['heads']}, "
                              f"context = {at['context']}", arg=4)
    dt = _floats(k, t, names, (0, 1, 2, 3, 4))
    return [((n, d), dt)] * 3


def _attn_fused_grad_cpu(ins, outs, at):
    dy, q, kk, v, p = ins
    dq, dk, dv = outs
    dvv = _tmp(dv.shape, dv.dtype)
    _grad_v_cpu([p, dy], [dvv], at)
    dp = _tmp(p.shape, dq.dtype)
    _grad_p_cpu([dy, v], [dp], at)
    ds = _tmp(p.shape, dq.dtype)
    _softmax_grad_cpu([dp, p], [ds], at)
    dkk = _tmp(dk.shape, dk.dtype)
    _grad_k_cpu([ds, q], [dkk], at)
    dqq = _tmp(dq.shape, dq.dtype)
    _grad_q_cpu([ds, kk], [dqq], at)
    dq[...] = dqq
    dk[...] = dkk
    dv[...] = dvv


_register("attn_fused_grad", "dy q k v p", "dq dk dv", _attn_fused_grad_infer, _attn_fused_grad_cpu,
          {"heads": None, "context": None}, inplace=False, doc="""
The gradient of attn_fused in one launch: dv = attn_grad_v(p, dy), dp = attn_grad_p(dy, v),
ds = softmax_grad(dp, p), dk = attn_grad_k(ds, q), dq = attn_grad_q(ds, k), with the values
each of those kernels writes (dp and ds rounded to the output dtype); on the CPU it is those
five kernels in turn.  dy, q, k, v: [n, d], p: [b, heads, context, context] (attn_fused's),
one float dtype -> dq, dk, dv: [n, d].  heads, context (required).  On the GPU: one block per
sequence, head and 8 rows (a warp each), the head's dy, q, k, v and p staged in shared memory
when they fit in 48 KiB (else a slower kernel of any size); each block computes sum_j p dp of
every row, then dq of its rows and dk, dv of its columns, recomputing dp rather than storing it.
""",
          row=DocRow("dy, q, k, v [n,d], p -> dq, dk, dv [n,d]", "comp3",
                     "attn_fused's gradient in one launch (dv, dp, softmax_grad, dk, dq)",
                     required=("heads", "context")))


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


_register("adamw_step", "w dw m v lr t", "w m v", _adamw_infer, _adamw_cpu,
          {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}, doc="""
PyTorch's AdamW (torch.optim.AdamW, amsgrad off; https://pytorch.org/docs/stable/generated/
torch.optim.AdamW.html): decoupled weight decay, applied to the weight before the Adam step:
w = w (1 - lr weight_decay);  m = m + (1 - beta1)(dw - m);  v = beta2 v + (1 - beta2) dw^2;
w = w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps).
w, dw, m, v: one shape and float dtype; lr: [] float, t: [] step count (1 on the first step),
both device scalars read when the kernel runs -> (w, m, v), in place.
""",
          row=DocRow("w, dw, m, v, lr [], t [] -> w, m, v", "update",
                     "PyTorch AdamW: w = w (1 - lr wd); m = b1 m + (1-b1) dw; v = b2 v + (1-b2) dw^2; w -= "
                     "lr/(1-b1^t) m / (sqrt(v)/sqrt(1-b2^t) + eps)"))


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


_register("grad_sumsq", "g sumsq", "sumsq", _sumsq_infer, _sumsq_cpu, doc="""
sumsq = sumsq + sum(g^2): one gradient's share of the global squared norm, squares summed in
float64 and added to the device scalar (rounded once to its dtype).  Zero sumsq once per step
(`clear`) and call it on every gradient; clip_scale then reads it on the device.
g: float, any shape; sumsq: [] float -> sumsq, in place.
""",
          row=DocRow("g, sumsq [] -> sumsq", "update",
                     "sumsq += Σ g² (squares summed in f64): one gradient's share of the global norm"))


def _clip_scale_infer(k, names, t, at):
    _number(k, at, "max_norm", lo=0.0)
    _number(k, at, "eps", lo=0.0)
    _scalar(k, t, names, 0)
    return [t[0]]


def _clip_scale_cpu(ins, outs, at):
    norm = math.sqrt(float(ins[0])) if float(ins[0]) >= 0 else float("nan")
    with np.errstate(invalid="ignore", divide="ignore"):
        _write(outs[0], np.minimum(1.0, at["max_norm"] / (norm + at["eps"])))


_register("clip_scale", "sumsq", "scale", _clip_scale_infer, _clip_scale_cpu, {"max_norm": 1.0, "eps": 1e-6}, doc="""
scale = min(1, max_norm / (sqrt(sumsq) + eps)), in float64 rounded to sumsq's dtype: the
clipping factor of torch.nn.utils.clip_grad_norm_ (total_norm = sqrt(sumsq), eps = 1e-6 as
PyTorch's), computed on the device from grad_sumsq's scalar, never read by the host.  A NaN norm
gives NaN (as torch.clamp), an infinite one 0.  sumsq: [] float -> scale: [] of its dtype.
""",
          row=DocRow("sumsq [] -> scale []", "update",
                     "scale = min(1, max_norm / (sqrt(sumsq) + eps)) (NaN stays NaN)"))


def _scale_grad_infer(k, names, t, at):
    dt = _floats(k, t, names, (0,))
    _scalar(k, t, names, 1)
    return [(t[0][0], dt)]


def _scale_grad_cpu(ins, outs, at):
    g, scale = ins
    ga = _acc(g)
    with np.errstate(invalid="ignore", over="ignore"):
        _write(outs[0], ga * np.asarray(float(scale), ga.dtype))


_register("scale_grad", "g scale", "g", _scale_grad_infer, _scale_grad_cpu, doc="""
g = g * scale, scale a [] device scalar (clip_scale's factor) rounded to g's compute dtype (f32
for f16/f32 g): the clipping itself, in place.  g: float, any shape; scale: [] float -> g.
""",
          row=DocRow("g, scale [] -> g", "update",
                     "g = g · scale, in place"))


TRANSFORMER_KERNELS: tuple[str, ...] = tuple(FAMILY.kernels)
"""The kernels this module registered, in registration order (the order of its rows in docs/kernels.md);
tests/test_kernels_transformer.py checks them."""


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.
#
# The transformer kernels' twins, the NumPy twins' semantics, written like the other families'
# so that they can be captured into a CUDA graph.
#
# Calling convention and capture rules are _cuda.py's: `fn(ctx, stream, ins, outs, attrs)`
# with CuPy arrays (outputs preallocated, an output may be an input for the elementwise kernels);
# GEMMs on the stream's own cuBLAS handle; step-varying scalars (lr, t, the clipping norm and
# scale) read from device memory inside the kernels; nothing allocated but the embedding
# backward's scratch, a temporary of the call from the current pool (under the executor the
# private pool of the graph being captured), as the convolutions' im2col columns are.  Raw kernels
# are compiled with FMA contraction off and the typedefs of _cuda's CNN kernels (X_t data,
# A_t compute: f32 for f16/f32, f64 for f64).  Every reduction has a fixed order: a warp per row
# adding lane by lane then a fixed xor butterfly (softmax, layer norm), a block per column with a
# fixed tree (dgamma, the squared norm), a serial loop (the position gradient, bitwise equal to the
# NumPy twin).  The embedding backward is a scatter-add with integer atomics only: each value is
# truncated onto a fixed-point grid chosen from its (row, column)'s largest magnitude and count
# (`segment_sum` above), the int64 sums are exact and order-free, so the result is
# bitwise the NumPy twin's whatever order the atomics land in.
#
# Attention runs on flat [b*t, d] activations: for head h the [t, dh] block of sequence b starts at
# element b*t*d + h*dh with row stride d, so the b blocks of one head are a strided batch (stride
# t*d) and each attention GEMM is one cuBLAS strided-batched GEMM per head (`_gemm_heads`), batched
# over the sequences; scores and probabilities [b, heads, t, t] have stride heads*t*t between
# sequences.
#
# CuPy and nvmath are imported on first use.

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

# Fused attention (attn_fused, attn_fused_grad).  The head slice of sequence b, head h in a flat
# [n, d] array: element (r, c) at base + r * d + c, base = b * t * d + h * dh.  Three variants:
#   tiled (ss_attn_fwd_tiled, ss_attn_bwd_tiled in _ATTN_FAST): 16 x 16 threads in register
#     tiles, bitwise the fast ones below, where their shared memory fits (_ATTN_TILED);
#   fast (_ATTN_FAST): the head's slices copied into shared memory (rows padded to dh + 1, so
#     lanes reading one column of consecutive rows hit distinct banks), one warp per query row
#     (forward) or per row and column (backward), 8 warps a block forward, 16 backward; taken
#     when its shared memory fits _ATTN_SMEM (the device's opt-in limit per block);
#   global (_ATTN_GLOBAL): any size: the slices read through the L1 cache, each row's scores in
#     p itself, per-lane register arrays of SS_MAXJ = ceil(t / 32) entries.
# Every product is an FMA; the scores and probabilities (forward), dp and ds (backward) are
# rounded to X_t where the unfused kernels write them, so f16 takes the same roundings; the sums
# over a row run in double, as ss_softmax and ss_softmax_grad do; every sum runs over all t
# entries (masked ones are 0), as the unfused GEMMs do.
_ATTN_COMMON = r"""
__device__ __forceinline__ float ss_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double ss_fma(double a, double b, double c) { return __fma_rn(a, b, c); }
__device__ __forceinline__ A_t ss_round(A_t v) { X_t x; ss_put(&x, v); return SS_LD(x); }
__device__ __forceinline__ A_t ss_warp_add(A_t v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
#define SS_HEAD_OF_BLOCK int bh = blockIdx.x, b = bh / heads, h = bh - b * heads; \
    long long base = (long long)b * t * d + (long long)h * dh; \
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
// The tiled kernels' head: block (head bh, row block blockIdx.y) of 16 x 16 threads, thread
// (ty, tx); shared rows padded by one (ld = dh + 1 for [t, dh] tiles, lp = t + 1 for [t, t]).
#define SS_TILE_OF_BLOCK int bh = blockIdx.x, b = bh / heads, h = bh - b * heads; \
    long long base = (long long)b * t * d + (long long)h * dh; \
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4; \
    int ld = dh + 1, lp = t + 1;
"""

_ATTN_FAST = r"""
#define SS_STAGE(dst, src, rows) for (int e = threadIdx.x; e < (rows) * dh; e += blockDim.x) { \
        int r_ = e / dh, c_ = e - r_ * dh; dst[r_ * ld + c_] = SS_LD(src[base + (long long)r_ * d + c_]); }

// y, p = attention(q, k, v): grid (b * heads, ceil(t / warps)); warp w takes query row
// i = blockIdx.y * warps + w: lanes over keys j compute s_ij = q_i . k_j * scale (-inf past i
// when causal) into the warp's row buffer, the row's max and sum, p_ij; then lanes over columns
// c compute y_ic = sum_j p_ij v_jc.  Shared: K, V [t, dh + 1], per warp q_i [dh] and the row [t].
extern "C" __global__ void ss_attn_fwd(const X_t* q, const X_t* k, const X_t* v, X_t* y, X_t* p,
        int heads, int t, int d, int dh, A_t scale, int causal) {
    extern __shared__ unsigned char ss_sm[];
    SS_HEAD_OF_BLOCK
    int ld = dh + 1;
    A_t* ks = (A_t*)ss_sm;
    A_t* vs = ks + t * ld;
    A_t* qi = vs + t * ld + warp * (dh + t);
    A_t* row = qi + dh;
    int i = blockIdx.y * nw + warp;
    SS_STAGE(ks, k, t)
    SS_STAGE(vs, v, t)
    if (i < t) for (int c = lane; c < dh; c += 32) qi[c] = SS_LD(q[base + (long long)i * d + c]);
    __syncthreads();
    if (i >= t) return;
    A_t m = -(A_t)SS_INF;
    for (int j = lane; j < t; j += 32) {
        A_t sc = -(A_t)SS_INF;
        if (!causal || j <= i) {
            A_t acc = 0;
            const A_t* kj = ks + j * ld;
#pragma unroll 8
            for (int c = 0; c < dh; ++c) acc = ss_fma(qi[c], kj[c], acc);
            sc = ss_round(acc * scale);
        }
        row[j] = sc;
        m = ss_nmax(m, sc);
    }
    m = ss_warp_max(m);
    double sum = 0.0;
    for (int j = lane; j < t; j += 32) sum += (double)ss_e(row[j] - m);
    sum = ss_warp_sum(sum);
    A_t den = (A_t)sum;
    X_t* pi = p + ((long long)bh * t + i) * t;
    for (int j = lane; j < t; j += 32) {
        A_t pv = ss_round(ss_e(row[j] - m) / den);
        row[j] = pv;
        ss_put(pi + j, pv);
    }
    __syncwarp();
    for (int c = lane; c < dh; c += 32) {
        A_t acc = 0;
#pragma unroll 8
        for (int j = 0; j < t; ++j) acc = ss_fma(row[j], vs[j * ld + c], acc);
        ss_put(y + base + (long long)i * d + c, acc);
    }
}

// dq, dk, dv of attention: grid (b * heads, ceil(t / rows)).  Every block first computes
// dot_i = sum_j p_ij dp_ij (dp_ij = dy_i . v_j) of all t rows; then warp w takes the block's
// rows r = blockIdx.y * rows + w, + warps, ...: ds_rj (its row) and ds_ir (its column) into the
// warp's buffers, with
// ds_ij = p_ij (dp_ij - dot_i), then lanes over columns c: dq_rc = scale sum_j ds_rj k_jc,
// dk_rc = scale sum_i ds_ir q_ic, dv_rc = sum_i p_ir dy_ic.  Shared: dot [t]; dy, q, k, v
// [t, dh + 1]; p [t, t + 1]; per warp two [t] buffers.
extern "C" __global__ void ss_attn_bwd(const X_t* dy, const X_t* q, const X_t* k, const X_t* v,
        const X_t* p, X_t* dq, X_t* dk, X_t* dv, int heads, int t, int d, int dh, A_t scale, int rows) {
    extern __shared__ unsigned char ss_sm[];
    SS_HEAD_OF_BLOCK
    int ld = dh + 1;
    A_t* dot = (A_t*)ss_sm;
    A_t* dys = dot + t;
    A_t* qs = dys + t * ld;
    A_t* ks = qs + t * ld;
    A_t* vs = ks + t * ld;
    A_t* ps = vs + t * ld;
    A_t* dsr = ps + t * (t + 1) + warp * 2 * t;
    A_t* dsc = dsr + t;
    SS_STAGE(dys, dy, t)
    SS_STAGE(qs, q, t)
    SS_STAGE(ks, k, t)
    SS_STAGE(vs, v, t)
    const X_t* pb = p + (long long)bh * t * t;
    for (int e = threadIdx.x; e < t * t; e += blockDim.x) {
        int r_ = e / t;
        ps[r_ * (t + 1) + (e - r_ * t)] = SS_LD(pb[e]);
    }
    __syncthreads();
    for (int i = warp; i < t; i += nw) {
        double sd = 0.0;
        const A_t* dyi = dys + i * ld;
        for (int j = lane; j < t; j += 32) {
            A_t dp = 0;
            const A_t* vj = vs + j * ld;
#pragma unroll 8
            for (int c = 0; c < dh; ++c) dp = ss_fma(dyi[c], vj[c], dp);
            sd += (double)(ss_round(dp) * ps[i * (t + 1) + j]);
        }
        sd = ss_warp_sum(sd);
        if (lane == 0) dot[i] = (A_t)sd;
    }
    __syncthreads();
    int r1 = min(t, (int)(blockIdx.y + 1) * rows);
    for (int r = blockIdx.y * rows + warp; r < r1; r += nw) {
        const A_t* dyr = dys + r * ld;
        const A_t* vr = vs + r * ld;
        for (int j = lane; j < t; j += 32) {
            A_t dp = 0;
            const A_t* vj = vs + j * ld;
#pragma unroll 8
            for (int c = 0; c < dh; ++c) dp = ss_fma(dyr[c], vj[c], dp);
            dsr[j] = ss_round(ps[r * (t + 1) + j] * (ss_round(dp) - dot[r]));
        }
        for (int i = lane; i < t; i += 32) {
            A_t dp = 0;
            const A_t* dyi = dys + i * ld;
#pragma unroll 8
            for (int c = 0; c < dh; ++c) dp = ss_fma(dyi[c], vr[c], dp);
            dsc[i] = ss_round(ps[i * (t + 1) + r] * (ss_round(dp) - dot[i]));
        }
        __syncwarp();
        for (int c = lane; c < dh; c += 32) {
            A_t aq = 0, ak = 0, av = 0;
#pragma unroll 4
            for (int j = 0; j < t; ++j) {
                aq = ss_fma(dsr[j], ks[j * ld + c], aq);
                ak = ss_fma(dsc[j], qs[j * ld + c], ak);
                av = ss_fma(ps[j * (t + 1) + r], dys[j * ld + c], av);
            }
            ss_put(dq + base + (long long)r * d + c, aq * scale);
            ss_put(dk + base + (long long)r * d + c, ak * scale);
            ss_put(dv + base + (long long)r * d + c, av);
        }
        __syncwarp();
    }
}

// The register-tiled forward (what runs where its operands fit, ss_attn_fwd past that): the
// products, maxima and sums of ss_attn_fwd in the same order, so bitwise its y and p, over
// 16 x 16 threads (ty, tx) in register tiles.  grid (b * heads, ceil(t / rows)), 256 threads;
// the block's query rows i = r0 + ...: thread (ty, tx) takes the SS_TFU x 4 tile of rows
// i0 + ty + 16u, keys j0 + tx + 16w of s_ij; the row's max and double sum are ss_attn_fwd's
// warp reductions (its lane l took keys l, l + 32, ...: here tx's even and odd w, then the
// half-warp's butterfly); then y_ic = sum_j p_ij v_jc, SS_TRA rows of column c = tx a thread.
// Shared: K, V [t, dh + 1], the block's q [rows, dh + 1] and rows of s / p [rows, t + 1].
#define SS_TFU 2
#define SS_TRA 2
extern "C" __global__ void ss_attn_fwd_tiled(const X_t* q, const X_t* k, const X_t* v, X_t* y, X_t* p,
        int heads, int t, int d, int dh, A_t scale, int causal, int rows) {
    extern __shared__ unsigned char ss_sm[];
    SS_TILE_OF_BLOCK
    int r0 = blockIdx.y * rows, r1 = min(t, r0 + rows);
    A_t* ks = (A_t*)ss_sm;
    A_t* vs = ks + t * ld;
    A_t* qs = vs + t * ld;
    A_t* ss = qs + rows * ld;
    for (int r = ty; r < t; r += 16) {
        long long g = base + (long long)r * d;
        for (int c = tx; c < dh; c += 16) {
            ks[r * ld + c] = SS_LD(k[g + c]);
            vs[r * ld + c] = SS_LD(v[g + c]);
        }
    }
    for (int r = r0 + ty; r < r1; r += 16)
        for (int c = tx; c < dh; c += 16) qs[(r - r0) * ld + c] = SS_LD(q[base + (long long)r * d + c]);
    __syncthreads();
    for (int i0 = r0; i0 < r1; i0 += 16 * SS_TFU) {
        A_t m[SS_TFU];
#pragma unroll
        for (int u = 0; u < SS_TFU; ++u) m[u] = -(A_t)SS_INF;
        for (int j0 = 0; j0 < t; j0 += 64) {
            A_t acc[SS_TFU][4];
            const A_t* ar[SS_TFU];
            const A_t* br[4];
#pragma unroll
            for (int u = 0; u < SS_TFU; ++u) {
                ar[u] = qs + (min(i0 + ty + 16 * u, r1 - 1) - r0) * ld;
#pragma unroll
                for (int w = 0; w < 4; ++w) acc[u][w] = 0;
            }
#pragma unroll
            for (int w = 0; w < 4; ++w) br[w] = ks + min(j0 + tx + 16 * w, t - 1) * ld;
            for (int c = 0; c < dh; ++c) {
                A_t a[SS_TFU], bv[4];
#pragma unroll
                for (int u = 0; u < SS_TFU; ++u) a[u] = ar[u][c];
#pragma unroll
                for (int w = 0; w < 4; ++w) bv[w] = br[w][c];
#pragma unroll
                for (int u = 0; u < SS_TFU; ++u)
#pragma unroll
                    for (int w = 0; w < 4; ++w) acc[u][w] = ss_fma(a[u], bv[w], acc[u][w]);
            }
#pragma unroll
            for (int u = 0; u < SS_TFU; ++u) {
                int i = i0 + ty + 16 * u;
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    int j = j0 + tx + 16 * w;
                    if (i < r1 && j < t) {
                        A_t sc = (!causal || j <= i) ? ss_round(acc[u][w] * scale) : -(A_t)SS_INF;
                        ss[(i - r0) * lp + j] = sc;
                        m[u] = ss_nmax(m[u], sc);
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < SS_TFU; ++u) {
            for (int o = 8; o > 0; o >>= 1) m[u] = ss_nmax(m[u], __shfl_xor_sync(0xffffffffu, m[u], o));
            int i = i0 + ty + 16 * u;
            A_t* sr = ss + (min(i, r1 - 1) - r0) * lp;
            double lo = 0.0, hi = 0.0;
            if (i < r1)
                for (int j0 = 0; j0 < t; j0 += 32) {
                    if (j0 + tx < t) lo += (double)ss_e(sr[j0 + tx] - m[u]);
                    if (j0 + tx + 16 < t) hi += (double)ss_e(sr[j0 + tx + 16] - m[u]);
                }
            double sum = lo + hi;
            for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            A_t den = (A_t)sum;
            if (i < r1) {
                X_t* pi = p + ((long long)bh * t + i) * t;
                for (int j = tx; j < t; j += 16) {
                    A_t pv = ss_round(ss_e(sr[j] - m[u]) / den);
                    sr[j] = pv;
                    ss_put(pi + j, pv);
                }
            }
        }
    }
    __syncthreads();
    for (int rr = r0; rr < r1; rr += 16 * SS_TRA) {
        int ra[SS_TRA];
#pragma unroll
        for (int a = 0; a < SS_TRA; ++a) ra[a] = min(rr + ty + 16 * a, r1 - 1) - r0;
        for (int c = tx; c < dh; c += 16) {
            A_t acc[SS_TRA];
#pragma unroll
            for (int a = 0; a < SS_TRA; ++a) acc[a] = 0;
#pragma unroll 4
            for (int j = 0; j < t; ++j) {
                A_t vc = vs[j * ld + c];
#pragma unroll
                for (int a = 0; a < SS_TRA; ++a) acc[a] = ss_fma(ss[ra[a] * lp + j], vc, acc[a]);
            }
#pragma unroll
            for (int a = 0; a < SS_TRA; ++a) {
                int r = rr + ty + 16 * a;
                if (r < r1) ss_put(y + base + (long long)r * d + c, acc[a]);
            }
        }
    }
}

// The register-tiled backward (what runs where its operands fit, ss_attn_bwd past that): the
// same products in the same order as ss_attn_bwd, so bitwise its dq, dk, dv, with the work
// spread over 16 x 16 threads (ty, tx) in register tiles instead of one row a warp.  grid
// (b * heads, ceil(t / rows)), 256 threads.  Phase 1 (every block, all t rows): thread (ty, tx)
// takes the 4 x 4 tile of rows i0 + ty + 16u, columns j0 + tx + 16w of dp_ij = dy_i . v_j,
// rounded into ds; dot_i is ss_attn_bwd's warp sum: its lane l added columns l, l + 32, ...
// (here tx's even and odd w), then the lanes' butterfly (here 16 + 8 + 4 + 2 + 1: the first
// step is lo + hi, the rest a half-warp's shuffles); then ds_ij = p_ij (dp_ij - dot_i) in place.
// Phase 2 (the block's rows r): thread (ty, tx) takes SS_TRA rows r = rr + ty + 16a of column
// c = tx (+ 16, ...) of dq, dk, dv, each one FMA chain over j ascending, as ss_attn_bwd's lanes.
// Shared: dy, q, k, v [t, dh + 1]; p, ds [t, t + 1].
extern "C" __global__ void ss_attn_bwd_tiled(const X_t* dy, const X_t* q, const X_t* k, const X_t* v,
        const X_t* p, X_t* dq, X_t* dk, X_t* dv, int heads, int t, int d, int dh, A_t scale, int rows) {
    extern __shared__ unsigned char ss_sm[];
    SS_TILE_OF_BLOCK
    A_t* dys = (A_t*)ss_sm;
    A_t* qs = dys + t * ld;
    A_t* ks = qs + t * ld;
    A_t* vs = ks + t * ld;
    A_t* ps = vs + t * ld;
    A_t* ss = ps + t * lp;
    for (int r = ty; r < t; r += 16) {
        long long g = base + (long long)r * d;
        for (int c = tx; c < dh; c += 16) {
            dys[r * ld + c] = SS_LD(dy[g + c]);
            qs[r * ld + c] = SS_LD(q[g + c]);
            ks[r * ld + c] = SS_LD(k[g + c]);
            vs[r * ld + c] = SS_LD(v[g + c]);
        }
    }
    const X_t* pb = p + (long long)bh * t * t;
    for (int i = ty; i < t; i += 16)
        for (int j = tx; j < t; j += 16) ps[i * lp + j] = SS_LD(pb[(long long)i * t + j]);
    __syncthreads();
    for (int i0 = 0; i0 < t; i0 += 64) {
        double lo[4] = {0.0, 0.0, 0.0, 0.0}, hi[4] = {0.0, 0.0, 0.0, 0.0};
        for (int j0 = 0; j0 < t; j0 += 64) {
            A_t acc[4][4];
            const A_t* ar[4];
            const A_t* br[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                ar[u] = dys + min(i0 + ty + 16 * u, t - 1) * ld;
                br[u] = vs + min(j0 + tx + 16 * u, t - 1) * ld;
#pragma unroll
                for (int w = 0; w < 4; ++w) acc[u][w] = 0;
            }
            for (int c = 0; c < dh; ++c) {
                A_t a[4], bv[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) { a[u] = ar[u][c]; bv[u] = br[u][c]; }
#pragma unroll
                for (int u = 0; u < 4; ++u)
#pragma unroll
                    for (int w = 0; w < 4; ++w) acc[u][w] = ss_fma(a[u], bv[w], acc[u][w]);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                int i = i0 + ty + 16 * u;
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    int j = j0 + tx + 16 * w;
                    if (i < t && j < t) {
                        A_t dp = ss_round(acc[u][w]);
                        ss[i * lp + j] = dp;
                        double x = (double)(dp * ps[i * lp + j]);
                        if (w & 1) hi[u] += x; else lo[u] += x;
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            double s = lo[u] + hi[u];
            for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            A_t dot = (A_t)s;
            int i = i0 + ty + 16 * u;
            if (i < t)
                for (int j = tx; j < t; j += 16) ss[i * lp + j] = ss_round(ps[i * lp + j] * (ss[i * lp + j] - dot));
        }
    }
    __syncthreads();
    int r1 = min(t, (int)(blockIdx.y + 1) * rows);
    for (int rr = blockIdx.y * rows; rr < r1; rr += 16 * SS_TRA) {
        int ra[SS_TRA];
#pragma unroll
        for (int a = 0; a < SS_TRA; ++a) ra[a] = min(rr + ty + 16 * a, t - 1);
        for (int c = tx; c < dh; c += 16) {
            A_t aq[SS_TRA], ak[SS_TRA], av[SS_TRA];
#pragma unroll
            for (int a = 0; a < SS_TRA; ++a) aq[a] = ak[a] = av[a] = 0;
#pragma unroll 4
            for (int j = 0; j < t; ++j) {
                A_t kc = ks[j * ld + c], qc = qs[j * ld + c], dyc = dys[j * ld + c];
#pragma unroll
                for (int a = 0; a < SS_TRA; ++a) {
                    aq[a] = ss_fma(ss[ra[a] * lp + j], kc, aq[a]);
                    ak[a] = ss_fma(ss[j * lp + ra[a]], qc, ak[a]);
                    av[a] = ss_fma(ps[j * lp + ra[a]], dyc, av[a]);
                }
            }
#pragma unroll
            for (int a = 0; a < SS_TRA; ++a) {
                int r = rr + ty + 16 * a;
                if (r < r1) {
                    long long o = base + (long long)r * d + c;
                    ss_put(dq + o, aq[a] * scale);
                    ss_put(dk + o, ak[a] * scale);
                    ss_put(dv + o, av[a]);
                }
            }
        }
    }
}
"""

_ATTN_GLOBAL = r"""
#define SS_AT(a, r, c) SS_LD(a[base + (long long)(r) * d + (c)])

// The forward of any size: grid (b * heads, ceil(t / rows)), warps taking rows i in turn, the
// row's scores and probabilities kept in p's row i.
extern "C" __global__ void ss_attn_fwd_global(const X_t* q, const X_t* k, const X_t* v, X_t* y, X_t* p,
        int heads, int t, int d, int dh, A_t scale, int causal, int rows) {
    SS_HEAD_OF_BLOCK
    int i1 = min(t, (int)(blockIdx.y + 1) * rows);
    for (int i = blockIdx.y * rows + warp; i < i1; i += nw) {
        const X_t* qi = q + base + (long long)i * d;
        X_t* pi = p + ((long long)bh * t + i) * t;
        A_t m = -(A_t)SS_INF;
        for (int j = lane; j < t; j += 32) {
            A_t sc = -(A_t)SS_INF;
            if (!causal || j <= i) {
                A_t acc = 0;
                for (int c = 0; c < dh; ++c) acc = ss_fma(SS_LD(qi[c]), SS_AT(k, j, c), acc);
                sc = ss_round(acc * scale);
            }
            ss_put(pi + j, sc);
            m = ss_nmax(m, sc);
        }
        m = ss_warp_max(m);
        double sum = 0.0;
        for (int j = lane; j < t; j += 32) sum += (double)ss_e(SS_LD(pi[j]) - m);
        sum = ss_warp_sum(sum);
        A_t den = (A_t)sum;
        for (int j = lane; j < t; j += 32) ss_put(pi + j, ss_round(ss_e(SS_LD(pi[j]) - m) / den));
        __syncwarp();
        for (int c = lane; c < dh; c += 32) {
            A_t acc = 0;
            for (int j = 0; j < t; ++j) acc = ss_fma(SS_LD(pi[j]), SS_AT(v, j, c), acc);
            ss_put(y + base + (long long)i * d + c, acc);
        }
        __syncwarp();
    }
}

// The backward of any size: grid (b * heads, ceil(t / rows)); every block computes dot_i of all
// rows (shared: dot [t]), then dq of its rows and dk, dv of its columns, each output column a
// warp sum over the lanes' register arrays of ds (and p).
extern "C" __global__ void ss_attn_bwd_global(const X_t* dy, const X_t* q, const X_t* k, const X_t* v,
        const X_t* p, X_t* dq, X_t* dk, X_t* dv, int heads, int t, int d, int dh, A_t scale, int rows) {
    extern __shared__ unsigned char ss_sm[];
    SS_HEAD_OF_BLOCK
    A_t* dot = (A_t*)ss_sm;
    const X_t* pb = p + (long long)bh * t * t;
    for (int i = warp; i < t; i += nw) {
        double sd = 0.0;
        for (int j = lane; j < t; j += 32) {
            A_t dp = 0;
            for (int c = 0; c < dh; ++c) dp = ss_fma(SS_AT(dy, i, c), SS_AT(v, j, c), dp);
            sd += (double)(ss_round(dp) * SS_LD(pb[(long long)i * t + j]));
        }
        sd = ss_warp_sum(sd);
        if (lane == 0) dot[i] = (A_t)sd;
    }
    __syncthreads();
    int r0 = blockIdx.y * rows, r1 = min(t, r0 + rows);
    for (int i = r0 + warp; i < r1; i += nw) {
        A_t ds[SS_MAXJ];
        int nj = 0;
        for (int j = lane; j < t; j += 32, ++nj) {
            A_t dp = 0;
            for (int c = 0; c < dh; ++c) dp = ss_fma(SS_AT(dy, i, c), SS_AT(v, j, c), dp);
            ds[nj] = ss_round(SS_LD(pb[(long long)i * t + j]) * (ss_round(dp) - dot[i]));
        }
        for (int c = 0; c < dh; ++c) {
            A_t acc = 0;
            nj = 0;
            for (int j = lane; j < t; j += 32, ++nj) acc = ss_fma(ds[nj], SS_AT(k, j, c), acc);
            acc = ss_warp_add(acc);
            if (lane == (c & 31)) ss_put(dq + base + (long long)i * d + c, acc * scale);
        }
    }
    for (int j = r0 + warp; j < r1; j += nw) {
        A_t ds[SS_MAXJ], pj[SS_MAXJ];
        int ni = 0;
        for (int i = lane; i < t; i += 32, ++ni) {
            A_t dp = 0;
            for (int c = 0; c < dh; ++c) dp = ss_fma(SS_AT(dy, i, c), SS_AT(v, j, c), dp);
            pj[ni] = SS_LD(pb[(long long)i * t + j]);
            ds[ni] = ss_round(pj[ni] * (ss_round(dp) - dot[i]));
        }
        for (int c = 0; c < dh; ++c) {
            A_t ak = 0, av = 0;
            ni = 0;
            for (int i = lane; i < t; i += 32, ++ni) {
                ak = ss_fma(ds[ni], SS_AT(q, i, c), ak);
                av = ss_fma(pj[ni], SS_AT(dy, i, c), av);
            }
            ak = ss_warp_add(ak);
            av = ss_warp_add(av);
            if (lane == (c & 31)) {
                ss_put(dk + base + (long long)j * d + c, ak * scale);
                ss_put(dv + base + (long long)j * d + c, av);
            }
        }
    }
}
"""

_ATTN_SMEM = None
"""Bytes of dynamic shared memory the fast fused-attention kernels may take; None: the device's
opt-in limit per block (cudaDevAttrMaxSharedMemoryPerBlockOptin, 227 KiB on the H200), which each
fast kernel is allowed with CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES when it is loaded.
Past it the global kernels run (tests set 0 to reach them).  With only the 48 KiB a block gets
without the opt-in, the backward of t = 64 rows of dh = 32 took the global kernel: 381 us
against 17 us for dh = 16 on the H200."""
_SMEM_PLAIN = 48 * 1024  # what every block may take without the opt-in
_SMEM_OPTIN_ATTR = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin


def _attn_smem(device_id: int) -> int:
    """The shared-memory bytes the fast kernels may take on this device (_ATTN_SMEM)."""
    if _ATTN_SMEM is not None:
        return int(_ATTN_SMEM)
    return _attn_smem_optin(device_id)


def _attn_smem_optin(device_id: int) -> int:
    """The device's opt-in shared-memory limit per block, at least the plain 48 KiB."""
    cache = _kernels().setdefault("_smem_optin", {})
    v = cache.get(device_id)
    if v is None:
        import cupy as cp

        try:
            v = int(cp.cuda.runtime.deviceGetAttribute(_SMEM_OPTIN_ATTR, device_id))
        except Exception:  # an older runtime without the attribute: the plain limit
            v = _SMEM_PLAIN
        cache[device_id] = v = max(v, _SMEM_PLAIN)
    return v


_ATTN_WARPS = 8  # warps per block of the fast kernels: one query row (and column) each
_ATTN_BWD = (16, 2)
"""(warps, rows per warp at most) of the fast backward kernel: every block recomputes dot_i of all
t rows, so fewer, larger blocks repeat less of it (8 warps of one row each, the first version,
took 32.5 us a layer in the GPT step)."""
_ATTN_ROWS = 16  # rows (and columns) per block of the global kernels, 4 warps
_ATTN_GWARPS = 4


_ATTN_TILED = True
"""Whether the forward and the backward take ss_attn_fwd_tiled / ss_attn_bwd_tiled where their
operands fit (False: ss_attn_fwd / ss_attn_bwd, the one-row-a-warp kernels they reproduce
bitwise; tests compare the two).  On the H200 in the GPT step (t = 64, dh = 16, 64 heads of
sequences) ss_attn_fwd took 9.5 us a layer, ss_attn_bwd 28.6 us."""
_ATTN_TILED_ROWS = (16, 32)
"""Rows of a head per block of the tiled forward and backward (each forward block stages K and V,
each backward block repeats phase 1, ds of all t rows).  Measured on the H200 (50 launches
replayed in a graph, f32, 16 x 4 heads of t = 64, dh = 16): forward 7.6 us at 16 rows, 8.1 at 32,
13.2 at 64 (ss_attn_fwd 8.6); backward 11.9 us at 16 rows, 8.6 at 32, 11.3 at 64 (ss_attn_bwd
17.4); at t = 128, 8 x 4 heads: forward 13.7 us at 32 rows, 23.2 at 64 (ss_attn_fwd 14.0),
backward 18.7 at 32, 23.8 at 64 (ss_attn_bwd 39.6)."""


def _attn_fwd_tiled_smem(t: int, dh: int, rows: int, itemsize: int) -> int:
    """Shared bytes of ss_attn_fwd_tiled for blocks of `rows` query rows: K, V [t, dh + 1], the
    rows' q [rows, dh + 1] and scores [rows, t + 1]."""
    return ((2 * t + rows) * (dh + 1) + rows * (t + 1)) * itemsize


def _attn_fwd_rows(t: int, dh: int, itemsize: int, limit: int) -> int | None:
    """Query rows per block of the tiled forward: _ATTN_TILED_ROWS[0] (at most t), halved (to 16
    at least) while its shared memory is past `limit` bytes; None where even that does not fit."""
    rows = max(1, min(t, int(_ATTN_TILED_ROWS[0])))
    while _attn_fwd_tiled_smem(t, dh, rows, itemsize) > limit and rows > 16:
        rows = max(16, -(-rows // 2))
    return rows if _attn_fwd_tiled_smem(t, dh, rows, itemsize) <= limit else None


def _attn_bwd_tiled_smem(t: int, dh: int, itemsize: int) -> int:
    """Shared bytes of ss_attn_bwd_tiled: dy, q, k, v [t, dh + 1] and p, ds [t, t + 1]."""
    return (4 * t * (dh + 1) + 2 * t * (t + 1)) * itemsize


def _attn_bwd_shape(t: int, dh: int, itemsize: int, limit: int, warps: int | None = None):
    """(warps, rows per block, shared bytes) of the fast backward for t rows of dh columns, or
    None where its staged operands do not fit `limit` bytes (the global kernel then runs): the
    most warps of _ATTN_BWD[0], then _ATTN_WARPS, that fit, each taking up to _ATTN_BWD[1] rows
    while the sequence still spreads over two blocks or more.  warps: at most this many (the
    compiled kernel's register limit, or a shape already tried)."""
    staged = (t + 4 * t * (dh + 1) + t * (t + 1)) * itemsize
    for nw in dict.fromkeys((_ATTN_BWD[0], _ATTN_WARPS)):
        if warps is not None and nw > warps:
            continue
        smem = staged + nw * 2 * t * itemsize
        if smem <= limit:
            return nw, nw * max(1, min(_ATTN_BWD[1], t // (2 * nw))), smem
    return None


def _attn_fn(name: str, fast: bool, t: int, x_dtype, a_dtype):
    """`name` (ss_attn_fwd / ss_attn_bwd) of the fast or the global fused-attention source,
    compiled for the typedefs X_t, A_t (and, for the global one, SS_MAXJ = ceil(t / 32): its
    per-lane register arrays); module and function cached by all of those."""
    import cupy as cp

    k = _kernels()
    maxj = 0 if fast else max(1, -(-int(t) // 32))
    tkey = (("A_t", str(a_dtype)), ("X_t", str(x_dtype)))
    fkey = ("attn", fast, maxj, tkey, name)
    f = k["_fn"].get(fkey)
    if f is not None:
        return f
    for _, dt in tkey:
        if dt not in ("float16", "float32", "float64"):
            raise NotImplementedError(f"attention: dtype {dt} is not supported on the device")
    mkey = ("attn", fast, maxj, tkey)
    mod = k["_raw"].get(mkey)
    if mod is None:
        head = "#include <cuda_fp16.h>\n#define SS_HALF 1\n" if "float16" in (str(x_dtype), str(a_dtype)) else ""
        head += _HEAD + "".join(f"typedef {_CNN_CT[d]} {n};\n" for n, d in tkey) + f"#define SS_MAXJ {maxj}\n"
        body = _ATTN_FAST if fast else _ATTN_GLOBAL
        mod = cp.RawModule(code=head + _CNN_PRE + _ROW_PRE + _ATTN_COMMON + body,
                           options=("-std=c++17", "--fmad=false"))
        k["_raw"][mkey] = mod
    f = k["_fn"][fkey] = mod.get_function(name if fast else name + "_global")
    return f


def _allow_smem(f, smem: int, device_id: int) -> bool:
    """Whether kernel f may launch with `smem` bytes of dynamic shared memory: past the plain
    48 KiB, f is first allowed the device's opt-in limit (once per kernel); False where the
    driver refuses (the caller then takes the global kernel)."""
    if smem <= _SMEM_PLAIN:
        return True
    allowed = _kernels().setdefault("_smem_allowed", {})
    key = (device_id, id(f))  # f: a RawKernel of the module cache, kept for the process
    v = allowed.get(key)
    if v is None:
        try:
            static = int(f.attributes.get("shared_size_bytes", 0))
            v = _attn_smem_optin(device_id) - static
            f.max_dynamic_shared_size_bytes = v  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        except Exception:  # refused (or an older CuPy): the plain limit
            v = _SMEM_PLAIN
        allowed[key] = v
    return smem <= v


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
    on _cuda's CNN preamble (`_CNN_PRE`); module and function cached by (group, typedefs)."""
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
    cb = _cublas()
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


def embedding_cuda(ctx, stream, ins, outs, attrs):
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


def embedding_grad_cuda(ctx, stream, ins, outs, attrs):
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


def pos_embedding_cuda(ctx, stream, ins, outs, attrs):
    np = _np()
    x, table = ins
    y = outs[0]
    _contiguous("pos_embedding", (x, table, y))
    _disjoint("pos_embedding", (table,), outs)
    if y.size == 0:
        return
    f = _fn("pos", "ss_pos_add", X_t=x.dtype, A_t=_acc_of(x.dtype))
    _go(ctx, stream, f, _grid(y.size), (x, table, y, np.int64(y.size), np.int64(table.size)))


def pos_embedding_grad_cuda(ctx, stream, ins, outs, attrs):
    np = _np()
    dy, dt = ins[0], outs[0]
    _contiguous("pos_embedding_grad", (dy, dt))
    _disjoint("pos_embedding_grad", ins, outs)
    if dt.size == 0:
        return
    f = _fn("pos", "ss_pos_grad", X_t=dy.dtype, A_t=_acc_of(dy.dtype))
    _go(ctx, stream, f, _grid(dt.size), (dy, dt, np.int64(dy.size // dt.size), np.int64(dt.size)))


def layernorm_cuda(ctx, stream, ins, outs, attrs):
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


def layernorm_grad_x_cuda(ctx, stream, ins, outs, attrs):
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


def layernorm_grad_gamma_cuda(ctx, stream, ins, outs, attrs):
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


def softmax_cuda(ctx, stream, ins, outs, attrs):
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


def softmax_grad_cuda(ctx, stream, ins, outs, attrs):
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


def attn_scores_cuda(ctx, stream, ins, outs, attrs):
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


def attn_apply_cuda(ctx, stream, ins, outs, attrs):
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


def attn_grad_p_cuda(ctx, stream, ins, outs, attrs):
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


def attn_grad_v_cuda(ctx, stream, ins, outs, attrs):
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


def attn_grad_q_cuda(ctx, stream, ins, outs, attrs):
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


def attn_grad_k_cuda(ctx, stream, ins, outs, attrs):
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


def adamw_step_cuda(ctx, stream, ins, outs, attrs):
    w, dw, m, v, lr, t = ins
    w_out, m_out, v_out = outs
    with _stream(ctx, stream):
        _same_or_copy(w, w_out)
        _same_or_copy(m, m_out)
        _same_or_copy(v, v_out)
        _adamw_kernel()(dw, lr, t, float(attrs.get("beta1", 0.9)), float(attrs.get("beta2", 0.999)),
                        float(attrs.get("eps", 1e-8)), float(attrs.get("weight_decay", 0.01)), w_out, m_out, v_out)


def grad_sumsq_cuda(ctx, stream, ins, outs, attrs):
    np = _np()
    g, acc = ins
    out = outs[0]
    _contiguous("grad_sumsq", (g,))
    f = _fn("clip", "ss_grad_sumsq", X_t=g.dtype, S_t=acc.dtype, A_t=_acc_of(g.dtype))
    _go(ctx, stream, f, (1,), (g, acc, out, np.int64(g.size)))


def clip_scale_cuda(ctx, stream, ins, outs, attrs):
    np = _np()
    f = _fn("clip", "ss_clip_scale", X_t=ins[0].dtype, S_t=ins[0].dtype, A_t=_acc_of(ins[0].dtype))
    _go(ctx, stream, f, (1,), (ins[0], outs[0], np.float64(attrs.get("max_norm", 1.0)),
                               np.float64(attrs.get("eps", 1e-6))))


def scale_grad_cuda(ctx, stream, ins, outs, attrs):
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


def attn_fused_cuda(ctx, stream, ins, outs, attrs):
    """y, p = softmax(q_h k_h^T / sqrt(dh), causal) v_h in one launch (ss_attn_fwd)."""
    np = _np()
    q, k, v = ins
    y, p = outs
    _checked("attn_fused", ins, outs)
    heads, t = int(attrs["heads"]), int(attrs["context"])
    b, n, d, dh = _flat_dims(q, heads, t)
    if y.size == 0 or p.size == 0:
        return
    acc = np.dtype(_acc_of(q.dtype))
    args = (q, k, v, y, p, np.int32(heads), np.int32(t), np.int32(d), np.int32(dh), acc.type(_scale_of(d, heads)),
            np.int32(bool(attrs.get("causal", True))))
    dev = q.data.device_id
    if _ATTN_TILED:
        rows = _attn_fwd_rows(t, dh, acc.itemsize, _attn_smem(dev))
        if rows is not None:
            smem = _attn_fwd_tiled_smem(t, dh, rows, acc.itemsize)
            f = _attn_fn("ss_attn_fwd_tiled", True, t, q.dtype, acc)
            if int(f.attributes.get("max_threads_per_block", 1024)) >= 256 and _allow_smem(f, smem, dev):
                with _stream(ctx, stream):
                    f((b * heads, -(-t // rows)), (256,), args + (np.int32(rows),), shared_mem=smem)
                return
    smem = (2 * t * (dh + 1) + _ATTN_WARPS * (dh + t)) * acc.itemsize
    fast = smem <= _attn_smem(dev)
    f = _attn_fn("ss_attn_fwd", fast, t, q.dtype, acc)
    if fast and not _allow_smem(f, smem, dev):
        fast, f = False, _attn_fn("ss_attn_fwd", False, t, q.dtype, acc)
    with _stream(ctx, stream):
        if fast:
            f((b * heads, -(-t // _ATTN_WARPS)), (32 * _ATTN_WARPS,), args, shared_mem=smem)
        else:
            f((b * heads, -(-t // _ATTN_ROWS)), (32 * _ATTN_GWARPS,), args + (np.int32(_ATTN_ROWS),))


def attn_fused_grad_cuda(ctx, stream, ins, outs, attrs):
    """dq, dk, dv of attn_fused in one launch (ss_attn_bwd)."""
    np = _np()
    dy, q, k, v, p = ins
    dq, dk, dv = outs
    _checked("attn_fused_grad", ins, outs)
    heads, t = int(attrs["heads"]), int(attrs["context"])
    b, n, d, dh = _flat_dims(q, heads, t)
    if dq.size == 0:
        return
    acc = np.dtype(_acc_of(q.dtype))
    args = (dy, q, k, v, p, dq, dk, dv, np.int32(heads), np.int32(t), np.int32(d), np.int32(dh),
            acc.type(_scale_of(d, heads)))
    dev = q.data.device_id
    if _ATTN_TILED:
        smem = _attn_bwd_tiled_smem(t, dh, acc.itemsize)
        if smem <= _attn_smem(dev):
            f = _attn_fn("ss_attn_bwd_tiled", True, t, q.dtype, acc)
            if int(f.attributes.get("max_threads_per_block", 1024)) >= 256 and _allow_smem(f, smem, dev):
                rows = max(1, min(t, int(_ATTN_TILED_ROWS[1])))
                with _stream(ctx, stream):
                    f((b * heads, -(-t // rows)), (256,), args + (np.int32(rows),), shared_mem=smem)
                return
    shape = _attn_bwd_shape(t, dh, acc.itemsize, _attn_smem(dev))
    f = _attn_fn("ss_attn_bwd", shape is not None, t, q.dtype, acc)
    if shape is not None and 32 * shape[0] > int(f.attributes.get("max_threads_per_block", 1024)):
        shape = _attn_bwd_shape(t, dh, acc.itemsize, _attn_smem(dev), warps=_ATTN_WARPS)  # registers
    if shape is not None and not _allow_smem(f, shape[2], dev):
        shape = _attn_bwd_shape(t, dh, acc.itemsize, _SMEM_PLAIN, warps=shape[0])
    if shape is None:
        f = _attn_fn("ss_attn_bwd", False, t, q.dtype, acc)
    fast = shape is not None
    with _stream(ctx, stream):
        if fast:
            nw, rows, smem = shape
            f((b * heads, -(-t // rows)), (32 * nw,), args + (np.int32(rows),), shared_mem=smem)
        else:
            if not _allow_smem(f, t * acc.itemsize, dev):
                raise NotImplementedError(f"attn_fused_grad: context {t} needs {t * acc.itemsize} bytes of shared "
                                          f"memory a block, more than this device allows")
            f((b * heads, -(-t // _ATTN_ROWS)), (32 * _ATTN_GWARPS,), args + (np.int32(_ATTN_ROWS),),
              shared_mem=t * acc.itemsize)
