from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fairseq2.utils.validation import ValidationError

from qwen35_fs2.hf.export import HfExportError
from qwen35_fs2.lora import PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME, LoraConfig, apply_lora, save_peft_adapter
from qwen35_fs2.models.qwen35 import create_qwen35_model, tiny_qwen35_config


class TestSavePeftAdapter:
    def test_writes_peft_config_and_keys_with_b_rows_in_hugging_face_order(self, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        model = create_qwen35_model(config)

        lora_config = LoraConfig(target_modules=["o_proj", "in_proj_qkv"], r=2, alpha=3.0, dropout_p=0.1, rslora=True)

        adapters = apply_lora(model, lora_config, config)

        qkv = adapters["decoder.layers.0.linear_attn.in_proj_qkv"]

        with torch.no_grad():
            qkv.b_proj.weight.copy_(torch.arange(qkv.b_proj.weight.numel(), dtype=torch.float32).view_as(qkv.b_proj.weight))

        save_peft_adapter(model, tmp_path / "adapter", config=lora_config, model_config=config, base_model_name_or_path="Qwen/Qwen3.5-0.8B")

        peft_config = json.loads((tmp_path / "adapter" / PEFT_CONFIG_NAME).read_text())

        assert peft_config["peft_type"] == "LORA"
        assert peft_config["task_type"] == "CAUSAL_LM"
        assert peft_config["base_model_name_or_path"] == "Qwen/Qwen3.5-0.8B"
        assert peft_config["target_modules"] == ["in_proj_qkv", "o_proj"]
        assert (peft_config["r"], peft_config["lora_alpha"], peft_config["lora_dropout"], peft_config["use_rslora"]) == (2, 3.0, 0.1, True)

        tensors = load_file(tmp_path / "adapter" / PEFT_WEIGHTS_NAME)

        expected_keys = {
            f"base_model.model.model.layers.{i}.{module}.lora_{ab}.weight"
            for i, module in [(0, "linear_attn.in_proj_qkv"), (1, "linear_attn.in_proj_qkv"), (2, "linear_attn.in_proj_qkv"), (3, "self_attn.o_proj")]
            for ab in ("A", "B")
        }

        assert set(tensors) == expected_keys

        # Ours: [q_0 k_0 v_0 v_1 | q_1 k_1 v_2 v_3], 16 rows per head; Hugging
        # Face's: [q_0 q_1 | k_0 k_1 | v_0 v_1 v_2 v_3].
        ours = qkv.b_proj.weight.detach()

        expected_b = torch.cat([ours[0:16], ours[64:80], ours[16:32], ours[80:96], ours[32:64], ours[96:128]])

        assert torch.equal(tensors["base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_B.weight"], expected_b)

        assert torch.equal(tensors["base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"], qkv.a_proj.weight.detach())

    def test_raises_error_when_model_has_no_adapters(self, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        with pytest.raises(ValueError, match=r"`model` must have LoRA adapters, but has none\."):
            save_peft_adapter(create_qwen35_model(config), tmp_path / "adapter", config=LoraConfig(), model_config=config)

    def test_raises_error_when_output_dir_has_files_or_config_is_invalid(self, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        model = create_qwen35_model(config)

        apply_lora(model, LoraConfig(), config)

        (tmp_path / "file").write_text("x")

        with pytest.raises(HfExportError, match=r"must be empty or absent"):
            save_peft_adapter(model, tmp_path, config=LoraConfig(), model_config=config)

        with pytest.raises(ValidationError, match=r"`r` must be greater than 0"):
            save_peft_adapter(model, tmp_path / "adapter", config=LoraConfig(r=0), model_config=config)

    def test_force_replaces_the_directory_whole(self, tmp_path: Path) -> None:
        # A merged export there before: left beside the adapter, its
        # `config.json` and weights would be what vLLM or transformers serve.
        config = tiny_qwen35_config()

        model = create_qwen35_model(config)

        apply_lora(model, LoraConfig(), config)

        out_dir = tmp_path / "out"

        out_dir.mkdir()

        for name in ("config.json", "model.safetensors", "model.safetensors.index.json"):
            (out_dir / name).write_text("{}")

        save_peft_adapter(model, out_dir, config=LoraConfig(), model_config=config, force=True)

        assert sorted(p.name for p in out_dir.iterdir()) == sorted([PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME])

        # Nothing left next to it either.
        assert [p.name for p in tmp_path.iterdir()] == ["out"]
