"""The GPT of examples/gpt_text.sched beside PyTorch: what the compiled file trains (`gpt_spec`:
the architecture, every layer norm's eps, AdamW's settings per parameter, the clipping), the
batches and learning rates a run of it sees (`run_batches`, `run_lr`), its steps issued through a
runner with the loss read after every step (`step_losses`), and its PyTorch twin (`torch_gpt`,
`torch_adamw`, `torch_clip_`, the timed variants), torch imported only inside those.

Used by tests/test_cuda_gpt_torch.py (50 steps against PyTorch, the loss at every step),
tests/test_gpt_twin.py (the torch-free parts, and the twin on the CPU when torch is there) and
benchmarks/step_time.py (`--models gpt_text`).  Run as a script it is the `torch_compile_graph`
variant of that benchmark in a process of its own, so that a compile which outlasts its budget
can be killed:

    python benchmarks/gpt_twin.py peer IN.npz OUT.json --steps 300 --reps 5 --warmup 30 --check-steps 20

The twin follows streamsched's documented kernel semantics, which are PyTorch's:
  embedding        tok.table [vocab, d] -> nn.Embedding.weight (as is)
  pos_embedding    h0.table [context, d] -> a Parameter added to every sequence (row r gets r % context)
  layernorm        gamma, beta -> nn.LayerNorm(d, eps).weight, .bias (biased variance, eps inside the sqrt)
  linear           w [in, out] -> nn.Linear.weight [out, in] (transposed), b -> .bias
  attention        q, k, v [b*t, d] split into heads of d / heads columns ([b, t, h, dh] -> [b, h, t, dh]),
                   softmax(q k^T / sqrt(dh), causal) v: F.scaled_dot_product_attention(is_causal=True)
                   or the same written out (masked_fill -inf, softmax, matmul)
  gelu             F.gelu(approximate="tanh")
  token_cross_entropy  F.cross_entropy over the [b*t, vocab] logits, mean over rows
  clip_scale + scale_grad  clip_grad_norm_(max_norm) (PyTorch's eps is 1e-6, clip_scale's default);
                   another eps is applied by hand with the same formula
  adamw_step       torch.optim.AdamW(betas, eps, weight_decay), one group per distinct setting:
                   w *= 1 - lr wd; m, v; w -= lr/(1-b1^t) m / (sqrt(v)/sqrt(1-b2^t) + eps)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TORCH_EPS = 1e-6
"""The eps torch.nn.utils.clip_grad_norm_ adds to the norm (fixed in PyTorch)."""


# -- what the file trains (no torch) -----------------------------------------------------------

def _defaults(kernel: str) -> dict:
    from streamsched.stdlib.kernels import KERNELS

    return dict(KERNELS[kernel].attrs)


def _attr(task, name: str):
    return task.attr(name, _defaults(task.kernel).get(name))


def torch_keys(spec: dict) -> list[tuple[str, str, bool]]:
    """(streamsched parameter, PyTorch parameter name, transposed) for every parameter of the
    twin, in the order of examples/gpt_text.sched's model lines: tok, h0, then per block i the
    layer norms n{i} / m{i}, the projections q/k/v/o{i}, the MLP f{i} / p{i}; nf and logits."""
    out = [("tok.table", "tok.weight", False), ("h0.table", "pos", False)]
    for i in range(1, spec["layers"] + 1):
        blk = f"blocks.{i - 1}"
        out += [(f"n{i}.gamma", f"{blk}.ln1.weight", False), (f"n{i}.beta", f"{blk}.ln1.bias", False)]
        for c, mod in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o")):
            out += [(f"{c}{i}.w", f"{blk}.{mod}.weight", True), (f"{c}{i}.b", f"{blk}.{mod}.bias", False)]
        out += [(f"m{i}.gamma", f"{blk}.ln2.weight", False), (f"m{i}.beta", f"{blk}.ln2.bias", False)]
        for c, mod in (("f", "fc"), ("p", "proj")):
            out += [(f"{c}{i}.w", f"{blk}.{mod}.weight", True), (f"{c}{i}.b", f"{blk}.{mod}.bias", False)]
    out += [("nf.gamma", "lnf.weight", False), ("nf.beta", "lnf.bias", False),
            ("logits.w", "head.weight", True), ("logits.b", "head.bias", False)]
    return out


def gpt_spec(compiled) -> dict:
    """The GPT a compiled gpt_text-style file trains, read from its program and one unrolled step:
    sizes (batch, context, vocab, width, heads, hidden, layers, classes), `ln_eps` (norm name ->
    eps), `adamw` (groups of parameters with one setting: beta1, beta2, eps, weight_decay), `clip`
    ({max_norm, eps} of clip_scale, or None), `lr` (the train block's schedule call), `lr_peak`,
    `epochs`, `seed`, `params` (the model's parameter names).  JSON-serialisable.

    Raises ValueError when the file is not that GPT: parameters other than the model lines of
    examples/gpt_text.sched name (`torch_keys`), dropout with p > 0 (masks differ between
    frameworks), an optimizer other than adamw or a parameter without it, clipping of only some
    gradients, attention with more than one heads/context setting."""
    program, sched = compiled.program, compiled.schedule
    if getattr(compiled, "fused", 0):  # read the tasks as written (the fusion pass folds adamw_step & co.)
        from streamsched.interp.unroll import unroll

        sched = unroll(program, steps=sched.steps)
    m = program.model
    if m is None:
        raise ValueError("the file has no model")
    shapes = {b.name: tuple(b.shape) for b in program.buffers}
    params = list(m.params)
    layers = 0
    while f"n{layers + 1}.gamma" in shapes:
        layers += 1
    step = [t for t in sched.tasks if t.step == 0]
    heads = {_attr(t, "heads") for t in step if t.kernel in ("attn_scores", "attn_grad_p", "attn_fused", "attn_fused_grad")}
    contexts = {_attr(t, "context") for t in step if t.kernel in ("attn_scores", "attn_grad_p", "attn_fused", "attn_fused_grad")}
    if len(heads) != 1 or len(contexts) != 1:
        raise ValueError(f"attention with heads {sorted(heads)} and context {sorted(contexts)}: the twin has one "
                         f"setting of each")
    for t in step:
        if t.kernel == "dropout" and float(_attr(t, "p")) > 0:
            raise ValueError(f"dropout p = {_attr(t, 'p')} at `{t.label}`: masks differ between frameworks; "
                             f"compare with p = 0")
    spec = {"batch": int(m.batch), "context": int(shapes["h0.table"][0]), "vocab": int(shapes["tok.table"][0]),
            "width": int(shapes["tok.table"][1]), "heads": int(heads.pop()), "layers": layers,
            "hidden": int(shapes["f1.w"][1]) if "f1.w" in shapes else 0,
            "classes": int(shapes["logits.w"][1]) if "logits.w" in shapes else 0, "params": params}
    if contexts.pop() != spec["context"]:
        raise ValueError(f"attention's context differs from the position table's {spec['context']} rows")
    want = [ss for ss, _, _ in torch_keys(spec)]
    if sorted(want) != sorted(params):
        raise ValueError(f"not the GPT of examples/gpt_text.sched: parameters missing "
                         f"{sorted(set(want) - set(params))}, extra {sorted(set(params) - set(want))}")
    spec["ln_eps"] = {}
    for t in step:
        if t.kernel == "layernorm":
            spec["ln_eps"][t.args[1].rsplit(".", 1)[0]] = float(_attr(t, "eps"))
    groups: dict[tuple, list[str]] = {}
    seen: set[str] = set()
    for t in step:
        if t.kernel in ("sgd_step", "adam_step", "lars_step", "amp_sgd_step", "amp_lars_step"):
            raise ValueError(f"`{t.label}` runs {t.kernel}: the twin's optimizer is AdamW")
        if t.kernel == "adamw_step" and t.args[0] in params:
            key = tuple(float(_attr(t, a)) for a in ("beta1", "beta2", "eps", "weight_decay"))
            groups.setdefault(key, []).append(t.args[0])
            seen.add(t.args[0])
    if seen != set(params):
        raise ValueError(f"parameters without adamw: {sorted(set(params) - seen)}")
    spec["adamw"] = [{"params": sorted(ps, key=params.index), "beta1": k[0], "beta2": k[1], "eps": k[2], "weight_decay": k[3]}
                     for k, ps in groups.items()]
    clip = [t for t in step if t.kernel == "clip_scale"]
    grads = {f"grad.{p}" for p in params}
    summed = {t.args[0] for t in step if t.kernel == "grad_sumsq"}
    scaled = {t.args[0] for t in step if t.kernel == "scale_grad"}
    if len(clip) > 1:
        raise ValueError("more than one clip_scale in a step")
    if clip and (summed != grads or scaled != grads):
        raise ValueError("clipping by global norm over some gradients only: the twin clips all of them")
    if not clip and (summed or scaled):
        raise ValueError("grad_sumsq / clip_grad_norm without clip_scale")
    spec["clip"] = {"max_norm": float(_attr(clip[0], "max_norm")), "eps": float(_attr(clip[0], "eps"))} \
        if clip else None
    tv = dict(program.train)
    spec["lr"] = _lr_call(program)
    a = spec["lr"]
    spec["lr_peak"] = float(a["args"][0]) if a["args"] else float(a["kwargs"].get("v", 0.1))
    spec["epochs"] = int(tv.get("epochs", 10))
    spec["seed"] = int(tv.get("seed", 0))
    return spec


def _lr_call(program) -> dict:
    """The train block's `lr = ...` as {name, args, kwargs} (a number is `constant(v)`; absent:
    the loop's default 0.1)."""
    lr = dict(program.train).get("lr", 0.1)
    if hasattr(lr, "name"):
        return {"name": lr.name, "args": list(lr.args), "kwargs": dict(lr.kwargs)}
    return {"name": "constant", "args": [float(lr)], "kwargs": {}}


def run_batches(compiled, base_dir: str, n: int, seed: int | None = None) -> tuple[list, int]:
    """The first n batches (x, y) a run of the compiled file trains on, in its order (epoch e's
    permutation of `Batches`, seed the train block's unless given), and its steps per epoch.
    x, y keep the data set's dtype (u8 for text); the staging casts them, as the loop does."""
    from streamsched.interp.data import Batches, load_dataset
    from streamsched.interp.train import setting_dir

    program = compiled.program
    m = program.model
    tv, spans = dict(program.train), dict(program.train_spans)
    v = tv.get("data")
    name, args, kwargs = (v.name, tuple(v.args), dict(v.kwargs)) if hasattr(v, "name") else (str(v), (), {})
    feat = next(nm for nm, _, _ in m.inputs if nm != m.labels)
    in_shape = next(s for nm, s, _ in m.inputs if nm == feat)
    ds = load_dataset(name, args, kwargs, base_dir=setting_dir(spans.get("data"), base_dir), span=spans.get("data"),
                      sample_shape=tuple(in_shape[1:]))
    b = Batches(ds.x_train, ds.y_train, m.batch, int(tv.get("seed", 0)) if seed is None else seed,
                epoch_samples=ds.epoch_samples)
    out: list = []
    e = 0
    while len(out) < n:
        order = b.order(e)
        for i in range(b.steps_per_epoch):
            if len(out) == n:
                break
            sel = order[i * b.batch:(i + 1) * b.batch]
            out.append((ds.x_train[sel], ds.y_train[sel]))
        e += 1
    return out, b.steps_per_epoch


def run_lr(compiled, steps_per_epoch: int):
    """The learning-rate schedule of a run of the file (its `lr` over epochs * steps_per_epoch
    steps, a warmup longer than that clipped), as the training loop plans it: step -> float."""
    from streamsched.interp.lr import make_schedule

    lr = _lr_call(compiled.program)
    epochs = int(dict(compiled.program.train).get("epochs", 10))
    return make_schedule(lr["name"], tuple(lr["args"]), dict(lr["kwargs"]), epochs * steps_per_epoch,
                         clip_warmup=True)


def step_losses(compiled, runner, init: dict, batches: list, lr_at, steps: int) -> list[float]:
    """Issue the prologue and `steps` steps of the compiled plan through `runner` (a CpuRunner or
    CudaRunner: run / write / last_loss), from the values `init`, staging what the training loop
    stages: batch j = step + the stage task's `ahead` (the last of `batches` past their end), the
    `lr` scalar lr_at(step), every other uploaded scalar (AdamW's t) step + 1.  Reads the loss
    after every step (a device synchronisation each: the loop itself reads once per epoch).
    Returns the `steps` losses, float."""
    from streamsched.interp.barriers import plan_segments

    m = compiled.program.model
    feat = next(nm for nm, _, _ in m.inputs if nm != m.labels)
    segs = compiled.segments or plan_segments(compiled.plan)
    for name, v in init.items():
        runner.write(name, v)

    def host_fn(task, arrays, step):
        if task.kernel == "stage":
            j = min(max(step + int(task.attr("ahead", 0)), 0), len(batches) - 1)
            xb, yb = batches[j]
            np.copyto(arrays[task.outs[0]], xb if task.attr("field") == feat else yb, casting="unsafe")
        elif task.kernel == "set_scalar":
            k = max(step, 0)
            arrays[task.outs[0]][...] = lr_at(k) if task.attr("name") == "lr" else float(k + 1)

    runner.run(segs.for_step(-1), functools.partial(host_fn, step=-1))
    out = []
    for k in range(steps):
        runner.run(segs.for_step(k), functools.partial(host_fn, step=k))
        out.append(float(runner.last_loss(m.loss)))
    return out


_FORKS = re.compile(r"(attention\.backward|layernorm\.backward)@(\w+)\.(\w+)$")
_PROJ = re.compile(r"linear@([qkv])(\d+)$")


def fork_overlaps(records: list[dict], step: int | None = None) -> dict:
    """How long the forked parts of one traced step (`streamsched.interp.cuda.trace` records:
    label, stream, start_us, end_us, step; default the last step) ran at the same time, in
    microseconds, per pair: the Q, K, V projection GEMMs of block i (`qkv{i}`: "k|q", ...),
    attention's backward of a{i} (dv, dp, ds, dk, dq) and each layer norm's backward (dx, dgamma,
    dbeta).  Also `streams` per group: how many streams its parts ran on."""
    if not records:
        return {}
    if step is None:
        step = max(r["step"] for r in records)
    groups: dict[str, dict[str, dict]] = {}
    for r in records:
        if r["step"] != step:
            continue
        body = (r.get("label") or "").split(": ", 1)[-1]
        mf, mp = _FORKS.search(body), _PROJ.search(body)
        if mf:
            groups.setdefault(mf.group(2), {})[mf.group(3)] = r
        elif mp and r.get("kernel", "matmul") == "matmul":
            groups.setdefault(f"qkv{mp.group(2)}", {})[mp.group(1)] = r
    out = {}
    for g, parts in sorted(groups.items()):
        names = sorted(parts)
        ov: dict[str, object] = {}
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                lo = max(parts[a]["start_us"], parts[b]["start_us"])
                hi = min(parts[a]["end_us"], parts[b]["end_us"])
                ov[f"{a}|{b}"] = round(max(0.0, hi - lo), 3)
        ov["streams"] = len({p["stream"] for p in parts.values()})
        out[g] = ov
    return out


# -- the PyTorch twin ----------------------------------------------------------------------------

def torch_gpt(spec: dict, init: dict, device, attention: str = "sdpa"):
    """The twin as an nn.Module on `device`, holding the values of `init` (streamsched's
    parameters, by `torch_keys`).  forward(x: int64 [b, context]) -> logits f32 [b*context,
    classes], rows in (sequence, position) order as streamsched's.  attention: "sdpa"
    (F.scaled_dot_product_attention, is_causal=True) or "explicit" (scores, -inf mask, softmax)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    if attention not in ("sdpa", "explicit"):
        raise ValueError(f"attention must be sdpa or explicit, got {attention!r}")
    d, h, t = spec["width"], spec["heads"], spec["context"]
    dh = d // h
    eps = spec["ln_eps"]

    class Block(nn.Module):
        def __init__(self, i: int):
            super().__init__()
            self.ln1 = nn.LayerNorm(d, eps=eps[f"n{i}"])
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
            self.ln2 = nn.LayerNorm(d, eps=eps[f"m{i}"])
            self.fc = nn.Linear(d, spec["hidden"])
            self.proj = nn.Linear(spec["hidden"], d)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(spec["vocab"], d)
            self.pos = nn.Parameter(torch.zeros(t, d))
            self.blocks = nn.ModuleList(Block(i) for i in range(1, spec["layers"] + 1))
            self.lnf = nn.LayerNorm(d, eps=eps["nf"])
            self.head = nn.Linear(d, spec["classes"])
            self.register_buffer("causal", torch.ones(t, t, dtype=torch.bool).tril(), persistent=False)

        def attend(self, q, k, v, b: int):
            def split(a):  # [b*t, d] -> [b, heads, t, dh]: head j is columns j*dh .. j*dh+dh-1
                return a.view(b, t, h, dh).transpose(1, 2)

            q, k, v = split(q), split(k), split(v)
            if attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                s = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(dh))
                y = torch.matmul(torch.softmax(s.masked_fill(~self.causal, float("-inf")), dim=-1), v)
            return y.transpose(1, 2).reshape(b * t, d)

        def forward(self, x):
            b = x.shape[0]
            hid = (self.tok(x) + self.pos).reshape(b * t, d)
            for blk in self.blocks:
                n = blk.ln1(hid)
                r = hid + blk.o(self.attend(blk.q(n), blk.k(n), blk.v(n), b))
                hid = r + blk.proj(F.gelu(blk.fc(blk.ln2(r)), approximate="tanh"))
            return self.head(self.lnf(hid))

    model = GPT()
    names = {n for n, _ in model.named_parameters()}
    keys = {k for _, k, _ in torch_keys(spec)}
    if names != keys:  # the mapping and the module agree, both ways
        raise AssertionError(f"twin parameters {sorted(names ^ keys)} unmapped")
    model = model.to(device)
    load_torch(model, spec, init)
    return model


def load_torch(model, spec: dict, init: dict) -> None:
    """streamsched's values into the twin, in place (linear weights transposed)."""
    import torch

    by = dict(model.named_parameters())
    with torch.no_grad():
        for ss, key, tr in torch_keys(spec):
            v = np.asarray(init[ss], dtype=np.float32)
            dst = by[key]
            if tuple(dst.shape) != (v.T.shape if tr else v.shape):
                raise ValueError(f"{ss} {v.shape} does not fit {key} {tuple(dst.shape)}")
            dst.copy_(torch.from_numpy(np.ascontiguousarray(v.T if tr else v)).to(dst.device))


def torch_params(model, spec: dict) -> list:
    """The twin's parameters in streamsched's parameter order."""
    by = dict(model.named_parameters())
    key = {ss: k for ss, k, _ in torch_keys(spec)}
    return [by[key[p]] for p in spec["params"]]


def torch_adamw(model, spec: dict, lr: float, **kw):
    """torch.optim.AdamW over the twin with streamsched's settings: one group per distinct
    (betas, eps, weight_decay) of the file's adamw calls; kw: foreach / fused / capturable."""
    import torch

    by = dict(model.named_parameters())
    key = {ss: k for ss, k, _ in torch_keys(spec)}
    groups = [{"params": [by[key[p]] for p in g["params"]], "betas": (g["beta1"], g["beta2"]), "eps": g["eps"],
               "weight_decay": g["weight_decay"]} for g in spec["adamw"]]
    return torch.optim.AdamW(groups, lr=lr, **kw)


def torch_clip_(params: list, clip: dict | None) -> None:
    """clip_scale + scale_grad: g *= min(1, max_norm / (||g||_2 over all + eps)), on the device;
    torch.nn.utils.clip_grad_norm_ when eps is PyTorch's own 1e-6, the same formula by hand else."""
    import torch

    if clip is None:
        return
    if clip["eps"] == TORCH_EPS:
        torch.nn.utils.clip_grad_norm_(params, clip["max_norm"])
        return
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coef = torch.clamp(clip["max_norm"] / (norm + clip["eps"]), max=1.0)
    torch._foreach_mul_(grads, coef)


def torch_loss(fwd, x, y):
    """Mean cross-entropy of the logits fwd(x) [b*t, classes] against y [b, t] flattened."""
    import torch.nn.functional as F

    return F.cross_entropy(fwd(x), y.reshape(-1))


def reset_torch(model, opt, spec: dict, init: dict) -> None:
    """Back to streamsched's initial values: parameters copied in place; every optimizer state
    tensor (m, v, and the step count) and every gradient zeroed in place (captured graphs keep
    their addresses)."""
    import torch

    load_torch(model, spec, init)
    with torch.no_grad():
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    v.zero_()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()


def torch_losses(spec: dict, init: dict, batches: list, lr_at, steps: int, device, attention: str = "sdpa") -> list:
    """The twin trained eagerly from `init` on `batches` (step k on batches[k]) with the learning
    rate lr_at(k) rounded to f32 (streamsched uploads an f32 scalar): per step zero_grad,
    forward, cross-entropy, backward, clipping, AdamW (foreach on CUDA).  Returns the loss of
    every step (before its update), float."""
    import torch

    model = torch_gpt(spec, init, device, attention)
    params = torch_params(model, spec)
    opt = torch_adamw(model, spec, float(np.float32(lr_at(0))))
    out = []
    for k in range(steps):
        xb, yb = batches[k]
        x = torch.from_numpy(np.asarray(xb, dtype=np.int64)).to(device)
        y = torch.from_numpy(np.asarray(yb, dtype=np.int64)).to(device)
        opt.zero_grad(set_to_none=True)
        loss = torch_loss(model, x, y)
        loss.backward()
        torch_clip_(params, spec["clip"])
        for g in opt.param_groups:
            g["lr"] = float(np.float32(lr_at(k)))
        opt.step()
        out.append(float(loss.detach()))
    return out


def time_cuda(step, steps: int, reps: int, warmup: int) -> dict:
    """GPU time per step (CUDA events around `steps` calls, median of `reps`) and host issue time
    per step, in microseconds; the keys of benchmarks/step_time.py's rows."""
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        e0.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        t1 = time.perf_counter()
        e1.record()
        e1.synchronize()
        gpu.append(e0.elapsed_time(e1) * 1e3 / steps)
        host.append((t1 - t0) * 1e6 / steps)
    return {"gpu_us": round(statistics.median(gpu), 2), "gpu_us_reps": [round(v, 2) for v in gpu],
            "host_us": round(statistics.median(host), 2), "host_us_reps": [round(v, 2) for v in host]}


def torch_eager(spec, init, x, y, lr, *, steps, reps, warmup, check_steps, device="cuda", check_only=False,
                attention="sdpa") -> dict:
    """PyTorch eager: zero_grad(set_to_none), forward, cross-entropy, backward, clip, AdamW
    (foreach).  The loss after `check_steps` steps from the initial values, then the timing."""
    model = torch_gpt(spec, init, device, attention)
    params = torch_params(model, spec)
    opt = torch_adamw(model, spec, lr, foreach=True)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch_loss(model, x, y)
        loss.backward()
        torch_clip_(params, spec["clip"])
        opt.step()
        return loss

    loss = None
    for _ in range(check_steps):
        loss = step()
    res = {"loss_after_check": float(loss.detach()),
           "note": f"nn.LayerNorm, {attention} attention, F.gelu(tanh), clip_grad_norm_, AdamW(foreach)"}
    if not check_only:
        res.update(time_cuda(step, steps, reps, warmup))
    return res


def torch_graph(spec, init, x, y, lr, *, steps, reps, warmup, check_steps, fused=False, compile_mode=None,
                device="cuda", check_only=False, attention="sdpa", before_timing=None) -> dict:
    """The whole step (forward, loss, backward, clip, AdamW(capturable), zero_grad(set_to_none=
    False)) captured in one torch.cuda.graph and replayed (PyTorch's whole-network capture);
    fused: AdamW(fused=True) instead of foreach; compile_mode: the model through
    torch.compile(mode=compile_mode) first (compiled by the warm-up, before the capture).
    The loss after `check_steps` replays from the initial values, then the timing (before_timing()
    called just before it: benchmarks/step_time.py's peers wait there for their turn on the GPU)."""
    import torch

    model = torch_gpt(spec, init, device, attention)
    params = torch_params(model, spec)
    fwd = torch.compile(model, mode=compile_mode) if compile_mode else model
    opt = torch_adamw(model, spec, lr, capturable=True, **({"fused": True} if fused else {"foreach": True}))

    def step():
        loss = torch_loss(fwd, x, y)
        loss.backward()
        torch_clip_(params, spec["clip"])
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    t0 = time.perf_counter()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(5):  # gradients, optimizer state, and the compile when asked
            wl = step()
        del wl
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    reset_torch(model, opt, spec, init)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_loss = step()
    torch.cuda.synchronize()
    reset_torch(model, opt, spec, init)  # capture runs nothing; be explicit
    torch.cuda.synchronize()
    for _ in range(check_steps):
        g.replay()
    res = {"loss_after_check": float(static_loss.detach()),
           "note": (f"torch.compile(model, mode={compile_mode!r}) " if compile_mode else "")
           + f"whole step in one torch.cuda.graph, AdamW(capturable, {'fused' if fused else 'foreach'}), "
             f"{attention} attention"}
    if compile_mode:
        res["compile_s"] = round(warm_s, 1)
    if not check_only:
        if before_timing is not None:
            before_timing()
        res.update(time_cuda(g.replay, steps, reps, warmup))
        from kernel_profile import kernel_profile, profile_dir
        if profile_dir():
            label = ("torch_compile_graph" if compile_mode else "torch_graph_fused" if fused else "torch_graph")
            t = kernel_profile(g.replay, 20, os.path.join(profile_dir(), f"gpt_text_{label}.json"), label)
            res["profile"] = {x: t[x] for x in ("kernels_per_step", "busy_us_per_step", "span_us_per_step")}
    return res


def peer_subprocess(spec: dict, init: dict, x: np.ndarray, y: np.ndarray, lr: float, *, steps, reps, warmup,
                    check_steps, budget_s: float, mode: str = "max-autotune-no-cudagraphs") -> dict:
    """The strongest PyTorch configuration (torch.compile(mode) of the twin inside a whole-step
    torch.cuda.graph, fused AdamW) run as `python gpt_twin.py peer` in a process of its own,
    killed with its whole process group (inductor's compile workers) after budget_s seconds:
    its result, or {"skipped": why}."""
    tmp = tempfile.mkdtemp(prefix="ss_gpt_peer_")
    inp, out = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.json")
    np.savez(inp, x=x, y=y, spec=np.array(json.dumps(spec)), **{f"init/{k}": v for k, v in init.items()})
    cmd = [sys.executable, os.path.abspath(__file__), "peer", inp, out, "--steps", str(steps), "--reps", str(reps),
           "--warmup", str(warmup), "--check-steps", str(check_steps), "--lr", repr(lr), "--mode", mode]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), HERE] + ([env["PYTHONPATH"]] if
                                                                             env.get("PYTHONPATH") else []))
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        p.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the child leads its own group: it and its compile workers
        p.wait()
        return {"skipped": f"did not finish within its budget of {budget_s:.0f} s (--peer-budget); "
                           f"killed after {time.perf_counter() - t0:.0f} s"}
    if not os.path.exists(out):
        return {"skipped": f"the peer process exited with status {p.returncode} and no result"}
    with open(out, encoding="utf-8") as f:
        res = json.load(f)
    shutil.rmtree(tmp, ignore_errors=True)
    res["process_s"] = round(time.perf_counter() - t0, 1)
    return res


