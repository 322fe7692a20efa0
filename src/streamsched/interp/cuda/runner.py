"""The CUDA backend behind the training loop's small interface (run / read / write / sync /
epoch_losses / last_loss / device_evaluator), the twin of `training.runners.CpuRunner`."""

from __future__ import annotations

import numpy as np

from streamsched.interp.cuda.executor import CudaExecutor, CudaTaskError
from streamsched.interp.training.losses import EpochLosses, TaskFailedError


class CudaRunner:
    """Runs a compiled program's EventPlan on the GPU in its capture mode (none | graphs | step).

    resident: the training set held on the device (`--data-on`), or None.
    read(name) -> ndarray waits for every stream first; a kernel or capture failure becomes
    `training.losses.TaskFailedError` naming the task (and so its .sched line)."""

    name = "cuda"

    def __init__(self, compiled, resident=None):
        m = compiled.program.model
        self.loss = m.loss if m is not None else None
        self.resident = resident  # cuda.resident.ResidentData, or None: host staging
        self.ex = CudaExecutor(compiled.schedule, compiled.plan, compiled.program.kernels,
                               capture=compiled.schedule.capture, accumulate=self.loss, resident=resident)
        self.races: list = []  # the CUDA backend has no run-time detector: the CPU backend is the oracle
        self._loss_tasks = frozenset(t.id for t in compiled.schedule.tasks if self.loss in t.outs)
        self._values: list[float] = []  # per-step losses, only when the device cannot sum them
        self.ends = None  # cuda.epoch.EpochEnds, once the loop sets them up
        self.graph = None  # cuda.epoch.EpochGraph: the epoch in one launch

    def _wrap(self, fn, *args):
        try:
            return fn(*args)
        except CudaTaskError as e:
            if e.task is None:
                raise
            raise TaskFailedError(e.task, e) from e

    def run(self, instrs, host_fn) -> None:
        """Issue one step; returns without waiting for the device (the loss is summed there)."""
        self._wrap(self.ex.run, instrs, host_fn)
        if self.ex.accumulator is None and any(i.op == "launch" and i.task in self._loss_tasks for i in instrs):
            self._values.append(float(self.read(self.loss)))  # an f16 loss: read per step

    def epoch_losses(self):
        """The losses of the steps issued since the last call: one synchronize and one 32-byte
        read per epoch (the device-side sum, `LossAccumulator`)."""
        acc = self.ex.accumulator
        if acc is None:
            vals, self._values = self._values, []
            return EpochLosses.of(vals)
        self._wrap(self.ex.synchronize)
        total, steps, bad, value = acc.take(self.ex.ctx.streams[self.ex.ctx.names[0]])
        return EpochLosses(total, steps, bad if bad >= 0 else None, value)

    # -- epoch ends without a host synchronization (cuda/epoch.py) --------------------------

    def setup_epoch_ends(self, check: list[str], saved: list[str], extra: list[str], evaluator=None) -> None:
        """Allocate the epoch ends (before the first step): `check` the arrays tested for
        inf/NaN at every end, `saved` what a snapshot copies, `extra` scalars always reported,
        `evaluator` a DeviceEvaluator run inside an end when asked (else None)."""
        from streamsched.interp.cuda.epoch import EpochEnds

        self.ends = EpochEnds(self.ex, check, saved, extra, resident=self.resident)
        if evaluator is not None and getattr(evaluator, "where", "") == "device":
            self.ends.set_evaluator(evaluator)

    def end_epoch(self, evaluate: bool, snapshot: bool, order=None):
        """Issue the end of the epoch just issued (no wait): an `epoch.EpochEnd` whose `result()`
        the loop reads later.  order: the sample order a resident run uploads at this end (the
        epoch two ends later, `EpochEnds.set_order`), or None."""
        b = self.ends
        values, self._values = self._values, []
        if b.uses_ring(snapshot):  # one captured end, its report published to the ring
            end = self._wrap(b.ring_end, evaluate and b.evaluator is not None)
        else:
            b.set_order(order)
            end = self._wrap(b.end, evaluate and b.evaluator is not None, snapshot)
        end.values = values
        return end

    def prepare_ends(self, evaluates) -> list[str]:
        """Capture the ring ends the run will issue (each `evaluate` flag of `evaluates`) now,
        before the first step, so none is captured inside the loop.  Where a capture fails, the
        ends are issued eagerly, as before ring ends (`EpochEnds.end`): the notes saying so."""
        b = self.ends
        if b is None or not b.ring_ok:
            return []
        try:
            for ev in dict.fromkeys(bool(e) and b.evaluator is not None for e in evaluates):
                b.ring_graph(ev)
        except Exception as exc:
            b.ring_ok = False
            self.ex.cp.cuda.Device().synchronize()
            return [f"the epoch ends are issued eagerly: capturing one failed ({type(exc).__name__}: {exc})"]
        return []

    def ring_ends(self, snapshot: bool) -> bool:
        """Whether an end (with a snapshot or not) is a ring end, which a launch of several
        epochs needs (`run_epochs`)."""
        return self.ends is not None and self.ends.uses_ring(snapshot)

    def epoch_graph(self, segs, start: int, ends: list[int], spe: int = 1):
        """Build the epoch in one launch (cuda/epoch.EpochGraph) for launches ending at `ends`
        (loop steps, exclusive), the first launch starting at loop step `start`, epochs of `spe`
        steps; raises NotImplementedError (why) where it cannot."""
        from streamsched.interp.cuda.epoch import EpochGraph, steady_units

        if self.ex.capture != "step" or self.resident is None:
            raise NotImplementedError("the epoch runs in one launch only with capture = step and "
                                      "device-resident data")
        if self.ex.accumulator is None:
            raise NotImplementedError("the loss is not summed on the device")
        period = segs.period or 1
        units, home = steady_units(self.ex, segs, segs.steps - period, period)
        # slot s of the graph is loop step (segs.steps - period) + s modulo the period
        g = EpochGraph(self.ex, units, segs.steps - period, ends, home, self.ends)
        g.start, g.spe = start, max(1, int(spe))
        g.loop.set(np.array([start, 0], dtype=np.int32))
        self.ex.cp.cuda.Device().synchronize()
        self.graph = g
        return g

    def run_epochs(self, n: int, evaluate: bool, snapshot: bool, order=None) -> list:
        """One launch of the epoch graph: n epochs (their steps and ends, ring ends, one per
        epoch), or one epoch with its end after the loop where its end cannot be a ring end
        (a snapshot, an order to upload, extra scalars); a list of ends, in epoch order."""
        b = self.ends
        if b.uses_ring(snapshot):
            ends = self._wrap(self.graph.launch_epochs, n, evaluate)
        else:
            if n != 1:
                raise ValueError("a launch of several epochs needs ring ends")
            b.set_order(order)
            ends = [self._wrap(self.graph.launch, evaluate, snapshot)]
        for end in ends:
            end.values = []
        return ends

    def device_evaluator(self, program, x: np.ndarray, y: np.ndarray):
        """The test split (x, y) evaluated on the GPU (`cuda.evaluate.DeviceEvaluator`: the eval
        forward captured as one graph per batch, one read per evaluation); eager launches when
        the capture fails.  Raises NotImplementedError when the eval forward cannot run on the
        device (the loop then evaluates in NumPy)."""
        from streamsched.interp.cuda.evaluate import DeviceEvaluator

        try:
            return DeviceEvaluator(self.ex, program, x, y)
        except NotImplementedError:
            raise
        except Exception as exc:  # a capture failure: the same work, launched eagerly
            try:
                ev = DeviceEvaluator(self.ex, program, x, y, capture=False)
            except NotImplementedError:
                raise
            except Exception as exc2:
                raise NotImplementedError(f"the eval forward failed on the device ({exc2})") from None
            import sys

            print(f"note: the eval forward could not be captured ({type(exc).__name__}: {exc}); it is launched "
                  "eagerly", file=sys.stderr)
            return ev

    def read(self, name: str) -> np.ndarray:
        return np.array(self._wrap(self.ex.get, name))

    def last_loss(self, name: str) -> float:
        """The loss the latest step computed: `read` waits for every stream, so it is that step's."""
        return float(self.read(name))

    def write(self, name: str, value) -> None:
        self.ex.set(name, value)

    def sync(self) -> None:
        self.ex.synchronize()
