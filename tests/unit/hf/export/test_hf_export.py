"""Unit tests of the Hugging Face exporter on tiny fairseq2 models (no
transformers); the integration tests compare exports with transformers."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from fairseq2.error import StateDictError
from fairseq2.models.hg import get_hugging_face_converter

from hf_reference import hf_reference_available, hf_reference_dir, read_safetensors_dir
from qwen35_fs2.models.qwen35_moe import (
    convert_qwen35_moe_state_dict,
    create_qwen35_moe_model,
)
from qwen35_fs2.models.qwen35 import convert_qwen35_state_dict, create_qwen35_model
from qwen35_fs2.hf import qwen35_config_from_hf
from qwen35_fs2.models.qwen35.config import Qwen35Config, tiny_qwen35_config
from qwen35_fs2.hf.export import (
    HfExportError,
    HfRepository,
    build_hf_config,
    lay_out_experts,
    plan_hf_export,
    save_hf_model,
    to_hg_state_dict,
    write_hf_export,
)
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig, tiny_qwen35_moe_config
from qwen35_fs2.lora import LoraConfig, apply_lora


def _state_dict(config: Qwen35Config) -> dict[str, Tensor]:
    torch.manual_seed(0)

    if isinstance(config, Qwen35MoeConfig):
        model = create_qwen35_moe_model(config)
    else:
        model = create_qwen35_model(config)

    return dict(model.state_dict())


def _tensor(value: object) -> Tensor:
    assert isinstance(value, Tensor)

    return value


def _make_vlm_base(
    path: Path, config: Qwen35Config, *, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """Writes a base repository in the released layout, with a vision tower
    and an MTP head; returns its tensors."""
    hg = to_hg_state_dict(_state_dict(config), config)

    hg = lay_out_experts(hg, "fused")

    tensors = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): _tensor(v).to(dtype)
        for k, v in hg.items()
    }

    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 4, 4, dtype=dtype)
    tensors["mtp.fc.weight"] = torch.randn(config.model_dim, 2 * config.model_dim, dtype=dtype)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.randn(config.model_dim, dtype=dtype)

    path.mkdir(parents=True)

    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})

    text = build_hf_config(config, base=None, text_only=True, dtype=dtype, num_mtp_layers=1)

    del text["architectures"]

    doc = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if isinstance(config, Qwen35MoeConfig) else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if isinstance(config, Qwen35MoeConfig) else "qwen3_5",
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 8, "model_type": "qwen3_5_vision"},
        "image_token_id": 248056,
        "tie_word_embeddings": config.tied_embeddings,
        "torch_dtype": "float32",
    }

    (path / "config.json").write_text(json.dumps(doc))
    (path / "generation_config.json").write_text('{"eos_token_id": [1, 2]}')
    (path / "tokenizer.json").write_text("{}")
    (path / "chat_template.jinja").write_text("{{ messages }}")
    (path / "preprocessor_config.json").write_text("{}")
    (path / "README.md").write_text("The base model.")

    return tensors


def _untied_tiny_config() -> Qwen35Config:
    config = tiny_qwen35_config()

    config.tied_embeddings = False

    return config


class TestToHgStateDict:
    @pytest.mark.parametrize("config", [tiny_qwen35_config(), _untied_tiny_config(), tiny_qwen35_moe_config()], ids=["dense-tied", "dense", "moe"])
    def test_is_inverted_by_import_key_for_key_without_changing_a_tensor(self, config: Qwen35Config) -> None:
        state_dict = _state_dict(config)

        hg_state_dict = to_hg_state_dict(state_dict, config)

        if isinstance(config, Qwen35MoeConfig):
            back = convert_qwen35_moe_state_dict(dict(hg_state_dict), config)
        else:
            back = convert_qwen35_state_dict(dict(hg_state_dict), config)

        assert back.keys() == state_dict.keys(), f"Missing in round trip: {state_dict.keys() - back.keys()}. Extra in round trip: {back.keys() - state_dict.keys()}."

        # Pure renames: the very same tensors, so no norm weight got a +-1;
        # the Gated DeltaNet rows grouped by key head are permuted there and
        # back, bit for bit.
        for key in state_dict:
            if key == "final_proj.weight" and config.tied_embeddings:
                continue

            if key.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):
                assert torch.equal(back[key], state_dict[key]), key
            else:
                assert back[key] is state_dict[key], key

    def test_writes_released_key_names(self) -> None:
        config = tiny_qwen35_config()

        hg_state_dict = to_hg_state_dict(_state_dict(config), config)

        assert {
            "model.embed_tokens.weight",
            "model.norm.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.linear_attn.A_log",
            "model.layers.0.linear_attn.out_proj.weight",
            "model.layers.3.self_attn.o_proj.weight",
            "model.layers.3.mlp.up_proj.weight",
        } <= hg_state_dict.keys()

        assert "lm_head.weight" not in hg_state_dict

    def test_writes_released_moe_key_names(self) -> None:
        config = tiny_qwen35_moe_config()

        hg_state_dict = to_hg_state_dict(_state_dict(config), config)

        assert {
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj",
            "model.layers.0.mlp.shared_expert.up_proj.weight",
            "model.layers.0.mlp.shared_expert_gate.weight",
            "lm_head.weight",
        } <= hg_state_dict.keys()

    def test_raises_error_naming_unknown_keys(self) -> None:
        config = tiny_qwen35_config()

        state_dict = _state_dict(config)

        state_dict["decoder.layers.0.adapter.weight"] = torch.zeros(1)

        with pytest.raises(StateDictError, match=r"no Hugging Face Qwen3\.5 counterpart: decoder\.layers\.0\.adapter\.weight"):
            to_hg_state_dict(state_dict, config)


class TestLayOutExperts:
    def test_splits_fused_experts_gate_first_and_fuses_them_back(self) -> None:
        gate_up = torch.randn(3, 8, 5)
        down = torch.randn(3, 5, 4)

        fused = {"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down, "x": torch.ones(1)}

        per_expert = lay_out_experts(fused, "per_expert")

        assert torch.equal(_tensor(per_expert["model.layers.0.mlp.experts.2.gate_proj.weight"]), gate_up[2, :4])
        assert torch.equal(_tensor(per_expert["model.layers.0.mlp.experts.2.up_proj.weight"]), gate_up[2, 4:])
        assert torch.equal(_tensor(per_expert["model.layers.0.mlp.experts.1.down_proj.weight"]), down[1])
        assert len(per_expert) == 3 * 3 + 1

        back = lay_out_experts(per_expert, "fused")

        assert back.keys() == fused.keys()

        for key, value in fused.items():
            assert torch.equal(_tensor(back[key]), value)

    def test_raises_error_when_a_projection_is_missing(self) -> None:
        per_expert = {
            "mtp.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(2, 2),
            "mtp.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(2, 2),
        }

        with pytest.raises(HfExportError, match="gate_proj, up_proj and down_proj"):
            lay_out_experts(per_expert, "fused")


def _transformers_config_fields(module: str, kls: str) -> set[str]:
    """Returns the fields of a transformers 5.x config class, read from the
    overlay's source (transformers 5 cannot be imported here)."""
    source = hf_reference_dir() / "transformers" / "models" / module / f"configuration_{module}.py"

    tree = ast.parse(source.read_text())

    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == kls:
            return {
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            }

    raise AssertionError(f"{kls} is not in {source}.")


