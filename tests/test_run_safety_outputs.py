"""Every output (`--save`, `--log`, the train block's `log`, `lower -o`, `graph -o`, `trace -o`,
`trace --png`) is refused before any work when writing it could lose something the user had:
each case asserts the exit status, the code, that no traceback appears (`main` asserts it), and
that every file that was there is byte-identical afterwards unless it is the run's own checkpoint
or log.  Non-regular files are ones the tests make in their temporary folder (FIFOs, links,
read-only folders), never the machine's /dev."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from safety_helpers import assert_untouched, code_of, main, project, run_tiny, snapshot
from streamsched.interp.checkpoint import load_checkpoint
from streamsched.outputs import OutputLock, check_output, holder_info, lock_path


@pytest.fixture
def proj(tmp_path, monkeypatch):
    """A tiny project in tmp_path, the current folder, with a file of notes and a good checkpoint
    and log of an earlier run."""
    sched = project(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("my notes\n")
    rc, _, err = run_tiny_quiet(sched, "--epochs", "1", "--save", "old.npz", "--log", "old.jsonl")
    assert rc == 0, err
    return tmp_path, sched


_capsys = None


@pytest.fixture(autouse=True)
def _grab_capsys(capsys):
    global _capsys
    _capsys = capsys


def run_tiny_quiet(sched, *extra):
    return run_tiny(_capsys, sched, *extra)


def refused(root, argv: list, code: str = "X021", *words: str) -> str:
    """Run `argv` in-process: exit 1 with `code`, every file untouched; returns stderr."""
    before = snapshot(root)
    rc, out, err = main(_capsys, *argv)
    assert rc == 1, err
    assert code_of(err) == code, err
    for w in words:
        assert w in err, (w, err)
    assert "steps in" not in out  # nothing trained
    assert_untouched(before, root)
    return err


RUN = ["run", "tiny.sched", "--backend", "cpu", "-q"]


# ---- --save and --log: what they must never replace


@pytest.mark.parametrize("flag", ["--save", "--log"])
@pytest.mark.parametrize("target,words", [
    ("tiny.npz", "it is a data file of `data = npz(...)`"),
    ("tiny.sched", "it is the program being run"),
    ("notes.txt", "it is a text file, not a"),
])
def test_outputs_never_replace_inputs_or_other_files(proj, flag, target, words):
    root, _ = proj
    refused(root, RUN + [flag, target], "X021", words, f"({flag})")


def test_save_onto_a_log_and_log_onto_a_checkpoint(proj):
    root, _ = proj
    refused(root, RUN + ["--save", "old.jsonl"], "X021", "not a checkpoint streamsched wrote")
    refused(root, RUN + ["--log", "old.npz"], "X021", "a zip archive (an .npz?), not a log streamsched wrote")


def test_save_onto_an_npz_that_is_not_a_checkpoint(proj):
    root, _ = proj
    np.savez(root / "other.npz", w=np.zeros(3))
    refused(root, RUN + ["--save", "other.npz"], "X021", "not a streamsched checkpoint")


def test_save_onto_an_include(tmp_path, monkeypatch):
    (tmp_path / "streams.sched").write_text("streams {\n    trans : copy\n    comp1 : compute\n    comp2 : compute\n"
                                             "    comp3 : compute\n    update : update\n}\n")
    sched = project(tmp_path, replace={"streams {\n    trans  : copy\n    comp1  : compute\n    comp2  : compute\n"
                                       "    comp3  : compute\n    update : update\n}\n": 'include "streams.sched"\n'})
    monkeypatch.chdir(tmp_path)
    for flag in ("--save", "--log"):
        refused(tmp_path, RUN + [flag, "streams.sched"], "X021", "it is a file the program includes")
    refused(tmp_path, ["lower", sched, "-o", "streams.sched"], "X021", "it is a file the program includes")


def test_two_outputs_on_one_path(proj):
    root, _ = proj
    refused(root, RUN + ["--log", "x", "--save", "x"], "X021", "it is also the checkpoint `x` (--save)")
    # a hard link is the same file, and so is a path through a linked folder
    (root / "empty").write_bytes(b"")  # each is a fine output alone
    os.link(root / "empty", root / "hard")
    os.symlink(root, root / "here")
    refused(root, RUN + ["--save", "empty", "--log", "hard"], "X021", "it is also")
    refused(root, RUN + ["--save", "tiny.npz2", "--log", "here/tiny.npz2"], "X021", "it is also")


def test_train_block_log_and_save_on_one_path(tmp_path, monkeypatch):
    sched = project(tmp_path, extra='log = "run.out"')
    monkeypatch.chdir(tmp_path)
    err = refused(tmp_path, RUN + ["--save", "run.out"], "X021", "it is also the checkpoint")
    assert "tiny.sched:30:" in err  # the train block's `log` line


def test_data_file_through_a_hard_link_or_a_linked_folder(proj):
    root, _ = proj
    os.link(root / "tiny.npz", root / "alias.npz")
    refused(root, RUN + ["--save", "alias.npz"], "X021", "it is a data file")
    os.mkdir(root / "sub")
    os.symlink(root, root / "sub" / "up")
    refused(root, RUN + ["--save", "sub/up/tiny.npz"], "X021", "it is a data file")


@pytest.mark.parametrize("flag", ["--save", "--log"])
def test_symbolic_links_are_refused_and_stay(proj, flag):
    root, _ = proj
    os.symlink("notes.txt", root / "link")
    os.symlink("nowhere.npz", root / "dangling")
    err = refused(root, RUN + [flag, "link"], "X021", "it is a symbolic link")
    assert "name a new file" in err  # the target (a text file) could not be written either
    refused(root, RUN + [flag, "dangling"], "X021", "it is a symbolic link")
    os.symlink("old.npz" if flag == "--save" else "old.jsonl", root / "ok_link")
    cont = ["--resume", "old.npz"] if flag == "--save" else []  # (a checkpoint is replaced only when continued)
    err = refused(root, RUN + cont + [flag, "ok_link"], "X021", "it is a symbolic link")
    assert f"name the file itself (`{root / ('old.npz' if flag == '--save' else 'old.jsonl')}`)" in err


@pytest.mark.parametrize("flag", ["--save", "--log"])
def test_fifo_and_folder_outputs_are_refused_without_blocking(proj, flag):
    root, _ = proj
    os.mkfifo(root / "fifo")
    refused(root, RUN + [flag, "fifo"], "X021", "it is a FIFO (named pipe), not a regular file")
    os.mkdir(root / "d")
    refused(root, RUN + [flag, "d"], "X021", "it is a folder")


def test_read_only_folder(proj, monkeypatch):
    root, _ = proj
    ro = root / "ro"
    ro.mkdir()
    (ro / "run.jsonl").write_text("")
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root may write anywhere: let access() answer as for anyone else
        import streamsched.outputs as outputs_mod

        real = os.access
        monkeypatch.setattr(outputs_mod.os, "access",
                            lambda p, mode: False if os.path.abspath(p) == str(ro) and mode & os.W_OK else real(p, mode))
    try:
        refused(root, RUN + ["--save", "ro/ck.npz"], "X021", f"the folder `{ro}` is not writable")
        refused(root, RUN + ["--log", "ro/run.jsonl"], "X021", f"the folder `{ro}` is not writable")
    finally:
        ro.chmod(0o755)


def test_the_runs_own_checkpoint_and_log_are_replaced_and_appended(proj):
    root, sched = proj
    before = snapshot(root)
    old_log = (root / "old.jsonl").read_bytes()
    (root / "empty.npz").write_bytes(b"")  # nothing to lose: may be used
    before = snapshot(root)
    rc, _, err = run_tiny_quiet(sched, "--epochs", "2", "--resume", "old.npz", "--save", "old.npz", "--log",
                                "old.jsonl")
    assert rc == 0, err
    assert_untouched(before, root, own=("old.npz", "old.jsonl"))
    log = (root / "old.jsonl").read_bytes()
    assert log.startswith(old_log) and log.count(b"\n") == 2
    runs = [json.loads(line)["run"] for line in log.splitlines()]
    assert runs[0] != runs[1]  # each run's lines carry its id
    assert load_checkpoint(root / "old.npz")[1]["run"] == runs[1]
    rc, _, err = run_tiny_quiet(sched, "--epochs", "1", "--save", "empty.npz")
    assert rc == 0 and load_checkpoint(root / "empty.npz")[1]["epoch"] == 1


def test_a_log_cut_off_mid_line_gets_its_next_record_on_a_line_of_its_own(proj):
    root, sched = proj
    with open(root / "old.jsonl", "ab") as f:
        f.write(b'{"run": "x", "epo')  # a killed run's last, unfinished line
    rc, _, err = run_tiny_quiet(sched, "--epochs", "1", "--log", "old.jsonl")
    assert rc == 0, err
    lines = (root / "old.jsonl").read_text().splitlines()
    assert lines[1] == '{"run": "x", "epo' and json.loads(lines[2])["epoch"] == 1


def test_resume_in_place_is_allowed_but_the_resume_file_is_no_log(proj):
    root, sched = proj
    rc, _, err = run_tiny_quiet(sched, "--epochs", "2", "--resume", "old.npz", "--save", "old.npz")
    assert rc == 0, err
    refused(root, RUN + ["--epochs", "3", "--resume", "old.npz", "--log", "old.npz"], "X021",
            "it is the checkpoint given to --resume")
    refused(root, RUN + ["--resume-weights", "old.npz", "--save", "old.npz"], "X021",
            "it is the checkpoint given to --resume-weights")


def test_outputs_are_checked_before_the_data_is_read(proj):
    root, sched = proj
    (root / "tiny.npz").write_bytes(b"broken")  # X003 if it were read
    refused(root, RUN + ["--save", "notes.txt"], "X021")


# ---- lower -o, graph -o, trace -o


def test_lower_output_rules(proj):
    root, sched = proj
    for target, words in (("tiny.sched", "it is the program being run"), ("tiny.npz", "it is a data file"),
                          ("notes.txt", "it is a text file, not a plan `streamsched lower` wrote")):
        refused(root, ["lower", "tiny.sched", "-o", target], "X021", words)
    os.mkfifo(root / "fifo")
    refused(root, ["lower", "tiny.sched", "-o", "fifo"], "X021", "FIFO")
    rc, _, err = main(_capsys, "lower", "tiny.sched", "-o", "plan.txt")
    text = (root / "plan.txt").read_text()
    assert rc == 0 and text.startswith("# written by streamsched ") and text.splitlines()[1].startswith("plan: ")
    before = snapshot(root)
    rc, _, err = main(_capsys, "lower", "tiny.sched", "-o", "plan.txt")  # its own plan: replaced
    assert rc == 0
    assert_untouched(before, root, own=("plan.txt",))
    assert oct(os.stat(root / "plan.txt").st_mode & 0o777) == oct(before["plan.txt"][2])


def test_graph_output_rules(proj):
    root, _ = proj
    (root / "notes.dot").write_text("my notes\n")
    refused(root, ["graph", "tiny.sched", "-o", "notes.dot"], "X021", "not a drawing streamsched wrote")
    (root / "pic.png").write_text("not a picture\n")
    refused(root, ["graph", "tiny.sched", "-o", "pic.png"], "X021", "not a drawing streamsched wrote")
    refused(root, ["graph", "tiny.sched", "-o", "tiny.sched"], "X021", "the program being run")
    rc, _, err = main(_capsys, "graph", "tiny.sched", "-o", "plan.dot")
    assert rc == 0, err
    before = snapshot(root)
    rc, _, err = main(_capsys, "graph", "tiny.sched", "-o", "plan.dot")
    assert rc == 0
    assert_untouched(before, root, own=("plan.dot",))


def test_trace_outputs_are_checked_before_the_gpu(proj, monkeypatch):
    root, _ = proj
    import streamsched.interp.cuda as cuda_pkg

    monkeypatch.setattr(cuda_pkg, "cuda_available", lambda: (False, "no GPU here"))
    refused(root, ["trace", "tiny.sched", "-o", "tiny.sched"], "X021", "the program being run")
    refused(root, ["trace", "tiny.sched", "-o", "notes.txt"], "X021", "not a trace streamsched wrote")
    refused(root, ["trace", "tiny.sched", "-o", "t.json", "--png", "t.json"], "X021", "it is also the trace")
    refused(root, ["trace", "tiny.sched", "-o", "t.json", "--png", "notes.txt"], "X021", "the timeline")
    before = snapshot(root)
    rc, _, err = main(_capsys, "trace", "tiny.sched", "-o", "t.json")
    assert rc == 1 and code_of(err) == "X020"
    assert_untouched(before, root)


def test_check_refuses_a_train_block_log_on_an_input(tmp_path, capsys):
    (tmp_path / "common.sched").write_text("# shared settings\n")
    sched = project(tmp_path, extra='log = "common.sched"',
                    replace={"streams {": 'include "common.sched"\nstreams {'})
    rc, _, err = main(capsys, "check", sched)
    assert rc == 1 and "error[X021]" in err and "it is a file the program includes" in err


# ---- locks


def test_a_locked_checkpoint_or_log_is_x009_naming_the_holder(proj):
    root, sched = proj
    for flag, name in (("--save", "old.npz"), ("--log", "old.jsonl")):
        out = check_output(str(root / name), "checkpoint" if flag == "--save" else "log", noun="x",
                           append=flag == "--log", overwrite=True)
        holder = holder_info("20990101-000000-beef", ["streamsched", "run", "x"])
        lock = OutputLock(out, holder)
        lock.acquire()
        try:
            err = refused(root, RUN + [flag, name], "X009", "is in use by another run", "run 20990101-000000-beef",
                          f"pid {os.getpid()}", f"`kill {os.getpid()}`")
            assert flag in err
        finally:
            lock.release()
        assert not os.path.exists(lock_path(str(root / name)))
    rc, _, err = run_tiny_quiet(sched, "--epochs", "1", "--save", "old.npz", "--log", "old.jsonl", "--overwrite")
    assert rc == 0, err
    assert not [n for n in os.listdir(root) if n.endswith(".lock")]  # released and removed


def test_a_lock_file_left_by_a_killed_run_is_taken_over(proj):
    root, sched = proj
    (root / ".old.npz.streamsched-lock").write_text('{"streamsched_lock": 1, "run": "dead", "pid": 1}\n')  # not held
    rc, _, err = run_tiny_quiet(sched, "--epochs", "2", "--resume", "old.npz", "--save", "old.npz")
    assert rc == 0, err
    assert not (root / ".old.npz.streamsched-lock").exists()


def test_stale_temporary_files_are_removed(proj, capsys):
    root, sched = proj
    (root / ".old.npz.streamsched-k3j9x0_a.tmp").write_bytes(b"half a checkpoint")
    (root / ".old.npz.notes").write_text("not ours")  # does not match the pattern: kept
    (root / ".old.npz.k3j9x0_a.tmp").write_text("a user's file of the old pattern")  # kept too
    rc, _, err = run_tiny_quiet(sched, "--epochs", "2", "--resume", "old.npz", "--save", "old.npz")
    assert rc == 0, err
    assert not (root / ".old.npz.streamsched-k3j9x0_a.tmp").exists() and (root / ".old.npz.notes").exists()
    assert (root / ".old.npz.k3j9x0_a.tmp").exists()
    assert ("removed 1 temporary file that a killed run left next to `old.npz`: .old.npz.streamsched-k3j9x0_a.tmp"
            in err)


def test_a_full_disk_when_the_log_closes_is_x021(proj, monkeypatch):
    root, sched = proj
    import streamsched.interp.train as train_mod

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, s):
            return self.f.write(s)

        def flush(self):
            self.f.flush()

        def fileno(self):
            return self.f.fileno()

        def close(self):
            self.f.close()
            raise OSError(28, "No space left on device")

    import streamsched.interp.training.run_log as log_mod  # where the log moved (issue 14)

    real = log_mod.open_log
    monkeypatch.setattr(log_mod, "open_log", lambda out: Full(real(out)))
    rc, out, err = run_tiny_quiet(sched, "--epochs", "1", "--log", "new.jsonl")
    assert rc == 1 and "error[X021]: cannot write the log `new.jsonl`: No space left on device" in err
