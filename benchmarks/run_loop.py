"""`streamsched run` at graph speed (issue 13): the training loop users run, against the captured
step's own GPU time measured in the same process, and against the same training written as a
PyTorch user writes it.

    python benchmarks/run_loop.py [--json benchmarks/results/h200.json] [--models mlp_digits,seed_step]
                                  [--torch mlp_digits,resnet_digits] [--epochs N] [--data-on host,device]

For each streamsched model (an example file, trained as `streamsched run` trains it, on the CUDA
backend, in this process), once per mode (`--data-on`: the first mode's figures at the top level of
the row, each other mode's under `<mode>_data`, e.g. `device_data`, `device_step_data`):
  data_on           where the training set was: host (staged into pinned slots every step) or
                    device (uploaded once, each batch gathered on the GPU by the step itself)
  eval_on           where the test split was evaluated (device: one captured graph per batch)
  run_us_per_step   the loop's steady-state wall time per training step: from the first issue of
                    the second epoch to the read of the last epoch's end, every epoch boundary
                    included, the evaluation's device time taken out (TrainResult.steady)
  cpu_us_per_step   host CPU time (time.process_time, every thread) per step over the same span
  epoch_launches    launches of the epoch graph, each of one or more whole epochs (mode `device`)
  eval_s            seconds spent evaluating, all epochs
  first_step_s      seconds from compile_file to the first step (compile, data, backend, capture)
  run_wall_s        the whole run: first step to the end (TrainResult.wall_s); train_call_s: the
                    whole train() call (setup included)
  step_us           the captured step's GPU time: the same compiled plan, its steady-state
                    segments replayed 300 times (5 repetitions, median) with the host's staging
                    left out (benchmarks/step_time.py `ss_variant(..., replay_only=True)`)
  ratio             run_us_per_step / step_us (target: at most 1.10), per data mode
  test_acc          the run's final test accuracy
For each PyTorch model (--torch): the same model, data split, batches (streamsched's epoch order),
initial weights, optimizer and learning-rate schedule, in a loop over device tensors (no
DataLoader): `eager` and `graph` (the whole step captured with torch.cuda.graph, the batch
gathered inside it from a static index tensor, the learning rate a device tensor), each reading
the loss once per epoch; wall-clock per step, host CPU per step, of the whole run, and test
accuracy.  seed_step (f16 CNN with LARS and a dynamic loss scale) has no PyTorch twin here;
resnet_digits (the f32 CNN) is its PyTorch comparison.
Figures go under `run_loop.<model>` of the JSON (merged into an existing file).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
EXAMPLES = os.path.join(ROOT, "examples")


def _ss_run(c, epochs: int | None, mode: str) -> dict:
    """One `streamsched run` of compiled `c` on the CUDA backend: mode `host` (--data-on host),
    `device` (--data-on device: whole epochs in one launch where the driver can) or
    `device-step` (--data-on device --epoch-launch step)."""
    from streamsched.interp.train import TrainOptions, train

    data_on, launch = (mode.split("-") + ["auto"])[:2]
    notes: list[str] = []
    t0 = time.perf_counter()
    res = train(c, TrainOptions(backend="cuda", epochs=epochs, progress=False, data_on=data_on, epoch_launch=launch),
                base_dir=EXAMPLES, echo=notes.append)
    return {"data_on": res.data_on, "eval_on": res.eval_on, "epoch_launch": launch,
            "epoch_launches": res.epoch_launches, "notes": notes,
            "loop_cpu_s": {k: round(v, 4) for k, v in res.loop_cpu_s.items()},
            "run_us_per_step": round(res.steady_us_per_step, 1),
            "cpu_us_per_step": round(res.steady_cpu_us_per_step, 1),
            "eval_s": round(res.eval_s, 3), "first_step_s": round(res.first_step_s, 3),
            "run_wall_s": round(res.wall_s, 3), "train_call_s": round(time.perf_counter() - t0, 3),
            "steps": res.steps, "epochs": len(res.history),
            "test_acc": res.history[-1].get("test_acc") if res.history else None,
            "train_loss": res.history[-1].get("train_loss") if res.history else None}


def run_streamsched(name: str, epochs: int | None, data_modes=("host", "device")) -> dict:
    """The model's `streamsched run` once per data mode (the first one's figures at the top level,
    the others under `<mode>_data`), and the captured step's GPU time, same plan, same process."""
    from streamsched.interp.train import init_params
    from streamsched.pipeline import compile_file
    from step_time import ss_variant

    path = os.path.join(EXAMPLES, f"{name}.sched")
    t0 = time.perf_counter()
    c = compile_file(path)
    compile_s = time.perf_counter() - t0
    out: dict = {}
    for i, mode in enumerate(data_modes):
        row = _ss_run(c if i == 0 else compile_file(path), epochs, mode)
        row["first_step_s"] = round(row["first_step_s"] + compile_s, 3)  # from the command: compile too
        if i == 0:
            out.update(row)
        else:
            out[f"{mode.replace('-', '_')}_data"] = row
    from streamsched.interp.data import load_dataset
    from streamsched.interp.train import _call, _fit_samples, _input_names
    from streamsched.dsl.resolve import CallValue

    prog = c.program
    m = prog.model
    tv = dict(prog.train)
    dname, dargs, dkw = _call(tv.get("data", CallValue("digits", (), ())), "digits")
    ds = load_dataset(dname, dargs, dkw, base_dir=EXAMPLES)
    feat, lab = _input_names(prog)
    in_shape = next(s for n, s, _ in m.inputs if n == feat)
    in_dtype = next(d for n, _, d in m.inputs if n == feat)
    ds = _fit_samples(ds, in_shape)
    xb = ds.x_train[:m.batch].astype(np.float16 if in_dtype == "f16" else np.float32)
    yb = ds.y_train[:m.batch].astype(np.int32)
    spec = {"x": xb, "y": yb, "lr": 0.05}
    init = init_params(prog, 0)
    args = SimpleNamespace(check_steps=5, warmup=30, reps=5, steps=300)
    step = ss_variant(path, c.schedule.capture, spec, init, args, replay_only=True)
    out["step_us"] = step.get("gpu_us")
    out["step_host_us"] = step.get("host_us")
    for row in [out] + [v for k, v in out.items() if k.endswith("_data") and isinstance(v, dict)]:
        row["ratio"] = round(row["run_us_per_step"] / out["step_us"], 3) if out.get("step_us") else None
    return out


