"""Step time of one training step (forward, backward, SGD with momentum 0.9; gpt_text: clipping
and AdamW): streamsched's CUDA backend against PyTorch, on one GPU, in one process, with the same
model, data and initial weights for every variant.

    python benchmarks/step_time.py [--json benchmarks/results/h200.json] [--md table.md]
                                   [--steps 300] [--reps 5] [--check-steps 20]
                                   [--models mlp784_b128,mlp784_b2048,mlp_digits,resnet_digits,
                                             resnet_digits_amp,gpt_text]   (default: all but gpt_text)
                                   [--captures none,graphs,step]
                                   [--compile-budget 150] [--no-compile] [--peer-budget 360]
                                   [--trace-dir DIR] [--profile-dir DIR]

Models: an MLP 784-1024-1024-10 in fp32 at batch 128 and 2048 (the .sched text is generated
here: linear, relu, linear, relu, linear, softmax_cross_entropy; random data written to an npz
file in a temp folder), examples/mlp_digits.sched (64-256-256-10, batch 128) and
examples/resnet_digits.sched (a residual CNN on 8x8x1 images, NHWC in streamsched: three 3x3
convolutions of 16 channels with batch norm and ReLU, a residual add, 2x2 max pooling, dropout
p = 0.1, linear 256 -> 10; batch 64; SGD momentum 0.9, weight decay 1e-4).  For resnet_digits the
PyTorch model is nn.Conv2d (cuDNN, NCHW) + nn.BatchNorm2d + nn.Dropout + nn.Linear with
streamsched's initial weights (conv weights [kh, kw, c, k] -> [k, c, kh, kw]; the linear's rows
permuted from NHWC to NCHW flattening order).  Dropout masks differ between the frameworks, so
the loss check of resnet_digits runs every variant a second time with dropout p = 0 (check only,
untimed); the timed runs use p = 0.1.

resnet_digits_amp is examples/resnet_digits_amp.sched: the same CNN in mixed precision (f16
input, activations, weights and gradients; f32 master weights held by `sgd_amp` as the state
`sgd_amp.master.<param>`; f32 batch-norm parameters; a dynamic loss scale in the device buffer
`loss_scale`, starting at 65536, with `found_inf` and `good_steps`).  Its PyTorch side is the
resnet_digits model in standard AMP: fp32 parameters (streamsched's f32 master values, i.e. its
f16 initial weights widened, so both start from the same weights), forward and loss under
torch.autocast("cuda", dtype=torch.float16), torch.amp.GradScaler(init_scale=65536), SGD momentum
0.9, weight decay 1e-4, foreach; the static batch is rounded to f16 for both.  Its loss check
(dropout p = 0, as resnet_digits) reports every variant's relative difference to PyTorch eager
and the loss scale after the check steps; differences above 5e-2 are flagged (printed and listed
in the JSON), never failed: f16 rounding differs between cuDNN/autocast and streamsched's kernels.

gpt_text is examples/gpt_text.sched (a two-block pre-norm GPT, width 64, 4 heads, context 64,
batch 16, byte vocabulary; clipping by global norm 1.0 and AdamW on the update stream).  Its
static batch is the first batch a run of the file trains on (text windows of Python's standard
library), its learning rate the schedule's peak (0.003) held constant, and its PyTorch side the
twin of benchmarks/gpt_twin.py (nn.Embedding, nn.LayerNorm, nn.Linear with streamsched's [in, out]
weights transposed, F.scaled_dot_product_attention(is_causal=True), tanh GELU, F.cross_entropy,
clip_grad_norm_(1.0), AdamW(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1) over every parameter),
from streamsched's initial weights.  tests/test_cuda_gpt_torch.py checks that twin step by step.
Its variants: torch_eager (AdamW foreach), torch_graph (the whole step, clipping and
AdamW(capturable, foreach) included, in one torch.cuda.graph), torch_graph_fused (the same with
fused AdamW), torch_compile_graph (PyTorch's strongest configuration on the H200's MLP steps:
torch.compile(model, mode="max-autotune-no-cudagraphs") inside a whole-step torch.cuda.graph with
fused AdamW; run last, in a process of its own killed after --peer-budget seconds; --no-compile
skips it), and the streamsched variants below.  The ratio `vs_strongest` is against the fastest
of the three graphed PyTorch variants (`strongest_torch`).  ss_step_*_replay leave out the host
upload of AdamW's step count, so their loss is reported but not compared (`not_compared`).
With --trace-dir: gated timelines of its step on five streams and on one, and how long the forks
overlapped (`forks`: the Q, K, V GEMMs, attention's backward dv/dp/ds/dk/dq, each layer norm's
dx/dgamma/dbeta).

Variants:
  torch_eager          nn.Sequential, F.cross_entropy, SGD(foreach=True, momentum=0.9),
                       zero_grad(set_to_none=True)
  torch_graph          the whole step (forward, backward, optimizer.step) captured once with
                       torch.cuda.graph on static inputs and replayed (PyTorch's "whole network
                       capture"; SGD keeps no step state, so it is capturable as is)
  torch_graph_partial  (resnet_digits_amp only, instead of torch_graph) PARTIAL capture, as
                       PyTorch's documented AMP recipe (CUDA Graphs > Usage with torch.cuda.amp):
                       forward + loss + scaled backward captured in one CUDA graph; after each
                       replay scaler.step(optimizer) and scaler.update() run eagerly (GradScaler.step
                       reads found_inf on the host, a sync that cannot be captured).  Its ratio
                       column "vs_torch_graph" is against this variant.
  torch_compile        torch.compile(mode="reduce-overhead") of forward + loss (its backward is
                       compiled and CUDA-graphed by AOTAutograd), optimizer eager foreach;
                       skipped, with the reason, when it fails or the compile budget is spent;
                       not run for resnet_digits_amp (skipped, with that reason)
  ss_{none,graphs,step}_{five,one}[_replay]
                       streamsched, capture none | graphs | step, with the five-stream schedule
                       (trans, comp1..3, update) or everything on one stream; the steady-state
                       step loop issued straight through CudaExecutor + plan_segment_for (no
                       per-step loss read); the batch is staged once into both pinned slots
                       (static data, like PyTorch's static inputs) but still copied host-to-device
                       every step by the plan's `load` graph, and the learning rate uploaded.
                       `_replay` (capture step only): the same graphs with the step's host tasks
                       and host waits left out: the device-side step time alone.
                       `_nozero` (MLP 784 only): the step without `zero_grad` (every gradient is
                       overwritten, not accumulated, so the six clears do nothing): what fewer
                       launches buy.

  ss_step_{five,one}_nofuse
                       the same step planned with `--no-fuse` (every per-parameter task, the loss
                       and its gradient, the GEMM, bias and activation as separate launches)
  torch_compile_graph  (mlp784_b128, mlp784_b2048, resnet_digits, gpt_text) the strongest PyTorch
                       configuration: torch.compile(model, mode="max-autotune-no-cudagraphs")
                       inside a whole-step torch.cuda.graph with fused SGD / AdamW, each in a
                       process of its own that compiles while the rest runs (--peer-after: only
                       after) and times alone once every peer is compiled; killed after
                       --peer-budget seconds from its start.  resnet_digits runs it with dropout
                       p = 0 (its loss check needs it; one fewer kernel favours the peer).
                       `strongest_peer.<model>` of the JSON: its `us`, streamsched's fastest fused
                       whole-step variant `streamsched_us` and `ratio`, the --no-fuse figures.

`--captures` restricts the streamsched capture modes that run (default: all three); `--quick`
leaves out the _nozero variants; `--peer-models`, `--peer-mode` (e.g. "default" for a compile
of seconds), `--peer-budget` and `--peer-log-dir` steer the peers.

For each: GPU time per step (CUDA events around `--steps` steps, `--reps` repetitions, median),
host issue time per step (wall time of the issuing loop / steps), and the loss after
`--check-steps` steps from the initial weights, compared across variants (max relative
difference) so that no variant is fast because it is wrong.  TF32 is off everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from kernel_profile import ENV as PROFILE_ENV, kernel_profile, profile_dir  # noqa: E402

PROFILE_STEPS = 20
"""Steps per kernel profile (--profile-dir)."""

FIVE_STREAMS = """streams {
    trans  : copy       # host-to-device batches and the learning rate
    comp1  : compute    # GEMMs
    comp2  : compute    # reductions
    comp3  : compute    # activations and dX
    update : update     # zero-grad, optimizer
}"""


def mlp_text(batch: int, dims=(784, 1024, 1024, 10), lr: float = 0.01, capture: str = "step") -> str:
    """The generated .sched file: linear, relu, linear, relu, linear, softmax_cross_entropy."""
    d_in, h1, h2, d_out = dims
    return f"""# generated by benchmarks/step_time.py: MLP {d_in}-{h1}-{h2}-{d_out}, fp32, batch {batch}
{FIVE_STREAMS}

