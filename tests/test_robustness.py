"""Mistakes a newcomer makes, each met with a diagnostic (a stable code, file:line:col or no span
for a command-line value, exit status 1) and never a traceback; nothing the user had is lost.

Most cases call `streamsched.cli.main` in-process on a tiny model and data set (a run takes a few
milliseconds); the ones that depend on the process itself (exit status of argparse, a closed
pipe, a file read from disk by a fresh interpreter) run `python -m streamsched`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from streamsched import cli
from streamsched.diagnostics import Diagnostic, SourceCache, StreamschedError, render
from streamsched.dsl import parse as parse_mod
from streamsched.interp.checkpoint import load_checkpoint, save_checkpoint
from streamsched.interp.data import load_dataset
from streamsched.interp.ir import Span

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = """\
streams {
    trans  : copy
    comp1  : compute
    comp2  : compute
    comp3  : compute
    update : update
}
model m(batch = 4) {
    input x : f32[batch, 4]
    input y : i32[batch]
    logits = linear(x, 3)
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
    model  = m
    data   = npz("tiny.npz")
    epochs = 2
    lr     = 0.05
EXTRA}
"""
TRAIN_LINE = 27  # the line of `data = ...`; epochs is 28, lr 29, EXTRA starts at 30


def _arrays(n_test: int = 8) -> dict:
    r = np.random.default_rng(0)
    return dict(x_train=r.normal(size=(16, 4)).astype(np.float32), y_train=r.integers(0, 3, 16).astype(np.int32),
                x_test=r.normal(size=(n_test, 4)).astype(np.float32),
                y_test=r.integers(0, 3, n_test).astype(np.int32))


def project(tmp_path, extra: str = "", replace: dict | None = None, name: str = "tiny.sched") -> str:
    """A tiny trainable program and its data in tmp_path; returns the .sched path."""
    text = TINY.replace("EXTRA", "".join(f"    {line}\n" for line in extra.splitlines()))
    for a, b in (replace or {}).items():
        assert a in text
        text = text.replace(a, b)
    np.savez(tmp_path / "tiny.npz", **_arrays())
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def main(capsys, *argv) -> tuple[int, str, str]:
    """`streamsched ARGV` in-process: (exit status, stdout, stderr)."""
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    return rc, out, err


def proc(*args, cwd=ROOT, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    p = subprocess.run([sys.executable, "-m", "streamsched", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120, **kw)
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    return p


def run_tiny(capsys, sched: str, *extra) -> tuple[int, str, str]:
    return main(capsys, "run", sched, "--backend", "cpu", "-q", *extra)


def test_tiny_project_trains(tmp_path, capsys):
    rc, out, err = run_tiny(capsys, project(tmp_path))
    assert rc == 0, err
    assert "cpu: 8 steps" in out and "test accuracy" in out


# ---- 1. --save / --log that cannot be written: refused before training (X021)


def test_save_into_missing_folder_is_refused_before_training(tmp_path, capsys):
    rc, out, err = run_tiny(capsys, project(tmp_path), "--save", tmp_path / "no" / "ck.npz")
    assert rc == 1 and "error[X021]" in err and "--save" in err and "does not exist" in err
    assert "steps" not in out  # nothing trained
    assert " --> " not in err  # a command-line value: no span


def test_save_to_a_folder_is_refused_and_leaves_no_temporary_file(tmp_path, capsys):
    outdir = tmp_path / "out"
    outdir.mkdir()
    rc, out, err = run_tiny(capsys, project(tmp_path), "--save", outdir)
    assert rc == 1 and "error[X021]" in err and "is a folder" in err
    assert sorted(os.listdir(tmp_path)) == ["out", "tiny.npz", "tiny.sched"] and os.listdir(outdir) == []


def test_save_checkpoint_to_a_folder_raises_oserror_without_a_stray_file(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        save_checkpoint(tmp_path / "d", {"w": np.zeros(2)}, {})
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_save_over_the_program_is_refused(tmp_path, capsys):
    sched = project(tmp_path)
    before = open(sched).read()
    rc, _, err = run_tiny(capsys, sched, "--save", sched)
    assert rc == 1 and "error[X021]" in err and "program" in err
    assert open(sched).read() == before


def test_log_into_missing_folder_is_refused(tmp_path, capsys):
    rc, out, err = run_tiny(capsys, project(tmp_path), "--log", tmp_path / "no" / "run.jsonl")
    assert rc == 1 and "error[X021]" in err and "--log" in err and "steps" not in out


def test_save_into_missing_folder_through_the_command(tmp_path):
    p = proc("run", project(tmp_path), "--backend", "cpu", "-q", "--save", "/nonexistent-dir/ck.npz")
    assert p.returncode == 1 and "error[X021]" in p.stderr


# ---- 2. seeds and epochs: whole numbers, never truncated (X004)


@pytest.mark.parametrize("flag,value", [("--seed", "-1"), ("--epochs", "0"), ("--steps", "-1"),
                                        ("--interleave-seed", "-3"), ("--lr", "-0.5"), ("--lr", "nan")])
def test_bad_command_line_numbers_are_x004_without_a_span(tmp_path, capsys, flag, value):
    rc, out, err = run_tiny(capsys, project(tmp_path), flag, value)
    assert rc == 1 and "error[X004]" in err and flag in err
    assert " --> " not in err and "^" not in err  # 7: a command-line value does not point at the file
    assert "steps" not in out


@pytest.mark.parametrize("setting,value", [("seed", "-1"), ("seed", "1.7"), ("seed", '"x"'),
                                           ("epochs", '"five"'), ("epochs", "2.5"), ("epochs", "0")])
def test_bad_train_block_numbers_are_x004_at_their_line(tmp_path, capsys, setting, value):
    if setting == "epochs":
        sched = project(tmp_path, replace={"epochs = 2": f"epochs = {value}"})
        line = TRAIN_LINE + 1
    else:
        sched = project(tmp_path, extra=f"seed = {value}")
        line = TRAIN_LINE + 3
    rc, out, err = run_tiny(capsys, sched)
    assert rc == 1 and "error[X004]" in err and f"`{setting}` must be a whole number" in err
    assert f"tiny.sched:{line}:" in err and "steps" not in out


# ---- 3. an empty test split is refused at load time (X003)


def test_empty_test_split_is_refused_before_training(tmp_path, capsys):
    sched = project(tmp_path)
    np.savez(tmp_path / "tiny.npz", **_arrays(n_test=0))
    rc, out, err = run_tiny(capsys, sched)
    assert rc == 1 and "error[X003]" in err and "no test samples" in err
    assert f"tiny.sched:{TRAIN_LINE}:" in err and "steps" not in out


# ---- 4. a .sched file that is not UTF-8 (P005)


def test_latin1_file_is_p005_at_the_byte(tmp_path):
    f = tmp_path / "latin1.sched"
    f.write_bytes(b"streams {\n    c : compute  # caf\xe9\n}\n")
    p = proc("check", f)
    assert p.returncode == 1 and "error[P005]" in p.stderr and "not UTF-8" in p.stderr
    assert "latin1.sched:2:23" in p.stderr


def test_latin1_include_is_p005_with_the_include_line(tmp_path, capsys):
    (tmp_path / "latin1.sched").write_bytes(b"# \xff\xfe\n")
    main_file = tmp_path / "main.sched"
    main_file.write_text('include "latin1.sched"\nstreams { c : compute }\n')
    rc, _, err = main(capsys, "check", main_file)
    assert rc == 1 and "error[P005]" in err and "latin1.sched:1:3" in err and "included here" in err


# ---- 5. deeply nested expressions (P004)


LOGITS = "    logits = linear(x, 3)"


def _nested(depth: int) -> str:
    e = "x"
    for _ in range(depth):
        e = f"relu({e})"
    return e


@pytest.mark.parametrize("depth", [250, 3000])
def test_deep_nesting_is_p004_at_its_line(tmp_path, capsys, depth):
    sched = project(tmp_path, replace={LOGITS: f"    z = {_nested(depth)}\n{LOGITS}"})
    rc, _, err = main(capsys, "check", sched)
    assert rc == 1 and "error[P004]" in err and "tiny.sched:11:9" in err


def test_long_operator_chain_is_p004(tmp_path, capsys):
    sched = project(tmp_path, replace={"epochs = 2": "epochs = " + " + ".join(["1"] * 2000)})
    rc, _, err = main(capsys, "check", sched)
    assert rc == 1 and "error[P004]" in err and f"tiny.sched:{TRAIN_LINE + 1}:14" in err


def test_recursion_in_the_ast_builder_is_still_p004(monkeypatch):
    """Past the limit check (disabled here), lark's VisitError(RecursionError) becomes P004."""
    monkeypatch.setattr(parse_mod, "MAX_NESTING", 10**9)
    text = TINY.replace("EXTRA", "").replace(LOGITS, f"    z = {_nested(2000)}\n{LOGITS}")
    with pytest.raises(StreamschedError) as e:
        parse_mod.parse(text, "deep.sched")
    (d,) = e.value.diagnostics
    assert d.code == "P004" and (d.span.file, d.span.line) == ("deep.sched", 11)


