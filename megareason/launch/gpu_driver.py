"""Can this node's NVIDIA driver run the CUDA that the image (or the installed torch) was built for?

A CUDA build needs a driver at least as new as its toolkit's first release (the CUDA release notes, "CUDA
Toolkit and Corresponding Driver Versions"): CUDA 13.0, the GPU image's (``containers/base-image``), needs
R580 or newer. Below that the NVIDIA container runtime refuses the image ("nvidia-container-cli:
requirement error: unsatisfied condition: cuda>=13.0"), and outside a container the first CUDA call fails
("The NVIDIA driver on your system is too old"), minutes into a job, after Ray and the workers started.

* The driver: ``nvidia-smi --query-gpu=driver_version --format=csv,noheader``, else the kernel module's
  ``/proc/driver/nvidia/version``. Neither (a node without GPUs): said so, and the check passes.
* The CUDA needed: the image's ``NVIDIA_REQUIRE_CUDA`` (``cuda>=13.0 brand=...``), else ``CUDA_VERSION``
  (both set by NVIDIA's CUDA images), else the CUDA the installed torch was built for (none for a CPU build:
  nothing to check).

``NVIDIA_REQUIRE_CUDA``'s ``brand=...,driver>=535,driver<536`` alternatives admit older data-center drivers
through CUDA's forward-compatibility libraries; megareason's image is not built or tested for that, so they
are not counted: a driver below the minimum fails here.

``megareason node-check`` reports it on every node of a Slurm job; ``python -m megareason.launch.gpu_driver``
prints the one line and exits 1 when the driver is too old (``containers/check.sh``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# CUDA (major, minor) -> the oldest Linux x86_64 driver of that toolkit's first release.
MIN_DRIVER: dict[tuple[int, int], tuple[int, ...]] = {
    (12, 0): (525, 60, 13), (12, 1): (530, 30, 2), (12, 2): (535, 54, 3), (12, 3): (545, 23, 6),
    (12, 4): (550, 54, 14), (12, 5): (555, 42, 2), (12, 6): (560, 28, 3), (12, 8): (570, 26),
    (12, 9): (575, 51, 3), (13, 0): (580, 65, 6),
}
_VERSION = re.compile(r"(?<![\d.])(\d{3,4})\.(\d{1,3})(?:\.(\d{1,3}))?(?![\d.])")


def parse_driver_version(text: str) -> tuple[int, ...] | None:
    """The driver version in ``nvidia-smi --query-gpu=driver_version --format=csv,noheader``'s output (one
    line per GPU) or in ``/proc/driver/nvidia/version`` (its ``NVRM version`` line; the GCC line below it is
    not the driver's). None when there is none."""
    lines = [ln for ln in text.splitlines() if "NVRM" in ln] or text.splitlines()
    found = [tuple(int(g) for g in m.groups() if g is not None) for ln in lines for m in [_VERSION.search(ln)] if m]
    return min(found) if found else None  # GPUs of one node share the driver; the oldest decides anyway


def parse_cuda_requirement(text: str) -> tuple[int, int] | None:
    """The CUDA version an image needs: from ``NVIDIA_REQUIRE_CUDA`` (``cuda>=13.0 brand=...``) or a plain
    version (``CUDA_VERSION=13.0.0``, torch's ``13.0``). None when it names none."""
    m = re.search(r"(?:^|\s)cuda>=(\d+)\.(\d+)", text) or re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)*\s*", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def shown(version: tuple[int, ...]) -> str:
    return ".".join(f"{v:02d}" if i else str(v) for i, v in enumerate(version))


def decide(driver: tuple[int, ...] | None, cuda: tuple[int, int] | None, cuda_source: str) -> tuple[str, str | None]:
    """(the report's line, an error or None) for this node's ``driver`` (None: no NVIDIA driver) and the CUDA
    version needed (None: no CUDA build here), named by ``cuda_source``."""
    if driver is None:
        return "NVIDIA driver: none on this node (no GPUs): not checked", None
    if cuda is None:
        return f"NVIDIA driver {shown(driver)}; no CUDA build to run here ({cuda_source}): not checked", None
    need = MIN_DRIVER.get(cuda)
    where = f"CUDA {cuda[0]}.{cuda[1]} ({cuda_source})"
    if need is None:
        known = max(MIN_DRIVER)
        return (f"NVIDIA driver {shown(driver)}, {where}: this check knows the drivers of CUDA 12.0 to "
                f"{known[0]}.{known[1]} only (megareason/launch/gpu_driver.py): not checked"), None
    if driver < need:
        return (f"NVIDIA driver {shown(driver)}, {where} needs {shown(need)} or newer",
                f"the NVIDIA driver {shown(driver)} is too old for {where}: it needs R{need[0]} ({shown(need)}) or "
                f"newer; CUDA fails to start on this node (update the driver, or use nodes that have R{need[0]}+)")
    return f"NVIDIA driver {shown(driver)}, {where} needs {shown(need)} or newer: ok", None


def driver_version_text() -> str:
    """What this machine says of its driver: nvidia-smi's query, else the kernel module's version file; ""
    when neither is here."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and parse_driver_version(out.stdout):
                return out.stdout
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        return Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return ""


def cuda_requirement(env: dict[str, str]) -> tuple[tuple[int, int] | None, str]:
    """(the CUDA version needed, where it comes from): the image's variables, else torch's build."""
    for name in ("NVIDIA_REQUIRE_CUDA", "CUDA_VERSION"):
        if env.get(name) and (cuda := parse_cuda_requirement(env[name])):
            return cuda, f"{name}={env[name].split()[0]}"
    version = _torch_cuda()
    return (parse_cuda_requirement(version) if version else None), f"torch built for CUDA {version or 'none'}"


def _torch_cuda() -> str | None:
    """The CUDA version the installed torch was built for, read from torch/version.py without importing
    torch (seconds per node otherwise)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(spec.submodule_search_locations[0]) / "version.py").read_text()
    except OSError:
        return None
    m = re.search(r"^cuda(?::[^=]*)?=\s*'([\d.]+)'", text, re.M)
    return m.group(1) if m else None


def check(env: dict[str, str] | None = None, driver_text: str | None = None) -> tuple[str, str | None]:
    """This node's line and error (``decide``); ``env`` and ``driver_text`` default to this machine's."""
    env = dict(os.environ) if env is None else env
    driver_text = driver_version_text() if driver_text is None else driver_text
    return decide(parse_driver_version(driver_text), *cuda_requirement(env))


def main() -> int:
    line, error = check()
    print(line)
    if error:
        print(f"error: {error}", file=sys.stderr)
    return 1 if error else 0


if __name__ == "__main__":
    raise SystemExit(main())
