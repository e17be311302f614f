#!/bin/bash
# Ray across a Slurm allocation, then the megareason driver: the logic every slurm/*.sbatch recipe shares.
#
# A recipe sources this file and calls `megareason_slurm_run CONFIG_NAME "$@"`, which
#   1. starts a Ray head on the allocation's first node and a Ray worker on each other node (srun steps,
#      `ray start --block`), with a per-job auth token and ports in a per-job block;
#   2. waits until Ray reports every node (and every GPU, when the job has GPUs), or fails with a message;
#   3. runs `megareason train --config-name CONFIG_NAME trainer.ray_address=HEAD:PORT OVERRIDES...` on the
#      first node and exits with its exit code;
#   4. on SIGUSR1 (sbatch --signal=B:USR1@SECONDS, before the time limit) forwards SIGUSR1 to the driver,
#      which saves a checkpoint after the step in progress and exits with 75; the job is then requeued
#      (`scontrol requeue`) and the next run resumes from that checkpoint (trainer.resume_mode=auto);
#   5. stops Ray by ending its srun steps (their PIDs), never `ray stop`, which kills every Ray on a node.
# `bash slurm/ray_cluster.sh node` is step 1's per-node command (run inside the srun steps).
#
# Environment (all optional):
#   MEGAREASON_ROOT              the megareason checkout (default: $SLURM_SUBMIT_DIR; submit from there)
#   MEGAREASON_PYTHON            python with megareason and ray installed (default: python3)
#   MEGAREASON_CONTAINER_IMAGE   run every step in this image via pyxis/enroot (srun --container-image);
#                                unset: the plain environment of the nodes
#   MEGAREASON_CONTAINER_MOUNTS  extra pyxis mounts, SRC:DST[,...]; the checkout is always mounted
#   MEGAREASON_RAY_PORT_BASE     first port of the job's block (default: 19000 + 1600 x (job id mod 8));
#                                node k uses BASE + 200 x (k mod 8) ... + 199, the head's GCS is BASE
#   MEGAREASON_RAY_WAIT_S        how long to wait for the Ray cluster (default: 600 s)
#   MEGAREASON_RAY_TMPDIR        root of Ray's per-node temp dirs (default: /tmp; keep it short: Ray's
#                                socket paths must stay under 107 characters)
#   MEGAREASON_RAY_START_ARGS    extra `ray start` arguments, e.g. --object-store-memory=...

MEGAREASON_EXIT_STOPPED=75  # the driver's exit code after a signal-requested checkpoint (trainer/loop.py)

_mr_log() { echo "$(date +%T) megareason-slurm: $*"; }

# srun on the given nodes, inside the container when one is configured; extra srun options first.
_mr_srun() {
    local container=()
    if [[ -n ${MEGAREASON_CONTAINER_IMAGE:-} ]]; then
        local mounts="$MR_ROOT:$MR_ROOT${MEGAREASON_CONTAINER_MOUNTS:+,$MEGAREASON_CONTAINER_MOUNTS}"
        container=(--container-image="$MEGAREASON_CONTAINER_IMAGE" --container-name=megareason
                   --container-mounts="$mounts" --container-workdir="$MR_ROOT")
    fi
    # --overlap: the Ray steps, the driver and the checks share the nodes' CPUs and GPUs.
    srun --overlap "${container[@]}" "$@"
}

# One Ray node (inside an srun step, one task per node): the head on the job's first node.
_mr_ray_node() {
    local nodes index=-1 k
    read -ra nodes <<< "$MR_NODES"
    for k in "${!nodes[@]}"; do [[ ${nodes[k]} == "$SLURMD_NODENAME" ]] && index=$k; done
    (( index >= 0 )) || { echo "node $SLURMD_NODENAME is not in MR_NODES=$MR_NODES" >&2; exit 1; }
    # Distinct ports for up to 8 Slurm nodes sharing one host (a test cluster); the same on real hosts.
    local b=$((MR_RAY_PORT_BASE + 200 * (index % 8)))
    local args=(--block --disable-usage-stats --num-cpus="$SLURM_CPUS_ON_NODE"
                --temp-dir="$MR_RAY_TMPDIR/mr-ray-$SLURM_JOB_ID-$index"
                --node-manager-port=$((b + 3)) --object-manager-port=$((b + 4)) --metrics-export-port=$((b + 5))
                --dashboard-agent-listen-port=$((b + 6)) --dashboard-agent-grpc-port=$((b + 7))
                --runtime-env-agent-port=$((b + 8)) --min-worker-port=$((b + 10)) --max-worker-port=$((b + 199)))
    if (( index == 0 )); then
        args+=(--head --node-ip-address="$MR_HEAD_IP" --port="$MR_RAY_PORT_BASE"
               --ray-client-server-port=$((b + 1)) --include-dashboard=false --dashboard-port=$((b + 2)))
    else
        args+=(--address="$MR_HEAD_IP:$MR_RAY_PORT_BASE")
    fi
    # shellcheck disable=SC2086  # MEGAREASON_RAY_START_ARGS is a list of words
    exec "$MR_PYTHON" -m ray.scripts.scripts start "${args[@]}" ${MEGAREASON_RAY_START_ARGS:-}
}

