"""Program to Schedule: the step unrolled over the slot period (a prologue, then at least two
steps per slot) so loop-carried dependencies appear, every buffer placed by `plan_memory`, and
tasks grouped into capture units by the capture mode.

Source: ARCHITECTURE.md ("Steps are unrolled over the slot period (2 for A/B, at least 2) so
loop-carried edges appear") and LANGUAGE.md ("the interpreter adds a prologue").
"""

from __future__ import annotations

from streamsched.dsl.program import SLOT, Launch, Program
from streamsched.interp.ir import HOST, Schedule, Task, Unit
from streamsched.interp.memory import plan_memory


def default_steps(program: Program) -> int:
    """Unrolled steps: two full periods, so each slot's step has a full period of history."""
    period = max(1, len(program.slots))
    return 2 * period if period > 1 else 3


def unroll(program: Program, steps: int | None = None, capture: str | None = None,
           policy: str | None = None) -> Schedule:
    """Expand the step `steps` times (default `default_steps`), after a prologue (step -1) that
    issues the launches the step makes on its `next` slot, for the first slot.

    Task keys identify the same work in different steps of one slot (events are shared by key).
    Host `stage` tasks carry attrs `ahead` (1 when they fill the next step's slot) so the training
    loop stages batch `step + ahead`.
    """
    capture = capture or program.capture
    policy = policy or program.policy
    steps = steps if steps is not None else default_steps(program)
    slots = program.slots or ("",)
    period = len(slots)
    tasks: list[tuple] = []  # rows of Task fields (_ID...), made Tasks in _host_first
    units: list[Unit] = []
    op_ids: dict[tuple, int] = {}
    # launch instances: (step, launch index) -> task ids
    issued: dict[tuple[int, int], list[int]] = {}
    step_units: dict[int, int] = {}
    instances: list[tuple[str, str, list[int]]] = []
    host_space = {b.name for b in program.buffers if b.space == "host"}
    last_host_write: dict[str, int] = {}
    last_host_read: dict[str, int] = {}
    last_sync: list[int] = []  # the latest step-level `synchronize` (none under capture = step)
    # `after` edges the interpreter adds to a task once it is issued (host hazards, launch
    # order, synchronize): kept aside and merged once, in _host_first, instead of rebuilding
    # the frozen task at each addition.
    more_after: dict[int, set[int]] = {}
    launch_after: dict[int, tuple[int, ...]] = {}  # the same, for edges a whole launch gets (shared tuples)
    per_slot: dict[tuple, list[tuple]] = {}  # (launch, slot, tag, ahead) -> per template (see emit)

    def slot_for(k: int, which: str) -> str:
        if which == "slot":
            return slots[k % period]
        if which == "next":
            return slots[(k + 1) % period]
        return which

    def unit_for(k: int, name: str, graph: str, home: str, slot: str, span) -> int:
        if capture == "step":
            if k not in step_units:
                step_units[k] = len(units)
                nm = "prologue" if k < 0 else f"step{k}[{slots[k % period]}]" if slots[0] else f"step{k}"
                # The step's own slot, not its first launch's: units of one slot share their
                # events (barriers._unit_share), and a step of slot a must not share its end with
                # a step of slot b (a host wait for the copy of the step before the last would
                # move to the last step's end, and the host would wait for the whole last graph)
                own = slots[k % period] if k >= 0 and slots[0] else slot
                units.append(Unit(len(units), nm, "step" if k >= 0 else "prologue", home, own, k, span))
            return step_units[k]
        units.append(Unit(len(units), name, graph, home, slot, k, span))
        return len(units) - 1

    def emit(k: int, li: int, launch: Launch, slot: str, ahead: int) -> None:
        ids: list[int] = []
        tag = "pro" if k < 0 else slots[k % period]
        if launch.kind == "graph":
            g = program.graph(launch.graph)
            inst = f"{g.name}[{slot}]" if slot and g.slotted else g.name
            unit = unit_for(k, inst, g.name, g.home, slot, launch.span)
            base = len(tasks)
            # What a template gives in every step of one slot (names, label, key) is made once
            # and shared by those steps' tasks: large schedules repeat it thousands of times.
            made = per_slot.get((li, slot, tag, ahead))
            if made is None:
                made = per_slot[(li, slot, tag, ahead)] = [
                    (tuple(a.replace(SLOT, slot) for a in t.args), tuple(o.replace(SLOT, slot) for o in t.outs),
                     t.attrs + (("ahead", ahead),) if t.kernel == "stage" else t.attrs,
                     f"{tag}|{li}|{ti}",
                     t.label if not slot or not g.slotted else t.label.replace(f"{g.name}:", f"{inst}:", 1),
                     t.stmt or g.name)
                    for ti, t in enumerate(g.templates)]
            n = base  # the next task's id
            for t, (args, outs, attrs, tkey, label, stmt) in zip(g.templates, made):
                key = (k, li, t.op)
                oid = op_ids.get(key)
                if oid is None:
                    oid = op_ids[key] = len(op_ids)
                after = t.after
                tasks.append((
                    n, t.kernel, t.stream, args, outs, attrs, tuple([base + a for a in after]) if after else (),
                    -1 if t.stream == HOST else unit, oid, t.rep_stream, k, slot, tkey, label, stmt,
                    t.span, li, t.site))
                ids.append(n)
                n += 1
        elif launch.kind == "upload":
            hb = f"{launch.name}@host" + (f"[{slots[k % period]}]" if program.slots else "")
            key = (k, li, "upload")
            op_ids[key] = len(op_ids)
            unit = unit_for(k, f"upload {launch.name}", "upload", launch.stream, "", launch.span) \
                if capture == "step" else -1
            tasks.append((len(tasks), "set_scalar", HOST, (), (hb,), (("name", launch.name),), (), -1,
                          op_ids[key], HOST, k, slot, f"{tag}|{li}|set", f"upload.{launch.name}: set {launch.name}",
                          f"set.{launch.name}", launch.span, li, None))
            tasks.append((len(tasks), "h2d", launch.stream, (hb,), (launch.name,), (), (), unit,
                          op_ids[key], launch.stream, k, slot, f"{tag}|{li}|up", f"upload.{launch.name}: upload {launch.name}",
                          f"upload.{launch.name}", launch.span, li, None))
            ids.extend([len(tasks) - 2, len(tasks) - 1])
        elif launch.kind == "sync":
            # The host waits for everything issued so far: ordered after each stream's last task.
            # Under capture = step the step is one graph, which cannot hold it (C003): it orders
            # nothing then, and validate_schedule reports it.
            last: dict[str, int] = {}
            for t in tasks:
                last[t[_STREAM]] = t[_ID]
            key = (k, li, "sync")
            op_ids[key] = len(op_ids)
            after = tuple(sorted(last.values())) if capture != "step" else ()
            attrs = (("in_step_graph", True),) if capture == "step" else ()
            tasks.append((len(tasks), "synchronize", HOST, (), (), attrs, after, -1,
                          op_ids[key], HOST, k, slot, f"{tag}|{li}|sync", "synchronize", "synchronize",
                          launch.span, li, None))
            ids.append(len(tasks) - 1)
            if capture != "step":
                last_sync[:] = [len(tasks) - 1]
        # `after` between launches: every task of this launch follows the referenced launch's
        # last task on each stream.
        extra: list[int] = []
        for ref in launch.after:
            kk = k - 1 if ref.prev else k
            cands = [j for j, l in enumerate(program.step)
                     if ((l.kind == "graph" and l.graph == ref.graph)
                         or (l.kind == "upload" and f"upload.{l.name}" == ref.graph))
                     and (ref.prev or j < li)]
            if not cands:
                continue
            src = issued.get((kk, cands[-1]))
            if src is None and kk == -1:
                src = issued.get((-1, cands[-1]))
            if not src:
                continue
            sinks: dict[str, int] = {}
            for tid in src:
                sinks[tasks[tid][_STREAM]] = tid
            extra.extend(sinks.values())
        # A binding (`pass(load[slot])`) orders the launch after that slot's latest load.
        if launch.kind == "graph":
            for bg in launch.binds:
                for g_name, g_slot, g_ids in reversed(instances):
                    if g_name == bg and g_slot == slot:
                        sinks = {}
                        for tid in g_ids:
                            if tasks[tid][_STREAM] != HOST:
                                sinks[tasks[tid][_STREAM]] = tid
                        extra.extend(sinks.values())
                        break
        # The interpreter's own host work: a staging buffer is copied after the host wrote it,
        # and rewritten only after the copy that last read it (LANGUAGE.md, "The host").
        for tid in ids:
            t = tasks[tid]
            t_args, t_outs = t[_ARGS], t[_OUTS]
            if host_space.isdisjoint(t_args) and host_space.isdisjoint(t_outs):
                continue  # (device work: no staging buffer)
            own: set[int] = set()
            for a in t_args:
                if a in host_space and a in last_host_write:
                    own.add(last_host_write[a])
            for o in t_outs:
                if o in host_space and o in last_host_read:
                    own.add(last_host_read[o])
            for a in t_args:
                if a in host_space:
                    last_host_read[a] = tid
            for o in t_outs:
                if o in host_space:
                    last_host_write[o] = tid
            if own:
                more_after.setdefault(tid, set()).update(own)
        if launch.kind != "sync" and last_sync:
            # The host returns from a `synchronize` only once all earlier work is done, and issues
            # everything after it only then (cudaDeviceSynchronize): later work follows it.
            for tid in ids:
                launch_after[tid] = tuple(last_sync)
        if launch.kind == "graph":
            instances.append((launch.graph, slot, ids))
        if extra:
            # The launch's device work follows; its host staging is ordered by its own hazards
            # alone (the copy that last read the slot, above), since the step issues it first.
            shared = tuple(extra)  # (one tuple for all the launch's tasks, merged in _host_first)
            for tid in ids:
                if tasks[tid][_STREAM] != HOST:
                    launch_after[tid] = launch_after[tid] + shared if tid in launch_after else shared
        issued[(k, li)] = ids

    # Prologue: the launches made on `next`, for step 0's slot.
    for li, l in enumerate(program.step):
        if l.kind == "graph" and l.slot == "next":
            emit(-1, li, l, slots[0], 1)
    for k in range(steps):
        for li, l in enumerate(program.step):
            slot = slot_for(k, l.slot) if l.kind == "graph" and l.slot else (slots[k % period] if l.kind != "graph" else "")
            ahead = 1 if l.kind == "graph" and l.slot == "next" else 0
            emit(k, li, l, slot, ahead)
    tasks = _host_first(tasks, capture, more_after, launch_after)
    streams = tuple(n for n, _ in program.streams) + (HOST,)
    return Schedule(streams, plan_memory(program.buffers), tuple(tasks), tuple(units), period, steps, capture, policy,
                    launches=tuple(program.step))


