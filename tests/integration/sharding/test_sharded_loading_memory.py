"""Loading a 2-file Hugging Face checkpoint of a 232 MB model into the FSDP2
shards of two CPU processes: each rank's peak resident memory grows by its
half of the model plus a small read buffer, far from the whole model that
fairseq2's rank-0 loading holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _loading_memory_worker import memory_test_config
from sharding_testing import create_reference_model, save_hf_checkpoint

pytestmark = pytest.mark.slow

_WORKER = Path(__file__).with_name("_loading_memory_worker.py")

_READ_BUFFER_BYTES = 4 * 1024 * 1024


def test_peak_memory_of_a_rank_stays_near_its_shard(tmp_path: Path) -> None:
    config = memory_test_config()

    checkpoint = tmp_path / "checkpoint"

    # bf16 on disk, fp32 in memory: every read goes through the buffer.
    save_hf_checkpoint(create_reference_model(config), config, checkpoint, dtype=torch.bfloat16)

    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(_WORKER),
        "--checkpoint", str(checkpoint), "--output-dir", str(tmp_path), "--read-buffer-bytes", str(_READ_BUFFER_BYTES),
    ]  # fmt: skip

    env = dict(os.environ, FAIRSEQ2_DEVICE="cpu", FAIRSEQ2_EXTENSION_TRACE="1", OMP_NUM_THREADS="1")

    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)

    assert process.returncode == 0, process.stderr[-8000:]

    result = json.loads((tmp_path / "result.json").read_text())

    model_bytes = result["model_bytes"]

    assert model_bytes > 200e6

    for rank, peak in enumerate(result["peak_bytes"]):
        assert peak < 0.65 * model_bytes, f"Rank {rank} peaked at {peak / model_bytes:.0%} of the model ({peak / 1e6:.0f} of {model_bytes / 1e6:.0f} MB)."
