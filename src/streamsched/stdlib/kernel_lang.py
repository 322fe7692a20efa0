"""Kernels written as expressions, compiled with SymPy into `Kernel` records: the `.sched`
`kernel` form (docs/language.md, "Kernels") after `streamsched.dsl.kernels` has checked it.
The spec and the shapes live in `kernel_spec.py`, the printing of the twins in `kernel_print.py`;
this module compiles them into records and derives the gradient kernels.

    ExprSpec   = params (inputs) + attrs + outputs + one expression per output
               + optionally one Reduction (kind, axis, map expression): y = post(reduce(map))
    ExprKernel = ExprSpec compiled: type rule, NumPy twin (SymPy's NumPy printer), CUDA twin
                 (SymPy's C printer inside a CuPy ElementwiseKernel / ReductionKernel, CuPy
                 imported only when the twin runs), gradient recipe (`sympy.diff`, `cse`)

Expressions are SymPy expressions over the symbols `a0, a1, ...` (the inputs, in order),
`p0, p1, ...` (the attributes), `s` (the reduced value, in a reduction's post expression) and
`cnt` (how many values each output reduces: a mean's divisor).  Printed code only ever holds
these names: nothing a user wrote reaches Python or C text but numbers.

Shapes: an elementwise kernel runs over the broadcast shape of all its inputs (NumPy rules; a row
`[n]` and a scalar `[]` broadcast), and every output has that shape.  A reduction runs its map
over the broadcast shape of its map inputs and reduces along `axis` (an int, or None for every
axis); the other inputs (post inputs) broadcast to the output shape.  Gradient kernels add two
internal forms: `axis = "like:i"` (sum down to the shape of input i: the gradient of a broadcast
operand) and `expand` (inputs that live in a reduction's output space, re-expanded along its
axis: the upstream gradient of a reduction).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Any, Callable

import numpy as np
import sympy as sp

from streamsched.stdlib.kernel_print import (_NP_TO_KEY, CudaSource, _compile_numpy, cuda_source,  # noqa: F401
                                             numpy_source)
from streamsched.stdlib.kernel_record import GradArgs, KCall, Kernel, KernelTypeError, NotDifferentiable
from streamsched.stdlib.kernel_spec import (CNT, FLOATS, FUNCTIONS, INTS, NOT_DIFFERENTIABLE,  # noqa: F401
                                            REDUCTIONS, S, ExprSpec, Output, Param, Plan, Reduction, _broadcast,
                                            _fmt, _like_axes, _pattern, a, condition, elementwise_twin,
                                            is_dtype_var, number, p, plan, post_inputs, sigmoid, softplus, where)

# ---- the compiled kernel -----------------------------------------------------------------------
def _acc_dtype(arrays) -> np.dtype:
    return np.dtype(np.float64) if any(getattr(x, "dtype", None) == np.float64 for x in arrays) else np.dtype(np.float32)


class ExprKernel:
    """A compiled `ExprSpec`: `record` is its `Kernel` (type rule, NumPy twin, CUDA twin, gradient
    recipe).  Built once per spec (`compiled`)."""

    def __init__(self, spec: ExprSpec):
        self.spec = spec
        self._np: dict[str, Callable] | None = None
        self._cuda: dict[tuple, Any] = {}
        self.record = Kernel(
            name=spec.name, inputs=tuple(pp.name for pp in spec.params), outputs=tuple(o.name for o in spec.outputs),
            infer=self.infer, cpu=self.cpu, attrs=dict(spec.attrs), cuda=self.cuda, doc=spec.doc,
            inplace=spec.reduction is None and not spec.expand,
            grad=None if spec.grad_of else self.grad)

    # -- type rule
    def infer(self, in_types, attrs=None) -> list[tuple[tuple[int, ...], str]]:
        """Output types on inputs `in_types` [(shape, dtype)]; KernelTypeError S003 (arity, shapes,
        attributes) or S004 (dtypes), `arg` the offending input."""
        spec, k = self.spec, self.spec.name
        names = [pp.name for pp in spec.params]
        if len(in_types) != len(spec.params):
            raise KernelTypeError(f"{k}: takes {len(names)} input{'s' if len(names) != 1 else ''} "
                                  f"({', '.join(names)}), got {len(in_types)}")
        attrs = attrs or {}
        known = dict(spec.attrs)
        for key, v in attrs.items():
            if key not in known:
                takes = f"takes {', '.join(known)}" if known else "takes no attributes"
                raise KernelTypeError(f"{k}: unknown attribute {key!r}; {k} {takes}")
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise KernelTypeError(f"{k}: attribute {key} must be a number, got {v!r}")
        env: dict[str, Any] = {}
        shapes = []
        for i, (pp, (shape, dt)) in enumerate(zip(spec.params, in_types)):
            shape = tuple(int(d) for d in shape)
            shapes.append(shape)
            if is_dtype_var(pp.dtype):
                if dt not in FLOATS:
                    raise KernelTypeError(f"{k}: {pp.name} must be a float dtype ({', '.join(FLOATS)}) for "
                                          f"`{pp.dtype}`, got {dt}", arg=i, code="S004")
                have = env.setdefault("$" + pp.dtype, (dt, pp.name))
                if have[0] != dt:
                    raise KernelTypeError(f"{k}: dtypes differ: {have[1]} is {have[0]}, {pp.name} is {dt} "
                                          f"(both `{pp.dtype}`)", arg=i, code="S004")
            elif pp.dtype != dt:
                raise KernelTypeError(f"{k}: {pp.name} must be {pp.dtype}, got {dt}", arg=i, code="S004")
            if pp.dims is not None:
                self._match(pp.name, pp.dims, shape, env, i, _pattern(pp))
        red = spec.reduction
        space = range(len(spec.params)) if red is None else red.inputs
        plain = [i for i in space if not spec.params[i].expanded]
        try:
            index = _broadcast([shapes[i] for i in plain])
        except ValueError:
            raise KernelTypeError(f"{k}: shapes do not broadcast: " + ", ".join(
                f"{names[i]} is {_fmt(shapes[i])}" for i in plain) + " (trailing dimensions must be equal or 1)",
                arg=plain[-1]) from None
        if red is not None and isinstance(red.axis, int) and not -len(index) <= red.axis < max(len(index), 1):
            raise KernelTypeError(f"{k}: axis {red.axis} is out of range for the {len(index)}-D "
                                  f"{_fmt(index)} it reduces", arg=plain[0] if plain else None)
        if red is not None and isinstance(red.axis, int) and not index:
            raise KernelTypeError(f"{k}: axis {red.axis} is out of range for the 0-D [] it reduces",
                                  arg=plain[0] if plain else None)
        pl = plan(spec, shapes)
        for i, pp in enumerate(spec.params):
            if pp.expanded and not _broadcast_to(shapes[i], pl.espace):
                raise KernelTypeError(f"{k}: {pp.name} is {_fmt(shapes[i])}, which does not broadcast to "
                                      f"{_fmt(pl.espace)}", arg=i)
        if red is not None:
            if isinstance(red.axis, str):
                t = int(red.axis[5:])
                if _like_axes(index, shapes[t]) is None:
                    raise KernelTypeError(f"{k}: {names[t]} {_fmt(shapes[t])} does not broadcast to "
                                          f"{_fmt(index)}", arg=t)
            post = post_inputs(spec)
            for i in range(len(spec.params)):
                if i in post and not _broadcast_to(shapes[i], pl.out):
                    raise KernelTypeError(f"{k}: {names[i]} is {_fmt(shapes[i])}, but outside the reduction it "
                                          f"must broadcast to the result's {_fmt(pl.out)}", arg=i)
        out = []
        for o in spec.outputs:
            dt = env["$" + o.dtype][0] if is_dtype_var(o.dtype) else o.dtype
            if o.dims is not None:
                self._match(o.name, o.dims, pl.out, env, None, f"{o.dtype}[{', '.join(map(str, o.dims))}]",
                            what="the result")
            out.append((pl.out, dt))
        return out

    def _match(self, name, dims, shape, env, arg, pattern, what=None) -> None:
        k = self.spec.name
        who = what or name
        rest = list(dims)
        lead = bool(rest) and rest[0] == "..."
        if lead:
            rest = rest[1:]
        if (len(shape) < len(rest)) if lead else (len(shape) != len(rest)):
            need = f"at least {len(rest)}" if lead else f"{len(rest)}"
            raise KernelTypeError(f"{k}: {who} has shape {_fmt(shape)}, but `{name} : {pattern}` needs {need} "
                                  f"dimension{'s' if len(rest) != 1 else ''}", arg=arg)
        for d, actual in zip(rest, shape[len(shape) - len(rest):]):
            if isinstance(d, int):
                if d != actual:
                    raise KernelTypeError(f"{k}: {who} has shape {_fmt(shape)}, but `{name} : {pattern}` needs "
                                          f"{d}, not {actual}", arg=arg)
                continue
            have = env.setdefault(d, (actual, name))
            if have[0] != actual:
                raise KernelTypeError(f"{k}: {who} has shape {_fmt(shape)}, but `{name} : {pattern}` does not fit: "
                                      f"`{d}` is {have[0]} (bound by {have[1]}), not {actual}", arg=arg)

    # -- CPU
    def _fns(self) -> dict[str, Callable]:
        if self._np is None:
            self._np = _compile_numpy(self.spec)
        return self._np

    def _values(self, attrs) -> list[float]:
        given = attrs or {}
        return [float(given.get(nm, d)) for nm, d in self.spec.attrs]

    def cpu(self, ins, outs, attrs=None) -> None:
        """The NumPy twin (Kernel.cpu's convention): every result computed before the first write,
        in float32 (f16 and integer inputs widened) or float64 when an array is f64."""
        spec = self.spec
        fns = self._fns()
        ins = [np.asarray(x) for x in ins]
        pl = plan(spec, [x.shape for x in ins])
        ct = _acc_dtype(list(ins) + list(outs))
        arrs = [x if x.dtype == ct else x.astype(ct) for x in ins]
        arrs = [_expand_np(x, pl) if pp.expanded else x for x, pp in zip(arrs, spec.params)]
        vals = self._values(attrs)
        red = spec.reduction
        with np.errstate(all="ignore"):
            if red is None:
                res = fns["_out"](*arrs, *vals, 0.0, float(pl.cnt))
            else:
                (m,) = fns["_map"](*arrs, *vals, 0.0, float(pl.cnt))
                m = np.broadcast_to(np.asarray(m, dtype=ct), pl.index)
                if pl.axes:
                    r = {"sum": np.sum, "mean": np.sum, "max": np.max, "min": np.min}[red.kind](m, axis=pl.axes)
                else:
                    r = m
                if red.kind == "mean":
                    r = r / ct.type(pl.cnt)
                r = np.reshape(r, pl.out)
                res = fns["_out"](*arrs, *vals, r, float(pl.cnt))
            res = [np.asarray(v, dtype=ct) for v in res]
        for o, v in zip(outs, res):
            o[...] = v

    # -- CUDA
    def cuda_source(self, in_dtypes, out_dtypes) -> CudaSource:
        return cuda_source(self.spec, in_dtypes, out_dtypes)

    def cuda(self, ctx, stream, ins, outs, attrs=None) -> None:
        """The CUDA twin (the stdlib twins' convention `fn(ctx, stream, ins, outs, attrs)`): one CuPy
        ElementwiseKernel or ReductionKernel launch on `stream` (a reduction whose post expression
        reads arrays adds one in-place elementwise launch); outputs given, so nothing allocates."""
        import cupy as cp

        from streamsched.stdlib.kernels._cuda import _stream

        spec = self.spec
        pl = plan(spec, [tuple(x.shape) for x in ins])
        use = spec
        if spec.reduction is not None and not pl.axes:  # nothing to reduce (an operand not broadcast)
            use = elementwise_twin(spec)
        key = (use is spec, tuple(str(x.dtype) for x in ins), tuple(str(o.dtype) for o in outs))
        if key not in self._cuda:
            src = cuda_source(use, [_NP_TO_KEY[str(x.dtype)] for x in ins], [_NP_TO_KEY[str(o.dtype)] for o in outs])
            if src.kind == "elementwise":
                kern = (src, cp.ElementwiseKernel(src.in_params, src.out_params, src.operation, src.name,
                                                  preamble=src.preamble), None)
            else:
                post = None
                if src.post is not None:
                    post = cp.ElementwiseKernel(src.post[0], src.post[1], src.post[2], src.name + "_post",
                                                preamble=src.preamble)
                kern = (src, cp.ReductionKernel(src.in_params, src.out_params, src.map_expr, src.reduce_expr,
                                                src.post_map_expr, src.identity, src.name,
                                                reduce_type=src.reduce_type, preamble=src.preamble), post)
            self._cuda[key] = kern
        src, kern, post = self._cuda[key]
        arrs = [_expand_cp(cp, x, pl) if pp.expanded else x for x, pp in zip(ins, spec.params)]
        vals = self._values(attrs) + [float(pl.cnt)]
        with _stream(ctx, stream):
            if src.kind == "elementwise":
                kern(*[arrs[i] for i in src.inputs], *vals, *outs)
                return
            out = outs[0].reshape(pl.reduced) if outs[0].shape != tuple(pl.reduced) else outs[0]
            kern(*[arrs[i] for i in src.inputs], *vals, out, axis=pl.axes)
            if post is not None:
                post_ins = post_inputs(spec)
                post(*[arrs[i] for i in post_ins], *vals, outs[0])

    # -- gradients
    def grad(self, g: GradArgs) -> list[KCall | None]:
        """The gradient recipe: for each wanted float input, one generated kernel (`NAME.dX`) that
        computes sum_k dy_k * d f_k / dX, summed down to X's shape where X was broadcast; for a
        reduction, the upstream gradient re-expanded along its axis (and, when the post
        expression's slope depends on the reduced value, `NAME.s` recomputes it)."""
        spec = self.spec
        present = tuple(k for k, d in enumerate(g.douts) if d is not None)
        out: list[KCall | None] = []
        attrs = tuple(sorted((nm, g.attrs.get(nm, d)) for nm, d in spec.attrs))
        for i, pp in enumerate(spec.params):
            if not g.need[i] or not (is_dtype_var(pp.dtype) or pp.dtype in FLOATS):
                out.append(None)
                continue
            gspec, argnames = (self._grad_elementwise(i, present, g) if spec.reduction is None
                               else self._grad_reduction(i, g))
            gk = compiled(gspec)
            if gk.spec.name not in g.kernels:
                g.define(gk.record)
            out.append(KCall(gk.spec.name, tuple(argnames), attrs))
        return out

    def _grad_elementwise(self, i: int, present: tuple[int, ...], g: GradArgs):
        spec = self.spec
        gs = [sp.Symbol(f"g{k}", real=True) for k in present]
        total = sum((gs[n] * sp.diff(spec.exprs[k], a(i)) for n, k in enumerate(present)), sp.Integer(0))
        _check_differentiable(total, spec.name)
        used = [j for j in range(len(spec.params)) if a(j) in total.free_symbols or j == i]
        params = [Param(f"d{spec.outputs[k].name}", spec.outputs[k].dtype) for k in present]
        params += [replace(spec.params[j], dims=None) for j in used]
        subs = {gs[n]: a(n) for n in range(len(present))}
        subs.update({a(j): a(len(present) + n) for n, j in enumerate(used)})
        total = total.xreplace(subs)
        like = len(present) + used.index(i)
        suffix = "" if len(present) == len(spec.outputs) else "@" + "+".join(spec.outputs[k].name for k in present)
        gspec = ExprSpec(f"{spec.name}.d{spec.params[i].name}{suffix}", tuple(params), spec.attrs,
                         (Output(f"d{spec.params[i].name}", spec.params[i].dtype),), (S,),
                         Reduction("sum", f"like:{like}", total, tuple(range(len(params)))),
                         doc=f"gradient of {spec.name} with respect to {spec.params[i].name}", grad_of=spec.name)
        names = [g.douts[k] for k in present] + [g.args[j] for j in used]
        return gspec, names

    def _s_kernel(self) -> ExprKernel:
        spec, red = self.spec, self.spec.reduction
        keep = list(red.inputs)
        subs = {a(j): a(n) for n, j in enumerate(keep)}
        return compiled(ExprSpec(f"{spec.name}.s", tuple(spec.params[j] for j in keep), spec.attrs,
                                 (Output("s", spec.outputs[0].dtype),), (S,),
                                 Reduction(red.kind, red.axis, red.map.xreplace(subs), tuple(range(len(keep)))),
                                 doc=f"the reduced value of {spec.name}, recomputed for its gradient",
                                 grad_of=spec.name))

    def _grad_reduction(self, i: int, g: GradArgs):
        spec, red = self.spec, self.spec.reduction
        post = spec.exprs[0]
        gy = sp.Symbol("g0", real=True)
        post_ins = post_inputs(spec)
        if i not in red.inputs and i not in post_ins:  # read nowhere: a zero gradient of its shape
            zspec = ExprSpec(f"{spec.name}.d{spec.params[i].name}", (replace(spec.params[i], dims=None),), spec.attrs,
                             (Output(f"d{spec.params[i].name}", spec.params[i].dtype),), (sp.Integer(0),),
                             doc=f"gradient of {spec.name} with respect to {spec.params[i].name} (zero)",
                             grad_of=spec.name)
            return zspec, [g.args[i]]
        if i in red.inputs:
            if red.kind in ("max", "min"):
                raise NotDifferentiable(f"the gradient of a {red.kind} reduction is not derived (ties have no "
                                        f"single answer)", red.kind)
            factor = sp.diff(post, S) * (1 / CNT if red.kind == "mean" else 1)
            d_map = sp.diff(red.map, a(i))
            total = gy * factor * d_map
        else:
            total = gy * sp.diff(post, a(i))
        _check_differentiable(total, spec.name)
        needs_s = S in total.free_symbols
        params: list[Param] = [Param(f"d{spec.outputs[0].name}", spec.outputs[0].dtype, expanded=i in red.inputs)]
        names: list[str] = [g.douts[0]]
        subs: dict = {gy: a(0)}
        if needs_s:
            sk = self._s_kernel()
            if sk.spec.name not in g.kernels:
                g.define(sk.record)
            subs[S] = a(len(params))
            params.append(Param("s", spec.outputs[0].dtype, expanded=i in red.inputs))
            names.append(KCall(sk.spec.name, tuple(g.args[j] for j in red.inputs),
                               tuple(sorted((nm, g.attrs.get(nm, d)) for nm, d in spec.attrs))))
        if i in red.inputs:
            for j in post_ins:
                if a(j) in total.free_symbols:
                    subs[a(j)] = a(len(params))
                    params.append(replace(spec.params[j], dims=None, expanded=True))
                    names.append(g.args[j])
            space = list(red.inputs)
        else:
            space = [j for j in post_ins if a(j) in total.free_symbols and j != i] + [i]
        for j in space:
            subs[a(j)] = a(len(params))
            params.append(replace(spec.params[j], dims=None))
            names.append(g.args[j])
        total = total.xreplace(subs)
        like = len(params) - len(space) + space.index(i)
        expand = (("all",) if red.axis is None else ("axis", red.axis)) if i in red.inputs else ()
        gspec = ExprSpec(f"{spec.name}.d{spec.params[i].name}", tuple(params), spec.attrs,
                         (Output(f"d{spec.params[i].name}", spec.params[i].dtype),), (S,),
                         Reduction("sum", f"like:{like}", total, tuple(range(len(params)))), expand=expand,
                         doc=f"gradient of {spec.name} with respect to {spec.params[i].name}", grad_of=spec.name)
        return gspec, names


def _check_differentiable(e, kernel: str) -> None:
    """NotDifferentiable when a derivative SymPy gives is not a function we can run: floor and
    ceil stay unevaluated `Derivative`s, sign becomes DiracDelta."""
    bad = e.atoms(sp.Derivative, sp.Subs, sp.DiracDelta, sp.Heaviside)
    if not bad:
        return
    culprit = ""
    for f in bad:
        inner = [x.func.__name__ for x in f.atoms(sp.Function) if x.func.__name__ in NOT_DIFFERENTIABLE]
        if isinstance(f, (sp.DiracDelta, sp.Heaviside)):
            inner = inner or ["sign"]
        if inner:
            culprit = NOT_DIFFERENTIABLE.get(inner[0], inner[0])
            break
    what = f"`{culprit}`" if culprit else "a function of its body"
    raise NotDifferentiable(f"{what} has no derivative to train with (zero almost everywhere, undefined at "
                            "its jumps)", culprit)


def _broadcast_to(shape, target) -> bool:
    try:
        return tuple(np.broadcast_shapes(tuple(shape), tuple(target))) == tuple(target)
    except ValueError:
        return False


def _expand_np(x, pl: Plan):
    x = np.broadcast_to(x, pl.espace)
    return np.expand_dims(x, pl.eaxis) if pl.eaxis is not None else x


def _expand_cp(cp, x, pl: Plan):
    x = cp.broadcast_to(x, pl.espace)
    return cp.expand_dims(x, pl.eaxis) if pl.eaxis is not None else x


def expr_kernel(record: Kernel) -> ExprKernel | None:
    """The ExprKernel a record was compiled from (None for a stdlib or Python kernel): its
    `spec`, `cuda_source(in_dtypes, out_dtypes)` and `numpy_source(spec)` show what runs."""
    owner = getattr(record.cpu, "__self__", None)
    return owner if isinstance(owner, ExprKernel) else None


@lru_cache(maxsize=1024)
def compiled(spec: ExprSpec) -> ExprKernel:
    """The ExprKernel of `spec`, built once (SymPy's printing is the slow part)."""
    return ExprKernel(spec)