model mlp(batch = {batch}) {{
    input x : f32[batch, {d_in}]
    input y : i32[batch]
    h1     = linear(x, {h1})
    a1     = relu(h1)
    h2     = linear(a1, {h2})
    a2     = relu(h2)
    logits = linear(a2, {d_out})
    loss   = softmax_cross_entropy(logits, y)
}}

graph load[a, b] on trans  {{ copy batch -> x, y }}
graph zero_grad  on update {{ clear grad(mlp) }}
graph pass       on comp1  {{ forward mlp; backward mlp }}
graph optimize   on update {{ sgd(mlp, lr, momentum = 0.9) }}

step train(slot) {{
    upload lr on trans
    zero_grad
    pass(load[slot])
    load[next]
    optimize
}}

train {{
    model   = mlp
    data    = npz("data.npz")
    epochs  = 1
    lr      = {lr}
    capture = {capture}
}}
"""


def one_stream_text(text: str) -> str:
    """`streams { main : compute }`, every explicit `on STREAM` moved onto main (the stdlib's
    placements fold onto the declared streams by role)."""
    block = re.search(r"streams\s*\{([^}]*)\}", text).group(1)
    names = re.findall(r"^\s*(\w+)\s*:\s*\w+", block, flags=re.M)
    text = re.sub(r"streams\s*\{[^}]*\}", "streams { main : compute }", text, count=1)
    return re.sub(r"\bon\s+(" + "|".join(map(re.escape, names)) + r")\b", "on main", text)


def compile_steady(path: str, capture: str, fuse: bool = True):
    """compile_file(path, capture=...), unrolled further when the default unrolling has no
    steady state for the loop to repeat (the loop runs thousands of steps); the last try is
    returned when none has one (`segment_index` then repeats its last slot period)."""
    from streamsched.interp.barriers import steady_step
    from streamsched.pipeline import compile_file

    c = None
    for n in (None, 6, 8, 12):
        c = compile_file(path, capture=capture, steps=n, fuse=fuse)
        if c.plan is None:
            return c
        try:
            steady_step(c.plan, c.schedule.steps + 3)
            return c
        except ValueError:
            continue
    return compile_file(path, capture=capture, fuse=fuse)


def segment_index(plan):
    """(k -> the unrolled step issued as loop step k, in O(1); how it was chosen).  The period
    is computed once (barriers.steady_step recomputes it on every call, O(plan)); without a
    steady state the last slot period is repeated (what the runtime did before steady_period)."""
    from streamsched.interp import barriers

    n, p = plan.schedule.steps, max(1, plan.schedule.period)
    how = "repeat-last-slot-period (no steady state found)"
    if hasattr(barriers, "plan_segments"):
        period = barriers.plan_segments(plan).period
    elif hasattr(barriers, "steady_period"):
        period = barriers.steady_period(plan)
    else:
        period, how = p, "slot period (no steady_period in barriers)"
    if period is not None:
        p, how = period, "steady_period"
    return (lambda k: k if k < n else n - p + (k - n) % p), how


# -- models and data ---------------------------------------------------------------------------

def prepare_models(names: list[str], tmp: str) -> dict[str, dict]:
    """name -> {"five": path, "one": path, "batch", "lr", "x", "y", "classes"}; the npz files
    hold random data of the model's shape; the static batch is its first `batch` rows."""
    out = {}
    rng = np.random.default_rng(1234)
    for name in names:
        if name.startswith("mlp784_b"):
            batch = int(name.split("_b")[1])
            lr = 0.01
            d = os.path.join(tmp, name)
            os.makedirs(d, exist_ok=True)
            n = max(batch * 2, 4096)
            x = rng.standard_normal((n, 784)).astype(np.float32)
            y = rng.integers(0, 10, n).astype(np.int32)
            np.savez(os.path.join(d, "data.npz"), x_train=x, y_train=y, x_test=x[:256], y_test=y[:256])
            text = mlp_text(batch, lr=lr)
            five = os.path.join(d, f"{name}.sched")
            with open(five, "w") as f:
                f.write(text)
            xb, yb, classes = x[:batch], y[:batch], 10
            # the same step without `zero_grad`: every gradient here is written, not accumulated
            # (dW = x^T dy, dB = sum dy), so clearing it first is work without effect
            nz = os.path.join(d, f"{name}_nozero.sched")
            with open(nz, "w") as f:
                f.write(text.replace("    zero_grad\n", ""))
            with open(nz.replace(".sched", "_one_stream.sched"), "w") as f:
                f.write(one_stream_text(text.replace("    zero_grad\n", "")))
        elif name == "mlp_digits":
            lr = 0.05
            d = os.path.join(tmp, name)
            os.makedirs(d, exist_ok=True)
            five = os.path.join(ROOT, "examples", "mlp_digits.sched")
            with open(five) as f:
                text = f.read()
            batch = 128
            xb = rng.standard_normal((batch, 64)).astype(np.float32)
            yb = rng.integers(0, 10, batch).astype(np.int32)
            classes = 10
        elif name in ("resnet_digits", "resnet_digits_amp"):
            lr = 0.05  # the example's cosine peak, held constant
            d = os.path.join(tmp, name)
            os.makedirs(d, exist_ok=True)
            five = os.path.join(ROOT, "examples", f"{name}.sched")
            with open(five) as f:
                text = f.read()
            batch = int(re.search(r"model\s+\w+\s*\(\s*batch\s*=\s*(\d+)", text).group(1))
            dropout = float(re.search(r"dropout\([^)]*\bp\s*=\s*([0-9.eE+-]+)", text).group(1))
            if name.endswith("_amp"):
                # its own generator (the same batch whatever --models lists before it); the
                # model's input is f16, so both frameworks get the f16-rounded values
                r = np.random.default_rng(5678)
                xb = r.standard_normal((batch, 8, 8, 1)).astype(np.float16)
                yb = r.integers(0, 10, batch).astype(np.int32)
            else:
                xb = rng.standard_normal((batch, 8, 8, 1)).astype(np.float32)
                yb = rng.integers(0, 10, batch).astype(np.int32)
            classes = 10
            # the loss check's twin: the same step with dropout p = 0 (masks differ between the
            # frameworks; with p = 0 both are the identity)
            p0 = os.path.join(d, f"{name}_p0.sched")
            with open(p0, "w") as f:
                f.write(dropout_text(text, 0.0))
            with open(p0.replace(".sched", "_one_stream.sched"), "w") as f:
                f.write(one_stream_text(dropout_text(text, 0.0)))
        elif name == "gpt_text":
            d = os.path.join(tmp, name)
            os.makedirs(d, exist_ok=True)
            five = os.path.join(ROOT, "examples", "gpt_text.sched")
            with open(five) as f:
                text = f.read()
            gspec, xb, yb = gpt_static(five)
            batch, lr, classes = gspec["batch"], gspec["lr_peak"], gspec["classes"]
        else:
            raise SystemExit(f"unknown model {name}")
        one = os.path.join(d, f"{name}_one_stream.sched")
        with open(one, "w") as f:
            f.write(one_stream_text(text))
        out[name] = {"five": five, "one": one, "batch": batch, "lr": lr, "x": xb, "y": yb,
                     "classes": classes}
        if name.startswith("mlp784_b"):
            out[name]["five_nozero"] = nz
            out[name]["one_nozero"] = nz.replace(".sched", "_one_stream.sched")
        if name == "gpt_text":
            out[name].update({"kind": "gpt", "gpt": gspec})
        if name in ("resnet_digits", "resnet_digits_amp"):
            out[name].update({"kind": "resnet_amp" if name.endswith("_amp") else "resnet",
                              "weight_decay": 1e-4, "dropout": dropout,
                              "five_p0": p0, "one_p0": p0.replace(".sched", "_one_stream.sched")})
    return out


def gpt_static(path: str) -> tuple[dict, np.ndarray, np.ndarray]:
    """The GPT file's twin spec (gpt_twin.gpt_spec) and its static batch: the first batch a run
    of it trains on (the text windows of its data line, in the run's order), as i32."""
    from gpt_twin import gpt_spec, run_batches
    from streamsched.pipeline import compile_file

    c = compile_file(path, capture="none")
    ((x, y),), _ = run_batches(c, os.path.dirname(os.path.abspath(path)), 1)
    return gpt_spec(c), np.ascontiguousarray(x, dtype=np.int32), np.ascontiguousarray(y, dtype=np.int32)


def dropout_text(text: str, p: float) -> str:
    """Every `dropout(..., p = P)` of the .sched text with p set to `p`."""
    return re.sub(r"(dropout\([^)]*\bp\s*=\s*)[0-9.eE+-]+", lambda m: f"{m.group(1)}{p!r}", text)


def initial_weights(path: str, seed: int = 0) -> tuple[dict, list[tuple[str, str]]]:
    """The seeded initial values of every initialised buffer (streamsched's init_params) and the
    (weight, bias) names of the linear layers in model order."""
    from streamsched.interp.train import init_params
    from streamsched.pipeline import compile_file

    c = compile_file(path, capture="none")
    params = list(c.program.model.params)
    layers = [(params[i], params[i + 1]) for i in range(0, len(params), 2)]
    return init_params(c.program, seed), layers


