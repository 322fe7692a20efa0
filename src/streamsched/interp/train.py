"""The training loop driven by the `train` block: data staged into the A/B slots by host tasks,
the learning rate uploaded every step, the EventPlan issued one step at a time on a backend,
evaluation each epoch, JSON-lines logs, atomic checkpoints, and a clear stop on divergence.

Source: LANGUAGE.md (`train`, `step`), the seed's run_train_epoch_gpu step loop.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.dsl.resolve import CallValue
from streamsched.interp.barriers import plan_segments
from streamsched.interp.checkpoint import check_arrays, check_meta, load_checkpoint, save_checkpoint
from streamsched.interp.data import Batches, check_compatible, load_dataset
from streamsched.interp.ir import Task
from streamsched.interp.lr import make_schedule
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
    """Command-line overrides of the `train` block (None keeps the file's value)."""

    epochs: int | None = None
    lr: float | None = None
    seed: int | None = None
    backend: str = "auto"
    interleave: str = "fixed"
    interleave_seed: int = 0
    log: str | None = None
    save: str | None = None
    resume: str | None = None
    max_steps: int | None = None
    progress: bool = True
    detect_races: bool = True
    eval_every: int = 1


@dataclass
class TrainResult:
    """What a run produced: per-epoch records (the JSON-lines log), the final parameters (host
    copies, name -> ndarray) and the backend used."""

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

    @property
    def final_accuracy(self) -> float:
        return self.history[-1]["test_acc"] if self.history else float("nan")


def _x(code: str, msg: str, span=None, help: str = "") -> StreamschedError:
    return StreamschedError([Diagnostic(code, msg, span, help=help)])


def init_params(program, seed: int) -> dict[str, np.ndarray]:
    """Initial values of every buffer with an init (params, optimizer state, constants).

    glorot: uniform(-l, l), l = sqrt(6 / (fan_in + fan_out)) (Glorot & Bengio, 2010);
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
        fan_in, fan_out = b.shape[0], b.shape[-1]
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


class CpuRunner:
    """The CPU backend behind the loop's small interface: run / read / write."""

    name = "cpu"

    def __init__(self, compiled: Compiled, interleave: str, seed: int, detect_races: bool):
        from streamsched.interp.cpu_backend import CpuExecutor
        from streamsched.interp.memory import allocate_arrays

        self.arrays = allocate_arrays(compiled.schedule.buffers)
        self.ex = CpuExecutor(compiled.schedule, self.arrays, compiled.program.kernels, interleave=interleave, seed=seed,
                              detect_races=detect_races)

    def run(self, instrs, host_fn) -> None:
        from streamsched.interp.cpu_backend import TaskFailed

        try:
            self.ex.run(instrs, host_fn)
        except TaskFailed as e:
            raise TaskFailedError(e.task, e.cause) from e

    def read(self, name: str) -> np.ndarray:
        return np.array(self.arrays[name])

    def write(self, name: str, value: np.ndarray) -> None:
        self.arrays[name][...] = value

    def sync(self) -> None:
        pass

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

            try:
                return CudaRunner(compiled)
            except ArenaOutOfMemory as exc:  # CuPy's OutOfMemoryError, or pinned memory
                raise _out_of_memory(exc, "cuda", compiled) from None
        if want == "cuda":
            raise _x("X020", f"--backend cuda: no usable GPU ({why})",
                     help="install streamsched[cuda12] or [cuda13] on a machine with an NVIDIA GPU, or use --backend cpu")
        print(f"note: no GPU ({why}); running on the CPU backend", file=sys.stderr)
    elif want != "cpu":
        raise _x("X004", f"unknown backend `{want}`", help="backends: auto, cpu, cuda")
    try:
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
    chunks of the model's batch (the last chunk padded, padding ignored)."""
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
        correct += int((logits[:k].argmax(axis=1) == yb).sum())
        # the batch loss averages over padding rows too: recompute on the real rows
        z = logits[:k].astype(np.float64)
        z = z - z.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=1))
        total_loss += float((lse - z[np.arange(k), yb]).sum())
    return total_loss / n, correct / n


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


