"""Tiny dense and MoE Qwen3.5 models loaded straight into FSDP2 shards over
two CPU processes (gloo): one unit per decoder layer holding about half of
its parameters on each rank, a gathered state dict equal to the unsharded
model, and the unsharded model's gradients; at every granularity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_WORKER = Path(__file__).with_name("_fsdp_worker.py")


def test_fsdp2_shards_every_layer_and_matches_the_unsharded_model(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(_WORKER), "--output-dir", str(tmp_path)]

    env = dict(os.environ, FAIRSEQ2_DEVICE="cpu", FAIRSEQ2_EXTENSION_TRACE="1", OMP_NUM_THREADS="1")

    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)

    assert process.returncode == 0, process.stderr[-8000:]

    result = json.loads((tmp_path / "result.json").read_text())

    assert set(result) == {"dense_layer", "moe_layer", "dense_stack", "dense_model"}

    for case in result.values():
        # 8 experts split 4/4; a few odd-sized rows make it not exactly half.
        assert all(0.49 <= fraction <= 0.51 for fraction in case["layer_fractions"]), case