def test_nesting_within_the_limit_parses():
    text = TINY.replace("EXTRA", "").replace("epochs = 2", "epochs = " + "+".join(["1"] * 90))
    parse_mod.parse(text, "ok.sched")


# ---- 6. a closed pipe ends the command quietly


@pytest.mark.parametrize("args,status", [(("lower", "examples/mlp_digits.sched"), 0),
                                         (("check", "--format", "json", "tests/golden/errors/s006_unknown_op.sched"), 1)])
def test_closed_pipe_is_quiet(args, status):
    """A reader that stops reading costs the output, not the verdict: the status is the command's own."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    p = subprocess.Popen([sys.executable, "-m", "streamsched", *args], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the first line is written, like `| head -0`
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert rc == status


# ---- 7. command-line values have no span; file values keep theirs


def test_divergence_from_command_line_lr_has_no_span(tmp_path, capsys):
    rc, _, err = run_tiny(capsys, project(tmp_path), "--lr", "1e30")
    assert rc == 1 and "error[X010]" in err and "--lr" in err and " --> " not in err
    assert "RuntimeWarning" not in err


def test_divergence_from_file_lr_points_at_it(tmp_path, capsys):
    rc, _, err = run_tiny(capsys, project(tmp_path, replace={"lr     = 0.05": "lr     = 1e30"}))
    assert rc == 1 and "error[X010]" in err and f"tiny.sched:{TRAIN_LINE + 2}:" in err


# ---- 8. files that are not archives, in our words


@pytest.mark.parametrize("content", [b"hello world\n", b"x", b"", b"\x00\x01\x02garbage"])
def test_not_an_archive_never_mentions_allow_pickle(tmp_path, content):
    f = tmp_path / "f.npz"
    f.write_bytes(content)
    with pytest.raises(StreamschedError) as e:
        load_checkpoint(f)
    assert e.value.diagnostics[0].code == "X007" and "not an .npz archive" in str(e.value)
    with pytest.raises(StreamschedError) as e2:
        load_dataset("npz", ("f.npz",), {}, base_dir=str(tmp_path))
    assert e2.value.diagnostics[0].code == "X003" and "not an .npz archive" in str(e2.value)
    for exc in (e.value, e2.value):
        assert "allow_pickle" not in str(exc) and "unsafely" not in str(exc)


def test_resume_from_text_file_is_x007(tmp_path, capsys):
    (tmp_path / "ck.npz").write_text("not a checkpoint\n")
    rc, _, err = run_tiny(capsys, project(tmp_path), "--resume", tmp_path / "ck.npz")
    assert rc == 1 and "error[X007]" in err and "allow_pickle" not in err


# ---- 9. tabs keep the caret under its column


def test_caret_under_the_right_column_with_tabs():
    src = "op f(x) -> y on c {\n\t\ty = relu(x)\tz\n}\n"
    sources = SourceCache({"t.sched": src})
    col = src.splitlines()[1].index("z") + 1
    text = render(Diagnostic("S007", "unknown `z`", Span("t.sched", 2, col, 2, col + 1)), sources)
    lines = text.splitlines()
    src_line = next(ln for ln in lines if ln.startswith("2 |"))
    caret_line = lines[lines.index(src_line) + 1]
    assert caret_line.expandtabs().index("^") == src_line.expandtabs().index("z")
    assert caret_line.count("\t") == 3


# ---- 10. JSON on a clean file


def test_check_json_clean_prints_empty_list(capsys):
    rc, out, _ = main(capsys, "check", "--format", "json", os.path.join(ROOT, "examples", "five_streams.sched"))
    assert rc == 0 and json.loads(out) == []


# ---- 11. no steps run


def test_steps_zero_says_so_and_writes_nothing(tmp_path, capsys):
    rc, out, err = run_tiny(capsys, project(tmp_path), "--steps", "0", "--save", tmp_path / "ck.npz",
                            "--log", tmp_path / "run.jsonl")
    assert rc == 0, err
    assert out.strip() == "no steps run (--steps 0)" and "nan" not in out
    assert not (tmp_path / "ck.npz").exists()  # no checkpoint claiming an epoch that never ran
    assert not (tmp_path / "run.jsonl").read_text()


def test_resuming_a_finished_run_says_so_and_keeps_the_checkpoint(tmp_path, capsys):
    sched = project(tmp_path)
    ck = tmp_path / "ck.npz"
    assert run_tiny(capsys, sched, "--save", ck)[0] == 0
    before = ck.read_bytes()
    rc, out, err = run_tiny(capsys, sched, "--resume", ck, "--save", ck)
    assert rc == 0, err
    assert out.startswith("no steps run (the checkpoint") and "nan" not in out and "us/step" not in out
    assert ck.read_bytes() == before


# ---- 12. usage errors exit 1


@pytest.mark.parametrize("argv", [("run", "x.sched", "--epochs", "five"), ("run", "x.sched", "--bogus"),
                                  ("run",), ("frobnicate",), ("check", "--format", "yaml", "x.sched")])
def test_usage_errors_exit_1_with_x004(capsys, argv):
    rc, out, err = main(capsys, *argv)
    assert rc == 1 and "usage:" in err and "error[X004]" in err


def test_usage_error_exit_status_of_the_process():
    p = proc("run", "examples/five_streams.sched", "--epochs", "five")
    assert p.returncode == 1 and "error[X004]" in p.stderr and "invalid int value" in p.stderr


# ---- 13. the train block's `log`


def test_train_block_log_is_written_next_to_the_program(tmp_path, capsys, monkeypatch):
    sched = project(tmp_path, extra='log = "run.jsonl"')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rc, _, err = run_tiny(capsys, sched)
    assert rc == 0, err
    lines = (tmp_path / "run.jsonl").read_text().splitlines()
    assert [json.loads(ln)["epoch"] for ln in lines] == [1, 2] and os.listdir(elsewhere) == []  # epochs from 1
    # --log overrides it
    rc, _, err = run_tiny(capsys, sched, "--log", "other.jsonl")
    assert rc == 0 and len((elsewhere / "other.jsonl").read_text().splitlines()) == 2
    assert len((tmp_path / "run.jsonl").read_text().splitlines()) == 2


def test_train_block_log_into_missing_folder_points_at_it(tmp_path, capsys):
    sched = project(tmp_path, extra='log = "no/run.jsonl"')
    rc, out, err = run_tiny(capsys, sched)
    assert rc == 1 and "error[X021]" in err and f"tiny.sched:{TRAIN_LINE + 3}:" in err and "steps" not in out


# ---- 14. warnings of the compilation are shown by `run`


def test_run_prints_compile_warnings(tmp_path, capsys, monkeypatch):
    import dataclasses

    import streamsched.pipeline as pipeline

    real = pipeline.compile_file

    def with_warning(*a, **kw):
        c = real(*a, **kw)
        w = Diagnostic("S015", "a test warning", c.program.train_span("lr"), severity="warning")
        return dataclasses.replace(c, diagnostics=c.diagnostics + (w,))

    monkeypatch.setattr(pipeline, "compile_file", with_warning)
    rc, out, err = run_tiny(capsys, project(tmp_path))
    assert rc == 0, err
    assert "warning[S015]: a test warning" in err and "cpu: 8 steps" in out


def test_an_unused_op_signature_is_checked_where_it_is_defined(tmp_path):
    """Types and inits of an op no model calls: a bare dtype outside optimizer state, an unknown
    init and an unknown dtype are each S015 at their own column, once; `T` bound by no input S004."""
    from streamsched.pipeline import check_file

    p = tmp_path / "unused.sched"
    p.write_text("streams { comp1 : compute }\n"
                 "op g(x : f32[n, k], param w : f32 = ones, param b : T[k] = bogus) -> y : f17[n] on comp1 {\n"
                 "    y = matmul(x, w)\n}\n")
    got = sorted((d.code, d.span.line, d.span.col) for d in check_file(str(p)))
    assert got == [("S004", 2, 53), ("S015", 2, 31), ("S015", 2, 60), ("S015", 2, 74)]



def _check_text(tmp_path, name, text):
    from streamsched.pipeline import check_file

    p = tmp_path / name
    p.write_text(text)
    return [(d.code, d.severity, d.message, d.help) for d in check_file(str(p))]


def test_a_file_included_twice_or_by_two_includers_is_read_once(tmp_path):
    (tmp_path / "common.sched").write_text("streams { comp1 : compute }\n")
    (tmp_path / "a.sched").write_text('include "common.sched"\n')
    assert _check_text(tmp_path, "top.sched", 'include "common.sched"\ninclude "a.sched"\ninclude "common.sched"\n') == []


def test_parameters_may_be_named_like_the_modifiers(tmp_path):
    text = ("streams { comp1 : compute }\nop f(state) -> y on comp1 {\n    y = relu(state)\n}\n"
            "op g(grad : f32[n], param w : f32[n] = ones) -> y on comp1 {\n    y = grad + w\n}\n")
    assert _check_text(tmp_path, "m.sched", text) == []


@pytest.mark.parametrize("text,word,guess", [
    ("stream {\n comp1 : compute\n}\n", "unknown block `stream`", "`streams {`"),
    ("streams { c : compute }\nmodle m(batch = 4) {\n  input x : f32[batch, 4]\n}\n", "unknown keyword `modle`", "`model`"),
    ("streams { c : compute }\ngrpah pass on c { forward m }\n", "unknown keyword `grpah`", "`graph`"),
    ("streams { c : compute }\ntrian {\n epochs = 3\n}\n", "unknown block `trian`", "`train {`"),
])
def test_a_misspelled_keyword_is_named_with_the_one_it_resembles(tmp_path, text, word, guess):
    (code, sev, msg, help_), = _check_text(tmp_path, "k.sched", text)
    assert sev == "error" and word in msg and guess in help_


def test_a_typo_in_a_stream_name_is_not_taken_for_a_block(tmp_path):
    (code, _, msg, _), = _check_text(tmp_path, "k.sched", "streams { steps : compute }\ngraph g on steps { forward m m }\n")
    assert code == "P002" and "unknown" not in msg


def test_unlaunched_graphs_and_parameters_left_out_are_warned(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "examples", "seed_step.sched"), encoding="utf-8").read()
    found = _check_text(tmp_path, "s.sched", text.replace("    lars_fc\n", ""))
    assert sorted((c, sev) for c, sev, _, _ in found) == [("S025", "warning"), ("S026", "warning")]
    assert any("`logits.w`, `logits.b`" in m for _, _, m, _ in found)
    twice = _check_text(tmp_path, "t.sched", text.replace('layers = "c2 b2 c3 b3")', 'layers = "c2 b2 c3 b3 logits")'))
    assert [(c, sev) for c, sev, _, _ in twice] == [("S026", "error")]
    no_pass = _check_text(tmp_path, "p.sched", text.replace("    pass(load[slot])\n", ""))
    assert any(c == "S021" and "never launched" in m for c, _, m, _ in no_pass)


@pytest.mark.parametrize("clause,words", [("after a1", "computes `a1` itself"),
                                          ("after logits", "`logits` is computed by a later line")])
def test_after_names_an_earlier_model_line(tmp_path, clause, words):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "examples", "mlp_digits.sched"), encoding="utf-8").read()
    assert "a1     = relu(h1)" in text
    found = _check_text(tmp_path, "a.sched", text.replace("a1     = relu(h1)", f"a1     = relu(h1) {clause}"))
    assert [(c, words in m) for c, _, m, _ in found] == [("S007", True)]
