"""The end of an epoch on the GPU without a host synchronization (issue 13), and whole epochs in
one launch: `EpochEnds` issues an epoch's end on the device, in stream order after its last step
and before the next epoch's first (the loop reads it later, when the device has got there);
`EpochGraph` puts the captured steady steps inside CUDA conditional nodes, so the host issues one
graph launch for several epochs, their ends included.

What an epoch's end does, on one stream, with every device stream joined to it first (a fork and
join through events, ARCHITECTURE.md's rule for crossing streams) and waiting for it after:

    losses     the LossAccumulator's four values copied into this end's report, then reset
    state      every floating-point parameter and state array checked for inf/NaN (a flag; one
               multi-tensor launch per dtype)
    evaluate   (when asked) the eval forward over the test set (DeviceEvaluator), its two sums
    snapshot   (when asked: a checkpoint, a host evaluation) the saved arrays copied aside
    order      (device-resident data) a later epoch's sample order uploaded into the half of
               the permutation that the epoch before this one read (finished by now)
    report     published to the host

Two kinds of end publish their report differently:

  ring end   (no snapshot, no order to upload, at most RING_WIDTH - REPORT f32/f64 scalars
             besides the report) one captured graph serves every epoch: `ss_publish` writes the
             report into entry c % RING of a ring in mapped page-locked host memory, then the
             counter c (the host reads both without a CUDA call; a blocking event after the
             launch lets it sleep until then).  A ring end that sees a non-finite loss or state
             sets a device stop flag: the epoch graph's loops run no step after it.
  slot end   (a snapshot, an order, other scalars) reports and snapshots double-buffered (slot
             e % 2), copied to pinned memory by the copy engine, an event recorded after.

The loop reads an end while the device runs the next launch, and before the launch after that
(a lag of at most one launch).

The epoch graph (CUDA 12.4+ conditional nodes, through cuda.bindings); k (the loop step) and j
(the launch) live on the device, `ends` holds each launch's last step, so the host writes
nothing per launch:

  several epochs, unrolled (SWITCH nodes, CUDA 12.8+, and at most UNROLL_STEPS step graphs):
    WHILE (default 1) {
        ss_epoch_slot: SWITCH = the slot of the epoch's first step, (k - first) % P
        SWITCH { body s: the epoch's steps from slot s on, one child graph each; its ring end }
        ss_epoch_after: k += spe; WHILE = k < ends[j] (else j += 1)
    }
  several epochs, a loop over the steps (longer epochs, or no SWITCH nodes):
    WHILE_outer { arm WHILE_inner; WHILE_inner { the step of k's slot; k += 1; WHILE_inner =
                  k does not end an epoch }; the ring end; WHILE_outer = k < ends[j] }
  one epoch with a slot end:
    WHILE { the step of k's slot; k += 1; WHILE = k < ends[j] }, then the slot end
  (the step of k's slot: one SWITCH node set by the iteration's kernel, or, CUDA < 12.8, one IF
   node per slot)

The step units are re-captured once as raw graphs (cudaStreamEndCapture) and added as child graph
nodes (cudaGraphAddChildGraphNode clones them), so the per-step graphs and the epoch graph replay
the same kernels on the same buffers.  Where the driver or bindings lack conditional nodes,
`EpochGraph` raises NotImplementedError and the loop issues the steps one by one (a one-line
notice says why).

Sources: CUDA Programming Guide, "Conditional Graph Nodes" (cudaGraphConditionalHandleCreate,
cudaGraphSetConditional, cudaStreamBeginCaptureToGraph) and "Mapped Memory"; CUDA_PITFALLS.md
(no host read inside a captured graph; every buffer allocated before capture).
"""

from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamsched.interp.cuda.device import check, cudart, cupy_module, instantiate_flags, mapped_pinned
from streamsched.interp.training.options import MAX_EPOCHS_PER_LAUNCH

_CHECK_SOURCE = r"""
// any element whose exponent bits are all ones (inf or NaN) sets flag[0] = 1 (every writer
// writes the same value: no atomic needed); one launch checks every array of one element
// width: array blockIdx.y is ptrs[blockIdx.y], of sizes[blockIdx.y] elements
template <typename T>
__device__ void nonfinite(const unsigned long long* ptrs, const long long* sizes, T mask, double* flag) {
    const T* a = (const T*)ptrs[blockIdx.y];
    long long n = sizes[blockIdx.y];
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
        if ((a[i] & mask) == mask) flag[0] = 1.0;
}
extern "C" __global__ void ss_nonfinite_b2(const unsigned long long* p, const long long* n, unsigned short m,
                                           double* f) {
    nonfinite(p, n, m, f);
}
extern "C" __global__ void ss_nonfinite_b4(const unsigned long long* p, const long long* n, unsigned int m,
                                           double* f) {
    nonfinite(p, n, m, f);
}
extern "C" __global__ void ss_nonfinite_b8(const unsigned long long* p, const long long* n, unsigned long long m,
                                           double* f) {
    nonfinite(p, n, m, f);
}
extern "C" __global__ void ss_zero1(double* p) { p[0] = 0.0; }

// -- ring ends: an end whose report goes to a ring in mapped page-locked host memory, indexed by a
// device counter, so the same captured end serves every epoch (and can sit inside a loop)
__device__ __forceinline__ unsigned long long ss_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// the loss accumulator's four values into the report, then reset; the rest of the report zeroed.
// ctr[2]: whether a divergence stopped the run before this end (then it publishes nothing)
extern "C" __global__ void ss_end_take(double* acc, double* rep, int* ctr) {
    ctr[2] = ctr[1];
    if (ctr[2]) return;
    for (int i = 0; i < 4; ++i) rep[i] = acc[i];
    acc[0] = 0.0; acc[1] = 0.0; acc[2] = -1.0; acc[3] = 0.0;
    for (int i = 4; i < 16; ++i) rep[i] = 0.0;
}
extern "C" __global__ void ss_stamp(double* rep) { rep[7] = (double)ss_now(); }
extern "C" __global__ void ss_extra_f32(const float* a, double* dst) { dst[0] = (double)a[0]; }
extern "C" __global__ void ss_extra_f64(const double* a, double* dst) { dst[0] = a[0]; }
// ctr: [0] the ends published so far, [1] 1 once an end saw a non-finite loss or state (the epoch
// graph's loops then stop: the steps after a divergence never run)
extern "C" __global__ void ss_publish(double* rep, const double* ev, int timed, double* ring, long long* seq,
                                      int* ctr, int ring_n) {
    if (ctr[2]) return;
    int e = ctr[0];
    if (ev != 0) { rep[4] = ev[0]; rep[5] = ev[1]; }
    rep[7] = timed ? ((double)ss_now() - rep[7]) * 1e-9 : 0.0;
    volatile double* dst = ring + (long long)(e % ring_n) * 16;
    for (int i = 0; i < 16; ++i) dst[i] = rep[i];
    __threadfence_system();
    *((volatile long long*)seq) = (long long)e + 1;
    ctr[0] = e + 1;
    if (rep[2] >= 0.0 || rep[6] != 0.0) ctr[1] = 1;
}
"""

