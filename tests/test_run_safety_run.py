"""The main job never lies about a run: a finite blow-up is X010 with the last good checkpoint
named and no checkpoint of the diverged epoch; resume goes on through any change that keeps the
arrays, with a note of what changed and the learning rate continued by absolute step;
`--resume-weights` fine-tunes; one epoch numbering everywhere; per-epoch lines; an interrupt
prints the exact resume command; BLAS threads are capped; dropout sites draw their own masks;
`--version`; a warmup longer than the run is clipped."""

from __future__ import annotations

import json
import math
import os
import re
import shlex

import numpy as np
import pytest

from safety_helpers import assert_untouched, code_of, main, project, run_tiny, snapshot
from streamsched import __version__, cli
from streamsched.diagnostics import StreamschedError
from streamsched.interp import cpu_threads
from streamsched.interp.checkpoint import load_checkpoint, save_checkpoint
from streamsched.interp.lr import make_schedule
from streamsched.interp.train import DIVERGE_BEST, DIVERGE_UNIFORM, TrainOptions, divergence, train
from streamsched.pipeline import compile_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "examples")
COSINE = {"lr     = 0.05": "lr     = cosine(0.05, warmup = 2)"}


def _log(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8").read().splitlines()]


# ---- divergence


def test_divergence_rule_against_its_definition():
    for classes in (2, 3, 10, 1000):
        u = math.log(classes)
        chance = 1 / classes
        for loss, best in ((0.1, None), (u, None), (9.99 * u, None), (10.01 * u, None), (1e29, 0.3),
                           (4.1 * 0.3, 0.3), (1.01 * u, 0.2), (0.99 * u, 0.01), (1.01 * u, u / 3.9),
                           (0.0004, 0.0001), (0.3, 0.07), (0.07 + 0.26 * u, 0.07), (0.07 + 0.24 * u, 0.07)):
            for acc, best_acc in ((None, None), (0.9, 0.95), (0.2, 0.95), (0.5, 0.95), (chance, 0.4), (0.01, 0.6)):
                want = loss > 10 * u or (best is not None and loss > 4 * best and loss > best + u / 4) or (
                    acc is not None and best_acc - chance >= (1 - chance) / 2 and acc < chance + (best_acc - chance) / 2)
                got = divergence(loss, best, classes, acc, best_acc)
                assert (got is not None) == want, (classes, loss, best, acc, best_acc, got)
    assert divergence(5.0, None, 1) is None  # one class: nothing to guess
    assert (DIVERGE_UNIFORM, DIVERGE_BEST) == (10.0, 4.0)


def _curves() -> dict[str, list[dict]]:
    with open(os.path.join(ROOT, "tests", "data", "loss_curves.json"), encoding="utf-8") as f:
        return json.load(f)["curves"]


def _first_firing(recs: list[dict], classes: int = 10) -> int | None:
    """The first epoch the rule stops, replaying the loop's bookkeeping (baselines from whole epochs)."""
    best = best_acc = None
    for r in recs:
        if divergence(r["train_loss"], best, classes, r.get("test_acc"), best_acc):
            return r["epoch"]
        best = r["train_loss"] if best is None else min(best, r["train_loss"])
        best_acc = r["test_acc"] if best_acc is None else max(best_acc, r["test_acc"])
    return None


def test_the_rule_never_fires_on_the_examples_real_curves():
    """F3's other half: no false alarm on every example's CPU run (tests/data/loss_curves.json,
    made by benchmarks/loss_curves.py), nor on noisy runs at high constant rates that learn."""
    curves = _curves()
    healthy = [k for k in curves if not k.startswith("collapse:")]
    assert {"mlp_digits", "resnet_digits", "resnet_lars", "seed_step", "swish_mlp"} <= set(healthy)
    assert any(k.startswith("noisy:") for k in healthy)
    for name in healthy:
        assert _first_firing(curves[name]) is None, name


def test_the_rule_stops_a_collapse_at_its_first_collapsed_epoch():
    """F3: `step(0.01, every = 11, gamma = 2)` doubles the rate each epoch: epoch 7 falls from 92% to 21%
    test accuracy at a train loss of 1.61, below ln(10), which the old rule let pass and saved."""
    curves = _curves()
    c = curves["collapse:step(0.01, every = 11, gamma = 2)"]
    assert c[6]["epoch"] == 7 and c[6]["test_acc"] < 0.25 < 0.9 < c[5]["test_acc"] and c[6]["train_loss"] < math.log(10)
    assert _first_firing(c) == 7
    c = curves["collapse:step(0.02, every = 11, gamma = 1.5)"]
    assert _first_firing(c) == 10 and c[9]["test_acc"] < 0.4


def test_a_finite_blow_up_is_x010_and_saves_nothing_of_it(tmp_path, capsys):
    sched = project(tmp_path, replace={"lr     = 0.05": "lr     = 0.05"})
    ck, log = tmp_path / "ck.npz", tmp_path / "run.jsonl"
    rc, _, err = run_tiny(capsys, sched, "--epochs", "1", "--save", ck, "--log", log)
    assert rc == 0, err
    before = snapshot(tmp_path)
    rc, out, err = run_tiny(capsys, sched, "--epochs", "3", "--resume", ck, "--save", ck, "--log", log,
                            "--lr", "300")
    assert rc == 1 and out == "" and code_of(err) == "X010", err
    assert "training diverged in epoch 2/3 with --lr 300: its train loss" in err
    assert f"the last good checkpoint is `{ck}` (epoch 1), no checkpoint of this epoch was written" in err
    assert f"--lr 30 --resume {ck}" in err  # the help's command resumes from it with a tenth of the rate
    after = assert_untouched(before, tmp_path, own=("run.jsonl",))
    assert after["ck.npz"] == before["ck.npz"]
    recs = _log(log)
    assert recs[-1]["epoch"] == 2 and recs[-1]["diverged"] is True and recs[-1]["train_loss"] > 10 * math.log(3)
    assert math.isfinite(recs[-1]["train_loss"])  # a finite blow-up: once called a success


def test_divergence_in_the_file_points_at_lr_and_the_help_is_a_command(tmp_path, capsys):
    sched = project(tmp_path, replace={"lr     = 0.05": "lr     = 300"})
    rc, out, err = run_tiny(capsys, sched, "--epochs", "2", "--save", tmp_path / "ck.npz")
    assert rc == 1 and code_of(err) == "X010" and f"tiny.sched:29:" in err
    assert "no checkpoint was written" in err and not (tmp_path / "ck.npz").exists()
    assert "help: lower `lr` in the train block" in err


def test_the_help_command_of_a_divergence_resumes(tmp_path, capsys, monkeypatch):
    sched = project(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert run_tiny(capsys, sched, "--epochs", "1", "--save", "ck.npz")[0] == 0
    rc, _, err = run_tiny(capsys, sched, "--epochs", "3", "--resume", "ck.npz", "--save", "ck.npz", "--lr", "300")
    cmd = re.search(r"resume from it with a tenth of the learning rate: `([^`]+)`", err).group(1)
    argv = shlex.split(cmd)
    assert argv[0] == "streamsched"
    rc, out, err = main(capsys, *argv[1:])
    assert rc in (0, 1) and ("resumed from `ck.npz` after epoch 1" in err)


# ---- resume


def test_a_comment_or_more_epochs_resume_with_a_note_and_bit_exact(tmp_path, capsys):
    sched = project(tmp_path, replace=COSINE)
    full = tmp_path / "full.jsonl"
    assert run_tiny(capsys, sched, "--epochs", "4", "--log", full)[0] == 0
    ck = tmp_path / "ck.npz"
    assert run_tiny(capsys, sched, "--epochs", "2", "--save", ck)[0] == 0
    with open(sched, "a") as f:
        f.write("# a comment added later\n")
    before = snapshot(tmp_path)
    log = tmp_path / "resumed.jsonl"
    rc, out, err = run_tiny(capsys, sched, "--epochs", "4", "--resume", ck, "--save", ck, "--log", log)
    assert rc == 0, err
    assert_untouched(before, tmp_path, own=("ck.npz", "resumed.jsonl"))
    assert f"resumed from `{ck}` after epoch 2 (step 8); changed since it was written: the program text, epochs 2 -> 4" \
        in err
    # the 2-epoch plan had ended (rate 0): the new steps follow the 16-step plan, not 0
    plan16 = make_schedule("cosine", (0.05,), {"warmup": 2}, 16)
    assert (f"note: the learning-rate plan of `{ck}` had ended at step 8 (rate 0), where going on would train at 0; "
            f"the 8 new steps follow cosine(v=0.05, warmup=2, min=0.0) stretched to the new end, step 16: "
            f"{plan16(8):.6g} at step 8, decaying to 0") in err
    recs = _log(log)
    assert [r["epoch"] for r in recs] == [3, 4] and [r["step"] for r in recs] == [12, 16]
    assert [r["lr"] for r in recs] == [plan16(11), plan16(15)] and recs[0]["lr"] > 0.005


def test_resume_with_the_same_length_is_the_uninterrupted_run(tmp_path):
    sched = project(tmp_path, replace=COSINE)
    c = compile_file(sched)
    full = train(c, TrainOptions(backend="cpu", progress=False, epochs=4), base_dir=str(tmp_path))
    ck = str(tmp_path / "ck.npz")
    train(c, TrainOptions(backend="cpu", progress=False, epochs=4, save=ck, max_steps=8), base_dir=str(tmp_path))
    res = train(c, TrainOptions(backend="cpu", progress=False, epochs=4, resume=ck), base_dir=str(tmp_path),
                echo=lambda s: None)
    for k, v in full.params.items():
        assert np.array_equal(v, res.params[k]), k
    assert [r["lr"] for r in res.history] == [r["lr"] for r in full.history]
    assert [r["epoch"] for r in res.history] == [1, 2, 3, 4]


def test_continued_schedule_is_continuous_and_decays_to_the_new_end():
    for name, kw in (("cosine", {"warmup": 5}), ("linear", {"warmup": 0}), ("cosine", {"warmup": 5, "min": 0.01})):
        old = make_schedule(name, (0.1,), kw, 40)
        lo = dict(old.params).get("min", 0.0)
        for t0, total in ((20, 80), (3, 80), (39, 60), (30, 35)):  # an interrupted plan: no jump
            new = old.continued(t0, total)
            assert not new.restarted
            assert new(t0) == pytest.approx(old(t0), rel=1e-12, abs=1e-15)
            vals = [new(t) for t in range(max(t0, 5), total + 3)]
            assert all(b <= a + 1e-15 for a, b in zip(vals, vals[1:]))
            assert new(total) == pytest.approx(lo)
        assert old.continued(20, 40) is old


def test_a_finished_plan_given_more_steps_follows_the_longer_plan():
    """F1: a finished cosine or linear plan had reached its floor (0): going on there trained at
    lr 0.  The new steps follow the plan stretched to the new end: the rate of a run planned for
    the new length from the start, which decays to `min` again (tested against the formula)."""
    for name, kw in (("cosine", {"warmup": 50}), ("linear", {"warmup": 0}), ("cosine", {"warmup": 5, "min": 0.01})):
        v, w, lo = 0.1, kw["warmup"], kw.get("min", 0.0)
        old = make_schedule(name, (v,), kw, 440)
        assert old(440) == pytest.approx(lo)
        for total in (451, 660, 880):
            new = old.continued(440, total)
            assert new.restarted
            for t in range(440, total + 1):
                p = (t - w) / (total - w)
                want = lo + (v - lo) * (1 + math.cos(math.pi * p)) / 2 if name == "cosine" else v * (1 - p)
                assert new(t) == pytest.approx(want, rel=1e-9, abs=1e-12), (name, total, t)
            assert new(total) == pytest.approx(lo)
            assert new(440) > lo + 1e-4  # trains again
        # 40 -> 60 epochs of 11 steps: the rate restarts at a quarter of the peak (cosine, p = 2/3)
    assert make_schedule("cosine", (0.1,), {"warmup": 50}, 440).continued(440, 660)(440) == pytest.approx(
        0.1 * (1 + math.cos(math.pi * 390 / 610)) / 2)


def test_a_changed_layout_is_x007_before_anything_is_written(tmp_path, capsys):
    sched = project(tmp_path)
    ck = tmp_path / "ck.npz"
    assert run_tiny(capsys, sched, "--epochs", "1", "--save", ck)[0] == 0
    wide = project(tmp_path, name="wide.sched", replace={"logits = linear(x, 3)": "h = linear(x, 5)\n    "
                                                                                  "logits = linear(h, 3)"})
    before = snapshot(tmp_path)
    rc, out, err = run_tiny(capsys, wide, "--resume", ck, "--save", ck)
    assert rc == 1 and code_of(err) == "X007"
    assert_untouched(before, tmp_path)


def test_resume_weights_loads_parameters_only(tmp_path, capsys):
    sched = project(tmp_path)
    ck = tmp_path / "ck.npz"
    assert run_tiny(capsys, sched, "--epochs", "2", "--save", ck)[0] == 0
    arrays, meta = load_checkpoint(ck)
    c = compile_file(sched)
    msgs = []
    res = train(c, TrainOptions(backend="cpu", progress=False, resume_weights=str(ck), max_steps=0),
                base_dir=str(tmp_path), echo=msgs.append)
    for name in ("logits.w", "logits.b"):
        assert np.array_equal(res.params[name], arrays[name])
    assert not res.params["sgd.v.logits.w"].any()  # the optimizer starts afresh
    assert np.abs(arrays["sgd.v.logits.w"]).sum() > 0
    assert any("loaded the 2 parameters of `m`" in m and "start afresh" in m for m in msgs)
    log = tmp_path / "ft.jsonl"
    rc, _, err = run_tiny(capsys, sched, "--resume-weights", ck, "--log", log, "--epochs", "2")
    assert rc == 0 and [r["epoch"] for r in _log(log)] == [1, 2]


def test_resume_weights_needs_every_parameter(tmp_path, capsys):
    sched = project(tmp_path)
    bad = tmp_path / "w.npz"
    save_checkpoint(bad, {"logits.w": np.zeros((4, 3), np.float32)}, {"model": "m"})
    rc, _, err = run_tiny(capsys, sched, "--resume-weights", bad)
    assert rc == 1 and code_of(err) == "X007" and "lacks 1 array this run needs: `logits.b`" in err
    rc, _, err = run_tiny(capsys, sched, "--resume-weights", bad, "--resume", bad)
    assert rc == 1 and code_of(err) == "X004" and "exclude each other" in err


def test_a_format_1_checkpoint_still_resumes(tmp_path, capsys):
    sched = project(tmp_path)
    ck = tmp_path / "ck.npz"
    assert run_tiny(capsys, sched, "--epochs", "1", "--save", ck)[0] == 0
    arrays, meta = load_checkpoint(ck)
    old = {"program": meta["program"], "model": "m", "seed": 0, "steps_per_epoch": 4, "epoch": 0,
           "history": [{**meta["history"][0], "epoch": 0}]}
    path = tmp_path / "v1.npz"  # as streamsched 0.1 wrote it: format 1, the last epoch counted from 0
    _write_format(path, arrays, {**old, "format": 1})
    assert load_checkpoint(path)[1]["format"] == 1
    log = tmp_path / "r.jsonl"
    rc, _, err = run_tiny(capsys, sched, "--epochs", "2", "--resume", path, "--log", log)
    assert rc == 0, err
    assert f"resumed from `{path}` after epoch 1 (step 4)" in err and [r["epoch"] for r in _log(log)] == [2]


def _write_format(path, arrays, meta):
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        for k, a in {**arrays, "__meta__": np.frombuffer(json.dumps(meta).encode(), np.uint8)}.items():
            with zf.open(k + ".npy", "w") as f:
                np.lib.format.write_array(f, np.asarray(a), allow_pickle=False)


# ---- feedback and numbering


def test_one_epoch_line_each_on_stderr_and_one_numbering(tmp_path, capsys):
    sched = project(tmp_path)
    log = tmp_path / "run.jsonl"
    rc, out, err = main(capsys, "run", sched, "--backend", "cpu", "--epochs", "3", "--log", log,
                        "--save", tmp_path / "ck.npz")
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("epoch ")]
    assert [ln.split(":")[0] for ln in lines] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert re.fullmatch(r"epoch 1/3: train loss \d+\.\d{4}, test loss \d+\.\d{4}, test accuracy \d+\.\d\d%, "
                        r"\d+\.\d\d s", lines[0])
    recs = _log(log)
    assert [r["epoch"] for r in recs] == [1, 2, 3]
    assert "epoch 3: train loss" in out and load_checkpoint(tmp_path / "ck.npz")[1]["epoch"] == 3
    assert all(r["run"] == recs[0]["run"] for r in recs) and f"run {recs[0]['run']}:" in err
    rc, out, err = main(capsys, "run", sched, "--backend", "cpu", "--epochs", "3", "-q")
    assert rc == 0 and err == ""  # -q: not a line


def test_version(capsys):
    assert cli.main(["--version"]) == 0  # main returns the status, it never raises (SystemExit included)
    assert capsys.readouterr().out.strip() == f"streamsched {__version__}"
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        assert f'version = "{__version__}"' in f.read()


def test_a_warmup_longer_than_a_short_run_is_clipped(capsys):
    rc, out, err = main(capsys, "run", os.path.join(EX, "mlp_digits.sched"), "--backend", "cpu", "--epochs", "3", "-q")
    assert rc == 0, err
    assert "note: the warmup of 50 steps is longer than this run (33 steps); it is clipped to 33 steps" in err
    assert "epoch 3:" in out


def test_an_interrupt_prints_the_checkpoint_and_the_exact_resume_command(tmp_path, capsys, monkeypatch):
    sched = project(tmp_path)
    monkeypatch.chdir(tmp_path)
    import streamsched.interp.train as train_mod

    real = train_mod._Run.end_epoch

    def stop_in_epoch_3(self, e, *rest):
        real(self, e, *rest)
        if e == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_mod._Run, "end_epoch", stop_in_epoch_3)
    before = snapshot(tmp_path)
    rc, out, err = main(capsys, "run", "tiny.sched", "--backend", "cpu", "-q", "--epochs", "5",
                        "--save", "ck.npz", "--log", "run.jsonl")
    assert rc == 130
    assert_untouched(before, tmp_path, own=("ck.npz", "run.jsonl"))
    assert "interrupted by SIGINT in epoch 2/5" in err
    assert "the checkpoint `ck.npz` holds epoch 2; resume with:" in err
    cmd = err.split("resume with:\n", 1)[1].splitlines()[0].strip()
    assert cmd == "streamsched run tiny.sched --backend cpu -q --epochs 5 --save ck.npz --log run.jsonl --resume ck.npz"
    monkeypatch.setattr(train_mod._Run, "end_epoch", real)
    rc, out, err = main(capsys, *shlex.split(cmd)[1:])
    assert rc == 0 and "resumed from `ck.npz` after epoch 2 (step 8)" in err and "epoch 5:" in out
    assert [r["epoch"] for r in _log(tmp_path / "run.jsonl")] == [1, 2, 3, 4, 5]


