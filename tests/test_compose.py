"""Composite ops and `repeat` (dsl/compose.py, issue 15): a block is its lines, inlined; the
program computes bitwise what the same lines written out compute, its backward is derived from
the block's body, placement follows `on` and `place`, and mistakes are diagnostics."""

from __future__ import annotations

import os

import numpy as np
import pytest

from streamsched.diagnostics import apply_fixes
from streamsched.interp.train import TrainOptions, train
from streamsched.pipeline import check_file, compile_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "examples")

STREAMS = """streams {
    trans  : copy
    comp1  : compute
    comp2  : compute
    comp3  : compute
    update : update
}
"""
REST = """graph load[a, b] on trans  { copy batch -> x, y }
graph zero_grad  on update { clear grad(mlp) }
graph pass       on comp1  { forward mlp; backward mlp }
graph optimize   on update { sgd(mlp, lr, momentum = 0.9) }
step train(slot) {
    upload lr on trans
    zero_grad
    pass(load[slot])
    load[next]
    optimize
}
train { model = mlp; data = digits(test = 0.2, seed = 0); epochs = 1; lr = 0.05 }
"""
BLOCK = """op block(x, width = 16) -> y on comp1 {
    h = linear(x, width)
    y = relu(h)
}
"""
BLOCKS = STREAMS + BLOCK + """model mlp(batch = 16, hidden = 16, layers = 2) {
    input x : f32[batch, 64]
    input y : i32[batch]
    a1     = block(x, width = hidden)
    a2     = repeat layers block(a1, width = hidden)
    logits = linear(a2, 10)
    loss   = softmax_cross_entropy(logits, y)
}
""" + REST
FLAT = STREAMS + """model mlp(batch = 16, hidden = 16) {
    input x : f32[batch, 64]
    input y : i32[batch]
    h1     = linear(x, hidden)
    a1     = relu(h1)
    h2     = linear(a1, hidden)
    a2     = relu(h2)
    h3     = linear(a2, hidden)
    a3     = relu(h3)
    logits = linear(a3, 10)
    loss   = softmax_cross_entropy(logits, y)
}
""" + REST


def write(tmp_path, text, name="p.sched") -> str:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


def params_in_order(path: str, steps: int, base: str | None = None) -> list[np.ndarray]:
    c = compile_file(path)
    assert c.ok, [d.message for d in c.diagnostics]
    res = train(c, TrainOptions(backend="cpu", max_steps=steps, progress=False), base_dir=base or ".",
                echo=lambda s: None)
    return [res.params[n] for n, _ in c.program.inits]


def test_blocks_and_repeat_train_bitwise_like_the_lines_written_out(tmp_path):
    a = params_in_order(write(tmp_path, BLOCKS), 8)
    b = params_in_order(write(tmp_path, FLAT, "flat.sched"), 8)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_names_of_block_instances(tmp_path):
    c = compile_file(write(tmp_path, BLOCKS))
    assert [n for n in c.program.model.params] == ["a1.h.w", "a1.h.b", "a2.1.h.w", "a2.1.h.b", "a2.2.h.w",
                                                  "a2.2.h.b", "logits.w", "logits.b"]


def test_gpt_blocks_is_gpt_text_with_composition():
    """The same tasks on the same streams, the same plan, bitwise the same training."""
    a, b = compile_file(os.path.join(EX, "gpt_blocks.sched")), compile_file(os.path.join(EX, "gpt_text.sched"))
    assert [(t.kernel, t.stream, t.attrs) for t in a.schedule.tasks] == \
        [(t.kernel, t.stream, t.attrs) for t in b.schedule.tasks]
    assert [(i.op, i.stream, i.event) for i in a.plan.instrs] == [(i.op, i.stream, i.event) for i in b.plan.instrs]
    pa, pb = params_in_order(a.program.path, 4, EX), params_in_order(b.program.path, 4, EX)
    assert all(np.array_equal(x, y) for x, y in zip(pa, pb))
    text = open(os.path.join(EX, "gpt_blocks.sched"), encoding="utf-8").read()
    model = text[text.index("model gpt"):text.index("graph load")]
    assert len([ln for ln in model.splitlines() if ln.strip()]) <= 12  # a stack of blocks in a dozen lines


