"""The CUDA twins of the transformer kernels (`<name>_cuda` in stdlib/kernels/transformer.py) against
their NumPy twins, run-to-run bitwise determinism (the embedding backward bitwise equal to the NumPy
twin, also with its duplicate ids permuted), in-place equal to separate outputs, and a captured
attention forward and backward that allocates nothing.  Needs CuPy and a GPU; skips itself
otherwise (`pytest -m cuda`)."""

from __future__ import annotations

import numpy as np
import pytest

import streamsched.stdlib.kernels.transformer as kt
from streamsched.stdlib.kernels import KERNELS, infer_types, numpy_dtype

pytestmark = pytest.mark.cuda

# fixtures `cp` (CuPy on a usable device, else skip) and `ctx` live in tests/conftest.py

_DT = {np.dtype(np.float64): "f64", np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
       np.dtype(np.int32): "i32", np.dtype(np.int64): "i64", np.dtype(np.uint8): "u8"}
_rng = np.random.default_rng(2024)


def _f(*shape, scale=1.0, dt=np.float32):
    return np.asarray(_rng.standard_normal(shape) * scale, dtype=dt)


def _s(v, dt=np.float32):
    return np.array(v, dtype=dt).reshape(())


def _probs(b, h, t, dt=np.float32):
    z = _rng.standard_normal((b, h, t, t))
    z = np.where(np.tril(np.ones((t, t))) > 0, z, -np.inf)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(dt)


_IDS = _rng.integers(0, 50, 4 * 64).astype(np.int32)  # 256 ids of 50: many duplicates
_MIXED = (_rng.standard_normal((256, 48)) * 10.0 ** _rng.integers(-6, 6, (256, 48))).astype(np.float32)

