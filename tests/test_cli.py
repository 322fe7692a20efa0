"""The command line as a user meets it: exit codes, diagnostics instead of tracebacks, JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "examples")


def run(*args, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    p = subprocess.run([sys.executable, "-m", "streamsched", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=300)
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    return p


def test_check_clean_examples_exit_0():
    p = run("check", *[os.path.join("examples", f) for f in sorted(os.listdir(EX)) if f.endswith(".sched")])
    assert p.returncode == 0, p.stderr
    assert "check clean" in p.stderr


def test_check_error_exit_1_with_code_and_position():
    p = run("check", "tests/golden/errors/s004_float_labels.sched")
    assert p.returncode == 1
    assert "error[S004]" in p.stderr
    assert "s004_float_labels.sched:13:" in p.stderr
    assert "^" in p.stderr


def test_check_json_format():
    p = run("check", "--format", "json", "tests/golden/errors/s006_unknown_op.sched")
    assert p.returncode == 1
    data = json.loads(p.stdout)
    assert data[0]["code"] == "S006" and data[0]["span"]["line"] == 12


def test_policy_flag_overrides_file():
    assert run("check", "examples/mlp_digits.sched").returncode == 0
    p = run("check", "examples/mlp_digits.sched", "--policy", "chain")
    assert p.returncode == 1 and "error[R001]" in p.stderr and "optimize after pass" in p.stderr


def test_missing_file_is_a_diagnostic():
    p = run("check", "no/such/file.sched")
    assert p.returncode == 1 and "error[X002]" in p.stderr


def test_run_bad_data_path(tmp_path):
    src = open(os.path.join(EX, "mlp_digits.sched")).read().replace(
        "digits(test = 0.2, seed = 0)", 'npz("missing.npz")')
    f = tmp_path / "bad.sched"
    f.write_text(src)
    p = run("run", str(f), "--backend", "cpu", "-q")
    assert p.returncode == 1 and "error[X002]" in p.stderr and "bad.sched:" in p.stderr


def test_run_cuda_without_gpu_says_so():
    pytest.importorskip("streamsched")
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy present")
    except ImportError:
        pass
    p = run("run", "examples/mlp_digits.sched", "--backend", "cuda", "--steps", "1", "-q")
    assert p.returncode == 1 and "error[X020]" in p.stderr


def test_run_two_steps_prints_accuracy():
    p = run("run", "examples/five_streams.sched", "--backend", "cpu", "--steps", "2", "-q")
    assert p.returncode == 0, p.stderr
    assert "test accuracy" in p.stdout and "cpu: 2 steps" in p.stdout


def test_lower_prints_per_stream_plan():
    p = run("lower", "examples/five_streams.sched", "--capture", "none")
    assert p.returncode == 0, p.stderr
    for s in ("comp1", "comp2", "comp3", "update", "trans", "wait", "record"):
        assert s in p.stdout


def test_graph_writes_dot(tmp_path):
    out = tmp_path / "plan.dot"
    p = run("graph", "examples/five_streams.sched", "-o", str(out))
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    assert text.startswith("// written by streamsched ") and text.splitlines()[1].startswith("digraph") and "comp2" in text


def test_check_validates_train_settings_without_running(tmp_path):
    src = open(os.path.join(EX, "mlp_digits.sched")).read()
    src = src.replace("digits(test = 0.2, seed = 0)", 'npz("nothere.npz")').replace("epochs   = 40", "epochs = 2.5")
    f = tmp_path / "tb.sched"
    f.write_text(src)
    p = run("check", str(f))
    assert p.returncode == 1
    assert "error[X002]" in p.stderr and "error[X004]" in p.stderr
    assert "tb.sched:42:" in p.stderr and "tb.sched:43:" in p.stderr
