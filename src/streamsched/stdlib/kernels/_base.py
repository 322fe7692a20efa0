"""What every kernel family module shares: dtypes, type-rule helpers, NumPy helpers, gradient-recipe
helpers, and `Family`, which turns a family's rules, twins, recipes and doc rows into `Kernel` records.

CPU calling convention (`Kernel.cpu(ins, outs, attrs)`): `outs` are preallocated arrays with the
types `infer` returned, possibly views into a shared arena, possibly the very arrays of `ins`
(`v = f(v, g)`).  Every kernel therefore writes only through `out[...] = ...` or
`np.ufunc(..., out=out)` (NumPy copies overlapping operands itself), and a kernel with several
outputs, or one that reads an input after writing, finishes computing into temporaries before
its first write.  Step-varying scalars (learning rate, step count, dloss) arrive as shape-()
arrays and are read when the kernel runs, never baked in (CUDA_PITFALLS.md, pitfall 3).

Type rules (`Kernel.infer(in_types, attrs)`) raise `KernelTypeError` with code S003 for shapes,
arity and attributes, S004 for dtypes; `arg` is the index of the offending input, so the caller
can point at the user's argument.  Messages use the kernel's own parameter names (`a`, `b`, ...).
`Kernel.infer` and `Kernel.cpu` both fill in attribute defaults, so `{}` is a valid `attrs`.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from streamsched.interp.ir import DTYPE_BYTES
from streamsched.stdlib.kernel_record import DocRow, GradArgs, GradRecipe, KCall, Kernel, KernelTypeError, TensorType

FLOATS = ("f16", "bf16", "f32", "f64")
INTS = ("i32", "i64")
NUMERIC = FLOATS + INTS

_NUMPY = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "i64": np.int64,
          "i32": np.int32, "u8": np.uint8, "bool": np.bool_}


def numpy_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype the CPU backend stores `dtype` in; bf16 has none (NotImplementedError)."""
    if dtype == "bf16":
        raise NotImplementedError(
            "bf16 buffers cannot run on the CPU backend (NumPy has no bfloat16); "
            "use f32 or f16 there, or the CUDA backend")
    if dtype not in _NUMPY:
        raise KeyError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return np.dtype(_NUMPY[dtype])


# --------------------------------------------------------------------------------------------
# Type-rule helpers: each check names the kernel, the parameter and the shapes involved.


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _dtype(k: str, types, i: int, names, allowed: tuple[str, ...], what: str) -> str:
    dt = types[i][1]
    if dt not in allowed:
        raise KernelTypeError(f"{k}: {names[i]} must be {what} ({', '.join(allowed)}), got {dt}",
                              arg=i, code="S004")
    return dt


def _floats(k: str, types, names, idx: Sequence[int]) -> str:
    """All of `idx` are floats of one dtype (the first one's); returns it."""
    first = _dtype(k, types, idx[0], names, FLOATS, "a float dtype")
    for i in idx[1:]:
        _dtype(k, types, i, names, FLOATS, "a float dtype")
        if types[i][1] != first:
            raise KernelTypeError(
                f"{k}: dtypes differ: {names[idx[0]]} is {first}, {names[i]} is {types[i][1]}",
                arg=i, code="S004")
    return first


def _same_shape(k: str, types, names, idx: Sequence[int]) -> tuple[int, ...]:
    first = types[idx[0]][0]
    for i in idx[1:]:
        if types[i][0] != first:
            raise KernelTypeError(
                f"{k}: shapes differ: {names[idx[0]]} is {_fmt(first)}, "
                f"{names[i]} is {_fmt(types[i][0])}", arg=i)
    return first


def _scalar(k: str, types, names, i: int, allowed: tuple[str, ...] = FLOATS) -> None:
    shape, dt = types[i]
    if shape != ():
        raise KernelTypeError(
            f"{k}: {names[i]} must be a scalar (shape []), got {_fmt(shape)}", arg=i)
    _dtype(k, types, i, names, allowed, "a scalar of dtype")


def _attr_error(k: str, msg: str) -> KernelTypeError:
    return KernelTypeError(f"{k}: {msg}", arg=None, code="S003")


def _number(k: str, attrs: dict, key: str, lo: float | None = None, hi: float | None = None,
            hi_open: bool = False) -> float:
    x = attrs[key]
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise _attr_error(k, f"attribute {key} must be a number, got {x!r}")
    if (lo is not None and x < lo) or (hi is not None and (x >= hi if hi_open else x > hi)):
        rng = f"[{lo}, {hi})" if hi_open else (f"[{lo}, {hi}]" if hi is not None else f">= {lo}")
        raise _attr_error(k, f"attribute {key} = {x} is out of range (must be {rng})")
    return float(x)


def _flag(k: str, attrs: dict, key: str) -> bool:
    x = attrs[key]
    if not isinstance(x, (bool, np.bool_)):
        raise _attr_error(k, f"attribute {key} must be true or false, got {x!r}")
    return bool(x)


