"""Data-flow checks on the unrolled schedule that races cannot see: a buffer read before
anything wrote it (S022), and a computed value overwritten before anything read it (S023).
Both are schedules that run race-free and train nothing (a load that never copies the labels,
`zero_grad` launched between the backward and the optimizer).
"""

from __future__ import annotations

from streamsched.diagnostics import Diagnostic, Label
from streamsched.interp.ir import Schedule, Task


def _roots(schedule: Schedule) -> dict[str, str]:
    bufs = schedule.buffer_map()
    out = {}
    for name, b in bufs.items():
        r = b
        while r.alias_of and r.alias_of in bufs:
            r = bufs[r.alias_of]
        out[name] = r.name
    return out


def _base(name: str) -> str:
    """`x[a]` and `x[b]` are one buffer to a user."""
    return name.partition("[")[0]


def lint_schedule(schedule: Schedule, initialized: set[str], host_read: set[str]) -> list[Diagnostic]:
    """S022 and S023 over the tasks in issue order.

    initialized: buffers that hold a value before the first step (parameters, optimizer state,
    constants); host_read: buffers the training loop reads after a step (the loss), whose
    overwrites are expected.  One diagnostic per source position and buffer.
    """
    roots = _roots(schedule)
    host_read = {roots.get(n, n) for n in host_read}  # the loss may live in another value's storage
    written: set[str] = {roots.get(n, n) for n in initialized}
    # (the distinct argument tuples first: unrolled steps repeat the same few thousand)
    read_anywhere = {roots.get(a, a) for args in {t.args for t in schedule.tasks} for a in args}
    pending: dict[str, Task] = {}  # root -> last writer whose value no one has read yet
    seen: set[tuple] = set()
    out: list[Diagnostic] = []

    roots_get, pending_get, pending_pop = roots.get, pending.get, pending.pop  # (bound once: a lookup per access)
    for t in schedule.tasks:
        for a in t.args:
            r = roots_get(a, a)
            if r not in written:
                key = ("S022", _base(a), t.span)
                if key not in seen:
                    seen.add(key)
                    help_ = ("copy it in the load graph: `copy batch -> ...`" if a.split("[")[0] in
                             _inputs(schedule) else "launch the work that computes it earlier in the step")
                    out.append(Diagnostic("S022", f"`{t.label or t.kernel}` reads `{_base(a)}`, which nothing "
                                          "has written before it", t.span, help=help_))
                written.add(r)  # report each buffer once
            pending_pop(r, None)
        for o in t.outs:
            r = roots_get(o, o)
            prev = pending_get(r)
            # (a staging write that would have to wait inside the step's graph is C003's to report;
            # an upload repeated before anything read the first one copies the same value again,
            # harmless like a second `clear`)
            again = prev is not None and prev.kernel == t.kernel == "h2d" and prev.stmt == t.stmt \
                and t.stmt.startswith("upload.") and prev.step == t.step
            if (prev is not None and prev.id != t.id and prev.kernel != "fill" and r in read_anywhere
                    and r not in host_read and o not in t.args and not t.attr("waits_in_step_graph")
                    and not again):
                key = ("S023", _base(o), prev.span, t.span)
                if key not in seen:
                    seen.add(key)
                    labels = (Label(t.span, f"overwritten here by `{t.label or t.kernel}`"),) if t.span else ()
                    out.append(Diagnostic(
                        "S023", f"the value of `{_base(o)}` written by `{prev.label or prev.kernel}` is overwritten "
                        f"by `{t.label or t.kernel}` before anything reads it", prev.span, labels=labels,
                        help="reorder the step so the value is used before it is replaced"))
            written.add(r)
            pending[r] = t
    return out


def _inputs(schedule: Schedule) -> set[str]:
    return {b.name.split("[")[0] for b in schedule.buffers if b.kind == "input"}


# Mixed precision (S024): the pieces of dynamic loss scaling must be wired to each other.
_AMP_OPTIMIZERS = {"amp_sgd_step": (5, 6), "amp_lars_step": (5, 6)}  # kernel -> (scale, found_inf) args
_PLAIN_OPTIMIZERS = ("sgd_step", "adam_step", "lars_step")
_FLAG_SETTERS = ("nonfinite_check", "unscale_check")


