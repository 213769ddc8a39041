"""Helpers of the 2-process sharding tests: random reference models and their
Hugging Face checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from fairseq2.gang import create_fake_gangs, set_gangs
from fairseq2.models.transformer_lm import TransformerLM

from qwen35_fs2.models.qwen35 import create_qwen35_model
from qwen35_fs2.models.qwen35_moe import create_qwen35_moe_model
from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.hf.export.tensors import to_hg_state_dict
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig

CPU = torch.device("cpu")


def create_reference_model(config: Qwen35Config, *, seed: int = 0) -> TransformerLM:
    """Returns an unsharded model of ``config`` with random weights (norms
    included), the same in every process."""
    torch.manual_seed(seed)

    with set_gangs(create_fake_gangs(CPU)):
        if isinstance(config, Qwen35MoeConfig):
            model = create_qwen35_moe_model(config)
        else:
            model = create_qwen35_model(config)

    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)

    return model


def save_hf_checkpoint(model: TransformerLM, config: Qwen35Config, path: Path, *, dtype: torch.dtype = torch.float32, num_files: int = 2) -> None:
    """Saves ``model`` as a Hugging Face checkpoint of ``num_files``
    safetensors files (text-only layout, fused experts)."""
    hg = {k: v.to(dtype).contiguous() for k, v in to_hg_state_dict(model.state_dict(), config).items() if isinstance(v, Tensor)}

    keys = list(hg)

    path.mkdir(parents=True, exist_ok=True)

    for idx in range(num_files):
        part = {k: hg[k] for k in keys[idx::num_files]}

        save_file(part, str(path / f"model-{idx + 1:05d}-of-{num_files:05d}.safetensors"))
