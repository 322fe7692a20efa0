"""CPU backend and memory planning: hand-built Schedules and EventPlans (no barrier pass), a
stand-in kernel table, and an independent happens-before oracle for the race detector."""

from __future__ import annotations

import re

import numpy as np
import pytest

from streamsched.diagnostics import InternalError
from streamsched.interp.cpu_backend import CpuExecutor, PlanDeadlock, TaskFailed
from streamsched.interp.ir import HOST, Buffer, Instr, Schedule, Task
from streamsched.interp.memory import allocate_arrays, plan_memory
from streamsched.stdlib.kernel_record import Kernel

# ---------------------------------------------------------------------------------------------
# Stand-in kernels


def _same(types, attrs):
    return [types[0]]


def _iota(ins, outs, attrs):
    outs[0][...] = np.arange(outs[0].size, dtype=outs[0].dtype).reshape(outs[0].shape) * attrs["scale"]


def _add1(ins, outs, attrs):
    np.add(ins[0], 1, out=outs[0])


def _mul2(ins, outs, attrs):
    np.multiply(ins[0], 2, out=outs[0])


def _add(ins, outs, attrs):
    np.add(ins[0], ins[1], out=outs[0])


def _copy(ins, outs, attrs):
    outs[0][...] = ins[0]


def _mix(ins, outs, attrs):
    acc = np.full(outs[0].shape, attrs["k"], dtype=outs[0].dtype)
    for a in ins:
        acc = acc * 0.5 + np.resize(a, acc.shape)  # a temporary: in-place outs stay correct
    outs[0][...] = acc


def _boom(ins, outs, attrs):
    raise ValueError("kernel exploded")


def _k(name, n_in, fn, **kw):
    return Kernel(name, tuple(f"i{i}" for i in range(n_in)), ("out",), _same, fn, **kw)


KERNELS = {
    "iota": _k("iota", 0, _iota, attrs={"scale": 1.0}),
    "add1": _k("add1", 1, _add1),
    "mul2": _k("mul2", 1, _mul2),
    "add": _k("add", 2, _add),
    "copy": _k("copy", 1, _copy),
    "mix": _k("mix", 3, _mix, attrs={"k": 0.0}),
    "boom": _k("boom", 0, _boom),
    "load": _k("load", 0, None, host=True, capturable=False),
}


def L(task: Task) -> Instr:
    return Instr("launch", task.stream, task=task.id)


def R(stream: str, e: int) -> Instr:
    return Instr("record", stream, event=e)


def W(stream: str, e: int) -> Instr:
    return Instr("wait", stream, event=e)


def sched(streams, buffers, tasks) -> Schedule:
    return Schedule(tuple(streams) + (HOST,), plan_memory(buffers), tuple(tasks))


def executor(s: Schedule, **kw) -> CpuExecutor:
    return CpuExecutor(s, allocate_arrays(s.buffers), KERNELS, **kw)


# ---------------------------------------------------------------------------------------------
# Memory planning


def test_plan_memory_offsets_alignment_aliases():
    bufs = [
        Buffer("a", (3,), "f32"),
        Buffer("c", (4,), "f32", alias_of="b"),  # alias declared before its target
        Buffer("b", (10,), "f64"),
        Buffer("h", (5,), "u8", space="host"),
        Buffer("d", (), "i32"),
        Buffer("e", (2,), "f16", alias_of="c"),  # alias of an alias
    ]
    p = {b.name: b for b in plan_memory(bufs)}
    assert [b.name for b in plan_memory(bufs)] == [b.name for b in bufs]
    assert (p["a"].offset, p["a"].nbytes) == (0, 12)
    assert (p["b"].offset, p["b"].nbytes) == (256, 80)
    assert (p["d"].offset, p["d"].nbytes) == (512, 4)
    assert (p["h"].offset, p["h"].nbytes) == (0, 5)  # its own arena
    assert (p["c"].offset, p["c"].nbytes) == (256, 16)
    assert (p["e"].offset, p["e"].nbytes) == (256, 4)
    assert plan_memory(bufs) == plan_memory(bufs)
    q = {b.name: b for b in plan_memory(bufs, align=64)}
    assert q["b"].offset == 64 and q["d"].offset == 192
    assert all(b.offset % 64 == 0 for b in q.values())
    assert p["c"].overlaps(p["b"]) and not p["a"].overlaps(p["b"]) and not p["h"].overlaps(p["a"])


