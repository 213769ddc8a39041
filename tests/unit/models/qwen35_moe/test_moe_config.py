from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from fairseq2.assets import get_asset_store
from fairseq2.runtime.dependency import get_dependency_resolver
from fairseq2.utils.structured import ValueConverter
from fairseq2.utils.validation import ValidationError

from offline_hub import use_offline_hub_cache
from qwen35_fs2 import Qwen35MoeConfig, qwen35_config_from_hf
from qwen35_fs2.models.qwen35_moe import (
    create_qwen35_moe_model,
    get_qwen35_moe_model_hub,
)
from qwen35_fs2.hf.config import adopt_hf_architecture
from qwen35_fs2.models.qwen35.config import check_config
from qwen35_fs2.nn.moe.router import TopKRouter
from qwen35_fs2.hf.config import qwen35_moe_config_from_hf
from qwen35_fs2.models.qwen35_moe.config import tiny_qwen35_moe_config

# Qwen3.5-35B-A3B in the released vision-language layout (values from the
# architecture notes, §1b), as transformers 5.x writes it.
_HG_35B_A3B_CONFIG: dict[str, object] = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "hidden_act": "silu",
        "attention_bias": False,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "full_attention_interval": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    },
    "vision_config": {"depth": 27, "hidden_size": 1152},
}

# A tiny Qwen3-Next config as transformers 4.57 writes it (flat, top-level
# RoPE settings).
_HG_QWEN3_NEXT_CONFIG: dict[str, object] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 80,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "partial_rotary_factor": 0.25,
    "rope_scaling": None,
    "attention_bias": False,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "norm_topk_prob": False,
    "tie_word_embeddings": False,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] + ["linear_attention"] * 2,
}


class TestQwen35MoeConfig:
    def test_round_trips_through_fairseq2_structuring(self) -> None:
        converter = get_dependency_resolver().resolve(ValueConverter)  # type: ignore[type-abstract]

        config = tiny_qwen35_moe_config()

        config.experts.dense_layers = [1]

        data = converter.unstructure(config)

        assert isinstance(data, dict) and data["experts"]["dense_layers"] == [1]

        assert converter.structure(data, Qwen35MoeConfig) == config

    @pytest.mark.parametrize(
        ("arch", "total_b", "active_b"),
        [
            ("qwen35_moe_35b_a3b", 35, 3),
            ("qwen35_moe_122b_a10b", 122, 10),
            ("qwen35_moe_397b_a17b", 397, 17),
            ("qwen3_next_80b_a3b", 80, 3),
        ],
    )
    def test_arch_sizes_match_their_names(self, arch: str, total_b: float, active_b: float) -> None:
        config = get_qwen35_moe_model_hub().get_arch_config(arch)

        with torch.device("meta"):
            model = create_qwen35_moe_model(config)

        total = sum(p.numel() for p in model.parameters())

        routed = sum(p.numel() for name, p in model.named_parameters() if ".ffn.experts." in name)

        active = total - routed + routed * config.experts.top_k // config.experts.num_experts

        # The released totals also count the vision tower and the MTP head.
        assert abs(total / 1e9 - total_b) / total_b < 0.03

        # "A3B" etc. are rounded; embeddings and LM head count as active.
        assert abs(active / 1e9 - active_b) < 1.0

    def test_defaults_describe_35b_a3b(self) -> None:
        assert Qwen35MoeConfig() == get_qwen35_moe_model_hub().get_arch_config("qwen35_moe_35b_a3b")

    def test_validate_names_a_top_k_above_the_number_of_experts(self) -> None:
        config = tiny_qwen35_moe_config()

        config.experts.top_k = 9

        with pytest.raises(ValidationError, match=r"`experts\.top_k` must be between 1 and `experts\.num_experts` \(8\), but is 9 instead\."):
            check_config(config)

    def test_validate_names_bad_expert_settings(self) -> None:
        config = tiny_qwen35_moe_config()

        config.experts.num_experts = 0
        config.experts.dense_layers = [4]
        config.experts.dispatch = "dense"  # type: ignore[assignment]
        config.experts.router_precision = "bf16"  # type: ignore[assignment]

        with pytest.raises(ValidationError) as info:
            check_config(config)

        message = str(info.value)

        assert "`experts.num_experts` must be greater than or equal to 1, but is 0 instead." in message
        assert "`experts.dense_layers` must hold layer indices in [0, 4), but holds 4." in message
        assert "`experts.dispatch` must be 'auto', 'grouped_mm', 'batched', or 'loop', but is 'dense' instead." in message
        assert "`experts.router_precision` must be 'activation' or 'fp32', but is 'bf16' instead." in message

    @pytest.mark.parametrize("precision", ["activation", "fp32"])
    def test_every_router_computes_its_logits_at_the_configured_precision(self, precision: str) -> None:
        config = tiny_qwen35_moe_config()

        config.experts.router_precision = precision  # type: ignore[assignment]

        model = create_qwen35_moe_model(config)

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]

        assert len(routers) == config.num_layers

        assert all(router.precision == precision for router in routers)

    def test_routers_compute_their_logits_as_serving_does_by_default(self) -> None:
        assert Qwen35MoeConfig().experts.router_precision == "activation"

    def test_model_creation_rejects_an_invalid_config(self) -> None:
        config = tiny_qwen35_moe_config()

        config.experts.top_k = 0

        with pytest.raises(ValidationError, match="`experts.top_k`"):
            create_qwen35_moe_model(config)


