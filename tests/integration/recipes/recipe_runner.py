"""Helpers of the end-to-end recipe tests: run the recipes on CPU as a user
would, with the `fairseq2` command or `torchrun -m qwen35_fs2.recipes.<recipe>`
(gloo, FSDP2), and read the metrics they record."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

REPO_DIR = Path(__file__).resolve().parents[3]

RECIPES_DIR = REPO_DIR / "recipes"

# A 2-layer (Gated DeltaNet + attention), 64-dim Qwen3.5 over the real
# vocabulary: the tiny configs, made smaller still.
TINY_MODEL_OVERRIDES = (
    "model.config_overrides={num_layers: 2, full_attention_interval: 2, model_dim: 64, ffn_inner_dim: 128}"
)

# Turns a hung run into a failure. The test machines have run up to 12 times
# slower than usual for hours (docs/performance.md, "The test suite's time"):
# a run of 2 minutes then takes 24, and the compiled run of test_compile.py
# hit the 900 s this was before.
TIMEOUT_S = 2400


def run_recipe(
    command: str,
    output_dir: Path,
    config: str | None,
    overrides: Sequence[str],
    *,
    nproc: int = 1,
    expected_returncode: int = 0,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Runs ``fairseq2 lm <command>`` (or its ``torchrun`` module) with the
    config file ``recipes/<config>`` and returns the finished process; fails
    the test with the output if it exits with another code than
    ``expected_returncode``."""
    args = [str(output_dir), "--no-rich", "--set", *overrides]

    if config is not None:
        args += ["--config", str(RECIPES_DIR / config)]

    if nproc == 1:
        cmd = [find_executable("fairseq2"), "lm", command, *args]
    else:
        module = {"instruction_finetune": "sft", "train": "train", "eval_gsm8k": "eval_gsm8k"}[command]

        cmd = [find_executable("torchrun"), "--standalone", f"--nproc_per_node={nproc}", "-m", f"qwen35_fs2.recipes.{module}", *args]  # fmt: skip

    process = run_command(cmd, env)

    if process.returncode != expected_returncode:
        pytest.fail(f"{' '.join(cmd)} exited with code {process.returncode} instead of {expected_returncode}:\n{process.stdout[-6000:]}")

    return process


def run_command(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs ``cmd`` on the CPU, in the environment of the tests plus ``env``."""
    full_env = dict(os.environ, FAIRSEQ2_DEVICE="cpu", PYTHONUNBUFFERED="1", **(env or {}))

    return subprocess.run(
        cmd, cwd=REPO_DIR, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S
    )


def find_executable(name: str) -> str:
    # The console scripts of the venv running the tests.
    path = Path(sys.executable).parent / name

    if path.exists():
        return str(path)

    found = shutil.which(name)

    if found is None:
        pytest.fail(f"`{name}` is not installed; run `pip install -e .`.")

    return found


def read_metrics(output_dir: Path, name: str = "train") -> dict[int, dict[str, float]]:
    """Returns the metrics of each step recorded in ``metrics/<name>.jsonl``."""
    return {int(record["Step"]): record for record in read_metric_records(output_dir, name)}


def read_metric_records(output_dir: Path, name: str) -> list[dict[str, float]]:
    """Returns the records of ``metrics/<name>.jsonl``."""
    with output_dir.joinpath("metrics", f"{name}.jsonl").open(encoding="utf-8") as fp:
        return [json.loads(line) for line in fp]
