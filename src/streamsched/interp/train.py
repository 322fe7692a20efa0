"""The training loop driven by the `train` block: data staged into the A/B slots by host tasks,
the learning rate uploaded every step, the EventPlan issued one step at a time on a backend,
evaluation each epoch, JSON-lines logs, atomic checkpoints, and a clear stop on divergence.

Source: LANGUAGE.md (`train`, `step`), the seed's run_train_epoch_gpu step loop.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import stat
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.dsl.resolve import CallValue
from streamsched.interp.barriers import plan_segments
from streamsched.interp.checkpoint import first_nonfinite, save_checkpoint
from streamsched.interp.cpu_threads import blas_threads, choose_threads
from streamsched.interp.data import Batches, check_compatible, data_paths, load_dataset
from streamsched.interp.distributed import dp_main, dp_place, shard
from streamsched.interp.ir import Task
from streamsched.interp.lr import F32_MAX, make_schedule
from streamsched.interp.resume import (Resumed, changes, load_for_resume, load_weights, lr_meta, resume_command,
                                       schedule_from_meta)
from streamsched.outputs import (Output, OutputLock, check_distinct, check_output, check_unchanged, file_stamp,
                                 holder_info, new_run_id, open_log, remove_stale_temps, same_file)
from streamsched.pipeline import Compiled
from streamsched.stdlib.kernels import KERNELS, numpy_dtype


class TaskFailedError(Exception):
    """A kernel failed at run time (any backend); `task` is the Task, `cause` the exception."""

    def __init__(self, task: Task, cause: BaseException):
        super().__init__(f"{task.label or task.kernel}: {cause}")
        self.task = task
        self.cause = cause


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
    """(steps, seconds) of each epoch's training phase: from its first step's issue to the read
    of its losses (which waits for the device), evaluation and checkpoints excluded."""
    eval_s: float = 0.0
    """Seconds spent evaluating (and reading parameters for it), all epochs together."""
    first_step_s: float = 0.0
    """Seconds from the start of `train` (data loaded, backend set up, graphs captured, kernels
    compiled) to the first step's issue."""

    @property
    def steady_us_per_step(self) -> float:
        """Wall microseconds per training step over every epoch but the first (warm caches,
        steady state), evaluation excluded; over all epochs when there is only one."""
        rows = self.epoch_steps[1:] or self.epoch_steps
        n = sum(k for k, _ in rows)
        return 1e6 * sum(t for _, t in rows) / n if n else float("nan")

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


DATA_HINT = 1e6
"""Training features beyond this magnitude get a note on a divergence (X010): inputs of a network
are scaled to about [-1, 1] (raw pixels to 255, raw audio to 32768), and one far larger can blow
up the loss at any rate."""


def _stderr_line(line: str) -> None:
    """The default `echo`: a line on stderr; a stderr that cannot be written (closed, a reader
    gone, a full disk) loses the line, never the run."""
    try:
        print(line, file=sys.stderr)
    except (OSError, ValueError, AttributeError):
        pass


def init_params(program, seed: int) -> dict[str, np.ndarray]:
    """Initial values of every buffer with an init (params, optimizer state, constants).

    glorot: uniform(-l, l), l = sqrt(6 / (fan_in + fan_out)) (Glorot & Bengio, 2010), fans as
    torch.nn.init counts them (a [kh, kw, in, out] convolution weight: fan_in = kh kw in,
    fan_out = kh kw out); uniform: the same as glorot;
    copy:P: the initial value of parameter P (an EMA of P starts at P; f32 master weights of an
    f16 parameter start at its value), in the buffer's own dtype; const:V: V everywhere;
    he: normal(0, sqrt(2 / fan_in)); normal: N(0, 0.01); zeros; ones.  A 1-D or scalar param
    named glorot/he is zero-initialized (biases).  Deterministic in `seed`.
    """
    bufs = {b.name: b for b in program.buffers}
    rng = np.random.default_rng(seed)
    out = {}
    copies = [(n, i) for n, i in program.inits if i.startswith("copy:")]
    for name, init in [(n, i) for n, i in program.inits if not i.startswith("copy:")]:
        b = bufs[name]
        try:
            out[name] = _init_value(b, init, rng)
        except MemoryError:  # the arena fit, the temporary of its initial value did not
            nbytes = b.size * 8
            raise _x("X013", f"out of memory: cannot allocate {_human_bytes(nbytes)} to initialize `{name}` "
                     f"({b.dtype}[{', '.join(str(d) for d in b.shape)}], init {init})", b.span,
                     help="use a smaller batch or smaller layer widths (and smaller state buffers)") from None
    for name, init in copies:  # state that starts as a copy of a parameter (EMA, f32 master)
        out[name] = out[init[5:]].astype(numpy_dtype(bufs[name].dtype))
    return out


def _init_value(b, init: str, rng) -> np.ndarray:
    """The initial value of buffer `b` (see init_params), drawing from `rng`."""
    dt = numpy_dtype(b.dtype)
    if init.startswith("const:"):  # `state s : f32[] = 65536`
        v = np.full(b.shape, float(init[6:]))
    elif init == "ones":
        v = np.ones(b.shape, dt)
    elif init in ("glorot", "he", "uniform") and len(b.shape) >= 2:
        # [in, out] for a dense weight, [kh, kw, in, out] (HWIO) for a convolution: each fan
        # counts the receptive field too, as torch.nn.init does (fan_in = kh * kw * in)
        receptive = int(np.prod(b.shape[:-2])) if len(b.shape) > 2 else 1
        fan_in, fan_out = b.shape[-2] * receptive, b.shape[-1] * receptive
        if init == "he":
            v = rng.normal(0.0, math.sqrt(2.0 / fan_in), b.shape)
        else:
            lim = math.sqrt(6.0 / (fan_in + fan_out))
            v = rng.uniform(-lim, lim, b.shape)
    elif init == "normal":
        v = rng.normal(0.0, 0.01, b.shape)
    else:
        v = np.zeros(b.shape)
    return v.astype(dt)


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


class CpuRunner:
    """The CPU backend behind the loop's small interface: run / read / write / sync /
    epoch_losses.

    Steps overlap as on a GPU, where the host issues ahead and the streams run asynchronously:
    `run` issues a step and executes only until every step `window` or more before it has
    finished; the rest runs interleaved with the next step's work, as the plan's waits allow
    (`CpuExecutor.issue` / `drain`).  The loss is snapshotted when a task that writes it runs,
    since the next step may overwrite it before the loop looks; the loop reads the epoch's values
    once, at its end (`epoch_losses`), as on the GPU; `read`, `write` and `sync` first drain
    everything (evaluation, checkpoints).
    Under `interleave = "fixed"` the execution order is the plan's global issue order, as before.
    A kernel failure raises TaskFailedError."""

    name = "cpu"
    window = 2
    """Steps in flight at most: step k - 2 has finished when `run` returns for step k."""

    def __init__(self, compiled: Compiled, interleave: str, seed: int, detect_races: bool):
        from streamsched.interp.cpu_backend import CpuExecutor
        from streamsched.interp.memory import allocate_arrays

        self.arrays = allocate_arrays(compiled.schedule.buffers)
        m = compiled.program.model
        self._loss = m.loss if m is not None else None
        self._loss_tasks = frozenset(t.id for t in compiled.schedule.tasks if self._loss in t.outs)
        self._losses: dict[int, tuple[int, np.ndarray]] = {}  # batch -> (loss writes seen, latest value)
        self._steps: list[int] = []  # batches of the steps issued since the last epoch_losses
        self.ex = CpuExecutor(compiled.schedule, self.arrays, compiled.program.kernels, interleave=interleave, seed=seed,
                              detect_races=detect_races, on_task_done=self._task_done)

    def _task_done(self, task: Task, batch: int) -> None:
        if task.id in self._loss_tasks:
            n, _ = self._losses.get(batch, (0, None))
            self._losses[batch] = (n + 1, np.array(self.arrays[self._loss]))

    def _guard(self, fn, *args):
        from streamsched.interp.cpu_backend import TaskFailed

        try:
            return fn(*args)
        except TaskFailed as e:
            raise TaskFailedError(e.task, e.cause) from e

    def run(self, instrs, host_fn) -> None:
        """Issue `instrs` (one step; bind the loop step into host_fn, which may run later) and
        execute until the steps `window` or more before it are done."""
        b = self.ex.issue(instrs, host_fn)
        want = sum(1 for i in instrs if i.op == "launch" and i.task in self._loss_tasks)
        if want:
            self._steps.append(b)
        self._guard(self.ex.drain, b - self.window)

    def epoch_losses(self) -> EpochLosses:
        """The losses of the steps issued since the last call, in step order (finishes them)."""
        self.sync()
        vals = [float(self._losses[b][1]) if b in self._losses else float(self.read(self._loss)) for b in self._steps]
        self._losses.clear()
        self._steps = []
        return EpochLosses.of(vals)

    def last_loss(self, name: str) -> float:
        """The loss of the latest step (finishes it): for callers that want one step's value."""
        b = self._steps[-1] if self._steps else None
        self.sync()
        if name == self._loss and b is not None and b in self._losses:
            return float(self._losses[b][1])
        return float(self.read(name))

    def read(self, name: str) -> np.ndarray:
        self.sync()
        return np.array(self.arrays[name])

    def write(self, name: str, value: np.ndarray) -> None:
        self.sync()
        self.arrays[name][...] = value

    def sync(self) -> None:
        self._guard(self.ex.drain)

    @property
    def races(self) -> list[Diagnostic]:
        return list(self.ex.races)


