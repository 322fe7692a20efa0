"""The record every kernel is (stdlib, `.sched` `kernel` forms, `--kernels` modules): signature,
type rule, CPU kernel, its CUDA kernel, its gradient recipe and (for the stdlib's) its row of
docs/kernels.md, in one place (STYLE.md, habit 5).  `import cupy` never happens here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, Union

TensorType = tuple[tuple[int, ...], str]
"""(shape, dtype) of one buffer; dtype is a key of `streamsched.interp.ir.DTYPE_BYTES`."""


class KernelTypeError(Exception):
    """A kernel's type rule rejected its arguments.  `arg` is the index of the offending input
    (None when the attributes or the arity are at fault); `code` is "S003" (shape) or "S004"
    (dtype)."""

    def __init__(self, message: str, arg: int | None = None, code: str = "S003"):
        super().__init__(message)
        self.message = message
        self.arg = arg
        self.code = code


@dataclass(frozen=True)
class KCall:
    """One launch in a gradient recipe: `kernel(args..., **attrs)`.  args are value names (the
    forward's inputs and outputs, their gradients) or nested KCalls, which become tasks of their
    own, as nested calls in an op body do."""

    kernel: str
    args: tuple["KArg", ...]
    attrs: tuple[tuple[str, Any], ...] = ()


KArg = Union[str, KCall]


@dataclass(frozen=True)
class GradArgs:
    """What a gradient recipe is told about one forward launch `outs = kernel(args, attrs)`.

    args/outs: value names; douts: the gradient flowing into each output (None where none flows);
    need: which inputs' gradients are wanted; attrs: with defaults filled in; types: (shape, dtype)
    of every name in args, outs and douts; define(record): adds a helper kernel (a generated
    gradient kernel) to the program's kernel table; kernels: that table."""

    kernel: str
    args: tuple[str, ...]
    outs: tuple[str, ...]
    douts: tuple[str | None, ...]
    need: tuple[bool, ...]
    attrs: Mapping[str, Any]
    types: Mapping[str, "TensorType"]
    define: Callable[["Kernel"], None] = lambda k: None
    kernels: Mapping[str, "Kernel"] = field(default_factory=dict)


class NotDifferentiable(Exception):
    """A gradient recipe cannot give a gradient that is needed (a kernel body's `floor`, a max
    reduction, a broadcast pattern its sums do not undo).  `construct` names what is at fault (a
    function name of the kernel body, or "" for the kernel as a whole)."""

    def __init__(self, message: str, construct: str = ""):
        super().__init__(message)
        self.message = message
        self.construct = construct


GradRecipe = Callable[[GradArgs], Sequence[Union[KArg, None]]]
"""recipe(g) -> one entry per forward input: the expression of its gradient (exactly the input's
shape and dtype), or None where no gradient is wanted or the input has none (integer labels).
Raises NotDifferentiable when a wanted gradient cannot be given."""


@dataclass(frozen=True)
class DocRow:
    """A kernel's row of the table in docs/kernels.md, as data (the attrs column is rendered from
    the record's own defaults, the kernel column from its name).

    signature: the parameters as the table shows them, inputs then outputs, each the record's own
    name in order followed by an optional shape or dtype note: "a [m,k], b [k,n] -> c [m,n]"
    ("()" for none); stream: the placement the seed's five-stream runtime uses ("comp1",
    "update", "host", ...); formula: what it computes, in markdown; required: the attributes whose
    default None means "must be given" rather than "none" (shown as `in_h, in_w (required)`)."""

    signature: str
    stream: str
    formula: str
    required: tuple[str, ...] = ()


@dataclass(frozen=True)
class Kernel:
    """One primitive launch.

    inputs/outputs: argument names; attrs: compile-time attributes with defaults;
    infer(in_types, attrs) -> out_types raises KernelTypeError; cpu(ins, outs, attrs) writes
    results into the preallocated NumPy arrays `outs` (an out may be the very array of an input:
    in-place updates must stay correct); cuda: "module:function" of the CUDA twin, imported only
    by the CUDA backend, or the function itself (generated kernels: it imports CuPy when called);
    grad: the gradient recipe (GradRecipe; None: an op built on this kernel needs a hand-written
    `NAME.backward`); row: its row of docs/kernels.md (DocRow; the stdlib's kernels have one);
    host: runs on the host stream (staging writes), filled by the training loop; capturable:
    False for work a CUDA graph cannot hold (synchronize, allocation);
    inplace: an output may be the very storage of an input of its own shape and dtype (each
    element is read before it is written, on every backend); False for kernels that read other
    elements than the one they write (GEMMs, reductions, convolutions, pooling, softmax, batch
    statistics), whose outputs may overlap no input at all (the checker's R005 enforces both).
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    infer: Callable[[Sequence[TensorType], dict[str, Any]], list[TensorType]]
    cpu: Callable[[Sequence[Any], Sequence[Any], dict[str, Any]], None] | None
    attrs: dict[str, Any] = field(default_factory=dict)
    cuda: str | Callable = ""
    host: bool = False
    capturable: bool = True
    doc: str = ""
    inplace: bool = True
    grad: GradRecipe | None = field(default=None, compare=False)
    row: DocRow | None = field(default=None, compare=False)