def test_plan_memory_errors():
    with pytest.raises(ValueError, match=r"`big`.*`small`"):
        plan_memory([Buffer("small", (2,), "f32"), Buffer("big", (3,), "f32", alias_of="small")])
    with pytest.raises(ValueError, match="nope"):
        plan_memory([Buffer("v", (2,), "f32", alias_of="nope")])
    with pytest.raises(ValueError, match="cycle"):
        plan_memory([Buffer("p", (1,), "f32", alias_of="q"), Buffer("q", (1,), "f32", alias_of="p")])
    with pytest.raises(ValueError, match="twice"):
        plan_memory([Buffer("p", (1,), "f32"), Buffer("p", (1,), "f32")])
    with pytest.raises(ValueError, match="space"):
        plan_memory([Buffer("p", (4,), "f32"), Buffer("q", (1,), "f32", space="host", alias_of="p")])
    with pytest.raises(ValueError):
        plan_memory([Buffer("p", (1,), "f32")], align=0)


def test_allocate_arrays_typed_views_share_alias_storage():
    bufs = plan_memory(
        [
            Buffer("a", (2, 3), "f32"),
            Buffer("b", (4,), "f64"),
            Buffer("c", (4,), "f32", alias_of="b"),
            Buffer("m", (3,), "bool"),
            Buffer("h", (2,), "i64", space="host"),
        ]
    )
    arr = allocate_arrays(bufs)
    assert arr["a"].shape == (2, 3) and arr["a"].dtype == np.float32
    assert arr["b"].dtype == np.float64 and arr["m"].dtype == np.bool_ and arr["h"].dtype == np.int64
    assert all(not x.any() for x in arr.values())  # zeroed arenas
    assert np.shares_memory(arr["b"], arr["c"])
    assert not np.shares_memory(arr["a"], arr["b"]) and not np.shares_memory(arr["h"], arr["a"])
    arr["b"][:2] = [1.5, -2.25]
    assert arr["c"].tobytes() == arr["b"][:2].tobytes()
    arr["a"][...] = 7
    assert arr["b"][0] == 1.5  # neighbours untouched
    with pytest.raises(ValueError, match="plan_memory"):
        allocate_arrays([Buffer("u", (2,), "f32")])
    with pytest.raises(ValueError, match="bf16"):
        allocate_arrays(plan_memory([Buffer("z", (2,), "bf16")]))


# ---------------------------------------------------------------------------------------------
# Fork / join


def fork_join():
    s = sched(
        ("main", "s1", "s2"),
        [Buffer(n, (64,), "f32") for n in "xabc"],
        [
            Task(0, "iota", "main", outs=("x",), label="t0", stmt="x"),
            Task(1, "add1", "s1", args=("x",), outs=("a",), label="t1", stmt="a"),
            Task(2, "mul2", "s2", args=("x",), outs=("b",), label="t2", stmt="b"),
            Task(3, "add", "main", args=("a", "b"), outs=("c",), label="t3", stmt="c"),
        ],
    )
    t = s.tasks
    instrs = [
        L(t[0]), R("main", 0),
        W("s1", 0), L(t[1]), R("s1", 1),
        W("s2", 0), L(t[2]), R("s2", 2),
        W("main", 1), W("main", 2), L(t[3]),
    ]  # fmt: skip
    return s, instrs


def test_fixed_order_is_issue_order():
    s, instrs = fork_join()
    ex = executor(s)
    ex.run(instrs)
    assert ex.executed == [0, 1, 2, 3]
    x = np.arange(64, dtype=np.float32)
    assert np.array_equal(ex.arrays["c"], (x + 1) + 2 * x)
    assert ex.races == []


def test_correct_plan_bitwise_identical_over_random_interleavings():
    s, instrs = fork_join()
    ref = executor(s)
    ref.run(instrs)
    ref.run(instrs)  # a second step: t0 rewrites x after the join (WAR across runs)
    orders = set()
    for seed in range(50):
        ex = executor(s, interleave="random", seed=seed)
        ex.run(instrs)
        ex.run(instrs)
        assert ex.races == [], seed
        orders.add(tuple(ex.executed))
        for name in "xabc":
            assert ex.arrays[name].tobytes() == ref.arrays[name].tobytes(), (seed, name)
    assert len(orders) > 1  # the interleavings really differ