def _human_bytes(n: int) -> str:
    x = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if x < 1024 or unit == "EiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:,} bytes ({x:.1f} {unit})"
        x /= 1024
    return f"{n:,} bytes"  # pragma: no cover


def _out_of_memory(exc, backend: str, compiled: Compiled | None = None) -> StreamschedError:
    """X013 for an arena (memory.ArenaOutOfMemory) the backend could not allocate; the span is
    the largest buffer's declaration in the user's file, else the first statement that uses it
    (a stdlib op's parameter is shown at the model line that calls the op)."""
    big = exc.largest
    span = getattr(big, "span", None)
    if big is not None and compiled is not None and (span is None or span.file.startswith("<")):
        span = next((t.span for t in compiled.schedule.tasks if big.name in t.args + t.outs
                     and t.span is not None and not t.span.file.startswith("<")), span)
    where = "GPU" if exc.space == "device" and backend == "cuda" else "pinned host" if backend == "cuda" else "host"
    msg = f"out of memory: the {backend} backend could not allocate {_human_bytes(exc.nbytes)} of {where} memory"
    if big is not None:
        dims = ", ".join(str(d) for d in big.shape)
        msg += f"; the largest buffer is `{big.name}` : {big.dtype}[{dims}], {_human_bytes(big.nbytes)}"
    return _x("X013", msg, span,
              help="use a smaller batch or smaller layer widths (and smaller state buffers); "
                   "`streamsched check` does not know how much memory the machine has")


def _checkpoint_layout(program) -> dict[str, tuple[tuple[int, ...], np.dtype | None]]:
    """name -> (shape, dtype) of every array a checkpoint of `program` holds: the buffers with an
    initial value (parameters, optimizer state, state blocks), as `train` saves them."""
    bufs = {b.name: b for b in program.buffers}
    out = {}
    for name, _ in program.inits:
        b = bufs[name]
        try:
            dt = numpy_dtype(b.dtype)
        except (NotImplementedError, KeyError):  # bf16: no NumPy dtype to compare with
            dt = None
        out[name] = (tuple(b.shape), dt)
    return out


def _layout_json(program) -> dict:
    """The checkpoint's `layout` field for `program`: {name: [shape, dtype name]} (bf16 by name)."""
    return {n: [list(shape), np.dtype(dt).name if dt is not None else "bf16"]
            for n, (shape, dt) in _checkpoint_layout(program).items()}


def make_runner(compiled: Compiled, opts: TrainOptions):
    """`--backend auto` picks CUDA when CuPy and a device are present, else the CPU with a notice;
    `--backend cuda` without a GPU is an X020 diagnostic; arenas too large to allocate are X013."""
    from streamsched.interp.memory import ArenaOutOfMemory

    want = opts.backend
    if want in ("auto", "cuda"):
        try:
            from streamsched.interp.cuda import cuda_available

            ok, why = cuda_available()
        except ImportError as exc:
            ok, why = False, f"the CUDA backend cannot load: {exc}"
        if ok:
            from streamsched.interp.cuda.runner import CudaRunner

            from streamsched.interp.distributed import rank_env_or_x004, use_device

            env = rank_env_or_x004()
            if env.world > 1:
                use_device(env)  # one GPU per process: GPU LOCAL_RANK, before any CuPy state
            if opts.devices > 1:
                raise _x("X004", f"--devices {opts.devices} on the GPU runs one process per device",
                         help="run it from the command line, `streamsched run --devices N FILE`, or start the "
                              "processes with torchrun (docs/cuda.md, \"Data parallel\")")

            from streamsched.interp.distributed import NcclUnavailable

            try:
                return CudaRunner(compiled)
            except ArenaOutOfMemory as exc:  # CuPy's OutOfMemoryError, or pinned memory
                raise _out_of_memory(exc, "cuda", compiled) from None
            except NcclUnavailable as exc:  # the step all-reduces
                raise _x("X020", f"the step all-reduces, but {exc}",
                         help="install NCCL for CuPy (e.g. the nvidia-nccl wheel of your CUDA), or run on the CPU "
                              "backend, where ranks are simulated") from None
        if want == "cuda":
            raise _x("X020", f"--backend cuda: no usable GPU ({why})",
                     help="install streamsched[cuda12] or [cuda13] on a machine with an NVIDIA GPU, or use --backend cpu")
        print(f"note: no GPU ({why}); running on the CPU backend", file=sys.stderr)
    elif want != "cpu":
        raise _x("X004", f"unknown backend `{want}`", help="backends: auto, cpu, cuda")
    from streamsched.interp.distributed import rank_env_or_x004

    if rank_env_or_x004().world > 1:
        raise _x("X004", "a launcher set WORLD_SIZE > 1, but the CPU backend simulates its ranks in one process",
                 help="on the CPU, run one process with `--devices N`; launched ranks need the GPU (--backend cuda)")
    try:
        if opts.devices > 1:
            from streamsched.interp.distributed import SimRanksRunner

            return SimRanksRunner(lambda: CpuRunner(compiled, opts.interleave, opts.interleave_seed, opts.detect_races),
                                  opts.devices, EpochLosses.of)
        return CpuRunner(compiled, opts.interleave, opts.interleave_seed, opts.detect_races)
    except ArenaOutOfMemory as exc:
        raise _out_of_memory(exc, "cpu", compiled) from None


def _call(v: Any, default_name: str) -> tuple[str, tuple, dict]:
    if isinstance(v, CallValue):
        return v.name, v.args, dict(v.kwargs)
    if isinstance(v, str):
        return v, (), {}
    if isinstance(v, (int, float)):
        return default_name, (v,), {}
    return default_name, (), {}


def evaluate(program, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean loss and accuracy of the model's forward pass on (x, y), NumPy on the host, in
    chunks of the model's batch (the last chunk padded, padding ignored).  A sequence model's
    logits have several rows per sample ([batch * t, classes] for labels y [N, t], row-major):
    the loss and accuracy are then the means over every token."""
    m = program.model
    bufs = {b.name: b for b in program.buffers}
    batch = m.batch
    arrs: dict[str, np.ndarray] = dict(params)
    feat, lab = _input_names(program)
    fwd = m.eval_forward or m.forward
    names = {n for t in fwd for n in t.args + t.outs}
    for n in names:
        concrete = n.replace("{slot}", program.slots[0]) if program.slots else n
        if concrete not in arrs:
            b = bufs[concrete]
            arrs[concrete] = np.zeros(b.shape, np.float32 if b.dtype.startswith("f") else np.int32)
        arrs[n] = arrs[concrete]
    xin = next(n for n in names if n.split("[")[0] == feat)
    yin = next((n for n in names if n.split("[")[0] == lab), None)
    correct = 0
    total_loss = 0.0
    count = 0
    n = len(x)
    for s in range(0, n, batch):
        xb = x[s:s + batch]
        yb = y[s:s + batch]
        k = len(xb)
        arrs[xin][...] = 0
        arrs[xin][:k] = xb
        if yin is not None:
            arrs[yin][...] = 0
            arrs[yin][:k] = yb
        for t in fwd:
            kern = program.kernels[t.kernel]
            kern.cpu([arrs[a] for a in t.args], [arrs[o] for o in t.outs], {**kern.attrs, **dict(t.attrs)})
        logits = arrs[m.logits]
        rows = k * (len(logits) // batch)  # the rows of the real samples (one per token)
        yr = np.asarray(yb).reshape(-1)
        correct += int((logits[:rows].argmax(axis=1) == yr).sum())
        # the batch loss averages over padding rows too: recompute on the real rows
        z = logits[:rows].astype(np.float64)
        z = z - z.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=1))
        total_loss += float((lse - z[np.arange(rows), yr]).sum())
        count += rows
    return total_loss / count, correct / count


def _fit_samples(ds, in_shape):
    """Samples with as many values as the model's input but another shape (the flat 8x8 digits
    for an NHWC `f32[batch, 8, 8, 1]` input) are reshaped, row-major; others are left for
    `check_compatible` to report."""
    want = tuple(in_shape[1:])
    if ds.sample_shape == want or int(np.prod(ds.sample_shape)) != int(np.prod(want)):
        return ds
    from dataclasses import replace as _replace

    return _replace(ds, x_train=ds.x_train.reshape((-1,) + want), x_test=ds.x_test.reshape((-1,) + want))


def _input_names(program) -> tuple[str, str]:
    m = program.model
    lab = m.labels
    feat = next((nm for nm, _, _ in m.inputs if nm != lab), m.inputs[0][0])
    return feat, lab


def _whole_number(value: Any, name: str, span, *, minimum: int, flag: str | None) -> int:
    """A setting that must be a whole number >= minimum: `flag` names the command-line option it
    came from (then there is no span), else it came from the train block's `name = ...` line.
    A float is refused rather than truncated."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= minimum
    if ok:
        return int(value)
    what = flag or f"`{name}`"
    shown = f'"{value}"' if isinstance(value, str) else repr(value)
    kind = "at least 1" if minimum == 1 else "zero or more" if minimum == 0 else f"at least {minimum}"
    example = {"epochs": "10", "seed": "0", "steps": "100"}.get(name, "1")
    raise _x("X004", f"{what} must be a whole number, {kind}; got {shown}", None if flag else span,
             help=f"write e.g. `{flag + ' ' if flag else name + ' = '}{example}`")


