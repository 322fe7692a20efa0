"""Pictures of an EventPlan: `plan_to_dot` gives Graphviz text with one lane (cluster) per
stream, its launches (and graph begin/end) in issue order joined by program-order edges, and
one dashed edge per wait, from the work the bound record follows to the work the wait precedes;
`write_graph` writes .dot always, and .svg/.png/.pdf through Graphviz's `dot` when it is on PATH,
else through matplotlib (optional), else it raises."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import defaultdict

from streamsched.interp.ir import EventPlan, Instr

_NODE_OPS = ("launch", "begin", "end")


def _label(plan: EventPlan, ins: Instr) -> str:
    s = plan.schedule
    if ins.op == "launch":
        t = s.tasks[ins.task]
        text = f"t{t.id} {t.kernel}"
        if t.label:
            text += "\n" + t.label
        if t.span is not None:
            text += f"\n{os.path.basename(t.span.file)}:{t.span.line}"
        return text
    units = s.units
    name = units[ins.unit].name if 0 <= ins.unit < len(units) else f"U{ins.unit}"
    return f"{ins.op} {name}"


def _wait_edges(plan: EventPlan) -> list[tuple[int, int, int]]:
    """(from instr, to instr, event) per wait: the node before its bound record on the record's
    stream, and the node after the wait on the wait's stream (both launch/begin/end)."""
    last_node: dict[str, int] = {}
    bound: dict[int, int | None] = {}  # event -> node the latest record follows
    pending: dict[str, list[tuple[int | None, int]]] = defaultdict(list)
    out = []
    for i, ins in enumerate(plan.instrs):
        if ins.op == "record":
            bound[ins.event] = last_node.get(ins.stream)
        elif ins.op == "wait":
            pending[ins.stream].append((bound.get(ins.event), ins.event))
        elif ins.op in _NODE_OPS:
            for src, ev in pending.pop(ins.stream, ()):
                if src is not None:
                    out.append((src, i, ev))
            last_node[ins.stream] = i
    return out


def plan_to_dot(plan: EventPlan) -> str:
    """Graphviz text of `plan` (deterministic): node `n<i>` is instruction i (a launch, begin or
    end); a cluster per stream in declared order; solid edges for program order, dashed red
    edges labelled `e<event>` for waits."""
    s = plan.schedule
    streams = list(s.streams) + sorted({i.stream for i in plan.instrs} - set(s.streams))
    lines = ["digraph plan {", "  rankdir=TB;", '  node [shape=box, fontsize=10, fontname="monospace"];',
             f'  label="policy {plan.policy}, capture {s.capture}"; labelloc=t;']
    for k, st in enumerate(streams):
        nodes = [i for i, ins in enumerate(plan.instrs) if ins.stream == st and ins.op in _NODE_OPS]
        if not nodes:
            continue
        lines.append(f"  subgraph cluster_{k} {{")
        lines.append(f'    label="{st}"; style=rounded; color=gray;')
        for i in nodes:
            ins = plan.instrs[i]
            shape = ', shape=ellipse' if ins.op != "launch" else ""
            text = _label(plan, ins).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            lines.append(f'    n{i} [label="{text}"{shape}];')
        for a, b in zip(nodes, nodes[1:]):
            lines.append(f"    n{a} -> n{b};")
        lines.append("  }")
    for a, b, ev in _wait_edges(plan):
        lines.append(f'  n{a} -> n{b} [style=dashed, color=red, fontcolor=red, label="e{ev}", constraint=false];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _draw_matplotlib(plan: EventPlan, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = plan.schedule
    streams = [st for st in list(s.streams) + sorted({i.stream for i in plan.instrs} - set(s.streams))
               if any(i.stream == st and i.op in _NODE_OPS for i in plan.instrs)]
    col = {st: k for k, st in enumerate(streams)}
    nodes = [i for i, ins in enumerate(plan.instrs) if ins.op in _NODE_OPS]
    row = {i: r for r, i in enumerate(nodes)}
    fig, ax = plt.subplots(figsize=(2.6 * max(1, len(streams)), 0.32 * max(4, len(nodes)) + 1))
    for st, k in col.items():
        ax.text(k, 1, st, ha="center", va="bottom", fontsize=9, weight="bold")
    prev: dict[str, int] = {}
    for i in nodes:
        ins = plan.instrs[i]
        x, y = col[ins.stream], -row[i]
        text = _label(plan, ins).split("\n")[0]
        ax.text(x, y, text, ha="center", va="center", fontsize=6,
                bbox={"boxstyle": "round", "fc": "white" if ins.op == "launch" else "#eee", "lw": 0.5})
        if ins.stream in prev:
            ax.plot([x, x], [-row[prev[ins.stream]], y], color="gray", lw=0.5, zorder=0)
        prev[ins.stream] = i
    for a, b, ev in _wait_edges(plan):
        xa, ya = col[plan.instrs[a].stream], -row[a]
        xb, yb = col[plan.instrs[b].stream], -row[b]
        ax.annotate("", xy=(xb, yb), xytext=(xa, ya),
                    arrowprops={"arrowstyle": "->", "color": "red", "lw": 0.6, "ls": "--",
                                # curved, so a wait never looks like it passes through a node
                                "connectionstyle": "arc3,rad=0.15", "shrinkA": 8, "shrinkB": 8})
    ax.set_xlim(-0.7, len(streams) - 0.3)
    ax.set_ylim(-len(nodes), 1.6)
    ax.axis("off")
    ax.set_title(f"policy {plan.policy}, capture {s.capture}", fontsize=9)
    fig.savefig(path, bbox_inches="tight", dpi=150)
    plt.close(fig)


def write_graph(plan: EventPlan, path: str) -> str:
    """Write `plan` to `path` by its suffix: .dot (Graphviz text), or .svg/.png/.pdf rendered by
    the `dot` binary when installed, else drawn with matplotlib.  Returns the renderer used
    ("text", "dot" or "matplotlib").  Raises ValueError for another suffix and RuntimeError when
    a picture is asked for and neither Graphviz nor matplotlib is available (or dot fails)."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    text = plan_to_dot(plan)
    if ext in ("dot", "gv"):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return "text"
    if ext not in ("svg", "png", "pdf"):
        raise ValueError(f"cannot write a graph as .{ext}: use .dot, .svg, .png or .pdf")
    dot = shutil.which("dot")
    if dot is not None:
        proc = subprocess.run([dot, f"-T{ext}", "-o", path], input=text.encode(), capture_output=True)
        if proc.returncode != 0:
            raise RuntimeError(f"dot failed ({proc.returncode}): {proc.stderr.decode(errors='replace').strip()}")
        return "dot"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError(
            f"writing .{ext} needs Graphviz (`dot` on PATH) or matplotlib (pip install 'streamsched[plot]'); "
            "or write a .dot file instead"
        ) from None
    _draw_matplotlib(plan, path)
    return "matplotlib"
