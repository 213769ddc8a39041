"""Helpers of the export integration tests: tiny reference checkpoints,
fairseq2 training runs made from them, and reading exports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor
from torch.nn import Module

from fairseq2.checkpoint import StandardCheckpointManager, StandardModelMetadataDumper
from fairseq2.device import CPU
from fairseq2.gang import create_fake_gangs
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout
from fairseq2.runtime.dependency import get_dependency_resolver, wire_object

from hf_reference import TinyQwen35Spec
from qwen35_fs2 import load_hf_model
from qwen35_fs2.hf.config import qwen35_config_from_hf
from qwen35_fs2.hf.config import load_hf_config
from qwen35_fs2.models.qwen35_moe.config import QWEN35_MOE_FAMILY, Qwen35MoeConfig

DENSE_VLM = TinyQwen35Spec(layout="vlm", add_mtp=True)
"""The released layout: vision tower, MTP head, untied, fp32."""

DENSE_VLM_BF16_TIED = TinyQwen35Spec(layout="vlm", add_mtp=True, tie_word_embeddings=True, dtype="bfloat16", seed=1)

DENSE_TEXT = TinyQwen35Spec(layout="text", seed=2)

MOE_VLM = TinyQwen35Spec(layout="vlm", moe=True, add_mtp=True, seed=3)
"""Fused experts, as released."""

MOE_TEXT_PER_EXPERT_BF16 = TinyQwen35Spec(layout="text", moe=True, expert_layout="per_expert", dtype="bfloat16", seed=4)
"""Per-expert tensors, as transformers 5.24's `save_pretrained` writes."""

DENSE_VLM_WIDE = TinyQwen35Spec(layout="vlm", hidden_size=96, seed=5)
"""Like ``DENSE_VLM`` but 96 wide: a base that does not match it."""

ALL_SPECS = (DENSE_VLM, DENSE_VLM_BF16_TIED, DENSE_TEXT, MOE_VLM, MOE_TEXT_PER_EXPERT_BF16, DENSE_VLM_WIDE)

INPUT_IDS = torch.tensor([[5, 9, 17, 3, 200, 11, 7, 42, 99, 1, 64, 128], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


def read_config(model_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())

    return config


def fine_tune(model: Module, seed: int = 7) -> Module:
    """Moves every parameter, norms included, as training would; an export
    that shifted a norm by 1, or copied a tensor from the base instead of the
    model, then gives other logits."""
    generator = torch.Generator().manual_seed(seed)

    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)

            param.add_((0.05 * param.float().std().nan_to_num(0.0) + 0.05) * noise.to(param.dtype))

    return model


@torch.no_grad()
def fairseq2_logits(model: Module, input_ids: Tensor = INPUT_IDS) -> Tensor:
    assert isinstance(model, TransformerLM)

    model.eval()

    logits: Tensor = model(input_ids, BatchLayout.of(input_ids))

    return logits.float()


def make_training_run(run_dir: Path, base: Path, *, step_nrs: tuple[int, ...] = (2, 4)) -> dict[int, Module]:
    """Writes a training output directory as a fairseq2 recipe does (the
    checkpoints with fairseq2's checkpoint manager, ``config.yaml`` naming
    ``base`` as ``model.path``), fine-tuned differently at each step; returns
    the model of each step."""
    resolver = get_dependency_resolver()

    config = qwen35_config_from_hf(load_hf_config(base))

    manager = wire_object(resolver, StandardCheckpointManager, output_dir=run_dir, gangs=create_fake_gangs(CPU))

    models = {}

    for step_nr in step_nrs:
        model = fine_tune(load_hf_model(base), seed=step_nr)

        manager.save_model_only(step_nr, model, blocking=True)

        models[step_nr] = model

    family = QWEN35_MOE_FAMILY if isinstance(config, Qwen35MoeConfig) else "qwen35"

    wire_object(resolver, StandardModelMetadataDumper).dump(run_dir / "checkpoints", family, config)

    run_config = {"model": {"name": None, "path": str(base), "family": family, "dtype": "float32"}}

    (run_dir / "config.yaml").write_text(yaml.safe_dump(run_config))

    return models


def run_fairseq2(*args: str) -> None:
    """Runs the ``fairseq2`` command of this environment; fails the test
    with its error output if it fails."""
    command = [str(Path(sys.executable).with_name("fairseq2")), *args, "--no-rich"]

    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)

    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr[-5000:]}"


def run_short_sft(
    base_dir: Path,
    work_dir: Path,
    *,
    lr: float,
    num_steps: int,
    export_hugging_face: bool = False,
    lora: dict[str, Any] | None = None,
) -> Path:
    """Fine-tunes the Hugging Face checkpoint ``base_dir`` (the
    ``qwen35_demo`` arch) in fp32 on synthetic GSM8K for ``num_steps`` steps
    with ``fairseq2 lm instruction_finetune``, checkpointing the last; returns
    the run's output directory, in ``work_dir``.

    :param export_hugging_face: Whether the run also exports its checkpoint
        in the Hugging Face format (``regime.export_hugging_face``).
    :param lora: The run's ``lora`` section, if it trains adapters.
    """
    regime: dict[str, Any] = {"num_steps": num_steps, "checkpoint_every_n_steps": num_steps, "publish_metrics_every_n_steps": 1}

    if export_hugging_face:
        regime["export_hugging_face"] = True

    config: dict[str, Any] = {
        "model": {"name": None, "path": str(base_dir), "family": "qwen35", "arch": "qwen35_demo"},
        "dataset": {
            "train": [{"path": "synthetic://gsm8k", "pattern": "main/train-*.parquet"}],
            "valid": [],
            "max_seq_len": 128,
            "max_num_tokens": 256,
            "packing": True,
            "prefetch": 1,
        },
        "tokenizer": {"name": "qwen35_tokenizer"},
        "trainer": {"mixed_precision": {"mode": "off"}, "max_grad_norm": 1.0},
        "optimizer": {"name": "adamw", "config": {"lr": lr, "weight_decay": 0.0}},
        "regime": regime,
        "common": {"metric_recorders": {"tensorboard": {"enabled": False}}},
    }

    if lora is not None:
        config["lora"] = lora

    config_file = work_dir / "sft.yaml"

    config_file.write_text(yaml.safe_dump(config))

    run_dir = work_dir / "run"

    run_fairseq2("lm", "instruction_finetune", str(run_dir), "--config", str(config_file))

    return run_dir
