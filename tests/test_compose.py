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
BLOCK = """op block(x, width = 16) -> y {
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
    # (gemm_bias_relu_aux where the relu backward fuses too: it writes the mask beside y)
    assert {t.stream for t in f.schedule.tasks if t.kernel in ("gemm_bias_relu", "gemm_bias_relu_aux")
            and "h." not in t.label and
            t.label.split(": ")[-1].startswith("linear@a")} == {"comp2"}
    moved = compile_file(write(tmp_path, BLOCKS + "place block.y on comp2\n", "placed.sched"), fuse=False)
    assert {t.stream for t in moved.schedule.tasks if t.kernel == "relu"} == {"comp2"}


def test_place_one_line_of_one_instance(tmp_path):
    """`place a2.2.h on comp3` moves instance 2's GEMM only; `place a1.y` the single call's relu;
    a name that matches no instance's line is S006 at the name, and a name missing a dot is P002."""
    c = compile_file(write(tmp_path, BLOCKS + "place a2.2.h on comp3\nplace a1.y on comp2\n", "inst.sched"), fuse=False)
    fwd = {t.label.split(": ")[-1]: t.stream for t in c.schedule.tasks if t.kernel in ("matmul", "relu")
           and t.label.split(": ")[-1].startswith(("linear@", "relu@"))}
    assert fwd["linear@a2.2.h"] == "comp3" and fwd["linear@a2.1.h"] == "comp1" and fwd["linear@a1.h"] == "comp1"
    assert {s for k, s in fwd.items() if k.startswith("relu@a1")} == {"comp2"}
    assert {s for k, s in fwd.items() if k.startswith("relu@a2")} == {"comp3"}  # relu's own stream
    for tail, code, col in (("place a2.7.h on comp3\n", "S006", 7), ("place a2 h on comp3\n", "P002", 10)):
        text = BLOCKS + tail
        ds = [d for d in check_file(write(tmp_path, text, "bad.sched")) if d.severity == "error"]
        assert [d.code for d in ds] == [code]
        assert ds[0].span.line == len(text.splitlines()) and ds[0].span.col == col


def test_the_backward_of_a_block_is_its_ops_backward(tmp_path):
    c = compile_file(write(tmp_path, BLOCKS))
    kernels = [t.kernel for t in c.program.graph("pass").templates]
    # forward: 3 blocks + logits; dW for all 4; dX for all but the first block (x is an input)
    assert kernels.count("relu_grad") == 3 and kernels.count("matmul") == 4 + 4 + 3


