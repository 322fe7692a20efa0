"""Learning-rate schedules for the `train` block: `lr = cosine(0.1, warmup = 50)` becomes a pure
function from the global step t (0-based) to a float, uploaded to the device every step.

Formulas (v: peak rate, T: total_steps, W: warmup steps, p: decay progress)::

    constant(v)                       lr(t) = v
    step(v, every = N, gamma = 0.1)   lr(t) = v * gamma ** (t // N)
    warmup, W > 0, for t < W          lr(t) = v * (t + 1) / W      (v/W at t = 0, v at t = W-1)
    after warmup                      p = min(1, (t - W) / (T - W))
    cosine(v, warmup = 0, min = 0.0)  lr(t) = min + (v - min) * (1 + cos(pi * p)) / 2
    linear(v, warmup = 0)             lr(t) = v * (1 - p)

A run resumed with another length T than the checkpoint's plan T0 (`Schedule.continued`; t0 the
resume step, a = max(t0, W), p_a = min(1, (a - W) / (T0 - W)) the progress the plan had reached):

- the plan had not ended (p_a < 1, an interrupted run): it goes on from where it was, to 1 at
  the new end, linearly in t: p(t) = p_a + (1 - p_a) (t - a) / (T - a).  The rate at the resume
  step is the one the interrupted run would have used, and it never jumps back up;
- the plan had ended (p_a = 1, a finished run given more epochs: its rate had reached `min`, 0
  by default, and going on there would train nothing): the new steps follow the schedule
  stretched to the new end, p(t) = (t - W) / (T - W), the rate a run planned for T steps from
  the start has at t.  The decay restarts at a rate that grows with the steps added (cosine(0.1)
  over 40 epochs, resumed to 60: 0.025; to 80: 0.05) and ends at `min` at T.

Both are stored as (a, p_start, T0): p(t) = p_start + (1 - p_start) (t - a) / (T - a) for t >= a
(p_start = p_a, or (a - W) / (T - W) when the plan had ended), the checkpoint's plan before a.
With T = T0 this is the unchanged plan (and is computed as such).

A warm-up longer than the run is clipped to the run's length when asked (`clip_warmup`): the
run then only warms up, reaching v at its last step.

The cosine branch is the annealing curve of SGDR (Loshchilov & Hutter, "SGDR: Stochastic
Gradient Descent with Warm Restarts", ICLR 2017, eq. 5) without restarts, the same formula as
PyTorch's `torch.optim.lr_scheduler.CosineAnnealingLR` with T_max = T - W and eta_min = min:
it equals v at t = W, (v + min) / 2 halfway, and min at t = T (and stays there after).
Every rate of a run must be a finite f32 number (at most 3.4e38, the dtype it is uploaded in):
`step` with gamma > 1 grows without bound, so its factor gamma ** (t // N) is checked over the
run's steps, even when v is 0.  Bad names or arguments are StreamschedError X004.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.interp.data import REQUIRED, _did_you_mean, _is_int, _is_number, bind_args
from streamsched.interp.ir import Span

F32_MAX = 3.4028234663852886e38

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
    total_steps: the run's length T (epochs * steps per epoch); warmup_clipped_from: the warmup
    the file asked for when it was clipped to T, else None; resume: when the schedule
    continues a checkpoint's plan over a new length (see the module docstring), with T0 the
    length of the first plan, as (a, p_a, T0); else None.
    """

    name: str
    params: tuple[tuple[str, Any], ...]
    total_steps: int
    warmup_clipped_from: int | None = None
    resume: tuple[int, float, int] | None = None

    def __call__(self, t: int) -> float:
        if t < 0:
            raise ValueError(f"learning-rate schedule asked for step {t}")
        p = self._p
        v = float(p["v"])
        if self.name == "constant":
            return v
        if self.name == "step":
            try:
                return v * float(p["gamma"]) ** (t // int(p["every"]))
            except OverflowError:  # refused by make_schedule within the run; inf past it
                return math.inf
        w = int(p["warmup"])
        if t < w:
            return v * (t + 1) / w
        progress = self._progress(t)
        if self.name == "cosine":
            lo = float(p["min"])
            return lo + (v - lo) * (1.0 + math.cos(math.pi * progress)) / 2.0
        return v * (1.0 - progress)  # linear

    @cached_property
    def _p(self) -> dict[str, Any]:
        """params as a dict, built once (the schedule is asked once per step)."""
        return dict(self.params)

    def _progress(self, t: int) -> float:
        """The decay's progress p at step t >= warmup: the plan's own, or its continuation."""
        w = int(self._p["warmup"])
        if self.resume is None or t < self.resume[0]:
            total = self.total_steps if self.resume is None else self.resume[2]
            return min(1.0, max(0.0, (t - w) / max(1, total - w)))
        a, pa, _ = self.resume
        return min(1.0, pa + (1.0 - pa) * (t - a) / max(1, self.total_steps - a))

    def __str__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.params)})"

    def continued(self, t0: int, total_steps: int) -> "Schedule":
        """This schedule (planned for self.total_steps) resumed at step t0 in a run of
        total_steps steps: equal to self before max(t0, warmup), then decaying to the end of the
        new length, from where it was, or, when it had ended, stretched to the new end (module
        docstring).  The same length gives self unchanged."""
        if self.name in ("constant", "step"):  # functions of t alone
            return replace(self, total_steps=int(total_steps))
        if total_steps == self.total_steps:
            return self
        w = int(dict(self.params)["warmup"])
        a = max(int(t0), w)
        first_plan = self.resume[2] if self.resume is not None else self.total_steps
        start = self._progress(a)
        if start >= 1.0:  # the plan had ended: the longer plan's own progress at a
            start = min(1.0, max(0.0, (a - w) / max(1, int(total_steps) - w)))
        return Schedule(self.name, self.params, int(total_steps), self.warmup_clipped_from, (a, start, first_plan))

    @property
    def restarted(self) -> bool:
        """Whether this is a continuation of a plan that had ended (its decay stretched to the new
        end rather than continued from where it was)."""
        if self.resume is None or self.name in ("constant", "step"):
            return False
        a, start, first = self.resume
        w = int(dict(self.params)["warmup"])
        return min(1.0, max(0.0, (a - w) / max(1, first - w))) >= 1.0


