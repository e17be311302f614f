#!/usr/bin/env bash
# The wheels tools/check_gpu.py needs on a bare GPU image (Python 3.12, torch + CUDA, transformers,
# safetensors and numpy already there, no network): downloaded here into .whl/ at the versions
# pyproject.toml pins. On the GPU machine, from the repository's root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 tools/check_gpu.py --out gpu_check.json
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for pkg in megatron-core==0.16.1 transformers==5.19.0 hydra-core==1.3.8 omegaconf==2.3.1 math-verify==0.9.0 \
           latex2sympy2_extended==1.11.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$pkg"
done
# hydra's parser runtime is published as a source archive only: built here (pure Python)
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls .whl
