"""The CPU backend: runs a slice of an EventPlan with the CPU kernels, one FIFO queue per stream,
in a fixed or seeded-random interleaving that only records and waits constrain, and reports
every pair of unordered conflicting accesses it sees as an R001 diagnostic.

Semantics (ARCHITECTURE.md, "Semantics to hold on to" and "The CPU backend"):

- ``record e`` on stream s behaves like ``cudaEventRecord(e, s)``: it captures the work issued
  to s so far.  ``wait e`` on stream t behaves like ``cudaStreamWaitEvent(t, e)``: it binds, *at
  issue time*, to the latest ``record e`` issued before it (possibly in an earlier ``run``
  call), and holds t until that record has executed; with no earlier record it waits for
  nothing (CUDA Runtime API, "Event Management" and "Stream Management").
- A ``launch`` always runs once it reaches its queue head; ``begin``/``end`` are no-ops here.
- The race detector is FastTrack-style (Flanagan & Freund, "FastTrack: efficient and precise
  dynamic race detection", PLDI 2009): one vector clock per stream, the host included; program
  order ticks a stream's own component, a record snapshots the stream's clock, a wait joins the
  snapshot it bound to.  Each buffer keeps its last write epoch and, per stream, the latest read
  since; accesses conflict when their byte ranges overlap (``Buffer.overlaps``).  Because
  happens-before is fixed by the plan, a missing barrier is reported in every interleaving,
  including the ones whose values happen to come out right.
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
    earlier-issued record, so a plan issued through ``run`` cannot deadlock by itself; this
    fires when a wait binds to a record that was discarded when an earlier ``run`` failed, and
    otherwise means the executor itself is broken."""

    def __init__(self, stuck: Sequence[Instr], details: Sequence[str]):
        self.stuck = tuple(stuck)
        super().__init__("cpu backend: plan deadlock; stuck waits: " + "; ".join(details))


# ---------------------------------------------------------------------------------------------
# Race detector

class _Access(NamedTuple):
    task: int  # Task.id
    stream: str
    epoch: int  # the stream's own clock component when the access ran
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
        self.clocks: dict[str, dict[str, int]] = {}
        self.overlaps = _overlap_index(schedule.buffers)
        self.last_write: dict[str, _Access] = {}
        self.reads: dict[str, dict[str, _Access]] = {}
        self.races: list[Diagnostic] = []
        self._seen: set[tuple[str, str, str]] = set()

    def _clock(self, stream: str) -> dict[str, int]:
        c = self.clocks.get(stream)
        if c is None:
            c = self.clocks[stream] = {}
        return c

    def snapshot(self, stream: str) -> dict[str, int]:
        return dict(self._clock(stream))

    def join(self, stream: str, snap: Mapping[str, int]) -> None:
        c = self._clock(stream)
        for s, v in snap.items():
            if v > c.get(s, 0):
                c[s] = v

    def _regions(self, name: str) -> tuple[str, ...]:
        r = self.overlaps.get(name)
        return (name,) if r is None else r

    def launch(self, task: Task, stream: str, seq: int) -> None:
        c = self._clock(stream)
        c[stream] = c.get(stream, 0) + 1  # program order: a fresh epoch per task
        me = _Access(task.id, stream, c[stream], seq)
        for b in task.reads:
            for r in self._regions(b):
                w = self.last_write.get(r)
                if w is not None and w.stream != stream and c.get(w.stream, 0) < w.epoch:
                    self._report(w, r, me, b)
            self.reads.setdefault(b, {})[stream] = me
        for b in task.writes:
            for r in self._regions(b):
                w = self.last_write.get(r)
                if w is not None and w.stream != stream and c.get(w.stream, 0) < w.epoch:
                    self._report(w, r, me, b)
                for s, a in self.reads.get(r, {}).items():
                    if s != stream and c.get(s, 0) < a.epoch:
                        self._report(a, r, me, b)
            self.last_write[b] = me
            self.reads.pop(b, None)  # later accesses ordered after this write are after these reads

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
    bound: int = -1  # record: its own seq; wait: seq of the record it bound to (-1: none)


_OPS = frozenset({"launch", "record", "wait", "begin", "end"})


