"""Imports Qwen3-Next checkpoints, whose Gated DeltaNet packs its input
projections, into the Qwen3.5 layout.

Qwen3-Next (transformers' ``Qwen3NextForCausalLM``) is the Qwen3.5-MoE
architecture with two checkpoint differences: its Gated DeltaNet stores
``in_proj_qkvz`` and ``in_proj_ba``, grouped per key head, where Qwen3.5 has
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``; and its
experts are saved one module per expert. Its plain RoPE equals Qwen3.5's
mRoPE on text, so nothing else differs.
"""

from __future__ import annotations

import re
from typing import Final

import torch
from torch import Tensor

from fairseq2.error import StateDictError

from qwen35_fs2.models.qwen35.config import Qwen35Config

_PACKED_KEY: Final = re.compile(
    r"^(model\.layers\.[0-9]+\.linear_attn\.)(in_proj_qkvz|in_proj_ba)\.weight$"
)


def is_qwen3_next_state_dict(state_dict: dict[str, object]) -> bool:
    """Returns ``True`` if ``state_dict`` holds packed Qwen3-Next Gated
    DeltaNet projections."""
    return any(_PACKED_KEY.match(key) for key in state_dict)


def unpack_qwen3_next_projections(
    state_dict: dict[str, object], config: Qwen35Config
) -> dict[str, object]:
    """Returns ``state_dict`` with every ``in_proj_qkvz`` and ``in_proj_ba``
    split into the Qwen3.5 projections.

    Per key head ``g`` (with ``r = num_linear_value_heads /
    num_linear_key_heads``), the rows of ``in_proj_qkvz`` are
    ``[q_g (dk) | k_g (dk) | v_g (r·dv) | z_g (r·dv)]`` and those of
    ``in_proj_ba`` are ``[b_g (r) | a_g (r)]``; Qwen3.5 concatenates all
    heads of each part instead.
    """
    num_key_heads = config.num_linear_key_heads
    num_value_heads = config.num_linear_value_heads

    key_head_dim = config.linear_key_head_dim
    value_head_dim = config.linear_value_head_dim

    ratio = num_value_heads // num_key_heads

    qkvz_split = [key_head_dim, key_head_dim, ratio * value_head_dim, ratio * value_head_dim]

    unpacked: dict[str, object] = {}

    for key, value in state_dict.items():
        match = _PACKED_KEY.match(key)

        if match is None:
            unpacked[key] = value

            continue

        prefix, name = match.groups()

        if name == "in_proj_qkvz":
            q, k, v, z = _split_per_key_head(key, value, num_key_heads, qkvz_split)

            unpacked[prefix + "in_proj_qkv.weight"] = torch.cat([q, k, v])
            unpacked[prefix + "in_proj_z.weight"] = z
        else:
            b, a = _split_per_key_head(key, value, num_key_heads, [ratio, ratio])

            unpacked[prefix + "in_proj_b.weight"] = b
            unpacked[prefix + "in_proj_a.weight"] = a

    return unpacked


def _split_per_key_head(
    key: str, weight: object, num_key_heads: int, sizes: list[int]
) -> list[Tensor]:
    """Splits the rows of each key head's group of ``weight`` into ``sizes``
    and concatenates each part over the groups."""
    if not isinstance(weight, Tensor):
        raise StateDictError(f"`{key}` must be a tensor, but is of type `{type(weight).__name__}` instead.")

    num_rows = num_key_heads * sum(sizes)

    if weight.ndim != 2 or weight.size(0) != num_rows:
        raise StateDictError(
            f"`{key}` must have {num_rows} rows ({num_key_heads} key heads × {sum(sizes)}), but has a shape of {tuple(weight.shape)} instead."
        )

    # (G x P, M) -> (G, P, M)
    groups = weight.view(num_key_heads, sum(sizes), -1)

    # (G, P_i, M) -> (G x P_i, M)
    return [part.reshape(-1, weight.size(1)) for part in groups.split_with_sizes(sizes, dim=1)]
