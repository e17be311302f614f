"""The hardware gates of ``megareason node-check`` (``launch/node_check.py``): a node that would fail the job
minutes later, after Ray and every worker started, is refused before Ray starts, naming what to fix.

* **GPUs**: ``nvidia-smi --query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total``: fewer GPUs than
  the job asks per node (``SLURM_GPUS_ON_NODE``, or ``--gpus``: a GPU that fell off the bus is still in Slurm's
  gres count), a GPU nvidia-smi cannot read ("Unable to determine the device handle"), or uncorrectable ECC
  errors since the driver loaded (the "Volatile Uncorr. ECC" column); ``nvidia-smi --query-remapped-rows=
  gpu_bus_id,remapped_rows.pending,remapped_rows.failure`` (Ampere and newer): a row remapping that waits for
  a GPU reset, or that failed (NVIDIA's "GPU Memory Error Management": the GPU needs a reset or replacement).
* **XID errors** in the kernel log (``dmesg``; ``NVRM: Xid (PCI:...): N``) of the kinds NVIDIA's XID catalog
  (docs.nvidia.com/deploy/xid-errors) lists as hardware faults that need a GPU reset or a node drain:
  ``FATAL_XIDS``. Application errors (13, 31, 43, ...) are not refused: a crashed job leaves them on a healthy
  GPU. A kernel log this user may not read (``kernel.dmesg_restrict``) is a warning: not checked.
* **memlock** (``ulimit -l``): NCCL's InfiniBand transport registers (pins) its buffers; below "unlimited" the
  registration fails or NCCL falls back to sockets without saying so. Slurm propagates the submitting shell's
  limits to the job (``PropagateResourceLimits=ALL`` by default), a login node's 64 KiB included.
* **InfiniBand devices**: every ``/dev/infiniband/uverbs*`` opened read-write, as the verbs library does (a
  container started without the devices, or without permission on them, still shows the HCAs in sysfs).

Each check takes its inputs as arguments (the text nvidia-smi printed, the kernel log, the limit, the /dev
folder) so the tests give stand-ins; ``gpu_report`` runs the ``nvidia-smi`` found on PATH.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
import subprocess
from pathlib import Path
from typing import Protocol


class Report(Protocol):
    """Where a check writes (``node_check.Report``): lines to print, warnings, errors (exit code 1)."""

    lines: list[str]
    warnings: list[str]
    errors: list[str]

# XIDs that mean the GPU or its links are faulty (NVIDIA's XID catalog): the GPU needs a reset, or the node a
# drain, before a job can trust it.
FATAL_XIDS = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    94: "contained ECC error (a GPU reset is required)",
    95: "uncontained ECC error (a GPU reset is required)",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+)")
GPU_QUERY = ["nvidia-smi", "--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total",
             "--format=csv,noheader,nounits"]
REMAP_QUERY = ["nvidia-smi", "--query-remapped-rows=gpu_bus_id,remapped_rows.pending,remapped_rows.failure",
               "--format=csv,noheader"]


def _drain(node: str) -> str:
    return f"drain the node (scontrol update nodename={node} state=drain reason=...) and resubmit with --exclude={node}"


def _count(text: str) -> int | None:
    """A counter of nvidia-smi's CSV (None: "[N/A]", "[Not Supported]": a GPU without ECC)."""
    text = text.strip()
    return int(text) if text.isdigit() else None


