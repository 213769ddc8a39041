"""HF -> fairseq2 -> HF reproduces checkpoints written by transformers 5.24:
the same keys and bitwise-equal tensors, in fp32 and bf16, dense and MoE,
both expert layouts, the vision tower and MTP head copied through."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from export_testing import (
    DENSE_TEXT,
    DENSE_VLM,
    DENSE_VLM_BF16_TIED,
    MOE_TEXT_PER_EXPERT_BF16,
    MOE_VLM,
    read_config,
)
from hf_reference import TinyQwen35Spec, read_safetensors_dir
from qwen35_fs2 import load_hf_model, qwen35_config_from_hf, save_hf_model

pytestmark = pytest.mark.slow

_SPECS = {
    "dense-vlm-mtp-fp32": DENSE_VLM,
    "dense-vlm-mtp-tied-bf16": DENSE_VLM_BF16_TIED,
    "dense-text-fp32": DENSE_TEXT,
    "moe-vlm-mtp-fused-fp32": MOE_VLM,
    "moe-text-per-expert-bf16": MOE_TEXT_PER_EXPERT_BF16,
}


@pytest.mark.parametrize("spec", _SPECS.values(), ids=_SPECS.keys())
def test_export_reproduces_the_base_bit_for_bit(spec: TinyQwen35Spec, base_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path) -> None:
    base_dir = base_dirs[spec]

    save_hf_model(load_hf_model(base_dir), tmp_path / "out", base=base_dir)

    expected = read_safetensors_dir(base_dir)
    actual = read_safetensors_dir(tmp_path / "out")

    assert actual.keys() == expected.keys(), f"Missing in round trip: {sorted(expected.keys() - actual.keys())}. Extra in round trip: {sorted(actual.keys() - expected.keys())}."

    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key

        # Bitwise, norms included: no +1 on import, no -1 on export.
        assert torch.equal(actual[key].view(torch.uint8), tensor.view(torch.uint8)), key

    assert any(k.startswith("mtp.") for k in actual) == spec.add_mtp
    assert any(k.startswith("model.visual.") for k in actual) == (spec.layout == "vlm")

    expected_config = read_config(base_dir)
    actual_config = read_config(tmp_path / "out")

    # The export counts the MTP layers it holds; transformers writes no
    # `mtp_num_hidden_layers`, read as 0.
    expected_model_config = replace(qwen35_config_from_hf(expected_config), mtp_num_layers=int(spec.add_mtp))

    assert qwen35_config_from_hf(actual_config) == expected_model_config

    assert actual_config["architectures"] == expected_config["architectures"]
    assert actual_config.get("vision_config") == expected_config.get("vision_config")

    # Every key transformers wrote is kept, with its value unless it is one
    # this package sets (the MTP layer count, which transformers omits).
    def flatten(doc: dict[str, object], prefix: str = "") -> dict[str, object]:
        flat: dict[str, object] = {}

        for key, value in doc.items():
            if isinstance(value, dict):
                flat.update(flatten(value, f"{prefix}{key}."))
            else:
                flat[prefix + key] = value

        return flat

    expected_flat = flatten(expected_config)
    actual_flat = flatten(actual_config)

    assert expected_flat.keys() <= actual_flat.keys()

    assert {k: v for k, v in expected_flat.items() if actual_flat[k] != v} == {}