_COND_SOURCE = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);

// loop: [k, j]: the loop step the next iteration runs, and which launch of the epoch graph this is;
// ctr[1]: set by a ring end that saw a divergence: no step runs after it.
// mode 0 (a launch of one epoch): the loop goes on while k < ends[j], else the next launch (j + 1);
// mode 1 (the inner loop of a launch of several epochs): while k does not end an epoch (epochs
// start at loop step `base`, every `spe` steps)
__device__ __forceinline__ void ss_advance(cudaGraphConditionalHandle h, int* loop, const int* ends, int mode,
                                           int base, int spe) {
    int k = loop[0] + 1;
    loop[0] = k;
    unsigned int more;
    if (mode == 0) {
        more = k < ends[loop[1]] ? 1u : 0u;
        if (!more) loop[1] += 1;
    } else {
        more = ((k - base) % spe != 0) ? 1u : 0u;
    }
    cudaGraphSetConditional(h, more);
}
__device__ __forceinline__ bool ss_stopped(cudaGraphConditionalHandle h, int* loop, const int* ctr, int mode) {
    if (!ctr[1]) return false;
    if (mode == 0) loop[1] += 1;
    cudaGraphSetConditional(h, 0u);
    return true;
}
// the SWITCH path: one kernel per iteration, before the step: its slot (none once stopped: a value
// past the last body runs none of them), then k += 1 and whether the loop goes on
extern "C" __global__ void ss_epoch_step(cudaGraphConditionalHandle hs, cudaGraphConditionalHandle h, int* loop,
                                         const int* ends, const int* ctr, int first, int period, int mode, int base,
                                         int spe) {
    if (ss_stopped(h, loop, ctr, mode)) {
        cudaGraphSetConditional(hs, 0xFFFFFFFFu);
        return;
    }
    cudaGraphSetConditional(hs, (unsigned int)((loop[0] - first) % period));
    ss_advance(h, loop, ends, mode, base, spe);
}
// the IF path (no SWITCH nodes, CUDA < 12.8): per slot s, IF_s = the step is slot s's; after
// them, ss_epoch_next
extern "C" __global__ void ss_epoch_if(cudaGraphConditionalHandle h, const int* loop, int first, int period,
                                       int s, const int* ctr) {
    int r = (loop[0] - first) % period;
    cudaGraphSetConditional(h, (r == s && ctr[1] == 0) ? 1u : 0u);
}
extern "C" __global__ void ss_epoch_next(cudaGraphConditionalHandle h, int* loop, const int* ends, const int* ctr,
                                         int mode, int base, int spe) {
    if (!ss_stopped(h, loop, ctr, mode)) ss_advance(h, loop, ends, mode, base, spe);
}
// a launch of several unrolled epochs: the SWITCH over the slot of the epoch's first step (none
// once stopped), and after the epoch k += spe, the loop going on while k < ends[j]
extern "C" __global__ void ss_epoch_slot(cudaGraphConditionalHandle hs, const int* loop, const int* ctr, int first,
                                         int period) {
    cudaGraphSetConditional(hs, ctr[1] ? 0xFFFFFFFFu : (unsigned int)((loop[0] - first) % period));
}
extern "C" __global__ void ss_epoch_after(cudaGraphConditionalHandle h, int* loop, const int* ends, const int* ctr,
                                          int spe) {
    if (!ctr[1]) loop[0] += spe;
    if (ctr[1] || loop[0] >= ends[loop[1]]) {
        loop[1] += 1;
        cudaGraphSetConditional(h, 0u);
    } else {
        cudaGraphSetConditional(h, 1u);
    }
}
// a launch of several epochs: the inner loop armed before each epoch (not once stopped); after
// each epoch's end, the outer loop goes on while k < ends[j] (else the next launch)
extern "C" __global__ void ss_epoch_arm(cudaGraphConditionalHandle h, const int* ctr) {
    cudaGraphSetConditional(h, ctr[1] ? 0u : 1u);
}
extern "C" __global__ void ss_epoch_outer(cudaGraphConditionalHandle h, int* loop, const int* ends, const int* ctr) {
    if (ctr[1] || loop[0] >= ends[loop[1]]) {
        loop[1] += 1;
        cudaGraphSetConditional(h, 0u);
    } else {
        cudaGraphSetConditional(h, 1u);
    }
}
"""

# exponent masks: a value is inf or NaN exactly when all its exponent bits are set
_MASKS = {"float16": (2, 0x7C00), "bfloat16": (2, 0x7F80), "float32": (4, 0x7F800000),
          "float64": (8, 0x7FF0000000000000)}
_H2D, _D2H, _D2D = 1, 2, 3
REPORT = 8
"""f64 values of one epoch's report: loss sum, steps, first bad step (-1: none), its value, eval
loss sum, eval hit sum, state flag (1: an inf/NaN in the parameters or state), and unused (a ring
end: the evaluation's device seconds)."""
RING = 64
"""Entries of the ring that ring ends publish to (`EpochEnds.ring_end`): the loop reads an end
before the device publishes RING more (it keeps at most two launches in flight, of at most
`training.options.MAX_EPOCHS_PER_LAUNCH` epochs each)."""
assert RING >= 2 * MAX_EPOCHS_PER_LAUNCH + 2
UNROLL_STEPS = 64
"""A launch of several epochs unrolls each epoch (one child graph per step, per slot the epoch can
start at) up to this many step graphs in all, else it loops over the steps (`EpochGraph`)."""
RING_WIDTH = 16
"""f64 values of one ring entry: the report's REPORT, then up to RING_WIDTH - REPORT scalars
(`extra`: the dynamic loss scale), as doubles."""


@dataclass
class EpochEndResult:
    """What an epoch's end reports once the device got there: `acc` (loss sum, steps, first bad
    step or -1, its value; None without a device accumulator), `eval` (mean loss, accuracy) or
    None, `state_bad` (an inf/NaN somewhere in the parameters or state), `params` (host copies
    of the snapshot, name -> ndarray) or None, `eval_s` (the evaluation's device seconds)."""

    acc: tuple[float, int, int, float] | None
    eval: tuple[float, float] | None
    state_bad: bool
    params: dict[str, np.ndarray] | None
    eval_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class EpochEnd:
    """One issued epoch end: `ready()` without waiting (an event query), `result()` waits for
    it (a blocking event: the host sleeps, it does not spin) and returns EpochEndResult."""

    def __init__(self, owner: "EpochEnds", slot: int, evaluate: bool, snapshot: bool):
        self.owner, self.slot, self.evaluate, self.snapshot = owner, slot, evaluate, snapshot
        self._result: EpochEndResult | None = None

    def ready(self) -> bool:
        return self._result is not None or bool(self.owner.ready[self.slot].done)

    def result(self) -> EpochEndResult:
        if self._result is None:
            self._result = self.owner._collect(self)
        return self._result


class RingEnd:
    """One issued ring end (`EpochEnds.ring_end`, or one epoch of a launch of several): its
    report is entry `index % RING` of the ring in mapped host memory, there once the device's
    publish counter passed `index`.  `ready()` reads that counter (host memory: no CUDA call);
    `result()` waits on `event` (blocking: the host sleeps), recorded after the launch that
    publishes it."""

    def __init__(self, owner: "EpochEnds", index: int, evaluate: bool, event):
        self.owner, self.index, self.evaluate, self.event = owner, index, evaluate, event
        self._result: EpochEndResult | None = None

    def ready(self) -> bool:
        return self._result is not None or int(self.owner.seq_host[0]) > self.index

    def result(self) -> EpochEndResult:
        if self._result is None:
            self._result = self.owner._collect_ring(self)
        return self._result


class EpochEnds:
    """The epoch ends of one CudaExecutor's run (module docstring).

    ex: the executor (its accumulator, arrays, streams); check: names of the arrays checked for
    inf/NaN (floating point only; others are skipped); saved: the names a snapshot copies;
    extra: names of scalars always reported (the dynamic loss scale), name -> value;
    resident: the run's ResidentData (its permutation receives the orders), or None.
    `set_evaluator` attaches the DeviceEvaluator once it exists.  Everything is allocated here,
    before any capture."""

    def __init__(self, ex, check_names, saved, extra=(), resident=None):
        cp = self.cp = cupy_module()
        self.ex, self.ctx = ex, ex.ctx
        self.resident = resident
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.report = cp.zeros((2, REPORT), dtype=cp.float64)
        self.report_host = [self._pinned(REPORT * 8).view(np.float64) for _ in range(2)]
        self.acc_init = self._pinned(32).view(np.float64)
        self.acc_init[:] = (0.0, 0.0, -1.0, 0.0)
        self.join = {s: cp.cuda.Event(disable_timing=True) for s in self.ctx.names}
        self.done = cp.cuda.Event(disable_timing=True)
        self.ready = [cp.cuda.Event(block=True, disable_timing=True) for _ in range(2)]
        self.eval_marks = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(2)]
        self.mod = cp.RawModule(code=_CHECK_SOURCE, options=("-std=c++14",))
        self._zero = self.mod.get_function("ss_zero1")
        # one multi-tensor launch per dtype (its exponent mask): (kernel, pointer table, size
        # table, arrays, blocks, count, mask); the tables live on the device, uploaded once here
        by_dtype: dict[str, list] = {}
        for n in dict.fromkeys(check_names):
            a = ex.arrays.get(n)
            if a is None or str(a.dtype) not in _MASKS or a.size == 0:
                continue
            by_dtype.setdefault(str(a.dtype), []).append(a)
        self.checks = []
        for dt, arrs in sorted(by_dtype.items()):
            width, mask = _MASKS[dt]
            fn = self.mod.get_function(f"ss_nonfinite_b{width}")
            mask_t = {2: np.uint16, 4: np.uint32, 8: np.uint64}[width](mask)
            ptrs = cp.asarray(np.array([int(a.data.ptr) for a in arrs], dtype=np.uint64))
            sizes = cp.asarray(np.array([int(a.size) for a in arrs], dtype=np.int64))
            blocks = max(1, min(1024, (max(int(a.size) for a in arrs) + 255) // 256))
            self.checks.append((fn, ptrs, sizes, arrs, blocks, len(arrs), mask_t))
        self.saved = [n for n in saved if n in ex.arrays]
        self.snap_dev: dict[str, Any] = {}
        self.snap_host: list[dict[str, np.ndarray]] = [{}, {}]
        self.extra = {n: ex.arrays[n] for n in extra if n in ex.arrays}
        self.extra_dev = {n: cp.zeros(a.shape, a.dtype) for n, a in self.extra.items()}
        self.extra_host = [{n: self._pinned(a.nbytes).view(a.dtype)[:a.size].reshape(a.shape)
                            for n, a in self.extra.items()} for _ in range(2)]
        self.order_host = None
        if resident is not None and resident.halves == 2:  # (else every order is on the device)
            n = resident.spe * resident.batch
            self.order_host = [self._pinned(4 * n).view(np.int32) for _ in range(2)]
        self.evaluator = None
        self.count = 0
        # ring ends: the report published by a kernel into a ring in mapped host memory, indexed
        # by a device counter, so one captured end serves every epoch, eagerly or inside the
        # epoch graph's loop (ctr: [0] ends published, [1] 1 once one saw a divergence)
        self.ctr = cp.zeros((4,), dtype=cp.int32)
        self.ring_ok = ex.accumulator is not None and self.order_host is None and \
            len(self.extra) <= RING_WIDTH - REPORT and \
            all(a.size == 1 and str(a.dtype) in ("float32", "float64") for a in self.extra.values())
        self.ring_count = 0  # ring ends issued: ctr[0] once the device ran them
        self.ring_graphs: dict[bool, tuple] = {}
        self.ring_events = [cp.cuda.Event(block=True, disable_timing=True) for _ in range(4)]
        self._ring_event = 0
        if self.ring_ok:
            self.scratch = cp.zeros((RING_WIDTH,), dtype=cp.float64)
            self._take = self.mod.get_function("ss_end_take")
            self._extra_fn = {"float32": self.mod.get_function("ss_extra_f32"),
                              "float64": self.mod.get_function("ss_extra_f64")}
            self._stamp = self.mod.get_function("ss_stamp")
            self._publish = self.mod.get_function("ss_publish")
            nring = RING * RING_WIDTH * 8
            view, dptr, self._ring_mem = mapped_pinned(nring + 64)
            self.ring_host = view[:nring].view(np.float64).reshape(RING, RING_WIDTH)
            self.seq_host = view[nring:nring + 8].view(np.int64)
            self.ring_dev, self.seq_dev = dptr, dptr + nring
        cp.cuda.Device().synchronize()  # zeroed on CuPy's current stream, read on non-blocking ones

    def _pinned(self, nbytes: int) -> np.ndarray:
        return self.ctx.pinned_zeros(max(8, int(nbytes)))[:max(8, int(nbytes))]

    def set_evaluator(self, evaluator) -> None:
        self.evaluator = evaluator

    def ensure_snapshot(self) -> None:
        """The snapshot's device and pinned buffers (allocated once, outside any capture)."""
        if self.snap_dev or not self.saved:
            return
        cp = self.cp
        for n in self.saved:
            a = self.ex.arrays[n]
            self.snap_dev[n] = cp.zeros(a.shape, a.dtype)
            for s in range(2):
                self.snap_host[s][n] = self._pinned(a.nbytes).view(a.dtype)[:a.size].reshape(a.shape)
        cp.cuda.Device().synchronize()

    def set_order(self, order: np.ndarray | None) -> None:
        """The sample order the next end (slot `count % 2`) uploads (None: the pinned buffer keeps
        what it had).
        End i (from 0, slot i % 2) uploads epoch i + 2's order into permutation half i % 2, the
        half epoch i read: finished once end i runs, read again by epoch i + 2 (and by the
        prefetch of epoch i + 1's last step).  An end with no later epoch uploads a stale order
        into a half nothing reads again.  The host writes the pinned buffer now: the end that
        reads it has not been issued, and the end that last read it (i - 2) was collected (the
        loop's lag is at most one epoch)."""
        slot = self.count % 2
        if self.order_host is None:
            return
        if order is not None:
            n = self.order_host[slot].size
            self.order_host[slot][:] = np.asarray(order[:n], dtype=np.int32)

    # -- issuing ----------------------------------------------------------------------------

    def _issue_checks(self, flag) -> None:
        """Every checked array tested for inf/NaN into `flag` (f64[1]), on the current stream:
        one multi-tensor launch per dtype."""
        for fn, ptrs, sizes, _arrs, blocks, count, mask in self.checks:
            fn((blocks, count), (256,), (ptrs, sizes, mask, flag))

    def issue_device(self, stream, slot: int, evaluate: bool, snapshot: bool, capturing: bool = False) -> None:
        """The end's device work on `stream` (module docstring), ordered by that stream alone:
        the caller has joined the epoch's streams to it (or captures it after the epoch's
        steps, on their stream).  capturing: inside a capture (the evaluator is re-captured,
        not launched)."""
        rt = cp_runtime()
        ptr = int(stream.ptr)
        rep = self.report[slot]
        rep_ptr = int(rep.data.ptr)
        acc = self.ex.accumulator
        if acc is not None:
            rt.memcpyAsync(rep_ptr, int(acc.acc.data.ptr), 32, _D2D, ptr)
            rt.memcpyAsync(int(acc.acc.data.ptr), int(self.acc_init.ctypes.data), 32, _H2D, ptr)
        with stream:
            self._zero((1,), (1,), (rep[6:7],))
            self._issue_checks(rep[6:7])
        if evaluate and self.evaluator is not None:
            t0, t1 = self.eval_marks[slot]
            _record(t0, stream, capturing)
            self.evaluator.issue(stream, capturing=capturing)
            _record(t1, stream, capturing)
            rt.memcpyAsync(rep_ptr + 4 * 8, int(self.evaluator.out.data.ptr), 16, _D2D, ptr)
        for n, a in self.extra.items():
            rt.memcpyAsync(int(self.extra_dev[n].data.ptr), int(a.data.ptr), a.nbytes, _D2D, ptr)
        if snapshot:
            for n in self.saved:
                a = self.ex.arrays[n]
                rt.memcpyAsync(int(self.snap_dev[n].data.ptr), int(a.data.ptr), a.nbytes, _D2D, ptr)
        if self.order_host is not None:  # end i fills permutation half i % 2 (set_order)
            half = self.resident.perm[slot]
            rt.memcpyAsync(int(half.data.ptr), int(self.order_host[slot].ctypes.data), half.nbytes, _H2D, ptr)

    def issue_host_copies(self, stream, slot: int, snapshot: bool) -> None:
        """The report (and snapshot) copied into page-locked memory, on `stream`."""
        rt = cp_runtime()
        ptr = int(stream.ptr)
        rt.memcpyAsync(int(self.report_host[slot].ctypes.data), int(self.report[slot].data.ptr), REPORT * 8,
                       _D2H, ptr)
        for n, d in self.extra_dev.items():
            rt.memcpyAsync(int(self.extra_host[slot][n].ctypes.data), int(d.data.ptr), d.nbytes, _D2H, ptr)
        if snapshot:
            for n in self.saved:
                d = self.snap_dev[n]
                rt.memcpyAsync(int(self.snap_host[slot][n].ctypes.data), int(d.data.ptr), d.nbytes, _D2H, ptr)

    def uses_ring(self, snapshot: bool) -> bool:
        """Whether an end can be a ring end: the loss summed on the device, no snapshot, at most
        RING_WIDTH - REPORT f32/f64 scalars reported besides the report, no order uploaded at
        ends."""
        return self.ring_ok and not snapshot

    def issue_ring_device(self, stream, evaluate: bool, capturing: bool = False) -> None:
        """A ring end's device work on `stream` (module docstring, without the snapshot and the
        order): the losses into the scratch report, the checks, the evaluation (timed on the
        device clock), then `ss_publish` (the report into the ring, the counter after it)."""
        sc = self.scratch
        with stream:
            self._take((1,), (1,), (self.ex.accumulator.acc, sc, self.ctr))
            self._issue_checks(sc[6:7])
            for i, a in enumerate(self.extra.values()):
                self._extra_fn[str(a.dtype)]((1,), (1,), (a, sc[REPORT + i:REPORT + i + 1]))
        ev, timed = np.uint64(0), np.int32(0)
        if evaluate and self.evaluator is not None:
            with stream:
                self._stamp((1,), (1,), (sc,))
            self.evaluator.issue(stream, capturing=capturing)
            ev, timed = self.evaluator.out, np.int32(1)
        with stream:
            self._publish((1,), (1,), (sc, ev, timed, np.uint64(self.ring_dev), np.uint64(self.seq_dev), self.ctr,
                                       np.int32(RING)))

    def ring_graph(self, evaluate: bool):
        """(graph, exec) of a ring end captured once (on the evaluator's home stream, where its
        work must be captured), launched on any stream."""
        evaluate = bool(evaluate) and self.evaluator is not None
        got = self.ring_graphs.get(evaluate)
        if got is not None:
            return got
        rt, cp = cudart(), self.cp
        cap = self.ctx.streams[self.ctx.names[0]]
        cptr = int(cap.ptr)
        gc_was = gc.isenabled()
        gc.disable()
        try:
            check(rt.cudaStreamBeginCapture(cptr, rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed),
                  "cudaStreamBeginCapture (a ring end)")
            try:
                with cp.cuda.using_allocator(self.ex._pool.malloc):
                    self.issue_ring_device(cap, evaluate, capturing=True)
            except BaseException:
                try:
                    rt.cudaStreamEndCapture(cptr)
                except Exception:
                    pass
                raise
            g = check(rt.cudaStreamEndCapture(cptr), "cudaStreamEndCapture (a ring end)")
        finally:
            if gc_was:
                gc.enable()
        ge = check(rt.cudaGraphInstantiate(g, instantiate_flags()), "cudaGraphInstantiate (a ring end)")
        check(rt.cudaGraphUpload(ge, int(self.stream.ptr)), "cudaGraphUpload")
        self.ring_graphs[evaluate] = (g, ge)
        cp.cuda.Device().synchronize()
        return g, ge

    def next_ring_event(self):
        """A blocking event to record after a launch that publishes ring ends (cycled: one
        recorded again later only makes a wait on it longer, never wrong)."""
        ev = self.ring_events[self._ring_event % len(self.ring_events)]
        self._ring_event += 1
        return ev

    def ring_end(self, evaluate: bool) -> RingEnd:
        """Issue an epoch's end as a ring end: every device stream joined to this end's
        stream, the captured end launched there, every device stream waiting for it."""
        ge = self.ring_graph(evaluate)[1]
        evaluate = bool(evaluate) and self.evaluator is not None
        es = self.stream
        for s, st in self.ctx.streams.items():
            self.join[s].record(st)
            es.wait_event(self.join[s])
        check(cudart().cudaGraphLaunch(ge, int(es.ptr)), "cudaGraphLaunch (a ring end)")
        self.done.record(es)
        for st in self.ctx.streams.values():
            st.wait_event(self.done)
        ev = self.next_ring_event()
        ev.record(es)
        end = RingEnd(self, self.ring_count, evaluate, ev)
        self.ring_count += 1
        return end

    def _collect_ring(self, end: RingEnd) -> EpochEndResult:
        seq = self.seq_host
        if int(seq[0]) <= end.index:
            end.event.synchronize()
            t0 = time.perf_counter()
            while int(seq[0]) <= end.index:  # (the event follows the publish: at most a moment)
                if time.perf_counter() - t0 > 10.0:
                    raise RuntimeError(f"epoch end {end.index} was never published (counter {int(seq[0])})")
                time.sleep(0)
        if int(seq[0]) > end.index + RING:
            raise RuntimeError(f"epoch end {end.index} was overwritten in the ring before it was read")
        r = self.ring_host[end.index % RING].copy()
        ev = None
        eval_s = 0.0
        if end.evaluate:
            tot = self.evaluator.total
            ev = (float(r[4]) / tot, float(r[5]) / tot)
            eval_s = max(0.0, float(r[7]))
        extra = {n: float(r[REPORT + i]) for i, n in enumerate(self.extra)}
        return EpochEndResult((float(r[0]), int(r[1]), int(r[2]), float(r[3])), ev, bool(r[6] != 0.0), None,
                              eval_s, extra)

    def end(self, evaluate: bool, snapshot: bool) -> EpochEnd:
        """Issue an epoch's end eagerly: every device stream joined to this end's stream, the
        device work, every device stream waiting for it, then the host copies and the event."""
        slot = self.count % 2
        self.count += 1
        if snapshot:
            self.ensure_snapshot()
        es = self.stream
        for s, st in self.ctx.streams.items():
            self.join[s].record(st)
            es.wait_event(self.join[s])
        self.issue_device(es, slot, evaluate, snapshot)
        self.done.record(es)
        for st in self.ctx.streams.values():
            st.wait_event(self.done)
        self.issue_host_copies(es, slot, snapshot)
        self.ready[slot].record(es)
        return EpochEnd(self, slot, evaluate, snapshot)

    def _collect(self, end: EpochEnd) -> EpochEndResult:
        self.ready[end.slot].synchronize()
        r = self.report_host[end.slot].copy()
        acc = None
        if self.ex.accumulator is not None:
            acc = (float(r[0]), int(r[1]), int(r[2]), float(r[3]))
        ev = None
        eval_s = 0.0
        if end.evaluate and self.evaluator is not None:
            tot = self.evaluator.total
            ev = (float(r[4]) / tot, float(r[5]) / tot)
            t0, t1 = self.eval_marks[end.slot]
            try:
                eval_s = self.cp.cuda.get_elapsed_time(t0, t1) / 1e3
            except Exception:  # events recorded by a graph that could not time them
                eval_s = 0.0
        params = None
        if end.snapshot:
            params = {n: np.array(a) for n, a in self.snap_host[end.slot].items()}
        extra = {n: float(np.asarray(a).reshape(-1)[0]) for n, a in self.extra_host[end.slot].items()}
        return EpochEndResult(acc, ev, bool(r[6] != 0.0), params, eval_s, extra)


def _record(ev, stream, capturing: bool) -> None:
    """Record `ev` on `stream`; inside a capture as an event record node of the graph
    (cudaEventRecordExternal), so the evaluation's time can be read after a replay."""
    if not capturing:
        ev.record(stream)
        return
    rt = cudart()
    check(rt.cudaEventRecordWithFlags(ev.ptr, int(stream.ptr), rt.cudaEventRecordExternal), "cudaEventRecordWithFlags")


def cp_runtime():
    return cupy_module().cuda.runtime


# -- the epoch in one launch ----------------------------------------------------------------------

def _conditional_support() -> str:
    """'' when the driver and the bindings have conditional WHILE/IF nodes, else why not."""
    rt = cudart()
    try:
        drv = check(rt.cudaDriverGetVersion(), "cudaDriverGetVersion")
    except Exception as exc:
        return f"the CUDA runtime bindings are unusable ({exc})"
    if int(drv) < 12040:
        return f"the driver's CUDA {int(drv) // 1000}.{int(drv) % 1000 // 10} has no conditional graph nodes (12.4+)"
    for name in ("cudaGraphConditionalHandleCreate", "cudaStreamBeginCaptureToGraph", "cudaGraphAddNode",
                 "cudaStreamUpdateCaptureDependencies", "cudaGraphAddChildGraphNode"):
        if not hasattr(rt, name):
            return f"cuda.bindings lacks {name}"
    return ""


def _capture_info(rt, stream_ptr: int):
    """(graph, dependencies) of a capturing stream, across the bindings' 12.x and 13.x forms."""
    r = check(rt.cudaStreamGetCaptureInfo(stream_ptr), "cudaStreamGetCaptureInfo")
    # 12.x: status, id, graph, deps, numDeps; 13.x: status, id, graph, deps, edgeData, numDeps
    graph, deps = r[2], r[3]
    n = int(r[-1])
    return graph, list(deps)[:n] if deps is not None else []


def _add_node(rt, graph, deps, params):
    try:  # 13.x: (graph, deps, edgeData, numDeps, params)
        return check(rt.cudaGraphAddNode(graph, deps, None, len(deps), params), "cudaGraphAddNode")
    except TypeError:  # 12.x: (graph, deps, numDeps, params)
        return check(rt.cudaGraphAddNode(graph, deps, len(deps), params), "cudaGraphAddNode")


def _set_deps(rt, stream_ptr: int, nodes):
    flag = rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies
    try:
        check(rt.cudaStreamUpdateCaptureDependencies(stream_ptr, nodes, None, len(nodes), flag),
              "cudaStreamUpdateCaptureDependencies")
    except TypeError:
        check(rt.cudaStreamUpdateCaptureDependencies(stream_ptr, nodes, len(nodes), flag),
              "cudaStreamUpdateCaptureDependencies")


def _conditional(rt, graph, deps, kind: str, handle, size: int = 1):
    """Add a conditional node of `kind` (While, If, Switch) with `size` bodies to `graph` after
    `deps`; (node, body graph) or, for size > 1, (node, [body graphs])."""
    p = rt.cudaGraphNodeParams()
    p.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
    p.conditional.handle = handle
    p.conditional.type = getattr(rt.cudaGraphConditionalNodeType, f"cudaGraphCondType{kind}")
    p.conditional.size = size
    node = _add_node(rt, graph, deps, p)
    bodies = p.conditional.phGraph_out
    return (node, bodies[0]) if size == 1 else (node, [bodies[i] for i in range(size)])


def _handle_value(h) -> int:
    try:
        return int(h)
    except TypeError:  # pragma: no cover - an older bindings object
        import ctypes

        return ctypes.c_ulonglong.from_address(h.getPtr()).value


def _while_handle(rt, graph):
    """A WHILE node's handle in `graph`, 1 at each launch (cudaGraphCondAssignDefault)."""
    return check(rt.cudaGraphConditionalHandleCreate(graph, 1, getattr(rt, "cudaGraphCondAssignDefault", 1)),
                 "cudaGraphConditionalHandleCreate")


@contextmanager
def _captured_into(rt, stream_ptr: int, graph, deps: list, what: str):
    """Capture what `stream_ptr` is issued meanwhile into `graph` (a conditional node's body),
    after `deps` (cudaStreamBeginCaptureToGraph, relaxed mode)."""
    mode = rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed
    check(rt.cudaStreamBeginCaptureToGraph(stream_ptr, graph, deps or None, None, len(deps), mode),
          f"cudaStreamBeginCaptureToGraph ({what})")
    try:
        yield
    finally:
        check(rt.cudaStreamEndCapture(stream_ptr), f"cudaStreamEndCapture ({what})")


def _node_built(rt, build, upload_stream) -> tuple:
    """(graph, exec): a graph built node by node by `build(graph)` with Python's collector off
    (no CuPy object is freed into a capture), destroyed if `build` raises, then instantiated and
    uploaded on `upload_stream`."""
    gc_was = gc.isenabled()
    gc.disable()
    g = check(rt.cudaGraphCreate(0), "cudaGraphCreate (the epoch graph)")
    try:
        build(g)
    except BaseException:
        rt.cudaGraphDestroy(g)
        raise
    finally:
        if gc_was:
            gc.enable()
    ge = check(rt.cudaGraphInstantiate(g, instantiate_flags()), "cudaGraphInstantiate (the epoch graph)")
    check(rt.cudaGraphUpload(ge, int(upload_stream.ptr)), "cudaGraphUpload")
    return g, ge


class EpochGraph:
    """The steady steps of a plan, looped on the device (module docstring), for one executor.

    ex: the CudaExecutor (capture = step, device-resident data); units: for each slot s of the
    period (loop steps first + s, first + P + s, ...), the CapturedUnit of that step; first: the
    loop step of slot 0 (the plan's unrolled steps minus the period), which the graph's kernels
    are captured with; `start` (set by the caller): the loop step of the first launch;
    ends: the last loop step (exclusive) of each launch, in launch order; home: the stream the
    step units were launched on.  Raises NotImplementedError (why) where conditional nodes are
    unavailable or a capture fails."""

    def __init__(self, ex, units: list, first: int, ends: list[int], home: str, boundary: EpochEnds):
        why = _conditional_support()
        if why:
            raise NotImplementedError(why)
        cp = self.cp = cupy_module()
        self.rt = cudart()
        self.ex, self.units, self.first, self.period = ex, units, int(first), len(units)
        self.start = int(first)  # the loop step of the first launch (the caller sets it)
        self.spe = 1  # steps per epoch: where a launch of several epochs ends one (the caller sets it)
        self.home_name = home
        self.home = ex.ctx.streams[home]
        self.boundary = boundary
        self.loop = cp.array([first, 0], dtype=cp.int32)
        self.ends = cp.array(list(ends) + [0], dtype=cp.int32)
        self.mod = cp.RawModule(code=_COND_SOURCE, options=("-std=c++14",))
        self._if = self.mod.get_function("ss_epoch_if")
        self._next = self.mod.get_function("ss_epoch_next")
        self._step = self.mod.get_function("ss_epoch_step")
        self._arm = self.mod.get_function("ss_epoch_arm")
        self._outer = self.mod.get_function("ss_epoch_outer")
        self._slot = self.mod.get_function("ss_epoch_slot")
        self._after = self.mod.get_function("ss_epoch_after")
        self.has_switch = hasattr(self.rt.cudaGraphConditionalNodeType, "cudaGraphCondTypeSwitch")
        self.unroll_failed = False
        # a SWITCH node where the runtime has one (12.8+), else one IF node per slot
        self.switch = self.period > 1 and hasattr(self.rt.cudaGraphConditionalNodeType, "cudaGraphCondTypeSwitch")
        self.side = cp.cuda.Stream(non_blocking=True)  # the WHILE body is captured here
        self.raw_units = ex.capture_raw(units)  # each slot's step again, as a cudaGraph_t
        self.raw = [cu.graph for cu in self.raw_units]
        if ex.resident is not None:  # the captures' warm-ups ran each gather once: start again at 0
            ex.resident.reset()
        self.execs: dict[tuple, Any] = {}
        self.launches = 0
        cp.cuda.Device().synchronize()

    def _build(self, slot: int, evaluate: bool, snapshot: bool):
        """The executable graph: the WHILE loop, then epoch-end slot `slot`'s work."""
        rt, cp = self.rt, self.cp
        b = self.boundary
        if snapshot:
            b.ensure_snapshot()
        # the outer capture is on the evaluator's home stream (its twins launch there)
        cap = b.ctx.streams[b.ctx.names[0]]
        cptr = int(cap.ptr)
        relaxed = rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed
        gc_was = gc.isenabled()
        gc.disable()
        try:
            check(rt.cudaStreamBeginCapture(cptr, relaxed), "cudaStreamBeginCapture")
            try:
                graph, deps = _capture_info(rt, cptr)
                hw = _while_handle(rt, graph)
                wnode, wbody = _conditional(rt, graph, deps, "While", hw)
                _set_deps(rt, cptr, [wnode])
                sptr = int(self.side.ptr)
                check(rt.cudaStreamBeginCaptureToGraph(sptr, wbody, None, None, 0, relaxed),
                      "cudaStreamBeginCaptureToGraph")
                try:
                    self._capture_iteration(wbody, sptr, hw, 0)
                finally:
                    check(rt.cudaStreamEndCapture(sptr), "cudaStreamEndCapture (the WHILE body)")
                with cp.cuda.using_allocator(self.ex._pool.malloc):
                    b.issue_device(cap, slot, evaluate, snapshot, capturing=True)
                    b.issue_host_copies(cap, slot, snapshot)
            except BaseException:
                try:
                    rt.cudaStreamEndCapture(cptr)
                except Exception:
                    pass
                raise
            g = check(rt.cudaStreamEndCapture(cptr), "cudaStreamEndCapture (the epoch graph)")
        finally:
            if gc_was:
                gc.enable()
        ge = check(rt.cudaGraphInstantiate(g, instantiate_flags()), "cudaGraphInstantiate (the epoch graph)")
        check(rt.cudaGraphUpload(ge, int(self.home.ptr)), "cudaGraphUpload")
        return g, ge

    def _capture_iteration(self, body, sptr: int, hw, mode: int) -> None:
        """Into the loop body `body` being captured on the side stream: one iteration, the step
        of its slot (a SWITCH node, or one IF node per slot), none once ctr[1] is set; then
        k += 1 and the loop's condition `hw` (mode 0: until the launch's end; 1: until the end of
        the epoch)."""
        rt, b = self.rt, self.boundary
        hwv = np.uint64(_handle_value(hw))
        tail = (np.int32(mode), np.int32(self.start), np.int32(self.spe))
        if self.switch:  # one SWITCH node (CUDA 12.8+), its value set by the iteration's one kernel
            hs = check(rt.cudaGraphConditionalHandleCreate(body, 0, 0), "cudaGraphConditionalHandleCreate")
            with self.side:
                self._step((1,), (1,), (np.uint64(_handle_value(hs)), hwv, self.loop, self.ends, b.ctr,
                                        np.int32(self.first), np.int32(self.period)) + tail)
            g2, d2 = _capture_info(rt, sptr)
            snode, sbodies = _conditional(rt, g2, d2, "Switch", hs, size=max(2, self.period))
            for sb, raw in zip(sbodies, self.raw):
                check(rt.cudaGraphAddChildGraphNode(sb, None, 0, raw), "cudaGraphAddChildGraphNode")
            _set_deps(rt, sptr, [snode])
            return
        for s, raw in enumerate(self.raw):  # an IF node per slot, its condition set just before it
            hs = check(rt.cudaGraphConditionalHandleCreate(body, 0, 0), "cudaGraphConditionalHandleCreate")
            with self.side:
                self._if((1,), (1,), (np.uint64(_handle_value(hs)), self.loop, np.int32(self.first),
                                      np.int32(self.period), np.int32(s), b.ctr))
            g2, d2 = _capture_info(rt, sptr)
            inode, ibody = _conditional(rt, g2, d2, "If", hs)
            check(rt.cudaGraphAddChildGraphNode(ibody, None, 0, raw), "cudaGraphAddChildGraphNode")
            _set_deps(rt, sptr, [inode])
        with self.side:
            self._next((1,), (1,), (hwv, self.loop, self.ends, b.ctr) + tail)

    def _build_chunk(self, evaluate: bool):
        """The executable graph of a launch of several epochs, two loops deep, so the per-step
        loop holds only the steps (its iterations cost what a launch of one epoch's do):

            WHILE_outer (default 1) {
                ss_epoch_arm: WHILE_inner = 1 (0 once stopped)
                WHILE_inner { the step of k's slot; k += 1; WHILE_inner = k does not end an epoch }
                the epoch's end, a ring end
                ss_epoch_outer: WHILE_outer = k < ends[j] (else j += 1)
            }

        The top graph is built node by node and the outer body captured on the evaluator's home
        stream (where its work must be captured), the inner body on the side stream."""
        rt, b = self.rt, self.boundary
        cap = b.ctx.streams[b.ctx.names[0]]
        cptr, sptr = int(cap.ptr), int(self.side.ptr)

        def build(g):
            ho = _while_handle(rt, g)
            _onode, obody = _conditional(rt, g, [], "While", ho)
            hi = check(rt.cudaGraphConditionalHandleCreate(obody, 0, 0), "cudaGraphConditionalHandleCreate")
            with _captured_into(rt, cptr, obody, [], "the outer loop"):
                with cap:
                    self._arm((1,), (1,), (np.uint64(_handle_value(hi)), b.ctr))
                g2, d2 = _capture_info(rt, cptr)
                inode, ibody = _conditional(rt, g2, d2, "While", hi)
                _set_deps(rt, cptr, [inode])
                with _captured_into(rt, sptr, ibody, [], "the inner loop"):
                    self._capture_iteration(ibody, sptr, hi, 1)
                self._ring_end(cap, evaluate)
                with cap:
                    self._outer((1,), (1,), (np.uint64(_handle_value(ho)), self.loop, self.ends, b.ctr))

        return _node_built(rt, build, self.home)

    def _ring_end(self, cap, evaluate: bool) -> None:
        """The epoch's ring end, into the graph `cap` (the evaluator's home stream) captures."""
        with self.cp.cuda.using_allocator(self.ex._pool.malloc):
            self.boundary.issue_ring_device(cap, evaluate, capturing=True)

    def prepare(self, variants) -> None:
        """Build the executable graphs of `variants` now, before the run's first step, so no
        instantiation falls inside the measured loop: (slot, evaluate, snapshot) for a launch of
        one epoch with its end after the loop, ("ring", evaluate) for a launch of ring ends.  A
        SWITCH the driver refuses falls back to IF nodes."""
        for v in variants:
            v = self._key(v)
            if v not in self.execs:
                try:
                    self.execs[v] = self._make(v)
                except Exception:
                    if not self.switch:
                        raise
                    self.switch = False
                    self.execs.clear()
                    self.execs[v] = self._make(v)

    def _key(self, v: tuple) -> tuple:
        if v[0] == "ring":
            return ("ring", self._evaluates(v[1]))
        slot, evaluate, snapshot = v
        return (slot, self._evaluates(evaluate), snapshot)

    def unrolls(self) -> bool:
        """Whether a launch of several epochs unrolls each epoch (`_build_unrolled`): SWITCH
        nodes, and at most UNROLL_STEPS step graphs in all (period x steps per epoch); the
        environment's STREAMSCHED_EPOCH_UNROLL=0 says never."""
        return self.has_switch and not self.unroll_failed and self.period * self.spe <= UNROLL_STEPS and \
            os.environ.get("STREAMSCHED_EPOCH_UNROLL", "1") != "0"

    def _make(self, v: tuple):
        if v[0] != "ring":
            return self._build(*v)
        if self.unrolls():
            try:
                return self._build_unrolled(v[1])
            except Exception:  # a driver that refuses the unrolled form: the loop over the steps
                self.unroll_failed = True
                self.cp.cuda.Device().synchronize()
        return self._build_chunk(v[1])

    def _build_unrolled(self, evaluate: bool):
        """The executable graph of a launch of several epochs, each epoch unrolled, so the
        device pays a loop iteration per epoch, not per step:

            WHILE (default 1) {
                ss_epoch_slot: SWITCH = the slot of the epoch's first step (none once stopped)
                SWITCH { body s: the epoch's steps from slot s on, one child graph each, in
                         order; then the epoch's end, a ring end }
                ss_epoch_after: k += spe; WHILE = k < ends[j] (else j += 1)
            }

        The top graph and the bodies are built node by node, the loop's kernels and each ring
        end captured on the evaluator's home stream (where its work must be captured)."""
        rt, b = self.rt, self.boundary
        cap = b.ctx.streams[b.ctx.names[0]]
        cptr = int(cap.ptr)

        def build(g):
            hw = _while_handle(rt, g)
            _wnode, wbody = _conditional(rt, g, [], "While", hw)
            hs = check(rt.cudaGraphConditionalHandleCreate(wbody, 0, 0), "cudaGraphConditionalHandleCreate")
            with _captured_into(rt, cptr, wbody, [], "the epoch loop"):
                with cap:
                    self._slot((1,), (1,), (np.uint64(_handle_value(hs)), self.loop, b.ctr, np.int32(self.first),
                                            np.int32(self.period)))
                g2, d2 = _capture_info(rt, cptr)
                snode, sbodies = _conditional(rt, g2, d2, "Switch", hs, size=max(2, self.period))
                _set_deps(rt, cptr, [snode])
                with cap:
                    self._after((1,), (1,), (np.uint64(_handle_value(hw)), self.loop, self.ends, b.ctr,
                                             np.int32(self.spe)))
            for s0, sb in enumerate(sbodies[:self.period]):
                prev: list = []
                for i in range(self.spe):
                    prev = [check(rt.cudaGraphAddChildGraphNode(sb, prev, len(prev), self.raw[(s0 + i) % self.period]),
                                  "cudaGraphAddChildGraphNode")]
                with _captured_into(rt, cptr, sb, prev, "the epoch's end"):
                    self._ring_end(cap, evaluate)

        return _node_built(rt, build, self.home)

    def _evaluates(self, evaluate: bool) -> bool:
        """Whether an end asked to evaluate does so on the device (it has an evaluator): the
        variant's key, the same at `prepare` and `launch`."""
        return bool(evaluate) and self.boundary.evaluator is not None

    def launch(self, evaluate: bool, snapshot: bool, pre_waits=()) -> EpochEnd:
        """One epoch: the next launch's steps and its end, one graph launch on the step units'
        home stream; the end's event recorded after it."""
        b = self.boundary
        slot = b.count % 2
        b.count += 1
        evaluate = self._evaluates(evaluate)
        key = (slot, evaluate, snapshot)
        if key not in self.execs:
            self.execs[key] = self._make(key)
        home = self.home
        for ev in pre_waits:
            home.wait_event(ev)
        check(self.rt.cudaGraphLaunch(self.execs[key][1], int(home.ptr)), "cudaGraphLaunch (the epoch graph)")
        cap = b.ctx.streams[b.ctx.names[0]]
        if cap is not home:  # the end was captured as if on the evaluator's stream: order it
            b.done.record(home)
            cap.wait_event(b.done)
        b.ready[slot].record(home)
        self.launches += 1
        return EpochEnd(b, slot, evaluate, snapshot)

    def launch_epochs(self, n: int, evaluate: bool) -> list[RingEnd]:
        """The next launch: n epochs, each ending in a ring end (the loop plan's `ends` says
        where the launch stops); one graph launch, one blocking event after it."""
        b = self.boundary
        key = ("ring", self._evaluates(evaluate))
        if key not in self.execs:
            self.execs[key] = self._make(key)
        check(self.rt.cudaGraphLaunch(self.execs[key][1], int(self.home.ptr)), "cudaGraphLaunch (the epoch graph)")
        ev = b.next_ring_event()
        ev.record(self.home)
        ends = [RingEnd(b, b.ring_count + i, key[1], ev) for i in range(n)]
        b.ring_count += n
        self.launches += 1
        return ends

    def close(self) -> None:
        rt = self.rt
        for g, ge in self.execs.values():
            rt.cudaGraphExecDestroy(ge)
            rt.cudaGraphDestroy(g)
        self.execs.clear()
        for raw in self.raw:
            rt.cudaGraphDestroy(raw)
        self.raw, self.raw_units = [], []


def steady_units(ex, segs, first: int, period: int):
    """(the CapturedUnit of each steady slot (loop steps first .. first + period - 1), their home
    stream) when every such step is one graph launch, all on one home stream, with nothing else
    but records and waits that the home stream's order already gives; else NotImplementedError
    naming what is in the way.  A device wait for an event that only the host records (the
    staging's, dropped with device-resident data) waits for nothing: it is ignored."""
    from streamsched.interp.ir import HOST

    dev_recorded = {i.event for i in ex.plan.instrs if i.op == "record" and i.stream != HOST}
    event_id = {id(ev): n for n, ev in enumerate(ex.events)}
    units = []
    progs = [ex.compile(segs.for_step(k)) for k in range(first, first + period)]
    graphs = [[op for op in p.ops if op[0] == "graph"] for p in progs]
    if any(len(g) != 1 for g in graphs):
        k = first + next(i for i, g in enumerate(graphs) if len(g) != 1)
        raise NotImplementedError(f"step {k} is not one graph launch")
    home = graphs[0][0][1].home
    home_stream = ex.ctx.streams[home]
    for i, (p, g) in enumerate(zip(progs, graphs)):
        cu = g[0][1]
        if cu.home != home:
            raise NotImplementedError("the steady steps launch on different streams")
        for op in p.ops:
            if op[0] == "graph" or op[0] == "record":
                continue  # a record outside the unit: the end joins every stream after the epoch
            if op[0] == "wait" and (op[1] is home_stream or event_id.get(id(op[2])) not in dev_recorded):
                continue  # ordered by the home stream itself, or waits for a host-only event
            raise NotImplementedError(f"step {first + i} issues `{op[0]}` outside its graph")
        units.append(cu)  # (its pre_waits: events recorded on streams whose only work is the graphs
        # launched on home, so home's order holds them)
    return units, home