def _peer_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="gpt_twin.py peer")
    ap.add_argument("inp")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--check-steps", type=int, default=20)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--mode", default="max-autotune-no-cudagraphs")
    ap.add_argument("--ready", default="", help="write this file once compiled and checked, then ...")
    ap.add_argument("--go", default="", help="... wait for this file before timing")
    a = ap.parse_args(argv)

    def turn():
        if a.ready:
            open(a.ready, "w").close()
            while a.go and not os.path.exists(a.go):
                time.sleep(0.1)
    try:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        z = np.load(a.inp)
        spec = json.loads(str(z["spec"]))
        init = {k[5:]: z[k] for k in z.files if k.startswith("init/")}
        x = torch.from_numpy(z["x"].astype(np.int64)).cuda()
        y = torch.from_numpy(z["y"].astype(np.int64)).cuda()
        res = torch_graph(spec, init, x, y, a.lr, steps=a.steps, reps=a.reps, warmup=a.warmup,
                          check_steps=a.check_steps, fused=True, compile_mode=a.mode, before_timing=turn)
    except Exception as exc:
        traceback.print_exc()
        res = {"skipped": f"{type(exc).__name__}: {str(exc)[:300]}"}
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(res, f)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        _peer_main(sys.argv[2:])
    else:
        raise SystemExit(__doc__)