# name, inputs, attrs, exact (bitwise equal to the NumPy twin)
CASES = [
    ("embedding", [_IDS.reshape(4, 64), _f(50, 48)], {}, True),
    ("embedding", [_IDS.astype(np.int64), _f(50, 48, dt=np.float16)], {}, True),
    ("embedding_grad", [_f(256, 48), _IDS], {"vocab": 50}, True),
    ("embedding_grad", [_MIXED, _IDS], {"vocab": 64}, True),
    ("embedding_grad", [_f(256, 48, dt=np.float64), _IDS.astype(np.int64)], {"vocab": 50}, True),
    ("embedding_grad", [_f(256, 8, dt=np.float16), _IDS], {"vocab": 50}, True),
    ("pos_embedding", [_f(256, 48), _f(64, 48)], {}, True),
    ("pos_embedding", [_f(256, 48, dt=np.float64), _f(64, 48, dt=np.float64)], {}, True),
    ("pos_embedding_grad", [_f(256, 48)], {"context": 64}, True),
    ("pos_embedding_grad", [_f(256, 48, dt=np.float16)], {"context": 32}, True),
    ("layernorm", [_f(256, 48, scale=3.0) + 1, _f(48), _f(48)], {}, False),
    ("layernorm", [_f(100, 768), _f(768), _f(768)], {"eps": 1e-6}, False),
    ("layernorm", [_f(64, 40, dt=np.float16), _f(40, dt=np.float16), _f(40, dt=np.float16)], {}, False),
    ("layernorm_grad_x", [_f(256, 48), _f(256, 48), _f(48), _f(256), np.abs(_f(256)) + 0.5], {}, False),
    ("layernorm_grad_gamma", [_f(256, 48), _f(256, 48), _f(256), np.abs(_f(256)) + 0.5], {}, False),
    ("softmax", [_f(4, 2, 64, 64, scale=3.0)], {}, False),
    ("softmax", [np.where(np.tril(np.ones((33, 33))) > 0, _f(2, 3, 33, 33, dt=np.float64), -np.inf)], {},
     False),  # -inf entries (a causal mask)
    ("softmax", [_f(7, 1000, dt=np.float16)], {}, False),
    ("softmax_grad", [_f(4, 2, 64, 64), _probs(4, 2, 64)], {}, False),
    ("attn_scores", [_f(256, 48), _f(256, 48)], {"heads": 4, "context": 64}, False),
    ("attn_scores", [_f(96, 24, dt=np.float64), _f(96, 24, dt=np.float64)], {"heads": 3, "context": 32,
                                                                                "causal": False}, False),
    ("attn_scores", [_f(128, 64, dt=np.float16), _f(128, 64, dt=np.float16)], {"heads": 2, "context": 64}, False),
    ("attn_apply", [_probs(4, 4, 64), _f(256, 48)], {}, False),
    ("attn_apply", [_probs(3, 3, 32, dt=np.float64), _f(96, 24, dt=np.float64)], {}, False),
    ("attn_grad_p", [_f(256, 48), _f(256, 48)], {"heads": 4, "context": 64}, False),
    ("attn_grad_v", [_probs(4, 4, 64), _f(256, 48)], {}, False),
    ("attn_grad_q", [_f(4, 4, 64, 64), _f(256, 48)], {}, False),
    ("attn_grad_k", [_f(4, 4, 64, 64), _f(256, 48)], {}, False),
    # fused attention: K, V staged in shared memory; t = 200, dh = 64: the forward's 112 KiB
    # takes the opt-in limit, the backward's 369 KiB is past it (the cache-read kernel); t = 70
    # is not a multiple of the warp
    ("attn_fused", [_f(256, 48), _f(256, 48), _f(256, 48)], {"heads": 4, "context": 64}, False),
    ("attn_fused", [_f(96, 24, dt=np.float64)] * 3, {"heads": 3, "context": 32, "causal": False}, False),
    ("attn_fused", [_f(128, 64, dt=np.float16), _f(128, 64, dt=np.float16), _f(128, 64, dt=np.float16)],
     {"heads": 2, "context": 64}, False),
    ("attn_fused", [_f(140, 20), _f(140, 20), _f(140, 20)], {"heads": 5, "context": 70}, False),
    ("attn_fused", [_f(400, 128), _f(400, 128), _f(400, 128)], {"heads": 2, "context": 200}, False),
    ("attn_fused_grad", [_f(256, 48), _f(256, 48), _f(256, 48), _f(256, 48), _probs(4, 4, 64)],
     {"heads": 4, "context": 64}, False),
    ("attn_fused_grad", [_f(96, 24, dt=np.float64), _f(96, 24, dt=np.float64), _f(96, 24, dt=np.float64),
                         _f(96, 24, dt=np.float64), _probs(3, 3, 32, dt=np.float64)],
     {"heads": 3, "context": 32}, False),
    ("attn_fused_grad", [_f(128, 64, dt=np.float16), _f(128, 64, dt=np.float16), _f(128, 64, dt=np.float16),
                         _f(128, 64, dt=np.float16), _probs(2, 2, 64, dt=np.float16)],
     {"heads": 2, "context": 64}, False),
    ("attn_fused_grad", [_f(140, 20), _f(140, 20), _f(140, 20), _f(140, 20), _probs(2, 5, 70)],
     {"heads": 5, "context": 70}, False),
    ("attn_fused_grad", [_f(400, 128), _f(400, 128), _f(400, 128), _f(400, 128), _probs(2, 2, 200)],
     {"heads": 2, "context": 200}, False),
    # t = 128, dh = 16: the tiled kernels loop over 64-row, 64-column tiles
    ("attn_fused", [_f(256, 32), _f(256, 32), _f(256, 32)], {"heads": 2, "context": 128}, False),
    ("attn_fused", [_f(256, 32), _f(256, 32), _f(256, 32)], {"heads": 2, "context": 128, "causal": False}, False),
    ("attn_fused_grad", [_f(256, 32), _f(256, 32), _f(256, 32), _f(256, 32), _probs(2, 2, 128)],
     {"heads": 2, "context": 128}, False),
    # f64 at t = 64: dot_i's double sum is not rounded to f32 after, so the order of its terms
    # (columns l, l + 32 per lane, then the butterfly) shows in the bits
    ("attn_fused_grad", [_f(128, 32, dt=np.float64), _f(128, 32, dt=np.float64), _f(128, 32, dt=np.float64),
                         _f(128, 32, dt=np.float64), _probs(2, 2, 64, dt=np.float64)],
     {"heads": 2, "context": 64}, False),
    # dh = 32: the backward's staged operands take 58 KiB, past the plain 48 KiB (the opt-in)
    ("attn_fused", [_f(128, 64), _f(128, 64), _f(128, 64)], {"heads": 2, "context": 64}, False),
    ("attn_fused_grad", [_f(128, 64), _f(128, 64), _f(128, 64), _f(128, 64), _probs(2, 2, 64)],
     {"heads": 2, "context": 64}, False),
    ("adamw_step", [_f(300), _f(300), _f(300, scale=0.1), np.abs(_f(300)), _s(1e-3), _s(3.0)],
     {"weight_decay": 0.1}, False),
    ("grad_sumsq", [_f(100000), _s(2.0)], {}, False),
    ("grad_sumsq", [_f(33, 7, dt=np.float16), _s(0.0)], {}, False),
    ("clip_scale", [_s(16.0)], {"max_norm": 1.0}, False),
    ("clip_scale", [_s(0.25)], {"max_norm": 1.0}, False),
    ("clip_scale", [_s(np.nan)], {}, False),
    ("scale_grad", [_f(1000), _s(0.3)], {}, True),
    ("scale_grad", [_f(1000, dt=np.float16), _s(0.3)], {}, True),
]


