"""Every rank gets the CPUs the job asks for with ``--cpus-per-task``: the
launch scripts pass it on to ``srun``, which does not inherit it on SLURM
22.05, the version of the test cluster.

The job runs on the cluster's ``bind1`` node, which declares this machine's
real CPU layout and binds each task to cores (task/affinity, CpuBind=cores),
as production nodes do. Without the option, its rank is bound to one core.
The rank's command is a stand-in for the venv's ``fairseq2`` that prints the
CPUs it may run on: the binding is what is tested here, and the training
itself is covered by test_slurm_training.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from slurm_cluster import BIND_NODE, BIND_PARTITION, CONFIGS, RUN_CPT, RUN_SFT, Cluster

pytestmark = pytest.mark.slurm

# The CPUs of its affinity mask, which SLURM sets.
STAND_IN = f"""#!{sys.executable}
import os
print(f"[stand-in] rank {{os.environ['RANK']}}: {{len(os.sched_getaffinity(0))}} CPU(s), OMP_NUM_THREADS={{os.environ['OMP_NUM_THREADS']}}")
"""


@pytest.mark.parametrize("script", [RUN_CPT, RUN_SFT], ids=["cpt", "sft"])
def test_a_rank_runs_on_the_cpus_it_asked_for(slurm_cluster: Cluster, tmp_path: Path, script: Path) -> None:
    out = slurm_cluster.run("scontrol", "show", "node", "-o", BIND_NODE)

    num_cpus = int(out.split("CPUTot=")[1].split()[0])

    if num_cpus < 2:
        pytest.skip(f"a rank bound to one core sees all CPUs of a {num_cpus}-CPU machine")

    venv = tmp_path / "venv"

    venv.joinpath("bin").mkdir(parents=True)

    stand_in = venv / "bin" / "fairseq2"

    stand_in.write_text(STAND_IN)

    stand_in.chmod(0o755)

    job = slurm_cluster.submit(
        script,
        tmp_path,
        [f"--partition={BIND_PARTITION}", "--nodes=1", "--ntasks-per-node=1", f"--cpus-per-task={num_cpus}", "--gpus-per-node=0"],
        env={
            "QWEN35_VENV": str(venv),
            "QWEN35_CONFIG": str(CONFIGS / "tiny_sft_cpu.yaml"),
            "QWEN35_OUTPUT_DIR": str(tmp_path / "out"),
            # The node's name does not resolve.
            "QWEN35_MASTER_ADDR": "127.0.0.1",
        },
    )

    info = slurm_cluster.wait(job, timeout=60)

    assert info["JobState"] == "COMPLETED", job.stderr()

    assert f"[stand-in] rank 0: {num_cpus} CPU(s), OMP_NUM_THREADS={num_cpus}" in job.stdout(), job.stdout()

    # The launcher's line for the rank says so too.
    assert f"[qwen35-slurm] rank 0 of 1 on {BIND_NODE} (local rank 0, {num_cpus} CPU(s), OMP_NUM_THREADS={num_cpus})" in job.stdout(), job.stdout()