# Poll Ray until it has $2 alive nodes and $3 GPUs, for at most $4 seconds (run on the head node).
_MR_WAIT_PY='
import socket, sys, time
address, nodes, gpus, deadline = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), time.time() + float(sys.argv[4])
host, port = address.rsplit(":", 1)
while True:  # ray.init retries forever while the head is not up: wait for its port first
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        break
    except OSError:
        if time.time() > deadline:
            sys.exit(f"no Ray head answers at {address} after {sys.argv[4]} s")
        time.sleep(2)
import ray
ray.init(address=address, log_to_driver=False, logging_level="WARNING")
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    have, cpus = (sum(n["Resources"].get(r, 0) for n in alive) for r in ("GPU", "CPU"))
    if len(alive) >= nodes and have >= gpus:
        print(f"megareason-slurm: Ray is up: {len(alive)} nodes, {have:g} GPUs, {cpus:g} CPUs", flush=True)
        break
    if time.time() > deadline:
        sys.exit(f"Ray has {len(alive)} of {nodes} nodes and {have:g} of {gpus} GPUs after {sys.argv[4]} s")
    time.sleep(2)
'

_mr_alive() { kill -0 "$1" 2>/dev/null; }

# The exit status of background job $1, waiting again when a trapped signal interrupts `wait`.
_mr_wait() {
    local rc seen
    while true; do
        seen=$MR_SIGNALS
        wait "$1"; rc=$?
        (( MR_SIGNALS == seen )) && return "$rc"
    done
}

_mr_on_usr1() {
    MR_SIGNALS=$((MR_SIGNALS + 1)) MR_STOP_REQUESTED=1
    if [[ -z $MR_DRIVER ]]; then
        _mr_log "SIGUSR1 before the driver started: requeueing once Ray is up"
        return
    fi
    _mr_log "SIGUSR1 (time limit or pre-emption ahead): asking the driver to checkpoint and stop"
    for _ in $(seq 60); do  # the driver may not have written its PID yet
        [[ -s $MR_DRIVER_PIDFILE ]] && { kill -USR1 "$(<"$MR_DRIVER_PIDFILE")" 2>/dev/null; return; }
        _mr_alive "$MR_DRIVER" || return
        sleep 1
    done
}

