"""The CPU backend: runs EventPlan instructions with the CPU kernels, one FIFO queue per lane (a
stream, or a stream inside one launch of a capture unit), issued ahead of their execution so that
later work (the next training step) runs as soon as the plan's records, waits and capture units
allow, in a fixed or seeded-random interleaving; every pair of unordered conflicting accesses it
sees is reported as an R001 diagnostic.

Semantics (ARCHITECTURE.md, "Semantics to hold on to" and "The CPU backend"; the lanes are those
of ``validate.py``, so the run-time detector and the static checker agree on happens-before):

- **Issue, then execute.**  ``issue`` appends instructions to lane queues and returns, as the
  host's ``cudaLaunchKernel`` / ``cudaEventRecord`` / ``cudaStreamWaitEvent`` /
  ``cudaGraphLaunch`` calls enqueue work on a stream and return before it runs (CUDA C++
  Programming Guide, "Asynchronous Concurrent Execution", "Streams").  ``drain`` executes queued
  work, all of it or until a condition holds, so step k+1 can be issued while step k is still
  pending and its work then runs whenever the waits allow, interleaved with step k's.
- **Lanes.**  A lane is a stream, except inside a capture unit when capture is graphs or step:
  there the instructions tagged with unit U run on lanes (stream, U), one per stream the unit
  uses.  A captured graph's nodes depend only on what was captured, never on the eager work of
  the streams it was captured from (Programming Guide, "CUDA Graphs", "Creating a Graph Using
  Stream Capture", "Cross-stream Dependencies and Events").  So a unit's tasks are ordered only
  by the unit's own stream order, its waits and its fork/join.
- ``begin U`` sits in its home stream h's queue: it runs after h's earlier work and starts the
  unit; no lane of U runs before it (``cudaGraphLaunch(exec, h)``: the graph starts after the
  work issued to h before it).  ``end U`` sits in h's queue too and runs when every lane of U is
  empty; h's later work follows it (the graph launch completes as one operation on h).  Other
  streams' eager work is not ordered by either, except through events.  The training loop issues
  the same unit again in its steady state, so units are numbered per ``begin`` (instances): the
  instructions tagged U after a ``begin U`` belong to that instance.
- ``record e`` on lane l behaves like ``cudaEventRecord(e, s)``: it captures the work issued to
  l so far.  ``wait e`` on lane l behaves like ``cudaStreamWaitEvent``: it binds, *at issue
  time*, to the latest ``record e`` issued before it (possibly in an earlier ``issue`` call) and
  holds l until that record has executed; with no earlier record it waits for nothing (CUDA
  Runtime API, "Event Management", "Stream Management").  Under capture, a wait bound to a record
  in another unit instance, or between a unit and eager work, orders nothing: CUDA refuses it
  (``cudaErrorStreamCaptureIsolation``; a non-captured event needs ``cudaEventWaitExternal``),
  the checker reports it as R003, and here it waits for nothing.
- The host is a lane like the others: its tasks run in order, each after the waits before it.
- A ``launch`` runs once it reaches its queue head (and its unit has begun).
- The race detector is FastTrack-style (Flanagan & Freund, "FastTrack: efficient and precise
  dynamic race detection", PLDI 2009) over lanes: one vector clock per lane, the host included;
  program order ticks a lane's own component, a record snapshots the lane's clock, a wait joins
  the snapshot it bound to.  ``begin U`` starts U's home lane from h's clock and U's other
  lanes empty (they learn the home's clock through the fork's event, as in the checker: so a
  missing fork is reported, though the executor, holding the unit until ``begin``, never lets it
  change a value); ``end U`` ticks h once and
  from then on the unit's accesses count as made by h at that tick (after ``end`` the unit is
  known outside only as a whole).  Each buffer keeps its last write epoch and, per lane, the
  latest read since; accesses conflict when their byte ranges overlap (``Buffer.overlaps``).
  Because happens-before is fixed by the plan, a missing barrier is reported in every
  interleaving, including those whose values happen to come out right, and cross-step races and
  races that exist only under capture are seen as well.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy

from streamsched.diagnostics import Diagnostic, InternalError
from streamsched.interp.ir import Buffer, Instr, Schedule, Task
from streamsched.interp.races import race_diagnostic
from streamsched.stdlib.kernel_record import Kernel

__all__ = ["CpuExecutor", "PlanDeadlock", "TaskFailed"]

HostFn = Callable[[Task, dict], None]
TaskDone = Callable[[Task, Any], None]
Lane = tuple[str, int]
"""(stream, unit instance), instance -1 for eager work."""


class TaskFailed(Exception):
    """A kernel (or the host function of a host kernel) raised while running ``task``.

    ``task`` is the Task (its ``span`` names the .sched line); ``cause`` is the original
    exception, also chained as ``__cause__``.
    """

    def __init__(self, task: Task, cause: BaseException):
        self.task = task
        self.cause = cause
        what = task.label or task.kernel
        super().__init__(f"task {task.id} `{what}` on {task.stream} failed: {type(cause).__name__}: {cause}")


class PlanDeadlock(InternalError):
    """No queue head can run while work is pending: every head is a wait whose record can never
    execute.  ``stuck`` holds those waits.  Under issue-time binding a wait only binds to an
    earlier-issued record, and the earliest pending instruction can always run, so a plan cannot
    deadlock by itself; this fires when a wait binds to a record that was discarded when an
    earlier ``drain`` failed, and otherwise means the executor itself is broken."""

    def __init__(self, stuck: Sequence[Instr], details: Sequence[str]):
        self.stuck = tuple(stuck)
        super().__init__("cpu backend: plan deadlock; stuck waits: " + "; ".join(details))


# ---------------------------------------------------------------------------------------------
# Race detector

class _Access(NamedTuple):
    task: int  # Task.id
    lane: Lane
    epoch: int  # the lane's own clock component when the access ran
    seq: int  # issue position of the launch, to report pairs in issue order


def _overlap_index(buffers: Sequence[Buffer]) -> dict[str, tuple[str, ...]]:
    """name -> names of all buffers whose bytes overlap it (itself included).

    Planned buffers are sorted per space and swept into clusters of transitively overlapping
    ranges; pairs are only compared inside a cluster, so unaliased buffers cost O(1) each.
    Zero-size buffers conflict with nothing; unplanned ones (offset < 0) only with their name.
    """
    ov: dict[str, tuple[str, ...]] = {}
    by_space: dict[str, list[Buffer]] = {}
    for b in buffers:
        if b.offset >= 0 and b.nbytes > 0:
            by_space.setdefault(b.space, []).append(b)
        elif b.size == 0:
            ov[b.name] = ()
        else:
            ov[b.name] = (b.name,)
    for bs in by_space.values():
        bs.sort(key=lambda b: (b.offset, b.name))
        clusters: list[list[Buffer]] = []
        end = -1
        for b in bs:
            if clusters and b.offset < end:
                clusters[-1].append(b)
                end = max(end, b.offset + b.nbytes)
            else:
                clusters.append([b])
                end = b.offset + b.nbytes
        for cl in clusters:
            for b in cl:
                ov[b.name] = tuple(c.name for c in cl if c.overlaps(b))
    return ov


def _acc(task: Task, name: str) -> str:
    return "writes" if name in task.writes else "reads"


def _report_name(first: Task, nf: str, second: Task, ns: str) -> str:
    """The buffer name to hand race_diagnostic, which classifies RAW/WAR/WAW from a single
    name: with aliases (nf != ns) pick the one that reproduces the true access kinds, else one
    that at least shows a write."""
    if nf == ns:
        return nf
    truth = (_acc(first, nf), _acc(second, ns))
    fallback = None
    for n in (ns, nf):
        pair = (_acc(first, n), _acc(second, n))
        if pair == truth:
            return n
        if fallback is None and pair != ("reads", "reads"):
            fallback = n
    return fallback or nf


class _RaceDetector:
    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.clocks: dict[Lane, dict[Lane, int]] = {}
        self.overlaps = _overlap_index(schedule.buffers)
        self.last_write: dict[str, _Access] = {}
        self.reads: dict[str, dict[Lane, _Access]] = {}
        self.touched: dict[int, set[str]] = {}  # unit instance -> buffer names its lanes accessed
        self.races: list[Diagnostic] = []
        self._seen: set[tuple[str, str, str]] = set()

    def _clock(self, lane: Lane) -> dict[Lane, int]:
        c = self.clocks.get(lane)
        if c is None:
            c = self.clocks[lane] = {}
        return c

    def snapshot(self, lane: Lane) -> dict[Lane, int]:
        return dict(self._clock(lane))

    def join(self, lane: Lane, snap: Mapping[Lane, int]) -> None:
        c = self._clock(lane)
        for s, v in snap.items():
            if v > c.get(s, 0):
                c[s] = v

    def begin(self, home: Lane, unit_home: Lane) -> None:
        """The unit's home lane starts from its home stream's clock; its other lanes start empty."""
        self.clocks[unit_home] = dict(self._clock(home))

    def end(self, inst: int, home: Lane) -> None:
        """The home stream ticks once; every access made on a lane of instance `inst` now counts
        as made by `home` at that tick, and the instance's lanes are forgotten."""
        c = self._clock(home)
        e = c[home] = c.get(home, 0) + 1
        for name in self.touched.pop(inst, ()):
            w = self.last_write.get(name)
            if w is not None and w.lane[1] == inst:
                self.last_write[name] = w._replace(lane=home, epoch=e)
            rs = self.reads.get(name)
            if rs:
                mine = [l for l in rs if l[1] == inst]
                if mine:
                    latest = max((rs.pop(l) for l in mine), key=lambda a: a.seq)
                    rs[home] = latest._replace(lane=home, epoch=e)
        for lane in [l for l in self.clocks if l[1] == inst]:
            del self.clocks[lane]

    def _regions(self, name: str) -> tuple[str, ...]:
        r = self.overlaps.get(name)
        return (name,) if r is None else r

    def launch(self, task: Task, lane: Lane, seq: int) -> None:
        c = self._clock(lane)
        c[lane] = c.get(lane, 0) + 1  # program order: a fresh epoch per task
        me = _Access(task.id, lane, c[lane], seq)
        for b in task.reads:
            for r in self._regions(b):
                w = self.last_write.get(r)
                if w is not None and w.lane != lane and c.get(w.lane, 0) < w.epoch:
                    self._report(w, r, me, b)
            self.reads.setdefault(b, {})[lane] = me
        for b in task.writes:
            for r in self._regions(b):
                w = self.last_write.get(r)
                if w is not None and w.lane != lane and c.get(w.lane, 0) < w.epoch:
                    self._report(w, r, me, b)
                for s, a in self.reads.get(r, {}).items():
                    if s != lane and c.get(s, 0) < a.epoch:
                        self._report(a, r, me, b)
            self.last_write[b] = me
            self.reads.pop(b, None)  # later accesses ordered after this write are after these reads
        if lane[1] >= 0:
            self.touched.setdefault(lane[1], set()).update(task.reads, task.writes)

    def _report(self, prev: _Access, prev_name: str, cur: _Access, cur_name: str) -> None:
        tasks = self.schedule.tasks
        (fa, nf), (sa, ns) = sorted(((prev, prev_name), (cur, cur_name)), key=lambda p: p[0].seq)
        first, second = tasks[fa.task], tasks[sa.task]
        name = _report_name(first, nf, second, ns)
        key = (first.key or f"#{first.id}", second.key or f"#{second.id}", name)
        if key not in self._seen:
            self._seen.add(key)
            self.races.append(race_diagnostic(self.schedule, first, second, name))


