"""Evaluation on the device (issue 13): the model's eval forward (batch-norm running statistics,
no dropout) captured once as a CUDA graph over one batch of the test set, which is held on the
device; the graph is launched once per batch with no host work between launches, each row's loss
and hit written on the device, summed there in a fixed order, and read once.

The graph of one batch, on the runner's first stream (`home`):

    take x      x_eval[i] -> the forward's input buffer          (i: a device counter)
    take y      y_eval[i] -> the forward's label buffer          (when the forward reads labels)
    forward     every eval-forward task's CUDA twin, in order
    rows        row r of batch i: loss = logsumexp(z_r) - z_r[y_r] in f64, hit = argmax(z_r) == y_r
    next        i += 1

Parameters and state (running statistics) are read where training keeps them (the executor's
arena); everything the eval forward writes lives in private buffers, so evaluating never changes
training state.  The same quantities as `training.evaluation.evaluate` (NumPy): the mean over the
real rows (padding of the last batch ignored; a sequence model's [batch * t, classes] logits have
one row per token), with the logits cast to f64 before the log-sum-exp.

Follows CUDA_PITFALLS.md: every buffer allocated before capture, one warm-up launch under the
graph's private memory pool, GC off during capture, no host copy or synchronize inside it.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np

from streamsched.interp.cuda.device import cupy_module

_SOURCE = r"""
template <typename T>
__device__ void take(const T* src, T* dst, long long n, const int* idx) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k < n) dst[k] = src[(long long)idx[0] * n + k];
}
extern "C" __global__ void ss_eval_take_f32(const float* s, float* d, long long n, const int* i) { take(s, d, n, i); }
extern "C" __global__ void ss_eval_take_f64(const double* s, double* d, long long n, const int* i) { take(s, d, n, i); }
extern "C" __global__ void ss_eval_take_u16(const unsigned short* s, unsigned short* d, long long n, const int* i) {
    take(s, d, n, i);
}
extern "C" __global__ void ss_eval_take_i32(const int* s, int* d, long long n, const int* i) { take(s, d, n, i); }
extern "C" __global__ void ss_eval_take_i64(const long long* s, long long* d, long long n, const int* i) {
    take(s, d, n, i);
}

template <typename T, typename L>
__device__ void rows(const T* z, const L* y, double* loss, double* hit, int rows_per_batch, int classes,
                     long long total, const int* idx) {
    // one thread per row of this batch: its loss and whether its argmax (the first maximum, as
    // NumPy's argmax) is the label; rows past `total` (padding of the last batch) are skipped
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows_per_batch) return;
    long long g = (long long)idx[0] * rows_per_batch + r;
    if (g >= total) return;
    const T* zr = z + (long long)r * classes;
    double m = (double)zr[0];
    int arg = 0;
    for (int c = 1; c < classes; ++c) {
        double v = (double)zr[c];
        if (v > m) { m = v; arg = c; }
    }
    double s = 0.0;
    for (int c = 0; c < classes; ++c) s += exp((double)zr[c] - m);
    long long lab = (long long)y[g];
    loss[g] = log(s) - ((double)zr[lab] - m);
    hit[g] = (arg == lab) ? 1.0 : 0.0;
}
extern "C" __global__ void ss_eval_rows_f32_i32(const float* z, const int* y, double* l, double* h, int n, int c,
                                                long long t, const int* i) { rows(z, y, l, h, n, c, t, i); }
extern "C" __global__ void ss_eval_rows_f32_i64(const float* z, const long long* y, double* l, double* h, int n,
                                                int c, long long t, const int* i) { rows(z, y, l, h, n, c, t, i); }
extern "C" __global__ void ss_eval_rows_f64_i32(const double* z, const int* y, double* l, double* h, int n, int c,
                                                long long t, const int* i) { rows(z, y, l, h, n, c, t, i); }
extern "C" __global__ void ss_eval_rows_f64_i64(const double* z, const long long* y, double* l, double* h, int n,
                                                int c, long long t, const int* i) { rows(z, y, l, h, n, c, t, i); }

