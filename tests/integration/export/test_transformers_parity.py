"""Exports of fine-tuned models load in transformers 5.24 (as the
ConditionalGeneration class and as ``AutoModelForCausalLM``) and give the
logits of the fairseq2 model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from export_testing import DENSE_VLM, DENSE_VLM_BF16_TIED, INPUT_IDS, MOE_VLM, fairseq2_logits, fine_tune, read_config
from hf_reference import HfReferenceBatch, ModelClass, Pending, TinyQwen35Spec, read_safetensors_dir
from qwen35_fs2 import load_hf_model, qwen35_config_from_hf, save_hf_model
from qwen35_fs2.hf.config import load_hf_config

pytestmark = pytest.mark.slow

# fp32 on CPU; the largest difference measured is 6e-6.
_ATOL = 2e-5

# (base, export options, the classes to load it as)
_CASES: dict[str, tuple[TinyQwen35Spec, dict[str, object], tuple[ModelClass, ...]]] = {
    "dense-vlm": (DENSE_VLM, {}, ("conditional_generation", "auto")),
    "dense-vlm-tied": (DENSE_VLM_BF16_TIED, {"dtype": torch.float32}, ("conditional_generation", "auto")),
    "dense-text-only": (DENSE_VLM, {"text_only": True}, ("auto",)),
    "dense-no-base": (DENSE_VLM, {"base": None}, ("auto",)),
    "moe-vlm-fused": (MOE_VLM, {}, ("conditional_generation", "auto")),
    "moe-no-base-per-expert": (MOE_VLM, {"base": None}, ("auto",)),
}


@pytest.fixture(scope="module")
def results(base_dirs: dict[TinyQwen35Spec, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Tensor, dict[ModelClass, Pending[Tensor]]]]:
    """Exports each case and runs all of transformers' forward passes in one
    subprocess."""
    batch = HfReferenceBatch()

    results = {}

    for name, (spec, options, model_classes) in _CASES.items():
        base_dir = base_dirs[spec]

        model = fine_tune(load_hf_model(base_dir))

        out_dir = tmp_path_factory.mktemp(name) / "hf"

        kwargs: dict[str, object] = {"base": base_dir, **options}

        if kwargs["base"] is None:
            kwargs["config"] = qwen35_config_from_hf(load_hf_config(base_dir))

        save_hf_model(model, out_dir, **kwargs)  # type: ignore[arg-type]

        pending = {kls: batch.logits(out_dir, INPUT_IDS, model_class=kls) for kls in model_classes}

        results[name] = (out_dir, fairseq2_logits(model), pending)

    batch.run()

    return results


@pytest.mark.parametrize("case", _CASES.keys())
def test_transformers_logits_equal_fairseq2_logits(case: str, results: dict[str, tuple[Path, Tensor, dict[ModelClass, Pending[Tensor]]]]) -> None:
    _, expected, pending = results[case]

    for model_class, logits in pending.items():
        max_diff = (logits.result() - expected).abs().max().item()

        assert max_diff <= _ATOL, f"{case} as {model_class}: max |diff| = {max_diff:.3g}"


def test_text_only_and_base_less_exports_have_the_text_layout(results: dict[str, tuple[Path, Tensor, dict[ModelClass, Pending[Tensor]]]]) -> None:
    for case in ("dense-text-only", "dense-no-base", "moe-no-base-per-expert"):
        out_dir = results[case][0]

        keys = read_safetensors_dir(out_dir).keys()

        assert not any(k.startswith(("model.visual.", "model.language_model.")) for k in keys), case
        assert "text_config" not in read_config(out_dir)

    # The MTP head is kept without the vision tower, but needs a base.
    assert any(k.startswith("mtp.") for k in read_safetensors_dir(results["dense-text-only"][0]))
    assert not any(k.startswith("mtp.") for k in read_safetensors_dir(results["dense-no-base"][0]))

    # Per-expert tensors without a base, as transformers 5.24 writes them.
    moe_keys = read_safetensors_dir(results["moe-no-base-per-expert"][0]).keys()

    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in moe_keys
    assert "model.layers.0.mlp.experts.gate_up_proj" not in moe_keys