_needs_overlay = pytest.mark.skipif(
    not hf_reference_available(), reason="needs the transformers 5.x overlay (make setup)"
)


class TestBuildHfConfig:
    @_needs_overlay
    @pytest.mark.parametrize(
        ("config", "module", "kls"),
        [(tiny_qwen35_config(), "qwen3_5", "Qwen3_5TextConfig"), (tiny_qwen35_moe_config(), "qwen3_5_moe", "Qwen3_5MoeTextConfig")],
        ids=["dense", "moe"],
    )
    def test_sets_every_field_of_the_transformers_config_class(self, config: Qwen35Config, module: str, kls: str) -> None:
        doc = build_hf_config(config, base=None, text_only=True, dtype=torch.bfloat16, num_mtp_layers=0)

        fields = _transformers_config_fields(module, kls)

        if isinstance(config, Qwen35MoeConfig):
            # transformers' MoE text config deletes the dense width.
            fields.discard("intermediate_size")

        assert fields - doc.keys() == set()

        assert doc["architectures"] == ["Qwen3_5MoeForCausalLM" if isinstance(config, Qwen35MoeConfig) else "Qwen3_5ForCausalLM"]
        assert doc["dtype"] == "bfloat16"

    @pytest.mark.parametrize("config", [tiny_qwen35_config(), _untied_tiny_config(), tiny_qwen35_moe_config()], ids=["dense-tied", "dense", "moe"])
    def test_is_read_back_as_the_same_config(self, config: Qwen35Config) -> None:
        doc = build_hf_config(config, base=None, text_only=True, dtype=torch.float32, num_mtp_layers=0)

        read_back = qwen35_config_from_hf(json.loads(json.dumps(doc)))

        if isinstance(config, Qwen35MoeConfig):
            # Not part of transformers' MoE config; unused without dense layers.
            read_back.ffn_inner_dim = config.ffn_inner_dim

        # Written out as a list, which Hugging Face configs hold.
        assert read_back.layer_types == config.get_layer_types()

        read_back.layer_types = config.layer_types

        assert read_back == config

    def test_writes_the_released_rope_and_mtp_keys(self) -> None:
        config = Qwen35Config()

        doc = build_hf_config(config, base=None, text_only=True, dtype=torch.bfloat16, num_mtp_layers=1)

        assert doc["rope_parameters"] == {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        }

        assert doc["mtp_num_hidden_layers"] == 1
        assert doc["eos_token_id"] == 248_044
        assert doc["full_attention_interval"] == 4

    def test_takes_vision_and_token_keys_from_the_base_and_text_keys_from_the_model(self, tmp_path: Path) -> None:
        config = _untied_tiny_config()

        _make_vlm_base(tmp_path / "base", config)

        base = HfRepository.open(tmp_path / "base")

        base.config["text_config"]["max_position_embeddings"] = 7  # type: ignore[index]
        base.config["text_config"]["mamba_ssm_dtype"] = "bfloat16"  # type: ignore[index]

        doc = build_hf_config(config, base=base, text_only=False, dtype=torch.bfloat16, num_mtp_layers=1)

        assert doc["vision_config"] == base.config["vision_config"]
        assert doc["image_token_id"] == 248056
        assert doc["architectures"] == ["Qwen3_5ForConditionalGeneration"]
        assert doc["dtype"] == doc["torch_dtype"] == "bfloat16"

        text = doc["text_config"]

        assert isinstance(text, dict)
        assert text["max_position_embeddings"] == config.max_seq_len
        assert text["mamba_ssm_dtype"] == "bfloat16"

    def test_lifts_the_text_config_of_a_vlm_base_for_text_only(self, tmp_path: Path) -> None:
        config = _untied_tiny_config()

        _make_vlm_base(tmp_path / "base", config)

        doc = build_hf_config(config, base=HfRepository.open(tmp_path / "base"), text_only=True, dtype=torch.float32, num_mtp_layers=1)

        assert "vision_config" not in doc and "text_config" not in doc
        assert doc["model_type"] == "qwen3_5_text"
        assert doc["architectures"] == ["Qwen3_5ForCausalLM"]
        assert doc["hidden_size"] == config.model_dim