def test_random_interleaving_is_seeded():
    s, instrs = fork_join()
    runs = []
    for _ in range(2):
        ex = executor(s, interleave="random", seed=7)
        for _ in range(5):
            ex.run(instrs)
        runs.append(ex.executed)
    assert runs[0] == runs[1]


def test_missing_wait_reported_in_every_interleaving():
    s, instrs = fork_join()
    broken = [i for i in instrs if not (i.op == "wait" and i.stream == "main" and i.event == 1)]
    assert len(broken) == len(instrs) - 1
    x = np.arange(64, dtype=np.float32)
    want = ((x + 1) + 2 * x).tobytes()
    right = wrong = 0
    for seed in range(50):
        ex = executor(s, interleave="random", seed=seed)
        ex.run(broken)
        if ex.arrays["c"].tobytes() == want:
            right += 1
        else:
            wrong += 1
        assert len(ex.races) == 1, (seed, ex.races)
        d = ex.races[0]
        assert d.code == "R001"
        assert d.message.startswith("race on buffer `a` (RAW)")
        assert "`t3` on main is not ordered after `t1` on s1" in d.message
        assert d.help == "add `after a` to the later statement"
    assert right and wrong  # caught even when the values came out right
    ex = executor(s)  # fixed order: values right, race still reported
    ex.run(broken)
    assert ex.arrays["c"].tobytes() == want and [d.code for d in ex.races] == ["R001"]


def test_races_deduplicated_across_steps_and_off_switch():
    s, instrs = fork_join()
    broken = [i for i in instrs if not (i.op == "wait" and i.stream == "main" and i.event == 1)]
    ex = executor(s, interleave="random", seed=3)
    ex.run(broken)
    ex.run(broken)
    # Step 2's t0 rewrites x while step 1's t1 (s1) may still read it: main never joined s1.
    want = {
        "race on buffer `a` (RAW): `t3` on main is not ordered after `t1` on s1",
        "race on buffer `x` (WAR): `t0` on main is not ordered after `t1` on s1",
    }
    assert {d.message for d in ex.races} == want and len(ex.races) == 2
    for _ in range(3):
        ex.run(broken)
    assert len(ex.races) == 2  # one report per (earlier key, later key, buffer), not per step
    ex = executor(s, detect_races=False)
    ex.run(broken)
    assert ex.races == [] and ex.executed == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------
# Byte ranges


def test_alias_conflicts_by_bytes_not_names():
    s = sched(
        ("s1", "s2"),
        [
            Buffer("base", (16,), "f32"),
            Buffer("view", (8,), "f32", alias_of="base"),
            Buffer("other", (16,), "f32"),
            Buffer("out", (8,), "f32"),
        ],
        [
            Task(0, "iota", "s1", outs=("base",), label="w"),
            Task(1, "add1", "s2", args=("view",), outs=("out",), label="r"),
            Task(2, "iota", "s2", outs=("other",), label="o"),
        ],
    )
    t = s.tasks
    ex = executor(s)
    ex.run([L(t[0]), L(t[1])])
    assert [d.message.split(":")[0] for d in ex.races] == ["race on buffer `base` (RAW)"]
    ex = executor(s)
    ex.run([L(t[0]), L(t[2])])  # disjoint bytes on two streams: fine
    assert ex.races == []
    ex = executor(s)
    ex.run([L(t[1]), L(t[0])])  # issued the other way round: the write comes second (WAR)
    assert [d.message.split(":")[0] for d in ex.races] == ["race on buffer `base` (WAR)"]


# ---------------------------------------------------------------------------------------------
# Event binding


def binding_schedule():
    return sched(
        ("s1", "s2"),
        [Buffer(n, (8,), "f32") for n in "xyz"],
        [
            Task(0, "iota", "s1", outs=("x",), label="t0"),
            Task(1, "add1", "s2", args=("x",), outs=("y",), label="t1"),
            Task(2, "iota", "s1", outs=("z",), label="t2", attrs=(("scale", 3.0),)),
        ],
    )


def test_wait_binds_to_record_from_previous_run():
    s = binding_schedule()
    t = s.tasks
    ex = executor(s)
    ex.run([L(t[0]), R("s1", 0)])
    # This wait binds to the record of the first run, not to the later record in this run.
    ex.run([W("s2", 0), L(t[1]), L(t[2]), R("s1", 0)])
    assert ex.executed == [0, 1, 2]
    assert np.array_equal(ex.arrays["y"], np.arange(8) + 1)
    assert np.array_equal(ex.arrays["z"], np.arange(8) * 3.0)  # task attrs override defaults
    assert ex.races == []
    for seed in range(20):
        ex = executor(s, interleave="random", seed=seed)
        ex.run([L(t[0]), R("s1", 0)])
        ex.run([W("s2", 0), L(t[1]), L(t[2]), R("s1", 0)])
        assert ex.races == [] and np.array_equal(ex.arrays["y"], np.arange(8) + 1)


