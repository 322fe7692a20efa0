"""What a backend's runner reports to the loop: a failed task, and one epoch's losses (read once,
at its end).  A leaf module: the CPU and CUDA runners and the loop all import it, it imports
neither (no train <-> cuda.runner cycle)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from streamsched.interp.ir import Task


class TaskFailedError(Exception):
    """A kernel failed at run time (any backend); `task` is the Task, `cause` the exception."""

    def __init__(self, task: Task, cause: BaseException):
        super().__init__(f"{task.label or task.kernel}: {cause}")
        self.task = task
        self.cause = cause


@dataclass
class EpochLosses:
    """The per-step losses of one epoch as the loop reads them, once, at its end (issue 13: no
    host synchronization inside an epoch): `values` when the backend kept each step's value (the
    CPU), else only their sum (the CUDA backend sums them on the device).  bad_step: the first
    step (1-based, in this epoch) whose loss was not finite, with its value; None when all were."""

    total: float = 0.0
    steps: int = 0
    bad_step: int | None = None
    bad_value: float = float("nan")
    values: list[float] | None = None

    @property
    def mean(self) -> float:
        return self.total / self.steps if self.steps else float("nan")

    def __len__(self) -> int:
        return self.steps

    @classmethod
    def of(cls, values: list[float]) -> "EpochLosses":
        bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
        finite = [v for v in values if math.isfinite(v)]
        return cls(float(np.sum(finite)) if finite else 0.0, len(values), None if bad is None else bad + 1,
                   values[bad] if bad is not None else float("nan"), list(values))

