"""The CUDA backend behind the training loop's small interface (run / read / write / sync /
last_loss), the twin of `train.CpuRunner`."""

from __future__ import annotations

import numpy as np

from streamsched.interp.cuda.executor import CudaExecutor, CudaTaskError


class CudaRunner:
    """Runs a compiled program's EventPlan on the GPU in its capture mode (none | graphs | step).

    read(name) -> ndarray waits for every stream first; a kernel or capture failure becomes
    `train.TaskFailedError` naming the task (and so its .sched line)."""

    name = "cuda"

    def __init__(self, compiled):
        self.ex = CudaExecutor(compiled.schedule, compiled.plan, compiled.program.kernels,
                               capture=compiled.schedule.capture)
        self.races: list = []  # the CUDA backend has no run-time detector: the CPU backend is the oracle

    def _wrap(self, fn, *args):
        from streamsched.interp.train import TaskFailedError

        try:
            return fn(*args)
        except CudaTaskError as e:
            if e.task is None:
                raise
            raise TaskFailedError(e.task, e) from e

    def run(self, instrs, host_fn) -> None:
        self._wrap(self.ex.run, instrs, host_fn)

    def read(self, name: str) -> np.ndarray:
        return np.array(self._wrap(self.ex.get, name))

    def last_loss(self, name: str) -> float:
        """The loss the latest step computed: `read` waits for every stream, so it is that step's."""
        return float(self.read(name))

    def write(self, name: str, value) -> None:
        self.ex.set(name, value)

    def sync(self) -> None:
        self.ex.synchronize()
