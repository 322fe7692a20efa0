"""Optimizer updates and device counters: SGD, Adam, LARS, EMA, the mixed-precision SGD and LARS
steps on f32 master weights, and `increment` (Adam's step count)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from streamsched.stdlib.kernels._base import (NUMERIC, DocRow, Family, _acc, _acc_dtype, _attr_error, _flag,
                                              _floats, _number, _same_shape, _scalar, _write)
from streamsched.stdlib.kernels._cuda import (_CNN_SRC, _acc_of, _cnn_fn, _contiguous, _go, _grid, _same_or_copy,
                                              _stream)

FAMILY = Family(__name__, "Optimizers and device counters")
_register = FAMILY.register


# --------------------------------------------------------------------------------------------
# SGD, Adam and the step counter


def _param_state_infer(k, names, t, n: int) -> tuple[tuple[int, ...], str]:
    """Inputs 0..n-1 (parameter, gradient, state buffers) share one shape and float dtype."""
    shape = _same_shape(k, t, names, tuple(range(n)))
    return shape, _floats(k, t, names, tuple(range(n)))


def _sgd_infer(k, names, t, at):
    momentum = _number(k, at, "momentum", lo=0.0)
    _number(k, at, "weight_decay", lo=0.0)
    if _flag(k, at, "nesterov") and momentum <= 0:
        raise _attr_error(k, "nesterov=true needs momentum > 0 (as torch.optim.SGD)")
    shape, dt = _param_state_infer(k, names, t, 3)
    _scalar(k, t, names, 3)
    return [(shape, dt), (shape, dt)]


def _sgd_cpu(ins, outs, at):
    w, dw, v, lr_buf = ins
    mu, wd = at["momentum"], at["weight_decay"]
    lr = float(lr_buf)
    g = dw + wd * w if wd else dw
    v_new = mu * v + g if mu else g
    step = g + mu * v_new if at["nesterov"] else v_new
    w_new = w - lr * step
    _write(outs[1], v_new)
    _write(outs[0], w_new)


_register("sgd_step", "w dw v lr", "w v", _sgd_infer, _sgd_cpu,
          {"momentum": 0.9, "weight_decay": 0.0, "nesterov": False}, doc="""
PyTorch's SGD (torch.optim.SGD, dampening 0; https://pytorch.org/docs/stable/generated/
torch.optim.SGD.html):  g = dw + weight_decay * w;  v = momentum * v + g (v = g when momentum is
0);  w = w - lr * (g + momentum * v if nesterov else v).  v starts at zero, which equals
PyTorch's first step (buf = g).
w, dw, v: one shape and float dtype; lr: [] float device scalar, read when the kernel runs
-> (w, v), normally in place.
""",
          row=DocRow("w, dw, v, lr [] -> w, v", "update",
                     "PyTorch SGD: g = dw + wd w; v = mu v + g (v = g if mu = 0); w -= lr (g + mu v if nesterov "
                     "else v)"))


def _adam_infer(k, names, t, at):
    _number(k, at, "beta1", lo=0.0, hi=1.0, hi_open=True)
    _number(k, at, "beta2", lo=0.0, hi=1.0, hi_open=True)
    _number(k, at, "eps", lo=0.0)
    _number(k, at, "weight_decay", lo=0.0)
    shape, dt = _param_state_infer(k, names, t, 4)
    _scalar(k, t, names, 4)
    _scalar(k, t, names, 5, NUMERIC)
    return [(shape, dt), (shape, dt), (shape, dt)]


def _adam_cpu(ins, outs, at):
    w, dw, m, v, lr_buf, t_buf = ins
    b1, b2, eps, wd = at["beta1"], at["beta2"], at["eps"], at["weight_decay"]
    lr, t = float(lr_buf), float(t_buf)
    if t < 1:
        raise ValueError(f"adam_step: step count t is {t:g}; increment it (1-based) before "
                         f"the update")
    g = dw + wd * w if wd else dw
    m_new = m + (1 - b1) * (g - m)  # PyTorch's exp_avg.lerp_(grad, 1 - beta1)
    v_new = v * b2 + (1 - b2) * g * g
    step_size = lr / (1 - b1 ** t)
    denom = np.sqrt(v_new) / math.sqrt(1 - b2 ** t) + eps
    w_new = w - step_size * (m_new / denom)
    _write(outs[1], m_new)
    _write(outs[2], v_new)
    _write(outs[0], w_new)


_register("adam_step", "w dw m v lr t", "w m v", _adam_infer, _adam_cpu,
          {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}, doc="""
