"""The CUDA device side of the CUDA backend: one non-blocking stream, one cuBLAS handle and one
fixed workspace per declared stream, pre-created events, pinned host memory, captured-safe
copies, and read-back of captured graphs (CUDA_PITFALLS.md rules 1-3, 8, 11, 18, 23).

CuPy, nvmath-python and cuda-python are imported lazily, on first use, so that importing this
module never needs a GPU.  Every cuda.bindings call goes through `check`, since those calls
return error codes instead of raising (pitfall 23).
"""

from __future__ import annotations

import os

from typing import Any, Sequence

WORKSPACE_BYTES = 32 << 20
"""cuBLAS workspace per stream: set once before any capture, so captured GEMMs allocate nothing
(pitfall 2: without it cuBLAS puts MemAlloc/MemFree nodes into the graph)."""

# cudaDataType_t values (library_types.h); nvmath's bindings take plain ints.
_CUDA_R_16F, _CUDA_R_32F = 2, 0
_LT_DTYPE = {"float32": 0, "float64": 1}
_LT_COMPUTE = {"float32": 68, "float64": 70}  # CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F
_LT_TF32 = 77  # CUBLAS_COMPUTE_32F_FAST_TF32


class CudaError(RuntimeError):
    """A CUDA runtime call (through cuda.bindings) returned an error code."""


def cupy_module():
    """CuPy, imported on first use (never at import time of streamsched)."""
    import cupy

    return cupy


def cudart():
    """cuda.bindings.runtime, imported on first use."""
    from cuda.bindings import runtime

    return runtime


def cublas():
    """nvmath-python's cuBLAS bindings, imported on first use."""
    from nvmath.bindings import cublas as _cublas

    return _cublas


def check(result: Any, what: str = "CUDA call") -> Any:
    """Raise CudaError unless `result` (a cuda.bindings return value: an error code, or a tuple
    whose first element is one) is success; return the remaining values (None, one value, or a
    tuple of them)."""
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    code = int(err)
    if code != 0:
        rt = cudart()
        try:
            name = rt.cudaGetErrorName(err)[1]
            text = rt.cudaGetErrorString(err)[1]
            name = name.decode() if isinstance(name, bytes) else str(name)
            text = text.decode() if isinstance(text, bytes) else str(text)
        except Exception:  # pragma: no cover - the error is what matters
            name, text = str(err), ""
        raise CudaError(f"{what} failed: {name} ({code}): {text}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


_H2D_SOURCE = r"""
// dst[0..n) = src[0..n) bytes, src in page-locked host memory read over the bus (16-byte words
// where both are aligned), a grid-stride loop
extern "C" __global__ void ss_h2d(const unsigned char* src, unsigned char* dst, long long n) {
    long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long step = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if ((((unsigned long long)src | (unsigned long long)dst) & 15ull) == 0) {
        long long n16 = n >> 4;
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (long long i = tid; i < n16; i += step) d[i] = s[i];
        done = n16 << 4;
    }
    for (long long i = done + tid; i < n; i += step) dst[i] = src[i];
}
"""
H2D_KERNEL_MAX = 1 << 20
"""Host-to-device copies up to this many bytes run as a zero-copy kernel (`DeviceContext.h2d`)."""


H2D_BLOCKS = 64
"""At most this many 256-thread blocks read a zero-copy upload (a grid-stride loop)."""
H2D_BYTES_PER_BLOCK = 100 * 1024
"""A zero-copy upload takes one 256-thread block per this many bytes (at least one, at most
H2D_BLOCKS).  The upload of the next batch runs beside the step's first GEMMs, and its blocks
take their multiprocessors: on the H100 (2026-12-05) the batch-128 MLP step (a 401 KB upload)
took 101.3 us with 64 blocks, 97.7-98.4 with 4 or 2, and 130 with 1, where the upload no longer
kept up with the step (benchmarks/results/h200.json `session20_h100.h2d_blocks`)."""


def _h2d_kernel_max() -> int:
    v = os.environ.get("STREAMSCHED_H2D_KERNEL_MAX")
    try:
        return H2D_KERNEL_MAX if v is None else max(0, int(v))
    except ValueError:
        return H2D_KERNEL_MAX


def mapped_pinned(nbytes: int):
    """(view, device_ptr, owner): a zeroed NumPy uint8 array of `nbytes` in page-locked host
    memory mapped into the device's address space (cudaHostAlloc with cudaHostAllocMapped |
    cudaHostAllocPortable), the pointer a kernel writes it through (cudaHostGetDevicePointer;
    the host pointer itself under unified addressing), and the allocation to keep alive as long
    as any kernel or graph may write it.  Source: CUDA Programming Guide, "Mapped Memory"."""
    import ctypes

    import numpy as np

    cp = cupy_module()
    n = max(int(nbytes), 8)
    mem = cp.cuda.PinnedMemory(n, 0x02 | 0x01)  # cudaHostAllocMapped | cudaHostAllocPortable
    ptr = int(mem.ptr)
    view = np.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=np.uint8)
    view[:] = 0
    dev = check(cudart().cudaHostGetDevicePointer(ptr, 0), "cudaHostGetDevicePointer")
    return view, int(dev), mem


