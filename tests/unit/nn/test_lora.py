from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fairseq2.error import NotSupportedError
from fairseq2.nn import Linear, get_shard_dims

from qwen35_fs2.lora import LoraConfig, apply_lora, merge_lora_state_dict, save_peft_adapter
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config
from qwen35_fs2.nn.lora import ExpertLoraAdapter, LoraAdapter, add_lora_adapter, reset_lora_adapters
from tp_testing import create_on_meta, fake_tp_gangs


def _projection(input_dim: int, output_dim: int, dtype: torch.dtype = torch.float32) -> Linear:
    return Linear(input_dim, output_dim, bias=False, dtype=dtype)


class TestLoraAdapter:
    @pytest.mark.parametrize(("rslora", "scaling"), [(False, 6.0 / 4), (True, 6.0 / 2)])
    def test_output_is_base_plus_scaled_low_rank_update(self, rslora: bool, scaling: float) -> None:
        torch.manual_seed(0)

        proj = _projection(8, 5)

        adapter = add_lora_adapter(proj, rank=4, alpha=6.0, dropout_p=0.0, rslora=rslora)

        torch.nn.init.normal_(adapter.b_proj.weight)

        x = torch.randn(3, 7, 8)

        w, a, b = proj.weight.detach(), adapter.a_proj.weight.detach(), adapter.b_proj.weight.detach()

        expected = x @ w.T + scaling * (x @ a.T @ b.T)

        torch.testing.assert_close(proj(x), expected)

    def test_new_adapter_leaves_output_unchanged_and_a_is_kaiming_uniform(self) -> None:
        torch.manual_seed(0)

        proj = _projection(64, 16)

        x = torch.randn(2, 64)

        before = proj(x)

        adapter = add_lora_adapter(proj, rank=8, alpha=16.0, dropout_p=0.0, rslora=False)

        assert torch.equal(proj(x), before)

        assert torch.count_nonzero(adapter.b_proj.weight) == 0

        # Kaiming-uniform with a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = 1 / math.sqrt(64)

        a = adapter.a_proj.weight

        assert a.abs().max() <= bound
        assert a.abs().max() > 0.9 * bound
        assert abs(a.mean().item()) < 0.1 * bound

    def test_reset_lora_adapters_makes_allocated_adapters_new_ones(self) -> None:
        # What sharded loading leaves: adapters allocated, not initialized.
        model = torch.nn.Sequential(_projection(64, 16), _projection(16, 32))

        adapters = [add_lora_adapter(proj, rank=8, alpha=16.0, dropout_p=0.0, rslora=False) for proj in model]

        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float("nan"))

        reset_lora_adapters(model)

        for proj, adapter, fan_in in zip(model, adapters, (64, 16)):
            assert torch.isnan(proj.weight).all()

            assert torch.count_nonzero(adapter.b_proj.weight) == 0

            a = adapter.a_proj.weight

            assert a.abs().max() <= 1 / math.sqrt(fan_in)
            assert a.abs().max() > 0.5 / math.sqrt(fan_in)

    def test_dropout_applies_to_the_adapter_input_only(self) -> None:
        proj = _projection(6, 6)

        torch.nn.init.eye_(proj.weight)

        adapter = add_lora_adapter(proj, rank=6, alpha=6.0, dropout_p=0.5, rslora=False)

        torch.nn.init.eye_(adapter.a_proj.weight)
        torch.nn.init.eye_(adapter.b_proj.weight)

        x = torch.ones(50, 6)

        # The update is the dropped-out input: 0 or 1 / (1 - p) = 2.
        update = proj(x) - x

        assert set(update.unique().tolist()) == {0.0, 2.0}

        proj.eval()

        assert torch.equal(proj(x) - x, x)

    def test_adapter_takes_dtype_of_projection_and_adds_in_output_dtype(self) -> None:
        proj = _projection(8, 4, dtype=torch.bfloat16)

        adapter = add_lora_adapter(proj, rank=2, alpha=2.0, dropout_p=0.0, rslora=False)

        assert adapter.a_proj.weight.dtype == torch.bfloat16
        assert adapter.b_proj.weight.dtype == torch.bfloat16

        assert proj(torch.randn(3, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16

    def test_parameter_names_of_projection_are_kept(self) -> None:
        proj = _projection(8, 4)

        add_lora_adapter(proj, rank=2, alpha=2.0, dropout_p=0.0, rslora=False)

        assert list(proj.state_dict()) == ["weight", "lora.a_proj.weight", "lora.b_proj.weight"]

    def test_add_lora_adapter_raises_error_when_projection_has_one(self) -> None:
        proj = _projection(8, 4)

        add_lora_adapter(proj, rank=2, alpha=2.0, dropout_p=0.0, rslora=False)

        with pytest.raises(ValueError, match=r"`proj` must not have a LoRA adapter yet"):
            add_lora_adapter(proj, rank=2, alpha=2.0, dropout_p=0.0, rslora=False)

    @pytest.mark.parametrize("rank", [0, -1])
    def test_raises_error_when_rank_is_not_positive(self, rank: int) -> None:
        with pytest.raises(ValueError, match=rf"`rank` must be greater than 0, but is {rank} instead\."):
            LoraAdapter(8, 4, rank=rank, alpha=1.0, dropout_p=0.0, rslora=False)


class TestTensorParallelProjections:
    """How adapters split under tensor parallelism; that the split computes
    what the unsharded adapter does is tested under 2 processes
    (tests/integration/sharding/test_tensor_parallel.py)."""

    def test_adapter_splits_as_its_projection(self) -> None:
        config = tiny_qwen35_config()

        model = create_on_meta(config, fake_tp_gangs(2, tp_rank=1))

        attn = model.decoder.layers[3].self_attn  # type: ignore[index, union-attr]

        # Column-sharded: B's rows split, A whole.
        column = add_lora_adapter(attn.q_proj, rank=4, alpha=8.0, dropout_p=0.0, rslora=False)

        assert column.a_proj.weight.shape == (4, config.model_dim)
        assert column.b_proj.weight.shape == (attn.q_proj.output_dim // 2, 4)

        # Row-sharded: A's columns split, B whole.
        row = add_lora_adapter(attn.output_proj, rank=4, alpha=8.0, dropout_p=0.0, rslora=False)

        assert row.a_proj.weight.shape == (4, attn.output_proj.input_dim // 2)
        assert row.b_proj.weight.shape == (config.model_dim, 4)

        shard_dims = get_shard_dims(attn)

        assert shard_dims["q_proj.lora.b_proj.weight"] == 0
        assert shard_dims["output_proj.lora.a_proj.weight"] == 1

        assert "q_proj.lora.a_proj.weight" not in shard_dims
        assert "output_proj.lora.b_proj.weight" not in shard_dims

    def test_refuses_a_projection_that_gathers_its_output(self) -> None:
        config = tiny_qwen35_config()

        config.tied_embeddings = False

        model = create_on_meta(config, fake_tp_gangs(2))

        proj = model.final_proj

        with pytest.raises(NotSupportedError, match=r"`proj` must keep its output sharded to take a LoRA adapter, but gathers it over 2 ranks instead\."):
            add_lora_adapter(proj, rank=4, alpha=8.0, dropout_p=0.0, rslora=False)

        assert not isinstance(getattr(proj, "lora", None), LoraAdapter)

    @pytest.mark.parametrize("write", ["peft", "merge"])
    def test_export_and_merge_refuse_split_adapters(self, write: str, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        model = create_on_meta(config, fake_tp_gangs(2))

        lora_config = LoraConfig(target_modules=["up_proj"], r=2)

        apply_lora(model, lora_config, config)

        with pytest.raises(ValueError, match=r"must be unsharded \(a tensor parallel size of 1\), but `decoder\.layers\.0\.ffn\.inner_proj\.lora` is split over 2 ranks instead\."):
            if write == "peft":
                save_peft_adapter(model, tmp_path / "adapter", config=lora_config, model_config=config)
            else:
                merge_lora_state_dict(model)

        assert not (tmp_path / "adapter").exists()

    def test_takes_a_projection_of_a_single_rank_gang(self) -> None:
        config = tiny_qwen35_config()

        model = create_on_meta(config, fake_tp_gangs(1))

        proj = model.decoder.layers[3].self_attn.q_proj  # type: ignore[index, union-attr]

        adapter = add_lora_adapter(proj, rank=4, alpha=8.0, dropout_p=0.0, rslora=False)

        assert proj.lora is adapter

        assert adapter.b_proj.weight.shape == (proj.output_dim, 4)


class TestExpertLoraAdapter:
    def test_new_adapter_leaves_weight_unchanged_and_a_is_uniform(self) -> None:
        torch.manual_seed(0)

        adapter = ExpertLoraAdapter(4, 64, 16, rank=8, alpha=16.0, rslora=False)

        weight = torch.randn(4, 16, 64)

        assert torch.equal(adapter(weight), weight)

        assert torch.count_nonzero(adapter.b) == 0

        # PEFT's A: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), for every expert.
        bound = 1 / math.sqrt(64)

        assert adapter.a.abs().max() <= bound
        assert adapter.a.abs().amax(dim=(1, 2)).min() > 0.9 * bound

    def test_reset_lora_adapters_makes_allocated_expert_adapters_new_ones(self) -> None:
        # What sharded loading leaves: adapters allocated, not initialized.
        model = torch.nn.ModuleDict({"experts": ExpertLoraAdapter(4, 64, 16, rank=8, alpha=16.0, rslora=True)})

        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float("nan"))

        reset_lora_adapters(model)

        adapter = model["experts"]

        assert torch.count_nonzero(adapter.b) == 0

        assert adapter.a.abs().max() <= 1 / math.sqrt(64)
        assert adapter.a.abs().max() > 0.5 / math.sqrt(64)