# ---------------------------------------------------------------------------------------------
# Executor

@dataclass
class _Pending:
    seq: int  # global issue position
    instr: Instr
    lane: Lane  # the queue it sits in
    batch: int  # the `issue` call it came from
    bound: int = -1  # record: its own seq; wait: seq of the record it bound to (-1: none)
    inst: int = -1  # begin / end: the unit instance they open / close


@dataclass
class _Batch:
    host_fn: HostFn | None
    tag: Any
    left: int = 0  # instructions not yet executed


_OPS = frozenset({"launch", "record", "wait", "begin", "end"})


class CpuExecutor:
    """Runs EventPlan instructions on NumPy arrays, one FIFO queue per lane (module docstring).

    schedule: the Schedule the instructions index (``Instr.task`` is an index into
    ``schedule.tasks``; ``schedule.capture`` decides whether units have lanes of their own);
    arrays: buffer name -> array (``allocate_arrays``); kernels: kernel name -> Kernel;
    interleave: "fixed" runs the first-issued runnable instruction (global issue order, however
    far ahead work was issued), "random" a uniformly random runnable queue head drawn from
    ``numpy.random.Generator(seed)``, which persists across calls; detect_races: run the
    vector-clock detector, whose findings accumulate in ``races`` (R001 Diagnostics, one per
    (earlier task key, later task key, buffer)); on_task_done(task, tag): called after each task
    ran, with the tag of the ``issue`` call that issued it (the training loop snapshots the
    loss there, since later steps may overwrite it before the loop looks).  ``executed`` lists
    task ids in execution order.

    Use ``issue`` + ``drain`` to keep several steps in flight, or ``run`` (issue, then drain
    everything) for one step at a time.  Event state (latest record per event, executed
    records), unit instances and the detector persist across calls, so one executor runs a
    whole training loop.  Raises ValueError for an unknown ``interleave``.
    """

    def __init__(
        self,
        schedule: Schedule,
        arrays: Mapping[str, Any],
        kernels: Mapping[str, Kernel],
        *,
        interleave: str = "fixed",
        seed: int = 0,
        detect_races: bool = True,
        on_task_done: TaskDone | None = None,
    ):
        if interleave not in ("fixed", "random"):
            raise ValueError(f"interleave must be 'fixed' or 'random', got {interleave!r}")
        self.schedule = schedule
        self.arrays = arrays
        self.kernels = kernels
        self.interleave = interleave
        self.detect_races = detect_races
        self.on_task_done = on_task_done
        self.rng = numpy.random.Generator(numpy.random.PCG64(seed))
        self.executed: list[int] = []
        self._captured = schedule.capture != "none"
        self._detector = _RaceDetector(schedule) if detect_races else None
        self._queues: dict[Lane, deque[_Pending]] = {(s, -1): deque() for s in schedule.streams}
        self._seq = 0
        self._batches: dict[int, _Batch] = {}  # batches with work left
        self._next_batch = 0
        self._latest_record: dict[int, tuple[int, int]] = {}  # event -> (seq, instance) of its latest record
        self._done: dict[int, dict[Lane, int] | None] = {}  # executed record seq -> clock snapshot
        self._instance: dict[int, int] = {}  # unit id -> its latest instance
        self._next_inst = 0
        self._started: set[int] = set()  # instances whose `begin` ran (or that have none)
        self._inst_left: dict[int, int] = {}  # instance -> its lanes' instructions not yet run

    @property
    def races(self) -> list[Diagnostic]:
        """R001 diagnostics found so far, in the order they were found."""
        return self._detector.races if self._detector is not None else []

    @property
    def pending(self) -> int:
        """Instructions issued and not yet executed."""
        return sum(b.left for b in self._batches.values())

    def run(self, instrs: Sequence[Instr], host_fn: HostFn | None = None) -> None:
        """``issue(instrs, host_fn)``, then ``drain()``: execute until every queue is empty
        (work issued earlier and still pending included).  Raises what ``drain`` raises."""
        self.issue(instrs, host_fn)
        self.drain()

    def issue(self, instrs: Sequence[Instr], host_fn: HostFn | None = None, *, tag: Any = None) -> int:
        """Append ``instrs`` (a contiguous slice of a plan's global issue order, e.g. one step) to
        the lane queues without executing anything; returns the batch number of this call
        (0, 1, 2, ... per executor), which ``drain(until=...)`` accepts.

        host_fn(task, arrays) runs each task of this batch whose kernel has ``host=True`` (the
        training loop fills staging buffers; bind the loop step into it, since the task may run
        after later steps were issued); other tasks call ``kernel.cpu(ins, outs, attrs)`` with
        ``attrs = {**kernel.attrs, **dict(task.attrs)}``.  The detector sees a task's ``args``
        as reads and ``outs`` as writes, host tasks included; whatever else host_fn touches is
        invisible to it.  tag: handed to ``on_task_done`` for this batch's tasks (default: the
        batch number).  Raises InternalError for a malformed instruction (nothing of this call
        is then issued past it)."""
        b = self._next_batch
        self._next_batch += 1
        batch = self._batches[b] = _Batch(host_fn, b if tag is None else tag)
        try:
            for ins in instrs:
                self._issue(ins, b, batch)
        finally:
            if not batch.left:
                del self._batches[b]
        return b

    def drain(self, until: int | Callable[[], bool] | None = None) -> None:
        """Execute queued instructions, picked by the interleaving, until ``until`` holds: None,
        until nothing is pending; a batch number b, until every instruction of batches <= b
        has run (later batches' work runs meanwhile whenever it is picked); a callable, until it
        returns True (checked before each instruction) or nothing is pending.

        Raises TaskFailed when a kernel or host_fn raises (also: unknown kernel, no CPU kernel,
        host kernel without host_fn), PlanDeadlock when pending waits can never run.  After an
        exception every unexecuted instruction is discarded; waits that later bind to a
        discarded record deadlock."""
        if until is None:
            stop: Callable[[], bool] = lambda: False
        elif callable(until):
            stop = until
        else:
            last = int(until)
            stop = lambda: not any(k <= last for k in self._batches)
        try:
            self._drain(stop)
        except BaseException:
            for q in self._queues.values():
                q.clear()
            self._batches.clear()
            self._inst_left.clear()
            raise
        # Only the latest record of each event, or one a queued wait bound to, can still be
        # waited on.
        live = {seq for seq, _ in self._latest_record.values()}
        live.update(p.bound for q in self._queues.values() for p in q if p.instr.op == "wait")
        self._done = {k: v for k, v in self._done.items() if k in live}

    # -- issue ---------------------------------------------------------------------------------

    def _lane(self, ins: Instr) -> Lane:
        """The queue of an instruction; begin / end sit on their home stream's own queue."""
        if not self._captured or ins.unit < 0 or ins.op in ("begin", "end"):
            return (ins.stream, -1)
        inst = self._instance.get(ins.unit)
        if inst is None:  # a unit with no `begin` (a hand-built plan): its lanes are not held
            inst = self._instance[ins.unit] = self._new_instance()
            self._started.add(inst)
        return (ins.stream, inst)

    def _new_instance(self) -> int:
        inst = self._next_inst
        self._next_inst += 1
        return inst

    def _issue(self, ins: Instr, b: int, batch: _Batch) -> None:
        if ins.op not in _OPS:
            raise InternalError(f"cpu backend: unknown instruction op {ins.op!r} in {ins}")
        if ins.op == "launch":
            if not 0 <= ins.task < len(self.schedule.tasks):
                raise InternalError(f"cpu backend: launch of unknown task {ins.task} in {ins}")
            task = self.schedule.tasks[ins.task]
            if task.stream != ins.stream:
                raise InternalError(
                    f"cpu backend: task {task.id} belongs to stream {task.stream} but is launched on {ins.stream}"
                )
        seq = self._seq
        self._seq += 1
        inst = -1
        if self._captured and ins.op == "begin" and ins.unit >= 0:
            inst = self._instance[ins.unit] = self._new_instance()
            self._inst_left[inst] = 0
        elif self._captured and ins.op == "end" and ins.unit >= 0:
            # Instructions tagged with this unit after its `end` belong to no open instance.
            inst = self._instance.pop(ins.unit, -1)
        lane = self._lane(ins)
        bound = -1
        if ins.op == "record":
            bound = seq
            self._latest_record[ins.event] = (seq, lane[1])
        elif ins.op == "wait":
            rec = self._latest_record.get(ins.event)
            # Under capture a wait orders nothing across a unit instance's boundary (isolation).
            if rec is not None and (not self._captured or rec[1] == lane[1]):
                bound = rec[0]
        if lane[1] >= 0:
            self._inst_left[lane[1]] = self._inst_left.get(lane[1], 0) + 1
        q = self._queues.get(lane)
        if q is None:
            q = self._queues[lane] = deque()
        q.append(_Pending(seq, ins, lane, b, bound, inst))
        batch.left += 1

    # -- execute -------------------------------------------------------------------------------

    def _runnable(self, p: _Pending) -> bool:
        if p.lane[1] >= 0 and p.lane[1] not in self._started:
            return False  # the unit's graph has not been launched yet
        op = p.instr.op
        if op == "wait":
            return p.bound < 0 or p.bound in self._done
        if op == "end" and p.inst >= 0:
            return self._inst_left.get(p.inst, 0) == 0
        return True

    def _drain(self, stop: Callable[[], bool]) -> None:
        queues = self._queues
        fixed = self.interleave == "fixed"
        while not stop():
            heads = [q[0] for q in queues.values() if q]
            if not heads:
                return
            runnable = [p for p in heads if self._runnable(p)]
            if not runnable:
                raise self._deadlock(heads)
            if fixed:
                p = min(runnable, key=lambda h: h.seq)
            else:
                p = runnable[int(self.rng.integers(len(runnable)))]
            queues[p.lane].popleft()
            self._execute(p)
            batch = self._batches[p.batch]
            batch.left -= 1
            if not batch.left:
                del self._batches[p.batch]
            if p.lane[1] >= 0:
                self._inst_left[p.lane[1]] -= 1

    def _execute(self, p: _Pending) -> None:
        ins, det, lane = p.instr, self._detector, p.lane
        if ins.op == "launch":
            task = self.schedule.tasks[ins.task]
            if det is not None:
                det.launch(task, lane, p.seq)
            batch = self._batches[p.batch]
            self._launch(task, batch.host_fn)
            self.executed.append(task.id)
            if self.on_task_done is not None:
                self.on_task_done(task, batch.tag)
        elif ins.op == "record":
            self._done[p.seq] = det.snapshot(lane) if det is not None else None
        elif ins.op == "wait":
            if p.bound >= 0 and det is not None:
                snap = self._done[p.bound]
                if snap is not None:
                    det.join(lane, snap)
        elif ins.op == "begin" and p.inst >= 0:
            self._started.add(p.inst)
            if det is not None:
                det.begin(lane, (ins.stream, p.inst))
        elif ins.op == "end" and p.inst >= 0:
            if det is not None:
                det.end(p.inst, lane)
            self._started.discard(p.inst)
            self._inst_left.pop(p.inst, None)
            for l in [l for l, q in self._queues.items() if l[1] == p.inst and not q]:
                del self._queues[l]
        # begin / end under capture = none: nothing to do eagerly

    def _launch(self, task: Task, host_fn: HostFn | None) -> None:
        try:
            kernel = self.kernels.get(task.kernel)
            if kernel is None:
                raise KeyError(f"no kernel named `{task.kernel}`")
            if kernel.host:
                if host_fn is None:
                    raise RuntimeError(f"host kernel `{kernel.name}` needs a host_fn to run")
                host_fn(task, self.arrays)
                return
            if kernel.cpu is None:
                raise NotImplementedError(f"kernel `{kernel.name}` has no CPU implementation")
            ins = [self.arrays[a] for a in task.args]
            outs = [self.arrays[o] for o in task.outs]
            kernel.cpu(ins, outs, {**kernel.attrs, **dict(task.attrs)})
        except Exception as e:
            raise TaskFailed(task, e) from e

    def _deadlock(self, heads: Sequence[_Pending]) -> PlanDeadlock:
        pending_records = {
            p.seq: p.instr for q in self._queues.values() for p in q if p.instr.op == "record"
        }
        details = []
        for p in heads:
            if p.instr.op != "wait":
                continue
            rec = pending_records.get(p.bound)
            where = (
                f"record #{p.bound} on {rec.stream} is still queued"
                if rec is not None
                else f"record #{p.bound} was discarded and will never run"
            )
            details.append(f"wait e{p.instr.event} on {p.instr.stream} (issued #{p.seq}): {where}")
        return PlanDeadlock([p.instr for p in heads if p.instr.op == "wait"], details)
