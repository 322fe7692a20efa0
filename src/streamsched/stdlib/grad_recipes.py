"""Gradient recipes of the stdlib kernels (`Kernel.grad`): the same formulas the stdlib's
hand-written `NAME.backward` ops use (docs/kernels.md, "Backward recipes"), so that an op built on
these kernels gets its backward derived (`streamsched.dsl.derive`).  Kernels left out (batch norm,
the optimizers, the gradient kernels themselves) have no recipe: an op built on them needs a
hand-written backward (S012).
"""

from __future__ import annotations

from typing import Callable

from streamsched.stdlib.kernel_record import GradArgs, KCall, NotDifferentiable

FLOATS = ("f16", "bf16", "f32", "f64")


def _shape(g: GradArgs, name: str) -> tuple[int, ...]:
    return tuple(g.types[name][0])


def _unbroadcast(kernel: str, grad, src: tuple[int, ...], dst: tuple[int, ...]):
    """The gradient of an operand of shape dst broadcast to src: grad summed over the broadcast
    dimensions (leading ones, or everything for a scalar)."""
    if src == dst:
        return grad
    if dst == ():
        return KCall("sum", (grad,))
    lead = len(src) - len(dst)
    if lead > 0 and src[lead:] == dst:
        if lead == 3 and len(src) == 4 and len(dst) == 1:
            return KCall("sum_nhw", (grad,))
        for _ in range(lead):
            grad = KCall("sum", (grad,), (("axis", 0),))
        return grad
    raise NotDifferentiable(f"`{kernel}` broadcast a {list(dst)} operand to {list(src)}: only a row (leading "
                            "dimensions) or a scalar is summed back")


def _matmul(g: GradArgs):
    a, b = g.args
    (dc,) = g.douts
    ta, tb = bool(g.attrs.get("ta")), bool(g.attrs.get("tb"))
    if not ta and not tb:     # c = a b
        da, db = KCall("matmul", (dc, b), (("tb", True),)), KCall("matmul", (a, dc), (("ta", True),))
    elif ta and not tb:       # c = a^T b
        da, db = KCall("matmul", (b, dc), (("tb", True),)), KCall("matmul", (a, dc))
    elif not ta and tb:       # c = a b^T
        da, db = KCall("matmul", (dc, b)), KCall("matmul", (dc, a), (("ta", True),))
    else:                     # c = a^T b^T
        da = KCall("matmul", (b, dc), (("ta", True), ("tb", True)))
        db = KCall("matmul", (dc, a), (("ta", True), ("tb", True)))
    return [da if g.need[0] else None, db if g.need[1] else None]


def _binary(kind: str) -> Callable:
    def recipe(g: GradArgs):
        a, b = g.args
        (dc,) = g.douts
        out = _shape(g, g.outs[0])
        ga = {"add": dc, "sub": dc, "mul": KCall("mul", (dc, b))}[kind]
        gb = {"add": dc, "sub": KCall("scale", (dc,), (("alpha", -1.0),)), "mul": KCall("mul", (dc, a))}[kind]
        return [_unbroadcast(kind, ga, out, _shape(g, a)) if g.need[0] else None,
                _unbroadcast(kind, gb, out, _shape(g, b)) if g.need[1] else None]
    return recipe


def _scale(g: GradArgs):
    return [KCall("scale", (g.douts[0],), (("alpha", float(g.attrs.get("alpha", 1.0))),))]


def _bias_add(g: GradArgs):
    x, b = g.args
    (dy,) = g.douts
    return [dy if g.need[0] else None,
            _unbroadcast("bias_add", dy, _shape(g, x), _shape(g, b)) if g.need[1] else None]


def _passthrough(g: GradArgs):
    return [g.douts[0] if n else None for n in g.need]


def _from_output(grad_kernel: str) -> Callable:
    def recipe(g: GradArgs):
        return [KCall(grad_kernel, (g.douts[0], g.outs[0]))]
    return recipe


