# shellcheck shell=bash
# The body of slurm/run_qwen35_*.sh, sourced by them: check the inputs, set the
# environment, start one task per GPU with srun, and turn the USR1 that SLURM
# sends before the time limit into a checkpoint, a clean exit and a requeue.
#
# The caller sets QWEN35_RECIPE (e.g. "lm train"), QWEN35_DEFAULT_CONFIG (a
# path in the checkout) and QWEN35_REPO, then runs `qwen35_launch "$@"`.
# Every setting the user may change is an environment variable; see
# docs/slurm.md.

qwen35_log() { echo "[qwen35-slurm] $*"; }

# Bad input ends the job at start time with one clear line in the error file
# and exit code 2, before any training process exists.
qwen35_fail() {
    echo "[qwen35-slurm] error: $*" >&2
    [ -z "${QWEN35_PROBE:-}" ] || rm -f -- "$QWEN35_PROBE"
    exit 2
}

# The output directory of the configuration file (`output_dir:`), if any. Read
# with the venv's YAML parser so that quoting and comments are handled.
_qwen35_config_output_dir() {
    "$1" - "$2" <<'EOF'
import sys
from ruamel.yaml import YAML
with open(sys.argv[1], encoding="utf-8") as f:
    doc = next(iter(YAML(typ="safe", pure=True).load_all(f)), None)
value = doc.get("output_dir") if isinstance(doc, dict) else None
if isinstance(value, str) and value:
    print(value)
EOF
}

# Every step_N checkpoint directory under OUTPUT_DIR/checkpoints or the
# checkpoints of its sweep directories (`common.no_sweep_dir=false`), a line
# each, sorted.
_qwen35_checkpoints() {
    local d
    for d in "$1"/checkpoints/step_* "$1"/*/checkpoints/step_*; do
        if [ -d "$d" ] && [[ ${d##*/step_} =~ ^[0-9]+$ ]]; then echo "$d"; fi
    done | sort
}