# -- PyTorch -----------------------------------------------------------------------------------

def torch_model(init: dict, layers, device):
    import torch

    mods = []
    for i, (w, b) in enumerate(layers):
        W, B = init[w], init[b]
        lin = torch.nn.Linear(W.shape[0], W.shape[1])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(np.ascontiguousarray(W.T)))
            lin.bias.copy_(torch.from_numpy(B))
        mods.append(lin)
        if i < len(layers) - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods).to(device)


def torch_resnet(init: dict, device, dropout: float):
    """examples/resnet_digits.sched in PyTorch (NCHW, cuDNN convolutions), with streamsched's
    initial weights."""
    import torch
    import torch.nn.functional as F

    class ResNetDigits(torch.nn.Module):
        def __init__(self, c_in=1, width=16, classes=10, hw=4):
            super().__init__()
            self.c1 = torch.nn.Conv2d(c_in, width, 3, padding=1)
            self.b1 = torch.nn.BatchNorm2d(width)
            self.c2 = torch.nn.Conv2d(width, width, 3, padding=1)
            self.b2 = torch.nn.BatchNorm2d(width)
            self.c3 = torch.nn.Conv2d(width, width, 3, padding=1)
            self.b3 = torch.nn.BatchNorm2d(width)
            self.pool = torch.nn.MaxPool2d(2)
            self.drop = torch.nn.Dropout(dropout)
            self.logits = torch.nn.Linear(width * hw * hw, classes)

        def forward(self, x):
            r1 = F.relu(self.b1(self.c1(x)))
            r2 = F.relu(self.b2(self.c2(r1)))
            r3 = F.relu(self.b3(self.c3(r2)) + r1)
            return self.logits(self.drop(torch.flatten(self.pool(r3), 1)))

    w1 = init["c1.w"]
    model = ResNetDigits(c_in=w1.shape[2], width=w1.shape[3], classes=init["logits.w"].shape[1])
    load_resnet(model, init)
    return model.to(device)


def load_resnet(model, init: dict) -> None:
    """streamsched's values into the PyTorch model: conv weights [kh, kw, c, k] -> [k, c, kh, kw];
    the linear's weight [h*w*c, classes] (NHWC flattening) -> [classes, c*h*w] (NCHW flattening);
    batch-norm gamma, beta and running statistics; num_batches_tracked to 0."""
    import torch

    def put(dst, v):
        dst.copy_(torch.from_numpy(np.ascontiguousarray(v)).to(dst.device))

    with torch.no_grad():
        for i in (1, 2, 3):
            conv, bn = getattr(model, f"c{i}"), getattr(model, f"b{i}")
            put(conv.weight, init[f"c{i}.w"].transpose(3, 2, 0, 1))
            put(conv.bias, init[f"c{i}.b"])
            put(bn.weight, init[f"b{i}.gamma"])
            put(bn.bias, init[f"b{i}.beta"])
            put(bn.running_mean, init[f"b{i}.running_mean"])
            put(bn.running_var, init[f"b{i}.running_var"])
            bn.num_batches_tracked.zero_()
        W = init["logits.w"]
        c = init["c3.w"].shape[3]
        hw = int(round((W.shape[0] // c) ** 0.5))
        put(model.logits.weight, W.reshape(hw, hw, c, W.shape[1]).transpose(3, 2, 0, 1).reshape(W.shape[1], -1))
        put(model.logits.bias, init["logits.b"])


def torch_builder(spec, init, layers, device, dropout=None):
    """(make() -> a fresh model, reset(model, opt) -> back to the initial weights with empty
    momentum, the input batch as PyTorch wants it)."""
    import torch

    if spec.get("kind") in ("resnet", "resnet_amp"):
        p = spec["dropout"] if dropout is None else dropout
        if spec["kind"] == "resnet_amp":
            # fp32 master params: streamsched's f32 master state (its f16 params' values widened)
            init = amp_torch_init(init)

        def reset(model, opt):
            load_resnet(model, init)
            _zero_momentum(opt)

        x = np.ascontiguousarray(spec["x"].astype(np.float32).transpose(0, 3, 1, 2))  # NHWC -> NCHW
        return (lambda: torch_resnet(init, device, p)), reset, torch.from_numpy(x).to(device)
    return ((lambda: torch_model(init, layers, device)), (lambda m, o: reset_torch(m, o, init, layers)),
            torch.from_numpy(spec["x"]).to(device))


def amp_torch_init(init: dict) -> dict:
    """PyTorch's fp32 parameters of the AMP model: each parameter with an f32 master copy
    (`sgd_amp.master.P`, the f16 parameter's initial value widened) takes that value; batch norm
    (f32 in both) and the running statistics as they are."""
    out = dict(init)
    for k, v in init.items():
        if k.startswith("sgd_amp.master."):
            out[k[len("sgd_amp.master."):]] = v
    return out


def _zero_momentum(opt) -> None:
    import torch

    with torch.no_grad():
        for st in opt.state.values():
            if st.get("momentum_buffer") is not None:
                st["momentum_buffer"].zero_()


def reset_torch(model, opt, init, layers) -> None:
    """Back to the initial weights with empty momentum (zeroed buffers step exactly like fresh
    ones: v = 0.9 * 0 + g)."""
    import torch

    lins = [m for m in model if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for lin, (w, b) in zip(lins, layers):
            lin.weight.copy_(torch.from_numpy(np.ascontiguousarray(init[w].T)))
            lin.bias.copy_(torch.from_numpy(init[b]))
        for st in opt.state.values():
            if st.get("momentum_buffer") is not None:
                st["momentum_buffer"].zero_()


def torch_variants(spec, init, layers, args, device="cuda", dropout=None, check_only=False):
    """Yield (name, result dict) for PyTorch eager, whole-step CUDA graph and torch.compile.
    dropout: the models' dropout p instead of the spec's; check_only: only the loss after
    `--check-steps` steps (eager and graph; nothing timed)."""
    import torch
    import torch.nn.functional as F

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if spec.get("kind") == "gpt":
        yield from torch_gpt_variants(spec, init, args, device, check_only)
        return
    if spec.get("kind") == "resnet_amp":
        yield from torch_amp_variants(spec, init, layers, args, device, dropout, check_only)
        return
    make, reset, x = torch_builder(spec, init, layers, device, dropout)
    y = torch.from_numpy(spec["y"].astype(np.int64)).to(device)
    lr = spec["lr"]
    wd = spec.get("weight_decay", 0.0)

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=wd, foreach=True)

    def timed(step) -> dict:
        return {} if check_only else time_torch(step, args)

    # eager
    model = make()
    opt = sgd(model)

    def eager_step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    loss = None
    for _ in range(args.check_steps):
        loss = eager_step()
    res = {"loss_after_check": float(loss.detach())}
    res.update(timed(eager_step))
    yield "torch_eager", res

    # whole-step CUDA graph
    try:
        model = make()
        opt = sgd(model)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):  # warm-up on a side stream: creates the momentum buffers
                eager_step_of(model, opt, x, y)
        torch.cuda.current_stream().wait_stream(s)
        reset(model, opt)
        g = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(g):
            static_loss = F.cross_entropy(model(x), y)
            static_loss.backward()
            opt.step()
        torch.cuda.synchronize()
        reset(model, opt)  # capture ran nothing, but be explicit
        for _ in range(args.check_steps):
            g.replay()
        res = {"loss_after_check": float(static_loss.detach())}
        res.update(timed(g.replay))
        yield "torch_graph", res
    except Exception as exc:
        yield "torch_graph", {"skipped": f"{type(exc).__name__}: {exc}"}

    # torch.compile(mode="reduce-overhead")
    if check_only:
        return
    if args.no_compile:
        yield "torch_compile", {"skipped": "--no-compile"}
        return
    if args.compile_spent >= args.compile_budget:
        yield "torch_compile", {"skipped": f"compile budget of {args.compile_budget:.0f} s spent "
                                           f"({args.compile_spent:.0f} s on earlier models)"}
        return
    try:
        import torch._dynamo

        torch._dynamo.reset()
        model = make()
        opt = sgd(model)

        def fwd_loss(a, b):
            return F.cross_entropy(model(a), b)

        cfn = torch.compile(fwd_loss, mode="reduce-overhead")

        def compiled_step():
            torch.compiler.cudagraph_mark_step_begin()
            opt.zero_grad(set_to_none=True)
            loss = cfn(x, y)
            loss.backward()
            opt.step()
            return loss

        t0 = time.perf_counter()
        for _ in range(3):  # compiles, records the CUDA graphs
            compiled_step()
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        args.compile_spent += took
        reset(model, opt)
        loss = None
        for _ in range(args.check_steps):
            loss = compiled_step()
        res = {"loss_after_check": float(loss.detach()), "compile_s": round(took, 1),
               "note": "forward+loss compiled (reduce-overhead; backward compiled and graphed "
                       "by AOTAutograd), optimizer eager foreach"}
        res.update(time_torch(compiled_step, args))
        yield "torch_compile", res
    except Exception as exc:
        yield "torch_compile", {"skipped": f"{type(exc).__name__}: {str(exc)[:300]}"}


def torch_gpt_variants(spec, init, args, device="cuda", check_only=False):
    """The GPT's PyTorch twin (benchmarks/gpt_twin.py: nn.LayerNorm, F.scaled_dot_product_attention,
    tanh GELU, clip_grad_norm_, AdamW with the file's settings, streamsched's initial weights) on
    the static batch at the constant learning rate spec["lr"]: eager (AdamW foreach), the whole
    step in one torch.cuda.graph (AdamW capturable foreach, then fused).  The strongest
    configuration is `gpt_peer`, run last."""
    import torch

    import gpt_twin as gt

    g = spec["gpt"]
    x = torch.from_numpy(spec["x"].astype(np.int64)).to(device)
    y = torch.from_numpy(spec["y"].astype(np.int64)).to(device)
    kw = {"steps": args.steps, "reps": args.reps, "warmup": args.warmup, "check_steps": args.check_steps,
          "device": device, "check_only": check_only}
    for name, fn, extra in (("torch_eager", gt.torch_eager, {}), ("torch_graph", gt.torch_graph, {}),
                            ("torch_graph_fused", gt.torch_graph, {"fused": True})):
        try:
            yield name, fn(g, init, x, y, spec["lr"], **kw, **extra)
        except Exception as exc:
            traceback.print_exc()
            yield name, {"skipped": f"{type(exc).__name__}: {str(exc)[:300]}"}


def gpt_peer(spec, init, args) -> dict:
    """The strongest PyTorch configuration of the GPT, torch_compile_graph: torch.compile(model,
    mode="max-autotune-no-cudagraphs") inside a whole-step torch.cuda.graph with fused AdamW, in
    a process of its own (gpt_twin.peer_subprocess) killed after --peer-budget seconds; run last
    (`run`), after every other variant and the timelines, so that a compile of minutes costs
    nothing else.  {"skipped": ...} under --no-compile."""
    import gpt_twin as gt

    if args.no_compile:
        return {"skipped": "--no-compile"}
    return gt.peer_subprocess(spec["gpt"], init, spec["x"], spec["y"], spec["lr"], steps=args.steps, reps=args.reps,
                              warmup=args.warmup, check_steps=args.check_steps, budget_s=args.peer_budget)


PEER_MODELS = ("mlp784_b128", "mlp784_b2048", "resnet_digits")
"""The SGD models whose strongest PyTorch variant, torch_compile_graph, runs in a process of its own
(`start_peer` / `finish_peer`); gpt_text's runs through gpt_twin.peer_subprocess (`gpt_peer`)."""

PEER_NOTE = ("torch.compile(model, mode=MODE) inside a whole-step torch.cuda.graph, SGD(momentum=0.9, fused=True), "
             "zero_grad(set_to_none=False) captured (../shared/tools/strongest_peer.py's configuration)")


def start_peer(name: str, spec: dict, init: dict, layers, args) -> dict:
    """Start the strongest PyTorch variant of an SGD model (`PEER_NOTE`) as `python step_time.py
    peer ...` in a process group of its own: it compiles and captures at once (in parallel with
    the other variants: compilation is CPU work), then waits for `finish_peer` to let it time, so
    no two timings share the GPU.  resnet_digits runs with dropout p = 0 (the loss check needs it;
    one fewer kernel favours the peer)."""
    import subprocess

    tmp = tempfile.mkdtemp(prefix=f"ss_peer_{name}_")
    inp, out = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.json")
    ready, go = os.path.join(tmp, "ready"), os.path.join(tmp, "go")
    meta = {k: v for k, v in spec.items() if not isinstance(v, np.ndarray)}
    meta["name"] = name
    if meta.get("kind") == "resnet":
        meta["dropout"] = 0.0
    np.savez(inp, x=spec["x"], y=spec["y"], meta=np.array(json.dumps({"spec": meta, "layers": layers})),
             **{f"init/{k}": v for k, v in init.items()})
    cmd = [sys.executable, os.path.abspath(__file__), "peer", inp, out, ready, go, "--steps", str(args.steps),
           "--reps", str(args.reps), "--warmup", str(args.warmup), "--check-steps", str(args.check_steps),
           "--mode", args.peer_mode]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), HERE] + ([env["PYTHONPATH"]] if
                                                                             env.get("PYTHONPATH") else []))
    log = open(os.path.join(args.peer_log_dir or tmp, f"peer_{name}.log"), "w")
    p = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    return {"p": p, "t0": time.perf_counter(), "out": out, "ready": ready, "go": go, "tmp": tmp, "log": log,
            "dropout": meta.get("dropout")}


