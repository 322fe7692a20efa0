"""User-review findings on `streamsched run`, `graph --captured` and `check`: out-of-memory
arenas (X013), checkpoints whose arrays do not fit the run (X007), `--steps` that stop inside an
epoch with `--save` (a note), `graph --captured` without a GPU (X020), `check --format json` on
unreadable files, and train-block values that `check` must refuse exactly as `run` does."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from streamsched.interp import memory
from streamsched.interp.checkpoint import load_checkpoint, save_checkpoint
from streamsched.interp.ir import Buffer

from test_robustness import ROOT, main, proc, project, run_tiny

STATE = "state { s : f32[] = 3 }\ntrain {"  # a state buffer: saved in checkpoints like a parameter


def _diag_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error[") or line.startswith(" --> ")]


# ---- 1. an arena too large to allocate is X013, not a NumPy traceback


def test_huge_state_buffer_is_x013_at_its_line(tmp_path, capsys):
    sched = project(tmp_path, replace={"train {": "state { big : f32[100000, 100000, 100000] }\ntrain {"})
    rc, out, err = main(capsys, "check", sched)
    assert rc == 0  # `check` does not know the machine's memory
    rc, out, err = run_tiny(capsys, sched, "--steps", "1")
    assert rc == 1 and out == ""
    head, where = _diag_lines(err)
    assert head.startswith("error[X013]: out of memory: the cpu backend could not allocate 4,000,000,000,")
    assert "`big` : f32[100000, 100000, 100000], 4,000,000,000,000,000 bytes (3.6 PiB)" in head
    assert where == f" --> {sched}:25:9"  # the state line, where `train {` was
    assert "smaller batch" in err


def test_buffer_beyond_numpys_largest_array_is_x013_too(tmp_path, capsys):
    # 4e20 bytes: NumPy raises ValueError ("Maximum allowed dimension exceeded"), not MemoryError
    sched = project(tmp_path, replace={"train {": "state { big : f32[100000, 100000, 100000, 100000] }\ntrain {"})
    rc, out, err = run_tiny(capsys, sched, "--steps", "1")
    assert rc == 1
    assert "error[X013]" in err and "400,000,000,000,000,000,000 bytes" in err


def test_huge_layer_width_points_at_the_model_line(tmp_path, capsys):
    sched = project(tmp_path, replace={"logits = linear(x, 3)": "h = linear(x, 100000000000)\n    "
                                                                 "logits = linear(h, 3)"})
    rc, out, err = run_tiny(capsys, sched, "--steps", "1")
    assert rc == 1
    head, where = _diag_lines(err)
    assert head.startswith("error[X013]") and "`h.w` : f32[4, 100000000000], 1,600,000,000,000 bytes" in head
    assert where == f" --> {sched}:11:5"  # `h = linear(x, 100000000000)`, not the stdlib's `op linear`


class _FakeCupyOOM(MemoryError):  # the shape of cupy.cuda.memory.OutOfMemoryError
    pass


_FakeCupyOOM.__name__ = "OutOfMemoryError"
_FakeCupyOOM.__module__ = "cupy.cuda.memory"


class _FakeCupy:
    uint8 = np.uint8

    @staticmethod
    def zeros(shape, dtype=None):
        raise _FakeCupyOOM(f"Out of memory allocating {shape[0]:,} bytes (allocated so far: 0 bytes).")


def test_cuda_arena_out_of_memory_is_arena_error_and_x013(monkeypatch):
    """The CUDA executor's arena allocation turns CuPy's OutOfMemoryError into ArenaOutOfMemory,
    and make_runner into X013 naming GPU memory (no CuPy needed: a fake module stands in)."""
    from streamsched.interp.cuda.executor import CudaExecutor
    from streamsched.interp.train import TrainOptions, make_runner
    from streamsched.diagnostics import StreamschedError

    bufs = memory.plan_memory([Buffer("w", (1000, 1000), "f32", kind="param"), Buffer("b", (10,), "f32")])
    ex = object.__new__(CudaExecutor)
    ex.cp = _FakeCupy
    with pytest.raises(memory.ArenaOutOfMemory) as ei:
        ex._allocate(bufs)
    assert ei.value.space == "device" and ei.value.nbytes == memory.arena_sizes(bufs)["device"] == 4_000_040
    assert ei.value.largest.name == "w" and isinstance(ei.value.cause, MemoryError)

    import streamsched.interp.cuda as cuda_pkg
    import streamsched.interp.cuda.runner as runner_mod
    from streamsched.pipeline import compile_file

    def fake_runner(compiled):
        raise memory.ArenaOutOfMemory("device", 123_456_789_012, _FakeCupyOOM("oom"), bufs[0])

    monkeypatch.setattr(cuda_pkg, "cuda_available", lambda: (True, ""))
    monkeypatch.setattr(runner_mod, "CudaRunner", fake_runner)
    c = compile_file(os.path.join(ROOT, "examples", "five_streams.sched"))
    with pytest.raises(StreamschedError) as se:
        make_runner(c, TrainOptions(backend="cuda"))
    (d,) = se.value.diagnostics
    assert d.code == "X013"
    assert d.message == ("out of memory: the cuda backend could not allocate 123,456,789,012 bytes (115.0 GiB) of "
                         "GPU memory; the largest buffer is `w` : f32[1000, 1000], 4,000,000 bytes (3.8 MiB)")


def test_allocate_arrays_reports_the_space_and_bytes():
    class Tiny:
        uint8 = np.uint8

        @staticmethod
        def zeros(n, dtype=None):
            raise MemoryError("no")

    bufs = memory.plan_memory([Buffer("a", (4,), "f32"), Buffer("h", (2,), "f32", space="host")])
    with pytest.raises(memory.ArenaOutOfMemory) as ei:
        memory.allocate_arrays(bufs, xp=Tiny)
    assert (ei.value.space, ei.value.nbytes, ei.value.largest.name) == ("device", 16, "a")


def test_other_allocation_errors_are_not_swallowed():
    class Broken:
        uint8 = np.uint8

        @staticmethod
        def zeros(n, dtype=None):
            raise TypeError("a bug, not a lack of memory")

    with pytest.raises(TypeError):
        memory.allocate_arrays(memory.plan_memory([Buffer("a", (4,), "f32")]), xp=Broken)


# ---- 2. a checkpoint whose arrays do not fit the run is X007, before anything is written


@pytest.fixture
def saved(tmp_path, capsys):
    sched = project(tmp_path, replace={"train {": STATE}, extra="")
    ck = tmp_path / "ck.npz"
    rc, _, err = run_tiny(capsys, sched, "--epochs", "1", "--save", ck)
    assert rc == 0, err
    arrays, meta = load_checkpoint(ck)
    assert set(arrays) == {"logits.w", "logits.b", "d(loss)", "s", "sgd.v.logits.w", "sgd.v.logits.b"}
    return sched, arrays, meta


def _resume_with(tmp_path, capsys, sched, arrays, meta):
    bad = tmp_path / "bad.npz"
    save_checkpoint(bad, arrays, meta)
    before = bad.read_bytes()
    rc, out, err = run_tiny(capsys, sched, "--epochs", "2", "--resume", bad, "--save", bad)
    assert bad.read_bytes() == before  # nothing the user had is lost
    return rc, out, err, str(bad)


def test_resume_wrong_shape_is_x007(tmp_path, capsys, saved):
    sched, arrays, meta = saved
    rc, out, err, bad = _resume_with(tmp_path, capsys, sched, {**arrays, "s": np.zeros(3, np.float32)}, meta)
    assert rc == 1 and out == ""
    assert (f"error[X007]: checkpoint `{bad}`: array `s` does not fit this run: expected shape (), dtype "
            f"float32, found shape (3,), dtype float32") in err
    assert "broadcast" not in err


def test_resume_shape_that_would_broadcast_is_refused(tmp_path, capsys, saved):
    sched, arrays, meta = saved
    rc, out, err, bad = _resume_with(tmp_path, capsys, sched,
                                     {**arrays, "logits.b": np.zeros(1, np.float32)}, meta)
    assert rc == 1
    assert "array `logits.b` does not fit this run: expected shape (3,), dtype float32, found shape (1,)" in err


def test_resume_wrong_dtype_is_x007(tmp_path, capsys, saved):
    sched, arrays, meta = saved
    rc, out, err, bad = _resume_with(tmp_path, capsys, sched,
                                     {**arrays, "logits.w": arrays["logits.w"].astype(np.float64)}, meta)
    assert rc == 1
    assert ("array `logits.w` does not fit this run: expected shape (4, 3), dtype float32, found shape (4, 3), "
            "dtype float64") in err


@pytest.mark.parametrize("drop", [("logits.w",), ("sgd.v.logits.w",), ("s",), ("s", "sgd.v.logits.b")])
def test_resume_missing_arrays_is_x007_naming_them(tmp_path, capsys, saved, drop):
    sched, arrays, meta = saved
    kept = {k: v for k, v in arrays.items() if k not in drop}
    rc, out, err, bad = _resume_with(tmp_path, capsys, sched, kept, meta)
    assert rc == 1 and out == ""
    names = ", ".join(f"`{n}`" for n in sorted(drop, key=list(arrays).index))
    n = len(drop)
    assert f"error[X007]: checkpoint `{bad}` lacks {n} array{'s' if n > 1 else ''} this run needs: {names}" in err


def test_resume_unknown_arrays_is_x007(tmp_path, capsys, saved):
    sched, arrays, meta = saved
    rc, out, err, bad = _resume_with(tmp_path, capsys, sched, {**arrays, "extra": np.zeros(2)}, meta)
    assert rc == 1
    assert f"error[X007]: checkpoint `{bad}` holds 1 array this run does not have: `extra`" in err


def test_resume_of_a_good_checkpoint_still_works(tmp_path, capsys, saved):
    sched, arrays, meta = saved
    good = tmp_path / "good.npz"
    save_checkpoint(good, arrays, meta)
    rc, out, err = run_tiny(capsys, sched, "--epochs", "2", "--resume", good)
    assert rc == 0, err
    assert out.startswith("cpu: 4 steps") and "epoch 2:" in out


# ---- 3. --steps inside an epoch with --save: a note, no checkpoint


def test_steps_inside_the_first_epoch_notes_that_no_checkpoint_was_written(tmp_path, capsys):
    ck = tmp_path / "c.npz"
    rc, out, err = run_tiny(capsys, project(tmp_path), "--steps", "3", "--save", ck)
    assert rc == 0, err
    assert out.startswith("cpu: 3 steps")
    assert (f"note: no checkpoint was written to `{ck}`: --steps 3 stopped after 3 of the 4 steps of epoch 1, "
            "and only whole epochs are saved (a resume restarts at an epoch)") in err.splitlines()
    assert not ck.exists()


def test_steps_inside_a_later_epoch_notes_what_the_checkpoint_holds(tmp_path, capsys):
    ck = tmp_path / "c.npz"
    rc, out, err = run_tiny(capsys, project(tmp_path), "--steps", "6", "--save", ck)
    assert rc == 0, err
    assert (f"note: the checkpoint `{ck}` holds epoch 1, not the last 2 steps: --steps 6 stopped after 2 of the "
            "4 steps of epoch 2, and only whole epochs are saved (a resume restarts at an epoch)") in err.splitlines()
    assert load_checkpoint(ck)[1]["epoch"] == 1  # whole epochs held, counted from 1


def test_whole_epochs_give_no_note(tmp_path, capsys):
    ck = tmp_path / "c.npz"
    rc, out, err = run_tiny(capsys, project(tmp_path), "--steps", "4", "--save", ck)
    assert rc == 0 and "note:" not in err and load_checkpoint(ck)[1]["epoch"] == 1


# ---- 4. graph --captured without a GPU is X020, like trace and run --backend cuda


def test_graph_captured_without_gpu_is_x020(tmp_path, capsys, monkeypatch):
    import streamsched.interp.cuda as cuda_pkg

    monkeypatch.setattr(cuda_pkg, "cuda_available", lambda: (False, "CuPy is not installed (No module named 'cupy')"))
    out_dot = tmp_path / "x.dot"
    rc, out, err = main(capsys, "graph", os.path.join(ROOT, "examples", "mlp_digits.sched"), "-o", out_dot, "--captured")
    assert rc == 1 and not out_dot.exists()
    assert err.startswith("error[X020]: --captured draws the CUDA graphs as captured on the GPU: no usable GPU "
                          "(CuPy is not installed (No module named 'cupy'))")
    assert "X011" not in err


def test_graph_captured_without_cupy_in_a_process(tmp_path):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    p = proc("graph", "examples/mlp_digits.sched", "-o", tmp_path / "x.dot", "--captured")
    assert p.returncode == 1 and p.stderr.startswith("error[X020]") and "X011" not in p.stderr


# ---- 5. check --format json: unreadable files as JSON; usage errors exit 1


@pytest.mark.parametrize("kind", ["missing", "folder"])
def test_check_json_unreadable_file_is_json(tmp_path, capsys, kind):
    path = tmp_path / "nope.sched"
    if kind == "folder":
        path.mkdir()
    rc, out, err = main(capsys, "check", "--format", "json", path)
    assert rc == 1 and err == ""
    (d,) = json.loads(out)
    assert d["code"] == "X002" and d["span"] is None and str(path) in d["message"]


def test_check_json_unreadable_among_good_files(tmp_path, capsys):
    rc, out, err = main(capsys, "check", "--format", "json", os.path.join(ROOT, "examples", "five_streams.sched"),
                        tmp_path / "nope.sched")
    assert rc == 1 and [d["code"] for d in json.loads(out)] == ["X002"]


def test_check_json_oserror_from_the_loader_is_json(tmp_path, capsys, monkeypatch):
    import streamsched.pipeline as pipeline

    def boom(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pipeline, "compile_file", boom)
    rc, out, err = main(capsys, "check", "--format", "json", tmp_path / "x.sched")
    assert rc == 1
    (d,) = json.loads(out)
    assert d["code"] == "X002" and d["message"] == f"cannot read `{tmp_path / 'x.sched'}`: Permission denied"


def test_check_bad_format_exits_1_in_a_process():
    p = proc("check", "--format", "xml", "examples/five_streams.sched")
    assert p.returncode == 1 and "error[X004]" in p.stderr and "invalid choice: 'xml'" in p.stderr


# ---- 6. check refuses every train-block value run refuses, with the same code and span


def _first_diag(err: str) -> tuple[str, str]:
    lines = _diag_lines(err)
    return lines[0].split(":")[0], lines[1]


@pytest.mark.parametrize("replace,extra,code,line", [
    ({'npz("tiny.npz")': "digits(test = 0.2, seed = bogus)"}, "", "X004", 27),
    ({'npz("tiny.npz")': "digits(test = 0.2, seed = -1)"}, "", "X004", 27),
    ({'npz("tiny.npz")': "digits(test = 0.9999)"}, "", "X004", 27),
    ({'npz("tiny.npz")': 'npz(".")'}, "", "X002", 27),
    ({'npz("tiny.npz")': 'idx("tiny.npz")'}, "", "X002", 27),
    ({}, "log = 3", "X004", 30),
    ({}, 'log = ""', "X004", 30),
    ({}, 'log = "no/such/folder/run.jsonl"', "X021", 30),
    ({}, 'log = "."', "X021", 30),
    ({}, 'log = "tiny.npz"', "X021", 30),  # the data file
    ({}, 'log = "tiny.sched"', "X021", 30),  # the program
])
def test_check_refuses_what_run_refuses(tmp_path, capsys, replace, extra, code, line):
    sched = project(tmp_path, replace=replace, extra=extra)
    rc_c, out_c, err_c = main(capsys, "check", sched)
    rc_r, out_r, err_r = run_tiny(capsys, sched, "--steps", "1")
    assert rc_c == 1 and rc_r == 1
    assert _first_diag(err_c) == _first_diag(err_r)
    got_code, where = _first_diag(err_c)
    assert got_code == f"error[{code}]" and where.startswith(f" --> {sched}:{line}:")
    # the same message, too
    assert err_c.splitlines()[0] == err_r.splitlines()[0]


def test_a_warmup_longer_than_the_run_is_clipped_with_a_note(tmp_path, capsys):
    # digits(test = 0.2): 1437 training samples, batch 4: 359 steps an epoch, 718 in 2 epochs
    digits = {'npz("tiny.npz")': "digits(test = 0.2)", "f32[batch, 4]": "f32[batch, 64]",
              "linear(x, 3)": "linear(x, 10)"}
    sched = project(tmp_path, replace={**digits, "lr     = 0.05": "lr     = cosine(0.1, warmup = 718)"})
    assert main(capsys, "check", sched)[0] == 0
    rc, out, err = run_tiny(capsys, sched, "--steps", "1")
    assert rc == 0 and "warmup" not in err
    sched = project(tmp_path, replace={**digits, "lr     = 0.05": "lr     = cosine(0.1, warmup = 719)"})
    assert main(capsys, "check", sched)[0] == 0  # not a mistake: `run` clips it
    rc, out, err = run_tiny(capsys, sched, "--steps", "1")
    assert rc == 0, err
    assert "note: the warmup of 719 steps is longer than this run (718 steps); it is clipped to 718 steps" in err