def _ids():
    return [f"{i}-{c[0]}" for i, c in enumerate(CASES)]


def test_cases_cover_every_transformer_kernel(cp):
    assert {c[0] for c in CASES} == set(kt.TRANSFORMER_KERNELS)


def _numpy(name, ins, attrs):
    types = [(a.shape, _DT[a.dtype]) for a in ins]
    outs = [np.zeros(s, numpy_dtype(d)) for s, d in infer_types(name, types, attrs)]
    KERNELS[name].cpu([a.copy() for a in ins], outs, attrs)
    return outs


def _device(cp, ctx, name, ins, attrs, stream="s1", in_place=True):
    from streamsched.stdlib.kernels import CUDA_KERNELS

    rec = KERNELS[name]
    full = {**rec.attrs, **attrs}
    g_ins = [cp.asarray(np.array(a, order="C")) for a in ins]
    types = [(a.shape, _DT[a.dtype]) for a in ins]
    g_outs = []
    for j, (s, d) in enumerate(infer_types(name, types, attrs)):
        oname = rec.outputs[j]
        if in_place and oname in rec.inputs:
            g_outs.append(g_ins[rec.inputs.index(oname)])
        else:
            g_outs.append(cp.full(s, 77, dtype=numpy_dtype(d)))
    cp.cuda.runtime.deviceSynchronize()
    CUDA_KERNELS[name](ctx, stream, g_ins, g_outs, full)
    ctx.synchronize()
    return [cp.asnumpy(o) for o in g_outs]


def _compare(got, want, exact, name):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        if exact or w.dtype.kind in "iu":
            np.testing.assert_array_equal(g, w)
            continue
        if w.dtype == np.float16:
            rtol, atol = 2e-3, 2e-3 * max(1.0, float(np.nanmax(np.abs(w.astype(np.float32)))))
        else:
            rtol = 1e-5
            finite = np.abs(w[np.isfinite(w)])
            atol = 1e-5 * max(1.0, float(finite.max())) if finite.size else 0.0
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", range(len(CASES)), ids=_ids())
def test_cuda_twin_matches_numpy(cp, ctx, case):
    name, ins, attrs, exact = CASES[case]
    _compare(_device(cp, ctx, name, ins, attrs), _numpy(name, ins, attrs), exact, name)


@pytest.mark.parametrize("case", range(len(CASES)), ids=_ids())
def test_cuda_twin_is_bitwise_deterministic(cp, ctx, case):
    name, ins, attrs, _ = CASES[case]
    first = _device(cp, ctx, name, ins, attrs, stream="s0")
    for stream in ("s0", "s1"):
        again = _device(cp, ctx, name, ins, attrs, stream=stream)
        for x, y in zip(first, again):
            assert x.tobytes() == y.tobytes(), name