def _type_attrs(k: str, attrs: dict) -> TensorType:
    """The (shape, dtype) a kernel with no inputs was told to produce."""
    shape, dt = attrs["shape"], attrs["dtype"]
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        shape = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise _attr_error(k, f"attribute shape must be a list of sizes, got {shape!r}") from None
    if any(d < 0 for d in shape):
        raise _attr_error(k, f"attribute shape {_fmt(shape)} has a negative size")
    if dt not in DTYPE_BYTES:
        raise _attr_error(k, f"attribute dtype {dt!r} is not a dtype ({', '.join(DTYPE_BYTES)})")
    return shape, dt


def _loss_dtype(dt: str) -> str:
    """The loss of `dt` logits: at least f32, so f16 logits under mixed precision give an f32
    loss (and an f32 gradient seed, the loss scale)."""
    return "f32" if dt in ("f16", "bf16") else dt


def _int(k: str, at: dict, key: str, lo: int, why: str = "") -> int:
    """An integer attribute >= lo; None (no default) is 'must be given'."""
    x = at[key]
    if x is None:
        raise _attr_error(k, f"attribute {key} must be given{f' ({why})' if why else ''}")
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)) \
            or x != int(x):
        raise _attr_error(k, f"attribute {key} must be an integer, got {x!r}")
    if x < lo:
        raise _attr_error(k, f"attribute {key} = {int(x)} is out of range (must be >= {lo})")
    return int(x)


def _rank(k: str, t, names, i: int, nd: int, layout: str) -> tuple[int, ...]:
    shape = t[i][0]
    if len(shape) != nd:
        raise KernelTypeError(f"{k}: {names[i]} must be {nd}-D {layout}, got {_fmt(shape)}", arg=i)
    return shape


def _image(k, t, names, i):
    return _rank(k, t, names, i, 4, "[n, h, w, c] (NHWC)")


def _channels_last(k, t, names, i) -> tuple[int, ...]:
    shape = t[i][0]
    if len(shape) < 2:
        raise KernelTypeError(f"{k}: {names[i]} must be [n, h, w, c] or [n, c] (channels last), "
                              f"got {_fmt(shape)}", arg=i)
    return shape


def _out_size(size: int, win: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - win) // stride + 1


def _window_fits(k, t, names, i, kh, kw, pad, what) -> None:
    _, h, w, _ = t[i][0]
    if h + 2 * pad < kh or w + 2 * pad < kw:
        padded = f" padded by {pad} ({h + 2 * pad} x {w + 2 * pad})" if pad else ""
        raise KernelTypeError(f"{k}: the {kh} x {kw} {what} does not fit {names[i]} "
                              f"{_fmt(t[i][0])}{padded}", arg=i)


def _ints(at: dict, *keys: str) -> tuple[int, ...]:
    """Integer attributes as ints when the kernel runs (a .sched `2.0` is accepted as 2)."""
    return tuple(int(at[key]) for key in keys)


# --------------------------------------------------------------------------------------------
# NumPy helpers


def _acc(x: np.ndarray) -> np.ndarray:
    """x in at least float32, so that f16 activations and losses are computed accurately."""
    return x.astype(np.promote_types(x.dtype, np.float32), copy=False)


def _acc_dtype(x: np.ndarray) -> np.dtype:
    return np.promote_types(x.dtype, np.float32)


def _bn_acc(x: np.ndarray, p: np.ndarray) -> np.ndarray:
    """x in the wider of its own and the parameters' precision, at least f32."""
    return x.astype(np.promote_types(np.promote_types(x.dtype, p.dtype), np.float32), copy=False)


def _write(out: np.ndarray, value: Any) -> None:
    out[...] = value


def _pad(x: np.ndarray, p: int) -> np.ndarray:
    return np.pad(x, ((0, 0), (p, p), (p, p), (0, 0))) if p else x


def _windows(xp: np.ndarray, kh: int, kw: int, s: int) -> np.ndarray:
    """The [n, oh, ow, kh, kw, c] view of every window of the (padded) image xp."""
    v = sliding_window_view(xp, (kh, kw), axis=(1, 2))  # [n, H-kh+1, W-kw+1, c, kh, kw]
    return v[:, ::s, ::s].transpose(0, 1, 2, 4, 5, 3)


def _scatter_windows(dwin: np.ndarray, shape: tuple[int, ...], s: int) -> np.ndarray:
    """col2im: the sum, at every image position, of the window entries dwin [n, oh, ow, kh, kw, c]
    that cover it; shape is the (padded) image's.  One strided add per window position, so
    overlapping windows (stride < window) accumulate."""
    n, oh, ow, kh, kw, c = dwin.shape
    out = np.zeros(shape, dwin.dtype)
    for i in range(kh):
        for j in range(kw):
            out[:, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s, :] += dwin[:, :, :, i, j, :]
    return out


# --------------------------------------------------------------------------------------------
# Gradient-recipe helpers (kernel_record.GradRecipe)


def _shape(g: GradArgs, name: str) -> tuple[int, ...]:
    return tuple(g.types[name][0])


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


