"""Mixed precision: float casts and dynamic loss scaling as torch.amp.GradScaler does it (scale the
loss, check and unscale gradients, update the scale); the loss scale, the overflow flag and the
growth tracker are `[]` device buffers, so a whole step can be captured."""

from __future__ import annotations

import numpy as np

from streamsched.stdlib.kernel_record import KCall
from streamsched.stdlib.kernels._base import (FLOATS, INTS, DocRow, Family, GradArgs, _acc, _acc_dtype,
                                              _attr_error, _bn_acc, _floats, _int, _number, _scalar, _write)
from streamsched.stdlib.kernels._cuda import _CNN_SRC, _acc_of, _cnn_fn, _contiguous, _go, _grid

FAMILY = Family(__name__, "Mixed precision: casts and dynamic loss scaling")
_register = FAMILY.register


def _cast_infer(k, names, t, at):
    if at["dtype"] not in FLOATS:
        raise _attr_error(k, f"attribute dtype must be a float dtype ({', '.join(FLOATS)}), "
                          f"got {at['dtype']!r}")
    _floats(k, t, names, (0,))
    return [(t[0][0], at["dtype"])]


def _cast_cpu(ins, outs, at):
    if "bf16" in (at["dtype"], str(ins[0].dtype)):
        raise NotImplementedError("cast: bf16 cannot run on the CPU backend (NumPy has no "
                                  "bfloat16); use the CUDA backend")
    with np.errstate(over="ignore"):
        _write(outs[0], ins[0])


def _cast_recipe(g: GradArgs):
    return [KCall("cast", (g.douts[0],), (("dtype", g.types[g.args[0]][1]),))]


_register("cast", "x", "y", _cast_infer, _cast_cpu, {"dtype": "f16"}, doc="""
y = x converted to `dtype` with round-to-nearest-even (CUDA's __float2half_rn); values beyond
f16's range (|x| >= 65520) become inf, NaN stays NaN.  Any float to any float: f32 -> f16 (the
f16 weight copy), f16 -> f32 (gradients for the f32 master weights), f32 -> f32 is a copy.
bf16 type-checks but raises NotImplementedError on the CPU backend.
x: float -> y: x's shape in `dtype`.
""", grad=_cast_recipe,
          row=DocRow("x -> y", "update", "float to float, round to nearest even, overflow to inf"))


def _scale_loss_infer(k, names, t, at):
    dt = _floats(k, t, names, (0,))
    _scalar(k, t, names, 1)
    return [(t[0][0], dt)]


def _scale_loss_cpu(ins, outs, at):
    loss, scale = ins
    _write(outs[0], _bn_acc(loss, scale) * scale)


_register("scale_loss", "loss scale", "scaled", _scale_loss_infer, _scale_loss_cpu, doc="""
scaled = loss * scale, scale a [] device scalar (the dynamic loss scale, read when the kernel
runs).  loss: float, any shape (usually []) -> scaled: loss's type.  Since softmax_xent_grad takes
dloss as a device scalar, passing the scale itself as dloss starts the backward pass scaled.
""",
          row=DocRow("loss, scale [] -> scaled", "comp1", "scaled = loss · scale"))


def _unscale_infer(k, names, t, at):
    dt = _floats(k, t, names, (0,))
    _scalar(k, t, names, 1)
    _scalar(k, t, names, 2)
    return [(t[0][0], dt), t[2]]


def _unscale_cpu(ins, outs, at):
    g, scale, found = ins
    bad = not bool(np.isfinite(g).all())
    flag = 1.0 if bad else found.item()
    inv = np.asarray(1.0 / float(scale), _acc_dtype(g))
    with np.errstate(over="ignore", invalid="ignore"):
        g_new = _acc(g) * inv
    _write(outs[0], g_new)
    _write(outs[1], flag)


_register("unscale_check", "g scale found_inf", "g found_inf", _unscale_infer, _unscale_cpu,
          doc="""
PyTorch's _amp_foreach_non_finite_check_and_unscale_ for one gradient:
g = g * inv_scale, inv_scale = 1 / scale computed in double and rounded to the compute dtype (f32
for f16/f32 g; equal to g / scale whenever scale is a power of two, as GradScaler's always is);
found_inf = 1.0 if any element of the *incoming* g is inf or NaN, else found_inf unchanged.
So zero found_inf once per step (fill) and call this on every gradient.
g: float -> g (in place); scale, found_inf: [] float device scalars -> found_inf (in place).
""",
          row=DocRow("g, scale [], found_inf [] -> g, found_inf", "update",
                     "g = g · (1/scale); found_inf = 1 if the incoming g has an inf/NaN, else unchanged"))