def setting_dir(span, default: str) -> str:
    """The folder a path written at `span` is relative to: the folder of the file that wrote it
    (an included file's own folder), else `default` (the top file's)."""
    if span is not None and getattr(span, "file", "") and os.path.exists(span.file):
        return os.path.dirname(os.path.abspath(span.file))
    return default




def _run_inputs(program, opts: TrainOptions, data: tuple, data_base: str) -> list[tuple[str, str]]:
    """Every file the run reads, as (path, what it is), so that no output overwrites one."""
    dname, dargs, dkw = data
    out = [(program.path, "the program being run")]
    out += [(p, "a file the program includes") for p in opts.protect if p]
    out += [(p, f"a data file of `data = {dname}(...)`") for p in data_paths(dname, dargs, dkw, base_dir=data_base)]
    if opts.resume:
        out.append((opts.resume, "the checkpoint given to --resume"))
    if opts.resume_weights:
        out.append((opts.resume_weights, "the checkpoint given to --resume-weights"))
    return out


def _log_output(tv: dict, spans: dict, flag_value, base_dir: str, inputs) -> Output | None:
    """The log of a run: --log (relative to the current folder), else the train block's `log`
    (relative to the .sched file that writes it), checked as an output (X004, X021)."""
    if flag_value is not None:
        return check_output(flag_value, "log", noun="the log", origin="--log", inputs=inputs, append=True)
    if tv.get("log") is None:
        return None
    log_v = tv["log"]
    if isinstance(log_v, str) and log_v:
        log_v = os.path.join(setting_dir(spans.get("log"), base_dir), os.path.expanduser(log_v))
    return check_output(log_v, "log", noun="the log", span=spans.get("log"), inputs=inputs, append=True)


def check_train_settings(program, includes: tuple[str, ...] = ()) -> list[Diagnostic]:
    """What `streamsched check` can say about the `train` block without loading data or
    training, with the very checks `train` runs, so that `check` refuses every value `run` would
    refuse, with the same code and span: whole-number epochs and seed, a known data source whose
    arguments bind and are in range and whose file or folder exists (data.check_source), a known
    learning-rate schedule with valid arguments (a warmup longer than the run is clipped by
    `run`, not refused), and a `log` that names a file that may be written (outputs.check_output:
    not the program, an include or a data file, not a file of another kind) (X001, X002, X004,
    X021)."""
    from streamsched.interp.data import check_source

    tv = dict(program.train)
    spans = dict(program.train_spans)
    top = os.path.dirname(os.path.abspath(program.path))
    diags: list[Diagnostic] = []

    def attempt(fn) -> Any:
        try:
            return fn()
        except StreamschedError as e:
            diags.extend(e.diagnostics)
            return None

    attempt(lambda: _whole_number(tv.get("epochs", 10), "epochs", spans.get("epochs"), minimum=1, flag=None))
    if "seed" in tv:
        attempt(lambda: _whole_number(tv["seed"], "seed", spans.get("seed"), minimum=0, flag=None))
    data = _call(tv.get("data", CallValue("digits", (), ())), "digits")
    dspan = spans.get("data")
    data_base = setting_dir(dspan, top)
    attempt(lambda: check_source(*data, base_dir=data_base, span=dspan))
    lname, largs, lkw = _call(tv.get("lr", 0.1), "constant")
    total = _planned_steps(program, tv, data)
    attempt(lambda: make_schedule(lname, largs, lkw, total or 10 ** 9, spans.get("lr"), clip_warmup=total is not None,
                                  check_range=total is not None))
    inputs = _run_inputs(program, TrainOptions(protect=tuple(includes)), data, data_base)
    attempt(lambda: _log_output(tv, spans, None, top, inputs))
    return diags


def _planned_steps(program, tv: dict, data: tuple) -> int | None:
    """The steps of a run of the train block as written, when they are known without reading data
    (the `digits` source: its split sizes are fixed), else None."""
    try:
        dname, dargs, dkw = data
        if dname != "digits" or program.model is None:
            return None
        from streamsched.interp.data import bind_args, digits_train_samples

        a = bind_args("digits", (("test", 0.2), ("seed", 0)), dargs, dkw)
        epochs = tv.get("epochs", 10)
        batch = int(program.model.batch)
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1 or batch < 1:
            return None
        spe = digits_train_samples(a["test"]) // batch
        return epochs * spe if spe >= 1 else None
    except (StreamschedError, TypeError, ValueError, AttributeError):
        return None


DIVERGE_UNIFORM = 10.0
"""An epoch whose mean training loss is above this many times ln(classes) has diverged."""
DIVERGE_BEST = 4.0
"""An epoch whose mean training loss is above this many times the best epoch's so far, and above
it by DIVERGE_MARGIN x ln(classes), has diverged."""
DIVERGE_MARGIN = 0.25
"""The least rise over the best epoch's loss, in units of ln(classes), that counts: a loss of
0.0004 after a best of 0.0001 is four times as large and still nothing (noise near zero)."""
LEARNED = 0.5
"""A run has learned once its best test accuracy is at least this far from chance (1/classes)
to 1: only then can its accuracy collapse."""
COLLAPSE = 0.5
"""An epoch whose test accuracy fell back more than this fraction of the way from the best
epoch's accuracy to chance has collapsed (diverged)."""


def divergence(loss: float, best: float | None, classes: int, acc: float | None = None,
               best_acc: float | None = None) -> str | None:
    """The divergence rule of an epoch (docs/data.md, "Divergence"): why the epoch whose mean
    training loss is `loss` (finite) and whose test accuracy is `acc` (None when not evaluated)
    has diverged, or None when it has not.  best, best_acc: the lowest mean training loss and the
    highest test accuracy of the earlier whole epochs of this run's history (resumed ones
    included), None for the first.  C = classes, u = ln(C), the cross-entropy of guessing
    uniformly, the loss an untrained model starts near:

    - loss > 10 u: blown up (lr = 1e6 reaches 1e29 in its first epoch);
    - loss > 4 best and loss > best + u / 4: the run climbed far from its own best epoch;
    - best_acc - 1/C >= (1 - 1/C) / 2 (it had learned) and acc < 1/C + (best_acc - 1/C) / 2:
      its test accuracy fell more than halfway back to chance.

    Tuned on the examples' loss curves (tests/data/loss_curves.json), on which it never fires,
    nor on noisy runs at high constant rates that still learn; it fires on the epoch where a run
    whose rate doubles each epoch collapses (92% -> 21% test accuracy at a loss of 1.6 < u)."""
    if classes < 2 or not math.isfinite(loss):
        return None
    uniform = math.log(classes)
    if loss > DIVERGE_UNIFORM * uniform:
        return (f"its train loss {loss:.4g} is above {DIVERGE_UNIFORM:g} x ln({classes}) = "
                f"{DIVERGE_UNIFORM * uniform:.4g}, ten times the loss of guessing uniformly")
    if best is not None and loss > DIVERGE_BEST * best and loss > best + DIVERGE_MARGIN * uniform:
        return (f"its train loss {loss:.4g} is above {DIVERGE_BEST:g} times the best epoch's {best:.4g} (and above it "
                f"by more than {DIVERGE_MARGIN:g} x ln({classes}) = {DIVERGE_MARGIN * uniform:.3g})")
    chance = 1.0 / classes
    if acc is not None and best_acc is not None and math.isfinite(acc) \
            and best_acc - chance >= LEARNED * (1 - chance) and acc < chance + COLLAPSE * (best_acc - chance):
        return (f"its test accuracy {100 * acc:.2f}% fell more than halfway back from the best epoch's "
                f"{100 * best_acc:.2f}% to chance ({100 * chance:.2f}%)")
    return None