def _err(message: str, span: Span | None, help: str = "") -> StreamschedError:
    return StreamschedError([Diagnostic("X004", message, span=span, help=help)])


def make_schedule(name: str, args: tuple, kwargs: dict, total_steps: int, span: Span | None = None, *,
                  clip_warmup: bool = False, check_range: bool = True) -> Schedule:
    """Build the schedule `name(*args, **kwargs)` for a run of total_steps steps.

    args/kwargs: the literal arguments from the `lr = ...` line; span: that line, put on every
    diagnostic; clip_warmup: a warmup longer than the run is clipped to total_steps (recorded in
    `warmup_clipped_from`, for the caller's notice) instead of refused.  Returns a `Schedule`
    (callable: step -> float).  Raises StreamschedError X004 for an unknown name, an
    unknown/missing/repeated argument, or a value out of range (v < 0 or beyond f32, every < 1,
    gamma <= 0, warmup < 0, or > total_steps unless clipped, min outside [0, v]), or (check_range,
    for a run of exactly total_steps) a rate beyond f32 at some step.
    """
    if name not in _PARAMS:
        raise _err(f"unknown learning-rate schedule `{name}`; known: {', '.join(SCHEDULES)}", span,
                   help=f"{_did_you_mean(name, SCHEDULES)}e.g. `lr = cosine(0.1, warmup = 50)`")
    a = bind_args(name, _PARAMS[name], args, kwargs, span)
    clipped = None
    if not _is_int(total_steps) or total_steps < 1:
        raise _err(f"the run has {total_steps} steps; a learning-rate schedule needs at least 1", span,
                   help="check `epochs` and the batch size")
    if not _is_number(a["v"]) or a["v"] < 0:
        raise _err(f"{name}: the learning rate must be a non-negative number, got {a['v']!r}", span)
    if a["v"] > F32_MAX:
        raise _err(f"{name}: the learning rate {a['v']!r} is beyond f32's range ({F32_MAX:.3g}), the dtype it is "
                   "uploaded in", span, help="use a rate such as 0.1")
    if name == "step":
        if not _is_int(a["every"]) or a["every"] < 1:
            raise _err(f"step: `every` must be a positive whole number of steps, got {a['every']!r}", span,
                       help="e.g. `step(0.1, every = 1000, gamma = 0.1)`")
        if not _is_number(a["gamma"]) or a["gamma"] <= 0:
            raise _err(f"step: `gamma` must be a positive number, got {a['gamma']!r}", span)
        if check_range and a["gamma"] > 1:
            _check_step_range(float(a["v"]), int(a["every"]), float(a["gamma"]), int(total_steps), span)
    if "warmup" in a:
        if not _is_int(a["warmup"]) or a["warmup"] < 0:
            raise _err(f"{name}: `warmup` must be a non-negative whole number of steps, got {a['warmup']!r}", span)
        if a["warmup"] > total_steps and clip_warmup:
            clipped = int(a["warmup"])
            a["warmup"] = int(total_steps)
        elif a["warmup"] > total_steps:
            raise _err(f"{name}: warmup of {a['warmup']} steps is longer than the run ({total_steps} steps)", span,
                       help="shorten the warmup or train for more epochs")
    if "min" in a and (not _is_number(a["min"]) or not 0 <= a["min"] <= a["v"]):
        raise _err(f"cosine: `min` must be a number between 0 and the peak rate {a['v']}, got {a['min']!r}", span)
    params = tuple((k, a[k]) for k, _ in _PARAMS[name])
    return Schedule(name, params, int(total_steps), clipped)


def _check_step_range(v: float, every: int, gamma: float, total_steps: int, span: Span | None) -> None:
    """X004 when `step(v, every, gamma)` with gamma > 1 leaves f32's range within the run: the
    factor gamma ** k (k = t // every, at most (total_steps - 1) // every) or the rate v * gamma ** k
    beyond 3.4e38 (with v = 0 the rate would be 0 x inf, NaN)."""
    k_max = (total_steps - 1) // every
    room = math.log(F32_MAX) - (math.log(v) if v > 1 else 0.0)  # the factor's room, and the rate's
    if k_max * math.log(gamma) <= room:
        return
    k = math.floor(room / math.log(gamma)) + 1  # the first k past the room
    raise _err(f"step: the learning rate overflows f32 at step {k * every} of this run's {total_steps}: "
               f"{v:g} x {gamma:g} ** {k} is beyond {F32_MAX:.3g}", span,
               help=f"a gamma above 1 grows the rate every {every} steps; use gamma < 1 to decay it, e.g. "
                    f"`step({v:g}, every = {every}, gamma = 0.1)`")