def test_wait_on_never_recorded_event_does_not_block():
    s = binding_schedule()
    ex = executor(s)
    ex.run([W("s1", 5), L(s.tasks[0])])
    assert ex.executed == [0]


def test_wait_issued_before_its_record_waits_for_nothing():
    s = binding_schedule()
    t = s.tasks
    ex = executor(s)
    ex.run([W("s2", 0), L(t[1]), L(t[0]), R("s1", 0)])
    assert ex.executed == [1, 0]
    assert [d.message.split(":")[0] for d in ex.races] == ["race on buffer `x` (WAR)"]


def test_deadlock_on_record_that_never_runs():
    s = sched(
        ("s1", "s2"),
        [Buffer("x", (4,), "f32"), Buffer("y", (4,), "f32")],
        [Task(0, "boom", "s1", outs=("x",)), Task(1, "add1", "s2", args=("x",), outs=("y",))],
    )
    ex = executor(s)
    with pytest.raises(TaskFailed):
        ex.run([L(s.tasks[0]), R("s1", 0)])  # the record after the failed task is discarded
    with pytest.raises(PlanDeadlock) as info:
        ex.run([W("s2", 0), L(s.tasks[1])])
    assert isinstance(info.value, InternalError)
    assert info.value.stuck == (W("s2", 0),)
    assert "wait e0 on s2" in str(info.value) and "discarded" in str(info.value)


def test_malformed_instructions_are_internal_errors():
    s = binding_schedule()
    ex = executor(s)
    with pytest.raises(InternalError):
        ex.run([Instr("launch", "s2", task=0)])  # task 0 belongs to s1
    with pytest.raises(InternalError):
        ex.run([Instr("launch", "s1", task=99)])
    with pytest.raises(InternalError):
        ex.run([Instr("jump", "s1")])
    with pytest.raises(ValueError):
        executor(s, interleave="sometimes")


# ---------------------------------------------------------------------------------------------
# Host work and failures


def host_schedule():
    return sched(
        ("s1",),
        [Buffer("stage", (8,), "f32", space="host", kind="staging"), Buffer("x", (8,), "f32")],
        [
            Task(0, "load", HOST, outs=("stage",), label="load", stmt="stage"),
            Task(1, "copy", "s1", args=("stage",), outs=("x",), label="h2d"),
        ],
    )


def test_host_fn_runs_host_kernels():
    s = host_schedule()
    t = s.tasks
    calls = []

    def host_fn(task, arrays):
        calls.append(task)
        arrays[task.outs[0]][...] = 7

    ex = executor(s)
    ex.run([L(t[0]), R(HOST, 0), W("s1", 0), L(t[1])], host_fn)
    assert calls == [t[0]]
    assert np.all(ex.arrays["x"] == 7) and ex.races == []
    ex = executor(s)
    ex.run([L(t[0]), L(t[1])], host_fn)  # no barrier between the host write and the copy
    assert len(ex.races) == 1 and "`h2d` on s1 is not ordered after `load` on host" in ex.races[0].message
    with pytest.raises(TaskFailed, match="host_fn"):
        executor(s).run([L(t[0])])


def test_task_failed_carries_task():
    s = sched(("s1",), [Buffer("x", (4,), "f32")], [Task(0, "boom", "s1", outs=("x",), label="kaboom")])
    ex = executor(s)
    with pytest.raises(TaskFailed) as info:
        ex.run([L(s.tasks[0])])
    assert info.value.task is s.tasks[0]
    assert isinstance(info.value.cause, ValueError) and info.value.__cause__ is info.value.cause
    assert "kaboom" in str(info.value)
    s2 = sched(("s1",), [Buffer("x", (4,), "f32")], [Task(0, "nosuch", "s1", outs=("x",))])
    with pytest.raises(TaskFailed) as info:
        executor(s2).run([L(s2.tasks[0])])
    assert isinstance(info.value.cause, KeyError)


# ---------------------------------------------------------------------------------------------
# Random plans against an independent happens-before oracle