class TestPlanHfExport:
    def test_raises_error_naming_the_differences_from_the_base(self, tmp_path: Path) -> None:
        base_config = _untied_tiny_config()

        _make_vlm_base(tmp_path / "base", base_config)

        config = _untied_tiny_config()

        config.model_dim = 128
        config.num_layers = 8

        with pytest.raises(HfExportError, match=r"differs in hidden_size \(base: 64, model: 128\); num_hidden_layers \(base: 4, model: 8\); layer_types"):
            plan_hf_export(_state_dict(config), config, base=HfRepository.open(tmp_path / "base"))

    def test_raises_error_when_the_base_is_moe_and_the_model_dense(self, tmp_path: Path) -> None:
        _make_vlm_base(tmp_path / "base", tiny_qwen35_moe_config())

        config = _untied_tiny_config()

        with pytest.raises(HfExportError, match="must be a dense Qwen3.5 model like the exported one"):
            plan_hf_export(_state_dict(config), config, base=HfRepository.open(tmp_path / "base"))

    def test_raises_error_when_tied_model_has_its_own_output_projection(self) -> None:
        config = tiny_qwen35_config()

        state_dict = _state_dict(config)

        state_dict["final_proj.weight"] = state_dict["final_proj.weight"] + 1.0

        with pytest.raises(HfExportError, match="has an output projection of its own"):
            plan_hf_export(state_dict, config)

    def test_refuses_unmerged_lora_adapters_and_writes_nothing(self, tmp_path: Path) -> None:
        # Written beside the base weights, transformers would load the base
        # model and only warn of the adapters' keys.
        config = tiny_qwen35_config()

        model = create_qwen35_model(config)

        apply_lora(model, LoraConfig(r=2, alpha=4.0), config)

        out_dir = tmp_path / "out"

        with pytest.raises(HfExportError, match=r"The model must hold no unmerged LoRA adapters, but holds \d+ adapter tensors \(decoder\.layers\.0\..*\.lora\..*, \.\.\.\) instead\. Merge them into the weights first"):
            save_hf_model(model, out_dir, config=config)

        assert not out_dir.exists()

    def test_keeps_base_dtypes_by_default_and_casts_everything_to_an_explicit_dtype(self, tmp_path: Path) -> None:
        config = _untied_tiny_config()

        _make_vlm_base(tmp_path / "base", config, dtype=torch.bfloat16)

        base = HfRepository.open(tmp_path / "base")

        plan = plan_hf_export(_state_dict(config), config, base=base)

        assert {t.dtype for t in plan.tensors.values()} == {torch.bfloat16}
        assert plan.config["dtype"] == "bfloat16"

        plan = plan_hf_export(_state_dict(config), config, base=base, dtype=torch.float16)

        assert {t.dtype for t in plan.tensors.values()} == {torch.float16}
        assert plan.config["dtype"] == "float16"

    def test_text_only_drops_the_vision_tower_and_keeps_the_mtp_head(self, tmp_path: Path) -> None:
        config = _untied_tiny_config()

        _make_vlm_base(tmp_path / "base", config)

        plan = plan_hf_export(_state_dict(config), config, base=HfRepository.open(tmp_path / "base"), text_only=True)

        assert not any(k.startswith(("model.visual.", "model.language_model.")) for k in plan.tensors)
        assert "mtp.fc.weight" in plan.tensors
        assert "model.embed_tokens.weight" in plan.tensors
        assert plan.config["mtp_num_hidden_layers"] == 1
        assert [f.name for f in plan.copied_files] == ["generation_config.json", "tokenizer.json", "chat_template.jinja"]

    def test_warns_when_a_vision_language_export_lacks_the_image_processor(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        import logging

        config = _untied_tiny_config()

        _make_vlm_base(tmp_path / "base", config)

        base = HfRepository.open(tmp_path / "base")

        with caplog.at_level(logging.WARNING, logger="fairseq2"):
            plan_hf_export(_state_dict(config), config, base=base)

            plan_hf_export(_state_dict(config), config, base=base, text_only=True)

        assert "preprocessor_config.json" not in caplog.text

        (tmp_path / "base" / "preprocessor_config.json").unlink()

        with caplog.at_level(logging.WARNING, logger="fairseq2"):
            plan = plan_hf_export(_state_dict(config), config, base=base)

        assert plan.config["architectures"] == ["Qwen3_5ForConditionalGeneration"]

        assert f"{base.path} holds no preprocessor_config.json: the export is a vision-language repository (`Qwen3_5ForConditionalGeneration`) without its image processor" in caplog.text

        # A text-only export has no processor.
        caplog.clear()

        with caplog.at_level(logging.WARNING, logger="fairseq2"):
            plan_hf_export(_state_dict(config), config, base=base, text_only=True)

        assert "preprocessor_config.json" not in caplog.text

    def test_ships_the_given_tokenizer_when_the_base_holds_none(self, tmp_path: Path) -> None:
        # fairseq2's download of a Hub model: its weights and config alone.
        config = _untied_tiny_config()

        _make_vlm_base(tmp_path / "base", config)

        for name in ("generation_config.json", "tokenizer.json", "chat_template.jinja"):
            (tmp_path / "base" / name).unlink()

        tokenizer_dir = tmp_path / "tokenizer"

        tokenizer_dir.mkdir()

        (tokenizer_dir / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 7, "content": "<|endoftext|>"}, {"id": 9, "content": "<|im_end|>"}]}))
        (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
        (tokenizer_dir / "chat_template.jinja").write_text("{{ messages }}")

        base = HfRepository.open(tmp_path / "base")

        plan = plan_hf_export(_state_dict(config), config, base=base, tokenizer_dir=tokenizer_dir)

        assert sorted(f.name for f in plan.copied_files) == ["chat_template.jinja", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"]
        assert {f.parent.name for f in plan.copied_files if f.name != "preprocessor_config.json"} == {"tokenizer"}
        assert plan.generation_config == {"bos_token_id": None, "eos_token_id": [9, 7], "pad_token_id": 7}

        # A base's own generation defaults stay, ending at the shipped
        # tokenizer's <|im_end|> too.
        (tmp_path / "base" / "generation_config.json").write_text('{"eos_token_id": [1, 2]}')

        plan = plan_hf_export(_state_dict(config), config, base=base, tokenizer_dir=tokenizer_dir)

        assert plan.generation_config == {"eos_token_id": [1, 2, 9]}
        assert "generation_config.json" not in [f.name for f in plan.copied_files]

        # A base with a tokenizer keeps its own.
        (tmp_path / "base" / "tokenizer.json").write_text("{}")

        plan = plan_hf_export(_state_dict(config), config, base=base, tokenizer_dir=tokenizer_dir)

        assert {f.parent.name for f in plan.copied_files} == {"base"}

    def test_generation_defaults_of_a_base_stop_at_the_end_of_a_turn(self, tmp_path: Path) -> None:
        from transformers import GenerationConfig

        config = _untied_tiny_config()

        _make_vlm_base(tmp_path / "base", config)

        # A pretrained base's defaults, as earlier Qwen base models have them:
        # text ends at <|endoftext|> alone.
        (tmp_path / "base" / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 248_044, "content": "<|endoftext|>"}, {"id": 248_046, "content": "<|im_end|>"}]}))
        (tmp_path / "base" / "generation_config.json").write_text('{"bos_token_id": 248044, "eos_token_id": 248044, "max_new_tokens": 2048}')

        plan = plan_hf_export(_state_dict(config), config, base=HfRepository.open(tmp_path / "base"))

        assert plan.generation_config == {"bos_token_id": 248_044, "eos_token_id": [248_044, 248_046], "max_new_tokens": 2048}
        assert "generation_config.json" not in [f.name for f in plan.copied_files]

        model = create_qwen35_model(config)

        save_hf_model(model, tmp_path / "out", base=tmp_path / "base")

        assert GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == [248_044, 248_046]

        # Defaults that stop there already are copied as they are.
        (tmp_path / "base" / "generation_config.json").write_text('{"eos_token_id": [248046, 248044]}')

        plan = plan_hf_export(_state_dict(config), config, base=HfRepository.open(tmp_path / "base"))

        assert plan.generation_config is None
        assert "generation_config.json" in [f.name for f in plan.copied_files]

        (tmp_path / "base" / "generation_config.json").write_text('{"eos_token_id": "<|im_end|>"}')

        with pytest.raises(HfExportError, match=r"`eos_token_id` of .*generation_config.json must be a token id or a list of them, but is '<\|im_end\|>' instead"):
            plan_hf_export(_state_dict(config), config, base=HfRepository.open(tmp_path / "base"))

    def test_writes_per_expert_tensors_without_a_base(self) -> None:
        config = tiny_qwen35_moe_config()

        plan = plan_hf_export(_state_dict(config), config)

        assert "model.layers.0.mlp.experts.7.down_proj.weight" in plan.tensors
        assert not any(k.endswith("experts.gate_up_proj") for k in plan.tensors)


    @pytest.mark.slow
    def test_ships_the_tokenizer_and_its_end_tokens_without_a_base(self, tmp_path: Path) -> None:
        from transformers import AutoTokenizer

        from qwen35_fs2.models.qwen35.tokenizer import get_qwen35_tokenizer_dir

        config = tiny_qwen35_config()

        config.vocab_size = 248_320
        config.pad_idx = 248_044

        # The cache the other tests share: building the vocabulary again in
        # an empty one is tests/unit/models/qwen35/test_tokenizer.py's.
        tokenizer_dir = get_qwen35_tokenizer_dir()

        out_dir = tmp_path / "out"

        save_hf_model(create_qwen35_model(config), out_dir, config=config, tokenizer_dir=tokenizer_dir)

        # The ids of the released vocabulary: <|im_end|>, <|endoftext|>.
        generation_config = json.loads((out_dir / "generation_config.json").read_text())

        assert generation_config["eos_token_id"] == [248_046, 248_044]
        assert generation_config["pad_token_id"] == 248_044

        # transformers tokenizes with the exported files as with ours.
        tokenizer = AutoTokenizer.from_pretrained(out_dir)

        assert tokenizer("Hello")["input_ids"] == AutoTokenizer.from_pretrained(tokenizer_dir)("Hello")["input_ids"]

        assert (out_dir / "chat_template.jinja").read_text() == (tokenizer_dir / "chat_template.jinja").read_text()


