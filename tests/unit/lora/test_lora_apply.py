from __future__ import annotations

import dataclasses

import pytest
import torch

from fairseq2.utils.validation import ValidationError

from qwen35_fs2.lora import LoraConfig, apply_lora, lora_parameters
from qwen35_fs2.models.qwen35 import create_qwen35_model, tiny_qwen35_config
from qwen35_fs2.models.qwen35_moe.config import tiny_qwen35_moe_config
from qwen35_fs2.models.qwen35_moe.factory import create_qwen35_moe_model
from qwen35_fs2.nn.lora import LoraAdapter


class TestApplyLora:
    def test_selects_projections_by_their_hugging_face_names(self) -> None:
        config = tiny_qwen35_config()  # layers 0-2 Gated DeltaNet, layer 3 attention

        model = create_qwen35_model(config)

        adapters = apply_lora(model, LoraConfig(target_modules=["o_proj", "in_proj_qkv", "in_proj_a", "up_proj"]), config)

        expected = {f"decoder.layers.{i}.linear_attn.{name}" for i in range(3) for name in ("in_proj_qkv", "in_proj_a")}

        expected.add("decoder.layers.3.self_attn.output_proj")

        expected.update(f"decoder.layers.{i}.ffn.inner_proj" for i in range(4))

        assert set(adapters) == expected

        assert {name.removesuffix(".lora") for name, m in model.named_modules() if isinstance(m, LoraAdapter)} == expected

    def test_mlp_names_select_dense_mlps_and_shared_experts_of_moe_model(self) -> None:
        config = tiny_qwen35_moe_config()

        config = dataclasses.replace(config, experts=dataclasses.replace(config.experts, dense_layers=[1]))

        model = create_qwen35_moe_model(config)

        adapters = apply_lora(model, LoraConfig(target_modules=["gate_proj", "down_proj"]), config)

        expected = {"decoder.layers.1.ffn.gate_proj", "decoder.layers.1.ffn.output_proj"}

        expected.update(
            f"decoder.layers.{i}.ffn.shared_expert.{name}" for i in (0, 2, 3) for name in ("gate_proj", "output_proj")
        )

        assert set(adapters) == expected

    def test_leaves_the_mtp_head_without_adapters(self) -> None:
        # transformers (and so PEFT) does not build the MTP head: an adapter on
        # it could not be exported as a PEFT adapter.
        config = dataclasses.replace(tiny_qwen35_config(), mtp_num_layers=1)

        model = create_qwen35_model(config)

        adapters = apply_lora(model, LoraConfig(target_modules=["q_proj", "o_proj", "gate_proj", "down_proj"]), config)

        expected = {"decoder.layers.3.self_attn.q_proj", "decoder.layers.3.self_attn.output_proj"}

        expected.update(f"decoder.layers.{i}.ffn.{name}" for i in range(4) for name in ("gate_proj", "output_proj"))

        assert set(adapters) == expected

        assert not any(p.requires_grad for p in model.mtp.parameters())  # type: ignore[union-attr]

    def test_freezes_base_in_its_dtype_and_trains_only_adapters(self) -> None:
        config = tiny_qwen35_config()

        model = create_qwen35_model(config).to(torch.bfloat16)

        before = {k: v.clone() for k, v in model.state_dict().items()}

        dtypes = {k: v.dtype for k, v in before.items()}

        adapters = apply_lora(model, LoraConfig(r=2), config)

        state_dict = model.state_dict()

        adapter_keys = {k for k in state_dict if ".lora." in k}

        assert adapter_keys == {f"{name}.lora.{p}.weight" for name in adapters for p in ("a_proj", "b_proj")}

        for key, value in before.items():
            assert torch.equal(state_dict[key], value), key
            assert state_dict[key].dtype == dtypes[key], key

        trainable = {name for name, p in model.named_parameters() if p.requires_grad}

        assert trainable == adapter_keys

        assert {id(p) for p in lora_parameters(model)} == {id(p) for p in model.parameters() if p.requires_grad}

    def test_raises_error_when_model_has_adapters(self) -> None:
        config = tiny_qwen35_config()

        model = create_qwen35_model(config)

        apply_lora(model, LoraConfig(target_modules=["q_proj"]), config)

        with pytest.raises(ValueError, match=r"`model` must not have LoRA adapters yet"):
            apply_lora(model, LoraConfig(target_modules=["k_proj"]), config)

    def test_raises_error_when_a_name_selects_nothing(self) -> None:
        config = dataclasses.replace(tiny_qwen35_config(), layer_types=["full_attention"] * 4)

        model = create_qwen35_model(config)

        with pytest.raises(ValueError, match=r"`target_modules` must name projections of the model, but `in_proj_qkv` selects none\."):
            apply_lora(model, LoraConfig(target_modules=["q_proj", "in_proj_qkv"]), config)

        assert all(p.requires_grad for p in model.parameters())

    @pytest.mark.parametrize(
        ("lora_config", "message"),
        [
            (LoraConfig(target_modules=["qkv_proj"]), r"`target_modules` must hold Hugging Face projection names \(.*\), but holds `qkv_proj` instead\."),
            (LoraConfig(target_modules=["gate_up_proj"]), r"`target_modules` must not name the routed experts \(`gate_up_proj`\)"),
            (LoraConfig(target_modules=[]), r"`target_modules` must name at least one projection"),
            (LoraConfig(r=0), r"`r` must be greater than 0, but is 0 instead\."),
            (LoraConfig(r=-2), r"`r` must be greater than 0, but is -2 instead\."),
            (LoraConfig(dropout_p=1.0), r"`dropout_p` must be in \[0, 1\), but is 1.0 instead\."),
        ],
    )
    def test_raises_error_when_config_is_invalid(self, lora_config: LoraConfig, message: str) -> None:
        config = tiny_qwen35_config()

        model = create_qwen35_model(config)

        with pytest.raises(ValidationError, match=message):
            apply_lora(model, lora_config, config)

        assert not any(isinstance(m, LoraAdapter) for m in model.modules())
