#!/usr/bin/env bash
# Stop exactly the daemons that scripts/slurm_local_up.sh started, by PID, in
# reverse order, after cancelling the jobs still in its queue. Other processes
# (and a real SLURM or munged that was already running) are left alone. The
# logs stay in the directory until the next slurm_local_up.sh.
set -uo pipefail

D=${QWEN35_SLURM_DIR:-/tmp/qwen35-slurm}

# After SIGTERM a daemon stays <defunct> until PID 1 reaps it, and `kill -0`
# still succeeds on a zombie: count a zombie as gone.
alive() { ps -o stat= -p "$1" 2>/dev/null | grep -qv Z; }

[ -f "$D/started.pids" ] || exit 0

# Jobs left in the queue would outlive slurmd as orphaned slurmstepd processes.
export SLURM_CONF=$D/slurm.conf
jobs=$(timeout 10 squeue -h -o %i 2>/dev/null)
if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086  # one argument per job id
    timeout 10 scancel $jobs 2>/dev/null
    for _ in $(seq 150); do
        [ -z "$(timeout 10 squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.1
    done
fi

tac "$D/started.pids" | while read -r f; do
    [ -s "$f" ] || continue
    p=$(cat "$f")
    [[ $p =~ ^[0-9]+$ ]] || continue
    kill "$p" 2>/dev/null || continue
    for _ in $(seq 100); do
        alive "$p" || break
        sleep 0.1
    done
    if alive "$p"; then
        echo "slurm_local_down: pid $p ($f) ignored SIGTERM for 10 s, sending SIGKILL" >&2
        kill -9 "$p" 2>/dev/null
    fi
done
rm -f "$D/started.pids"
