"""Merging LoRA adapters into the weights of their projections."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import Module

from qwen35_fs2.nn.lora import ExpertLoraAdapter, check_lora_adapters_unsharded, is_lora_module


def merge_lora_state_dict(model: Module) -> dict[str, Tensor]:
    """Returns the state dict of ``model`` with each LoRA adapter merged into
    the weight of its projection and without the adapters' own tensors: the
    state dict of the model without adapters that computes what ``model``
    does (less dropout).

    A merged weight is ``W + (B A) · scaling`` (per expert for the stacked
    weights of routed experts) computed in float32 and stays
    float32, whatever the dtype of ``W``, ``A`` and ``B``: cast to an export
    dtype, it is the float32 merge rounded once, not the sum of two rounded
    terms. The other tensors keep their dtype.

    :raises ValueError: if ``model`` has no adapters, or adapters split over
        tensor-parallel ranks.
    """
    check_lora_adapters_unsharded(model)

    adapters = {name: module for name, module in model.named_modules() if is_lora_module(module)}

    if not adapters:
        raise ValueError("`model` must have LoRA adapters, but has none. Call `apply_lora()` first.")

    prefixes = tuple(f"{name}." for name in adapters)

    state_dict = {key: tensor for key, tensor in model.state_dict().items() if not key.startswith(prefixes)}

    with torch.no_grad():
        for name, adapter in adapters.items():
            if isinstance(adapter, ExpertLoraAdapter):
                # `experts.lora.{weight name}` adapts `experts.{weight name}`.
                experts_name, _, weight_name = name.rpartition(".lora.")

                key = f"{experts_name}.{weight_name}"

                update = torch.bmm(adapter.b.float(), adapter.a.float())
            else:
                key = name.removesuffix("lora") + "weight"

                update = adapter.b_proj.weight.float() @ adapter.a_proj.weight.float()

            state_dict[key] = state_dict[key].float() + update * adapter.scaling

    return state_dict