class CpuExecutor:
    """Runs EventPlan instructions on NumPy arrays, one FIFO queue per stream.

    schedule: the Schedule the instructions index (``Instr.task`` is an index into
    ``schedule.tasks``); arrays: buffer name -> array (``allocate_arrays``); kernels: kernel
    name -> Kernel; interleave: "fixed" runs the first-issued runnable instruction (global issue
    order whenever the plan allows), "random" a uniformly random runnable queue head drawn from
    ``numpy.random.Generator(seed)``, which persists across ``run`` calls; detect_races: run the
    vector-clock detector, whose findings accumulate in ``races`` (R001 Diagnostics, one per
    (earlier task key, later task key, buffer)).  ``executed`` lists task ids in execution order.

    Event state (latest record per event, executed records) and the detector persist across
    ``run`` calls, so one executor runs a whole training loop step by step.  Raises ValueError
    for an unknown ``interleave``.
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
    ):
        if interleave not in ("fixed", "random"):
            raise ValueError(f"interleave must be 'fixed' or 'random', got {interleave!r}")
        self.schedule = schedule
        self.arrays = arrays
        self.kernels = kernels
        self.interleave = interleave
        self.detect_races = detect_races
        self.rng = numpy.random.Generator(numpy.random.PCG64(seed))
        self.executed: list[int] = []
        self._detector = _RaceDetector(schedule) if detect_races else None
        self._queues: dict[str, deque[_Pending]] = {s: deque() for s in schedule.streams}
        self._seq = 0
        self._latest_record: dict[int, int] = {}  # event -> seq of its latest issued record
        self._done: dict[int, dict[str, int] | None] = {}  # executed record seq -> clock snapshot

    @property
    def races(self) -> list[Diagnostic]:
        """R001 diagnostics found so far, in the order they were found."""
        return self._detector.races if self._detector is not None else []

    def run(self, instrs: Sequence[Instr], host_fn: HostFn | None = None) -> None:
        """Issue ``instrs`` (a contiguous slice of a plan's global issue order, e.g. one step) to
        the stream queues, then execute until every queue is empty.

        host_fn(task, arrays) runs each task whose kernel has ``host=True`` (the training loop
        fills staging buffers); other tasks call ``kernel.cpu(ins, outs, attrs)`` with
        ``attrs = {**kernel.attrs, **dict(task.attrs)}``.  The detector sees a task's
        ``args`` as reads and ``outs`` as writes, host tasks included; whatever else host_fn
        touches is invisible to it.  Raises TaskFailed when a kernel or
        host_fn raises (also: unknown kernel, no CPU kernel, host kernel without host_fn),
        PlanDeadlock when pending waits can never run, InternalError for a malformed
        instruction.  After an exception the unexecuted instructions are discarded; waits that
        later bind to a discarded record deadlock.
        """
        for ins in instrs:
            self._issue(ins)
        try:
            self._drain(host_fn)
        except BaseException:
            for q in self._queues.values():
                q.clear()
            raise
        # Only the latest record of each event can still be bound to by a future wait.
        live = set(self._latest_record.values())
        self._done = {k: v for k, v in self._done.items() if k in live}

    # -- issue ---------------------------------------------------------------------------------

    def _issue(self, ins: Instr) -> None:
        if ins.op not in _OPS:
            raise InternalError(f"cpu backend: unknown instruction op {ins.op!r} in {ins}")
        seq = self._seq
        self._seq += 1
        bound = -1
        if ins.op == "launch":
            if not 0 <= ins.task < len(self.schedule.tasks):
                raise InternalError(f"cpu backend: launch of unknown task {ins.task} in {ins}")
            task = self.schedule.tasks[ins.task]
            if task.stream != ins.stream:
                raise InternalError(
                    f"cpu backend: task {task.id} belongs to stream {task.stream} but is launched on {ins.stream}"
                )
        elif ins.op == "record":
            bound = seq
            self._latest_record[ins.event] = seq
        elif ins.op == "wait":
            bound = self._latest_record.get(ins.event, -1)
        q = self._queues.get(ins.stream)
        if q is None:
            q = self._queues[ins.stream] = deque()
        q.append(_Pending(seq, ins, bound))

    # -- execute -------------------------------------------------------------------------------

    def _runnable(self, p: _Pending) -> bool:
        return p.instr.op != "wait" or p.bound < 0 or p.bound in self._done

    def _drain(self, host_fn: HostFn | None) -> None:
        queues = self._queues
        fixed = self.interleave == "fixed"
        while True:
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
            queues[p.instr.stream].popleft()
            self._execute(p, host_fn)

    def _execute(self, p: _Pending, host_fn: HostFn | None) -> None:
        ins, det = p.instr, self._detector
        if ins.op == "launch":
            task = self.schedule.tasks[ins.task]
            if det is not None:
                det.launch(task, ins.stream, p.seq)
            self._launch(task, host_fn)
            self.executed.append(task.id)
        elif ins.op == "record":
            self._done[p.seq] = det.snapshot(ins.stream) if det is not None else None
        elif ins.op == "wait":
            if p.bound >= 0 and det is not None:
                snap = self._done[p.bound]
                if snap is not None:
                    det.join(ins.stream, snap)
        # begin / end: capture-unit boundaries, nothing to do eagerly

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
            rec = pending_records.get(p.bound)
            where = (
                f"record #{p.bound} on {rec.stream} is still queued"
                if rec is not None
                else f"record #{p.bound} was discarded and will never run"
            )
            details.append(f"wait e{p.instr.event} on {p.instr.stream} (issued #{p.seq}): {where}")
        return PlanDeadlock([p.instr for p in heads], details)
