"""The fusion pass: a task-level rewrite of an unrolled Schedule, before dependency analysis, that
turns each run of per-parameter tasks of one kernel (an optimizer call's updates, `clear
grad(m)`'s fills, the inf/NaN checks) on one stream into one `multi_tensor` task, so the checker
proves the plan that runs (a fused task reads and writes the union of what its parts do).

Which tasks fuse (the general rule, for any file): a maximal run of tasks *adjacent in issue
order* (no task of any stream between them), of one kernel of `multi_tensor.FUSIBLE` taken from
the stdlib (not a user kernel of the same name), on one device stream, in one capture unit, step
and step statement, with equal attributes (fill: equal value; its shape and dtype are per part),
the same shared device scalars (lr, t, scale, found_inf), and per-parameter tensors that share no
byte with another part's.  Adjacency makes the rewrite safe: every edge goes forward in issue
order, so no path can leave the run and come back into it, and merging it cannot make a cycle;
disjointness makes the parts' order inside the launch immaterial.

Pairs: a `softmax_xent(logits, labels) -> loss` task followed at once (adjacent, one stream, unit,
step and launch) by `softmax_xent_grad(dloss, logits, labels) -> dlogits` on the same logits and
labels becomes one `softmax_xent_fused(logits, labels, dloss) -> (loss, dlogits)` task, when dloss
shares no byte with the loss (the gradient's seed is not the value the first task writes) and
dlogits none with logits, labels or the loss.

GEMM epilogues: `matmul(x, w) -> t` (no transposes), `add(t, b) -> h` (b a vector of w's columns)
and `relu(h) -> y` or `gelu(h) -> y`, adjacent in issue order in one unit, step and launch, become
one `gemm_bias_relu(x, w, b) -> y` / `gemm_bias_gelu(x, w, b) -> (h, y)` task on the GEMM's stream
(with no such activation next, the matmul and the add become `gemm_bias(x, w, b) -> h`: cuBLASLt's
BIAS epilogue, the transformer's projections),
when no other task reads t (nor, for relu, h: the RELU_BIAS epilogue never writes it; gelu's
backward reads h, which GELU_AUX_BIAS writes as its auxiliary output) or any buffer sharing
their bytes, and neither is a value a run returns and saves (a buffer of a kind other than act
and temp, or sharing a byte with one: `_kept`; the backward epilogues and gated products alike);
under `barriers = explicit` only when all three are on one stream (the user orders the streams
there: fusing across them would hide a missing `after`).  The seed's runtime does the
same with its region-level batched updates on the update stream.

Backward epilogues: a linear's input-gradient GEMM `matmul(dz, w) -> dy` (either transpose flag),
followed at once by `gelu_grad(dy, pre) -> dpre` or `relu_grad(dy, y) -> dpre`, and the bias
gradient `sum(dpre, axis=0) -> db` (the first sum of dpre after them, in the same unit, step and
launch) become one `gemm_dgelu_bgrad(dz, w, pre) -> (dpre, db)` / `gemm_drelu_bgrad(dz, w, y,
mask) -> (dpre, db)` task at the GEMM's place, on its stream (cuBLASLt's DGELU_BGRAD /
DRELU_BGRAD), when no other task reads dy or a buffer sharing its bytes (the same fixed point
as above), dpre and db share no byte with dz, w, the aux or each other, under `barriers =
explicit` only when all three are on one stream, and never moving a gradient the user placed on
its stream.  The linear backward forks dW, dB and dX, so the sum comes after the dW GEMM that
also reads dpre: it is moved up to the fused task over the tasks between, which is the same
program exactly when none of them writes a byte of dpre or db or reads a byte of db and the sum
has no `after` on one of them (both required); two fused spans never interleave, so each move
is checked against the tasks it really passes.  The gelu aux is the pre-activation, a buffer
the forward keeps anyway.  DRELU_BGRAD needs a bitmask of y > 0, which no task writes: the pass
fuses a relu backward only when every task writing a byte of y is a fused forward
`gemm_bias_relu(x, w, b) -> y`, makes each of them `gemm_bias_relu_aux(x, w, b) -> (y, mask)`
(RELU_AUX_BIAS) and adds the mask to the schedule's buffers (u8 [m, ceil(n/128)*16], a fresh
byte range after the device arena's end), so the mask is rewritten exactly when y is, and the
checker sees it written by the forward and read by the backward like any tensor (its RAW and
WAR orders are y's own).  Accesses stay the union of the parts' (plus the mask): the checker
proves the fused plan.

Gated products: what the backward epilogues leave of `matmul(dz, w) -> dy` (either transpose
flag) followed at once (adjacent in issue order, one unit, step and launch) by `relu_grad(dy, y)
-> dpre` becomes one `gemm_relu_grad(dz, w, y) -> dpre` task at the GEMM's place, on its stream
(on the device, the skinny product applies the relu gate before it stores: the classifier's
input gradient, k = the class count, then costs one memory-bound launch instead of two), when no
other task reads dy or a buffer sharing its bytes, dpre shares no byte with dz, w, y or dy
and y none with dy, under `barriers = explicit` only when both are on one stream, and never
moving a relu_grad the user placed on another stream.  "No other task reads dy" is exact about
storage: a task after the pair that reads a byte of dy (a buffer `into` dy's storage, say) keeps
the pair apart unless a task between them overwrites all of dy's bytes first.  The fused task
reads and writes the union of its parts' buffers but dy, which nothing reads any more and nothing
writes.  With the backward epilogues on (an experiment, off by default), a pair whose product is
not skinny (k > 32) and whose y is written by fused forward relu GEMMs only becomes
`gemm_drelu(dz, w, y, mask) -> dpre` instead (cuBLASLt's DRELU on the forward's relu bitmask,
made exactly as for the backward epilogues above).

Batch norm epilogues: `batchnorm_train(x, gamma, beta) -> (y, mean, invstd)` whose y is next
touched (issue order, storage segments) by `relu(y) -> r` becomes `batchnorm_train_relu(x,
gamma, beta) -> (r, mean, invstd)`; by `add(y, z) -> s` (either order) whose sum is next touched
by `relu(s) -> r`, `batchnorm_train_add_relu(x, gamma, beta, z) -> (r, mean, invstd)` (the
residual block's end).  `relu_grad(dy, g) -> d` whose d is next touched by `batchnorm_grad(d, x,
gamma, mean, invstd)` as its dy becomes `batchnorm_grad_relu(dy, g, x, gamma, mean, invstd)`.
Each when: the parts are in one unit, step, slot and launch, on device streams; no task after
the reader touches an intermediate (y, s, d) before it is overwritten whole (`_dead_after`), and
none is a value the run returns or saves (`_kept`); the fused outputs share no byte with its
inputs; the batch norm is not synchronized (`sync = true`: a collective); the moved parts pass
the tasks between them exactly as `_passes` requires (no RAW, WAR or WAW on a storage segment,
no `after` between them, no host task); a part on another stream is not one the user placed
there (`on`, `place`), and under `barriers = explicit` all parts are on one stream.  The forward
task sits at the batch norm's place and stream, the backward at the gradient's.  The batch
norm's statistics update (`batchnorm_stats_update`, on the update stream) sits between a batch
norm and its relu in issue order and reads only mean and invstd: the relu moves up past it.
Values are bitwise the unfused tasks' (the NumPy twins run the parts in order; the CUDA kernels
round y to its dtype before the add and the relu, as the separate kernels do).  On the H100 the
resnet_digits step went from 160.6 to 152.2 us (six launches fewer, 2026-12-05).
`STREAMSCHED_BN_EPILOGUES=0` turns this off.

Updates in two launches: a run of one optimizer's updates (SGD, Adam, ...) fuses into at most two
launches, in place of the run, on its stream: the parts whose gradients are ready early first,
then the rest, when that is estimated to end the run sooner by more than one launch's cost.  The
estimate is interp/priority.py's roofline (each task's cost; a task starts when its stream is free
and the last writers of what it reads have finished); a part's readiness is that of its inputs.
This is the backward of a layer stack: the first layer's weight gradient comes last, and the
other layers' updates can run beside its GEMM instead of after it.  The parts of a run are
adjacent in issue order and share no byte, so any order of them is the same program; a run whose
parts name each other in `after` stays one launch, and the same work in every unrolled step
(equal keys, but for the slot) is split alike.  Where every update waits for one shared input
(AMP's found_inf, a clipping scale) nothing is gained and the run stays one launch.  Only under `barriers = auto`
(under `chain` and `explicit` the plan is the file's, orders and all).
`STREAMSCHED_SPLIT_UPDATES=0` turns this off.

Heavy products in turn: a product of at least HEAVY_FLOPS (a GEMM, a convolution's, attention's)
fills the device by itself, so two of them side by side gain nothing (on the H200, the batch-2048
MLP's dX2 and dW2 took 180 and 173 us together against 99 and 88 alone), and they can lose much:
a single-wave GEMM whose blocks start while another one holds the SMs shares half of them to its
end (the same dX2 took 221-266 us when dW2's blocks started first).  Each heavy product is
therefore ordered after the heavy product issued before it in the same unit, step and launch
(an `after` added to it when they are on two streams), so they run one at a time in issue order.
This adds orders only: the program's values are unchanged, and nothing else waits.  Only under
`barriers = auto` and without collectives: an added order could otherwise hide a race the file
leaves (R001 under `chain` and `explicit`) or order two all-reduces the file leaves unordered
(R008), and fusion must not change a diagnostic.
`STREAMSCHED_HEAVY_IN_TURN=0` turns it off.

Critical path first: before they are put in turn, a heavy product is issued ahead of the heavy
product before it (same unit, step and launch) when more work of its step waits on it: its
upward rank, its estimated cost (interp/priority.py's roofline) plus the largest rank of a task
of the same unit, step and launch that reads what it writes (read after write, storage segments),
exceeds the other's by more than one launch's cost.  This is the backward of a layer stack: a
linear's backward issues its weight gradient first, which only the update waits for, and its
input gradient after it, which the layer below (its activation's gradient, its weight gradient,
the rest of the backward) waits for; the input gradient now runs first, and the weight
gradient's GEMM, split-K reduction and update beside the activation's gradient.  The move is the
same program exactly: the product passes only tasks it shares no storage segment with where
either writes (no RAW, WAR or WAW between them), that it names in no `after` and that are not
host tasks, all of its unit, step and launch; ids are renumbered so they stay in issue order.
Only under `barriers = auto` and with heavy products in turn (a move could otherwise change the
orders the file's diagnostics are about).  Off by default: on the H100 it made the batch-2048
MLP step slower (516.2 against 512.8 us; 99.8 against 98.8 at batch 128, 2026-12-05).
`STREAMSCHED_CRITICAL_FIRST=1` turns it on.

Dead clears: a `fill` task (the stdlib's own; `clear grad(m)` makes one per gradient) is dropped
when nothing can observe what it writes: for every storage segment it covers, the next task in
issue order that reads the segment or overwrites it is an overwrite in the fill's own step (a
run may end after any step, and what a step leaves is returned, saved and checkpointed): a
device task of a stdlib kernel (the stdlib writes every element of each output; a user kernel
might not) that writes the segment without reading it.  Writes by host tasks and user kernels neither read nor cover.
The rule is decided on storage segments, so `into` aliases and planned storage reuse count as
the same bytes; it holds for every unrolled step of the fill's work (its `key`) or for none; a
fill named in another task's `after` is kept.  Only under `barriers = auto`: under `chain` and
`explicit` the checker reports the orders a file leaves out, and a clear that races its
overwrite (or the previous step's read) is the user's bug, which dropping the clear would hide
from the check of the plan that runs (the same file must be rejected with `--no-fuse` too).
This is the case of a step whose backward writes each gradient (dW = x^T dz, db = sum dz): the
clear before it is work without effect, which on the device also takes bandwidth from the
forward it runs beside.  Where a gradient accumulates
(`add` reads it, a second micro-batch), or a parameter takes no gradient in the step, the clear
stays.  Removing a dead clear changes no value the program can read; the checker proves the plan
without it.  `STREAMSCHED_DEAD_FILLS=0` keeps every clear (for comparison).
"""