def _op_name(t: Task) -> str:
    """`optimize: sgd_amp@c1.w.w` -> `sgd_amp`."""
    return (t.label or t.kernel).split(": ")[-1].split("@")[0]


def lint_precision(schedule: Schedule, loss_scale: str) -> list[Diagnostic]:
    """S024: mixed-precision schedules that run race-free and train wrongly.

    - an optimizer that unscales (`sgd_amp`, `lars_amp`) by a buffer other than the backward's
      seed (`backward M * S`), or when the backward is not scaled at all (error);
    - its overflow flag never set by a `nonfinite` check, or never cleared in the step (after
      the first overflow every step would be skipped) (error);
    - a scaled backward feeding an optimizer that does not unscale (`sgd`, `adam`, `lars`) (error);
    - an f16 parameter updated in f16 by such an optimizer, without f32 master weights (warning).
    Source: Micikevicius et al., "Mixed Precision Training" (2018); torch.amp.GradScaler.
    """
    amp = set(_AMP_OPTIMIZERS) | {"update_scale"}
    if not any(t.kernel in amp for t in schedule.tasks):
        # No loss scaling in the schedule: only the plain optimizers' findings can arise, and
        # they need none of the data flow tracked below.
        return _plain_precision(schedule, loss_scale)
    bufs = schedule.buffer_map()
    written_by: dict[str, set[str]] = {}
    for t in schedule.tasks:
        for o in t.outs:
            b = _base(o)
            w = written_by.get(b)
            if w is None:
                written_by[b] = {t.kernel}
            else:
                w.add(t.kernel)
    out: list[Diagnostic] = []
    last_writer: dict[str, str] = {}  # buffer -> kernel of its latest writer, in issue order
    seed_read: dict[str, int] = {}  # scale -> index of the latest backward seed read
    last_write: dict[str, int] = {}
    for idx, t in enumerate(schedule.tasks):
        kernel = t.kernel
        if kernel not in amp and kernel not in _PLAIN_OPTIMIZERS:
            if kernel == "softmax_xent_grad" and t.args:
                seed_read[_base(t.args[0])] = idx
            for o in t.outs:
                b = _base(o)
                last_writer[b] = kernel
                last_write[b] = idx
            continue  # (most tasks: nothing of theirs is checked here)
        op = _op_name(t)
        if t.kernel == "softmax_xent_grad" and t.args:
            seed_read[_base(t.args[0])] = idx
        if t.kernel in _AMP_OPTIMIZERS or t.kernel == "update_scale":
            si, fi = _AMP_OPTIMIZERS.get(t.kernel, (0, 1))
            scale, found = _base(t.args[si]), _base(t.args[fi])
            if scale != loss_scale:
                why = (f"the backward is scaled by `{loss_scale}`" if loss_scale else "the backward is not scaled")
                verb = "unscales the gradients by" if t.kernel != "update_scale" else "updates"
                out.append(Diagnostic("S024", f"`{op}` {verb} `{scale}`, but {why}", t.span,
                                      help=f"seed the backward with the same scale: `backward MODEL * {scale}`"))
            setters = written_by.get(found, set())
            if not setters & set(_FLAG_SETTERS):
                out.append(Diagnostic("S024", f"`{op}` reads the overflow flag `{found}`, but no check sets it",
                                      t.span, help=f"run `nonfinite(MODEL, {found})` on the update stream before it"))
            elif "fill" not in setters:
                out.append(Diagnostic("S024", f"`{found}` is never cleared: after the first overflow `{op}` would "
                                      f"skip every step", t.span,
                                      help=f"clear it each step before the check: `clear {found}` in the zero-grad graph"))
            elif last_writer.get(found) not in _FLAG_SETTERS and t.step >= 0:
                out.append(Diagnostic("S024", f"`{op}` reads `{found}` before this step's check sets it", t.span,
                                      help=f"launch `nonfinite(MODEL, {found})` before it in the step"))
            if t.kernel in _AMP_OPTIMIZERS and last_write.get(scale, -1) > seed_read.get(scale, -1) and \
                    last_writer.get(scale) == "update_scale":
                out.append(Diagnostic("S024", f"`{op}` unscales by `{scale}` after `update_scale` changed it in this "
                                      "step", t.span, help="update the scale after the optimizer, as GradScaler.update"))
        elif t.kernel in _PLAIN_OPTIMIZERS:
            out.extend(_plain_finding(t, loss_scale, bufs))
        for o in t.outs:
            last_writer[_base(o)] = t.kernel
            last_write[_base(o)] = idx
    return out


