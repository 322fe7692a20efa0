"""The stdlib's kernels, one table `KERNELS` assembled from one module per family; each family
module holds, per kernel, its whole record (`kernel_record.Kernel`): signature and type rule, NumPy
twin, CUDA twin (`<family module>:<kernel>_cuda`, CuPy imported only inside it), gradient recipe
and its row of docs/kernels.md (`DocRow`).

    gemm             matmul
    elementwise      add sub mul scale bias_add accumulate; relu tanh gelu sigmoid and their *_grad
    reductions       sum mean
    conv             conv2d conv2d_grad_x conv2d_grad_w sum_nhw
    pooling          maxpool2d avgpool2d global_avgpool and their *_grad
    normalization    batchnorm_train batchnorm_grad batchnorm_stats_update batchnorm_infer
                     batchnorm_train_relu batchnorm_train_add_relu batchnorm_grad_relu
    dropout          dropout dropout_grad offset_advance (Philox-4x32-10: philox4x32_10, dropout_bits)
    loss             softmax_xent softmax_xent_grad
    optimizers       sgd_step adam_step increment lars_step ema_update amp_sgd_step amp_lars_step
    mixed_precision  cast scale_loss unscale_check update_scale nonfinite_check
    transfers        fill copy flatten unflatten h2d d2h alloc synchronize stage set_scalar
    transformer      embedding pos_embedding layernorm softmax attn_scores attn_apply and their
                     gradients; adamw_step grad_sumsq clip_scale scale_grad
    collectives      allreduce_mean (data-parallel ranks: CPU simulated, NCCL on the GPU)
    multi_tensor     multi_tensor (one launch for many per-parameter tasks: the fusion pass's)

`_base` (dtypes, type-rule and NumPy helpers, `Family`) and `_cuda` (what the CUDA twins share)
are imported by the family modules, never the other way round, and no family imports another;
`_doc` renders docs/kernels.md's table from the records (`python -m streamsched.stdlib.kernels
--doc`).  Adding a kernel is one `_register(...)` call, its twins and recipe beside it, in the
family module it belongs to (docs/kernels.md, "Adding a stdlib kernel").
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Callable, Sequence

from streamsched.stdlib.kernel_record import GradRecipe, Kernel, KernelTypeError, TensorType
from streamsched.stdlib.kernels import (collectives, conv, dropout, elementwise, gemm, loss, mixed_precision,
                                        multi_tensor, normalization, optimizers, pooling, reductions, transfers,
                                        transformer)
from streamsched.stdlib.kernels import _base
from streamsched.stdlib.kernels._base import FLOATS, INTS, NUMERIC, Family, numpy_dtype

__all__ = ["KERNELS", "FAMILIES", "NOT_IN_PLACE", "RECIPES", "CNN_KERNELS", "CUDA_KERNELS", "kernel", "infer_types",
           "cuda_twin", "numpy_dtype", "FLOATS", "INTS", "NUMERIC", "Kernel", "KernelTypeError", "TensorType", "Family"]

FAMILIES: tuple[Family, ...] = (gemm.FAMILY, elementwise.FAMILY, reductions.FAMILY, conv.FAMILY,
                                pooling.FAMILY, normalization.FAMILY, dropout.FAMILY, loss.FAMILY,
                                optimizers.FAMILY, mixed_precision.FAMILY, transfers.FAMILY, transformer.FAMILY,
                                collectives.FAMILY, multi_tensor.FAMILY)
"""Every family module's records, in the order of docs/kernels.md's table."""


def _table(families: Sequence[Family]) -> dict[str, Kernel]:
    table: dict[str, Kernel] = {}
    owner: dict[str, str] = {}
    for fam in families:
        for name, rec in fam.kernels.items():
            if name in table:
                raise ValueError(f"kernel {name!r} is registered by both {owner[name]} and {fam.module}")
            table[name], owner[name] = rec, fam.module
    return table


KERNELS: dict[str, Kernel] = _table(FAMILIES)
_base.STDLIB.update(KERNELS)
"""Kernel name -> record, family by family (the order of docs/kernels.md)."""

NOT_IN_PLACE: tuple[str, ...] = tuple(n for n, k in KERNELS.items() if not k.inplace)
"""Kernels that read other elements than the one they write (`Kernel.inplace` is False): none of
their outputs may share storage with an input (the CUDA twins of the convolutions and pools refuse
overlap outright, cuBLAS gives wrong results when C aliases A or B)."""

RECIPES: dict[str, GradRecipe] = {n: k.grad for n, k in KERNELS.items() if k.grad is not None}
"""Kernel name -> its gradient recipe (`Kernel.grad`), for the kernels that have one: an op built
on these kernels without `NAME.backward` gets its backward derived (streamsched.dsl.derive)."""

CNN_KERNELS: tuple[str, ...] = (
    "conv2d", "conv2d_grad_x", "conv2d_grad_w", "sum_nhw", "maxpool2d", "maxpool2d_grad", "avgpool2d",
    "avgpool2d_grad", "global_avgpool", "global_avgpool_grad", "batchnorm_train", "batchnorm_grad",
    "batchnorm_stats_update", "batchnorm_infer", "dropout", "dropout_grad", "offset_advance", "lars_step",
    "ema_update", "cast", "scale_loss", "unscale_check", "update_scale", "nonfinite_check", "amp_sgd_step",
    "amp_lars_step", "batchnorm_train_relu", "batchnorm_train_add_relu", "batchnorm_grad_relu")
"""The kernels the seed's CNN step added (convolution, pooling, batch norm, dropout, LARS, EMA,
mixed precision), in the order they were added: tests/test_kernels_cnn.py checks these,
tests/test_kernels.py the others."""


def kernel(name: str) -> Kernel:
    """The kernel called `name`; KeyError naming the closest known kernels otherwise."""
    try:
        return KERNELS[name]
    except KeyError:
        close = difflib.get_close_matches(name, KERNELS, n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else \
            f"; known kernels: {', '.join(KERNELS)}"
        raise KeyError(f"unknown kernel {name!r}{hint}") from None


def infer_types(name: str, in_types: Sequence[TensorType],
                attrs: dict[str, Any] | None = None) -> list[TensorType]:
    """Output types of kernel `name` on inputs `in_types`, attribute defaults filled in;
    raises KernelTypeError (S003 shapes/arity/attributes, S004 dtypes)."""
    return kernel(name).infer(in_types, attrs or {})


def cuda_twin(rec: Kernel) -> Callable:
    """The CUDA twin `fn(ctx, stream, ins, outs, attrs)` record `rec` names: `rec.cuda` itself when
    it is a function, else the attribute its "module:function" names, the module imported (as the
    CUDA executor binds it; CuPy is not imported: twins import it when called).  ImportError or
    AttributeError when the path does not resolve, ValueError when it is empty."""
    if callable(rec.cuda):
        return rec.cuda
    mod, sep, attr = rec.cuda.partition(":")
    if not (mod and sep and attr):
        raise ValueError(f"kernel {rec.name}: cuda {rec.cuda!r} is not \"module:function\"")
    return getattr(importlib.import_module(mod), attr)


_CUDA_KERNELS: dict[str, Callable] = {}


def __getattr__(name: str) -> Any:
    """`CUDA_KERNELS`: kernel name -> its CUDA twin (the host kernels' twins refuse to run: the
    training loop does their work), for code that calls twins directly, as the CUDA tests do.
    Resolved on first use, so that a twin path that does not resolve breaks only CUDA work
    (tests/test_kernel_families.py reports it), never the import of the CPU kernels."""
    if name == "CUDA_KERNELS":
        if not _CUDA_KERNELS:
            twins = {}
            for n, k in KERNELS.items():
                try:
                    twins[n] = cuda_twin(k)
                except (ImportError, AttributeError, ValueError) as exc:
                    raise ImportError(f"kernel {n}: its CUDA twin {k.cuda!r} does not resolve: {exc}") from exc
            _CUDA_KERNELS.update(twins)
        return _CUDA_KERNELS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
