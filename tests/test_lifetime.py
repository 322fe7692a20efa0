"""R005, the value-lifetime check: `into` is an optimisation, never a change of meaning.

The property test runs random straight-line schedules twice in an independent little machine of
its own: once with the planned storage (aliases share bytes), once with every buffer in storage of
its own (every `into` removed).  Each write stores a token unique to (task, buffer); each read
records what it saw.  The checker must report a destroyed value exactly when the two runs
disagree.  The file cases below are the adversarial constructions a user writes."""

from __future__ import annotations

import os
import subprocess
import sys

from hypothesis import given, settings, strategies as st

from streamsched.interp.ir import Buffer, Schedule, Task
from streamsched.interp.lifetime import check_lifetimes
from streamsched.interp.memory import plan_memory
from streamsched.pipeline import check_file

# -- the property --------------------------------------------------------------------------------

NAMES = ["a", "b", "c", "d", "e"]


@st.composite
def schedules(draw):
    """Buffers a..e of 1-4 elements, some aliasing an earlier one (never larger than it), and 1-12
    tasks reading and writing random names, none writing a buffer that shares bytes with one it
    reads under another name (that is the in-place rule, checked apart)."""
    bufs = []
    for i, n in enumerate(NAMES):
        size = draw(st.integers(1, 4))
        alias = None
        if i and draw(st.booleans()):
            tgt = draw(st.sampled_from(bufs))
            root = tgt
            while root.alias_of:
                root = next(b for b in bufs if b.name == root.alias_of)
            alias, size = root.name, min(size, root.shape[0])
        bufs.append(Buffer(n, (size,), "f32", alias_of=alias))
    planned = plan_memory(bufs)
    by = {b.name: b for b in planned}

    def overlap(x, y):
        return by[x].overlaps(by[y])

    tasks = []
    for tid in range(draw(st.integers(1, 12))):
        reads = tuple(sorted(set(draw(st.lists(st.sampled_from(NAMES), max_size=2)))))
        cand = [n for n in NAMES if not any(overlap(n, r) and n != r for r in reads)]
        if not cand:
            continue
        writes = tuple(sorted(set(draw(st.lists(st.sampled_from(cand), min_size=1, max_size=2)))))
        if any(overlap(w1, w2) for w1 in writes for w2 in writes if w1 < w2):
            writes = writes[:1]
        tasks.append(Task(len(tasks), "op", "s", reads, writes, step=0, label=f"t{len(tasks)}"))
    return Schedule(("s", "host"), planned, tuple(tasks))


def _run(schedule: Schedule, shared: bool) -> list:
    """What every read sees, and the final values; storage is byte-exact when `shared`."""
    bufs = schedule.buffer_map()
    cell: dict = {}

    def cells(name):
        b = bufs[name]
        if shared:
            return [("mem", b.offset + i) for i in range(b.nbytes)]
        return [(name, i) for i in range(b.nbytes)]

    for b in schedule.buffers:
        if b.alias_of is None:  # (an alias is never read before it is written: _initial_ok)
            for c in cells(b.name):
                cell[c] = ("init", b.name)
    seen = []
    for t in schedule.tasks:
        for r in t.reads:
            seen.append((t.id, r, tuple(cell.get(c) for c in cells(r))))
        for w in t.writes:
            for c in cells(w):
                cell[c] = (t.id, w)
    final = [(n, tuple(cell.get(c) for c in cells(n))) for n in NAMES]
    return seen + final


def _initial_ok(schedule: Schedule) -> bool:
    """Reads of a value nothing produced are S022's business, not R005's: keep only schedules
    whose every read (and final read) is of a root buffer or of a name written before."""
    written = {b.name for b in schedule.buffers if b.alias_of is None}
    for t in schedule.tasks:
        if any(r not in written for r in t.reads):
            return False
        written |= set(t.writes)
    return all(n in written for n in NAMES)


_SEEN = {True: 0, False: 0}


@settings(max_examples=300, deadline=None)
@given(schedules())
def test_r005_exactly_when_sharing_storage_changes_what_is_read(schedule):
    if not _initial_ok(schedule):
        return
    roots = {b.name for b in schedule.buffers if b.alias_of is None}
    diags = [d for d in check_lifetimes(schedule, initialized=roots, at_end=tuple(NAMES)) if d.code == "R005"]
    same = _run(schedule, shared=True) == _run(schedule, shared=False)
    _SEEN[bool(diags)] += 1
    assert (not diags) == same, ([d.message for d in diags], [(t.reads, t.writes) for t in schedule.tasks],
                                 [(b.name, b.alias_of, b.offset, b.nbytes) for b in schedule.buffers])


def test_the_property_saw_both_verdicts():
    """Not vacuous: among the generated schedules some destroy a value and some do not."""
    test_r005_exactly_when_sharing_storage_changes_what_is_read()
    assert _SEEN[True] >= 20 and _SEEN[False] >= 20, _SEEN


# -- adversarial files ---------------------------------------------------------------------------

