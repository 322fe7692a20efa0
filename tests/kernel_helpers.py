"""Helpers shared by the kernel tests: run a kernel on fresh outputs from its type rule, and
central finite differences (the trusted reference every backward kernel is checked against)."""

from __future__ import annotations

import numpy as np

from streamsched.stdlib.kernels import infer_types, kernel, numpy_dtype

DT = {np.dtype(np.float64): "f64", np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
      np.dtype(np.int32): "i32", np.dtype(np.int64): "i64", np.dtype(np.uint8): "u8"}


def types_of(arrays):
    return [(a.shape, DT[a.dtype]) for a in arrays]


def run(name, ins, attrs=None):
    """Run a kernel on fresh outputs allocated from its type rule (floats start as NaN, so an
    output the kernel forgets to write fails every comparison)."""
    attrs = attrs or {}
    outs = [np.full(s, np.nan, numpy_dtype(d)) if d in ("f16", "f32", "f64")
            else np.zeros(s, numpy_dtype(d)) for s, d in infer_types(name, types_of(ins), attrs)]
    kernel(name).cpu(ins, outs, attrs)
    return outs


def run1(name, ins, attrs=None):
    return run(name, ins, attrs)[0]


def num_grad(f, x, eps=1e-6):
    """Central finite differences of the scalar f() with respect to the array x (perturbed in
    place, restored afterwards)."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


def close(got, want, tol=1e-6):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
