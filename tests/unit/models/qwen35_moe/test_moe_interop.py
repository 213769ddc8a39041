from __future__ import annotations

import re

import pytest
import torch
from torch import Tensor
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from fairseq2.error import StateDictError

from qwen35_fs2.models.qwen35_moe import (
    convert_qwen35_moe_state_dict,
    create_qwen35_moe_model,
)
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig, tiny_qwen35_moe_config
from qwen35_fs2.models.qwen3_next.interop import unpack_qwen3_next_projections

E, I, H = 8, 32, 64  # experts, expert inner dim, model dim of the tiny config


def _config() -> Qwen35MoeConfig:
    config = tiny_qwen35_moe_config()

    assert (config.experts.num_experts, config.experts.inner_dim, config.model_dim) == (E, I, H)

    return config


def _hf_state_dict(config: Qwen35MoeConfig, *, per_expert: bool, prefix: str = "model.") -> dict[str, object]:
    """Builds every tensor of a Hugging Face checkpoint of ``config`` from our
    model's state dict, by the documented correspondence."""
    model = create_qwen35_moe_model(config)

    renames = {
        "decoder_frontend.embed.": "embed_tokens.",
        "self_attn_layer_norm.": "input_layernorm.",
        "ffn_layer_norm.": "post_attention_layernorm.",
        "self_attn.output_proj.": "self_attn.o_proj.",
        "linear_attn.output_proj.": "linear_attn.out_proj.",
        "linear_attn.decay.": "linear_attn.",
        "ffn.router.": "mlp.gate.",
        "ffn.shared_expert.inner_proj.": "mlp.shared_expert.up_proj.",
        "ffn.shared_expert.output_proj.": "mlp.shared_expert.down_proj.",
        "ffn.shared_expert.gate_proj.": "mlp.shared_expert.gate_proj.",
        "ffn.shared_expert_gate.": "mlp.shared_expert_gate.",
        "ffn.experts.gate_inner_proj": "mlp.experts.gate_up_proj",
        "ffn.experts.output_proj": "mlp.experts.down_proj",
        "ffn.gate_proj.": "mlp.gate_proj.",
        "ffn.inner_proj.": "mlp.up_proj.",
        "ffn.output_proj.": "mlp.down_proj.",
        "decoder.layer_norm.": "norm.",
        "decoder.layers.": "layers.",
    }

    state_dict: dict[str, object] = {}

    for key, value in model.state_dict().items():
        if key == "final_proj.weight":
            state_dict["lm_head.weight"] = torch.randn_like(value)

            continue

        for old, new in renames.items():
            key = key.replace(old, new)

        state_dict[prefix + key] = torch.randn_like(value)

    if per_expert:
        for key in [k for k in state_dict if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
            value = state_dict.pop(key)

            assert isinstance(value, Tensor)

            if key.endswith("gate_up_proj"):
                base = key.removesuffix("gate_up_proj")

                for e in range(E):
                    state_dict[f"{base}{e}.gate_proj.weight"] = value[e, :I].clone()
                    state_dict[f"{base}{e}.up_proj.weight"] = value[e, I:].clone()
            else:
                base = key.removesuffix("down_proj")

                for e in range(E):
                    state_dict[f"{base}{e}.down_proj.weight"] = value[e].clone()

    return state_dict


class TestConvertQwen35MoeStateDict:
    @pytest.mark.parametrize("dense_layers", [[], [1]])
    @pytest.mark.parametrize("prefix", ["model.", "model.language_model."])
    @pytest.mark.parametrize("per_expert", [False, True])
    def test_converts_to_exactly_the_model_keys(self, per_expert: bool, prefix: str, dense_layers: list[int]) -> None:
        config = _config()

        config.experts.dense_layers = dense_layers

        state_dict = _hf_state_dict(config, per_expert=per_expert, prefix=prefix)

        converted = convert_qwen35_moe_state_dict(state_dict, config)

        expected_keys = set(create_qwen35_moe_model(config).state_dict())

        assert set(converted) == expected_keys, (
            f"Missing: {sorted(expected_keys - set(converted))} Extra: {sorted(set(converted) - expected_keys)}"
        )

    def test_fuses_per_expert_tensors_gate_rows_first(self) -> None:
        config = _config()

        state_dict = _hf_state_dict(config, per_expert=True)

        converted = convert_qwen35_moe_state_dict(dict(state_dict), config)

        gate_inner = converted["decoder.layers.2.ffn.experts.gate_inner_proj"]
        output = converted["decoder.layers.2.ffn.experts.output_proj"]

        assert isinstance(gate_inner, Tensor) and isinstance(output, Tensor)

        assert gate_inner.shape == (E, 2 * I, H) and output.shape == (E, H, I)

        for e in (0, 5):
            assert torch.equal(gate_inner[e, :I], state_dict[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"])  # type: ignore[arg-type]
            assert torch.equal(gate_inner[e, I:], state_dict[f"model.layers.2.mlp.experts.{e}.up_proj.weight"])  # type: ignore[arg-type]
            assert torch.equal(output[e], state_dict[f"model.layers.2.mlp.experts.{e}.down_proj.weight"])  # type: ignore[arg-type]

    def test_keeps_fused_tensors_and_never_touches_norms(self) -> None:
        config = _config()

        state_dict = _hf_state_dict(config, per_expert=False)

        converted = convert_qwen35_moe_state_dict(dict(state_dict), config)

        assert converted["decoder.layers.1.ffn.experts.gate_inner_proj"] is state_dict["model.layers.1.mlp.experts.gate_up_proj"]
        assert converted["decoder.layers.1.ffn.router.weight"] is state_dict["model.layers.1.mlp.gate.weight"]
        assert converted["decoder.layers.1.ffn_layer_norm.weight"] is state_dict["model.layers.1.post_attention_layernorm.weight"]

    def test_skips_vision_tower_and_mtp_head(self) -> None:
        config = _config()

        state_dict = _hf_state_dict(config, per_expert=False, prefix="model.language_model.")

        state_dict["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(2)
        state_dict["mtp.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(2)
        state_dict["mtp.layers.0.mlp.experts.3.up_proj.weight"] = torch.zeros(2)

        converted = convert_qwen35_moe_state_dict(state_dict, config)

        assert not any(k.startswith(("model.", "mtp.")) for k in converted)

    def test_raises_error_naming_a_missing_expert_tensor(self) -> None:
        config = _config()

        state_dict = _hf_state_dict(config, per_expert=True)

        del state_dict["model.layers.3.mlp.experts.6.up_proj.weight"]

        with pytest.raises(StateDictError, match=r"misses expert tensors of layer 3: model\.layers\.3\.mlp\.experts\.6\.up_proj\.weight$"):
            convert_qwen35_moe_state_dict(state_dict, config)

    def test_raises_error_naming_a_mis_shaped_per_expert_tensor(self) -> None:
        config = _config()

        state_dict = _hf_state_dict(config, per_expert=True)

        state_dict["model.layers.0.mlp.experts.2.down_proj.weight"] = torch.zeros(I, H)

        with pytest.raises(StateDictError, match=r"`model\.layers\.0\.mlp\.experts\.2\.down_proj\.weight` must have a shape of \(64, 32\) for the model's configuration, but has a shape of \(32, 64\) instead\."):
            convert_qwen35_moe_state_dict(state_dict, config)

    def test_raises_error_naming_a_mis_shaped_fused_tensor(self) -> None:
        config = _config()

        state_dict = _hf_state_dict(config, per_expert=False)

        # 7 experts instead of 8.
        state_dict["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(E - 1, 2 * I, H)

        with pytest.raises(StateDictError, match=r"`model\.layers\.1\.mlp\.experts\.gate_up_proj` must have a shape of \(8, 64, 64\) for the model's configuration, but has a shape of \(7, 64, 64\) instead\."):
            convert_qwen35_moe_state_dict(state_dict, config)

    def test_raises_error_naming_experts_beyond_the_config(self) -> None:
        config = _config()

        state_dict = _hf_state_dict(config, per_expert=True)

        state_dict["model.layers.0.mlp.experts.8.gate_proj.weight"] = torch.zeros(I, H)
        state_dict["model.layers.0.mlp.experts.gate_up_proj.weight"] = torch.zeros(2)

        with pytest.raises(StateDictError, match=r"not part of a Qwen3\.5-MoE model with 8 experts: model\.layers\.0\.mlp\.experts\.8\.gate_proj\.weight, model\.layers\.0\.mlp\.experts\.gate_up_proj\.weight$"):
            convert_qwen35_moe_state_dict(state_dict, config)

    def test_raises_error_when_a_layer_mixes_both_layouts(self) -> None:
        config = _config()

        state_dict = _hf_state_dict(config, per_expert=True)

        state_dict["model.layers.0.mlp.experts.down_proj"] = torch.zeros(E, H, I)

        with pytest.raises(StateDictError, match=r"Layer 0 of the Hugging Face checkpoint has both fused \(model\.layers\.0\.mlp\.experts\.down_proj\) and per-expert"):
            convert_qwen35_moe_state_dict(state_dict, config)

    def test_raises_error_naming_moe_keys_of_a_dense_layer(self) -> None:
        config = _config()

        config.experts.dense_layers = [0]

        state_dict = _hf_state_dict(config, per_expert=False)

        state_dict["model.layers.0.mlp.gate.weight"] = torch.zeros(E, H)

        with pytest.raises(StateDictError, match=r"not part of a Qwen3\.5 language model: model\.layers\.0\.mlp\.gate\.weight$"):
            convert_qwen35_moe_state_dict(state_dict, config)

    def test_passes_native_checkpoints_through(self) -> None:
        config = _config()

        state_dict = dict(create_qwen35_moe_model(config).state_dict())

        assert convert_qwen35_moe_state_dict(state_dict, config) is state_dict

    @pytest.mark.parametrize("prefix", ["model.", "model.language_model."])
    def test_raises_error_naming_both_keys_when_a_tied_config_meets_a_trained_head(self, prefix: str) -> None:
        config = _config()

        config.tied_embeddings = True

        state_dict = _hf_state_dict(config, per_expert=False, prefix=prefix)

        message = f"`lm_head.weight` must equal `{prefix}embed_tokens.weight` for a model with tied embeddings (`tied_embeddings: true`), but differs from it instead."

        with pytest.raises(StateDictError, match=re.escape(message) + ".*set `tied_embeddings: false`"):
            convert_qwen35_moe_state_dict(state_dict, config)

    def test_drops_an_lm_head_equal_to_the_embedding_of_tied_checkpoints(self) -> None:
        config = _config()

        config.tied_embeddings = True

        state_dict = _hf_state_dict(config, per_expert=False, prefix="model.language_model.")

        embed = state_dict["model.language_model.embed_tokens.weight"]

        assert isinstance(embed, Tensor)

        state_dict["lm_head.weight"] = embed.clone()

        converted = convert_qwen35_moe_state_dict(state_dict, config)

        assert converted["final_proj.weight"] is embed


class TestUnpackQwen3NextProjections:
    @pytest.mark.parametrize(("num_key_heads", "num_value_heads"), [(2, 2), (2, 4), (1, 3)])
    def test_matches_transformers_grouping(self, num_key_heads: int, num_value_heads: int) -> None:
        """transformers 4.57's `fix_query_key_value_ordering` is the reference."""
        hf_config = Qwen3NextConfig(  # type: ignore[no-untyped-call]
            hidden_size=H,
            linear_num_key_heads=num_key_heads,
            linear_num_value_heads=num_value_heads,
            linear_key_head_dim=8,
            linear_value_head_dim=4,
        )

        torch.manual_seed(0)

        gdn = Qwen3NextGatedDeltaNet(hf_config, layer_idx=0)

        config = _config()

        config.num_linear_key_heads = num_key_heads
        config.num_linear_value_heads = num_value_heads
        config.linear_key_head_dim = 8
        config.linear_value_head_dim = 4

        prefix = "model.layers.0.linear_attn."

        state_dict: dict[str, object] = {
            prefix + "in_proj_qkvz.weight": gdn.in_proj_qkvz.weight.detach(),
            prefix + "in_proj_ba.weight": gdn.in_proj_ba.weight.detach(),
            prefix + "conv1d.weight": gdn.conv1d.weight.detach(),
        }

        unpacked = unpack_qwen3_next_projections(state_dict, config)

        assert set(unpacked) == {prefix + name for name in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight")}

        x = torch.randn(2, 3, H)

        with torch.no_grad():
            q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))  # type: ignore[no-untyped-call]

        def project(name: str) -> Tensor:
            weight = unpacked[prefix + name + ".weight"]

            assert isinstance(weight, Tensor)

            return x @ weight.t()

        key_dim = num_key_heads * 8

        expected_qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)

        torch.testing.assert_close(project("in_proj_qkv"), expected_qkv)
        torch.testing.assert_close(project("in_proj_qkv")[..., :key_dim], q.flatten(2))
        torch.testing.assert_close(project("in_proj_z"), z.flatten(2))
        torch.testing.assert_close(project("in_proj_b"), b)
        torch.testing.assert_close(project("in_proj_a"), a)

    def test_raises_error_naming_a_mis_shaped_packed_projection(self) -> None:
        config = _config()

        state_dict: dict[str, object] = {"model.layers.0.linear_attn.in_proj_ba.weight": torch.zeros(5, H)}

        with pytest.raises(StateDictError, match=r"`model\.layers\.0\.linear_attn\.in_proj_ba\.weight` must have 8 rows \(2 key heads × 4\), but has a shape of \(5, 64\) instead\."):
            unpack_qwen3_next_projections(state_dict, config)
