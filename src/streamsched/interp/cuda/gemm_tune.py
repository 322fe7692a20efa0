"""GEMM algorithms chosen by measurement: cuBLASLt's candidates for one problem, each timed on the
device, the choice kept for the rest of the process.

cuBLAS picks a GEMM algorithm by a heuristic, without running anything.  For the small and skinny
products of a training step (batch 128 against 1024 features; a 10-column classifier) its first
choice is often not the fastest: on the H200, the input gradient of a 1024x10 layer at batch 2048
(`dz [2048, 10] @ w^T`) takes 28.7 us with cuBLAS's choice and 7.5 us with the fastest of
cuBLASLt's other candidates; the eight GEMMs of the MLP 784-1024-1024-10 step take 493.7 us one
after another at batch 2048 and 470.4 us tuned (80.4 and 71.7 at batch 128).  This is what
PyTorch's `torch.compile(mode="max-autotune")` does for its own GEMM templates.

How a choice is made (`choose`):

- The candidates are cuBLASLt's heuristic list (`cublasLtMatmulAlgoGetHeuristic`, up to
  `CANDIDATES`), asked for the problem's layouts, epilogue, the stream workspace's size and
  16-byte operand alignment, and **restricted to deterministic reductions**: split-K only with a
  separate reduction (`CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE` / `OUTPUT_TYPE`), never the in-place
  reduction, so a chosen algorithm gives bitwise the same result every time it runs.
- Each candidate is captured `REPS` times into a CUDA graph on a private stream, on scratch
  outputs (nothing the program holds is written), and the graph is replayed `ROUNDS` times; its
  time is the best round's mean.  A candidate cuBLASLt refuses is skipped.
- The choice is the first candidate in the heuristic's order whose time is within `MARGIN` of the
  fastest: a near-tie keeps the heuristic's own order, so timing noise rarely changes a choice.
- A choice is made once per problem and process (device, dtype, compute type, m, n, k, the
  transposes, the epilogue) and used for every later call with that problem, on every stream, in
  eager runs and in captures alike: one problem is always one algorithm in a process.
- No timing happens while the calling stream is being captured (a capture must not synchronize):
  a problem first met inside a capture takes the heuristic's first candidate, and keeps it.

Which problems are timed (`STREAMSCHED_GEMM_TUNE`):

- `epilogues` (the default): the GEMMs with a fused epilogue (bias + ReLU / GELU forward, the
  backward epilogues when they are on).  Plain GEMMs (`matmul`, the convolutions' GEMMs) take
  the heuristic's first candidate.  Why: a candidate's time alone ranks it well for a GEMM that
  runs alone, as the forward's chain of layers does, but not for the backward's GEMMs, which a
  multi-stream step runs beside each other (dW beside dX).  Measured on the H200
  (mlp784, `benchmarks/step_time.py`, step us, untimed / epilogues / all): batch 128
  112.0 / 106.3 / 100.3-109.6, batch 2048 545.5 / 543.1 / 559.8-564.1.  At batch 2048 "all"
  changed one choice, the classifier's input gradient (21 us faster alone), and the step was
  18 us slower.
- `all`: every problem, plain GEMMs too.
- `0`: none: every problem takes cuBLASLt's first candidate (the heuristic's own choice).
- Also accepted: `1` and an empty value (`epilogues`).  Any other value is refused: `mode()`
  raises ValueError, and `streamsched run` / `train()` report X004 before any work.

Choices are per process: two processes may choose differently where two candidates are within
noise of each other, and their results may then differ in the last bits; with the timing off,
runs are reproducible across processes.  Within a process one problem is one algorithm, so the
metamorphic properties (any placement or barrier policy gives bitwise the same parameters) hold.

Source: the cuBLASLt API reference (cublasLtMatmulAlgoGetHeuristic, cublasLtMatmulPreference
attributes, cublasLtReductionScheme_t), CUDA Programming Guide on stream capture modes.
"""

from __future__ import annotations


from typing import Any, Callable, Sequence

import numpy as np

from streamsched.interp.env_choice import EnvChoice

CANDIDATES = 16
"""How many of cuBLASLt's heuristic candidates are timed."""
REPS = 10
"""Launches of one candidate per captured timing graph."""
ROUNDS = 3
"""Replays of each timing graph; the best round counts."""
MARGIN = 0.03
"""A candidate earlier in the heuristic's order wins when at most this much slower (relative)."""
DETERMINISTIC_REDUCTIONS = 0 | 2 | 4
"""CUBLASLT_REDUCTION_SCHEME_NONE | COMPUTE_TYPE | OUTPUT_TYPE: no in-place (atomic) split-K."""

