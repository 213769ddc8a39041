"""How each Qwen3.5 block splits under tensor parallelism, checked on the
meta device for one rank; the numerics are checked against the unsharded
model in ``tests/integration/sharding/test_tensor_parallel.py``."""

from __future__ import annotations

import re

import pytest
import torch
from tp_testing import create_on_meta, fake_tp_gangs

from fairseq2.error import StateDictError
from fairseq2.models.transformer import CausalAttentionBias, create_default_sdpa
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import get_shard_dims

from qwen35_fs2.nn.attention import Qwen35Attention
from qwen35_fs2.models.qwen35.config import Qwen35Config, tiny_qwen35_config
from qwen35_fs2.nn.decoder_layer import Qwen35DecoderLayer
from qwen35_fs2.nn.gated_deltanet import GatedDeltaNet
from qwen35_fs2.models.qwen35.interop import group_qkv_rows, ungroup_qkv_rows
from qwen35_fs2.nn.moe.block import Qwen35MoeBlock
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig, tiny_qwen35_moe_config
from qwen35_fs2.models.qwen35_moe.sharder import get_qwen35_moe_shard_specs
from qwen35_fs2.nn.normalization import ZeroCenteredRMSNorm
from qwen35_fs2.nn.rotary import PartialRotaryEncoder
from qwen35_fs2.models.qwen35.sharder import get_qwen35_shard_specs
from qwen35_fs2.nn.tp import TiedVocabShardedProjection


def _attention(num_heads: int, num_key_value_heads: int, tp_size: int, tp_rank: int) -> Qwen35Attention:
    head_dim = 8

    return Qwen35Attention(
        64,
        num_heads,
        num_key_value_heads,
        head_dim,
        create_default_sdpa(CausalAttentionBias()),
        PartialRotaryEncoder(head_dim, 4, theta=10_000.0),
        ZeroCenteredRMSNorm(head_dim),
        ZeroCenteredRMSNorm(head_dim),
        gangs=fake_tp_gangs(tp_size, tp_rank),
        device=torch.device("meta"),
    )


def _gated_delta_net(num_key_heads: int, num_value_heads: int, tp_size: int, tp_rank: int = 0) -> GatedDeltaNet:
    return GatedDeltaNet(
        64, num_key_heads, num_value_heads, 16, 8, 4, gangs=fake_tp_gangs(tp_size, tp_rank), device=torch.device("meta")
    )


class TestQwen35AttentionUnderTensorParallelism:
    def test_shards_query_and_key_value_heads_when_both_divide(self) -> None:
        attn = _attention(num_heads=8, num_key_value_heads=4, tp_size=2, tp_rank=1)

        assert attn.shard_key_value_heads

        # 4 heads of 2 x 8 rows (query and gate), 2 key/value heads of 8 rows.
        assert attn.q_proj.weight.shape == (64, 64)
        assert attn.k_proj.weight.shape == (16, 64)
        assert attn.output_proj.weight.shape == (64, 32)

    @pytest.mark.parametrize(
        ("num_heads", "num_key_value_heads", "tp_rank", "first_head", "indices"),
        [
            # 27B: 24 query heads, 4 key/value heads, 8 ranks of 3 query heads.
            (24, 4, 0, 0, [0, 0, 0]),
            (24, 4, 1, 0, [0, 0, 0]),
            (24, 4, 2, 1, [0, 0, 0]),
            (24, 4, 7, 3, [0, 0, 0]),
            # Groups of 4 query heads straddle the ranks' 3.
            (24, 6, 1, 0, [0, 1, 1]),
            (24, 6, 6, 4, [0, 0, 1]),
        ],
    )
    def test_replicates_key_value_heads_that_do_not_divide(
        self, num_heads: int, num_key_value_heads: int, tp_rank: int, first_head: int, indices: list[int]
    ) -> None:
        attn = _attention(num_heads, num_key_value_heads, tp_size=8, tp_rank=tp_rank)

        assert not attn.shard_key_value_heads

        # Stored sharded by rows, gathered to compute.
        assert attn.k_proj.weight.shape == (num_key_value_heads, 64)

        assert attn.first_key_value_head == first_head

        assert attn.key_value_head_indices == indices

    def test_raises_error_naming_query_heads_that_do_not_divide(self) -> None:
        with pytest.raises(ValueError, match=re.escape("`num_heads` must be a multiple of the tensor parallel size (3), but is 8 instead.")):
            _attention(num_heads=8, num_key_value_heads=2, tp_size=3, tp_rank=0)


class TestGatedDeltaNetUnderTensorParallelism:
    def test_holds_the_parameters_of_its_key_head_groups(self) -> None:
        gdn = _gated_delta_net(num_key_heads=4, num_value_heads=8, tp_size=2, tp_rank=1)

        # 2 groups of [q (16) | k (16) | 2 value heads (2 x 8)].
        assert gdn.in_proj_qkv.weight.shape == (96, 64)
        assert gdn.conv1d.weight.shape == (96, 1, 4)
        assert gdn.in_proj_z.weight.shape == (32, 64)
        assert gdn.in_proj_b.weight.shape == (4, 64)
        assert gdn.in_proj_a.weight.shape == (4, 64)
        assert gdn.decay.A_log.shape == (4,)
        assert gdn.decay.dt_bias.shape == (4,)
        assert gdn.output_proj.weight.shape == (64, 32)

        # Shared by all heads.
        assert gdn.norm.weight.shape == (8,)

    def test_raises_error_naming_key_heads_that_do_not_divide(self) -> None:
        with pytest.raises(ValueError, match=re.escape("`num_key_heads` must be a multiple of the tensor parallel size (4), but is 2 instead.")):
            _gated_delta_net(num_key_heads=2, num_value_heads=4, tp_size=4)


