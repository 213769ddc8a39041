"""Tiny dense and MoE Qwen3.5 models loaded straight into FSDP2 shards over
two CPU processes (gloo): one unit per decoder layer holding about half of
its parameters on each rank, a gathered state dict equal to the unsharded
model, and the unsharded model's loss and gradients; at every granularity.
The MoE model carries LoRA adapters on its projections and routed experts:
it gets the unsharded model's new adapters from the same seed, and their
gradients."""

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

    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)

    assert process.returncode == 0, process.stderr[-8000:]

    result = json.loads((tmp_path / "result.json").read_text())

    mixed_precision = result.pop("mixed_precision")

    assert set(result) == {"dense_layer", "moe_layer", "dense_stack", "dense_model"}

    # `A` and `B` of both stacked expert weights in each of the 4 layers.
    assert result["moe_layer"]["expert_adapter_grads"] == 16

    # Static bf16 through fairseq2's wrapper: `A_log` and `dt_bias` are
    # gathered, differentiated and reduced in fp32 (the log decay too), the
    # projections run in bf16.
    assert mixed_precision["decay_params"] == ["torch.float32"]
    assert mixed_precision["decay_grads"] == ["torch.float32"]
    assert mixed_precision["decay_outputs"] == ["torch.float32"]
    assert mixed_precision["sharded_decay"] == ["torch.float32/torch.float32"]
    assert mixed_precision["proj_weights"] == ["torch.bfloat16"]

    # A router computing in fp32 gets its weight in fp32, not rounded to
    # bf16 by FSDP2 and upcast; the default computes in bf16 as serving does.
    assert mixed_precision["router_weights"] == {"activation": ["torch.bfloat16"], "fp32": ["torch.float32"]}

    # Their gradients follow the fp32 reference up to the bf16 rounding of
    # the rest of the model.
    assert len(mixed_precision["decay_grad_errors"]) == 6
    assert all(error < 0.05 for error in mixed_precision["decay_grad_errors"].values()), mixed_precision

    for case in result.values():
        # 8 experts split 4/4; a few odd-sized rows make it not exactly half.
        assert all(0.49 <= fraction <= 0.51 for fraction in case["layer_fractions"]), case