from __future__ import annotations

import bisect
import os

from dataclasses import replace
from operator import attrgetter

from streamsched.interp.dependencies import storage_segments
from streamsched.interp.env_choice import EnvChoice
from streamsched.interp.ir import HOST, Buffer, Schedule, Task, evolve, renumbered
from streamsched.stdlib.kernels.multi_tensor import FUSIBLE


def backward_epilogues() -> bool:
    """Whether the backward GEMM epilogues fuse (`STREAMSCHED_BWD_EPILOGUES=1`; off by default).
    Measured on the H200 (2026-12-02) they made the mlp_digits step slower (73.3 against 58.5 us)
    and the batch-2048 MLP's (580.4 against 556.9 us), and their device test found the bias
    gradient outside its tolerance for 128x1024x1024: until that is understood they are an
    experiment, and the plans that run fuse the forward epilogues only."""
    return os.environ.get("STREAMSCHED_BWD_EPILOGUES", "0") == "1"


DEAD_FILLS = EnvChoice("STREAMSCHED_DEAD_FILLS", ("1", "0"), "1")
SPLIT_UPDATES = EnvChoice("STREAMSCHED_SPLIT_UPDATES", ("1", "0"), "1")
HEAVY_IN_TURN = EnvChoice("STREAMSCHED_HEAVY_IN_TURN", ("1", "0"), "1")
CRITICAL_FIRST = EnvChoice("STREAMSCHED_CRITICAL_FIRST", ("1", "0"), "0")
BN_EPILOGUES = EnvChoice("STREAMSCHED_BN_EPILOGUES", ("1", "0"), "1")
"""The five rules' switches (module docstring): `1` or `0`; unset or empty is the
default, `1` (on) for all but critical path first, `0` (off), which measured slower
(H100, 2026-12-05: 516.2 against 512.8 us at batch 2048, 99.8 against 98.8 at batch 128).
`streamsched run` and `train()` refuse any other value with X004 (training/settings.py,
`env_choices`); the checker reads such a value as the switch's default."""


def _rule_on(choice: EnvChoice) -> bool:
    """The switch is on: it says `1`, or it is unset, empty or refused (X004, read here as its
    default) and its default is `1`."""
    refused = choice.error(os.environ.get(choice.name)) != ""
    return (choice.default if refused else choice.get()) == "1"


def fuse_tasks(schedule: Schedule, kernels=None, min_parts: int = 2) -> Schedule:
    """The schedule with every fusible run of tasks (module docstring) replaced by one
    `multi_tensor` task (kernel "multi_tensor", args/outs the parts' in order, attrs `base` and
    `parts` = ((nin, nout, attrs), ...)); ids renumbered to stay the task index, `after` clauses
    remapped (a clause between two parts of one run is dropped: the launch runs its parts in
    order).  kernels: the program's kernel table (a name that is not the stdlib's own record is
    never fused).  Returns `schedule` itself when nothing fuses."""
    from streamsched.stdlib.kernels import KERNELS

    bufs = schedule.buffer_map()
    explicit = schedule.policy == "explicit"
    tasks = _epilogues(_pairs(schedule.tasks, bufs, kernels, KERNELS), schedule.buffers, kernels, KERNELS,
                       one_stream=explicit)
    if backward_epilogues():
        tasks, masks = _bwd_epilogues(tasks, schedule.buffers, kernels, KERNELS, one_stream=explicit)
    else:
        masks = ()
    tasks, more = _gated_products(tasks, schedule.buffers + masks, kernels, KERNELS, one_stream=explicit)
    masks += more
    if _rule_on(BN_EPILOGUES):
        tasks = _bn_epilogues(tasks, schedule.buffers + masks, kernels, KERNELS, one_stream=explicit)
    # (after the epilogues: a clear is dead on the writes that remain, not on those they fold)
    tasks = _dead_fills(schedule, tasks, kernels, KERNELS)
    if _rule_on(CRITICAL_FIRST):
        tasks = _critical_first(tasks, schedule)
    tasks = _heavy_in_turn(tasks, schedule)
    # Placed buffers (after plan_memory, as unroll leaves them) are compared by storage segment.
    segs = storage_segments(schedule) if all(b.offset >= 0 for b in schedule.buffers) else None
    groups: list[list[Task]] = []
    held: _Held | None = None  # the bytes and names the last group's parts own (for _joins)
    sig = None  # what every part of the last group shares (_signature), None: it takes no part
    fusible = FUSIBLE
    for t in tasks:
        if t.kernel not in fusible or t.stream == HOST:
            groups.append([t])  # (most tasks: no run grows past them)
            held = sig = None
            continue
        shared, own = _own(t)
        tsig = _signature(t, shared)
        if sig is not None and tsig == sig and _joins(own, shared, bufs, held):
            groups[-1].append(t)
            held.add(own, bufs)
        else:
            groups.append([t])
            held = _Held(segs, shared, bufs)
            held.add(own, bufs)
            sig = tsig
    if _rule_on(SPLIT_UPDATES):
        groups = _split_updates(groups, tasks, schedule, segs)
    if tasks is schedule.tasks and all(len(g) < max(2, min_parts) or not _fusible(g[0], kernels, KERNELS)
                                       for g in groups):
        return schedule
    new_id: list[int] = [0] * len(schedule.tasks)  # by old id (the unfused schedule's indexes)
    kept: list[Task | list[Task]] = []
    for g in groups:
        nid = len(kept)
        if len(g) >= max(2, min_parts) and _fusible(g[0], kernels, KERNELS):
            for t in g:
                new_id[t.id] = nid
            kept.append(g)
        else:
            for t in g:
                new_id[t.id] = len(kept)
                kept.append(t)
    fixed = []
    for nid, t in enumerate(kept):
        if type(t) is list:
            t = _merge(t, nid)
        if t.after:
            after = tuple(dict.fromkeys(a for a in map(new_id.__getitem__, t.after) if a != nid))
        else:
            after = ()
        fixed.append(t if nid == t.id and after == t.after else renumbered(t, nid, after))
    return replace(schedule, tasks=tuple(fixed), buffers=schedule.buffers + masks)