class DeviceContext:
    """Streams, cuBLAS handles, workspaces and helpers for one GPU.

    streams: the declared stream names (never `host`); each gets its own
    `cupy.cuda.Stream(non_blocking=True)`, so the legacy default stream is never touched
    (pitfall 18), and its own cuBLAS handle bound to it with a `workspace_bytes` workspace.
    `tf32=True` lets cuBLAS use TF32 tensor cores for fp32 GEMMs (off by default: results then
    match NumPy to about 1e-6 relative).
    """

    def __init__(self, streams: Sequence[str], *, workspace_bytes: int = WORKSPACE_BYTES,
                 device: int | None = None, tf32: bool = False):
        cp = cupy_module()
        self.cp = cp
        if device is not None:
            cp.cuda.Device(device).use()
        self.device_id = cp.cuda.runtime.getDevice()
        names = tuple(dict.fromkeys(s for s in streams if s != "host"))
        if not names:
            raise ValueError("DeviceContext needs at least one device stream")
        self.names = names
        self.streams: dict[str, Any] = {n: cp.cuda.Stream(non_blocking=True) for n in names}
        self.workspace_bytes = int(workspace_bytes)
        self.workspaces: dict[str, Any] = {}
        self.handles: dict[str, int] = {}
        self._consts: dict[tuple[str, float], Any] = {}
        self.lt_handles: dict[str, int] = {}
        self.lt_workspaces: dict[str, Any] = {}
        self._tf32 = tf32
        self._closed = False
        self._h2d_fn = None
        self._lt_gemms: dict[tuple, Any] = {}
        self._tune_stream = None
        self.close_hooks: list = []
        """Callables hook(ctx) run by close(): what kernels cached for this context drops
        (stdlib/kernels/gemm.py registers its cuBLASLt plans' forget_context)."""

    # -- streams ------------------------------------------------------------------------------

    def stream(self, s: Any):
        """The CuPy stream for a stream name (a Stream object passes through)."""
        if isinstance(s, str):
            try:
                return self.streams[s]
            except KeyError:
                raise KeyError(f"unknown stream {s!r}; declared: {', '.join(self.names)}") from None
        return s

    def stream_ptr(self, s: Any) -> int:
        return int(self.stream(s).ptr)

    def synchronize(self) -> None:
        """Wait for every stream of this context."""
        for st in self.streams.values():
            st.synchronize()

    def device_synchronize(self) -> None:
        self.cp.cuda.runtime.deviceSynchronize()

    # -- events and host memory ---------------------------------------------------------------

    def make_events(self, n: int) -> list[Any]:
        """n events, created now (before any capture), timing disabled."""
        return [self.cp.cuda.Event(disable_timing=True) for _ in range(n)]

    def pinned_zeros(self, nbytes: int):
        """A zeroed NumPy uint8 array in page-locked host memory; keep it alive as long as any
        graph that copies from or to it may run (pitfall 10)."""
        import cupyx

        return cupyx.zeros_pinned((max(int(nbytes), 1),), dtype="uint8")

    # -- cuBLAS -------------------------------------------------------------------------------

    def handle(self, s: str) -> int:
        """The cuBLAS handle of stream `s`, created on first use with its stream and workspace
        set; call `init_blas()` before any capture so that creation never happens inside one."""
        h = self.handles.get(s)
        if h is None:
            self.init_blas((s,))
            h = self.handles[s]
        return h

    def init_blas(self, names: Sequence[str] | None = None) -> None:
        """Create the cuBLAS handle, set stream and workspace, for each of `names` (all streams
        by default).  Must run outside any capture."""
        cb = cublas()
        for s in names or self.names:
            if s in self.handles:
                continue
            st = self.stream(s)
            h = cb.create()
            try:
                cb.set_stream(h, int(st.ptr))
                ws = self.cp.empty((self.workspace_bytes,), dtype=self.cp.uint8)
                cb.set_workspace(h, int(ws.data.ptr), self.workspace_bytes)
                cb.set_pointer_mode(h, int(cb.PointerMode.HOST))
                if self._tf32:
                    cb.set_math_mode(h, int(cb.Math.TF32_TENSOR_OP_MATH))
            except Exception:
                cb.destroy(h)
                raise
            self.workspaces[s] = ws
            self.handles[s] = h
        for s in names or self.names:
            try:
                self.lt_handle(s)  # the cuBLASLt handle and workspace too (ctx.gemm's path)
            except Exception:  # no usable cuBLASLt: gemm runs cublas<t>gemm, the epilogues unfused
                break

    def lt_handle(self, s: str) -> tuple[int, int, int]:
        """(cuBLASLt handle, workspace pointer, workspace bytes) of stream `s`, created on first use
        (nvmath-python's cublasLt bindings; ImportError when they are missing).  A cuBLASLt call
        takes its stream and workspace per call, so the handle is the stream's own only by
        convention; create it outside any capture (the twins that use it do, when they are bound)."""
        h = self.lt_handles.get(s)
        if h is None:
            from nvmath.bindings import cublasLt as lt

            self.stream(s)  # a known stream
            h = lt.create()
            # the stream's cuBLAS workspace when it has one: both libraries' calls on one stream
            # run one after another (in stream order, or along a captured graph's edges)
            ws = self.workspaces.get(s)
            self.lt_workspaces[s] = ws if ws is not None else self.cp.empty((self.workspace_bytes,), dtype=self.cp.uint8)
            self.lt_handles[s] = h
        ws = self.lt_workspaces[s]
        return h, int(ws.data.ptr), self.workspace_bytes

    def _const(self, dtype: str, value: float) -> int:
        """Host pointer to a constant alpha/beta kept alive by the context (host pointer mode:
        cuBLAS reads it when the call is made, so under capture it is frozen - fine for
        constants, never used for step-varying scalars: pitfall 3)."""
        import numpy as np

        key = (dtype, float(value))
        arr = self._consts.get(key)
        if arr is None:
            arr = np.array([value], dtype=dtype)
            self._consts[key] = arr
        return int(arr.ctypes.data)

    def gemm(self, stream: Any, a, b, c, ta: bool = False, tb: bool = False,
             alpha: float = 1.0, beta: float = 0.0) -> None:
        """c = alpha * op(a) @ op(b) + beta * c for row-major, C-contiguous 2-D CuPy arrays, on
        `stream`'s own cuBLAS handle.

        cuBLAS is column-major: a row-major [r, s] matrix is its column-major transpose, so
        row-major C = op(A) op(B) is computed as column-major C^T = op(B)^T op(A)^T, i.e.
        gemm(opB, opA, n, m, k, B, ldb = cols(b), A, lda = cols(a), C, ldc = n)."""
        name = stream if isinstance(stream, str) else self._name_of(stream)
        if a.ndim != 2 or b.ndim != 2 or c.ndim != 2:
            raise ValueError(f"gemm: 2-D operands only, got {a.shape} {b.shape} {c.shape}")
        for nm, x in (("a", a), ("b", b), ("c", c)):
            if not x.flags.c_contiguous:
                raise ValueError(f"gemm: {nm} must be C-contiguous")
        m, k = (a.shape[1], a.shape[0]) if ta else a.shape
        k2, n = (b.shape[1], b.shape[0]) if tb else b.shape
        if k != k2 or c.shape != (m, n):
            raise ValueError(f"gemm: shapes do not fit: op(a) {m}x{k}, op(b) {k2}x{n}, c {c.shape}")
        cp = self.cp
        if cp.may_share_memory(c, a) or cp.may_share_memory(c, b):
            # cuBLAS reads while it writes: an aliased output would be garbage.
            raise ValueError("gemm: the output shares memory with an input")
        if m == 0 or n == 0:
            return
        if k == 0:
            with self.stream(stream):
                c.fill(0)
            return
        if a.dtype == b.dtype == c.dtype and str(a.dtype) in _LT_COMPUTE and \
                self._lt_gemm(name, a, b, c, m, n, k, ta, tb, alpha, beta):
            return
        cb = cublas()
        h = self.handle(name)
        opa = int(cb.Operation.T if ta else cb.Operation.N)
        opb = int(cb.Operation.T if tb else cb.Operation.N)
        lda, ldb = a.shape[1], b.shape[1]
        dt = a.dtype
        if dt != b.dtype or dt != c.dtype:
            raise ValueError(f"gemm: dtypes differ: {a.dtype} {b.dtype} {c.dtype}")
        if dt == cp.float32:
            cb.sgemm(h, opb, opa, n, m, k, self._const("float32", alpha), b.data.ptr, ldb,
                     a.data.ptr, lda, self._const("float32", beta), c.data.ptr, n)
        elif dt == cp.float64:
            cb.dgemm(h, opb, opa, n, m, k, self._const("float64", alpha), b.data.ptr, ldb,
                     a.data.ptr, lda, self._const("float64", beta), c.data.ptr, n)
        elif dt == cp.float16:
            # fp16 storage, fp32 compute (alpha/beta are floats for sgemmEx).
            cb.sgemm_ex(h, opb, opa, n, m, k, self._const("float32", alpha), b.data.ptr,
                        _CUDA_R_16F, ldb, a.data.ptr, _CUDA_R_16F, lda,
                        self._const("float32", beta), c.data.ptr, _CUDA_R_16F, n)
        else:
            raise NotImplementedError(f"gemm: dtype {dt} is not supported")

    def _lt_gemm(self, name: str, a, b, c, m: int, n: int, k: int, ta: bool, tb: bool,
                 alpha: float, beta: float) -> bool:
        """`gemm` through cuBLASLt with the algorithm `gemm_tune.choose` made for this problem
        (timed once per process, outside captures); False (the caller runs cublas<t>gemm) when
        cuBLASLt is missing or refuses the problem, or an operand is not 16-byte aligned (what the
        algorithms were chosen for).  Layouts as in `gemm`: row-major C = op(A) op(B) is
        column-major C^T = op(B)^T op(A)^T, so cuBLASLt's A is `b` (transposed when tb) and its B
        is `a` (transposed when ta)."""
        if (a.data.ptr | b.data.ptr | c.data.ptr) % 16:
            return False
        dt = str(a.dtype)
        key = (dt, m, n, k, ta, tb)
        plan = self._lt_gemms.get(key, False)
        if plan is False:
            plan = self._lt_gemm_plan(name, dt, m, n, k, ta, tb, a, b)
            self._lt_gemms[key] = plan
        if plan is None:
            return False
        lt, desc, la, lb, ld, cands, pkey = plan
        handle, ws_ptr, ws_bytes = self.lt_handle(name)
        sp = int(self.stream(name).ptr)

        def make_run():
            scratch = self.cp.empty((m, n), dtype=c.dtype)  # tuning writes here, never into c
            one, zero, d = self._const(dt, 1.0), self._const(dt, 0.0), scratch.data.ptr

            def run(al, stream_ptr, wp, wb):
                lt.matmul(handle, desc, one, b.data.ptr, la, a.data.ptr, lb, zero, d, ld, d, ld,
                          al.ctypes.data, wp, wb, stream_ptr)

            held = [scratch]
            return run, held.clear  # release: drops the last reference to scratch

        algo = self.lt_algo(pkey, cands, name, ws_bytes, make_run)
        lt.matmul(handle, desc, self._const(dt, alpha), b.data.ptr, la, a.data.ptr, lb,
                  self._const(dt, beta), c.data.ptr, ld, c.data.ptr, ld, algo.ctypes.data, ws_ptr,
                  ws_bytes, sp)
        return True

    def _lt_gemm_plan(self, name, dt, m, n, k, ta, tb, a, b):
        """(lt, desc, la, lb, ld, candidates, problem key) of one plain GEMM problem, or None."""
        try:
            from nvmath.bindings import cublasLt as lt
        except ImportError:
            return None
        import numpy as np

        r = _LT_DTYPE[dt]
        compute = _LT_TF32 if (self._tf32 and dt == "float32") else _LT_COMPUTE[dt]
        made = []
        desc = None
        try:
            handle, _, ws_bytes = self.lt_handle(name)
            desc = lt.matmul_desc_create(compute, r)
            for attr, v in ((lt.MatmulDescAttribute.TRANSA, 1 if tb else 0),
                            (lt.MatmulDescAttribute.TRANSB, 1 if ta else 0)):
                buf = np.array([v], dtype=np.int32)
                lt.matmul_desc_set_attribute(desc, int(attr), buf.ctypes.data, buf.itemsize)
            br, bc = b.shape  # row-major [br, bc] is column-major [bc, br], ld bc
            ar, ac = a.shape
            la = lt.matrix_layout_create(r, bc, br, bc)
            made.append(la)
            lb = lt.matrix_layout_create(r, ac, ar, ac)
            made.append(lb)
            ld = lt.matrix_layout_create(r, n, m, n)
            made.append(ld)
            cands = self.lt_candidates(lt, handle, desc, la, lb, ld, ws_bytes)
        except Exception:
            for h in made:
                lt.matrix_layout_destroy(h)
            if desc is not None:
                lt.matmul_desc_destroy(desc)
            return None
        return (lt, desc, la, lb, ld, cands, self.lt_problem_key("plain", dt, compute, m, n, k, ta, tb, ws_bytes))

    def lt_candidates(self, lt, handle: int, desc: int, la: int, lb: int, ld: int, ws_bytes: int) -> list:
        """cuBLASLt's heuristic candidates for one problem, best first (gemm_tune.candidates:
        deterministic reductions, 16-byte alignment, at most `ws_bytes` of workspace)."""
        from streamsched.interp.cuda import gemm_tune

        return gemm_tune.candidates(lt, handle, desc, la, lb, ld, ws_bytes)

    def lt_problem_key(self, kind: str, dtype: str, compute: int, m: int, n: int, k: int, ta: bool,
                       tb: bool, *extra) -> tuple:
        """gemm_tune.problem_key on this context's device."""
        from streamsched.interp.cuda import gemm_tune

        return gemm_tune.problem_key(self, kind, dtype, compute, m, n, k, ta, tb, *extra)

    def lt_algo(self, key: tuple, cands: list, stream: Any, ws_bytes: int, make_run) -> Any:
        """The algorithm of problem `key` (gemm_tune.choose: made once per process, by timing when
        the problem's kind is timed and `stream` is not being captured).  make_run() -> (run,
        release): called only when the candidates are timed now; run(algo, stream_ptr, ws_ptr,
        ws_bytes) issues the problem on scratch outputs, release() (called once the timing has
        synchronized) frees what run needed."""
        from streamsched.interp.cuda import gemm_tune

        algo = gemm_tune._CHOICES.get(key)
        if algo is not None:
            return algo
        sp = self.stream_ptr(stream)
        if not gemm_tune.may_time(sp, key[1]):
            return gemm_tune.choose(self, key, cands, None, sp, ws_bytes)
        run, release = make_run()
        try:
            return gemm_tune.choose(self, key, cands, run, sp, ws_bytes)
        finally:
            release()

    def tune_stream(self):
        """A private non-blocking stream for timing GEMM candidates (gemm_tune)."""
        if self._tune_stream is None:
            self._tune_stream = self.cp.cuda.Stream(non_blocking=True)
        return self._tune_stream

    def _name_of(self, st) -> str:
        for n, s in self.streams.items():
            if s is st:
                return n
        raise KeyError("gemm: the stream is not one of this context's streams")

    # -- copies -------------------------------------------------------------------------------

    def memcpy(self, stream: Any, dst, src) -> None:
        """Copy src to dst (same byte size; CuPy device arrays or NumPy pinned arrays, any
        direction) with cudaMemcpyAsync on `stream`.  CuPy refuses host<->device copies during
        capture (pitfall 8), this call is captured as a memcpy node.  Host memory must be pinned
        (pitfall 11); a captured copy reads the host buffer when it runs (pitfall 9)."""
        n_dst, n_src = int(dst.nbytes), int(src.nbytes)
        if n_dst != n_src:
            raise ValueError(f"memcpy: sizes differ ({n_src} -> {n_dst} bytes)")
        if n_dst == 0:
            return
        rt = cudart()
        d_dev, s_dev = _is_device(dst), _is_device(src)
        for nm, x in (("dst", dst), ("src", src)):
            if not x.flags.c_contiguous:
                raise ValueError(f"memcpy: {nm} must be C-contiguous")
        kinds = rt.cudaMemcpyKind
        kind = {
            (True, False): kinds.cudaMemcpyHostToDevice,
            (False, True): kinds.cudaMemcpyDeviceToHost,
            (True, True): kinds.cudaMemcpyDeviceToDevice,
            (False, False): kinds.cudaMemcpyHostToHost,
        }[(d_dev, s_dev)]
        check(rt.cudaMemcpyAsync(_ptr(dst), _ptr(src), n_dst, kind, self.stream_ptr(stream)),
              "cudaMemcpyAsync")

    def h2d(self, stream: Any, dst, src) -> None:
        """Copy the pinned host array src to the device array dst on `stream`.  Up to
        H2D_KERNEL_MAX bytes (environment STREAMSCHED_H2D_KERNEL_MAX; 0: never) a kernel reads
        the page-locked source directly (zero-copy: under unified addressing every cudaHostAlloc
        buffer is device-accessible at its host address, CUDA Programming Guide, "Unified
        Virtual Address Space"), so a captured step holds a kernel node, not a host memcpy
        node, whose launches cost the host more; larger copies stay on the copy engine
        (`memcpy`).  Either reads the host buffer when it runs, not at launch."""
        n = int(dst.nbytes)
        if _is_device(src) or not _is_device(dst) or n != int(src.nbytes) or n == 0 or n > _h2d_kernel_max() \
                or not src.flags.c_contiguous or not dst.flags.c_contiguous or not _page_locked(_ptr(src)):
            self.memcpy(stream, dst, src)
            return
        import numpy as np

        fn = self._h2d_fn
        if fn is None:
            fn = self._h2d_fn = self.cp.RawKernel(_H2D_SOURCE, "ss_h2d")
        blocks = max(1, min(H2D_BLOCKS, -(-n // H2D_BYTES_PER_BLOCK), (n // 16 + 255) // 256))
        with self.stream(stream):
            fn((blocks,), (256,), (np.uint64(_ptr(src)), dst, np.int64(n)))

    d2h = memcpy

    # -- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the cuBLAS handles (after synchronizing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
        finally:
            for hook in self.close_hooks:  # e.g. the GEMM epilogues' plans of this context
                hook(self)
            if self.handles:
                cb = cublas()
                for h in self.handles.values():
                    try:
                        cb.destroy(h)
                    except Exception:  # pragma: no cover
                        pass
            self.handles.clear()
            for plan in self._lt_gemms.values():
                if plan:
                    lt_, desc, la, lb, ld = plan[:5]
                    for h in (la, lb, ld):
                        lt_.matrix_layout_destroy(h)
                    lt_.matmul_desc_destroy(desc)
            self._lt_gemms.clear()
            if self.lt_handles:
                from nvmath.bindings import cublasLt as lt

                for h in self.lt_handles.values():
                    try:
                        lt.destroy(h)
                    except Exception:  # pragma: no cover
                        pass
            self.lt_handles.clear()


def _is_device(x) -> bool:
    return isinstance(x, cupy_module().ndarray)


def _page_locked(ptr: int) -> bool:
    """Whether host address `ptr` is in page-locked memory CUDA knows (cudaHostAlloc or
    registered: device-accessible); pageable memory is not.  Asked each time (an eager launch or
    a capture, never a graph replay): an address freed and reused may change kind."""
    rt = cudart()
    try:
        attrs = check(rt.cudaPointerGetAttributes(ptr), "cudaPointerGetAttributes")
        return int(attrs.type) == int(rt.cudaMemoryType.cudaMemoryTypeHost)
    except Exception:
        return False


def _ptr(x) -> int:
    if _is_device(x):
        return int(x.data.ptr)
    return int(x.ctypes.data)


# -- captured graphs: read back -----------------------------------------------------------------


def _graph_handle(graph) -> int:
    """The cudaGraph_t of a cupy.cuda.Graph (or an int handle)."""
    h = getattr(graph, "graph", graph)
    return int(h)


def graph_structure(graph) -> tuple[list[int], list[str], list[tuple[int, int]]]:
    """Read a captured graph back: (node handles as ints, in cudaGraphGetNodes order; node type
    names without the cudaGraphNodeType prefix: "Kernel", "Memcpy", "MemAlloc", ...; edges as
    (from handle, to handle)).  Follows the CUDA Runtime API's cudaGraphGetNodes /
    cudaGraphGetEdges / cudaGraphNodeGetType; raises CudaError on a failing call."""
    rt = cudart()
    g = _graph_handle(graph)
    r = check(rt.cudaGraphGetNodes(g, 0), "cudaGraphGetNodes")
    count = r[-1] if isinstance(r, tuple) else r
    nodes: list = []
    if count:
        r = check(rt.cudaGraphGetNodes(g, count), "cudaGraphGetNodes")
        nodes = list(r[0])
    types = []
    for nd in nodes:
        t = check(rt.cudaGraphNodeGetType(nd), "cudaGraphNodeGetType")
        types.append(getattr(t, "name", str(t)).replace("cudaGraphNodeType", ""))
    r = check(rt.cudaGraphGetEdges(g, 0), "cudaGraphGetEdges")
    n_edges = r[-1] if isinstance(r, tuple) else r
    edges: list[tuple[int, int]] = []
    if n_edges:
        r = check(rt.cudaGraphGetEdges(g, n_edges), "cudaGraphGetEdges")
        frm, to = r[0], r[1]  # (from, to[, edgeData], count) across cuda-bindings 12/13
        edges = [(int(a), int(b)) for a, b in zip(frm, to)]
    return [int(n) for n in nodes], types, edges


def graph_nodes_edges(graph) -> tuple[list[str], list[tuple[int, int]]]:
    """Read a captured graph back: (node types, edges), edges as (from, to) indices into the
    node list of `graph_structure`."""
    handles, types, edges = graph_structure(graph)
    index = {h: i for i, h in enumerate(handles)}
    return types, [(index[a], index[b]) for a, b in edges]


def captured_dot(graph, path: str | None = None, verbose: bool = True) -> str:
    """The Graphviz text of a captured graph (cudaGraphDebugDotPrint); also left at `path` when
    one is given."""
    import os
    import tempfile

    rt = cudart()
    flags = 0
    if verbose:
        flags = int(rt.cudaGraphDebugDotFlags.cudaGraphDebugDotFlagsVerbose)
    tmp = None
    if path is None:
        fd, tmp = tempfile.mkstemp(suffix=".dot")
        os.close(fd)
        path = tmp
    try:
        try:
            check(rt.cudaGraphDebugDotPrint(_graph_handle(graph), path.encode(), flags),
                  "cudaGraphDebugDotPrint")
        except TypeError:
            check(rt.cudaGraphDebugDotPrint(_graph_handle(graph), path, flags),
                  "cudaGraphDebugDotPrint")
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    finally:
        if tmp is not None:
            os.unlink(tmp)


# -- kernel priorities (interp/priority.py) ------------------------------------------------------

USE_NODE_PRIORITY = 8
"""cudaGraphInstantiateFlagUseNodePriority: run a graph with its kernel nodes' own priorities
rather than the launch stream's (CUDA Runtime API, cudaGraphInstantiate)."""


def priorities_on() -> bool:
    """Whether captured kernels carry critical-path priorities (interp/priority.py): the
    environment variable STREAMSCHED_PRIORITIES, "slack" (on) or "off" (the default); ValueError
    for another value (`streamsched run` and `train()` refuse it first, with X004)."""
    from streamsched.interp.priority import mode

    return mode() == "slack"


def instantiate_flags() -> int:
    """The flags every streamsched graph is instantiated with: USE_NODE_PRIORITY when
    priorities are on, else 0."""
    return USE_NODE_PRIORITY if priorities_on() else 0


def priority_range() -> tuple[int, int]:
    """(least, greatest) stream priority of the current device (cudaDeviceGetStreamPriorityRange;
    greatest is the numerically lowest, e.g. (0, -5) on the H200)."""
    least, greatest = check(cudart().cudaDeviceGetStreamPriorityRange(), "cudaDeviceGetStreamPriorityRange")
    return int(least), int(greatest)


def level_priority(level: int, levels: int, rng: tuple[int, int]) -> int:
    """The CUDA priority of slack level `level` (0 = most critical) of `levels`, spread over
    `rng` = (least, greatest): level 0 -> greatest, the last level -> least."""
    least, greatest = rng
    if levels <= 1:
        return greatest
    return int(round(greatest + (least - greatest) * min(level, levels - 1) / (levels - 1)))


def _priority_attr_forms(rt) -> list[tuple]:
    """(attribute id, value class) pairs for cudaGraphKernelNodeSetAttribute's priority, the
    most likely first: cuda-bindings 13 wants cudaKernelNodeAttrValue; the id enum has been
    cudaKernelNodeAttrID and cudaLaunchAttributeID, its member cudaLaunchAttributePriority or
    cudaKernelNodeAttributePriority."""
    ids = []
    for enum in ("cudaKernelNodeAttrID", "cudaLaunchAttributeID"):
        e = getattr(rt, enum, None)
        for member in ("cudaLaunchAttributePriority", "cudaKernelNodeAttributePriority"):
            if e is not None and hasattr(e, member):
                ids.append(getattr(e, member))
    values = [getattr(rt, n) for n in ("cudaKernelNodeAttrValue", "cudaLaunchAttributeValue") if hasattr(rt, n)]
    return [(a, v) for v in values for a in ids]


def set_kernel_priorities(node_priority) -> int:
    """Give each kernel node of `node_priority` (cudaGraphNode_t int -> CUDA priority) that
    priority (cudaGraphKernelNodeSetAttribute, cudaLaunchAttributePriority); other node types
    are left alone.  Returns how many nodes were set; raises CudaError on a failing call, or
    TypeError when no form of the bindings' attribute types is accepted."""
    rt = cudart()
    kernel = rt.cudaGraphNodeType.cudaGraphNodeTypeKernel
    forms = _priority_attr_forms(rt)
    n = 0
    for node, prio in node_priority.items():
        if check(rt.cudaGraphNodeGetType(node), "cudaGraphNodeGetType") != kernel:
            continue
        err: Exception | None = None
        for attr, value_cls in forms:
            v = value_cls()
            v.priority = int(prio)
            try:
                r = rt.cudaGraphKernelNodeSetAttribute(node, attr, v)
            except TypeError as exc:
                err = exc
                continue
            check(r, "cudaGraphKernelNodeSetAttribute")
            forms = [(attr, value_cls)]  # the accepted form, for every other node
            break
        else:
            raise TypeError(f"cudaGraphKernelNodeSetAttribute took no priority form: {err}")
        n += 1
    return n


class PriorityGraph:
    """A captured cupy.cuda.Graph instantiated again with USE_NODE_PRIORITY, so its kernel
    nodes' priorities count; the same launch(stream) / upload(stream) as CuPy's Graph, and
    `.graph` (the cudaGraph_t, owned by the CuPy Graph kept here)."""

    def __init__(self, cupy_graph):
        self.base = cupy_graph
        self.graph = cupy_graph.graph
        self._rt = cudart()
        self.exec = check(self._rt.cudaGraphInstantiate(int(self.graph), USE_NODE_PRIORITY),
                          "cudaGraphInstantiate (node priorities)")

    def launch(self, stream) -> None:
        check(self._rt.cudaGraphLaunch(self.exec, int(stream.ptr)), "cudaGraphLaunch")

    def upload(self, stream) -> None:
        check(self._rt.cudaGraphUpload(self.exec, int(stream.ptr)), "cudaGraphUpload")

    def __del__(self):
        ex, self.exec = getattr(self, "exec", None), None
        if ex is not None:
            try:
                self._rt.cudaGraphExecDestroy(ex)
            except Exception:
                pass
