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

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings

from sched_gen import programs
from streamsched.interp.fuse import fuse_tasks
from streamsched.interp.ir import HOST
from streamsched.pipeline import compile_file
from streamsched.stdlib.kernels import KERNELS
from streamsched.stdlib.kernels.multi_tensor import FUSIBLE, split
from test_soundness_properties import clean, compile_text, differ, interleavings, outcome

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.sched")))


def _recount(schedule) -> int:
    """Tasks the rule folds away, counted independently: adjacent tasks of one fusible kernel,
    stream, unit, step, launch and attributes (fill's shape and dtype aside), sharing the shared
    scalars, each with tensors of its own."""
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
    for i in range(len(tasks) - 2):
        a, b, c = tasks[i:i + 3]
        if a.kernel == "matmul" and not any(v for _, v in a.attrs) and b.kernel == "add" and c.kernel in ("relu", "gelu") \
                and b.args[0] == a.outs[0] and c.args == b.outs and readers[a.outs[0]] == {"add"} \
                and (c.kernel == "gelu" or readers[b.outs[0]] == {"relu"}) and len(set((u.unit, u.step) for u in (a, b, c))) == 1 \
                and (schedule.policy != "explicit" or a.stream == b.stream == c.stream):
            folded += 2
    for t in schedule.tasks:
        if t.id in pairs:
            continue
        s = sig(t) if t.kernel in FUSIBLE and t.stream != HOST else None
        if s is not None and s == prev:
            folded += 1
        prev = s
    return folded


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_examples_fuse_check_clean_and_fold_what_the_rule_names(path):
    fused, plain = compile_file(path), compile_file(path, fuse=False)
    assert fused.ok and plain.ok
    assert [d.code for d in fused.diagnostics] == [d.code for d in plain.diagnostics]
    assert plain.fused == 0 and len(plain.schedule.tasks) == len(fused.schedule.tasks) + fused.fused
    assert fused.fused == _recount(plain.schedule) > 0
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
    # every optimizer call, every clear of the gradients, is one launch per step
    assert "fill" in parts and set(parts) & (set(FUSIBLE) - {"fill", "nonfinite_check"})


def test_fused_tasks_have_the_union_of_their_parts_accesses_and_keep_order():
    c = compile_file(os.path.join(ROOT, "examples", "mlp_digits.sched"), fuse=False)
    s = c.schedule
    f = fuse_tasks(s, c.program.kernels)
    it = iter(s.tasks)
    for t in f.tasks:
        if t.kernel in ("gemm_bias_relu", "gemm_bias_gelu"):
            a, b, act = next(it), next(it), next(it)
            assert (a.kernel, b.kernel, act.kernel) == ("matmul", "add", t.kernel[-4:])
            assert t.args == a.args + b.args[1:] and t.outs == (b.outs if act.kernel == "gelu" else ()) + act.outs
            continue
        if t.kernel == "softmax_xent_fused":
            a, b = next(it), next(it)
            assert (a.kernel, b.kernel) == ("softmax_xent", "softmax_xent_grad")
            assert t.args == a.args + b.args[:1] and t.outs == a.outs + b.outs and b.args[1:] == a.args
            continue
        if t.kernel != "multi_tensor":
            u = next(it)
            assert (u.kernel, u.args, u.outs, u.stream) == (t.kernel, t.args, t.outs, t.stream)
            continue
        n = len(t.attr("parts"))
        us = [next(it) for _ in range(n)]
        assert all(u.kernel == t.attr("base") for u in us)
        assert t.args == tuple(a for u in us for a in u.args) and t.outs == tuple(o for u in us for o in u.outs)
        assert t.attr("parts") == tuple((len(u.args), len(u.outs), u.attrs) for u in us)
    assert next(it, None) is None
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
