from __future__ import annotations

import copy

import pytest

from fairseq2.runtime.dependency import get_dependency_resolver
from fairseq2.utils.structured import ValueConverter
from fairseq2.utils.validation import ValidationError

from qwen35_fs2 import Qwen35Config, qwen35_config_from_hf
from qwen35_fs2.models.qwen35 import get_qwen35_model_hub
from qwen35_fs2.hf.config import adopt_hf_architecture
from qwen35_fs2.models.qwen35.config import check_config, tiny_qwen35_config

# A Qwen3.5-9B config in the released vision-language layout (values from
# docs/architecture.md), as transformers 5.x writes it.
_HG_9B_CONFIG: dict[str, object] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "image_token_id": 248056,
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "intermediate_size": 12288,
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
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "eos_token_id": 248044,
    },
    "vision_config": {"depth": 27, "hidden_size": 1152},
}


class TestQwen35Config:
    def test_round_trips_through_fairseq2_structuring(self) -> None:
        converter = get_dependency_resolver().resolve(ValueConverter)

        config = tiny_qwen35_config()

        config.layer_types = ["linear_attention", "full_attention"] * 2

        data = converter.unstructure(config)

        assert converter.structure(data, Qwen35Config) == config

    def test_derives_layer_types_from_the_interval(self) -> None:
        config = Qwen35Config(num_layers=8, full_attention_interval=4)

        assert config.get_layer_types() == (["linear_attention"] * 3 + ["full_attention"]) * 2

    def test_validate_names_every_inconsistent_field(self) -> None:
        config = Qwen35Config(
            num_attn_heads=6,
            num_key_value_heads=4,
            num_linear_key_heads=16,
            num_linear_value_heads=24,
            layer_types=["full_attention"],
        )

        with pytest.raises(ValidationError) as exc_info:
            check_config(config)

        message = str(exc_info.value)

        assert "`num_attn_heads` (6) must be a multiple of `num_key_value_heads` (4)" in message
        assert "`num_linear_value_heads` (24) must be a multiple of `num_linear_key_heads` (16)" in message
        assert "`layer_types` must have `num_layers` (24) entries, but has 1" in message

    def test_validate_rejects_an_out_of_vocabulary_pad_index(self) -> None:
        config = tiny_qwen35_config()

        config.pad_idx = config.vocab_size

        with pytest.raises(ValidationError, match="`pad_idx` must be in the range"):
            check_config(config)


class TestQwen35Archs:
    @pytest.mark.parametrize(
        "arch, model_dim, num_layers, num_attn_heads, num_kv_heads, num_v_heads, ffn_dim, tied",
        [
            # Values of the released config.json files (docs/architecture.md).
            ("qwen35_0.8b", 1024, 24, 8, 2, 16, 3584, True),
            ("qwen35_2b", 2048, 24, 8, 2, 16, 6144, True),
            ("qwen35_4b", 2560, 32, 16, 4, 32, 9216, True),
            ("qwen35_9b", 4096, 32, 16, 4, 32, 12288, False),
            ("qwen35_27b", 5120, 64, 24, 4, 48, 17408, False),
        ],
    )
    def test_arch_has_the_released_sizes(
        self,
        arch: str,
        model_dim: int,
        num_layers: int,
        num_attn_heads: int,
        num_kv_heads: int,
        num_v_heads: int,
        ffn_dim: int,
        tied: bool,
    ) -> None:
        config = get_qwen35_model_hub().get_arch_config(arch)

        check_config(config)

        assert (
            config.model_dim,
            config.num_layers,
            config.num_attn_heads,
            config.num_key_value_heads,
            config.num_linear_value_heads,
            config.ffn_inner_dim,
            config.tied_embeddings,
        ) == (model_dim, num_layers, num_attn_heads, num_kv_heads, num_v_heads, ffn_dim, tied)

        # Common to every released size.
        assert config.vocab_size == 248_320
        assert config.head_dim == 256
        assert config.rotary_dim == 64
        assert config.num_linear_key_heads == 16
        assert config.linear_key_head_dim == config.linear_value_head_dim == 128
        assert config.get_layer_types()[3] == "full_attention"
        assert config.get_layer_types().count("full_attention") == num_layers // 4

    def test_9b_arch_equals_the_config_built_from_its_hf_config(self) -> None:
        expected = get_qwen35_model_hub().get_arch_config("qwen35_9b")

        config = qwen35_config_from_hf(_HG_9B_CONFIG)

        assert config.get_layer_types() == expected.get_layer_types()

        config.layer_types = None

        assert config == expected


