"""Writing the LoRA adapters of a model as a PEFT adapter directory, which
``PeftModel.from_pretrained`` loads onto the transformers model."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Final, cast

from safetensors.torch import save_file
from torch import Tensor
from torch.nn import Module

from fairseq2.utils.validation import StandardObjectValidator

from qwen35_fs2.hf.export.tensors import to_hg_state_dict
from qwen35_fs2.hf.export.writer import StagingDir, check_output_dir
from qwen35_fs2.lora.apply import hg_expert_weight_name
from qwen35_fs2.lora.config import LoraConfig
from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.nn.lora import ExpertLoraAdapter, LoraAdapter, check_lora_adapters_unsharded

PEFT_CONFIG_NAME: Final = "adapter_config.json"

PEFT_WEIGHTS_NAME: Final = "adapter_model.safetensors"

# PEFT's keys are the transformers model's module names under the wrapper
# `PeftModel.base_model.model`, without the adapter's name.
_PEFT_KEY_PREFIX: Final = "base_model.model."

PEFT_BASE_MODEL_TYPES: Final = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
"""The Hugging Face model types whose transformers models load the adapters
of :func:`save_peft_adapter` as they are written."""


def check_peft_base(hf_config: Mapping[str, object], where: str) -> None:
    """Raises :class:`ValueError` unless the transformers model of
    ``hf_config`` (a ``config.json``; ``where`` names it) loads the adapters
    of :func:`save_peft_adapter` as written.

    Qwen3-Next, whose checkpoints our Qwen3.5-MoE models load, does not:
    transformers' ``Qwen3NextForCausalLM`` fuses the Gated DeltaNet's input
    projections (``in_proj_qkvz``, ``in_proj_ba``) that the adapters name
    apart, and PEFT 0.21 moves the adapters of ``gate_proj``, ``up_proj``
    and ``down_proj`` from its shared expert to its routed experts. PEFT
    would load the adapters of the other projections and drop these without
    an error.
    """
    model_type = hf_config.get("model_type")

    if model_type not in PEFT_BASE_MODEL_TYPES:
        types = ", ".join(f"'{t}'" for t in PEFT_BASE_MODEL_TYPES)

        raise ValueError(
            f"The base of a PEFT adapter must be a Qwen3.5 model (`model_type` {types}), but {where} has `model_type` {model_type!r} instead: PEFT would not load its adapters as they are written."
        )


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
    its projection (or of its experts, :func:`_expert_adapter_tensors`), in
    their dtype; ``B``'s rows are put in the transformers
    order by the checkpoint converter that orders the projection's weight
    (the Gated DeltaNet ``in_proj_qkv`` rows are grouped by key head in our
    model), so the transformers model with the adapter computes what ours
    does.

    :param config: The configuration the adapters were made with.
    :param base_model_name_or_path: The base model the adapter applies to (a
        Hub id or a directory), as PEFT records it.
    :param force: If ``True``, replaces a non-empty ``out_dir`` whole.

    :raises ValueError: if ``model`` has no adapters, or adapters split over
        tensor-parallel ranks.
    """
    StandardObjectValidator().validate(config)

    check_lora_adapters_unsharded(model)

    check_output_dir(out_dir, force=force)

    tensors: dict[str, Tensor] = {}

    for name, module in model.named_modules():
        if isinstance(module, ExpertLoraAdapter):
            tensors.update(_expert_adapter_tensors(name, module, config, model_config))

            continue

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
        "target_parameters": sorted(config.target_parameters),
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout_p,
        "use_rslora": config.rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }

    # Written aside and renamed into place: `out_dir` never holds a partial
    # adapter, nor, with `force`, the files of what it held before (a merged
    # model that vLLM would serve instead of the adapter).
    with StagingDir(Path(out_dir).absolute()) as staging_dir:
        save_file(tensors, staging_dir.path / PEFT_WEIGHTS_NAME, metadata={"format": "pt"})

        (staging_dir.path / PEFT_CONFIG_NAME).write_text(json.dumps(peft_config, indent=2) + "\n")

        staging_dir.commit()


def _expert_adapter_tensors(
    name: str, adapter: ExpertLoraAdapter, config: LoraConfig, model_config: Qwen35Config
) -> dict[str, Tensor]:
    """Returns the tensors of the adapter ``name`` of a stacked expert weight
    as PEFT's ``target_parameters`` adapter of that weight stores them.

    PEFT stacks the experts' ``A_e`` :math:`(r, I)` along the rows of one
    ``lora_A`` :math:`(E r, I)`, expert by expert, and their ``B_e``
    :math:`(O, r)` along the columns of one ``lora_B`` :math:`(O, r E)`,
    with the expert index varying fastest. Its adapter sits on the experts
    module; where both of its weights are adapted, PEFT nests the second
    weight's adapter around the first's, in the order transformers
    registers them (``gate_up_proj``, then ``down_proj``), so the
    ``gate_up_proj`` adapter's keys are under ``base_layer``.
    """
    experts_name, _, weight_name = name.rpartition(".lora.")

    hg_name = hg_expert_weight_name(f"{experts_name}.{weight_name}", adapter.a, model_config)

    hg_experts_name, _, hg_weight_name = hg_name.rpartition(".")

    prefix = _PEFT_KEY_PREFIX + hg_experts_name

    if hg_weight_name == "gate_up_proj" and len(config.target_parameters) == 2:
        prefix = f"{prefix}.base_layer"

    a = adapter.a.detach()
    b = adapter.b.detach()

    num_experts, output_dim, rank = b.shape

    # (E, r, I) -> (E r, I); (E, O, r) -> (O, r, E) -> (O, r E)
    lora_a = a.reshape(num_experts * rank, -1)
    lora_b = b.permute(1, 2, 0).reshape(output_dim, rank * num_experts)

    return {
        f"{prefix}.lora_A.weight": lora_a.cpu().contiguous(),
        f"{prefix}.lora_B.weight": lora_b.cpu().contiguous(),
    }