def _check_output(path: Any, noun: str, flag: str | None, span, program_path: str | None, *, append: bool) -> str:
    """Refuse, before any training, an output file that cannot be written: a folder, a file in a
    folder that does not exist or cannot be written, or the program's own .sched file.
    noun: "the checkpoint", "the log"; flag: the command-line option it came from, None for the
    train block (then span is its line); append: the file is appended to (a log), else replaced
    atomically (a checkpoint).  Returns the path."""
    if not isinstance(path, str) or not path:
        raise _x("X004", f"{flag or '`log`'} needs a file name, got {path!r}", span,
                 help=f"e.g. `{flag} run.out`" if flag else 'write e.g. `log = "run.jsonl"`')
    full = os.path.abspath(os.path.expanduser(path))
    parent = os.path.dirname(full)
    origin = f" ({flag})" if flag else ""

    def fail(why: str, help: str) -> StreamschedError:
        return _x("X021", f"cannot write {noun} `{path}`{origin}: {why}", span, help=help)

    if os.path.isdir(full):
        example = os.path.join(path, "run.jsonl" if append else "run.npz")
        raise fail("it is a folder", f"name a file in it, e.g. `{example}`")
    if not os.path.isdir(parent):
        why = f"the folder `{parent}` does not exist" if not os.path.exists(parent) else f"`{parent}` is not a folder"
        raise fail(why, "create the folder first, or name a file in an existing folder")
    exists = os.path.exists(full)
    if append and exists:  # a log grows in place
        if not os.access(full, os.W_OK):
            raise fail("the file is not writable", "name another file, or make it writable")
    elif not os.access(parent, os.W_OK | os.X_OK):  # a new file, or a checkpoint replaced via a temporary
        raise fail(f"the folder `{parent}` is not writable", "name a file in a folder you can write to")
    if exists and program_path and os.path.exists(program_path) and os.path.samefile(full, program_path):
        raise fail("it is the program being run", "name another file; the .sched file is never overwritten")
    return path


def setting_dir(span, default: str) -> str:
    """The folder a path written at `span` is relative to: the folder of the file that wrote it
    (an included file's own folder), else `default` (the top file's)."""
    if span is not None and getattr(span, "file", "") and os.path.exists(span.file):
        return os.path.dirname(os.path.abspath(span.file))
    return default


def check_train_settings(program) -> list[Diagnostic]:
    """What `streamsched check` can say about the `train` block without loading data or
    training, with the very checks `train` runs, so that `check` refuses every value `run` would
    refuse, with the same code and span: whole-number epochs and seed, a known data source whose
    arguments bind and are in range and whose file or folder exists (data.check_source), a known
    learning-rate schedule with valid arguments (its warmup against the run's length when the
    data's size is known without reading it: `digits`), and a `log` that names a file that can
    be written (X001, X002, X004, X021)."""
    from streamsched.interp.data import check_source, digits_train_samples

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

    epochs = attempt(lambda: _whole_number(tv.get("epochs", 10), "epochs", spans.get("epochs"), minimum=1, flag=None))
    if "seed" in tv:
        attempt(lambda: _whole_number(tv["seed"], "seed", spans.get("seed"), minimum=0, flag=None))
    dname, dargs, dkw = _call(tv.get("data", CallValue("digits", (), ())), "digits")
    dspan = spans.get("data")
    bound = attempt(lambda: check_source(dname, dargs, dkw, base_dir=setting_dir(dspan, top), span=dspan))
    total = 10 ** 9  # the run's length, unknown until the data is read
    m = program.model
    if dname == "digits" and bound is not None and epochs is not None and m is not None and m.batch:
        spe = digits_train_samples(bound["test"]) // m.batch
        if spe >= 1:  # (a batch larger than the data is X006 when run reads it)
            total = epochs * spe
    lname, largs, lkw = _call(tv.get("lr", 0.1), "constant")
    attempt(lambda: make_schedule(lname, largs, lkw, total, spans.get("lr")))
    if tv.get("log") is not None:
        log_v = tv["log"]
        if isinstance(log_v, str) and log_v:
            log_v = os.path.join(setting_dir(spans.get("log"), top), os.path.expanduser(log_v))
        attempt(lambda: _check_output(log_v, "the log", None, spans.get("log"), program.path, append=True))
    return diags


