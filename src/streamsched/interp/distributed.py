"""Data parallel: which rank this process is (the launcher variables RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), its shard of every batch, the process's NCCL communicator
for the CUDA backend (`nccl_communicator`), N ranks simulated in one process for the CPU backend
(`SimRanksRunner`, the all-reduce an exact mean), and `launch`, which starts one process per GPU
for `streamsched run --devices N` and stops the others when one fails.

Semantics (docs/cuda.md, "Data parallel"): every rank runs the same plan on its own replica; the
global batch of a step is WORLD_SIZE * B samples (B: the model's `batch`, per rank), rank r's
shard its rows [r * B, (r + 1) * B), so N ranks at B see exactly the samples one rank at N * B
sees; `allreduce` replaces each gradient by its mean over the ranks, which is then the gradient
of the global batch's mean loss.  Evaluation, logs and checkpoints happen on rank 0 only.

Source: NCCL's user guide (one communicator per GPU, one process per GPU, ncclGetUniqueId on one
rank shared out of band, ncclCommInitRank on all); torchrun's environment variables;
CuPy's `cupyx.distributed` (its TCP store is the out-of-band exchange); CUDA_PITFALLS.md #24, #25.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from streamsched.stdlib.kernels import collectives


# --------------------------------------------------------------------------------------------
# Which rank this process is


@dataclass(frozen=True)
class RankEnv:
    """This process's place among the ranks: rank (global), world (ranks in all), local_rank
    (the GPU index on this machine), master_addr / master_port (where rank 0's rendezvous
    listens)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class LaunchError(ValueError):
    """A launcher variable that is not usable (the CLI turns it into an X004 diagnostic)."""