@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES)
                                  if any(o in KERNELS[c[0]].inputs for o in KERNELS[c[0]].outputs)],
                         ids=lambda i: f"{i}-{CASES[i][0]}")
def test_separate_outputs_equal_in_place(cp, ctx, case):
    name, ins, attrs, _ = CASES[case]
    a = _device(cp, ctx, name, ins, attrs, in_place=True)
    b = _device(cp, ctx, name, ins, attrs, in_place=False)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes(), name


def test_embedding_grad_ignores_the_order_of_duplicates_on_the_device(cp, ctx):
    perm = _rng.permutation(len(_IDS))
    a = _device(cp, ctx, "embedding_grad", [_MIXED, _IDS], {"vocab": 64})[0]
    b = _device(cp, ctx, "embedding_grad", [_MIXED[perm], _IDS[perm]], {"vocab": 64})[0]
    assert a.tobytes() == b.tobytes()


def test_captured_attention_step_allocates_nothing_and_replays_like_eager(cp, ctx):
    """scores, softmax, apply and the five backward kernels, and the embedding backward (whose
    scratch comes from the capture's private pool), captured in one graph on one stream: no
    memory nodes, the pool is empty again afterwards, and replays equal the eager results."""
    import gc

    from streamsched.interp.cuda import graph_nodes_edges
    from streamsched.stdlib.kernels import CUDA_KERNELS as K

    at = {"heads": 4, "context": 64, "causal": True}
    q, k, v, do = (cp.asarray(_f(256, 48)) for _ in range(4))
    ids = cp.asarray(_IDS)
    s, p, dp, ds = (cp.zeros((4, 4, 64, 64), cp.float32) for _ in range(4))
    o, dv, dq, dk = (cp.zeros((256, 48), cp.float32) for _ in range(4))
    dt = cp.zeros((50, 48), cp.float32)
    cp.cuda.runtime.deviceSynchronize()

    def step():
        K["attn_scores"](ctx, "s0", [q, k], [s], at)
        K["softmax"](ctx, "s0", [s], [p], {})
        K["attn_apply"](ctx, "s0", [p, v], [o], {})
        K["attn_grad_p"](ctx, "s0", [do, v], [dp], at)
        K["attn_grad_v"](ctx, "s0", [p, do], [dv], {})
        K["softmax_grad"](ctx, "s0", [dp, p], [ds], {})
        K["attn_grad_q"](ctx, "s0", [ds, k], [dq], {})
        K["attn_grad_k"](ctx, "s0", [ds, q], [dk], {})
        K["embedding_grad"](ctx, "s0", [dq, ids], [dt], {"vocab": 50})

    ctx.init_blas()
    step()  # warm-up: compiles every kernel before capture
    ctx.synchronize()
    outs = (o, dq, dk, dv, dt)
    eager = [cp.asnumpy(a) for a in outs]
    for a in outs:
        a.fill(0)
    cp.cuda.runtime.deviceSynchronize()
    st = ctx.streams["s0"]
    gc.collect()
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc):
        st.begin_capture()
        try:
            step()
        finally:
            graph = st.end_capture()
    assert pool.used_bytes() == 0
    types, _ = graph_nodes_edges(graph)
    assert not [t for t in types if t.startswith("Mem") and t not in ("Memcpy", "Memset")], types
    for _ in range(2):
        graph.launch(st)
        st.synchronize()
        for got, want in zip(outs, eager):
            assert cp.asnumpy(got).tobytes() == want.tobytes()


@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES) if c[0].startswith("attn_fused")],
                         ids=lambda i: f"{i}-{CASES[i][0]}")
def test_fused_attention_read_through_the_cache_matches_numpy(cp, ctx, case, monkeypatch):
    """The SS_STAGED 0 kernels (what runs past 48 KiB of shared memory) on every fused case."""
    monkeypatch.setattr(kt, "_ATTN_SMEM", 0)
    name, ins, attrs, exact = CASES[case]
    _compare(_device(cp, ctx, name, ins, attrs), _numpy(name, ins, attrs), exact, name)


