"""The new-user trial of issue 12 (findings F1-F26 and the notes): each reproduction in its general
form, asserting the exit status, the code, that no traceback appears (`main` asserts it), and
that every file that was there is byte-identical afterwards unless it is the run's own checkpoint
or log.  Non-regular paths, full disks and closed streams are made in the test's own folder or
simulated (a stream whose writes fail, a file-size limit on the child), never the machine's /dev."""

from __future__ import annotations

import errno
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import zipfile
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from safety_helpers import assert_untouched, code_of, main, project, run_tiny, snapshot
from streamsched import cli
from streamsched.diagnostics import Diagnostic, SourceCache, render
from streamsched.interp.checkpoint import load_checkpoint
from streamsched.interp.ir import Span
from streamsched.interp.lr import F32_MAX, make_schedule
from streamsched.outputs import (LOCK_SUFFIX, OutputLock, aux_base, check_output, holder_info, is_reserved_name,
                                 lock_path, mark_file, temp_pattern, temp_prefix, temp_suffix)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
RUN = ["run", "tiny.sched", "--backend", "cpu", "-q"]
COSINE = {"lr     = 0.05": "lr     = cosine(0.05, warmup = 2)"}


@pytest.fixture
def proj(tmp_path, monkeypatch):
    """A tiny project in tmp_path, the current folder, with a checkpoint and log of an earlier run."""
    sched = project(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path, sched


def _log(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8").read().splitlines()]


def refused(capsys, root, argv, code="X021", *words) -> str:
    before = snapshot(root)
    rc, out, err = main(capsys, *argv)
    assert rc == 1, err
    assert code_of(err) == code, err
    for w in words:
        assert w in err, (w, err)
    assert "steps in" not in out
    assert_untouched(before, root)
    return err


def _proc(cwd, *args, timeout=180, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "streamsched", *map(str, args)], cwd=cwd, env=ENV,
                       capture_output=True, text=True, timeout=timeout, **kw)
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    return p


# ---- F1: a finished schedule given more epochs trains, at the rates the note announces


def test_f1_resuming_a_finished_cosine_run_with_more_epochs_trains(proj, capsys):
    root, sched = proj
    sched = project(root, replace=COSINE)
    assert run_tiny(capsys, sched, "--epochs", "2", "--save", "ck.npz")[0] == 0
    done, _ = load_checkpoint(root / "ck.npz")
    rc, _, err = run_tiny(capsys, sched, "--epochs", "6", "--resume", "ck.npz", "--save", "ck.npz", "--log", "r.jsonl")
    assert rc == 0, err
    plan = make_schedule("cosine", (0.05,), {"warmup": 2}, 24)  # the 6-epoch plan: what the new steps follow
    m = re.search(r"follow cosine\(v=0\.05, warmup=2, min=0\.0\) stretched to the new end, step 24: (\S+) at step 8, "
                  r"decaying to 0 ", err)
    assert m and float(m.group(1)) == pytest.approx(plan(8), rel=1e-5)
    recs = _log(root / "r.jsonl")
    assert [r["lr"] for r in recs] == pytest.approx([plan(r["step"] - 1) for r in recs], rel=1e-12)
    assert all(r["lr"] > 0 for r in recs[:-1]) and recs[0]["lr"] > 0.02  # it trains, not at lr 0
    after, _ = load_checkpoint(root / "ck.npz")
    assert not np.array_equal(after["logits.w"], done["logits.w"])  # the new epochs moved the weights


# ---- F2, F11, F12: standard streams are feedback, never the work


def test_f2_a_reader_that_stops_reading_stderr_does_not_stop_the_run(tmp_path):
    project(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "streamsched", "run", "tiny.sched", "--backend", "cpu", "--epochs",
                          "25", "--save", "ck.npz", "--log", "run.jsonl"], cwd=tmp_path, env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    p.stderr.readline()  # like `2>&1 | head -1`: the reader leaves after the first line
    p.stderr.close()
    assert p.wait(timeout=180) == 0
    assert [r["epoch"] for r in _log(tmp_path / "run.jsonl")] == list(range(1, 26))  # all 25, not 1
    assert load_checkpoint(tmp_path / "ck.npz")[1]["epoch"] == 25


@pytest.mark.parametrize("closed", [1, 2])
def test_f11_a_closed_stdout_or_stderr_is_like_dev_null(tmp_path, closed):
    project(tmp_path)
    p = subprocess.run([sys.executable, "-m", "streamsched", "run", "tiny.sched", "--backend", "cpu", "--epochs", "3",
                        "--save", "ck.npz", "--log", "run.jsonl"], cwd=tmp_path, env=ENV, capture_output=True,
                       text=True, timeout=180, preexec_fn=lambda: os.close(closed))
    assert p.returncode == 0 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert load_checkpoint(tmp_path / "ck.npz")[1]["epoch"] == 3
    recs = _log(tmp_path / "run.jsonl")  # no message landed in it (its descriptor is not 1 or 2)
    assert [r["epoch"] for r in recs] == [1, 2, 3]
    assert sorted(os.listdir(tmp_path)) == ["ck.npz", "run.jsonl", "tiny.npz", "tiny.sched"]


class _Full(io.StringIO):
    """A stream on a full disk: every write fails with ENOSPC."""

    def write(self, s):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass


def test_f12_stdout_on_a_full_disk_is_x021_after_the_work(proj, capsys, monkeypatch):
    root, _ = proj
    full = _Full()

    def run(*argv):
        real = sys.stdout
        sys.stdout = full
        try:
            rc = cli.main([str(a) for a in argv])
        finally:
            sys.stdout = real
        return rc, capsys.readouterr().err

    rc, err = run(*RUN, "--epochs", "2", "--save", "ck.npz")
    assert rc == 1 and "error[X021]: cannot write the standard output: No space left on device" in err
    assert "Traceback" not in err and load_checkpoint(root / "ck.npz")[1]["epoch"] == 2  # trained and saved
    rc, err = run("check", "--format", "json", "tiny.sched")
    assert rc == 1 and "cannot write the standard output" in err and "Traceback" not in err


def test_f12_stdout_over_a_file_size_limit(tmp_path):
    import resource

    with open(tmp_path / "plan.txt", "wb") as out:
        p = subprocess.run([sys.executable, "-m", "streamsched", "lower", os.path.join(ROOT, "examples",
                                                                                     "seed_step.sched")],
                           cwd=tmp_path, env=ENV, stdout=out, stderr=subprocess.PIPE, text=True, timeout=180,
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "error[X021]: cannot write the standard output: File too large" in p.stderr


# ---- F15, F25, F26: interrupts


def test_f15_an_interrupt_while_the_command_imports_is_a_clean_message(proj, capsys, monkeypatch):
    import builtins

    real = builtins.__import__

    def interrupted(name, *a, **kw):
        if name == "streamsched.interp.train":
            raise KeyboardInterrupt
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    monkeypatch.delitem(sys.modules, "streamsched.interp.train")
    rc, out, err = main(capsys, *RUN, "--save", "ck.npz")
    assert rc == 130 and err.strip() == "interrupted by SIGINT"
    monkeypatch.setattr(builtins, "__import__", real)
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_DFL or True


def test_f15_an_interrupt_in_exec_code_does_not_kill_the_process_after_it_was_handled(tmp_path):
    """A KeyboardInterrupt that lands in code run by exec() of a string (namedtuple and dataclass
    make their methods so, while modules import) made CPython kill itself with SIGINT at exit
    (status -2), after the clean message: the message's status, 130, is the process's."""
    # run as `python -m` does (the interpreter checks that flag after a module run as main)
    (tmp_path / "ki_in_exec.py").write_text("from streamsched import cli\n"
                                            "def boom(argv):\n"
                                            "    exec('raise KeyboardInterrupt')\n"
                                            "cli._main = boom\n"
                                            "raise SystemExit(cli.main([]))\n")
    env = dict(ENV, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "ki_in_exec"], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 130 and p.stderr.strip() == "interrupted by SIGINT", (p.returncode, p.stderr)


def test_f25_an_interrupt_says_which_epochs_of_this_run_are_lost(proj, capsys, monkeypatch):
    root, sched = proj
    assert run_tiny(capsys, sched, "--epochs", "1", "--save", "base.npz")[0] == 0
    import streamsched.interp.train as train_mod

    real = train_mod._Run.end_epoch

    def stop_after_epoch_3(self, e, *rest):
        real(self, e, *rest)
        if e == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_mod._Run, "end_epoch", stop_after_epoch_3)
    before = snapshot(root)
    rc, _, err = main(capsys, *RUN, "--epochs", "9", "--resume", "base.npz")
    assert rc == 130
    assert "the checkpoint `base.npz` holds epoch 1; resume with:" in err
    assert "Epochs 2-3 of this run are in no checkpoint (no --save was given): they are lost" in err
    assert_untouched(before, root)


def _hup_default() -> None:
    """The child starts with SIGHUP's default action even where the suite runs under `nohup`
    (which ignores SIGHUP, and a run keeps that choice: this session's CI once hung here so)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def test_f26_sighup_ends_a_run_like_sigterm(tmp_path):
    project(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "streamsched", "run", "tiny.sched", "--backend", "cpu", "--epochs",
                          "100000", "--save", "ck.npz"], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=_hup_default)
    while not (line := p.stderr.readline()).startswith("epoch 2/"):
        if not line:  # the run ended before its second epoch
            p.kill()
            pytest.fail("no epoch 2 line")
    p.send_signal(signal.SIGHUP)
    try:  # a run that goes on after the signal fails here, it does not hang the suite
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("the run went on after SIGHUP")
    assert p.returncode == 129 and "Traceback" not in err
    assert "interrupted by SIGHUP in epoch" in err and "resume with:" in err
    assert not [n for n in os.listdir(tmp_path) if n.endswith(LOCK_SUFFIX)]  # released


# ---- F3: divergence relative to the run's own history (the curves: test_run_safety_run.py)


def test_f3_an_accuracy_collapse_stops_before_its_epoch_is_saved(proj, capsys, monkeypatch):
    root, sched = proj
    import streamsched.interp.train as train_mod

    import streamsched.interp.training.evaluation as eval_mod  # where evaluate moved (issue 14)

    real = train_mod.evaluate
    calls = []

    def collapsing(program, params, x, y):  # epochs 1-2 learn, epoch 3 collapses to chance
        calls.append(1)
        loss, _ = real(program, params, x, y)
        return loss, (0.95 if len(calls) < 3 else 0.30)

    monkeypatch.setattr(eval_mod, "evaluate", collapsing)
    assert run_tiny(capsys, sched, "--epochs", "2", "--save", "ck.npz", "--log", "run.jsonl")[0] == 0
    calls.clear()
    calls.extend([1, 1])
    before = snapshot(root)
    rc, _, err = run_tiny(capsys, sched, "--epochs", "5", "--resume", "ck.npz", "--save", "ck.npz", "--log", "run.jsonl")
    assert rc == 1 and code_of(err) == "X010", err
    assert "its test accuracy 30.00% fell more than halfway back from the best epoch's 95.00% to chance" in err
    assert "the last good checkpoint is `ck.npz` (epoch 2), no checkpoint of this epoch was written" in err
    after = assert_untouched(before, root, own=("run.jsonl",))
    assert after["ck.npz"] == before["ck.npz"]
    assert _log(root / "run.jsonl")[-1]["diverged"] is True


def test_f3_a_state_that_is_not_finite_is_never_saved(proj, capsys, monkeypatch):
    root, sched = proj
    assert run_tiny(capsys, sched, "--epochs", "1", "--save", "ck.npz")[0] == 0
    import streamsched.interp.train as train_mod

    real = train_mod.CpuRunner.read

    def read(self, name):
        a = real(self, name)
        if name == "sgd.v.logits.w" if "sgd.v.logits.w" in self.arrays else name == "logits.w":
            a = a.copy()
            a.flat[1] = np.inf
        return a

    monkeypatch.setattr(train_mod.CpuRunner, "read", read)
    before = snapshot(root)
    rc, _, err = run_tiny(capsys, sched, "--epochs", "3", "--resume", "ck.npz", "--save", "ck.npz")
    assert rc == 1 and code_of(err) == "X010" and "became inf at index [0, 1] while the loss stayed finite" in err
    assert_untouched(before, root)


# ---- F4-F8, F16, F17, F22, F23, the trailing slash: the output policy


def test_f4_drawings_plans_and_traces_of_other_tools_are_never_replaced(proj, capsys, monkeypatch):
    root, _ = proj
    import streamsched.interp.cuda as cuda_pkg

    monkeypatch.setattr(cuda_pkg, "cuda_available", lambda: (False, "no GPU here"))
    shutil.copy(os.path.join(ROOT, "docs", "timeline_five_streams.png"), root / "photo.png")
    (root / "arch.dot").write_text("digraph mine {\n a -> b;\n}\n")
    (root / "logo.svg").write_text('<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"></svg>\n')
    (root / "todo.txt").write_text("plan: buy milk\n")
    (root / "profile.json").write_text('{"traceEvents": [], "displayTimeUnit": "ns"}\n')
    for argv, words in ((["graph", "tiny.sched", "-o", "photo.png"], "a PNG picture that streamsched did not write"),
                        (["graph", "tiny.sched", "-o", "arch.dot"], "a DOT graph that streamsched did not write"),
                        (["graph", "tiny.sched", "-o", "logo.svg"], "an SVG picture that streamsched did not write"),
                        (["lower", "tiny.sched", "-o", "todo.txt"], "not a plan `streamsched lower` wrote"),
                        (["trace", "tiny.sched", "-o", "profile.json"], "a Chrome trace that streamsched did not write")):
        refused(capsys, root, argv, "X021", words)
    # what streamsched wrote it replaces, marked so, in every format it writes here
    for name in ("plan.dot", "plan.png", "plan.svg"):
        assert main(capsys, "graph", "tiny.sched", "-o", name)[0] == 0
        before = snapshot(root)
        assert main(capsys, "graph", "tiny.sched", "-o", name)[0] == 0
        assert_untouched(before, root, own=(name,))
    assert main(capsys, "lower", "tiny.sched", "-o", "plan.txt")[0] == 0
    assert main(capsys, "lower", "tiny.sched", "-o", "plan.txt")[0] == 0


def test_f4_marks_keep_each_format_valid(tmp_path):
    import xml.etree.ElementTree as ET

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 1))
    fig.savefig(tmp_path / "a.png")
    fig.savefig(tmp_path / "a.svg")
    fig.savefig(tmp_path / "a.pdf")
    plt.close(fig)
    (tmp_path / "a.dot").write_text("digraph plan {\n a -> b;\n}\n")
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": [{"ph": "X"}], "otherData": {"steps": 3}}))
    (tmp_path / "p.txt").write_text("plan: policy auto\n")
    for name, kind in (("a.png", "graph"), ("a.svg", "graph"), ("a.pdf", "graph"), ("a.dot", "graph"),
                       ("t.json", "trace"), ("p.txt", "plan")):
        p = str(tmp_path / name)
        mark_file(p, kind, os.path.splitext(name)[1])
        from streamsched.outputs import kind_of

        assert kind_of(p, kind)[0], name
    data = (tmp_path / "a.png").read_bytes()
    pos = 8
    while pos < len(data):  # every chunk's CRC still holds
        n, typ = struct.unpack(">I4s", data[pos:pos + 8])
        assert struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(data[pos + 4:pos + 8 + n])
        pos += 12 + n
    assert matplotlib.image.imread(str(tmp_path / "a.png")).shape[:2] == (100, 100)
    ET.parse(tmp_path / "a.svg")
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["otherData"]["steps"] == 3 and doc["traceEvents"] == [{"ph": "X"}]
    assert (tmp_path / "a.dot").read_text().splitlines()[1] == "digraph plan {"
    assert (tmp_path / "a.pdf").read_bytes().rstrip().endswith(b"0.1.0")


def test_f5_a_read_only_file_is_never_replaced_even_as_root(proj, capsys, monkeypatch):
    root, sched = proj
    assert run_tiny(capsys, sched, "--epochs", "1", "--save", "ro.npz", "--log", "ro.jsonl")[0] == 0
    for name in ("ro.npz", "ro.jsonl"):
        os.chmod(root / name, 0o444)
    refused(capsys, root, RUN + ["--epochs", "2", "--resume", "ro.npz", "--save", "ro.npz"], "X021",
            "the file is read-only (mode 0444)", "`chmod u+w ro.npz`")
    refused(capsys, root, RUN + ["--log", "ro.jsonl"], "X021", "read-only")
    assert main(capsys, "lower", "tiny.sched", "-o", "p.txt")[0] == 0
    os.chmod(root / "p.txt", 0o400)
    refused(capsys, root, ["lower", "tiny.sched", "-o", "p.txt"], "X021", "read-only")
    os.chmod(root / "ro.npz", 0o644)  # writable by its mode, but not by this user: refused too
    import streamsched.outputs as outputs_mod

    real = os.access
    monkeypatch.setattr(outputs_mod.os, "access", lambda p, m: False if str(p).endswith("ro.npz") else real(p, m))
    refused(capsys, root, RUN + ["--epochs", "2", "--resume", "ro.npz", "--save", "ro.npz"], "X021",
            "the file is not writable by you")


def test_f6_a_checkpoint_is_replaced_only_by_the_run_that_continues_it(proj, capsys):
    root, sched = proj
    assert run_tiny(capsys, sched, "--epochs", "2", "--save", "best.npz")[0] == 0
    other = project(root, name="other.sched", replace={"logits = linear(x, 3)": "h = linear(x, 5)\n    "
                                                                                "logits = linear(h, 3)"})
    err = refused(capsys, root, ["run", other, "--backend", "cpu", "-q", "--save", "best.npz"], "X021",
                  "it holds a checkpoint of model `m` (epoch 2 of 2", "whose arrays do not fit this program")
    assert "--resume" not in err.split("help:")[1]  # resuming another model's checkpoint is no fix
    err = refused(capsys, root, RUN + ["--save", "best.npz"], "X021", "which this run does not continue")
    fix = re.search(r"continue it with `(--resume best\.npz)`", err).group(1)
    before = snapshot(root)
    rc, _, err = main(capsys, *RUN, "--epochs", "3", *shlex.split(fix), "--save", "best.npz")  # the help's fix
    assert rc == 0 and "resumed from `best.npz` after epoch 2" in err
    assert_untouched(before, root, own=("best.npz",))
    rc, _, err = main(capsys, "run", other, "--backend", "cpu", "-q", "--save", "best.npz", "--overwrite")
    assert rc == 0 and load_checkpoint(root / "best.npz")[1]["epoch"] == 2


def test_f7_a_log_held_by_a_run_is_refused_under_another_name(proj, capsys):
    root, sched = proj
    assert run_tiny(capsys, sched, "--epochs", "1", "--log", "a.jsonl")[0] == 0
    os.link(root / "a.jsonl", root / "b.jsonl")
    out = check_output(str(root / "a.jsonl"), "log", noun="the log", append=True)
    lock = OutputLock(out, holder_info("20990101-000000-beef", ["streamsched", "run"]))
    lock.acquire()
    lock.hold_file()
    try:
        refused(capsys, root, RUN + ["--log", "b.jsonl"], "X009", "run 20990101-000000-beef",
                "it is the same file as another name that run writes (a hard link)")
    finally:
        lock.release()
    assert run_tiny(capsys, sched, "--epochs", "1", "--log", "b.jsonl")[0] == 0  # free again


def test_f8_lock_and_temporary_names_never_meet_an_output_or_a_users_file(proj, capsys):
    root, sched = proj
    # names that were lock files before are ordinary outputs now, and nothing is deleted at exit
    rc, _, err = run_tiny(capsys, sched, "--epochs", "2", "--save", ".l.jsonl.lock", "--log", "l.jsonl")
    assert rc == 0 and load_checkpoint(root / ".l.jsonl.lock")[1]["epoch"] == 2
    assert run_tiny(capsys, sched, "--epochs", "1", "--log", ".ck.npz.lock")[0] == 0
    assert run_tiny(capsys, sched, "--epochs", "1", "--save", "ck.npz", "--log", ".ck.npz.lock")[0] == 0
    assert len(_log(root / ".ck.npz.lock")) == 2
    # the names streamsched keeps are no output's
    refused(capsys, root, RUN + ["--save", ".x.npz" + LOCK_SUFFIX], "X021", "one streamsched keeps for its own files")
    refused(capsys, root, RUN + ["--log", ".ck.npz.streamsched-abcd1234.tmp"], "X021", "one streamsched keeps")
    # a user's file where a lock goes is left as it is
    (root / (".x.npz" + LOCK_SUFFIX)).write_text("mine\n")
    refused(capsys, root, RUN + ["--save", "x.npz"], "X021", "a file that streamsched did not write is at")
    assert (root / (".x.npz" + LOCK_SUFFIX)).read_text() == "mine\n"
    os.symlink("notes", root / (".y.npz" + LOCK_SUFFIX))  # a link or a folder there: left too
    os.mkdir(root / (".z.npz" + LOCK_SUFFIX))
    refused(capsys, root, RUN + ["--save", "y.npz"], "X021", "is a symbolic link, not one streamsched made")
    refused(capsys, root, RUN + ["--save", "z.npz"], "X021", "is a folder, not one streamsched made")


@settings(max_examples=80, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1,
               max_size=255))
def test_f8_f17_every_name_gets_a_lock_and_temporary_name_that_fit_and_are_reserved(name):
    if name in (".", "..") or len(os.fsencode(name)) > 255:
        return
    full = os.path.join("/nowhere", name)  # (NAME_MAX of a folder that is not there: 255)
    lock = os.path.basename(lock_path(full))
    tmp = temp_prefix(full) + "a1b2c3d4" + temp_suffix(full, True)
    for aux in (lock, tmp):
        assert len(os.fsencode(aux)) <= 255, aux  # every name the folder allows gets files that fit
        assert is_reserved_name(aux) and aux != name
    assert temp_pattern(full).match(tmp)
    assert len(os.fsencode(aux_base(full))) <= len(os.fsencode(name))


@pytest.mark.parametrize("n", [200, 230, 240, 250, 255])
@pytest.mark.parametrize("char", ["c", "\u00e9", "\u4e2d"])
def test_f17_long_names_get_lock_and_temporary_names_that_fit(tmp_path, n, char):
    name = (char * n).encode()[:n].decode("utf-8", "ignore") + ".npz"
    name = name[: len(name)] if len(name.encode()) <= 255 else name.encode()[:251].decode("utf-8", "ignore") + ".npz"
    full = str(tmp_path / name)
    for aux in (os.path.basename(lock_path(full)), temp_prefix(full) + "a1b2c3d4" + temp_suffix(full, True)):
        assert len(os.fsencode(aux)) <= os.pathconf(tmp_path, "PC_NAME_MAX"), (n, char, aux)
        assert is_reserved_name(aux)


def test_f16_an_empty_file_name_is_x004_before_any_work(proj, capsys):
    root, _ = proj
    for argv in (RUN + ["--save", ""], RUN + ["--log", ""], RUN + ["--resume", ""], RUN + ["--resume-weights", ""],
                 ["lower", "tiny.sched", "-o", ""], ["graph", "tiny.sched", "-o", ""],
                 ["trace", "tiny.sched", "-o", ""]):
        refused(capsys, root, argv, "X004", "needs a file name, got an empty one (an unset shell variable?)")


def test_f17_the_longest_names_work_and_longer_are_refused_before_any_work(proj, capsys):
    root, sched = proj
    name = "c" * 251 + ".npz"  # 255: the most a name may have
    rc, _, err = run_tiny(capsys, sched, "--epochs", "2", "--save", name)
    assert rc == 0, err
    assert sorted(os.listdir(root)) == sorted([name, "tiny.npz", "tiny.sched"])  # no lock or temporary left
    refused(capsys, root, RUN + ["--save", "c" * 256 + ".npz"], "X021", "File name too long")


def test_f22_a_file_put_on_the_checkpoint_or_log_during_the_run_is_kept(proj, capsys, monkeypatch):
    root, sched = proj
    import streamsched.interp.train as train_mod

    real = train_mod._Run.end_epoch
    target = {}

    def copy_over(self, e, *rest):
        real(self, e, *rest)
        if e == 0:  # after epoch 1, the user copies a file over the output, in place
            shutil.copyfile(root / "tiny.sched", root / target["name"])

    monkeypatch.setattr(train_mod._Run, "end_epoch", copy_over)
    for name, flag in (("ck.npz", "--save"), ("run.jsonl", "--log")):
        target["name"] = name
        rc, _, err = run_tiny(capsys, sched, "--epochs", "4", flag, name)
        assert rc == 1 and code_of(err) == "X021", err
        assert "it changed during the run (it is now a text file, not the file this run wrote)" in err
        assert (root / name).read_bytes() == (root / "tiny.sched").read_bytes()
        os.unlink(root / name)


def test_f22_a_deleted_log_is_made_anew_and_a_deleted_folder_is_x021(proj, capsys, monkeypatch):
    root, sched = proj
    import streamsched.interp.train as train_mod

    real = train_mod._Run.end_epoch

    def delete(self, e, *rest):
        real(self, e, *rest)
        if e == 0:
            shutil.rmtree(root / "out") if (root / "out" / "gone").exists() else os.unlink(root / "out" / "run.jsonl")

    monkeypatch.setattr(train_mod._Run, "end_epoch", delete)
    os.mkdir(root / "out")
    rc, _, err = main(capsys, *RUN[:-1], "--epochs", "3", "--log", "out/run.jsonl")
    assert rc == 0 and "the log `out/run.jsonl` was deleted or moved during the run; a new one there holds the " \
                      "records from epoch 2 on" in err
    assert [r["epoch"] for r in _log(root / "out" / "run.jsonl")] == [2, 3]
    (root / "out" / "gone").write_text("")
    rc, _, err = run_tiny(capsys, sched, "--epochs", "3", "--log", "out/run.jsonl")
    assert rc == 1 and code_of(err) == "X021" and "No such file or directory" in err


def test_f23_a_broken_resume_file_is_x007_even_when_it_is_also_the_save(proj, capsys):
    root, sched = proj
    assert run_tiny(capsys, sched, "--epochs", "1", "--save", "ck.npz")[0] == 0
    raw = (root / "ck.npz").read_bytes()
    (root / "ck.npz").write_bytes(raw[: len(raw) * 2 // 3])
    refused(capsys, root, RUN + ["--resume", "ck.npz", "--save", "ck.npz"], "X007", "checkpoint `ck.npz`")
    (root / "ck.npz").write_text("not a checkpoint\n")
    refused(capsys, root, RUN + ["--resume", "ck.npz", "--save", "ck.npz"], "X007")


def test_a_trailing_slash_is_refused_and_the_help_is_a_fix(proj, capsys):
    root, sched = proj
    err = refused(capsys, root, RUN + ["--save", "ck.npz/"], "X021", "ends in `/`, so it names a folder",
                  "drop the trailing `/` to write the file `ck.npz`")
    assert run_tiny(capsys, sched, "--save", "ck.npz")[0] == 0


# ---- F9: a lock file that cannot be written


def test_f9_a_full_disk_while_writing_the_lock_is_x021_and_leaves_nothing(proj, capsys, monkeypatch):
    root, _ = proj
    import streamsched.outputs as outputs_mod

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs_mod.os, "pwrite", full)
    refused(capsys, root, RUN + ["--log", "new.jsonl"], "X021", "cannot make its lock file",
            "No space left on device")


def test_f9_a_file_size_limit_of_zero(tmp_path):
    import resource

    project(tmp_path)
    before = snapshot(tmp_path)
    p = subprocess.run([sys.executable, "-m", "streamsched", "run", "tiny.sched", "--backend", "cpu", "-q", "--log",
                        "new.jsonl"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=180,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)))
    assert p.returncode == 1 and "Traceback" not in p.stderr and "error[X021]" in p.stderr, p.stderr
    assert_untouched(before, tmp_path)


# ---- F10, F13, F14, F18, F19, F20: what is blamed, and helps that are fixes


def _idx(a: np.ndarray) -> bytes:
    return bytes([0, 0, 8, a.ndim]) + struct.pack(">" + "I" * a.ndim, *a.shape) + a.astype(">u1").tobytes()


@pytest.mark.parametrize("test_shape", [(0, 4, 1), (0, 3_000_000_000, 3_000_000_000)])
def test_f10_an_idx_folder_with_an_empty_split_is_x003(tmp_path, capsys, test_shape):
    d = tmp_path / "mnist"
    d.mkdir()
    x = np.random.default_rng(0).integers(0, 255, (16, 4, 1)).astype(np.uint8)
    y = (np.arange(16) % 3).astype(np.uint8)
    (d / "train-images-idx3-ubyte").write_bytes(_idx(x))
    (d / "train-labels-idx1-ubyte").write_bytes(_idx(y))
    (d / "t10k-images-idx3-ubyte").write_bytes(bytes([0, 0, 8, 3]) + struct.pack(">III", *test_shape))
    (d / "t10k-labels-idx1-ubyte").write_bytes(_idx(y[:0]))
    sched = project(tmp_path, replace={'npz("tiny.npz")': 'idx("mnist")', "f32[batch, 4]": "f32[batch, 4]"})
    before = snapshot(tmp_path)
    rc, _, err = run_tiny(capsys, sched)
    assert rc == 1 and code_of(err) == "X003" and "holds no samples" in err and "the test split is empty" in err
    assert_untouched(before, tmp_path)


def test_f13_data_far_beyond_the_usual_scale_is_blamed_not_the_rate(proj, capsys):
    root, _ = proj
    a = dict(np.load(root / "tiny.npz"))
    a["x_train"] = a["x_train"].copy()
    a["x_train"][3, 2] = 1e12
    np.savez(root / "tiny.npz", **a)
    for extra in (["--lr", "0"], []):
        rc, _, err = main(capsys, *RUN, "--epochs", "1", *extra)
        assert rc == 1 and code_of(err) == "X010", err
        assert "tiny.sched:27:" in err  # the caret is on `data`
        assert "the training features reach 1e+12 (`x_train` at [3, 2])" in err
        assert "scale the data" in err and "--lr" not in err.split("help:")[1]  # no rate offered as the fix
    assert "the learning rate was 0, so the weights did not move" in main(capsys, *RUN, "--lr", "0")[2]


def test_f14_a_checkpoint_value_that_is_not_finite_is_x007_at_load(proj, capsys):
    root, sched = proj
    assert run_tiny(capsys, sched, "--epochs", "1", "--save", "ck.npz")[0] == 0
    arrays, meta = load_checkpoint(root / "ck.npz")
    arrays["sgd.v.logits.w" if "sgd.v.logits.w" in arrays else "logits.w"].flat[2] = np.nan
    with zipfile.ZipFile(root / "nan.npz", "w") as zf:
        for k, v in {**arrays, "__meta__": np.frombuffer(json.dumps(meta).encode(), np.uint8)}.items():
            with zf.open(k + ".npy", "w") as f:
                np.lib.format.write_array(f, np.asarray(v), allow_pickle=False)
    for flag in ("--resume", "--resume-weights"):
        if flag == "--resume-weights":
            arrays["logits.w"].flat[2] = np.nan
            with zipfile.ZipFile(root / "nan.npz", "w") as zf:
                for k, v in {**arrays, "__meta__": np.frombuffer(json.dumps(meta).encode(), np.uint8)}.items():
                    with zf.open(k + ".npy", "w") as f:
                        np.lib.format.write_array(f, np.asarray(v), allow_pickle=False)
        refused(capsys, root, RUN + ["--epochs", "3", flag, "nan.npz"], "X007", "checkpoint `nan.npz` is corrupt",
                "holds nan at index [")


def test_f18_a_schedule_that_leaves_f32_is_x004_at_lr_in_check_and_run(proj, capsys):
    root, _ = proj
    digits = project(root, name="d.sched", replace={'npz("tiny.npz")': "digits()",
                                                    "f32[batch, 4]": "f32[batch, 64]",
                                                    "logits = linear(x, 3)": "logits = linear(x, 10)",
                                                    "lr     = 0.05": "lr     = step(0, every = 1, gamma = 1e300)"})
    for argv in (["check", digits], ["run", digits, "--backend", "cpu", "-q"]):
        rc, _, err = main(capsys, *argv)
        assert rc == 1 and code_of(err) == "X004" and "d.sched:29:" in err, err
        assert "step: the learning rate overflows f32 at step 1 of this run's" in err
    rc, _, err = main(capsys, *RUN, "--lr", "1e300")
    assert rc == 1 and code_of(err) == "X004" and "beyond f32's range" in err
    # a rate that grows but stays within f32 over the run is fine
    assert make_schedule("step", (0.1,), {"every": 10, "gamma": 2.0}, 1000)(999) == 0.1 * 2.0 ** 99


@settings(max_examples=60, deadline=None)
@given(st.floats(0, 10), st.integers(1, 50), st.floats(1.5, 1e30), st.integers(1, 3000))
def test_f18_the_overflow_step_named_is_the_first_one(v, every, gamma, total):
    from streamsched.diagnostics import StreamschedError

    def over(t):  # the independent oracle: the factor and the rate at step t, in exact-enough floats
        k = t // every
        logf = k * math.log(gamma)
        return logf > math.log(F32_MAX) - max(0.0, math.log(v) if v > 1 else 0.0)

    first = next((t for t in range(total) if over(t)), None)
    try:
        make_schedule("step", (v,), {"every": every, "gamma": gamma}, total)
        assert first is None
    except StreamschedError as e:
        assert first is not None and f"at step {first} of this run's {total}" in e.diagnostics[0].message


def test_f19_limits_helps_are_fixes(proj, capsys):
    root, sched = proj
    r = np.random.default_rng(1)
    np.savez(root / "tiny.npz", x_train=r.normal(size=(400, 4)).astype(np.float32), y_train=r.integers(0, 3, 400),
             x_test=r.normal(size=(8, 4)).astype(np.float32), y_test=r.integers(0, 3, 8))  # 8 KiB: a KiB hint
    rc, _, err = run_tiny(capsys, sched, "--data-limit", "1K")
    assert rc == 1 and code_of(err) == "X014"
    fix = re.search(r"`(--data-limit \S+)`", err).group(1)
    assert run_tiny(capsys, sched, *shlex.split(fix))[0] == 0  # the suggested limit admits the data
    assert run_tiny(capsys, sched, "--epochs", "1", "--save", "ck.npz")[0] == 0
    arrays, meta = load_checkpoint(root / "ck.npz")
    meta["pad"] = "x" * (17 * 2 ** 20)
    with zipfile.ZipFile(root / "big.npz", "w") as zf:
        for k, v in {**arrays, "__meta__": np.frombuffer(json.dumps(meta).encode(), np.uint8)}.items():
            with zf.open(k + ".npy", "w") as f:
                np.lib.format.write_array(f, np.asarray(v), allow_pickle=False)
    err = refused(capsys, root, RUN + ["--resume", "big.npz"], "X014", "has a `__meta__` of 17.0 MiB")
    assert "--data-limit 16G" not in err and "the metadata limit is fixed at 16 MiB" in err


def test_f20_numpys_advice_to_allow_pickles_is_never_relayed(proj, capsys):
    root, _ = proj
    a = dict(np.load(root / "tiny.npz"))
    with zipfile.ZipFile(root / "tiny.npz", "w") as zf:
        for k, v in a.items():
            b = io.BytesIO()
            np.lib.format.write_array(b, v)
            raw = b.getvalue()
            if k == "x_train":  # a header of 200 KB, as np.save never writes
                hl = int.from_bytes(raw[8:10], "little")
                head = raw[10:10 + hl].rstrip(b"\n").rstrip() + b" " * 200_000 + b"\n"
                raw = b"\x93NUMPY\x02\x00" + len(head).to_bytes(4, "little") + head + raw[10 + hl:]
            zf.writestr(k + ".npy", raw)
    err = refused(capsys, root, RUN, "X003", "longer than NumPy reads safely")
    assert "allow_pickle" not in err and "max_header_size" not in err


# ---- F21: a partial epoch is marked as one


def test_f21_steps_inside_an_epoch_mark_it_partial(proj, capsys):
    root, sched = proj
    rc, out, err = main(capsys, *RUN[:-1], "--steps", "6", "--save", "ck.npz", "--log", "run.jsonl", "--epochs", "3")
    assert rc == 0, err
    assert "epoch 2/3 (partial: 2 of 4 steps, not saved): train loss" in err
    assert "epoch 2 (partial: 2 of 4 steps): train loss" in out
    recs = _log(root / "run.jsonl")
    assert [(r["epoch"], r.get("partial", False)) for r in recs] == [(1, False), (2, True)]
    assert recs[1]["epoch_steps"] == 2 and recs[1]["steps_per_epoch"] == 4
    assert [r["epoch"] for r in load_checkpoint(root / "ck.npz")[1]["history"]] == [1]
    rc, _, err = run_tiny(capsys, sched, "--epochs", "3", "--save", "ck.npz", "--log", "run.jsonl", "--resume", "ck.npz")
    assert rc == 0
    recs = _log(root / "run.jsonl")
    assert [(r["epoch"], r.get("partial", False)) for r in recs] == [(1, False), (2, True), (2, False), (3, False)]


# ---- F24, P004: reading and showing source


def test_f24_old_mac_line_ends_are_line_ends(proj, capsys):
    root, sched = proj
    text = (root / "tiny.sched").read_text()
    (root / "cr.sched").write_bytes(text.replace("\n", "\r").encode())
    rc, _, err = main(capsys, "check", "cr.sched")
    assert rc == 0, err
    (root / "bad.sched").write_bytes(text.replace("comp1  : compute", "comp1  : compute $").replace("\n", "\r").encode())
    rc, _, err = main(capsys, "check", "bad.sched")
    assert rc == 1 and "bad.sched:3:" in err  # the line of the mistake, not one line for the whole file


def test_a_very_long_source_line_is_shown_as_a_window(tmp_path):
    line = "    a1     = " + "relu(" * 2000 + "h1" + ")" * 2000
    p = tmp_path / "long.sched"
    p.write_text("# x\n" + line + "\n")
    src = SourceCache()
    text = render(Diagnostic("P004", "expression nested too deeply", Span(str(p), 2, 14, 2, len(line) + 1)), src)
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) < 220
    code_line, caret_line = lines[3], lines[4]
    assert code_line.endswith("...") and caret_line.index("^") == code_line.index("relu")


def test_f3_a_resume_onto_other_data_starts_a_new_baseline(proj, capsys):
    """The resumed history is the divergence rule's baseline only for the same data and model: a
    loss on other data says nothing of this one's (a fine-tune through --resume is no collapse)."""
    root, _ = proj
    r = np.random.default_rng(3)
    x = r.normal(size=(64, 4)).astype(np.float32)
    np.savez(root / "tiny.npz", x_train=x, y_train=np.argmax(x[:, :3], 1), x_test=x[:8], y_test=np.argmax(x[:8, :3], 1))
    sched = project(root, name="easy.sched", replace={"lr     = 0.05": "lr     = 0.5"})
    np.savez(root / "tiny.npz", x_train=x, y_train=np.argmax(x[:, :3], 1), x_test=x[:8], y_test=np.argmax(x[:8, :3], 1))
    assert run_tiny(capsys, sched, "--epochs", "40", "--save", "ck.npz")[0] == 0
    best = min(h["train_loss"] for h in load_checkpoint(root / "ck.npz")[1]["history"])
    y = r.permutation(np.argmax(x[:, :3], 1))  # the same shapes, labels no model can fit: a loss near ln 3
    np.savez(root / "hard.npz", x_train=x, y_train=y, x_test=x[:8], y_test=y[:8])
    hard = project(root, name="hard.sched", replace={'npz("tiny.npz")': 'npz("hard.npz")', "lr     = 0.05": "lr     = 0.5"})
    np.savez(root / "hard.npz", x_train=x, y_train=y, x_test=x[:8], y_test=y[:8])
    rc, _, err = run_tiny(capsys, hard, "--epochs", "42", "--resume", "ck.npz", "--log", "h.jsonl")
    assert rc == 0, err
    first = _log(root / "h.jsonl")[0]["train_loss"]
    assert first > 4 * best and first > best + math.log(3) / 4  # the old baseline would have called it a collapse
    assert "changed since it was written: the program text, the data" in err
