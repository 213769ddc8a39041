"""Bad input gives a clear error at submit time (sbatch refuses) or at start
time (the job fails within seconds with one line in its error file), never a
job that waits or hangs. These jobs never start Python, so they are fast; the
stop requests at the start of a job are the exception."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from ruamel.yaml import YAML
from slurm_cluster import CONFIGS, CPUS_PER_NODE, GPUS_PER_NODE, RUN_CPT, RUN_SFT, Cluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# A CPU job of 2 tasks on one node.
CPU_JOB = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]

SFT_CONFIG = CONFIGS / "tiny_sft_cpu.yaml"

# A failing start-time check must end the job this fast.
FAIL_FAST_S = 30


def _expect_start_failure(
    cluster: Cluster,
    workdir: Path,
    message: str,
    sbatch_args: list[str],
    env: dict[str, str],
    script: Path = RUN_SFT,
    script_args: tuple[str, ...] = (),
) -> None:
    start = time.monotonic()
    job = cluster.submit(script, workdir, sbatch_args, script_args, env)
    info = cluster.wait(job, timeout=FAIL_FAST_S)
    assert info["JobState"] == "FAILED", info
    assert info["ExitCode"] == "2:0", info
    assert message in job.stderr(), job.stderr()
    # Nothing was requeued, and no rank was started.
    assert info["Restarts"] == "0"
    assert "[qwen35-slurm] job" not in job.stdout()
    assert time.monotonic() - start < FAIL_FAST_S


def test_missing_config_file(slurm_cluster: Cluster, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-config.yaml"
    _expect_start_failure(
        slurm_cluster,
        tmp_path,
        f"config file not found: {missing} (set QWEN35_CONFIG)",
        CPU_JOB,
        {"QWEN35_CONFIG": str(missing), "QWEN35_OUTPUT_DIR": str(tmp_path / "out")},
    )


def test_config_that_is_a_directory(slurm_cluster: Cluster, tmp_path: Path) -> None:
    _expect_start_failure(
        slurm_cluster,
        tmp_path,
        f"config file is not a readable file: {tmp_path}",
        CPU_JOB,
        {"QWEN35_CONFIG": str(tmp_path), "QWEN35_OUTPUT_DIR": str(tmp_path / "out")},
    )


def test_output_dir_that_cannot_be_created(slurm_cluster: Cluster, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "out"
    _expect_start_failure(
        slurm_cluster,
        tmp_path,
        f"cannot create output directory {out}: Not a directory",
        CPU_JOB,
        {"QWEN35_CONFIG": str(SFT_CONFIG), "QWEN35_OUTPUT_DIR": str(out)},
    )


def test_output_dir_that_is_not_writable(
    slurm_cluster: Cluster, read_only_dir: Path, tmp_path: Path
) -> None:
    """The directory exists but cannot be written. (Not by a job running as
    another user: it could not reach a checkout in a private directory, such
    as one made by `mktemp -d`.)"""
    reason = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    _expect_start_failure(
        slurm_cluster,
        tmp_path,
        f"output directory {read_only_dir} is not writable: {reason}",
        CPU_JOB,
        {"QWEN35_CONFIG": str(SFT_CONFIG), "QWEN35_OUTPUT_DIR": str(read_only_dir)},
    )


def test_output_dir_in_use_by_a_running_job(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """The same command submitted twice must not train twice into one
    directory: the second job stops while the first runs."""
    out = tmp_path / "out"
    out.mkdir()
    holder = slurm_cluster.run(
        "sbatch", "--parsable", "--nodes=1", "--ntasks=1", "--cpus-per-task=1",
        f"--output={tmp_path}/holder.out", "--wrap", "sleep 60",
    ).strip()
    try:
        deadline = time.monotonic() + FAIL_FAST_S
        while slurm_cluster.run("squeue", "-h", "-j", holder, "-o", "%T").strip() != "RUNNING":
            assert time.monotonic() < deadline, "the holder job did not start"
            time.sleep(0.2)
        (out / ".qwen35-slurm-job").write_text(f"{holder}\n")
        _expect_start_failure(
            slurm_cluster,
            tmp_path,
            f"output directory {out} is in use by running job {holder}: wait for it, "
            "cancel it, or set QWEN35_OUTPUT_DIR",
            CPU_JOB,
            {"QWEN35_CONFIG": str(SFT_CONFIG), "QWEN35_OUTPUT_DIR": str(out)},
        )
        # The failed job neither took the directory over nor left its probe.
        assert (out / ".qwen35-slurm-job").read_text().strip() == holder
        assert sorted(p.name for p in out.iterdir()) == [".qwen35-slurm-job"]
    finally:
        slurm_cluster.run("scancel", holder, check=False)


def test_default_config_and_its_output_dir(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """Without QWEN35_CONFIG the script's GPU config is used, and the output
    directory is that config's `output_dir`, under the submit directory. (A
    file in place of its parent makes it fail before any training starts.)"""
    config = RUN_CPT.parent.parent / "recipes/qwen35_0.8b_fineweb_edu.yaml"
    output_dir = Path(YAML(typ="safe").load(config.read_text())["output_dir"])
    assert not output_dir.is_absolute() and len(output_dir.parts) >= 2, output_dir
    (tmp_path / output_dir.parent).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / output_dir.parent).write_text("")
    _expect_start_failure(
        slurm_cluster,
        tmp_path,
        f"cannot create output directory {tmp_path / output_dir}: Not a directory",
        CPU_JOB,
        {},
        script=RUN_CPT,
    )


def test_venv_without_the_command(slurm_cluster: Cluster, tmp_path: Path) -> None:
    _expect_start_failure(
        slurm_cluster,
        tmp_path,
        f"no fairseq2 command at {tmp_path}/bin/fairseq2: set QWEN35_VENV",
        CPU_JOB,
        {"QWEN35_VENV": str(tmp_path), "QWEN35_CONFIG": str(SFT_CONFIG)},
    )


def test_override_that_is_not_key_value(slurm_cluster: Cluster, tmp_path: Path) -> None:
    _expect_start_failure(
        slurm_cluster,
        tmp_path,
        "override 'regime.num_steps' is not KEY=VALUE",
        CPU_JOB,
        {"QWEN35_CONFIG": str(SFT_CONFIG), "QWEN35_OUTPUT_DIR": str(tmp_path / "out")},
        script_args=("regime.num_steps",),
    )


def test_unknown_device(slurm_cluster: Cluster, tmp_path: Path) -> None:
    _expect_start_failure(
        slurm_cluster,
        tmp_path,
        "QWEN35_DEVICE must be 'cuda' or 'cpu', not 'tpu'",
        CPU_JOB,
        {"QWEN35_DEVICE": "tpu"},
    )


@pytest.mark.parametrize(
    ("gpu_args", "message"),
    [
        (
            ["--ntasks-per-node=2", "--gpus-per-node=0"],
            "no GPUs allocated: submit with --gpus-per-node=N, or set QWEN35_DEVICE=cpu",
        ),
        (
            ["--ntasks-per-node=1", f"--gpus-per-node={GPUS_PER_NODE}"],
            f"one task per GPU, but --ntasks-per-node=1 with {GPUS_PER_NODE} GPUs per node: "
            f"submit with --ntasks-per-node={GPUS_PER_NODE}",
        ),
    ],
    ids=["no-gpus", "tasks-not-gpus"],
)
def test_gpu_mode_needs_one_task_per_gpu(
    slurm_cluster: Cluster, tmp_path: Path, gpu_args: list[str], message: str
) -> None:
    _expect_start_failure(
        slurm_cluster,
        tmp_path,
        message,
        ["--nodes=1", "--cpus-per-task=1", *gpu_args],
        {
            "QWEN35_DEVICE": "cuda",
            "QWEN35_CONFIG": str(SFT_CONFIG),
            "QWEN35_OUTPUT_DIR": str(tmp_path / "out"),
        },
    )


def test_first_host_that_does_not_resolve(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """The emulated node n2 sorts first and has no address: the rendezvous
    would hang, so the job stops and says how to fix it."""
    _expect_start_failure(
        slurm_cluster,
        tmp_path,
        "the rendezvous host 'n2' (the job's first node unless QWEN35_MASTER_ADDR is set) does not resolve",
        ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"],
        {"QWEN35_CONFIG": str(SFT_CONFIG), "QWEN35_OUTPUT_DIR": str(tmp_path / "out")},
        script=RUN_CPT,
    )


@pytest.mark.parametrize(
    ("sbatch_args", "message"),
    [
        # The scripts' own defaults: 2 nodes x 8 GPUs x 8 tasks x 8 CPUs.
        ([], "Batch job submission failed"),
        (["--nodes=1", f"--ntasks-per-node={CPUS_PER_NODE + 1}", "--gpus-per-node=0",
          "--cpus-per-task=1"],
         "Requested node configuration is not available"),
        (["--nodes=1", "--ntasks-per-node=2", f"--gpus-per-node={GPUS_PER_NODE + 1}",
          "--cpus-per-task=1"],
         "Requested node configuration is not available"),
        (["--nodes=3", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"],
         "Node count specification invalid"),
        (["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1",
          "--mem=64G"],
         "Requested node configuration is not available"),
    ],
    ids=["defaults", "cpus", "gpus", "nodes", "memory"],
)
@pytest.mark.parametrize("script", [RUN_CPT, RUN_SFT], ids=["cpt", "sft"])
def test_request_larger_than_the_nodes_is_refused_at_submit(
    slurm_cluster: Cluster,
    tmp_path: Path,
    script: Path,
    sbatch_args: list[str],
    message: str,
) -> None:
    proc = slurm_cluster.sbatch(
        script, tmp_path, sbatch_args, env={"QWEN35_CONFIG": str(SFT_CONFIG)}
    )
    assert proc.returncode != 0, proc.stdout
    assert message in proc.stderr, proc.stderr
    assert proc.stdout.strip() == ""
    # Nothing waits in the queue.
    assert slurm_cluster.run("squeue", "-h", "-o", "%i").strip() == ""


# A job whose ranks start Python must stop within this.
RANK_START_S = 180


@pytest.mark.parametrize("moment", ["launcher-start", "rank-start"])
def test_stop_request_before_any_checkpoint_fails_instead_of_requeueing(
    slurm_cluster: Cluster, tmp_path: Path, moment: str
) -> None:
    """A time limit within the scripts' `--signal` margin sends USR1 right at
    the start; a requeued job would start over from the same checkpoint (here
    none) and be stopped again, forever. Sent as soon as the job runs, before
    any rank can save a checkpoint, the stop ends the job instead: at once if
    it comes before srun (`launcher-start`, which is also the moment at which
    srun, just started, may drop it), and from the ranks before their first
    step if it comes while they start (`rank-start`: they ignore the signal
    then and read the launcher's stop file)."""
    out = tmp_path / "out"
    job = slurm_cluster.submit(RUN_SFT, tmp_path, CPU_JOB, (), {"QWEN35_CONFIG": str(SFT_CONFIG), "QWEN35_OUTPUT_DIR": str(out)})
    # After the launcher set its USR1 trap, or after srun started both ranks
    # (they log it before they start Python).
    marks = ["[qwen35-slurm] job"] if moment == "launcher-start" else ["[qwen35-slurm] rank 0 of 2", "[qwen35-slurm] rank 1 of 2"]
    deadline = time.monotonic() + RANK_START_S
    while not all(mark in job.stdout() for mark in marks) and time.monotonic() < deadline:
        time.sleep(0.1)
    slurm_cluster.signal_batch_shell(job)
    info = slurm_cluster.wait(job, timeout=RANK_START_S)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "3:0", "0"), info
    assert "came before the run saved a checkpoint (last checkpoint: step none, as when the job started)" in job.stderr(), job.stderr()
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("step_*"))
    # The launcher removed its stop file.
    assert not (out / ".qwen35-stop-request").exists()
    if moment == "rank-start":
        # Both ranks stopped by themselves, before training, rather than
        # dying of the signal.
        output = job.stdout() + job.stderr()
        assert "ranks exited with 0 after the stop request" in output, output
        assert "A stop was requested before the first step: stopping without training and without a checkpoint." in output, output
