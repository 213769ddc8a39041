"""Which rows of which Hugging Face tensors make up each tensor of a
fairseq2 Qwen3.5 model: the state-dict converters' work, as row ranges that
each rank can read on its own (see :mod:`qwen35_fs2.hf.sharded_loading`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast, final

import torch

from fairseq2.error import InternalError, StateDictError
from fairseq2.models.utils.checkpoint import convert_state_dict

from qwen35_fs2.hf.safetensors import matrix_rows
from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.models.qwen35.interop import (
    _GROUPED_QKV_KEY,
    _HG_KEY_MAP,
    convert_qwen35_state_dict,
    is_hg_state_dict,
    mtp_layers_as_trunk_layers,
    qkv_row_segments,
    strip_vlm_prefix,
    trunk_layers_as_mtp_layers,
)
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig
from qwen35_fs2.models.qwen35_moe.interop import (
    _HG_MOE_KEY_MAP,
    _MOE_KEY,
    _PER_EXPERT_KEY,
    convert_qwen35_moe_state_dict,
)
from qwen35_fs2.models.qwen3_next.interop import _PACKED_KEY

@final
@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, start + length)`` of the Hugging Face tensor ``key``,
    viewed as 2-D (all dimensions but the last are rows)."""

    key: str
    start: int
    length: int


RowPlan = dict[str, list[RowRange]]
"""Maps each fairseq2 tensor to the row ranges whose concatenation it is."""


def plan_hf_rows(shapes: Mapping[str, tuple[int, ...]], config: Qwen35Config) -> RowPlan:
    """Returns, for every tensor of the fairseq2 state dict of a Hugging Face
    checkpoint whose tensors have ``shapes``, the row ranges it is made of.

    Raises the converters' :class:`StateDictError` for a checkpoint that does
    not match ``config``.
    """
    if not is_hg_state_dict(shapes):
        raise StateDictError(
            "The checkpoint must be a Hugging Face Qwen3.5 checkpoint (with `model.embed_tokens.weight` or `model.language_model.embed_tokens.weight`), but is not."
        )

    _check_with_converter(shapes, config)

    # Text-only layout keys (the MTP head's layers as trunk layers, as the
    # converters take them) -> the rows of the checkpoint's tensors.
    text_keys = mtp_layers_as_trunk_layers(strip_vlm_prefix({key: key for key in shapes}), config)

    plan: RowPlan = {
        text_key: [RowRange(key, 0, matrix_rows(shapes[key]))]
        for text_key, key in text_keys.items()
        if isinstance(key, str)
    }

    plan = _unpack_qwen3_next_rows(plan, config)

    moe_plan: RowPlan = {}

    if isinstance(config, Qwen35MoeConfig):
        for key in list(plan):
            match = _MOE_KEY.match(key)

            if match is not None and config.is_moe_layer(int(match.group(1))):
                moe_plan[key] = plan.pop(key)

        moe_plan = _fuse_expert_rows(moe_plan, config)

    if config.tied_embeddings:
        plan.pop("lm_head.weight", None)

    fs2_plan: RowPlan = {}

    for key_map, part in ((_HG_KEY_MAP, plan), (_HG_MOE_KEY_MAP, moe_plan)):
        for key, ranges in convert_state_dict(dict(part), key_map).items():
            if not isinstance(ranges, list):
                raise InternalError(f"The row plan of `{key}` is of type `{type(ranges)}`.")

            fs2_plan[key] = ranges

    for key, ranges in fs2_plan.items():
        if _GROUPED_QKV_KEY.match(key):
            fs2_plan[key] = [r for start, length in qkv_row_segments(config) for r in take_rows(ranges, start, length)]

    return cast(RowPlan, trunk_layers_as_mtp_layers(fs2_plan, config))


def _check_with_converter(shapes: Mapping[str, tuple[int, ...]], config: Qwen35Config) -> None:
    """Runs the state-dict converter on meta tensors of ``shapes``: it raises
    its errors for keys and shapes that do not match ``config``."""
    state_dict: dict[str, object] = {
        key: torch.empty(shape, device="meta") for key, shape in shapes.items()
    }

    if isinstance(config, Qwen35MoeConfig):
        convert_qwen35_moe_state_dict(state_dict, config)
    else:
        convert_qwen35_state_dict(state_dict, config)


