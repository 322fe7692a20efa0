"""Required edges of a schedule: `dependencies(schedule)` returns every RAW, WAR and WAW edge
between tasks whose accesses overlap in bytes, plus the `after` edges, in near-linear time.

Conflicts are decided on bytes, not names (ARCHITECTURE.md, "plan_memory"): each space's planned
byte ranges are cut into elementary *segments* at every buffer boundary, so a buffer is a run of
segments and two buffers conflict exactly when they share one.  Per segment we keep the last
writer and the readers since it (the classic scoreboard), which yields a set of edges whose
transitive closure orders every conflicting pair, without looking at all O(n^2) pairs.

    access   = (segment, read_name, write_name)     names "" when the task does not read/write
    Edge     = (u, v, kind, buffer)                 u.id < v.id, kind RAW | WAR | WAW | AFTER
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict

from streamsched.diagnostics import InternalError
from streamsched.interp.ir import Buffer, Edge, Schedule

Access = tuple[int, str, str]
"""(segment, name read, name written) of one task; a name is "" when that access is absent."""

KIND_ORDER = {"RAW": 0, "WAR": 1, "WAW": 2, "AFTER": 3}


def alias_roots(schedule: Schedule) -> dict[str, str]:
    """Buffer name -> the name at the end of its `alias_of` chain (itself when it aliases
    nothing).  A broken or cyclic chain stops at the last buffer it reached.  Computed once per
    buffer table (a schedule and its fused form share one); callers must not mutate the returned
    dict."""
    return _cached("roots", schedule.buffers, lambda _: _alias_roots(schedule))


def _alias_roots(schedule: Schedule) -> dict[str, str]:
    bufs = schedule.buffer_map()
    roots: dict[str, str] = {}
    for b in schedule.buffers:
        cur, seen = b, {b.name}
        while cur.alias_of and cur.alias_of in bufs and cur.alias_of not in seen:
            seen.add(cur.alias_of)
            cur = bufs[cur.alias_of]
        roots[b.name] = cur.name
    return roots


def _extent(b: Buffer, bufs: dict[str, Buffer]) -> tuple[str, int, int] | tuple[str, str] | None:
    """Where `b` lives: (space, lo, hi) for a planned range, ("name", root) for a buffer whose
    memory is not planned yet (it conflicts with itself and its aliases only), None for a planned
    empty buffer (no bytes, no conflicts: Buffer.overlaps)."""
    cur, seen = b, {b.name}
    while True:
        if cur.offset >= 0:
            if cur.nbytes <= 0:
                return None
            return (cur.space, cur.offset, cur.offset + cur.nbytes)
        # An `into` alias may be listed before plan_memory copied its root's range to it.
        if cur.alias_of and cur.alias_of in bufs and cur.alias_of not in seen:
            seen.add(cur.alias_of)
            cur = bufs[cur.alias_of]
            continue
        return ("name", cur.name)


def storage_segments(schedule: Schedule) -> dict[str, tuple[int, ...]]:
    """Buffer name -> ids of the elementary storage segments it covers (`_storage_segments`);
    computed once per buffer table (a schedule and its fused form share one).  Callers must not
    mutate the returned dict."""
    return _cached("segments", schedule.buffers, lambda _: _storage_segments(schedule))


def _storage_segments(schedule: Schedule) -> dict[str, tuple[int, ...]]:
    """Buffer name -> ids of the elementary storage segments it covers.

    Two buffers share a segment iff `Buffer.overlaps` says they overlap (same space, intersecting
    byte ranges); aliases made by `into` share their root's range.  Unplanned buffers (offset -1)
    fall back to identity of their alias root.  Names a task uses that no Buffer declares get a
    segment of their own, keyed by name (see `task_accesses`)."""
    bufs = schedule.buffer_map()
    extents = {b.name: _extent(b, bufs) for b in schedule.buffers}
    bounds: dict[str, set[int]] = defaultdict(set)
    for ext in extents.values():
        if ext is not None and len(ext) == 3:
            bounds[ext[0]].update((ext[1], ext[2]))
    # Segment ids: spaces in sorted order, each space's cut points in ascending order.
    base: dict[str, int] = {}
    cuts: dict[str, list[int]] = {}
    nxt = 0
    for space in sorted(bounds):
        cuts[space] = sorted(bounds[space])
        base[space] = nxt
        nxt += len(cuts[space]) - 1
    named: dict[str, int] = {}
    out: dict[str, tuple[int, ...]] = {}
    for b in schedule.buffers:
        ext = extents[b.name]
        if ext is None:
            out[b.name] = ()
        elif len(ext) == 2:
            if ext[1] not in named:
                named[ext[1]] = nxt
                nxt += 1
            out[b.name] = (named[ext[1]],)
        else:
            space, lo, hi = ext
            c = cuts[space]
            i, j = bisect_left(c, lo), bisect_left(c, hi)
            out[b.name] = tuple(range(base[space] + i, base[space] + j))
    return out


_CACHE: dict[tuple[str, int], tuple[object, object]] = {}


def _cached(kind: str, key: object, make):
    """`make(key)`, computed once per key object, a schedule or its buffer table (every pass
    after unroll asks for the same segments and accesses; both are frozen, so the answer never
    changes).  Keyed by identity, with the key kept alive beside its answer; the cache holds the
    last few."""
    k = (kind, id(key))
    hit = _CACHE.get(k)
    if hit is not None and hit[0] is key:
        return hit[1]
    value = make(key)
    if len(_CACHE) > 16:
        _CACHE.clear()
    _CACHE[k] = (key, value)
    return value


def task_accesses(schedule: Schedule) -> tuple[tuple[Access, ...], ...]:
    """Per task (indexed by task id): its accesses sorted by segment, one per segment, with the
    first name it reads and the first name it writes there ("" for none)."""
    return _cached("accesses", schedule, _task_accesses)


def _task_accesses(schedule: Schedule) -> tuple[tuple[Access, ...], ...]:
    segs = storage_segments(schedule)
    extra: dict[str, tuple[int, ...]] = {}
    nxt = 1 + max((s for t in segs.values() for s in t), default=-1)

    def seg_of(name: str) -> tuple[int, ...]:
        nonlocal nxt
        if name in segs:
            return segs[name]
        if name not in extra:  # undeclared name: conflicts with itself only
            extra[name] = (nxt,)
            nxt += 1
        return extra[name]

    out = []
    # Tasks of one template in different steps of a slot share their names (unroll): their
    # accesses are equal, computed once and shared.
    known: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[Access, ...]] = {}
    for t in schedule.tasks:
        same = known.get((t.args, t.outs))
        if same is not None:
            out.append(same)
            continue
        acc: dict[int, list[str]] = {}
        for name in t.reads:
            for s in seg_of(name):
                slot = acc.setdefault(s, ["", ""])
                slot[0] = slot[0] or name
        for name in t.writes:
            for s in seg_of(name):
                slot = acc.setdefault(s, ["", ""])
                slot[1] = slot[1] or name
        known[(t.args, t.outs)] = mine = tuple((s, r, w) for s, (r, w) in sorted(acc.items()))
        out.append(mine)
    return tuple(out)


def report_name(earlier: str, later: str, roots: dict[str, str]) -> str:
    """The buffer name to print for a conflict between two accesses: the shared name, else the
    alias root both views belong to (`dx into x` conflicts are reported on `x`), else the name
    the later task uses."""
    if earlier == later:
        return later
    r1, r2 = roots.get(earlier, earlier), roots.get(later, later)
    if r1 == r2:
        return r1
    return later


def _check_ids(schedule: Schedule) -> None:
    n = len(schedule.tasks)
    for i, t in enumerate(schedule.tasks):
        if t.id != i:
            raise InternalError(f"dependencies: task at index {i} has id {t.id} (resolve must number tasks in issue order)")
        for a in t.after:
            if not 0 <= a < n:
                raise InternalError(f"dependencies: task {t.id} is ordered after task {a}, which does not exist")


def dependencies(schedule: Schedule) -> tuple[Edge, ...]:
    """Required edges u -> v (u.id < v.id) of `schedule`, sorted by (v, u, kind, buffer).

    RAW: v reads bytes whose last writer is u.  WAW: v writes bytes whose last writer is u.
    WAR: v writes bytes u read since their last write.  AFTER: u in v.after with u < v (an
    `after` naming a later task is a cycle: `validate_schedule` reports it, R002, and it yields no
    edge here).  Same-stream edges are included; barrier insertion skips them as covered by stream
    order.  The closure of these edges orders every pair of conflicting accesses (each later
    writer of a segment follows the previous one by WAW), which is what barrier insertion needs.

    Cost: O(sum of segments per access + edges).  Raises InternalError (never a user mistake) if
    task ids are not 0..n-1 in issue order or an `after` names a task that does not exist.
    """
    _check_ids(schedule)
    roots = alias_roots(schedule)
    acc = task_accesses(schedule)
    n_segs = 1 + max((a[-1][0] for a in acc if a), default=-1)  # (a task's accesses are sorted by segment)
    last_w: list[tuple[int, str] | None] = [None] * n_segs  # per segment: its last writer and the name it wrote
    readers: list[list[tuple[int, str]] | None] = [None] * n_segs  # per segment: the readers since
    out: list[Edge] = []
    kinds = _KINDS
    # Every edge into v is found while v is processed, so duplicates (a buffer of several
    # segments) are merged and the edges sorted per v: no table of all edges is ever held.
    for t in schedule.tasks:
        v = t.id
        mine: dict[tuple[int, int, str], None] = {}  # (u, kind order, buffer)
        for seg, rname, wname in acc[v]:
            w = last_w[seg]
            if w is not None and w[0] == v:
                w = None
            if rname and w is not None:
                wn = w[1]
                mine[(w[0], 0, rname if wn == rname else report_name(wn, rname, roots))] = None
            if wname:
                if w is not None:
                    wn = w[1]
                    mine[(w[0], 2, wname if wn == wname else report_name(wn, wname, roots))] = None
                rs = readers[seg]
                if rs:
                    for r, rn in rs:
                        if r != v:
                            mine[(r, 1, wname if rn == wname else report_name(rn, wname, roots))] = None
                last_w[seg] = (v, wname)
                readers[seg] = None
            else:
                lst = readers[seg]
                if lst is None:
                    readers[seg] = [(v, rname)]
                elif lst[-1][0] != v:
                    lst.append((v, rname))
        for a in t.after:
            if a < v:
                mine[(a, 3, "")] = None
        if mine:
            out.extend([Edge(u, v, kinds[k], buf) for u, k, buf in sorted(mine)])
    return tuple(out)


_KINDS = tuple(sorted(KIND_ORDER, key=KIND_ORDER.__getitem__))


def conflicting_pairs(schedule: Schedule) -> tuple[tuple[int, int, str], ...]:
    """Every pair (u, v, buffer), u < v, of tasks on different streams whose accesses overlap in
    bytes with at least one write, sorted; buffer as `report_name` picks it.

    Exact and simple, O(sum over segments of accesses^2): meant for small schedules and tests.
    The race check in `validate_plan` does not use it (it enumerates only unordered pairs)."""
    roots = alias_roots(schedule)
    acc = task_accesses(schedule)
    per_seg: dict[int, list[tuple[int, bool, str]]] = defaultdict(list)
    for t in schedule.tasks:
        for seg, rname, wname in acc[t.id]:
            per_seg[seg].append((t.id, bool(wname), wname or rname))
    tasks = schedule.tasks
    out: dict[tuple[int, int], str] = {}
    for seg in sorted(per_seg):
        lst = per_seg[seg]
        for i, (u, wu, nu) in enumerate(lst):
            for v, wv, nv in lst[i + 1:]:
                if (wu or wv) and tasks[u].stream != tasks[v].stream and (u, v) not in out:
                    out[(u, v)] = report_name(nu, nv, roots)
    return tuple((u, v, b) for (u, v), b in sorted(out.items()))
