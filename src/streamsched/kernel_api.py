"""Kernels written in Python, for what a `kernel` expression cannot say (a scan, a softmax, a
hand-tuned CUDA kernel): a module the user names explicitly (`streamsched run F --kernels
package.module`, or the name of an entry point of the group `streamsched.kernels`) lists records
of the same kind as the stdlib's in `KERNELS`; they join that one program's kernel table.
docs/kernels.md, "Adding a kernel in Python", has a complete example.

    from streamsched.kernel_api import kernel, KCall

    def _infer(in_types, attrs):            # [(shape, dtype)] -> [(shape, dtype)]
        ...
    KERNELS = [kernel("row_softmax", "x", "y", _infer, _cpu, cuda=_cuda, grad=_grad, doc="...")]
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import traceback
import types
from typing import Any, Callable, Iterable, Sequence

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.stdlib.kernel_record import (GradArgs, KArg, KCall, Kernel, KernelTypeError, NotDifferentiable,
                                              TensorType)

__all__ = ["kernel", "Kernel", "KernelTypeError", "KCall", "KArg", "GradArgs", "NotDifferentiable", "TensorType",
           "ENTRY_POINT_GROUP", "KernelModules", "load_kernel_modules"]

ENTRY_POINT_GROUP = "streamsched.kernels"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def kernel(name: str, inputs: str | Sequence[str], outputs: str | Sequence[str],
           infer: Callable[[Sequence[TensorType], dict[str, Any]], Sequence[TensorType]],
           cpu: Callable[[Sequence[Any], Sequence[Any], dict[str, Any]], None], *,
           attrs: dict[str, Any] | None = None, cuda: str | Callable | None = None,
           grad: Callable[[GradArgs], Sequence[KArg | None]] | None = None, doc: str = "",
           inplace: bool = False, capturable: bool = True) -> Kernel:
    """A kernel record with the stdlib's conventions (docs/kernels.md, "Calling convention").

    name: how op bodies call it (a name, not a stdlib kernel's); inputs/outputs: parameter
    names ("dy x" or a list); infer(in_types, attrs) -> out_types, raising KernelTypeError
    (S003 shapes, S004 dtypes) -- arity and unknown attributes are checked before it is called,
    and attrs has the defaults filled in; cpu(ins, outs, attrs) writes NumPy `outs` in place;
    cuda: "module:function" or the function `fn(ctx, stream, ins, outs, attrs)` (import CuPy
    inside it), None when the kernel has no CUDA twin (the CUDA backend then refuses to bind it);
    grad: the gradient recipe (kernel_record.GradRecipe), None when ops on it need a written
    backward; inplace: True only if each output element depends on the same element of the
    inputs alone (then an output may share an input's storage).  Raises ValueError for a bad
    name or parameter list."""
    ins = tuple(inputs.split()) if isinstance(inputs, str) else tuple(inputs)
    outs = tuple(outputs.split()) if isinstance(outputs, str) else tuple(outputs)
    for n in (name,) + ins + outs:
        if not isinstance(n, str) or not _NAME.match(n):
            raise ValueError(f"kernel {name!r}: {n!r} is not a name (letters, digits, _)")
    if not outs:
        raise ValueError(f"kernel {name!r} has no output")
    defaults = dict(attrs or {})

    def merged(given):
        return {**defaults, **given} if given else dict(defaults)

    def checked_infer(in_types, given=None):
        if len(in_types) != len(ins):
            raise KernelTypeError(f"{name}: takes {len(ins)} input{'s' if len(ins) != 1 else ''} "
                                  f"({', '.join(ins)}), got {len(in_types)}")
        unknown = sorted(set(given or ()) - set(defaults))
        if unknown:
            takes = f"takes {', '.join(defaults)}" if defaults else "takes no attributes"
            raise KernelTypeError(f"{name}: unknown attribute {unknown[0]!r}; {name} {takes}")
        types = [(tuple(int(d) for d in s), dt) for s, dt in in_types]
        out = [(tuple(int(d) for d in s), dt) for s, dt in infer(types, merged(given))]
        if len(out) != len(outs):
            raise KernelTypeError(f"{name}: its type rule gave {len(out)} output types for {len(outs)} outputs")
        return out

    @functools.wraps(cpu)
    def run(ins_, outs_, given=None):
        cpu(ins_, outs_, merged(given))

    def no_cuda(ctx, stream, ins_, outs_, given=None):
        raise NotImplementedError(f"kernel {name} has no CUDA twin")

    return Kernel(name=name, inputs=ins, outputs=outs, infer=checked_infer, cpu=run, attrs=defaults,
                  cuda=cuda if cuda is not None else no_cuda, capturable=capturable, doc=doc.strip(),
                  inplace=inplace, grad=grad)


class KernelModules(dict):
    """Kernel name -> record of the loaded `--kernels` modules; `origins`: name -> the module
    that registered it (for diagnostics)."""

    def __init__(self):
        super().__init__()
        self.origins: dict[str, str] = {}


def _x015(msg: str, help: str) -> StreamschedError:
    return StreamschedError([Diagnostic("X015", msg, None, help=help)])


def _where(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in tb if "importlib" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" ({os.path.basename(f.filename)}:{f.lineno})"


def _entry_point(name: str):
    try:
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == name:
                return ep
    except Exception:  # a broken installation's metadata must not stop a run that names a module
        return None
    return None


def _records(name: str, obj) -> Iterable:
    """The records an imported module (its `KERNELS`) or an entry point's object (a module, a list,
    or a function returning one) gives."""
    if isinstance(obj, types.ModuleType):
        if not hasattr(obj, "KERNELS"):
            raise _x015(f"kernel module `{name}` defines no `KERNELS`",
                        "list its records at module level: `KERNELS = [kernel(\"my_kernel\", ...)]` "
                        "(streamsched.kernel_api.kernel)")
        obj = obj.KERNELS
    elif callable(obj) and not isinstance(obj, Kernel):
        try:
            obj = obj()
        except Exception as exc:
            raise _x015(f"kernel entry point `{name}` failed: {type(exc).__name__}: {exc}{_where(exc)}",
                        "fix the function the entry point names") from None
    try:
        return list(obj.values()) if isinstance(obj, dict) else list(obj)
    except TypeError:
        raise _x015(f"`KERNELS` of kernel module `{name}` is not a list of kernel records",
                    "`KERNELS = [kernel(...), ...]`") from None


def load_kernel_modules(names: Sequence[str]) -> KernelModules:
    """Import each `--kernels NAME` (an entry point of the group `streamsched.kernels`, else a
    module name) and collect its records.  Raises StreamschedError with one X015 diagnostic
    (never a traceback) when a module cannot be imported, fails while importing, has no
    `KERNELS`, lists something that is not a Kernel, or registers a name the stdlib or another
    module already has."""
    from streamsched.stdlib.kernels import KERNELS as STDLIB

    out = KernelModules()
    for name in names:
        ep = _entry_point(name)
        try:
            obj = ep.load() if ep is not None else importlib.import_module(name)
        except ModuleNotFoundError as exc:
            pathlike = name.endswith(".py") or "/" in name or os.sep in name
            if exc.name is not None and not name.startswith(exc.name) and not pathlike:
                raise _x015(f"importing kernel module `{name}` failed: it imports `{exc.name}`, which is not "
                            f"installed{_where(exc)}", f"install `{exc.name}`") from None
            raise _x015(f"cannot import kernel module `{name}`: no module of that name",
                        ("`--kernels` takes a module name, not a file: put the file's folder on PYTHONPATH and "
                         f"write `--kernels {os.path.splitext(os.path.basename(name))[0]}`") if pathlike else
                        "the module must be importable: install its package, or put its folder on PYTHONPATH; "
                        f"entry points of `{ENTRY_POINT_GROUP}` are found by name too") from None
        except (Exception, SystemExit) as exc:  # the module's own bug: reported, not raised
            raise _x015(f"importing kernel module `{name}` failed: {type(exc).__name__}: {exc}{_where(exc)}",
                        "fix the module; streamsched imports it before reading the .sched file") from None
        for rec in _records(name, obj):
            if not isinstance(rec, Kernel):
                raise _x015(f"kernel module `{name}` lists {type(rec).__name__} {rec!r:.60}, not a kernel record",
                            "build each record with streamsched.kernel_api.kernel(...)")
            if not _NAME.match(rec.name):
                raise _x015(f"kernel module `{name}` registers `{rec.name}`, which op bodies cannot call",
                            "name it with letters, digits and _")
            if rec.name in STDLIB:
                raise _x015(f"kernel module `{name}` registers `{rec.name}`, which is a stdlib kernel",
                            f"give it another name (`my_{rec.name}`)")
            if rec.name in out:
                raise _x015(f"kernel module `{name}` registers `{rec.name}`, which `{out.origins[rec.name]}` "
                            "registers too", "give one of the two another name")
            out[rec.name] = rec
            out.origins[rec.name] = name
    return out