def start_gpt_peer(name: str, spec: dict, init: dict, args) -> dict:
    """gpt_text's strongest variant (gpt_twin.py peer: torch.compile(MODE) of the twin inside a
    whole-step torch.cuda.graph, fused AdamW) started like `start_peer`, for `finish_peer`."""
    import subprocess

    tmp = tempfile.mkdtemp(prefix=f"ss_peer_{name}_")
    inp, out = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.json")
    ready, go = os.path.join(tmp, "ready"), os.path.join(tmp, "go")
    np.savez(inp, x=spec["x"], y=spec["y"], spec=np.array(json.dumps(spec["gpt"])),
             **{f"init/{k}": v for k, v in init.items()})
    cmd = [sys.executable, os.path.join(HERE, "gpt_twin.py"), "peer", inp, out, "--steps", str(args.steps),
           "--reps", str(args.reps), "--warmup", str(args.warmup), "--check-steps", str(args.check_steps),
           "--lr", repr(spec["lr"]), "--mode", args.peer_mode, "--ready", ready, "--go", go]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), HERE] + ([env["PYTHONPATH"]] if
                                                                             env.get("PYTHONPATH") else []))
    log = open(os.path.join(args.peer_log_dir or tmp, f"peer_{name}.log"), "w")
    p = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    return {"p": p, "t0": time.perf_counter(), "out": out, "ready": ready, "go": go, "tmp": tmp, "log": log}


def wait_ready(h: dict, budget_s: float) -> None:
    """Until the peer is compiled and waits for its turn, has exited, or its budget is spent."""
    while not os.path.exists(h["ready"]) and h["p"].poll() is None and time.perf_counter() < h["t0"] + budget_s:
        time.sleep(0.2)


def finish_peer(h: dict, budget_s: float) -> dict:
    """Let a started peer time its step (once it is ready) and collect its result; killed with its
    whole group (inductor's compile workers) when budget_s seconds after its start have passed."""
    import shutil
    import signal
    import subprocess

    p, deadline = h["p"], h["t0"] + budget_s
    try:
        while not os.path.exists(h["ready"]) and p.poll() is None and time.perf_counter() < deadline:
            time.sleep(0.2)
        if os.path.exists(h["ready"]):
            open(h["go"], "w").close()
        try:
            p.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return {"skipped": f"did not finish within its budget of {budget_s:.0f} s (--peer-budget); killed "
                               f"after {time.perf_counter() - h['t0']:.0f} s"}
        if not os.path.exists(h["out"]):
            return {"skipped": f"the peer process exited with status {p.returncode} and no result"}
        with open(h["out"], encoding="utf-8") as f:
            res = json.load(f)
        res["process_s"] = round(time.perf_counter() - h["t0"], 1)
        return res
    finally:
        h["log"].close()
        shutil.rmtree(h["tmp"], ignore_errors=True)


