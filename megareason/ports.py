"""Ports for the services a run starts (torch.distributed rendezvous, vLLM's engines), from a fixed block
below the kernel's ephemeral range.

A port that ``bind(0)`` hands out comes from the ephemeral range (``net.ipv4.ip_local_port_range``), from
which the kernel also picks the source port of every outgoing connection: between the moment such a port is
found free and the moment the service binds it, any connection on the node may take it, and the start fails
with EADDRINUSE (verl#3521; NeMo-RL pins its ports to fixed ranges for the same reason). A port below that
range is only ever taken by a service that asks for it by number.

The block (``BLOCK`` ports):
- in a Slurm job, ``MEGAREASON_PORT_BASE`` set per node by ``slurm/ray_cluster.sh`` inside the job's Ray
  port block (every Ray worker on the node inherits it from its raylet);
- in a run that starts its own Ray, ``MEGAREASON_PORT_BASE`` chosen by the driver from its PID (``run_block``)
  and passed to its workers, so two runs on one machine start from different blocks;
- otherwise a block chosen from this process's PID in ``LOCAL_RANGE``.

Inside the block: ports ``0 .. RENDEZVOUS - 1`` for the rendezvous stores (bound at once, scanning upward
past a port in use: no window in which another process can take it), then ``ENGINE_PORTS`` ports for each of
``ENGINES`` vLLM engine slots (vLLM scans upward from ``VLLM_PORT``; distinct starts keep engines that start
together apart), then the rest for servers started by number (``server_ports``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

PORT_BASE_ENV = "MEGAREASON_PORT_BASE"
BLOCK = 64  # ports per block: what slurm/ray_cluster.sh leaves each node after Ray's own ports
RENDEZVOUS = 16  # the first ports of a block: rendezvous stores (one per role; a scan passes busy ones)
ENGINE_PORTS = 4  # vLLM's distributed init takes one port per engine; the rest is headroom for its scan
ENGINES = 10  # engine slots (engine k uses slot k mod ENGINES); the last ports of a block are for servers
# Outside Slurm: above Ray's default worker ports (10002-19999), below Linux's default ephemeral range
# (32768-60999).
LOCAL_RANGE = (20000, 32768)
EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")

T = TypeVar("T")


class PortError(RuntimeError):
    """No port for a service: the block is below 1024, reaches into the ephemeral range, or is full."""


def ephemeral_range(path: Path = EPHEMERAL_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range, inclusive (Linux's default when the file cannot be read)."""
    try:
        lo, hi = map(int, path.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def local_blocks(ephemeral: tuple[int, int] | None = None) -> range:
    """First ports of the blocks a run outside Slurm may use: ``LOCAL_RANGE`` cut below the ephemeral range."""
    lo, hi = LOCAL_RANGE
    hi = min(hi, (ephemeral or ephemeral_range())[0])
    if hi - lo < BLOCK:
        raise PortError(f"no room for a {BLOCK}-port block in {lo}-{hi - 1}: the ephemeral port range "
                        f"(net.ipv4.ip_local_port_range) starts at {hi}; set {PORT_BASE_ENV} to a free block "
                        f"below it")
    return range(lo, hi - BLOCK + 1, BLOCK)


def run_block(key: int | None = None, ephemeral: tuple[int, int] | None = None) -> int:
    """First port of a block for a run, chosen from ``key`` (default: this process's PID)."""
    blocks = local_blocks(ephemeral)
    return blocks[(os.getpid() if key is None else key) % len(blocks)]


def block_base(env: dict[str, str] | None = None, ephemeral: tuple[int, int] | None = None) -> int:
    """First port of this process's block: ``MEGAREASON_PORT_BASE`` (checked against the ephemeral range),
    else ``run_block()``."""
    env = os.environ if env is None else env
    text = env.get(PORT_BASE_ENV)
    if not text:
        return run_block(ephemeral=ephemeral)
    try:
        base = int(text)
    except ValueError:
        raise PortError(f"{PORT_BASE_ENV}={text!r}: expected a port number") from None
    problem = fixed_ports_problem(base, base + BLOCK - 1, ephemeral)
    if problem:
        raise PortError(f"{PORT_BASE_ENV}={base}: {problem}")
    return base


def fixed_ports_problem(first: int, last: int, ephemeral: tuple[int, int] | None = None) -> str | None:
    """Why ports ``first``..``last`` (inclusive) cannot be taken by number, or None: they must lie within
    1024-65535 and outside the ephemeral range. The one rule for this module's blocks and for the job's Ray
    ports that ``megareason node-check`` checks on every node before Ray starts."""
    lo, hi = ephemeral or ephemeral_range()
    if first < 1024 or last > 65535 or (first <= hi and last >= lo):
        return (f"the ports {first}-{last} must lie within 1024-65535 and outside the ephemeral range {lo}-{hi} "
                f"(net.ipv4.ip_local_port_range), from which the kernel takes the source port of every outgoing "
                f"connection")
    return None


def engine_port(index: int, base: int | None = None) -> int:
    """Where vLLM engine ``index`` starts its port scan (``VLLM_PORT``)."""
    return (block_base() if base is None else base) + RENDEZVOUS + ENGINE_PORTS * (index % ENGINES)


def server_ports(base: int | None = None) -> range:
    """The block's last ports: for a server the run or a test starts by number (a verifier server)."""
    base = block_base() if base is None else base
    return range(base + RENDEZVOUS + ENGINE_PORTS * ENGINES, base + BLOCK)


def unused_server_port(host: str = "127.0.0.1", base: int | None = None) -> int:
    """A port of ``server_ports`` that nothing listens on now. Outside the ephemeral range, so only a server
    of this block (started by number) can take it before the caller's server binds it."""
    import socket

    def probe(port: int) -> int:
        with socket.socket() as s:
            s.bind((host, port))
        return port

    return bind_first(probe, server_ports(base), f"a server port on {host}")


def bind_first(bind: Callable[[int], T], ports: range, what: str) -> T:
    """``bind(port)`` on the first port of ``ports`` that is not in use; ``bind`` raises an exception whose
    text names EADDRINUSE for a port in use (torch's ``DistNetworkError`` does; so does ``OSError``)."""
    for port in ports:
        try:
            return bind(port)
        except (OSError, RuntimeError) as e:
            if "EADDRINUSE" not in str(e) and getattr(e, "errno", None) != 98 and "in use" not in str(e):
                raise
    raise PortError(f"{what}: every port in {ports.start}-{ports.stop - 1} is in use (set {PORT_BASE_ENV} to "
                    f"a free block of {BLOCK} ports below the ephemeral range)")


def rendezvous_store(host: str, world: int, timeout: timedelta, base: int | None = None):
    """The master ``torch.distributed.TCPStore`` of a process group of ``world`` ranks, listening on ``host``
    at the first free rendezvous port of this process's block; ``.port`` is the port it took."""
    import torch.distributed as dist

    base = block_base() if base is None else base
    return bind_first(lambda port: dist.TCPStore(host, port, world, is_master=True, timeout=timeout,
                                                 wait_for_workers=False),
                      range(base, base + RENDEZVOUS), f"torch.distributed rendezvous on {host}")