_PRODUCTS = ("matmul", "gemm", "conv2d", "attn_")
"""The kernels priority.task_flops counts flops of (every other kernel: 0)."""

HEAVY_FLOPS = 1e9
"""A product of at least this many flops fills the device on its own (module docstring, "Heavy
products in turn"): cuBLAS tiles a GEMM of 1 GFLOP into at least a wave of blocks."""


def _heavy_in_turn(tasks, schedule: Schedule):
    """`tasks` with each heavy product (priority.task_flops >= HEAVY_FLOPS) ordered after the heavy
    product issued before it in its unit, step and launch, when that one is on another stream
    (an `after` on it; the same stream already orders them); `tasks` itself when none is."""
    if not _rule_on(HEAVY_IN_TURN) or schedule.policy != "auto":
        return tasks
    from streamsched.interp.priority import task_flops
    from streamsched.stdlib.kernels.collectives import is_collective

    if any(is_collective(t.kernel, t.attrs) for t in tasks):
        return tasks  # (an order between two products may order two collectives: R008 is checked on it)

    shapes = {b.name: tuple(b.shape) for b in schedule.buffers}
    last: dict[tuple, Task] = {}
    out, changed = list(tasks), False
    for i, t in enumerate(tasks):
        if t.stream == HOST or not t.kernel.startswith(_PRODUCTS) or task_flops(t, shapes) < HEAVY_FLOPS:
            continue
        where = (t.unit, t.step, t.launch)
        p = last.get(where)
        last[where] = t
        if p is not None and p.stream != t.stream and p.id not in t.after:
            out[i] = evolve(t, after=t.after + (p.id,))
            changed = True
    return tuple(out) if changed else tasks


def _critical_first(tasks, schedule: Schedule):
    """`tasks` with heavy products moved ahead of the heavy product before them where their
    upward rank is larger (module docstring, "Critical path first"); `tasks` itself when none
    moves.  Linear in tasks plus accesses, and nothing but the scan for heavy products when fewer
    than two of them share a unit, step and launch."""
    if not _rule_on(HEAVY_IN_TURN) or schedule.policy != "auto":
        return tasks
    from streamsched.interp.priority import LAUNCH_US, task_cost_us, task_flops
    from streamsched.stdlib.kernels.collectives import is_collective

    shapes = {b.name: tuple(b.shape) for b in schedule.buffers}
    heavy: dict[tuple, list[int]] = {}  # (unit, step, launch) -> positions of its heavy products
    for i, t in enumerate(tasks):
        if t.stream != HOST and t.kernel.startswith(_PRODUCTS) and task_flops(t, shapes) >= HEAVY_FLOPS:
            heavy.setdefault((t.unit, t.step, t.launch), []).append(i)
    if all(len(h) < 2 for h in heavy.values()) or any(is_collective(t.kernel, t.attrs) for t in tasks):
        return tasks
    view = _Segments(storage_segments(schedule))
    seg_of, touches = view.of, view.touches
    nbytes = {b.name: int(b.nbytes) for b in schedule.buffers}
    # Upward ranks, one walk from the end: need[(where, segment)] is the largest rank of a task of
    # `where` that reads the segment before anything of `where` writes it again.
    first = min(h[0] for h in heavy.values() if len(h) > 1)
    rank: dict[int, float] = {}
    need: dict[tuple, float] = {}
    for i in range(len(tasks) - 1, first - 1, -1):
        t = tasks[i]
        where = (t.unit, t.step, t.launch)
        r = 0.0
        for o in t.outs:
            for x in seg_of(o):
                got = need.pop((where, x), 0.0)
                if got > r:
                    r = got
        r += 0.0 if t.stream == HOST else task_cost_us(t, shapes, nbytes)
        rank[i] = r
        for a in t.args:
            for x in seg_of(a):
                k = (where, x)
                if need.get(k, 0.0) < r:
                    need[k] = r

    order = list(range(len(tasks)))  # issue order, as positions into tasks
    at = list(range(len(tasks)))  # position -> its index in order
    moved = False
    for where, hs in heavy.items():
        cur: list[int] = []  # the heavy products placed so far, in their current issue order
        for q in hs:
            qt = tasks[q]
            reads, writes = touches(qt)
            c = len(cur)
            while c and rank[q] > rank[cur[c - 1]] + LAUNCH_US and _passes(
                    qt, reads, writes, (tasks[order[k]] for k in range(at[cur[c - 1]], at[q])), where, touches):
                i, j = at[cur[c - 1]], at[q]
                order[i + 1:j + 1] = order[i:j]
                order[i] = q
                for k in range(i, j + 1):
                    at[order[k]] = k
                moved = True
                c -= 1
            cur.insert(c, q)
    if not moved:
        return tasks
    # Ids stay in issue order: each position takes the id that was there, afters follow the task.
    new_id = {tasks[p].id: tasks[k].id for k, p in enumerate(order) if p != k}
    out = []
    for k, p in enumerate(order):
        t = tasks[p]
        after = tuple(new_id.get(a, a) for a in t.after) if t.after else ()
        nid = tasks[k].id
        out.append(t if nid == t.id and after == t.after else renumbered(t, nid, after))
    return tuple(out)


class _Segments:
    """Storage segments by buffer name (`dependencies.storage_segments`), with a segment of its own
    for a name no buffer declares (a relu mask the pass adds): what `_passes` compares."""

    def __init__(self, segs: dict[str, tuple[int, ...]]):
        self.segs = segs
        self.own: dict[str, tuple[int, ...]] = {}

    def of(self, name: str) -> tuple[int, ...]:
        got = self.segs.get(name)
        if got is None:
            got = self.own.setdefault(name, (-1 - len(self.own),))
        return got

    def touches(self, t: Task) -> tuple[set, set]:
        """(segments t reads, segments t writes)."""
        of = self.of
        return ({x for a in t.args for x in of(a)}, {x for o in t.outs for x in of(o)})


def _passes(qt: Task, reads: set, writes: set, between, where: tuple, touches) -> bool:
    """Whether task qt (reading segments `reads`, writing `writes`) may be issued ahead of the
    tasks `between` as the same program: none is a host task or of another unit, step or launch,
    none is named in an `after` of the other, and no storage segment one writes the other reads
    or writes."""
    for u in between:
        if u.stream == HOST or (u.unit, u.step, u.launch) != where or u.id in qt.after or qt.id in u.after:
            return False
        ur, uw = touches(u)
        if not writes.isdisjoint(ur) or not writes.isdisjoint(uw) or not reads.isdisjoint(uw):
            return False
    return True


def _work(key: str) -> str:
    """A task key without its slot ("a|3|7" -> "3|7"): the same work in every step."""
    return key.split("|", 1)[-1]


def _update_run(g: list[Task]) -> bool:
    """Whether group g is a run of optimizer updates that may be split: three parts or more of a
    FUSIBLE `*_step` kernel, none named in another's `after`."""
    if len(g) < 3 or not g[0].kernel.endswith("_step") or g[0].kernel not in FUSIBLE:
        return False
    ids = {t.id for t in g}
    return not any(a in ids for t in g for a in t.after)