def _peer_main(argv: list[str]) -> None:
    """The child of `start_peer`: compile, capture, check the loss, write `ready`, wait for `go`,
    time, write the result as JSON."""
    ap = argparse.ArgumentParser(prog="step_time.py peer")
    for a in ("inp", "out", "ready", "go"):
        ap.add_argument(a)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--check-steps", type=int, default=20)
    ap.add_argument("--mode", default="max-autotune-no-cudagraphs")
    a = ap.parse_args(argv)
    try:
        import torch
        import torch.nn.functional as F

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        z = np.load(a.inp)
        meta = json.loads(str(z["meta"]))
        spec = dict(meta["spec"], x=z["x"], y=z["y"])
        layers = [tuple(l) for l in meta["layers"]]
        init = {k[5:]: z[k] for k in z.files if k.startswith("init/")}
        make, reset, x = torch_builder(spec, init, layers, "cuda")
        y = torch.from_numpy(spec["y"].astype(np.int64)).cuda()
        model = make()
        t0 = time.perf_counter()
        cm = torch.compile(model, mode=a.mode)
        opt = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9,
                              weight_decay=spec.get("weight_decay", 0.0), fused=True)

        def step():
            loss = F.cross_entropy(cm(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(5):  # compiles (minutes under max-autotune), creates the momentum buffers
                step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        reset(model, opt)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_loss = step()
        torch.cuda.synchronize()
        reset(model, opt)
        for _ in range(a.check_steps):
            g.replay()
        loss = float(static_loss.detach())
        res = {"loss_after_check": loss, "compile_s": round(compile_s, 1), "mode": a.mode,
               "note": PEER_NOTE.replace("MODE", a.mode)}
        if spec.get("kind") == "resnet":
            res["loss_after_check_p0"] = loss
            res["dropout"] = 0.0
        open(a.ready, "w").close()
        while not os.path.exists(a.go):
            time.sleep(0.1)
        res.update(time_torch(g.replay, a))
        if profile_dir():
            t = kernel_profile(g.replay, PROFILE_STEPS, os.path.join(profile_dir(), f"{meta['spec'].get('name', 'peer')}"
                                                                     f"_torch_compile_graph.json"), "torch_compile_graph")
            res["profile"] = {x: t[x] for x in ("kernels_per_step", "busy_us_per_step", "span_us_per_step")}
    except Exception as exc:
        traceback.print_exc()
        res = {"skipped": f"{type(exc).__name__}: {str(exc)[:300]}"}
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(res, f)


def strongest_peer_rows(out: dict) -> dict:
    """`strongest_peer.<model>` of h200.json: the strongest PyTorch variant's GPU time per step
    (`us`), streamsched's fastest fused whole-step variant (`streamsched_us`, ss_step_five or
    ss_step_one) and their ratio, with the unfused (`--no-fuse`) figures beside them."""
    rows = {}
    for name, row in out["models"].items():
        v = row["variants"]
        peer = v.get("torch_compile_graph", {})
        best = min((k for k in ("ss_step_five", "ss_step_one") if v.get(k, {}).get("gpu_us")),
                   key=lambda k: v[k]["gpu_us"], default=None)
        nof = min((k for k in ("ss_step_five_nofuse", "ss_step_one_nofuse") if v.get(k, {}).get("gpu_us")),
                  key=lambda k: v[k]["gpu_us"], default=None)
        us = peer.get("gpu_us")
        ss = v[best]["gpu_us"] if best else None
        r = {"us": us, "streamsched_us": ss, "ratio": ratio(ss, us), "streamsched_variant": best,
             "peer": peer.get("note", "torch_compile_graph") if us else peer.get("skipped", "not run"),
             "peer_compile_s": peer.get("compile_s")}
        if nof:
            r.update({"nofuse_us": v[nof]["gpu_us"], "nofuse_ratio": ratio(v[nof]["gpu_us"], us),
                      "nofuse_variant": nof})
        lc = row.get("loss_check", {})
        r["loss_max_rel_diff"] = lc.get("max_rel_diff")
        rows[name] = r
    return rows


AMP_LOSS_TOL = 5e-2  # relative loss difference flagged (not failed) for the f16 model
AMP_INIT_SCALE = 65536.0  # GradScaler's default, and the .sched file's `loss_scale` state


def torch_amp_variants(spec, init, layers, args, device="cuda", dropout=None, check_only=False):
    """The AMP model in PyTorch (standard AMP: fp32 params, torch.autocast(float16),
    GradScaler(init_scale=65536), SGD momentum 0.9, weight decay 1e-4, foreach): eager, and the
    partial CUDA graph of PyTorch's documented AMP recipe (forward + loss + scaled backward
    captured; scaler.step and scaler.update eager after each replay, since GradScaler.step syncs).
    torch.compile is not run for AMP."""
    import torch
    import torch.nn.functional as F

    make, reset, x = torch_builder(spec, init, layers, device, dropout)
    y = torch.from_numpy(spec["y"].astype(np.int64)).to(device)

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9,
                               weight_decay=spec.get("weight_decay", 0.0), foreach=True)

    def timed(step) -> dict:
        return {} if check_only else time_torch(step, args)

    def reset_scaler(scaler):  # in place: the captured graph reads scaler's scale tensor
        scaler._scale.fill_(AMP_INIT_SCALE)
        scaler._growth_tracker.zero_()

    # eager AMP
    model = make()
    opt = sgd(model)
    scaler = torch.amp.GradScaler("cuda", init_scale=AMP_INIT_SCALE)

    def eager_step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    loss = None
    for _ in range(args.check_steps):
        loss = eager_step()
    res = {"loss_after_check": float(loss.detach()), "loss_scale_after_check": float(scaler.get_scale()),
           "note": "torch.autocast(float16) + GradScaler(init_scale=65536), fp32 params, SGD foreach"}
    res.update(timed(eager_step))
    yield "torch_eager", res

    # partial capture (PyTorch docs, CUDA Graphs > Usage with torch.cuda.amp): forward, loss and
    # the scaled backward in the graph; scaler.step(opt) and scaler.update() eagerly after each
    # replay (GradScaler.step reads found_inf on the host: a sync, not capturable)
    try:
        model = make()
        opt = sgd(model)
        scaler = torch.amp.GradScaler("cuda", init_scale=AMP_INIT_SCALE)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):  # warm-up on a side stream: creates momentum buffers, scaler state
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    wl = F.cross_entropy(model(x), y)
                scaler.scale(wl).backward()
                scaler.step(opt)
                scaler.update()
            del wl  # no autograd node of the warm-up kept alive into the capture
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        reset(model, opt)
        reset_scaler(scaler)
        g = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(g):
            with torch.autocast("cuda", dtype=torch.float16):
                static_loss = F.cross_entropy(model(x), y)
            scaler.scale(static_loss).backward()
        torch.cuda.synchronize()
        reset(model, opt)  # capture ran nothing, but be explicit
        reset_scaler(scaler)

        def partial_step():
            g.replay()
            scaler.step(opt)
            scaler.update()

        for _ in range(args.check_steps):
            partial_step()
        res = {"loss_after_check": float(static_loss.detach()),
               "loss_scale_after_check": float(scaler.get_scale()),
               "note": "partial capture (PyTorch's AMP recipe): forward + loss + scaled backward "
                       "in one CUDA graph; scaler.step(opt) (host sync) and scaler.update() eager"}
        res.update(timed(partial_step))
        yield "torch_graph_partial", res
    except Exception as exc:
        traceback.print_exc()
        yield "torch_graph_partial", {"skipped": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if not check_only:
        yield "torch_compile", {"skipped": "not run for AMP (GradScaler around a compiled step "
                                           "left out of this benchmark)"}


def eager_step_of(model, opt, x, y):
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def time_torch(step, args) -> dict:
    import torch

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(args.reps):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        e0.record()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        t1 = time.perf_counter()
        e1.record()
        e1.synchronize()
        gpu.append(e0.elapsed_time(e1) * 1e3 / args.steps)
        host.append((t1 - t0) * 1e6 / args.steps)
    return _stats(gpu, host)


def _stats(gpu, host) -> dict:
    return {"gpu_us": round(statistics.median(gpu), 2), "gpu_us_reps": [round(v, 2) for v in gpu],
            "host_us": round(statistics.median(host), 2), "host_us_reps": [round(v, 2) for v in host]}


# -- streamsched -------------------------------------------------------------------------------

def ss_variant(path: str, capture: str, spec: dict, init: dict, args, replay_only: bool = False,
               check_only: bool = False, fuse: bool = True, profile_as: str = "") -> dict:
    """One streamsched variant.  replay_only: issue only the device work of each step (graph
    launches, waits, records), leaving out its host tasks and host waits: the device-side step
    time without the host/device round trip of the plan's staging waits (valid here only because
    the data are static).  check_only: only the loss after `--check-steps` steps.  profile_as:
    with --profile-dir, after the timing, the per-kernel table of PROFILE_STEPS steps is written
    to DIR/<profile_as>.json (benchmarks/kernel_profile.py)."""
    import cupy as cp

    from streamsched.interp.barriers import plan_segment
    from streamsched.interp.cuda import CudaExecutor, Program, graph_nodes_edges
    c = compile_steady(path, capture, fuse)
    if not c.ok or c.plan is None:
        return {"skipped": f"does not check: {[d.code for d in c.diagnostics]}"}
    plan, program = c.plan, c.program
    m = program.model
    feat = next(n for n, _, _ in m.inputs if n != m.labels)
    t0 = time.perf_counter()
    ex = CudaExecutor(c.schedule, plan, capture=capture)
    setup_s = time.perf_counter() - t0
    try:
        for n, v in init.items():
            ex.set(n, v)
        filled: set[str] = set()
        lr = np.float32(spec["lr"])
        cur = {"k": -1}

        def host_fn(task, arrays):
            out = task.outs[0]
            if task.kernel == "stage":
                if out not in filled:  # static data: each pinned slot is written once
                    arrays[out][...] = spec["x"] if task.attr("field") == feat else spec["y"]
                    filled.add(out)
            elif task.kernel == "set_scalar":
                arrays[out][...] = lr if task.attr("name") == "lr" else np.float32(cur["k"] + 1)

        progs: dict[int, object] = {}
        index, how = segment_index(plan)

        def prog(k: int):
            s = index(k)
            p = progs.get(s)
            if p is None:
                p = ex.compile(plan_segment(plan, s))
                if replay_only:
                    p = Program([op for op in p.ops if op[0] not in ("host", "sync")], p.n_instrs)
                progs[s] = p
            return p

        ex.run(ex.compile(plan_segment(plan, -1)), host_fn)
        k = 0
        if replay_only:  # fill both staging slots and the lr once, through a full step
            ex.run(ex.compile(plan_segment(plan, 0)), host_fn)
            ex.run(ex.compile(plan_segment(plan, 1)), host_fn)
            ex.synchronize()
            for n, v in init.items():  # and start again from the initial weights
                ex.set(n, v)
        for _ in range(args.check_steps):
            cur["k"] = k
            ex.run(prog(k), host_fn)
            k += 1
        ex.synchronize()
        loss = float(ex.get(m.loss))
        amp = {"loss_scale_after_check": float(ex.get("loss_scale"))} if "loss_scale" in init else {}
        if check_only:
            return {"loss_after_check": loss, **amp}
        for _ in range(args.warmup):
            cur["k"] = k
            ex.run(prog(k), host_fn)
            k += 1
        ex.synchronize()
        streams = list(ex.ctx.streams.values())
        last = streams[-1]
        joins = [cp.cuda.Event(disable_timing=True) for _ in streams]
        gpu, host = [], []
        for _ in range(args.reps):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            ex.synchronize()
            e0.record(streams[0])
            a = time.perf_counter()
            for _ in range(args.steps):
                cur["k"] = k
                ex.run(prog(k), host_fn)
                k += 1
            b = time.perf_counter()
            for ev, st in zip(joins, streams):  # the end: every stream finished
                ev.record(st)
                last.wait_event(ev)
            e1.record(last)
            e1.synchronize()
            gpu.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / args.steps)
            host.append((b - a) * 1e6 / args.steps)
        res = {"loss_after_check": loss, **amp}
        if profile_as and profile_dir():
            def one_step():
                cur["k"] = k_box[0]
                ex.run(prog(k_box[0]), host_fn)
                k_box[0] += 1
            k_box = [k]
            t = kernel_profile(one_step, PROFILE_STEPS, os.path.join(profile_dir(), f"{profile_as}.json"), profile_as)
            k = k_box[0]
            res["profile"] = {x: t[x] for x in ("kernels_per_step", "busy_us_per_step", "span_us_per_step")}
        stale = sorted({t.attr("name") for t in c.schedule.tasks
                        if t.kernel == "set_scalar" and t.attr("name") != "lr"})
        if replay_only and stale:  # e.g. AdamW's step count: the replay re-reads the last upload
            res["loss_not_compared"] = (f"host uploads of {', '.join(stale)} left out with the host tasks: the "
                                        f"replayed steps reuse stale values (AdamW's bias correction)")
        res.update(_stats(gpu, host))
        nodes: dict[str, int] = {}
        for cu in ex.graphs.values():
            for t in graph_nodes_edges(cu.graph)[0]:
                nodes[t] = nodes.get(t, 0) + 1
        seg = plan_segment(plan, index(10 ** 6))
        res.update({"setup_s": round(setup_s, 2), "graphs": len(ex.graphs), "segments": how,
                    "unrolled_steps": c.schedule.steps, "fused_tasks": c.fused,
                    "graph_nodes": nodes, "streams": len(streams),
                    "kernels_per_step": sum(1 for i in seg if i.op == "launch" and i.stream != "host"),
                    "host_waits_per_step": sum(1 for i in seg if i.op == "wait" and i.stream == "host")})
        return res
    finally:
        ex.close()


