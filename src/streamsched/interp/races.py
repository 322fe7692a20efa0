"""The one way a race is reported, shared by the static checker and the CPU backend's run-time
detector, so both name the same buffer, tasks, streams and source lines."""

from __future__ import annotations

from streamsched.diagnostics import Diagnostic, Label
from streamsched.interp.ir import Schedule, Task


def _access(task: Task, buffer: str) -> str:
    if buffer in task.writes:
        return "writes"
    return "reads"


def _graph_of(task: Task) -> str:
    """The graph a task was launched from (labels read `GRAPH[slot]: ...`), or ""."""
    head, sep, _ = task.label.partition(":")
    return head.split("[")[0].strip() if sep else ""


def race_diagnostic(schedule: Schedule, first: Task, second: Task, buffer: str) -> Diagnostic:
    """R001: `first` (issued earlier) and `second` touch overlapping bytes of `buffer`, at least
    one writes, they run on different streams and no happens-before path orders them.
    The primary span is the later task; the help suggests the `after` clause that fixes it."""
    a1, a2 = _access(first, buffer), _access(second, buffer)
    kind = {("writes", "reads"): "RAW", ("reads", "writes"): "WAR", ("writes", "writes"): "WAW"}[(a1, a2)]
    labels = []
    if first.span is not None:
        labels.append(Label(first.span, f"{a1} `{buffer}` on {first.stream} ({first.label or first.kernel})"))
    msg = (
        f"race on buffer `{buffer}` ({kind}): `{second.label or second.kernel}` on {second.stream} "
        f"is not ordered after `{first.label or first.kernel}` on {first.stream}"
    )
    help_ = f"add `after {first.stmt}` to the later statement" if first.stmt else "order the two tasks with an `after` clause"
    g1, g2 = _graph_of(first), _graph_of(second)
    if g1 and g2 and g1 != g2:
        prev = "prev." if first.step < second.step else ""
        later = f"upload {g2[7:]} on {second.stream}" if g2.startswith("upload.") else g2
        help_ = f"order the launches in the step: `{later} after {prev}{g1}`"
    return Diagnostic(
        "R001",
        msg,
        second.span,
        help=help_,
        labels=tuple(labels),
        notes=(f"{second.label or second.kernel} {a2} `{buffer}` on {second.stream}",),
    )
