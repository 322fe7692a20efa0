#!/usr/bin/env bash
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src:$PWD:$PWD/tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
timeout 200 python3 -m pytest -q -m cuda tests/test_cuda_run_loop.py tests/test_kernel_lang_cuda.py "tests/test_cuda_training.py::test_mixed_precision_on_cuda_follows_the_cpu" -p no:cacheprovider 2>&1 | tail -30 > $OUT/tests3.txt
cp benchmarks/results/h200.json $OUT/h200.json
timeout 300 python3 benchmarks/run_loop.py --json $OUT/h200.json 2>&1 | tail -30 > $OUT/run_loop.txt
for f in mlp_digits seed_step; do timeout 60 python3 -m streamsched run examples/$f.sched --backend cuda -q > $OUT/run_$f.txt 2>&1; done
tail -3 $OUT/tests3.txt; cat $OUT/run_loop.txt; cat $OUT/run_*.txt