def check_gpus(f: Report, query: str | None, remap: str | None, asked: int, node: str = "NODE") -> None:
    """``query``: what ``GPU_QUERY`` printed (None: no nvidia-smi here); ``remap``: what ``REMAP_QUERY`` printed
    (None: not supported by these GPUs or this driver); ``asked``: the GPUs the job asks on this node (0: not
    checked)."""
    if query is None:
        f.lines.append("GPUs (nvidia-smi): none here")
        if asked:
            f.errors.append(f"the job asks for {asked} GPUs on this node and nvidia-smi is not found (no NVIDIA "
                            f"driver, or a container started without the GPUs): {_drain(node)}")
        return
    gpus, broken = [], []
    for line in query.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            gpus.append(parts)
        elif line.strip() and "No devices were found" not in line:
            broken.append(line.strip())
    f.lines.append(f"GPUs (nvidia-smi): {len(gpus)}" + (f", the job asks for {asked}" if asked else "") +
                   "".join(f"; GPU {i} {bus} uncorrectable ECC {ecc}" for i, bus, ecc in gpus))
    for line in broken:  # a job without GPUs on a node without working ones: only said
        (f.errors if asked or gpus else f.warnings).append(
            f"nvidia-smi cannot read a GPU: {line!r} (a GPU fell off the bus or its driver state is broken): reset "
            f"the GPU or {_drain(node)}")
    if asked and len(gpus) < asked:
        f.errors.append(f"{len(gpus)} GPUs work on this node, the job asks for {asked} (SLURM_GPUS_ON_NODE): a "
                        f"GPU is missing or failed; {_drain(node)}")
    for index, bus, ecc in gpus:
        if (_count(ecc) or 0) > 0:
            f.errors.append(f"GPU {index} ({bus}) has {ecc} uncorrectable ECC errors since the driver loaded "
                            f"(ecc.errors.uncorrected.volatile.total): its memory returned bad data; reset the "
                            f"GPU (nvidia-smi -r) or {_drain(node)}")
    for line in (remap or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        bus, pending, failure = parts
        if pending.lower() in ("yes", "1") or failure.lower() in ("yes", "1"):
            what = "a row remapping failed" if failure.lower() in ("yes", "1") else "a row remapping waits for a reset"
            f.errors.append(f"GPU {bus}: {what} (remapped_rows.pending {pending}, remapped_rows.failure {failure}): "
                            f"reset the GPU (nvidia-smi -r) or {_drain(node)}")


def check_xids(f: Report, kernel_log: str | None, why_unread: str = "", node: str = "NODE") -> None:
    """The hardware-fault XIDs (``FATAL_XIDS``) in ``kernel_log`` (None: it could not be read, ``why_unread``)."""
    if kernel_log is None:
        f.warnings.append(f"the kernel log cannot be read here ({why_unread}): NVIDIA XID errors not checked")
        return
    seen: dict[tuple[str, int], int] = {}
    for m in _XID.finditer(kernel_log):
        key = (m.group(1), int(m.group(2)))
        seen[key] = seen.get(key, 0) + 1
    fatal = {k: n for k, n in seen.items() if k[1] in FATAL_XIDS}
    f.lines.append("NVIDIA XID errors in the kernel log: " + (", ".join(
        f"XID {x} on {bus} x{n}" for (bus, x), n in sorted(seen.items())) or "none"))
    for (bus, xid), n in sorted(fatal.items()):
        f.errors.append(f"XID {xid} ({FATAL_XIDS[xid]}) on the GPU at PCI {bus}, {n} time(s) in the kernel log "
                        f"since boot: reset the GPU or {_drain(node)} (a reboot clears the log)")


def check_memlock(f: Report, limit: int, uses_ib: bool) -> None:
    """``limit``: the soft ``RLIMIT_MEMLOCK`` in bytes (``RLIM_INFINITY`` for unlimited); an error only when
    NCCL would use InfiniBand (``uses_ib``)."""
    shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit // 1024} KiB"
    f.lines.append(f"locked memory (ulimit -l): {shown}")
    if limit != resource.RLIM_INFINITY and uses_ib:
        f.errors.append(f"locked memory limited to {shown} (ulimit -l): NCCL over InfiniBand pins its buffers and "
                        f"fails or falls back to sockets; set it unlimited where slurmd starts (LimitMEMLOCK="
                        f"infinity in its systemd unit) and stop Slurm carrying the login shell's limit "
                        f"(PropagateResourceLimitsExcept=MEMLOCK in slurm.conf, or srun --propagate=NONE)")


def check_ib_devices(f: Report, hcas: list[str], dev: Path = Path("/dev")) -> None:
    """With InfiniBand HCAs in sysfs (``hcas``), every ``dev/infiniband/uverbs*`` must open read-write."""
    if not hcas:
        return
    folder = dev / "infiniband"
    devices = sorted(folder.glob("uverbs*")) if folder.is_dir() else []
    if not devices:
        f.errors.append(f"InfiniBand HCAs {', '.join(hcas)} are in sysfs but {folder} has no uverbs devices: the "
                        f"container or cgroup does not pass them in (enroot/pyxis: the NVIDIA and MOFED hooks); "
                        f"NCCL would fall back to sockets")
        return
    failed = []
    for path in devices:
        try:
            os.close(os.open(path, os.O_RDWR))
        except OSError as e:
            failed.append(f"{path} ({errno.errorcode.get(e.errno, e.errno)}: {e.strerror})")
    f.lines.append(f"InfiniBand devices: {len(devices) - len(failed)} of {len(devices)} open ({folder})")
    if failed:
        f.errors.append(f"InfiniBand devices do not open: {'; '.join(failed)}: give the job read-write access "
                        f"(the rdma group, the container's device list); NCCL would fall back to sockets")


def run_nvidia_smi(args: list[str]) -> tuple[int, str] | None:
    """(exit code, what ``args`` printed on stdout and stderr: a GPU it cannot read is reported on stderr), None
    when nvidia-smi is not on PATH or does not answer."""
    if shutil.which(args[0]) is None:
        return None
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.returncode, proc.stdout + proc.stderr


def check_node_gpus(f: Report, asked: int, node: str = "NODE") -> None:
    """``check_gpus`` and ``check_xids`` with this node's nvidia-smi and kernel log (XIDs only where nvidia-smi
    runs: a node without the driver has none)."""
    query = run_nvidia_smi(GPU_QUERY)
    if query is None:
        check_gpus(f, None, None, asked, node)
        return
    remap = run_nvidia_smi(REMAP_QUERY)
    check_gpus(f, query[1], remap[1] if remap and remap[0] == 0 else None, asked, node)
    check_xids(f, *read_kernel_log(), node=node)


def read_kernel_log() -> tuple[str | None, str]:
    """(``dmesg``'s text, "") or (None, why it cannot be read)."""
    if shutil.which("dmesg") is None:
        return None, "no dmesg"
    try:
        proc = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    if proc.returncode:
        return None, f"dmesg: {proc.stderr.strip() or f'exit code {proc.returncode}'}"
    return proc.stdout, ""
