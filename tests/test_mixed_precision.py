"""Mixed precision in the language and on the CPU: dtype variables in the stdlib ops, `state { }`
device buffers, `backward M * scale`, `clear NAME`, f32 master weights as optimizer state, and
dynamic loss scaling that skips a step on overflow (examples/resnet_digits_amp.sched)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from streamsched.diagnostics import StreamschedError
from streamsched.interp.train import TrainOptions, train
from streamsched.pipeline import compile_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AMP = os.path.join(ROOT, "examples", "resnet_digits_amp.sched")
AMP_TEXT = open(AMP, encoding="utf-8").read()


def _compile(text: str = AMP_TEXT):
    return compile_file(AMP, text)


def _types(c):
    return {b.name: (b.shape, b.dtype, b.kind) for b in c.program.buffers}


def test_an_f16_input_makes_the_model_f16_except_batch_norm_and_the_loss():
    c = _compile()
    t = _types(c)
    assert t["c1.w"] == ((3, 3, 1, 16), "f16", "param")
    assert t["logits.w"] == ((256, 10), "f16", "param")
    assert t["grad.c2.w"][1] == "f16" and t["r1"][1] == "f16" and t["logits"][1] == "f16"
    assert t["b1.gamma"][1] == "f32" and t["grad.b1.gamma"][1] == "f32"  # f32 batch-norm parameters
    assert t["b1.running_mean"][1] == "f32" and t["b1.mean"][1] == "f32"
    assert t["loss"] == ((), "f32", "act")  # an f32 loss from f16 logits
    # master weights and momentum: f32 optimizer state shaped like the parameter
    assert t["sgd_amp.master.c1.w"] == ((3, 3, 1, 16), "f32", "state")
    assert t["sgd_amp.v.c1.w"] == ((3, 3, 1, 16), "f32", "state")
    assert t["loss_scale"] == ((), "f32", "state") and t["good_steps"] == ((), "i32", "state")
    assert c.program.loss_scale == "loss_scale"
    inits = dict(c.program.inits)
    assert inits["loss_scale"] == "const:65536" and inits["sgd_amp.master.c1.w"] == "copy:c1.w"


def test_the_same_file_in_f32_is_all_f32():
    c = _compile(AMP_TEXT.replace("input x : f16[", "input x : f32["))
    t = _types(c)
    assert t["c1.w"][1] == "f32" and t["logits"][1] == "f32" and t["grad.c2.w"][1] == "f32"


def test_the_scaled_backward_reads_the_loss_scale_and_the_optimizer_waits_for_the_check():
    c = compile_file(AMP, AMP_TEXT, fuse=False)  # the tasks as written
    tasks = c.schedule.tasks
    seeds = [t for t in tasks if t.kernel == "softmax_xent_grad"]
    assert seeds and all(t.args[0] == "loss_scale" for t in seeds)
    assert not any("d(loss)" in t.args for t in tasks)
    # each step, on the update stream in this order: all 14 checks write found_inf, then the 14
    # updates read it, then the scale update
    upd = [t for t in tasks if t.kernel in ("nonfinite_check", "amp_sgd_step", "update_scale")]
    assert {t.stream for t in upd} == {"update"}
    kinds = [t.kernel for t in upd[:29]]
    assert kinds == ["nonfinite_check"] * 14 + ["amp_sgd_step"] * 14 + ["update_scale"]


def _steps(text: str, n: int):
    c = _compile(text)
    return train(c, TrainOptions(backend="cpu", max_steps=n, progress=False), base_dir=os.path.dirname(AMP))


def test_an_overflowing_scale_skips_the_steps_and_backs_off():
    """With a scale of 2^100 every f16 gradient overflows: each step is skipped (parameters,
    master weights and momentum unchanged) and the scale halves, as GradScaler does."""
    huge = AMP_TEXT.replace("loss_scale : f32[] = 65536", "loss_scale : f32[] = 1267650600228229401496703205376")
    init = _steps(huge, 0).params
    res = _steps(huge, 3)
    assert float(res.params["loss_scale"]) == 2.0 ** 97
    for name in ("c1.w", "logits.w", "b1.gamma", "sgd_amp.master.c2.w", "sgd_amp.v.c2.w"):
        np.testing.assert_array_equal(res.params[name], init[name])
    assert int(res.params["good_steps"]) == 0
    # batch-norm running statistics still move: they are not part of the skipped update
    assert not np.array_equal(res.params["b1.running_mean"], init["b1.running_mean"])


def test_a_normal_scale_trains_and_keeps_w_the_f16_copy_of_the_master():
    text = AMP_TEXT.replace("loss_scale : f32[] = 65536", "loss_scale : f32[] = 1024")
    init = _steps(text, 0).params
    res = _steps(text, 3)
    assert float(res.params["loss_scale"]) == 1024.0 and int(res.params["good_steps"]) == 3
    for name in ("c1.w", "logits.w", "logits.b"):
        assert not np.array_equal(res.params[name], init[name])
        master = res.params[f"sgd_amp.master.{name}"]
        assert master.dtype == np.float32 and res.params[name].dtype == np.float16
        assert not np.array_equal(master, init[f"sgd_amp.master.{name}"])
        np.testing.assert_array_equal(res.params[name], master.astype(np.float16))
    np.testing.assert_array_equal(init["sgd_amp.master.c1.w"], init["c1.w"].astype(np.float32))


@pytest.mark.parametrize("text,code,words", [
    (AMP_TEXT.replace("backward resnet * loss_scale", "backward resnet * lossscale"), "S007",
     "no device scalar `lossscale`"),
    (AMP_TEXT.replace("clear found_inf", "clear foundinf"), "S007", "no `state` buffer `foundinf`"),
    (AMP_TEXT.replace("clear found_inf", "clear r1"), "S015", "`r1` is not a `state` buffer"),
    (AMP_TEXT.replace("update_scale(loss_scale, found_inf, good_steps", "update_scale(loss_scale, found_inf, loss_scale"),
     "S002", "two outputs of `update_scale` are the same buffer `loss_scale`"),
    (AMP_TEXT.replace("found_inf  : f32[] = 0 ", "x  : f32[] = 0 "), "S002", "`x` is already a buffer of the model"),
    (AMP_TEXT.replace("found_inf  : f32[] = 0 ", "found_inf  : f32[] = glorot "), "S015", "initializes weights"),
    (AMP_TEXT.replace("good_steps : i32[] = 0 ", "good_steps : i32[] = 99999999999 "), "S004", "cannot hold"),
    (AMP_TEXT.replace("found_inf  : f32[] = 0 ", "found_inf  : f32[] = true "), "S015", "not true"),
    (AMP_TEXT.replace("backward resnet * loss_scale", "backward resnet * lr"), "S007", "`lr` is a host value"),
    (AMP_TEXT.replace("backward resnet * loss_scale", "backward resnet * r1"), "S007", "`r1` is a value of the model"),
    (AMP_TEXT.replace("good_steps : i32[] = 0 ", "good_steps : i32[] = zeroes "), "S007", "unknown name"),
    (AMP_TEXT.replace("found_inf  : f32[] = 0", "found_inf  : f32[] = \"no\""), "S015", "starts as a number"),
    (AMP_TEXT.replace("found_inf  : f32[] = 0", "found_inf  : f17[] = 0"), "S015", "unknown dtype `f17`"),
    (AMP_TEXT.replace("found_inf  : f32[] = 0", "found_inf  : f32[] = 0\n    found_inf : f32[]"), "S002",
     "defined twice"),
])
def test_mistakes_in_the_mixed_precision_forms(text, code, words):
    with pytest.raises(StreamschedError) as e:
        _compile(text)
    diags = e.value.diagnostics
    assert any(d.code == code and words in d.message for d in diags), [(d.code, d.message) for d in diags]


def test_a_broken_state_is_reported_once():
    text = AMP_TEXT.replace("found_inf  : f32[] = 0 ", "found_inf  : f32[batch] = 0 ")
    with pytest.raises(StreamschedError) as e:
        _compile(text)
    assert [d.code for d in e.value.diagnostics] == ["S007"]  # `batch` is unknown there; no follow-ups


def test_a_dtype_variable_must_be_bound_by_an_input():
    text = AMP_TEXT.replace("graph load[a, b]", """op make(x) -> y : T[4] on comp1 {
    y = copy(x)
}
graph load[a, b]""").replace("    d      = dropout(f, p = 0.1)", "    d      = dropout(f, p = 0.1)\n    e      = make(d)")
    with pytest.raises(StreamschedError) as e:
        _compile(text)
    assert any(d.code == "S004" and "`T` is not bound" in d.message for d in e.value.diagnostics)


def _s024(text):
    c = _compile(text)
    return [(d.severity, d.message) for d in c.diagnostics if d.code == "S024"]


@pytest.mark.parametrize("old,new,words", [
    ("backward resnet * loss_scale", "backward resnet", "the backward is not scaled"),
    ("clear grad(resnet); clear found_inf", "clear grad(resnet)", "`found_inf` is never cleared"),
    ("    nonfinite(resnet, found_inf)\n", "", "no check sets it"),
    ("sgd_amp(resnet, lr, loss_scale, found_inf, momentum = 0.9, weight_decay = 0.0001)",
     "sgd(resnet, lr, momentum = 0.9)", "does not unscale them"),
])
def test_miswired_mixed_precision_is_s024(old, new, words):
    assert old in AMP_TEXT
    found = _s024(AMP_TEXT.replace(old, new))
    assert any(sev == "error" and words in msg for sev, msg in found), found


def test_the_amp_example_has_no_s024_and_an_f16_model_with_plain_sgd_is_warned():
    assert _s024(AMP_TEXT) == []
    plain = (AMP_TEXT.replace("backward resnet * loss_scale", "backward resnet")
             .replace("    nonfinite(resnet, found_inf)\n", "")
             .replace("sgd_amp(resnet, lr, loss_scale, found_inf, momentum = 0.9, weight_decay = 0.0001)",
                      "sgd(resnet, lr, momentum = 0.9)")
             .replace("    update_scale(loss_scale, found_inf, good_steps, interval = 2000)\n", ""))
    found = _s024(plain)
    assert found and all(sev == "warning" and "updates f16 parameters in f16" in msg for sev, msg in found)
    assert _compile(plain).ok  # a warning: it still runs


def test_bf16_is_refused_where_it_is_declared():
    with pytest.raises(StreamschedError) as e:
        _compile(AMP_TEXT.replace("input x : f16[", "input x : bf16["))
    assert [d.code for d in e.value.diagnostics] == ["S004"]
    assert "bfloat16" in e.value.diagnostics[0].message


_OPT = ("    nonfinite(resnet, found_inf)\n"
        "    sgd_amp(resnet, lr, loss_scale, found_inf, momentum = 0.9, weight_decay = 0.0001)\n"
        "    update_scale(loss_scale, found_inf, good_steps, interval = 2000)\n")


@pytest.mark.parametrize("body,extra_state,words", [
    (_OPT.splitlines(True)[1] + _OPT.splitlines(True)[0] + _OPT.splitlines(True)[2], "",
     "`sgd_amp` reads `found_inf` before this step's check sets it"),
    (_OPT.splitlines(True)[0] + _OPT.splitlines(True)[2] + _OPT.splitlines(True)[1], "",
     "`sgd_amp` unscales by `loss_scale` after `update_scale` changed it in this step"),
    (_OPT.replace("update_scale(loss_scale, found_inf,", "update_scale(loss_scale, other,"), "\n    other : f32[]",
     "`update_scale` reads the overflow flag `other`, but no check sets it"),
    (_OPT.replace("update_scale(loss_scale, found_inf,", "update_scale(other, found_inf,"), "\n    other : f32[] = 2",
     "`update_scale` updates `other`, but the backward is scaled by `loss_scale`"),
])
def test_the_order_and_the_buffers_of_the_update_graph_are_checked(body, extra_state, words):
    assert _OPT in AMP_TEXT
    text = AMP_TEXT.replace(_OPT, body).replace("good_steps : i32[] = 0 ", "good_steps : i32[] = 0" + extra_state + " ")
    found = _s024(text)
    assert any(sev == "error" and words in msg for sev, msg in found), found


@pytest.mark.parametrize("start", ["0", "-1", "zeros"])
def test_a_loss_scale_must_start_positive(start):
    with pytest.raises(StreamschedError) as e:
        _compile(AMP_TEXT.replace("loss_scale : f32[] = 65536", f"loss_scale : f32[] = {start}"))
    assert [(d.code, "must be positive" in d.message) for d in e.value.diagnostics] == [("S015", True)]


def test_graph_op_inputs_by_name_and_shared_variables():
    ok = AMP_TEXT.replace("sgd_amp(resnet, lr, loss_scale, found_inf,", "sgd_amp(resnet, lr, found_inf = found_inf, scale = loss_scale,")
    assert _compile(ok).ok
    with pytest.raises(StreamschedError) as e:
        _compile(AMP_TEXT.replace("sgd_amp(resnet, lr, loss_scale, found_inf,", "sgd_amp(resnet, lr, found_inf = found_inf,"))
    assert any(d.code == "S005" and "missing: scale" in d.message for d in e.value.diagnostics)
    # one dtype variable across two graph arguments: f32 and i32 buffers do not fit `T`
    text = AMP_TEXT.replace("graph load[a, b]", """op both(a : T[], b : T[]) -> a on update {
    a = relu(b)
}
graph load[a, b]""").replace("    update_scale(loss_scale, found_inf, good_steps, interval = 2000)\n",
                              "    update_scale(loss_scale, found_inf, good_steps, interval = 2000)\n    both(found_inf, good_steps)\n")
    with pytest.raises(StreamschedError) as e:
        _compile(text)
    assert any(d.code == "S004" and "`good_steps`" in d.message for d in e.value.diagnostics)