class TestQwen35ConfigFromHf:
    def test_reads_the_text_only_layout(self) -> None:
        text_config = dict(_HG_9B_CONFIG["text_config"])  # type: ignore[arg-type]

        text_config["tie_word_embeddings"] = True

        config = qwen35_config_from_hf(text_config)

        assert config.tied_embeddings
        assert config.model_dim == 4096

    def test_prefers_explicit_layer_types(self) -> None:
        hg_config = copy.deepcopy(_HG_9B_CONFIG)

        layer_types = ["full_attention", "linear_attention"] * 16

        hg_config["text_config"]["layer_types"] = layer_types  # type: ignore[index]

        assert qwen35_config_from_hf(hg_config).get_layer_types() == layer_types

    def test_reads_legacy_top_level_rope_keys(self) -> None:
        hg_config = copy.deepcopy(_HG_9B_CONFIG)

        text_config = hg_config["text_config"]

        del text_config["rope_parameters"]  # type: ignore[attr-defined]

        text_config.update(rope_theta=1_000_000, partial_rotary_factor=0.5)  # type: ignore[attr-defined]

        config = qwen35_config_from_hf(hg_config)

        assert (config.rope_theta, config.rotary_dim) == (1_000_000.0, 128)

    @pytest.mark.parametrize(
        "key, value, message",
        [
            ("attention_bias", True, "`attention_bias` must be False"),
            ("hidden_act", "gelu", "`hidden_act` must be 'silu'"),
            ("hidden_size", "4096", "`hidden_size` must be an integer"),
            ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}, "Only the 'default' RoPE type is supported, but `rope_parameters.rope_type` is 'yarn'."),
            # Beside `rope_parameters`, as Qwen's YaRN recipe adds it: transformers
            # then reads `rope_scaling` alone.
            ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}, "Only the 'default' RoPE type is supported, but `rope_scaling.rope_type` is 'yarn'."),
            ("linear_num_value_heads", 24, "`num_linear_value_heads` (24) must be a multiple"),
            # transformers' per-layer-type form, read as defaults before.
            ("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}, "`rope_parameters` must hold the RoPE parameters of the attention layers, but holds mappings under `full_attention` instead"),
        ],
    )
    def test_rejects_what_this_package_does_not_implement(
        self, key: str, value: object, message: str
    ) -> None:
        hg_config = copy.deepcopy(_HG_9B_CONFIG)

        hg_config["text_config"][key] = value  # type: ignore[index]

        with pytest.raises((ValueError, ValidationError), match=message.replace("(", r"\(").replace(")", r"\)")):
            qwen35_config_from_hf(hg_config)

    def test_names_a_missing_key(self) -> None:
        hg_config = copy.deepcopy(_HG_9B_CONFIG)

        del hg_config["text_config"]["num_hidden_layers"]  # type: ignore[attr-defined]

        with pytest.raises(ValueError, match="must have a `num_hidden_layers` entry"):
            qwen35_config_from_hf(hg_config)

    def test_rejects_another_model_type(self) -> None:
        with pytest.raises(ValueError, match="`model_type` 'qwen3_5' or 'qwen3_5_text', but has 'qwen3'"):
            qwen35_config_from_hf({"model_type": "qwen3"})


class TestAdoptHfArchitecture:
    def test_takes_every_field_of_the_hf_config_and_keeps_our_settings(self) -> None:
        hub = get_qwen35_model_hub()

        config = hub.get_arch_config("qwen35_0.8b")

        config.gdn_backend = "torch"

        original = copy.deepcopy(config)

        adopted, changes = adopt_hf_architecture(config, qwen35_config_from_hf(_HG_9B_CONFIG))

        expected = hub.get_arch_config("qwen35_9b")

        expected.gdn_backend = "torch"

        assert adopted == expected

        assert config == original

        # The 9B layers follow the preset's interval: no `layer_types` entry.
        assert changes == [
            "`model_dim` 1024 -> 4096",
            "`tied_embeddings` True -> False",
            "`num_layers` 24 -> 32",
            "`num_attn_heads` 8 -> 16",
            "`num_key_value_heads` 2 -> 4",
            "`num_linear_value_heads` 16 -> 32",
            "`ffn_inner_dim` 3584 -> 12288",
        ]

    def test_takes_and_reports_other_mixers(self) -> None:
        hg_config = copy.deepcopy(_HG_9B_CONFIG)

        layer_types = ["full_attention", "linear_attention"] * 16

        hg_config["text_config"]["layer_types"] = layer_types  # type: ignore[index]

        config = get_qwen35_model_hub().get_arch_config("qwen35_9b")

        adopted, changes = adopt_hf_architecture(config, qwen35_config_from_hf(hg_config))

        assert adopted.get_layer_types() == layer_types

        assert changes == [f"`layer_types` {config.get_layer_types()} -> {layer_types}"]

    def test_raises_error_for_a_config_of_the_other_family(self) -> None:
        from qwen35_fs2.models.qwen35_moe.config import tiny_qwen35_moe_config

        with pytest.raises(TypeError, match="`hf_config` must be of type `Qwen35Config`, but is of type `Qwen35MoeConfig` instead."):
            adopt_hf_architecture(tiny_qwen35_config(), tiny_qwen35_moe_config())