PyTorch's Adam (torch.optim.Adam, amsgrad off; https://pytorch.org/docs/stable/generated/
torch.optim.Adam.html), L2 weight decay added to the gradient:  g = dw + weight_decay * w;
m = m + (1 - beta1)(g - m);  v = beta2 v + (1 - beta2) g^2;
w = w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps).
w, dw, m, v: one shape and float dtype; lr: [] float, t: [] step count (already incremented
for this step, so 1 on the first), both device scalars read when the kernel runs -> (w, m, v).
""",
          row=DocRow("w, dw, m, v, lr [], t [] -> w, m, v", "update",
                     "PyTorch Adam: g = dw + wd w; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; w -= lr/(1-b1^t) "
                     "m / (sqrt(v)/sqrt(1-b2^t) + eps)"))


def _increment_infer(k, names, t, at):
    _number(k, at, "by")
    _scalar(k, t, names, 0, NUMERIC)
    return [t[0]]


def _increment_cpu(ins, outs, at):
    np.add(ins[0], at["by"], out=outs[0], casting="unsafe")


_register("increment", "t", "t", _increment_infer, _increment_cpu, {"by": 1.0}, doc="""
t = t + by: a device scalar counter (Adam's step count), so a captured graph advances it.
t: [] float or integer -> t, in place.
""",
          row=DocRow("t [] -> t", "update", "t = t + by: the device step counter"))


# --------------------------------------------------------------------------------------------
# LARS, EMA


def _lars_infer(k, names, t, at):
    _number(k, at, "momentum", lo=0.0)
    _number(k, at, "weight_decay", lo=0.0)
    _number(k, at, "trust", lo=0.0)
    _number(k, at, "eps", lo=0.0)
    shape = _same_shape(k, t, names, (0, 1, 2))
    dt = _floats(k, t, names, (0, 1, 2))
    _scalar(k, t, names, 3)
    return [(shape, dt), (shape, dt)]


def _lars_cpu(ins, outs, at):
    w, dw, v, lr_buf = ins
    wd = at["weight_decay"]
    wa, ga = _acc(w), _acc(dw)
    wn, gn = float(np.sqrt((wa * wa).sum())), float(np.sqrt((ga * ga).sum()))
    local = at["trust"] * wn / (gn + wd * wn + at["eps"]) if wn > 0 and gn > 0 else 1.0
    v_new = at["momentum"] * _acc(v) + (float(lr_buf) * local) * (ga + wd * wa)
    w_new = wa - v_new
    _write(outs[1], v_new)
    _write(outs[0], w_new)


_register("lars_step", "w dw v lr", "w v", _lars_infer, _lars_cpu,
          {"momentum": 0.9, "weight_decay": 0.0005, "trust": 0.001, "eps": 1e-9}, doc="""
LARS, layer-wise adaptive rate scaling (You, Gitman, Ginsburg, "Large Batch Training of
Convolutional Networks", arXiv:1708.03888, Algorithm 1), one layer (one tensor) per call:
local = trust * ||w|| / (||dw|| + weight_decay * ||w|| + eps), or 1 when ||w|| or ||dw|| is 0;
v = momentum * v + lr * local * (dw + weight_decay * w);  w = w - v.
Norms are L2 over the whole tensor (f16 in f32).  As in the paper the global lr is inside the
momentum buffer (torchlars/LARC apply lr outside it; the two agree while lr is constant).
w, dw, v: one shape and float dtype; lr: [] float device scalar read when the kernel runs
-> (w, v), normally in place.  Biases and batch-norm parameters usually take sgd_step instead.
""",
          row=DocRow("w, dw, v, lr [] -> w, v", "update (or per region on comp1/2/3, as the seed)",
                     "local = trust ‖w‖ / (‖dw‖ + wd ‖w‖ + eps) (1 if a norm is 0); v = mom v + lr local (dw + "
                     "wd w); w -= v"))


def _ema_infer(k, names, t, at):
    _number(k, at, "decay", lo=0.0, hi=1.0)
    shape = _same_shape(k, t, names, (0, 1))
    _floats(k, t, names, (1,))
    return [(shape, _floats(k, t, names, (0,)))]


def _ema_cpu(ins, outs, at):
    ema = _acc(ins[0])
    w = ins[1].astype(ema.dtype, copy=False)  # computed in the average's precision
    _write(outs[0], ema + ema.dtype.type(1.0 - at["decay"]) * (w - ema))


_register("ema_update", "ema w", "ema", _ema_infer, _ema_cpu, {"decay": 0.999}, doc="""
ema = ema + (1 - decay) (w - ema), i.e. decay * ema + (1 - decay) * w written as a lerp, as
torch.optim.swa_utils.get_ema_multi_avg_fn (torch._foreach_lerp_(ema, w, 1 - decay)).
ema, w: one shape, float dtypes (w may be narrower: the f32 average of an f16 weight) -> ema, in
place; computed in ema's dtype (at least f32).
""",
          row=DocRow("ema, w -> ema", "update",
                     "ema = ema + (1 - decay)(w - ema), in ema's dtype (w may be narrower)"))


# --------------------------------------------------------------------------------------------
# Mixed precision: SGD and LARS on f32 master weights under dynamic loss scaling


def _amp_types(k, names, t):
    """(w, dw, master, v, lr, scale, found_inf) -> types of (w, master, v): w and dw share a shape
    and float dtype (f16), master and v that shape in their own float dtype (f32); the rest are
    float scalars."""
    shape = _same_shape(k, t, names, (0, 1, 2, 3))
    wdt = _floats(k, t, names, (0, 1))
    mdt = _floats(k, t, names, (2, 3))
    for i in (4, 5, 6):
        _scalar(k, t, names, i)
    return [(shape, wdt), (shape, mdt), (shape, mdt)]


def _amp_skipped(found, state, outs) -> bool:
    """An inf/NaN gradient somewhere (found_inf != 0): the whole step is skipped, every output
    keeps its input's value (copied first: outputs may alias inputs).  True when skipped."""
    if found.item() == 0:
        return False
    keep = [np.array(i, copy=True) for i in state]
    for o, i in zip(outs, keep):
        _write(o, i)
    return True


def _amp_sgd_infer(k, names, t, at):
    momentum = _number(k, at, "momentum", lo=0.0)
    _number(k, at, "weight_decay", lo=0.0)
    if _flag(k, at, "nesterov") and momentum <= 0:
        raise _attr_error(k, "nesterov=true needs momentum > 0 (as torch.optim.SGD)")
    return _amp_types(k, names, t)


def _amp_sgd_cpu(ins, outs, at):
    w, dw, master, v, lr_buf, scale, found = ins
    if _amp_skipped(found, (w, master, v), outs):
        return
    acc = master.dtype
    mu, wd = at["momentum"], at["weight_decay"]
    inv = np.asarray(1.0 / float(scale), acc)
    g = dw.astype(acc) * inv
    if wd:
        g = g + np.asarray(wd, acc) * master
    v_new = np.asarray(mu, acc) * v + g if mu else g
    step = g + np.asarray(mu, acc) * v_new if at["nesterov"] else v_new
    m_new = master - np.asarray(float(lr_buf), acc) * step
    _write(outs[2], v_new)
    _write(outs[1], m_new)
    _write(outs[0], m_new)  # the master-to-half cast (round to nearest even)


_register("amp_sgd_step", "w dw master v lr scale found_inf", "w master v", _amp_sgd_infer,
          _amp_sgd_cpu, {"momentum": 0.9, "weight_decay": 0.0, "nesterov": False}, doc="""
SGD with momentum on f32 master weights under dynamic loss scaling (Micikevicius et al., 2018,
"Mixed Precision Training"; torch.amp.GradScaler.step around torch.optim.SGD): if found_inf != 0
nothing changes (the step is skipped); else g = dw / scale (dw widened to the master's dtype,
times 1 / scale computed in double and rounded to that dtype), g = g + weight_decay * master,
v = momentum * v + g, master = master - lr * (g + momentum * v if nesterov else v), and
w = master rounded to w's dtype (the master-to-half cast, round to nearest even).
w, dw: one shape, one float dtype (f16: the model's copy and its scaled gradient); master, v:
same shape, one float dtype (f32); lr, scale, found_inf: [] float device scalars read when the
kernel runs -> (w, master, v), in place.
""",
          row=DocRow("w, dw, master, v, lr [], scale [], found_inf [] -> w, master, v", "update",
                     "skipped if found_inf; else SGD on master with dw/scale, then w = f16(master)"))


def _amp_lars_infer(k, names, t, at):
    for a in ("momentum", "weight_decay", "trust", "eps"):
        _number(k, at, a, lo=0.0)
    return _amp_types(k, names, t)


def _amp_lars_cpu(ins, outs, at):
    w, dw, master, v, lr_buf, scale, found = ins
    if _amp_skipped(found, (w, master, v), outs):
        return
    acc = _acc_dtype(master)
    wd = at["weight_decay"]
    inv = np.asarray(1.0 / float(scale), acc)
    ma = master.astype(acc)
    ga = dw.astype(acc) * inv
    m64, g64 = ma.astype(np.float64), ga.astype(np.float64)
    wn, gn = float(np.sqrt((m64 * m64).sum())), float(np.sqrt((g64 * g64).sum()))
    local = at["trust"] * wn / (gn + wd * wn + at["eps"]) if wn > 0 and gn > 0 else 1.0
    coef = np.asarray(float(lr_buf) * local, acc)
    v_new = np.asarray(at["momentum"], acc) * v.astype(acc) + coef * (ga + np.asarray(wd, acc) * ma)
    m_new = ma - v_new
    _write(outs[2], v_new)
    _write(outs[1], m_new)
    _write(outs[0], m_new)  # the master-to-half cast


_register("amp_lars_step", "w dw master v lr scale found_inf", "w master v", _amp_lars_infer,
          _amp_lars_cpu, {"momentum": 0.9, "weight_decay": 0.0005, "trust": 0.001, "eps": 1e-9},
          doc="""
lars_step on f32 master weights under dynamic loss scaling: if found_inf != 0 nothing changes
(the step is skipped); else g = dw / scale (dw widened to the master's compute dtype),
local = trust * ||master|| / (||g|| + weight_decay * ||master|| + eps) (1 if a norm is 0; norms
summed in double), v = momentum * v + lr * local * (g + weight_decay * master),
master = master - v, and w = master rounded to w's dtype (the master-to-half cast).
w, dw: one shape and float dtype (f16); master, v: same shape, one float dtype (f32); lr, scale,
found_inf: [] float device scalars -> (w, master, v), in place.
""",
          row=DocRow("w, dw, master, v, lr [], scale [], found_inf [] -> w, master, v",
                     "update (or per region on comp1/2/3)",
                     "skipped if found_inf; else lars_step on master with dw/scale (norms in double), then w = "
                     "f16(master)"))


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.


_K: dict[str, Any] = {}


def _kernels() -> dict[str, Any]:
    """Build the CuPy kernel objects once (compilation itself happens per dtype on first
    launch, which is why the executor warms every task up before capture)."""
    if _K:
        return _K
    import cupy as cp

    E = cp.ElementwiseKernel
    k = _K
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
    return k


def sgd_step_cuda(ctx, stream, ins, outs, attrs):
    w, dw, v, lr = ins
    w_out, v_out = outs
    with _stream(ctx, stream):
        _same_or_copy(w, w_out)
        _same_or_copy(v, v_out)
        _kernels()["sgd_step"](dw, lr, float(attrs.get("momentum", 0.9)),
                               float(attrs.get("weight_decay", 0.0)),
                               bool(attrs.get("nesterov", False)), w_out, v_out)


def adam_step_cuda(ctx, stream, ins, outs, attrs):
    w, dw, m, v, lr, t = ins
    w_out, m_out, v_out = outs
    with _stream(ctx, stream):
        _same_or_copy(w, w_out)
        _same_or_copy(m, m_out)
        _same_or_copy(v, v_out)
        _kernels()["adam_step"](dw, lr, t, float(attrs.get("beta1", 0.9)),
                                float(attrs.get("beta2", 0.999)), float(attrs.get("eps", 1e-8)),
                                float(attrs.get("weight_decay", 0.0)), w_out, m_out, v_out)


def increment_cuda(ctx, stream, ins, outs, attrs):
    with _stream(ctx, stream):
        _same_or_copy(ins[0], outs[0])
        _kernels()["increment"](float(attrs.get("by", 1.0)), outs[0])


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


def lars_step_cuda(ctx, stream, ins, outs, attrs):
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


def ema_update_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    ema, w = ins
    out = outs[0]
    _contiguous("ema_update", (ema, w, out))
    if out.size == 0:
        return
    f = _cnn_fn("ema", "ss_ema", X_t=ema.dtype, W_t=w.dtype, A_t=_acc_of(ema.dtype))
    _go(ctx, stream, f, _grid(out.size),
        (ema, w, out, np.int64(out.size), np.float64(1.0 - float(attrs.get("decay", 0.999)))))


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


def amp_sgd_step_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    _amp_update(ctx, stream, ins, outs, "amp_sgd_step", "ampsgd", "ss_amp_sgd", _grid(ins[0].size),
                (np.float64(float(attrs.get("momentum", 0.9))), np.float64(float(attrs.get("weight_decay", 0.0))),
                 np.int32(1 if attrs.get("nesterov", False) else 0)))


def amp_lars_step_cuda(ctx, stream, ins, outs, attrs):
    import numpy as np

    _amp_update(ctx, stream, ins, outs, "amp_lars_step", "amplars", "ss_amp_lars", (1,),
                (np.float64(attrs.get("momentum", 0.9)), np.float64(attrs.get("weight_decay", 0.0005)),
                 np.float64(attrs.get("trust", 0.001)), np.float64(attrs.get("eps", 1e-9))))
