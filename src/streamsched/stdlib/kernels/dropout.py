"""Dropout with a counter-based RNG: Philox-4x32-10 words as a pure function of (seed, offset,
element), so the mask is the same bits on the CPU and the GPU and a captured graph draws a new
mask each replay (`offset_advance`)."""

from __future__ import annotations

import hashlib
import math
from typing import Any, Sequence

import numpy as np

from streamsched.stdlib.kernel_record import KCall
from streamsched.stdlib.kernels._base import (DocRow, Family, dp_rank, GradArgs, _acc, _acc_dtype, _attr_error, _dtype,
                                              _floats, _int, _ints, _number, _same_shape, _scalar, _write)
from streamsched.stdlib.kernels._cuda import _CNN_SRC, _acc_of, _cnn_fn, _contiguous, _go, _grid

FAMILY = Family(__name__, "Dropout with a counter-based RNG")
_register = FAMILY.register


_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_LO32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
_OFFSET_DTYPES = ("i32", "i64", "f32", "f64")
_MASK_DTYPES = ("u8", "f32")


def philox4x32_10(ctr: Sequence[Any], key: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Philox-4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3",
    SC'11; Random123's philox4x32 with 10 rounds): ctr is four uint32 words (arrays or ints, the
    counter), key two uint32 ints; returns the four uint32 output words.  Checked against
    Random123's tests/kat_vectors."""
    c0, c1, c2, c3 = (np.asarray(w, np.uint64) & _LO32 for w in ctr)
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for r in range(10):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & 0xFFFFFFFF, (k1 + _PHILOX_W[1]) & 0xFFFFFFFF
        p0, p1 = _PHILOX_M[0] * c0, _PHILOX_M[1] * c2  # 32 x 32 -> 64 bits: exact in uint64
        c0, c1, c2, c3 = ((p1 >> _SHIFT32) ^ c1 ^ np.uint64(k0), p1 & _LO32,
                          (p0 >> _SHIFT32) ^ c3 ^ np.uint64(k1), p0 & _LO32)
    return tuple(w.astype(np.uint32) for w in (c0, c1, c2, c3))


def dropout_threshold(p: float) -> int:
    """The uint32 threshold t = floor(p * 2^32): element i is kept iff its word is >= t."""
    return int(math.floor(float(p) * 4294967296.0))


def site_seed(model: str, target: str) -> int:
    """The `seed` attribute of a model line that does not give one (`d = dropout(f, p = 0.1)` in
    model `net`): the first 8 bytes of sha256("net.d"), big-endian, as an integer < 2^63 (the
    Philox key of that site's mask stream).  Distinct sites get distinct keys, the same site the
    same key on every run."""
    return int.from_bytes(hashlib.sha256(f"{model}.{target}".encode()).digest()[:8], "big") >> 1


