"""The adapter counts of docs/lora.md: ``apply_lora`` on the released
architectures, built on the meta device, against the closed form of the
docs, computed here from the configs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qwen35_fs2.lora import LoraConfig, apply_lora, lora_parameters
from qwen35_fs2.models.qwen35 import Qwen35Config, create_qwen35_model, get_qwen35_model_hub
from qwen35_fs2.models.qwen35_moe import Qwen35MoeConfig, create_qwen35_moe_model, get_qwen35_moe_model_hub


def _closed_form(config: Qwen35Config, r: int) -> int:
    """``r * (input_dim + output_dim)`` of every projection of the trunk:
    Gated DeltaNet, gated attention and MLP (the shared expert of MoE
    layers); none in the MTP head."""
    d = config.model_dim

    key_dim = config.num_linear_key_heads * config.linear_key_head_dim
    value_dim = config.num_linear_value_heads * config.linear_value_head_dim

    gdn = (d + 2 * key_dim + value_dim) + (d + value_dim) + 2 * (d + config.num_linear_value_heads) + (value_dim + d)

    attn_dim = config.num_attn_heads * config.head_dim

    # `q_proj` computes the queries and their output gates.
    attn = (d + 2 * attn_dim) + 2 * (d + config.num_key_value_heads * config.head_dim) + (attn_dim + d)

    if isinstance(config, Qwen35MoeConfig):
        mlp = 3 * (d + config.experts.shared_expert_inner_dim)
    else:
        mlp = 3 * (d + config.ffn_inner_dim)

    num_attn = config.num_layers // config.full_attention_interval

    return r * ((config.num_layers - num_attn) * gdn + num_attn * attn + config.num_layers * mlp)


@pytest.mark.parametrize(
    ("arch", "documented"),
    [("qwen35_9b", 43_278_336), ("qwen35_27b", 116_727_808), ("qwen35_moe_35b_a3b", 21_166_080)],
)
def test_adapter_parameters_are_those_of_the_docs(arch: str, documented: int) -> None:
    if "moe" in arch:
        config: Qwen35Config = get_qwen35_moe_model_hub().get_arch_config(arch)
    else:
        config = get_qwen35_model_hub().get_arch_config(arch)

    # With the MTP head of the released checkpoints, which gets no adapters.
    config = dataclasses.replace(config, mtp_num_layers=1)

    with torch.device("meta"):
        model = create_qwen35_moe_model(config) if isinstance(config, Qwen35MoeConfig) else create_qwen35_model(config)

    apply_lora(model, LoraConfig(r=16), config)

    count = sum(p.numel() for p in lora_parameters(model))

    assert count == _closed_form(config, r=16) == documented
