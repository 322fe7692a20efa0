"""The backend behind the loop's small interface (run / read / write / sync / epoch_losses /
last_loss): `CpuRunner` here, `cuda.runner.CudaRunner` on a GPU, and `make_runner`, which picks
one as `--backend` asks (X004, X013, X020)."""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.interp.ir import Task
from streamsched.interp.training.losses import EpochLosses, TaskFailedError
from streamsched.interp.training.options import TrainOptions, _x
from streamsched.pipeline import Compiled


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


DATA_ON = ("auto", "host", "device")


def make_runner(compiled: Compiled, opts: TrainOptions, data=None, steps: int = 0, notes: list | None = None):
    """`--backend auto` picks CUDA when CuPy and a device are present, else the CPU with a notice;
    `--backend cuda` without a GPU is an X020 diagnostic; arenas too large to allocate are X013.

    data: the run's data_path.DataPath and steps its number of steps, for `--data-on`
    (opts.data_on): on the CUDA backend `device` holds the training set on the GPU
    (cuda.resident.ResidentData; X004 when the plan cannot, X013 when it does not fit), `auto`
    does so when the plan can and it fits cuda.resident.DEVICE_SHARE of the free device memory,
    `host` stages every batch from the host; the CPU backend always stages (a note says so for
    `device`).  notes: where to add the line that says which was chosen, when it was not the
    one asked for."""
    from streamsched.interp.memory import ArenaOutOfMemory

    if opts.data_on not in DATA_ON:
        raise _x("X004", f"unknown --data-on `{opts.data_on}`", help="--data-on auto, host or device")

    want = opts.backend
    if want in ("auto", "cuda"):
        try:
            from streamsched.interp.cuda import cuda_available

            ok, why = cuda_available()
        except ImportError as exc:
            ok, why = False, f"the CUDA backend cannot load: {exc}"
        if ok:
            from streamsched.interp.cuda.runner import CudaRunner
            from streamsched.interp.distributed import NcclUnavailable, rank_env_or_x004, use_device

            env = rank_env_or_x004()
            if env.world > 1:
                use_device(env)  # one GPU per process: GPU LOCAL_RANK, before any CuPy state
            if opts.devices > 1:
                raise _x("X004", f"--devices {opts.devices} on the GPU runs one process per device",
                         help="run it from the command line, `streamsched run --devices N FILE`, or start the "
                              "processes with torchrun (docs/cuda.md, \"Data parallel\")")
            try:
                # data parallel: each rank stages its shard from the host (a device gather would
                # fetch the global batch)
                resident = (_resident(compiled, opts.data_on, data, steps, notes)
                            if data is not None and env.world == 1 else None)
                return CudaRunner(compiled) if resident is None else CudaRunner(compiled, resident=resident)
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
    if opts.data_on == "device" and notes is not None:
        notes.append("--data-on device: the CPU backend stages every batch from the host")
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



def _resident(compiled: Compiled, mode: str, data, steps: int, notes: list | None):
    """The ResidentData of a CUDA run with `--data-on mode` (None: host staging)."""
    if mode == "host":
        return None
    from streamsched.interp.cuda.resident import DEVICE_SHARE, ResidentData, resident_bytes
    from streamsched.interp.resident import resident_plan

    rp = resident_plan(compiled.schedule, compiled.plan)
    if not rp.why_not:  # what the gather twins can copy: 2-, 4- and 8-byte inputs, 4- and 8-byte scalars
        from streamsched.interp.memory import ARRAY_DTYPES

        dtypes = {b.name: b.dtype for b in compiled.schedule.buffers}
        for g in rp.gathers.values():
            dt = ARRAY_DTYPES.get(dtypes.get(compiled.schedule.tasks[g.task].outs[0], ""))
            if dt is None or dt.itemsize not in ((4, 8) if g.kind == "scalar" else (2, 4, 8)):
                rp = replace(rp, why_not=f"the {g.kind} `{g.name}` is {dt or 'of no array dtype'}, which the device "
                                         "gather does not copy")
                break
    if rp.why_not:
        if mode == "device":
            raise _x("X004", f"--data-on device: this plan cannot hold its data on the device: {rp.why_not}",
                     help="use --data-on host (or auto)")
        return None
    b = data.batches
    scalars = len({g.name for g in rp.gathers.values() if g.kind == "scalar"})
    need = resident_bytes(b.x, b.y, data.x_dtype, data.y_dtype, b.batch, data.spe, steps, scalars)
    from streamsched.interp.cuda.device import cupy_module

    free = int(cupy_module().cuda.runtime.memGetInfo()[0])
    if need > DEVICE_SHARE * free:
        if mode == "device" and need > free:
            raise _x("X013", f"out of memory: the training set needs {_human_bytes(need)} on the GPU, "
                     f"{_human_bytes(free)} are free", help="use --data-on host (or auto)")
        if mode == "auto":
            if notes is not None:
                notes.append(f"the training set ({_human_bytes(need)}) is more than {DEVICE_SHARE:.0%} of the free GPU "
                             f"memory ({_human_bytes(free)}): batches are staged from the host")
            return None
    try:
        return ResidentData(rp, b.x.astype(data.x_dtype, copy=False), b.y.astype(data.y_dtype, copy=False),
                            data.feat, b.batch, data.spe, steps)
    except Exception as exc:
        if "OutOfMemory" not in type(exc).__name__:
            raise
        raise _x("X013", f"out of memory: the training set needs {_human_bytes(need)} on the GPU",
                 help="use --data-on host") from None
