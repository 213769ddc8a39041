#!/usr/bin/env bash
# Continued pretraining of Qwen3.5 on FineWeb-Edu: `fairseq2 lm train`, one
# task per GPU. Preemption-safe: SLURM sends USR1 ten minutes before the time
# limit, the ranks checkpoint and stop, and the job requeues itself; every run
# resumes from the last checkpoint in its output directory.
#
#   sbatch slurm/run_qwen35_fineweb_edu.sh     # recipes/qwen35_0.8b_fineweb_edu.yaml, 4 nodes
#   sbatch --nodes=8 slurm/run_qwen35_fineweb_edu.sh regime.num_steps=10000
#   QWEN35_CONFIG=my.yaml QWEN35_OUTPUT_DIR=/shared/runs/cpt1 sbatch slurm/run_qwen35_fineweb_edu.sh
#
# Environment: QWEN35_CONFIG, QWEN35_OUTPUT_DIR, QWEN35_OVERRIDES, QWEN35_VENV,
# QWEN35_DEVICE=cpu (gloo, no GPUs), QWEN35_MASTER_ADDR/PORT. Script arguments
# are config overrides (KEY=VALUE). Sizing and memory arithmetic: docs/slurm.md.
#
#SBATCH --job-name=qwen35-fineweb-edu
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#SBATCH --error=%x-%j.err
set -euo pipefail

# sbatch runs a copy of this file from its spool directory: find the checkout
# through the path the job was submitted with.
if [ -z "${QWEN35_REPO:-}" ]; then
    script=${BASH_SOURCE[0]}
    # Unless run from the checkout (bash inside salloc, a wrapper script).
    if [ -n "${SLURM_JOB_ID:-}" ] && [ ! -f "$(dirname "$script")/lib/launch.sh" ]; then
        script=$(scontrol show job -o "$SLURM_JOB_ID" | sed -n 's/.* Command=\([^ ]*\).*/\1/p')
    fi
    QWEN35_REPO=$(cd "$(dirname "$script")/.." && pwd)
fi
[ -f "$QWEN35_REPO/slurm/lib/launch.sh" ] || {
    echo "[qwen35-slurm] error: no slurm/lib/launch.sh under $QWEN35_REPO: set QWEN35_REPO to the checkout" >&2
    exit 2
}
# shellcheck source=slurm/lib/launch.sh
source "$QWEN35_REPO/slurm/lib/launch.sh"

QWEN35_RECIPE="lm train"
QWEN35_DEFAULT_CONFIG=recipes/qwen35_0.8b_fineweb_edu.yaml
qwen35_launch "$@"