def test_place_and_on_inside_a_block(tmp_path):
    text = BLOCKS.replace("    h = linear(x, width)\n", "    h = linear(x, width) on comp2\n")
    c = compile_file(write(tmp_path, text), fuse=False)
    gemms = {t.stream for t in c.schedule.tasks if t.kernel == "matmul" and "h." not in t.label and
             t.label.split(": ")[-1].startswith("linear@a")}
    assert gemms == {"comp2"}
    # fused (the default), the GEMM with its bias and relu epilogue runs where the GEMM was placed
    f = compile_file(write(tmp_path, text))
    assert {t.stream for t in f.schedule.tasks if t.kernel == "gemm_bias_relu" and "h." not in t.label and
            t.label.split(": ")[-1].startswith("linear@a")} == {"comp2"}
    moved = compile_file(write(tmp_path, BLOCKS + "place block.y on comp2\n", "placed.sched"), fuse=False)
    assert {t.stream for t in moved.schedule.tasks if t.kernel == "relu"} == {"comp2"}


def test_the_backward_of_a_block_is_its_ops_backward(tmp_path):
    c = compile_file(write(tmp_path, BLOCKS))
    kernels = [t.kernel for t in c.program.graph("pass").templates]
    # forward: 3 blocks + logits; dW for all 4; dX for all but the first block (x is an input)
    assert kernels.count("relu_grad") == 3 and kernels.count("matmul") == 4 + 4 + 3


@pytest.mark.parametrize("edit,code,needle", [
    ("    a2     = repeat layers block(a1, width = hidden)\n", None, None),
    ("    a2     = repeat 0 block(a1, width = hidden)\n", "S015", "repeat 0"),
    ("    a2     = repeat layers linear(a1, hidden)\n", "S015", "repeat layers linear"),
    ("    a2     = block(a1, depth = 3)\n", "S015", "depth = 3"),
    ("    a2     = block(a1, a1, 4, 5)\n", "S005", "block(a1, a1, 4, 5)"),
])
def test_misused_blocks_are_diagnostics(tmp_path, edit, code, needle):
    text = BLOCKS.replace("    a2     = repeat layers block(a1, width = hidden)\n", edit)
    ds = [d for d in check_file(write(tmp_path, text)) if d.severity == "error"]
    if code is None:
        assert ds == []
        return
    assert [d.code for d in ds] == [code]
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)
    assert ds[0].span.line == line and "Traceback" not in ds[0].message


def test_a_block_reading_an_unknown_value_or_calling_a_kernel(tmp_path):
    bad = BLOCKS.replace("    y = relu(h)\n", "    y = relu(z)\n")
    (d,) = [d for d in check_file(write(tmp_path, bad)) if d.severity == "error"]
    assert d.code == "S007" and "`z`" in d.message
    mixed = BLOCKS.replace("    y = relu(h)\n", "    y = relu(h)\n    w = matmul(y, y)\n")
    codes = {d.code for d in check_file(write(tmp_path, mixed, "m.sched")) if d.severity == "error"}
    assert "S015" in codes


def test_a_block_that_calls_itself_stops(tmp_path):
    text = BLOCKS.replace("    y = relu(h)\n", "    y = block(h, width = width)\n")
    ds = [d for d in check_file(write(tmp_path, text)) if d.severity == "error"]
    assert ds and all(d.code == "S015" for d in ds) and "calls itself" in ds[0].message


def test_explicit_races_inside_a_block_get_a_fix_in_the_block(tmp_path):
    """Under explicit, the relu on comp3 reads the GEMM's h from comp1 in every instance: the fix is
    `after h` on the block's own line, and it removes every one of those races."""
    text = "barriers explicit\n" + STREAMS + BLOCK.replace("    y = relu(h)\n", "    y = relu(h) on comp3\n") + \
        BLOCKS[len(STREAMS) + len(BLOCK):]
    p = write(tmp_path, text)
    inner = [d for d in check_file(p) if d.code == "R001" and "relu" in d.message and "`h`" not in d.message
             and d.fixes and d.fixes[0].text == " after h"]
    assert inner, [d.message for d in check_file(p) if d.code == "R001"][:5]
    fixed = write(tmp_path, apply_fixes(text, inner[0].fixes), "fixed.sched")
    after = [d for d in check_file(fixed) if d.code == "R001" and "relu" in d.message.split(" is not")[0]]
    assert after == []
