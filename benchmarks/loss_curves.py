"""The loss curves the divergence rule is tested on (tests/data/loss_curves.json): every example
trained on the CPU backend, noisy runs at high constant rates that still learn, and runs whose
rate grows each epoch until they collapse.  tests/test_run_safety_run.py replays the rule
(train.divergence) over them: it must never fire on the first two kinds, and must fire on the
first collapsed epoch of the third.

    python benchmarks/loss_curves.py                 # trains them all (a few minutes on 2 cores)
    python benchmarks/loss_curves.py --logs DIR      # build the file from logs in DIR (NAME.jsonl)

Each curve is the run's JSON-lines log cut to epoch, train_loss, test_loss, test_acc and lr.  The
collapse runs stop at X010 (exit status 1); their log ends at the epoch that stopped them, under
the rule of the streamsched that made them (the first file was made with the rule before this
one, which stopped a few epochs later: the curves then hold every epoch up to that stop).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = ("mlp_digits", "explicit_mlp", "five_streams", "inplace_backward", "swish_mlp", "resnet_digits",
            "resnet_digits_amp", "resnet_lars", "seed_step")
SHORT = ("epochs   = 40", "epochs   = 4"), ("cosine(0.1, warmup = 50)", "cosine(0.1, warmup = 5)")
VARIANTS = {  # name -> (lr line, epochs) on mlp_digits with a 5-step warmup
    "noisy:constant(0.3)": ("0.3", 40),
    "noisy:constant(0.5)": ("0.5", 40),
    "collapse:step(0.01, every = 11, gamma = 2)": ("step(0.01, every = 11, gamma = 2)", 25),
    "collapse:step(0.02, every = 11, gamma = 1.5)": ("step(0.02, every = 11, gamma = 1.5)", 30),
}
KEYS = ("epoch", "train_loss", "test_loss", "test_acc", "lr")


def _file(name: str) -> str:
    return name.replace(":", "_").replace(" ", "").replace("(", "_").replace(")", "").replace(",", "_") \
        .replace("=", "")


def _variant(folder: str, name: str) -> str:
    lr, epochs = VARIANTS[name]
    with open(os.path.join(ROOT, "examples", "mlp_digits.sched"), encoding="utf-8") as f:
        text = f.read()
    text = text.replace("epochs   = 40", f"epochs   = {epochs}").replace("cosine(0.1, warmup = 50)", lr)
    path = os.path.join(folder, _file(name) + ".sched")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _train(sched: str, log: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + ROOT)
    subprocess.run([sys.executable, "-m", "streamsched", "run", sched, "--backend", "cpu", "-q", "--log", log],
                   env=env, cwd=ROOT, capture_output=True, timeout=1800)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--logs", help="read NAME.jsonl from this folder instead of training")
    ap.add_argument("-o", "--output", default=os.path.join(ROOT, "tests", "data", "loss_curves.json"))
    args = ap.parse_args()
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in EXAMPLES + tuple(VARIANTS):
            log = os.path.join(args.logs or tmp, _file(name) + ".jsonl")
            if not args.logs:
                sched = os.path.join(ROOT, "examples", name + ".sched") if name in EXAMPLES else _variant(tmp, name)
                _train(sched, log)
            with open(log, encoding="utf-8") as f:
                curves[name] = [{k: r[k] for k in KEYS if k in r} for r in map(json.loads, f.read().splitlines())]
            print(f"{name}: {len(curves[name])} epochs", file=sys.stderr)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"made_by": "benchmarks/loss_curves.py (CPU backend)", "curves": curves}, f, indent=0)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