def _plain_finding(t: Task, loss_scale: str, bufs) -> list[Diagnostic]:
    """S024 for an optimizer that does not unscale: fed a scaled backward (error), or updating
    f16 parameters in f16 (warning)."""
    op = _op_name(t)
    if loss_scale:
        return [Diagnostic("S024", f"`{op}` reads gradients multiplied by the loss scale `{loss_scale}` "
                           "and does not unscale them", t.span,
                           help="use `sgd_amp` or `lars_amp`, which unscale and skip overflowing steps")]
    w = bufs.get(t.args[0])
    if w is not None and w.dtype in ("f16", "bf16"):
        return [Diagnostic(
            "S024", f"`{op}` updates {w.dtype} parameters in {w.dtype}: updates smaller than their "
            "rounding step are lost, and small gradients underflow", t.span, severity="warning",
            help="use `sgd_amp` or `lars_amp` (f32 master weights) with `backward MODEL * loss_scale`")]
    return []


def _plain_precision(schedule: Schedule, loss_scale: str) -> list[Diagnostic]:
    """lint_precision of a schedule without loss-scaling kernels: the plain optimizers' findings."""
    plain = [t for t in schedule.tasks if t.kernel in _PLAIN_OPTIMIZERS]
    if not plain:
        return []
    bufs = schedule.buffer_map()
    out: list[Diagnostic] = []
    for t in plain:
        out.extend(_plain_finding(t, loss_scale, bufs))
    return out


_UPDATES = ("sgd_step", "adam_step", "lars_step", "amp_sgd_step", "amp_lars_step")


def lint_updates(schedule: Schedule, params: tuple[str, ...]) -> list[Diagnostic]:
    """S026: a parameter that no optimizer updates in a step (a layer left out of every `layers`
    group, a graph never launched: a warning, since freezing can be meant), or that two updates
    write in one step (an error: the second applies the gradient again)."""
    steps = sorted({t.step for t in schedule.tasks if t.step >= 0})
    if not steps or not params:
        return []
    first = steps[0]
    writers: dict[str, list[Task]] = {p: [] for p in params}
    for t in schedule.tasks:
        if t.step == first and t.kernel in _UPDATES and t.outs and t.outs[0] in writers:
            writers[t.outs[0]].append(t)
    if not any(writers.values()):
        return []  # no optimizer at all: S021 and friends speak for that
    out: list[Diagnostic] = []
    never = [p for p, ws in writers.items() if not ws]
    if never:
        # point at the model line of the first layer left out (the task computing its value)
        layer = never[0].rsplit(".", 1)[0]
        at = next((t.span for t in schedule.tasks if layer in t.outs and t.span is not None), None)
        out.append(Diagnostic("S026", f"no optimizer updates {', '.join(f'`{p}`' for p in never)}: "
                              f"{'it stays' if len(never) == 1 else 'they stay'} at the initial value",
                              at, severity="warning",
                              help="add the layer to an optimizer's `layers`, or launch the graph that updates it"))
    twice: dict[tuple, list[str]] = {}  # (first, second update's spans) -> parameters
    for p, ws in writers.items():
        if len(ws) > 1:
            twice.setdefault((ws[0].span, ws[1].span), []).append(p)
    for (first, second), ps in twice.items():
        out.append(Diagnostic("S026", f"{', '.join(f'`{p}`' for p in ps)} {'is' if len(ps) == 1 else 'are'} updated "
                              "twice per step: the gradient is applied again", second,
                              labels=(Label(first, "first updated here"),) if first else (),
                              help="give each layer to one optimizer: check the `layers` groups"))
    return out


def lint_launches(graphs, step, has_step: bool) -> list[Diagnostic]:
    """S025 (warning): a graph the step never launches: its work never runs."""
    if not has_step:
        return []
    launched = {ln.graph for ln in step if ln.kind == "graph"}
    return [Diagnostic("S025", f"graph `{g.name}` is never launched by the step", g.span, severity="warning",
                       help=f"launch it in the step (`{g.name}`), or remove it") for g in graphs
            if g.name not in launched]
