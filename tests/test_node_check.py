"""`megareason node-check`'s verdicts from hand-made inputs (megareason/launch/node_check.py, gpu_driver.py):
interfaces and environment variables as a node would have them, and what nvidia-smi and the kernel module
print of the NVIDIA driver. No GPU, no network, no cluster."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from megareason import ports
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


# ----------------------------------------------------------------------------------------- hardware gates
# A stand-in nvidia-smi (and dmesg) on PATH that prints what a node with the fault prints, stand-in /proc,
# /dev and /sys folders: the verdict of each gate as the job's node-check step gives it.

HEALTHY = "".join(f"{i}, 00000000:{0x18 + 0x10 * i:02X}:00.0, 0\n" for i in range(8))
H100_REMAP = "".join(f"00000000:{0x18 + 0x10 * i:02X}:00.0, No, No\n" for i in range(8))
# what the kernel log of a node holds: a user's crashed kernel (13, 43: not the GPU's fault) and the fault
XID_APP = ("[ 812.52] NVRM: Xid (PCI:0000:38:00): 13, pid=4242, name=python, Graphics SM Warp Exception\n"
           "[ 812.60] NVRM: Xid (PCI:0000:38:00): 43, pid=4242, name=python, Ch 00000008\n")
XID_79 = "[90210.1] NVRM: Xid (PCI:0000:88:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"


def _stand_ins(tmp: Path, monkeypatch, gpus: str = HEALTHY, remap: str | None = H100_REMAP, smi_rc: int = 0,
               dmesg: str | None = XID_APP) -> None:
    """nvidia-smi answering the GPU and remapped-rows queries (remap None: "not a valid field", exit code 2, as
    on a V100's driver), and dmesg printing ``dmesg`` (None: refused, as under kernel.dmesg_restrict), first on
    PATH."""
    bin_ = tmp / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "gpus.csv").write_text(gpus)
    (bin_ / "remap.csv").write_text(remap or "")
    (bin_ / "dmesg.txt").write_text(dmesg or "")
    here = '"$(dirname "$0")"'
    remap_answer = f"cat {here}/remap.csv" if remap is not None else \
        'echo "Field \\"remapped_rows.pending\\" is not a valid field to query."; exit 2'
    (bin_ / "nvidia-smi").write_text(f'#!/bin/sh\ncase "$*" in\n'
                                     f'  *--query-gpu=index*) cat {here}/gpus.csv; exit {smi_rc};;\n'
                                     f'  *--query-remapped-rows*) {remap_answer};;\n'
                                     f'  *driver_version*) echo 580.95.05;;\nesac\n')
    (bin_ / "dmesg").write_text(f"#!/bin/sh\ncat {here}/dmesg.txt\n" if dmesg is not None else
                                '#!/bin/sh\necho "dmesg: read kernel buffer failed: Operation not permitted" >&2\n'
                                'exit 1\n')
    for name in ("nvidia-smi", "dmesg"):
        (bin_ / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")


def _node(tmp: Path, *, ephemeral: str = "32768\t60999", hcas: tuple[str, ...] = (),
          uverbs: tuple[str, ...] = ()) -> dict:
    """Stand-in /proc (the ephemeral port range), /sys (InfiniBand HCAs, port 1 active) and /dev (``uverbs``:
    character devices stood in by files; a name ending in "/" is one that does not open: a folder)."""
    proc, sysfs, dev = tmp / "proc", tmp / "sys", tmp / "dev"
    (proc / "sys/net/ipv4").mkdir(parents=True, exist_ok=True)
    (proc / "sys/net/ipv4/ip_local_port_range").write_text(ephemeral + "\n")
    for hca in hcas:
        port = sysfs / "class/infiniband" / hca / "ports/1"
        port.mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n")
        (port / "link_layer").write_text("InfiniBand\n")
    (dev / "infiniband").mkdir(parents=True) if uverbs else dev.mkdir(parents=True)
    for name in uverbs:
        (dev / "infiniband" / name).mkdir() if name.endswith("/") else (dev / "infiniband" / name).write_text("")
    return {"proc": proc, "sysfs": sysfs, "dev": dev}


def _gate(tmp: Path, gpus: int = 8, memlock: int = resource.RLIM_INFINITY, ports: tuple[int, int] | None = None,
          **node):
    env = {"GLOO_SOCKET_IFNAME": "eth0", "NVIDIA_REQUIRE_CUDA": REQUIRE_CUDA_13, "SLURMD_NODENAME": "gpu-017"}
    return node_check.check(nodes=2, env=env, ifaces=IFACES, gpus=gpus, memlock=memlock, ports=ports,
                            **_node(tmp, **node))


def test_a_healthy_eight_gpu_node_passes_every_gate(tmp_path, monkeypatch):
    _stand_ins(tmp_path, monkeypatch)
    r = _gate(tmp_path, hcas=("mlx5_0", "mlx5_1"), uverbs=("uverbs0", "uverbs1"), ports=(2000, 2799))
    assert r.errors == [], r.errors
    assert any(line.startswith("GPUs (nvidia-smi): 8, the job asks for 8; GPU 0 00000000:18:00.0") for line in r.lines)
    assert "InfiniBand devices: 2 of 2 open (" in " ".join(r.lines)
    assert "locked memory (ulimit -l): unlimited" in r.lines
    # the application XIDs are shown, not refused
    assert "NVIDIA XID errors in the kernel log: XID 13 on 0000:38:00 x1, XID 43 on 0000:38:00 x1" in r.lines


@pytest.mark.parametrize("gpus, rc, want", [
    # a GPU lost: Slurm's gres count still says 8
    (HEALTHY.splitlines(keepends=True)[:7], 0, "7 GPUs work on this node, the job asks for 8 (SLURM_GPUS_ON_NODE)"),
    # nvidia-smi cannot reach one of them (it prints the others and fails)
    (HEALTHY.splitlines(keepends=True)[:7] + ["Unable to determine the device handle for GPU0000:88:00.0: "
                                              "Unknown Error\n"], 15,
     "nvidia-smi cannot read a GPU: 'Unable to determine the device handle for GPU0000:88:00.0: Unknown Error'"),
    (HEALTHY.replace("3, 00000000:48:00.0, 0", "3, 00000000:48:00.0, 2").splitlines(keepends=True), 0,
     "GPU 3 (00000000:48:00.0) has 2 uncorrectable ECC errors since the driver loaded"),
])
def test_a_missing_or_broken_gpu_or_ecc_errors_are_refused_naming_the_gpu(tmp_path, monkeypatch, gpus, rc, want):
    _stand_ins(tmp_path, monkeypatch, gpus="".join(gpus), smi_rc=rc)
    r = _gate(tmp_path)
    assert [e for e in r.errors if e.startswith(want)], r.errors
    assert all(e.endswith("drain the node (scontrol update nodename=gpu-017 state=drain reason=...) and resubmit "
                          "with --exclude=gpu-017") for e in r.errors)


def test_gpus_without_ecc_or_row_remapping_pass_and_a_pending_remap_is_refused(tmp_path, monkeypatch):
    # a GPU without ECC prints [N/A]; a V100's driver knows no remapped rows (not checked, no error)
    _stand_ins(tmp_path / "a", monkeypatch, gpus="0, 00000000:18:00.0, [N/A]\n", remap=None)
    assert _gate(tmp_path / "a", gpus=1).errors == []
    _stand_ins(tmp_path / "b", monkeypatch, remap=H100_REMAP.replace("00000000:58:00.0, No, No",
                                                                     "00000000:58:00.0, Yes, No"))
    r = _gate(tmp_path / "b")
    assert r.errors == ["GPU 00000000:58:00.0: a row remapping waits for a reset (remapped_rows.pending Yes, "
                        "remapped_rows.failure No): reset the GPU (nvidia-smi -r) or drain the node (scontrol "
                        "update nodename=gpu-017 state=drain reason=...) and resubmit with --exclude=gpu-017"]


def test_a_hardware_xid_is_refused_an_application_one_is_not_and_an_unreadable_log_warns(tmp_path, monkeypatch):
    _stand_ins(tmp_path / "a", monkeypatch, dmesg=XID_APP + XID_79 + XID_79)
    r = _gate(tmp_path / "a")
    assert r.errors == ["XID 79 (GPU has fallen off the bus) on the GPU at PCI 0000:88:00, 2 time(s) in the kernel "
                        "log since boot: reset the GPU or drain the node (scontrol update nodename=gpu-017 "
                        "state=drain reason=...) and resubmit with --exclude=gpu-017 (a reboot clears the log)"]
    _stand_ins(tmp_path / "b", monkeypatch, dmesg=None)
    r = _gate(tmp_path / "b")
    assert not r.errors and r.warnings[-1] == ("the kernel log cannot be read here (dmesg: dmesg: read kernel "
                                               "buffer failed: Operation not permitted): NVIDIA XID errors not "
                                               "checked")


def test_no_nvidia_smi_or_no_driver_fails_only_a_job_that_asks_for_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert not _gate(tmp_path / "a", gpus=0).errors  # a CPU job (the loopback test cluster)
    r = _gate(tmp_path / "b", gpus=4)
    assert r.errors[0].startswith("the job asks for 4 GPUs on this node and nvidia-smi is not found")
    monkeypatch.undo()  # PATH back
    no_driver = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
    _stand_ins(tmp_path / "c", monkeypatch, gpus=no_driver, smi_rc=9)
    r = _gate(tmp_path / "c", gpus=0)
    assert not r.errors and [w for w in r.warnings if w.startswith('nvidia-smi cannot read a GPU: "NVIDIA-SMI has')]
    assert _gate(tmp_path / "d", gpus=8).errors[0].startswith('nvidia-smi cannot read a GPU: "NVIDIA-SMI has failed')


def test_infiniband_needs_unlimited_locked_memory_and_devices_that_open(tmp_path, monkeypatch):
    _stand_ins(tmp_path, monkeypatch)
    ib = {"hcas": ("mlx5_0",), "uverbs": ("uverbs0",)}
    r = _gate(tmp_path / "a", memlock=64 * 1024, **ib)  # the login node's 64 KiB, carried by Slurm
    assert len(r.errors) == 1 and r.errors[0].startswith("locked memory limited to 64 KiB (ulimit -l): NCCL over "
                                                         "InfiniBand pins its buffers")
    assert "PropagateResourceLimitsExcept=MEMLOCK" in r.errors[0]
    assert not _gate(tmp_path / "b", memlock=64 * 1024).errors  # no InfiniBand: only shown
    r = _gate(tmp_path / "c", hcas=("mlx5_0", "mlx5_1"))  # sysfs has them, the container passed no devices
    assert r.errors == [f"InfiniBand HCAs mlx5_0, mlx5_1 are in sysfs but {tmp_path}/c/dev/infiniband has no uverbs "
                        "devices: the container or cgroup does not pass them in (enroot/pyxis: the NVIDIA and MOFED "
                        "hooks); NCCL would fall back to sockets"]
    r = _gate(tmp_path / "d", hcas=("mlx5_0", "mlx5_1"), uverbs=("uverbs0", "uverbs1/"))
    assert len(r.errors) == 1 and r.errors[0].startswith(f"InfiniBand devices do not open: {tmp_path}/d/dev/"
                                                         "infiniband/uverbs1 (EISDIR: Is a directory)")
    # NCCL_IB_HCA selecting only the HCA whose device opens, or IB off: no error
    env = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1"}
    r = node_check.check(env=env, ifaces=IFACES, memlock=64 * 1024, **_node(tmp_path / "e", hcas=("mlx5_0",),
                                                                            uverbs=("uverbs0",)))
    assert not r.errors


@pytest.mark.parametrize("ephemeral, ray_ports", [
    ((32768, 60999), (2000, 2799)), ((32768, 60999), (32000, 32767)),  # Linux's default range: fine
    ((32768, 60999), (32000, 32768)), ((1024, 65535), (2000, 2799)),  # into the range; a site's wide range
    ((32768, 60999), (800, 1599)),  # below 1024
])
def test_ray_ports_in_the_ephemeral_range_are_refused_by_the_rule_ports_py_applies(tmp_path, monkeypatch,
                                                                                   ephemeral, ray_ports):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    r = _gate(tmp_path, gpus=0, ports=ray_ports, ephemeral=f"{ephemeral[0]}\t{ephemeral[1]}")
    # megareason/ports.py, once Ray is up, refuses a services' block inside these ports for the same reason
    base = ray_ports[1] + 1 - ports.BLOCK
    try:
        ports.block_base({ports.PORT_BASE_ENV: str(base)}, ephemeral)
        later = None
    except ports.PortError as e:
        later = str(e)
    overlap = ray_ports[0] <= ephemeral[1] and ray_ports[1] >= ephemeral[0] or ray_ports[0] < 1024
    assert bool(r.errors) == overlap == (later is not None or ray_ports[0] < 1024), (r.errors, later)
    if overlap:
        assert r.errors == [f"the job's Ray ports: the ports {ray_ports[0]}-{ray_ports[1]} must lie within 1024-65535 "
                            f"and outside the ephemeral range {ephemeral[0]}-{ephemeral[1]} (net.ipv4.ip_local_port_"
                            f"range), from which the kernel takes the source port of every outgoing connection; an "
                            f"outgoing connection may take one before Ray or a service binds it. Set MEGAREASON_RAY_"
                            f"PORT_BASE so that the job's ports lie below {ephemeral[0]}, or move the range on the "
                            f"nodes (sysctl net.ipv4.ip_local_port_range)"]


def test_the_job_step_names_the_node_and_fails_on_a_lost_gpu(tmp_path, monkeypatch, capsys):
    _stand_ins(tmp_path, monkeypatch, gpus="".join(HEALTHY.splitlines(keepends=True)[:7]))
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")  # srun sets it in each task of a job with GPUs
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-017")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert node_check.main(["--nodes", "1"]) == 1
    out = capsys.readouterr().out
    assert "node-check gpu-017: error: 7 GPUs work on this node, the job asks for 8 (SLURM_GPUS_ON_NODE)" in out
    assert node_check.main(["--nodes", "1", "--gpus", "7"]) == 0