def take_rows(ranges: list[RowRange], start: int, length: int) -> list[RowRange]:
    """Returns rows ``[start, start + length)`` of the concatenation of
    ``ranges``."""
    taken = []

    offset = 0

    for r in ranges:
        begin = max(start, offset)
        end = min(start + length, offset + r.length)

        if begin < end:
            taken.append(RowRange(r.key, r.start + begin - offset, end - begin))

        offset += r.length

    if sum(r.length for r in taken) != length:
        raise InternalError(f"Rows {start} to {start + length} are out of the {offset} rows of {ranges}.")

    return taken


def _per_group_rows(ranges: list[RowRange], num_groups: int, sizes: list[int]) -> list[list[RowRange]]:
    """Splits the rows of each of ``num_groups`` consecutive groups into
    parts of ``sizes`` and concatenates each part over the groups (the rows
    of :func:`qwen35_fs2.models.qwen3_next.interop._split_per_key_head`)."""
    group_size = sum(sizes)

    parts: list[list[RowRange]] = [[] for _ in sizes]

    for group_idx in range(num_groups):
        offset = group_idx * group_size

        for part, size in zip(parts, sizes):
            part.extend(take_rows(ranges, offset, size))

            offset += size

    return parts


def _unpack_qwen3_next_rows(plan: RowPlan, config: Qwen35Config) -> RowPlan:
    """The rows of :func:`qwen35_fs2.models.qwen3_next.interop.unpack_qwen3_next_projections`."""
    num_key_heads = config.num_linear_key_heads

    ratio = config.num_linear_value_heads // num_key_heads

    value_group_dim = ratio * config.linear_value_head_dim

    key_head_dim = config.linear_key_head_dim

    unpacked: RowPlan = {}

    for key, ranges in plan.items():
        match = _PACKED_KEY.match(key)

        if match is None:
            unpacked[key] = ranges

            continue

        prefix, name = match.groups()

        if name == "in_proj_qkvz":
            q, k, v, z = _per_group_rows(ranges, num_key_heads, [key_head_dim, key_head_dim, value_group_dim, value_group_dim])

            unpacked[prefix + "in_proj_qkv.weight"] = q + k + v
            unpacked[prefix + "in_proj_z.weight"] = z
        else:
            b, a = _per_group_rows(ranges, num_key_heads, [ratio, ratio])

            unpacked[prefix + "in_proj_b.weight"] = b
            unpacked[prefix + "in_proj_a.weight"] = a

    return unpacked


def _fuse_expert_rows(plan: RowPlan, config: Qwen35MoeConfig) -> RowPlan:
    """The rows of the fused expert tensors of
    :func:`qwen35_fs2.models.qwen35_moe.interop.convert_qwen35_moe_state_dict`:
    ``gate_up_proj`` :math:`(E, 2I, M)` viewed as :math:`(E·2I, M)` is, per
    expert, its gate then its up rows; ``down_proj`` its down rows."""
    fused: RowPlan = {}

    # layer prefix -> {(expert index, projection): rows}
    per_expert: dict[str, dict[tuple[int, str], list[RowRange]]] = {}

    for key, ranges in plan.items():
        match = _PER_EXPERT_KEY.match(key)

        if match is None:
            fused[key] = ranges

            continue

        layer_idx, expert_idx, projection = match.groups()

        prefix = f"model.layers.{layer_idx}.mlp.experts."

        per_expert.setdefault(prefix, {})[(int(expert_idx), projection)] = ranges

    for prefix, tensors in per_expert.items():
        experts = range(config.experts.num_experts)

        fused[prefix + "gate_up_proj"] = [
            r for e in experts for projection in ("gate_proj", "up_proj") for r in tensors[(e, projection)]
        ]

        fused[prefix + "down_proj"] = [r for e in experts for r in tensors[(e, "down_proj")]]

    return fused
