from __future__ import annotations

import re

import pytest
import torch

from fairseq2.error import StateDictError

from qwen35_fs2.models.qwen35 import convert_qwen35_state_dict, create_qwen35_model
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config

_TEXT_KEYS = {
    "model.embed_tokens.weight": "decoder_frontend.embed.weight",
    "model.layers.0.input_layernorm.weight": "decoder.layers.0.self_attn_layer_norm.weight",
    "model.layers.0.linear_attn.A_log": "decoder.layers.0.linear_attn.decay.A_log",
    "model.layers.0.linear_attn.out_proj.weight": "decoder.layers.0.linear_attn.output_proj.weight",
    "model.layers.3.self_attn.o_proj.weight": "decoder.layers.3.self_attn.output_proj.weight",
    "model.layers.3.mlp.up_proj.weight": "decoder.layers.3.ffn.inner_proj.weight",
    "model.norm.weight": "decoder.layer_norm.weight",
}


def _tensors(keys: object) -> dict[str, object]:
    return {key: torch.full((2,), float(idx)) for idx, key in enumerate(keys)}  # type: ignore[arg-type]


class TestConvertQwen35StateDict:
    @pytest.mark.parametrize("prefix", ["model.", "model.language_model."])
    def test_maps_both_hf_layouts(self, prefix: str) -> None:
        state_dict = {prefix + k.removeprefix("model."): v for k, v in _tensors(_TEXT_KEYS).items()}

        converted = convert_qwen35_state_dict(state_dict, tiny_qwen35_config())

        assert set(converted) == set(_TEXT_KEYS.values()) | {"final_proj.weight"}

        for hg_key, fs2_key in _TEXT_KEYS.items():
            assert converted[fs2_key] is state_dict[prefix + hg_key.removeprefix("model.")]

    def test_never_changes_norm_weights(self) -> None:
        # Norms are stored zero-centred in both formats: no +1/-1 anywhere.
        state_dict = _tensors(_TEXT_KEYS)

        converted = convert_qwen35_state_dict(dict(state_dict), tiny_qwen35_config())

        assert torch.equal(
            converted["decoder.layer_norm.weight"], state_dict["model.norm.weight"]  # type: ignore[arg-type]
        )

    def test_skips_vision_tower_and_mtp_head(self) -> None:
        state_dict = _tensors(
            ["model.language_model.embed_tokens.weight", "model.visual.blocks.0.attn.qkv.weight", "mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight"]
        )

        converted = convert_qwen35_state_dict(state_dict, tiny_qwen35_config())

        assert set(converted) == {"decoder_frontend.embed.weight", "final_proj.weight"}

    def test_raises_error_naming_unknown_keys(self) -> None:
        state_dict = _tensors(["model.embed_tokens.weight", "model.layers.0.mlp.experts.0.up_proj.weight", "vision.x"])

        with pytest.raises(StateDictError, match=r"not part of a Qwen3\.5 language model: model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight, vision\.x"):
            convert_qwen35_state_dict(state_dict, tiny_qwen35_config())

    @pytest.mark.parametrize("prefix", ["model.", "model.language_model."])
    def test_raises_error_naming_both_keys_when_a_tied_config_meets_a_trained_head(self, prefix: str) -> None:
        embed_key = prefix + "embed_tokens.weight"

        state_dict = _tensors([embed_key, "lm_head.weight"])

        message = (
            f"`lm_head.weight` must equal `{embed_key}` for a model with tied embeddings (`tied_embeddings: true`), but differs from it instead. "
            "The checkpoint has a trained output projection of its own: to load it, set `tied_embeddings: false`"
        )

        with pytest.raises(StateDictError, match=re.escape(message)):
            convert_qwen35_state_dict(state_dict, tiny_qwen35_config())

    def test_drops_an_lm_head_equal_to_the_embedding_of_tied_checkpoints(self) -> None:
        embed = torch.randn(4, 2)

        state_dict: dict[str, object] = {"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone()}

        tied = convert_qwen35_state_dict(dict(state_dict), tiny_qwen35_config())

        assert tied.keys() == {"decoder_frontend.embed.weight", "final_proj.weight"}

        assert tied["final_proj.weight"] is embed

    def test_keeps_the_lm_head_of_untied_checkpoints(self) -> None:
        state_dict = _tensors(["model.embed_tokens.weight", "lm_head.weight"])

        config = tiny_qwen35_config()

        config.tied_embeddings = False

        untied = convert_qwen35_state_dict(dict(state_dict), config)

        assert untied["final_proj.weight"] is state_dict["lm_head.weight"]
        assert untied["decoder_frontend.embed.weight"] is state_dict["model.embed_tokens.weight"]

    def test_leaves_meta_tensors_to_the_caller(self) -> None:
        # They hold no values; the sharded loader compares the data itself.
        state_dict = {k: torch.empty(4, 2, device="meta") for k in ("model.embed_tokens.weight", "lm_head.weight")}

        converted = convert_qwen35_state_dict(dict(state_dict), tiny_qwen35_config())

        assert converted["final_proj.weight"] is state_dict["model.embed_tokens.weight"]

    def test_passes_native_checkpoints_through(self) -> None:
        config = tiny_qwen35_config()

        config.tied_embeddings = False

        model = create_qwen35_model(config)

        state_dict = dict(model.state_dict())

        assert convert_qwen35_state_dict(state_dict, config) is state_dict

    def test_drops_the_duplicate_output_weights_of_tied_native_checkpoints(self) -> None:
        model = create_qwen35_model(tiny_qwen35_config())

        state_dict = dict(model.state_dict())

        converted = convert_qwen35_state_dict(state_dict, tiny_qwen35_config())

        assert converted.keys() == state_dict.keys() - {"final_proj.weight"}

        assert all(converted[key] is state_dict[key] for key in converted)

    def test_raises_error_when_a_tied_config_meets_the_untied_head_of_a_native_checkpoint(self) -> None:
        config = tiny_qwen35_config()

        config.tied_embeddings = False

        state_dict = dict(create_qwen35_model(config).state_dict())

        with pytest.raises(StateDictError, match=re.escape("`final_proj.weight` must equal `decoder_frontend.embed.weight` for a model with tied embeddings")):
            convert_qwen35_state_dict(state_dict, tiny_qwen35_config())

    def test_raises_error_when_a_key_is_in_both_layouts(self) -> None:
        state_dict = _tensors(["model.embed_tokens.weight", "model.language_model.embed_tokens.weight"])

        with pytest.raises(StateDictError, match="in both the text-only and the vision-language layout"):
            convert_qwen35_state_dict(state_dict, tiny_qwen35_config())
