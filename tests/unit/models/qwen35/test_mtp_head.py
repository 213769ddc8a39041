"""The MTP head as an optional part of the dense and MoE models: its
configuration, the keys it is built and imported with, and the strictness of
its import."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from fairseq2.error import StateDictError
from fairseq2.nn import BatchLayout
from fairseq2.utils.validation import ValidationError

from qwen35_fs2.hf.config import drop_absent_mtp_head, qwen35_config_from_hf
from qwen35_fs2.models.qwen35 import convert_qwen35_state_dict, create_qwen35_model
from qwen35_fs2.models.qwen35.config import check_config, tiny_qwen35_config
from qwen35_fs2.models.qwen35_moe.config import Qwen35ExpertsConfig, Qwen35MoeConfig
from qwen35_fs2.models.qwen35_moe.interop import convert_qwen35_moe_state_dict
from qwen35_fs2.nn.mtp import Qwen35MultiTokenPredictor

# The released checkpoints' names of the head of a dense model.
_DENSE_MTP_KEYS = {
    "mtp.fc.weight": "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding.weight": "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight": "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight": "mtp.layer_norm.weight",
    "mtp.layers.0.input_layernorm.weight": "mtp.layers.0.self_attn_layer_norm.weight",
    "mtp.layers.0.post_attention_layernorm.weight": "mtp.layers.0.ffn_layer_norm.weight",
    "mtp.layers.0.self_attn.q_proj.weight": "mtp.layers.0.self_attn.q_proj.weight",
    "mtp.layers.0.self_attn.k_proj.weight": "mtp.layers.0.self_attn.k_proj.weight",
    "mtp.layers.0.self_attn.v_proj.weight": "mtp.layers.0.self_attn.v_proj.weight",
    "mtp.layers.0.self_attn.o_proj.weight": "mtp.layers.0.self_attn.output_proj.weight",
    "mtp.layers.0.self_attn.q_norm.weight": "mtp.layers.0.self_attn.q_norm.weight",
    "mtp.layers.0.self_attn.k_norm.weight": "mtp.layers.0.self_attn.k_norm.weight",
    "mtp.layers.0.mlp.gate_proj.weight": "mtp.layers.0.ffn.gate_proj.weight",
    "mtp.layers.0.mlp.up_proj.weight": "mtp.layers.0.ffn.inner_proj.weight",
    "mtp.layers.0.mlp.down_proj.weight": "mtp.layers.0.ffn.output_proj.weight",
}


def _mtp_config() -> object:
    config = tiny_qwen35_config()

    config.mtp_num_layers = 1

    return config


def _tiny_moe_config(mtp_num_layers: int) -> Qwen35MoeConfig:
    tiny = tiny_qwen35_config()

    return Qwen35MoeConfig(
        **{f: getattr(tiny, f) for f in ("model_dim", "max_seq_len", "vocab_size", "pad_idx", "num_layers", "num_attn_heads", "num_key_value_heads", "head_dim", "num_linear_key_heads", "num_linear_value_heads", "linear_key_head_dim", "linear_value_head_dim")},
        tied_embeddings=False,
        experts=Qwen35ExpertsConfig(num_experts=4, top_k=2, inner_dim=16, shared_expert_inner_dim=24),
        mtp_num_layers=mtp_num_layers,
    )


def _trunk_keys() -> dict[str, object]:
    return {"model.embed_tokens.weight": torch.zeros(2)}


class TestMtpConfig:
    def test_reads_mtp_num_hidden_layers_from_the_hf_text_config(self) -> None:
        hg_config = {
            "model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "intermediate_size": 128, "vocab_size": 1024, "max_position_embeddings": 2048, "pad_token_id": 0,
        }

        assert qwen35_config_from_hf(hg_config).mtp_num_layers == 0

        assert qwen35_config_from_hf({**hg_config, "mtp_num_hidden_layers": 1}).mtp_num_layers == 1

    def test_rejects_more_than_one_layer(self) -> None:
        config = tiny_qwen35_config()

        config.mtp_num_layers = 2

        with pytest.raises(ValidationError, match=r"`mtp_num_layers` must be 0 or 1 .* but is 2 instead"):
            check_config(config)

    def test_drops_the_head_of_a_checkpoint_without_its_tensors_and_says_so(self, caplog: pytest.LogCaptureFixture) -> None:
        config = _mtp_config()

        with caplog.at_level(logging.INFO):
            dropped = drop_absent_mtp_head(config, ["model.embed_tokens.weight"], Path("/ckpt"))

        assert dropped.mtp_num_layers == 0 and config.mtp_num_layers == 1

        assert "/ckpt has no MTP head" in caplog.text

    @pytest.mark.parametrize("key", ["mtp.fc.weight", "model.language_model.mtp.fc.weight"])
    def test_keeps_the_head_of_a_checkpoint_with_its_tensors(self, key: str) -> None:
        assert drop_absent_mtp_head(_mtp_config(), ["model.embed_tokens.weight", key], Path("/ckpt")).mtp_num_layers == 1


class TestMtpModel:
    def test_has_no_head_without_mtp_layers(self) -> None:
        model = create_qwen35_model(tiny_qwen35_config())

        assert not hasattr(model, "mtp")

        assert not any(k.startswith("mtp.") for k in model.state_dict())

    def test_has_the_head_with_the_keys_of_the_released_checkpoints(self) -> None:
        model = create_qwen35_model(_mtp_config())

        assert isinstance(model.mtp, Qwen35MultiTokenPredictor)

        assert {k for k in model.state_dict() if k.startswith("mtp.")} == set(_DENSE_MTP_KEYS.values())

    def test_leaves_the_lm_forward_pass_unchanged(self) -> None:
        torch.manual_seed(0)

        model = create_qwen35_model(tiny_qwen35_config())

        mtp_model = create_qwen35_model(_mtp_config())

        # The trunk of the model with the head, the head left out.
        mtp_model.load_state_dict({**mtp_model.state_dict(), **model.state_dict()})

        seqs = torch.randint(1, 1024, (2, 7))

        layout = BatchLayout.of(seqs)

        torch.testing.assert_close(mtp_model(seqs, layout), model(seqs, layout), rtol=0, atol=0)

    def test_builds_the_moe_block_in_the_head_of_moe_models(self) -> None:
        from qwen35_fs2.models.qwen35_moe.factory import create_qwen35_moe_model
        from qwen35_fs2.nn.moe.block import Qwen35MoeBlock

        model = create_qwen35_moe_model(_tiny_moe_config(1))

        assert isinstance(model.mtp.layers[0].ffn, Qwen35MoeBlock)

        assert model.mtp.layers[0].self_attn is not None


class TestMtpImport:
    @pytest.mark.parametrize("prefix", ["", "model.language_model."])
    def test_maps_the_head_in_both_layouts(self, prefix: str) -> None:
        state_dict = _trunk_keys()

        for idx, key in enumerate(_DENSE_MTP_KEYS):
            state_dict[prefix + key] = torch.full((2,), float(idx))

        converted = convert_qwen35_state_dict(dict(state_dict), _mtp_config())

        for hg_key, fs2_key in _DENSE_MTP_KEYS.items():
            assert converted[fs2_key] is state_dict[prefix + hg_key]

    def test_skips_the_head_of_a_model_without_one(self) -> None:
        state_dict = {**_trunk_keys(), **{k: torch.zeros(2) for k in _DENSE_MTP_KEYS}}

        converted = convert_qwen35_state_dict(state_dict, tiny_qwen35_config())

        assert not any(k.startswith("mtp.") for k in converted)

    @pytest.mark.parametrize("key", ["mtp.layers.1.input_layernorm.weight", "mtp.head.weight", "mtp.layers.0.self_attn.qkv_proj.weight"])
    def test_raises_error_naming_unknown_head_keys(self, key: str) -> None:
        state_dict = {**_trunk_keys(), key: torch.zeros(2)}

        with pytest.raises(StateDictError, match=f"not part of a Qwen3.5 language model: {re.escape(key)}$"):
            convert_qwen35_state_dict(state_dict, _mtp_config())

    def test_raises_error_for_trunk_layers_beyond_the_model(self) -> None:
        # They would take the place of the head's layer.
        state_dict = {**_trunk_keys(), "model.layers.4.input_layernorm.weight": torch.zeros(2)}

        with pytest.raises(StateDictError, match=r"layers beyond the 4 of the model: model\.layers\.4\.input_layernorm\.weight"):
            convert_qwen35_state_dict(state_dict, _mtp_config())

    @pytest.mark.parametrize("layout", ["fused", "per_expert"])
    def test_fuses_the_experts_of_the_head_of_moe_models(self, layout: str) -> None:
        config = _tiny_moe_config(1)

        num_experts, inner_dim, model_dim = 4, 16, 64

        gate = torch.randn(num_experts, inner_dim, model_dim)
        up = torch.randn(num_experts, inner_dim, model_dim)
        down = torch.randn(num_experts, model_dim, inner_dim)

        prefix = "mtp.layers.0.mlp.experts."

        if layout == "fused":
            experts = {prefix + "gate_up_proj": torch.cat([gate, up], dim=1), prefix + "down_proj": down}
        else:
            experts = {}

            for e in range(num_experts):
                experts[f"{prefix}{e}.gate_proj.weight"] = gate[e]
                experts[f"{prefix}{e}.up_proj.weight"] = up[e]
                experts[f"{prefix}{e}.down_proj.weight"] = down[e]

        state_dict = {
            **_trunk_keys(),
            **experts,
            "mtp.layers.0.mlp.gate.weight": torch.zeros(num_experts, model_dim),
            "mtp.layers.0.mlp.shared_expert_gate.weight": torch.zeros(1, model_dim),
        }

        converted = convert_qwen35_moe_state_dict(state_dict, config)

        torch.testing.assert_close(converted["mtp.layers.0.ffn.experts.gate_inner_proj"], torch.cat([gate, up], dim=1), rtol=0, atol=0)
        torch.testing.assert_close(converted["mtp.layers.0.ffn.experts.output_proj"], down, rtol=0, atol=0)

        assert "mtp.layers.0.ffn.router.weight" in converted
        assert "mtp.layers.0.ffn.shared_expert_gate.weight" in converted

    def test_raises_error_naming_mis_shaped_experts_of_the_head(self) -> None:
        config = _tiny_moe_config(1)

        state_dict = {**_trunk_keys(), "mtp.layers.0.mlp.experts.down_proj": torch.zeros(3, 64, 16)}

        with pytest.raises(StateDictError, match=r"`mtp\.layers\.0\.mlp\.experts\.down_proj` must have a shape of \(4, 64, 16\)"):
            convert_qwen35_moe_state_dict(state_dict, config)
