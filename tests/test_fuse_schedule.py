"""The fusion pass's scheduling rules (interp/fuse.py): dead clears (a clear whose every byte is
overwritten unread is dropped), updates in two launches (an optimizer's early gradients first),
and heavy products in turn (two device-filling GEMMs never side by side).  The values a fused plan
trains are the unfused plan's bitwise (tests/test_fuse.py, for every small example and for
generated programs); these tests check which tasks each rule touches, against an independent
recount where the rule is a decision."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamsched.interp.fuse import HEAVY_FLOPS, _critical_first, _dead_fills, fuse_tasks
from streamsched.interp.ir import HOST, Buffer, Schedule, Task
from streamsched.interp.priority import task_flops
from streamsched.pipeline import compile_file
from streamsched.stdlib.kernels import KERNELS
from test_soundness_properties import differ, interleavings, outcome

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STREAMS = """streams {
    trans  : copy
    comp1  : compute
    comp2  : compute
    comp3  : compute
    update : update
}
"""

MLP = STREAMS + """model mlp(batch = BATCH) {
    input x : f32[batch, IN]
    input y : i32[batch]
    h1     = linear(x, HID)
    a1     = relu(h1)
    h2     = linear(a1, HID)
    a2     = relu(h2)
    logits = linear(a2, 10)
    loss   = softmax_cross_entropy(logits, y)
}
graph load[a, b] on trans  { copy batch -> x, y }
graph zero_grad  on update { clear grad(mlp) }
graph pass       on comp1  { forward mlp; backward mlp }
graph optimize   on update { sgd(mlp, lr, momentum = 0.9) }
step train(slot) {
    upload lr on trans
    zero_grad
    PASSES
    load[next]
    optimize
}
train {
    model   = mlp
    data    = digits(test = 0.2, seed = 0)
    epochs  = 1
    lr      = 0.01
    capture = step
}
"""

SMALL = """model mlp(batch = 8, hidden = 16) {
    input x : f32[batch, 64]
    input y : i32[batch]
    h1     = linear(x, hidden)
    a1     = relu(h1)
    logits = linear(a1, 10)
    loss   = softmax_cross_entropy(logits, y)
}
"""
"""The two-layer model of the clip and state cases below."""


def _mlp(tmp_path, batch=128, inp=64, hid=256, passes=1, name="m.sched") -> str:
    text = MLP.replace("BATCH", str(batch)).replace("IN", str(inp)).replace("HID", str(hid))
    text = text.replace("PASSES", "\n    ".join(["pass(load[slot])"] * passes))
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _per_step(c, step=1):
    return [t for t in c.schedule.tasks if t.step == step]


# -- dead clears ------------------------------------------------------------------------------


def test_the_clear_before_a_backward_that_writes_every_gradient_is_dropped(tmp_path, monkeypatch):
    path = _mlp(tmp_path)
    fused = compile_file(path)
    assert fused.ok
    assert not [t for t in fused.schedule.tasks if t.kernel == "fill" or t.attr("base") == "fill"]
    monkeypatch.setenv("STREAMSCHED_DEAD_FILLS", "0")
    kept = compile_file(path)
    assert [t.attr("base") for t in _per_step(kept) if t.kernel == "multi_tensor"].count("fill") == 1


def test_a_clear_that_a_later_read_can_observe_stays(tmp_path):
    """The found_inf clear of the AMP step and the clipping sum's clear are read (accumulated
    into) before any overwrite: both stay."""
    seed = compile_file(os.path.join(ROOT, "examples", "seed_step.sched"))
    gpt = compile_file(os.path.join(ROOT, "examples", "gpt_text.sched"))
    assert [t.label for t in _per_step(seed) if t.kernel == "fill"] == ["zero_grad: clear found_inf"]
    assert [t.label for t in _per_step(gpt) if t.kernel == "fill"] == ["optimize: clear gnorm"]


def test_explicit_barriers_keep_every_clear():
    """Under `barriers = explicit` the checker reports a clear that races its overwrite: the
    clear stays so that the plan it proves is the program the user wrote."""
    c = compile_file(os.path.join(ROOT, "examples", "explicit_mlp.sched"))
    plain = compile_file(os.path.join(ROOT, "examples", "explicit_mlp.sched"), fuse=False)
    n = sum(t.kernel == "fill" for t in plain.schedule.tasks)
    assert n > 0
    got = sum(t.kernel == "fill" for t in c.schedule.tasks) + \
        sum(len(t.attr("parts")) for t in c.schedule.tasks if t.attr("base") == "fill")
    assert got == n


def test_a_wide_mlp_without_its_clear_and_with_two_updates_trains_bitwise_the_unfused(tmp_path):
    """Batch 128, 784-1024-1024-10 (the benchmark's MLP): its clear is dead and its update is two
    launches, and the values after two steps are the unfused plan's under every interleaving."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 784)).astype(np.float32)
    y = rng.integers(0, 10, 512).astype(np.int32)
    np.savez(tmp_path / "data.npz", x_train=x, y_train=y, x_test=x[:64], y_test=y[:64])
    path = _mlp(tmp_path, batch=128, inp=784, hid=1024)
    text = open(path).read().replace("digits(test = 0.2, seed = 0)", f'npz("{tmp_path / "data.npz"}")')
    open(path, "w").write(text)
    fused, plain = compile_file(path), compile_file(path, fuse=False)
    assert fused.ok and not [t for t in fused.schedule.tasks if t.kernel == "fill" or t.attr("base") == "fill"]
    assert len([t for t in _per_step(fused) if t.attr("base") == "sgd_step"]) == 2
    want = outcome(plain, max_steps=2)
    for how, got in interleavings(fused, max_steps=2):
        assert got[1] == (), how
        assert got[0] == want[0], f"{how}: {differ(got[0], want[0])}"


CLIP_RESET = STREAMS + """state { gnorm : f32[]; clip : f32[] }
""" + SMALL + """graph load[a, b] on trans  { copy batch -> x, y }
graph zero_grad  on update { clear grad(mlp); clear gnorm }
graph pass       on comp1  { forward mlp; backward mlp }
graph optimize   on update {
    grad_sumsq(mlp, gnorm)
    clip_scale(gnorm, clip, max_norm = 1.0)
    clip_grad_norm(mlp, clip)
    sgd(mlp, lr, momentum = 0.9)
    clear clip
}
step train(slot) {
    upload lr on trans
    zero_grad
    pass(load[slot])
    load[next]
    optimize
}
train {
    model    = mlp
    data     = digits(test = 0.2, seed = 0)
    epochs   = 1
    lr       = 0.05
    capture  = step
}
"""


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_a_clear_at_the_end_of_a_step_stays_whatever_step_the_run_ends_on(tmp_path, steps):
    """`clear clip` ends each step; the next step's clip_scale overwrites it unread, but a run that
    stops after this step returns (saves, checkpoints) the cleared value: the clear stays, in
    both slots, and the state after any number of steps is the unfused plan's (a run of an odd
    number of steps returned clip = 0.54 instead of 0 when the rule looked past the step)."""
    p = tmp_path / "clip.sched"
    p.write_text(CLIP_RESET)
    fused, plain = compile_file(str(p)), compile_file(str(p), fuse=False)
    clears = [t for t in fused.schedule.tasks if t.kernel == "fill" and t.outs == ("clip",)]
    assert len(clears) == fused.schedule.steps
    assert outcome(fused, max_steps=steps) == outcome(plain, max_steps=steps)


def _wide_explicit(tmp_path) -> str:
    text = open(os.path.join(ROOT, "examples", "explicit_mlp.sched")).read()
    start, end = text.index("model mlp"), text.index("}", text.index("model mlp")) + 1
    model = """model mlp(batch = 1024, hidden = 8192) {
    input x : f32[batch, 64]
    input y : i32[batch]
    h1     = linear(x, hidden)
    h2     = linear(h1, 64) on comp2
    a2     = relu(h2) after h2
    logits = linear(a2, 10) after a2
    loss   = softmax_cross_entropy(logits, y)
}"""
    p = tmp_path / "wide_explicit.sched"
    p.write_text(text[:start] + model + text[end:])
    return str(p)


def test_an_order_the_file_leaves_out_is_reported_with_heavy_products_too(tmp_path):
    """Under `barriers = explicit` a heavy consumer on another stream without its `after` is a
    race (R001) with and without fusion: the heavy-products rule adds no order there."""
    path = _wide_explicit(tmp_path)
    fused, plain = compile_file(path), compile_file(path, fuse=False)
    assert "R001" in {d.code for d in plain.diagnostics}
    assert sorted(d.code for d in fused.diagnostics) == sorted(d.code for d in plain.diagnostics)


def _oracle_dead(schedule: Schedule, user: set[str]) -> set[int]:
    """The fills the rule drops, recomputed on byte intervals: walk on from each fill through its
    step; a read of a byte still unwritten keeps it, a device task of a stdlib kernel covers the
    bytes it writes, the step's end before every byte is covered keeps it;
    all the fills of one key or none; a fill named in an `after` stays; not under chain /
    explicit."""
    if schedule.policy != "auto":
        return set()
    bufs = schedule.buffer_map()

    def rng(n):  # (space, lo, hi); a buffer without bytes is its own space
        b = bufs.get(n)
        if b is None or b.nbytes == 0 or b.offset < 0:
            return (("name", n), 0, 1)
        return (b.space, b.offset, b.offset + b.nbytes)

    def hit(iv, open_):
        return any(sp == iv[0] and lo < iv[2] and iv[1] < hi for sp, lo, hi in open_)

    def cut(open_, iv):
        out = []
        for sp, lo, hi in open_:
            if sp != iv[0] or hi <= iv[1] or iv[2] <= lo:
                out.append((sp, lo, hi))
                continue
            if lo < iv[1]:
                out.append((sp, lo, iv[1]))
            if iv[2] < hi:
                out.append((sp, iv[2], hi))
        return out

    named = {a for t in schedule.tasks for a in t.after}
    verdict: dict[str, bool] = {}
    for i, f in enumerate(schedule.tasks):
        if f.kernel != "fill":
            continue
        if f.stream == HOST or f.id in named or f.args:
            verdict[f.key] = False
            continue
        open_ = [rng(o) for o in f.outs]
        dead = False
        for t in schedule.tasks[i + 1:]:
            if t.step != f.step:  # what a step leaves is observable: the overwrite is in the step
                break
            if any(hit(rng(a), open_) for a in t.args):
                break
            if t.stream != HOST and t.kernel not in user:
                for o in t.outs:
                    open_ = cut(open_, rng(o))
            if not open_:
                dead = True
                break
        verdict[f.key] = verdict.get(f.key, True) and dead
    return {t.id for t in schedule.tasks if t.kernel == "fill" and verdict.get(t.key, False)}


_BUFS = (Buffer("g", (8,), "f32", offset=0, nbytes=32), Buffer("g_lo", (4,), "f32", offset=0, nbytes=16, alias_of="g"),
         Buffer("g_hi", (4,), "f32", offset=16, nbytes=16, alias_of="g"),
         Buffer("h", (8,), "f32", offset=32, nbytes=32), Buffer("x", (8,), "f32", offset=64, nbytes=32),
         Buffer("y", (4,), "f32", offset=96, nbytes=16))


@st.composite
def _schedules(draw):
    names = [b.name for b in _BUFS]
    n = draw(st.integers(2, 9))
    tasks = []
    for i in range(n):
        kind = draw(st.sampled_from(["fill", "fill", "copy", "add", "mine"]))
        stream = draw(st.sampled_from(["s1", "s1", "s2", HOST]))
        out = draw(st.sampled_from(names))
        args = () if kind == "fill" else tuple(draw(st.lists(st.sampled_from(names), min_size=1, max_size=2)))
        after = tuple(draw(st.lists(st.integers(0, i - 1), max_size=1))) if i and draw(st.booleans()) else ()
        key = draw(st.sampled_from(["k0", "k1", f"u{i}"]))
        step = draw(st.sampled_from([0, 0, 1])) if not tasks else max(tasks[-1].step, draw(st.sampled_from([0, 0, 1])))
        tasks.append(Task(i, kind if kind != "add" or len(args) == 2 else "copy", stream, args[:2], (out,),
                          after=after, key=key, step=step))
    policy = draw(st.sampled_from(["auto", "auto", "auto", "explicit"]))
    return Schedule(("s1", "s2", HOST), _BUFS, tuple(tasks), policy=policy, steps=2)


@settings(max_examples=300, deadline=None)
@given(_schedules(), st.booleans())
def test_dead_fills_are_those_the_byte_recount_finds(s, user_copy):
    """Against the oracle above, on random task lists over aliased buffers (halves of g), host
    tasks, `after`s, shared keys and a user kernel ("mine", and "copy" when it is the user's)."""
    kernels = dict(KERNELS)
    kernels["mine"] = object()
    user = {"mine"}
    if user_copy:
        kernels["copy"] = object()
        user.add("copy")
    kept = _dead_fills(s, s.tasks, kernels, KERNELS)
    gone = {t.id for t in s.tasks} - {t.id for t in kept}
    assert gone == _oracle_dead(s, user)


def test_a_partial_overwrite_keeps_the_clear_and_two_halves_drop_it():
    t = [Task(0, "fill", "s1", (), ("g",), key="a"), Task(1, "copy", "s1", ("x",), ("g_lo",), key="b"),
         Task(2, "copy", "s2", ("g",), ("y",), key="c")]
    s = Schedule(("s1", "s2", HOST), _BUFS, tuple(t))
    assert [x.id for x in _dead_fills(s, s.tasks, None, KERNELS)] == [0, 1, 2]
    t2 = t[:2] + [Task(2, "copy", "s2", ("x",), ("g_hi",), key="c"), Task(3, "copy", "s2", ("g",), ("y",), key="d")]
    s2 = Schedule(("s1", "s2", HOST), _BUFS, tuple(t2))
    assert [x.id for x in _dead_fills(s2, s2.tasks, None, KERNELS)] == [1, 2, 3]


# -- updates in two launches ------------------------------------------------------------------


def test_a_wide_mlps_update_is_two_launches_the_first_layers_last(tmp_path, monkeypatch):
    path = _mlp(tmp_path, batch=2048, inp=784, hid=1024)
    c = compile_file(path)
    assert c.ok
    ups = [t for t in _per_step(c) if t.attr("base") == "sgd_step"]
    assert len(ups) == 2
    first, last = (sorted(p for p in t.args if p.startswith("grad.")) for t in ups)
    assert last == ["grad.h1.b", "grad.h1.w"]
    assert first == ["grad.h2.b", "grad.h2.w", "grad.logits.b", "grad.logits.w"]
    # the second launch waits for the first layer's gradients; the first does not
    dw1 = next(t.id for t in c.schedule.tasks if t.step == 1 and t.outs == ("grad.h1.w",))
    edges = {(e.u, e.v) for e in c.edges}
    assert (dw1, ups[1].id) in edges and (dw1, ups[0].id) not in edges
    monkeypatch.setenv("STREAMSCHED_SPLIT_UPDATES", "0")
    one = compile_file(path)
    assert [len(t.attr("parts")) for t in _per_step(one) if t.attr("base") == "sgd_step"] == [6]


def test_a_small_mlps_update_stays_one_launch(tmp_path):
    """Where the estimate gains less than a launch (the digits MLP), one launch."""
    c = compile_file(_mlp(tmp_path))
    assert [len(t.attr("parts")) for t in _per_step(c) if t.attr("base") == "sgd_step"] == [6]


# -- heavy products in turn -------------------------------------------------------------------


def _heavy(c):
    shapes = {b.name: tuple(b.shape) for b in c.schedule.buffers}
    return [t for t in c.schedule.tasks if t.stream != HOST and task_flops(t, shapes) >= HEAVY_FLOPS]


def test_heavy_products_run_one_at_a_time_in_issue_order(tmp_path, monkeypatch):
    path = _mlp(tmp_path, batch=2048, inp=784, hid=1024)
    c = compile_file(path)
    heavy = _heavy(c)
    assert len(heavy) == 5 * c.schedule.steps  # two forward, dW2, dX2, dW1 a step
    edges = {(e.u, e.v) for e in c.edges}
    for step in range(c.schedule.steps):
        hs = [t for t in heavy if t.step == step]
        for p, t in zip(hs, hs[1:]):  # every heavy product after the one before it
            assert (p.id, t.id) in edges or p.stream == t.stream, (p.label, t.label)
    monkeypatch.setenv("STREAMSCHED_HEAVY_IN_TURN", "0")
    free = compile_file(path)
    dx2 = next(t for t in _per_step(free) if "h2.dx" in t.label)
    dw2 = next(t for t in _per_step(free) if "h2.dw" in t.label)
    assert (dw2.id, dx2.id) not in {(e.u, e.v) for e in free.edges}


def test_small_products_keep_their_overlap(tmp_path, monkeypatch):
    """The digits MLP's products are far below HEAVY_FLOPS: the rule adds no order."""
    c = compile_file(_mlp(tmp_path), fuse=False)
    assert not _heavy(c)
    on = fuse_tasks(c.schedule, c.program.kernels)
    monkeypatch.setenv("STREAMSCHED_HEAVY_IN_TURN", "0")
    off = fuse_tasks(c.schedule, c.program.kernels)
    assert [t.after for t in on.tasks] == [t.after for t in off.tasks]


# -- critical path first ----------------------------------------------------------------------


def test_an_input_gradient_that_the_layer_below_waits_for_is_issued_before_the_weight_gradient(tmp_path, monkeypatch):
    """The batch-2048 MLP: h2's dX (which h1's backward waits for) now comes before h2's dW (which
    only the update waits for) in every step, and the heavy products run in turn in the new order."""
    path = _mlp(tmp_path, batch=2048, inp=784, hid=1024)
    monkeypatch.setenv("STREAMSCHED_CRITICAL_FIRST", "1")
    c = compile_file(path)
    assert c.ok
    edges = {(e.u, e.v) for e in c.edges}
    for step in range(c.schedule.steps):
        tasks = _per_step(c, step)
        names = [t.label.split("@")[-1] for t in tasks if "backward@h" in t.label]
        assert names[:5] == ["h2.dx +relu_grad", "h2.dw", "h2.db", "h1.dw", "h1.db"], names
        dx2, dw2 = (next(t for t in tasks if t.label.endswith(n)) for n in ("h2.dx +relu_grad", "h2.dw"))
        assert (dx2.id, dw2.id) in edges
    assert [t.id for t in c.schedule.tasks] == list(range(len(c.schedule.tasks)))
    for value in ("0", None, "yes"):  # off, unset (the default) and refused (read as the default)
        if value is None:
            monkeypatch.delenv("STREAMSCHED_CRITICAL_FIRST")
        else:
            monkeypatch.setenv("STREAMSCHED_CRITICAL_FIRST", value)
        off = compile_file(path)
        names = [t.label.split("@")[-1] for t in _per_step(off) if "backward@h" in t.label]
        assert names[:3] == ["h2.dw", "h2.db", "h2.dx +relu_grad"], value


def test_critical_path_first_trains_the_same_values(tmp_path, monkeypatch):
    """Metamorphic: the reordered plan trains bitwise the parameters of the plan in issue order
    (CPU backend, two steps of the batch-2048 MLP, fixed and shuffled interleavings)."""
    path = _mlp(tmp_path, batch=2048, inp=784, hid=1024)
    monkeypatch.setenv("STREAMSCHED_CRITICAL_FIRST", "1")
    moved = compile_file(path)
    monkeypatch.setenv("STREAMSCHED_CRITICAL_FIRST", "0")
    kept = compile_file(path)
    assert [t.label for t in moved.schedule.tasks] != [t.label for t in kept.schedule.tasks]
    want = outcome(kept, max_steps=2)
    for how, got in interleavings(moved, max_steps=2):
        assert got == want, (how, differ(got, want))


_MB = 1 << 20
_BIG = tuple(Buffer(n, (512, 512), "f32", offset=i * _MB, nbytes=_MB) for i, n in enumerate("abcdefgh")) + (
    Buffer("lo", (256, 512), "f32", offset=0, nbytes=_MB // 2, alias_of="a"),
    Buffer("hi", (256, 512), "f32", offset=_MB // 2, nbytes=_MB // 2, alias_of="a"))
"""Buffers for hand-built schedules: a [512, 512] @ [512, 512] product is 0.27 GFLOP, so products
of them are heavy only with `_HEAVY_SHAPES`' larger declared shapes; lo and hi are a's halves."""


def _bytes_of(name: str) -> range:
    b = next(x for x in _BIG if x.name == name)
    return range(b.offset, b.offset + b.nbytes)


def _conflict(u: Task, v: Task) -> bool:
    """Independent oracle: u and v touch a common byte that one of them writes."""
    def hit(xs, ys):
        return any(_bytes_of(x).start < _bytes_of(y).stop and _bytes_of(y).start < _bytes_of(x).stop
                   for x in xs for y in ys)
    return hit(u.outs, v.args + v.outs) or hit(v.outs, u.args)


def _big_schedule(tasks) -> Schedule:
    heavy = tuple(Buffer(b.name, (2048, 2048) if b.alias_of is None else (1024, 2048), "f32", offset=b.offset,
                         nbytes=b.nbytes, alias_of=b.alias_of) for b in _BIG)
    # (declared shapes make every product heavy; the byte ranges are the ones _bytes_of reads)
    return Schedule(("s1", "s2", "s3", HOST), heavy, tuple(tasks))


@st.composite
def _heavy_schedules(draw):
    names = [b.name for b in _BIG]
    tasks = []
    for i in range(draw(st.integers(2, 10))):
        kind = draw(st.sampled_from(["matmul", "matmul", "matmul", "copy", "host"]))
        after = tuple(sorted(draw(st.sets(st.integers(0, i - 1), max_size=1)))) if i and draw(st.booleans()) else ()
        if kind == "host":
            tasks.append(Task(i, "stage", HOST, (draw(st.sampled_from(names)),), (), after=after, label=f"t{i}"))
            continue
        nin = 2 if kind == "matmul" else 1
        args = tuple(draw(st.sampled_from(names)) for _ in range(nin))
        out = draw(st.sampled_from(names))
        tasks.append(Task(i, kind, draw(st.sampled_from(["s1", "s2", "s3"])), args, (out,), after=after,
                          label=f"t{i}"))
    return _big_schedule(tasks)


@settings(max_examples=1000, deadline=None)
@given(_heavy_schedules())
def test_critical_path_first_moves_only_what_commutes(s):
    """Any schedule: the same tasks, ids still in issue order, every pair that shares a written
    byte (RAW, WAR, WAW) or an `after` in its order, nothing moved across a host task, and the
    afters naming the same tasks after the renumbering."""
    out = _critical_first(s.tasks, s)
    assert sorted(t.label for t in out) == sorted(t.label for t in s.tasks)
    assert [t.id for t in out] == [t.id for t in s.tasks]
    pos = {t.label: k for k, t in enumerate(out)}
    by_id = {t.id: t.label for t in s.tasks}
    new_by_id = {t.id: t.label for t in out}
    for i, u in enumerate(s.tasks):
        for v in s.tasks[i + 1:]:
            if u.stream == HOST or v.stream == HOST or u.id in v.after or _conflict(u, v):
                assert pos[u.label] < pos[v.label], (u, v)
    old = {t.label: {by_id[a] for a in t.after} for t in s.tasks}
    assert {t.label: {new_by_id[a] for a in t.after} for t in out} == old


def test_a_heavy_product_the_rest_waits_on_passes_one_only_the_update_reads():
    """P (weight gradient: read by one copy) then Q (input gradient: read by the next heavy
    product R): Q is issued first.  With Q reading what P writes, or P in Q's after, it is not."""
    def sched(q_args=("c", "d"), q_after=()):
        return _big_schedule([
            Task(0, "matmul", "s1", ("a", "b"), ("e",), label="P"),
            Task(1, "copy", "s2", ("b",), ("h",), label="light"),
            Task(2, "matmul", "s3", q_args, ("f",), after=q_after, label="Q"),
            Task(3, "matmul", "s1", ("f", "c"), ("g",), label="R"),
            Task(4, "copy", "s2", ("e",), ("d",), label="update")])
    s = sched()
    assert [t.label for t in _critical_first(s.tasks, s)] == ["Q", "P", "light", "R", "update"]
    for s in (sched(q_args=("e", "c")), sched(q_after=(0,)), sched(q_args=("h", "c"))):
        assert [t.label for t in _critical_first(s.tasks, s)] == ["P", "light", "Q", "R", "update"]


# -- epilogues and state: a value the run returns ----------------------------------------------

def _probe_program(state_and_op: str, look: str, clears: str = "clear grad(mlp)") -> str:
    """STREAMS, a user op probe over `state` buffers (state_and_op), SMALL, and a step that runs
    `look` (the probe's call) on comp2 after zero_grad (`clears`)."""
    return STREAMS + state_and_op + SMALL + f"""graph load[a, b] on trans  {{ copy batch -> x, y }}
graph zero_grad  on update {{ {clears} }}
graph pass       on comp1  {{ forward mlp; backward mlp }}
graph optimize   on update {{ sgd(mlp, lr, momentum = 0.9) }}
graph look       on comp2  {{ {look} }}
step train(slot) {{ upload lr on trans; zero_grad; look; pass(load[slot]); load[next]; optimize }}
train {{
    model    = mlp
    data     = digits(test = 0.2, seed = 0)
    epochs   = 1
    lr       = 0.05
    capture  = graphs
}}
"""


EPILOGUE_STATE = _probe_program("""state { a : f32[16, 16] = ones
        w : f32[16, 10] = ones
        bb : f32[10] = ones
        t : f32[16, 10]
        h : f32[16, 10]
        r : f32[16, 10] }
op probe(a : f32[16, 16], w : f32[16, 10], bb : f32[10], t : f32[16, 10], h : f32[16, 10], r : f32[16, 10]) -> (t, h, r) on comp2 {
    t = matmul(a, w)
    h = t + bb
    r = relu(h)
}
""", "probe(a, w, bb, t, h, r)")

GATED_STATE = _probe_program("""state { a : f32[16, 16] = ones
        w : f32[16, 10] = ones
        yv : f32[16, 10] = ones
        t : f32[16, 10]
        r : f32[16, 10] }
op probe(a : f32[16, 16], w : f32[16, 10], yv : f32[16, 10], t : f32[16, 10], r : f32[16, 10]) -> (t, r) on comp2 {
    t = matmul(a, w)
    r = relu_grad(t, yv)
}
""", "probe(a, w, yv, t, r)", clears="clear grad(mlp); clear t")


@pytest.mark.parametrize("text", [EPILOGUE_STATE, GATED_STATE], ids=["epilogue", "gated"])
def test_an_epilogue_never_folds_away_a_state_the_run_returns(tmp_path, text):
    """A user op whose matmul (and bias add) write state buffers: the epilogue and the gated
    product would not write them, so they stay unfused, and a clear of such a state is decided on
    the writes that remain (a breaker's case: t and h came back 0 fused, 16 and 17 unfused)."""
    p = tmp_path / "s.sched"
    p.write_text(text)
    fused, plain = compile_file(str(p)), compile_file(str(p), fuse=False)
    assert fused.ok and plain.ok
    assert any(t.kernel == "matmul" and t.outs == ("t",) for t in fused.schedule.tasks)
    for steps in (1, 2):
        assert outcome(fused, max_steps=steps) == outcome(plain, max_steps=steps)


@pytest.mark.parametrize("var", ["STREAMSCHED_DEAD_FILLS", "STREAMSCHED_SPLIT_UPDATES", "STREAMSCHED_HEAVY_IN_TURN",
                                 "STREAMSCHED_CRITICAL_FIRST", "STREAMSCHED_BN_EPILOGUES"])
def test_a_switch_that_says_something_else_is_refused_before_a_run(tmp_path, var):
    """`streamsched run` refuses a rule's switch set to anything but 1 or 0 with X004 and exit
    status 1, before any work (no traceback, nothing written); `check` reads it as the default."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), **{var: "yes"})
    path = os.path.join(ROOT, "examples", "mlp_digits.sched")
    run = subprocess.run([sys.executable, "-m", "streamsched", "run", path, "--epochs", "1"], capture_output=True,
                         text=True, env=env, cwd=str(tmp_path))
    assert run.returncode == 1 and f"error[X004]: ${var}: `yes` is not 1 or 0" in run.stderr + run.stdout
    assert "Traceback" not in run.stderr and list(tmp_path.iterdir()) == []
    chk = subprocess.run([sys.executable, "-m", "streamsched", "check", path], capture_output=True, text=True,
                         env=env, cwd=str(tmp_path))
    assert chk.returncode == 0, chk.stderr
