"""Runs an EventPlan on the GPU: eagerly (each instruction issued as it comes) or with every
capture unit replayed as one CUDA graph, the instructions outside units issued eagerly.

    instr     | eager                          | inside a captured unit
    ----------+--------------------------------+-------------------------------------------
    launch t  | twin(ctx, stream, ins, outs)   | captured into the unit's graph
    record e  | events[e].record(stream)       | captured edge; re-recorded on the home
              |                                |   stream after the graph launch
    wait e    | stream.wait_event(events[e])   | captured edge when e is recorded inside the
              | (host: events[e].synchronize())|   unit, else a wait on the home stream
              |                                |   before the graph launch
    begin/end | nothing                        | graph.launch(home)

Everything is allocated before anything runs (device arena + pinned host arena, one view per
buffer, aliases share storage); events are created up front; each graph owns a private memory
pool in which its tasks were warmed up and captured (CUDA_PITFALLS.md rules 4, 5, 20).  A failure
while capturing or replaying raises CudaTaskError naming the task, so the caller can print the
.sched line.
"""

from __future__ import annotations

import gc
import importlib
import os
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from streamsched.interp.ir import HOST, Buffer, EventPlan, Instr, Schedule, Task, Unit
from streamsched.interp.cuda.device import (DeviceContext, PriorityGraph, captured_dot, cupy_module,
                                            graph_nodes_edges, level_priority, priorities_on,
                                            priority_range, set_kernel_priorities)
from streamsched.interp.priority import slack_levels, task_cost_us, unit_dag

PRIORITY_LEVELS = 4
"""Slack levels (interp/priority.py) spread over the device's priority range."""

__all__ = ["CudaExecutor", "CudaTaskError", "Program", "events_bound_outside", "graph_nodes_edges",
           "captured_dot"]

HostFn = Callable[[Task, Mapping[str, Any]], None]


class CudaTaskError(RuntimeError):
    """A task failed on the CUDA backend.  task: the Task (its span names the .sched line), or
    None when the failure belongs to a unit as a whole; unit: the Unit, if any; phase: "bind",
    "warmup", "capture", "eager" or "launch"."""

    def __init__(self, message: str, task: Task | None = None, unit: Unit | None = None,
                 phase: str = ""):
        where = ""
        if task is not None:
            where = f" (task {task.id} `{task.label or task.kernel}` on {task.stream}"
            where += f" at {task.span})" if task.span is not None else ")"
        elif unit is not None:
            where = f" (graph {unit.name} on {unit.home})"
        super().__init__(f"{phase + ': ' if phase else ''}{message}{where}")
        self.task = task
        self.unit = unit
        self.phase = phase


@dataclass
class _Bound:
    """One task, resolved: twin, merged attributes, argument arrays."""

    task: Task
    fn: Callable | None
    attrs: dict
    ins: list
    outs: list
    host: bool
    capturable: bool


@dataclass
class CapturedUnit:
    """One captured graph and what its launch needs: waits hoisted before it, events recorded
    after it, the private memory pool that owns its temporaries."""

    graph: Any
    pool: Any
    home: str
    pre_waits: tuple[int, ...]
    post_records: tuple[int, ...]
    tasks: tuple[int, ...]
    units: list[int] = field(default_factory=list)
    task_nodes: dict[int, list[int]] = field(default_factory=dict)
    """task id -> the graph node(s) its stream depended on right after the task was captured
    (cudaStreamGetCaptureInfo): the node(s) the task ended with, as cudaGraphNode_t ints."""
    node_task: dict[int, int] = field(default_factory=dict)
    """every graph node (cudaGraphNode_t int) that capturing a task created -> that task's id
    (a split-K GEMM creates two); empty when the CUDA bindings could not be queried."""


@dataclass
class Program:
    """A compiled instruction list: `ops` are (kind, a, b) tuples the run loop dispatches."""

    ops: list
    n_instrs: int
    allocates: bool = True
    """Whether an op may allocate temporaries (an eager launch): run() then issues under the
    executor's memory pool."""


_DTYPE_CACHE: dict[str, Any] = {}


def events_bound_outside(instrs: Sequence[Instr]) -> set[int]:
    """The events some wait binds to a record made in another unit, or outside every unit (unit
    -1): a wait binds to the latest record of its event before it in the plan (ARCHITECTURE.md,
    "events"), so a record and a wait inside the same unit are an edge of that unit's graph, and
    only these events are recorded again after a graph launch."""
    last_rec: dict[int, int] = {}
    out: set[int] = set()
    for i in instrs:
        if i.op == "record":
            last_rec[i.event] = i.unit
        elif i.op == "wait" and i.event in last_rec and last_rec[i.event] != i.unit:
            out.add(i.event)
    return out


