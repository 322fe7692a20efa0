"""Continuing a run from its checkpoint: a checkpoint whose every array fits the program (name,
shape and dtype) resumes, whatever else changed, with a note listing the changes; the
learning-rate schedule continues by absolute step; `--resume-weights` takes only the model's
parameters, for fine-tuning.  Also the exact command line that resumes a stopped run.

Epochs are numbered from 1 everywhere the user sees them (the log, the summary, these notes,
the checkpoint's `epoch`: the number of whole epochs it holds).  Checkpoints of format 1
numbered their last epoch from 0; they are read and converted.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace
from typing import Any

import numpy as np

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.interp.checkpoint import check_arrays, check_finite_arrays, load_checkpoint
from streamsched.interp.lr import SCHEDULES, Schedule


def _x(code: str, msg: str, span=None, help: str = "") -> StreamschedError:
    return StreamschedError([Diagnostic(code, msg, span, help=help)])


@dataclass
class Resumed:
    """A checkpoint to continue: path; epochs_done, the whole epochs it holds; step, the steps
    trained in all (the learning-rate schedule's position); history, its per-epoch records
    (epochs from 1); meta, its metadata; arrays, name -> array, already checked to fit."""

    path: str
    epochs_done: int
    step: int
    history: list[dict]
    meta: dict
    arrays: dict[str, np.ndarray] = field(repr=False)


def _count(meta: dict, key: str, path: str) -> int:
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise _x("X007", f"checkpoint `{path}` is corrupt: its `{key}` is {v!r}, not a count",
                 help="point --resume at a checkpoint written by `streamsched run`")
    return v


def load_for_resume(path: str, layout: dict, limit: int | None) -> Resumed:
    """Read `path` and check that it fits `layout` (train._checkpoint_layout: name -> (shape,
    dtype) of every parameter and state buffer).  Raises StreamschedError X007 (X014 over the
    limit; X007 too for a value that is not finite) before anything is written into the run's
    buffers."""
    arrays, meta = load_checkpoint(path, limit=limit)
    check_arrays(arrays, layout, path)
    check_finite_arrays(arrays, path)
    history = meta.get("history", [])
    if not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
        history = []
    if meta["format"] >= 2:
        done, step = _count(meta, "epoch", path), _count(meta, "step", path)
    else:  # format 1: `epoch` was the last epoch, from 0; no step count
        done = _count(meta, "epoch", path) + 1
        step = done * _count(meta, "steps_per_epoch", path)
        history = [{**r, "epoch": r["epoch"] + 1} if isinstance(r.get("epoch"), int) else r for r in history]
    return Resumed(path, done, step, list(history), meta, arrays)


# What a note calls each setting that may change between the checkpoint and the resumed run.
_WHAT = {"program": "the program text", "model": "the model", "data": "the data", "seed": "the shuffle seed",
         "epochs": "epochs", "steps_per_epoch": "steps per epoch", "lr": "the learning rate"}


def changes(meta: dict, now: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's metadata and the run resuming it, in words, for the
    settings of `now` (keys of _WHAT) that the checkpoint records: `epochs 10 -> 20`,
    `the program text`."""
    out = []
    for key, value in now.items():
        if key not in meta:
            continue
        old = meta[key]
        if key == "lr":
            old = old.get("requested", old.get("schedule")) if isinstance(old, dict) else old
        if old == value:
            continue
        if key in ("program",):
            out.append(_WHAT[key])
        else:
            out.append(f"{_WHAT[key]} {old} -> {value}")
    return out


def lr_meta(schedule: Schedule, requested: str) -> dict:
    """The checkpoint's record of the learning-rate plan: requested, the schedule as written (or
    `--lr`); name, params and total_steps of the plan in effect (a clipped warmup included);
    resume, its continuation point, or None."""
    return {"requested": requested, "schedule": str(schedule), "name": schedule.name,
            "params": [[k, v] for k, v in schedule.params], "total_steps": schedule.total_steps,
            "resume": list(schedule.resume) if schedule.resume else None}


def schedule_from_meta(d: Any) -> Schedule | None:
    """The plan a checkpoint recorded (lr_meta), None when it recorded none or a broken one."""
    try:
        if not isinstance(d, dict) or d.get("name") not in SCHEDULES:
            return None
        params = tuple((str(k), v) for k, v in d["params"])
        resume = tuple(d["resume"]) if d.get("resume") else None
        sched = Schedule(d["name"], params, int(d["total_steps"]), None,
                         (int(resume[0]), float(resume[1]), int(resume[2])) if resume else None)
        sched(max(0, sched.total_steps - 1))  # every parameter it needs is there
        return sched
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError):
        return None


def load_weights(path: str, program, layout: dict, limit: int | None) -> tuple[dict[str, np.ndarray], dict]:
    """The parameters of `program`'s model from the checkpoint `path` (`--resume-weights`):
    every parameter must be there with its shape and dtype; the checkpoint's other arrays
    (optimizer state, statistics, another head...) are left out.  Returns (name -> array, meta).
    Raises StreamschedError X007 (X014 over the limit), its help naming --resume-weights."""
    try:
        arrays, meta = load_checkpoint(path, limit=limit)
        params = [b.name for b in program.buffers if b.kind == "param" and b.name in layout]
        want = {n: layout[n] for n in params}
        got = {n: a for n, a in arrays.items() if n in want}
        check_arrays(got, want, path)
        check_finite_arrays(got, path)
    except StreamschedError as e:  # the checks are --resume's: their help names the flag given
        raise StreamschedError([dc_replace(d, help=re.sub(r"--resume\b(?!-)", "--resume-weights", d.help or ""))
                                for d in e.diagnostics]) from None
    return got, meta


def resume_command(argv: tuple[str, ...] | None, checkpoint: str, prog: str = "streamsched") -> str | None:
    """The command line that continues the run of `argv` (the arguments after `streamsched`) from
    `checkpoint`: the same arguments with `--resume CHECKPOINT` instead of any --resume or
    --resume-weights.  None without argv (a run started from Python)."""
    if not argv:
        return None
    args = list(argv)
    kept = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--resume", "--resume-weights"):
            i += 2
            continue
        if a.startswith(("--resume=", "--resume-weights=")):
            i += 1
            continue
        kept.append(a)
        i += 1
    return shlex.join([*shlex.split(prog), *kept, "--resume", checkpoint])
