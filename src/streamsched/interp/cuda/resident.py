"""Device-resident data (issue 13), the CUDA side: the training set uploaded once, the epoch
order as a device permutation, per-step tables of the uploaded scalars (learning rate, step
count), and the twins that replace the plan's host-to-device copies (`interp/resident.py` says
which): each gathers its step's batch (or value) on the device at the index its own device
counter gives, then advances the counter, both on the copy's stream, captured into its graph.

Memory: x [N, ...] in the model input's dtype, y [N, ...], the permutation (int32 [rows,
steps_per_epoch * batch]: every epoch's order, uploaded at the start, when they fit
ORDERS_BYTES; else two rows, the epoch in progress and the next one, which the last step's
prefetch reads), one f32/f64 table of `steps` values per scalar, one int32 counter per
copy.  `DEVICE_SHARE` of the free device memory is the most `auto` holds.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from streamsched.interp.cuda.device import cupy_module
from streamsched.interp.resident import Gather, ResidentPlan

DEVICE_SHARE = 0.25
"""`--data-on auto` holds the training set on the device when it (with its permutation and
tables) takes at most this share of the device memory free before the run's arenas are made."""

_SOURCE = r"""
__device__ long long ss_res_index(const int* cnt, int s, int period, int ahead, long long total) {
    long long j = (long long)s + (long long)cnt[0] * period + ahead;
    if (j > total - 1) j = total - 1;   // a prefetch past the end repeats the last batch
    if (j < 0) j = 0;
    return j;
}

template <typename T>
__device__ void gather(const T* src, T* dst, const int* perm, const int* cnt, long long row, int batch, int s,
                       int period, int ahead, long long total, int spe, int halves) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (long long)batch * row) return;
    long long j = ss_res_index(cnt, s, period, ahead, total);
    long long e = j / spe, i = j % spe;
    long long r = k / row, c = k % row;
    long long sample = perm[(e % halves) * (long long)spe * batch + i * batch + r];
    dst[k] = src[sample * row + c];
}
extern "C" __global__ void ss_res_gather_b2(const unsigned short* a, unsigned short* b, const int* p, const int* c,
        long long row, int n, int s, int period, int ahead, long long total, int spe, int h) {
    gather(a, b, p, c, row, n, s, period, ahead, total, spe, h);
}
extern "C" __global__ void ss_res_gather_b4(const unsigned int* a, unsigned int* b, const int* p, const int* c,
        long long row, int n, int s, int period, int ahead, long long total, int spe, int h) {
    gather(a, b, p, c, row, n, s, period, ahead, total, spe, h);
}
extern "C" __global__ void ss_res_gather_b8(const unsigned long long* a, unsigned long long* b, const int* p,
        const int* c, long long row, int n, int s, int period, int ahead, long long total, int spe, int h) {
    gather(a, b, p, c, row, n, s, period, ahead, total, spe, h);
}

template <typename T>
__device__ void scalar(const T* table, T* dst, const int* cnt, int s, int period, long long total) {
    dst[0] = table[ss_res_index(cnt, s, period, 0, total)];
}
extern "C" __global__ void ss_res_scalar_b4(const unsigned int* t, unsigned int* d, const int* c, int s, int period,
        long long total) { scalar(t, d, c, s, period, total); }
extern "C" __global__ void ss_res_scalar_b8(const unsigned long long* t, unsigned long long* d, const int* c, int s,
        int period, long long total) { scalar(t, d, c, s, period, total); }

extern "C" __global__ void ss_res_next(int* cnt) { cnt[0] += 1; }
"""


ORDERS_BYTES = 64 << 20
"""The sample orders of every epoch of a run are uploaded at its start when they take at most
this many bytes (int32 [epochs, steps_per_epoch * batch]); else two rows are held, and each
epoch's end uploads a later epoch's order (cuda/epoch.EpochEnds.set_order)."""