_CHOICES: dict[tuple, np.ndarray] = {}
"""problem -> the chosen cublasLtMatmulAlgo_t (8 uint64 words), for the rest of the process."""
_TIMES: dict[tuple, list] = {}
"""problem -> [(heuristic index, us or None)] of the timed candidates (for benchmarks and tests)."""

_HEUR = np.dtype([("algo", np.uint64, (8,)), ("workspace_size", np.uint64), ("state", np.int32),
                  ("waves", np.float32), ("reserved", np.int32, (4,))])
"""cublasLtMatmulHeuristicResult_t."""


TUNE_MODES = ("0", "epilogues", "all")
TUNE_ENV = "STREAMSCHED_GEMM_TUNE"
TUNE = EnvChoice(TUNE_ENV, TUNE_MODES, "epilogues", {"1": "epilogues"})
"""STREAMSCHED_GEMM_TUNE: time no problem, the epilogue GEMMs' problems (the default), or all;
`1` and an empty value are read as `epilogues` (case and surrounding spaces are ignored); any
other value is refused."""


def mode_error(value: str | None) -> str:
    """Why `value` is not a STREAMSCHED_GEMM_TUNE value, or '' when it is one (None or empty:
    unset)."""
    return TUNE.error(value)


def mode() -> str:
    """STREAMSCHED_GEMM_TUNE as one of TUNE_MODES (unset: "epilogues"); ValueError for any other
    value (`streamsched run` and `train()` refuse it first, with X004)."""
    return TUNE.get()


def enabled(kind: str = "plain") -> bool:
    """Whether problems of `kind` ("plain" for ctx.gemm, else an epilogue name) are timed."""
    m = mode()
    return m == "all" or (m == "epilogues" and kind != "plain")


def preference(lt, ws_bytes: int) -> int:
    """A cublasLtMatmulPreference_t: at most `ws_bytes` of workspace, operands 16-byte aligned,
    deterministic reductions only.  The caller destroys it (lt.matmul_preference_destroy)."""
    pref = lt.matmul_preference_create()
    P = lt.MatmulPreferenceAttribute

    def put(name, value):
        attr = getattr(P, name)
        get = getattr(lt, "get_matmul_preference_attribute_dtype", None)
        buf = np.array([value], dtype=get(attr) if get is not None else np.uint64)
        lt.matmul_preference_set_attribute(pref, int(attr), buf.ctypes.data, buf.itemsize)

    try:
        put("MAX_WORKSPACE_BYTES", ws_bytes)
        # The heuristic assumes 256-byte aligned operands unless told: an algorithm chosen for a
        # 256-byte aligned allocation faulted intermittently on the H200 with a less aligned one,
        # and a choice that depends on where the allocator put the arrays is not reproducible.
        for name in ("MIN_ALIGNMENT_A_BYTES", "MIN_ALIGNMENT_B_BYTES", "MIN_ALIGNMENT_C_BYTES",
                     "MIN_ALIGNMENT_D_BYTES"):
            if hasattr(P, name):
                put(name, 16)
        if hasattr(P, "REDUCTION_SCHEME_MASK"):
            put("REDUCTION_SCHEME_MASK", DETERMINISTIC_REDUCTIONS)
    except BaseException:
        lt.matmul_preference_destroy(pref)
        raise
    return pref


def candidates(lt, handle: int, desc: int, la: int, lb: int, ld: int, ws_bytes: int,
               count: int = CANDIDATES) -> list[np.ndarray]:
    """cuBLASLt's heuristic candidates for D = op(A) op(B) (C = D, layouts la, lb, ld), best
    first; RuntimeError when there is none."""
    pref = preference(lt, ws_bytes)
    try:
        res = np.zeros((count,), dtype=_HEUR)
        got = np.zeros((1,), np.int32)
        lt.matmul_algo_get_heuristic(handle, desc, la, lb, ld, ld, pref, count, res.ctypes.data,
                                     got.ctypes.data)
    finally:
        lt.matmul_preference_destroy(pref)
    out = [np.ascontiguousarray(r["algo"]) for r in res[:int(got[0])] if int(r["state"]) == 0]
    if not out:
        raise RuntimeError("cuBLASLt has no algorithm for this problem")
    return out


def capturing(stream_ptr: int) -> bool:
    """Whether `stream_ptr` is being captured (cudaStreamIsCapturing); True when unsure."""
    try:
        from cuda.bindings import runtime as rt

        status = _ok(rt.cudaStreamIsCapturing(stream_ptr), "cudaStreamIsCapturing")
    except Exception:
        return True
    return int(status) != int(rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone)


def may_time(stream_ptr: int, kind: str = "plain") -> bool:
    """Whether a new problem of `kind` met on `stream_ptr` is timed now: tuning is on for its kind
    and the stream is not being captured (the caller then allocates its scratch outputs and passes
    `run` to `choose`)."""
    return enabled(kind) and not capturing(stream_ptr)