class CudaExecutor:
    """Run `plan` (for `schedule`) on the GPU.

    kernels: kernel name -> `Kernel` record (default `streamsched.stdlib.kernels.KERNELS`) or
    name -> CUDA twin callable; capture: "none" (eager), "graphs" or "step" (each Unit of the
    plan becomes one CUDA graph; units with identical instructions share one), default the
    schedule's.  sync_each: synchronize after every eager launch so an asynchronous fault is
    reported against its task (slow; for debugging).  map_nodes: while capturing, note which
    graph nodes each task created (`CapturedUnit.task_nodes` / `.node_task`).  accumulate: a
    scalar buffer (the model's loss) summed on the device after every task that writes it, in
    the same stream (captured into the graph under capture), so the training loop reads one
    total per epoch instead of synchronizing every step (`LossAccumulator`).  resident: a
    `cuda.resident.ResidentData` (device-resident training data): its plan's host-to-device
    copies are bound to device gathers, its host tasks and host waits are never issued.
    """

    def __init__(self, schedule: Schedule, plan: EventPlan, kernels: Mapping[str, Any] | None = None,
                 capture: str | None = None, *, ctx: DeviceContext | None = None,
                 sync_each: bool = False, tf32: bool = False, map_nodes: bool = True,
                 accumulate: str | None = None, resident=None):
        cp = cupy_module()
        self.cp = cp
        self.schedule = schedule
        self.plan = plan
        self.capture = capture or schedule.capture or "none"
        if self.capture not in ("none", "graphs", "step"):
            raise ValueError(f"capture must be none, graphs or step, got {self.capture!r}")
        self.sync_each = sync_each
        self.map_nodes = map_nodes
        if kernels is None:
            from streamsched.stdlib.kernels import KERNELS

            kernels = KERNELS
        self.kernels = kernels
        if any(t.kernel == "allreduce_mean" for t in schedule.tasks):
            from streamsched.interp.distributed import nccl_communicator, register_executor

            nccl_communicator()  # before warm-up and capture (CUDA_PITFALLS.md #24)
            register_executor(self)  # graphs destroyed before the communicator at exit (#25)
        dev_streams = [s for s in schedule.streams if s != HOST]
        for t in schedule.tasks:
            if t.stream != HOST and t.stream not in dev_streams:
                dev_streams.append(t.stream)
        self.ctx = ctx or DeviceContext(dev_streams, tf32=tf32)
        self.ctx.init_blas()  # handles, streams and workspaces exist before any capture
        self.buffers = self._planned(schedule.buffers)
        self._buf = {b.name: b for b in self.buffers}
        self.resident = resident
        self.arrays, self._arenas = self._allocate(self.buffers)
        self.host_arrays = {b.name: self.arrays[b.name] for b in self.buffers if b.space != "device"}
        self.events = self.ctx.make_events(plan.num_events)
        self._fork = self.ctx.make_events(1)[0]
        self._join = {s: ev for s, ev in zip(self.ctx.names, self.ctx.make_events(len(self.ctx.names)))}
        self._bound = [self._bind(t, self.arrays) for t in schedule.tasks]
        self.sync_warmup = os.environ.get("STREAMSCHED_SYNC_WARMUP", "1") != "0"
        # event -> the units (-1: none) whose waits bind to it; events only the host records
        self._bound_outside = events_bound_outside(plan.instrs)
        self._host_only = ({i.event for i in plan.instrs if i.op == "record" and i.stream == HOST}
                           - {i.event for i in plan.instrs if i.op == "record" and i.stream != HOST})
        self.accumulator = None
        if accumulate is not None and accumulate in self.arrays and str(self.arrays[accumulate].dtype) in (
                "float32", "float64"):  # (the loss is f32 under mixed precision too)
            self.accumulator = LossAccumulator(cp, self.arrays[accumulate])
            self._acc_tasks = frozenset(t.id for t in schedule.tasks if accumulate in t.outs)
        else:
            self._acc_tasks = frozenset()
        self._pool = cp.cuda.MemoryPool()  # temporaries of eager launches
        self.priorities = priorities_on()
        """Whether captured kernels carry critical-path priorities (STREAMSCHED_PRIORITIES=slack,
        read once here; ValueError for a value that is not off or slack)."""
        self.task_priority: dict[int, int] = {}
        """task id -> the CUDA priority its captured kernels carry (STREAMSCHED_PRIORITIES)."""
        self.graphs: dict[tuple, CapturedUnit] = {}
        self.unit_graph: dict[int, CapturedUnit] = {}
        self._programs: dict[tuple | None, Program] = {}
        self._by_tuple: dict[int, tuple[tuple, Program]] = {}  # id(instrs) -> (instrs, its program)
        cp.cuda.Device().synchronize()  # the arenas' zeroing, the bindings' uploads (see _scratch_bound)
        if self.capture != "none":
            self.capture_units()
        if resident is not None:  # the warm-up ran each gather once: its counter starts again at 0
            resident.reset()

    # -- memory -------------------------------------------------------------------------------

    @staticmethod
    def _planned(buffers: Sequence[Buffer]) -> tuple[Buffer, ...]:
        from streamsched.interp.memory import plan_memory

        if any(b.offset < 0 for b in buffers):
            return plan_memory(buffers)
        return tuple(buffers)

    def _allocate(self, buffers: Sequence[Buffer], arenas: dict | None = None):
        """One zeroed arena per space (device: CuPy; anything else: pinned host memory) and one
        view per buffer; buffers with the same byte range, dtype and shape get the very same
        array object (CuPy copies an input that overlaps an output unless it *is* the output)."""
        from streamsched.interp.memory import ARRAY_DTYPES, allocate_arena, arena_sizes

        cp = self.cp
        if arenas is None:  # an allocation failure (CuPy's OutOfMemoryError) is ArenaOutOfMemory: X013
            arenas = {}
            for space, n in arena_sizes(buffers).items():
                if space == "device":
                    arenas[space] = allocate_arena(lambda k: cp.zeros((max(k, 1),), dtype=cp.uint8), space, n,
                                                   buffers)
                else:
                    arenas[space] = allocate_arena(self.ctx.pinned_zeros, space, n, buffers)
        views: dict[tuple, Any] = {}
        arrays: dict[str, Any] = {}
        for b in buffers:
            dt = ARRAY_DTYPES.get(b.dtype)
            if dt is None:
                raise ValueError(f"buffer `{b.name}`: dtype {b.dtype!r} has no array dtype")
            key = (b.space, b.offset, b.nbytes, str(dt), tuple(b.shape))
            v = views.get(key)
            if v is None:
                raw = arenas[b.space][b.offset:b.offset + b.nbytes]
                v = raw.view(dt).reshape(b.shape)
                views[key] = v
            arrays[b.name] = v
        return arrays, arenas

    def set(self, name: str, value) -> None:
        """Write `value` into buffer `name` now (synchronously, on the buffer's first stream),
        e.g. to initialise parameters or inputs before running."""
        import numpy as np

        arr = self.arrays[name]
        val = np.asarray(value, dtype=arr.dtype).reshape(arr.shape)
        if self._buf[name].space == "device":
            st = self.ctx.streams[self.ctx.names[0]]
            with st:
                arr.set(np.array(val, order="C"), stream=st)
            st.synchronize()
        else:
            arr[...] = val

    def get(self, name: str):
        """A NumPy copy of buffer `name`, after all streams finished."""
        self.ctx.synchronize()
        arr = self.arrays[name]
        if self._buf[name].space == "device":
            st = self.ctx.streams[self.ctx.names[0]]
            out = arr.get(stream=st)
            st.synchronize()
            return out
        return arr.copy()

    # -- binding ------------------------------------------------------------------------------

    def _resolve(self, kernel: str):
        rec = self.kernels.get(kernel) if hasattr(self.kernels, "get") else None
        if rec is None:
            raise KeyError(f"unknown kernel {kernel!r}")
        if callable(rec) and not hasattr(rec, "cuda"):
            return rec, {}, False, True
        fn = None
        path = getattr(rec, "cuda", "")
        if not path:  # a bare record named like a stdlib kernel gets the stdlib's twin
            from streamsched.stdlib.kernels import KERNELS as STDLIB

            if kernel not in STDLIB:
                raise KeyError(f"kernel {kernel!r} has no CUDA twin")
            path = STDLIB[kernel].cuda
        if callable(path):  # a generated kernel's twin (stdlib.kernel_lang) or a --kernels module's function
            fn = path
        elif not rec.host:
            mod, _, attr = path.partition(":")
            fn = getattr(importlib.import_module(mod), attr)
        return fn, dict(rec.attrs), bool(rec.host), bool(rec.capturable)

    def _bind(self, t: Task, arrays: Mapping[str, Any]) -> _Bound:
        try:
            fn, attrs, host, capturable = self._resolve(t.kernel)
        except Exception as exc:
            raise CudaTaskError(str(exc), task=t, phase="bind") from exc
        attrs.update(dict(t.attrs))
        host = host or t.stream == HOST
        if host and t.stream != HOST:
            raise CudaTaskError(f"host kernel {t.kernel} placed on device stream {t.stream}",
                                task=t, phase="bind")
        try:
            ins = [arrays[a] for a in t.args]
            outs = [arrays[o] for o in t.outs]
        except KeyError as exc:
            raise CudaTaskError(f"unknown buffer {exc}", task=t, phase="bind") from None
        g = self.resident.rp.gathers.get(t.id) if self.resident is not None else None
        if g is not None:  # device-resident data: the copy from the pinned slot becomes a device gather
            try:
                if g.kind == "scalar":
                    self.resident.table_for(g.name, outs[0].dtype)
                fn, host, capturable = self.resident.twin(g), False, True
            except Exception as exc:
                raise CudaTaskError(f"{type(exc).__name__}: {exc}", task=t, phase="bind") from exc
        prepare = getattr(fn, "prepare", None)
        if prepare is not None and not host:  # device tables a twin reads (multi_tensor): built before any capture
            try:
                prepare(self.ctx, t.stream, ins, outs, attrs)
            except Exception as exc:
                raise CudaTaskError(f"{type(exc).__name__}: {exc}", task=t, phase="bind") from exc
        return _Bound(t, fn, attrs, ins, outs, host, capturable)

    # -- eager issue --------------------------------------------------------------------------

    def _launch(self, b: _Bound, phase: str) -> None:
        t = b.task
        try:
            b.fn(self.ctx, t.stream, b.ins, b.outs, b.attrs)
        except Exception as exc:
            raise CudaTaskError(f"{type(exc).__name__}: {exc}", task=t, phase=phase) from exc

    def compile(self, instrs: Sequence[Instr] | None = None) -> Program:
        """Turn instructions (default: the whole plan) into a Program that `run` can issue many
        times; under capture, each begin..end range becomes one graph launch."""
        instrs = list(self.plan.instrs if instrs is None else instrs)
        if self.resident is not None:  # no host tasks, no host waits
            instrs = list(self.resident.rp.device_instrs(tuple(instrs)))
        ops: list = []
        streams, events = self.ctx.streams, self.events
        captured = self.capture != "none"
        i = 0
        while i < len(instrs):
            ins = instrs[i]
            op = ins.op
            if op == "begin":
                if captured:
                    cu = self.unit_graph.get(ins.unit)
                    if cu is None:
                        raise CudaTaskError(f"unit {ins.unit} was not captured",
                                            unit=self._unit(ins.unit), phase="launch")
                    j = i + 1
                    while j < len(instrs) and not (instrs[j].op == "end" and instrs[j].unit == ins.unit):
                        j += 1
                    ops.append(("graph", cu, ins.unit))
                    i = j + 1
                    continue
            elif op == "launch":
                b = self._bound[ins.task]
                ops.append(("host" if b.host else "launch", b, None))
                if ins.task in self._acc_tasks and not b.host:  # eager: sum the loss right after it
                    ops.append(("accumulate", streams[ins.stream], None))
            elif op == "record":
                if ins.stream != HOST:  # host work is complete when issued: nothing to record
                    ops.append(("record", events[ins.event], streams[ins.stream]))
            elif op == "wait":
                if ins.stream == HOST:
                    ops.append(("sync", events[ins.event], None))
                elif ins.event not in self._host_only:  # (host work is done when issued: nothing to wait for)
                    ops.append(("wait", streams[ins.stream], events[ins.event]))
            i += 1
        return Program(ops, len(instrs), any(op[0] in ("launch", "accumulate") for op in ops))

    def run(self, instrs: Sequence[Instr] | Program | None = None,
            host_fn: HostFn | None = None) -> None:
        """Issue `instrs` (default: the whole plan; or a compiled Program) in order.  Host tasks
        call host_fn(task, host_arrays) on this thread when reached.  Returns without waiting
        for the device (the plan's host waits, or `synchronize()`, do that)."""
        if isinstance(instrs, Program):
            prog = instrs
        else:
            # Compiled programs are cached by the identity of the Instr objects, so a training
            # loop that passes plan_segment(plan, k) (fresh tuples of the plan's own Instrs)
            # compiles each distinct segment once; the very tuple seen before (Segments.for_step
            # hands out the same one every period) is found without looking at its Instrs.
            hit = self._by_tuple.get(id(instrs)) if instrs is not None else None
            if hit is not None and hit[0] is instrs:
                prog = hit[1]
            else:
                key = None if instrs is None else tuple(map(id, instrs))
                prog = self._programs.get(key)
                if prog is None:
                    prog = self._programs[key] = self.compile(instrs)
                if isinstance(instrs, tuple):
                    self._by_tuple[id(instrs)] = (instrs, prog)
        host_arrays = self.host_arrays
        # eager launches may allocate temporaries: from the executor's pool; a step of graph
        # launches, host work, records and waits skips the context (a cost per step on the host)
        with self.cp.cuda.using_allocator(self._pool.malloc) if prog.allocates else nullcontext():
            for kind, a, b in prog.ops:
                if kind == "graph":
                    self._launch_graph(a, b)
                elif kind == "launch":
                    self._launch(a, "eager")
                    if self.sync_each:
                        self._sync_task(a)
                elif kind == "wait":
                    a.wait_event(b)
                elif kind == "record":
                    a.record(b)
                elif kind == "sync":
                    a.synchronize()
                elif kind == "accumulate":
                    self.accumulator.launch(a)
                elif kind == "host":
                    if host_fn is None:
                        raise CudaTaskError("host task reached but run() got no host_fn",
                                            task=a.task, phase="eager")
                    host_fn(a.task, host_arrays)

    def _sync_task(self, b: _Bound) -> None:
        try:
            self.ctx.stream(b.task.stream).synchronize()
        except Exception as exc:
            raise CudaTaskError(f"{type(exc).__name__}: {exc}", task=b.task, phase="eager") from exc

    def _launch_graph(self, cu: CapturedUnit, unit_id: int) -> None:
        home = self.ctx.streams[cu.home]
        for e in cu.pre_waits:
            home.wait_event(self.events[e])
        try:
            cu.graph.launch(home)
        except Exception as exc:
            raise CudaTaskError(f"graph launch failed: {type(exc).__name__}: {exc}",
                                unit=self._unit(unit_id), phase="launch") from exc
        for e in cu.post_records:
            self.events[e].record(home)

    def synchronize(self) -> None:
        self.ctx.synchronize()

    # -- capture ------------------------------------------------------------------------------

    def _unit(self, uid: int) -> Unit | None:
        units = self.schedule.units
        if 0 <= uid < len(units) and units[uid].id == uid:
            return units[uid]
        for u in units:
            if u.id == uid:
                return u
        return None

    def unit_ranges(self) -> dict[int, tuple[int, int]]:
        """Unit id -> (index of its begin, index of its end) in plan.instrs."""
        out: dict[int, tuple[int, int]] = {}
        open_: dict[int, int] = {}
        for i, ins in enumerate(self.plan.instrs):
            if ins.op == "begin":
                if open_:
                    raise CudaTaskError(f"unit {ins.unit} begins inside unit {next(iter(open_))}",
                                        unit=self._unit(ins.unit), phase="capture")
                open_[ins.unit] = i
            elif ins.op == "end":
                b = open_.pop(ins.unit, None)
                if b is None:
                    raise CudaTaskError(f"unit {ins.unit} ends without a begin",
                                        unit=self._unit(ins.unit), phase="capture")
                out[ins.unit] = (b, i)
        if open_:
            uid = next(iter(open_))
            raise CudaTaskError(f"unit {uid} never ends", unit=self._unit(uid), phase="capture")
        return out

    def capture_units(self) -> None:
        """Warm up and capture every unit of the plan (units with identical instruction lists
        share one graph)."""
        instrs = self.plan.instrs
        scratch = None
        for uid, (b, e) in self.unit_ranges().items():
            body = instrs[b + 1:e]
            home = instrs[b].stream
            u = self._unit(uid)
            if u is not None and u.home:
                home = u.home
            key = (home,) + tuple(self._sig(ins) for ins in body)
            cu = self.graphs.get(key)
            if cu is None:
                if scratch is None:
                    scratch = self._scratch_bound()
                cu = self._capture(uid, home, body, scratch)
                self.graphs[key] = cu
            cu.units.append(uid)
            self.unit_graph[uid] = cu
        self.ctx.synchronize()

    def _sig(self, ins: Instr) -> tuple:
        if ins.op == "launch":
            t = self.schedule.tasks[ins.task]
            if self.resident is not None and t.id in self.resident.rp.gathers:  # its own counter: its own graph
                return ("gather", t.id)
            return ("launch", ins.stream, t.kernel, t.args, t.outs, t.attrs)
        return (ins.op, ins.stream, ins.event)

    def _scratch_bound(self) -> list[_Bound]:
        """The tasks bound to a zeroed copy of the arenas: warm-up runs every kernel once for real
        (compiling it and growing its graph's pool) without touching the program's state."""
        from streamsched.interp.memory import allocate_arena

        arenas = {}
        for space, arena in self._arenas.items():
            if space == "device":
                arenas[space] = allocate_arena(lambda k, a=arena: self.cp.zeros_like(a), space, arena.nbytes,
                                               self.buffers)
            else:
                arenas[space] = allocate_arena(self.ctx.pinned_zeros, space, arena.nbytes, self.buffers)
        arrays, _ = self._allocate(self.buffers, arenas)
        bound = [self._bind(t, arrays) for t in self.schedule.tasks]
        # The zeroing memsets (and any table a binding uploaded) ran on CuPy's current stream, which
        # our non-blocking streams do not wait for: without this, a warm-up kernel could read a
        # scratch buffer before it is zeroed (garbage labels index out of bounds: an illegal address)
        self.cp.cuda.Device().synchronize()
        return bound

    def capture_raw(self, cus: Sequence[CapturedUnit]) -> list[CapturedUnit]:
        """Each unit of `cus` captured again with its `.graph` a raw cudaGraph_t (cuda.bindings;
        the caller destroys it, and keeps the returned units alive: their pools own the graphs'
        temporaries): for the epoch graph, which adds them as child graph nodes (cuda/epoch.py)."""
        ranges = self.unit_ranges()
        instrs = self.plan.instrs
        scratch = self._scratch_bound()
        out = []
        for cu in cus:
            b, e = ranges[cu.units[0]]
            out.append(self._capture(cu.units[0], cu.home, instrs[b + 1:e], scratch, raw=True))
        self.ctx.synchronize()
        return out

    def _capture(self, uid: int, home_name: str, body: Sequence[Instr],
                 scratch: list[_Bound], raw: bool = False) -> CapturedUnit:
        """Warm up and capture one unit's body on its home stream, forked to the others and joined
        back; raw: end with cuda.bindings' cudaStreamEndCapture and return the cudaGraph_t as
        `.graph` (not instantiated) instead of a cupy.cuda.Graph."""
        cp, ctx = self.cp, self.ctx
        unit = self._unit(uid)
        home = ctx.streams[home_name]
        recorded: set[int] = set()
        pre_waits: list[int] = []
        issue: list[Instr] = []
        tasks: list[int] = []
        for ins in body:
            if ins.op == "record":
                if ins.stream == HOST:
                    raise CudaTaskError("host record inside a capture unit", unit=unit, phase="capture")
                recorded.add(ins.event)
                issue.append(ins)
            elif ins.op == "wait":
                if ins.stream == HOST:
                    raise CudaTaskError("host wait inside a capture unit", unit=unit, phase="capture")
                if ins.event in recorded:
                    issue.append(ins)
                elif ins.event not in pre_waits:
                    pre_waits.append(ins.event)  # recorded before the unit: wait before launch
            elif ins.op == "launch":
                b = self._bound[ins.task]
                if b.host:
                    raise CudaTaskError("host task inside a capture unit", task=b.task,
                                        unit=unit, phase="capture")
                if not b.capturable:
                    raise CudaTaskError(f"kernel {b.task.kernel} cannot be captured", task=b.task,
                                        unit=unit, phase="capture")
                issue.append(ins)
                tasks.append(ins.task)
            elif ins.op in ("begin", "end"):
                raise CudaTaskError("nested unit", unit=unit, phase="capture")
        secondary = [s for s in dict.fromkeys(ins.stream for ins in issue) if s != home_name]

        task_nodes: dict[int, list[int]] = {}
        node_task: dict[int, int] = {}
        pool = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(pool.malloc):
            # Warm-up: every kernel once, eagerly, on scratch buffers, under the graph's pool.
            # Each task is waited for, so a fault names its task (the warm-up runs once per graph).
            with home:
                for ti in tasks:
                    sb = scratch[ti]
                    try:
                        sb.fn(ctx, home_name, sb.ins, sb.outs, sb.attrs)
                        if self.sync_warmup:
                            home.synchronize()
                    except Exception as exc:
                        raise CudaTaskError(f"{type(exc).__name__}: {exc}", task=sb.task,
                                            unit=unit, phase="warmup") from exc
            try:
                home.synchronize()
            except Exception as exc:
                raise CudaTaskError(f"warm-up failed: {exc}", unit=unit, phase="warmup") from exc

            gc.collect()
            gc_was = gc.isenabled()
            gc.disable()  # pitfall 26: no collection of graphs/arrays in the middle of a capture
            current: Task | None = None
            from streamsched.interp.cuda.device import check, cudart

            rt = cudart()
            try:
                if raw:
                    check(rt.cudaStreamBeginCapture(int(home.ptr),
                                                    rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed),
                          "cudaStreamBeginCapture")
                    end_capture = lambda: check(rt.cudaStreamEndCapture(int(home.ptr)), "cudaStreamEndCapture")  # noqa: E731
                else:
                    home.begin_capture()
                    end_capture = home.end_capture
                try:
                    self._fork.record(home)
                    for s in secondary:
                        ctx.streams[s].wait_event(self._fork)
                    prio = self.priorities
                    mapper = _NodeMapper(ctx) if (self.map_nodes and not raw) or prio else None
                    for ins in issue:
                        if ins.op == "launch":
                            b = self._bound[ins.task]
                            current = b.task
                            if mapper is not None:
                                mapper.before()
                            b.fn(ctx, b.task.stream, b.ins, b.outs, b.attrs)
                            if mapper is not None:
                                mapper.after(b.task.id, b.task.stream, task_nodes, node_task)
                            if b.task.id in self._acc_tasks:  # the loss summed in the graph, after its task
                                self.accumulator.launch(ctx.streams[b.task.stream])
                            current = None
                        elif ins.op == "record":
                            self.events[ins.event].record(ctx.streams[ins.stream])
                        else:
                            ctx.streams[ins.stream].wait_event(self.events[ins.event])
                    for s in secondary:  # join every forked stream (pitfall 12)
                        self._join[s].record(ctx.streams[s])
                        home.wait_event(self._join[s])
                except BaseException as exc:
                    try:
                        end_capture()
                    except Exception:
                        pass
                    raise CudaTaskError(f"{type(exc).__name__}: {exc}", task=current, unit=unit,
                                        phase="capture") from exc
                try:
                    graph = end_capture()
                except Exception as exc:
                    raise CudaTaskError(f"end of capture failed: {type(exc).__name__}: {exc}",
                                        unit=unit, phase="capture") from exc
            finally:
                if gc_was:
                    gc.enable()
        for s, st in ctx.streams.items():
            if st.is_capturing():
                raise CudaTaskError(f"stream {s} is still capturing after the unit's capture",
                                    unit=unit, phase="capture")
        if prio and node_task:
            self._prioritize(issue, node_task)
            if not raw:
                graph = PriorityGraph(graph)
        if not raw:
            graph.upload(home)
        # Re-recorded after the launch: only the events some wait outside this unit binds to (an
        # eager or host wait, or another unit's hoisted pre-wait); the unit's own fork and join
        # events are edges of its graph, and recording them again would cost the host a call each.
        post = {e for e in recorded if e in self._bound_outside}
        return CapturedUnit(graph, pool, home_name, tuple(pre_waits), tuple(sorted(post)),
                            tuple(tasks), task_nodes=task_nodes, node_task=node_task)

    def _prioritize(self, issue: Sequence[Instr], node_task: dict[int, int]) -> None:
        """Give every kernel node of a captured unit its task's critical-path priority
        (interp/priority.py: slack on the unit's DAG, the roofline cost of each task)."""
        order, preds = unit_dag(issue)
        shapes = {n: tuple(b.shape) for n, b in self._buf.items()}
        nbytes = {n: int(b.nbytes) for n, b in self._buf.items()}
        tasks = self.schedule.tasks
        cost = {t: task_cost_us(tasks[t], shapes, nbytes) for t in order}
        levels = slack_levels(order, preds, cost, PRIORITY_LEVELS)
        rng = priority_range()
        self.task_priority.update({t: level_priority(lv, PRIORITY_LEVELS, rng) for t, lv in levels.items()})
        set_kernel_priorities({nd: self.task_priority[t] for nd, t in node_task.items() if t in levels})

    # -- inspection ---------------------------------------------------------------------------

    def graph_of(self, unit: int) -> Any:
        """The cupy.cuda.Graph that replays unit `unit`."""
        return self.unit_graph[unit].graph

    def close(self) -> None:
        self.ctx.synchronize()
        self.unit_graph.clear()
        self.graphs.clear()
        self.ctx.close()


