"""A tiny Qwen3.5-MoE model trains the same under FSDP2 (experts sharded along
the expert dimension, with layerwise activation checkpointing) and DDP, in two
CPU processes (gloo), as in one process that accumulates the same shares."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

_SCRIPT = Path(__file__).with_name("_distributed_train.py")


def _run(output_dir: Path, wrap: str, *extra_args: str) -> dict[str, object]:
    args = [str(_SCRIPT), "--wrap", wrap, "--output-dir", str(output_dir), *extra_args]

    if wrap == "none":
        command = [sys.executable, *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]

    env = dict(os.environ, FAIRSEQ2_DEVICE="cpu", FAIRSEQ2_EXTENSION_TRACE="1", OMP_NUM_THREADS="1")

    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)

    assert process.returncode == 0, process.stderr[-5000:]

    result: dict[str, object] = json.loads((output_dir / "result.json").read_text())

    return result


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    output_dir = tmp_path_factory.mktemp("single")

    result = _run(output_dir, "none")

    return result, torch.load(output_dir / "state_dict.pt")


@pytest.mark.parametrize(("wrap", "extra_args"), [("fsdp2", ["--activation-checkpointing"]), ("ddp", [])])
def test_two_processes_train_like_one(
    wrap: str,
    extra_args: list[str],
    single_process: tuple[dict[str, object], dict[str, torch.Tensor]],
    tmp_path: Path,
) -> None:
    expected, expected_state_dict = single_process

    result = _run(tmp_path, wrap, *extra_args)

    losses = result["losses"]

    assert isinstance(losses, list)

    assert losses[-1] < losses[0] - 0.5, f"The loss must fall, but went {losses}."

    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6)

    grad_norms, expected_grad_norms = result["grad_norms"], expected["grad_norms"]

    assert isinstance(grad_norms, dict) and isinstance(expected_grad_norms, dict)

    assert grad_norms.keys() == expected_grad_norms.keys()

    for name, norms in expected_grad_norms.items():
        torch.testing.assert_close(torch.tensor(grad_norms[name]), torch.tensor(norms), rtol=1e-5, atol=1e-6, msg=name)

    state_dict = torch.load(tmp_path / "state_dict.pt")

    assert state_dict.keys() == expected_state_dict.keys()

    for key, value in expected_state_dict.items():
        torch.testing.assert_close(state_dict[key], value, rtol=1e-5, atol=1e-6, msg=key)

    # 8 experts: FSDP2 gives each of the 2 ranks 4 whole experts.
    num_local_experts = 4 if wrap == "fsdp2" else 8

    assert result["expert_shard_sizes"] == [num_local_experts] * 4
