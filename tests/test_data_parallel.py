"""Data parallel without a GPU: the `allreduce` statement, its checks, and N ranks simulated in one
process on the CPU backend.

- N = 1, 2, 4 simulated ranks at per-rank batch B give the parameters one rank gives at batch
  N * B after 20 steps (relative 1e-5, f64), for examples/mlp_digits_dp.sched; taking the
  all-reduce out makes them differ (the test sees what it exists for).
- resnet_digits: with synchronized batch norm (examples/resnet_digits_dp.sched, `sync = true`)
  N = 1, 2, 4 ranks at B equal one rank at N * B after 20 steps (relative 1e-5, f64; dropout
  draws each rank's elements of the global mask); without `sync`, ranks normalize by their own
  shard's statistics (DDP without SyncBatchNorm) and differ, as documented; one rank with the
  all-reduce equals the file without it; buckets on `update` beside synchronized batch norm on
  comp2 are R008.
- Buckets: by layer groups, by size, one bucket; each bucket's task waits only for the writers
  of its own gradients (happens-before recomputed here from the plan, independently).
- The diagnostics: R006, R007, S031, R008 (and their fixes check clean), R001 under `explicit`,
  the statement's S005/S007/S015 mistakes.
- The launcher: its variables, a failing rank stopping the others, `--devices` on the CLI.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np
import pytest

from streamsched.diagnostics import StreamschedError
from streamsched.interp.distributed import (CollectiveError, LaunchError, SimGroup, _without_devices, launch,
                                            rank_env, shard)
from streamsched.interp.train import TrainOptions, train
from streamsched.pipeline import check_file, compile_file
from streamsched.stdlib.kernels import collectives

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _read(name: str) -> str:
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
        return f.read()


def _params(tmp_path, text: str, name: str, devices: int, steps: int = 20) -> dict[str, np.ndarray]:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    c = compile_file(str(path))
    assert c.ok, c.diagnostics
    r = train(c, TrainOptions(backend="cpu", progress=False, max_steps=steps, devices=devices), base_dir=str(tmp_path))
    assert r.steps == steps
    return r.params


def _worst(got: dict, want: dict, names) -> float:
    return max(float(np.max(np.abs(got[n] - want[n])) / max(float(np.max(np.abs(want[n]))), 1e-300)) for n in names)


def _mlp_f64(batch: int) -> str:
    text = _read("mlp_digits_dp.sched").replace("f32[batch, 64]", "f64[batch, 64]")
    return re.sub(r"model mlp\(batch = \d+,", f"model mlp(batch = {batch},", text)


# -- the done-when: N ranks at B are one rank at N * B ----------------------------------------------


@pytest.fixture(scope="module")
def mlp_one_rank(tmp_path_factory):
    return _params(tmp_path_factory.mktemp("one"), _mlp_f64(64), "one.sched", 1)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_n_ranks_at_b_equal_one_rank_at_n_times_b(tmp_path, mlp_one_rank, n):
    got = _params(tmp_path, _mlp_f64(64 // n), f"dp{n}.sched", n)
    params = [k for k in mlp_one_rank if "." in k and not k.startswith("sgd.")]
    assert {"h1.w", "h2.w", "logits.w", "logits.b"} <= set(params)
    assert all(got[k].dtype == np.float64 for k in params)
    assert _worst(got, mlp_one_rank, mlp_one_rank) <= 1e-5
    # and training moved them: the comparison is not between two initial states
    init = _params(tmp_path, _mlp_f64(64 // n), f"dp{n}_0.sched", n, steps=0) if n == 2 else None
    if init is not None:
        assert _worst(got, init, params) > 1e-2


def test_without_the_allreduce_the_ranks_are_not_one_rank(tmp_path, mlp_one_rank, monkeypatch):
    """(The all-reduce is what makes N ranks one: with `run`'s X004 for a step that reduces
    nothing turned off, the replicas train apart.)"""
    from streamsched.interp.training.loop import Run

    monkeypatch.setattr(Run, "check_ranks_reduce", lambda self: None)
    text = re.sub(r"^\s*reduce\b.*\n", "", _mlp_f64(32), flags=re.M)
    text = re.sub(r"^graph reduce .*\n", "", text, flags=re.M)
    got = _params(tmp_path, text, "noreduce.sched", 2)
    assert _worst(got, mlp_one_rank, ["h1.w", "logits.w"]) > 1e-3


def _resnet_dp(batch: int, reduce: bool = True) -> str:
    text = _read("resnet_digits.sched").replace("f32[batch, 8, 8, 1]", "f64[batch, 8, 8, 1]")
    text = re.sub(r"model resnet\(batch = \d+,", f"model resnet(batch = {batch},", text)
    if reduce:
        text = text.replace("graph optimize   on update {",
                            'graph reduce     on update { allreduce(grad(resnet), buckets = "logits | c3 b3 c2 b2 | c1 b1"); '
                            'allreduce(stats(resnet)) }\ngraph optimize   on update {')
        text = text.replace("    load[next]\n    optimize", "    load[next]\n    reduce\n    optimize")
    return text


def test_resnet_one_rank_with_the_allreduce_is_the_file_without_it(tmp_path):
    with_ = _params(tmp_path, _resnet_dp(32), "r1.sched", 1, steps=6)
    without = _params(tmp_path, _resnet_dp(32, reduce=False), "r0.sched", 1, steps=6)
    assert _worst(with_, without, without) <= 1e-12


def test_resnet_ranks_use_their_own_batch_statistics(tmp_path):
    """Without `sync`, batch norm normalizes each rank's shard by the shard's own mean and
    variance (DDP without SyncBatchNorm): two ranks at 16 are close to, but not, one rank at 32."""
    two = _params(tmp_path, _resnet_dp(16), "r2.sched", 2, steps=6)
    one = _params(tmp_path, _resnet_dp(32), "r1.sched", 1, steps=6)
    names = ["c1.w", "logits.w"]
    assert 1e-8 < _worst(two, one, names) < 0.5


def _resnet_sync_f64(batch: int) -> str:
    text = _read("resnet_digits_dp.sched").replace("f32[batch, 8, 8, 1]", "f64[batch, 8, 8, 1]")
    return re.sub(r"model resnet\(batch = \d+,", f"model resnet(batch = {batch},", text)


@pytest.fixture(scope="module")
def resnet_one_rank(tmp_path_factory):
    return _params(tmp_path_factory.mktemp("r1"), _resnet_sync_f64(32), "one.sched", 1)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_resnet_with_synchronized_batch_norm_n_ranks_at_b_equal_one_rank_at_n_times_b(tmp_path, resnet_one_rank, n):
    """examples/resnet_digits_dp.sched (batch norm `sync = true`, dropout drawing each rank's
    elements of the global batch's mask): 20 steps, relative 1e-5 for every parameter and
    momentum but the convolutions' biases: under batch norm a bias has no gradient in exact
    arithmetic (batch norm removes the mean), so those values are rounding noise near 1e-9 in
    both runs, checked to stay below 1e-6.
    Batch norm's gamma and beta are f32 parameters (the op declares them so) even in an f64
    model: they agree to f32's rounding.  Running variances are left out: each rank's unbiased
    correction uses its own count (docs/cuda.md)."""
    got = _params(tmp_path, _resnet_sync_f64(32 // n), f"rs{n}.sched", n)
    noise = re.compile(r"(^|\.)c\d\.b$")  # conv biases under batch norm, and their momentum
    names = [k for k in resnet_one_rank if "running" not in k and k != "d(loss)" and not noise.search(k)]
    assert {"c1.w", "b1.gamma", "logits.w", "logits.b", "sgd.v.c2.w", "sgd.v.b3.beta"} <= set(names)
    worst = {k: float(np.max(np.abs(got[k] - resnet_one_rank[k])) / float(np.max(np.abs(resnet_one_rank[k]))))
             for k in names}
    assert max(worst.values()) <= 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    for k in resnet_one_rank:  # the biases are noise: tiny, in both runs
        if noise.search(k):
            assert float(np.max(np.abs(got[k]))) < 1e-6 and float(np.max(np.abs(resnet_one_rank[k]))) < 1e-6


def test_synchronized_batch_norm_with_buckets_on_update_may_deadlock(tmp_path):
    """The R008 the example's header speaks of: the synchronized batch norm's collectives on
    comp2 and the gradient buckets on update are not ordered."""
    text = _read("resnet_digits_dp.sched").replace("graph reduce     on comp2  {", "graph reduce     on update {")
    assert set(_codes(tmp_path, text)) == {"R008"}
    assert _codes(tmp_path, _read("resnet_digits_dp.sched")) == []


def test_running_statistics_are_averaged_over_the_ranks(tmp_path):
    """allreduce(stats(m)): every rank ends with the mean of the ranks' running means, which for
    equal shards is the running mean of the global batch (the running mean is linear in the
    batch means); SimGroup's mean is recomputed here from the two shards' statistics."""
    text = _resnet_dp(16)
    two = _params(tmp_path, text, "r2.sched", 2, steps=1)
    assert "b1.running_mean" in two and "b1.running_var" in two
    assert float(np.max(np.abs(two["b1.running_mean"]))) > 0  # moved from its zero start


# -- buckets and the planner ---------------------------------------------------------------------


def _compile_text(tmp_path, text: str, name: str = "t.sched"):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return compile_file(str(p))


def _buckets(c) -> list[tuple[str, ...]]:
    return [t.outs for t in c.schedule.tasks if t.kernel == "allreduce_mean" and t.step == 0]


def test_buckets_by_layer_group_by_size_and_whole(tmp_path):
    base = _read("mlp_digits_dp.sched")
    c = compile_file(os.path.join(EXAMPLES, "mlp_digits_dp.sched"))
    assert _buckets(c) == [("grad.logits.b", "grad.logits.w", "grad.h2.b", "grad.h2.w"), ("grad.h1.b", "grad.h1.w")]
    whole = _compile_text(tmp_path, base.replace('allreduce(grad(mlp), buckets = "logits h2 | h1")',
                                                 "allreduce(grad(mlp))"))
    assert whole.ok and len(_buckets(whole)) == 1 and len(_buckets(whole)[0]) == 6
    # h2.w and h1.w are 256 KiB and 64 KiB in f32; logits.w 10 KiB: at 64 KiB the buckets close
    # at logits.w + h2.b + h2.w, then h1.b + h1.w
    sized = _compile_text(tmp_path, base.replace('buckets = "logits h2 | h1"', "bucket_kib = 64"))
    assert sized.ok
    assert _buckets(sized) == [("grad.logits.b", "grad.logits.w", "grad.h2.b", "grad.h2.w"),
                               ("grad.h1.b", "grad.h1.w")]
    tiny = _compile_text(tmp_path, base.replace('buckets = "logits h2 | h1"', "bucket_kib = 0.001"))
    assert [len(b) for b in _buckets(tiny)] == [1] * 6


def _hb_before(plan, target: int) -> set[int]:
    """Tasks that happen before task `target` in `plan` (capture none): stream order plus
    record -> wait edges, walked backwards (an oracle independent of validate.py)."""
    nodes = []  # (kind, stream, payload) in issue order
    last_on: dict[str, int] = {}
    preds: dict[int, set[int]] = defaultdict(set)
    record_at: dict[int, int] = {}
    task_node: dict[int, int] = {}
    for ins in plan.instrs:
        i = len(nodes)
        nodes.append(ins)
        if ins.stream in last_on:
            preds[i].add(last_on[ins.stream])
        last_on[ins.stream] = i
        if ins.op == "record":
            record_at[ins.event] = i
        elif ins.op == "wait" and ins.event in record_at:
            preds[i].add(record_at[ins.event])
        elif ins.op == "launch":
            task_node[ins.task] = i
    seen, todo = set(), [task_node[target]]
    while todo:
        n = todo.pop()
        for p in preds[n]:
            if p not in seen:
                seen.add(p)
                todo.append(p)
    return {nodes[n].task for n in seen if nodes[n].op == "launch"}


def test_each_bucket_waits_only_for_its_own_gradients():
    c = compile_file(os.path.join(EXAMPLES, "mlp_digits_dp.sched"), capture="none")
    assert c.ok
    tasks = c.schedule.tasks
    first, second = [t for t in tasks if t.kernel == "allreduce_mean" and t.step == 1]
    before1, before2 = _hb_before(c.plan, first.id), _hb_before(c.plan, second.id)
    step1 = [t for t in tasks if t.step == 1]

    def writer(grad):
        return next(t.id for t in reversed(step1) if grad in t.outs and t.kernel != "allreduce_mean")

    assert {writer(g) for g in first.outs} <= before1
    assert {writer(g) for g in second.outs} <= before2
    # the first bucket does not wait for the first layer's gradients: it overlaps their GEMMs
    assert writer("grad.h1.w") not in before1 and writer("grad.h1.b") not in before1
    # and every optimizer task runs after the all-reduce of the gradient it reads
    for t in step1:
        if t.kernel == "sgd_step":
            bucket = first if set(t.args) & set(first.outs) else second
            assert bucket.id in _hb_before(c.plan, t.id), t.label


# -- diagnostics -----------------------------------------------------------------------------------

HEAD = """streams {
    trans : copy
    comp1 : compute
    comp2 : compute
    update : update
}
model m(batch = 8) {
    input x : f32[batch, 4]
    input y : i32[batch]
    h = linear(x, 8)
    a = relu(h)
    logits = linear(a, 3)
    loss = softmax_cross_entropy(logits, y)
}
graph load[a, b] on trans { copy batch -> x, y }
graph zero_grad on update { clear grad(m) }
graph pass on comp1 { forward m; backward m }
graph opt on update { sgd(m, lr) }
"""


def _program(graphs: str, step: str) -> str:
    return HEAD + graphs + "\nstep train(slot) {\n    upload lr on trans\n    zero_grad\n" + step + "\n}\n"


def _codes(tmp_path, text: str) -> list[str]:
    p = tmp_path / "d.sched"
    p.write_text(text, encoding="utf-8")
    return sorted(d.code for d in check_file(str(p)))


STEP = "    pass(load[slot])\n    load[next]\n    reduce\n    opt"


def test_the_ordered_step_is_clean(tmp_path):
    assert _codes(tmp_path, _program("graph reduce on update { allreduce(grad(m)) }", STEP)) == []


def test_allreduce_before_the_backward_is_r006(tmp_path):
    step = "    reduce\n    pass(load[slot])\n    load[next]\n    opt"
    assert _codes(tmp_path, _program("graph reduce on update { allreduce(grad(m)) }", step)) == ["R006"]


def test_optimizer_before_the_allreduce_is_r007(tmp_path):
    step = "    pass(load[slot])\n    load[next]\n    opt\n    reduce"
    assert _codes(tmp_path, _program("graph reduce on update { allreduce(grad(m)) }", step)) == ["R007"]


def test_a_gradient_left_out_is_s031_and_its_help_is_the_fix(tmp_path):
    text = _program('graph reduce on update { allreduce(grad(m), buckets = "logits") }', STEP)
    p = tmp_path / "d.sched"
    p.write_text(text, encoding="utf-8")
    diags = check_file(str(p))
    assert [d.code for d in diags] == ["S031"]
    fix = re.search(r"`(buckets = \"[^`]*\")`", diags[0].help).group(1)
    assert _codes(tmp_path, text.replace('buckets = "logits"', fix)) == []


def test_collectives_on_two_unordered_streams_are_r008_and_the_help_fixes_it(tmp_path):
    graphs = ('graph reduce_head on update { allreduce(grad(m), buckets = "logits") }\n'
              'graph reduce_first on comp2 { allreduce(grad(m), buckets = "h") }')
    step = "    pass(load[slot])\n    load[next]\n    reduce_head\n    reduce_first\n    opt"
    text = _program(graphs, step)
    p = tmp_path / "d.sched"
    p.write_text(text, encoding="utf-8")
    diags = check_file(str(p))
    assert [d.code for d in diags] == ["R008"]
    clause = re.search(r"`(on \w+)`", diags[0].help).group(1)
    fixed = text.replace('buckets = "h") }', f'buckets = "h") {clause} }}')
    assert _codes(tmp_path, fixed) == []
    # ordered by an `after` in the step instead: also clean
    ordered = text.replace("    reduce_first\n", "    reduce_first after reduce_head\n")
    assert _codes(tmp_path, ordered) == []


def test_missing_after_under_explicit_is_a_race_on_the_gradient(tmp_path):
    text = _program("graph reduce on update { allreduce(grad(m)) }", STEP).replace(
        "graph load[a, b]", "barriers explicit\ngraph load[a, b]")
    p = tmp_path / "d.sched"
    p.write_text(text, encoding="utf-8")
    races = [d for d in check_file(str(p)) if d.code == "R001"]
    assert any("grad." in d.message and "allreduce" in d.message for d in races), [d.message for d in races]


@pytest.mark.parametrize("stmt,code", [
    ("allreduce(m)", "S015"),
    ("allreduce(grad(m), stats(m))", "S005"),
    ('allreduce(grad(m), buckets = "h nope")', "S007"),
    ('allreduce(grad(m), buckets = "h | h logits")', "S015"),
    ('allreduce(grad(m), buckets = "h || logits")', "S015"),
    ('allreduce(grad(m), buckets = "h", bucket_kib = 4)', "S015"),
    ("allreduce(grad(m), bucket_kib = 0)", "S015"),
    ("allreduce(grad(m), sizes = 3)", "S015"),
    ("allreduce(stats(m))", "S015"),  # m has no batch norm
])
def test_statement_mistakes(tmp_path, stmt, code):
    assert code in _codes(tmp_path, _program(f"graph reduce on update {{ {stmt} }}", STEP))


# -- the simulated group and the launcher ----------------------------------------------------------


def test_sim_group_mean_and_mismatch():
    import threading

    g = SimGroup(3, timeout=5)
    arrays = [np.full(4, float(r + 1)) for r in range(3)]
    errs = []

    def rank(r, key):
        try:
            g.member(r).allreduce_mean(key, [arrays[r]])
        except CollectiveError as e:
            errs.append(str(e))

    ts = [threading.Thread(target=rank, args=(r, "k")) for r in range(3)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errs and all(np.array_equal(a, np.full(4, 2.0)) for a in arrays)
    g2 = SimGroup(2, timeout=5)
    ts = [threading.Thread(target=rank2, args=(g2, r, k, errs)) for r, k in ((0, "a"), (1, "b"))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert len(errs) == 2 and "different collectives" in " ".join(errs)


def rank2(g, r, key, errs):
    try:
        g.member(r).allreduce_mean(key, [np.zeros(2)])
    except CollectiveError as e:
        errs.append(str(e))


def test_a_failing_rank_releases_the_others(tmp_path):
    """A kernel failure on one simulated rank stops the run with that failure, not a hang: the
    other rank, waiting in the all-reduce, is released."""
    import dataclasses

    from streamsched.interp.train import TaskFailedError

    rec = collectives.FAMILY.kernels["allreduce_mean"]
    calls = {"n": 0}

    def flaky(ins, outs, at=None):
        if collectives.current_group().rank == 1:
            calls["n"] += 1
            raise RuntimeError("rank 1 lost its GPU")
        rec.cpu(ins, outs, at)

    path = tmp_path / "f.sched"
    path.write_text(_mlp_f64(32), encoding="utf-8")
    c = compile_file(str(path))
    kernels = dict(c.program.kernels)
    kernels["allreduce_mean"] = dataclasses.replace(rec, cpu=flaky)
    c = dataclasses.replace(c, program=dataclasses.replace(c.program, kernels=kernels))
    t0 = time.monotonic()
    with pytest.raises(TaskFailedError, match="rank 1 lost its GPU"):
        train(c, TrainOptions(backend="cpu", progress=False, max_steps=4, devices=2), base_dir=str(tmp_path))
    assert time.monotonic() - t0 < 60 and calls["n"] == 1


def test_launcher_variables():
    assert rank_env({}) == rank_env({"WORLD_SIZE": "1"})
    e = rank_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "1234"})
    assert (e.rank, e.world, e.local_rank, e.master_addr, e.master_port, e.is_main) == (3, 4, 1, "node7", 1234, False)
    m = rank_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert (m.rank, m.world, m.local_rank) == (1, 2, 1)
    for bad in ({"RANK": "2", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "two"}, {"WORLD_SIZE": "0"},
                {"MASTER_PORT": "70000"}, {"LOCAL_RANK": "-1"}):
        with pytest.raises(LaunchError):
            rank_env(bad)


def test_shards_tile_the_global_batch():
    x, y = np.arange(24).reshape(12, 2), np.arange(12)
    parts = [shard(x, y, r, 3) for r in range(3)]
    assert np.array_equal(np.concatenate([p[0] for p in parts]), x)
    assert np.array_equal(np.concatenate([p[1] for p in parts]), y)


def test_child_command_line():
    assert _without_devices(["run", "f.sched", "--devices", "2", "--epochs", "3"]) == \
        ["f.sched", "--epochs", "3", "--backend", "cuda"]
    assert _without_devices(["run", "--devices=4", "f.sched", "--backend", "cuda"]) == ["f.sched", "--backend", "cuda"]


def test_a_failing_process_stops_the_others(tmp_path, capsys):
    script = tmp_path / "rank.py"
    script.write_text("import os, sys, time\n"
                      "assert os.environ['NCCL_NVLS_ENABLE'] == '0' and os.environ['WORLD_SIZE'] == '2'\n"
                      "open(os.path.join(sys.argv[1], 'started' + os.environ['RANK']), 'w').close()\n"
                      "if os.environ['RANK'] == '1': sys.exit(3)\n"
                      "time.sleep(120)\n", encoding="utf-8")
    t0 = time.monotonic()
    err = []

    class Sink:
        def write(self, s):
            err.append(s)

    rc = launch([str(tmp_path)], 2, command=[sys.executable, str(script)], stderr=Sink())
    assert rc == 1 and time.monotonic() - t0 < 30
    assert (tmp_path / "started0").exists() and (tmp_path / "started1").exists()
    assert "X022" in "".join(err) and "rank 1 of 2" in "".join(err)


def test_cli_devices_on_the_cpu_simulates_the_ranks(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "streamsched", "run", os.path.join(EXAMPLES, "mlp_digits_dp.sched"),
                        "--backend", "cpu", "--devices", "2", "--steps", "3", "-q"],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "cpu: 3 steps" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "streamsched", "run", os.path.join(EXAMPLES, "mlp_digits_dp.sched"),
                          "--backend", "cpu", "--steps", "1", "-q"], capture_output=True, text=True,
                         env=dict(env, WORLD_SIZE="2", RANK="5"), cwd=str(tmp_path), timeout=300)
    assert bad.returncode == 1 and "X004" in bad.stderr and "Traceback" not in bad.stderr


def test_ranks_without_an_allreduce_are_refused_and_the_help_is_the_fix(tmp_path):
    """`--devices 2` on a step that all-reduces nothing would train replicas apart: X004, and the
    graph and launch its help names make the file train data parallel."""
    import re

    from streamsched.diagnostics import StreamschedError
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "mlp_digits.sched")
    c = compile_file(src)
    with pytest.raises(StreamschedError) as ei:
        train(c, TrainOptions(backend="cpu", devices=2, max_steps=2, progress=False), base_dir=os.path.dirname(src))
    (d,) = ei.value.diagnostics
    assert d.code == "X004" and "all-reduces nothing" in d.message
    graph = re.search(r"`(graph reduce on update \{[^`]*\})`", d.help).group(1)
    text = open(src, encoding="utf-8").read().replace("graph optimize", graph + "\ngraph optimize", 1)
    text = re.sub(r"(\n\s*)optimize\b", r"\1reduce\1optimize", text, count=1)
    fixed = tmp_path / "dp.sched"
    fixed.write_text(text)
    c2 = compile_file(str(fixed))
    assert c2.ok, c2.diagnostics
    r = train(c2, TrainOptions(backend="cpu", devices=2, max_steps=2, progress=False), base_dir=os.path.dirname(src))
    assert r.steps == 2
