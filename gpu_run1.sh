#!/usr/bin/env bash
# GPU session call 1: install, CUDA tests, examples on the GPU.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/gpu.txt 2>&1
python3 -c "import cupy, numpy, sympy, torch; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'sympy', sympy.__version__, 'torch', torch.__version__); import cuda.bindings; print('cuda-bindings', cuda.bindings.__version__)" >> $OUT/gpu.txt 2>&1
timeout 330 python3 -m pytest -q -m cuda tests/ -p no:cacheprovider -x -q 2>&1 | tail -60 > $OUT/cuda_tests.txt
for f in mlp_digits swish_mlp seed_step; do
  timeout 60 python3 -m streamsched run examples/$f.sched --backend cuda -q 2>&1 | tail -3 > $OUT/run_$f.txt
done
cat $OUT/gpu.txt; tail -15 $OUT/cuda_tests.txt; tail -2 $OUT/run_*.txt