def choose(ctx, key: tuple, cands: Sequence[np.ndarray],
           run: Callable[[np.ndarray, int, int, int], None] | None,
           stream_ptr: int, ws_bytes: int) -> np.ndarray:
    """The algorithm for problem `key` (made once per process; see the module docstring).

    cands: `candidates(...)`, best first.  run(algo, stream_ptr, ws_ptr, ws_bytes) issues one
    cublasLtMatmul of the problem with `algo` on scratch outputs; None: no timing, the first
    candidate.  stream_ptr: the stream the caller is about to issue on (no timing while it is
    being captured)."""
    got = _CHOICES.get(key)
    if got is not None:
        return got
    if run is None or len(cands) == 1 or not enabled(key[1]) or capturing(stream_ptr):
        choice = cands[0]
    else:
        choice = _timed(ctx, key, cands, run, ws_bytes)
    _CHOICES[key] = choice
    return choice


def _timed(ctx, key, cands, run, ws_bytes) -> np.ndarray:
    cp = ctx.cp
    st = ctx.tune_stream()
    ws = cp.empty((max(int(ws_bytes), 1),), dtype=cp.uint8)
    wp, sp = int(ws.data.ptr), int(st.ptr)  # ws (scratch workspace) lives until the timing is done
    times: list[tuple[int, float | None]] = []
    for i, algo in enumerate(cands):
        try:
            times.append((i, _graph_us(cp, st, lambda a=algo: run(a, sp, wp, ws_bytes))))
        except Exception:  # a candidate the library refuses at run time: skipped
            times.append((i, None))
    st.synchronize()
    _TIMES[key] = times
    ok = [(i, t) for i, t in times if t is not None]
    if not ok:
        return cands[0]
    best = min(t for _, t in ok)
    for i, t in ok:  # heuristic order
        if t <= best * (1.0 + MARGIN):
            return cands[i]
    return cands[ok[0][0]]  # pragma: no cover


def _graph_us(cp, st, issue: Callable[[], None]) -> float:
    """Mean device time (us) of one `issue()`, from REPS of them captured into one graph on stream
    `st` (relaxed mode: the caller's streams are not capturing) and replayed ROUNDS times."""
    from cuda.bindings import runtime as rt

    check = _ok
    sp = int(st.ptr)
    issue()  # once eagerly: lazy library set-up happens outside the capture
    st.synchronize()
    check(rt.cudaStreamBeginCapture(sp, rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed),
          "cudaStreamBeginCapture (GEMM tuning)")
    failed = None
    try:
        for _ in range(REPS):
            issue()
    except Exception as exc:
        failed = exc
    g = check(rt.cudaStreamEndCapture(sp), "cudaStreamEndCapture (GEMM tuning)")
    if failed is not None:
        rt.cudaGraphDestroy(g)
        raise failed
    try:
        ge = check(rt.cudaGraphInstantiate(g, 0), "cudaGraphInstantiate (GEMM tuning)")
        try:
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            check(rt.cudaGraphLaunch(ge, sp), "cudaGraphLaunch (GEMM tuning)")  # upload, warm
            best = float("inf")
            for _ in range(ROUNDS):
                e0.record(st)
                check(rt.cudaGraphLaunch(ge, sp), "cudaGraphLaunch (GEMM tuning)")
                e1.record(st)
                e1.synchronize()
                best = min(best, cp.cuda.get_elapsed_time(e0, e1) * 1000.0 / REPS)
        finally:
            rt.cudaGraphExecDestroy(ge)
    finally:
        rt.cudaGraphDestroy(g)
    return best


def _ok(result, what: str):
    """The value of a cuda.bindings call `(err, value)`; RuntimeError naming `what` on an error
    (this module is a leaf: device.check would make an import cycle through device.gemm)."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed with cudaError {int(err)}")
    return rest[0] if len(rest) == 1 else (tuple(rest) or None)


def timings() -> dict[tuple, list]:
    """The timed problems of this process: key -> [(heuristic index, us or None)]."""
    return dict(_TIMES)


def forget() -> None:
    """Drop every choice (tests; a later problem is timed again)."""
    _CHOICES.clear()
    _TIMES.clear()


def problem_key(ctx, kind: str, dtype: str, compute: int, m: int, n: int, k: int, ta: bool, tb: bool,
                *extra: Any) -> tuple:
    """The key of one problem: what makes two calls the same GEMM to cuBLASLt."""
    return (int(getattr(ctx, "device_id", 0)), kind, dtype, int(compute), int(m), int(n), int(k), bool(ta), bool(tb)) + extra