class TestAdoptHfArchitecture:
    def test_takes_the_expert_fields_and_keeps_dispatch_and_router_precision(self) -> None:
        config = get_qwen35_moe_model_hub().get_arch_config("qwen35_moe_397b_a17b")

        config.experts.dispatch = "loop"
        config.experts.router_precision = "fp32"

        adopted, changes = adopt_hf_architecture(config, qwen35_config_from_hf(_HG_35B_A3B_CONFIG))

        expected = Qwen35MoeConfig()

        expected.experts.dispatch = "loop"
        expected.experts.router_precision = "fp32"

        assert adopted == expected

        assert "`experts.num_experts` 512 -> 256" in changes and "`experts.top_k` 10 -> 8" in changes

        assert not any("dispatch" in change or "router_precision" in change for change in changes)


class TestQwen35MoeConfigFromHf:
    def test_reads_the_released_vlm_layout(self) -> None:
        config = qwen35_config_from_hf(_HG_35B_A3B_CONFIG)

        assert isinstance(config, Qwen35MoeConfig)

        # Released 35B-A3B is the arch preset, but for the explicit layer types.
        expected = Qwen35MoeConfig(layer_types=config.layer_types)

        assert config == expected

        assert config.get_layer_types() == Qwen35MoeConfig().get_layer_types()

    def test_reads_the_text_only_layout(self) -> None:
        text = dict(_HG_35B_A3B_CONFIG["text_config"])  # type: ignore[call-overload]

        config = qwen35_config_from_hf(text)

        assert config == qwen35_config_from_hf(_HG_35B_A3B_CONFIG)

    def test_reads_qwen3_next_dense_layers_and_unnormalized_routing(self) -> None:
        config = qwen35_moe_config_from_hf(_HG_QWEN3_NEXT_CONFIG)

        # Layers 0, 2, 4 fail the sparse step; layer 3 is listed.
        assert config.experts.dense_layers == [0, 2, 3, 4]

        assert config.experts.normalize_top_k is False

        assert config.ffn_inner_dim == 80

        assert config.rope_theta == 1_000_000.0

        assert config.pad_idx == 151_643

    def test_raises_error_when_top_k_exceeds_num_experts(self) -> None:
        hg_config = copy.deepcopy(_HG_35B_A3B_CONFIG)

        hg_config["text_config"]["num_experts_per_tok"] = 300  # type: ignore[index]

        with pytest.raises(ValidationError, match=r"`experts\.top_k` must be between 1 and `experts\.num_experts` \(256\), but is 300 instead\."):
            qwen35_config_from_hf(hg_config)

    def test_raises_error_naming_a_missing_moe_key(self) -> None:
        hg_config = copy.deepcopy(_HG_35B_A3B_CONFIG)

        del hg_config["text_config"]["moe_intermediate_size"]  # type: ignore[attr-defined]

        with pytest.raises(ValueError, match="must have a `moe_intermediate_size` entry"):
            qwen35_config_from_hf(hg_config)

    def test_raises_error_on_a_dense_text_config_inside_an_moe_one(self) -> None:
        hg_config = copy.deepcopy(_HG_35B_A3B_CONFIG)

        hg_config["text_config"]["model_type"] = "qwen3_5_text"  # type: ignore[index]

        with pytest.raises(ValueError, match="`text_config.model_type` must be 'qwen3_5_moe_text', but is 'qwen3_5_text' instead."):
            qwen35_config_from_hf(hg_config)


class TestAssetCards:
    @pytest.mark.parametrize(
        ("name", "arch", "repo"),
        [
            ("qwen35_moe_35b_a3b", "qwen35_moe_35b_a3b", "Qwen3.5-35B-A3B"),
            ("qwen35_moe_35b_a3b_base", "qwen35_moe_35b_a3b", "Qwen3.5-35B-A3B-Base"),
            ("qwen35_moe_122b_a10b", "qwen35_moe_122b_a10b", "Qwen3.5-122B-A10B"),
            ("qwen35_moe_397b_a17b", "qwen35_moe_397b_a17b", "Qwen3.5-397B-A17B"),
            ("qwen3_next_80b_a3b_instruct", "qwen3_next_80b_a3b", "Qwen3-Next-80B-A3B-Instruct"),
            ("qwen3_next_80b_a3b_thinking", "qwen3_next_80b_a3b", "Qwen3-Next-80B-A3B-Thinking"),
        ],
    )
    def test_released_models_have_cards_of_the_moe_family_and_their_arch(
        self, name: str, arch: str, repo: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        # Without a config.json of the checkpoint, the card's config is its
        # arch's.
        use_offline_hub_cache(monkeypatch, tmp_path)

        hub = get_qwen35_moe_model_hub()

        card = get_asset_store().retrieve_card(name)

        assert card.field("model_family").as_(str) == "qwen35_moe"

        assert card.field("checkpoint").as_(str) == f"hg://Qwen/{repo}"

        # Qwen3-Next has the Qwen3 vocabulary.
        tokenizer_family = "qwen" if repo.startswith("Qwen3-Next") else "qwen35"

        assert card.field("tokenizer_family").as_(str) == tokenizer_family

        assert hub.get_model_config(card) == hub.get_arch_config(arch)