def _split_updates(groups: list[list[Task]], tasks, schedule: Schedule, segs) -> list[list[Task]]:
    """`groups` with each run of optimizer updates (`_update_run`) that gains from it split in two
    (module docstring, "Updates in two launches"); the list itself when none does."""
    runs = [g for g in groups if _update_run(g)]
    if schedule.policy != "auto" or not runs:
        return groups
    from streamsched.interp.priority import BYTE_RATE, LAUNCH_US, task_cost_us

    nbytes = {b.name: int(b.nbytes) for b in schedule.buffers}
    # A split saves at most the bytes of its first launch, so a run of at most LAUNCH_US worth of
    # bytes in all never gains a launch's cost: no estimate needed when every run is that small.
    if all(sum(nbytes.get(b, 0) for t in g for b in t.args + t.outs) <= LAUNCH_US * BYTE_RATE for g in runs):
        return groups
    if segs is None:
        segs = storage_segments(schedule)
    shapes = {b.name: tuple(b.shape) for b in schedule.buffers}
    # The estimate runs up to the last part of the first run of each kind: the same work in a
    # later step, of either slot (a key is "slot|statement|template": _work drops the slot), is
    # split alike, so the rest of the schedule is not needed.
    last_needed = max(g[-1].id for g in {tuple(_work(t.key) for t in g): g for g in reversed(runs)}.values())
    done: dict[int, float] = {}  # segment -> estimated finish of its last writer
    free: dict[str, float] = {}  # stream -> estimated finish of its last task
    ready: dict[int, float] = {}  # task id -> when its inputs are estimated ready
    start_of: dict[int, float] = {}  # task id -> when its stream is estimated free
    for t in tasks:
        if t.id > last_needed:
            break
        r = max((done.get(x, 0.0) for a in t.args for x in segs.get(a, ())), default=0.0)
        ready[t.id], start_of[t.id] = r, free.get(t.stream, 0.0)
        f = max(r, start_of[t.id]) + (0.0 if t.stream == HOST else task_cost_us(t, shapes, nbytes))
        for o in t.outs:
            for x in segs.get(o, ()):  # (an undeclared name: no producer to wait for)
                done[x] = f
        free[t.stream] = f

    chosen: dict[tuple, frozenset] = {}  # the parts' keys -> the keys of the first launch
    out: list[list[Task]] = []
    for g in groups:
        if not _update_run(g):
            out.append(g)
            continue
        keys = tuple(_work(t.key) for t in g)
        first = chosen.get(keys)
        if first is None:
            order = sorted(g, key=lambda t: ready[t.id])  # (stable: issue order among equals)
            s0, rn = start_of[g[0].id], ready[order[-1].id]
            # a launch's cost: LAUNCH_US + its bytes / BYTE_RATE, the shared scalars once, each
            # part's own tensors (disjoint from the others') by prefix sums
            shared_names = set(_own(g[0])[0])
            shared = sum(nbytes.get(b, 0) for b in shared_names)
            own_bytes = [sum(nbytes.get(b, 0) for b in dict.fromkeys(t.args + t.outs) if b not in shared_names)
                         for t in order]
            total = sum(own_bytes)
            best, best_k = max(s0, rn) + LAUNCH_US + (shared + total) / BYTE_RATE, len(order)
            head = 0.0
            for k in range(1, len(order)):
                head += own_bytes[k - 1]
                f1 = max(s0, ready[order[k - 1].id]) + LAUNCH_US + (shared + head) / BYTE_RATE
                f = max(f1, rn) + LAUNCH_US + (shared + total - head) / BYTE_RATE
                if f < best - LAUNCH_US:
                    best, best_k = f, k
            first = chosen[keys] = frozenset(_work(t.key) for t in order[:best_k] if best_k < len(order))
        if not first or len(first) == len(g):
            out.append(g)
            continue
        out.append([t for t in g if _work(t.key) in first])
        out.append([t for t in g if _work(t.key) not in first])
    return out


def _dead_fills(schedule: Schedule, tasks, kernels, stdlib) -> tuple[Task, ...]:
    """`tasks` (schedule.tasks, or the epilogue passes' rewrite of them) without their dead clears
    (module docstring, "Dead clears"); the tuple itself when there is none.  One pass over the
    tasks builds each cleared storage segment's accesses in issue order; a fill is then decided by
    one bisection per segment it covers."""
    fill = stdlib.get("fill")
    if not _rule_on(DEAD_FILLS) or schedule.policy != "auto" or fill is None \
            or (kernels is not None and kernels.get("fill") is not fill):
        return tasks
    if not any(t.kernel == "fill" and t.stream != HOST for t in tasks):
        return tasks
    view = _Segments(storage_segments(schedule))
    segs, seg_of = view.segs, view.of
    trusted = {k for k in {t.kernel for t in tasks} if kernels is None or kernels.get(k) is stdlib.get(k)}
    cleared = {s for t in tasks if t.kernel == "fill" for o in t.outs for s in seg_of(o)}
    rel: dict[str, tuple[int, ...]] = {}  # name -> the cleared segments it covers

    def rel_of(name: str) -> tuple[int, ...]:
        got = rel.get(name)
        if got is None:
            got = rel[name] = tuple(s for s in seg_of(name) if s in cleared)
        return got

    # cleared segment -> positions of the tasks that read it or overwrite it without reading it
    # (a write by a host task or a user kernel that reads nothing of it observes nothing: skipped)
    pos: dict[int, list[int]] = {}
    blind: dict[int, list[bool]] = {}  # segment -> per position: overwritten (not read)
    touching = {n for n, ss in segs.items() if not cleared.isdisjoint(ss)} | set(view.own)  # names on them
    rel_names: dict[tuple[str, ...], set[int]] = {}  # names -> the cleared segments they cover (steps share names)
    for i, t in enumerate(tasks):
        if touching.isdisjoint(t.args) and touching.isdisjoint(t.outs):
            continue
        r = rel_names.get(t.args)
        if r is None:
            r = rel_names[t.args] = {s for a in t.args for s in rel_of(a)}
        over = t.stream != HOST and t.kernel in trusted and t.kernel in stdlib
        w = rel_names.get(t.outs) if over else ()
        if w is None:
            w = rel_names[t.outs] = {s for o in t.outs for s in rel_of(o)}
        if not r and not w:
            continue
        for s in r.union(w):
            at = pos.get(s)
            if at is None:  # (not setdefault, which builds two lists per access)
                pos[s], blind[s] = [i], [s not in r]
            else:
                at.append(i)
                blind[s].append(s not in r)
    named = {a for t in tasks for a in t.after}
    dead_at: dict[str, bool] = {}  # key -> every fill of that key is dead
    for i, t in enumerate(tasks):
        if t.kernel != "fill" or t.stream == HOST or t.id in named or t.args:
            if t.kernel == "fill":
                dead_at[t.key] = False
            continue
        dead = True
        for s in {s for o in t.outs for s in seg_of(o)}:
            ps = pos.get(s, ())
            j = bisect.bisect_right(ps, i)
            # a run may end after any step, and what a step leaves is observable (the state a
            # run returns, saves and checkpoints): the overwrite must come in the fill's step
            if j == len(ps) or not blind[s][j] or tasks[ps[j]].step != t.step:
                dead = False
                break
        dead_at[t.key] = dead_at.get(t.key, True) and dead
    if not any(dead_at.values()):
        return tasks
    return tuple(t for t in tasks if not (t.kernel == "fill" and dead_at.get(t.key, False)))


_PAIR = ("softmax_xent", "softmax_xent_grad", "softmax_xent_fused")


def _pairs(tasks, bufs, kernels, stdlib):
    """`tasks` with every fusible softmax_xent / softmax_xent_grad pair (module docstring) made one
    softmax_xent_fused task that keeps the first's id; the second's id is mapped to it through
    the `after` of the tasks that name it.  `tasks` itself when there is none."""
    first, second, fused = _PAIR
    if kernels is not None and any(kernels.get(k) is not stdlib.get(k) for k in _PAIR):
        return tasks
    out, gone = [], {}
    i = 0
    while i < len(tasks):
        t = tasks[i]
        u = tasks[i + 1] if i + 1 < len(tasks) else None
        if u is not None and t.kernel == first and u.kernel == second and t.stream == u.stream != HOST \
                and (t.unit, t.step, t.slot, t.launch) == (u.unit, u.step, u.slot, u.launch) \
                and len(t.args) == 2 and len(u.args) == 3 and tuple(u.args[1:]) == tuple(t.args) \
                and _apart(bufs, u.args[0], t.outs[0]) \
                and all(_apart(bufs, u.outs[0], n) for n in (t.args[0], t.args[1], t.outs[0], u.args[0])):
            gone[u.id] = t.id
            out.append(evolve(t, kernel=fused, args=(t.args[0], t.args[1], u.args[0]),
                               outs=(t.outs[0], u.outs[0]), attrs=(), after=tuple(dict.fromkeys(t.after + u.after)),
                               key="fuse(" + t.key + "|" + u.key + ")",
                               label=f"{t.label} + {u.label}" if t.label and u.label else t.label))
            i += 2
        else:
            out.append(t)
            i += 1
    if not gone:
        return tasks
    gone_ids = gone.keys()
    return tuple(evolve(t, after=tuple(gone.get(a, a) for a in t.after)) if t.after and not gone_ids.isdisjoint(t.after)
                 else t for t in out)


