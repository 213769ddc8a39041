#!/usr/bin/env bash
# Start a throw-away SLURM 22.05 cluster on this machine: munged, slurmctld and
# one slurmd per emulated node, as plain background daemons (no systemd). It is
# what the SLURM tests run against, and what you use to try the launch scripts
# locally. Run as root. Stop it with scripts/slurm_local_down.sh.
#
# Environment (all optional):
#   QWEN35_SLURM_DIR    state, spool, logs, pid files, slurm.conf (/tmp/qwen35-slurm)
#   QWEN35_SLURM_NODES  number of nodes (2). Node 1 is named after this host, so
#                       that the first host of a job resolves; nodes 2.. are
#                       n2, n3, ... and do not resolve.
#   QWEN35_SLURM_CPUS   CPUs per node (2); may exceed the real cores
#   QWEN35_SLURM_GPUS   GPUs per node (2), fake ones (empty device files), so
#                       that the scripts' GPU-shaped requests can be submitted
#   QWEN35_SLURM_PORT   slurmctld port (16817); slurmd ports follow it. Not the
#                       default 6817, so a real local SLURM is left alone.
#   QWEN35_SLURM_BIND   1 (default) also starts node `bind1`, alone in partition
#                       `bind`: this machine's real CPU layout (`slurmd -C`)
#                       with CpuBind=cores, so that SLURM binds each task to
#                       the cores it asked for, as production nodes do. The
#                       nodes above declare more CPUs than exist, and SLURM
#                       binds no task on them. 0 leaves it out.
#
# Prints `export SLURM_CONF=...` as its last line: clients need it.
set -euo pipefail

D=${QWEN35_SLURM_DIR:-/tmp/qwen35-slurm}
NODES=${QWEN35_SLURM_NODES:-2}
CPUS=${QWEN35_SLURM_CPUS:-2}
GPUS=${QWEN35_SLURM_GPUS:-2}
PORT=${QWEN35_SLURM_PORT:-16817}
BIND=${QWEN35_SLURM_BIND:-1}
BIND_NODE=bind1
CONF=$D/slurm.conf
H=$(hostname -s)

