"""Fairseq2 state dicts of either family in Hugging Face keys, and the two
layouts of the MoE experts in Hugging Face checkpoints."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

import torch
from torch import Tensor

from fairseq2.models.utils.checkpoint import convert_state_dict, create_reverse_key_map

from qwen35_fs2.hf.export.repository import FUSED_EXPERT_KEY, PER_EXPERT_KEY, ExpertLayout, HfExportError
from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.models.qwen35.interop import (
    convert_to_hg_state_dict,
    hg_trunk_layers_as_mtp_layers,
    mtp_layers_as_fs2_trunk_layers,
)
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig
from qwen35_fs2.models.qwen35_moe.interop import _HG_MOE_KEY_MAP

_HG_MOE_REVERSE_KEY_MAP: Final = create_reverse_key_map(_HG_MOE_KEY_MAP)

_HG_MOE_REVERSE_KEY_MAP_PATTERNS: Final = tuple(
    re.compile(p) for p in _HG_MOE_REVERSE_KEY_MAP
)


def to_hg_state_dict(
    state_dict: Mapping[str, object], config: Qwen35Config
) -> dict[str, object]:
    """Converts a fairseq2 state dict of either family to Hugging Face keys
    in the text-only layout (the MTP head as ``mtp.*``); MoE experts come out
    fused, as fairseq2 stores them."""
    if not isinstance(config, Qwen35MoeConfig):
        return convert_to_hg_state_dict(state_dict, config)

    # The MTP head's MoE block converts as a trunk layer's.
    state_dict = mtp_layers_as_fs2_trunk_layers(state_dict, config)

    moe_state_dict = {}
    other_state_dict = {}

    for key, value in state_dict.items():
        if any(p.match(key) for p in _HG_MOE_REVERSE_KEY_MAP_PATTERNS):
            moe_state_dict[key] = value
        else:
            other_state_dict[key] = value

    converted = convert_to_hg_state_dict(other_state_dict, config)

    converted.update(convert_state_dict(moe_state_dict, _HG_MOE_REVERSE_KEY_MAP))

    return hg_trunk_layers_as_mtp_layers(converted, config)


class StateDictShapeError(HfExportError):
    """Raised when expert tensors cannot be laid out as asked."""

    def __init__(self, key: str, expected: str) -> None:
        super().__init__(f"`{key}` must be {expected}, but is not.")


def lay_out_experts(
    hg_state_dict: Mapping[str, object], layout: ExpertLayout
) -> dict[str, object]:
    """Stores the MoE experts of a Hugging Face state dict in ``layout``.

    ``"fused"``: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows
    first) and ``mlp.experts.down_proj`` ``[E, H, I]``, as in the released
    checkpoints. ``"per_expert"``: ``mlp.experts.{e}.{gate,up,down}_proj.weight``,
    as transformers 5.24's ``save_pretrained`` writes. Other keys pass through.
    """
    output: dict[str, object] = {}

    per_expert: dict[str, dict[int, dict[str, Tensor]]] = {}

    for key, value in hg_state_dict.items():
        if (m := FUSED_EXPERT_KEY.search(key)) is not None and layout == "per_expert":
            prefix = key.removesuffix(m[1])

            if not isinstance(value, Tensor) or value.dim() != 3:
                raise StateDictShapeError(key, "a 3-D tensor")

            if m[1] == "gate_up_proj":
                if value.size(1) % 2 != 0:
                    raise StateDictShapeError(key, "[E, 2I, H] with an even second dimension")

                for expert_idx, gate_up in enumerate(value):
                    gate, up = gate_up.chunk(2, dim=0)

                    output[f"{prefix}{expert_idx}.gate_proj.weight"] = gate
                    output[f"{prefix}{expert_idx}.up_proj.weight"] = up
            else:
                for expert_idx, down in enumerate(value):
                    output[f"{prefix}{expert_idx}.down_proj.weight"] = down
        elif (m := PER_EXPERT_KEY.match(key)) is not None and layout == "fused":
            if not isinstance(value, Tensor):
                raise StateDictShapeError(key, "a tensor")

            per_expert.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = value
        else:
            output[key] = value

    for prefix, experts in per_expert.items():
        if sorted(experts) != list(range(len(experts))):
            raise StateDictShapeError(
                f"{prefix}*", f"experts numbered 0 to {len(experts) - 1}, not {sorted(experts)}"
            )

        gate_ups, downs = [], []

        for expert_idx in range(len(experts)):
            projs = experts[expert_idx]

            if projs.keys() != {"gate_proj", "up_proj", "down_proj"}:
                raise StateDictShapeError(
                    f"{prefix}{expert_idx}.*", "gate_proj, up_proj and down_proj"
                )

            gate_ups.append(torch.cat([projs["gate_proj"], projs["up_proj"]], dim=0))

            downs.append(projs["down_proj"])

        output[prefix + "gate_up_proj"] = torch.stack(gate_ups)
        output[prefix + "down_proj"] = torch.stack(downs)

    return output