# End the Ray steps (their srun PIDs; srun forwards SIGTERM to the step's processes), then wait a minute.
_mr_teardown() {
    local pid left
    (( ${#MR_RAY_STEPS[@]} )) || return 0
    for pid in "${MR_RAY_STEPS[@]}"; do _mr_alive "$pid" && kill -TERM "$pid"; done
    for _ in $(seq 60); do
        left=0
        for pid in "${MR_RAY_STEPS[@]}"; do _mr_alive "$pid" && left=1; done
        (( left )) || break
        sleep 1
    done
    for pid in "${MR_RAY_STEPS[@]}"; do _mr_alive "$pid" && kill -KILL "$pid"; done
    MR_RAY_STEPS=()
    _mr_log "Ray stopped"
}

_mr_fail() {
    _mr_log "error: $*"
    exit 1  # the EXIT trap tears Ray down
}

megareason_slurm_run() {
    local config=$1; shift
    MR_ROOT=${MEGAREASON_ROOT:-$SLURM_SUBMIT_DIR}
    MR_PYTHON=${MEGAREASON_PYTHON:-python3}
    MR_RAY_TMPDIR=${MEGAREASON_RAY_TMPDIR:-/tmp}
    MR_RAY_PORT_BASE=${MEGAREASON_RAY_PORT_BASE:-$((19000 + 1600 * (SLURM_JOB_ID % 8)))}
    MR_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\n' ' ')
    local nodes
    read -ra nodes <<< "$MR_NODES"
    local head=${nodes[0]} addr
    addr=$(scontrol show node "$head" | grep -oP 'NodeAddr=\K\S+')
    MR_HEAD_IP=$(getent ahostsv4 "$addr" | awk 'NR == 1 {print $1}')
    MR_HEAD_IP=${MR_HEAD_IP:-$addr}
    MR_SIGNALS=0 MR_STOP_REQUESTED=0 MR_RAY_STEPS=() MR_DRIVER=
    # Per-job files (the driver's PID) on the shared filesystem, also seen from inside the container.
    MR_JOBDIR="$MR_ROOT/outputs/slurm/${SLURM_CLUSTER_NAME:-slurm}-$SLURM_JOB_ID"
    MR_DRIVER_PIDFILE="$MR_JOBDIR/driver.pid"
    mkdir -p "$MR_JOBDIR" && rm -f "$MR_DRIVER_PIDFILE"
    # This job's own Ray auth token: Ray 2.60 turns token auth on for a head when ~/.ray/auth_token
    # exists, and its workers then fail without the token; an explicit one works everywhere.
    RAY_AUTH_TOKEN=$("$MR_PYTHON" -c 'import secrets; print(secrets.token_hex(32))') ||
        _mr_fail "$MR_PYTHON does not run (MEGAREASON_PYTHON)"
    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN RAY_USAGE_STATS_ENABLED=0
    export MR_ROOT MR_PYTHON MR_RAY_TMPDIR MR_RAY_PORT_BASE MR_NODES MR_HEAD_IP
    trap _mr_on_usr1 USR1
    trap '_mr_teardown; rm -rf "$MR_JOBDIR"' EXIT
    local n=${#nodes[@]} gpus=$(( ${#nodes[@]} * ${SLURM_GPUS_ON_NODE:-0} ))
    _mr_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $config on $n nodes ($MR_NODES)," \
            "Ray head $head at $MR_HEAD_IP:$MR_RAY_PORT_BASE, container: ${MEGAREASON_CONTAINER_IMAGE:-none}"

    local ray_node=(bash "$MR_ROOT/slurm/ray_cluster.sh" node)
    _mr_srun --nodes=1 --ntasks=1 -w "$head" --cpus-per-task="$SLURM_CPUS_ON_NODE" "${ray_node[@]}" &
    MR_RAY_STEPS+=($!)
    if (( n > 1 )); then
        _mr_srun --nodes=$((n - 1)) --ntasks=$((n - 1)) --ntasks-per-node=1 --exclude="$head" \
                 --cpus-per-task="$SLURM_CPUS_ON_NODE" "${ray_node[@]}" &
        MR_RAY_STEPS+=($!)
    fi
    local wait_s=${MEGAREASON_RAY_WAIT_S:-600}
    _mr_srun --nodes=1 --ntasks=1 -w "$head" "$MR_PYTHON" -c "$_MR_WAIT_PY" "$MR_HEAD_IP:$MR_RAY_PORT_BASE" \
             "$n" "$gpus" "$wait_s" &
    local waiter=$!
    while _mr_alive "$waiter"; do  # a Ray step that dies early fails the job now, not after the timeout
        for pid in "${MR_RAY_STEPS[@]}"; do
            _mr_alive "$pid" || { kill "$waiter"; _mr_fail "a Ray node step exited during start-up (see above)"; }
        done
        sleep 2
    done
    _mr_wait "$waiter" || _mr_fail "the Ray cluster did not come up: expected $n nodes and $gpus GPUs" \
                                   "within $wait_s s (MEGAREASON_RAY_WAIT_S)"
    if (( MR_STOP_REQUESTED )); then
        _mr_teardown
        scontrol requeue "$SLURM_JOB_ID"
        exit "$MEGAREASON_EXIT_STOPPED"
    fi

    # The driver writes its PID (the host's, also in a pyxis container) so SIGUSR1 reaches it alone:
    # a signal to its srun would reach every process of the step, the reward workers included.
    # shellcheck disable=SC2016  # $$ and $@ belong to the inner bash
    _mr_srun --nodes=1 --ntasks=1 -w "$head" --cpus-per-task="$SLURM_CPUS_ON_NODE" \
             bash -c 'echo $$ > "$0" && exec "$@"' "$MR_DRIVER_PIDFILE" \
             "$MR_PYTHON" -m megareason.cli train --config-name "$config" \
             "trainer.ray_address=$MR_HEAD_IP:$MR_RAY_PORT_BASE" "$@" &
    MR_DRIVER=$!
    local rc
    _mr_wait "$MR_DRIVER"; rc=$?
    _mr_log "driver exited with $rc"
    _mr_teardown
    if (( MR_STOP_REQUESTED && rc == MEGAREASON_EXIT_STOPPED )); then
        _mr_log "requeueing job $SLURM_JOB_ID: the next run resumes from the checkpoint just saved"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    exit "$rc"
}

if [[ ${BASH_SOURCE[0]} == "$0" && ${1:-} == node ]]; then
    _mr_ray_node
fi
