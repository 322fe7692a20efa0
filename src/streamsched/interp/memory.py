"""Memory planning: every buffer gets a fixed, aligned byte range in its space's arena before
anything runs, and one arena per space backs typed views of all its buffers.

Fixed addresses are what CUDA graphs need (ARCHITECTURE.md, "plan_memory"), and byte ranges,
not names, are what the race checks compare: a buffer made by `into` (``alias_of``) starts at
its target's offset, so the two views really share storage.  The array module is a parameter
(``xp=numpy`` here, ``xp=cupy`` in the CUDA backend); nothing in this file imports CuPy.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy

from streamsched.interp.ir import DTYPE_BYTES, Buffer, evolve

__all__ = ["ARRAY_DTYPES", "ArenaOutOfMemory", "arena_sizes", "plan_memory", "allocate_arena", "allocate_arrays"]

ARRAY_DTYPES: Mapping[str, numpy.dtype] = {
    "f32": numpy.dtype(numpy.float32),
    "f64": numpy.dtype(numpy.float64),
    "f16": numpy.dtype(numpy.float16),
    "i32": numpy.dtype(numpy.int32),
    "i64": numpy.dtype(numpy.int64),
    "u8": numpy.dtype(numpy.uint8),
    "bool": numpy.dtype(numpy.bool_),
}
"""streamsched dtype -> array dtype (CuPy accepts NumPy dtypes).  ``bf16`` has a byte size in
``DTYPE_BYTES`` but no NumPy dtype, so it can be planned but not allocated."""


class ArenaOutOfMemory(Exception):
    """An arena could not be allocated: ``space`` ("device", "host"), ``nbytes`` requested,
    ``largest`` the largest buffer placed in it (for the diagnostic's span), ``cause`` the array
    module's own exception.  The training loop turns it into an X013 diagnostic."""

    def __init__(self, space: str, nbytes: int, cause: BaseException, largest: Buffer | None = None):
        super().__init__(f"cannot allocate {nbytes} bytes for the {space} arena: {cause}")
        self.space = space
        self.nbytes = nbytes
        self.cause = cause
        self.largest = largest


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an allocation failure of NumPy or CuPy: MemoryError (NumPy's, and CuPy's
    ``OutOfMemoryError``, a subclass), a size the array module cannot even represent
    (ValueError "Maximum allowed dimension exceeded", OverflowError), or a CUDA runtime error
    cudaErrorMemoryAllocation (pinned host memory).  Tells by name: nothing here imports CuPy."""
    if isinstance(exc, (MemoryError, OverflowError)):
        return True
    text = str(exc)
    if isinstance(exc, ValueError):
        return "dimension" in text or "too big" in text or "maximum" in text.lower()
    return type(exc).__name__ in ("OutOfMemoryError", "CUDARuntimeError", "CUDADriverError") and (
        "MemoryAllocation" in text or "OUT_OF_MEMORY" in text or "out of memory" in text.lower())


def allocate_arena(alloc: Any, space: str, nbytes: int, buffers: Sequence[Buffer] = ()) -> Any:
    """``alloc(nbytes)`` (a zeroed uint8 arena), with an allocation failure raised as
    ArenaOutOfMemory naming the space, the bytes and the largest of ``buffers`` in that space."""
    try:
        return alloc(nbytes)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        inside = [b for b in buffers if b.space == space]
        largest = max(inside, key=lambda b: b.nbytes) if inside else None
        raise ArenaOutOfMemory(space, nbytes, exc, largest) from exc


def _align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _nbytes(b: Buffer) -> int:
    try:
        return b.size * DTYPE_BYTES[b.dtype]
    except KeyError:
        raise ValueError(f"buffer `{b.name}`: unknown dtype {b.dtype!r}") from None


def plan_memory(buffers: Sequence[Buffer], align: int = 256) -> tuple[Buffer, ...]:
    """Give every buffer a fixed byte range; returns new Buffers in the input order.

    Each space ("device", "host", ...) is its own arena, filled by bump allocation in input
    order: ``offset`` is the arena cursor rounded up to ``align`` bytes, ``nbytes = size *
    DTYPE_BYTES[dtype]``.  A buffer with ``alias_of`` is placed second: it takes exactly its
    target's offset (chains of aliases resolve to the root) and keeps its own ``nbytes``.
    Deterministic: the same input always gives the same ranges; earlier offsets are ignored.

    Raises ValueError for a non-positive ``align``, a duplicate name, an unknown dtype, an alias
    whose target is missing, in another space, part of an alias cycle, or smaller than the alias
    (the message names both buffers).
    """
    if not isinstance(align, int) or align <= 0:
        raise ValueError(f"align must be a positive int, got {align!r}")
    by_name: dict[str, Buffer] = {}
    for b in buffers:
        if b.name in by_name:
            raise ValueError(f"buffer `{b.name}` is declared twice")
        by_name[b.name] = b

    placed: dict[str, Buffer] = {}
    cursor: dict[str, int] = {}
    for b in buffers:
        if b.alias_of is not None:
            continue
        off = _align_up(cursor.get(b.space, 0), align)
        n = _nbytes(b)
        cursor[b.space] = off + n
        placed[b.name] = evolve(b, offset=off, nbytes=n)

    def place_alias(b: Buffer, chain: tuple[str, ...]) -> Buffer:
        if b.name in placed:
            return placed[b.name]
        if b.name in chain:
            raise ValueError(f"alias cycle: {' -> '.join(chain + (b.name,))}")
        target_name = b.alias_of
        assert target_name is not None
        target = by_name.get(target_name)
        if target is None:
            raise ValueError(f"buffer `{b.name}` aliases `{target_name}`, which is not declared")
        target = place_alias(target, chain + (b.name,))
        if target.space != b.space:
            raise ValueError(
                f"buffer `{b.name}` ({b.space}) aliases `{target.name}` ({target.space}): "
                "an alias must live in its target's space"
            )
        n = _nbytes(b)
        if n > target.nbytes:
            raise ValueError(
                f"buffer `{b.name}` ({n} bytes) is larger than `{target.name}` "
                f"({target.nbytes} bytes), which it aliases"
            )
        out = evolve(b, offset=target.offset, nbytes=n)
        placed[b.name] = out
        return out

    try:
        for b in buffers:
            if b.alias_of is not None:
                place_alias(b, ())
    finally:
        place_alias = None  # it calls itself through its closure: a cycle the collector would have to free
    return tuple(placed[b.name] for b in buffers)


def arena_sizes(buffers: Sequence[Buffer]) -> dict[str, int]:
    """Space -> arena size in bytes (the largest end offset of its planned buffers).

    Raises ValueError for a buffer that plan_memory has not placed (offset < 0)."""
    sizes: dict[str, int] = {}
    for b in buffers:
        if b.offset < 0:
            raise ValueError(f"buffer `{b.name}` has no planned offset; run plan_memory first")
        sizes[b.space] = max(sizes.get(b.space, 0), b.offset + b.nbytes)
    return sizes


def allocate_arrays(buffers: Sequence[Buffer], xp: Any = numpy) -> dict[str, Any]:
    """Allocate one zeroed uint8 arena per space and return name -> typed view of it.

    Each view is ``arena[offset:offset + nbytes].view(dtype).reshape(shape)``, so buffers whose
    ranges overlap (aliases made by `into`) share storage, and addresses never change after this
    call.  ``xp`` is the array module: ``numpy`` (default) or ``cupy`` (CUDA backend).

    Raises ValueError for an unplanned buffer, a dtype with no array dtype (``bf16``), or an
    ``nbytes`` that does not match ``size * DTYPE_BYTES[dtype]``; ArenaOutOfMemory when an
    arena cannot be allocated.
    """
    arenas = {space: allocate_arena(lambda k: xp.zeros(k, dtype=xp.uint8), space, n, buffers)
              for space, n in arena_sizes(buffers).items()}
    arrays: dict[str, Any] = {}
    for b in buffers:
        dt = ARRAY_DTYPES.get(b.dtype)
        if dt is None:
            raise ValueError(f"buffer `{b.name}`: dtype {b.dtype!r} has no array dtype")
        if b.nbytes != b.size * dt.itemsize:
            raise ValueError(
                f"buffer `{b.name}`: nbytes {b.nbytes} != {b.size} x {dt.itemsize}; "
                "run plan_memory first"
            )
        raw = arenas[b.space][b.offset : b.offset + b.nbytes]
        arrays[b.name] = raw.view(dt).reshape(b.shape)
    return arrays