_EPI = {"relu": "gemm_bias_relu", "gelu": "gemm_bias_gelu"}
_EPI_KERNELS = ("matmul", "add", "relu", "gelu", "gemm_bias", "gemm_bias_relu", "gemm_bias_gelu")


def _epilogues(tasks, buffers, kernels, stdlib, one_stream: bool = False):
    """`tasks` with every matmul -> add -> relu|gelu run (module docstring) made one
    gemm_bias_relu / gemm_bias_gelu task, and every matmul -> add pair with no such activation
    next one gemm_bias task, keeping the matmul's id (the others' ids mapped to it in
    every `after`); `tasks` itself when there is none.  "No other reader" counts the same work in
    the other unrolled steps as fused too: the candidates are found first, then dropped until
    every reader of a dropped intermediate is itself a fused part (a fixed point)."""
    if kernels is not None and any(kernels.get(k) is not stdlib.get(k) for k in _EPI_KERNELS):
        return tasks
    bufs = {b.name: b for b in buffers}
    kept = _kept(buffers).__contains__
    cand: dict[int, tuple] = {}  # index of t1 -> (t1, t2, t3 or None)
    for i, t1 in enumerate(tasks):
        if t1.kernel != "matmul" or i + 1 >= len(tasks):
            continue
        t2, t3 = tasks[i + 1], tasks[i + 2] if i + 2 < len(tasks) else None
        if any(v for _, v in t1.attrs) or t2.kernel != "add" or len(t2.args) != 2 or t2.args[0] != t1.outs[0]:
            continue
        if t3 is not None and (t3.kernel not in _EPI or t3.args != t2.outs
                               or (t3.unit, t3.step, t3.slot, t3.launch) != (t1.unit, t1.step, t1.slot, t1.launch)):
            t3 = None  # no activation the epilogue takes: the bias alone (gemm_bias)
        parts = (t2,) if t3 is None else (t2, t3)
        if any((u.unit, u.step, u.slot, u.launch) != (t1.unit, t1.step, t1.slot, t1.launch) for u in parts):
            continue
        if one_stream and any(u.stream != t1.stream for u in parts):
            continue  # explicit: the user orders streams; a missing `after` between them stays an R001
        if any(u.stream != t1.stream and u.site is not None and u.site.placed for u in parts[-1:]):
            continue  # the user put the activation (or the bias add) on its stream: fusing would move it
        if HOST in (t1.stream,) + tuple(u.stream for u in parts):
            continue
        m, bias = t1.outs[0], t2.args[1]
        bm, bb = bufs.get(m), bufs.get(bias)
        if bm is None or bb is None or len(bm.shape) != 2 or bb.shape != bm.shape[1:]:
            continue
        if kept(m) or (t3 is not None and t3.kernel == "relu" and kept(t2.outs[0])):
            continue  # a value the run returns or saves: the epilogue would not write it
        if not all(_apart(bufs, o, a) for o in (t3.outs if t3 else ()) + t2.outs for a in t1.args + (bias,)):
            continue
        cand[i] = (t1, t2, t3)
    if not cand:
        return tasks
    touching = _Touching(buffers)
    readers = _by_name(tasks, "args")

    def readers_of(name: str) -> set[int]:
        return touching.tasks(name, readers)

    need = {i: (readers_of(c[0].outs[0]), readers_of(c[1].outs[0]) if c[2] and c[2].kernel == "relu" else set())
            for i, c in cand.items()}
    while True:
        t2s = {c[1].id for c in cand.values()}
        t3s = {c[2].id for c in cand.values() if c[2] is not None}
        bad = [i for i in cand if not (need[i][0] <= t2s and need[i][1] <= t3s)]
        if not bad:
            break
        for i in bad:
            del cand[i]
    if not cand:
        return tasks
    out, gone = [], {}
    i = 0
    while i < len(tasks):
        if i in cand:
            t1, t2, t3 = cand[i]
            parts = (t1, t2) if t3 is None else (t1, t2, t3)
            for u in parts[1:]:
                gone[u.id] = t1.id
            if t3 is None:
                kernel, outs, last = "gemm_bias", t2.outs, "add"
            else:
                kernel, last = _EPI[t3.kernel], t3.kernel
                outs = (t2.outs[0],) + t3.outs if t3.kernel == "gelu" else t3.outs
            out.append(evolve(t1, kernel=kernel, args=t1.args + (t2.args[1],), outs=outs, attrs=(),
                               after=tuple(a for a in dict.fromkeys(sum((u.after for u in parts), ()))
                                           if a not in {u.id for u in parts}),
                               key="fuse(" + "|".join(u.key for u in parts) + ")",
                               label=f"{t1.label} +{last}" if t1.label else t1.label))
            i += len(parts)
        else:
            out.append(tasks[i])
            i += 1
    gone_ids = gone.keys()
    return tuple(evolve(t, after=tuple(gone.get(a, a) for a in t.after)) if t.after and not gone_ids.isdisjoint(t.after)
                 else t for t in out)


class _Touching:
    """The buffers sharing a byte with a buffer (itself included), by space, sorted by offset: a
    bisection per query (a scan of every buffer per candidate made the pass quadratic in the
    model's depth)."""

    def __init__(self, buffers):
        self.bufs = {b.name: b for b in buffers}
        self.by_space: dict[str, list] = {}
        for o in buffers:
            if o.nbytes:
                self.by_space.setdefault(o.space, []).append((o.offset, o.offset + o.nbytes, o.name))
        self.starts: dict[str, list[int]] = {}
        self.longest: dict[str, int] = {}
        for sp, lst in self.by_space.items():
            lst.sort()
            self.starts[sp] = [x[0] for x in lst]
            self.longest[sp] = max(x[1] - x[0] for x in lst)

    def names(self, name: str) -> list[str]:
        b = self.bufs.get(name)
        out = [name]
        if b is None or not b.nbytes or b.space not in self.by_space:
            return out
        lst, st = self.by_space[b.space], self.starts[b.space]
        lo, hi = b.offset, b.offset + b.nbytes
        j = bisect.bisect_left(st, hi) - 1  # buffers starting before b's end, walked back
        while j >= 0 and st[j] + self.longest[b.space] > lo:
            if lst[j][1] > lo and lst[j][2] != name:
                out.append(lst[j][2])
            j -= 1
        return out

    def tasks(self, name: str, index: dict[str, set[int]]) -> set[int]:
        """The ids in `index` (buffer name -> task ids) of every buffer touching `name`."""
        r: set[int] = set()
        for n in self.names(name):
            r |= index.get(n, set())
        return r


def _by_name(tasks, field: str) -> dict[str, set[int]]:
    """Buffer name -> ids of the tasks naming it in `field` ("args" or "outs")."""
    out: dict[str, set[int]] = {}
    get = out.get
    names_of = attrgetter(field)
    for t in tasks:
        tid = t.id
        for a in names_of(t):
            ids = get(a)
            if ids is None:  # (not setdefault: it would build a set for every name it finds)
                out[a] = {tid}
            else:
                ids.add(tid)
    return out


_BWD = {"gelu_grad": "gemm_dgelu_bgrad", "relu_grad": "gemm_drelu_bgrad"}
_FWD_RELU = ("gemm_bias_relu", "gemm_bias_relu_aux")