def test_an_interrupt_before_any_checkpoint_says_so(tmp_path, capsys, monkeypatch):
    sched = project(tmp_path)
    import streamsched.interp.train as train_mod

    def stop(self, k):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod._Run, "after_step", stop)
    rc, out, err = main(capsys, "run", sched, "--backend", "cpu", "-q")
    assert rc == 130 and "no checkpoint was written: give --save FILE to be able to resume" in err


# ---- BLAS threads


def test_threads_are_capped_to_the_usable_cores(monkeypatch):
    c = compile_file(os.path.join(EX, "mlp_digits.sched"))
    assert cpu_threads.largest_product_flops(c.schedule) == 2 * 128 * 256 * 256
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 2)
    assert cpu_threads.choose_threads(None, c.schedule) == (1, "")  # small products: one thread
    n, note = cpu_threads.choose_threads(16, c.schedule)
    assert n == 2 and note.startswith("--threads 16: this process may use 2 cores; using 2 BLAS threads; more BLAS "
                                      "threads than the 1 this program's matrix products can keep busy")
    n, note = cpu_threads.choose_threads(2, c.schedule)  # within the cores, above what the products use
    assert n == 2 and note.startswith("--threads 2: more BLAS threads than the 1") and "busy" in note
    assert cpu_threads.choose_threads(1, c.schedule) == (1, "")


