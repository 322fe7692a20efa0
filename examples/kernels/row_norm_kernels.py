"""Kernels written in Python for `streamsched --kernels row_norm_kernels`: the normalisation of
layer norm (Ba, Kiros and Hinton, 2016) over the last axis, which one `kernel` expression cannot
say (it needs each row's mean and variance first: two reductions), with its gradient kernel and
the recipe that ties them together.

    PYTHONPATH=src:examples/kernels python -m streamsched run examples/kernels/layer_norm_mlp.sched \\
        --kernels row_norm_kernels --backend cpu
"""

from __future__ import annotations

import numpy as np

from streamsched.kernel_api import KCall, KernelTypeError, kernel

FLOATS = ("f16", "f32", "f64")


def _infer(in_types, attrs):
    """x: float, at least 1-D -> y: x's type (attrs: eps > 0)."""
    (shape, dtype), = in_types
    if dtype not in FLOATS:
        raise KernelTypeError(f"row_norm: x must be a float dtype, got {dtype}", arg=0, code="S004")
    if len(shape) < 1:
        raise KernelTypeError("row_norm: x needs at least one dimension, got []", arg=0)
    if not attrs["eps"] > 0:
        raise KernelTypeError(f"row_norm: eps must be positive, got {attrs['eps']}")
    return [(shape, dtype)]


def _infer_grad(in_types, attrs):
    (s0, d0), (s1, d1) = in_types
    if (s0, d0) != (s1, d1):
        raise KernelTypeError(f"row_norm_grad: dy and x differ: {d0}{list(s0)} and {d1}{list(s1)}", arg=1)
    return [(s0, d0)]


def _stats(x, eps):
    x = x.astype(np.promote_types(x.dtype, np.float32))  # f16 rows are normalised in f32
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    return x, mean, rstd


def _norm_cpu(ins, outs, attrs):
    x, mean, rstd = _stats(ins[0], attrs["eps"])
    outs[0][...] = (x - mean) * rstd


def _norm_grad_cpu(ins, outs, attrs):
    x, mean, rstd = _stats(ins[1], attrs["eps"])
    dy = ins[0].astype(x.dtype)
    xhat = (x - mean) * rstd
    outs[0][...] = rstd * (dy - dy.mean(axis=-1, keepdims=True) - xhat * (dy * xhat).mean(axis=-1, keepdims=True))


def _cuda_stats(cp, x, eps):
    x = x.astype(cp.promote_types(x.dtype, cp.float32), copy=False)
    mean = x.mean(axis=-1, keepdims=True)
    return x, mean, 1.0 / cp.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)


def _norm_cuda(ctx, stream, ins, outs, attrs):
    import cupy as cp  # only on the CUDA backend

    with ctx.stream(stream):
        x, mean, rstd = _cuda_stats(cp, ins[0], attrs["eps"])
        outs[0][...] = (x - mean) * rstd


def _norm_grad_cuda(ctx, stream, ins, outs, attrs):
    import cupy as cp

    with ctx.stream(stream):
        x, mean, rstd = _cuda_stats(cp, ins[1], attrs["eps"])
        dy = ins[0].astype(x.dtype, copy=False)
        xhat = (x - mean) * rstd
        outs[0][...] = rstd * (dy - dy.mean(axis=-1, keepdims=True)
                               - xhat * (dy * xhat).mean(axis=-1, keepdims=True))


def _grad(g):
    """dx = row_norm_grad(dy, x), with the forward's eps."""
    return [KCall("row_norm_grad", (g.douts[0], g.args[0]), (("eps", g.attrs["eps"]),)) if g.need[0] else None]


KERNELS = [
    kernel("row_norm", "x", "y", _infer, _norm_cpu, attrs={"eps": 1e-5}, cuda=_norm_cuda, grad=_grad,
           doc="y = (x - mean(x)) / sqrt(var(x) + eps) along the last axis (biased variance)"),
    kernel("row_norm_grad", "dy x", "dx", _infer_grad, _norm_grad_cpu, attrs={"eps": 1e-5}, cuda=_norm_grad_cuda,
           doc="dx = (dy - mean(dy) - y mean(dy y)) / sqrt(var(x) + eps), y the normalised x"),
]
