"""How a run is asked for (TrainOptions), what it produced (TrainResult), how it is interrupted
(TrainInterrupted), and the one way the loop's parts make an X diagnostic."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

from streamsched.diagnostics import Diagnostic, StreamschedError


@dataclass
class TrainOptions:
    """Command-line overrides of the `train` block (None keeps the file's value), and how to run.

    resume: continue from a checkpoint (every array must fit the program; other changes are
    listed in a note); resume_weights: load only the model's parameters from a checkpoint and
    start training afresh (fine-tuning); threads: BLAS threads (None: cpu_threads' rule);
    data_limit: bytes the data and checkpoints may hold (None: reads.data_limit()); protect: more
    files no output may overwrite (the program's includes); argv: the command line after
    `streamsched`, for the exact resume command printed on an interrupt or divergence; progress:
    the progress bar (on a terminal) and one line per epoch on stderr; overwrite: `--save` may
    replace a checkpoint streamsched wrote that this run does not continue (outputs.check_output)."""

    epochs: int | None = None
    lr: float | None = None
    seed: int | None = None
    backend: str = "auto"
    interleave: str = "fixed"
    interleave_seed: int = 0
    log: str | None = None
    save: str | None = None
    resume: str | None = None
    resume_weights: str | None = None
    max_steps: int | None = None
    progress: bool = True
    detect_races: bool = True
    eval_every: int = 1
    threads: int | None = None
    data_limit: int | None = None
    protect: tuple[str, ...] = ()
    argv: tuple[str, ...] | None = None
    overwrite: bool = False
    devices: int = 1
    """Data-parallel ranks simulated in one process on the CPU backend (`--devices N`); a launched
    process's rank and world size come from the launcher's variables (interp/distributed.py)."""
    data_on: str = "auto"
    """Where the training set lives (`--data-on`): `host` (each step's batch staged into a pinned
    slot by host tasks), `device` (uploaded once, each batch gathered on the GPU, no host work per
    step), `auto` (device when the plan allows and it fits cuda.resident.DEVICE_SHARE of the free
    GPU memory; the CPU backend always stages)."""
    epoch_launch: str = "auto"
    """`--epoch-launch`: `auto` runs the whole epochs of a device-resident run as launches of
    the epoch graph (the captured steps inside a CUDA conditional WHILE node, each epoch's end
    inside the loop) where the driver has conditional nodes, several epochs per launch (about
    STEPS_PER_LAUNCH steps, at most MAX_EPOCHS_PER_LAUNCH epochs); `epoch` one epoch per launch;
    a number N (ASCII digits, 1 or more) at most N epochs per launch, and never more than
    MAX_EPOCHS_PER_LAUNCH; `step` launches the steps one by one.  Anything else is X004."""


STEPS_PER_LAUNCH = 256
"""`--epoch-launch auto`: enough whole epochs in one launch of the epoch graph for about this many
steps, so the host's cost per launch (the launch, reading the ends) is spread over them."""
MAX_EPOCHS_PER_LAUNCH = 16
"""The most epochs in one launch (`--epoch-launch N` is capped here): the loop reads a launch's
ends after it has issued the next launch, so the progress, the log lines and a divergence stop
come at most one launch after the device got there."""


@dataclass
class TrainResult:
    """What a run produced: per-epoch records (the JSON-lines log; epochs numbered from 1), the
    final parameters (host copies, name -> ndarray) and the backend used."""

    history: list[dict] = field(default_factory=list)
    params: dict[str, np.ndarray] = field(default_factory=dict)
    backend: str = "cpu"
    steps: int = 0
    wall_s: float = 0.0
    races: list[Diagnostic] = field(default_factory=list)
    note: str = ""
    """Why no step ran, when none did (`--steps 0`, a checkpoint that already holds every epoch)."""
    notes: list[str] = field(default_factory=list)
    """Things the user should know about a run that worked (the CLI prints each as `note: ...`),
    e.g. that `--save` wrote no checkpoint because `--steps` stopped inside the first epoch."""
    run_id: str = ""
    threads: int = 1
    epoch_steps: list[tuple[int, float]] = field(default_factory=list)
    """(steps, seconds) of each epoch's issue: from its first step's issue to its end's issue
    (the device may still be running it)."""
    eval_s: float = 0.0
    """Seconds spent evaluating (and reading parameters for it), all epochs together."""
    data_on: str = "host"
    """Where the training set was: "device" (held on the GPU, batches gathered there) or "host"."""
    eval_on: str = ""
    """Where the test split was evaluated: "device" (one captured graph per batch on the GPU) or
    "host" (NumPy), "" before any evaluation was set up."""
    first_step_s: float = 0.0
    """Seconds from the start of `train` (data loaded, backend set up, graphs captured, kernels
    compiled) to the first step's issue."""

    steady: tuple[int, float, float] | None = None
    """(steps, wall seconds, host CPU seconds) of the steady state: from the first issue of the
    run's second epoch to the read of its last epoch's end (every epoch's end included: the
    device's and the host's work at the epoch boundaries), evaluation time taken out; None for
    a run of one epoch."""
    epoch_launches: int = 0
    """Launches of the epoch graph (`--epoch-launch auto|epoch|N`), each of one or more whole
    epochs; 0 when the steps were launched one by one."""
    loop_cpu_s: dict[str, float] = field(default_factory=lambda: {"launch": 0.0, "finish": 0.0, "main_thread": 0.0})
    """The loop thread's CPU seconds (time.thread_time): in epoch-graph launches, in reading
    epoch ends (`finish`, the whole run), and in the steady state (`steady`'s span)."""

    @property
    def steady_us_per_step(self) -> float:
        """Wall microseconds per training step in the steady state (`steady`), evaluation
        excluded; for a run of one epoch, that epoch's issue time per step."""
        if self.steady is not None and self.steady[0]:
            return 1e6 * self.steady[1] / self.steady[0]
        n = sum(k for k, _ in self.epoch_steps)
        return 1e6 * sum(t for _, t in self.epoch_steps) / n if n else float("nan")

    @property
    def steady_cpu_us_per_step(self) -> float:
        """Host CPU microseconds (time.process_time: every thread) per step over `steady`."""
        if self.steady is not None and self.steady[0]:
            return 1e6 * self.steady[2] / self.steady[0]
        return float("nan")

    @property
    def final_accuracy(self) -> float:
        return self.history[-1]["test_acc"] if self.history else float("nan")


class TrainInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a run; the checkpoint and log hold every whole epoch before.
    signum: the signal; lines: what to tell the user (where it stopped, what the checkpoint
    holds, the exact command that resumes)."""

    def __init__(self, signum: int, lines: list[str]):
        super().__init__("\n".join(lines))
        self.signum = signum
        self.lines = lines


def _x(code: str, msg: str, span=None, help: str = "") -> StreamschedError:
    return StreamschedError([Diagnostic(code, msg, span, help=help)])


def _with_help(d: Diagnostic, extra: str) -> Diagnostic:
    """`d` with `extra` appended to its help."""
    from dataclasses import replace as _replace

    return _replace(d, help=d.help + extra) if extra else d


def _stderr_line(line: str) -> None:
    """The default `echo`: a line on stderr; a stderr that cannot be written (closed, a reader
    gone, a full disk) loses the line, never the run."""
    try:
        print(line, file=sys.stderr)
    except (OSError, ValueError, AttributeError):
        pass