@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES) if c[0] == "attn_fused_grad"],
                         ids=lambda i: f"{i}-{CASES[i][0]}")
def test_fused_attention_backward_bits_do_not_depend_on_the_block_shape(cp, ctx, case, monkeypatch):
    """The fast backward's warps and rows per block only move work between blocks: every
    (warps, rows per warp) gives bitwise the same dq, dk, dv as the first version's one row a
    warp, 8 warps a block."""
    name, ins, attrs, _ = CASES[case]
    monkeypatch.setattr(kt, "_ATTN_TILED", False)
    runs = []
    for shape in ((8, 1), (16, 2), (4, 3), (16, 4)):
        monkeypatch.setattr(kt, "_ATTN_BWD", shape)
        runs.append(_device(cp, ctx, name, ins, attrs))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES) if c[0].startswith("attn_fused")],
                         ids=lambda i: f"{i}-{CASES[i][0]}")
def test_tiled_attention_is_bitwise_the_row_kernels(cp, ctx, case, monkeypatch):
    """ss_attn_fwd_tiled / ss_attn_bwd_tiled take the products, maxima and sums of ss_attn_fwd /
    ss_attn_bwd (one row a warp) in the same order: bitwise the same y, p / dq, dk, dv, whatever
    the split of a head's rows over blocks; the backward cases it does not fit (t = 200,
    dh = 64: 530 KiB) take ss_attn_bwd, so also agree."""
    name, ins, attrs, _ = CASES[case]
    monkeypatch.setattr(kt, "_ATTN_TILED", False)
    want = _device(cp, ctx, name, ins, attrs)
    monkeypatch.setattr(kt, "_ATTN_TILED", True)
    for rows in ((16, 32), (32, 16), (7, 100), (1000, 1000)):
        monkeypatch.setattr(kt, "_ATTN_TILED_ROWS", rows)
        got = _device(cp, ctx, name, ins, attrs)
        for a, b in zip(want, got):
            assert a.tobytes() == b.tobytes(), rows


def test_tiled_attention_runs_where_it_fits(cp, ctx, monkeypatch):
    """The GPT step's shape (t = 64, dh = 16, f32): the backward's 50 KiB of shared memory, past the
    plain 48 KiB, take the tiled kernel where the device's opt-in limit allows it, the row kernel
    under 48 KiB; the forward's 14 KiB take the tiled kernel under 48 KiB."""
    names = []
    real = kt._attn_fn
    monkeypatch.setattr(kt, "_attn_fn", lambda name, *a: names.append(name) or real(name, *a))
    ins = [_f(256, 64), _f(256, 64), _f(256, 64), _f(256, 64), _probs(4, 4, 64)]
    at = {"heads": 4, "context": 64}
    need = kt._attn_bwd_tiled_smem(64, 16, 4)
    assert need == (4 * 64 * 17 + 2 * 64 * 65) * 4 > 48 * 1024
    got = _device(cp, ctx, "attn_fused_grad", ins, at)
    fits = need <= kt._attn_smem(cp.cuda.Device().id)
    assert (names[0] == "ss_attn_bwd_tiled") == fits
    _compare(got, _numpy("attn_fused_grad", ins, at), False, "attn_fused_grad")
    names.clear()
    monkeypatch.setattr(kt, "_ATTN_SMEM", 48 * 1024)
    _device(cp, ctx, "attn_fused_grad", ins, at)
    assert names == ["ss_attn_bwd"]
    names.clear()
    fwd = _device(cp, ctx, "attn_fused", ins[1:4], at)  # 14 KiB: tiled under the plain limit
    assert names == ["ss_attn_fwd_tiled"]
    _compare(fwd, _numpy("attn_fused", ins[1:4], at), False, "attn_fused")
    assert kt._attn_fwd_rows(64, 16, 4, 48 * 1024) == 16
    assert kt._attn_fwd_rows(1024, 64, 4, 227 * 1024) is None  # K and V alone take 520 KiB
    monkeypatch.setattr(kt, "_ATTN_TILED_ROWS", (256, 32))
    assert kt._attn_fwd_rows(256, 64, 4, 227 * 1024) == 64  # 128 rows: 290 KiB; 64 rows: 211 KiB


