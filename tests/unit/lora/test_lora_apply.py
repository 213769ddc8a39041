from __future__ import annotations

import dataclasses

import pytest
import torch

from fairseq2.error import NotSupportedError
from fairseq2.utils.validation import ValidationError

from qwen35_fs2.lora import LoraConfig, apply_lora, lora_parameters, merge_lora_state_dict
from qwen35_fs2.models.qwen35 import create_qwen35_model, tiny_qwen35_config
from qwen35_fs2.models.qwen35_moe.config import tiny_qwen35_moe_config
from qwen35_fs2.models.qwen35_moe.factory import create_qwen35_moe_model
from qwen35_fs2.nn.lora import ExpertLoraAdapter, LoraAdapter
from qwen35_fs2.nn.moe import ExpertDispatch
from tp_testing import create_on_meta, fake_tp_gangs


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

    def test_target_parameters_select_routed_expert_weights_of_moe_layers(self) -> None:
        config = tiny_qwen35_moe_config()

        config = dataclasses.replace(config, mtp_num_layers=1, experts=dataclasses.replace(config.experts, dense_layers=[1]))

        model = create_qwen35_moe_model(config)

        lora_config = LoraConfig(target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"], r=3)

        adapters = apply_lora(model, lora_config, config)

        # Not the dense layer 1, not the MTP head's experts.
        expected = {f"decoder.layers.{i}.ffn.experts.output_proj" for i in (0, 2, 3)}

        assert {name for name in adapters if ".experts." in name} == expected

        experts = model.decoder.layers[0].ffn.experts  # type: ignore[index, union-attr]

        adapter = adapters["decoder.layers.0.ffn.experts.output_proj"]

        assert isinstance(adapter, ExpertLoraAdapter)

        assert experts.lora["output_proj"] is adapter

        num_experts, model_dim, inner_dim = experts.output_proj.shape

        assert adapter.a.shape == (num_experts, 3, inner_dim)
        assert adapter.b.shape == (num_experts, model_dim, 3)

        assert {id(p) for p in lora_parameters(model)} >= {id(adapter.a), id(adapter.b)}

        assert not experts.output_proj.requires_grad

    @pytest.mark.parametrize("dispatch", ["batched", "loop"])
    def test_expert_adapters_update_each_experts_weight(self, dispatch: ExpertDispatch) -> None:
        torch.manual_seed(0)

        config = tiny_qwen35_moe_config()

        model = create_qwen35_moe_model(config)

        lora_config = LoraConfig(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"], r=2, alpha=3.0)

        adapter = apply_lora(model, lora_config, config)["decoder.layers.0.ffn.experts.gate_inner_proj"]

        assert isinstance(adapter, ExpertLoraAdapter)

        experts = model.decoder.layers[0].ffn.experts  # type: ignore[index, union-attr]

        experts.dispatch = dispatch

        torch.nn.init.normal_(adapter.b)

        seqs = torch.randn(5, experts.model_dim)

        tokens_per_expert = torch.zeros(experts.num_experts, dtype=torch.int64)

        tokens_per_expert[1], tokens_per_expert[-1] = 2, 3

        output = experts(seqs, tokens_per_expert)

        grad_output = torch.randn_like(output)

        grad_a, grad_b = torch.autograd.grad(output, (adapter.a, adapter.b), grad_output)

        expected = []

        # Expert by expert, with its own adapted weight, through autograd.
        for expert_idx, rows in ((1, seqs[:2]), (experts.num_experts - 1, seqs[2:])):
            weight = experts.gate_inner_proj[expert_idx] + 1.5 * adapter.b[expert_idx] @ adapter.a[expert_idx]

            gate, inner = (rows @ weight.T).chunk(2, dim=-1)

            expected.append((torch.nn.functional.silu(gate) * inner) @ experts.output_proj[expert_idx].T)

        expected_output = torch.cat(expected)

        expected_grad_a, expected_grad_b = torch.autograd.grad(expected_output, (adapter.a, adapter.b), grad_output)

        torch.testing.assert_close(output, expected_output)

        torch.testing.assert_close(grad_a, expected_grad_a)
        torch.testing.assert_close(grad_b, expected_grad_b)

        # Experts without tokens get no gradient.
        assert torch.count_nonzero(grad_b[0]) == 0

    def test_raises_error_when_experts_are_tensor_parallel(self) -> None:
        config = tiny_qwen35_moe_config()

        model = create_on_meta(config, fake_tp_gangs(2))

        with pytest.raises(NotSupportedError, match=r"LoRA adapters on routed experts need the experts unsharded \(a tensor parallel size of 1\)"):
            apply_lora(model, LoraConfig(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]), config)

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

        with pytest.raises(ValueError, match=r"`target_parameters` must name routed expert weights of the model, but `mlp\.experts\.down_proj` selects none\."):
            apply_lora(model, LoraConfig(target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"]), config)

        assert all(p.requires_grad for p in model.parameters())

    @pytest.mark.parametrize(
        ("lora_config", "message"),
        [
            (LoraConfig(target_modules=["qkv_proj"]), r"`target_modules` must hold Hugging Face projection names \(.*\), but holds `qkv_proj` instead\."),
            (LoraConfig(target_modules=["gate_up_proj"]), r"`target_modules` must not name the routed experts \(`gate_up_proj`\), .* Name their stacked weights in `target_parameters` instead"),
            (LoraConfig(target_parameters=["gate_up_proj"]), r"`target_parameters` must hold Hugging Face names of routed expert weights \(.*\), but holds `gate_up_proj` instead\."),
            (LoraConfig(target_parameters=["mlp.experts.down_proj"] * 2), r"`target_parameters` must not repeat a name"),
            (LoraConfig(target_parameters=["mlp.experts.down_proj"], dropout_p=0.1), r"`dropout_p` must be 0 when `target_parameters` is set, but is 0.1 instead"),
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


class TestMergeExpertLoraAdapters:
    def test_merged_experts_compute_what_the_adapted_experts_do(self) -> None:
        torch.manual_seed(0)

        config = tiny_qwen35_moe_config()

        model = create_qwen35_moe_model(config).eval()

        lora_config = LoraConfig(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])

        apply_lora(model, lora_config, config)

        with torch.no_grad():
            for param in lora_parameters(model):
                param.normal_(std=0.1)

        state_dict = merge_lora_state_dict(model)

        assert not any(".lora." in key for key in state_dict)

        merged = create_qwen35_moe_model(config).eval()

        merged.load_state_dict(state_dict)

        experts = model.decoder.layers[0].ffn.experts  # type: ignore[index, union-attr]

        merged_experts = merged.decoder.layers[0].ffn.experts  # type: ignore[index, union-attr]

        seqs = torch.randn(6, experts.model_dim)

        tokens_per_expert = torch.zeros(experts.num_experts, dtype=torch.int64)

        tokens_per_expert[0], tokens_per_expert[2] = 4, 2

        with torch.no_grad():
            torch.testing.assert_close(merged_experts(seqs, tokens_per_expert), experts(seqs, tokens_per_expert))