# The highest N of those step_N directories, or nothing.
_qwen35_last_checkpoint() {
    local d best=""
    while IFS= read -r d; do
        d=${d##*/step_}
        if [ -z "$best" ] || [ "$d" -gt "$best" ]; then best=$d; fi
    done < <(_qwen35_checkpoints "$1")
    echo "$best"
}

# USR1 from SLURM (`--signal=B:USR1@...` reaches only this shell): remember it
# and pass it on to srun, which forwards it to every rank. fairseq2's trainer
# then saves a checkpoint and stops. srun drops a signal that comes before it
# has started the ranks, and the ranks ignore one that comes before fairseq2
# has set its handler, so the request also goes into the stop file, which the
# ranks read before their first step and after every step
# (qwen35_fs2.compat.stop_on_signal).
_qwen35_on_usr1() {
    QWEN35_STOP_REQUESTED=1
    qwen35_log "USR1 received: asking the ranks to checkpoint and stop"
    if [ -n "${QWEN35_STOP_FILE:-}" ]; then
        : >"$QWEN35_STOP_FILE" || qwen35_log "cannot write the stop file $QWEN35_STOP_FILE: ranks that have not started yet will not see the request"
    fi
    if [ -n "${QWEN35_SRUN_PID:-}" ]; then
        kill -USR1 "$QWEN35_SRUN_PID" 2>/dev/null || true
    fi
}

_qwen35_requeue() {
    qwen35_log "requeueing job $SLURM_JOB_ID; it resumes from the last checkpoint in $QWEN35_OUTPUT_DIR"
    if ! scontrol requeue "$SLURM_JOB_ID"; then
        echo "[qwen35-slurm] error: scontrol requeue failed (was the job submitted with --no-requeue?)." \
            "Submit the same command again to resume from $QWEN35_OUTPUT_DIR." >&2
        exit 3
    fi
    exit 0
}

# Requeues the job if it saved a checkpoint that the output directory $1 did
# not hold when the job started ($2, the list of _qwen35_checkpoints then).
# Requeued, a job that saved nothing would start over from the same
# checkpoint and be stopped again at the same point, forever: a time limit
# within the --signal margin sends USR1 at once, before the ranks can save
# anything.
_qwen35_requeue_after_progress() {
    local saved
    saved=$(_qwen35_last_checkpoint "$1")
    qwen35_log "last checkpoint: step ${saved:-none}"
    if [ -z "$(comm -13 <(echo "$2") <(_qwen35_checkpoints "$1"))" ]; then
        echo "[qwen35-slurm] error: the stop request (USR1, which --signal asks for that long before the time limit) came before the run saved a checkpoint (last checkpoint: step ${saved:-none}, as when the job started), so a requeued job would start over and be stopped again." \
            "Give the job a time limit well beyond the --signal margin (the scripts ask for USR1 600 s before it)." >&2
        exit 3
    fi
    _qwen35_requeue
}

qwen35_launch() {
    QWEN35_STOP_REQUESTED=0
    QWEN35_SRUN_PID=""
    QWEN35_STOP_FILE=""
    trap _qwen35_on_usr1 USR1

    [ -n "${SLURM_JOB_ID:-}" ] || qwen35_fail "not inside a SLURM job: submit this script with sbatch"

    # --- mode
    local device=${QWEN35_DEVICE:-cuda}
    case $device in
        cuda | cpu) ;;
        *) qwen35_fail "QWEN35_DEVICE must be 'cuda' or 'cpu', not '$device'" ;;
    esac

    # --- the command: the venv the user points at, the active one, or the checkout's
    local venv=${QWEN35_VENV:-${VIRTUAL_ENV:-$QWEN35_REPO/.venv}}
    local cli=$venv/bin/fairseq2 python=$venv/bin/python
    [ -x "$cli" ] || qwen35_fail "no fairseq2 command at $cli: set QWEN35_VENV to the venv where qwen35-fs2 is installed (pip install -e .)"

    # --- configuration file: the script's GPU config unless QWEN35_CONFIG is
    # set; set but empty means none, the recipe's built-in defaults.
    local config=${QWEN35_CONFIG-$QWEN35_REPO/$QWEN35_DEFAULT_CONFIG}
    local -a config_args=()
    if [ -n "$config" ]; then
        [ -e "$config" ] || qwen35_fail "config file not found: $config (set QWEN35_CONFIG)"
        if [ ! -f "$config" ] || [ ! -r "$config" ]; then
            qwen35_fail "config file is not a readable file: $config"
        fi
        config=$(realpath "$config")
        config_args=(--config "$config")
    fi

    # --- extra overrides: QWEN35_OVERRIDES, then the script's arguments
    local -a overrides=()
    read -r -a overrides <<<"${QWEN35_OVERRIDES:-}"
    overrides+=("$@")
    local o
    for o in "${overrides[@]}"; do
        [[ $o == *=* ]] || qwen35_fail "override '$o' is not KEY=VALUE (QWEN35_OVERRIDES and script arguments are config overrides)"
    done

    # --- output directory: the same one on every run, so that a requeued or
    # resubmitted job finds its checkpoints and resumes. An `output_dir`
    # override names it (the last one, as in fairseq2); the ranks get it as
    # their output directory and as the override, so that config.yaml
    # records the directory they write to.
    local -a recipe
    read -r -a recipe <<<"$QWEN35_RECIPE"
    local out=${QWEN35_OUTPUT_DIR:-} override_out="" i
    for i in "${!overrides[@]}"; do
        if [[ ${overrides[$i]} == output_dir=* ]]; then
            override_out=${overrides[$i]#output_dir=}
            unset 'overrides[i]'
        fi
    done
    overrides=("${overrides[@]}")
    if [ -n "$override_out" ]; then
        [ -z "$out" ] || qwen35_fail "the output directory is given twice: QWEN35_OUTPUT_DIR=$out and the override output_dir=$override_out"
        out=$override_out
    fi
    if [ -z "$out" ] && [ -n "$config" ]; then
        out=$(_qwen35_config_output_dir "$python" "$config") \
            || qwen35_fail "cannot read output_dir from $config with $python"
        [ -n "$out" ] || out=runs/$(basename "${config%.*}")
    fi
    [ -n "$out" ] || out=runs/${recipe[-1]}
    # A literal ~ (from the config or an override), as fairseq2 expands it.
    # shellcheck disable=SC2088
    case $out in "~") out=$HOME ;; "~/"*) out=$HOME/${out#"~/"} ;; esac
    case $out in /*) ;; *) out=${SLURM_SUBMIT_DIR:-$PWD}/$out ;; esac
    local err
    err=$(mkdir -p -- "$out" 2>&1) || qwen35_fail "cannot create output directory $out: ${err##*: }"
    out=$(realpath "$out")
    local probe=$out/.qwen35-write-probe.$SLURM_JOB_ID
    err=$( : 2>&1 >"$probe") || qwen35_fail "output directory $out is not writable: ${err##*: }"
    QWEN35_PROBE=$probe # removed once every node has seen it
    QWEN35_OUTPUT_DIR=$out

    # Two jobs training into one directory would overwrite each other's
    # checkpoints (e.g. a command submitted again while the first still runs).
    # A requeued job keeps its id, so it passes.
    local owner_file=$out/.qwen35-slurm-job owner=""
    [ -f "$owner_file" ] && owner=$(cat "$owner_file")
    if [[ $owner =~ ^[0-9]+$ ]] && [ "$owner" != "$SLURM_JOB_ID" ] \
        && [ -n "$(squeue -h -j "$owner" -t RUNNING,COMPLETING -o %i 2>/dev/null)" ]; then
        qwen35_fail "output directory $out is in use by running job $owner: wait for it, cancel it, or set QWEN35_OUTPUT_DIR"
    fi
    echo "$SLURM_JOB_ID" >"$owner_file"

    # The stop file of this run (see _qwen35_on_usr1); one that an earlier
    # run of the job left (it was killed before it could remove it) would stop
    # this one at once. Removed before it is named: a USR1 in between is in
    # QWEN35_STOP_REQUESTED, which ends the job before srun.
    local stop_file=$out/.qwen35-stop-request
    rm -f -- "$stop_file"
    export QWEN35_STOP_FILE=$stop_file

    # --- shape of the allocation: one task per GPU
    local nnodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
    local tpn=${SLURM_NTASKS_PER_NODE:-}
    [[ $tpn =~ ^[0-9]+$ ]] || qwen35_fail "submit with --ntasks-per-node (one task per GPU); SLURM_TASKS_PER_NODE=${SLURM_TASKS_PER_NODE:-unset}"
    local world=$((nnodes * tpn))
    if [ "$device" = cuda ]; then
        # What was asked for per node (with --exclusive, SLURM_GPUS_ON_NODE
        # counts every GPU of the node, requested or not).
        local gpus=${SLURM_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
        gpus=${gpus##*:}
        [[ $gpus =~ ^[0-9]+$ ]] || qwen35_fail "cannot read the GPUs per node from SLURM_GPUS_PER_NODE=${SLURM_GPUS_PER_NODE:-}: submit with --gpus-per-node=N"
        [ "$gpus" -gt 0 ] || qwen35_fail "no GPUs allocated: submit with --gpus-per-node=N, or set QWEN35_DEVICE=cpu"
        [ "$gpus" = "$tpn" ] || qwen35_fail "one task per GPU, but --ntasks-per-node=$tpn with $gpus GPUs per node: submit with --ntasks-per-node=$gpus"
        unset FAIRSEQ2_DEVICE # each rank takes cuda:LOCAL_RANK
    else
        export FAIRSEQ2_DEVICE=cpu # gloo; GPUs, if any were allocated, stay unused
    fi

    # --- rendezvous on the first host of the job
    local head
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_ADDR=${QWEN35_MASTER_ADDR:-$head}
    export MASTER_PORT=${QWEN35_MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
    # (An address needs no lookup; getent would want a reverse entry.)
    if ! [[ $MASTER_ADDR =~ ^[0-9.]+$ || $MASTER_ADDR == *:* ]] && ! getent hosts "$MASTER_ADDR" >/dev/null; then
        qwen35_fail "the rendezvous host '$MASTER_ADDR' (the job's first node unless QWEN35_MASTER_ADDR is set) does not resolve from $(hostname): set QWEN35_MASTER_ADDR to its address"
    fi

    # --- CPUs of every rank. srun does not inherit the job's --cpus-per-task
    # on every SLURM version (22.05 does not): pass it on, or a node that binds
    # tasks to cores gives each rank one core, with OMP_NUM_THREADS threads.
    local -a cpu_args=()
    if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
        [[ $SLURM_CPUS_PER_TASK =~ ^[1-9][0-9]*$ ]] || qwen35_fail "SLURM_CPUS_PER_TASK must be a positive integer, but is '$SLURM_CPUS_PER_TASK' instead"
        cpu_args=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
    fi

    # --- environment of every rank (srun passes this shell's environment on)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
    export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
    export PATH=$venv/bin:$PATH
    if [ "$device" = cuda ]; then
        # Abort a rank whose collective fails or times out instead of hanging
        # until the time limit; --kill-on-bad-exit then ends the others.
        export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    fi

    # --- every node sees the same output directory, config and venv
    if [ "$nnodes" -gt 1 ]; then
        local bad
        # shellcheck disable=SC2016  # expanded on each node
        bad=$(srun --nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1 --kill-on-bad-exit=0 \
            bash -c 'for p; do [ -e "$p" ] || echo "$SLURMD_NODENAME cannot see $p"; done' \
            _ "$probe" "$cli" ${config:+"$config"} 2>&1) \
            || qwen35_fail "the check on every node failed: $bad"
        [ -z "$bad" ] || qwen35_fail "all nodes must share the output directory, config and venv: $(echo "$bad" | paste -sd ';')"
    fi
    rm -f -- "$probe"
    QWEN35_PROBE=""

    local last checkpoints_at_start
    last=$(_qwen35_last_checkpoint "$out")
    checkpoints_at_start=$(_qwen35_checkpoints "$out")
    qwen35_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST: $nnodes node(s) x $tpn task(s), device=$device, rendezvous $MASTER_ADDR:$MASTER_PORT"
    qwen35_log "recipe: $QWEN35_RECIPE; config: ${config:-none, the recipe defaults}; output: $out"
    if [ -n "$last" ]; then
        qwen35_log "resuming from the checkpoint of step $last"
    else
        qwen35_log "no checkpoint yet: starting from step 0"
    fi

    if [ "$QWEN35_STOP_REQUESTED" = 1 ]; then
        rm -f -- "$QWEN35_STOP_FILE"
        _qwen35_requeue_after_progress "$out" "$checkpoints_at_start"
    fi

    # One task per GPU. Each task gets its rank from SLURM; fairseq2 sees RANK
    # and WORLD_SIZE and uses them as they are. `--kill-on-bad-exit` ends every
    # rank when one fails, so a crash never leaves the others waiting.
    # shellcheck disable=SC2016  # expanded by each task's shell
    srun --nodes="$nnodes" --ntasks="$world" --ntasks-per-node="$tpn" "${cpu_args[@]}" --kill-on-bad-exit=1 \
        bash -c 'trap "" USR1 # until fairseq2 sets its handler; the stop file holds the request
            export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID LOCAL_WORLD_SIZE='"$tpn"'
            cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) # (nproc reports OMP_NUM_THREADS if set)
            echo "[qwen35-slurm] rank $RANK of $WORLD_SIZE on $SLURMD_NODENAME (local rank $LOCAL_RANK, $cpus CPU(s), OMP_NUM_THREADS=$OMP_NUM_THREADS)"
            exec "$@"' \
        qwen35-rank "$cli" "${recipe[@]}" "$out" "${config_args[@]}" --no-rich \
        --set common.no_sweep_dir=true "${overrides[@]}" "output_dir='${out//\'/\'\'}'" &
    QWEN35_SRUN_PID=$!
    # A USR1 that came while srun was starting has not reached it yet.
    if [ "$QWEN35_STOP_REQUESTED" = 1 ]; then
        kill -USR1 "$QWEN35_SRUN_PID" 2>/dev/null || true
    fi

    # `wait` returns early when a trapped signal arrives: wait again until srun
    # has really exited.
    local rc
    while :; do
        rc=0
        wait "$QWEN35_SRUN_PID" || rc=$?
        if [ "$rc" -gt 128 ] && kill -0 "$QWEN35_SRUN_PID" 2>/dev/null; then
            continue
        fi
        break
    done
    QWEN35_SRUN_PID=""
    rm -f -- "$QWEN35_STOP_FILE"

    if [ "$QWEN35_STOP_REQUESTED" = 1 ]; then
        qwen35_log "ranks exited with $rc after the stop request"
        _qwen35_requeue_after_progress "$out" "$checkpoints_at_start"
    fi
    if [ "$rc" != 0 ]; then
        echo "[qwen35-slurm] error: training failed with exit code $rc; see the rank logs in $out/logs" >&2
        exit "$rc"
    fi
    qwen35_log "training finished; checkpoints in $out/checkpoints"
}
