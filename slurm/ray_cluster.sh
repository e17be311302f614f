#!/bin/bash
# Ray across a Slurm allocation, then the megareason driver: the logic every slurm/*.sbatch recipe (and
# `megareason launch --executor slurm`) shares.
#
# A recipe sources this file and calls `megareason_slurm_run CONFIG "$@"` (CONFIG: a name in configs/ or a
# path to a YAML file), which
#   1. checks every node (one task per node, in the container; megareason/launch/node_check.py): the
#      interfaces gloo and NCCL will use (loopback fails a job whose nodes are on several hosts), InfiniBand
#      HCAs, open-files and memory limits, the ephemeral port range against the job's Ray ports, Ray's temp
#      dir, the NVIDIA driver against the image's CUDA. With a pyxis image this step also creates each
#      node's container (megareason_JOBID), once, before the concurrent steps attach to it (concurrent first
#      attaches of one named container fail with "Could not acquire rootfs lock");
#   2. checks the job's inputs before Ray starts, each refusal naming what to change (exit code 2, no
#      requeue): the config with the driver's own arguments and its preflight (model, data files, free space
#      for the checkpoints it keeps: megareason/launch/slurm_job.py run-dir); and that a job across several
#      hosts keeps its run folder (trainer.output_dir) outside the checkout, on scratch storage. At the first
#      start it then snapshots the code into the run folder (_mr_snapshot): every later step and every
#      requeued run runs that snapshot;
#   3. starts a Ray head on the first node and a Ray worker on each other node (srun steps running
#      megareason/launch/ray_node.py: `ray start --block` with SIGTERM blocked, retried while the cluster
#      is not up), with a per-job auth token and ports in a per-job block below the ephemeral range (not
#      `ray symmetric-run`, which starts every node alike: each node here gets its own port block and
#      ray_node.py's pre-emption handling);
#   4. waits until Ray reports every node (and every GPU, when the job has GPUs), or fails saying what is
#      missing (a Ray step that dies fails the job at once);
#   5. runs `megareason train --config-name CONFIG trainer.ray_address=HEAD:PORT OVERRIDES...` on the first
#      node and exits with its exit code;
#   6. stops: SIGUSR1 to this script (sbatch --signal=B:USR1@LEAD, before the time limit) is forwarded to
#      the driver, which saves a checkpoint and exits with 75. A pre-emption's SIGTERM reaches the job steps
#      (not this script): the driver does the same on it, and Ray, which ignores it, stays up for the
#      checkpoint. On exit code 75 the job tears Ray down (keeping its logs), requeues itself (`scontrol
#      requeue`), and the next run resumes from that checkpoint (trainer.resume_mode=auto). A missed deadline
#      still requeues: Slurm's SIGTERM at the time limit (JobState TIMEOUT) reaches this script, which
#      requeues the job first thing (the next run resumes from the latest complete checkpoint; a save that
#      KillWait's SIGKILL cut short leaves a .tmp folder, which the next start removes); a job cancelled by
#      scancel is not requeued;
#   7. stops Ray through a file the Ray steps watch: each kills its Ray process tree and copies its Ray logs
#      to RUN_FOLDER/ray_logs/restart_R/NODE/; never `ray stop`, which kills every Ray on a node.
# `bash slurm/ray_cluster.sh node` is step 3's per-node command (run inside the srun steps).
#
# Environment (all optional):
#   MEGAREASON_ROOT              the megareason checkout (default: $SLURM_SUBMIT_DIR; submit from there); the
#                                driver runs there, so a relative trainer.output_dir is relative to it
#   MEGAREASON_PYTHON            python with megareason and ray installed (default: python3)
#   MEGAREASON_CONTAINER_IMAGE   run every step in this image via pyxis/enroot (srun --container-image,
#                                --no-container-mount-home); unset: the plain environment of the nodes
#   MEGAREASON_CONTAINER_MOUNTS  extra pyxis mounts, SRC:DST[,...]; the checkout and the Ray temp dir are
#                                always mounted (models, data and output folders are yours to add)
#   MEGAREASON_RAY_PORT_BASE     first port of the job's block (default: 2000 + 800 x (job id mod 8), so every
#                                port stays below 9000, where the ephemeral range starts on some DGX nodes);
#                                node k uses BASE + 200 x (k mod 4) ... + 199: Ray's own ports (+0..+8; the
#                                head's GCS is BASE), Ray's worker ports (+10..+135), megareason's services
#                                (+136..+199: torch.distributed rendezvous, vLLM; megareason/ports.py)
#   MEGAREASON_RAY_WORKERS_SOFT_LIMIT  idle Ray workers a node keeps (RAY_num_workers_soft_limit; default 32);
#                                prestarting workers is off
#   MEGAREASON_RAY_WAIT_S        how long to wait for the Ray cluster (default: 1800 s: unpacking a large
#                                image on many nodes takes minutes)
#   MEGAREASON_RAY_START_RETRIES more `ray start` attempts per node while the cluster is not up (ray_node.py's
#                                default: 3)
#   MEGAREASON_RAY_TMPDIR        an existing node-local directory for Ray's temp dirs, logs and spilled
#                                objects, and every cache and temporary folder of a step
#                                (megareason/launch/job_env.py) (default: $TMPDIR or /tmp; mounted into the
#                                container; keep the path short: Ray's socket paths must stay under 107 characters)
#   MEGAREASON_RAY_START_ARGS    extra `ray start` arguments, e.g. --object-store-memory=...
#   NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_*: reach every step (srun passes the job's
#                                environment on); step 1 prints what they select on each node