def _bwd_epilogues(tasks, buffers, kernels, stdlib, one_stream: bool = False):
    """(`tasks` with every matmul -> gelu_grad | relu_grad -> sum run of the module docstring made
    one gemm_dgelu_bgrad / gemm_drelu_bgrad task keeping the matmul's id, the others' ids mapped
    to it in every `after`, and each gemm_bias_relu writing a fused relu's y made
    gemm_bias_relu_aux; the relu masks' new buffers, placed after the device arena's end).
    `tasks` itself and () when nothing fuses."""
    from streamsched.stdlib.kernels.gemm import _mask_ld

    names = ("matmul", "sum") + tuple(_BWD) + tuple(_BWD.values()) + _FWD_RELU
    if kernels is not None and any(kernels.get(k) is not stdlib.get(k) for k in names):
        return tasks, ()
    bufs = {b.name: b for b in buffers}
    touching = _Touching(buffers)
    readers, writers = _by_name(tasks, "args"), _by_name(tasks, "outs")
    at = {t.id: i for i, t in enumerate(tasks)}

    def conflicts(u: Task, reads: tuple, writes: tuple) -> bool:
        """Whether u touches a byte the moved task reads (u writing it) or writes (u at all)."""
        return any(not _apart(bufs, o, r) for o in u.outs for r in reads + writes) \
            or any(not _apart(bufs, a, w) for a in u.args for w in writes)

    kept = _kept(buffers).__contains__
    cand: dict[int, tuple] = {}  # index of t1 -> (t1, t2, t3, index of t3)
    reach = -1  # the last candidate's t3: spans never interleave, so each move is its own
    for i in range(len(tasks) - 2):
        t1, t2 = tasks[i], tasks[i + 1]
        if i <= reach:
            continue
        names = _product_then(t1, t2, bufs) if t2.kernel in _BWD else None
        if names is None:
            continue
        where = (t1.unit, t1.step, t1.slot, t1.launch)
        dy, aux, dpre = names
        bdy = bufs[dy]
        # the bias gradient: the first task after t2 reading dpre that is sum(dpre, axis=0), in
        # the same statement; the tasks between (the dW GEMM) must commute with it
        t3, j = None, -1
        for r in sorted(at[x] for x in readers.get(dpre, ()) if at[x] > i + 1):
            u = tasks[r]
            if (u.unit, u.step, u.slot, u.launch) != where:
                break
            if u.kernel == "sum" and u.args == (dpre,) and u.attr("axis") in (0, -2) and len(u.outs) == 1 \
                    and u.stream != HOST:
                b = bufs.get(u.outs[0])
                if b is not None and b.shape == bdy.shape[1:]:
                    t3, j = u, r
                break
        if t3 is None:
            continue
        db = t3.outs[0]
        if one_stream and not t1.stream == t2.stream == t3.stream:
            continue  # explicit: the user orders streams; a missing `after` between them stays an R001
        if any(u.stream != t1.stream and u.site is not None and u.site.placed for u in (t2, t3)):
            continue  # the user put it on its stream: fusing would move it to the GEMM's
        if not all(_apart(bufs, o, a) for o in (dpre, db) for a in t1.args + (aux,)) or not _apart(bufs, dpre, db):
            continue
        if kept(t1.outs[0]):
            continue  # a value the run returns or saves: the epilogue would not write it
        skipped = tasks[i + 2:j]
        if any(u.id in t3.after for u in skipped) or any(conflicts(u, (dpre,), (db,)) for u in skipped):
            continue
        if t2.kernel == "relu_grad":
            # the mask is written beside y by every task that writes y's bytes: then it is y > 0
            # wherever the backward reads it
            ws = touching.tasks(aux, writers)
            if not ws or any(tasks[at[w]].kernel not in _FWD_RELU or tasks[at[w]].outs[:1] != (aux,) for w in ws):
                continue
        cand[i] = (t1, t2, t3, j)
        reach = j
    if not cand:
        return tasks, ()
    need = {i: touching.tasks(c[0].outs[0], readers) for i, c in cand.items()}
    while True:
        t2s = {c[1].id for c in cand.values()}
        bad = [i for i in cand if not need[i] <= t2s]
        if not bad:
            break
        for i in bad:
            del cand[i]
    if not cand:
        return tasks, ()

    masks = _relu_masks([c[1].args[1] for c in cand.values() if c[1].kernel == "relu_grad"], bufs, buffers)
    drop = {c[3] for c in cand.values()}
    out, gone = [], {}
    for i, t in enumerate(tasks):
        if i in drop or (i - 1) in cand:
            continue
        if i in cand:
            t1, t2, t3, _ = cand[i]
            gone[t2.id] = gone[t3.id] = t1.id
            args = t1.args + (t2.args[1],) + ((masks[t2.args[1]].name,) if t2.kernel == "relu_grad" else ())
            ta, tb = bool(t1.attr("ta", False)), bool(t1.attr("tb", False))
            out.append(evolve(t1, kernel=_BWD[t2.kernel], args=args, outs=(t2.outs[0], t3.outs[0]),
                               attrs=(("ta", ta), ("tb", tb)),
                               after=tuple(dict.fromkeys(t1.after + t2.after + t3.after)),
                               key="fuse(" + "|".join(u.key for u in (t1, t2, t3)) + ")",
                               label=f"{t1.label} +{t2.kernel} +{t3.kernel}" if t1.label else t1.label))
        elif t.kernel in _FWD_RELU and t.outs[:1] and t.outs[0] in masks:
            out.append(evolve(t, kernel="gemm_bias_relu_aux", outs=(t.outs[0], masks[t.outs[0]].name)))
        else:
            out.append(t)
    out = tuple(evolve(t, after=tuple(dict.fromkeys(gone.get(a, a) for a in t.after)))
                if any(a in gone for a in t.after) else t for t in out)
    return out, tuple(masks.values())




_GATED = ("matmul", "relu_grad", "gemm_relu_grad", "gemm_drelu", "gemm_bias_relu", "gemm_bias_relu_aux")


def _drelu() -> bool:
    """Whether a gated product that is not skinny takes cuBLASLt's DRELU epilogue (gemm_drelu):
    with the backward epilogues (`STREAMSCHED_BWD_EPILOGUES=1`) only.  Measured on the H200
    (2026-12-02, docs/performance.md session 12) it made the MLP 784 step slower, 103.0 -> 112.3
    us at batch 128 and 522.0 -> 538.8 at 2048: the forward's RELU_AUX_BIAS and the DRELU GEMM
    cost more than the relu_grad launch they save."""
    return backward_epilogues()


def _gated_products(tasks, buffers, kernels, stdlib, one_stream: bool = False):
    """`tasks` with every matmul -> relu_grad pair of the module docstring ("Gated products")
    made one gemm_relu_grad task keeping the matmul's id (relu_grad's id mapped to it in every
    `after`), or, with the backward epilogues on (`_drelu`), one gemm_drelu task where the
    product is not skinny (k > SKINNY_K) and every
    task writing a byte of y is a fused forward gemm_bias_relu(_aux) writing y (made
    gemm_bias_relu_aux, with the relu masks' new buffers); (`tasks` itself, ()) when nothing
    fuses."""
    from streamsched.stdlib.kernels._cuda import SKINNY_K

    if kernels is not None and any(kernels.get(k) is not stdlib.get(k) for k in _GATED):
        return tasks, ()
    bufs = {b.name: b for b in buffers}
    kept = _kept(buffers).__contains__
    cand: dict[int, tuple] = {}  # index of t1 -> (t1, t2)
    for i in range(len(tasks) - 1):
        t1, t2 = tasks[i], tasks[i + 1]
        names = _product_then(t1, t2, bufs) if t2.kernel == "relu_grad" else None
        if names is None:
            continue
        dy, y, dpre = names
        if one_stream and t1.stream != t2.stream:
            continue  # explicit: the user orders streams; a missing `after` between them stays an R001
        if t2.stream != t1.stream and t2.site is not None and t2.site.placed:
            continue  # the user put it on its stream: fusing would move it to the GEMM's
        if not all(_apart(bufs, dpre, a) for a in t1.args + (y, dy)) or not _apart(bufs, y, dy):
            continue
        if kept(dy):
            continue  # a value the run returns or saves: the fused task would not write it
        cand[i] = (t1, t2)
    if not cand:
        return tasks, ()
    touching = _Touching(buffers)
    readers, writers = _by_name(tasks, "args"), _by_name(tasks, "outs")
    at = {t.id: i for i, t in enumerate(tasks)}
    for i in list(cand):
        if not _dead_after(tasks[i].outs[0], i + 1, bufs, touching, readers, writers, at):
            del cand[i]
    if not cand:
        return tasks, ()
    # the DRELU epilogue where the forward writes y's mask (every writer of y a fused relu GEMM)
    drelu, use_drelu = set(), _drelu()
    for i, (t1, t2) in cand.items():
        ta = bool(t1.attr("ta", False))
        k = bufs[t1.args[0]].shape[0 if ta else 1]
        ws = touching.tasks(t2.args[1], writers)
        if use_drelu and k > SKINNY_K and ws and all(tasks[at[w]].kernel in _FWD_RELU and tasks[at[w]].outs[:1] == (t2.args[1],)
                                                 for w in ws):
            drelu.add(i)
    old = {t.outs[0]: t.outs[1] for t in tasks if t.kernel == "gemm_bias_relu_aux" and len(t.outs) == 2}
    new = _relu_masks([cand[i][1].args[1] for i in sorted(drelu) if cand[i][1].args[1] not in old], bufs, buffers)
    mask_of = {**old, **{y: b.name for y, b in new.items()}}
    out, gone = [], {}
    for i, t in enumerate(tasks):
        if (i - 1) in cand:
            continue
        if i in cand:
            t1, t2 = cand[i]
            gone[t2.id] = t1.id
            y = t2.args[1]
            out.append(evolve(t1, kernel="gemm_drelu" if i in drelu else "gemm_relu_grad",
                               args=t1.args + (y,) + ((mask_of[y],) if i in drelu else ()), outs=t2.outs,
                               attrs=(("ta", bool(t1.attr("ta", False))), ("tb", bool(t1.attr("tb", False)))),
                               after=tuple(a for a in dict.fromkeys(t1.after + t2.after) if a != t1.id),
                               key=f"fuse({t1.key}|{t2.key})",
                               label=f"{t1.label} +relu_grad" if t1.label else t1.label))
        elif t.kernel == "gemm_bias_relu" and t.outs[:1] and t.outs[0] in new:
            out.append(evolve(t, kernel="gemm_bias_relu_aux", outs=(t.outs[0], new[t.outs[0]].name)))
        else:
            out.append(t)
    gone_ids = gone.keys()
    return tuple(evolve(t, after=tuple(dict.fromkeys(gone.get(a, a) for a in t.after)))
                 if t.after and not gone_ids.isdisjoint(t.after) else t for t in out), tuple(new.values())


