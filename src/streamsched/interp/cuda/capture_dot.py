"""The CUDA graphs of a program as captured, read back from the driver and drawn as one DOT file
(`streamsched graph FILE -o out.dot --captured`).

    write_captured_dot(compiled, path)      capture every unit, write one digraph: a cluster per
                                            captured graph, nodes labelled with their tasks
    graph_structure(graph)                  (node handles, node types, edges as handle pairs)
    reachable(edges, sources)               nodes reachable from `sources` along `edges`

Nodes are labelled from the capture-time map the executor keeps (`CapturedUnit.node_task`:
which task's launch created each node) and coloured by the task's stream; edges are the
graph's own dependencies (cudaGraphGetEdges), so a fork shows as branches with no path between
them.  Needs the CUDA backend (CuPy, cuda-python, nvmath-python and a GPU).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable

from streamsched.interp.cuda.device import graph_structure

__all__ = ["write_captured_dot", "captured_program_dot", "graph_structure", "reachable"]

# one colour per stream, in declaration order (the colours of draw.py's lanes, roughly)
_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
            "#ff9da7", "#9c755f", "#bab0ac")


def reachable(edges: Iterable[tuple[int, int]], sources: Iterable[int]) -> set[int]:
    """Every node reachable from `sources` (included) along the directed `edges`."""
    succ: dict[int, list[int]] = {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
    seen = set(sources)
    todo = deque(seen)
    while todo:
        n = todo.popleft()
        for m in succ.get(n, ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def captured_program_dot(executor: Any) -> str:
    """The DOT text of every graph `executor` (a CudaExecutor that captured its units) holds:
    one cluster per captured graph, one node per graph node, labelled with the task that
    created it, coloured by that task's stream."""
    sched = executor.schedule
    streams = [s for s in sched.streams if s != "host"]
    for t in sched.tasks:
        if t.stream != "host" and t.stream not in streams:
            streams.append(t.stream)
    colour = {s: _PALETTE[i % len(_PALETTE)] for i, s in enumerate(streams)}
    units = {u.id: u for u in sched.units}
    out = ["digraph captured {", "  rankdir=TB;", "  compound=true;",
           '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
           '  edge [color="#555555"];']
    # a legend: one node per stream
    out.append('  subgraph cluster_legend { label="streams"; fontname="Helvetica";')
    for s in streams:
        out.append(f"    legend_{len(out)} [label={_q(s)}, fillcolor={_q(colour[s])}];")
    out.append("  }")
    for gi, cu in enumerate(executor.graphs.values()):
        handles, types, edges = graph_structure(cu.graph)
        names = []
        for uid in cu.units:
            u = units.get(uid)
            names.append(f"{u.name}" if u is not None else f"unit {uid}")
        title = f"graph {gi}: {', '.join(dict.fromkeys(names))} on {cu.home}"
        title += f" ({len(handles)} nodes, {len(edges)} edges; units {', '.join(map(str, cu.units))})"
        if cu.pre_waits:
            title += f"\\nwaits before launch: events {', '.join(map(str, cu.pre_waits))}"
        out.append(f"  subgraph cluster_g{gi} {{")
        out.append(f"    label={_q(title)}; fontname=\"Helvetica\"; style=rounded;")
        ids = {h: f"g{gi}_n{i}" for i, h in enumerate(handles)}
        for h, ty in zip(handles, types):
            tid = cu.node_task.get(h)
            if tid is None:
                for t_id, ends in cu.task_nodes.items():
                    if h in ends:
                        tid = t_id
                        break
            if tid is not None and 0 <= tid < len(sched.tasks):
                t = sched.tasks[tid]
                label = f"{t.label or t.kernel}\n{t.kernel} on {t.stream}"
                if ty != "Kernel":
                    label += f" [{ty}]"
                fill = colour.get(t.stream, "#dddddd")
            else:
                label, fill = ty, "#dddddd"
            out.append(f"    {ids[h]} [label={_q(label)}, fillcolor={_q(fill)}];")
        for a, b in edges:
            if a in ids and b in ids:
                out.append(f"    {ids[a]} -> {ids[b]};")
        out.append("  }")
    out.append("}")
    return "\n".join(out) + "\n"


def write_captured_dot(compiled, path: str, *, capture: str | None = None) -> str:
    """Build a CudaExecutor for `compiled` (its capture mode; `graphs` when it says `none`, or
    `capture`), capture its units, and write every captured graph into one DOT file at `path`.
    Returns the DOT text."""
    from streamsched.interp.cuda.executor import CudaExecutor

    mode = capture or compiled.schedule.capture or "none"
    if mode == "none":
        mode = "graphs"
    ex = CudaExecutor(compiled.schedule, compiled.plan, capture=mode)
    try:
        text = captured_program_dot(ex)
    finally:
        ex.close()
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text