def hb_oracle(instrs, n_tasks):
    """Task u HB task v: reachability over stream order + (latest earlier record -> wait)."""
    reach = []  # per instruction: bitset of instruction indices that happen before or equal it
    last_on, last_rec = {}, {}
    for i, ins in enumerate(instrs):
        r = 1 << i
        if ins.stream in last_on:
            r |= reach[last_on[ins.stream]]
        if ins.op == "wait" and ins.event in last_rec:
            r |= reach[last_rec[ins.event]]
        if ins.op == "record":
            last_rec[ins.event] = i
        last_on[ins.stream] = i
        reach.append(r)
    at = {ins.task: i for i, ins in enumerate(instrs) if ins.op == "launch"}
    return lambda u, v: bool(reach[at[v]] >> at[u] & 1)


def random_case(rng, drop):
    streams = ("s0", "s1", "s2")
    bufs = [Buffer(f"b{i}", (16,), "f64") for i in range(4)] + [Buffer("v", (8,), "f64", alias_of="b0")]
    s_bufs = plan_memory(bufs)
    bm = {b.name: b for b in s_bufs}
    names = list(bm)
    tasks = []
    for i in range(10):
        args = tuple(rng.choice(names, size=int(rng.integers(0, 3)), replace=False))
        out = str(rng.choice(names))
        tasks.append(Task(i, "mix", str(rng.choice(streams)), args=args + ("b3",) * (3 - len(args)),
                          outs=(out,), label=f"T{i}", attrs=(("k", float(i)),)))
    s = Schedule(streams + (HOST,), s_bufs, tuple(tasks))

    def conflict(u, v):
        ru = {(n, "w") for n in u.writes} | {(n, "r") for n in u.reads}
        rv = {(n, "w") for n in v.writes} | {(n, "r") for n in v.reads}
        return any((a == "w" or b == "w") and bm[x].overlaps(bm[y]) for x, a in ru for y, b in rv)

    instrs = []
    for v in tasks:  # naive barriers: wait on every earlier conflicting task on another stream
        for u in tasks[: v.id]:
            if u.stream != v.stream and conflict(u, v) and not rng.random() < drop:
                instrs.append(W(v.stream, u.id))
        instrs += [L(v), R(v.stream, v.id)]
    hb = hb_oracle(instrs, len(tasks))
    racy = {
        (u.id, v.id) for v in tasks for u in tasks[: v.id]
        if u.stream != v.stream and conflict(u, v) and not hb(u.id, v.id)
    }  # fmt: skip
    return s, instrs, racy


PAIR = re.compile(r"`T(\d+)` on \S+ is not ordered after `T(\d+)`")


def detector_oracle(s, instrs, executed):
    """The pairs the run-time detector promises for one execution order (cpu_backend.py: a
    FastTrack detector, Flanagan & Freund 2009): when a task runs, the accesses it is compared
    with are, per buffer name, the latest write and, per stream, the latest read since that
    write, of every buffer sharing bytes with what it touches (a read meets the writes, a write
    meets the writes and the reads); each of those on another stream that does not happen
    before it (`hb_oracle`) is a race.  FastTrack keeps only these, so a race with an access
    that a later write hid is found through that write instead: the pairs are a subset of all
    racy pairs, and some pair is found whenever one exists."""
    hb = hb_oracle(instrs, len(s.tasks))
    bm = {b.name: b for b in s.buffers}
    sharing = {n: [m for m in bm if bm[m].overlaps(bm[n])] for n in bm}
    last_write: dict[str, int] = {}
    reads: dict[str, dict[str, int]] = {}
    pairs = set()

    def meet(u, v):
        if s.tasks[u].stream != s.tasks[v].stream and not hb(u, v) and not hb(v, u):
            pairs.add((min(u, v), max(u, v)))

    for v in executed:
        t = s.tasks[v]
        for b in t.reads:
            for r in sharing[b]:
                if r in last_write:
                    meet(last_write[r], v)
            reads.setdefault(b, {})[t.stream] = v
        for b in t.writes:
            for r in sharing[b]:
                if r in last_write:
                    meet(last_write[r], v)
                for u in reads.get(r, {}).values():
                    meet(u, v)
            last_write[b] = v
            reads.pop(b, None)
    return pairs