STREAMS = """streams {
    trans  : copy
    comp1  : compute
    comp2  : compute
    comp3  : compute
    update : update
}
"""
REST = """graph load[a, b] on trans  { copy batch -> x, y }
graph zero_grad  on update { clear grad(mlp) }
graph pass       on comp1  { forward mlp; backward mlp }
graph optimize   on update { sgd(mlp, lr, momentum = 0.9) }
step train(slot) {
    upload lr on trans
    zero_grad
    pass(load[slot])
    load[next]
    optimize
}
train { model = mlp; data = digits(test = 0.2, seed = 0); epochs = 1; lr = 0.05 }
"""


def _model(lines: str) -> str:
    return "model mlp(batch = 16, hidden = 16) {\n    input x : f32[batch, 64]\n    input y : i32[batch]\n" + lines + "}\n"


CASES = {
    # a chain of in-place results: the last one holds the value everyone reads
    "chain": ("op f(x) -> y on comp3 {\n    t = relu(x) into x\n    y = tanh(t) into t\n}\n"
              "op f.backward(dy, y) -> dx on comp3 {\n    dx = tanh_grad(dy, y)\n}\n",
              "    h1 = linear(x, hidden)\n    a1 = f(h1)\n    logits = linear(a1, 10)\n"
              "    loss = softmax_cross_entropy(logits, y)\n", []),
    # a parameter overwritten by its own op: the backward and the optimizer still read it
    "into_param": ("op sc(x : f32[n, k], param w : f32[n, k] = ones) -> y on comp3 {\n    y = mul(x, w) into w\n}\n"
                   "op sc.backward(dy, x, w) -> (dx, dw) on comp3 {\n    dx = mul(dy, w)\n    dw = mul(dy, x)\n}\n",
                   "    h1 = linear(x, hidden)\n    a1 = sc(h1)\n    logits = linear(a1, 10)\n"
                   "    loss = softmax_cross_entropy(logits, y)\n", ["R005"]),
    # two users of one value, the first in place
    "two_users": ("", "    h1 = linear(x, hidden)\n    a1 = relu(h1) into h1\n    b1 = tanh(h1)\n    s = add(a1, b1)\n"
                      "    logits = linear(s, 10)\n    loss = softmax_cross_entropy(logits, y)\n", ["R005"]),
    # a reduction into what it reads (partial overlap), which a later line also reads
    "sum_into_self": ("op rs(x : f32[n, k]) -> y : f32[n] on comp2 {\n    y = sum(x, axis = 1) into x\n}\n"
                      "op rs.backward(dy, x) -> dx on comp2 {\n    dx = x * 0.0\n}\n",
                      "    h1 = linear(x, hidden)\n    r = rs(h1)\n    logits = linear(h1, 10)\n"
                      "    loss = softmax_cross_entropy(logits, y)\n", ["R005"]),
    # the loss itself placed in another value's storage: the loop reads `loss`, nobody reads l0
    "loss_in_place": ("op half(x) -> y on comp1 {\n    y = x * 0.5 into x\n}\nop half.backward(dy) -> dx on comp1 {\n"
                      "    dx = dy * 0.5\n}\n",
                      "    h1 = linear(x, hidden)\n    logits = linear(h1, 10)\n    l0 = softmax_cross_entropy(logits, y)\n"
                      "    loss = half(l0)\n", []),
    # a cast into its own (wider) input: overlapping, not the same array
    "cast_into_self": ("op c16(x) -> y on comp3 {\n    y = cast(x, dtype = \"f16\") into x\n}\n"
                       "op c16.backward(dy) -> dx on comp3 {\n    dx = cast(dy, dtype = \"f32\")\n}\n",
                       "    h1 = linear(x, hidden)\n    a1 = relu(h1)\n    c = c16(a1)\n    logits = linear(a1, 10)\n"
                       "    loss = softmax_cross_entropy(logits, y)\n", ["R005"]),
}


def _check(tmp_path, name):
    ops, lines, _ = CASES[name]
    p = tmp_path / f"{name}.sched"
    p.write_text(STREAMS + ops + _model(lines) + REST, encoding="utf-8")
    return sorted({d.code for d in check_file(str(p)) if d.severity == "error"})


def test_adversarial_into_files(tmp_path):
    got = {n: _check(tmp_path, n) for n in CASES}
    assert got == {n: sorted(set(c[2])) for n, c in CASES.items()}


def test_unused_op_with_into_is_not_reported(tmp_path):
    """A lifetime is a property of the values a step computes: an op no model calls has none."""
    p = tmp_path / "u.sched"
    p.write_text(STREAMS + "op rs(x : f32[n, k]) -> y : f32[n] on comp2 {\n    y = sum(x, axis = 1) into x\n}\n"
                 + _model("    h1 = linear(x, hidden)\n    logits = linear(h1, 10)\n"
                          "    loss = softmax_cross_entropy(logits, y)\n") + REST, encoding="utf-8")
    assert [d.code for d in check_file(str(p)) if d.severity == "error"] == []


def test_check_cli_exit_status_on_r005(tmp_path):
    ops, lines, _ = CASES["two_users"]
    p = tmp_path / "two.sched"
    p.write_text(STREAMS + ops + _model(lines) + REST, encoding="utf-8")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "streamsched", "check", str(p)], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "error[R005]" in r.stderr and "Traceback" not in r.stderr
