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


def alias_cases(samples, kernel_of=lambda key: key):
    """(key, output index, input index) for every output of every sample call whose type equals
    an input's type: the pairs the executor may alias (an update written in place, a planned
    buffer reused).  samples: key -> (inputs, attrs); kernel_of maps a key to its kernel."""
    cases = []
    for key, (ins, attrs) in samples.items():
        for j, ot in enumerate(infer_types(kernel_of(key), types_of(ins), attrs)):
            for i, it in enumerate(types_of(ins)):
                if it == ot:
                    cases.append((key, j, i))
    return cases


def assert_output_may_be_input(name, ins, attrs, out, inp):
    """The kernel writes output `out` into input `inp`'s array and gets every output exactly as
    with fresh outputs."""
    fresh = run(name, [i.copy() for i in ins], attrs)
    outs = [np.empty(s, numpy_dtype(d)) for s, d in infer_types(name, types_of(ins), attrs)]
    outs[out] = ins[inp]
    kernel(name).cpu(ins, outs, attrs)
    for got, want in zip(outs, fresh):
        np.testing.assert_array_equal(got, want)


def arena_views(arrays, pad=8):
    """Views of one uint8 arena holding copies of `arrays`, each at an 8-byte-aligned offset
    (as the memory planner lays buffers out)."""
    sizes = [a.nbytes + (-a.nbytes) % pad + pad for a in arrays]
    arena = np.zeros(sum(sizes) + pad, np.uint8)
    views, off = [], pad
    for a, size in zip(arrays, sizes):
        v = arena[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
        v[...] = a
        views.append(v)
        off += size
    return arena, views


def assert_runs_in_one_arena(name, ins, attrs):
    """Inputs and outputs as views into one byte arena, each output that has an input's type
    being that input's very view: the results equal those on fresh outputs."""
    fresh = run(name, [i.copy() for i in ins], attrs)
    out_types = infer_types(name, types_of(ins), attrs)
    arena, views = arena_views(ins + [np.zeros(s, numpy_dtype(d)) for s, d in out_types])
    vin, vout = views[:len(ins)], views[len(ins):]
    taken = set()
    for j, ot in enumerate(out_types):
        for i, it in enumerate(types_of(ins)):
            if it == ot and i not in taken:
                vout[j] = vin[i]
                taken.add(i)
                break
    kernel(name).cpu(vin, vout, attrs)
    for got, want in zip(vout, fresh):
        np.testing.assert_array_equal(got, want)
    assert all(np.shares_memory(v, arena) for v in vout)


def graph_us(cp, st, once, per_graph: int = 20, replays: int = 5) -> float:
    """µs of one call of `once` (it launches on CuPy stream `st`), from a captured graph of
    `per_graph` calls replayed `replays` times after one warm-up replay (CUDA events around the
    replays).  `once` runs once uncaptured first, so that what it compiles or tunes is ready.
    For timing printouts in GPU tests, never asserted: speed lives in benchmarks."""
    cp.cuda.Device().synchronize()
    once()
    st.synchronize()
    st.begin_capture()
    for _ in range(per_graph):
        once()
    g = st.end_capture()
    g.launch(st)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(st)
    for _ in range(replays):
        g.launch(st)
    e1.record(st)
    e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / (per_graph * replays)
