"""The data path of a run: the train block's data source loaded and checked against the model's
inputs (X003), batched in the seeded epoch order (`data.Batches`), and staged: each step's host
`stage` task copies its batch from a view of its epoch's samples, gathered ahead of time by one
background thread (issue 13: the host waits only on the copy that last read a slot)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from streamsched.interp.data import Batches, check_compatible, load_dataset
from streamsched.interp.distributed import shard
from streamsched.interp.ir import Task
from streamsched.stdlib.kernels import numpy_dtype

DATA_HINT = 1e6
"""Training features beyond this magnitude get a note on a divergence (X010): inputs of a network
are scaled to about [-1, 1] (raw pixels to 255, raw audio to 32768), and one far larger can blow
up the loss at any rate."""


def _input_names(program) -> tuple[str, str]:
    """(features, labels): the model's input names."""
    m = program.model
    lab = m.labels
    feat = next((nm for nm, _, _ in m.inputs if nm != lab), m.inputs[0][0])
    return feat, lab


def _fit_samples(ds, in_shape):
    """Samples with as many values as the model's input but another shape (the flat 8x8 digits
    for an NHWC `f32[batch, 8, 8, 1]` input) are reshaped, row-major; others are left for
    `check_compatible` to report."""
    want = tuple(in_shape[1:])
    if ds.sample_shape == want or int(np.prod(ds.sample_shape)) != int(np.prod(want)):
        return ds
    return replace(ds, x_train=ds.x_train.reshape((-1,) + want), x_test=ds.x_test.reshape((-1,) + want))


class DataPath:
    """The data of one run of `program`: `ds` (the dataset, train and test splits), `batches`
    (the seeded epoch order), `spe` (steps per epoch), `classes` (the logits' width), `feat`
    (the features' input name).  `stage` fills a host `stage` task's pinned slot with the batch
    of a step of the run; epochs are numbered absolutely (a resume goes on with its order).

    data: (source name, args, kwargs) of the train block; base_dir: the folder its paths are
    relative to; spans: the train block's spans (errors point at `data = ...`); limit: bytes the
    data may hold.  Raises StreamschedError X003 for data that does not fit the model."""

    def __init__(self, program, data: tuple, base_dir: str, spans: dict, seed: int, limit: int | None,
                 world: int = 1, rank: int = 0):
        m = program.model
        dname, dargs, dkw = data
        feat, lab = _input_names(program)
        in_shape = next(s for n, s, _ in m.inputs if n == feat)
        ds = load_dataset(dname, dargs, dkw, base_dir=base_dir, span=spans.get("data"), limit=limit,
                          sample_shape=tuple(in_shape[1:]))
        lab_dtype = next((d for n, _, d in m.inputs if n == lab), "i32")
        self.classes = dict((b.name, b.shape) for b in program.buffers).get(m.logits, (0, 0))[-1]
        ds = _fit_samples(ds, in_shape)
        check_compatible(ds, in_shape, lab_dtype, self.classes, spans.get("data"))
        self.ds, self.feat = ds, feat
        # data parallel: a step draws one global batch of world * B samples; rank r trains on its
        # rows [r B, (r + 1) B) (distributed.shard), the same split on every rank
        self.world, self.rank = world, rank
        self.batches = Batches(ds.x_train, ds.y_train, m.batch * world, seed, span=spans.get("data"),
                               epoch_samples=ds.epoch_samples)
        self.spe = self.batches.steps_per_epoch
        dt = {n: d for n, _, d in m.inputs}
        self.x_dtype, self.y_dtype = numpy_dtype(dt.get(feat, "f32")), numpy_dtype(dt.get(lab, "i32"))
        self.start_epoch = 0
        self.local_total = 0
        self.last_epoch = 0
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._ahead = None
        self._ahead_epoch = -1

    def plan(self, start_epoch: int, epochs: int) -> None:
        """This run trains epochs start_epoch .. epochs - 1 (absolute, from 0)."""
        self.start_epoch = start_epoch
        self.local_total = max(0, epochs - start_epoch) * self.spe
        self.last_epoch = start_epoch + max(epochs - start_epoch, 1) - 1

    def stage(self, task: Task, out: np.ndarray, at: int, rank: int | None = None) -> None:
        """The host work of `stage` task `task` issued by step `at` of this run (from 0; its
        `ahead` attribute says which later step's batch it prefetches): that batch's field (rank
        `rank`'s shard of it; None: this process's rank), cast into the pinned slot `out`."""
        self.stager(task, out)(at, rank)

    def stager(self, task: Task, out: np.ndarray):
        """`stage` for one task and its slot, as a call (at, rank) with the task's attributes
        read once."""
        ahead, feat = task.attr("ahead", 0), task.attr("field") == self.feat
        batch_at, copyto = self.batch_at, np.copyto

        def stage(at: int, rank: int | None) -> None:
            xb, yb = batch_at(at + ahead)
            if self.world > 1:
                xb, yb = shard(xb, yb, self.rank if rank is None else rank, self.world)
            copyto(out, xb if feat else yb, casting="unsafe")
        return stage

    def batch_at(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """The batch of step j of this run (a prefetch past the end repeats the last batch): views
        of its epoch's samples, gathered in batch order ahead of time (`epoch_arrays`)."""
        j = min(j, self.local_total - 1) if j >= self.local_total else j
        e, i = divmod(j, self.spe)
        xs, ys = self.epoch_arrays(e + self.start_epoch)
        b = self.batches.batch
        return xs[i * b:(i + 1) * b], ys[i * b:(i + 1) * b]

    def gather(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch e's samples in its batch order, cast to the model's input dtypes once."""
        order = self.batches.order(e)
        return self.batches.x.take(order, axis=0).astype(self.x_dtype, copy=False), \
            self.batches.y.take(order, axis=0).astype(self.y_dtype, copy=False)

    def epoch_arrays(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch e's gathered samples.  Host staging runs ahead (issue 13): while epoch e trains,
        one background thread gathers epoch e + 1, so a step's host work is a copy from a view into
        its pinned slot."""
        cache = self._epochs
        if e not in cache:
            fut = self._ahead
            cache[e] = fut.result() if fut is not None and self._ahead_epoch == e else self.gather(e)
            for old in [k for k in cache if k < e]:
                del cache[old]
            if e + 1 <= self.last_epoch:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="staging")
                self._ahead, self._ahead_epoch = self._pool.submit(self.gather, e + 1), e + 1
        return cache[e]

    def outlier(self) -> tuple[float, tuple[int, ...]] | None:
        """The largest training feature and its index when it is over DATA_HINT in magnitude, the
        scale past which the data, not the rate, is the likely cause of a blow-up."""
        x = self.ds.x_train
        if x.size == 0:
            return None
        with np.errstate(invalid="ignore"):
            flat = np.abs(x.reshape(-1))
            i = int(np.nanargmax(flat)) if np.isfinite(flat).any() else 0
        v = float(flat[i])
        if not v > DATA_HINT:
            return None
        return float(x.reshape(-1)[i]), tuple(int(j) for j in np.unravel_index(i, x.shape))

    def close(self) -> None:
        """Stop the staging thread (it may be gathering an epoch nobody will run)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
