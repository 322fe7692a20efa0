"""Learning-rate schedules for the `train` block: `lr = cosine(0.1, warmup = 50)` becomes a pure
function from the global step t (0-based) to a float, uploaded to the device every step.

Formulas (v: peak rate, T: total_steps, W: warmup steps, p: decay progress)::

    constant(v)                       lr(t) = v
    step(v, every = N, gamma = 0.1)   lr(t) = v * gamma ** (t // N)
    warmup, W > 0, for t < W          lr(t) = v * (t + 1) / W      (v/W at t = 0, v at t = W-1)
    after warmup                      p = min(1, (t - W) / (T - W))
    cosine(v, warmup = 0, min = 0.0)  lr(t) = min + (v - min) * (1 + cos(pi * p)) / 2
    linear(v, warmup = 0)             lr(t) = v * (1 - p)

The cosine branch is the annealing curve of SGDR (Loshchilov & Hutter, "SGDR: Stochastic
Gradient Descent with Warm Restarts", ICLR 2017, eq. 5) without restarts, the same formula as
PyTorch's `torch.optim.lr_scheduler.CosineAnnealingLR` with T_max = T - W and eta_min = min:
it equals v at t = W, (v + min) / 2 halfway, and min at t = T (and stays there after).
Bad names or arguments are StreamschedError X004.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.interp.data import REQUIRED, _did_you_mean, _is_int, _is_number, bind_args
from streamsched.interp.ir import Span

_PARAMS: dict[str, tuple[tuple[str, Any], ...]] = {
    "constant": (("v", REQUIRED),),
    "step": (("v", REQUIRED), ("every", REQUIRED), ("gamma", 0.1)),
    "cosine": (("v", REQUIRED), ("warmup", 0), ("min", 0.0)),
    "linear": (("v", REQUIRED), ("warmup", 0)),
}
SCHEDULES = tuple(_PARAMS)
"""The schedule names `make_schedule` knows."""


@dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule: `sched(t)` is the rate at global step t (0-based), a float.

    name: a key of `SCHEDULES`; params: the bound arguments as (name, value) pairs;
    total_steps: the run's length T (epochs * steps per epoch).
    """

    name: str
    params: tuple[tuple[str, Any], ...]
    total_steps: int

    def __call__(self, t: int) -> float:
        if t < 0:
            raise ValueError(f"learning-rate schedule asked for step {t}")
        p = dict(self.params)
        v = float(p["v"])
        if self.name == "constant":
            return v
        if self.name == "step":
            return v * float(p["gamma"]) ** (t // int(p["every"]))
        w = int(p["warmup"])
        if t < w:
            return v * (t + 1) / w
        progress = min(1.0, (t - w) / max(1, self.total_steps - w))
        if self.name == "cosine":
            lo = float(p["min"])
            return lo + (v - lo) * (1.0 + math.cos(math.pi * progress)) / 2.0
        return v * (1.0 - progress)  # linear

    def __str__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.params)})"


def _err(message: str, span: Span | None, help: str = "") -> StreamschedError:
    return StreamschedError([Diagnostic("X004", message, span=span, help=help)])


def make_schedule(name: str, args: tuple, kwargs: dict, total_steps: int, span: Span | None = None) -> Schedule:
    """Build the schedule `name(*args, **kwargs)` for a run of total_steps steps.

    args/kwargs: the literal arguments from the `lr = ...` line; span: that line, put on every
    diagnostic.  Returns a `Schedule` (callable: step -> float).  Raises StreamschedError X004 for
    an unknown name, an unknown/missing/repeated argument, or a value out of range (v < 0,
    every < 1, gamma <= 0, warmup < 0 or > total_steps, min outside [0, v]).
    """
    if name not in _PARAMS:
        raise _err(f"unknown learning-rate schedule `{name}`; known: {', '.join(SCHEDULES)}", span,
                   help=f"{_did_you_mean(name, SCHEDULES)}e.g. `lr = cosine(0.1, warmup = 50)`")
    a = bind_args(name, _PARAMS[name], args, kwargs, span)
    if not _is_int(total_steps) or total_steps < 1:
        raise _err(f"the run has {total_steps} steps; a learning-rate schedule needs at least 1", span,
                   help="check `epochs` and the batch size")
    if not _is_number(a["v"]) or a["v"] < 0:
        raise _err(f"{name}: the learning rate must be a non-negative number, got {a['v']!r}", span)
    if name == "step":
        if not _is_int(a["every"]) or a["every"] < 1:
            raise _err(f"step: `every` must be a positive whole number of steps, got {a['every']!r}", span,
                       help="e.g. `step(0.1, every = 1000, gamma = 0.1)`")
        if not _is_number(a["gamma"]) or a["gamma"] <= 0:
            raise _err(f"step: `gamma` must be a positive number, got {a['gamma']!r}", span)
    if "warmup" in a:
        if not _is_int(a["warmup"]) or a["warmup"] < 0:
            raise _err(f"{name}: `warmup` must be a non-negative whole number of steps, got {a['warmup']!r}", span)
        if a["warmup"] > total_steps:
            raise _err(f"{name}: warmup of {a['warmup']} steps is longer than the run ({total_steps} steps)", span,
                       help="shorten the warmup or train for more epochs")
    if "min" in a and (not _is_number(a["min"]) or not 0 <= a["min"] <= a["v"]):
        raise _err(f"cosine: `min` must be a number between 0 and the peak rate {a['v']}, got {a['min']!r}", span)
    params = tuple((k, a[k]) for k, _ in _PARAMS[name])
    return Schedule(name, params, int(total_steps))
