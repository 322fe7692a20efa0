"""The GEMMs of the MLP 784-1024-1024-10 step, each alone: cublasSgemm against every cuBLASLt
heuristic candidate (deterministic reductions: mask 6; and mask 7, the in-place reduction too), and
torch.mm, at batch 128 and 2048, row-major as the step runs them.

Each problem is launched 20 times inside one captured CUDA graph; a figure is the best of 5
replays divided by 20 (us).  Needs CuPy, nvmath-python and a GPU (torch optional).  This is what
docs/performance.md's "GEMM algorithms by timing" quotes (H200, 2026-12-02):

    python3 benchmarks/gemm_alone.py OUT.json
"""
import json
import sys

import numpy as np

REPS = 20
WS = 32 << 20


def graph_time(fn, reps=REPS, launches=5):
    with st:
        fn(); st.synchronize()
        st.begin_capture()
        for _ in range(reps): fn()
        g = st.end_capture()
        g.upload(st); g.launch(st); st.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        best = 1e9
        for _ in range(launches):
            e0.record(st); g.launch(st); e1.record(st); e1.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(e0, e1) * 1000 / reps)
    return best

def put(desc, attr, v, dt):
    b = np.array([v], dt); lt.matmul_desc_set_attribute(desc, int(attr), b.ctypes.data, b.itemsize)

def lt_cands(m, n, k, ta, tb, mask, count=32, epi=None, bias=None):
    # row-major c[m,n] = op(a) op(b): column-major c^T[n,m] = op(b)^T op(a)^T: A=b, B=a
    desc = lt.matmul_desc_create(68, 0)
    At = lt.MatmulDescAttribute
    put(desc, At.TRANSA, 1 if tb else 0, np.int32); put(desc, At.TRANSB, 1 if ta else 0, np.int32)
    if epi is not None:
        put(desc, At.EPILOGUE, epi, np.uint32); put(desc, At.BIAS_POINTER, bias.data.ptr, np.uint64)
    # b row-major: (k,n) or (n,k) if tb -> column-major [cols, rows]
    br, bc = (n, k) if tb else (k, n)
    ar, ac = (k, m) if ta else (m, k)
    la = lt.matrix_layout_create(0, bc, br, bc)
    lb = lt.matrix_layout_create(0, ac, ar, ac)
    ld = lt.matrix_layout_create(0, n, m, n)
    pref = lt.matmul_preference_create()
    P = lt.MatmulPreferenceAttribute
    def pp(attr, v, dt=np.uint64):
        b = np.array([v], lt.get_matmul_preference_attribute_dtype(attr)); lt.matmul_preference_set_attribute(pref, int(attr), b.ctypes.data, b.itemsize)
    pp(P.MAX_WORKSPACE_BYTES, WS)
    pp(P.REDUCTION_SCHEME_MASK, mask)
    for a in ("MIN_ALIGNMENT_A_BYTES", "MIN_ALIGNMENT_B_BYTES", "MIN_ALIGNMENT_C_BYTES", "MIN_ALIGNMENT_D_BYTES"):
        pp(getattr(P, a), 16)
    res = np.zeros((count,), dtype=np.dtype([("algo", np.uint64, (8,)), ("workspace_size", np.uint64), ("state", np.int32), ("waves", np.float32), ("reserved", np.int32, (4,))]))
    cnt = np.zeros((1,), np.int32)
    lt.matmul_algo_get_heuristic(h_lt, desc, la, lb, ld, ld, pref, count, res.ctypes.data, cnt.ctypes.data)
    return desc, la, lb, ld, res[:cnt[0]]

def cfg(algo):
    C = lt.MatmulAlgoConfigAttribute
    out = {}
    for nm in ("ID", "TILE_ID", "SPLITK_NUM", "REDUCTION_SCHEME", "STAGES_ID", "CTA_SWIZZLING"):
        if not hasattr(C, nm): continue
        a = getattr(C, nm); dt = lt.get_matmul_algo_config_attribute_dtype(a)
        b = np.zeros((1,), dt); w = np.zeros((1,), np.uint64)
        try:
            lt.matmul_algo_config_get_attribute(algo.ctypes.data, int(a), b.ctypes.data, b.itemsize, w.ctypes.data); out[nm] = int(b[0])
        except Exception: out[nm] = None
    return out

def shapes(B):
    # (label, m, n, k, ta, tb): row-major c[m,n] = op(a)[m,k] op(b)[k,n]
    return [("fwd1", B, 1024, 784, 0, 0), ("fwd2", B, 1024, 1024, 0, 0), ("fwd3", B, 10, 1024, 0, 0),
            ("dW3", 1024, 10, B, 1, 0), ("dX3", B, 1024, 10, 0, 1), ("dW2", 1024, 1024, B, 1, 0),
            ("dX2", B, 1024, 1024, 0, 1), ("dW1", 784, 1024, B, 1, 0)]


