"""The `train` block's settings as `run` and `check` both read them (`check_train_settings`: the
very checks `train` runs), the files a run reads and the log it writes, the checkpoint layout of a
program, and the initial values of its buffers (`init_params`)."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.dsl.resolve import CallValue
from streamsched.interp.data import data_paths
from streamsched.interp.lr import make_schedule
from streamsched.interp.training.options import TrainOptions, _x
from streamsched.interp.training.runners import _human_bytes
from streamsched.outputs import Output, check_output
from streamsched.stdlib.kernels import numpy_dtype


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

def _call(v: Any, default_name: str) -> tuple[str, tuple, dict]:
    if isinstance(v, CallValue):
        return v.name, v.args, dict(v.kwargs)
    if isinstance(v, str):
        return v, (), {}
    if isinstance(v, (int, float)):
        return default_name, (v,), {}
    return default_name, (), {}


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


def run_settings(program, opts: TrainOptions) -> tuple[int, int]:
    """(seed, epochs) of a run of `program` with `opts`, after every command-line value is
    checked (X004): whole-number --seed, --epochs, --steps, --interleave-seed and --threads (the
    train block's seed and epochs when not given), a finite non-negative --lr within f32's range,
    file names for --resume / --resume-weights (not both), a known --data-on."""
    from streamsched.interp.lr import F32_MAX
    from streamsched.interp.training.runners import DATA_ON

    tv = dict(program.train)
    spans = dict(program.train_spans)
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
    if opts.data_on not in DATA_ON:
        raise _x("X004", f"unknown --data-on `{opts.data_on}`", help="--data-on auto, host or device")
    why = epoch_launch_error(opts.epoch_launch)
    if why:
        raise _x("X004", f"--epoch-launch: {why}", help="--epoch-launch auto, epoch, step or a number of epochs, "
                                                        "e.g. `--epoch-launch 4`")
    for choice in env_choices():
        why = choice.error(os.environ.get(choice.name))
        if why:
            raise _x("X004", f"${choice.name}: {why}", help=choice.help())
    return seed, epochs


def env_choices() -> tuple:
    """The environment settings (interp/env_choice.py), each refused with X004 before a run when
    it says something else: GEMM timing, kernel priorities, skinny products (the CUDA backend's)
    and the fusion pass's scheduling rules (dead clears, updates in two launches, heavy products
    in turn, critical path first, batch-norm epilogues).  Their modules are leaves (NumPy only, no CuPy)."""
    from streamsched.interp.cuda.gemm_tune import TUNE
    from streamsched.interp.fuse import BN_EPILOGUES, CRITICAL_FIRST, DEAD_FILLS, HEAVY_IN_TURN, SPLIT_UPDATES
    from streamsched.interp.priority import PRIORITIES
    from streamsched.stdlib.kernels._cuda import SKINNY

    return TUNE, PRIORITIES, SKINNY, DEAD_FILLS, SPLIT_UPDATES, HEAVY_IN_TURN, CRITICAL_FIRST, BN_EPILOGUES


def epoch_launch_error(value) -> str:
    """Why `value` is not an --epoch-launch (auto, epoch, step, or a whole number of epochs per
    launch, 1 or more, in ASCII digits), or '' when it is one."""
    if isinstance(value, str) and (value in ("auto", "epoch", "step")
                                   or (value.isascii() and value.isdigit() and value.strip("0") != "")):
        return ""
    return f"`{value}` is not auto, epoch, step or a number of epochs (1 or more)"