_ID, _STREAM, _ARGS, _OUTS, _ATTRS, _AFTER, _STEP, _LAUNCH = 0, 2, 3, 4, 5, 6, 10, 16
"""Indexes of a row of `unroll`'s task table: a Task's fields in order (made a Task once, in
_host_first, when its final id and `after` are known)."""


def _host_first(tasks: list[tuple], capture: str, more_after: dict[int, set[int]],
                launch_after: dict[int, tuple[int, ...]] | None = None) -> list[Task]:
    """Issue each launch's host work (staging writes) before its device work, so a capture
    unit's tasks stay contiguous: the host fills the pinned slot, then launches the graph.
    Under capture = step the group is the whole step; otherwise one launch (one unit).
    tasks: rows of Task fields in order (`_ID`...); more_after: per task id, the `after` edges
    unroll added to it (merged here, once); launch_after: the same, for edges a whole launch gets."""
    # The order sorted by (group, device after host, index), group = step (capture = step) or
    # (step, launch), made by bucketing: each group's host rows then its device rows, in index
    # order, groups in ascending order (the rows come nearly grouped; no key tuple per row).
    groups: dict = {}
    by_launch = capture != "step"
    for i, t in enumerate(tasks):
        g = (t[_STEP], t[_LAUNCH]) if by_launch else t[_STEP]
        lists = groups.get(g)
        if lists is None:
            lists = groups[g] = ([], [])
        lists[t[_STREAM] != HOST].append(i)
    order = []
    for g in sorted(groups):
        host, device = groups[g]
        order += host
        order += device
    new_id = [0] * len(tasks)
    for new, old in enumerate(order):
        new_id[old] = new
    renum = new_id.__getitem__
    out = []
    for nid, old in enumerate(order):
        t = tasks[old]
        more = more_after.get(old)
        whole = launch_after.get(old) if launch_after else None
        t_after = t[_AFTER]
        if more or whole:
            merged = set(t_after)
            if more:
                merged |= more
            if whole:
                merged.update(whole)
            after = tuple(sorted(map(renum, merged)))
        else:
            after = tuple(sorted(map(renum, t_after))) if t_after else ()
        attrs = t[_ATTRS]
        if t[_STREAM] == HOST and after and after[-1] > nid:
            # Only under capture = step can host work move above device work it must follow: a
            # staging buffer written twice in one step, whose second write waits for the copy of
            # the first, which is now inside the step's graph.  That wait cannot be captured (the
            # host cannot wait inside a graph): validate_schedule reports C003 from this mark.
            # It is no `after` the user wrote, so it must never surface as an R002 cycle.
            waits_for = tuple(a for a in after if a > nid)
            after = tuple(a for a in after if a < nid)
            attrs = attrs + (("waits_in_step_graph", waits_for),)
        out.append(Task(nid, *t[1:_ATTRS], attrs, after, *t[_AFTER + 1:]))
    return out
