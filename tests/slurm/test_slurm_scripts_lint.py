"""Static checks of every SLURM shell script: ``bash -n``, ``shellcheck``, and
the ``#SBATCH`` defaults a GPU job needs (a script without ``--requeue`` or the
USR1 warning would lose the work since its last checkpoint at the time limit)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from slurm_cluster import REPO, RUN_CPT, RUN_SFT, SLURM_DIR

SCRIPTS = sorted(
    [
        *SLURM_DIR.glob("*.sh"),
        *SLURM_DIR.glob("lib/*.sh"),
        *(REPO / "scripts").glob("slurm_*.sh"),
    ]
)

RUN_SCRIPTS = [RUN_CPT, RUN_SFT]


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(REPO)) for p in paths]


def test_the_scripts_exist() -> None:
    assert RUN_CPT in SCRIPTS and RUN_SFT in SCRIPTS
    assert (SLURM_DIR / "lib" / "launch.sh") in SCRIPTS
    assert (REPO / "scripts" / "slurm_local_up.sh") in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=_ids(SCRIPTS))
def test_bash_syntax(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=_ids(SCRIPTS))
def test_shellcheck(script: Path, shellcheck: str) -> None:
    # From the checkout's root, so `source` directives resolve (-x).
    proc = subprocess.run(
        [shellcheck, "-x", str(script.relative_to(REPO))],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _sbatch_directives(script: Path) -> dict[str, str]:
    directives: dict[str, str] = {}
    for line in script.read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if m:
            directives[m.group(1)] = m.group(2) or ""
    return directives


@pytest.mark.parametrize("script", RUN_SCRIPTS, ids=_ids(RUN_SCRIPTS))
def test_sbatch_defaults_for_gpu_nodes(script: Path) -> None:
    d = _sbatch_directives(script)
    for key in ("nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time"):
        assert key in d, f"#SBATCH --{key} missing"
    # One task per GPU.
    assert d["ntasks-per-node"] == d["gpus-per-node"]
    # The warning goes to the batch shell, which forwards it to the ranks and
    # requeues; the requeued job appends to the same log files.
    assert re.fullmatch(r"B:USR1@\d+", d.get("signal", "")), d.get("signal")
    assert "requeue" in d
    assert d.get("open-mode") == "append"
    assert "output" in d and "error" in d
    # A log directory that does not exist makes SLURM fail the job with no
    # output at all: the defaults write to the submit directory.
    assert "/" not in d["output"] and "/" not in d["error"]


@pytest.mark.parametrize("script", RUN_SCRIPTS, ids=_ids(RUN_SCRIPTS))
def test_default_config_exists(script: Path) -> None:
    m = re.search(r"^QWEN35_DEFAULT_CONFIG=(\S+)$", script.read_text(), re.M)
    assert m, "QWEN35_DEFAULT_CONFIG missing"
    assert (REPO / m.group(1)).is_file(), m.group(1)


@pytest.mark.parametrize("script", RUN_SCRIPTS, ids=_ids(RUN_SCRIPTS))
def test_direct_run_outside_slurm_fails_clearly(script: Path, tmp_path: Path) -> None:
    """Running the script with bash instead of sbatch stops at once."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert "not inside a SLURM job: submit this script with sbatch" in proc.stderr


@pytest.mark.parametrize("layout", ["flat", "sweep"])
def test_the_launcher_finds_the_last_checkpoint(tmp_path: Path, layout: str) -> None:
    # With `common.no_sweep_dir=false` fairseq2 nests the checkpoints in a
    # `ws_<world size>.<hash>` directory: the launcher's resume messages and
    # its check of progress before a requeue must find them there too.
    checkpoints = tmp_path / "checkpoints" if layout == "flat" else tmp_path / "ws_2.0123abcd" / "checkpoints"
    for name in ("step_2", "step_10", "step_4.tmp", "step_x"):
        (checkpoints / name).mkdir(parents=True)
    proc = subprocess.run(
        ["bash", "-c", 'set -euo pipefail; source "$0"; _qwen35_last_checkpoint "$1"', str(SLURM_DIR / "lib" / "launch.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert (proc.returncode, proc.stdout) == (0, "10\n"), proc.stderr


@pytest.mark.parametrize("saved", [True, False], ids=["saved", "nothing_saved"])
def test_a_stop_requeues_only_after_a_new_checkpoint(tmp_path: Path, saved: bool) -> None:
    # An older run's sweep directory holds a later step than this run's: a
    # new checkpoint of this run is progress all the same. `scontrol requeue`
    # is stood in for (no job here).
    (tmp_path / "ws_1.aaaa" / "checkpoints" / "step_1000").mkdir(parents=True)
    (tmp_path / "ws_1.bbbb" / "checkpoints" / "step_100").mkdir(parents=True)
    save = 'mkdir -p "$1/ws_1.bbbb/checkpoints/step_200"' if saved else ":"
    script = (
        # As the scripts run it.
        'set -euo pipefail; source "$0"; _qwen35_requeue() { echo requeued; exit 0; }; start=$(_qwen35_checkpoints "$1"); '
        + save
        + '; _qwen35_requeue_after_progress "$1" "$start"'
    )
    proc = subprocess.run(
        ["bash", "-c", script, str(SLURM_DIR / "lib" / "launch.sh"), str(tmp_path)], capture_output=True, text=True
    )
    if saved:
        assert (proc.returncode, proc.stdout.splitlines()[-1]) == (0, "requeued"), proc.stderr
    else:
        assert proc.returncode == 3, proc.stdout
        assert "came before the run saved a checkpoint (last checkpoint: step 1000, as when the job started)" in proc.stderr


def test_listing_no_checkpoints_does_not_end_the_script(tmp_path: Path) -> None:
    # Under `set -e -o pipefail`, as the scripts run, a listing that ends on
    # a test that fails would end the job at start without a word.
    proc = subprocess.run(
        ["bash", "-c", 'set -euo pipefail; source "$0"; listing=$(_qwen35_checkpoints "$1"); echo "[$listing]"', str(SLURM_DIR / "lib" / "launch.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert (proc.returncode, proc.stdout) == (0, "[]\n"), proc.stderr
