"""End-to-end runs of the launch scripts on the real SLURM test cluster, in CPU
mode (gloo) with tiny configs and 2 ranks (FSDP2):

- continued pretraining on the two emulated nodes, one rank each;
- the same run on one node, signalled as SLURM does before the time limit: it
  checkpoints, stops, requeues itself, resumes and must reproduce the loss
  curve of the uninterrupted run exactly;
- instruction fine-tuning on one node, into the output directory that its
  arguments name.

The three jobs are submitted together when the module starts, so they overlap
and the module stays within its time budget.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ruamel.yaml import YAML
from scratch import scratch_dir
from slurm_cluster import CONFIGS, RUN_CPT, RUN_SFT, Cluster, Job, read_metrics

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CPT_CONFIG = CONFIGS / "tiny_pretrain_cpu.yaml"
SFT_CONFIG = CONFIGS / "tiny_sft_cpu.yaml"

CPT_STEPS = 6
SFT_STEPS = 3

# One training job, start to end, on a busy 2-core machine, in its slow hours
# (``recipe_runner.TIMEOUT_S``).
JOB_TIMEOUT_S = 1800

# `--oversubscribe` lifts the scripts' `--exclusive`, so the jobs share nodes.
CPU_JOB = ["--gpus-per-node=0", "--cpus-per-task=1", "--oversubscribe"]
TWO_NODES = ["--nodes=2", "--ntasks-per-node=1", *CPU_JOB]


def one_node(cluster: Cluster) -> list[str]:
    """On node 1, whose name resolves (the first host is the rendezvous)."""
    return ["--nodes=1", "--ntasks-per-node=2", f"--nodelist={cluster.head}", *CPU_JOB]


@dataclass
class Signaller:
    """Sends the batch shell USR1 once the run has published its first step,
    from a thread, whichever test is running at that moment."""

    cluster: Cluster
    job: Job
    output_dir: Path
    sent_after_step: int | None = None
    error: str | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                steps = [int(str(r["Step"])) for r in read_metrics(self.output_dir)]
                if steps:
                    self.cluster.signal_batch_shell(self.job)
                    self.sent_after_step = max(steps)
                    return
                if self.cluster.info(self.job.id)["JobState"] not in ("PENDING", "RUNNING"):
                    self.error = "the job ended before publishing a step"
                    return
                time.sleep(0.2)
            self.error = "no step published before the timeout"
        except Exception as ex:  # reported by the test that waits on it
            self.error = repr(ex)


@dataclass
class Runs:
    reference: Job
    reference_out: Path
    interrupted: Job
    interrupted_out: Path
    signaller: Signaller
    sft: Job
    sft_out: Path


@pytest.fixture(scope="module")
def runs(slurm_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    def cpt_env(out: Path) -> dict[str, str]:
        return {
            "QWEN35_CONFIG": str(CPT_CONFIG),
            "QWEN35_OUTPUT_DIR": str(out),
            "QWEN35_OVERRIDES": f"regime.num_steps={CPT_STEPS}",
        }

    with scratch_dir(tmp_path_factory, "slurm-training") as base:
        # The emulated node n2 comes first in the job's node list and does not
        # resolve: rendezvous on the loopback address instead.
        reference_out = base / "reference" / "out"
        reference = slurm_cluster.submit(
            RUN_CPT,
            base / "reference",
            TWO_NODES,
            env={**cpt_env(reference_out), "QWEN35_MASTER_ADDR": "127.0.0.1"},
        )

        interrupted_out = base / "interrupted" / "out"
        interrupted = slurm_cluster.submit(
            RUN_CPT, base / "interrupted", one_node(slurm_cluster), env=cpt_env(interrupted_out)
        )
        signaller = Signaller(slurm_cluster, interrupted, interrupted_out)

        # The step count and the output directory (relative: under the
        # submit directory) come from the script's arguments.
        sft_out = base / "sft" / "runs" / "from_argument"
        sft = slurm_cluster.submit(
            RUN_SFT,
            base / "sft",
            one_node(slurm_cluster),
            script_args=[f"regime.num_steps={SFT_STEPS}", "output_dir=runs/from_argument"],
            env={"QWEN35_CONFIG": str(SFT_CONFIG)},
        )

        yield Runs(reference, reference_out, interrupted, interrupted_out, signaller, sft, sft_out)


def _losses(output_dir: Path) -> dict[int, float]:
    return {int(str(r["Step"])): float(str(r["NLL Loss"])) for r in read_metrics(output_dir)}


def _assert_succeeded(cluster: Cluster, job: Job) -> dict[str, str]:
    info = cluster.wait(job, timeout=JOB_TIMEOUT_S)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (
        f"{info['JobState']} {info['ExitCode']}\n--- stdout\n{job.stdout()[-3000:]}"
        f"\n--- stderr\n{job.stderr()[-5000:]}"
    )
    return info


def _assert_two_rank_fsdp2_run(output_dir: Path, last_step: int) -> None:
    """Both ranks took part in an FSDP2 run, and its final checkpoint holds
    the state of both."""
    log0 = (output_dir / "logs" / "rank_0.log").read_text()
    log1 = (output_dir / "logs" / "rank_1.log").read_text()
    assert "Running on 2 process(es)." in log0
    assert "Wrapping model with FSDP2" in log0
    assert "[Rank 1]" in log1 and "Running on 2 process(es)." in log1

    step_dir = output_dir / "checkpoints" / f"step_{last_step}"
    assert step_dir.is_dir(), sorted(p.name for p in (output_dir / "checkpoints").iterdir())
    for part in ("model", "optimizer", "trainer", "data_reader"):
        assert (step_dir / part).is_dir(), part
    assert sorted(p.name for p in (step_dir / "trainer").iterdir()) == ["rank_00.pt", "rank_01.pt"]
    assert sorted(p.name for p in (step_dir / "data_reader").iterdir()) == ["dp_00.pt", "dp_01.pt"]

    losses = _losses(output_dir)
    assert max(losses) == last_step


def test_pretraining_on_two_nodes(slurm_cluster: Cluster, runs: Runs) -> None:
    info = _assert_succeeded(slurm_cluster, runs.reference)
    assert info["NodeList"] == f"n2,{slurm_cluster.head}"
    assert info["Restarts"] == "0"

    out = runs.reference.stdout()
    # One rank on each node.
    assert "rank 0 of 2 on n2 (local rank 0, " in out
    assert f"rank 1 of 2 on {slurm_cluster.head} (local rank 0, " in out
    assert "2 node(s) x 1 task(s), device=cpu, rendezvous 127.0.0.1:" in out
    assert "no checkpoint yet: starting from step 0" in out

    _assert_two_rank_fsdp2_run(runs.reference_out, CPT_STEPS)

    # Each rank reads a packed batch of 129 tokens a step (the config's
    # `max_num_tokens`; the first token of a document is no target), and the
    # step's metrics count both.
    first = next(r for r in read_metrics(runs.reference_out) if int(str(r["Step"])) == 1)
    assert first["Number of Elements"] == 2 * 128


def test_signalled_pretraining_checkpoints_requeues_and_resumes(
    slurm_cluster: Cluster, runs: Runs
) -> None:
    info = _assert_succeeded(slurm_cluster, runs.interrupted)
    signaller = runs.signaller
    signaller.thread.join(timeout=5)
    assert signaller.error is None, signaller.error
    assert signaller.sent_after_step is not None

    out = runs.interrupted.stdout()
    log0 = (runs.interrupted_out / "logs" / "rank_0.log").read_text()

    # The rendezvous is on the job's first host, found by the script.
    assert f"device=cpu, rendezvous {slurm_cluster.head}:" in out

    # The signal reached the ranks and they stopped early, with a checkpoint.
    assert "USR1 received: asking the ranks to checkpoint and stop" in out
    stopped = re.search(r"Stopping training at step (\d+)\.", log0)
    assert stopped, (
        "the ranks did not stop on SIGUSR1 (fairseq2 0.8.1's trainer ignores the stop "
        "request when regime.num_steps is set unless the package's fix is installed)\n"
        + out
    )
    stop_step = int(stopped.group(1))
    assert signaller.sent_after_step <= stop_step < CPT_STEPS

    # The job requeued itself and the second run resumed from that checkpoint.
    assert info["Restarts"] == "1"
    assert f"requeueing job {runs.interrupted.id}" in out
    assert f"job {runs.interrupted.id} (restart 1)" in out
    assert f"resuming from the checkpoint of step {stop_step}" in out
    assert f"Training restored. Resuming from step {stop_step}." in log0

    _assert_two_rank_fsdp2_run(runs.interrupted_out, CPT_STEPS)

    # Same losses as the uninterrupted run, step for step, up to the last.
    _assert_succeeded(slurm_cluster, runs.reference)
    reference = _losses(runs.reference_out)
    resumed = _losses(runs.interrupted_out)
    assert sorted(resumed) == list(range(1, CPT_STEPS + 1))
    for step in range(1, CPT_STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-6), step


def test_instruction_finetuning(slurm_cluster: Cluster, runs: Runs) -> None:
    info = _assert_succeeded(slurm_cluster, runs.sft)
    assert info["Restarts"] == "0"
    out = runs.sft.stdout()
    assert f"recipe: lm instruction_finetune; config: {SFT_CONFIG}; output: {runs.sft_out}" in out
    assert "1 node(s) x 2 task(s), device=cpu" in out
    _assert_two_rank_fsdp2_run(runs.sft_out, SFT_STEPS)
    # The run records the directory it wrote to.
    assert YAML(typ="safe").load((runs.sft_out / "config.yaml").read_text())["output_dir"] == str(runs.sft_out)
