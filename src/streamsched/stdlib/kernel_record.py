"""The record every stdlib kernel is: signature, type rule, CPU kernel and the name of its CUDA
kernel, in one place (STYLE.md, habit 5).  `import cupy` never happens here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

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
class Kernel:
    """One primitive launch.

    inputs/outputs: argument names; attrs: compile-time attributes with defaults;
    infer(in_types, attrs) -> out_types raises KernelTypeError; cpu(ins, outs, attrs) writes
    results into the preallocated NumPy arrays `outs` (an out may be the very array of an input:
    in-place updates must stay correct); cuda: "module:function" of the CUDA twin, imported only
    by the CUDA backend; host: runs on the host stream (staging writes), filled by the training
    loop; capturable: False for work a CUDA graph cannot hold (synchronize, allocation);
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
    cuda: str = ""
    host: bool = False
    capturable: bool = True
    doc: str = ""
    inplace: bool = True
