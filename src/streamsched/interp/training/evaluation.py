"""The test split evaluated after an epoch: the model's eval forward (batch-norm running
statistics, no dropout) over the test set in batches of the model's, the mean loss and accuracy
reduced and read once.  `HostEvaluator` runs it in NumPy (`evaluate`); on the CUDA backend
`cuda.evaluate.DeviceEvaluator` runs it as one captured graph over the test set held on the
device.  Both are called the same way: `evaluator(runner) -> (loss, accuracy)`."""

from __future__ import annotations

import sys

import numpy as np

from streamsched.interp.training.data_path import _input_names


def evaluate(program, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean loss and accuracy of the model's forward pass on (x, y), NumPy on the host, in
    chunks of the model's batch (the last chunk padded, padding ignored).  A sequence model's
    logits have several rows per sample ([batch * t, classes] for labels y [N, t], row-major):
    the loss and accuracy are then the means over every token."""
    m = program.model
    bufs = {b.name: b for b in program.buffers}
    batch = m.batch
    arrs: dict[str, np.ndarray] = dict(params)
    feat, lab = _input_names(program)
    fwd = m.eval_forward or m.forward
    names = {n for t in fwd for n in t.args + t.outs}
    for n in names:
        concrete = n.replace("{slot}", program.slots[0]) if program.slots else n
        if concrete not in arrs:
            b = bufs[concrete]
            arrs[concrete] = np.zeros(b.shape, np.float32 if b.dtype.startswith("f") else np.int32)
        arrs[n] = arrs[concrete]
    xin = next(n for n in names if n.split("[")[0] == feat)
    yin = next((n for n in names if n.split("[")[0] == lab), None)
    correct = 0
    total_loss = 0.0
    count = 0
    n = len(x)
    for s in range(0, n, batch):
        xb = x[s:s + batch]
        yb = y[s:s + batch]
        k = len(xb)
        arrs[xin][...] = 0
        arrs[xin][:k] = xb
        if yin is not None:
            arrs[yin][...] = 0
            arrs[yin][:k] = yb
        for t in fwd:
            kern = program.kernels[t.kernel]
            kern.cpu([arrs[a] for a in t.args], [arrs[o] for o in t.outs], {**kern.attrs, **dict(t.attrs)})
        logits = arrs[m.logits]
        rows = k * (len(logits) // batch)  # the rows of the real samples (one per token)
        yr = np.asarray(yb).reshape(-1)
        correct += int((logits[:rows].argmax(axis=1) == yr).sum())
        # the batch loss averages over padding rows too: recompute on the real rows
        z = logits[:rows].astype(np.float64)
        z = z - z.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=1))
        total_loss += float((lse - z[np.arange(rows), yr]).sum())
        count += rows
    return total_loss / count, correct / count


class HostEvaluator:
    """Evaluation in NumPy on the host: the parameters and state read from the runner (one read
    each), then `evaluate` over (x, y), the test split [N, ...] and its labels [N] or [N, t]."""

    where = "host"

    def __init__(self, program, x: np.ndarray, y: np.ndarray, names: list[str]):
        self.program, self.x, self.y, self.names = program, x, y, names

    def __call__(self, runner, params: dict[str, np.ndarray] | None = None) -> tuple[float, float]:
        """(mean loss, accuracy); params: the arrays already read from the runner, if any."""
        if params is None:
            params = {n: runner.read(n) for n in self.names}
        return evaluate(self.program, params, self.x, self.y)


def make_evaluator(runner, program, x: np.ndarray, y: np.ndarray, names: list[str], echo=None):
    """The runner's device evaluator when it has one (`runner.device_evaluator`, the CUDA
    backend), else `HostEvaluator`.  A model whose eval forward cannot run on the device (a host
    kernel, a kernel without a CUDA twin) falls back to the host with a one-line notice on
    `echo` (default stderr); `STREAMSCHED_EVAL=host` asks for the host (NumPy) evaluation on any backend."""
    import os

    make = getattr(runner, "device_evaluator", None)
    if make is not None and os.environ.get("STREAMSCHED_EVAL", "") != "host":
        try:
            return make(program, x, y)
        except NotImplementedError as exc:
            line = f"note: evaluating on the host: {exc}"
            echo(line) if echo is not None else print(line, file=sys.stderr)
    return HostEvaluator(program, x, y, names)
