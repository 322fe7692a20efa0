"""The one way a race is reported, shared by the static checker and the CPU backend's run-time
detector, so both name the same buffer, tasks, streams and source lines, and suggest the same
fix: an `after` clause written where it is valid (LANGUAGE.md, "Barrier policies"):

    same op call, two statements of a user op body   -> `after STMT` on the later statement
    two model lines of one forward                    -> `after VALUE` on the later model line
    two statements of one graph body                  -> `after NAME` on the later call statement
    two step statements (or one in consecutive steps) -> `after [prev.]G` on the later statement

Derived backward work is ordered for the user by its own hazards, so a race never needs an
`after` on it; where no statement can take the clause (inside a stdlib op, a `forward` line),
the help says so instead of suggesting syntax that would not parse or would name nothing.
"""

from __future__ import annotations

from streamsched.diagnostics import Diagnostic, Fix, Label
from streamsched.interp.fixes import insert_after
from streamsched.interp.ir import Schedule, Site, Task


def _access(task: Task, buffer: str) -> str:
    if buffer in task.writes:
        return "writes"
    return "reads"


def suggest_order(schedule: Schedule, first: Task, second: Task) -> tuple[str, tuple[Fix, ...], tuple[Label, ...]]:
    """(help, fixes, labels) ordering `second` after `first` (issued earlier) where an `after`
    can be written: the innermost scope both belong to (module docstring).  The fixes are empty
    when no statement can take the clause; the help then says what can be done instead."""
    s1, s2 = first.site or Site(), second.site or Site()
    same_launch = first.launch == second.launch and first.step == second.step
    # 1. two statements of one call of a user op
    if (same_launch and first.op == second.op and first.op >= 0 and s1.op and s2.op and s2.op_tail is not None
            and s1.op != s2.op):
        return (f"add `after {s1.op}` to the statement `{s2.op}` (the op body's order: `{s2.op} = ... after {s1.op}`)",
                (insert_after(s2.op_tail, s1.op),), ())
    # 2. two lines of the model's forward (or of one block inlined into it: the `after` goes on
    #    the later line in the innermost scope both share, naming the earlier one there)
    if (same_launch and s1.gstmt == s2.gstmt and s1.line and s2.line and not s1.derived and not s2.derived
            and s2.line_tail is not None):
        p1 = s1.line_path or (("", s1.line, s1.line_tail),)
        p2 = s2.line_path or (("", s2.line, s2.line_tail),)
        for e1, e2 in zip(p1, p2):
            (sc1, r1), (sc2, r2, tail2) = e1[:2], e2[:3]
            if sc1 != sc2:
                # different instances: the later one's statement reads what the earlier one's
                # output line made, as one of the block's inputs: `after INPUT` orders it so
                fed = dict(e2[3]) if len(e2) > 3 else {}
                if s1.line in fed and tail2 is not None and not any(len(e) > 3 and e[0] == sc1 for e in p2):
                    inp = fed[s1.line]
                    return (f"add `after {inp}` to the line of the block inlined as `{sc2}`, `{r2} = ...` "
                            f"(its input `{inp}` is `{s1.line}` there: the line that made it runs first)",
                            (insert_after(tail2, inp),), ())
                break
            if r1 != r2:
                if tail2 is None:
                    break
                where = "the model line" if not sc2 else f"the line of the block inlined as `{sc2}`"
                return (f"add `after {r1}` to {where} `{r2} = ...`", (insert_after(tail2, r1),), ())
        if s1.line != s2.line:
            return (f"the two accesses are in different instances of a block (`{s1.line}`, `{s2.line}`): "
                    "no `after` in the file orders only them; use `barriers auto`", (), ())
        if not s2.op:
            return (f"both accesses are inside one call of a stdlib op (`{s2.line} = ...`), which orders its own work "
                    "under every policy: this is a bug in streamsched; `barriers auto` avoids it", (), ())
    # 3. two statements of one graph body
    if same_launch and s1.gstmt != s2.gstmt and s1.gstmt >= 0 and s2.gstmt >= 0:
        if s2.gtail is not None and s1.gname:
            return (f"add `after {s1.gname}` to the graph statement `{s2.gname}(...)`",
                    (insert_after(s2.gtail, s1.gname),), ())
        return (f"the graph statement `{s2.gname or 'this one'}` takes no `after`: launch `{s1.gname}` and "
                f"`{s2.gname}` from separate graphs and order the launches in the step, or use `barriers auto`",
                (), ())
    # 4. two step statements
    launches = schedule.launches
    if 0 <= first.launch < len(launches) and 0 <= second.launch < len(launches) and not same_launch:
        l1, l2 = launches[first.launch], launches[second.launch]
        prev = "prev." if first.step < second.step else ""
        if l1.ref and l1.kind != "sync" and l2.tail is not None:
            ref = f"{prev}{l1.ref}"
            labels = (Label(l2.span, f"add `after {ref}` here"),) if l2.span is not None else ()
            far = (" (the two are more than one step apart: order them through the launches between)"
                   if first.step >= 0 and second.step - first.step > 1 else "")
            written = [("prev." if a.prev else "") + a.graph for a in l2.after]
            return (f"order the launches in the step: `{l2.text} after {', '.join(written + [ref])}`{far}",
                    (insert_after(l2.tail, ref),), labels)
    if first.stmt and first.site is None and second.site is None:
        # a schedule built through the API, with no source to edit: name the clause only
        return f"add `after {first.stmt}` to the later statement", (), ()
    return (f"order `{second.label or second.kernel}` after `{first.label or first.kernel}` (no statement of the "
            "file can take that `after`; `barriers auto` orders it)"), (), ()


def race_diagnostic(schedule: Schedule, first: Task, second: Task, buffer: str) -> Diagnostic:
    """R001: `first` (issued earlier) and `second` touch overlapping bytes of `buffer`, at least
    one writes, they run on different streams and no happens-before path orders them.
    The primary span is the later task; the help (and its fix) orders it after the first where
    an `after` is valid (`suggest_order`); for two launches a label marks the step statement."""
    a1, a2 = _access(first, buffer), _access(second, buffer)
    kind = {("writes", "reads"): "RAW", ("reads", "writes"): "WAR", ("writes", "writes"): "WAW"}[(a1, a2)]
    labels = []
    if first.span is not None:
        labels.append(Label(first.span, f"{a1} `{buffer}` on {first.stream} ({first.label or first.kernel})"))
    msg = (
        f"race on buffer `{buffer}` ({kind}): `{second.label or second.kernel}` on {second.stream} "
        f"is not ordered after `{first.label or first.kernel}` on {first.stream}"
    )
    help_, fixes, more = suggest_order(schedule, first, second)
    labels.extend(more)
    return Diagnostic(
        "R001",
        msg,
        second.span,
        help=help_,
        labels=tuple(labels),
        notes=(f"{second.label or second.kernel} {a2} `{buffer}` on {second.stream}",),
        fixes=fixes,
    )