# -- PyTorch, as its users write the same training ------------------------------------------------

def torch_loop(name: str, variant: str, epochs: int | None) -> dict:
    import torch
    import torch.nn.functional as F

    from streamsched.dsl.resolve import CallValue
    from streamsched.interp.data import Batches, load_dataset
    from streamsched.interp.lr import make_schedule
    from streamsched.interp.train import _call, _fit_samples, _input_names, init_params
    from streamsched.pipeline import compile_file
    from step_time import load_resnet, torch_model, torch_resnet

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda"
    path = os.path.join(EXAMPLES, f"{name}.sched")
    c = compile_file(path)
    prog = c.program
    m = prog.model
    tv = dict(prog.train)
    epochs = epochs or int(tv.get("epochs", 10))
    dname, dargs, dkw = _call(tv.get("data", CallValue("digits", (), ())), "digits")
    ds = load_dataset(dname, dargs, dkw, base_dir=EXAMPLES)
    feat, _ = _input_names(prog)
    in_shape = next(s for n, s, _ in m.inputs if n == feat)
    ds = _fit_samples(ds, in_shape)
    seed = int(tv.get("seed", 0))
    batches = Batches(ds.x_train, ds.y_train, m.batch, seed)
    spe = batches.steps_per_epoch
    lname, largs, lkw = _call(tv.get("lr", 0.1), "constant")
    sched = make_schedule(lname, largs, lkw, epochs * spe)
    init = init_params(prog, seed)
    t_start = time.perf_counter()
    if name.startswith("resnet"):
        model = torch_resnet(init, dev, dropout=0.1)
        load_resnet(model, init)
        x_all = torch.tensor(ds.x_train.reshape(-1, 8, 8, 1), device=dev).permute(0, 3, 1, 2).contiguous()
        x_test = torch.tensor(ds.x_test.reshape(-1, 8, 8, 1), device=dev).permute(0, 3, 1, 2).contiguous()
        wd = 1e-4
    else:
        layers = [("h1.w", "h1.b"), ("h2.w", "h2.b"), ("logits.w", "logits.b")]
        model = torch_model(init, layers, dev)
        x_all = torch.tensor(ds.x_train, device=dev, dtype=torch.float32)
        x_test = torch.tensor(ds.x_test, device=dev, dtype=torch.float32)
        wd = 0.0
    y_all = torch.tensor(ds.y_train, device=dev, dtype=torch.long)
    # The learning rate is a device tensor (it changes every step, and a captured step reads it
    # when it runs); torch's SGD takes a tensor rate in its fused implementation.
    lr_t = torch.tensor(sched(0), device=dev, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=lr_t, momentum=0.9, weight_decay=wd, fused=True)
    idx = torch.zeros(m.batch, dtype=torch.long, device=dev)
    loss_sum = torch.zeros((), device=dev)

    def step():
        xb = x_all.index_select(0, idx)
        yb = y_all.index_select(0, idx)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        loss_sum.add_(loss.detach())

    run = step
    if variant == "graph":
        idx.copy_(torch.arange(m.batch, device=dev))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        load_state = init  # warm-up steps moved the weights: start again from the initial ones
        if name.startswith("resnet"):
            load_resnet(model, load_state)
        else:
            with torch.no_grad():
                for lin, (w, b) in zip([mm for mm in model if isinstance(mm, torch.nn.Linear)], layers):
                    lin.weight.copy_(torch.tensor(np.ascontiguousarray(init[w].T), device=dev))
                    lin.bias.copy_(torch.tensor(init[b], device=dev))
        for st in opt.state.values():
            if "momentum_buffer" in st and st["momentum_buffer"] is not None:
                st["momentum_buffer"].zero_()
        run = g.replay
    torch.cuda.synchronize()
    first_step_s = time.perf_counter() - t_start
    step_time = []
    step_cpu = []
    k = 0
    for e in range(epochs):
        order = torch.tensor(batches.order(e), device=dev, dtype=torch.long)
        loss_sum.zero_()
        t0 = time.perf_counter()
        c0 = time.process_time()
        for i in range(spe):
            idx.copy_(order[i * m.batch:(i + 1) * m.batch])
            if isinstance(opt.param_groups[0]["lr"], torch.Tensor):
                opt.param_groups[0]["lr"].fill_(float(sched(k)))
            else:
                opt.param_groups[0]["lr"] = float(sched(k))
            run()
            k += 1
        mean_loss = float(loss_sum) / spe  # the one read of the epoch
        step_time.append(time.perf_counter() - t0)
        step_cpu.append(time.process_time() - c0)
        if not math.isfinite(mean_loss):
            break
    model.eval()
    with torch.no_grad():
        acc = float((model(x_test).argmax(1).cpu().numpy() == ds.y_test).mean())
    wall = time.perf_counter() - t_start
    steady = step_time[1:] or step_time
    steady_cpu = step_cpu[1:] or step_cpu
    return {"us_per_step": round(1e6 * sum(steady) / (len(steady) * spe), 1),
            "cpu_us_per_step": round(1e6 * sum(steady_cpu) / (len(steady_cpu) * spe), 1), "wall_s": round(wall, 3),
            "first_step_s": round(first_step_s, 3), "test_acc": acc, "train_loss": mean_loss, "epochs": epochs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--models", default="mlp_digits,seed_step")
    ap.add_argument("--torch", default="mlp_digits,resnet_digits")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--data-on", default="host,device,device-step",
                    help="streamsched's modes, the first one at the top level of each row: host, device (whole "
                         "epochs in one launch), device-step (device data, steps launched one by one)")
    args = ap.parse_args()
    modes = tuple(m for m in args.data_on.split(",") if m)
    out: dict = {}
    for name in [n for n in args.models.split(",") if n]:
        try:
            out[name] = run_streamsched(name, args.epochs, modes)
        except Exception as exc:  # report, go on with the others
            import traceback

            traceback.print_exc()
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, json.dumps(out[name]), flush=True)
    for name in [n for n in args.torch.split(",") if n]:
        row = out.setdefault(name, {})
        for variant in ("eager", "graph"):
            try:
                row[f"torch_{variant}"] = torch_loop(name, variant, args.epochs)
            except Exception as exc:
                row[f"torch_{variant}"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(name, variant, json.dumps(row[f"torch_{variant}"]), flush=True)
        if name not in (args.models.split(",")):
            try:
                row.update(run_streamsched(name, args.epochs, modes))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            print(name, json.dumps(row), flush=True)
    if args.json:
        data = {}
        if os.path.exists(args.json):
            with open(args.json, encoding="utf-8") as f:
                data = json.load(f)
        data.setdefault("run_loop", {}).update(out)
        tmp = args.json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