def train(compiled: Compiled, opts: TrainOptions | None = None, *, base_dir: str = ".",
          echo: Callable[[str], None] | None = None) -> TrainResult:
    """Run the training loop of a compiled program; returns the history and final parameters.

    Before any work: the settings, then every output (outputs.check_output: `--save`, the log;
    none is an input of the run, a file streamsched did not write as that output, a checkpoint
    this run does not continue (unless overwrite), read-only, or the other output), then their
    locks (X009 when another run holds one; the log through its inode too), then the checkpoint
    to resume from (X007, X014), then the data (bounded, finite, X003).  Each epoch's checkpoint
    and log line are written together, after the outputs are checked again (X021 for a file put
    there during the run).  Raises StreamschedError (X codes) for bad data, options, outputs and
    checkpoints and for a diverging run (X010: the loss or the state became NaN or infinite, or
    the epoch broke the divergence rule; no checkpoint of that epoch is written, the last one is
    named); TrainInterrupted on SIGINT, SIGTERM or SIGHUP (as the CLI maps them), at any point.
    Feedback lines go to `echo` (default: stderr, where a failed write loses the line, never the
    run).
    """
    opts = opts or TrainOptions()
    echo = echo or _stderr_line
    program = compiled.program
    if program.model is None:
        raise _x("X004", "the file has no model to train")
    if compiled.plan is None or not compiled.ok:
        raise StreamschedError(list(compiled.diagnostics) or [Diagnostic("X004", "the schedule does not check")])
    m = program.model
    if not program.step:
        raise _x("X012", "nothing to run: the file has no `step` block",
                 help="add the step, e.g. `step train(slot) { upload lr on trans; zero_grad; pass(load[slot]); "
                      "load[next]; optimize }` (see examples/mlp_digits.sched)")
    written = {o for t in compiled.schedule.tasks for o in t.outs}
    if m.loss not in written:
        raise _x("X012", f"the step never computes the loss of model `{m.name}`",
                 help=f"launch a graph that runs `forward {m.name}; backward {m.name}`")
    stale = [p for p in m.params if not any(p in t.outs for t in compiled.schedule.tasks)]
    if stale and len(stale) == len(m.params):
        raise _x("X012", f"the step never updates the parameters of model `{m.name}`",
                 help=f"launch a graph that calls an optimizer, e.g. `sgd({m.name}, lr, momentum = 0.9)`")
    tv = dict(program.train)
    spans = dict(program.train_spans)
    # Settings first, every output second, the data last: a mistake stops the run before any work.
    if opts.seed is not None:
        seed = _whole_number(opts.seed, "seed", None, minimum=0, flag="--seed")
    else:
        seed = _whole_number(tv.get("seed", 0), "seed", spans.get("seed"), minimum=0, flag=None)
    if opts.epochs is not None:
        epochs = _whole_number(opts.epochs, "epochs", None, minimum=1, flag="--epochs")
    else:
        epochs = _whole_number(tv.get("epochs", 10), "epochs", spans.get("epochs"), minimum=1, flag=None)
    if opts.max_steps is not None:
        _whole_number(opts.max_steps, "steps", None, minimum=0, flag="--steps")
    _whole_number(opts.interleave_seed, "seed", None, minimum=0, flag="--interleave-seed")
    if opts.threads is not None:
        _whole_number(opts.threads, "threads", None, minimum=1, flag="--threads")
    if opts.lr is not None and (isinstance(opts.lr, bool) or not isinstance(opts.lr, (int, float))
                                or not math.isfinite(opts.lr) or opts.lr < 0):
        raise _x("X004", f"--lr must be a non-negative number, got {opts.lr!r}", help="e.g. `--lr 0.05`")
    if opts.lr is not None and opts.lr > F32_MAX:
        raise _x("X004", f"--lr {opts.lr:g} is beyond f32's range ({F32_MAX:.3g}), the dtype the rate is uploaded in",
                 help="e.g. `--lr 0.05`")
    for flag, value in (("--resume", opts.resume), ("--resume-weights", opts.resume_weights)):
        if value is not None and (not isinstance(value, (str, os.PathLike)) or not os.fspath(value)):
            raise _x("X004", f"{flag} needs a file name, got {'an empty one' if value == '' else repr(value)}",
                     help=f"give {flag} the checkpoint to read, e.g. `{flag} run.npz`")
    if opts.resume and opts.resume_weights:
        raise _x("X004", "--resume and --resume-weights exclude each other",
                 help="--resume continues a run (its optimizer state, epochs and learning rate too); "
                      "--resume-weights starts a new run from a checkpoint's parameters: give one of them")
    data = _call(tv.get("data", CallValue("digits", (), ())), "digits")
    data_base = setting_dir(spans.get("data"), base_dir)
    inputs = _run_inputs(program, opts, data, data_base)
    layout = _layout_json(program)
    save = check_output(opts.save, "checkpoint", noun="the checkpoint", origin="--save", inputs=inputs,
                        replaceable=(opts.resume,), overwrite=opts.overwrite,
                        fits=lambda meta: meta.get("layout", layout) == layout) if opts.save is not None else None
    log = _log_output(tv, spans, opts.log, base_dir, inputs)
    if not dp_main():  # a data-parallel rank other than 0: rank 0 writes the log and the checkpoints
        save, log, opts = None, None, replace(opts, progress=False)
    check_distinct([save, log])
    run_id = new_run_id()
    holder = holder_info(run_id, ["streamsched", *opts.argv] if opts.argv else None)
    locks: list[OutputLock] = []
    try:
        for out in (save, log):
            if out is not None:
                lock = OutputLock(out, holder)
                lock.acquire()
                locks.append(lock)
                if out is log:  # appended in place: its inode is the file, whatever its name (hard links)
                    lock.hold_file()
        if save is not None:
            gone = remove_stale_temps(save.full)
            if gone:
                echo(f"note: removed {len(gone)} temporary file{'s' if len(gone) != 1 else ''} that a killed run "
                     f"left next to `{save.path}`: {', '.join(gone)}")
        run = _Run(compiled, opts, echo, run_id, seed, epochs, data, data_base, save, log)
        run.log_lock = next((lk for lk in locks if lk.out is log), None)
        return run.go()
    finally:
        for lock in reversed(locks):
            lock.release()