_BN_FUSED = ("batchnorm_train", "batchnorm_grad", "relu", "relu_grad", "add", "batchnorm_train_relu",
             "batchnorm_train_add_relu", "batchnorm_grad_relu")


def _bn_epilogues(tasks, buffers, kernels, stdlib, one_stream: bool = False):
    """`tasks` with the batch-norm chains of the module docstring ("Batch norm epilogues") made one
    task each: `batchnorm_train -> relu` (batchnorm_train_relu), `batchnorm_train -> add -> relu`
    (batchnorm_train_add_relu), both at the batch norm's place, and `relu_grad -> batchnorm_grad`
    (batchnorm_grad_relu) at the gradient's place; `tasks` itself when none fuses.  Linear in
    tasks plus accesses but for the scans between a chain's parts."""
    if kernels is not None and any(kernels.get(k) is not stdlib.get(k) for k in _BN_FUSED):
        return tasks
    if not any(t.kernel in ("batchnorm_train", "batchnorm_grad") for t in tasks):
        return tasks
    bufs = {b.name: b for b in buffers}
    kept = _kept(buffers).__contains__
    touching = _Touching(buffers)
    readers, writers = _by_name(tasks, "args"), _by_name(tasks, "outs")
    at = {t.id: i for i, t in enumerate(tasks)}
    touches = _Segments(storage_segments(Schedule((), tuple(buffers), ()))).touches

    def next_touch(name: str, i: int) -> int | None:
        ks = [at[k] for k in touching.tasks(name, readers) | touching.tasks(name, writers) if at[k] > i]
        return min(ks, default=None)

    def where(t: Task) -> tuple:
        return (t.unit, t.step, t.slot, t.launch)

    def like(a: str, b: str) -> bool:
        ba, bb = bufs.get(a), bufs.get(b)
        return ba is not None and bb is not None and tuple(ba.shape) == tuple(bb.shape) and ba.dtype == bb.dtype

    def movable(parts, home: Task, lo: int, hi: int) -> bool:
        """Every part may be issued at `home`'s place: none of the tasks strictly between lo and hi
        (the parts and home aside) conflicts with it (fuse._passes)."""
        ids = {u.id for u in parts} | {home.id}
        between = [tasks[k] for k in range(lo + 1, hi) if tasks[k].id not in ids]
        w = (home.unit, home.step, home.launch)
        return all(_passes(u, *touches(u), between, w, touches) for u in parts)

    def placed_elsewhere(u: Task, home: Task) -> bool:
        return u.stream != home.stream and (one_stream or (u.site is not None and u.site.placed))

    chains: list[tuple] = []  # (lo, hi, home index, fused task, ids of the parts it replaces)
    busy_until = -1
    for i, t1 in enumerate(tasks):
        if i <= busy_until or t1.stream == HOST:
            continue
        if t1.kernel == "batchnorm_train" and not t1.attr("sync", False):
            y = t1.outs[0]
            j = next_touch(y, i)
            if j is None or kept(y):
                continue
            t2 = tasks[j]
            if where(t2) != where(t1) or t2.stream == HOST or placed_elsewhere(t2, t1):
                continue
            if t2.kernel == "relu" and t2.args == (y,) and like(t2.outs[0], y):
                parts, res, kernel, inter = (t2,), (), "batchnorm_train_relu", [(y, j)]
            elif t2.kernel == "add" and len(t2.args) == 2 and t2.args.count(y) == 1 and like(t2.outs[0], y) \
                    and like(t2.args[0], t2.args[1]):
                s_ = t2.outs[0]
                k = next_touch(s_, j)
                if k is None or kept(s_):
                    continue
                t3 = tasks[k]
                if t3.kernel != "relu" or t3.args != (s_,) or where(t3) != where(t1) or t3.stream == HOST \
                        or placed_elsewhere(t3, t1) or not like(t3.outs[0], y):
                    continue
                parts = (t2, t3)
                res = (t2.args[1] if t2.args[0] == y else t2.args[0],)
                kernel, inter = "batchnorm_train_add_relu", [(y, j), (s_, k)]
            else:
                continue
            out = parts[-1].outs[0]
            ins = t1.args + res
            if not all(_apart(bufs, out, a) for a in ins + (y,) + t1.outs[1:]) or \
                    not all(_apart(bufs, r_, y) for r_ in res):
                continue
            if not all(_dead_after(n, k_, bufs, touching, readers, writers, at) for n, k_ in inter):
                continue
            hi = at[parts[-1].id]
            if not movable(parts, t1, i, hi):
                continue
            every = (t1,) + parts
            fused = evolve(t1, kernel=kernel, args=ins, outs=(out,) + t1.outs[1:],
                           attrs=tuple((a, v) for a, v in t1.attrs if a == "eps"),
                           after=tuple(a for a in dict.fromkeys(sum((u.after for u in every), ()))
                                       if a not in {u.id for u in every}),
                           key="fuse(" + "|".join(u.key for u in every) + ")",
                           label=f"{t1.label} +{'add+' if res else ''}relu" if t1.label else t1.label)
            chains.append((i, hi, i, fused, {u.id for u in parts}))
            busy_until = hi
        elif t1.kernel == "relu_grad" and len(t1.args) == 2:
            d = t1.outs[0]
            j = next_touch(d, i)
            if j is None or kept(d):
                continue
            t2 = tasks[j]
            if t2.kernel != "batchnorm_grad" or t2.attr("sync", False) or t2.args[0] != d or d in t2.args[1:] \
                    or where(t2) != where(t1) or t2.stream == HOST or placed_elsewhere(t1, t2):
                continue
            if not (like(t1.args[0], d) and like(t1.args[1], d)):
                continue
            ins = t1.args + t2.args[1:]
            if not all(_apart(bufs, o, a) for o in t2.outs for a in ins + (d,)):
                continue
            if not _dead_after(d, j, bufs, touching, readers, writers, at) or not movable((t1,), t2, i, j):
                continue
            fused = evolve(t2, kernel="batchnorm_grad_relu", args=ins, attrs=(),
                           after=tuple(a for a in dict.fromkeys(t1.after + t2.after) if a not in (t1.id, t2.id)),
                           key=f"fuse({t1.key}|{t2.key})",
                           label=f"{t2.label} +relu_grad" if t2.label else t2.label)
            chains.append((i, j, j, fused, {t1.id}))
            busy_until = j
    if not chains:
        return tasks
    home = {h: f for _, _, h, f, _ in chains}
    gone: dict[int, int] = {}
    for _, _, h, f, ids in chains:
        for x in ids:
            gone[x] = f.id
    out = [home.get(k, t) for k, t in enumerate(tasks) if t.id not in gone]
    return tuple(evolve(t, after=tuple(dict.fromkeys(gone.get(a, a) for a in t.after)))
                 if t.after and not gone.keys().isdisjoint(t.after) else t for t in out)


