"""``megareason node-check``: what NCCL, gloo and Ray will use on this node, and what will break them.

Every Slurm job runs it once per node before Ray starts (``slurm/ray_cluster.sh``; in the container, so it
is also the step that creates each node's pyxis container, one task per node), and prints per node:

* the network interfaces, and which of them **gloo** binds (``GLOO_SOCKET_IFNAME``, else the address the
  host name resolves to, as torch's gloo does; megatron-core creates gloo groups beside NCCL's) and which
  **NCCL** uses for its sockets (``NCCL_SOCKET_IFNAME`` with NCCL's prefix / ``^`` exclude / ``=`` exact
  syntax, else NCCL's default order: ``ib*`` interfaces, then any but ``docker*`` and ``lo``);
* the InfiniBand HCAs and their ports (``/sys/class/infiniband``) and which ``NCCL_IB_HCA`` selects;
* the address Ray registers (the source address of the route to the head, as ``ray start`` finds it);
* the open-files and locked-memory limits, the job's memory limit (cgroup) against the node's RAM, the kernel's
  ephemeral port range against the job's Ray ports, and the file system and free space of Ray's temp dir;
* the NVIDIA driver against the CUDA version the image or torch was built for (``launch/gpu_driver.py``);
* the GPUs' health: their number against the job's, uncorrectable ECC errors, pending or failed row
  remappings, hardware-fault XIDs in the kernel log, and the InfiniBand devices opened
  (``launch/node_health.py``).

Errors exit with code 1 so the job fails before Ray starts, each naming the fix (the output names the node):
an interface variable that names nothing on this node; gloo or NCCL's sockets on a loopback interface when the
job's nodes are on more than one host (other hosts cannot reach it: "Gloo connectFullMesh failed", NCCL's
bootstrap hangs); an NVIDIA driver too old for the CUDA build; fewer working GPUs than the job asks, ECC or
XID faults; InfiniBand in use with a locked-memory limit below unlimited, or with devices that do not open;
Ray ports inside the ephemeral range (``megareason/ports.py``'s rule, which the services' ports meet later).
Warnings are printed and pass: loopback when the job's several Slurm nodes share one host (a test cluster: it
works there, and would not across hosts), a RAM-backed temp dir, a memory limit below the node's RAM, a kernel
log this user cannot read.

``--hosts`` is the number of distinct hosts among the job's nodes: ``slurm/ray_cluster.sh`` counts the nodes'
addresses (``NodeAddr``, resolved; every loopback address is one host), so two Slurm nodes on one machine
count as one host. Run by hand, it defaults to ``--nodes`` (every node its own host).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import resource
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from megareason import ports as job_ports
from megareason.launch import gpu_driver, node_health

HELP = """\
Print what NCCL, gloo and Ray will use on this node: network interfaces, the interface gloo binds
(GLOO_SOCKET_IFNAME or the host name's address), the interfaces NCCL's sockets use (NCCL_SOCKET_IFNAME or
NCCL's default order), InfiniBand HCAs (NCCL_IB_HCA), Ray's node address, open-files and memory limits,
the ephemeral port range against the Ray ports, Ray's temp dir, the NVIDIA driver against the CUDA build.
Exit code 1 when an interface variable names nothing here, when gloo or NCCL would use loopback on a job
across hosts, when the driver is too old, when fewer GPUs work than --gpus, a GPU has ECC or XID faults,
InfiniBand devices do not open or locked memory is limited, or the Ray ports lie in the ephemeral range.
Run it on every node of an allocation:

  srun --ntasks-per-node=1 megareason node-check
  srun --ntasks-per-node=1 --container-image=IMAGE python -m megareason.launch.node_check --ports 2000-2799
"""

NCCL_DEFAULT_EXCLUDE = ("docker", "lo")  # NCCL_SOCKET_IFNAME's default is "^docker,lo", after ib* first


@dataclass(frozen=True)
class Interface:
    name: str
    ipv4: tuple[str, ...]
    up: bool


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def local_interfaces() -> list[Interface]:
    import psutil

    stats = psutil.net_if_stats()
    out = []
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        ipv4 = tuple(a.address for a in addrs if a.family == socket.AF_INET)
        out.append(Interface(name, ipv4, bool(stats.get(name) and stats[name].isup)))
    return out


def match_nccl_spec(names: list[str], spec: str) -> list[str]:
    """The names NCCL selects with NCCL_SOCKET_IFNAME / NCCL_IB_HCA ``spec``: comma-separated prefixes,
    ``^`` excludes them, ``=`` makes them exact names (an ``:port`` suffix is dropped here)."""
    exclude, spec = spec.startswith("^"), spec.lstrip("^")
    exact, spec = spec.startswith("="), spec.lstrip("=")
    parts = [p.split(":")[0] for p in spec.split(",") if p]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in parts)

    return [n for n in names if hit(n) != exclude]


def nccl_socket_interfaces(ifaces: list[Interface], spec: str | None) -> tuple[list[str], str]:
    """The interfaces NCCL's socket transport and bootstrap use (the first one leads), and why."""
    usable = [i.name for i in ifaces if i.up and i.ipv4]
    if spec:
        return match_nccl_spec(usable, spec), f"NCCL_SOCKET_IFNAME={spec}"
    ib = [n for n in usable if n.startswith("ib")]
    if ib:
        return ib, "NCCL's default: ib* interfaces first"
    rest = match_nccl_spec(usable, "^" + ",".join(NCCL_DEFAULT_EXCLUDE))
    if rest:
        return rest, "NCCL's default: no ib*, any interface but docker*/lo"
    return [n for n in usable if n.startswith("lo")], "NCCL's default: only loopback is left"


def gloo_interface(ifaces: list[Interface], spec: str | None, hostname: str,
                   resolved: list[str]) -> tuple[str | None, str | None, str]:
    """(interface, address, why) that torch's gloo binds: GLOO_SOCKET_IFNAME's first interface, else the
    first local address the host name resolves to, else loopback (torch's fallback)."""
    by_addr = {a: i.name for i in ifaces for a in i.ipv4}
    if spec:
        name = spec.split(",")[0]
        iface = next((i for i in ifaces if i.name == name), None)
        if iface is None or not iface.ipv4:
            return None, None, f"GLOO_SOCKET_IFNAME={spec}: no interface {name!r} with an IPv4 address here"
        return name, iface.ipv4[0], f"GLOO_SOCKET_IFNAME={spec}"
    for addr in resolved:
        if addr in by_addr:
            return by_addr[addr], addr, f"host name {hostname!r} resolves to {addr}"
    lo = next((i for i in ifaces if i.name.startswith("lo") and i.ipv4), None)
    why = f"host name {hostname!r} resolves to {', '.join(resolved) or 'nothing'}, not a local address: loopback"
    return (lo.name if lo else None), (lo.ipv4[0] if lo else None), why


def infiniband_ports(root: Path = Path("/sys/class/infiniband")) -> dict[str, list[str]]:
    """HCA name -> ["port N: STATE (link layer)"], from sysfs (empty without InfiniBand/RoCE)."""
    out: dict[str, list[str]] = {}
    for dev in sorted(root.glob("*")) if root.is_dir() else []:
        ports = []
        for port in sorted((dev / "ports").glob("*")):
            state = _read(port / "state").split(":")[-1].strip() or "?"
            ports.append(f"port {port.name}: {state} ({_read(port / 'link_layer') or '?'})")
        out[dev.name] = ports
    return out


def route_source(head_ip: str) -> str | None:
    """The local address of the route to ``head_ip`` (what ``ray start`` registers as the node's IP)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((head_ip, 9))  # UDP connect sends nothing; it only picks the route
            return s.getsockname()[0]
    except OSError:
        return None


def loopback_problem(r: Report, what: str, nodes: int, hosts: int) -> None:
    """``what`` (gloo's or NCCL's sockets, on a loopback address) on a job of ``nodes`` Slurm nodes on
    ``hosts`` distinct hosts: an error across hosts, a warning for several nodes on one host, nothing for
    one node."""
    if hosts > 1:
        r.errors.append(f"{what} on a job across {hosts} hosts: the other hosts cannot reach it (\"Gloo "
                        f"connectFullMesh failed\", NCCL's bootstrap hangs); set GLOO_SOCKET_IFNAME and "
                        f"NCCL_SOCKET_IFNAME to the interface between the nodes")
    elif nodes > 1:
        r.warnings.append(f"{what}: fine while this job's {nodes} nodes share one host, not across hosts")


def check(*, nodes: int = 1, hosts: int | None = None, ports: tuple[int, int] | None = None, ray_tmpdir: str = "",
          head_ip: str = "", env: dict[str, str] | None = None, ifaces: list[Interface] | None = None,
          driver_text: str | None = None, gpus: int = 0, memlock: int | None = None, proc: Path = Path("/proc"),
          dev: Path = Path("/dev"), sysfs: Path = Path("/sys")) -> Report:
    """The node's report (see the module docstring) for a job of ``nodes`` Slurm nodes on ``hosts`` distinct
    hosts (default: ``nodes``) that asks for ``gpus`` GPUs on this node (0: not checked); ``env``, ``ifaces``,
    ``driver_text`` (what nvidia-smi or the kernel module says of the NVIDIA driver), ``memlock`` (the soft
    locked-memory limit in bytes) and the ``proc``, ``dev`` and ``sysfs`` folders default to this machine's;
    nvidia-smi and dmesg are the ones on PATH (``launch/node_health.py``)."""
    env = dict(os.environ) if env is None else env
    ifaces = local_interfaces() if ifaces is None else ifaces
    hosts = nodes if hosts is None else hosts
    r = Report()
    hostname = socket.gethostname()
    r.lines.append("interfaces: " + "; ".join(
        f"{i.name} {','.join(i.ipv4) or '-'} {'up' if i.up else 'down'}" for i in ifaces))
    set_vars = {k: v for k, v in sorted(env.items()) if k.startswith(("NCCL_", "GLOO_", "UCX_", "TP_SOCKET"))}
    r.lines.append("variables: " + (" ".join(f"{k}={v}" for k, v in set_vars.items()) or "none of NCCL_*/GLOO_* set"))

    try:
        resolved = sorted({a[4][0] for a in socket.getaddrinfo(hostname, None, socket.AF_INET)})
    except OSError:
        resolved = []
    name, addr, why = gloo_interface(ifaces, env.get("GLOO_SOCKET_IFNAME"), hostname, resolved)
    if name is None and env.get("GLOO_SOCKET_IFNAME"):
        r.errors.append(why)
    else:
        r.lines.append(f"gloo: {name} {addr} ({why})")
        if addr and ipaddress.ip_address(addr).is_loopback:
            loopback_problem(r, f"gloo binds loopback {addr} ({why})", nodes, hosts)

    nccl, why = nccl_socket_interfaces(ifaces, env.get("NCCL_SOCKET_IFNAME"))
    if not nccl:
        (r.errors if env.get("NCCL_SOCKET_IFNAME") else r.warnings).append(f"NCCL sockets: no interface ({why})")
    else:
        r.lines.append(f"NCCL sockets: {', '.join(nccl)} ({why}; bootstrap on {nccl[0]})")
        lead = next(i for i in ifaces if i.name == nccl[0])
        if all(ipaddress.ip_address(a).is_loopback for a in lead.ipv4):
            loopback_problem(r, f"NCCL's bootstrap uses loopback {nccl[0]} {lead.ipv4[0]} ({why})", nodes, hosts)

    hcas = infiniband_ports(sysfs / "class" / "infiniband")
    chosen = []
    if hcas:
        chosen = match_nccl_spec(list(hcas), env["NCCL_IB_HCA"]) if env.get("NCCL_IB_HCA") else list(hcas)
        r.lines.append("InfiniBand HCAs: " + "; ".join(f"{h} [{', '.join(p)}]" for h, p in hcas.items()))
        r.lines.append(f"NCCL IB: {', '.join(chosen) or 'none'} "
                       f"({'NCCL_IB_HCA=' + env['NCCL_IB_HCA'] if env.get('NCCL_IB_HCA') else 'every HCA'})")
        if not chosen:
            r.errors.append(f"NCCL_IB_HCA={env['NCCL_IB_HCA']} selects none of the HCAs {', '.join(hcas)}")
    else:
        r.lines.append("InfiniBand HCAs: none (NCCL uses its socket transport between nodes)")
    node_health.check_ib_devices(r, chosen, dev)
    node_health.check_memlock(r, resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] if memlock is None else memlock,
                              uses_ib=bool(chosen) and env.get("NCCL_IB_DISABLE", "0") != "1")

    if head_ip:
        r.lines.append(f"Ray node address: {route_source(head_ip) or '?'} (the route to the head {head_ip})")

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    r.lines.append(f"open files (ulimit -n): {soft} (hard {hard})")
    if soft < 65536 and soft != resource.RLIM_INFINITY:
        r.warnings.append(f"open files limit {soft} < 65536: Ray with many workers may run out of file descriptors")

    mem_total, limit = _mem_total(), _cgroup_memory_limit()
    if mem_total:
        shown = f"{limit / 2**30:.1f} GiB" if limit else "none"
        r.lines.append(f"memory: node {mem_total / 2**30:.1f} GiB, this job's limit (cgroup) {shown}")
        if limit and limit < 0.9 * mem_total:
            r.warnings.append(f"the job may use {limit / 2**30:.1f} GiB of the node's {mem_total / 2**30:.1f} GiB "
                              f"(sbatch --mem=0 asks for all of it)")

    eph = job_ports.ephemeral_range(proc / "sys" / "net" / "ipv4" / "ip_local_port_range")
    r.lines.append(f"ephemeral ports: {eph[0]}-{eph[1]}" + (f"; Ray ports {ports[0]}-{ports[1]}" if ports else ""))
    problem = ports and job_ports.fixed_ports_problem(ports[0], ports[1], eph)
    if problem:  # the rule megareason/ports.py applies to the services' block once Ray is up
        r.errors.append(f"the job's Ray ports: {problem}; an outgoing connection may take one before Ray or a "
                        f"service binds it. Set MEGAREASON_RAY_PORT_BASE so that the job's ports lie below "
                        f"{eph[0]}, or move the range on the nodes (sysctl net.ipv4.ip_local_port_range)")

    if ray_tmpdir:
        probe = Path(ray_tmpdir)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        fs = _filesystem(probe)
        free = shutil.disk_usage(probe).free
        r.lines.append(f"Ray temp dir {ray_tmpdir}: {fs}, {free / 2**30:.1f} GiB free")
        if fs in ("tmpfs", "ramfs", "overlay"):
            r.warnings.append(f"Ray's temp dir {ray_tmpdir} is on {fs} (memory or the container's root): set "
                              f"MEGAREASON_RAY_TMPDIR to node-local disk for Ray's logs and object spilling")

    visible = env.get("CUDA_VISIBLE_DEVICES")
    r.lines.append(f"GPUs: CUDA_VISIBLE_DEVICES={visible if visible is not None else '(unset)'}, "
                   f"SLURM_GPUS_ON_NODE={env.get('SLURM_GPUS_ON_NODE', '(unset)')}")
    node_health.check_node_gpus(r, gpus, env.get("SLURMD_NODENAME") or hostname)
    line, error = gpu_driver.check(env, driver_text)
    r.lines.append(line)
    if error:
        r.errors.append(error)
    return r


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _mem_total() -> int:
    for line in _read(Path("/proc/meminfo")).splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def _cgroup_memory_limit() -> int:
    """This process's memory limit in bytes (cgroup v2 or v1), 0 when unlimited or unknown."""
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            value = _read(Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max")
        elif "memory" in controllers.split(","):
            value = _read(Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.limit_in_bytes")
        else:
            continue
        if value.isdigit() and int(value) < 2**60:
            return int(value)
    return 0


def _filesystem(path: Path) -> str:
    """The type of the file system holding ``path`` (the longest mount point above it in /proc/mounts)."""
    best, kind = "", "?"
    resolved = str(path.resolve())
    for line in _read(Path("/proc/mounts")).splitlines():
        parts = line.split()
        if len(parts) >= 3 and (resolved == parts[1] or resolved.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) >= len(best):
                best, kind = parts[1], parts[2]
    return kind


def _port_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        return int(low), int(high or low)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--ports must be LOW-HIGH, got {text!r}") from e


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=int(os.environ.get("SLURM_JOB_NUM_NODES")
                                                    or os.environ.get("SLURM_NNODES") or "1"),
                   help="Slurm nodes of the job (default: $SLURM_JOB_NUM_NODES, $SLURM_NNODES or 1)")
    p.add_argument("--hosts", type=int, default=None,
                   help="distinct hosts among the job's nodes (default: --nodes); > 1 makes gloo or NCCL on "
                   "loopback an error")
    p.add_argument("--ports", type=_port_range, default=None, help="the job's Ray ports, LOW-HIGH")
    p.add_argument("--gpus", type=int, default=int(os.environ.get("SLURM_GPUS_ON_NODE") or "0"),
                   help="GPUs the job asks for on this node (default: $SLURM_GPUS_ON_NODE or 0: not checked)")
    p.add_argument("--ray-tmpdir", default="", help="Ray's temp dir on this node")
    p.add_argument("--head-ip", default="", help="the Ray head's address (prints the route's source address)")


def run_cli(args: argparse.Namespace) -> int:
    r = check(nodes=args.nodes, hosts=args.hosts, ports=args.ports, ray_tmpdir=args.ray_tmpdir, head_ip=args.head_ip,
              gpus=args.gpus)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    for line in r.lines:
        print(f"node-check {node}: {line}")
    for w in r.warnings:
        print(f"node-check {node}: warning: {w}")
    for e in r.errors:
        print(f"node-check {node}: error: {e}")
    return 1 if r.errors else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megareason.launch.node_check", description=HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