# -- the run -----------------------------------------------------------------------------------

EXTRAS = ("_nozero", "_nofuse", "_prio", "_noprio", "_noskinny", "_smalln", "_crit", "_nobnepi")
"""The suffixed ss_step_five variants (--extras): gradients not cleared, fusion off, and EXTRA_ENV's."""

EXTRA_ENV = {"_prio": {"STREAMSCHED_PRIORITIES": "slack"}, "_noprio": {"STREAMSCHED_PRIORITIES": "off"},
             "_noskinny": {"STREAMSCHED_SKINNY_GEMM": "0"}, "_smalln": {"STREAMSCHED_SKINNY_GEMM": "all"},
             "_crit": {"STREAMSCHED_CRITICAL_FIRST": "1"}, "_nobnepi": {"STREAMSCHED_BN_EPILOGUES": "0"}}
"""Variants that differ from ss_step_five by one environment setting: critical-path priorities
on / off (interp/priority.py; the one that is not the default runs), the skinny GEMMs off and
with the small-n kernel too (stdlib/kernels/_cuda.py `_skinny_gemm`), fuse.py's "Critical path first" turned on (off by default), and its batch-norm epilogues turned off."""


def extra_differs(extra: str) -> bool:
    """Whether the variant's setting differs from what ss_step_five runs with."""
    from streamsched.interp.cuda.device import priorities_on

    if extra in ("_prio", "_noprio"):
        return (extra == "_prio") != priorities_on()
    from streamsched.interp.training.settings import env_choices

    choice = {c.name: c for c in env_choices()}
    return all((os.environ.get(k) or choice[k].default) != v for k, v in EXTRA_ENV[extra].items())


