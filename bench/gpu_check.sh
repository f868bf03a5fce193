#!/usr/bin/env bash
# The GPU machine's checks, in one call (docs/benchmarks.md, "On a GPU"): the `cuda` tests, the
# tiny policies' tokens/s at bf16, and one study cell's run profile. On a machine whose python
# lacks the project's pure-Python dependencies, carry them as wheels in .whl/ (device README).
#     OUT=/tmp/gpu-out bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)"
  nproc; } 2>&1 | tee "$OUT/machine.txt"
timeout 300 python3 -m pytest -m cuda tests/cuda -v -p no:cacheprovider -o addopts="" 2>&1 \
    | tee "$OUT/cuda_tests.txt" | grep -E "PASS|FAIL|ERROR|passed|failed|error" 
timeout 150 python3 bench/gpu_bench.py --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.txt"
timeout 240 python3 bench/run_profile.py --arms gtr,rl4vlm --updates 4 --json "$OUT/profile.json" \
    2>&1 | tee "$OUT/profile.txt"
