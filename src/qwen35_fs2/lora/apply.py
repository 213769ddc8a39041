"""Putting LoRA adapters on a Qwen3.5 model, selected by Hugging Face names."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from fairseq2.nn import Projection
from fairseq2.utils.validation import StandardObjectValidator

from qwen35_fs2.hf.export.tensors import to_hg_state_dict
from qwen35_fs2.lora.config import LoraConfig
from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.models.qwen35.interop import has_mtp_tensors
from qwen35_fs2.nn.lora import (
    ExpertLoraAdapter,
    LoraAdapter,
    add_expert_lora_adapter,
    add_lora_adapter,
    is_lora_module,
)
from qwen35_fs2.nn.moe import RoutedExperts


def apply_lora(
    model: Module, config: LoraConfig, model_config: Qwen35Config
) -> dict[str, LoraAdapter | ExpertLoraAdapter]:
    """Freezes every parameter of ``model`` and puts a LoRA adapter on each
    projection that ``config.target_modules`` names, and on each stacked
    routed-expert weight that ``config.target_parameters`` names.

    A projection is named by its Hugging Face module name (the key the
    checkpoint converter gives its weight), so a name selects in our model
    exactly what it selects in PEFT on the transformers model, also where
    our names differ (``o_proj`` is our ``output_proj``). The base
    parameters keep their dtype; the adapters are created in the dtype of
    their projection.

    The rows of our Gated DeltaNet ``in_proj_qkv`` are grouped by key head
    (docs/architecture.md), so its adapter's ``B`` rows are too: the update
    ``B A`` then has the weight's row order, and the export permutes ``B``'s
    rows as the converter permutes the weight's.

    The multi-token-prediction head (``mtp.*``) gets no adapters and stays
    frozen: transformers does not build it, so PEFT could not load adapters
    on it, and an export would hold adapters that no server applies.

    Call it after loading the base weights: the adapters are new parameters
    that a base checkpoint does not have.

    An expert weight is named as PEFT's ``target_parameters`` names it
    (``mlp.experts.gate_up_proj``, our ``gate_inner_proj``, whose layout
    transformers shares), and gets one adapter per expert
    (:class:`~qwen35_fs2.nn.lora.ExpertLoraAdapter`).

    :returns: The adapters, by the names of their projections (or expert
        weights) in ``model``.

    :raises ValidationError: if ``config`` is invalid: an unknown target
        name, ``r`` not greater than 0.
    :raises ValueError: if ``model`` has adapters already, or a target name
        selects no projection (or expert weight) of ``model``.
    :raises NotSupportedError: if ``config.target_parameters`` names
        experts that are split over tensor-parallel ranks.
    """
    StandardObjectValidator().validate(config)

    if any(is_lora_module(m) for m in model.modules()):
        raise ValueError("`model` must not have LoRA adapters yet, but has some instead.")

    targets = set(config.target_modules)

    selected = {}

    for name, module in model.named_modules():
        if not isinstance(module, Projection):
            continue

        hg_name = hg_module_name(name, module, model_config)

        if hg_name is None or has_mtp_tensors([hg_name]):
            continue

        if hg_name.rsplit(".", 1)[-1] in targets:
            selected[name] = (module, hg_name)

    unmatched = targets - {hg_name.rsplit(".", 1)[-1] for _, hg_name in selected.values()}

    if unmatched:
        raise ValueError(
            f"`target_modules` must name projections of the model, but {', '.join(f'`{n}`' for n in sorted(unmatched))} selects none."
        )

    selected_experts = _select_expert_weights(model, config.target_parameters, model_config)

    for param in model.parameters():
        param.requires_grad_(False)

    adapters: dict[str, LoraAdapter | ExpertLoraAdapter] = {}

    for name, (module, _) in selected.items():
        adapters[name] = add_lora_adapter(
            module, rank=config.r, alpha=config.alpha, dropout_p=config.dropout_p, rslora=config.rslora
        )

    for name, (experts, weight_name) in selected_experts.items():
        adapters[name] = add_expert_lora_adapter(
            experts, weight_name, rank=config.r, alpha=config.alpha, rslora=config.rslora
        )

    return adapters


def _select_expert_weights(
    model: Module, target_parameters: list[str], model_config: Qwen35Config
) -> dict[str, tuple[RoutedExperts, Literal["gate_inner_proj", "output_proj"]]]:
    """Returns the stacked expert weights of ``model`` (outside the MTP head)
    whose Hugging Face names end in one of ``target_parameters``, by their
    names in ``model``, with their experts and weight names.

    :raises ValueError: if a target name selects none.
    """
    selected = {}

    matched = set()

    for name, module in model.named_modules():
        if not isinstance(module, RoutedExperts):
            continue

        weight_name: Literal["gate_inner_proj", "output_proj"]

        for weight_name in ("gate_inner_proj", "output_proj"):
            hg_name = hg_expert_weight_name(f"{name}.{weight_name}", getattr(module, weight_name), model_config)

            if has_mtp_tensors([hg_name]):
                continue

            for target in target_parameters:
                if hg_name.endswith(f".{target}"):
                    selected[f"{name}.{weight_name}"] = (module, weight_name)

                    matched.add(target)

    unmatched = set(target_parameters) - matched

    if unmatched:
        raise ValueError(
            f"`target_parameters` must name routed expert weights of the model, but {', '.join(f'`{n}`' for n in sorted(unmatched))} selects none."
        )

    return selected


def hg_expert_weight_name(name: str, weight: Tensor, model_config: Qwen35Config) -> str:
    """Returns the Hugging Face parameter name of the stacked expert weight
    ``name`` of our model, given by the checkpoint converter (a meta tensor
    of the weight's shape stands in for it)."""
    ((hg_key, _),) = to_hg_state_dict({name: torch.empty(weight.shape, device="meta")}, model_config).items()

    return hg_key


def hg_module_name(name: str, proj: Projection, model_config: Qwen35Config) -> str | None:
    """Returns the Hugging Face module name of the projection ``name`` of our
    model, or ``None`` if the Hugging Face model has none (the output
    projection of a tied model).

    The name is the key that the checkpoint converter gives the weight, less
    ``.weight``; a meta tensor of the weight's shape stands in for it, so
    the converter's row permutation copies nothing.
    """
    weight = torch.empty((proj.output_dim, proj.input_dim), device="meta")

    converted = to_hg_state_dict({f"{name}.weight": weight}, model_config)

    if not converted:
        return None

    (hg_key,) = converted

    return hg_key.removesuffix(".weight")


def lora_parameters(model: Module) -> list[Parameter]:
    """Returns the parameters of the LoRA adapters of ``model``: the only
    ones that need gradients and optimizer state."""
    return [param for module in model.modules() if is_lora_module(module) for param in module.parameters()]
