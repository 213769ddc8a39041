"""Converts Hugging Face Qwen3.5-MoE and Qwen3-Next checkpoints to fairseq2
state dicts."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Final

import torch
from torch import Tensor

from fairseq2.error import StateDictError
from fairseq2.models.utils.checkpoint import convert_state_dict

from qwen35_fs2.models.qwen35.interop import (
    check_tied_output_weights,
    convert_hg_text_state_dict,
    convert_qwen35_state_dict,
    is_hg_state_dict,
    mtp_keys_in_errors,
    mtp_layers_as_trunk_layers,
    strip_vlm_prefix,
    trunk_layers_as_mtp_layers,
)
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig
from qwen35_fs2.models.qwen3_next.interop import (
    is_qwen3_next_state_dict,
    unpack_qwen3_next_projections,
)

# Keys of the text-only layout; the dense converter handles all others.
_HG_MOE_KEY_MAP: Final = {
    # fmt: off
    r"^model\.layers\.([0-9]+)\.mlp\.gate\.":                     r"decoder.layers.\1.ffn.router.",
    r"^model\.layers\.([0-9]+)\.mlp\.experts\.gate_up_proj":      r"decoder.layers.\1.ffn.experts.gate_inner_proj",
    r"^model\.layers\.([0-9]+)\.mlp\.experts\.down_proj":         r"decoder.layers.\1.ffn.experts.output_proj",
    r"^model\.layers\.([0-9]+)\.mlp\.shared_expert\.gate_proj\.": r"decoder.layers.\1.ffn.shared_expert.gate_proj.",
    r"^model\.layers\.([0-9]+)\.mlp\.shared_expert\.up_proj\.":   r"decoder.layers.\1.ffn.shared_expert.inner_proj.",
    r"^model\.layers\.([0-9]+)\.mlp\.shared_expert\.down_proj\.": r"decoder.layers.\1.ffn.shared_expert.output_proj.",
    r"^model\.layers\.([0-9]+)\.mlp\.shared_expert_gate\.":       r"decoder.layers.\1.ffn.shared_expert_gate.",
    # fmt: on
}

_MOE_KEY: Final = re.compile(
    r"^model\.layers\.([0-9]+)\.mlp\.(gate\.|experts\.|shared_expert\.|shared_expert_gate\.)"
)

# The experts as released (fused 3-D tensors, no `.weight` suffix).
_FUSED_EXPERTS_KEY: Final = re.compile(
    r"^model\.layers\.([0-9]+)\.mlp\.experts\.(gate_up_proj|down_proj)$"
)

# The experts as transformers 5.x `save_pretrained` and Qwen3-Next write them.
_PER_EXPERT_KEY: Final = re.compile(
    r"^model\.layers\.([0-9]+)\.mlp\.experts\.([0-9]+)\.(gate_proj|up_proj|down_proj)\.weight$"
)

_PROJECTIONS: Final = ("gate_proj", "up_proj", "down_proj")


def convert_qwen35_moe_state_dict(
    state_dict: dict[str, object], config: Qwen35MoeConfig
) -> dict[str, object]:
    """Converts a Hugging Face Qwen3.5-MoE or Qwen3-Next state dict to
    fairseq2 keys.

    Experts may be fused (``mlp.experts.gate_up_proj`` ``[E, 2I, M]``, gate
    rows first, and ``mlp.experts.down_proj`` ``[E, M, I]``) or per expert
    (``mlp.experts.{e}.{gate,up,down}_proj.weight``); both become the fused
    parameters of :class:`~qwen35_fs2.nn.moe.experts.RoutedExperts`. Missing,
    unknown or mis-shaped expert tensors raise a :class:`StateDictError`
    naming them, in the trunk and in the MTP head alike. The output
    projection is checked, the MTP head converted or skipped, and native
    fairseq2 checkpoints pass through as in
    :func:`~qwen35_fs2.models.qwen35.interop.convert_qwen35_state_dict`.
    """
    if not is_hg_state_dict(state_dict):
        return convert_qwen35_state_dict(state_dict, config)

    check_tied_output_weights(state_dict, config)

    if is_qwen3_next_state_dict(state_dict):
        state_dict = unpack_qwen3_next_projections(state_dict, config)

    # The MTP head's layer is an MoE layer numbered after the trunk's.
    text_state_dict = mtp_layers_as_trunk_layers(strip_vlm_prefix(state_dict), config)

    moe_state_dict = {}
    other_state_dict = {}

    for key, value in text_state_dict.items():
        match = _MOE_KEY.match(key)

        if match is not None and config.is_moe_layer(int(match.group(1))):
            moe_state_dict[key] = value
        else:
            other_state_dict[key] = value

    with mtp_keys_in_errors(config):
        converted = convert_hg_text_state_dict(other_state_dict, config)

        converted.update(convert_state_dict(_fuse_experts(moe_state_dict, config), _HG_MOE_KEY_MAP))

    return trunk_layers_as_mtp_layers(converted, config)


def _fuse_experts(
    state_dict: dict[str, object], config: Qwen35MoeConfig
) -> dict[str, object]:
    """Replaces per-expert tensors by the fused ones, checking the shapes of
    both layouts."""
    num_experts = config.experts.num_experts

    model_dim = config.model_dim
    inner_dim = config.experts.inner_dim

    fused_shapes = {
        "gate_up_proj": (num_experts, 2 * inner_dim, model_dim),
        "down_proj": (num_experts, model_dim, inner_dim),
    }

    per_expert_shapes = {
        "gate_proj": (inner_dim, model_dim),
        "up_proj": (inner_dim, model_dim),
        "down_proj": (model_dim, inner_dim),
    }

    output: dict[str, object] = {}

    # layer index -> {(expert index, projection): tensor}
    per_expert: dict[str, dict[tuple[int, str], Tensor]] = defaultdict(dict)

    unknown_keys = []

    for key, value in state_dict.items():
        if match := _FUSED_EXPERTS_KEY.match(key):
            _check_shape(key, value, fused_shapes[match.group(2)])

            output[key] = value
        elif match := _PER_EXPERT_KEY.match(key):
            layer_idx, expert_idx, projection = match.groups()

            if int(expert_idx) >= num_experts:
                unknown_keys.append(key)

                continue

            per_expert[layer_idx][(int(expert_idx), projection)] = _check_shape(
                key, value, per_expert_shapes[projection]
            )
        elif ".mlp.experts." in key:
            unknown_keys.append(key)
        else:
            output[key] = value

    if unknown_keys:
        raise StateDictError(
            f"The Hugging Face checkpoint has expert tensors that are not part of a Qwen3.5-MoE model with {num_experts} experts: {', '.join(sorted(unknown_keys))}"
        )

    for layer_idx, tensors in per_expert.items():
        prefix = f"model.layers.{layer_idx}.mlp.experts."

        fused_keys = [prefix + name for name in fused_shapes if prefix + name in output]

        if fused_keys:
            raise StateDictError(
                f"Layer {layer_idx} of the Hugging Face checkpoint has both fused ({', '.join(fused_keys)}) and per-expert expert tensors."
            )

        missing_keys = [
            f"{prefix}{expert_idx}.{projection}.weight"
            for expert_idx in range(num_experts)
            for projection in _PROJECTIONS
            if (expert_idx, projection) not in tensors
        ]

        if missing_keys:
            raise StateDictError(
                f"The Hugging Face checkpoint misses expert tensors of layer {layer_idx}: {', '.join(missing_keys)}"
            )

        # (E, 2I, M): the gate rows, then the up rows of each expert.
        output[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([tensors[(e, "gate_proj")], tensors[(e, "up_proj")]]) for e in range(num_experts)]
        )

        # (E, M, I)
        output[prefix + "down_proj"] = torch.stack(
            [tensors[(e, "down_proj")] for e in range(num_experts)]
        )

    return output


def _check_shape(key: str, value: object, shape: tuple[int, ...]) -> Tensor:
    if not isinstance(value, Tensor):
        raise StateDictError(f"`{key}` must be a tensor, but is of type `{type(value).__name__}` instead.")

    if tuple(value.shape) != shape:
        raise StateDictError(
            f"`{key}` must have a shape of {shape} for the model's configuration, but has a shape of {tuple(value.shape)} instead."
        )

    return value