def order_rows(spe: int, batch: int, steps: int) -> int:
    """Rows of the permutation: every epoch of the run (a prefetch past its end reads the last
    epoch), or 2 when that would exceed ORDERS_BYTES."""
    epochs = -(-max(int(steps), 1) // max(int(spe), 1))
    return epochs if epochs > 2 and 4 * epochs * spe * batch <= ORDERS_BYTES else 2


def resident_bytes(x: np.ndarray, y: np.ndarray, x_dtype, y_dtype, batch: int, spe: int, steps: int,
                   scalars: int) -> int:
    """Device bytes ResidentData needs for training samples x, labels y (cast to the model's
    dtypes), `spe` steps of `batch` per epoch, a run of `steps` steps and `scalars` tables."""
    return (x.size * np.dtype(x_dtype).itemsize + y.size * np.dtype(y_dtype).itemsize
            + 4 * order_rows(spe, batch, steps) * spe * batch + 8 * max(steps, 1) * scalars)


class ResidentData:
    """The training set on the device for one run: rp (interp.resident.ResidentPlan), x, y (the
    training split, [N, ...], already in the model inputs' dtypes), feat (the features' input
    name: a gather of another field copies y), batch, spe (steps per epoch), steps (the run's
    steps; later ones repeat its last batch).  `twin(gather)` is the CUDA twin an executor binds
    to the gather's task; `set_epoch` uploads an epoch's order, `fill_scalars` the tables,
    `reset` zeroes the counters (after the executor's warm-up ran the twins once)."""

    def __init__(self, rp: ResidentPlan, x: np.ndarray, y: np.ndarray, feat: str, batch: int, spe: int, steps: int):
        cp = self.cp = cupy_module()
        self.rp, self.feat, self.batch, self.spe, self.steps = rp, feat, int(batch), int(spe), max(int(steps), 1)
        self.halves = order_rows(self.spe, self.batch, self.steps)
        self.stream = cp.cuda.Stream(non_blocking=True)  # uploads and fills: never the legacy stream
        with self.stream:
            self.x = cp.asarray(np.ascontiguousarray(x))
            self.y = cp.asarray(np.ascontiguousarray(y))
            self.perm = cp.zeros((self.halves, self.spe * self.batch), dtype=cp.int32)
        self.stream.synchronize()
        self.tables: dict[str, Any] = {}
        self.counters: dict[int, Any] = {}
        self.mod = cp.RawModule(code=_SOURCE, options=("-std=c++14",))
        self.nexts = self.mod.get_function("ss_res_next")

    def twin(self, g: Gather) -> Callable:
        """The twin `fn(ctx, stream, ins, outs, attrs)` of gather g: its output is the copy's
        destination (its input, the pinned slot, is not read)."""
        cp = self.cp
        if g.task not in self.counters:
            with self.stream:
                self.counters[g.task] = cp.zeros((1,), dtype=cp.int32)
            self.stream.synchronize()
        cnt = self.counters[g.task]
        period = self.rp.period
        if g.kind == "field":
            src = self.x if g.name == self.feat else self.y
            width = src.dtype.itemsize
            if width not in (2, 4, 8):
                raise NotImplementedError(f"a {src.dtype} input cannot be gathered")
            fn = self.mod.get_function(f"ss_res_gather_b{width}")
            row = int(np.prod(src.shape[1:])) if src.ndim > 1 else 1

            def gather_cuda(ctx, stream, ins, outs, attrs):
                dst = outs[0]
                if dst.dtype != src.dtype or dst.size != self.batch * row:
                    raise ValueError(f"{g.name}: a batch of {dst.size} {dst.dtype} values from resident "
                                     f"{src.dtype} rows of {row}")
                n = self.batch * row
                with ctx.stream(stream):
                    fn(((n + 255) // 256,), (256,), (src, dst, self.perm, cnt, np.int64(row), np.int32(self.batch),
                                                     np.int32(g.step), np.int32(period), np.int32(g.ahead),
                                                     np.int64(self.steps), np.int32(self.spe), np.int32(self.halves)))
                    self.nexts((1,), (1,), (cnt,))
            return gather_cuda

        def scalar_cuda(ctx, stream, ins, outs, attrs):
            dst = outs[0]
            table = self.tables.get(g.name)
            if table is None or table.dtype != dst.dtype:
                raise ValueError(f"no {dst.dtype} table for the scalar `{g.name}`")
            fn = self.mod.get_function(f"ss_res_scalar_b{dst.dtype.itemsize}")
            with ctx.stream(stream):
                fn((1,), (1,), (table, dst, cnt, np.int32(g.step), np.int32(period), np.int64(self.steps)))
                self.nexts((1,), (1,), (cnt,))
        return scalar_cuda

    def table_for(self, name: str, dtype) -> None:
        """Allocate the per-step table of scalar `name` in `dtype` (before capture)."""
        if name not in self.tables:
            if np.dtype(dtype).itemsize not in (4, 8):
                raise NotImplementedError(f"a {np.dtype(dtype)} scalar `{name}` cannot be uploaded from a table")
            with self.stream:
                self.tables[name] = self.cp.zeros((self.steps,), dtype=dtype)
            self.stream.synchronize()

    def fill_scalars(self, value: Callable[[str, int], float]) -> None:
        """Every table: value(name, j) for each step j of this run (from 0)."""
        for name, t in self.tables.items():
            t.set(np.array([value(name, j) for j in range(self.steps)], dtype=t.dtype), stream=self.stream)
        self.stream.synchronize()

    def set_epoch(self, e: int, order: np.ndarray) -> None:
        """The order of this run's epoch e (from 0; samples by index into x) into its half of the
        permutation.  The device must be idle for that half: the loop calls it before the run,
        and at the start of an epoch for the next one (the half of the epoch before, finished)."""
        n = self.spe * self.batch
        self.perm[e % self.halves].set(np.ascontiguousarray(np.asarray(order)[:n], dtype=np.int32), stream=self.stream)
        self.stream.synchronize()

    def reset(self) -> None:
        with self.stream:
            for c in self.counters.values():
                c.fill(0)
        self.stream.synchronize()