# --------------------------------------------------------------------------------------------
# Registration: wraps each rule with the arity check and attribute defaults.


# --------------------------------------------------------------------------------------------
# The data-parallel place of the calling code, for the kernels that depend on it (the all-reduce,
# synchronized batch norm, dropout's per-rank mask): on the CPU, the simulated rank group of the
# calling thread (interp/distributed.py `SimRanksRunner`); on the GPU, the process's rank.


class RankGroup:
    """What a kernel's CPU twin needs of the ranks it runs among: `rank`, `size` and
    `allreduce_mean(key, arrays)`, which blocks until every rank brought the same key and
    replaces each array by the exact mean (interp/distributed.py's `SimGroup`)."""

    rank: int = 0
    size: int = 1

    def allreduce_mean(self, key: Any, arrays: list) -> None:  # pragma: no cover - interface
        raise NotImplementedError


_DP_LOCAL = threading.local()
_DP_PROCESS: dict[str, int] = {"rank": 0, "size": 1}


def set_group(group: "RankGroup | None") -> None:
    """Make `group` the rank group of the calling thread (None: the process's place)."""
    _DP_LOCAL.group = group


def current_group() -> "RankGroup | None":
    return getattr(_DP_LOCAL, "group", None)


def set_process_rank(rank: int, size: int) -> None:
    """This process's data-parallel rank among `size` (one GPU per process)."""
    _DP_PROCESS.update(rank=int(rank), size=int(size))


def dp_rank() -> tuple[int, int]:
    """(rank, ranks) of the calling code: its thread's simulated group, else the process's."""
    g = current_group()
    if g is not None:
        return g.rank, g.size
    return _DP_PROCESS["rank"], _DP_PROCESS["size"]


STDLIB: dict[str, Kernel] = {}
"""The stdlib's whole kernel table, filled by the package (`stdlib/kernels/__init__.py`) once its
families are joined: the one way a family reaches another's records (multi_tensor runs them)
without importing it."""


class Family:
    """The records one family module registers, in registration order (the order of its rows in
    docs/kernels.md).  module: the family module's `__name__` (where `Kernel.cuda` points);
    title: its heading in docs/kernels.md."""

    def __init__(self, module: str, title: str):
        self.module = module
        self.title = title
        self.kernels: dict[str, Kernel] = {}

    def register(self, name: str, inputs: str, outputs: str, infer: Callable, cpu: Callable | None,
                 attrs: dict[str, Any] | None = None, *, doc: str, row: DocRow, grad: GradRecipe | None = None,
                 host: bool = False, capturable: bool = True, inplace: bool = True) -> None:
        """Add the record of kernel `name` (inputs, outputs: parameter names, "a b"): the type rule
        infer(name, input names, in_types, attrs), the NumPy twin cpu(ins, outs, attrs) (None for
        host work), attrs: the attribute defaults (a None default is the rule's to read: "none"
        for sum's axis, "must be given" for conv2d_grad_x's in_h), doc (the formula in full), row
        (its line in docs/kernels.md), grad (the gradient recipe; None: an op on it needs a
        written backward).  Its CUDA twin is `<this module>:<name>_cuda`.  Wraps infer with the arity and
        unknown-attribute checks and fills in defaults for infer and cpu.  ValueError for a name
        registered twice."""
        if name in self.kernels:
            raise ValueError(f"kernel {name!r} is registered twice in {self.module}")
        ins = tuple(inputs.split())
        outs = tuple(outputs.split())
        defaults = dict(attrs or {})

        def merged(given: dict[str, Any] | None) -> dict[str, Any]:
            return {**defaults, **given} if given else defaults

        def checked_infer(in_types: Sequence[TensorType], given: dict[str, Any] | None = None):
            if len(in_types) != len(ins):
                want = f"{len(ins)} input{'s' if len(ins) != 1 else ''} ({', '.join(ins)})" if ins \
                    else "no inputs"
                raise KernelTypeError(f"{name}: takes {want}, got {len(in_types)}")
            unknown = sorted(set(given or ()) - set(defaults))
            if unknown:
                takes = f"takes {', '.join(defaults)}" if defaults else "takes no attributes"
                raise _attr_error(name, f"unknown attribute {unknown[0]!r}; {name} {takes}")
            types = [(tuple(int(d) for d in s), dt) for s, dt in in_types]
            return [(tuple(s), dt) for s, dt in infer(name, ins, types, merged(given))]

        run = None
        if cpu is not None:
            @functools.wraps(cpu)
            def run(ins_: Sequence[Any], outs_: Sequence[Any], given: dict[str, Any] | None = None):
                cpu(ins_, outs_, merged(given))

        self.kernels[name] = Kernel(name=name, inputs=ins, outputs=outs, infer=checked_infer, cpu=run,
                                    attrs=defaults, cuda=f"{self.module}:{name}_cuda",
                                    host=host, capturable=capturable, doc=doc.strip(), inplace=inplace,
                                    grad=grad, row=row)