class TestHuggingFaceConverter:
    @pytest.mark.parametrize("config", [tiny_qwen35_config(), tiny_qwen35_moe_config()], ids=["dense", "moe"])
    def test_gives_fairseq2_the_text_only_export(self, config: Qwen35Config) -> None:
        family = "qwen35_moe" if isinstance(config, Qwen35MoeConfig) else "qwen35"

        converter = get_hugging_face_converter(family)

        hg_config = converter.to_hg_config(config)

        plan = plan_hf_export(_state_dict(config), config)

        assert hg_config.arch == plan.config["architectures"]
        assert hg_config.kls_name == ("Qwen3_5MoeTextConfig" if family == "qwen35_moe" else "Qwen3_5TextConfig")
        assert {**hg_config.data, "architectures": hg_config.arch, "dtype": "float32"} == plan.config

        state_dict: dict[str, object] = dict(_state_dict(config))

        assert converter.to_hg_state_dict(state_dict, config).keys() == plan.tensors.keys()


class TestWriteHfExport:
    def test_text_only_copies_a_nested_mtp_head_of_the_base(self, tmp_path: Path) -> None:
        # Some re-exports nest the head under `model.language_model.`; the
        # text-only export names it `mtp.*` and must read it by its base name.
        config = _untied_tiny_config()

        base_tensors = _make_vlm_base(tmp_path / "base", config)

        nested = {(f"model.language_model.{k}" if k.startswith("mtp.") else k): v for k, v in base_tensors.items()}

        save_file(nested, tmp_path / "base" / "model.safetensors", metadata={"format": "pt"})

        model = create_qwen35_model(config)

        model.load_state_dict(convert_qwen35_state_dict(dict(base_tensors), config))

        save_hf_model(model, tmp_path / "out", base=tmp_path / "base", text_only=True)

        out_tensors = read_safetensors_dir(tmp_path / "out")

        for key in ("mtp.fc.weight", "mtp.layers.0.input_layernorm.weight"):
            assert torch.equal(out_tensors[key], base_tensors[key]), key

    def test_round_trips_a_vlm_base_with_visual_mtp_and_files(self, tmp_path: Path) -> None:
        config = _untied_tiny_config()

        base_tensors = _make_vlm_base(tmp_path / "base", config)

        model = create_qwen35_model(config)

        model.load_state_dict(convert_qwen35_state_dict(dict(base_tensors), config))

        save_hf_model(model, tmp_path / "out", base=tmp_path / "base")

        out_tensors = read_safetensors_dir(tmp_path / "out")

        assert out_tensors.keys() == base_tensors.keys()

        for key, value in base_tensors.items():
            assert torch.equal(out_tensors[key], value), key

        names = sorted(p.name for p in (tmp_path / "out").iterdir())

        assert names == [
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            "model-00001-of-00001.safetensors",
            "model.safetensors.index.json",
            "preprocessor_config.json",
            "tokenizer.json",
        ]

        assert (tmp_path / "out" / "generation_config.json").read_text() == '{"eos_token_id": [1, 2]}'

    def test_writes_shards_under_the_limit_and_a_consistent_index(self, tmp_path: Path) -> None:
        config = _untied_tiny_config()

        plan = plan_hf_export(_state_dict(config), config)

        max_shard_size = 70_000

        write_hf_export(plan, tmp_path / "out", max_shard_size=max_shard_size)

        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())

        shards = sorted((tmp_path / "out").glob("*.safetensors"))

        assert len(shards) > 2
        assert [s.name for s in shards] == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]

        total_size = 0

        for shard in shards:
            with safe_open(shard, framework="pt") as reader:
                keys = list(reader.keys())

                assert reader.metadata() == {"format": "pt"}

                sizes = [reader.get_tensor(k).numel() * 4 for k in keys]

            assert sum(sizes) <= max_shard_size or len(keys) == 1

            total_size += sum(sizes)

            for key in keys:
                assert index["weight_map"][key] == shard.name

        assert index["weight_map"].keys() == plan.tensors.keys()
        assert index["metadata"]["total_size"] == total_size

    def test_gives_the_shards_the_mode_of_other_files(self, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        write_hf_export(plan_hf_export(_state_dict(config), config), tmp_path / "out")

        modes = {p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}

        assert modes == {0o666 & ~_umask()}
        assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~_umask()

    def test_refuses_a_non_empty_directory_without_force_and_replaces_it_with(self, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        plan = plan_hf_export(_state_dict(config), config)

        out_dir = tmp_path / "out"

        out_dir.mkdir()

        (out_dir / "old.txt").write_text("old")

        with pytest.raises(HfExportError, match="must be empty or absent, but .* has files"):
            write_hf_export(plan, out_dir)

        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
        assert [p.name for p in out_dir.iterdir()] == ["old.txt"]

        write_hf_export(plan, out_dir, force=True)

        assert not (out_dir / "old.txt").exists()
        assert (out_dir / "config.json").is_file()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    def test_writes_into_an_empty_directory_and_creates_missing_parents(self, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        plan = plan_hf_export(_state_dict(config), config)

        (tmp_path / "empty").mkdir()

        write_hf_export(plan, tmp_path / "empty")
        write_hf_export(plan, tmp_path / "a" / "b" / "out")

        assert (tmp_path / "empty" / "config.json").is_file()
        assert (tmp_path / "a" / "b" / "out" / "config.json").is_file()

    def test_refuses_to_replace_the_base(self, tmp_path: Path) -> None:
        config = _untied_tiny_config()

        _make_vlm_base(tmp_path / "base", config)

        model = create_qwen35_model(config)

        with pytest.raises(HfExportError, match="must not hold the base model"):
            save_hf_model(model, tmp_path / "base", base=tmp_path / "base", force=True)

        with pytest.raises(HfExportError, match="must not hold the base model"):
            save_hf_model(model, tmp_path, base=tmp_path / "base", force=True)

        assert (tmp_path / "base" / "model.safetensors").is_file()

    def test_leaves_nothing_behind_when_the_disk_is_full(self, tmp_path: Path) -> None:
        # A file-size limit makes every write past 20 kB fail as on a full
        # disk (EFBIG instead of ENOSPC), in a subprocess.
        script = textwrap.dedent(
            f"""
            import resource, signal, sys
            from qwen35_fs2.models.qwen35.config import tiny_qwen35_config
            from qwen35_fs2.models.qwen35.factory import create_qwen35_model
            from qwen35_fs2.hf.export import HfExportError, save_hf_model

            config = tiny_qwen35_config()
            model = create_qwen35_model(config)

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

            try:
                save_hf_model(model, {str(tmp_path / "parent" / "out")!r}, config=config)
            except HfExportError as ex:
                print(ex)
                sys.exit(3)
            """
        )

        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)

        assert result.returncode == 3, result.stderr
        assert "Writing the export to" in result.stdout and "nothing was left behind" in result.stdout
        assert "File too large" in result.stdout

        assert list(tmp_path.iterdir()) == []

    def test_leaves_nothing_behind_in_a_read_only_location(self, read_only_dir: Path) -> None:
        config = tiny_qwen35_config()

        plan = plan_hf_export(_state_dict(config), config)

        with pytest.raises(HfExportError, match="cannot be written next to"):
            write_hf_export(plan, read_only_dir / "new" / "out")

        assert list(read_only_dir.iterdir()) == []


def _umask() -> int:
    umask = os.umask(0)

    os.umask(umask)

    return umask
