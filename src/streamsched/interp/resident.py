"""Device-resident data (issue 13), the plan side: which of a plan's host-to-device copies
become gathers on the device when the training set is held there, and which host work goes away.

With host staging, each step's `stage` host task writes its batch into a pinned slot and the
plan's `h2d` task copies the slot to the device; `set_scalar` host tasks write the learning rate
(and a step count) that an `h2d` uploads.  Held on the device, every such `h2d` becomes a device
gather from the uploaded data (or from a per-step table of the scalar) at the index its own
device counter gives, and the `stage` and `set_scalar` tasks and the host waits that guarded
their pinned slots are dropped: a step issues no host work at all.  The device plan is the host
plan with host tasks and host waits removed and each copy's source replaced by device memory
that nothing writes during an epoch, so every device-side order the plan proves (races, waits,
`after`) holds unchanged: `check`'s proof of the host plan covers it.

Counting (barriers.Segments): the loop issues unrolled step s as its steps k = s + n * period
(n = 0, 1, ...; once for steps before the steady state and for the prologue, s = -1), so the
gather of task t at its n-th execution reads batch s + n * period + ahead, the batch the host
would have staged (`ahead` is the stage task's prefetch distance), clamped to the run's steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamsched.interp.ir import HOST, EventPlan, Instr, Schedule


@dataclass(frozen=True)
class Gather:
    """One `h2d` task of the plan made a device gather: task (its id), kind ("field": a model
    input, the batch; "scalar": a per-step value), name (the input, e.g. "x", or the scalar,
    e.g. "lr"), step (its unrolled step; -1 the prologue), ahead (the batch it loads is that many
    steps after the step that issues it)."""

    task: int
    kind: str
    name: str
    step: int
    ahead: int = 0


@dataclass(frozen=True)
class ResidentPlan:
    """gathers: h2d task id -> Gather; dropped: the host tasks the loop no longer runs; period:
    the plan's steady period (0 when it has none); why_not: why the plan cannot run with
    device-resident data ("" when it can)."""

    gathers: dict[int, Gather] = field(default_factory=dict)
    dropped: frozenset[int] = frozenset()
    period: int = 0
    why_not: str = ""

    def device_instrs(self, instrs: tuple[Instr, ...]) -> tuple[Instr, ...]:
        """`instrs` without the dropped host tasks and without host waits (they only held the
        host back from a pinned slot a copy still read)."""
        return tuple(i for i in instrs if not (i.op == "launch" and i.task in self.dropped)
                     and not (i.op == "wait" and i.stream == HOST))


def resident_plan(schedule: Schedule, plan: EventPlan) -> ResidentPlan:
    """The ResidentPlan of `plan`: every `h2d` whose source a `stage` or `set_scalar` host task of
    the same step writes becomes a Gather.  why_not is set when other host work exists (a host
    kernel the loop does not own), when a staged buffer is copied by something else than `h2d`,
    or when the plan has no `stage` task at all (nothing to hold on the device)."""
    from streamsched.interp.barriers import steady_period

    writers: dict[tuple[int, str], object] = {}
    dropped: set[int] = set()
    for t in schedule.tasks:
        if t.stream != HOST:
            continue
        if t.kernel not in ("stage", "set_scalar"):
            return ResidentPlan(why_not=f"the host task `{t.label or t.kernel}` is not the loop's own staging")
        dropped.add(t.id)
        for o in t.outs:
            writers[(t.step, o)] = t
    if not any(t.kernel == "stage" for t in schedule.tasks):
        return ResidentPlan(why_not="the plan stages no batch (no `copy batch -> ...`)")
    gathers: dict[int, Gather] = {}
    host_bufs = {o for (_, o) in writers}
    for t in schedule.tasks:
        if t.stream == HOST:
            continue
        src = [a for a in t.args if a in host_bufs]
        if not src:
            continue
        w = writers.get((t.step, src[0]))
        if t.kernel != "h2d" or len(t.args) != 1 or w is None:
            return ResidentPlan(why_not=f"`{t.label or t.kernel}` reads the staged `{src[0]}` other than as one copy "
                                        "of its own step")
        if w.kernel == "stage":
            gathers[t.id] = Gather(t.id, "field", str(w.attr("field")), t.step, int(w.attr("ahead", 0)))
        else:
            gathers[t.id] = Gather(t.id, "scalar", str(w.attr("name")), t.step)
    return ResidentPlan(gathers, frozenset(dropped), steady_period(plan) or 0)
