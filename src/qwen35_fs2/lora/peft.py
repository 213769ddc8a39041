"""Writing the LoRA adapters of a model as a PEFT adapter directory, which
``PeftModel.from_pretrained`` loads onto the transformers model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final, cast

from safetensors.torch import save_file
from torch import Tensor
from torch.nn import Module

from fairseq2.utils.validation import StandardObjectValidator

from qwen35_fs2.hf.export.tensors import to_hg_state_dict
from qwen35_fs2.hf.export.writer import check_output_dir
from qwen35_fs2.lora.config import LoraConfig
from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.nn.lora import LoraAdapter, check_lora_adapters_unsharded

PEFT_CONFIG_NAME: Final = "adapter_config.json"

PEFT_WEIGHTS_NAME: Final = "adapter_model.safetensors"

# PEFT's keys are the transformers model's module names under the wrapper
# `PeftModel.base_model.model`, without the adapter's name.
_PEFT_KEY_PREFIX: Final = "base_model.model."


def save_peft_adapter(
    model: Module,
    out_dir: str | Path,
    *,
    config: LoraConfig,
    model_config: Qwen35Config,
    base_model_name_or_path: str | None = None,
    force: bool = False,
) -> None:
    """Writes the adapters that :func:`~qwen35_fs2.lora.apply_lora` put on
    ``model`` as a PEFT LoRA adapter for the text-only transformers model
    (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``).

    Each adapter's ``A`` and ``B`` are written under the Hugging Face name of
    its projection, in their dtype; ``B``'s rows are put in the transformers
    order by the checkpoint converter that orders the projection's weight
    (the Gated DeltaNet ``in_proj_qkv`` rows are grouped by key head in our
    model), so the transformers model with the adapter computes what ours
    does.

    :param config: The configuration the adapters were made with.
    :param base_model_name_or_path: The base model the adapter applies to (a
        Hub id or a directory), as PEFT records it.
    :param force: If ``True``, replaces the files of a non-empty ``out_dir``.

    :raises ValueError: if ``model`` has no adapters, or adapters split over
        tensor-parallel ranks.
    """
    StandardObjectValidator().validate(config)

    check_lora_adapters_unsharded(model)

    check_output_dir(out_dir, force=force)

    tensors: dict[str, Tensor] = {}

    for name, module in model.named_modules():
        if not isinstance(module, LoraAdapter):
            continue

        proj_name = name.removesuffix(".lora")

        ((hg_key, b_weight),) = to_hg_state_dict({f"{proj_name}.weight": module.b_proj.weight.detach()}, model_config).items()

        b_weight = cast(Tensor, b_weight)

        prefix = _PEFT_KEY_PREFIX + hg_key.removesuffix(".weight")

        tensors[f"{prefix}.lora_A.weight"] = module.a_proj.weight.detach().cpu().contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b_weight.cpu().contiguous()

    if not tensors:
        raise ValueError("`model` must have LoRA adapters, but has none. Call `apply_lora()` first.")

    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "target_modules": sorted(config.target_modules),
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout_p,
        "use_rslora": config.rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }

    out_dir = Path(out_dir)

    out_dir.mkdir(parents=True, exist_ok=True)

    save_file(tensors, out_dir / PEFT_WEIGHTS_NAME, metadata={"format": "pt"})

    (out_dir / PEFT_CONFIG_NAME).write_text(json.dumps(peft_config, indent=2) + "\n")
