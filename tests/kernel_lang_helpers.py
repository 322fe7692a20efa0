"""Helpers for the tests of `kernel` forms: compile kernel text through the real front end
(parse, then the resolver's kernel compiler), run a record on fresh outputs, and evaluate a
gradient recipe's KCall trees with the records of the table they name."""

from __future__ import annotations

import numpy as np

from streamsched.diagnostics import StreamschedError
from streamsched.dsl.kernels import compile_kernel_defs
from streamsched.dsl.parse import parse
from streamsched.dsl.resolve import Resolver
from streamsched.stdlib.kernel_record import GradArgs, KCall
from streamsched.stdlib.kernels import KERNELS, numpy_dtype

DT = {np.dtype(np.float64): "f64", np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
      np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}


def compile_kernels(text: str) -> dict:
    """The program kernel table (stdlib + these kernels) of `text` (kernel forms only); raises
    StreamschedError with the diagnostics of any mistake."""
    f = parse("streams { c : compute }\n" + text, "k.sched")
    res = Resolver([f])
    res.collect()
    res.kernels.update(compile_kernel_defs(res, list(res.kernel_defs.values()), KERNELS, {}))
    if res.diags:
        raise StreamschedError(res.diags)
    return res.kernels


def types_of(arrays):
    return [(np.shape(a), DT[np.asarray(a).dtype]) for a in arrays]


def run(rec, ins, attrs=None):
    """Outputs of `rec` on `ins` (fresh arrays from its type rule, NaN-filled)."""
    attrs = attrs or {}
    outs = [np.full(s, np.nan, numpy_dtype(d)) for s, d in rec.infer(types_of(ins), attrs)]
    rec.cpu(ins, outs, attrs)
    return outs


def eval_karg(table, e, env):
    """The value of a recipe's expression (a name in env, or a KCall tree)."""
    if isinstance(e, str):
        return env[e]
    args = [eval_karg(table, a, env) for a in e.args]
    rec = table[e.kernel]
    (out,) = run(rec, args, dict(e.attrs))
    return out


def gradients(table, name, ins, douts, attrs=None, arg_names=None):
    """The input gradients kernel `name`'s recipe gives on `ins` with upstream `douts`."""
    rec = table[name]
    attrs = {**rec.attrs, **(attrs or {})}
    args = tuple(arg_names or (f"in{i}" for i in range(len(ins))))
    outs = tuple(f"out{k}" for k in range(len(rec.outputs)))
    fwd = run(rec, ins, attrs)
    env = dict(zip(args, ins))
    env.update(zip(outs, fwd))
    dnames = []
    for k, d in enumerate(douts):
        if d is None:
            dnames.append(None)
        else:
            env[f"d{outs[k]}"] = d
            dnames.append(f"d{outs[k]}")
    types = {n: (np.shape(v), DT[np.asarray(v).dtype]) for n, v in env.items()}
    g = GradArgs(name, args, outs, tuple(dnames), tuple(True for _ in ins), attrs, types,
                 define=lambda r: table.setdefault(r.name, r), kernels=table)
    parts = rec.grad(g)
    return [None if p is None else eval_karg(table, p, env) for p in parts], parts


__all__ = ["compile_kernels", "run", "gradients", "eval_karg", "KCall", "StreamschedError"]