_ACC_SOURCE = r"""
template <typename T>
__device__ void acc_step(const T* loss, double* acc) {
    // acc: [sum of finite losses, steps, first non-finite step (-1: none), its value]
    double v = (double)loss[0];
    acc[1] += 1.0;
    if (isfinite(v)) acc[0] += v;
    else if (acc[2] < 0.0) { acc[2] = acc[1]; acc[3] = v; }
}
extern "C" __global__ void ss_loss_acc_f32(const float* loss, double* acc) { acc_step(loss, acc); }
extern "C" __global__ void ss_loss_acc_f64(const double* loss, double* acc) { acc_step(loss, acc); }
"""


class LossAccumulator:
    """The training loop's per-step loss, summed on the device: one single-thread kernel after
    each task that writes the loss, on that task's stream (so it reads this step's value before
    the next step can rewrite it: the next writer is the same task on the same stream), captured
    into the step's graph under capture.  `acc` (f64[4]) holds the sum of the finite losses, the
    number of steps, the first step (1-based, since the last reset) whose loss was not finite
    and that value; `take()` reads it once and resets it (ARCHITECTURE.md: no host read inside
    a captured graph; issue 13: no host synchronization inside an epoch)."""

    def __init__(self, cp, loss):
        import numpy as np

        self.cp = cp
        self.loss = loss
        self.acc = cp.zeros((4,), dtype=cp.float64)
        self._init = np.array([0.0, 0.0, -1.0, 0.0])
        self.acc.set(self._init)
        mod = cp.RawModule(code=_ACC_SOURCE, options=("-std=c++14",))
        self.fn = mod.get_function(f"ss_loss_acc_{ {'float32': 'f32', 'float64': 'f64'}[str(loss.dtype)] }")

    def launch(self, stream) -> None:
        with stream:
            self.fn((1,), (1,), (self.loss, self.acc))

    def take(self, stream) -> tuple[float, int, int, float]:
        """(sum, steps, first bad step or -1, its value) since the last take; then reset.  The
        caller has synchronized the streams that accumulate."""
        got = self.acc.get(stream=stream)
        stream.synchronize()
        self.acc.set(self._init, stream=stream)
        stream.synchronize()
        return float(got[0]), int(got[1]), int(got[2]), float(got[3])