MEGAREASON_EXIT_STOPPED=75  # the driver's exit code after a signal-requested checkpoint (trainer/loop.py)
MR_EXIT_REFUSED=2           # the job's inputs were refused before Ray started (the CLI's code for bad input)
MR_NODE_SLOTS=4             # Slurm nodes of one job that may share a host (a test cluster): distinct ports
MR_RAY_WORKER_PORTS=126     # per node: one for each Ray worker process (an actor or a task's worker)

_mr_log() { echo "$(date +%T) megareason-slurm: $*"; }

# srun on the given nodes, inside the container when one is configured: `_mr_srun SRUN_OPTIONS... -- COMMAND...`.
# COMMAND runs through megareason/launch/job_env.py, which points every cache and temporary folder of the
# stack (vLLM, torch inductor, Triton, Hugging Face, matplotlib, TMPDIR, a home that cannot be written) at the
# node's folder of the job under MR_RAY_TMPDIR: the container's root and home stay untouched (enroot mounts
# the root read-only by default). MR_STEP_SCRATCH=--ephemeral: a folder of the step's own, removed after it.
_mr_srun() {
    local opts=()
    while (( $# )) && [[ $1 != -- ]]; do opts+=("$1"); shift; done
    shift
    local where=(--chdir="$MR_ROOT")
    if [[ -n ${MEGAREASON_CONTAINER_IMAGE:-} ]]; then
        local mounts="$MR_ROOT:$MR_ROOT,$MR_RAY_TMPDIR:$MR_RAY_TMPDIR"
        mounts+=${MEGAREASON_CONTAINER_MOUNTS:+,$MEGAREASON_CONTAINER_MOUNTS}
        # One container per job for every step: step 1 creates it on each node from the image, later steps
        # attach to it. Named per job: pyxis keeps a named container on the node after the job with
        # container_scope=global and then skips the import, so a node would keep an older image's stack.
        where=(--container-image="$MEGAREASON_CONTAINER_IMAGE" --container-name="$MR_CONTAINER"
               --container-mounts="$mounts" --container-workdir="$MR_ROOT" --no-container-mount-home)
    fi
    # --overlap: the Ray steps, the driver and the checks share the nodes' CPUs and GPUs.
    srun --overlap "${opts[@]}" "${where[@]}" "$MR_PYTHON" -m megareason.launch.job_env ${MR_STEP_SCRATCH:-} -- "$@"
}

# One Ray node (inside an srun step, one task per node): the head on the job's first node.
_mr_ray_node() {
    local nodes index=-1 k
    read -ra nodes <<< "$MR_NODES"
    for k in "${!nodes[@]}"; do [[ ${nodes[k]} == "$SLURMD_NODENAME" ]] && index=$k; done
    (( index >= 0 )) || { echo "node $SLURMD_NODENAME is not in MR_NODES=$MR_NODES" >&2; exit 1; }
    # Distinct ports for Slurm nodes sharing one host (a test cluster); the same on real hosts.
    local b=$((MR_RAY_PORT_BASE + 200 * (index % MR_NODE_SLOTS)))
    local args=(--disable-usage-stats --num-cpus="$SLURM_CPUS_ON_NODE"
                --node-manager-port=$((b + 3)) --object-manager-port=$((b + 4)) --metrics-export-port=$((b + 5))
                --dashboard-agent-listen-port=$((b + 6)) --dashboard-agent-grpc-port=$((b + 7))
                --runtime-env-agent-port=$((b + 8)) --min-worker-port=$((b + 10))
                --max-worker-port=$((b + 9 + MR_RAY_WORKER_PORTS)))
    # The node's last 64 ports: the megareason services its Ray workers start (torch.distributed rendezvous,
    # vLLM; megareason/ports.py). Ray's workers inherit the variable from the raylet.
    export MEGAREASON_PORT_BASE=$((b + 136))
    # Each Ray worker process holds one of the node's 126 worker ports. Ray keeps as many idle workers as the
    # node has CPUs (RAY_num_workers_soft_limit's default: 224 on a DGX H100 node with SMT) and may prestart
    # workers for the first driver (ray_config_def.h); both are bounded here.
    export RAY_prestart_worker_first_driver=0 RAY_enable_worker_prestart=0
    export RAY_num_workers_soft_limit=${MEGAREASON_RAY_WORKERS_SOFT_LIMIT:-32}
    if (( index == 0 )); then
        args+=(--head --node-ip-address="$MR_HEAD_IP" --port="$MR_RAY_PORT_BASE"
               --ray-client-server-port=$((b + 1)) --include-dashboard=false --dashboard-port=$((b + 2)))
    else
        args+=(--address="$MR_HEAD_IP:$MR_RAY_PORT_BASE")
    fi
    # shellcheck disable=SC2206  # MEGAREASON_RAY_START_ARGS is a list of words
    args+=(${MEGAREASON_RAY_START_ARGS:-})
    exec "$MR_PYTHON" -m megareason.launch.ray_node --job-dir="$MR_JOBDIR" \
        --temp-dir="$MR_RAY_TMPDIR/mr-ray-$SLURM_JOB_ID-$index" \
        ${MEGAREASON_RAY_START_RETRIES:+--retries="$MEGAREASON_RAY_START_RETRIES"} -- "${args[@]}"
}

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

# SIGUSR1 (the time limit ahead: sbatch --signal=B:USR1@LEAD) or SIGTERM to this script: ask the driver to
# checkpoint and stop, with SIGUSR1 (it may have had a SIGTERM of its own already; a second one kills it).
_mr_on_signal() {
    MR_SIGNALS=$((MR_SIGNALS + 1)) MR_STOP_REQUESTED=1
    if [[ -n ${MR_AWAITING_NODE_FAILURE:-} ]]; then
        _mr_log "SIG$1: Slurm requeued the job after the failure of node(s) $MR_AWAITING_NODE_FAILURE" \
                "($(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -oP 'Restarts=\S+' | head -1))"
        exit "$MEGAREASON_EXIT_STOPPED"  # the EXIT trap tears down what is left of Ray
    fi
    if [[ $1 == TERM ]] && (( ${MR_REQUEUED:-0} )); then
        _mr_log "SIGTERM: the job's own requeue ends its steps"
        return
    fi
    [[ $1 == TERM ]] && _mr_requeue_on_term
    if [[ -z $MR_DRIVER ]]; then
        _mr_log "SIG$1 before the driver started: requeueing once Ray is up"
        return
    fi
    _mr_log "SIG$1 (time limit or pre-emption ahead): asking the driver to checkpoint and stop"
    for _ in $(seq 60); do  # the driver may not have written its PID yet
        [[ -s $MR_DRIVER_PIDFILE ]] && { kill -USR1 "$(<"$MR_DRIVER_PIDFILE")" 2>/dev/null; return; }
        _mr_alive "$MR_DRIVER" || return
        sleep 1
    done
}

# Stop Ray: the Ray steps see the stop file, kill their Ray and keep its logs; srun's own SIGTERM handling
# (SIGKILL to the step's tasks) is the fallback for a step that does not end within two minutes.
_mr_teardown() {
    local pid sig
    (( ${#MR_RAY_STEPS[@]} )) || return 0
    touch "$MR_JOBDIR/ray.stop"
    for sig in NONE TERM KILL; do
        [[ $sig != NONE ]] && for pid in "${MR_RAY_STEPS[@]}"; do _mr_alive "$pid" && kill -"$sig" "$pid"; done
        for _ in $(seq 120); do
            _mr_steps_alive || break
            sleep 1
        done
        _mr_steps_alive || break
    done
    MR_RAY_STEPS=()
    _mr_log "Ray stopped"
}

_mr_steps_alive() {
    local pid
    for pid in "${MR_RAY_STEPS[@]}"; do _mr_alive "$pid" && return 0; done
    return 1
}

_mr_fail() {
    _mr_log "error: $*"
    exit 1  # the EXIT trap tears Ray down
}

# Requeue this job, once: the next run resumes from the run folder's latest complete checkpoint. First, before
# Ray's teardown (up to minutes), which a time limit's or pre-emption's SIGKILL may cut short. Slurm ends the
# job's steps as a requeue does (SIGTERM, KillWait, SIGKILL), which the teardown would do anyway.
_mr_requeue_job() {
    (( MR_REQUEUED )) && return 0
    _mr_log "requeueing job $SLURM_JOB_ID ($1): the next run resumes from the latest checkpoint"
    scontrol requeue "$SLURM_JOB_ID" && MR_REQUEUED=1
}

# After the driver's checkpoint: Ray's teardown first (its steps keep Ray's logs in the run folder; a requeue's
# SIGTERM to the steps would cut that short), then the requeue, then exit with 75. The time limit's SIGTERM
# requeues first thing instead (_mr_requeue_on_term).
_mr_requeue() {
    _mr_teardown
    _mr_requeue_job "$1"
    exit "$MEGAREASON_EXIT_STOPPED"
}

# SIGTERM to this script. At the time limit Slurm marks the job TIMEOUT, then sends SIGTERM to the script and
# every step and SIGKILL KillWait seconds later: no time for a checkpoint of a large model, so the job is
# requeued at once and resumes from the latest complete checkpoint (a missed deadline: a step far longer than
# the last one). Not after scancel (CANCELLED). Otherwise (a pre-emption's grace time, a signal sent by
# hand) the driver is asked to stop and the requeue follows its checkpoint (exit code 75).
_mr_requeue_on_term() {
    local state
    state=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -oP 'JobState=\K\S+' | head -1)
    case $state in
        TIMEOUT*|DEADLINE*) _mr_requeue_job "SIGTERM at the time limit (JobState=$state)" ;;
        CANCELLED*) _mr_log "SIGTERM: the job was cancelled (JobState=$state): not requeued" ;;
    esac
}

# The job folder goes with the job; a requeued job keeps its record of the code it started from.
_mr_clean_jobdir() {
    if (( ${MR_REQUEUED:-0} )); then
        find "$MR_JOBDIR" -mindepth 1 -maxdepth 1 ! -name checkout -exec rm -rf {} +
    else
        rm -rf "$MR_JOBDIR"
    fi
}

# How many distinct hosts the given node addresses (Slurm's NodeAddr) are: each resolved to its IPv4 address
# here, every loopback address counted as one host (a test cluster's Slurm nodes on one machine).
_mr_count_hosts() {
    local addr ip
    for addr in "$@"; do
        ip=$(getent ahostsv4 "$addr" | awk 'NR == 1 {print $1}')
        ip=${ip:-$addr}
        [[ $ip == 127.* || $ip == ::1 || $ip == localhost ]] && ip=loopback
        echo "$ip"
    done | sort -u | wc -l
}

# The checkout's code: "COMMIT clean" or "COMMIT dirty:HASH" (HASH: of its uncommitted changes to tracked
# files); fails when $1 is not a git checkout or git is missing.
_mr_checkout_state() {
    local commit diff
    commit=$(git -C "$1" rev-parse HEAD 2>/dev/null) || return 1
    if git --no-optional-locks -C "$1" diff --quiet HEAD -- 2>/dev/null; then
        echo "$commit clean"
    else
        diff=$(git --no-optional-locks -C "$1" diff --binary HEAD -- | sha256sum)
        echo "$commit dirty:${diff:0:12}"
    fi
}

# The code this job runs: at its first start a snapshot of the checkout MR_ROOT's megareason/, configs/, slurm/
# and pyproject.toml (in a git checkout: their tracked files and the untracked ones git does not ignore, with
# their uncommitted changes, as NeMo-RL's tools/code_snapshot.sh copies a checkout's tracked files) into the run
# folder, RUN/code/CLUSTER-JOB, written whole or not at all; the job folder records where (its `checkout`
# file). Every later step of the job and every requeued run runs that snapshot (PYTHONPATH, with
# PYTHONSAFEPATH=1 so that the working directory, the checkout, never comes first), so an edit or a new commit
# in the checkout reaches neither a running job nor its requeue. A new job takes a new snapshot: it resumes the
# run with the checkout's code of then, on purpose. $1: the run folder.
_mr_snapshot() {
    local dest="$1/code/${SLURM_CLUSTER_NAME:-slurm}-$SLURM_JOB_ID" state
    local paths=(megareason configs slurm pyproject.toml)
    local tmp="$dest.partial"
    rm -rf "$tmp" && mkdir -p "$tmp" || return 1
    if state=$(_mr_checkout_state "$MR_ROOT"); then
        git -C "$MR_ROOT" ls-files -z --cached --others --exclude-standard -- "${paths[@]}" |
            tar -C "$MR_ROOT" --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -C "$tmp" -xf - || return 1
    else
        state="not a git checkout"
        local have=() p
        for p in "${paths[@]}"; do [[ -e $MR_ROOT/$p ]] && have+=("$p"); done
        tar -C "$MR_ROOT" --exclude=__pycache__ -cf - "${have[@]}" | tar -C "$tmp" -xf - || return 1
    fi
    echo "$MR_ROOT $state" > "$tmp/.megareason-code"
    rm -rf "$dest" && mv "$tmp" "$dest" || return 1
    echo "$dest" > "$MR_JOBDIR/checkout.tmp" && mv "$MR_JOBDIR/checkout.tmp" "$MR_JOBDIR/checkout"
    MR_CODE=$dest
}

# Run every later step from the code in $MR_CODE (the checkout at the first start until its snapshot exists).
_mr_use_code() {
    export MR_CODE PYTHONSAFEPATH=1 PYTHONPATH="$MR_CODE${MR_PYTHONPATH:+:$MR_PYTHONPATH}"
}

# Open files: Ray's processes hold many sockets and files; srun passes the soft limit on to the steps.
_mr_raise_nofile() {
    local hard want=65536
    hard=$(ulimit -Hn)
    [[ $hard != unlimited ]] && (( hard < want )) && want=$hard
    (( $(ulimit -Sn) < want )) && ulimit -Sn "$want"
}

megareason_slurm_run() {
    local config=$1; shift
    MR_ROOT=${MEGAREASON_ROOT:-$SLURM_SUBMIT_DIR}
    MR_PYTHON=${MEGAREASON_PYTHON:-python3}
    MR_RAY_TMPDIR=${MEGAREASON_RAY_TMPDIR:-${TMPDIR:-/tmp}}
    MR_RAY_PORT_BASE=${MEGAREASON_RAY_PORT_BASE:-$((2000 + 800 * (SLURM_JOB_ID % 8)))}
    MR_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\n' ' ')
    local nodes hosts addrs
    read -ra nodes <<< "$MR_NODES"
    local head=${nodes[0]} addr
    addr=$(scontrol show node "$head" | grep -oP 'NodeAddr=\K\S+')
    MR_HEAD_IP=$(getent ahostsv4 "$addr" | awk 'NR == 1 {print $1}')
    MR_HEAD_IP=${MR_HEAD_IP:-$addr}
    read -ra addrs <<< "$(scontrol show node "$SLURM_JOB_NODELIST" | grep -oP 'NodeAddr=\K\S+' | tr '\n' ' ')"
    hosts=$(_mr_count_hosts "${addrs[@]}")
    MR_SIGNALS=0 MR_STOP_REQUESTED=0 MR_RAY_STEPS=() MR_DRIVER= MR_REQUEUED=0
    # Per-job files (the run folder, Ray's stop file, where the code's snapshot is) on the shared filesystem,
    # written by this script only, read also from inside the container.
    MR_JOBDIR="$MR_ROOT/outputs/slurm/${SLURM_CLUSTER_NAME:-slurm}-$SLURM_JOB_ID"
    # The driver's PID, written by its step: in the head node's folder of the job (job_env.py), one of the few
    # places a step can write in a container with a read-only root.
    MR_DRIVER_PIDFILE="$MR_RAY_TMPDIR/mr-ray-$SLURM_JOB_ID-0/driver.pid"
    MR_CONTAINER="megareason_$SLURM_JOB_ID"
    mkdir -p "$MR_JOBDIR" && rm -f "$MR_JOBDIR"/{ray.stop,ray.up,run_dir} "$MR_DRIVER_PIDFILE"
    # The code: the checkout until the first start's snapshot is taken; a requeued run's, from its start.
    MR_CODE=$MR_ROOT MR_PYTHONPATH=${PYTHONPATH:-}
    if (( ${SLURM_RESTART_COUNT:-0} > 0 )) && [[ -s $MR_JOBDIR/checkout ]]; then
        MR_CODE=$(<"$MR_JOBDIR/checkout")
        [[ -f $MR_CODE/.megareason-code ]] ||
            _mr_fail "the snapshot of the code this job started with, $MR_CODE, is gone: submit a new job (it" \
                     "resumes the run from its latest checkpoint with the checkout's code)"
    fi
    _mr_use_code
    _mr_raise_nofile
    # This job's own Ray auth token: Ray 2.60 turns token auth on for a head when ~/.ray/auth_token
    # exists, and its workers then fail without the token; an explicit one works everywhere.
    RAY_AUTH_TOKEN=$("$MR_PYTHON" -c 'import secrets; print(secrets.token_hex(32))') ||
        _mr_fail "$MR_PYTHON does not run (MEGAREASON_PYTHON)"
    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN RAY_USAGE_STATS_ENABLED=0
    export MR_ROOT MR_PYTHON MR_RAY_TMPDIR MR_RAY_PORT_BASE MR_NODES MR_HEAD_IP MR_JOBDIR MR_NODE_SLOTS MR_CONTAINER
    # The job's end time: the driver saves and stops before it without waiting for a signal
    # (trainer.must_save_by_minutes in megareason/config/schema.py). None for a job without a time limit.
    local end
    end=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -oP 'EndTime=\K\S+' | head -1)
    if [[ $end =~ ^[0-9]{4}- ]] && end=$(date -d "$end" +%s 2>/dev/null); then
        export MEGAREASON_JOB_END_TIME=$end
    fi
    trap '_mr_on_signal USR1' USR1
    trap '_mr_on_signal TERM' TERM
    trap '_mr_teardown; _mr_clean_jobdir' EXIT
    local n=${#nodes[@]} gpus=$(( ${#nodes[@]} * ${SLURM_GPUS_ON_NODE:-0} ))
    local ports="$MR_RAY_PORT_BASE-$((MR_RAY_PORT_BASE + 200 * MR_NODE_SLOTS - 1))"
    _mr_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $config on $n nodes (${MR_NODES% })" \
            "on $hosts host(s), Ray head $head at $MR_HEAD_IP:$MR_RAY_PORT_BASE (ports $ports)," \
            "Ray temp dirs in $MR_RAY_TMPDIR, open files $(ulimit -Sn), container: ${MEGAREASON_CONTAINER_IMAGE:-none}," \
            "ends: $(date -d "@${MEGAREASON_JOB_END_TIME:-}" +%FT%T 2>/dev/null || echo 'no time limit')"
    [[ $MR_CODE != "$MR_ROOT" ]] &&
        _mr_log "code: $MR_CODE, the snapshot of $(<"$MR_CODE/.megareason-code") at the job's first start"
    if (( hosts > 1 )) && [[ $MR_HEAD_IP == 127.* ]]; then
        _mr_fail "the head node $head's address $addr resolves to $MR_HEAD_IP (loopback) here, on a job across" \
                 "$hosts hosts: the other nodes cannot reach Ray's head; fix the node's NodeAddr or /etc/hosts"
    fi

    # 1. every node, one task each: what NCCL/gloo/Ray will use (and the container, created once per node)
    MR_STEP_SCRATCH=--ephemeral _mr_srun --nodes="$n" --ntasks="$n" --ntasks-per-node=1 -- \
             "$MR_PYTHON" -m megareason.launch.node_check \
             --nodes="$n" --hosts="$hosts" --ports="$ports" --ray-tmpdir="$MR_RAY_TMPDIR" --head-ip="$MR_HEAD_IP" ||
        _mr_fail "the node check failed (its errors are above)"

    # 2. the job's inputs: the config and its preflight with the driver's own arguments, the run folder; the code
    local train_args=(--config-name "$config")
    if [[ $config == *.yaml || $config == *.yml || $config == */* ]]; then
        train_args=(--config-dir "$(dirname "$config")" --config-name "$(basename "${config%.y*ml}")")
    fi
    local out rc
    out=$(MR_STEP_SCRATCH=--ephemeral _mr_srun --nodes=1 --ntasks=1 -w "$head" -- \
              "$MR_PYTHON" -m megareason.launch.slurm_job run-dir \
              --hosts="$hosts" --checkout="$MR_ROOT" "${train_args[@]}" "$@"); rc=$?
    if (( rc != 0 )); then
        _mr_log "the config was refused (exit code $rc, the reason is above); Ray was not started"
        exit "$rc"
    fi
    MR_RUN_DIR=${out##*$'\n'}
    echo "$MR_RUN_DIR" > "$MR_JOBDIR/run_dir.tmp" && mv "$MR_JOBDIR/run_dir.tmp" "$MR_JOBDIR/run_dir"
    _mr_log "run folder: $MR_RUN_DIR (this run's Ray logs: ray_logs/restart_${SLURM_RESTART_COUNT:-0}/)"
    if [[ $MR_CODE == "$MR_ROOT" ]]; then
        _mr_snapshot "$MR_RUN_DIR" || _mr_fail "the code could not be copied into $MR_RUN_DIR/code"
        _mr_use_code
        _mr_log "code: $MR_CODE, the snapshot of $(<"$MR_CODE/.megareason-code") at the job's first start"
    fi
    if [[ ${train_args[0]} == --config-dir ]]; then  # a YAML file of the checkout: the snapshot's copy
        local dir root
        dir=$(cd "$MR_ROOT" && realpath -m "${train_args[1]}") root=$(realpath -m "$MR_ROOT")
        [[ $dir == "$root"/* && -d $MR_CODE/${dir#"$root"/} ]] && train_args[1]=$MR_CODE/${dir#"$root"/}
    fi

    # 3. Ray
    # No --cpus-per-task: a step then has all of the job's CPUs on each of its nodes (srun's default without
    # --exact), and each node's Ray declares its own node's count, whatever the others have.
    local ray_node=(bash "$MR_CODE/slurm/ray_cluster.sh" node)
    _mr_srun --nodes=1 --ntasks=1 -w "$head" -- "${ray_node[@]}" &
    MR_RAY_STEPS+=($!)
    if (( n > 1 )); then
        _mr_srun --nodes=$((n - 1)) --ntasks=$((n - 1)) --ntasks-per-node=1 --exclude="$head" -- "${ray_node[@]}" &
        MR_RAY_STEPS+=($!)
    fi

    # 4. the wait
    local wait_s=${MEGAREASON_RAY_WAIT_S:-1800} pid
    _mr_srun --nodes=1 --ntasks=1 -w "$head" -- "$MR_PYTHON" -m megareason.launch.slurm_job wait \
             "$MR_HEAD_IP:$MR_RAY_PORT_BASE" "$n" "$gpus" "$wait_s" &
    local waiter=$!
    while _mr_alive "$waiter"; do  # a Ray step that dies early fails the job now, not after the timeout
        for pid in "${MR_RAY_STEPS[@]}"; do
            if ! _mr_alive "$pid"; then
                kill "$waiter"
                _mr_requeue_without_failed_nodes
                _mr_fail "a Ray node step exited during start-up (see above)"
            fi
        done
        sleep 2
    done
    if ! _mr_wait "$waiter"; then
        (( MR_STOP_REQUESTED )) && _mr_requeue "a stop signal came during start-up"
        _mr_fail "the Ray cluster did not come up: expected $n nodes and $gpus GPUs within $wait_s s" \
                 "(MEGAREASON_RAY_WAIT_S)"
    fi
    touch "$MR_JOBDIR/ray.up"
    (( MR_STOP_REQUESTED )) && _mr_requeue "a stop signal came during start-up"

    # 5. the driver. It writes its PID (the host's, also in a pyxis container) so SIGUSR1 reaches it
    # alone: a signal to its srun would reach every process of the step, the reward workers included.
    # shellcheck disable=SC2016  # $$ and $@ belong to the inner bash
    _mr_srun --nodes=1 --ntasks=1 -w "$head" --cpus-per-task="$SLURM_CPUS_ON_NODE" -- \
             bash -c 'echo $$ > "$0" && exec "$@"' "$MR_DRIVER_PIDFILE" \
             "$MR_PYTHON" -m megareason.cli train "${train_args[@]}" \
             "trainer.ray_address=$MR_HEAD_IP:$MR_RAY_PORT_BASE" "$@" &
    MR_DRIVER=$!
    _mr_wait "$MR_DRIVER"
    _mr_driver_exited $?
}

# The driver exited with $1: on 75 (a checkpoint, then a stop) the job tears Ray down and requeues; on a
# failure, it requeues without the nodes that failed, if any did; then the EXIT trap tears Ray down.
_mr_driver_exited() {
    _mr_log "driver exited with $1"
    (( $1 == MEGAREASON_EXIT_STOPPED )) && _mr_requeue "the driver stopped after a checkpoint"
    (( $1 != 0 && $1 != MR_EXIT_REFUSED )) && _mr_requeue_without_failed_nodes
    exit "$1"
}

# The job's nodes (MR_NODES) that failed, one "node why" line each: Slurm's node state (DOWN, FAIL, DRAIN, or a
# trailing * for a node whose slurmd stopped answering, which Slurm marks only after SlurmdTimeout), or "no
# answer": a one-task step on it does not run `true` within MEGAREASON_NODE_PROBE_S (default 60) seconds.
_mr_failed_nodes() {
    local node
    for node in $MR_NODES; do
        (
            state=$(scontrol show node "$node" 2>/dev/null | grep -oP 'State=\K\S+' | head -1)
            if [[ -z $state || $state =~ DOWN|FAIL|DRAIN || $state == *'*' ]]; then
                echo "$node ${state:-unknown}"
            elif ! timeout "${MEGAREASON_NODE_PROBE_S:-60}" srun --overlap --nodes=1 --ntasks=1 -w "$node" true \
                    >/dev/null 2>&1; then
                echo "$node no-answer"
            fi
        ) &
    done | sort
    wait
}

# After a failure (the driver's, or a Ray step's): when nodes of the job failed, requeue the job without them,
# and the requeued run resumes from the latest checkpoint on other nodes. Without a failed node the failure
# stands (exit 1).
#  - A node that does not answer (dead, or its slurmd gone): Slurm marks it DOWN SlurmdTimeout after its last
#    answer and then requeues the job itself (a requeueable batch job, `--requeue`), on nodes without it. The
#    script waits for that, up to SlurmdTimeout and a ping interval (SlurmdTimeout/3) more: a requeue of its
#    own would race Slurm's (a node set DOWN while the job is held and being requeued can leave it held
#    for good, or refuse the change of its excluded nodes).
#  - A node that answers but is down for Slurm (DRAIN after a failed health check, e.g. a GPU's XID error), or
#    a dead node Slurm did not mark in time: the job is held, the node added to its ExcNodeList (Slurm changes
#    it on a pending job only), and released; the release is checked.
_mr_requeue_without_failed_nodes() {
    local failed lines unreachable
    lines=$(_mr_failed_nodes)
    [[ -n $lines ]] || return 0
    (( MR_REQUEUED )) && exit "$MEGAREASON_EXIT_STOPPED"
    failed=$(awk '{print $1}' <<<"$lines" | paste -sd, -)
    unreachable=$(awk '$2 == "no-answer" || $2 ~ /DOWN|\*/ {print $1}' <<<"$lines" | paste -sd, -)
    MR_REQUEUED=1  # the requeued run needs the job folder's record of the code
    _mr_log "node(s) $failed down or not answering ($(paste -sd, - <<<"$lines" | sed 's/,/, /g')):" \
            "requeueing job $SLURM_JOB_ID without them; the next run resumes from the latest checkpoint"
    [[ -n $unreachable ]] && _mr_await_slurms_requeue "$unreachable"
    _mr_requeue_excluding "$failed"
    exit "$MEGAREASON_EXIT_STOPPED"
}

# Wait for Slurm to mark the nodes $1 DOWN and requeue the job (its SIGTERM then ends this script: see
# _mr_on_signal). Returns when it did not within SlurmdTimeout + SlurmdTimeout/3 + 30 s.
_mr_await_slurms_requeue() {
    local timeout_s requeue wait_s t
    timeout_s=$(scontrol show config 2>/dev/null | grep -oP '^SlurmdTimeout\s*=\s*\K\d+' | head -1)
    requeue=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -oP '\bRequeue=\K\d' | head -1)
    [[ ${timeout_s:-0} -gt 0 && $requeue == 1 ]] || return 0
    wait_s=$((timeout_s + timeout_s / 3 + 30))
    _mr_log "node(s) $1 do not answer: Slurm marks them DOWN after SlurmdTimeout ($timeout_s s) and requeues" \
            "the job without them; waiting up to $wait_s s for that"
    MR_AWAITING_NODE_FAILURE=$1
    for ((t = 0; t < wait_s; t += 2)); do sleep 2; done
    MR_AWAITING_NODE_FAILURE=
    _mr_log "warning: Slurm did not requeue the job within $wait_s s: requeueing it without node(s) $1 itself"
}

# Requeue the job held, add the nodes $1 to its ExcNodeList, release it; the release checked (a job left held
# would never run again).
_mr_requeue_excluding() {
    local excluded state
    excluded=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -oP 'ExcNodeList=\K\S+' | head -1)
    [[ $excluded == "(null)" ]] && excluded=
    excluded=${excluded:+$excluded,}$1
    scontrol requeuehold "$SLURM_JOB_ID" || return 0
    # The requeue's SIGTERM reaches this script's children too (a scontrol in flight): each change is read
    # back and tried again.
    for _ in 1 2 3 4 5; do
        scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$excluded" 2>/dev/null
        state=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -oP 'ExcNodeList=\K\S+' | head -1)
        [[ $state == "$excluded" ]] && break
        sleep 1
    done
    if [[ $state == "$excluded" ]]; then
        _mr_log "job $SLURM_JOB_ID requeued held, its ExcNodeList set to $excluded"
    else
        _mr_log "warning: the failed node(s) could not be excluded; the requeued job may land on them again"
    fi
    for _ in 1 2 3 4 5; do
        scontrol release "$SLURM_JOB_ID" 2>/dev/null
        state=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -oP 'Reason=\K\S+' | head -1)
        [[ $state != *held* && $state != *Held* ]] && { _mr_log "job $SLURM_JOB_ID released"; return 0; }
        sleep 1
    done
    _mr_log "error: job $SLURM_JOB_ID is still held (Reason=$state): release it with scontrol release $SLURM_JOB_ID"
}

if [[ ${BASH_SOURCE[0]} == "$0" && ${1:-} == node ]]; then
    _mr_ray_node
elif [[ ${BASH_SOURCE[0]} != "$0" ]] && (( ${SLURM_RESTART_COUNT:-0} > 0 )) && [[ -z ${MR_SNAPSHOT_SOURCED:-} ]]; then
    # A recipe sources this file from the checkout: a requeued run defines these functions again from the
    # snapshot its first start took (megareason_slurm_run), so the checkout's edits reach not even the job script.
    _mr_record="${MEGAREASON_ROOT:-$SLURM_SUBMIT_DIR}/outputs/slurm/${SLURM_CLUSTER_NAME:-slurm}-$SLURM_JOB_ID/checkout"
    if [[ -s $_mr_record && -f $(<"$_mr_record")/slurm/ray_cluster.sh ]]; then
        MR_SNAPSHOT_SOURCED=1
        # shellcheck source=/dev/null
        source "$(<"$_mr_record")/slurm/ray_cluster.sh"
    fi
fi