@pytest.mark.parametrize("case", range(30))
def test_detector_matches_hb_oracle(case):
    """The races found are exactly those the detector's contract names for the order the tasks
    ran in (`detector_oracle`), all of them racy pairs by the happens-before oracle, and found
    whenever a racy pair exists; a race-free plan gives bitwise the same arrays in every
    interleaving."""
    rng = np.random.default_rng(1000 + case)
    s, instrs, racy = random_case(rng, drop=0.0 if case % 3 == 0 else 0.3)
    ref = None
    for seed in range(12):
        ex = executor(s, interleave="random" if seed else "fixed", seed=seed)
        ex.run(instrs)
        found = set()
        for d in ex.races:
            later, earlier = map(int, PAIR.search(d.message).groups())
            found.add((earlier, later))
        want = detector_oracle(s, instrs, ex.executed)
        assert found == want, (seed, sorted(found - want), sorted(want - found))
        assert want <= racy and bool(want) == bool(racy), (seed, racy)
        if not racy:
            got = {n: a.tobytes() for n, a in ex.arrays.items()}
            ref = ref or got
            assert got == ref, seed


# ---------------------------------------------------------------------------------------------
# The real kernel table: every kernel, launched by the executor, computes what a direct call does

# Kernels the executor never calls with `kernel.cpu`, and why.
NOT_CALLED = {
    "stage": "a host kernel: the training loop's host_fn fills the staging buffer (test_host_fn_runs_host_kernels)",
    "set_scalar": "a host kernel: the training loop's host_fn writes the scalar (test_host_fn_runs_host_kernels)",
}


def _kernel_calls() -> dict[str, tuple[str, list, dict]]:
    """A valid call of every kernel with a CPU kernel: the samples the kernel tests run
    (tests/test_kernels.py, tests/test_kernels_cnn.py, tests/test_kernels_transformer.py), each
    with attributes of its own."""
    from test_kernels import SAMPLES as core
    from test_kernels_cnn import SAMPLES as cnn
    from test_kernels_transformer import SAMPLES as transformer

    return {key: ("matmul" if key == "matmul_t" else key, ins, attrs)
            for key, (ins, attrs) in {**core, **cnn, **transformer}.items()}


CALLS = _kernel_calls()


def test_every_kernel_is_called_or_listed_with_its_reason():
    from streamsched.stdlib.kernels import KERNELS as table

    called = {name for name, _, _ in CALLS.values()}
    assert called.isdisjoint(NOT_CALLED)
    assert called | set(NOT_CALLED) == set(table)
    assert all(table[n].host and table[n].cpu is None for n in NOT_CALLED)


@pytest.mark.parametrize("key", sorted(CALLS))
def test_real_kernels_called_like_direct_calls(key):
    """One launch through the executor (arena views from plan_memory, the task's own attributes
    over the kernel's defaults) gives bitwise what calling the kernel directly gives."""
    from kernel_helpers import types_of

    from streamsched.stdlib.kernels import KERNELS as table, infer_types, numpy_dtype

    name, ins, attrs = CALLS[key]
    k = table[name]
    out_types = infer_types(name, types_of(ins), attrs)
    bufs = [Buffer(f"i{j}", tuple(a.shape), dt) for j, (a, (_, dt)) in enumerate(zip(ins, types_of(ins)))]
    bufs += [Buffer(f"o{j}", tuple(sh), dt) for j, (sh, dt) in enumerate(out_types)]
    planned = plan_memory(bufs)
    arrays = allocate_arrays(planned)
    for j, a in enumerate(ins):
        arrays[f"i{j}"][...] = a
    direct_ins = [a.copy() for a in ins]
    direct_outs = [np.zeros(sh, numpy_dtype(dt)) for sh, dt in out_types]
    k.cpu(direct_ins, direct_outs, {**k.attrs, **attrs})
    task = Task(0, name, "s1", args=tuple(f"i{j}" for j in range(len(ins))),
                outs=tuple(f"o{j}" for j in range(len(out_types))), attrs=tuple(attrs.items()))
    ex = CpuExecutor(Schedule(("s1", HOST), planned, (task,)), arrays, table)
    ex.run([L(task)])
    assert ex.executed == [0] and ex.races == []
    for j, want in enumerate(direct_ins):
        assert arrays[f"i{j}"].tobytes() == want.tobytes(), (key, f"input {j}")
    for j, want in enumerate(direct_outs):
        got = arrays[f"o{j}"]
        assert got.dtype == want.dtype and got.shape == want.shape, (key, j)
        assert got.tobytes() == want.tobytes(), (key, f"output {j}")