class _Run:
    """One training run once its settings and outputs are checked and locked: the data, the
    runner, the step loop and its bookkeeping (records, log, checkpoints, divergence,
    feedback).  The step loop itself stays a few lines (`go`); what happens after each step is
    `after_step`, after each epoch `end_epoch`."""

    def __init__(self, compiled: Compiled, opts: TrainOptions, echo, run_id: str, seed: int, epochs: int,
                 data: tuple, data_base: str, save: Output | None, log: Output | None):
        self.c, self.opts, self.echo, self.run_id = compiled, opts, echo, run_id
        self.program, self.m = compiled.program, compiled.program.model
        self.seed, self.epochs, self.data, self.data_base = seed, epochs, data, data_base
        self.save, self.log = save, log
        self.spans = dict(self.program.train_spans)
        self.result = TrainResult(run_id=run_id)
        self.saved_epoch: int | None = None  # the last epoch (from 1) this run wrote a checkpoint of
        self.resumed: Resumed | None = None
        self.steps_run = 0
        self.epoch_now = 0  # the epoch (from 1) in progress
        self.losses: list[float] = []
        self.bar = None
        self.log_f = None
        self.log_lock = None  # the OutputLock of the log (train sets it), re-held when the log is made anew
        self.log_ident: tuple[int, int] | None = None  # the log file this run appends to
        self.save_ident = save.ident if save is not None else None  # the checkpoint file it may replace
        self.save_lost = False  # another file took the checkpoint's place during the run
        self.done_epoch = 0  # the last whole epoch (from 1) this run finished
        self.start_epoch = 0
        self.t0 = time.perf_counter()
        self.best: float | None = None  # the lowest train loss of the whole epochs so far (the baseline)
        self.best_acc: float | None = None  # the highest test accuracy of the whole epochs so far
        self.weights_meta: tuple[dict, dict] | None = None  # --resume-weights: (parameters, metadata)

    # ---- setup

    def load_checkpoints(self) -> None:
        """--resume or --resume-weights, read and checked (X007, X014) before the data is: a bad
        checkpoint is reported at once, for what it is, before anything is written."""
        layout = _checkpoint_layout(self.program)
        if self.opts.resume:
            self.resumed = load_for_resume(self.opts.resume, layout, self.opts.data_limit)
        elif self.opts.resume_weights:
            self.weights_meta = load_weights(self.opts.resume_weights, self.program, layout, self.opts.data_limit)

    def load_data(self):
        m = self.m
        dname, dargs, dkw = self.data
        feat, lab = _input_names(self.program)
        in_shape = next(s for n, s, _ in m.inputs if n == feat)
        ds = load_dataset(dname, dargs, dkw, base_dir=self.data_base, span=self.spans.get("data"),
                          limit=self.opts.data_limit, sample_shape=tuple(in_shape[1:]))
        lab_dtype = next((d for n, _, d in m.inputs if n == lab), "i32")
        self.classes = dict((b.name, b.shape) for b in self.program.buffers).get(m.logits, (0, 0))[-1]
        ds = _fit_samples(ds, in_shape)
        check_compatible(ds, in_shape, lab_dtype, self.classes, self.spans.get("data"))
        self.ds, self.feat = ds, feat
        self.rank, self.world = dp_place(self.opts)
        self.batches = Batches(ds.x_train, ds.y_train, m.batch * self.world, self.seed, span=self.spans.get("data"),
                               epoch_samples=ds.epoch_samples)
        self.spe = self.batches.steps_per_epoch
        dt = {n: d for n, _, d in m.inputs}
        self._x_dtype, self._y_dtype = numpy_dtype(dt.get(feat, "f32")), numpy_dtype(dt.get(lab, "i32"))

    def lr_request(self) -> tuple[str, tuple, dict, Any]:
        if self.opts.lr is not None:
            return "constant", (self.opts.lr,), {}, None
        lname, largs, lkw = _call(dict(self.program.train).get("lr", 0.1), "constant")
        return lname, largs, lkw, self.spans.get("lr")

    def plan_lr(self, total: int) -> None:
        """The learning-rate schedule over absolute steps 0..total-1: the file's (or --lr), with a
        warmup longer than the run clipped (a note says so); when resuming with the very schedule
        the checkpoint was planned with, that plan continued by absolute step."""
        lname, largs, lkw, span = self.lr_request()
        sched = make_schedule(lname, largs, lkw, total, span, clip_warmup=True)
        self.lr_continues = False
        self.lr_requested = (f"--lr {self.opts.lr:g}" if self.opts.lr is not None else
                             str(make_schedule(lname, largs, lkw, 10 ** 12, span, check_range=False)))
        if self.resumed is not None:
            old = schedule_from_meta(self.resumed.meta.get("lr"))
            same = isinstance(self.resumed.meta.get("lr"), dict) and \
                self.resumed.meta["lr"].get("requested") == self.lr_requested
            if old is not None and same:
                sched = old.continued(self.resumed.step, total)
                self.lr_continues = total != old.total_steps
                self.lr_planned = old
        if sched.warmup_clipped_from is not None and not (self.resumed and sched.resume):
            self.echo(f"note: the warmup of {sched.warmup_clipped_from} steps is longer than this run "
                      f"({total} steps); it is clipped to {total} steps")
        self.lr_sched = sched

    def start(self, runner) -> None:
        """Initial values, then the checkpoint: --resume (every array, where the run stopped) or
        --resume-weights (the parameters only)."""
        program, opts = self.program, self.opts
        state = init_params(program, self.seed)
        if self.resumed is not None:
            state.update(self.resumed.arrays)
            self.result.history = list(self.resumed.history)
        elif self.weights_meta is not None:
            params, meta = self.weights_meta
            state.update(params)
            bufs = {b.name: b for b in program.buffers}
            for name, init in program.inits:  # EMA and f32 masters start at the loaded parameter
                if init.startswith("copy:") and init[5:] in params:
                    state[name] = params[init[5:]].astype(numpy_dtype(bufs[name].dtype))
            self.echo(f"note: loaded the {len(params)} parameter{'s' if len(params) != 1 else ''} of `{self.m.name}` "
                      f"from `{opts.resume_weights}`" + (f" (epoch {meta['epoch']} of run {meta['run']})"
                                                         if meta.get("run") and meta.get("format", 1) >= 2 else "")
                      + "; the optimizer state, statistics and epoch count start afresh")
        for name, v in state.items():
            runner.write(name, v)
        self.saved = [n for n, _ in program.inits]

    def resume_notes(self, total: int) -> None:
        r = self.resumed
        now = {"program": self.program.text_hash, "model": self.m.name, "data": self.ds.name, "seed": self.seed,
               "epochs": self.epochs, "steps_per_epoch": self.spe, "lr": self.lr_requested}
        changed = changes(r.meta, now)
        msg = f"resumed from `{r.path}` after epoch {r.epochs_done} (step {r.step})"
        if changed:
            msg += "; changed since it was written: " + ", ".join(changed)
        self.echo(msg)
        s = self.lr_sched
        if self.lr_continues and self.start_epoch < self.epochs:
            old = self.lr_planned
            end = s(total)
            if s.restarted:
                self.echo(f"note: the learning-rate plan of `{r.path}` had ended at step {old.total_steps} (rate "
                          f"{old(old.total_steps):.6g}), where going on would train at {end:.6g}; the {total - r.step} "
                          f"new steps follow {s} stretched to the new end, step {total}: {s(r.step):.6g} at step "
                          f"{r.step}, decaying to {end:.6g} (docs/data.md, \"Learning-rate schedules\")")
            else:
                self.echo(f"note: the learning rate continues the plan of `{r.path}` from step {r.step} "
                          f"({s(r.step):.6g}) and decays to {end:.6g} at step {total}, the end of this run (the plan "
                          f"ended at step {old.total_steps})")
        if self.start_epoch >= self.epochs:
            self.result.note = (f"the checkpoint `{r.path}` already holds all {self.epochs} epoch"
                                f"{'s' if self.epochs != 1 else ''}; give a larger --epochs to train further")

    # ---- the loop

    def go(self) -> TrainResult:
        """The run, from its checkpoints and data to its last epoch.  An interrupt at any point
        (loading the data included) is TrainInterrupted with what the outputs hold."""
        try:
            try:
                self.prepare()
                if self.log is not None:
                    self.open_log()
                self.t0 = time.perf_counter()
                self.open_bar()
                opts, runner, threads = self.opts, self.runner, self.result.threads
                if opts.progress and self.local_total:
                    ranks = f", {self.world} ranks of batch {self.m.batch}" if self.world > 1 else ""
                    self.say(f"run {self.run_id}: model `{self.m.name}` on {runner.name} ({threads} BLAS thread"
                             f"{'s' if threads != 1 else ''}{ranks}), epochs {self.start_epoch + 1}-{self.epochs} of "
                             f"{self.spe} steps")
                with blas_threads(threads), _quiet_numpy():
                    self.loop(runner)
                self.close(report=True)
            finally:
                self.close()
        except KeyboardInterrupt as exc:
            signum = getattr(exc, "signum", signal.SIGINT)
            raise TrainInterrupted(signum, self.interrupted_lines(signum)) from None
        runner.sync()
        self.result.params = {n: runner.read(n) for n in self.saved}
        self.result.steps = self.steps_run
        self.steps_note()
        self.result.wall_s = time.perf_counter() - self.t0
        self.result.races = runner.races
        return self.result

    def prepare(self) -> None:
        """Everything before the first step: the checkpoints, the data, the backend, the initial
        values, the learning-rate plan, the notes."""
        opts = self.opts
        self.t_start = time.perf_counter()
        self.load_checkpoints()
        self.load_data()
        runner = make_runner(self.c, opts)
        self.runner = runner
        self.result.backend = runner.name
        threads, note = choose_threads(opts.threads, self.c.schedule)
        self.result.threads = threads
        if note:
            self.echo(f"note: {note}")
        self.start(runner)
        spe = self.spe
        self.start_epoch = self.resumed.epochs_done if self.resumed else 0
        self.base_step = self.resumed.step if self.resumed else 0  # absolute steps before this run
        total = self.base_step + max(0, self.epochs - self.start_epoch) * spe  # the run's end, absolute
        self.plan_lr(max(total, 1))
        if self.resumed:
            self.resume_notes(total)
        if opts.max_steps == 0 and not self.result.note:
            self.result.note = "--steps 0"
        self.local_total = max(0, self.epochs - self.start_epoch) * spe
        self.done_epoch = self.start_epoch
        self.baseline()

    def loop(self, runner) -> None:
        opts, m, spe = self.opts, self.m, self.spe
        segs = self.c.segments or plan_segments(self.c.plan)
        self.cur = -1  # the step (of this run, from 0) whose host work runs
        self.result.first_step_s = time.perf_counter() - self.t_start
        runner.run(segs.for_step(-1), functools.partial(self.host_fn, step=-1))
        for e in range(self.start_epoch, self.epochs):
            if opts.max_steps is not None and self.steps_run >= opts.max_steps:
                break  # (before any work: `--steps 0` runs, records and saves nothing)
            self.epoch_now, self.losses, self.epoch_t0 = e + 1, EpochLosses(), time.perf_counter()
            self.epoch_first = self.steps_run  # steps of this run before this epoch
            for i in range(spe):
                if opts.max_steps is not None and self.steps_run >= opts.max_steps:
                    break
                k = (e - self.start_epoch) * spe + i
                self.cur = k
                runner.run(segs.for_step(k), functools.partial(self.host_fn, step=k))
                self.after_step(k)
            self.losses = runner.epoch_losses()  # the one read of the epoch's losses
            self.result.epoch_steps.append((len(self.losses), time.perf_counter() - self.epoch_t0))
            self.check_losses(e)
            runner.sync()
            self.end_epoch(e)
            if opts.max_steps is not None and self.steps_run >= opts.max_steps:
                break

    def host_fn(self, task: Task, arrays: dict, step: int | None = None, rank: int | None = None) -> None:
        """Host work: batches into staging slots, scalars into pinned buffers.  step: the loop
        step that issued the task (on the CPU it may run after later steps were issued); rank:
        the data-parallel rank whose shard is staged (simulated ranks; else this process's)."""
        at = self.cur if step is None else step
        if task.kernel == "stage":
            xb, yb = shard(*self.batch_at(at + task.attr("ahead", 0)), self.rank if rank is None else rank, self.world)
            np.copyto(arrays[task.outs[0]], xb if task.attr("field") == self.feat else yb, casting="unsafe")
        elif task.kernel == "set_scalar":
            k = self.base_step + max(at, 0)  # absolute: the schedule and Adam's t go on across resumes
            arrays[task.outs[0]][...] = self.lr_sched(k) if task.attr("name") == "lr" else float(k + 1)

    def batch_at(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """The batch of step j of this run (a prefetch past the end repeats the last batch): views
        of its epoch's samples, gathered in batch order ahead of time (`_epoch_arrays`)."""
        j = min(j, self.local_total - 1) if j >= self.local_total else j
        e, i = divmod(j, self.spe)
        xs, ys = self._epoch_arrays(e + self.start_epoch)
        b = self.batches.batch
        return xs[i * b:(i + 1) * b], ys[i * b:(i + 1) * b]

    def _gather(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch e's samples in its batch order, cast to the model's input dtypes once."""
        order = self.batches.order(e)
        return self.batches.x.take(order, axis=0).astype(self._x_dtype, copy=False), \
            self.batches.y.take(order, axis=0).astype(self._y_dtype, copy=False)

    def _epoch_arrays(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch e's gathered samples.  Host staging runs ahead (issue 13): while epoch e trains,
        one background thread gathers epoch e + 1, so a step's host work is a copy from a view into
        its pinned slot (the host waits only on the copy that last read that slot)."""
        cache = self.__dict__.setdefault("_epochs", {})
        if e not in cache:
            fut = self.__dict__.get("_ahead")
            cache[e] = fut.result() if fut is not None and self._ahead_epoch == e else self._gather(e)
            for old in [k for k in cache if k < e]:
                del cache[old]
            if e + 1 < self.start_epoch + max(self.epochs - self.start_epoch, 1):
                from concurrent.futures import ThreadPoolExecutor

                pool = self.__dict__.setdefault("_pool", ThreadPoolExecutor(1, thread_name_prefix="staging"))
                self._ahead, self._ahead_epoch = pool.submit(self._gather, e + 1), e + 1
        return cache[e]

    def after_step(self, k: int) -> None:
        """Bookkeeping after issuing step k of this run (from 0): count it, move the progress
        bar.  Nothing is read from the device here: the losses are read once per epoch."""
        self.steps_run += 1
        if self.bar is not None:
            try:
                self.bar.update(1)
            except (OSError, ValueError, AttributeError):  # feedback lost, never the run
                self.bar = None

    def check_losses(self, e: int) -> None:
        """Stop (X010) when a step of epoch e had a loss that is not finite, naming that step."""
        el = self.losses
        if el.bad_step is not None:
            step = self.base_step + self.epoch_first + el.bad_step  # absolute, from 1
            lr_what = f" with --lr {self.opts.lr:g}" if self.opts.lr is not None else ""
            raise self.diverged(f"the loss became {el.bad_value} at step {step} (epoch {e + 1}/{self.epochs}){lr_what}")

    def baseline(self) -> None:
        """The divergence rule's baseline from the resumed history: its best train loss and test
        accuracy, when they are comparable (the same data and model; a resume onto other data
        starts a new baseline, since a loss on other data says nothing of this one's)."""
        hist = self.result.history
        if self.resumed is not None:
            meta = self.resumed.meta
            if meta.get("data", self.ds.name) != self.ds.name or meta.get("model", self.m.name) != self.m.name:
                hist = []

        def good(r, key):
            v = r.get(key)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and not r.get("partial")

        self.best = min((r["train_loss"] for r in hist if good(r, "train_loss")), default=None)
        self.best_acc = max((r["test_acc"] for r in hist if good(r, "test_acc")), default=None)

    def end_epoch(self, e: int) -> None:
        """After epoch e (from 0): its record (evaluated on the test split; `partial` when --steps
        cut it short), the divergence rule, then the checkpoint (whole epochs only) and the log
        line together, then the per-epoch line."""
        program, runner, spe = self.program, self.runner, self.spe
        losses = self.losses
        whole = len(losses) == spe
        params = {n: runner.read(n) for n in self.saved}  # params and state (running statistics)
        step = self.base_step + (e - self.start_epoch) * spe + len(losses)
        rec = {"run": self.run_id, "epoch": e + 1, "step": step,
               "train_loss": losses.mean if len(losses) else float("nan"),
               "lr": self.lr_sched(max(0, min(step - 1, self.lr_sched.total_steps - 1))),
               "time_s": round(time.perf_counter() - self.t0, 3)}
        if not whole:  # --steps stopped inside it: never saved, and a resume trains it again, whole
            rec.update(partial=True, epoch_steps=len(losses), steps_per_epoch=spe)
        if program.loss_scale:  # mixed precision: the dynamic loss scale after this epoch
            rec["loss_scale"] = float(runner.read(program.loss_scale))
        if ((e + 1) % self.opts.eval_every == 0 or e == self.epochs - 1 or not whole) and self.rank == 0:
            t_eval = time.perf_counter()
            tl, acc = evaluate(program, params, self.ds.x_test, self.ds.y_test)
            self.result.eval_s += time.perf_counter() - t_eval
            rec.update(test_loss=tl, test_acc=acc)
            if self.ds.kind == "text":  # bytes are the tokens: the loss in bits per byte
                rec["test_bpb"] = tl / math.log(2)
        lr_what = f" with --lr {self.opts.lr:g}" if self.opts.lr is not None else ""
        why = divergence(rec["train_loss"], self.best, self.classes, rec.get("test_acc"), self.best_acc) \
            if losses else None
        bad = first_nonfinite(params) if not why else None
        if bad is not None:  # the loss stayed finite, the state did not: never saved
            name, idx, v = bad
            why = f"`{name}` became {v} at index [{', '.join(map(str, idx))}] while the loss stayed finite"
        if why:
            rec["diverged"] = True
            self.write_log(rec)
            raise self.diverged(f"training diverged in epoch {e + 1}/{self.epochs}{lr_what}: {why}", epoch=e + 1)
        self.result.history.append(rec)
        if whole:
            self.done_epoch = e + 1
            if math.isfinite(rec["train_loss"]):
                self.best = rec["train_loss"] if self.best is None else min(self.best, rec["train_loss"])
            if isinstance(rec.get("test_acc"), float) and math.isfinite(rec["test_acc"]):
                self.best_acc = rec["test_acc"] if self.best_acc is None else max(self.best_acc, rec["test_acc"])
        with _signals_deferred():  # the checkpoint and its log line: both, or an interrupt before both
            if self.save is not None and whole:  # only a whole epoch: a resume restarts at the next one
                self.write_checkpoint(e + 1, step, params)
            self.write_log(rec)
        if self.bar is not None and "test_acc" in rec:
            try:
                self.bar.set_postfix(epoch=e + 1, loss=f"{rec['train_loss']:.4f}", acc=f"{rec['test_acc']:.3f}")
            except (OSError, ValueError, AttributeError):
                self.bar = None
        if self.opts.progress:
            part = "" if whole else f" (partial: {len(losses)} of {spe} steps{', not saved' if self.save else ''})"
            line = f"epoch {e + 1}/{self.epochs}{part}: train loss {rec['train_loss']:.4f}"
            if "test_acc" in rec:
                line += f", test loss {rec['test_loss']:.4f}, test accuracy {100 * rec['test_acc']:.2f}%"
            if "test_bpb" in rec:
                line += f", {rec['test_bpb']:.4f} bits per byte"
            self.say(line + f", {time.perf_counter() - self.epoch_t0:.2f} s")

    def open_log(self) -> None:
        """Open the log for appending and lock it through its inode (a second name for it, a hard
        link, is refused to other runs)."""
        self.log_f = open_log(self.log)
        fd = self.log_f.fileno()
        st = os.fstat(fd)
        self.log_ident = (st.st_dev, st.st_ino)
        self.log_head = b""
        self.log_f.flush()  # (a newline that ends a killed run's last line)
        self.log_seen()
        if self.log_lock is not None and self.log_lock.file_ident != self.log_ident:
            if self.log_lock.file_fd is not None:  # the file the lock held is not the one opened
                os.close(self.log_lock.file_fd)
                self.log_lock.file_fd = None
            self.log_lock.hold_file(fd)

    def write_log(self, rec: dict) -> None:
        """Append `rec` to the log, which must still be the file this run opened (outputs.
        check_unchanged): a log deleted or moved away is made anew, with a note; another file put
        at its path is X021 and left as it is."""
        if self.log_f is None:
            return
        try:
            if not self.log_is_ours():
                self.log_f.close()
                self.log_f = None
                self.open_log()
                self.echo(f"note: the log `{self.log.path}` was deleted or moved during the run; a new one there "
                          f"holds the records from epoch {rec['epoch']} on")
            self.log_f.write(json.dumps(rec) + "\n")
            self.log_f.flush()
            self.log_seen()
        except StreamschedError as e:
            kept = self.kept()
            raise StreamschedError([_with_help(d, kept.replace("; the checkpoint", ", then resume: the checkpoint", 1))
                                    for d in e.diagnostics]) from None
        except OSError as exc:
            raise _x("X021", f"cannot write the log `{self.log.path}`: {exc.strerror or exc}", self.log.span,
                     help="the lines written before are kept; free space or name another file" + self.kept()) from None

    def log_seen(self) -> None:
        """Note the log as this run left it: its size and its first bytes (log_is_ours)."""
        fd = self.log_f.fileno()
        self.log_size = os.fstat(fd).st_size
        if len(getattr(self, "log_head", b"")) < 256:
            try:
                self.log_head = os.pread(fd, 256, 0)
            except OSError:  # a log this user may write but not read: its size and inode only
                self.log_head = b""

    def log_is_ours(self) -> bool:
        """Whether the log path still names the file this run appends to, as it left it (the same
        inode, not shorter, the same first bytes: another file copied over it in place is not);
        False when it is gone (deleted or moved: made anew).  Raises StreamschedError X021 when
        another file is there."""
        fd = self.log_f.fileno()
        st = os.fstat(fd)
        head = getattr(self, "log_head", b"")
        expect = (st.st_dev, st.st_ino)
        try:
            now = os.lstat(self.log.full)
        except FileNotFoundError:
            return False
        except OSError:
            now = None
        same = now is not None and (now.st_dev, now.st_ino) == expect and stat.S_ISREG(now.st_mode)
        if same and st.st_size >= getattr(self, "log_size", 0):
            try:
                if os.pread(fd, len(head), 0) == head:
                    return True
            except OSError:
                return True
        # another file is there, or this one was rewritten: never appended to
        return check_unchanged(self.log, None, help="move that file away")  # X021 naming it (False: gone now)

    def kept(self) -> str:
        """`; the checkpoint `ck.npz` holds epoch 3: resume with `...`` for a run that stops on an
        output it cannot write, or ""."""
        ck = self.good_checkpoint()
        if not ck:
            return ""
        cmd = resume_command(self.opts.argv, ck[0])
        return f"; the checkpoint `{ck[0]}` holds epoch {ck[1]}" + (f": resume with `{cmd}`" if cmd else "")

    def write_checkpoint(self, epoch: int, step: int, arrays: dict[str, np.ndarray] | None = None) -> None:
        """Write the checkpoint of whole epoch `epoch` (absolute step `step`) over the file this run
        may replace (outputs.check_unchanged: the one it wrote last, or the one it was allowed at
        the start, or nothing; another file put there during the run is X021 and kept)."""
        program, m = self.program, self.m
        if arrays is None:
            arrays = {n: self.runner.read(n) for n in self.saved}
        layout = _layout_json(program)
        meta = {"run": self.run_id, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": m.name,
                "program": program.text_hash, "data": self.ds.name, "seed": self.seed, "epoch": epoch,
                "epochs": self.epochs, "step": step, "steps_per_epoch": self.spe,
                "lr": lr_meta(self.lr_sched, self.lr_requested), "layout": layout,
                "history": [_json_safe(r) for r in self.result.history]}
        from streamsched.interp.checkpoint import checkpoint_meta

        held = self.saved_epoch or (self.resumed.epochs_done if self.resumed and same_file(self.resumed.path,
                                                                                           self.save.full) else 0)
        gone = f"; the checkpoint of epoch {held} that was there is gone" if held else ""
        logged = f" (the log `{self.log.path}` holds the records of every finished epoch)" if self.log else ""
        try:
            check_unchanged(self.save, self.save_ident,
                            ours=lambda p: (checkpoint_meta(p) or {}).get("run") == self.run_id,
                            help=f"move that file away, then run again{gone}{logged}")
        except StreamschedError:
            self.save_lost = True
            raise
        try:
            with _signals_deferred():  # what the file holds and what an interrupt reports stay one
                save_checkpoint(self.save.full, arrays, meta)
                self.saved_epoch = epoch
                self.save_ident = file_stamp(os.lstat(self.save.full))
        except OSError as exc:
            raise _x("X021", f"cannot write the checkpoint `{self.save.path}` after epoch {epoch}: "
                     f"{exc.strerror or exc}",
                     help="the previous checkpoint, if any, is untouched; free space or name another "
                          "file with --save") from None

    # ---- ends

    def good_checkpoint(self) -> tuple[str, int] | None:
        """The latest checkpoint of this run's state: (path, whole epochs it holds), or None."""
        if self.save is not None and self.saved_epoch is not None and not self.save_lost:
            return self.save.path, self.saved_epoch
        gone = self.save is not None and (self.save_lost or self.saved_epoch is not None)
        if self.resumed is not None and os.path.exists(self.resumed.path) and not (
                gone and same_file(self.resumed.path, self.save.full)):
            return self.resumed.path, self.resumed.epochs_done
        return None

    def lost_epochs(self, ck: tuple[str, int] | None) -> str:
        """What a stop loses: ` epochs 4-27 of this run are in no checkpoint: ...`, or ""."""
        held = ck[1] if ck else 0
        if self.done_epoch <= max(held, self.start_epoch):
            return ""
        first = max(held, self.start_epoch) + 1
        span = f"epoch {first}" if first == self.done_epoch else f"epochs {first}-{self.done_epoch}"
        why = "no --save was given" if self.save is None else f"`{self.save.path}` could not be written"
        return f"{span} of this run {'is' if first == self.done_epoch else 'are'} in no checkpoint ({why})"

    def data_outlier(self) -> tuple[float, tuple[int, ...]] | None:
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

    def diverged(self, what: str, epoch: int | None = None) -> StreamschedError:
        """X010 for a run that diverged: names the last checkpoint (and whether it is the run's best
        epoch), and the help gives the command that resumes from it with a lower learning rate (a
        tenth of --lr when the rate came from the command line; the train block's `lr` is the
        user's to lower).  A rate of 0 is never blamed (nor suggested): the weights did not move,
        so the data (caret on `data`) or the initial weights made the loss; data with features far
        beyond the usual scale gets a note either way."""
        ck = self.good_checkpoint()
        lr = self.opts.lr
        argv = self.opts.argv
        k0 = self.base_step + getattr(self, "epoch_first", 0)
        rates = [self.lr_sched(k) for k in range(k0, k0 + max(1, len(self.losses)))]
        zero_rate = max(rates, default=0.0) == 0.0
        outlier = self.data_outlier() if hasattr(self, "ds") else None
        notes = []
        if outlier is not None:
            v, idx = outlier
            notes.append(f"the training features reach {v:.3g} (`x_train` at [{', '.join(map(str, idx))}]); features "
                         f"that large make the loss blow up at any rate")
        if lr is not None and argv:
            argv = _without_option(argv, "--lr") + ("--lr", f"{lr / 10:g}")
        lower = "lower `lr` in the train block" if lr is None else f"use a lower rate, e.g. `--lr {lr / 10:g}`"
        where = ""
        if ck:
            rec = next((r for r in self.result.history if r.get("epoch") == ck[1] and not r.get("partial")), {})
            best = self.best_acc
            acc = rec.get("test_acc")
            if isinstance(acc, float) and best is not None and acc < best - 0.01:
                best_ep = max((r for r in self.result.history if r.get("test_acc") == best), key=lambda r: r["epoch"],
                              default={}).get("epoch")
                where = (f"; the last checkpoint is `{ck[0]}` (epoch {ck[1]}, test accuracy {100 * acc:.2f}%; the best "
                         f"epoch{f' ({best_ep})' if best_ep else ''} had {100 * best:.2f}%), no checkpoint of this "
                         "epoch was written")
            else:
                where = f"; the last good checkpoint is `{ck[0]}` (epoch {ck[1]}), no checkpoint of this epoch was written"
            lost = self.lost_epochs(ck)
            if lost:
                where += f"; {lost}"
        else:
            where = "; no checkpoint was written" + (" (none was asked for: --save FILE keeps the last good epoch)"
                                                     if self.save is None else "")
        if zero_rate or outlier is not None:  # the data, not the rate, is the suspect: the caret is on `data`
            dspan = self.spans.get("data")
            msg = f"{what}; stopping{where}"
            if zero_rate:
                msg += ("; the learning rate was 0, so the weights did not move: the loss comes from the data and the "
                        "initial weights, not from the rate")
            if outlier is not None:
                help_ = "scale the data: every feature should be a finite number of about [-1, 1] or [0, 1]"
                if not zero_rate:
                    help_ += f", then train again (if the data is as meant, {lower})"
            else:
                help_ = "check the data and the model's initial values (`init`)"
            return StreamschedError([Diagnostic("X010", msg, dspan, help=help_, notes=tuple(notes))])
        if ck:
            cmd = resume_command(argv, ck[0])
            if cmd:
                help_ = (f"lower `lr` in the train block, then resume from it: `{cmd}`" if lr is None else
                         f"resume from it with a tenth of the learning rate: `{cmd}`")
            else:
                help_ = f"{lower}, then resume from `{ck[0]}`"
        else:
            help_ = lower
        lr_span = None if lr is not None else self.spans.get("lr")
        return StreamschedError([Diagnostic("X010", f"{what}; stopping{where}", lr_span, help=help_,
                                            notes=tuple(notes))])

    def interrupted_lines(self, signum: int) -> list[str]:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        where = f"in epoch {self.epoch_now}/{self.epochs}" if self.epoch_now else "before the first step"
        lines = [f"interrupted by {name} {where}, after {self.steps_run} step{'s' if self.steps_run != 1 else ''} "
                 f"of this run (run {self.run_id})"]
        ck = self.good_checkpoint()
        if ck:
            cmd = resume_command(self.opts.argv, ck[0])
            lines.append(f"the checkpoint `{ck[0]}` holds epoch {ck[1]}" + ("; resume with:" if cmd else ""))
            if cmd:
                lines.append(f"  {cmd}")
        elif self.save is not None:
            lines.append(f"no epoch finished, so nothing was written to `{self.save.path}`; run the same command "
                         "again" + ("" if self.opts.resume else " to start over"))
        else:
            lines.append("no checkpoint was written: give --save FILE to be able to resume")
        lost = self.lost_epochs(ck)
        if lost:
            lines.append(lost[0].upper() + lost[1:] + ": they are lost")
        if self.log is not None:
            lines.append(f"the log `{self.log.path}` holds every finished epoch")
        return lines

    def steps_note(self) -> None:
        spe, save = self.spe, self.save
        if save and self.steps_run > 0 and self.steps_run % spe:  # --steps stopped inside an epoch
            done = self.steps_run % spe
            stopped = self.start_epoch + self.steps_run // spe + 1  # the epoch (from 1) it stopped in
            why = (f"--steps {self.opts.max_steps} stopped after {done} of the {spe} steps of epoch {stopped}, "
                   f"and only whole epochs are saved (a resume restarts at an epoch)")
            if self.saved_epoch is None:
                kept = " (the file there is untouched)" if save.exists else ""
                self.result.notes.append(f"no checkpoint was written to `{save.path}`{kept}: {why}")
            else:
                self.result.notes.append(f"the checkpoint `{save.path}` holds epoch {self.saved_epoch}, not the "
                                         f"last {done} step{'s' if done != 1 else ''}: {why}")

    def open_bar(self) -> None:
        if not self.opts.progress:
            return
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=self.local_total, unit="step", leave=False, file=sys.stderr, disable=None)
            if self.bar.disable:  # not a terminal: the per-epoch lines are the feedback
                self.bar = None
        except ImportError:  # pragma: no cover
            self.bar = None

    def say(self, line: str) -> None:
        """A feedback line (above the progress bar when there is one); feedback that cannot be
        written is dropped, it never stops the run."""
        try:
            if self.bar is not None:
                self.bar.write(line, file=sys.stderr)
            else:
                self.echo(line)
        except (OSError, ValueError, AttributeError):
            self.bar = None

    def close(self, report: bool = False) -> None:
        """Close the bar and the log; report: a failure to close the log (a full disk shows at the
        last flush) is X021, else (another error already on its way) it is dropped."""
        pool = self.__dict__.pop("_pool", None)
        if pool is not None:  # the staging thread (it may be gathering an epoch nobody will run)
            pool.shutdown(wait=False, cancel_futures=True)
        if self.bar is not None:
            try:
                self.bar.close()
            except (OSError, ValueError, AttributeError):
                pass
            self.bar = None
        if self.log_f is not None:
            f, self.log_f = self.log_f, None
            try:
                f.close()
            except OSError as exc:
                if report:
                    raise _x("X021", f"cannot write the log `{self.log.path}`: {exc.strerror or exc}", self.log.span,
                             help="the lines written before are kept; free space or name another file") from None


def _json_safe(rec: dict) -> dict:
    """A record with NaN and infinities as null (a test loss can overflow while the training loss
    stays finite), since checkpoint metadata is strict JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}


def _without_option(argv: tuple[str, ...], flag: str) -> tuple[str, ...]:
    """argv without `flag VALUE` and `flag=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return tuple(out)


_DEFERRED = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


@contextmanager
def _signals_deferred():
    """SIGINT and SIGTERM that arrive during the block take effect when it is done (their handlers
    are swapped for ones that only note them, then restored and called).  Blocking the signals
    in the kernel would not do: another thread (BLAS's) would take them, and Python would run the
    handler in the main thread inside the block all the same.  A no-op outside the main thread."""
    got: list[int] = []
    old = {}
    try:
        for sig in _DEFERRED:
            old[sig] = signal.signal(sig, lambda signum, frame: got.append(signum))
    except ValueError:  # not the main thread
        for sig, h in old.items():
            signal.signal(sig, h)
        yield
        return
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        if got:
            h = old[got[0]]
            if callable(h):
                h(got[0], None)
            elif h == signal.SIG_DFL:
                os.kill(os.getpid(), got[0])


@contextmanager
def _quiet_numpy():
    """Overflow and NaN in the kernels are caught as X010, by the loss: no NumPy warnings."""
    old = np.seterr(over="ignore", invalid="ignore", divide="ignore")
    try:
        yield
    finally:
        np.seterr(**old)
