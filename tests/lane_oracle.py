"""An independent happens-before oracle over lanes, for the tests of the CPU executor and of the
soundness properties: written from the semantics stated in cpu_backend's and validate's
docstrings (CUDA stream and graph semantics), never by calling the code under test.

A lane is a stream, or (stream, unit) inside a capture unit when capture is graphs or step.
`begin U` on h starts U's home lane where h's lane is; U's other lanes start empty; `end U`
puts every task of U before h's later work; a wait adds what the latest earlier record of its
event knew, except across a unit boundary under capture (CUDA refuses such a wait).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from streamsched.interp.ir import Instr, Schedule


def lane_hb(capture: str, plan: Sequence[Instr]) -> dict[int, int]:
    """before[t]: bitset (bit u set) of the tasks that happen before task t, for a plan whose
    unit ids are distinct per launch (an unrolled plan) and whose tasks are launched once."""
    cap = capture != "none"
    know: dict[tuple, int] = defaultdict(int)
    rec: dict[int, tuple[int, int]] = {}
    members: dict[int, int] = defaultdict(int)
    before = {}
    for ins in plan:
        unit = ins.unit if cap else -1
        lane = (ins.stream, -1 if ins.op in ("begin", "end") else unit)
        if ins.op == "begin" and cap:
            know[(ins.stream, unit)] = know[lane]
        elif ins.op == "end" and cap:
            know[lane] |= members[unit]
        elif ins.op == "launch":
            before[ins.task] = know[lane]
            know[lane] |= 1 << ins.task
            members[unit] |= 1 << ins.task
        elif ins.op == "record":
            rec[ins.event] = (know[lane], unit)
        elif ins.op == "wait" and ins.event in rec:
            seen, where = rec[ins.event]
            if not cap or where == unit:
                know[lane] |= seen
    return before


def conflicting_pairs(s: Schedule) -> set[tuple[int, int]]:
    """Task pairs (u, v), u < v, that touch a common byte of one space, at least one writing
    (buffers made by `into` share their target's bytes)."""
    bufs = s.buffer_map()

    def overlap(a, b) -> bool:
        return a.space == b.space and a.nbytes > 0 and b.nbytes > 0 and \
            a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes

    readers: dict[str, set[int]] = defaultdict(set)
    writers: dict[str, set[int]] = defaultdict(set)
    for t in s.tasks:
        for n in t.args:
            readers[n].add(t.id)
        for n in t.outs:
            writers[n].add(t.id)
    used = sorted(set(readers) | set(writers))
    pairs = set()
    for n in used:
        if not writers[n]:
            continue
        for m in used:
            if not overlap(bufs[n], bufs[m]):
                continue
            for w in writers[n]:
                for o in writers[m] | readers[m]:
                    if o != w:
                        pairs.add((min(w, o), max(w, o)))
    return pairs


def unordered(pairs: set[tuple[int, int]], before: dict[int, int]) -> set[tuple[int, int]]:
    """The pairs neither of whose tasks happens before the other."""
    return {(u, v) for u, v in pairs if not (before[v] >> u & 1 or before[u] >> v & 1)}
