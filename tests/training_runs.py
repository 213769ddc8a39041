"""Training output directories as fairseq2's recipes leave them, written
without training, for the tests of the export command and of the
training-time exporter."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from fairseq2.checkpoint import StandardCheckpointManager, StandardModelMetadataDumper
from fairseq2.device import CPU
from fairseq2.gang import create_fake_gangs
from fairseq2.nn.data_parallel import get_data_parallel_facade
from fairseq2.runtime.dependency import get_dependency_resolver, wire_object

from fairseq2.utils.structured import ValueConverter

from qwen35_fs2.hf.export.tensors import to_hg_state_dict
from qwen35_fs2.lora import LoraConfig, apply_lora
from qwen35_fs2.lora.checkpoint import LoraCheckpointFacade, describe_lora_base, save_lora_base
from qwen35_fs2.models.qwen35 import create_qwen35_model
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config


def write_scratch_run(run_dir: Path) -> Path:
    """Writes into ``run_dir`` a training output directory with checkpoints
    of steps 2 and 4, written by fairseq2's checkpoint manager, of a
    ``qwen35_tiny`` model trained from scratch whose final norm is filled
    with the step number; returns ``run_dir``."""
    resolver = get_dependency_resolver()

    config = tiny_qwen35_config()

    model = create_qwen35_model(config)

    manager = wire_object(resolver, StandardCheckpointManager, output_dir=run_dir, gangs=create_fake_gangs(CPU))

    for step_nr in (2, 4):
        with torch.no_grad():
            dict(model.named_parameters())["decoder.layer_norm.weight"].fill_(step_nr)

        manager.save_model_only(step_nr, model, blocking=True)

    wire_object(resolver, StandardModelMetadataDumper).dump(run_dir / "checkpoints", "qwen35", config)

    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"name": None, "path": None, "family": "qwen35", "arch": "qwen35_tiny"}}))

    return run_dir


LORA_RUN_CONFIG = LoraConfig(target_modules=["q_proj", "o_proj", "in_proj_qkv", "in_proj_a", "down_proj"], r=3, alpha=5.0)
"""The adapters of :func:`write_lora_run`."""


def write_lora_run(run_dir: Path) -> Path:
    """Writes into ``run_dir`` a training output directory of a LoRA run with
    a checkpoint of step 2, written by fairseq2's checkpoint manager through
    the facade the recipes set: the adapters of ``LORA_RUN_CONFIG`` on a
    random ``qwen35_tiny`` model, whose ``B`` is random too (not zero, as it
    starts). Its base, the model's other tensors, is ``run_dir/base``, a
    Hugging Face checkpoint of safetensors alone (no ``config.json``, so
    exports have no base to carry over), recorded as the run records it;
    ``config.yaml`` has ``model.path`` and the ``lora`` section. Returns
    ``run_dir``."""
    resolver = get_dependency_resolver()

    config = tiny_qwen35_config()

    torch.manual_seed(3)

    model = create_qwen35_model(config)

    base_dir = run_dir / "base"

    base_dir.mkdir()

    hg = to_hg_state_dict(model.state_dict(), config)

    save_file({key: tensor.contiguous() for key, tensor in hg.items() if isinstance(tensor, torch.Tensor)}, str(base_dir / "model.safetensors"))

    for adapter in apply_lora(model, LORA_RUN_CONFIG, config).values():
        torch.nn.init.normal_(adapter.b_proj.weight, std=0.5)

    manager = wire_object(resolver, StandardCheckpointManager, output_dir=run_dir, gangs=create_fake_gangs(CPU))

    manager.save_model_only(2, LoraCheckpointFacade(get_data_parallel_facade(model)), blocking=True)

    wire_object(resolver, StandardModelMetadataDumper).dump(run_dir / "checkpoints", "qwen35", config)

    save_lora_base(run_dir / "checkpoints", describe_lora_base(base_dir, LORA_RUN_CONFIG))

    lora = resolver.resolve(ValueConverter).unstructure(LORA_RUN_CONFIG)  # type: ignore[type-abstract]

    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"name": None, "path": str(base_dir), "family": "qwen35", "arch": "qwen35_tiny"}, "lora": lora}))

    return run_dir