def train(compiled: Compiled, opts: TrainOptions | None = None, *, base_dir: str = ".",
          echo: Callable[[str], None] | None = None) -> TrainResult:
    """Run the training loop of a compiled program; returns the history and final parameters.

    Raises StreamschedError (X codes) for bad data, options, checkpoints and for a diverging
    run (X010: the loss became NaN or infinite; the last good checkpoint is kept).
    """
    opts = opts or TrainOptions()
    echo = echo or (lambda s: print(s, file=sys.stderr))
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
    if opts.lr is not None and (isinstance(opts.lr, bool) or not isinstance(opts.lr, (int, float))
                                or not math.isfinite(opts.lr) or opts.lr < 0):
        raise _x("X004", f"--lr must be a non-negative number, got {opts.lr!r}", help="e.g. `--lr 0.05`")
    save = _check_output(opts.save, "the checkpoint", "--save", None, program.path, append=False) if opts.save else None
    if opts.log:
        log = _check_output(opts.log, "the log", "--log", None, program.path, append=True)
    elif tv.get("log") is not None:  # the train block's `log = "run.jsonl"`, relative to the .sched file
        log_v = tv["log"]
        if isinstance(log_v, str) and log_v:
            log_v = os.path.join(setting_dir(spans.get("log"), base_dir), os.path.expanduser(log_v))
        log = _check_output(log_v, "the log", None, spans.get("log"), program.path, append=True)
    else:
        log = None
    dname, dargs, dkw = _call(tv.get("data", CallValue("digits", (), ())), "digits")
    ds = load_dataset(dname, dargs, dkw, base_dir=setting_dir(spans.get("data"), base_dir), span=spans.get("data"))
    feat, lab = _input_names(program)
    in_shape = next(s for n, s, _ in m.inputs if n == feat)
    lab_dtype = next((d for n, _, d in m.inputs if n == lab), "i32")
    classes = dict((b.name, b.shape) for b in program.buffers).get(m.logits, (0, 0))[-1]
    ds = _fit_samples(ds, in_shape)
    check_compatible(ds, in_shape, lab_dtype, classes, spans.get("data"))
    batches = Batches(ds.x_train, ds.y_train, m.batch, seed, span=spans.get("data"))
    spe = batches.steps_per_epoch
    total = epochs * spe
    if opts.lr is not None:
        lr_sched = make_schedule("constant", (opts.lr,), {}, total)
    else:
        lname, largs, lkw = _call(tv.get("lr", 0.1), "constant")
        lr_sched = make_schedule(lname, largs, lkw, total, spans.get("lr"))

    runner = make_runner(compiled, opts)
    state = {**init_params(program, seed)}
    for name, v in state.items():
        runner.write(name, v)
    start_epoch = 0
    result = TrainResult(backend=runner.name)
    expected_meta = {"program": program.text_hash, "model": m.name, "seed": seed, "steps_per_epoch": spe}
    if opts.resume:
        arrays, meta = load_checkpoint(opts.resume)
        check_meta(meta, expected_meta)
        check_arrays(arrays, _checkpoint_layout(program), opts.resume)
        for name, v in arrays.items():
            runner.write(name, v)
        start_epoch = int(meta["epoch"]) + 1
        result.history = list(meta.get("history", []))
        echo(f"resumed from {opts.resume} after epoch {start_epoch}")
        if start_epoch >= epochs:
            result.note = (f"the checkpoint `{opts.resume}` already holds all {epochs} epoch"
                           f"{'s' if epochs != 1 else ''}; give a larger --epochs to train further")
    if opts.max_steps == 0 and not result.note:
        result.note = "--steps 0"
    saved = [n for n, _ in program.inits]

    # host work: batches into staging slots, scalars into pinned buffers
    cur = {"k": -1}
    order_cache: dict[int, np.ndarray] = {}

    def batch_at(j: int) -> tuple[np.ndarray, np.ndarray]:
        e, i = divmod(min(j, total - 1) if j >= total else j, spe)
        if e not in order_cache:
            order_cache.clear()
            order_cache[e] = batches.order(e)
        sel = order_cache[e][i * batches.batch:(i + 1) * batches.batch]
        return batches.x[sel], batches.y[sel]

    def host_fn(task: Task, arrays: dict) -> None:
        if task.kernel == "stage":
            xb, yb = batch_at(cur["k"] + task.attr("ahead", 0))
            arrays[task.outs[0]][...] = xb if task.attr("field") == feat else yb
        elif task.kernel == "set_scalar":
            name = task.attr("name")
            k = max(cur["k"], 0)
            arrays[task.outs[0]][...] = lr_sched(k) if name == "lr" else float(k + 1)

    plan = compiled.plan
    steps_run = 0
    saved_epoch = None  # the last epoch this run wrote a checkpoint for
    try:
        log_f = open(log, "a", encoding="utf-8") if log else None
    except OSError as exc:
        raise _x("X021", f"cannot write the log `{log}`: {exc.strerror or exc}", None if opts.log else spans.get("log"),
                 help="name a file in a folder you can write to") from None
    t0 = time.perf_counter()
    bar = None
    if opts.progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=max(0, epochs - start_epoch) * spe, unit="step", leave=False, file=sys.stderr,
                       disable=None)
        except ImportError:  # pragma: no cover
            bar = None
    first = start_epoch * spe
    cur["k"] = first - 1
    segs = compiled.segments or plan_segments(plan)
    lr_span = None if opts.lr is not None else spans.get("lr")
    lr_what = f" with --lr {opts.lr:g}" if opts.lr is not None else ""
    # Overflow and NaN in the kernels are caught as X010 below, by the loss: no NumPy warnings.
    old_err = np.seterr(over="ignore", invalid="ignore", divide="ignore")
    try:
        runner.run(segs.for_step(-1), host_fn)
        for e in range(start_epoch, epochs):
            if opts.max_steps is not None and steps_run >= opts.max_steps:
                break  # (before any work: `--steps 0` runs, records and saves nothing)
            losses = []
            for i in range(spe):
                if opts.max_steps is not None and steps_run >= opts.max_steps:
                    break
                k = e * spe + i
                cur["k"] = k
                runner.run(segs.for_step(k - first), host_fn)
                loss = float(runner.read(m.loss))
                losses.append(loss)
                steps_run += 1
                if not math.isfinite(loss):
                    where = f" (last good checkpoint: {save})" if save and os.path.exists(save) else ""
                    raise _x("X010", f"the loss became {loss} at step {k} (epoch {e}){lr_what}; "
                             f"stopping{where}", lr_span, help="lower the learning rate, or check the data for NaN")
                if bar is not None:
                    bar.update(1)
                    if i % 5 == 0:
                        bar.set_postfix(epoch=e, loss=f"{loss:.4f}")
            runner.sync()
            params = {n: runner.read(n) for n in saved}  # params and state (running statistics)
            rec = {"epoch": e, "step": e * spe + len(losses), "train_loss": float(np.mean(losses)) if losses else float("nan"),
                   "lr": lr_sched(min((e + 1) * spe - 1, total - 1)), "time_s": round(time.perf_counter() - t0, 3)}
            if program.loss_scale:  # mixed precision: the dynamic loss scale after this epoch
                rec["loss_scale"] = float(runner.read(program.loss_scale))
            if (e + 1) % opts.eval_every == 0 or e == epochs - 1:
                tl, acc = evaluate(program, params, ds.x_test, ds.y_test)
                rec.update(test_loss=tl, test_acc=acc)
            result.history.append(rec)
            if log_f:
                try:
                    log_f.write(json.dumps(rec) + "\n")
                    log_f.flush()
                except OSError as exc:
                    raise _x("X021", f"cannot write the log `{log}`: {exc.strerror or exc}",
                             help="the lines written before are kept; free space or name another file") from None
            if bar is not None and "test_acc" in rec:
                bar.set_postfix(epoch=e, loss=f"{rec['train_loss']:.4f}", acc=f"{rec['test_acc']:.3f}")
            if save and len(losses) == spe:  # only a whole epoch: a resume restarts at the next one
                arrays = {n: runner.read(n) for n in saved}
                try:
                    save_checkpoint(save, arrays, {**expected_meta, "epoch": e, "history": result.history})
                    saved_epoch = e
                except OSError as exc:
                    raise _x("X021", f"cannot write the checkpoint `{save}` after epoch {e}: {exc.strerror or exc}",
                             help="the previous checkpoint, if any, is untouched; free space or name another "
                                  "file with --save") from None
            if opts.max_steps is not None and steps_run >= opts.max_steps:
                break
    finally:
        np.seterr(**old_err)
        if bar is not None:
            bar.close()
        if log_f:
            log_f.close()
    runner.sync()
    result.params = {n: runner.read(n) for n in saved}
    result.steps = steps_run
    if save and steps_run > 0 and steps_run % spe:  # --steps stopped inside an epoch
        stopped = (first + steps_run) // spe  # the 0-based epoch it stopped in
        done = (first + steps_run) % spe
        why = (f"--steps {opts.max_steps} stopped after {done} of the {spe} steps of epoch {stopped + 1}, "
               f"and only whole epochs are saved (a resume restarts at an epoch)")
        if saved_epoch is None:
            kept = " (the file there is untouched)" if os.path.exists(save) else ""
            result.notes.append(f"no checkpoint was written to `{save}`{kept}: {why}")
        else:
            result.notes.append(f"the checkpoint `{save}` holds epoch {saved_epoch + 1}, not the last {done} "
                                f"step{'s' if done != 1 else ''}: {why}")
    result.wall_s = time.perf_counter() - t0
    result.races = runner.races
    return result
