#!/usr/bin/env bash
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src:$PWD:$PWD/tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
timeout 400 python3 -m pytest -q -m cuda tests/ -p no:cacheprovider -q --deselect tests/test_cuda_training.py::test_mixed_precision_on_cuda_follows_the_cpu 2>&1 | tail -80 > $OUT/cuda_tests2.txt
timeout 100 python3 - > $OUT/amp_diff.txt 2>&1 <<'PY'
import os, numpy as np
from streamsched.interp.train import TrainOptions, train
from streamsched.pipeline import compile_file
EX = "examples"
path = os.path.join(EX, "resnet_digits_amp.sched")
res = {}
for backend in ("cpu", "cuda"):
    c = compile_file(path, capture="step")
    res[backend] = train(c, TrainOptions(backend=backend, max_steps=20, progress=False), base_dir=EX)
cpu, cuda = res["cpu"], res["cuda"]
def rel(a, b):
    a = a.astype(np.float64); b = b.astype(np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
for n in sorted(cpu.params):
    print(n, cpu.params[n].dtype, round(rel(cuda.params[n], cpu.params[n]), 5))
print("loss", cpu.history[-1]["train_loss"], cuda.history[-1]["train_loss"])
PY
tail -5 $OUT/cuda_tests2.txt; cat $OUT/amp_diff.txt | head -70