def _relu_masks(ys, bufs, buffers) -> dict[str, Buffer]:
    """One relu bitmask buffer per relu output y of `ys` (u8 [m, ceil(n/128)*16], named
    relu_mask(y)), placed after the device arena's end (a fresh byte range) when the buffers are."""
    masks: dict[str, Buffer] = {}
    planned = all(b.offset >= 0 for b in buffers)
    end = max((b.offset + b.nbytes for b in buffers if b.space == "device"), default=0)
    from streamsched.stdlib.kernels.gemm import _mask_ld

    for y in ys:
        if y in masks:
            continue
        m, n = bufs[y].shape
        shape = (m, _mask_ld(n) // 8)
        name = f"relu_mask({y})"
        while name in bufs:
            name += "'"
        nbytes = m * shape[1]
        off = -(-end // 256) * 256 if planned else -1
        masks[y] = Buffer(name, shape, "u8", "device", "act", off, nbytes if planned else 0, span=bufs[y].span)
        if planned:
            end = off + nbytes
    return masks


def _dead_after(name: str, j: int, bufs, touching: "_Touching", readers, writers, at) -> bool:
    """Whether no task after index j (issue order) reads a byte of buffer `name` before a task
    overwrites all of its bytes.  Issue order is the order the bytes' accesses run in: the
    schedule is race-free (every reader and writer of a byte are ordered) and every edge goes
    forward in issue order, so a read after the next full overwrite sees that overwrite's value,
    and one before it the value at j's time.  Every pair that fuses passing this check, with the
    overwrite a fused pair's own GEMM (whose write of its dy goes), stays sound: a later read of
    those bytes before their next overwrite would have kept that pair apart."""
    b = bufs[name]
    over = touching.names(name)
    cover = [n for n in over if n == name or (bufs[n].space == b.space and bufs[n].offset <= b.offset
                                               and bufs[n].offset + bufs[n].nbytes >= b.offset + b.nbytes)]
    ends = [at[w] for n in cover for w in writers.get(n, ()) if at[w] > j]
    end = min(ends, default=len(at))
    return not any(j < at[r] <= end for n in over for r in readers.get(n, ()))


def _product_then(t1: Task, t2: Task, bufs) -> tuple[str, str, str] | None:
    """(dy, aux, dpre) when t1 is `matmul(dz, w) -> dy` (transpose flags only) and t2 the
    activation gradient `t2(dy, aux) -> dpre` right after it in one unit, step, slot and launch,
    on device streams, the three buffers 2-D of one shape and dtype; else None."""
    if t1.kernel != "matmul" or any(k not in ("ta", "tb") for k, _ in t1.attrs) or len(t1.args) != 2 \
            or len(t1.outs) != 1 or len(t2.args) != 2 or len(t2.outs) != 1 or t2.args[0] != t1.outs[0]:
        return None
    if (t1.unit, t1.step, t1.slot, t1.launch) != (t2.unit, t2.step, t2.slot, t2.launch) or HOST in (t1.stream, t2.stream):
        return None
    names = (t1.outs[0], t2.args[1], t2.outs[0])
    bs = [bufs.get(n) for n in names]
    if any(b is None for b in bs) or len(bs[0].shape) != 2 or len({(tuple(b.shape), b.dtype) for b in bs}) != 1:
        return None
    return names


_PASSING = ("act", "temp")
"""Buffer kinds a run neither returns nor saves: a step's intermediate values."""


def _kept(buffers) -> set[str]:
    """The buffers whose bytes a run returns, saves or checkpoints (every kind but act and temp:
    parameters, gradients, state, inputs), and every buffer sharing a storage segment with one
    (an `into` alias of a state): an epilogue must not drop a write of them."""
    segs = storage_segments(Schedule((), tuple(buffers), ()))
    kept = {s for b in buffers if b.kind not in _PASSING for s in segs.get(b.name, ())}
    return {n for n, ss in segs.items() if not kept.isdisjoint(ss)}


def _apart(bufs, a: str, b: str) -> bool:
    if a == b:
        return False
    ba, bb = bufs.get(a), bufs.get(b)
    return ba is None or bb is None or not ba.overlaps(bb)


def _fusible(t: Task, kernels, stdlib) -> bool:
    if t.kernel not in FUSIBLE or t.stream == HOST:
        return False
    return kernels is None or kernels.get(t.kernel) is stdlib.get(t.kernel)


def _plain_attrs(t: Task) -> tuple:
    drop = ("shape", "dtype") if t.kernel == "fill" else ()
    return tuple(sorted((k, v) for k, v in t.attrs if k not in drop))


def _own(t: Task) -> tuple[list[str], list[str]]:
    """(shared names, the part's own tensor names) of task t of a FUSIBLE kernel."""
    si, so = FUSIBLE[t.kernel]
    shared = [t.args[i] for i in si if i < len(t.args)] + [t.outs[i] for i in so if i < len(t.outs)]
    own = [a for i, a in enumerate(t.args) if i not in si] + [o for i, o in enumerate(t.outs) if i not in so]
    return shared, own


class _Held:
    """The names and bytes the parts of one growing group own.  With `segs`
    (`dependencies.storage_segments` of a schedule whose buffers are all placed) the bytes are
    the set of storage segments they cover: two planned buffers share a byte exactly when they
    share a segment, so a new part's overlap test is one set intersection per buffer, whatever
    the order of the parts' offsets.  Without it, byte ranges per space sorted by start, so that
    the test is a bisection, not a scan of every part (a 700-parameter optimizer call made the
    scan quadratic); while the held ranges are disjoint (parts never share bytes; only one part's
    own tensors could), the range starting last before b's end is the only one that can reach b;
    otherwise every range is tested."""

    def __init__(self, segs: dict[str, tuple[int, ...]] | None = None, shared=(), bufs=None):
        self.names: set[str] = set()
        self.segs = segs
        self.held: set[int] = set()  # segments (with segs)
        # the segments of the group's shared scalars (with segs): no part's own tensor may touch them
        self.shared: set[int] = {g for n in shared if bufs is not None and n in bufs and bufs[n].nbytes
                                 for g in segs[n]} if segs is not None else set()
        self.starts: dict[str, list[int]] = {}
        self.ends: dict[str, list[int]] = {}
        self.disjoint = True

    def add(self, names, bufs) -> None:
        segs = self.segs
        for n in names:
            if n in self.names:
                continue  # (a part's tensor read and written: one range)
            self.names.add(n)
            b = bufs.get(n)
            if b is None or b.nbytes == 0:
                continue
            if segs is not None:
                self.held.update(segs[n])
                continue
            if self.disjoint and self.hits(b):
                self.disjoint = False
            st, en = self.starts.setdefault(b.space, []), self.ends.setdefault(b.space, [])
            i = bisect.bisect_left(st, b.offset)
            st.insert(i, b.offset)
            en.insert(i, b.offset + b.nbytes)

    def hits(self, b) -> bool:
        """Whether buffer b shares a byte with a held range."""
        if b.nbytes == 0:
            return False
        if self.segs is not None:
            return not self.held.isdisjoint(self.segs[b.name])
        st, en = self.starts.get(b.space), self.ends.get(b.space)
        if not st:
            return False
        lo, hi = b.offset, b.offset + b.nbytes
        if not self.disjoint:
            return any(s < hi and lo < e for s, e in zip(st, en))
        i = bisect.bisect_left(st, hi)  # ranges 0..i-1 start before b's end
        return i > 0 and en[i - 1] > lo


def _signature(t: Task, shared: list[str]) -> tuple:
    """What the parts of one run share (module docstring): kernel, stream, unit, step, slot and
    step statement, arity, attributes but a fill's shape and dtype, and the shared scalars."""
    return (t.kernel, t.stream, t.unit, t.step, t.slot, t.launch, len(t.args), len(t.outs), _plain_attrs(t), shared)


def _joins(own: list[str], shared: list[str], bufs, held: "_Held") -> bool:
    """Whether a task with the group's signature and its own tensors `own` may join the group
    whose parts own `held`: its own tensors share no byte with the shared scalars, nor a name or
    a byte with another part's."""
    segs = held.segs
    if segs is not None:  # (placed buffers: a byte shared is a segment shared)
        names = held.names
        for n in own:
            if n in names:
                return False
        blocked, taken = held.shared, held.held
        for n in own:
            b = bufs.get(n)
            if b is not None and b.nbytes:
                sg = segs[n]
                if not blocked.isdisjoint(sg) or not taken.isdisjoint(sg):
                    return False
        return True
    mine = [bufs[n] for n in own if n in bufs]
    for b in mine:
        for s in shared:
            if s in bufs and b.overlaps(bufs[s]):
                return False
    return not any(n in held.names for n in own) and not any(held.hits(b) for b in mine)


def _merge(g: list[Task], nid: int) -> Task:
    first = g[0]
    parts = tuple((len(t.args), len(t.outs), t.attrs) for t in g)
    args = tuple(a for t in g for a in t.args)
    outs = tuple(o for t in g for o in t.outs)
    after = tuple(dict.fromkeys(a for t in g for a in t.after))
    label = f"{first.label} +{len(g) - 1} fused" if first.label else f"{first.kernel} x{len(g)}"
    key = "fuse(" + "|".join(t.key for t in g) + ")"
    return evolve(first, id=nid, kernel="multi_tensor", args=args, outs=outs,
                   attrs=(("base", first.kernel), ("parts", parts)), after=after, key=key, label=label)
