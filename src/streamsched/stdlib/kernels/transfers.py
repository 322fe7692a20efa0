"""Memory, copies and host work: fill, copy, flatten/unflatten, host<->device copies, allocation,
synchronize, and the host writes the training loop fills in (stage, set_scalar)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from streamsched.stdlib.kernel_record import KCall, KernelTypeError
from streamsched.stdlib.kernels._base import (DocRow, Family, GradArgs, _attr_error, _number, _passthrough,
                                              _type_attrs, _write)
from streamsched.stdlib.kernels._cuda import _kernels, _stream

FAMILY = Family(__name__, "Memory, copies and host work")
_register = FAMILY.register


# --------------------------------------------------------------------------------------------
# Fill, copies, allocation


def _fill_infer(k, names, t, at):
    _number(k, at, "value")
    return [_type_attrs(k, at)]


def _fill_cpu(ins, outs, at):
    _write(outs[0], at["value"])


_register("fill", "", "out", _fill_infer, _fill_cpu, {"value": 0.0, "shape": (), "dtype": "f32"},
          doc="""
out = value everywhere; no inputs, so the output's shape and dtype come from the attributes
(the caller passes the target buffer's type).  Zeroes gradient buffers (`clear grad(m)`).
""",
          row=DocRow("() -> out", "update", "out = value (zero-grad; the caller passes the target's shape and dtype)"))


def _same_infer(k, names, t, at):
    return [t[0]]


def _copy_cpu(ins, outs, at):
    _write(outs[0], ins[0])


_register("copy", "a", "b", _same_infer, _copy_cpu, doc="""
b = a, device to device; any shape and dtype, b has a's type.
""", grad=_passthrough,
          row=DocRow("a -> b", "any", "b = a, device to device; any dtype"))


def _flatten_infer(name, ins, types, at):
    (shape, dt), = types[:1]
    if len(shape) < 2:
        raise KernelTypeError(f"{name}: x must have a batch dimension and at least one more, got {list(shape)}", 0)
    if name == "flatten":
        n = 1
        for d in shape[1:]:
            n *= d
        return [((shape[0], n), dt)]
    dy, x = types
    if dy[0] != (x[0][0], int(np.prod(x[0][1:]))):
        raise KernelTypeError(f"{name}: dy is {list(dy[0])}, but x {list(x[0])} flattens to "
                              f"[{x[0][0]}, {int(np.prod(x[0][1:]))}]", 0)
    return [(x[0], dy[1])]


def _reshape_cpu(ins, outs, at):
    outs[0][...] = np.asarray(ins[0]).reshape(outs[0].shape)


def _flatten_recipe(g: GradArgs):
    return [KCall("unflatten", (g.douts[0], g.args[0]))]


_register("flatten", "x", "y", _flatten_infer, _reshape_cpu, doc="""
y[n, h*w*c] = x[n, h, w, c] reshaped row-major (a copy; NHWC order is kept).
""", grad=_flatten_recipe,
          row=DocRow("x -> y", "comp3", "y[n, h*w*c] = x[n, h, w, c], row-major (NHWC order kept)"))

_register("unflatten", "dy x", "dx", lambda name, ins, types, at: _flatten_infer(name, ins, types, at),
          lambda ins, outs, at: _reshape_cpu(ins[:1], outs, at), doc="""
dx = dy reshaped to x's shape (x is read for its shape only): the gradient of `flatten`.
""",
          row=DocRow("dy, x -> dx", "comp3", "dx = dy reshaped to x's shape (the gradient of flatten)"))

_register("h2d", "a", "b", _same_infer, _copy_cpu, doc="""
b = a, host (pinned staging) to device; on the CUDA backend a zero-copy kernel that reads the
page-locked buffer over the bus (up to 1 MiB) or a cudaMemcpyAsync on the copy stream, either of
which reads the host buffer when it runs, not at launch.  Any shape and dtype.
""",
          row=DocRow("a -> b", "trans", "b = a, pinned host staging to device"))

_register("d2h", "a", "b", _same_infer, _copy_cpu, doc="""
b = a, device to host (pinned); any shape and dtype.  The host reads b only after waiting on
the copy's event.
""",
          row=DocRow("a -> b", "trans", "b = a, device to pinned host"))


def _alloc_infer(k, names, t, at):
    return [_type_attrs(k, at)]


def _alloc_cpu(ins, outs, at):
    _write(outs[0], 0)


def _synchronize_cpu(ins, outs, at):
    pass


_register("alloc", "", "out", _alloc_infer, _alloc_cpu, {"shape": (), "dtype": "f32"},
          capturable=False, doc="""
Allocates out (shape and dtype from the attributes); zero-filled on the CPU.  Not capturable:
memory is planned before capture, so an allocation inside a graph is rejected (C family).
""",
          row=DocRow("() -> out", "outside graphs", "allocation (zero-filled on the CPU); **not capturable**"))


def _synchronize_infer(k, names, t, at):
    return []


_register("synchronize", "", "", _synchronize_infer, _synchronize_cpu,
          capturable=False, doc="""
Waits for the whole device (cudaDeviceSynchronize); no inputs, no outputs; a no-op on the CPU.
Not capturable: a synchronize inside a graph is rejected (C family).
""",
          row=DocRow("() -> ()", "outside graphs",
                     "whole-device synchronize (a no-op on the CPU); **not capturable**"))


# --------------------------------------------------------------------------------------------
# Host work: filled by the training loop, present so the plan sees the host's writes


def _stage_infer(k, names, t, at):
    if not isinstance(at["field"], str):
        raise _attr_error(k, f"attribute field must be a name, got {at['field']!r}")
    return [_type_attrs(k, at)]


_register("stage", "", "out", _stage_infer, None, {"field": "x", "shape": (), "dtype": "f32"},
          host=True, doc="""
A host write of the next batch's `field` (a model input such as x or y) into a pinned staging
buffer of shape/dtype from the attributes.  There is no CPU kernel: the training loop fills the
buffer itself, after waiting on the event of the copy that last read that slot; the task exists
so the dependency analysis and race checker see the host's write.
""",
          row=DocRow("() -> out", "host",
                     "**host**: the training loop writes the next batch's `field` into pinned staging"))


def _set_scalar_infer(k, names, t, at):
    if not isinstance(at["name"], str):
        raise _attr_error(k, f"attribute name must be a name, got {at['name']!r}")
    return [_type_attrs(k, {"shape": (), "dtype": at["dtype"]})]


_register("set_scalar", "", "out", _set_scalar_infer, None, {"name": "lr", "dtype": "f32"},
          host=True, doc="""
A host write of the scalar `name` (the learning rate from the schedule, ...) into a pinned
buffer of shape []; `upload` then copies it to the device.  No CPU kernel: the training loop
writes it.
""",
          row=DocRow("() -> out []", "host",
                     "**host**: the training loop writes the scalar `name` into a pinned buffer"))


# ============================================================================================
# CUDA twins, `<kernel>_cuda(ctx, stream, ins, outs, attrs)`: what each record's `cuda` names.
# CuPy is imported inside them only; the calling convention and capture rules are in _cuda.py.


def fill_cuda(ctx, stream, ins, outs, attrs):
    with _stream(ctx, stream):
        _kernels()["fill"](float(attrs.get("value", 0.0)), outs[0])


def copy_cuda(ctx, stream, ins, outs, attrs):
    if outs[0] is ins[0]:
        return
    with _stream(ctx, stream):
        _kernels()["copy"](ins[0], outs[0])


def _reshape_cuda(ctx, stream, ins, outs, attrs):
    with _stream(ctx, stream):
        _kernels()["copy"](ins[0].reshape(outs[0].shape), outs[0])


def h2d_cuda(ctx, stream, ins, outs, attrs):
    ctx.h2d(stream, outs[0], ins[0])


def d2h_cuda(ctx, stream, ins, outs, attrs):
    ctx.memcpy(stream, outs[0], ins[0])


def alloc_cuda(ctx, stream, ins, outs, attrs):
    # Memory is planned up front; on the device `alloc` only zero-fills its planned buffer.
    with _stream(ctx, stream):
        _kernels()["fill"](0.0, outs[0])


def synchronize_cuda(ctx, stream, ins, outs, attrs):
    ctx.device_synchronize()


def _host_only(name: str) -> Callable:
    def fn(ctx, stream, ins, outs, attrs):
        raise RuntimeError(f"{name} is host work: the training loop runs it (host_fn), "
                           f"never a device stream")
    fn.__name__ = name
    return fn


flatten_cuda = _reshape_cuda
unflatten_cuda = _reshape_cuda
stage_cuda = _host_only("stage")
set_scalar_cuda = _host_only("set_scalar")