@contextlib.contextmanager
def variant_env(env: dict):
    """The environment variables of `env` set for one variant, restored after."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ratio(a, b):
    if a is None or b is None or not b:
        return None
    return round(a / b, 3)


def run(args) -> dict:
    import cupy as cp
    import torch

    names = [n for n in args.models.split(",") if n]
    tmp = tempfile.mkdtemp(prefix="ss_step_time_")
    specs = prepare_models(names, tmp)
    props = cp.cuda.runtime.getDeviceProperties(0)
    out = {
        "benchmark": "benchmarks/step_time.py",
        "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "driver": cp.cuda.runtime.driverGetVersion(), "runtime": cp.cuda.runtime.runtimeGetVersion(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "cupy": cp.__version__, "numpy": np.__version__},
        "config": {"steps": args.steps, "reps": args.reps, "warmup": args.warmup,
                   "check_steps": args.check_steps, "tf32": False,
                   "dtype": "fp32 (resnet_digits_amp: mixed f16/f32, see its `precision`)",
                   "optimizer": "SGD momentum 0.9 (gpt_text: see its row's `optimizer`)", "statistic": "median over reps of "
                   "(CUDA-event time of `steps` steps / steps)"},
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "models": {},
    }
    deferred: dict[str, dict] = {}  # gpt models: name -> initial values, for the peer run last
    peers: dict[str, dict] = {}  # SGD models: their strongest-peer processes, compiling meanwhile
    peer_models = [n for n in (args.peer_models.split(",") if args.peer_models else PEER_MODELS + ("gpt_text",))
                   if n]

    def start_peers():
        for name in peer_models if not args.no_compile else ():
            if name in specs and name in PEER_MODELS:
                init, layers = initial_weights(specs[name]["five"])
                peers[name] = start_peer(name, specs[name], init, layers, args)
            elif name in specs and specs[name].get("kind") == "gpt":
                init, _ = initial_weights(specs[name]["five"])
                peers[name] = start_gpt_peer(name, specs[name], init, args)
            else:
                continue
            print(f"== {name}: torch_compile_graph started (budget {args.peer_budget:.0f} s)", flush=True)

    if not args.peer_after:
        start_peers()  # they compile while the other variants run, and time one at a time at the end
    for name, spec in specs.items():
        init, layers = initial_weights(spec["five"])
        row: dict = {"batch": spec["batch"], "lr": spec["lr"],
                     "layers": [list(init[w].shape) for w, _ in layers], "variants": {}}
        if spec.get("kind") in ("resnet", "resnet_amp"):
            row["layers"] = [list(init[w].shape) for w in ("c1.w", "c2.w", "c3.w", "logits.w")]
            row.update({"weight_decay": spec["weight_decay"], "dropout": spec["dropout"],
                        "torch_layout": "NCHW (cuDNN), nn.BatchNorm2d, nn.Dropout",
                        "loss_check_dropout": 0.0})
        if spec.get("kind") == "gpt":
            gs = spec["gpt"]
            row["layers"] = {k: gs[k] for k in ("layers", "width", "heads", "context", "hidden", "vocab", "classes")}
            a = gs["adamw"][0]
            row.update({"optimizer": f"AdamW(betas=({a['beta1']}, {a['beta2']}), eps={a['eps']}, weight_decay="
                                     f"{a['weight_decay']}, every parameter) after clipping by global norm "
                                     f"{gs['clip']}; lr constant at the schedule's peak",
                        "torch_twin": "benchmarks/gpt_twin.py: nn.Embedding, nn.LayerNorm, nn.Linear, "
                                      "F.scaled_dot_product_attention(is_causal=True), F.gelu(tanh), "
                                      "clip_grad_norm_, torch.optim.AdamW",
                        "static_batch": "the run's first batch of text windows"})
        if spec.get("kind") == "resnet_amp":
            row.update({"precision": "mixed: f16 compute, f32 master weights (streamsched: sgd_amp "
                                     "state; PyTorch: fp32 params under torch.autocast(float16)), "
                                     "f32 batch-norm params, dynamic loss scale from 65536",
                        "torch_graph_reference": "torch_graph_partial",
                        "loss_check_tolerance": AMP_LOSS_TOL})
        out["models"][name] = row
        print(f"== {name}", flush=True)
        try:
            for vname, res in torch_variants(spec, init, layers, args):
                row["variants"][vname] = res
                print(f"  {vname:22s} {json.dumps({k: v for k, v in res.items() if not k.endswith('_reps')})}",
                      flush=True)
        except Exception as exc:
            traceback.print_exc()
            row["variants"].setdefault("torch_eager", {"skipped": f"{type(exc).__name__}: {exc}"})
        if "five_p0" in spec:  # the loss check with dropout p = 0 (masks differ between frameworks)
            try:
                for vname, res in torch_variants(spec, init, layers, args, dropout=0.0, check_only=True):
                    if vname in row["variants"] and "loss_after_check" in res:
                        row["variants"][vname]["loss_after_check_p0"] = res["loss_after_check"]
                        if "loss_scale_after_check" in res:
                            row["variants"][vname]["loss_scale_after_check_p0"] = res["loss_scale_after_check"]
                        print(f"  {vname:22s} p=0 loss {res['loss_after_check']:.7g}", flush=True)
            except Exception:
                traceback.print_exc()
        captures = [c for c in args.captures.split(",") if c]
        extras = {e for e in args.extras.split(",") if e}
        for capture, replay, extra in (("none", False, ""), ("graphs", False, ""), ("step", False, ""),
                                       ("step", True, "")) + tuple(("step", False, e) for e in EXTRAS):
            if capture not in captures or (extra and extra not in extras):
                continue
            for streams in ("five", "one"):
                vname = f"ss_{capture}_{streams}" + ("_replay" if replay else "") + extra
                src = streams + ("" if extra == "_nofuse" or extra in EXTRA_ENV else extra)
                if src not in spec or (extra == "_nozero" and args.quick):
                    continue
                if extra in EXTRA_ENV and (streams == "one" or not extra_differs(extra)):
                    continue  # a setting other than the default's, five streams only
                try:
                    with variant_env(EXTRA_ENV.get(extra, {})):
                        res = ss_variant(spec[src], capture, spec, init, args, replay_only=replay,
                                         fuse=extra != "_nofuse",
                                         profile_as=f"{name}_{vname}" if capture == "step" else "")
                except Exception as exc:
                    traceback.print_exc()
                    res = {"skipped": f"{type(exc).__name__}: {str(exc)[:300]}"}
                if streams + "_p0" in spec and not replay and extra in ("", "_nofuse") and "skipped" not in res:
                    try:
                        chk = ss_variant(spec[streams + "_p0"], capture, spec, init, args, check_only=True,
                                         fuse=extra != "_nofuse")
                        res["loss_after_check_p0"] = chk["loss_after_check"]
                        if "loss_scale_after_check" in chk:
                            res["loss_scale_after_check_p0"] = chk["loss_scale_after_check"]
                    except Exception as exc:
                        traceback.print_exc()
                        res["loss_after_check_p0_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                row["variants"][vname] = res
                print(f"  {vname:22s} {json.dumps({k: v for k, v in res.items() if not k.endswith('_reps')})}",
                      flush=True)
        summarize_model(name, row, args.check_steps)
        if spec.get("kind") == "gpt":
            deferred[name] = init
        if args.json:
            _write_json(args.json, out)
    if args.trace_dir:
        out["timelines"] = timelines(specs, args.trace_dir)
        if args.json:
            _write_json(args.json, out)
    if args.peer_after:
        start_peers()
    for h in peers.values():  # every compile (and its autotuning on the GPU) done before any peer times
        wait_ready(h, args.peer_budget)
    for name, h in peers.items():  # then one at a time on a quiet GPU
        res = finish_peer(h, args.peer_budget)
        out["models"][name]["variants"]["torch_compile_graph"] = res
        print(f"  {name} {'torch_compile_graph':22s} "
              f"{json.dumps({k: v for k, v in res.items() if not k.endswith('_reps')})}", flush=True)
        summarize_model(name, out["models"][name], args.check_steps)
        if args.json:
            _write_json(args.json, out)
    for name, init in deferred.items():  # last: its compile can take minutes (--peer-budget)
        if name in peers or args.no_compile or name not in peer_models:
            continue
        print(f"== {name}: torch_compile_graph (budget {args.peer_budget:.0f} s)", flush=True)
        row = out["models"][name]
        try:
            res = gpt_peer(specs[name], init, args)
        except Exception as exc:
            traceback.print_exc()
            res = {"skipped": f"{type(exc).__name__}: {str(exc)[:300]}"}
        row["variants"]["torch_compile_graph"] = res
        print(f"  {'torch_compile_graph':22s} {json.dumps({k: v for k, v in res.items() if not k.endswith('_reps')})}",
              flush=True)
        summarize_model(name, row, args.check_steps)
        if args.json:
            _write_json(args.json, out)
    out["strongest_peer"] = strongest_peer_rows(out)
    print("strongest_peer " + json.dumps(out["strongest_peer"], indent=1), flush=True)
    if args.json:
        _write_json(args.json, out)
    return out


def summarize_model(name: str, row: dict, check_steps: int) -> None:
    """Loss check, ratios and targets of one model's variants (into `row`)."""
    v = row["variants"]
    g = {k: r.get("gpu_us") for k, r in v.items()}
    key = "loss_after_check_p0" if any("loss_after_check_p0" in r for r in v.values()) else "loss_after_check"
    losses = {k: r[key] for k, r in v.items() if key in r and "loss_not_compared" not in r}
    ref = losses.get("torch_eager")
    row["loss_check"] = {
        "steps": check_steps, "reference": "torch_eager", "losses": losses,
        "dropout": 0.0 if key.endswith("_p0") else "as timed",
        "max_rel_diff": max((abs(l - ref) / abs(ref) for l in losses.values()), default=None)
        if ref else None,
    }
    skipped = {k: r["loss_not_compared"] for k, r in v.items() if "loss_not_compared" in r}
    if skipped:
        row["loss_check"]["not_compared"] = skipped
    if "loss_check_tolerance" in row:  # AMP: f16-level differences are reported, not failed
        lc = row["loss_check"]
        lc["rel_diffs"] = {k: abs(l - ref) / abs(ref) for k, l in losses.items()} if ref else {}
        lc["tolerance"] = row["loss_check_tolerance"]
        lc["flagged"] = sorted(k for k, d in lc["rel_diffs"].items() if d > lc["tolerance"])
        sk = key.replace("loss_after_check", "loss_scale_after_check")
        lc["loss_scales"] = {k: r[sk] for k, r in v.items() if sk in r}
        if lc["flagged"]:
            print(f"  WARNING {name}: loss after {check_steps} steps differs from torch_eager by more "
                  f"than {lc['tolerance']:g} (relative): {lc['flagged']}", flush=True)
    gref = row.get("torch_graph_reference", "torch_graph")
    row["ratios"] = {
        k: {"vs_torch_graph": ratio(g[k], g.get(gref)), "vs_torch_eager": ratio(g[k], g.get("torch_eager"))}
        for k in v if g.get(k)
    }
    if True:  # the strongest PyTorch configuration measured, by GPU time
        strong = min((k for k in ("torch_graph", "torch_graph_fused", "torch_compile_graph") if g.get(k)),
                     key=lambda k: g[k], default=None)
        row["strongest_torch"] = strong
        for k in row["ratios"]:
            row["ratios"][k]["vs_strongest"] = ratio(g[k], g.get(strong)) if strong else None
    row["ratios"]["ss_step_five_vs_ss_step_one"] = ratio(g.get("ss_step_five"), g.get("ss_step_one"))
    row["ratios"]["ss_graphs_five_vs_ss_graphs_one"] = ratio(g.get("ss_graphs_five"), g.get("ss_graphs_one"))
    row["ratios"]["ss_step_five_replay_vs_ss_step_one_replay"] = ratio(g.get("ss_step_five_replay"),
                                                                       g.get("ss_step_one_replay"))
    tg = {}
    if name == "mlp784_b128":
        r1 = ratio(g.get("ss_step_five"), g.get("torch_graph"))
        r2 = ratio(g.get("ss_step_five"), g.get("torch_eager"))
        r3 = ratio(g.get("ss_step_five"), g.get("ss_step_one"))
        tg = {"ss_step_five <= 0.8 x torch_graph": {"ratio": r1, "met": r1 is not None and r1 <= 0.8},
              "ss_step_five <= 0.2 x torch_eager": {"ratio": r2, "met": r2 is not None and r2 <= 0.2},
              "ss_step_five <= 0.95 x ss_step_one": {"ratio": r3, "met": r3 is not None and r3 <= 0.95}}
    elif name == "mlp784_b2048":
        r1 = ratio(g.get("ss_step_five"), g.get("torch_graph"))
        tg = {"ss_step_five <= 1.0 x torch_graph": {"ratio": r1, "met": r1 is not None and r1 <= 1.0}}
    row["targets"] = tg


