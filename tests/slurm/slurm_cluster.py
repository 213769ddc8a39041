"""Helpers of the SLURM tests: paths, the cluster's layout, and a thin client
that submits jobs with sbatch and follows them with scontrol."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SLURM_DIR = REPO / "slurm"

RUN_SFT = SLURM_DIR / "run_qwen35_gsm8k.sh"

RUN_CPT = SLURM_DIR / "run_qwen35_fineweb_edu.sh"

CONFIGS = Path(__file__).resolve().parent / "configs"

# Not the default SLURM ports, nor those of scripts/slurm_local_up.sh's
# defaults, so a cluster someone started by hand is left alone.
CLUSTER_DIR = Path("/tmp/qwen35-slurm-tests")
CLUSTER_PORT = 17817
LOCK_FILE = Path("/tmp/qwen35-slurm-tests.lock")
LOCK_TIMEOUT_S = 900

# The emulated cluster: node 1 is named after this host, node 2 is `n2`. More
# CPUs than the machine has, so that the training jobs of a module can run at
# the same time (2 + 2 tasks on node 1, 1 + 1 across both nodes).
NUM_NODES = 2
CPUS_PER_NODE = 6
GPUS_PER_NODE = 2

# The node of scripts/slurm_local_up.sh with this machine's real CPU layout,
# alone in its partition, where SLURM binds each task to its cores.
BIND_PARTITION = "bind"
BIND_NODE = "bind1"

FINISHED_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


@dataclass(frozen=True)
class Job:
    """A submitted batch job and the directory its output files land in."""

    id: int
    workdir: Path
    name: str

    @property
    def stdout_path(self) -> Path:
        return self.workdir / f"{self.name}-{self.id}.out"

    @property
    def stderr_path(self) -> Path:
        return self.workdir / f"{self.name}-{self.id}.err"

    def stdout(self) -> str:
        return _read(self.stdout_path)

    def stderr(self) -> str:
        return _read(self.stderr_path)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@dataclass
class Cluster:
    """The running test cluster; runs SLURM commands against it."""

    directory: Path
    env: dict[str, str]
    head: str
    """The name of node 1 (this host's short name); it resolves."""

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> str:
        """Runs a SLURM client command and returns its stdout."""
        proc = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}"
            )
        return proc.stdout

    def job_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment a test submits with: this one, minus any QWEN35_*
        setting of the developer's shell and the thread count of the tests
        (one under pytest-xdist; a job's comes from its CPUs), in CPU mode,
        with this venv."""
        env = {k: v for k, v in self.env.items() if not k.startswith("QWEN35_") and k != "OMP_NUM_THREADS"}
        env["QWEN35_DEVICE"] = "cpu"
        env["QWEN35_VENV"] = sys.prefix
        if extra:
            env.update(extra)
        return env

    def sbatch(
        self,
        script: Path,
        workdir: Path,
        sbatch_args: Sequence[str] = (),
        script_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``sbatch --parsable ... script ...`` from ``workdir``, the way a
        user submits; returns the finished sbatch process."""
        workdir.mkdir(parents=True, exist_ok=True)
        return subprocess.run(
            ["sbatch", "--parsable", *sbatch_args, str(script), *script_args],
            cwd=workdir,
            env=self.job_env(env),
            capture_output=True,
            text=True,
            timeout=30,
        )

    def submit(
        self,
        script: Path,
        workdir: Path,
        sbatch_args: Sequence[str] = (),
        script_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> Job:
        """Submits and returns the job; fails the test if sbatch refuses."""
        proc = self.sbatch(script, workdir, sbatch_args, script_args, env)
        assert proc.returncode == 0, f"sbatch refused the job: {proc.stderr.strip()}"
        job_id = int(proc.stdout.strip().split(";")[0])
        return Job(job_id, workdir, self.info(job_id)["JobName"])

    def info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (kept for MinJobAge after the end)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job: Job, timeout: float) -> dict[str, str]:
        """Waits until the job has finished (a requeued job is not finished)
        and returns its ``scontrol show job``. On timeout, cancels it and fails
        with its logs, so a hung job never hangs the tests."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info(job.id)
            if info["JobState"] in FINISHED_STATES:
                return info
            if time.monotonic() > deadline:
                self.run("scancel", str(job.id), check=False)
                pytest.fail(
                    f"job {job.id} still {info['JobState']} after {timeout:.0f} s\n"
                    f"--- stdout\n{job.stdout()[-3000:]}\n--- stderr\n{job.stderr()[-3000:]}"
                )
            time.sleep(0.2)

    def signal_batch_shell(self, job: Job, signal: str = "USR1") -> None:
        """What ``--signal=B:USR1@...`` does at the time limit: signal only the
        batch shell, not the job steps."""
        self.run("scancel", "--batch", f"--signal={signal}", str(job.id))


def read_metrics(output_dir: Path) -> list[dict[str, object]]:
    """The training metrics of a run, one record per published step, in order
    (a resumed run appends to the same file)."""
    path = output_dir / "metrics" / "train.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
