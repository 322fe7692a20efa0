"""What only a data-parallel step can get wrong, found before anything runs: an all-reduce issued
before the backward's last write of a gradient in its bucket (R006), a gradient read (by the
optimizer, a clip, an overflow check) before its all-reduce (R007), a gradient no all-reduce
averages while others are (S031), and two collectives that may be in flight on different streams
in different orders on different ranks, a deadlock (R008).

R006, R007 and S031 follow the step's issue order, which the derived barriers turn into
happens-before (under `explicit`, a missing `after` is also an R001 race on the gradient).  R008
walks the EventPlan's happens-before with vector clocks over lanes, as validate.py does: every
rank runs the same plan, so two collectives ordered on one rank are ordered on all; two that are
not may start in either order, and NCCL requires every rank to issue the collectives of one
communicator in one order (CUDA_PITFALLS.md #24).

Source: NCCL's documentation ("Collective operations": the same order on every rank); PyTorch
DDP (buckets launched once all their gradients are ready).
"""

from __future__ import annotations

from collections import defaultdict

from streamsched.diagnostics import Diagnostic, Label
from streamsched.interp.ir import EventPlan, Schedule, Task
from streamsched.interp.validate import lane_of
from streamsched.stdlib.kernels.collectives import COLLECTIVE_KERNELS, is_collective


def _is_collective(t: Task) -> bool:
    return t.kernel in COLLECTIVE_KERNELS


def _communicates(t: Task) -> bool:
    return is_collective(t.kernel, t.attrs)


def _name(t: Task) -> str:
    return t.label or t.stmt or t.kernel


def check_collectives(schedule: Schedule) -> list[Diagnostic]:
    """R006, R007 and S031 over each unrolled step of `schedule`, in issue order."""
    by_step: dict[int, list[Task]] = defaultdict(list)
    for t in schedule.tasks:
        if t.step >= 0:
            by_step[t.step].append(t)
    kinds = {b.name: b.kind for b in schedule.buffers}
    out: list[Diagnostic] = []
    for step in sorted(by_step):
        tasks = sorted(by_step[step], key=lambda t: t.id)
        colls = [t for t in tasks if _is_collective(t)]
        if not colls:
            continue
        reduced: dict[str, Task] = {}
        for c in colls:
            for b in c.outs:
                reduced.setdefault(b, c)
        for c in colls:
            early: list[tuple[str, Task]] = []  # (gradient, its last writer after the all-reduce)
            stale: dict[tuple, list[str]] = {}  # reader's span -> gradients it reads too early
            first_reader: dict[tuple, Task] = {}
            for b in c.outs:
                later = [t for t in tasks if t.id > c.id and not _is_collective(t) and b in t.outs]
                if later:
                    early.append((b, later[-1]))
                    continue
                before = [t for t in tasks if t.id < c.id and not _is_collective(t) and b in t.outs]
                last_w = before[-1].id if before else -1
                for r in tasks:
                    if last_w < r.id < c.id and not _is_collective(r) and b in r.args and b not in r.outs:
                        key = (r.span, r.stmt.split("@")[0])
                        stale.setdefault(key, []).append(b)
                        first_reader.setdefault(key, r)
            if early:
                names = ", ".join(f"`{b}`" for b, _ in early)
                w = early[0][1]
                out.append(Diagnostic(
                    "R006", f"all-reduce before the backward finished: the step writes {names} after this "
                    "all-reduce, so the ranks would average gradients that are not finished", c.span,
                    labels=(Label(w.span, f"`{early[0][0]}` written here, after the all-reduce"),) if w.span else (),
                    help="launch the all-reduce's graph after the graph that runs the backward, and before the "
                         "optimizer's"))
            for key, bs in stale.items():
                r = first_reader[key]
                names = ", ".join(f"`{b}`" for b in bs)
                out.append(Diagnostic(
                    "R007", f"{names} read before {'its' if len(bs) == 1 else 'their'} all-reduce: this would use "
                    "the rank's own gradient, not the mean over the ranks", r.span,
                    labels=(Label(c.span, "all-reduced here, later in the step"),) if c.span else (),
                    help="launch the all-reduce's graph before this one in the step"))
        if not any(c.attr("bucket", "").startswith("grad:") for c in colls):
            continue
        # gradients read after their last write, never averaged: each rank applies its own
        missing: dict[tuple, list[str]] = {}
        readers: dict[tuple, Task] = {}
        for b, kind in kinds.items():
            if kind != "grad" or not b.startswith("grad.") or b in reduced:  # parameter gradients
                continue
            writes = [t.id for t in tasks if b in t.outs]
            if not writes:
                continue
            reader = next((t for t in tasks if t.id > writes[-1] and b in t.args and b not in t.outs), None)
            if reader is not None:
                key = (reader.span, reader.stmt.split("@")[0])
                missing.setdefault(key, []).append(b)
                readers.setdefault(key, reader)
        first = next(c for c in colls if c.attr("bucket", "").startswith("grad:"))
        have = list(dict.fromkeys(_layer(b) for b in first.outs))
        for key, bs in missing.items():
            lost = list(dict.fromkeys(_layer(b) for b in bs))
            names = ", ".join(f"`{b}`" for b in bs)
            out.append(Diagnostic(
                "S031", f"{names} {'is' if len(bs) == 1 else 'are'} never all-reduced, but other gradients are: "
                "each rank would apply its own gradient and the replicas drift apart", readers[key].span,
                labels=(Label(first.span, "the all-reduce of the other gradients"),) if first.span else (),
                help=f"name {'its layer' if len(lost) == 1 else 'their layers'} in a bucket: "
                     f"`buckets = \"{' '.join(have)} | {' '.join(lost)}\"`"))
    return out