class _NodeMapper:
    """Maps captured graph nodes to the task whose launch created them, during one capture.

    before(): the set of nodes of the graph being captured (cudaGraphGetNodes on the capture's
    graph, which the runtime allows while capturing); after(task): the nodes created since
    (node_task) and the capturing stream's current dependencies (task_nodes: the node(s) the
    task ended with, from cudaStreamGetCaptureInfo).  Any failure of the bindings turns the
    mapper off for the rest of the capture: the mapping is for inspection, never for running.
    """

    def __init__(self, ctx: DeviceContext):
        self.ctx = ctx
        self.ok = True
        self.graph = None
        self.seen: set[int] = set()

    def _info(self, stream_ptr: int):
        """(graph, [dependency node ints]) of a capturing stream, across cuda-bindings 12/13:
        13's cudaStreamGetCaptureInfo and 12's _v3/_v2 return the dependencies as a list."""
        from streamsched.interp.cuda.device import cudart

        rt = cudart()
        for name in ("cudaStreamGetCaptureInfo", "cudaStreamGetCaptureInfo_v3",
                     "cudaStreamGetCaptureInfo_v2"):
            fn = getattr(rt, name, None)
            if fn is None:
                continue
            r = fn(stream_ptr)
            if not isinstance(r, tuple) or int(r[0]) != 0:
                continue
            lists = [x for x in r[1:] if isinstance(x, (list, tuple))]
            if not lists:
                continue  # the old signature (status, id): no dependencies
            graph = next((x for x in r[1:] if type(x).__name__ == "cudaGraph_t"), None)
            return graph, [int(d) for d in lists[0]]
        raise RuntimeError("cudaStreamGetCaptureInfo gave no dependencies")

    def _nodes(self) -> set[int]:
        from streamsched.interp.cuda.device import check, cudart

        rt = cudart()
        r = check(rt.cudaGraphGetNodes(self.graph, 0), "cudaGraphGetNodes")
        n = r[-1] if isinstance(r, tuple) else r
        if not n:
            return set()
        r = check(rt.cudaGraphGetNodes(self.graph, n), "cudaGraphGetNodes")
        return {int(x) for x in r[0]}

    def before(self) -> None:
        if not self.ok or self.graph is None:
            return
        try:
            self.seen = self._nodes()
        except Exception:
            self.ok = False

    def after(self, task_id: int, stream: str, task_nodes: dict, node_task: dict) -> None:
        if not self.ok:
            return
        try:
            graph, deps = self._info(self.ctx.stream_ptr(stream))
            first = self.graph is None
            if first:
                self.graph = graph
            task_nodes[task_id] = deps
            if self.graph is not None:
                now = self._nodes()
                # no "before" snapshot for the first task: every node so far is its own (the
                # unit's fork and the event waits create no nodes)
                new = now if first else now - self.seen
                for nd in new:
                    node_task.setdefault(nd, task_id)
                self.seen = now
        except Exception:
            self.ok = False
