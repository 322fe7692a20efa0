"""Mistakes that once crashed the front end or misled its user (found by fuzzing the `check`
pipeline and by a new user's trial, session 8): each is now one diagnostic, at its place."""

from __future__ import annotations

import os

import pytest

from streamsched.diagnostics import StreamschedError
from streamsched.pipeline import compile_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = open(os.path.join(ROOT, "examples", "mlp_digits.sched"), encoding="utf-8").read()


def _diags(tmp_path, text: str | bytes, name: str = "prog.sched"):
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text, encoding="utf-8")
    with pytest.raises(StreamschedError) as err:
        compile_file(str(p))
    return [(d.code, d.span.line if d.span else None, d.message) for d in err.value.diagnostics]


def test_an_include_path_with_a_nul_byte_is_s010(tmp_path):
    (code, line, msg), = _diags(tmp_path, b'include "a\x00b.sched"\nstreams { c : compute }\n')
    assert (code, line) == ("S010", 1) and "NUL" in msg


@pytest.mark.parametrize("text", ["1e999", "1" + "0" * 400, "-1e400"])
def test_a_number_past_floats_is_p007_at_its_place(tmp_path, text):
    src = DIGITS.replace("model mlp(batch = 128, hidden = 256)", f"model mlp(batch = 128, hidden = {text})")
    (code, line, msg), = _diags(tmp_path, src)
    assert code == "P007" and line == DIGITS[:DIGITS.index("model mlp(")].count("\n") + 1


def test_a_big_but_finite_number_is_not_p007(tmp_path):
    """2^100 is a fine loss scale: the bound is what a float holds, not a 64-bit integer."""
    from streamsched.dsl.parse import number_in_range

    assert number_in_range(2 ** 100) and number_in_range(1e308) and number_in_range(-(2 ** 1000))
    assert not number_in_range(2 ** 1024) and not number_in_range(float("inf")) and not number_in_range(float("nan"))


def test_a_first_input_that_is_a_scalar_needs_no_batch(tmp_path):
    p = tmp_path / "s.sched"
    p.write_text("streams { c : compute }\nmodel m() {\n    input x : f32[]\n    y = relu(x)\n}\n", encoding="utf-8")
    assert compile_file(str(p)).ok


def test_a_graph_left_out_for_its_mistake_is_not_also_unknown_to_the_step(tmp_path):
    """`graph pass on host` is S001; the step's `pass(...)` and the backward it runs are not then
    reported again as S008 (unknown graph) and S021 (no graph runs backward)."""
    src = DIGITS.replace("graph pass       on comp1", "graph pass       on host")
    assert src != DIGITS
    (code, line, msg), = _diags(tmp_path, src)
    assert code == "S001" and "host" in msg


def test_a_model_without_a_loss_names_its_own_last_value(tmp_path):
    src = DIGITS.replace("    loss   = softmax_cross_entropy(logits, y)\n", "")
    (code, line, msg), = _diags(tmp_path, src)
    assert code == "S018" and "`logits` is f32[128, 10]" in msg


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n"])
def test_an_empty_file_names_itself(tmp_path, text):
    (code, line, msg), = _diags(tmp_path, text, "empty.sched")
    assert (code, line, msg) == ("S001", 1, "no streams are declared")


def test_resuming_a_constant_rate_says_it_stays_not_that_it_decays(tmp_path):
    from streamsched.interp.train import TrainOptions, train

    src = DIGITS.replace("lr       = cosine(0.1, warmup = 50)", "lr       = 0.05")
    assert src != DIGITS
    p = tmp_path / "c.sched"
    p.write_text(src, encoding="utf-8")
    ck = str(tmp_path / "ck.npz")
    c = compile_file(str(p))
    train(c, TrainOptions(backend="cpu", progress=False, epochs=1, save=ck), base_dir=str(tmp_path), echo=lambda s: None)
    said = []
    train(c, TrainOptions(backend="cpu", progress=False, epochs=2, save=ck, resume=ck), base_dir=str(tmp_path),
          echo=said.append)
    (note,) = [s for s in said if "learning rate continues" in s]
    assert "(0.05) and stays there until step" in note and "decays" not in note


def test_into_a_result_the_op_writes_later_is_one_s007(tmp_path):
    five = open(os.path.join(ROOT, "examples", "five_streams.sched"), encoding="utf-8").read()
    src = five.replace("dw = matmul(x^T, dy)   on comp1 ", "dw = matmul(x^T, dy)   on comp1 into dx ")
    assert src != five
    (code, line, msg), = _diags(tmp_path, src)
    assert code == "S007" and "`dx`" in msg and line == src[:src.index("into dx")].count("\n") + 1


@pytest.mark.parametrize("zero", ["0", "0.0"])
def test_an_op_dividing_by_zero_is_s015(tmp_path, zero):
    src = ("streams { comp1 : compute }\nop half(x) -> y on comp1 {\n    y = x / " + zero + "\n}\n"
           "model m(batch = 4) {\n    input x : f32[batch, 4]\n    h = half(x)\n    y = relu(h)\n}\n")
    (code, line, msg), = _diags(tmp_path, src)
    assert (code, line, msg) == ("S015", 3, "division by zero")


@pytest.mark.parametrize("test", ["1e308", "-1e308", "1.5"])
def test_a_digits_split_out_of_range_is_x004_at_check(tmp_path, test):
    from streamsched.cli import main

    p = tmp_path / "d.sched"
    p.write_text(DIGITS.replace("digits(test = 0.2, seed = 0)", f"digits(test = {test}, seed = 0)"), encoding="utf-8")
    assert main(["check", str(p)]) == 1