def _layer(grad: str) -> str:
    name = grad[len("grad."):] if grad.startswith("grad.") else grad
    return name.rsplit(".", 1)[0]


def check_collective_order(plan: EventPlan) -> list[Diagnostic]:
    """R008: two collective tasks of `plan` (all-reduce buckets, synchronized batch norm) with no
    happens-before path either way (different lanes: streams, or streams of a capture unit).
    One finding per pair of statements."""
    sched = plan.schedule
    tasks = sched.tasks
    if not any(_communicates(t) for t in tasks):
        return []
    capture = sched.capture
    clock: dict[tuple, dict[tuple, int]] = {}
    pos: dict[tuple, int] = defaultdict(int)
    records: dict[int, tuple[int, dict]] = {}
    loc: dict[int, tuple[tuple, int]] = {}
    unit_tasks: dict[int, list[int]] = defaultdict(list)
    unit_lanes: dict[int, set] = defaultdict(set)
    seen: list[int] = []
    out: list[Diagnostic] = []
    reported: set[tuple] = set()
    for ins in plan.instrs:
        if ins.op == "launch":
            lane = lane_of(capture, ins.stream, ins.unit)
            c = clock.setdefault(lane, {})
            pos[lane] += 1
            p = c[lane] = pos[lane]
            v = ins.task
            loc[v] = (lane, p)
            if lane[1] >= 0:
                unit_tasks[lane[1]].append(v)
                unit_lanes[lane[1]].add(lane)
            if _communicates(tasks[v]):
                for u in seen:
                    lu, pu = loc[u]
                    if lu == lane or c.get(lu, 0) >= pu:
                        continue
                    tu, tv = tasks[u], tasks[v]
                    key = (tu.span, tv.span, tu.stmt, tv.stmt)
                    if key in reported:
                        continue
                    reported.add(key)
                    out.append(Diagnostic(
                        "R008", f"collectives may deadlock: {_name(tv)} on `{tv.stream}` and {_name(tu)} on "
                        f"`{tu.stream}` are not ordered, so ranks may start them in different orders and each "
                        "wait for the other", tv.span,
                        labels=(Label(tu.span, f"the other collective, on `{tu.stream}`"),) if tu.span else (),
                        help=f"issue every collective on one stream: add `on {tu.stream}` to this statement"))
                seen.append(v)
        elif ins.op == "record":
            lane = lane_of(capture, ins.stream, ins.unit)
            records[ins.event] = (lane[1], dict(clock.get(lane, {})))
        elif ins.op == "wait":
            lane = lane_of(capture, ins.stream, ins.unit)
            bound = records.get(ins.event)
            if bound is None or (capture != "none" and bound[0] != lane[1]):
                continue  # validate.py reports waits that order nothing (R003)
            c = clock.setdefault(lane, {})
            for k, val in bound[1].items():
                if val > c.get(k, 0):
                    c[k] = val
        elif ins.op == "begin" and capture != "none":
            clock[(ins.stream, ins.unit)] = dict(clock.get((ins.stream, -1), {}))
        elif ins.op == "end" and capture != "none":
            eager = (ins.stream, -1)
            pos[eager] += 1
            clock.setdefault(eager, {})[eager] = pos[eager]
            home = clock.get((ins.stream, ins.unit), {})
            ce = clock[eager]
            for k, val in home.items():  # the graph's completion carries what its home saw
                if k[1] < 0 and val > ce.get(k, 0):
                    ce[k] = val
            for t in unit_tasks.pop(ins.unit, ()):
                loc[t] = (eager, pos[eager])
            for lane in unit_lanes.pop(ins.unit, ()):
                clock.pop(lane, None)
            clock.pop((ins.stream, ins.unit), None)
    return out
