"""`megareason node-check`'s verdicts from hand-made inputs (megareason/launch/node_check.py, gpu_driver.py):
interfaces and environment variables as a node would have them, and what nvidia-smi and the kernel module
print of the NVIDIA driver. No GPU, no network, no cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megareason.launch import gpu_driver, node_check
from megareason.launch.gpu_driver import MIN_DRIVER, decide, parse_cuda_requirement, parse_driver_version
from megareason.launch.node_check import Interface

REPO = Path(__file__).resolve().parents[1]
IFACES = [Interface("eth0", ("10.0.0.5",), True), Interface("lo", ("127.0.0.1",), True)]
# NVIDIA's CUDA 13.0 images (containers/base-image) set this; the brand alternatives are forward compatibility.
REQUIRE_CUDA_13 = ("cuda>=13.0 brand=unknown,driver>=535,driver<536 brand=grid,driver>=535,driver<536 "
                   "brand=tesla,driver>=535,driver<536 brand=nvidia,driver>=535,driver<536")
PROC_535 = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.161.08  Release Build  "
            "(dvs-builder@U16-I3-B03-4-3)  Tue Mar  5 00:00:00 UTC 2024\n"
            "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n")


def _check(env: dict[str, str], nodes: int, hosts: int | None = None, driver_text: str = ""):
    return node_check.check(nodes=nodes, hosts=hosts, env=env, ifaces=IFACES, driver_text=driver_text)


# ----------------------------------------------------------------------------------------- loopback


@pytest.mark.parametrize("env, what", [
    ({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "eth0"}, "gloo binds loopback 127.0.0.1"),
    ({"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "lo"}, "NCCL's bootstrap uses loopback lo 127.0.0.1"),
])
def test_loopback_fails_a_job_across_hosts_and_only_warns_for_nodes_sharing_one(env, what):
    across = _check(env, nodes=2, hosts=2)
    assert [e for e in across.errors if e.startswith(what)], across.errors
    assert "on a job across 2 hosts" in across.errors[0] and "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME" \
        in across.errors[0]
    shared = _check(env, nodes=2, hosts=1)  # the test cluster: two Slurm nodes on one machine
    assert not shared.errors and [w for w in shared.warnings if w.startswith(what) and "share one host" in w]
    single = _check(env, nodes=1)
    assert not single.errors and not [w for w in single.warnings if "loopback" in w]
    assert _check(env, nodes=3).errors  # run by hand: --hosts defaults to --nodes


def test_interfaces_between_the_hosts_pass():
    r = _check({"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}, nodes=8, hosts=8)
    assert not r.errors and not [w for w in r.warnings if "loopback" in w]
    assert "gloo: eth0 10.0.0.5 (GLOO_SOCKET_IFNAME=eth0)" in r.lines
    # NCCL's default skips lo when another interface is up
    r = _check({"GLOO_SOCKET_IFNAME": "eth0"}, nodes=8, hosts=8)
    assert not r.errors and any(line.startswith("NCCL sockets: eth0 (") for line in r.lines)


def test_the_cli_takes_the_node_count_from_slurm_and_hosts_from_its_flag(monkeypatch, capsys):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setattr(gpu_driver, "driver_version_text", lambda: "")
    assert node_check.main([]) == 1  # two nodes, taken for two hosts
    assert "error: gloo binds loopback" in capsys.readouterr().out
    assert node_check.main(["--hosts", "1"]) == 0
    assert "warning: gloo binds loopback" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------- NVIDIA driver


def test_the_driver_version_from_nvidia_smi_or_the_kernel_module():
    assert parse_driver_version("580.65.06\n580.65.06\n") == (580, 65, 6)  # one line per GPU
    assert parse_driver_version("570.26\n") == (570, 26)
    assert parse_driver_version(PROC_535) == (535, 161, 8)  # not the GCC line's 12.3.0
    assert parse_driver_version("") is None
    assert parse_driver_version("No devices were found\n") is None


def test_the_cuda_an_image_needs():
    assert parse_cuda_requirement(REQUIRE_CUDA_13) == (13, 0)
    assert parse_cuda_requirement("cuda>=12.8 brand=tesla,driver>=470,driver<471") == (12, 8)
    assert parse_cuda_requirement("13.0.0") == (13, 0)  # CUDA_VERSION
    assert parse_cuda_requirement("12.9") == (12, 9)  # torch.version.cuda
    assert parse_cuda_requirement("brand=tesla,driver>=535,driver<536") is None
    env = {"NVIDIA_REQUIRE_CUDA": REQUIRE_CUDA_13, "CUDA_VERSION": "12.8.1"}
    assert gpu_driver.cuda_requirement(env) == ((13, 0), "NVIDIA_REQUIRE_CUDA=cuda>=13.0")
    assert gpu_driver.cuda_requirement({"CUDA_VERSION": "12.8.1"}) == ((12, 8), "CUDA_VERSION=12.8.1")
    import torch

    cuda, source = gpu_driver.cuda_requirement({})  # this torch's build, read without importing it
    assert source == f"torch built for CUDA {torch.version.cuda or 'none'}"
    assert cuda == (tuple(map(int, torch.version.cuda.split(".")[:2])) if torch.version.cuda else None)


def test_a_driver_older_than_the_images_cuda_fails_naming_both():
    line, error = decide((535, 161, 8), (13, 0), "NVIDIA_REQUIRE_CUDA=cuda>=13.0")
    assert error == ("the NVIDIA driver 535.161.08 is too old for CUDA 13.0 (NVIDIA_REQUIRE_CUDA=cuda>=13.0): it "
                     "needs R580 (580.65.06) or newer; CUDA fails to start on this node (update the driver, or use "
                     "nodes that have R580+)")
    assert "535.161.08" in line
    assert decide((575, 51, 3), (13, 0), "x")[1] is not None  # the last CUDA 12 branch
    for ok in [(580, 65, 6), (580, 95, 5), (590, 44, 1)]:
        line, error = decide(ok, (13, 0), "x")
        assert error is None and line.endswith("needs 580.65.06 or newer: ok"), line
    assert decide((570, 26), (12, 8), "x")[1] is None and decide((560, 35, 3), (12, 8), "x")[1] is not None


def test_no_driver_no_cuda_build_or_an_unknown_cuda_passes_saying_so():
    assert decide(None, (13, 0), "x") == ("NVIDIA driver: none on this node (no GPUs): not checked", None)
    line, error = decide((580, 65, 6), None, "torch built for CUDA none")
    assert error is None and "no CUDA build to run here" in line
    line, error = decide((535, 161, 8), (14, 0), "x")
    assert error is None and "not checked" in line and f"{max(MIN_DRIVER)[0]}.{max(MIN_DRIVER)[1]}" in line


def test_node_check_fails_a_node_whose_driver_is_too_old():
    env = {"GLOO_SOCKET_IFNAME": "eth0", "NVIDIA_REQUIRE_CUDA": REQUIRE_CUDA_13}
    r = _check(env, nodes=1, driver_text=PROC_535)
    assert len(r.errors) == 1 and r.errors[0].startswith("the NVIDIA driver 535.161.08 is too old for CUDA 13.0")
    r = _check(env, nodes=1, driver_text="580.82.07\n")
    assert not r.errors and "NVIDIA driver 580.82.07, CUDA 13.0 (NVIDIA_REQUIRE_CUDA=cuda>=13.0) needs 580.65.06 " \
        "or newer: ok" in r.lines
    r = _check(env, nodes=1, driver_text="")
    assert not r.errors and "NVIDIA driver: none on this node (no GPUs): not checked" in r.lines


def _fake_nvidia_smi(folder: Path, version: str) -> dict[str, str]:
    """A PATH whose nvidia-smi answers the driver query with ``version`` on two GPUs (and lists none)."""
    folder.mkdir(exist_ok=True)
    smi = folder / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\ncase "$*" in *driver_version*) echo {version}; echo {version};; esac\n')
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}", "NVIDIA_REQUIRE_CUDA": REQUIRE_CUDA_13}


@pytest.mark.parametrize("version, rc", [("535.183.01", 1), ("580.65.06", 0)])
def test_the_driver_check_command_asks_nvidia_smi(tmp_path, version, rc):
    proc = subprocess.run([sys.executable, "-m", "megareason.launch.gpu_driver"], cwd=REPO, capture_output=True,
                          text=True, env=_fake_nvidia_smi(tmp_path / "bin", version), timeout=60)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"NVIDIA driver {version}, CUDA 13.0 (NVIDIA_REQUIRE_CUDA=cuda>=13.0)")
    assert ("error: the NVIDIA driver 535.183.01 is too old" in proc.stderr) == (rc == 1)