def test_large_products_get_threads_up_to_the_cores(tmp_path, monkeypatch):
    sched = project(tmp_path, replace={"model m(batch = 4)": "model m(batch = 2048)",
                                       "logits = linear(x, 3)": "h = linear(x, 4096)\n    logits = linear(h, 3)"})
    c = compile_file(sched)
    flops = cpu_threads.largest_product_flops(c.schedule)
    assert flops == 2 * 2048 * 4096 * 3 or flops >= 2 * 2048 * 4096 * 3
    for cores in (1, 3, 64):
        monkeypatch.setattr(cpu_threads, "usable_cores", lambda: cores)
        assert cpu_threads.choose_threads(None, c.schedule)[0] == max(1, min(cores, flops // cpu_threads.FLOPS_PER_THREAD))


def test_the_run_holds_blas_to_its_threads(tmp_path):
    from threadpoolctl import threadpool_info

    sched = project(tmp_path)
    seen = []

    def echo(line):
        if line.startswith("epoch "):
            seen.append({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})

    res = train(compile_file(sched), TrainOptions(backend="cpu", epochs=1), base_dir=str(tmp_path), echo=echo)
    assert res.threads == 1 and seen == [{1}]


def test_usable_cores_reads_the_cgroup_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(cpu_threads, "_cgroup_quota", lambda: 2.5)
    assert cpu_threads.usable_cores() == 3
    monkeypatch.setattr(cpu_threads, "_cgroup_quota", lambda: None)
    assert cpu_threads.usable_cores() == 8


# ---- dropout sites


DROP = """\
streams {
    trans  : copy
    comp1  : compute
    comp2  : compute
    comp3  : compute
    update : update
}
model m(batch = 4) {
    input x : f32[batch, 6]
    input y : i32[batch]
    a      = dropout(x, p = 0.5)
    b      = dropout(x, p = 0.5)
    c      = dropout(x, p = 0.5, seed = 7)
    s      = add(a, b)
    t      = add(s, c)
    logits = linear(t, 10)
    loss   = softmax_cross_entropy(logits, y)
}
graph load[a, b] on trans  { copy batch -> x, y }
graph zero_grad  on update { clear grad(m) }
graph pass       on comp1  { forward m; backward m }
graph optimize   on update { sgd(m, lr) }
step train(slot) {
    upload lr on trans
    zero_grad
    pass(load[slot])
    load[next]
    optimize
}
train {
    model = m
    data  = digits()
}
"""


def test_same_shaped_dropout_sites_draw_different_masks(tmp_path):
    from streamsched.stdlib.kernels.dropout import site_seed
    from streamsched.stdlib.kernels.dropout import dropout_bits

    p = tmp_path / "drop.sched"
    p.write_text(DROP)
    c = compile_file(str(p))
    seeds = {t.label.split("@")[1].split(".")[0]: t.attr("seed") for t in c.schedule.tasks if t.kernel == "dropout"}
    assert seeds == {"a": site_seed("m", "a"), "b": site_seed("m", "b"), "c": 7}
    assert seeds["a"] != seeds["b"] and 0 <= seeds["a"] < 2**63
    import hashlib

    assert site_seed("m", "a") == int.from_bytes(hashlib.sha256(b"m.a").digest()[:8], "big") >> 1
    assert not np.array_equal(dropout_bits(24, seeds["a"], 0), dropout_bits(24, seeds["b"], 0))
    # one step on the CPU backend: the two same-shaped sites keep different elements
    from streamsched.interp.train import CpuRunner
    from test_runtime import _stage

    runner = CpuRunner(c, "fixed", 0, False)
    runner.run(c.segments.for_step(-1), _stage)
    runner.run(c.segments.for_step(0), _stage)
    ma, mb = runner.read("a.mask"), runner.read("b.mask")
    assert ma.shape == mb.shape == (4, 6) and not np.array_equal(ma, mb)
    again = compile_file(str(p))  # the same program, the same masks
    assert {t.attr("seed") for t in again.schedule.tasks if t.kernel == "dropout"} == set(seeds.values())


def test_resume_weights_errors_name_their_own_flag(tmp_path):
    """A bad checkpoint given to --resume-weights is X007 whose help names --resume-weights (the
    checks are --resume's, whose help would send the user to the wrong flag)."""
    import os

    from streamsched.diagnostics import StreamschedError
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a checkpoint")
    c = compile_file(os.path.join(root, "examples", "mlp_digits.sched"))
    with pytest.raises(StreamschedError) as ei:
        train(c, TrainOptions(backend="cpu", resume_weights=str(bad), max_steps=1, progress=False),
              base_dir=os.path.join(root, "examples"))
    (d,) = ei.value.diagnostics
    assert d.code == "X007" and "--resume-weights" in d.help and "without --resume," not in d.help
