"""Tiny dense and MoE Qwen3.5 models under 2-way tensor parallelism (two CPU
processes, gloo) give the logits, loss and gradients of the unsharded model,
with the loss of their MTP head, and their checkpoints load under either
tensor parallel size; so do their LoRA adapters on every target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_WORKER = Path(__file__).with_name("_tp_worker.py")


def test_tp2_matches_tp1_and_checkpoints_reshard(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(_WORKER), "--output-dir", str(tmp_path)]

    env = dict(os.environ, FAIRSEQ2_DEVICE="cpu", FAIRSEQ2_EXTENSION_TRACE="1", OMP_NUM_THREADS="1")

    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)

    assert process.returncode == 0, process.stderr[-8000:]

    result = json.loads((tmp_path / "result.json").read_text())

    assert set(result) == {"dense", "dense_replicated_kv", "moe", "lora_dense", "lora_dense_replicated_kv", "lora_moe"}