def timelines(specs, trace_dir: str) -> dict:
    """Gated eager timelines (device-side concurrency) of the five- and one-stream step of the
    MLP 784 models, for the explanation of the numbers."""
    from streamsched.interp.cuda.trace import trace

    os.makedirs(trace_dir, exist_ok=True)
    out = {}
    for name, spec in specs.items():
        if name == "gpt_text":
            out.update(gpt_timelines(spec, trace_dir))
            continue
        if not name.startswith("mlp784"):
            continue
        for streams in ("five", "one"):
            try:
                c = compile_steady(spec[streams], "none")
                base = os.path.join(trace_dir, f"timeline_{name}_{streams}")
                res = trace(c, base + ".json", png=base + ".png" if name.endswith("b128") else None, steps=2)
                out[f"{name}_{streams}"] = res["summary"]["steps"]["2"]
                print(f"  timeline {name} {streams}: {json.dumps(out[f'{name}_{streams}'])}", flush=True)
            except Exception as exc:
                traceback.print_exc()
                out[f"{name}_{streams}"] = {"skipped": f"{type(exc).__name__}: {exc}"}
    return out


def gpt_timelines(spec, trace_dir: str) -> dict:
    """Gated eager timelines of the GPT step on five streams and on one (Chrome trace and PNG of
    the second traced step each): the per-stream busy time and span, and how long the forked
    parts ran at the same time (gpt_twin.fork_overlaps: the Q, K, V GEMMs, attention's and
    layer norm's backward parts), in microseconds."""
    import gpt_twin as gt
    from streamsched.interp.cuda.trace import trace

    out = {}
    for streams in ("five", "one"):
        key = f"gpt_text_{streams}"
        try:
            c = compile_steady(spec[streams], "none")
            base = os.path.join(trace_dir, f"timeline_{key}")
            res = trace(c, base + ".json", png=base + ".png", steps=2, lr=spec["lr"])
            out[key] = {**res["summary"]["steps"]["2"], "forks": gt.fork_overlaps(res["records"], step=2),
                        "files": [base + ".json", base + ".png"]}
            print(f"  timeline {key}: span {out[key]['span_us']} us, forks {json.dumps(out[key]['forks'])}",
                  flush=True)
        except Exception as exc:
            traceback.print_exc()
            out[key] = {"skipped": f"{type(exc).__name__}: {exc}"}
    return out


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


ORDER = ["torch_eager", "torch_graph", "torch_graph_fused", "torch_graph_partial", "torch_compile",
         "torch_compile_graph", "ss_none_five", "ss_none_one", "ss_graphs_five",
         "ss_graphs_one", "ss_step_five", "ss_step_one", "ss_step_five_replay", "ss_step_one_replay",
         "ss_step_five_nozero", "ss_step_one_nozero", "ss_step_five_nofuse", "ss_step_one_nofuse"]


def markdown(out: dict) -> str:
    lines = []
    for name, row in out["models"].items():
        lines.append(f"### {name} (batch {row['batch']}, layers {row['layers']})\n")
        p0 = row["loss_check"].get("dropout") == 0.0
        lines.append("| variant | GPU µs/step (median) | host issue µs/step | × PyTorch CUDA graph | × PyTorch eager | loss after "
                     f"{row['loss_check']['steps']} steps{' (dropout p = 0)' if p0 else ''} |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for v in ORDER:
            r = row["variants"].get(v)
            if r is None:
                continue
            if "skipped" in r:
                lines.append(f"| {v} | skipped: {r['skipped'][:120]} | | | | |")
                continue
            rr = row["ratios"].get(v, {})
            lc = r.get("loss_after_check_p0", "") if p0 else r["loss_after_check"]
            lines.append(f"| {v} | {r['gpu_us']:.1f} | {r['host_us']:.1f} | {_f(rr.get('vs_torch_graph'))} | "
                         f"{_f(rr.get('vs_torch_eager'))} | {lc if isinstance(lc, str) else f'{lc:.7g}'} |")
        lc = row["loss_check"]["max_rel_diff"]
        lines.append(f"\nLoss check: max relative difference to PyTorch eager {lc:.2e}." if lc is not None else "")
        for k, why in row["loss_check"].get("not_compared", {}).items():
            lines.append(f"(loss of {k} not compared: {why}.)")
        if row.get("strongest_torch"):
            st = row["strongest_torch"]
            lines.append(f"Against the strongest PyTorch configuration measured ({st}): " + ", ".join(
                f"{k} × {_f(row['ratios'][k]['vs_strongest'])}" for k in ORDER
                if k.startswith("ss_") and row["ratios"].get(k, {}).get("vs_strongest") is not None) + ".")
        if row.get("torch_graph_reference"):
            lines.append(f"(× PyTorch CUDA graph is against {row['torch_graph_reference']}; loss tolerance "
                         f"{row['loss_check'].get('tolerance')}, flagged: {row['loss_check'].get('flagged') or 'none'}.)")
        for t, r in row["targets"].items():
            lines.append(f"- target `{t}`: ratio {_f(r['ratio'])}, {'met' if r['met'] else 'MISSED'}")
        lines.append("")
    return "\n".join(lines)


def _f(x):
    return "" if x is None else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=os.path.join(HERE, "results", "h200.json"))
    ap.add_argument("--md", default="")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--check-steps", type=int, default=20)
    ap.add_argument("--models", default="mlp784_b128,mlp784_b2048,mlp_digits,resnet_digits,resnet_digits_amp")
    ap.add_argument("--captures", default="none,graphs,step",
                    help="the streamsched capture modes to run (comma-separated)")
    ap.add_argument("--compile-budget", type=float, default=100.0,
                    help="seconds of torch.compile time, all models together, before skipping it")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (torch_compile, torch_compile_graph)")
    ap.add_argument("--peer-budget", type=float, default=360.0,
                    help="seconds each strongest-peer variant (torch_compile_graph: torch.compile max-autotune inside a "
                         "whole-step CUDA graph, fused SGD / AdamW; compile and timing) may take in its own process, "
                         "from its start, before it is killed")
    ap.add_argument("--peer-models", default="",
                    help="the models whose torch_compile_graph variant runs (default: mlp784_b128, mlp784_b2048, "
                         "resnet_digits and gpt_text; each in its own process, killed after --peer-budget s)")
    ap.add_argument("--peer-mode", default="max-autotune-no-cudagraphs",
                    help="torch.compile mode of the peers (\"default\" compiles in seconds, autotunes nothing)")
    ap.add_argument("--peer-log-dir", default="", help="write each peer process's output here")
    ap.add_argument("--peer-after", action="store_true",
                    help="start the peers' compiles only after every other variant has been timed (slower; no "
                         "compile competes with the host side of the timed steps)")
    ap.add_argument("--quick", action="store_true", help="leave out the _nozero variants")
    ap.add_argument("--extras", default=",".join(EXTRAS),
                    help="the suffixed whole-step variants to run, of " + ", ".join(EXTRAS) +
                         " (comma-separated; default all; empty: ss_step_five and ss_step_one only)")
    ap.add_argument("--trace-dir", default="",
                    help="also write gated timelines of the MLP 784 and gpt_text steps here")
    ap.add_argument("--profile-dir", default="",
                    help="after each timed whole-step variant (streamsched's step captures and the strongest peers), "
                         "profile 20 more steps with CUPTI and write the per-kernel table to DIR/<model>_<variant>.json "
                         "(benchmarks/kernel_profile.py)")
    args = ap.parse_args()
    unknown = sorted({e for e in args.extras.split(",") if e} - set(EXTRAS))
    if unknown:
        ap.error(f"--extras: unknown variant(s) {', '.join(unknown)}; the variants are {', '.join(EXTRAS)}")
    if args.profile_dir:
        os.environ[PROFILE_ENV] = os.path.abspath(args.profile_dir)  # the peer processes inherit it
    args.compile_spent = 0.0
    if args.compile_budget <= 0:
        args.compile_spent = 1.0  # torch_compile (reduce-overhead) skipped: its budget is spent
    sys.path.insert(0, os.path.join(ROOT, "src"))
    out = run(args)
    if args.json:
        _write_json(args.json, out)
    md = markdown(out)
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        sys.path.insert(0, os.path.join(ROOT, "src"))
        _peer_main(sys.argv[2:])
    else:
        main()