def main() -> None:
    global cp, cublas, lt, h_lt, ws, st, hb, one, zero
    import cupy as cp
    from nvmath.bindings import cublas
    from nvmath.bindings import cublasLt as lt

    h_lt = lt.create()
    ws = cp.empty((WS,), cp.uint8)
    st = cp.cuda.Stream(non_blocking=True)
    hb = cublas.create(); cublas.set_stream(hb, st.ptr)
    one = np.array([1.0], np.float32); zero = np.array([0.0], np.float32)
    out = {}
    for B in (128, 2048):
        tot = {"sgemm": 0, "lt_top1": 0, "lt_best_det": 0, "lt_best_any": 0}
        for (lab, m, n, k, ta, tb) in shapes(B):
            a = cp.random.rand(*((k, m) if ta else (m, k)), dtype=cp.float32)
            b = cp.random.rand(*((n, k) if tb else (k, n)), dtype=cp.float32)
            c = cp.empty((m, n), cp.float32)
            opa = 1 if ta else 0; opb = 1 if tb else 0
            lda, ldb = a.shape[1], b.shape[1]
            t_sg = graph_time(lambda: cublas.sgemm(hb, opb, opa, n, m, k, one.ctypes.data, b.data.ptr, ldb, a.data.ptr, lda, zero.ctypes.data, c.data.ptr, n))
            ref = c.copy()
            row = {"sgemm": t_sg, "algos": []}
            for mask in (6, 7):
                desc, la, lb, ld, res = lt_cands(m, n, k, ta, tb, mask)
                for i, r in enumerate(res):
                    algo = np.ascontiguousarray(r["algo"])
                    f = lambda: lt.matmul(h_lt, desc, one.ctypes.data, b.data.ptr, la, a.data.ptr, lb, zero.ctypes.data, c.data.ptr, ld, c.data.ptr, ld, algo.ctypes.data, ws.data.ptr, WS, st.ptr)
                    try:
                        t = graph_time(f)
                    except Exception as e:
                        row["algos"].append({"mask": mask, "i": i, "err": str(e)[:80]}); continue
                    err = float(cp.abs(c - ref).max() / cp.abs(ref).max())
                    row["algos"].append({"mask": mask, "i": i, "us": round(t, 2), "ws": int(r["workspace_size"]), "err": err, **cfg(algo)})
            ok = [x for x in row["algos"] if "us" in x]
            det = [x for x in ok if x["mask"] == 6]
            top1 = det[0]["us"] if det else None
            bd = min(det, key=lambda x: x["us"]) if det else None
            ba = min(ok, key=lambda x: x["us"]) if ok else None
            print(f"B={B} {lab:5s} m{m} n{n} k{k} ta{ta} tb{tb}: sgemm {t_sg:7.2f}  lt_top1 {top1}  best_det {bd['us'] if bd else None} {bd}  best_any {ba['us'] if ba else None} (n={len(ok)})", flush=True)
            tot["sgemm"] += t_sg; tot["lt_top1"] += top1 or t_sg; tot["lt_best_det"] += bd["us"] if bd else t_sg; tot["lt_best_any"] += ba["us"] if ba else t_sg
            out[f"{B}_{lab}"] = row
        print(f"B={B} totals (serial, us):", {k: round(v, 1) for k, v in tot.items()}, flush=True)
    # torch for reference
    try:
        import torch
        for B in (128, 2048):
            s = 0
            for (lab, m, n, k, ta, tb) in shapes(B):
                a = torch.rand(*((k, m) if ta else (m, k)), device="cuda"); b = torch.rand(*((n, k) if tb else (k, n)), device="cuda")
                A = a.t() if ta else a; Bm = b.t() if tb else b
                o = torch.empty(m, n, device="cuda")
                torch.mm(A, Bm, out=o); torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                s_ = torch.cuda.Stream()
                with torch.cuda.stream(s_):
                    torch.mm(A, Bm, out=o)
                torch.cuda.synchronize()
                with torch.cuda.graph(g):
                    for _ in range(REPS): torch.mm(A, Bm, out=o)
                g.replay(); torch.cuda.synchronize()
                e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
                best = 1e9
                for _ in range(5):
                    e0.record(); g.replay(); e1.record(); e1.synchronize(); best = min(best, e0.elapsed_time(e1) * 1000 / REPS)
                s += best
                print(f"torch B={B} {lab} {best:.2f}", flush=True)
            print(f"torch B={B} total {s:.1f}")
    except Exception as e:
        print("torch ref failed", e)
    json.dump(out, open(sys.argv[1], "w"), indent=1)



if __name__ == "__main__":
    main()