def test_fused_attention_backward_takes_the_opt_in_shared_memory(cp):
    """Past the plain 48 KiB a block, the fast backward runs where the device's opt-in limit
    allows (t = 64, dh = 32 f32: 58 KiB; the H200 allows 227 KiB), and the global kernel past it."""
    optin = kt._attn_smem_optin(cp.cuda.Device().id)
    need = kt._attn_bwd_shape(64, 32, 4, 1 << 30)[2]
    assert need > 48 * 1024
    assert (kt._attn_bwd_shape(64, 32, 4, kt._attn_smem(cp.cuda.Device().id)) is not None) == (need <= optin)
    assert kt._attn_bwd_shape(64, 32, 4, 48 * 1024) is None  # 8 warps would take 53.5 KiB
    assert kt._attn_bwd_shape(64, 16, 4, 48 * 1024) == (16, 32, (64 + 4 * 64 * 17 + 64 * 65 + 16 * 2 * 64) * 4)


def test_fused_attention_is_close_to_the_unfused_kernels_on_the_device(cp, ctx):
    """attn_fused / attn_fused_grad against attn_scores, softmax, attn_apply and the five
    backward kernels, all on the GPU (an oracle that shares no code with the fused kernels)."""
    at = {"heads": 4, "context": 64}
    q, k, v, dy = (_f(256, 48) for _ in range(4))
    s = _device(cp, ctx, "attn_scores", [q, k], at)[0]
    p = _device(cp, ctx, "softmax", [s], {})[0]
    y = _device(cp, ctx, "attn_apply", [p, v], {})[0]
    fy, fp = _device(cp, ctx, "attn_fused", [q, k, v], at)
    _compare([fy, fp], [y, p], False, "attn_fused")
    dv = _device(cp, ctx, "attn_grad_v", [p, dy], {})[0]
    dp = _device(cp, ctx, "attn_grad_p", [dy, v], at)[0]
    ds = _device(cp, ctx, "softmax_grad", [dp, p], {})[0]
    dq = _device(cp, ctx, "attn_grad_q", [ds, k], {})[0]
    dk = _device(cp, ctx, "attn_grad_k", [ds, q], {})[0]
    _compare(_device(cp, ctx, "attn_fused_grad", [dy, q, k, v, p], at), [dq, dk, dv], False, "attn_fused_grad")


def test_captured_fused_attention_allocates_nothing_and_replays_like_eager(cp, ctx):
    from streamsched.interp.cuda import graph_nodes_edges
    from streamsched.stdlib.kernels import CUDA_KERNELS as K

    at = {"heads": 4, "context": 64, "causal": True}
    q, k, v, do = (cp.asarray(_f(256, 48)) for _ in range(4))
    p = cp.zeros((4, 4, 64, 64), cp.float32)
    y, dq, dk, dv = (cp.zeros((256, 48), cp.float32) for _ in range(4))

    def step():
        K["attn_fused"](ctx, "s0", [q, k, v], [y, p], at)
        K["attn_fused_grad"](ctx, "s0", [do, q, k, v, p], [dq, dk, dv], {"heads": 4, "context": 64})

    step()
    ctx.synchronize()
    outs = (y, p, dq, dk, dv)
    eager = [cp.asnumpy(a) for a in outs]
    for a in outs:
        a.fill(0)
    cp.cuda.runtime.deviceSynchronize()
    st = ctx.streams["s0"]
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc):
        st.begin_capture()
        try:
            step()
        finally:
            graph = st.end_capture()
    assert pool.used_bytes() == 0
    types, _ = graph_nodes_edges(graph)
    assert types.count("Kernel") == 2, types
    graph.launch(st)
    st.synchronize()
    for got, want in zip(outs, eager):
        assert cp.asnumpy(got).tobytes() == want.tobytes()