extern "C" __global__ void ss_eval_next(int* idx) { idx[0] += 1; }

extern "C" __global__ void ss_eval_sum(const double* loss, const double* hit, long long total, double* out) {
    // one block of 256 threads: strided partial sums, then a tree in shared memory (a fixed
    // order: the same total every time)
    __shared__ double sl[256];
    __shared__ double sh[256];
    double a = 0.0, b = 0.0;
    for (long long k = threadIdx.x; k < total; k += 256) { a += loss[k]; b += hit[k]; }
    sl[threadIdx.x] = a;
    sh[threadIdx.x] = b;
    __syncthreads();
    for (int w = 128; w > 0; w >>= 1) {
        if (threadIdx.x < w) { sl[threadIdx.x] += sl[threadIdx.x + w]; sh[threadIdx.x] += sh[threadIdx.x + w]; }
        __syncthreads();
    }
    if (threadIdx.x == 0) { out[0] = sl[0]; out[1] = sh[0]; }
}
"""

_TAKE = {"float32": "f32", "float64": "f64", "float16": "u16", "int32": "i32", "int64": "i64"}


class DeviceEvaluator:
    """The eval forward of `program`'s model over the test split (x [N, ...], y [N] or [N, t]),
    as one captured graph per batch launched N / batch times (`__call__`: one read).

    ex: the run's CudaExecutor (its arena holds the parameters and state; its first stream runs
    the evaluation).  Raises NotImplementedError when the eval forward cannot run this way (a
    host kernel, a kernel without a CUDA twin or one that cannot be captured, a buffer on the
    host, an eval forward that writes training state, logits or labels of a dtype the row
    kernel lacks); the loop then evaluates on the host.  capture=False launches the same work
    eagerly (for comparison and debugging)."""

    where = "device"

    def __init__(self, ex, program, x: np.ndarray, y: np.ndarray, capture: bool = True):
        cp = self.cp = cupy_module()
        self.ex, self.ctx = ex, ex.ctx
        with ex.ctx.streams[ex.ctx.names[0]]:  # every allocation and upload on the home stream
            self._init(program, x, y, capture, cp)
        self.home.synchronize()
        self._build(capture)

    def _init(self, program, x, y, capture, cp) -> None:
        from streamsched.interp.memory import ARRAY_DTYPES

        ex = self.ex
        m = program.model
        self.batch = b = int(m.batch)
        self.home_name = self.ctx.names[0]
        self.home = self.ctx.streams[self.home_name]
        bufs = {bf.name: bf for bf in program.buffers}
        slot0 = program.slots[0] if program.slots else ""
        fwd = list(m.eval_forward or m.forward)
        from streamsched.interp.training.data_path import _input_names

        feat, lab = _input_names(program)
        inits = {n for n, _ in program.inits}
        names = list(dict.fromkeys(n for t in fwd for n in t.args + t.outs))
        written = {o for t in fwd for o in t.outs}
        arrays: dict[str, Any] = {}
        for n in names:
            concrete = n.replace("{slot}", slot0)
            if concrete in inits:
                if n in written:
                    raise NotImplementedError(f"the eval forward writes the training state `{concrete}`")
                arrays[n] = ex.arrays[concrete]
                continue
            bf = bufs.get(concrete)
            if bf is None:
                raise NotImplementedError(f"the eval forward's buffer `{concrete}` is not in the program")
            dt = ARRAY_DTYPES.get(bf.dtype)
            if dt is None:
                raise NotImplementedError(f"`{concrete}` is {bf.dtype}, which has no array dtype")
            arrays[n] = cp.zeros(tuple(bf.shape), dtype=dt)
        self.xin = next(n for n in names if n.split("[")[0] == feat)
        self.yin = next((n for n in names if n.split("[")[0] == lab), None)
        if m.logits not in arrays:
            raise NotImplementedError(f"the eval forward does not compute the logits `{m.logits}`")
        logits = arrays[m.logits]
        if logits.ndim != 2:
            raise NotImplementedError(f"the logits `{m.logits}` are not [rows, classes]")
        self.rows_per_batch, self.classes = int(logits.shape[0]), int(logits.shape[1])
        if self.rows_per_batch % b:
            raise NotImplementedError("the logits' rows are not a whole number per sample")
        per = self.rows_per_batch // b  # rows per sample (tokens of a sequence model)
        self.n = n_test = len(x)
        self.nb = max(1, -(-n_test // b))
        self.total = n_test * per
        # the test set on the device, padded to whole batches (zeros, as `evaluate` pads)
        xa = arrays[self.xin]
        xp = np.zeros((self.nb * b,) + tuple(xa.shape[1:]), dtype=xa.dtype)
        xp[:n_test] = np.asarray(x).reshape((n_test,) + tuple(xa.shape[1:]))
        yflat = np.asarray(y).reshape(-1)
        if yflat.size != self.total:
            raise NotImplementedError(f"{yflat.size} labels for {self.total} logit rows")
        ydt = np.int64 if yflat.dtype == np.int64 else np.int32
        yp = np.zeros(self.nb * self.rows_per_batch, dtype=ydt)
        yp[:self.total] = yflat
        self.x_dev = cp.asarray(xp)
        self.y_dev = cp.asarray(yp)
        self.loss_rows = cp.zeros(self.nb * self.rows_per_batch, dtype=cp.float64)
        self.hit_rows = cp.zeros(self.nb * self.rows_per_batch, dtype=cp.float64)
        self.idx = cp.zeros(1, dtype=cp.int32)
        self.out = cp.zeros(2, dtype=cp.float64)
        self.mod = cp.RawModule(code=_SOURCE, options=("-std=c++14",))
        self.steps = []  # (fn, ins, outs, attrs, task) of the forward, in order
        for t in fwd:
            try:
                fn, attrs, host, capturable = ex._resolve(t.kernel)
            except KeyError as exc:
                raise NotImplementedError(str(exc)) from None
            if host or fn is None:
                raise NotImplementedError(f"`{t.kernel}` is host work")
            if capture and not capturable:
                raise NotImplementedError(f"`{t.kernel}` cannot be captured")
            attrs.update(dict(t.attrs))
            self.steps.append((fn, [arrays[a] for a in t.args], [arrays[o] for o in t.outs], attrs, t))
        self.arrays = arrays
        self._takes = [(self.x_dev, xa)]
        if self.yin is not None:  # the forward's own label buffer (its loss reads it)
            ya = arrays[self.yin]
            if ya.dtype == self.y_dev.dtype and ya.size == self.rows_per_batch:
                self._takes.append((self.y_dev, ya))
            else:
                try:
                    host = np.zeros((self.nb * b,) + tuple(ya.shape[1:]), ya.dtype)
                    host[:n_test] = np.asarray(y).reshape((n_test,) + tuple(ya.shape[1:]))
                except ValueError as exc:
                    raise NotImplementedError(f"labels that do not fit `{self.yin}`: {exc}") from None
                self._takes.append((cp.asarray(host), ya))
        for src, dst in self._takes:
            if str(dst.dtype) not in _TAKE:
                raise NotImplementedError(f"an input of dtype {dst.dtype}")
        zdt = {"float32": "f32", "float64": "f64"}.get(str(logits.dtype))
        self.logits = self.z = logits
        if zdt is None:  # f16 logits: cast into an f32 buffer first (inside the graph)
            self.z = cp.zeros(logits.shape, dtype=cp.float32)
            self._cast = cp.ElementwiseKernel("T x", "float32 y", "y = (float)x", "ss_eval_cast")
            zdt = "f32"
        else:
            self._cast = None
        ldt = "i64" if self.y_dev.dtype == np.int64 else "i32"
        self._rows = self.mod.get_function(f"ss_eval_rows_{zdt}_{ldt}")
        self._next = self.mod.get_function("ss_eval_next")
        self._sum = self.mod.get_function("ss_eval_sum")
        self.graph = None
        self.pool = cp.cuda.MemoryPool()

    def _body(self) -> None:
        """One batch: inputs taken at the device counter, the forward, the rows, the counter.
        Every launch is on `home` (the twins are given its name)."""
        home = self.home
        with home:
            for src, dst in self._takes:
                n = int(dst.size)
                fn = self.mod.get_function(f"ss_eval_take_{_TAKE[str(dst.dtype)]}")
                fn(((n + 255) // 256,), (256,), (src, dst, np.int64(n), self.idx))
        for fn, ins, outs, attrs, _t in self.steps:
            fn(self.ctx, self.home_name, ins, outs, attrs)
        r = self.rows_per_batch
        with home:
            if self._cast is not None:
                self._cast(self.logits, self.z)
            self._rows(((r + 127) // 128,), (128,), (self.z, self.y_dev, self.loss_rows, self.hit_rows, np.int32(r),
                                                     np.int32(self.classes), np.int64(self.total), self.idx))
            self._next((1,), (1,), (self.idx,))

    def _build(self, capture: bool) -> None:
        cp, home = self.cp, self.home
        with cp.cuda.using_allocator(self.pool.malloc):
            # warm-up: every kernel once, eagerly, under the graph's pool (compiles, grows the pool)
            with home:
                self.idx.fill(0)
            self._body()
            home.synchronize()
            if not capture:
                return
            gc.collect()
            gc_was = gc.isenabled()
            gc.disable()  # pitfall 26: no collection in the middle of a capture
            try:
                home.begin_capture()
                try:
                    self._body()
                except BaseException:
                    try:
                        home.end_capture()
                    except Exception:
                        pass
                    raise
                self.graph = home.end_capture()
            finally:
                if gc_was:
                    gc.enable()
        for s, st in self.ctx.streams.items():
            if st.is_capturing():
                raise RuntimeError(f"stream {s} is still capturing after the evaluation graph's capture")
        self.graph.upload(home)

    def issue(self, stream, capturing: bool = False) -> None:
        """The whole evaluation on `stream`, without reading it: the counter reset, one graph
        launch per batch, the two sums into `out` (f64[2]: loss sum, hits; divide by `total`).
        capturing: `stream` is being captured (it must be this evaluator's home stream): the
        batches' work is issued again into that capture instead of launching the graph."""
        cp = self.cp
        with stream:
            self.idx.fill(0)
        if capturing or self.graph is None:
            if capturing and stream is not self.home:
                raise ValueError("an evaluation is captured on its home stream only")
            hop = stream is not self.home  # eager work runs on home: order it between `stream`'s
            if hop:
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(stream)
                self.home.wait_event(ev)
            with cp.cuda.using_allocator(self.pool.malloc):
                for _ in range(self.nb):
                    self._body()
            if hop:
                back = cp.cuda.Event(disable_timing=True)
                back.record(self.home)
                stream.wait_event(back)
        else:
            for _ in range(self.nb):
                self.graph.launch(stream)
        with stream:
            self._sum((1,), (256,), (self.loss_rows, self.hit_rows, np.int64(self.total), self.out))

    def __call__(self, runner=None, params=None) -> tuple[float, float]:
        """(mean loss, accuracy) of the current parameters; the training streams must be idle
        (the loop synchronizes before an epoch ends).  One read: the two sums."""
        home = self.home
        with home:
            self.idx.fill(0)
        for _ in range(self.nb):
            if self.graph is not None:
                self.graph.launch(home)
            else:
                with self.cp.cuda.using_allocator(self.pool.malloc):
                    self._body()
        with home:
            self._sum((1,), (256,), (self.loss_rows, self.hit_rows, np.int64(self.total), self.out))
        got = self.out.get(stream=home)
        home.synchronize()
        return float(got[0]) / self.total, float(got[1]) / self.total