def _from_input(grad_kernel: str) -> Callable:
    def recipe(g: GradArgs):
        return [KCall(grad_kernel, (g.douts[0], g.args[0]))]
    return recipe


def _reduction(kind: str) -> Callable:
    def recipe(g: GradArgs):
        (x,) = g.args
        if g.types[x][1] not in FLOATS:
            return [None]
        from streamsched.stdlib import kernel_lang as L  # SymPy, only when a gradient needs it

        axis = g.attrs.get("axis")
        name = f"{kind}.da" + ("" if axis is None else f"@axis{int(axis)}")
        spec = L.ExprSpec(name, (L.Param("dc", "T", expanded=True), L.Param("a", "T")), (),
                          (L.Output("da", "T"),), (L.S,),
                          L.Reduction("sum", "like:1", L.a(0) / L.CNT if kind == "mean" else L.a(0), (0, 1)),
                          expand=("all",) if axis is None else ("axis", int(axis)),
                          doc=f"the gradient of {kind}: dc broadcast back along the reduced axes", grad_of=kind)
        k = L.compiled(spec)
        if name not in g.kernels:
            g.define(k.record)
        return [KCall(name, (g.douts[0], x))]
    return recipe


def _softmax_xent(g: GradArgs):
    logits, labels = g.args
    return [KCall("softmax_xent_grad", (g.douts[0], logits, labels)) if g.need[0] else None, None]


def _flatten(g: GradArgs):
    return [KCall("unflatten", (g.douts[0], g.args[0]))]


def _conv2d(g: GradArgs):
    x, w = g.args
    (dy,) = g.douts
    (_, h, wd, _), (kh, kw, _, _) = _shape(g, x), _shape(g, w)
    s, p = ("stride", g.attrs.get("stride", 1)), ("pad", g.attrs.get("pad", 0))
    return [KCall("conv2d_grad_x", (dy, w), (s, p, ("in_h", h), ("in_w", wd))) if g.need[0] else None,
            KCall("conv2d_grad_w", (x, dy), (("kh", kh), ("kw", kw), s, p)) if g.need[1] else None]


def _pool(grad_kernel: str) -> Callable:
    def recipe(g: GradArgs):
        attrs = tuple((k, g.attrs[k]) for k in ("size", "stride") if k in g.attrs)
        return [KCall(grad_kernel, (g.douts[0], g.args[0]), attrs)]
    return recipe


def _dropout(g: GradArgs):
    dy = g.douts[0]
    if dy is None:
        return [None, None]
    return [KCall("dropout_grad", (dy, g.outs[1]), (("p", g.attrs.get("p", 0.1)),)) if g.need[0] else None, None]


def _cast(g: GradArgs):
    return [KCall("cast", (g.douts[0],), (("dtype", g.types[g.args[0]][1]),))]


RECIPES: dict[str, Callable] = {
    "matmul": _matmul, "add": _binary("add"), "sub": _binary("sub"), "mul": _binary("mul"), "scale": _scale,
    "bias_add": _bias_add, "accumulate": _passthrough, "copy": _passthrough,
    "relu": _from_output("relu_grad"), "tanh": _from_output("tanh_grad"), "sigmoid": _from_output("sigmoid_grad"),
    "gelu": _from_input("gelu_grad"), "sum": _reduction("sum"), "mean": _reduction("mean"),
    "softmax_xent": _softmax_xent, "flatten": _flatten, "conv2d": _conv2d, "maxpool2d": _pool("maxpool2d_grad"),
    "avgpool2d": _pool("avgpool2d_grad"), "global_avgpool": _from_input("global_avgpool_grad"),
    "dropout": _dropout, "cast": _cast,
}
"""Kernel name -> its gradient recipe (kernel_record.GradRecipe)."""


def attach(table: dict) -> None:
    """Give the records of `table` (the stdlib's KERNELS) their recipes."""
    from dataclasses import replace

    for name, recipe in RECIPES.items():
        if name in table:
            table[name] = replace(table[name], grad=recipe)
