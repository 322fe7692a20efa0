"""The fusion pass (interp/fuse.py) and its multi_tensor launches: a fused plan checks clean exactly
when the unfused one does, trains bitwise the same numbers on the CPU (the metamorphic property:
fusion on == fusion off, under every interleaving), folds exactly the runs its rule names (checked
against an independent recount here), and a fused task reads and writes exactly the union of its
parts.  The CUDA twin against the NumPy twin is in tests/test_cuda_fuse.py."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings

from sched_gen import programs
from streamsched.interp.fuse import fuse_tasks
from streamsched.interp.ir import HOST
from streamsched.pipeline import compile_file
from streamsched.stdlib.kernels import KERNELS
from streamsched.stdlib.kernels.multi_tensor import FUSIBLE, split
from test_fuse_schedule import _oracle_dead
from test_soundness_properties import clean, compile_text, differ, interleavings, outcome

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.sched")))


@pytest.fixture(autouse=True)
def _backward_epilogues_on(monkeypatch):
    """The backward GEMM epilogues are off by default (interp/fuse.backward_epilogues): these
    tests prove the rule with them on."""
    monkeypatch.setenv("STREAMSCHED_BWD_EPILOGUES", "1")


def _recount(schedule) -> int:
    """Tasks the rule folds away, counted independently: adjacent tasks of one fusible kernel,
    stream, unit, step, launch and attributes (fill's shape and dtype aside), sharing the shared
    scalars, each with tensors of its own; the GEMM epilogues forward, and backward (a GEMM, its
    activation gradient next, the bias gradient the first later sum of that, nothing between
    touching what it reads or writes; relu only where the forward relu fused), and a GEMM with
    relu_grad next that the backward epilogues left (the gated product), and a GEMM with its bias
    add next and no activation after (gemm_bias); the batch-norm epilogues (bn + relu, bn + add +
    relu, relu_grad + the batch-norm gradient) where each intermediate has one reader kind."""
    def sig(t):
        si, so = FUSIBLE[t.kernel]
        at = tuple(sorted((k, v) for k, v in t.attrs if not (t.kernel == "fill" and k in ("shape", "dtype"))))
        return (t.kernel, t.stream, t.unit, t.step, t.slot, t.launch, at, len(t.args), len(t.outs),
                tuple(t.args[i] for i in si), tuple(t.outs[i] for i in so))

    folded, prev = 0, None
    tasks = list(schedule.tasks)
    pairs = {i + 1 for i in range(len(tasks) - 1)
             if tasks[i].kernel == "softmax_xent" and tasks[i + 1].kernel == "softmax_xent_grad"
             and tasks[i].stream == tasks[i + 1].stream and tasks[i + 1].args[1:] == tasks[i].args}
    folded += len(pairs)
    readers = {}
    for t in tasks:
        for a in t.args:
            readers.setdefault(a, set()).add(t.kernel)
    relu_out, triple = set(), set()
    for i in range(len(tasks) - 2):
        a, b, c = tasks[i:i + 3]
        if a.kernel == "matmul" and not any(v for _, v in a.attrs) and b.kernel == "add" and c.kernel in ("relu", "gelu") \
                and b.args[0] == a.outs[0] and c.args == b.outs and readers[a.outs[0]] == {"add"} \
                and (c.kernel == "gelu" or readers[b.outs[0]] == {"relu"}) and len(set((u.unit, u.step) for u in (a, b, c))) == 1 \
                and (schedule.policy != "explicit" or a.stream == b.stream == c.stream):
            folded += 2
            if c.kernel == "relu":
                relu_out.add(c.outs[0])
            triple.add(i)
    bias_shape = {b.name: b.shape for b in schedule.buffers}
    for i in range(len(tasks) - 1):  # a bias add with no activation the epilogue takes next
        a, b = tasks[i:i + 2]
        c = tasks[i + 2] if i + 2 < len(tasks) else None
        if i in triple or a.kernel != "matmul" or any(v for _, v in a.attrs) or b.kernel != "add" \
                or b.args[0] != a.outs[0] or readers[a.outs[0]] != {"add"} or (a.unit, a.step, a.launch) != (b.unit, b.step, b.launch) \
                or bias_shape[b.args[1]] != bias_shape[a.outs[0]][1:]:
            continue
        if c is not None and c.kernel in ("relu", "gelu") and c.args == b.outs and (c.unit, c.step) == (a.unit, a.step):
            continue  # the triple's rule decides (it may keep them apart)
        if schedule.policy == "explicit" and a.stream != b.stream:
            continue
        if b.site is not None and b.site.placed and b.stream != a.stream:
            continue
        folded += 1
    writers = {}
    for t in tasks:
        for o in t.outs:
            writers.setdefault(o, set()).add(t.kernel)
    reach, bwd = -1, set()
    for i in range(len(tasks) - 2):
        a, b = tasks[i], tasks[i + 1]
        if i <= reach or a.kernel != "matmul" or b.kernel not in ("relu_grad", "gelu_grad") or b.args[0] != a.outs[0] \
                or readers[a.outs[0]] != {b.kernel} or (a.unit, a.step, a.launch) != (b.unit, b.step, b.launch):
            continue
        if b.kernel == "relu_grad" and (b.args[1] not in relu_out or writers[b.args[1]] != {"relu"}):
            continue
        later = [j for j in range(i + 2, len(tasks)) if b.outs[0] in tasks[j].args and tasks[j].kernel == "sum"]
        if not later or tasks[later[0]].attr("axis") != 0:
            continue
        c = tasks[later[0]]
        if (c.unit, c.step, c.launch) != (a.unit, a.step, a.launch) or (schedule.policy == "explicit" and
                                                                         not a.stream == b.stream == c.stream):
            continue
        if any(u.site is not None and u.site.placed and u.stream != a.stream for u in (b, c)):
            continue  # the user's stream for it (five_streams writes its linear.backward out)
        between = tasks[i + 2:later[0]]
        if any(set(u.outs) & {b.outs[0], c.outs[0]} or c.outs[0] in u.args for u in between):
            continue
        folded += 2
        reach = later[0]
        bwd.add(i)
    for i in range(len(tasks) - 1):  # gated products: what the backward epilogues leave
        a, b = tasks[i], tasks[i + 1]
        if i in bwd or a.kernel != "matmul" or b.kernel != "relu_grad" or b.args[0] != a.outs[0] \
                or readers[a.outs[0]] != {"relu_grad"} or (a.unit, a.step, a.launch) != (b.unit, b.step, b.launch):
            continue
        if (schedule.policy == "explicit" and a.stream != b.stream) or (
                b.site is not None and b.site.placed and b.stream != a.stream):
            continue
        folded += 1
    # batch-norm epilogues: a batch norm's y read only by one relu (or by one add whose sum only
    # one relu reads), and a relu gradient read only by one batch-norm gradient as its dy
    def apart(u, v):
        return (schedule.policy == "explicit" and u.stream != v.stream) or (
            v.site is not None and v.site.placed and u.stream != v.stream)

    one = {}
    for t in tasks:
        for a in t.args:
            one.setdefault(a, []).append(t)
    for a in tasks:
        if a.kernel == "batchnorm_train" and not a.attr("sync", False):
            rs = one.get(a.outs[0], [])
            if readers.get(a.outs[0]) == {"relu"} and all(not apart(a, r) for r in rs):
                folded += 1
            elif readers.get(a.outs[0]) == {"add"} and all(readers.get(r.outs[0]) == {"relu"} for r in rs) \
                    and all(not apart(a, r) for r in rs) and all(not apart(a, q) for r in rs for q in one[r.outs[0]]):
                folded += 2
        elif a.kernel == "relu_grad" and readers.get(a.outs[0]) == {"batchnorm_grad"} and \
                all(r.args[0] == a.outs[0] and not r.attr("sync", False) and not apart(r, a) for r in one[a.outs[0]]):
            folded += 1
    for t in schedule.tasks:
        if t.id in pairs:
            continue
        s = sig(t) if t.kernel in FUSIBLE and t.stream != HOST else None
        if s is not None and s == prev:
            folded += 1
        prev = s
    return folded


def _user_kernels(c) -> set[str]:
    return {k for k, v in c.program.kernels.items() if KERNELS.get(k) is not v}


def _split_runs(schedule) -> int:
    """Update runs the rule made two launches: adjacent multi_tensor tasks of one `*_step` base
    on one stream, unit, step and launch."""
    ts = schedule.tasks
    return sum(1 for a, b in zip(ts, ts[1:]) if a.kernel == b.kernel == "multi_tensor"
               and a.attr("base") == b.attr("base") and str(a.attr("base")).endswith("_step")
               and (a.stream, a.unit, a.step, a.launch) == (b.stream, b.unit, b.step, b.launch))


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_examples_fuse_check_clean_and_fold_what_the_rule_names(path):
    fused, plain = compile_file(path), compile_file(path, fuse=False)
    assert fused.ok and plain.ok
    assert [d.code for d in fused.diagnostics] == [d.code for d in plain.diagnostics]
    assert plain.fused == 0 and len(plain.schedule.tasks) == len(fused.schedule.tasks) + fused.fused
    dead = _oracle_dead(plain.schedule, _user_kernels(plain))  # dead clears (tests/test_fuse_schedule.py)
    live = replace(plain.schedule, tasks=tuple(replace(t, id=i) for i, t in enumerate(
        t for t in plain.schedule.tasks if t.id not in dead)))  # (_recount indexes tasks by id)
    assert fused.fused == _recount(live) + len(dead) - _split_runs(fused.schedule) > 0
    parts = {}
    assert sum(t.kernel == "softmax_xent_fused" for t in fused.schedule.tasks) == \
        sum(t.kernel == "softmax_xent" for t in plain.schedule.tasks) > 0
    for t in fused.schedule.tasks:
        assert t.id == fused.schedule.tasks.index(t)
        if t.kernel == "multi_tensor":
            base = t.attr("base")
            assert base in FUSIBLE and len(t.attr("parts")) >= 2
            parts[base] = parts.get(base, 0) + 1
            names = [n for pins, pouts, _ in split(t.args, t.outs, dict(t.attrs)) for n in pins + pouts]
            assert set(names) == set(t.args) | set(t.outs)
    # every optimizer call is one launch per step (or two: updates in two launches), every clear
    # of the gradients one launch, or none where the backward overwrites them all (dead clears)
    assert ("fill" in parts or dead) and set(parts) & (set(FUSIBLE) - {"fill", "nonfinite_check"})


def test_fused_tasks_have_the_union_of_their_parts_accesses_and_keep_order():
    c = compile_file(os.path.join(ROOT, "examples", "mlp_digits.sched"), fuse=False)
    s = c.schedule
    f = fuse_tasks(s, c.program.kernels)
    # the bias-gradient sums a backward epilogue took from further on, and the dead clears
    hoisted: set[int] = set(_oracle_dead(s, _user_kernels(c)))
    assert hoisted  # (mlp_digits' clear of its gradients)
    it = iter(s.tasks)

    def nxt():
        u = next(it)
        while u.id in hoisted:
            u = next(it)
        return u

    masks = {b.name for b in f.buffers} - {b.name for b in s.buffers}
    assert masks and all(next(b for b in f.buffers if b.name == m).dtype == "u8" for m in masks)
    written = set()
    n_bwd = 0
    for t in f.tasks:
        if t.kernel in ("gemm_bias_relu", "gemm_bias_relu_aux", "gemm_bias_gelu"):
            a, b, act = nxt(), nxt(), nxt()
            assert (a.kernel, b.kernel, act.kernel) == ("matmul", "add", t.kernel.split("_")[2])
            mask = t.outs[1:] if t.kernel == "gemm_bias_relu_aux" else ()
            assert t.args == a.args + b.args[1:] and t.outs == (b.outs if act.kernel == "gelu" else ()) + act.outs + mask
            assert set(mask) <= masks
            written |= set(mask)
            continue
        if t.kernel in ("gemm_drelu_bgrad", "gemm_dgelu_bgrad"):
            a, g = nxt(), nxt()
            later = [u for u in s.tasks if u.id > g.id and g.outs[0] in u.args and u.kernel == "sum"]
            assert later, t
            sm = later[0]
            hoisted.add(sm.id)
            assert (a.kernel, g.kernel, sm.kernel) == ("matmul", t.kernel[6:10] + "_grad", "sum")
            mask = t.args[3:] if t.kernel == "gemm_drelu_bgrad" else ()
            assert t.args == a.args + g.args[1:] + mask and t.outs == g.outs + sm.outs and sm.args == g.outs
            assert set(mask) <= written  # the forward of this step wrote it
            assert dict(t.attrs) == {"ta": bool(a.attr("ta")), "tb": bool(a.attr("tb"))}
            n_bwd += 1
            continue
        if t.kernel == "gemm_bias":
            a, b = nxt(), nxt()
            assert (a.kernel, b.kernel) == ("matmul", "add") and t.args == a.args + b.args[1:] and t.outs == b.outs
            continue
        if t.kernel in ("gemm_relu_grad", "gemm_drelu"):
            a, g = nxt(), nxt()
            mask = t.args[3:] if t.kernel == "gemm_drelu" else ()
            assert set(mask) <= written  # the forward of this step wrote it
            assert (a.kernel, g.kernel) == ("matmul", "relu_grad") and t.args == a.args + g.args[1:] + mask
            assert t.outs == g.outs and dict(t.attrs) == {"ta": bool(a.attr("ta")), "tb": bool(a.attr("tb"))}
            continue
        if t.kernel == "softmax_xent_fused":
            a, b = nxt(), nxt()
            assert (a.kernel, b.kernel) == ("softmax_xent", "softmax_xent_grad")
            assert t.args == a.args + b.args[:1] and t.outs == a.outs + b.outs and b.args[1:] == a.args
            continue
        if t.kernel != "multi_tensor":
            u = nxt()
            assert (u.kernel, u.args, u.outs, u.stream) == (t.kernel, t.args, t.outs, t.stream)
            continue
        n = len(t.attr("parts"))
        us = [nxt() for _ in range(n)]
        assert all(u.kernel == t.attr("base") for u in us)
        assert t.args == tuple(a for u in us for a in u.args) and t.outs == tuple(o for u in us for o in u.outs)
        assert t.attr("parts") == tuple((len(u.args), len(u.outs), u.attrs) for u in us)
    assert next(it, None) is None
    assert n_bwd == 2 * s.steps  # both relu layers' dX GEMMs, every step
    assert fuse_tasks(f, c.program.kernels) is f  # nothing left to fuse


def test_overlapping_parts_never_fuse():
    """Two sgd_step tasks that update one buffer (the same weight twice) are left apart: their
    order matters, and the multi-tensor launch runs its parts at once."""
    c = compile_file(os.path.join(ROOT, "examples", "mlp_digits.sched"), fuse=False)
    s = c.schedule
    from dataclasses import replace

    sgd = [t for t in s.tasks if t.kernel == "sgd_step"]
    a, b = sgd[0], sgd[1]
    tasks = list(s.tasks)
    tasks[b.id] = replace(b, args=(a.args[0],) + b.args[1:], outs=(a.outs[0],) + b.outs[1:])
    f = fuse_tasks(replace(s, tasks=tuple(tasks)), c.program.kernels)
    m = [t for t in f.tasks if t.kernel == "multi_tensor" and t.attr("base") == "sgd_step" and t.step == a.step]
    assert m and all(t.outs.count(a.outs[0]) <= 1 for t in m)
    assert sum(len(t.attr("parts")) for t in m) == len([t for t in sgd if t.step == a.step]) - 1


def test_a_part_touching_a_shared_scalar_never_joins():
    """An sgd_step whose own tensor shares bytes with the learning rate the run shares (a
    momentum placed over `lr`) does not join the run before it: the launch reads the scalar
    once for all parts."""
    c = compile_file(os.path.join(ROOT, "examples", "mlp_digits.sched"), fuse=False)
    s = c.schedule
    from dataclasses import replace

    sgd = [t for t in s.tasks if t.kernel == "sgd_step"]
    a, b = sgd[0], sgd[1]
    si, _ = FUSIBLE["sgd_step"]
    shared = a.args[si[0]]
    own = next(n for i, n in enumerate(b.args) if i not in si and n not in b.outs)
    bufs = s.buffer_map()
    lr, mine = bufs[shared], bufs[own]
    assert lr.space == mine.space and lr.nbytes
    moved = replace(mine, offset=lr.offset, nbytes=min(mine.nbytes, lr.nbytes))  # lr's bytes, no other's
    buffers = tuple(moved if x.name == own else x for x in s.buffers)
    f = fuse_tasks(replace(s, buffers=buffers), c.program.kernels)
    with_a = [t for t in f.tasks if t.step == a.step and a.outs[0] in t.outs]
    assert len(with_a) == 1 and b.outs[0] not in with_a[0].outs
    untouched = fuse_tasks(s, c.program.kernels)
    assert any(a.outs[0] in t.outs and b.outs[0] in t.outs for t in untouched.tasks if t.step == a.step)


def _small(path):
    return os.path.basename(path) in ("mlp_digits.sched", "resnet_digits_amp.sched", "resnet_lars.sched",
                                      "explicit_mlp.sched", "gpt_text.sched", "five_streams.sched")


@pytest.mark.parametrize("path", [p for p in EXAMPLES if _small(p)], ids=os.path.basename)
def test_fused_training_is_bitwise_the_unfused_on_the_cpu(path):
    fused, plain = compile_file(path), compile_file(path, fuse=False)
    assert fused.fused > 0
    want = outcome(plain, max_steps=4)
    for how, got in interleavings(fused, max_steps=4):
        assert got[1] == (), how
        assert got[0] == want[0], f"{how}: {differ(got[0], want[0])}"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(programs())
def test_generated_programs_train_bitwise_alike_fused_and_unfused(g):
    fused = compile_text(g.text)
    plain = compile_text(g.text, fuse=False)
    assert clean(fused) == clean(plain)
    assume(clean(fused))
    want, races = outcome(plain)
    got, races_f = outcome(fused)
    assert races == races_f == ()
    assert got == want, differ(got, want)


def test_no_fuse_flag_shows_every_launch(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    path = os.path.join(ROOT, "examples", "mlp_digits.sched")
    on = subprocess.run([sys.executable, "-m", "streamsched", "lower", path], capture_output=True, text=True,
                        env=env, cwd=str(tmp_path))
    off = subprocess.run([sys.executable, "-m", "streamsched", "lower", "--no-fuse", path], capture_output=True,
                         text=True, env=env, cwd=str(tmp_path))
    assert on.returncode == off.returncode == 0, on.stderr + off.stderr
    assert "multi_tensor" in on.stdout and "multi_tensor" not in off.stdout
    assert off.stdout.count("sgd_step") > on.stdout.count("sgd_step")


def test_multi_tensor_cpu_twin_is_its_parts_in_order():
    rng = np.random.default_rng(0)
    shapes = [(5, 3), (7,), (2, 2, 2)]
    ws = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    gs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    vs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    lr = np.array(0.05, np.float32)
    at = {"momentum": 0.9, "weight_decay": 0.01, "nesterov": True}
    want = [(w.copy(), v.copy()) for w, v in zip(ws, vs)]
    for (w, v), g in zip(want, gs):
        KERNELS["sgd_step"].cpu([w, g, v, lr], [w, v], at)
    ins, outs = [], []
    for w, g, v in zip(ws, gs, vs):
        ins += [w, g, v, lr]
        outs += [w, v]
    parts = tuple((4, 2, tuple(at.items())) for _ in shapes)
    KERNELS["multi_tensor"].cpu(ins, outs, {"base": "sgd_step", "parts": parts})
    for (w, v), w2, v2 in zip(want, ws, vs):
        assert w.tobytes() == w2.tobytes() and v.tobytes() == v2.tobytes()
    with pytest.raises(ValueError):
        KERNELS["multi_tensor"].cpu(ins[:-1], outs, {"base": "sgd_step", "parts": parts})


# ---------------------------------------------------------------------------------------------
# Backward epilogues: matmul -> relu_grad | gelu_grad -> sum(axis 0) into one GEMM


MLP = os.path.join(ROOT, "examples", "mlp_digits.sched")


def _mlp_text(**swap):
    with open(MLP, encoding="utf-8") as f:
        text = f.read()
    for a, b in swap.items():
        text = text.replace(a.replace("_", " "), b)
    return text


def _bwd(schedule):
    """{(step, dX label) : fused task} of the backward epilogues of `schedule`."""
    return {(t.step, t.label.split(": ")[-1].split(" +")[0]): t for t in schedule.tasks
            if t.kernel in ("gemm_drelu_bgrad", "gemm_dgelu_bgrad")}


def _edit(s, pick, change):
    """`s` with every task `pick` accepts changed by the fields `change(task)` gives."""
    from dataclasses import replace

    return replace(s, tasks=tuple(replace(t, **change(t)) if pick(t) else t for t in s.tasks))


def test_backward_epilogues_fuse_both_relu_layers_of_the_mlp_every_step():
    c = compile_file(MLP, fuse=False)
    f = fuse_tasks(c.schedule, c.program.kernels)
    got = _bwd(f)
    assert set(got) == {(s, lab) for s in range(c.schedule.steps)
                        for lab in ("linear.backward@logits.dx", "linear.backward@h2.dx")}
    t = got[(0, "linear.backward@logits.dx")]
    assert t.kernel == "gemm_drelu_bgrad" and t.stream == "comp3" and dict(t.attrs) == {"ta": False, "tb": True}
    assert t.args == ("d(logits)", "logits.w", "a2", "relu_mask(a2)") and t.outs == ("d(h2)", "grad.h2.b")
    mask = next(b for b in f.buffers if b.name == "relu_mask(a2)")
    assert mask.shape == (128, 256 // 128 * 16) and mask.dtype == "u8" and mask.nbytes == 128 * 32
    assert not any(mask.overlaps(b) for b in f.buffers if b.name != mask.name)  # a fresh byte range
    writers = [u for u in f.tasks if "relu_mask(a2)" in u.outs]
    assert writers and all(u.kernel == "gemm_bias_relu_aux" and u.outs == ("a2", "relu_mask(a2)") for u in writers)


def test_a_reader_of_the_gemm_output_elsewhere_keeps_that_layer_unfused():
    """d(a2) read by one more task (an optimizer part, in one step only): the logits layer's dX
    GEMM keeps its output in every step (the fixed point), and a2 gets no mask; h2's still fuses."""
    c = compile_file(MLP, fuse=False)
    sgd = next(t for t in c.schedule.tasks if t.kernel == "sgd_step" and t.step == 1)
    s = _edit(c.schedule, lambda t: t.id == sgd.id, change=lambda t: {"args": t.args + ("d(a2)",)})
    f = fuse_tasks(s, c.program.kernels)
    assert {lab for _, lab in _bwd(f)} == {"linear.backward@h2.dx"}
    assert "relu_mask(a2)" not in {b.name for b in f.buffers} and "relu_mask(a1)" in {b.name for b in f.buffers}


def test_the_bias_gradient_moves_up_only_over_tasks_that_do_not_touch_its_bytes():
    c = compile_file(MLP, fuse=False)
    # the dW GEMM between relu_grad and the sum writing db's buffer: the sum cannot pass it
    s = _edit(c.schedule, lambda t: t.label.endswith("linear.backward@h2.dw"),
              change=lambda t: {"outs": ("grad.h2.b",)})
    assert {lab for _, lab in _bwd(fuse_tasks(s, c.program.kernels))} == {"linear.backward@h2.dx"}
    # ... or writing dpre (the sum would read the value before it)
    s = _edit(c.schedule, lambda t: t.label.endswith("linear.backward@h2.dw"), change=lambda t: {"outs": ("d(h2)",)})
    assert {lab for _, lab in _bwd(fuse_tasks(s, c.program.kernels))} == {"linear.backward@h2.dx"}
    # ... or one the sum is ordered after by an `after`
    dw = {t.step: t.id for t in c.schedule.tasks if t.label.endswith("linear.backward@h2.dw")}
    s = _edit(c.schedule, lambda t: t.label.endswith("linear.backward@h2.db"), change=lambda t: {"after": (dw[t.step],)})
    assert {lab for _, lab in _bwd(fuse_tasks(s, c.program.kernels))} == {"linear.backward@h2.dx"}
    # reading db is a conflict too; reading dpre (the dW GEMM does) is not
    s = _edit(c.schedule, lambda t: t.label.endswith("linear.backward@h2.dw"),
              change=lambda t: {"args": t.args + ("grad.h2.b",)})
    assert {lab for _, lab in _bwd(fuse_tasks(s, c.program.kernels))} == {"linear.backward@h2.dx"}


def test_relu_fuses_backward_only_where_every_writer_of_y_is_a_fused_forward():
    c = compile_file(MLP, fuse=False)
    # h2 read elsewhere: the forward relu of a2 stays unfused, so nothing writes a2's mask
    sgd = next(t for t in c.schedule.tasks if t.kernel == "sgd_step")
    s = _edit(c.schedule, lambda t: t.id == sgd.id, change=lambda t: {"args": t.args + ("h2",)})
    f = fuse_tasks(s, c.program.kernels)
    assert {lab for _, lab in _bwd(f)} == {"linear.backward@h2.dx"}
    assert not any("relu_mask(a2)" in t.outs for t in f.tasks)


@pytest.mark.parametrize("place,fuses", [
    ("place relu.backward on comp2", set()),
    ("place linear.backward.db on comp2", set()),
    ("place linear.backward.db on comp3", {"linear.backward@h2.dx", "linear.backward@logits.dx"}),
])
def test_a_gradient_the_user_placed_on_another_stream_is_never_moved(place, fuses):
    """`place` of the activation's backward or of the bias gradient on a stream other than the
    dX GEMM's keeps them apart; placed on the GEMM's own stream, nothing moves and they fuse."""
    text = _mlp_text().replace("\ntrain {", f"\n{place}\n\ntrain {{")
    c = compile_file("gen.sched", text)
    assert c.ok
    assert {lab for _, lab in _bwd(c.schedule)} == fuses
    if not fuses:  # the gated product takes relu_grad into the GEMM only on the GEMM's stream
        kinds = {t.kernel for t in c.schedule.tasks}
        assert ("relu_grad" in kinds) == place.startswith("place relu.backward")
        assert ("gemm_relu_grad" in kinds) == (not place.startswith("place relu.backward"))


@pytest.mark.parametrize("stream", ["comp2", "comp3"])
def test_placing_an_ops_backward_leaves_its_forward_free_to_fuse(stream):
    """`place relu.backward on ...` places the backward task only: the forward relu still fuses
    into its GEMM's epilogue (it used to count as placing the forward too)."""
    text = _mlp_text().replace("\ntrain {", f"\nplace relu.backward on {stream}\n\ntrain {{")
    c = compile_file("gen.sched", text)
    assert c.ok
    assert sum(t.kernel in ("gemm_bias_relu", "gemm_bias_relu_aux") for t in c.schedule.tasks) == 2 * c.schedule.steps
    grads = [t for t in c.schedule.tasks if t.kernel == "relu_grad"]
    assert (not grads) == (stream == "comp3") and all(t.stream == stream for t in grads)


def test_explicit_policy_fuses_the_backward_only_on_one_stream():
    """Under `barriers = explicit` the user orders the streams: the GELU layers' dX GEMM and
    gelu_grad (comp3) and the bias sum (comp2) stay apart; all on one stream, they fuse."""
    text = _mlp_text(**{"relu(h1)": "gelu(h1)", "relu(h2)": "gelu(h2)"})
    assert _bwd(compile_file("gen.sched", text, policy="auto").schedule)
    c = compile_file("gen.sched", text, policy="explicit", fuse=False)
    assert c.schedule.policy == "explicit"
    f = fuse_tasks(c.schedule, c.program.kernels)
    assert not _bwd(f)
    # every task on one stream: the user's order is the issue order, and the backward fuses
    one = _edit(c.schedule, lambda t: t.stream != HOST, lambda t: {"stream": "comp1"})
    assert _bwd(fuse_tasks(one, c.program.kernels))
    # the dX GEMM and gelu_grad on one stream, the sum on another: still apart
    two = _edit(one, lambda t: t.kernel == "sum", lambda t: {"stream": "comp2"})
    assert not _bwd(fuse_tasks(two, c.program.kernels))


def test_a_gelu_mlp_fuses_forward_and_backward_and_trains_bitwise_the_unfused():
    text = _mlp_text(**{"relu(h1)": "gelu(h1)", "relu(h2)": "gelu(h2)"})
    fused, plain = compile_file("gen.sched", text), compile_file("gen.sched", text, fuse=False)
    assert fused.ok and plain.ok
    kinds = {t.kernel for t in fused.schedule.tasks}
    assert {"gemm_bias_gelu", "gemm_dgelu_bgrad"} <= kinds and "gelu_grad" not in kinds and "relu_mask" not in \
        "".join(b.name for b in fused.schedule.buffers)
    want = outcome(plain, max_steps=4)
    for how, got in interleavings(fused, max_steps=4):
        assert got[1] == (), how
        assert got[0] == want[0], f"{how}: {differ(got[0], want[0])}"


# ---------------------------------------------------------------------------------------------
# Gated products: matmul -> relu_grad into one gemm_relu_grad (what the backward epilogues leave)


def _gated(schedule):
    """{(step, dX label)} of the gated products of `schedule`."""
    return {(t.step, t.label.split(": ")[-1].split(" +")[0]) for t in schedule.tasks
            if t.kernel in ("gemm_relu_grad", "gemm_drelu")}


def test_gated_products_take_every_relu_layer_when_the_backward_epilogues_are_off(monkeypatch):
    monkeypatch.setenv("STREAMSCHED_BWD_EPILOGUES", "0")
    c = compile_file(MLP)
    assert _gated(c.schedule) == {(s, lab) for s in range(c.schedule.steps)
                                  for lab in ("linear.backward@logits.dx", "linear.backward@h2.dx")}
    t = next(t for t in c.schedule.tasks if t.kernel == "gemm_relu_grad" and t.step == 0)
    assert t.args == ("d(logits)", "logits.w", "a2") and t.outs == ("d(h2)",) and dict(t.attrs) == {"ta": False, "tb": True}
    assert {t.kernel for t in c.schedule.tasks if t.label.endswith("+relu_grad")} == {"gemm_relu_grad"}
    assert not any("mask" in b.name for b in c.schedule.buffers)  # the forward writes no relu mask


def test_with_backward_epilogues_on_what_they_leave_of_a_wide_layer_takes_drelu():
    """db placed on comp2 keeps the backward epilogues apart (the user's stream); with them on
    (the autouse fixture), the pairs they leave become gated products: the classifier's (k = 10)
    the skinny gate, the hidden layer's (k = 256) cuBLASLt's DRELU on the forward's mask."""
    text = _mlp_text().replace("\ntrain {", "\nplace linear.backward.db on comp2\n\ntrain {")
    c = compile_file("gen.sched", text)
    assert c.ok and not _bwd(c.schedule)
    got = {(t.step, t.label.split(": ")[-1].split(" +")[0]): t for t in c.schedule.tasks
           if t.kernel in ("gemm_relu_grad", "gemm_drelu")}
    assert {k[1] for k in got} == {"linear.backward@logits.dx", "linear.backward@h2.dx"}
    assert got[(0, "linear.backward@logits.dx")].kernel == "gemm_relu_grad"
    d = got[(0, "linear.backward@h2.dx")]
    assert d.kernel == "gemm_drelu" and d.args == ("d(h2)", "h2.w", "a1", "relu_mask(a1)") and d.outs == ("d(h1)",)
    assert all(u.kernel == "gemm_bias_relu_aux" and u.outs == ("a1", "relu_mask(a1)")
               for u in c.schedule.tasks if "relu_mask(a1)" in u.outs)
    assert {u.step for u in c.schedule.tasks if u.kernel == "gemm_bias_relu_aux"} == set(range(c.schedule.steps))
    plain = compile_file("gen.sched", text, fuse=False)
    want = outcome(plain, max_steps=4)
    for how, res in interleavings(c, max_steps=4):
        assert res[1] == () and res[0] == want[0], f"{how}: {differ(res[0], want[0])}"
    assert not any(t.kernel == "relu_grad" for t in c.schedule.tasks)
    assert not any("d(a2)" in t.args + t.outs for t in c.schedule.tasks)  # dy: nothing reads or writes it


def test_a_read_of_the_product_before_its_next_overwrite_keeps_that_pair_apart(monkeypatch):
    """d(a2) read once more by step 1's first update (after step 1's dX GEMM wrote it): step 1's
    pair stays apart; step 0's fuses (step 1's GEMM overwrites d(a2) before that read)."""
    monkeypatch.setenv("STREAMSCHED_BWD_EPILOGUES", "0")
    c = compile_file(MLP, fuse=False)
    sgd = next(t for t in c.schedule.tasks if t.kernel == "sgd_step" and t.step == 1)
    s = _edit(c.schedule, lambda t: t.id == sgd.id, change=lambda t: {"args": t.args + ("d(a2)",)})
    got = _gated(fuse_tasks(s, c.program.kernels))
    assert (1, "linear.backward@logits.dx") not in got
    assert got == {(st, lab) for st in range(c.schedule.steps)
                   for lab in ("linear.backward@logits.dx", "linear.backward@h2.dx")} - {(1, "linear.backward@logits.dx")}


def test_a_read_of_the_products_bytes_under_another_name_keeps_that_pair_apart(monkeypatch):
    """inplace_backward.sched writes d(a2) `into` a2's storage: a read of a2 after the pair and
    before step 1's relu rewrites a2 reads d(a2)'s bytes, so that pair stays apart (by bytes,
    not names); the reads of a2 after that rewrite keep nothing apart."""
    monkeypatch.setenv("STREAMSCHED_BWD_EPILOGUES", "0")
    path = os.path.join(ROOT, "examples", "inplace_backward.sched")
    c = compile_file(path, fuse=False)
    every = _gated(fuse_tasks(c.schedule, c.program.kernels))
    assert (0, "linear.backward@logits.dx") in every
    sgd = next(t for t in c.schedule.tasks if t.kernel == "sgd_step" and t.step == 0)
    s = _edit(c.schedule, lambda t: t.id == sgd.id, change=lambda t: {"args": t.args + ("a2",)})
    assert _gated(fuse_tasks(s, c.program.kernels)) == every - {(0, "linear.backward@logits.dx")}


def test_gated_products_train_bitwise_the_unfused_on_the_cpu(monkeypatch):
    monkeypatch.setenv("STREAMSCHED_BWD_EPILOGUES", "0")
    for name in ("mlp_digits.sched", "inplace_backward.sched"):
        path = os.path.join(ROOT, "examples", name)
        fused, plain = compile_file(path), compile_file(path, fuse=False)
        assert _gated(fused.schedule) and fused.ok and plain.ok
        want = outcome(plain, max_steps=4)
        for how, got in interleavings(fused, max_steps=4):
            assert got[1] == (), how
            assert got[0] == want[0], f"{name} {how}: {differ(got[0], want[0])}"


@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
def test_backward_epilogue_cpu_twins_are_their_parts_in_order(act, ta, tb):
    """Bitwise the unfused matmul, activation gradient and sum; the relu mask against an
    independent unpacking of its bits (row r, bit j of byte j // 8, little-endian)."""
    rng = np.random.default_rng(5)
    m, k, n = 7, 5, 131
    x, w, b = rng.standard_normal((m, 9)), rng.standard_normal((9, n)), rng.standard_normal(n)
    dz = rng.standard_normal((k, m) if ta else (m, k))
    wb = rng.standard_normal((n, k) if tb else (k, n))
    pre = np.empty((m, n))
    KERNELS["gemm_bias_gelu"].cpu([x, w, b], [pre, np.empty((m, n))], {})
    y, mask = np.empty((m, n)), np.zeros((m, 32), np.uint8)
    KERNELS["gemm_bias_relu_aux"].cpu([x, w, b], [y, mask], {})
    for r in range(m):
        for j in range(256):
            bit = (int(mask[r, j // 8]) >> (j % 8)) & 1
            assert bit == (j < n and y[r, j] > 0)
    aux = y if act == "relu" else pre
    t = np.empty((m, n))
    KERNELS["matmul"].cpu([dz, wb], [t], {"ta": ta, "tb": tb})
    want_d, want_b = np.empty((m, n)), np.empty(n)
    KERNELS[f"{act}_grad"].cpu([t, aux], [want_d], {})
    KERNELS["sum"].cpu([want_d], [want_b], {"axis": 0})
    got_d, got_b = np.full((m, n), np.nan), np.full(n, np.nan)
    ins = [dz, wb, aux] + ([mask] if act == "relu" else [])
    KERNELS[f"gemm_d{act}_bgrad"].cpu(ins, [got_d, got_b], {"ta": ta, "tb": tb})
    assert got_d.tobytes() == want_d.tobytes() and got_b.tobytes() == want_b.tobytes()


class _FakeLt:
    """nvmath's cublasLt bindings as far as gemm.py's epilogues call them, recording every
    descriptor attribute and layout (CPU: no GPU here to check the descriptors on)."""

    def __init__(self):
        import enum

        self.attrs, self.layouts, self.calls = {}, [], []
        self.MatmulDescAttribute = enum.IntEnum("A", "TRANSA TRANSB EPILOGUE BIAS_POINTER EPILOGUE_AUX_POINTER "
                                                     "EPILOGUE_AUX_LD")
        self.MatmulPreferenceAttribute = enum.IntEnum("P", "MAX_WORKSPACE_BYTES MIN_ALIGNMENT_A_BYTES "
                                                           "MIN_ALIGNMENT_B_BYTES MIN_ALIGNMENT_C_BYTES MIN_ALIGNMENT_D_BYTES")

    def matmul_desc_create(self, compute, scale):
        self.attrs = {"compute": compute}
        return 11

    def matmul_desc_set_attribute(self, desc, attr, ptr, size):
        import ctypes

        raw = ctypes.string_at(ptr, size)
        self.attrs[self.MatmulDescAttribute(attr).name] = int.from_bytes(raw, "little")

    def matrix_layout_create(self, r, rows, cols, ld):
        self.layouts.append((rows, cols, ld))
        return len(self.layouts)

    def matmul_preference_create(self):
        return 5

    def matmul_preference_set_attribute(self, *a):
        pass

    def matmul_algo_get_heuristic(self, handle, desc, la, lb, lc, ld, pref, n, res, count):
        import ctypes

        ctypes.c_int32.from_address(count).value = 1

    def matmul(self, *a):
        self.calls.append(a)

    def matrix_layout_destroy(self, h):
        pass

    def matmul_preference_destroy(self, h):
        pass

    def matmul_desc_destroy(self, h):
        pass


class _FakeArray:
    _next = [1 << 20]

    def __init__(self, shape, dtype=np.float32):
        from types import SimpleNamespace

        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.flags = SimpleNamespace(c_contiguous=True)
        self.data = SimpleNamespace(ptr=self._next[0])
        self._next[0] += 1 << 20


class _FakeCtx:
    def lt_handle(self, s):
        return 3, 4096, 1 << 22

    def lt_candidates(self, lt, handle, desc, la, lb, ld, ws_bytes):
        return [np.zeros((8,), np.uint64)]

    def lt_problem_key(self, *parts):
        return parts

    def lt_algo(self, key, cands, stream, ws_bytes, make_run):
        return cands[0]  # no device here: nothing is timed

    def stream_ptr(self, s):
        return 99


@pytest.mark.parametrize("ta,tb", [(False, True), (False, False), (True, False), (True, True)])
def test_cublaslt_descriptors_are_the_layouts_the_gemm_comment_derives(monkeypatch, ta, tb):
    """The backward's row-major op(dz) [m, p] @ op(w) [p, n] as cuBLASLt's column-major
    D^T = op(w)^T op(dz)^T: A = w with TRANSA = tb, B = dz with TRANSB = ta, a row-major buffer
    [r, c] laid out (c, r, ld c), D (n, m, n); DRELU_BGRAD 152 / DGELU_BGRAD 208 (cublasLt.h), the
    bias pointer db, the aux pointer the mask (ld ceil(n/128)*128 bits) / pre (ld n); and the
    forward's RELU_AUX_BIAS 134 with the mask, GELU_AUX_BIAS 164, RELU_BIAS 6 as before."""
    import sys
    import types

    from streamsched.stdlib.kernels import gemm

    lt = _FakeLt()
    mod = types.ModuleType("nvmath.bindings.cublasLt")
    for k in dir(lt):
        if not k.startswith("__"):
            setattr(mod, k, getattr(lt, k))
    pkg, sub = types.ModuleType("nvmath"), types.ModuleType("nvmath.bindings")
    pkg.bindings, sub.cublasLt = sub, mod
    monkeypatch.setitem(sys.modules, "nvmath", pkg)
    monkeypatch.setitem(sys.modules, "nvmath.bindings", sub)
    monkeypatch.setitem(sys.modules, "nvmath.bindings.cublasLt", mod)
    monkeypatch.setattr(gemm, "_LT_PLANS", {})
    monkeypatch.setattr(gemm, "_LT_MASKS", {})
    m, p, n = 128, 10, 200
    dz = _FakeArray((p, m) if ta else (m, p))
    w = _FakeArray((n, p) if tb else (p, n))
    dpre, db, pre = _FakeArray((m, n)), _FakeArray((n,)), _FakeArray((m, n))
    y, mask = _FakeArray((m, n)), _FakeArray((m, 32), np.uint8)
    x, wf, bf = _FakeArray((m, 16)), _FakeArray((16, n)), _FakeArray((n,))
    ctx = _FakeCtx()
    gemm.gemm_bias_relu_aux_cuda.prepare(ctx, "s0", [x, wf, bf], [y, mask], {})
    assert lt.attrs["EPILOGUE"] == 134 and lt.attrs["EPILOGUE_AUX_POINTER"] == mask.data.ptr
    assert lt.attrs["EPILOGUE_AUX_LD"] == 256 and lt.attrs["BIAS_POINTER"] == bf.data.ptr
    assert (lt.attrs["TRANSA"], lt.attrs["TRANSB"]) == (0, 0) and lt.layouts[-3:] == [(n, 16, n), (16, m, 16), (n, m, n)]
    assert gemm._LT_MASKS == {mask.data.ptr: True}
    gemm.gemm_bias_relu_cuda.prepare(ctx, "s0", [x, wf, bf], [y], {})
    assert lt.attrs["EPILOGUE"] == 6 and "EPILOGUE_AUX_POINTER" not in lt.attrs and lt.layouts[-1] == (n, m, n)
    gemm.gemm_bias_gelu_cuda.prepare(ctx, "s0", [x, wf, bf], [pre, y], {})
    assert lt.attrs["EPILOGUE"] == 164 and lt.attrs["EPILOGUE_AUX_POINTER"] == pre.data.ptr
    assert lt.attrs["EPILOGUE_AUX_LD"] == n and lt.layouts[-3:] == [(n, 16, n), (16, m, 16), (n, m, n)]
    for act, aux in (("relu", mask), ("gelu", pre)):
        fn = gemm.gemm_drelu_bgrad_cuda if act == "relu" else gemm.gemm_dgelu_bgrad_cuda
        ins = [dz, w, y, mask] if act == "relu" else [dz, w, pre]
        if act == "gelu":
            n8 = _FakeArray((m, n))  # n = 200 is a multiple of 8
            ins[2] = aux = n8
        fn(ctx, "s1", ins, [dpre, db], {"ta": ta, "tb": tb})
        a = lt.attrs
        assert a["EPILOGUE"] == (152 if act == "relu" else 208), act
        assert (a["TRANSA"], a["TRANSB"]) == (int(tb), int(ta))
        assert a["BIAS_POINTER"] == db.data.ptr and a["EPILOGUE_AUX_POINTER"] == aux.data.ptr
        assert a["EPILOGUE_AUX_LD"] == (256 if act == "relu" else n)
        assert lt.layouts[-3:] == [(w.shape[1], w.shape[0], w.shape[1]), (dz.shape[1], dz.shape[0], dz.shape[1]),
                                   (n, m, n)]
        call = lt.calls[-1]
        assert (call[3], call[5], call[8], call[10], call[15]) == (w.data.ptr, dz.data.ptr, dpre.data.ptr,
                                                                   dpre.data.ptr, 99)
    # op(w)^T op(dz)^T really is (op(dz) op(w))^T: the column-major reading of the layouts above
    rng = np.random.default_rng(0)
    dzv, wv = rng.standard_normal(dz.shape), rng.standard_normal(w.shape)
    A = dzv if not ta else dzv.T
    B = wv if not tb else wv.T
    cm = lambda buf, t: (buf.T if not t else buf)  # noqa: E731  column-major view of a row-major buffer, op applied
    np.testing.assert_allclose(cm(wv, tb) @ cm(dzv, ta), (A @ B).T)
    # a forward that fell back writes no mask: the backward then runs unfused (no cuBLASLt call)
    gemm._LT_MASKS[mask.data.ptr] = False
    before = len(lt.calls)
    monkeypatch.setattr(gemm, "_bwd_unfused", lambda *a: lt.calls.append("unfused"))
    gemm.gemm_drelu_bgrad_cuda(ctx, "s1", [dz, w, y, mask], [dpre, db], {"ta": ta, "tb": tb})
    assert lt.calls[before:] == ["unfused"]


# ---------------------------------------------------------------------------------------------
# Batch-norm epilogues: batchnorm_train -> relu (-> add -> relu) and relu_grad -> batchnorm_grad


RESNET = os.path.join(ROOT, "examples", "resnet_digits.sched")
_BN = ("batchnorm_train_relu", "batchnorm_train_add_relu", "batchnorm_grad_relu")


def _bn_chains(schedule):
    """{(step, kernel, label without the suffix)} of the fused batch-norm tasks."""
    return {(t.step, t.kernel, t.label.split(": ")[-1].split(" +")[0]) for t in schedule.tasks if t.kernel in _BN}


def _resnet(tmp_path, edit=lambda s: s, name="r.sched"):
    with open(RESNET) as f:
        text = edit(f.read())
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_the_resnet_step_fuses_each_batch_norm_with_its_relu_and_the_relu_gradients_into_its_backward():
    c = compile_file(RESNET)
    assert c.ok
    want = {("batchnorm_train_relu", "batchnorm@b1.y"), ("batchnorm_train_relu", "batchnorm@b2.y"),
            ("batchnorm_train_add_relu", "batchnorm@b3.y"), ("batchnorm_grad_relu", "batchnorm.backward@b2.dx"),
            ("batchnorm_grad_relu", "batchnorm.backward@b1.dx")}
    got = _bn_chains(c.schedule)
    assert {(k, lab) for _, k, lab in got} == want and len(got) == len(want) * c.schedule.steps
    t = next(t for t in c.schedule.tasks if t.kernel == "batchnorm_train_add_relu" and t.step == 0)
    assert t.args == ("c3", "b3.gamma", "b3.beta", "r1") and t.outs[0] == "r3" and t.stream == "comp2"
    g = next(t for t in c.schedule.tasks if t.kernel == "batchnorm_grad_relu" and t.step == 0
             and "b2" in t.label)
    assert g.args[:3] == ("d(r2)", "r2", "c2") and g.stream == "comp2"
    # b3's gradient reads the residual's copy of d(s), which the accumulation of r1 also reads: apart
    assert any(t.kernel == "batchnorm_grad" and "b3" in t.label for t in c.schedule.tasks)
    # nothing reads the intermediates any more
    assert not any(n in t.args + t.outs for t in c.schedule.tasks for n in ("b1", "b2", "b3", "s", "d(b1)", "d(b2)"))


def test_a_batch_norm_output_read_twice_stays_apart(tmp_path):
    """y read by relu and by something else (here the residual add takes b1 instead of r1): the
    relu of b1 does not fuse, b3's chain still does."""
    c = compile_file(_resnet(tmp_path, lambda s: s.replace("s      = add(b3, r1)", "s      = add(b3, b1)")))
    assert c.ok
    labs = {lab for _, _, lab in _bn_chains(c.schedule)}
    assert "batchnorm@b1.y" not in labs and "batchnorm@b2.y" in labs and "batchnorm@b3.y" in labs


def test_a_relu_the_user_placed_on_another_stream_and_explicit_barriers_keep_the_parts_apart(tmp_path):
    placed = compile_file(_resnet(tmp_path, lambda s: s.replace("r2     = relu(b2)", "r2     = relu(b2) on comp3")))
    assert placed.ok
    labs = {lab for _, _, lab in _bn_chains(placed.schedule)}
    assert "batchnorm@b2.y" not in labs and "batchnorm@b1.y" in labs
    c = compile_file(RESNET, policy="explicit", fuse=False)
    f = fuse_tasks(c.schedule, c.program.kernels)
    assert not _bn_chains(f)  # conv, bn, relu sit on three streams: the user's orders between them stay
    one = replace(c.schedule, tasks=tuple(replace(t, stream="comp1") if t.stream != HOST else t for t in c.schedule.tasks))
    assert _bn_chains(fuse_tasks(one, c.program.kernels))


def test_the_switch_turns_the_batch_norm_epilogues_off(monkeypatch):
    monkeypatch.setenv("STREAMSCHED_BN_EPILOGUES", "0")
    c = compile_file(RESNET)
    assert c.ok and not _bn_chains(c.schedule) and any(t.kernel == "relu" for t in c.schedule.tasks)


@pytest.mark.parametrize("edit", ["", " on comp3"], ids=["default", "placed"])
def test_resnet_trains_bitwise_alike_with_and_without_the_batch_norm_epilogues(tmp_path, edit):
    path = _resnet(tmp_path, lambda s: s.replace("r2     = relu(b2)", "r2     = relu(b2)" + edit))
    fused, plain = compile_file(path), compile_file(path, fuse=False)
    assert _bn_chains(fused.schedule)
    want = outcome(plain, max_steps=2)
    for how, got in interleavings(fused, max_steps=2):
        assert got[1] == (), how
        assert got[0] == want[0], f"{how}: {differ(got[0], want[0])}"