def dropout_bits(size: int, seed: int, offset: int) -> np.ndarray:
    """The uint32 random word of each of `size` elements (flat, row-major index i): word i & 3 of
    philox4x32_10(ctr = (lo32(i >> 2), hi32(i >> 2), lo32(offset), hi32(offset)),
    key = (lo32(seed), hi32(seed)))."""
    blocks = np.arange((size + 3) // 4, dtype=np.uint64)
    off = np.uint64(offset)
    words = philox4x32_10((blocks & _LO32, blocks >> _SHIFT32, off & _LO32, off >> _SHIFT32),
                          (seed & 0xFFFFFFFF, seed >> 32))
    return np.stack(words, axis=1).reshape(-1)[:size]


def _offset_value(k: str, offset: np.ndarray) -> int:
    v = offset.item()
    if not (isinstance(v, int) or (math.isfinite(v) and v == int(v))) or v < 0:
        raise ValueError(f"{k}: offset {v!r} is not a non-negative integer; the dropout offset "
                         f"counts steps (offset_advance adds 1 per step)")
    return int(v)


def _keep_scale(x: np.ndarray, p: float) -> np.ndarray:
    """1 / (1 - p) computed in double, rounded to x's compute dtype (f32 for f16/f32)."""
    return np.asarray(1.0 / (1.0 - p), _acc_dtype(x))


def _dropout_infer(k, names, t, at):
    _number(k, at, "p", lo=0.0, hi=1.0, hi_open=True)
    seed = _int(k, at, "seed", 0)
    if seed >= 1 << 64:
        raise _attr_error(k, f"attribute seed = {seed} does not fit 64 bits")
    if at["mask"] not in _MASK_DTYPES:
        raise _attr_error(k, f"attribute mask must be u8 or f32 (the mask's dtype), "
                          f"got {at['mask']!r}")
    dt = _floats(k, t, names, (0,))
    _scalar(k, t, names, 1, _OFFSET_DTYPES)
    return [(t[0][0], dt), (t[0][0], at["mask"])]


def _dropout_cpu(ins, outs, at):
    x, offset = ins
    rank, ranks = dp_rank()
    # Data parallel: rank r's shard is rows [r * n, (r + 1) * n) of the global batch, so it draws
    # the bits of those elements of the global batch's mask (one rank at N * n draws the same mask).
    start = rank * x.size if ranks > 1 else 0
    bits = dropout_bits(start + x.size, *_ints(at, "seed"), _offset_value("dropout", offset))[start:]
    keep = (bits >= np.uint32(dropout_threshold(at["p"]))).reshape(x.shape)
    y = np.where(keep, _acc(x) * _keep_scale(x, at["p"]), 0)
    _write(outs[1], keep)
    _write(outs[0], y)


def _dropout_recipe(g: GradArgs):
    dy = g.douts[0]
    if dy is None:
        return [None, None]
    return [KCall("dropout_grad", (dy, g.outs[1]), (("p", g.attrs.get("p", 0.1)),)) if g.need[0] else None, None]


_register("dropout", "x offset", "y mask", _dropout_infer, _dropout_cpu,
          {"p": 0.1, "seed": 0, "mask": "u8"}, doc="""
Inverted dropout with a counter-based RNG, so the mask is a pure function of (seed, offset, i)
and reproducible bit for bit on the GPU.  For element i (flat row-major index of x):
r_i = word (i & 3) of Philox-4x32-10 (Salmon et al., SC'11) with counter
(lo32(i >> 2), hi32(i >> 2), lo32(offset), hi32(offset)) and key (lo32(seed), hi32(seed));
keep_i = r_i >= floor(p * 2^32)  (so P(keep) = 1 - p up to 2^-32);
y_i = keep_i ? x_i * s : 0,  s = 1 / (1 - p) in double rounded to the compute dtype (f32 for
f16/f32 x, f64 for f64), the product rounded to x's dtype;  mask_i = keep_i (1 or 0).
x: float, offset: [] i32/i64/f32/f64 device counter (a non-negative integer value, read when the
kernel runs; an f32 counter is exact up to 2^24) -> y: x's type, mask: x's shape in the `mask`
dtype (u8 or f32).  p in [0, 1); seed an integer < 2^64, fixed at compile time (two sites with
one seed and one offset draw the same bits: a model line that gives none gets its site's own).
Each step advances offset with offset_advance, so every replay of a captured graph draws a new
mask.  A dropped element is 0 even when x is inf or NaN.
""", grad=_dropout_recipe,
          row=DocRow("x, offset [] -> y, mask", "comp2",
                     "keep_i = philox(seed, offset, i) >= floor(p·2³²); y = keep ? x/(1-p) : 0; mask = keep (u8 "
                     "or f32)"))


def _dropout_grad_infer(k, names, t, at):
    _number(k, at, "p", lo=0.0, hi=1.0, hi_open=True)
    shape = _same_shape(k, t, names, (0, 1))
    dt = _floats(k, t, names, (0,))
    _dtype(k, t, 1, names, _MASK_DTYPES, "the dropout mask's dtype")
    return [(shape, dt)]


def _dropout_grad_cpu(ins, outs, at):
    dy, mask = ins
    _write(outs[0], np.where(mask != 0, _acc(dy) * _keep_scale(dy, at["p"]), 0))


_register("dropout_grad", "dy mask", "dx", _dropout_grad_infer, _dropout_grad_cpu, {"p": 0.1},
          doc="""
dx = mask ? dy * s : 0,  s = 1 / (1 - p) as in dropout (p must be the forward's).
dy: float, mask: same shape, u8 or f32 (dropout's mask) -> dx: dy's type.
""",
          row=DocRow("dy, mask -> dx", "comp2", "dx = mask ? dy/(1-p) : 0"))


def _offset_advance_infer(k, names, t, at):
    _int(k, at, "by", 0)
    _scalar(k, t, names, 0, _OFFSET_DTYPES)
    return [t[0]]


def _offset_advance_cpu(ins, outs, at):
    np.add(ins[0], *_ints(at, "by"), out=outs[0], casting="unsafe")


_register("offset_advance", "offset", "offset", _offset_advance_infer, _offset_advance_cpu,
          {"by": 1}, doc="""
offset = offset + by: advances dropout's device counter once per step (by = 1 is enough: the
offset fills counter words 2-3, the element index words 0-1, so consecutive offsets never share
a Philox block).  offset: [] i32/i64/f32/f64 -> offset, in place; by a non-negative integer.
""",
          row=DocRow("offset [] -> offset", "update", "offset += by: dropout's per-step counter"))


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.


# Philox-4x32-10 exactly as philox4x32_10 above; thread g draws block g: the words of
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
                                      unsigned long long thr, double scale, unsigned long long bbase) {
    unsigned long long off = ss_u64(offset[0]);
    A_t sc = (A_t)scale;
    long long nb = (size + 3) >> 2;
    SS_LOOP(blk, nb) {
        unsigned long long ub = (unsigned long long)blk + bbase;  // bbase: a rank's first block
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


def dropout_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    x, offset = ins
    y, mask = outs
    _contiguous("dropout", (x, y, mask))
    p = float(attrs.get("p", 0.1))
    seed = int(attrs.get("seed", 0))
    thr = int(math.floor(p * 4294967296.0))  # dropout_threshold
    if x.size == 0:
        return
    rank, ranks = dp_rank()
    start = rank * x.size if ranks > 1 else 0  # the rank's elements of the global batch's mask
    if start % 4:
        raise NotImplementedError(f"dropout: a rank's shard of {x.size} elements does not start on a Philox "
                                  "block (a multiple of 4 elements) on the GPU")
    f = _cnn_fn("drop", "ss_dropout", X_t=x.dtype, O_t=offset.dtype, M_t=mask.dtype,
                A_t=_acc_of(x.dtype))
    _go(ctx, stream, f, _grid((x.size + 3) // 4),
        (x, offset, y, mask, np.int64(x.size), np.uint32(seed & 0xFFFFFFFF),
         np.uint32((seed >> 32) & 0xFFFFFFFF), np.uint64(thr), np.float64(1.0 / (1.0 - p)),
         np.uint64(start // 4)))


def dropout_grad_cuda(ctx, stream, ins, outs, attrs):
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


def offset_advance_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    f = _cnn_fn("offs", "ss_offset_advance", O_t=ins[0].dtype)
    _go(ctx, stream, f, (1,), (ins[0], outs[0], np.int64(int(attrs.get("by", 1)))))