die() { echo "slurm_local_up: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (munged, slurmd)"
[[ $NODES =~ ^[1-9][0-9]?$ ]] || die "QWEN35_SLURM_NODES must be 1..99, got '$NODES'"
[[ $CPUS =~ ^[1-9][0-9]*$ ]] || die "QWEN35_SLURM_CPUS must be a positive integer, got '$CPUS'"
[[ $GPUS =~ ^[0-9]+$ ]] || die "QWEN35_SLURM_GPUS must be a non-negative integer, got '$GPUS'"
[[ $BIND =~ ^[01]$ ]] || die "QWEN35_SLURM_BIND must be 0 or 1, got '$BIND'"

if [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/slurmd ] || [ ! -x /usr/sbin/munged ] \
    || ! command -v sbatch >/dev/null; then
    command -v apt-get >/dev/null || die "SLURM is not installed and there is no apt-get"
    echo "slurm_local_up: installing slurmctld slurmd slurm-client munge" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
fi

# A previous run that died without cleaning up left daemons behind: stop them.
if [ -f "$D/started.pids" ]; then
    QWEN35_SLURM_DIR=$D bash "$(dirname "$0")/slurm_local_down.sh"
fi

rm -rf "$D"
mkdir -p "$D"/state "$D"/log
: >"$D/started.pids"

# --- munge: the package postinst makes the key; make one if it was purged.
if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --force
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
fi
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    install -d -o munge -g munge -m 0755 /run/munge
    rm -f /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    munge -n </dev/null | unmunge >/dev/null || die "munged did not start"
    echo "/run/munge/munged.pid" >>"$D/started.pids"
fi

# --- slurm.conf and gres.conf
node_name() { if [ "$1" = 1 ]; then echo "$H"; else echo "n$1"; fi; }
emulated=()
for i in $(seq "$NODES"); do emulated+=("$(node_name "$i")"); done

{
    cat <<EOF
ClusterName=qwen35ci
SlurmctldHost=$H(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
ReturnToService=2
# Start jobs at once, and look at pending ones (a requeued job) every 2 s, not 60 s.
SchedulerParameters=batch_sched_delay=0,sched_interval=2
KillWait=10
# A requeued job waits cred_expire + 1 s before it may start again (default 120 s).
AuthInfo=cred_expire=5
MailProg=/bin/true
# Keep a finished job's record for an hour (default 300 s): the tests submit
# their jobs together and read each one's end state in turn, which on a slow
# machine came more than 300 s after a job ended ("Invalid job id").
MinJobAge=3600
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
EOF
    # Node 1 gets the lowest weight so that one-node jobs land on the node whose
    # name resolves.
    gres=""
    [ "$GPUS" = 0 ] || gres="Gres=gpu:$GPUS"
    for i in $(seq "$NODES"); do
        echo "NodeName=$(node_name "$i") NodeHostname=$H NodeAddr=127.0.0.1" \
            "Port=$((PORT + i)) CPUs=$CPUS RealMemory=4000 $gres Weight=$i State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${emulated[*]}") Default=YES MaxTime=INFINITE State=UP"
    if [ "$BIND" = 1 ]; then
        # CPUs, Boards, SocketsPerBoard, CoresPerSocket and ThreadsPerCore as
        # slurmd detects them: a node that declares what it has gets bound.
        layout=$(/usr/sbin/slurmd -C | head -n 1 | tr ' ' '\n' \
            | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' | xargs)
        [ -n "$layout" ] || die "slurmd -C did not report this machine's CPU layout"
        echo "NodeName=$BIND_NODE NodeHostname=$H NodeAddr=127.0.0.1 Port=$((PORT + NODES + 1))" \
            "$layout RealMemory=4000 CpuBind=cores Weight=$((NODES + 1)) State=UNKNOWN"
        echo "PartitionName=bind Nodes=$BIND_NODE MaxTime=INFINITE State=UP"
    fi
} >"$CONF"

# Fake GPUs: SLURM drops a GPU without a device file, so point it at empty
# files. SLURM counts and allocates them and sets CUDA_VISIBLE_DEVICES, nothing
# more (no cgroup plugin binds devices).
{
    echo "AutoDetect=off"
    if [ "$GPUS" != 0 ]; then
        mkdir -p "$D/dev"
        for g in $(seq 0 $((GPUS - 1))); do : >"$D/dev/nvidia$g"; done
        for i in $(seq "$NODES"); do
            echo "NodeName=$(node_name "$i") Name=gpu File=$D/dev/nvidia[0-$((GPUS - 1))]"
        done
    fi
} >"$D/gres.conf"

export SLURM_CONF=$CONF

# --- daemons (they fork into the background and write their pid files)
/usr/sbin/slurmctld -i -f "$CONF"
echo "$D/slurmctld.pid" >>"$D/started.pids"
all_nodes=("${emulated[@]}")
[ "$BIND" = 0 ] || all_nodes+=("$BIND_NODE")
for n in "${all_nodes[@]}"; do
    mkdir -p "$D/spool/$n"
    /usr/sbin/slurmd -f "$CONF" -N "$n"
    echo "$D/slurmd-$n.pid" >>"$D/started.pids"
done

# Up: every node idle. A node that registers as invalid or drained will not
# recover by waiting, so stop at once.
states() { sinfo -h -N -o %T 2>/dev/null | sort | uniq -c | xargs; }
up() { [ "$(states)" = "${#all_nodes[@]} idle" ]; }
for _ in $(seq 300); do
    up && break
    case $(states) in *inval* | *drain*) break ;; esac
    sleep 0.1
done
if ! up; then
    sinfo -N >&2 || true
    tail -n 30 "$D"/log/*.log >&2 || true
    die "the cluster did not come up (logs in $D/log)"
fi
sinfo -N -o '%N %T %c %G' >&2
echo "export SLURM_CONF=$CONF"