def _update_scale_infer(k, names, t, at):
    _number(k, at, "growth", lo=1.0)
    _number(k, at, "backoff", lo=0.0, hi=1.0)
    _int(k, at, "interval", 1)
    _scalar(k, t, names, 0)
    _scalar(k, t, names, 1)
    _scalar(k, t, names, 2, INTS + ("f32", "f64"))
    return [t[0], t[2]]


def _update_scale_cpu(ins, outs, at):
    scale, found, good = ins
    s, steps = scale.item(), good.item()
    if found.item() != 0:
        s, steps = s * at["backoff"], 0
    elif steps + 1 == int(at["interval"]):
        with np.errstate(over="ignore"):
            grown = np.asarray(s * at["growth"], scale.dtype)  # rounded to the scale's dtype
        s, steps = (grown if np.isfinite(grown) else s), 0
    else:
        steps += 1
    _write(outs[0], s)
    _write(outs[1], steps)


_register("update_scale", "scale found_inf good_steps", "scale good_steps", _update_scale_infer,
          _update_scale_cpu, {"growth": 2.0, "backoff": 0.5, "interval": 2000}, doc="""
PyTorch's _amp_update_scale_ (torch.amp.GradScaler.update): if found_inf != 0:
scale = scale * backoff, good_steps = 0; else if good_steps + 1 == interval: scale = scale *
growth unless that overflows the scale's dtype (then unchanged), good_steps = 0; else
good_steps += 1.  scale, found_inf: [] float, good_steps: [] i32/i64/f32/f64 (PyTorch's growth
tracker is i32) -> (scale, good_steps), in place.
""",
          row=DocRow("scale [], found_inf [], good_steps [] -> scale, good_steps", "update",
                     "PyTorch GradScaler.update (below)"))


def _nonfinite_infer(k, names, t, at):
    _floats(k, t, names, (0,))
    _scalar(k, t, names, 1)
    return [t[1]]


def _nonfinite_cpu(ins, outs, at):
    g, found = ins
    _write(outs[0], 1.0 if not bool(np.isfinite(g).all()) else found.item())


_register("nonfinite_check", "g found_inf", "found_inf", _nonfinite_infer, _nonfinite_cpu, doc="""
found_inf = 1.0 if any element of g is inf or NaN, else found_inf unchanged: the check half of
PyTorch's _amp_foreach_non_finite_check_and_unscale_, on a (scaled, usually f16) gradient that
is left untouched.  Zero found_inf once per step and call this on every gradient; then
amp_sgd_step skips the whole step when it is set.
g: float, any shape; found_inf: [] float device scalar -> found_inf (in place).
""",
          row=DocRow("g, found_inf [] -> found_inf", "update",
                     "found_inf = 1 if g has an inf/NaN, else unchanged; g untouched"))


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.


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


def cast_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    x, y = ins[0], outs[0]
    _contiguous("cast", (x, y))
    if y.size == 0 or (y.dtype == x.dtype and y.data.ptr == x.data.ptr):
        return
    f = _cnn_fn("cast", "ss_cast", X_t=x.dtype, Y_t=y.dtype)
    _go(ctx, stream, f, _grid(y.size), (x, y, np.int64(y.size)))


def scale_loss_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    loss, scale = ins
    out = outs[0]
    _contiguous("scale_loss", (loss, out))
    if out.size == 0:
        return
    f = _cnn_fn("sloss", "ss_scale_loss", X_t=loss.dtype, S_t=scale.dtype,
                A_t=_acc_of(loss.dtype, scale.dtype))
    _go(ctx, stream, f, _grid(out.size), (loss, scale, out, np.int64(out.size)))


def unscale_check_cuda(ctx, stream, ins, outs, attrs):
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


def update_scale_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    scale, found, good = ins
    scale_out, good_out = outs
    f = _cnn_fn("upd", "ss_update_scale", S_t=scale.dtype, F_t=found.dtype, G_t=good.dtype)
    _go(ctx, stream, f, (1,), (scale, found, good, scale_out, good_out,
                               np.float64(attrs.get("growth", 2.0)),
                               np.float64(attrs.get("backoff", 0.5)),
                               np.float64(int(attrs.get("interval", 2000)))))


def nonfinite_check_cuda(ctx, stream, ins, outs, attrs):
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
