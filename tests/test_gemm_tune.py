"""gemm_tune's choice rule on the CPU: timings are faked, the rule is recomputed here.

The rule (interp/cuda/gemm_tune.py): the first candidate in the heuristic's order whose time is
within MARGIN of the fastest; refused candidates skipped; no timing while the stream is captured,
with STREAMSCHED_GEMM_TUNE=0, or without `run`; a choice is made once per problem and kept."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from streamsched.interp.cuda import gemm_tune


class _Stream:
    ptr = 7

    def synchronize(self):
        pass


class _Cp:
    uint8 = np.uint8

    @staticmethod
    def empty(shape, dtype):
        from types import SimpleNamespace

        return SimpleNamespace(data=SimpleNamespace(ptr=4096))


class _Ctx:
    cp = _Cp()
    device_id = 0

    def tune_stream(self):
        return _Stream()


def _algos(n):
    return [np.full((8,), i, np.uint64) for i in range(n)]


def _oracle(times, margin):
    ok = [(i, t) for i, t in enumerate(times) if t is not None]
    if not ok:
        return 0
    best = min(t for _, t in ok)
    return next(i for i, t in ok if t <= best * (1 + margin))


@pytest.fixture
def fake(monkeypatch):
    gemm_tune.forget()
    monkeypatch.setattr(gemm_tune, "capturing", lambda ptr: False)
    monkeypatch.setenv("STREAMSCHED_GEMM_TUNE", "all")
    calls = []

    def install(times):
        def graph_us(cp, st_, issue):
            issue()
            i = calls[-1]
            if times[i] is None:
                raise RuntimeError("refused")
            return times[i]

        monkeypatch.setattr(gemm_tune, "_graph_us", graph_us)

    def run(algo, sp, wp, wb):
        calls.append(int(algo[0]))

    yield install, run, calls
    gemm_tune.forget()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(0.5, 100.0)), min_size=2, max_size=16))
def test_the_choice_is_the_first_candidate_within_the_margin_of_the_fastest(times):
    gemm_tune.forget()
    calls = []

    def run(algo, sp, wp, wb):
        calls.append(int(algo[0]))

    orig = gemm_tune._graph_us, gemm_tune.capturing
    try:
        def graph_us(cp, st_, issue):
            issue()
            if times[calls[-1]] is None:
                raise RuntimeError("refused")
            return times[calls[-1]]

        gemm_tune._graph_us, gemm_tune.capturing = graph_us, (lambda ptr: False)
        got = gemm_tune.choose(_Ctx(), (0, "relu"), _algos(len(times)), run, 7, 1 << 20)
    finally:
        gemm_tune._graph_us, gemm_tune.capturing = orig
        gemm_tune.forget()
    assert int(got[0]) == _oracle(times, gemm_tune.MARGIN)
    assert sorted(set(calls)) == list(range(len(times)))  # every candidate was tried


def test_a_near_tie_keeps_the_heuristic_order_and_a_clear_win_does_not(fake):
    install, run, calls = fake
    install([10.0, 9.8, 5.0, 5.1])
    assert int(gemm_tune.choose(_Ctx(), (0, "relu", "a"), _algos(4), run, 7, 1)[0]) == 2
    install([10.0, 9.75])
    assert int(gemm_tune.choose(_Ctx(), (0, "relu", "b"), _algos(2), run, 7, 1)[0]) == 0  # 9.75 * 1.03 > 10
    install([None, 8.0, 4.0])
    assert int(gemm_tune.choose(_Ctx(), (0, "relu", "c"), _algos(3), run, 7, 1)[0]) == 2
    assert gemm_tune.timings()[(0, "relu", "c")] == [(0, None), (1, 8.0), (2, 4.0)]


def test_a_choice_is_made_once_per_problem(fake):
    install, run, calls = fake
    install([3.0, 1.0])
    first = gemm_tune.choose(_Ctx(), (0, "relu", "p"), _algos(2), run, 7, 1)
    n = len(calls)
    install([1.0, 3.0])  # the timings would now say otherwise: the first choice stands
    again = gemm_tune.choose(_Ctx(), (0, "relu", "p"), _algos(2), run, 7, 1)
    assert int(first[0]) == int(again[0]) == 1 and len(calls) == n


def test_no_timing_while_captured_or_turned_off_or_without_run(fake, monkeypatch):
    install, run, calls = fake
    install([9.0, 1.0])
    monkeypatch.setattr(gemm_tune, "capturing", lambda ptr: True)
    assert not gemm_tune.may_time(7)
    assert int(gemm_tune.choose(_Ctx(), (0, "relu", "cap"), _algos(2), run, 7, 1)[0]) == 0
    monkeypatch.setattr(gemm_tune, "capturing", lambda ptr: False)
    monkeypatch.setenv("STREAMSCHED_GEMM_TUNE", "0")
    assert not gemm_tune.may_time(7)
    assert int(gemm_tune.choose(_Ctx(), (0, "relu", "off"), _algos(2), run, 7, 1)[0]) == 0
    monkeypatch.setenv("STREAMSCHED_GEMM_TUNE", "all")
    assert gemm_tune.may_time(7)
    assert int(gemm_tune.choose(_Ctx(), (0, "relu", "norun"), _algos(2), None, 7, 1)[0]) == 0
    assert calls == []
    # a problem first met inside a capture keeps the heuristic's choice when met again outside
    assert int(gemm_tune.choose(_Ctx(), (0, "relu", "cap"), _algos(2), run, 7, 1)[0]) == 0 and calls == []


def test_the_problem_key_names_what_makes_two_gemms_the_same_problem():
    ctx = _Ctx()
    k = gemm_tune.problem_key(ctx, "plain", "float32", 68, 128, 1024, 784, False, True, 1 << 25)
    assert k == (0, "plain", "float32", 68, 128, 1024, 784, False, True, 1 << 25)
    assert k != gemm_tune.problem_key(ctx, "plain", "float32", 68, 128, 1024, 784, True, False, 1 << 25)


def test_the_preference_asks_for_deterministic_reductions_only():
    import enum

    set_ = {}

    class Lt:
        MatmulPreferenceAttribute = enum.IntEnum("P", "MAX_WORKSPACE_BYTES MIN_ALIGNMENT_A_BYTES REDUCTION_SCHEME_MASK")

        def matmul_preference_create(self):
            return 1

        def matmul_preference_set_attribute(self, pref, attr, ptr, size):
            import ctypes

            set_[self.MatmulPreferenceAttribute(attr).name] = int.from_bytes(ctypes.string_at(ptr, size), "little")

        def matmul_preference_destroy(self, h):
            pass

    gemm_tune.preference(Lt(), 1 << 20)
    # cublasLtReductionScheme_t: NONE 0, INPLACE 1, COMPUTE_TYPE 2, OUTPUT_TYPE 4
    assert set_ == {"MAX_WORKSPACE_BYTES": 1 << 20, "MIN_ALIGNMENT_A_BYTES": 16, "REDUCTION_SCHEME_MASK": 6}


@pytest.mark.parametrize("value,plain,epilogue", [(None, False, True), ("epilogues", False, True), ("1", False, True),
                                                  ("", False, True), ("all", True, True), (" ALL ", True, True),
                                                  ("0", False, False)])
def test_which_problems_are_timed(monkeypatch, value, plain, epilogue):
    if value is None:
        monkeypatch.delenv("STREAMSCHED_GEMM_TUNE", raising=False)
    else:
        monkeypatch.setenv("STREAMSCHED_GEMM_TUNE", value)
    monkeypatch.setattr(gemm_tune, "capturing", lambda ptr: False)
    assert gemm_tune.may_time(7, "plain") is plain
    for act in ("relu", "relu_aux", "gelu", "drelu", "dgelu"):
        assert gemm_tune.may_time(7, act) is epilogue


def test_by_default_a_plain_problem_takes_the_heuristic_choice_untimed(fake, monkeypatch):
    install, run, calls = fake
    install([9.0, 1.0])
    monkeypatch.delenv("STREAMSCHED_GEMM_TUNE")
    assert int(gemm_tune.choose(_Ctx(), (0, "plain"), _algos(2), run, 7, 1)[0]) == 0 and calls == []
    assert int(gemm_tune.choose(_Ctx(), (0, "relu"), _algos(2), run, 7, 1)[0]) == 1


@pytest.mark.parametrize("value", ["false", "off", "no", "plain", "2", "epilogue", "0.0", "all,plain"])
def test_any_other_value_is_refused_before_a_run(monkeypatch, value):
    """gemm_tune refuses it (ValueError), and so does train(), with X004 before any work: a
    mistyped value must not silently leave timing on."""
    import os

    from streamsched.diagnostics import StreamschedError
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    monkeypatch.setenv("STREAMSCHED_GEMM_TUNE", value)
    assert gemm_tune.mode_error(value)
    with pytest.raises(ValueError, match="STREAMSCHED_GEMM_TUNE"):
        gemm_tune.mode()
    examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
    c = compile_file(os.path.join(examples, "mlp_digits.sched"))
    with pytest.raises(StreamschedError) as err:
        train(c, TrainOptions(backend="cpu", progress=False, epochs=1), base_dir=examples, echo=lambda s: None)
    (d,) = err.value.diagnostics
    assert d.code == "X004" and d.message == f"$STREAMSCHED_GEMM_TUNE: `{value}` is not 0, epilogues or all"


def test_the_command_line_refuses_it_with_x004_and_no_traceback():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "streamsched", "run", os.path.join(root, "examples", "mlp_digits.sched"),
                        "-q", "--epochs", "1"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.path.join(root, "src"), STREAMSCHED_GEMM_TUNE="false"))
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "error[X004]: $STREAMSCHED_GEMM_TUNE: `false` is not 0, epilogues or all" in out
    assert "Traceback" not in out
