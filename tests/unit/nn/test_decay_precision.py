"""``A_log`` and ``dt_bias`` stay fp32 parameters, and the log decay fp32
math, in every way a model is made lower precision (``mamba_ssm_dtype:
float32`` of the released configs). FSDP2 static mixed precision is tested in
``tests/integration/sharding/test_fsdp2.py``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn import Parameter

from fairseq2.data_type import set_dtype
from fairseq2.nn import BatchLayout
from fairseq2.nn.utils.module import apply_to_parameters

from qwen35_fs2 import load_hf_model
from qwen35_fs2.models.qwen35 import create_qwen35_model
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config
from qwen35_fs2.nn.gated_deltanet import GatedDeltaNet, GatedDeltaNetDecay
from qwen35_fs2.hf.export.save import save_hf_model

BF16 = torch.bfloat16


def _decays(model: torch.nn.Module) -> list[GatedDeltaNetDecay]:
    decays = [m for m in model.modules() if isinstance(m, GatedDeltaNetDecay)]

    assert decays

    return decays


def _decay_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for decay in _decays(model) for p in decay.parameters()}


class TestGatedDeltaNetDecay:
    def test_forms_the_log_decay_in_fp32(self) -> None:
        decay = GatedDeltaNetDecay(4)

        a = torch.randn(2, 3, 4).to(BF16)

        g = decay(a)

        expected = -decay.A_log.exp() * F.softplus(a.float() + decay.dt_bias)

        assert g.dtype == torch.float32

        torch.testing.assert_close(g, expected, rtol=0, atol=0)

    def test_parameters_are_fp32_when_built_in_bf16(self) -> None:
        decay = GatedDeltaNetDecay(4, dtype=BF16)

        assert decay.A_log.dtype == torch.float32 and decay.dt_bias.dtype == torch.float32

    def test_parameters_stay_fp32_when_cast_to_bf16_or_fp16(self) -> None:
        layer = GatedDeltaNet(16, 1, 2, 8, 8, 4)

        values = layer.decay.A_log.detach().clone()

        for cast in (lambda m: m.to(BF16), lambda m: m.half(), lambda m: m.bfloat16()):
            cast(layer)

            assert layer.in_proj_qkv.weight.dtype != torch.float32

            assert layer.decay.A_log.dtype == torch.float32 and layer.decay.dt_bias.dtype == torch.float32

            # Not rounded through bf16 on the way.
            assert torch.equal(layer.decay.A_log, values)

    def test_parameters_follow_fp64(self) -> None:
        # Gradient checks run the whole model in fp64.
        layer = GatedDeltaNet(16, 1, 2, 8, 8, 4).double()

        assert layer.decay.A_log.dtype == torch.float64

    def test_warns_when_its_parameters_arrive_in_bf16(self, caplog: pytest.LogCaptureFixture) -> None:
        decay = GatedDeltaNetDecay(4)

        # As FSDP at a granularity our applier does not see would gather them.
        decay.A_log = Parameter(torch.randn(4, dtype=BF16))

        with caplog.at_level(logging.WARNING):
            decay(torch.randn(3, 4))

        assert any("arrive in torch.bfloat16" in r.getMessage() for r in caplog.records)


    def test_parameters_stay_fp32_when_replaced_by_a_lower_precision_copy(self) -> None:
        # fairseq2's FSDP2 `summon_full_parameters`, in which validation runs,
        # gathers every parameter and replaces it by its copy in the
        # mixed-precision dtype with fairseq2's `apply_to_parameters`.
        layer = GatedDeltaNet(16, 1, 2, 8, 8, 4)

        values = layer.decay.A_log.detach().clone()

        apply_to_parameters(layer, lambda t: t.to(BF16) if isinstance(t, Parameter) else t)

        assert layer.in_proj_qkv.weight.dtype == BF16

        assert layer.decay.A_log.dtype == torch.float32 and layer.decay.dt_bias.dtype == torch.float32

        assert torch.equal(layer.decay.A_log, values)


class TestModelsInLowerPrecision:
    def test_model_built_in_bf16_keeps_fp32_decay(self) -> None:
        with set_dtype(BF16):
            model = create_qwen35_model(tiny_qwen35_config())

        assert _decay_dtypes(model) == {torch.float32}

        assert model.decoder_frontend.embed.weight.dtype == BF16

    def test_model_loaded_in_bf16_keeps_fp32_decay_and_exports_the_base_dtype(self, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        model = create_qwen35_model(config)

        save_hf_model(model, tmp_path / "base", config=config, dtype=BF16)

        loaded = load_hf_model(tmp_path / "base", dtype=BF16)

        assert _decay_dtypes(loaded) == {torch.float32}

        # The bf16 values of the checkpoint, exactly.
        for name, value in loaded.state_dict().items():
            if ".decay." in name:
                torch.testing.assert_close(value, model.state_dict()[name].to(BF16).float(), rtol=0, atol=0)

        save_hf_model(loaded, tmp_path / "export", base=tmp_path / "base")

        from safetensors import safe_open

        dtypes = set()

        for path in (tmp_path / "export").glob("*.safetensors"):
            with safe_open(path, "pt") as f:
                dtypes.update(f.get_tensor(k).dtype for k in f.keys() if k.endswith(("A_log", "dt_bias")))

        assert dtypes == {BF16}

    def test_autocast_keeps_decay_and_its_gradients_fp32(self) -> None:
        torch.manual_seed(0)

        layer = GatedDeltaNet(16, 1, 2, 8, 8, 4)

        x = torch.randn(2, 7, 16)

        with torch.autocast("cpu", dtype=BF16):
            y = layer(x, BatchLayout.of(x))

        y.float().square().sum().backward()

        for param in (layer.decay.A_log, layer.decay.dt_bias):
            assert param.grad is not None and param.grad.dtype == torch.float32
