"""The MTP head goes from a Hugging Face checkpoint into our model and back
out bit for bit: both key layouts of the head (``mtp.*`` and the
``model.language_model.mtp.*`` of some re-exports), dense and MoE, without a
base (text-only, per-expert experts) and with one (the base's layout and
dtype). The model's head is exported, not the base's, unless asked.

The checkpoints are transformers 5.24's tiny models with the released
checkpoints' ``mtp.*`` tensors added by the reference harness (transformers
neither models nor saves them), and ``mtp_num_hidden_layers: 1`` added to
their config.json here, as the released config.json files have it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import Tensor

from export_testing import DENSE_VLM, DENSE_VLM_BF16_TIED, MOE_VLM, read_config
from hf_reference import TinyQwen35Spec, read_safetensors_dir
from mtp_testing import NESTED_PREFIX, with_mtp_config
from qwen35_fs2 import load_hf_model, qwen35_config_from_hf, save_hf_model
from qwen35_fs2.nn.mtp import Qwen35MultiTokenPredictor

pytestmark = pytest.mark.slow


def _mtp_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The MTP head of a checkpoint, in either layout, under ``mtp.``."""
    return {k.removeprefix(NESTED_PREFIX): v for k, v in tensors.items() if k.removeprefix(NESTED_PREFIX).startswith("mtp.")}


def _per_expert(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Splits fused expert tensors (``gate_up_proj`` ``[E, 2I, H]``, gate rows
    first; ``down_proj`` ``[E, H, I]``) into transformers' per-expert
    tensors, as an export without a base writes them."""
    output = {}

    for key, tensor in tensors.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")

            inner_dim = tensor.size(1) // 2

            for e in range(tensor.size(0)):
                output[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :inner_dim]
                output[f"{prefix}{e}.up_proj.weight"] = tensor[e, inner_dim:]
        elif key.endswith(".mlp.experts.down_proj"):
            prefix = key.removesuffix("down_proj")

            for e in range(tensor.size(0)):
                output[f"{prefix}{e}.down_proj.weight"] = tensor[e]
        else:
            output[key] = tensor

    return output


def _assert_bitwise_equal(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys(), f"Missing: {sorted(expected.keys() - actual.keys())}. Extra: {sorted(actual.keys() - expected.keys())}."

    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key

        assert torch.equal(actual[key].contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), key


_SPECS = {"dense": DENSE_VLM, "moe-fused": MOE_VLM}


class TestMtpRoundTrip:
    @pytest.mark.parametrize("nested", [False, True], ids=["mtp", "language-model-mtp"])
    @pytest.mark.parametrize("spec", _SPECS.values(), ids=_SPECS.keys())
    def test_export_without_base_keeps_every_mtp_tensor(
        self, spec: TinyQwen35Spec, nested: bool, base_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path
    ) -> None:
        checkpoint = with_mtp_config(base_dirs[spec], tmp_path / "ckpt", nested=nested)

        model = load_hf_model(checkpoint)

        assert isinstance(model.mtp, Qwen35MultiTokenPredictor)

        config = qwen35_config_from_hf(read_config(checkpoint))

        save_hf_model(model, tmp_path / "out", config=config)

        expected = _per_expert(_mtp_tensors(read_safetensors_dir(checkpoint)))

        actual = read_safetensors_dir(tmp_path / "out")

        # Text-only: the head is at the top level.
        _assert_bitwise_equal({k: v for k, v in actual.items() if k.startswith("mtp.")}, expected)

        assert not any(k.startswith(NESTED_PREFIX) for k in actual)

        assert read_config(tmp_path / "out")["mtp_num_hidden_layers"] == 1

    @pytest.mark.parametrize("nested", [False, True], ids=["mtp", "language-model-mtp"])
    @pytest.mark.parametrize("spec", [DENSE_VLM_BF16_TIED, MOE_VLM], ids=["dense-bf16-tied", "moe-fused"])
    def test_export_with_base_writes_the_head_in_the_layout_and_dtype_of_the_base(
        self, spec: TinyQwen35Spec, nested: bool, base_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path
    ) -> None:
        checkpoint = with_mtp_config(base_dirs[spec], tmp_path / "ckpt", nested=nested)

        # Loaded in fp32 whatever the checkpoint's dtype.
        model = load_hf_model(checkpoint, dtype=torch.float32)

        save_hf_model(model, tmp_path / "out", base=checkpoint)

        expected = read_safetensors_dir(checkpoint)

        actual = read_safetensors_dir(tmp_path / "out")

        _assert_bitwise_equal(actual, expected)

        assert read_config(tmp_path / "out")["text_config"]["mtp_num_hidden_layers"] == 1

    def test_export_with_base_writes_the_models_head_unless_asked_for_the_bases(
        self, base_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path
    ) -> None:
        checkpoint = with_mtp_config(base_dirs[DENSE_VLM], tmp_path / "ckpt", nested=False)

        model = load_hf_model(checkpoint)

        with torch.no_grad():
            model.mtp.fc.weight.add_(1.0)
            model.mtp.layers[0].ffn.output_proj.weight.mul_(2.0)

        base = read_safetensors_dir(checkpoint)

        save_hf_model(model, tmp_path / "trained", base=checkpoint)

        trained = read_safetensors_dir(tmp_path / "trained")

        torch.testing.assert_close(trained["mtp.fc.weight"], base["mtp.fc.weight"] + 1.0, rtol=0, atol=0)
        torch.testing.assert_close(trained["mtp.layers.0.mlp.down_proj.weight"], base["mtp.layers.0.mlp.down_proj.weight"] * 2.0, rtol=0, atol=0)

        save_hf_model(model, tmp_path / "kept", base=checkpoint, keep_base_mtp=True)

        kept = read_safetensors_dir(tmp_path / "kept")

        _assert_bitwise_equal(_mtp_tensors(kept), _mtp_tensors(base))

    def test_checkpoint_without_the_tensors_loads_without_the_head_and_exports_none(
        self, base_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        # What transformers' `save_pretrained` leaves: the config's count,
        # no tensors.
        checkpoint = with_mtp_config(base_dirs[DENSE_VLM], tmp_path / "ckpt", nested=False, mtp=False)

        with caplog.at_level(logging.INFO):
            model = load_hf_model(checkpoint)

        assert not hasattr(model, "mtp")

        assert "has no MTP head" in caplog.text

        save_hf_model(model, tmp_path / "out", base=checkpoint)

        assert not any(k.startswith("mtp.") for k in read_safetensors_dir(tmp_path / "out"))

        assert read_config(tmp_path / "out")["text_config"]["mtp_num_hidden_layers"] == 0