def rank_env(environ: dict[str, str] | None = None) -> RankEnv:
    """The RankEnv the launcher variables give (torchrun, mpirun through OMPI_COMM_WORLD_*, a
    cluster scheduler, or `streamsched run --devices N`); a single rank when none is set.
    Raises LaunchError for a value that is not a whole number or out of range."""
    env = os.environ if environ is None else environ

    def num(*names: str, default: int) -> int:
        for n in names:
            v = env.get(n)
            if v is not None and v.strip() != "":
                try:
                    return int(v)
                except ValueError:
                    raise LaunchError(f"{n}={v!r} is not a whole number") from None
        return default

    world = num("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=1)
    rank = num("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", default=0)
    local = num("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", default=rank if world > 1 else 0)
    port = num("MASTER_PORT", default=29500)
    if world < 1:
        raise LaunchError(f"WORLD_SIZE={world}: at least 1")
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is not in 0..{world - 1} (WORLD_SIZE={world})")
    if local < 0:
        raise LaunchError(f"LOCAL_RANK={local} is negative")
    if not 0 < port < 65536:
        raise LaunchError(f"MASTER_PORT={port} is not a TCP port")
    return RankEnv(rank, world, local, env.get("MASTER_ADDR", "127.0.0.1") or "127.0.0.1", port)


def dp_place(opts) -> tuple[int, int]:
    """(rank, world size) of this run: the launcher's when it set WORLD_SIZE > 1 (one process per
    GPU), else rank 0 of `opts.devices` ranks (simulated in this process on the CPU backend)."""
    env = rank_env_or_x004()
    if env.world > 1:
        return env.rank, env.world
    return 0, max(1, int(getattr(opts, "devices", 1) or 1))


def dp_main() -> bool:
    """Whether this process is rank 0 (the one that evaluates and writes logs and checkpoints)."""
    try:
        return rank_env().is_main
    except LaunchError:
        return True  # the runner reports the bad variable


def shard(batch_x: np.ndarray, batch_y: np.ndarray, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank `rank`'s rows of a global batch of world * B rows: [rank * B, (rank + 1) * B)."""
    b = len(batch_x) // world
    return batch_x[rank * b:(rank + 1) * b], batch_y[rank * b:(rank + 1) * b]


# --------------------------------------------------------------------------------------------
# The CPU backend: N ranks in one process


class CollectiveError(RuntimeError):
    """Simulated ranks disagree on a collective (different buckets at one point: the deadlock R008
    guards against), a rank waited too long for the others, or another rank failed."""


class SimGroup:
    """N simulated ranks that meet at each collective.  Each rank's thread calls
    `member(r).allreduce_mean(key, arrays)`; the call returns when every rank brought the same
    key, each array replaced by the exact mean (summed in rank order, then divided by N: every
    rank computes the same floating-point numbers).  abort() releases every waiting rank with a
    CollectiveError (a rank failed)."""

    def __init__(self, size: int, timeout: float = 600.0):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[tuple[Any, list[np.ndarray]] | None] = [None] * size

    def member(self, rank: int) -> "collectives.RankGroup":
        group = self

        class _Member(collectives.RankGroup):
            def allreduce_mean(self, key, arrays):
                group._reduce(rank, key, arrays)

        m = _Member()
        m.rank, m.size = rank, self.size
        return m

    def abort(self) -> None:
        self._barrier.abort()

    def _wait(self, rank: int, key) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise CollectiveError(f"rank {rank} waited in the all-reduce of `{key}` and the other ranks did not "
                                  "come (a rank failed, or the ranks issue collectives in different orders)") from None

    def _reduce(self, rank: int, key, arrays: list[np.ndarray]) -> None:
        self._slots[rank] = (key, arrays)
        self._wait(rank, key)
        keys = [s[0] if s is not None else None for s in self._slots]
        if len(set(keys)) != 1:
            self._barrier.abort()
            raise CollectiveError("the ranks reached different collectives at once: "
                                  + ", ".join(f"rank {r}: `{k}`" for r, k in enumerate(keys)))
        means = []
        for i in range(len(arrays)):
            acc = np.array(self._slots[0][1][i], dtype=np.float64 if arrays[i].dtype.kind == "f" else arrays[i].dtype)
            for r in range(1, self.size):
                acc = acc + self._slots[r][1][i]
            means.append(acc / self.size)
        self._wait(rank, key)  # every rank has read every contribution
        for a, m in zip(arrays, means):
            a[...] = m.astype(a.dtype, copy=False)
        self._wait(rank, key)  # nobody deposits the next collective's arrays before all wrote


class SimRanksRunner:
    """`train.CpuRunner`'s interface over N replicas, each a CpuRunner (`make_rank()`: one with its
    own arrays; losses_of: `train.EpochLosses.of`) run in
    N threads that meet in every `allreduce_mean` (SimGroup).  Every rank runs the same plan under
    the same interleaving (fixed, or random with one seed), so the ranks reach each collective in
    one `run` call together.  host_fn(task, arrays, rank=r) fills rank r's staging buffers from
    its shard; host work of the ranks is serialized (the loop's batch cache is not thread-safe).

    read(name): rank 0's value; write(name, v): every rank's (initial values, checkpoints);
    epoch_losses(): per step, the mean of the ranks' losses (the global batch's mean loss, when
    the loss is a mean over the batch)."""

    name = "cpu"

    def __init__(self, make_rank: Callable[[], Any], ranks: int, losses_of: Callable[[list[float]], Any]):
        self.size = ranks
        self.ranks = [make_rank() for _ in range(ranks)]
        self._losses_of = losses_of
        self.group = SimGroup(ranks)
        self._pool = ThreadPoolExecutor(ranks, thread_name_prefix="rank")
        self._host = threading.Lock()

    def _all(self, fn) -> list:
        """fn(rank, runner) on every rank at once; the first failure (by rank) is raised, after
        the others are released from any collective they wait in."""

        def job(r):
            collectives.set_group(self.group.member(r))
            try:
                return fn(r, self.ranks[r])
            except BaseException:
                self.group.abort()
                raise
            finally:
                collectives.set_group(None)

        futs = [self._pool.submit(job, r) for r in range(self.size)]
        out, errors = [], []
        for f in futs:
            try:
                out.append(f.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below, the root cause first
                errors.append(e)
        if errors:
            real = [e for e in errors if not _is_released(e)]
            raise (real or errors)[0]
        return out

    def run(self, instrs, host_fn) -> None:
        def one(r, runner):
            def fn(task, arrays):
                with self._host:
                    host_fn(task, arrays, rank=r)
            runner.run(instrs, fn)

        self._all(one)

    def epoch_losses(self):
        per = self._all(lambda r, runner: runner.epoch_losses())
        vals = [float(np.mean([p.values[i] for p in per])) for i in range(len(per[0].values or []))]
        return self._losses_of(vals)

    def last_loss(self, name: str) -> float:
        return float(np.mean(self._all(lambda r, runner: runner.last_loss(name))))

    def read(self, name: str) -> np.ndarray:
        self.sync()
        return self.ranks[0].read(name)

    def write(self, name: str, value) -> None:
        self.sync()
        for runner in self.ranks:
            runner.write(name, value)

    def sync(self) -> None:
        self._all(lambda r, runner: runner.sync())

    @property
    def races(self):
        """Rank 0's: every rank runs the same plan under the same interleaving."""
        return self.ranks[0].races

    @property
    def arrays(self):
        return self.ranks[0].arrays


def _is_released(e: BaseException) -> bool:
    """A rank that only failed because another rank's failure released it from a collective."""
    cause = getattr(e, "cause", None) or e.__cause__
    return isinstance(e, CollectiveError) or isinstance(cause, CollectiveError)


# --------------------------------------------------------------------------------------------
# The CUDA backend: the process's NCCL communicator

_COMM: dict[str, Any] = {}


class NcclUnavailable(RuntimeError):
    """No NCCL communicator for this process (CuPy without NCCL, a failed rendezvous): the
    training loop reports it as X020."""


def nccl_communicator() -> tuple[Any, int]:
    """(communicator, world size) of this process, made on first use from `rank_env()`: a
    `cupy.cuda.nccl.NcclCommunicator` over WORLD_SIZE ranks, one GPU per process (the current
    device: `use_device` set it to LOCAL_RANK).  With one rank its unique id needs no exchange;
    with more, `cupyx.distributed.init_process_group` runs the rendezvous (rank 0's TCP store on
    MASTER_ADDR:MASTER_PORT hands ncclGetUniqueId's id to the others).  Made eagerly, before any
    capture: the executor warms every task up, the all-reduce included, before capturing
    (CUDA_PITFALLS.md #24).  Raises NcclUnavailable (no NCCL in CuPy, a failed rendezvous)."""
    if "comm" in _COMM:
        return _COMM["comm"], _COMM["size"]
    env = rank_env()
    try:
        from cupy.cuda import nccl

        if not getattr(nccl, "available", True):
            raise ImportError("CuPy was built without NCCL")
        if env.world == 1:
            comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        else:
            import cupyx.distributed as dist

            backend = dist.init_process_group(env.world, env.rank, host=env.master_addr, port=env.master_port)
            comm = getattr(backend, "_comm", None)
            if comm is None:
                raise ImportError("cupyx.distributed's NCCL backend has no communicator (`_comm`) in this CuPy")
            _COMM["backend"] = backend  # keeps rank 0's store alive
    except ImportError as exc:
        raise NcclUnavailable(f"NCCL is not usable through CuPy: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - NcclError, a rendezvous that failed: one message
        raise NcclUnavailable(f"the NCCL communicator could not be made (rank {env.rank} of {env.world}, "
                              f"rendezvous {env.master_addr}:{env.master_port}): {exc}") from exc
    _COMM["comm"], _COMM["size"] = comm, env.world
    collectives.set_communicator(comm, env.world, env.rank)
    return comm, env.world


_EXECUTORS: "weakref.WeakSet" = weakref.WeakSet()


def register_executor(ex: Any) -> None:
    """Note a CUDA executor whose graphs hold the communicator: at exit its graphs are destroyed
    (ex.close()) before the communicator is (CUDA_PITFALLS.md #25: ncclCommDestroy hangs while
    graphs reference the communicator; garbage collection at exit keeps no order)."""
    if not _EXECUTORS:
        atexit.register(_shutdown)
    _EXECUTORS.add(ex)


def _shutdown() -> None:
    for ex in list(_EXECUTORS):
        try:
            ex.close()
        except Exception:  # noqa: BLE001 - at exit, nothing to save
            pass
    _EXECUTORS.clear()
    close_communicator()


def use_device(env: RankEnv) -> None:
    """Bind this process to GPU LOCAL_RANK (before any CuPy state is made)."""
    import cupy as cp

    n = cp.cuda.runtime.getDeviceCount()
    if env.local_rank >= n:
        raise LaunchError(f"LOCAL_RANK={env.local_rank} but this machine has {n} GPU{'s' if n != 1 else ''}")
    cp.cuda.Device(env.local_rank).use()


def close_communicator() -> None:
    """Forget the communicator; the caller has destroyed every graph that references it first
    (CUDA_PITFALLS.md #25: ncclCommDestroy hangs while graphs hold the communicator)."""
    comm = _COMM.pop("comm", None)
    _COMM.pop("size", None)
    collectives.set_communicator(None, 0)
    _COMM.pop("backend", None)
    if comm is not None:
        try:
            comm.destroy()
        except Exception:  # noqa: BLE001 - at exit, nothing to save
            pass


# --------------------------------------------------------------------------------------------
# `streamsched run --devices N`: one process per GPU

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}
"""Set in every process the launcher starts (NVLink multicast stays off on shared machines)."""


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_or_simulate(backend: str, devices: int, argv: Sequence[str],
                       cuda_available: Callable[[], tuple[bool, str]]) -> int | None:
    """`streamsched run --devices N` (N > 1): None when this process runs the ranks itself (the
    CPU backend simulates them; a process a launcher started is one rank already), else the exit
    status of the N processes `launch` started, one per GPU.  X020 when fewer GPUs than N."""
    from streamsched.diagnostics import Diagnostic, StreamschedError

    if rank_env_or_x004().world > 1:
        raise StreamschedError([Diagnostic("X004", "--devices inside a launched rank (WORLD_SIZE is set)",
                                           help="drop --devices: the launcher (torchrun, mpirun) starts the ranks")])
    if backend == "cpu":
        return None
    ok, why = cuda_available()
    if not ok:
        if backend == "cuda":
            raise StreamschedError([Diagnostic("X020", f"--backend cuda --devices {devices}: no usable GPU ({why})",
                                               help="use --backend cpu to simulate the ranks in one process")])
        print(f"note: no GPU ({why}); simulating {devices} ranks on the CPU backend", file=sys.stderr)
        return None
    import cupy as cp

    n = cp.cuda.runtime.getDeviceCount()
    if n < devices:
        raise StreamschedError([Diagnostic("X020", f"--devices {devices}: this machine has {n} GPU{'s' if n != 1 else ''}",
                                           help=f"--devices {n}, or start ranks on more machines with torchrun "
                                                "(docs/cuda.md, \"Data parallel\")")])
    return launch(_without_devices(argv), devices)


def _without_devices(argv: Sequence[str]) -> list[str]:
    """The command line after `streamsched` minus `run` and `--devices N`, plus `--backend cuda`."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--devices":
            skip = True
            continue
        if a.startswith("--devices="):
            continue
        out.append(a)
    if out and out[0] == "run":
        out = out[1:]
    return out + ["--backend", "cuda"] if "--backend" not in out and not any(a.startswith("--backend=") for a in out) \
        else out


def rank_env_or_x004() -> RankEnv:
    """rank_env(), a bad launcher variable an X004 diagnostic."""
    from streamsched.diagnostics import Diagnostic, StreamschedError

    try:
        return rank_env()
    except LaunchError as e:
        raise StreamschedError([Diagnostic("X004", f"bad launcher variable: {e}",
                                           help="RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT are whole numbers, "
                                                "0 <= RANK < WORLD_SIZE")]) from None


def launch(argv: Sequence[str], devices: int, *, master_port: int | None = None, poll_s: float = 0.2,
           stderr=None, command: Sequence[str] | None = None) -> int:
    """Run `python -m streamsched run ARGV` once per device, rank r on GPU r, with RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and NCCL_NVLS_ENABLE=0 set; return the exit
    status (0 when every rank finished cleanly); command: what each process runs before ARGV
    (default `python -m streamsched run`).  When a rank fails, the others get SIGTERM (then
    SIGKILL after 10 s) and a line on stderr says which rank failed with which status; rank 0
    alone writes logs and checkpoints, so nothing a stopped rank held is lost."""
    stderr = stderr or sys.stderr
    port = master_port or free_port()
    procs: list[subprocess.Popen] = []
    base = dict(os.environ)
    base.update(NCCL_ENV)
    base.update({"WORLD_SIZE": str(devices), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    for r in range(devices):
        env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        cmd = list(command) if command is not None else [sys.executable, "-m", "streamsched", "run"]
        procs.append(subprocess.Popen([*cmd, *argv], env=env))
    failed: tuple[int, int] | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    except KeyboardInterrupt:
        failed = (-1, 130)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    r, c = failed
    if r >= 0:
        print(f"error[X022]: rank {r} of {devices} stopped with exit status {c}; the other ranks were stopped "
              "(rank 0 writes the log and checkpoints: what it saved is kept)", file=stderr)
    return 1 if c != 130 else 130
