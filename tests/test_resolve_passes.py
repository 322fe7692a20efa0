"""The resolver as passes: dsl/resolve.py keeps the names other modules import from it (each the
very object of the pass module that now holds it), and one run reports the mistakes of several
passes together (they share one diagnostic sink)."""

from __future__ import annotations

import dataclasses

import pytest

from streamsched.diagnostics import StreamschedError
from streamsched.dsl import backward, program, scope, types
from streamsched.dsl.lower import Lowering


def test_entry_points_stay_importable_from_resolve():
    from streamsched.dsl.resolve import SEED, CallValue, Resolver, _Abort, grad_name, is_dtype_var, resolve

    assert CallValue is program.CallValue and SEED is backward.SEED and _Abort is scope._Abort
    assert grad_name is backward.grad_name and is_dtype_var is types.is_dtype_var
    assert issubclass(Resolver, scope.Scope) and callable(resolve)
    assert SEED == "d(loss)" and grad_name("h1") == "d(h1)"
    assert [is_dtype_var(n) for n in ("T", "f32", "TT", "t")] == [True, False, False, False]


def test_lowering_is_frozen():
    cx = Lowering(stream="comp1", rep="comp1", op_id=0, label="relu@h", out=[])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cx.stream = "comp2"
    assert dataclasses.replace(cx, stream="comp2").out is cx.out  # a statement's context shares the call's list


def test_one_run_reports_mistakes_of_several_passes():
    from streamsched.dsl.resolve import resolve

    text = """streams { comp1 : compute }
place relu on nowhere
model m {
  input x : f32[4, 3]
  h = linear(x, 5)
  loss = nosuchop(h)
}
train {
  model = m
  colour = 2
}
"""
    with pytest.raises(StreamschedError) as e:
        resolve("t.sched", text)
    found = sorted((d.code, d.span.line) for d in e.value.diagnostics)
    assert found == [("S001", 2), ("S006", 6), ("S015", 10)]


@pytest.mark.parametrize("op", [
    "op twice(__attrs__ : f32[n, k]) -> y : f32[n, k] on comp1 { y = scale(__attrs__, alpha = 2.0) }",
    "op twice(x : f32[n, k]) -> y : f32[n, k] on comp1 { __attrs__ = scale(x, alpha = 2.0); y = copy(__attrs__) }",
])
def test_attrs_is_an_ordinary_name_in_an_op_body(op):
    """The call's attributes travel in the Lowering record, not under a key `__attrs__` of the
    body's names: a parameter or result of that name is a buffer like any other (it was an S007
    for a declared parameter, and a traceback for a result)."""
    from streamsched.dsl.resolve import resolve

    text = ("streams { comp1 : compute }\n" + op +
            "\nmodel m {\n  input x : f32[4, 3]\n  input t : i32[4]\n  h = twice(x)\n"
            "  loss = softmax_cross_entropy(h, t)\n}\n")
    prog = resolve("t.sched", text)
    scales = [t for t in prog.model.forward if t.kernel == "scale"]
    assert [(t.args, dict(t.attrs)["alpha"]) for t in scales] == [(("x",), 2.0)]