class TestQwen35ModelUnderTensorParallelism:
    def test_ties_a_vocabulary_sharded_embedding_to_the_output_projection(self) -> None:
        model = create_on_meta(tiny_qwen35_config(), fake_tp_gangs(2, 1))

        assert isinstance(model, TransformerLM)

        final_proj = model.final_proj

        assert isinstance(final_proj, TiedVocabShardedProjection)

        assert final_proj.weight is model.decoder_frontend.embed.weight  # type: ignore[union-attr]

        assert final_proj.weight.shape == (512, 64)
        assert final_proj.output_dim == 1024

    def test_shards_experts_along_the_expert_dimension(self) -> None:
        model = create_on_meta(tiny_qwen35_moe_config(), fake_tp_gangs(2, 1))

        assert isinstance(model, TransformerLM)

        layer = model.decoder.layers[0]

        assert isinstance(layer, Qwen35DecoderLayer) and isinstance(layer.ffn, Qwen35MoeBlock)

        experts = layer.ffn.experts

        assert experts.gate_inner_proj.shape == (4, 64, 64)
        assert experts.output_proj.shape == (4, 64, 32)

    def test_raises_error_naming_experts_that_do_not_divide(self) -> None:
        config = tiny_qwen35_moe_config()

        config.experts.num_experts = 6

        with pytest.raises(ValueError, match=re.escape("`num_experts` must be a multiple of the tensor parallel size (4), but is 6 instead.")):
            create_on_meta(_four_key_heads(config), fake_tp_gangs(4))


def _four_key_heads(config: Qwen35Config) -> Qwen35Config:
    """Makes every head count of ``config`` divisible by 4 ranks, except the
    key/value heads of the full-attention layers."""
    config.num_attn_heads = 4
    config.num_key_value_heads = 2
    config.num_linear_key_heads = 4
    config.num_linear_value_heads = 8

    return config


def _with_mtp(config: Qwen35Config) -> Qwen35Config:
    """``config`` with an MTP head, whose decoder layer shards as the
    trunk's."""
    config.mtp_num_layers = 1

    return config


class TestGetQwen35ShardSpecs:
    @pytest.mark.parametrize(
        ("config", "tp_size"),
        [
            (tiny_qwen35_config(), 2),
            # Key/value heads replicated.
            (_four_key_heads(tiny_qwen35_config()), 4),
            (tiny_qwen35_moe_config(), 2),
            (_with_mtp(tiny_qwen35_config()), 2),
            (_with_mtp(tiny_qwen35_moe_config()), 2),
        ],
        ids=["dense", "replicated-key-values", "moe", "dense-mtp", "moe-mtp"],
    )
    def test_matches_the_shard_dims_of_the_modules(self, config: Qwen35Config, tp_size: int) -> None:
        model = create_on_meta(config, fake_tp_gangs(tp_size))

        shard_dims = get_shard_dims(model)

        if isinstance(config, Qwen35MoeConfig):
            config_specs = get_qwen35_moe_shard_specs(config)
        else:
            config_specs = get_qwen35_shard_specs(config)

        specs = {re.compile(pattern): spec for pattern, spec in config_specs.items()}

        from_specs = {}

        # A tied output projection shares the embedding's weight, which both
        # `named_parameters` and `get_shard_dims` name once.
        for param_name, _ in model.named_parameters():
            module_name = param_name.rpartition(".")[0]

            matches = [spec for pattern, spec in specs.items() if pattern.match(module_name)]

            assert len(matches) <= 1, module_name

            if matches:
                from_specs[param_name] = matches[0].dim

        assert from_specs == shard_dims


class TestQkvRowGrouping:
    def test_groups_rows_by_key_head_and_back_bit_for_bit(self) -> None:
        # 2 key heads of 16 rows, 4 value heads of 16 rows: [q | k | v] has
        # 32 + 32 + 64 rows.
        config = tiny_qwen35_config()

        weight = torch.arange(128.0).unsqueeze(1).expand(128, 3).contiguous()

        grouped = group_qkv_rows("w", weight, config)

        expected_rows = [*range(0, 16), *range(32, 48), *range(64, 96), *range(16, 32), *range(48, 64), *range(96, 128)]

        assert grouped[:, 0].tolist() == expected_rows

        assert torch.equal(ungroup_qkv_rows("w", grouped, config), weight)

    def test_raises_error_naming_a_tensor_with_other_rows(self) -> None:
        with pytest.raises(StateDictError, match=re.escape("`w` must have 128 rows (2 × key dim + value dim), but has a shape of (127, 3) instead.")):
            group_qkv_rows("w", torch.zeros(127, 3), tiny_qwen35_config())
