#!/usr/bin/env bash
# The GPU machine's checks (docs/benchmarks.md, "On a GPU"), run there in the repo root:
#     OUT=/tmp/gpu-out bash bench/gpu_check.sh [tiny|stash|smol]
# tiny (default): the `cuda` tests, the tiny policies' tokens/s at bf16 and one study cell's run
#   profile (≈ 6.5 min on an H200).
# smol: SmolLM2-135M (issue 59): the model folder rebuilt from its GGUF, the `cuda` tests with it
#   (tests/cuda/test_smol_cuda.py) and a short `gtr train configs/ezpoints-smol-gpu.toml`.
# stash: nothing but keeping what this call carried.
# Whatever a call carries in .gpu/ (bench/gpu_pack.sh fills it here: the project's wheels the
# machine's python lacks, the GGUF in parts) is kept in /tmp/gtr-gpu for the later calls to the
# same warm machine; the wheels are installed once into /tmp/site.
set -uo pipefail
STAGE=${1:-tiny}
OUT=${OUT:-/tmp/gpu-out}
KEEP=/tmp/gtr-gpu
mkdir -p "$OUT" "$KEEP"
export PYTHONUNBUFFERED=1
if [ -d .gpu ]; then cp -f .gpu/* "$KEEP"/ 2>/dev/null; fi
ls -l "$KEEP" > "$OUT/kept.txt"
if [ -d .whl ]; then cp -f .whl/*.whl "$KEEP"/ 2>/dev/null; fi
if compgen -G "$KEEP/*.whl" > /dev/null; then
    if [ ! -f /tmp/site/.installed ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$KEEP"/*.whl || exit 1
        touch /tmp/site/.installed
    fi
    export PYTHONPATH=/tmp/site
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)"
  nproc; } 2>&1 | tee "$OUT/machine.txt"

tiny() {
    timeout 300 python3 -m pytest -m cuda tests/cuda/test_cuda.py -v -p no:cacheprovider \
        -o addopts="" 2>&1 | tee "$OUT/cuda_tests.txt" | grep -E "PASS|FAIL|ERROR|passed|failed|error"
    timeout 150 python3 bench/gpu_bench.py --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.txt"
    timeout 240 python3 bench/run_profile.py --arms gtr,rl4vlm --updates 4 --json "$OUT/profile.json" \
        2>&1 | tee "$OUT/profile.txt"
}

smol() {
    local gguf="$KEEP/smol.gguf" model=gtr-data/models/smollm2-135m-idefics3
    if ! compgen -G "$KEEP/smol.gguf.part-*" > /dev/null; then
        echo "no GGUF parts in $KEEP: carry bench/gpu_pack.sh's bundles first"; return 1
    fi
    cat "$KEEP"/smol.gguf.part-* > "$gguf"
    (cd "$KEEP" && sha256sum -c smol.gguf.sha256) || { echo "GGUF parts missing"; return 1; }
    python3 -m services.cli model init-pretrained "$model" --gguf "$gguf" --force 2>&1 \
        | grep -v "GGUF tensors" | tee "$OUT/smol_build.txt"
    GTR_SMOL_GGUF="$gguf" timeout 200 python3 -m pytest -m cuda tests/cuda/test_smol_cuda.py -v \
        -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/smol_cuda_tests.txt" \
        | grep -E "PASS|FAIL|ERROR|passed|failed|error"
    rm -rf /tmp/smol-data
    local timed=(); [ -x /usr/bin/time ] && timed=(/usr/bin/time -v)
    GTR_DATA_DIR=/tmp/smol-data timeout 300 "${timed[@]}" python3 -m services.cli train \
        configs/ezpoints-smol-gpu.toml > "$OUT/smol_train.txt" 2>&1
    echo "gtr train exit $?"; grep -E "update [0-9]+ done|completed|Maximum resident|Elapsed" \
        "$OUT/smol_train.txt"
    python3 bench/run_figures.py /tmp/smol-data 2>&1 | tee "$OUT/smol_figures.txt"
}

case "$STAGE" in
    tiny) tiny ;;
    smol) smol ;;
    stash) echo "kept: $(ls "$KEEP" | tr '\n' ' ')" ;;
    *) echo "usage: bash bench/gpu_check.sh [tiny|stash|smol]"; exit 2 ;;
esac
