"""A LoRA model's exported PEFT adapter, loaded with ``PeftModel.from_pretrained``
onto transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` (the
overlay), gives our model's logits; also for a base in the released
(vision-language) layout, which ``AutoModelForCausalLM`` loads as the
text-only model the adapter's keys name."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fairseq2.nn import BatchLayout

from hf_reference import HfReferenceBatch, TinyQwen35Spec
from hf_reference.fixtures import TinyModelCache
from hf_reference.tensors import random_padded_batch
from qwen35_fs2 import load_hf_model, qwen35_config_from_hf
from qwen35_fs2.hf.config import load_hf_config
from qwen35_fs2.lora import (
    LORA_TARGET_MODULES,
    LORA_TARGET_PARAMETERS,
    LoraConfig,
    apply_lora,
    lora_parameters,
    save_peft_adapter,
)

_SEQ_LENS = [1, 37, 70]

# Two key heads with two value heads each, so that the key-head grouping of
# `in_proj_qkv` rows is not the identity; both mixers; untied, with GQA. The
# MoE model's `gate_proj`/`up_proj`/`down_proj` are its shared experts'.
_SPECS: dict[str, TinyQwen35Spec] = {
    "dense": TinyQwen35Spec(
        layout="text",
        num_hidden_layers=4,
        layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
        num_attention_heads=4,
        num_key_value_heads=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        seed=11,
        initializer_range=0.02,
    ),
    "moe": TinyQwen35Spec(
        layout="text",
        moe=True,
        num_hidden_layers=4,
        layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        seed=12,
        initializer_range=0.02,
    ),
}

# The released layout (`model.language_model.*`, a vision tower).
_SPECS["dense-vlm"] = replace(_SPECS["dense"], layout="vlm", seed=13)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "rslora", "target_parameters"),
    [
        ("dense", False, []),
        ("dense", True, []),
        ("dense-vlm", False, []),
        # Both expert weights: PEFT nests their adapters on the experts module.
        ("moe", False, list(LORA_TARGET_PARAMETERS)),
        ("moe", True, ["mlp.experts.gate_up_proj"]),
    ],
)
def test_exported_adapter_gives_our_logits_in_peft(
    name: str, rslora: bool, target_parameters: list[str], hf_tiny_models: TinyModelCache, tmp_path: Path
) -> None:
    spec = _SPECS[name]

    model_dir = hf_tiny_models.get(spec)

    model_config = qwen35_config_from_hf(load_hf_config(model_dir))

    model = load_hf_model(model_dir, dtype=torch.float32).eval()

    lora_config = LoraConfig(
        target_modules=list(LORA_TARGET_MODULES), target_parameters=target_parameters, r=4, alpha=8.0, rslora=rslora
    )

    apply_lora(model, lora_config, model_config)

    # B starts at zero; random B (and A) make every adapter count.
    generator = torch.Generator().manual_seed(1)

    with torch.no_grad():
        for param in lora_parameters(model):
            param.copy_(0.1 * torch.randn(param.shape, generator=generator))

    adapter_dir = tmp_path / "adapter"

    save_peft_adapter(model, adapter_dir, config=lora_config, model_config=model_config, base_model_name_or_path=str(model_dir))

    seqs, mask = random_padded_batch(spec.vocab_size, _SEQ_LENS)

    batch = HfReferenceBatch()

    expected = batch.logits(model_dir, seqs, attention_mask=mask, adapter_dir=adapter_dir)

    base = batch.logits(model_dir, seqs, attention_mask=mask)

    batch.run()

    with torch.no_grad():
        logits = model(seqs, BatchLayout(seqs.shape, _SEQ_LENS))

    for idx, n in enumerate(_SEQ_LENS):
        diff = (logits[idx, :n] - expected.result()[idx, :n]).abs().max().item()

        assert diff <= 2e-5, f"seq_len={n}: max abs diff {diff:.3g} > 2e-5"

        # The adapters change the logits far beyond the tolerance.
        assert (expected.result()[idx, :n] - base.result()[idx, :n]).abs().max().item() > 1e-2