@pytest.mark.parametrize("edit,code,needle", [
    ("    a2     = repeat layers block(a1, width = hidden)\n", None, None),
    ("    a2     = repeat 0 block(a1, width = hidden)\n", "S015", "repeat 0"),
    ("    a2     = repeat layers linear(a1, hidden)\n", None, None),   # any op with one output repeats
    ("    a2     = repeat 5000 block(a1, width = hidden)\n", "S015", "repeat 5000"),
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
    assert "S006" in codes  # a kernel is no op: a block's statements call ops


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


def test_a_hand_written_backward_of_a_block_is_refused_not_ignored(tmp_path):
    text = BLOCKS.replace("model mlp", "op block.backward(dy, x) -> dx on comp1 {\n    dx = relu(dy)\n}\n\nmodel mlp", 1)
    ds = [d for d in check_file(write(tmp_path, text, "bwd.sched")) if d.severity == "error"]
    assert [d.code for d in ds] == ["S015"] and "block.backward" in ds[0].message
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith("op block.backward"))
    assert (ds[0].span.line, ds[0].span.col) == (line, 4)


def test_explicit_race_between_chained_instances_is_fixed_by_after_input(tmp_path):
    """Under explicit, instance 2's GEMM (comp1) reads instance 1's relu (comp3): the fix is
    `after x` (the block's input) on the block's GEMM line, which orders it after the line that
    made that input; applied, no race between instances is left."""
    block = BLOCK.replace("    y = relu(h)\n", "    y = relu(h) on comp3\n    \n").replace(
        "    h = linear(x, width)\n", "    h = linear(x, width) after x\n").replace(" after x\n", "\n")
    text = "barriers explicit\n" + STREAMS + block + BLOCKS[len(STREAMS) + len(BLOCK):]
    p = write(tmp_path, text)
    cross = [d for d in check_file(p) if d.code == "R001" and "linear@a2.2.h" in d.message
             and "relu@a2.1" in d.message]
    assert cross and cross[0].fixes and cross[0].fixes[0].text == " after x", [d.help for d in cross]
    fixed = apply_fixes(text, cross[0].fixes)
    assert "    h = linear(x, width) after x\n" in fixed
    left = [d for d in check_file(write(tmp_path, fixed, "fixed.sched"))
            if d.code == "R001" and "linear@a2." in d.message and "relu@a" in d.message.split(" after ")[-1]]
    assert left == []


def _model(block_text: str, lines: str, tmp_path, name="m.sched", extra: str = "") -> str:
    text = STREAMS + block_text + "model mlp(batch = 16, hidden = 16, layers = 2) {\n" \
        "    input x : f32[batch, 64]\n    input y : i32[batch]\n" + lines + \
        "    logits = linear(z, 10)\n    loss   = softmax_cross_entropy(logits, y)\n}\n" + REST + extra
    return write(tmp_path, text, name)


def _errors(path):
    return [d for d in check_file(path) if d.severity == "error"]


def test_names_inside_blocks_never_collide(tmp_path):
    """A body statement named like a parameter of the output line (`w`), a tie to the block's own
    statement (`a.w`, even with a model line named `a`), and a block whose output statement
    calls a block: each line's parameters live under its own name."""
    c = compile_file(_model("op blk(h) -> out {\n    w = relu(h)\n    out = linear(w, 16)\n}\n",
                            "    z = blk(x)\n", tmp_path))
    assert c.ok and [n for n in c.program.model.params if n.startswith("z.")] == ["z.out.w", "z.out.b"]
    tied = "op blk(h) -> out {\n    a = linear(h, 16)\n    r = relu(a)\n    out = linear(r, 16, w = a.w)\n}\n"
    c = compile_file(_model(tied, "    a = linear(x, 16)\n    z = blk(a)\n", tmp_path, "t.sched"))
    assert c.ok, c.diagnostics
    assert [n for n in c.program.model.params if n.startswith(("a.", "z."))] == ["a.w", "a.b", "z.a.w", "z.a.b",
                                                                                "z.out.b"]
    nested = ("op inner(h) -> out {\n    a = linear(h, 16)\n    out = relu(a)\n}\n"
              "op outer(h) -> out {\n    a = linear(h, 16)\n    out = inner(a)\n}\n")
    c = compile_file(_model(nested, "    z = outer(x)\n", tmp_path, "n.sched"))
    assert c.ok and [n for n in c.program.model.params if n.startswith("z.")] == \
        ["z.a.w", "z.a.b", "z.out.a.w", "z.out.a.b"]
    inst = compile_file(_model(BLOCK, "    h = repeat 2 block(x)\n    z = linear(h, 16, w = h.2.h.w)\n",
                               tmp_path, "i.sched"))
    assert inst.ok and "z.w" not in inst.program.model.params


def test_streams_of_block_lines_most_specific_first(tmp_path):
    """Header `on`: the default of the lines; the calling line's `on` beats it; a body `on` beats
    that; `place block.s` beats the body's `on`."""
    def streams(block_text, lines, extra=""):
        c = compile_file(_model(block_text, lines, tmp_path, "s.sched", extra), fuse=False)
        assert c.ok, c.diagnostics
        return {t.label.split(": ")[-1]: t.stream for t in c.schedule.tasks if t.kernel in ("matmul", "relu")
                and t.step == 0 and t.label.split(": ")[-1].startswith(("linear@z", "relu@z"))}
    hdr = "op blk(h) -> out on comp2 {\n    a = linear(h, 16)\n    out = relu(a)\n}\n"
    assert set(streams(hdr, "    z = blk(x)\n").values()) == {"comp2"}
    assert set(streams(hdr, "    z = blk(x) on comp3\n").values()) == {"comp3"}
    body_on = hdr.replace("    a = linear(h, 16)\n", "    a = linear(h, 16) on comp1\n")
    got = streams(body_on, "    z = blk(x) on comp3\n")
    assert got["linear@z.a"] == "comp1" and got["relu@z.y"] == "comp3"
    got = streams(body_on, "    z = blk(x)\n", "place blk.a on comp3\n")
    assert got["linear@z.a"] == "comp3"


@pytest.mark.parametrize("block_text,lines,extra,code,needle", [
    (BLOCK, "    z = block(x) into x\n", "", "S015", "into x"),
    ("op two(h) -> (p, q) on comp3 {\n    p = relu(h)\n    q = relu(h)\n}\n", "    z = repeat 2 two(x)\n", "", "S005",
     "two(x)"),
    ("op blk(h : f32[n, 32]) -> out : f32[n, 16] {\n    out = linear(h, 16)\n}\n", "    z = blk(x)\n", "", "S003",
     "blk(x)"),
    ("op blk(h) -> out {\n    h = linear(h, 16)\n    out = relu(h)\n}\n", "    z = blk(x)\n", "", "S002", "    h = "),
    (BLOCK, "    z = block(x)\n    z = block(z)\n", "", "S002", "    z = block(z)"),
    ("op blk(h) -> out {\n    a = linear(h, 16, w = x0.w)\n    out = relu(a)\n}\n",
     "    x0 = linear(x, 16)\n    z = blk(x0)\n", "", "S007", "x0.w"),
    ("op blk(h) -> out {\n    a = linear(h, hidden)\n    out = relu(a)\n}\n", "    z = blk(x)\n", "", "S007",
     "linear(h, hidden)"),
    (BLOCK, "    z = block(x, width = 16, width = 8)\n", "", "S015", "width = 8"),
    (BLOCK, "    z = block(x)\n", "op block.eval(x) -> y {\n    y = relu(x)\n}\n", "S015", "op block.eval"),
    (BLOCK, "    z = block(x)\n", "place block.backward on comp2\n", "S006", "place block.backward"),
    ("op f(x) -> y {\n    y = relu(x)\n}\n", "    z = f(x)\n", "", "S015", "op f("),
])
def test_block_mistakes_are_diagnostics_where_written(tmp_path, block_text, lines, extra, code, needle):
    path = _model(block_text, lines, tmp_path, "bad.sched", extra)
    ds = _errors(path)
    assert [d.code for d in ds][:1] == [code], [(d.code, d.message) for d in ds]
    text = open(path, encoding="utf-8").read().splitlines()
    line = max(i for i, ln in enumerate(text, 1) if needle in ln)
    assert ds[0].span.line == line, (ds[0].span, needle)
    assert ds[0].span.col - 1 <= text[line - 1].index(needle.strip()) + len(needle.strip())


def test_a_block_of_kernel_named_ops_is_a_block_or_an_op_and_repeats(tmp_path):
    """`out = dropout(a)` (one target) calls the op; relu+add is an op of kernels; both repeat."""
    drop = "op blk(h) -> out {\n    a = relu(h)\n    out = dropout(a, p = 0.1)\n}\n"
    assert compile_file(_model(drop, "    h = linear(x, 16)\n    z = repeat 2 blk(h)\n", tmp_path, "d.sched")).ok
    res = "op res(h) -> out on comp1 {\n    a = relu(h)\n    out = add(h, a)\n}\n"
    c = compile_file(_model(res, "    h = linear(x, 16)\n    z = repeat 2 res(h)\n", tmp_path, "r.sched"))
    assert c.ok, c.diagnostics


def test_place_the_output_line_of_the_last_instance(tmp_path):
    """`place a2 on S`: the line that makes `a2`, the last instance's output (instance 1's is `a2.1`)."""
    c = compile_file(write(tmp_path, BLOCKS + "place a2 on comp2\n", "out.sched"), fuse=False)
    relu = {t.label.split(": ")[-1]: t.stream for t in c.schedule.tasks if t.step == 0 and t.kernel == "relu"}
    assert relu["relu@a2.y"] == "comp2" and relu["relu@a2.1.y"] == relu["relu@a1.y"] == "comp3"
