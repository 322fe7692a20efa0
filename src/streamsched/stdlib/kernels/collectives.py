"""Collectives across data-parallel ranks: `allreduce_mean`, one bucket of buffers replaced in
place by their mean over every rank (gradients after the backward, batch-norm running
statistics), on the CPU through the simulated rank group of the calling thread, on the GPU
through the process's NCCL communicator, issued on the task's stream.

A bucket's task reads and writes every buffer it holds, so the checker orders it against the
backward that writes them and the optimizer that reads them like any other task.  Its arity is
the bucket's: the front end builds the task itself (dsl/collectives.py), never through a type rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from streamsched.stdlib.kernels._base import (DocRow, Family, RankGroup, current_group, set_group,  # noqa: F401
                                              set_process_rank)

FAMILY = Family(__name__, "Collectives across data-parallel ranks")
_register = FAMILY.register

COLLECTIVE_KERNELS = frozenset({"allreduce_mean"})
"""The all-reduce of a bucket (the checker's R006, R007, S031 look at these)."""

SYNC_KERNELS = frozenset({"batchnorm_train", "batchnorm_grad"})
"""Kernels that are collectives when their `sync` attribute is true (synchronized batch norm)."""


def is_collective(kernel: str, attrs) -> bool:
    """Whether a task of `kernel` with `attrs` ((name, value) pairs) communicates across ranks:
    every rank must issue it in the same order as every other collective (R008)."""
    return kernel in COLLECTIVE_KERNELS or (kernel in SYNC_KERNELS and bool(dict(attrs).get("sync", False)))


_COMM: dict[str, Any] = {}


def set_communicator(comm: Any, size: int, rank: int = 0) -> None:
    """Make `comm` (a `cupy.cuda.nccl.NcclCommunicator` over `size` ranks, this process `rank`)
    the process's: what the CUDA twins issue on (interp/distributed.py `nccl_communicator`
    calls this; None forgets it)."""
    _COMM.clear()
    if comm is not None:
        _COMM.update(comm=comm, size=size)
    set_process_rank(rank if comm is not None else 0, size if comm is not None else 1)


def _allreduce_infer(k, names, t, at):
    return [t[0]]


def _allreduce_cpu(ins, outs, at):
    group = current_group()
    if group is None or group.size == 1:
        for a, o in zip(ins, outs):  # one rank: the mean is the value itself
            if o is not a:
                o[...] = a
        return
    for a, o in zip(ins, outs):
        if o is not a:
            o[...] = a
    group.allreduce_mean(at.get("bucket", ""), list(outs))


_register("allreduce_mean", "x", "x", _allreduce_infer, _allreduce_cpu, {"bucket": ""}, doc="""
x_i = (1 / R) * sum over ranks r of x_i on rank r, for every buffer x_i of the bucket, in place
(R ranks).  Variable arity: one input and one output per buffer of the bucket, the same buffers.
On the CPU the ranks are simulated in one process (exact mean, rank order fixed); on the GPU one
NCCL group of ncclAllReduce(ncclAvg) calls on the task's stream.
""", row=DocRow("x -> x", "update", "x = mean of x over the data-parallel ranks, in place, for every buffer of a bucket "
                "(`allreduce(grad(m))`)"))


# --------------------------------------------------------------------------------------------
# CUDA twin, `allreduce_mean_cuda(ctx, stream, ins, outs, attrs)`.  CuPy is imported inside.
# The communicator is the process's (`set_communicator`, from interp/distributed.py): one GPU per
# process (CUDA_PITFALLS.md #24).  NCCL >= 2.9 records its kernel into a capturing stream, so
# the all-reduce becomes a kernel node of the step's graph; the group makes one NCCL launch of
# the whole bucket.  ncclAvg (NCCL >= 2.10) is the mean itself: floats are multiplied by 1/R
# before the sum, and even one rank gets a kernel (NCCL's one-rank path runs its reduce kernel
# for a pre-multiplied sum, where an in-place ncclSum would be no work at all).  Nothing here
# allocates.

NCCL_AVG = 4
"""ncclRedOp_t's ncclAvg (nccl.h), for a CuPy whose nccl module does not name it."""

_NCCL_DTYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
                "int32": "NCCL_INT32", "int64": "NCCL_INT64"}


def allreduce_mean_cuda(ctx, stream, ins, outs, attrs):
    from cupy.cuda import nccl

    comm = _COMM.get("comm")
    if comm is None:
        raise RuntimeError("allreduce_mean: this process has no NCCL communicator (the CUDA executor makes one "
                           "before warm-up: interp/distributed.py `nccl_communicator`)")
    ptr = ctx.stream_ptr(stream) if ctx is not None else 0
    for a, o in zip(ins, outs):
        if o.data.ptr != a.data.ptr:
            raise ValueError("allreduce_mean works in place: each output is its input")
    avg = getattr(nccl, "NCCL_AVG", NCCL_AVG)
    nccl.groupStart()
    try:
        for o in outs:
            comm.allReduce(o.data.ptr, o.data.ptr, o.size, getattr(nccl, _NCCL_DTYPES[str(o.dtype)]), avg, ptr)
    finally:
        nccl.groupEnd()
