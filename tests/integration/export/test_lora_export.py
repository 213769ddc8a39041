"""``fairseq2 lm export_hf --adapter`` and ``--merge`` on the checkpoint of
a LoRA run whose base is a transformers-made bf16 checkpoint: the PEFT
adapter gives our LoRA model's logits in ``PeftModel``, the merged model is
the float32 merge cast to bf16 bit for bit and gives our logits in
transformers, and a base of another architecture is refused. Then the same
for the adapter of a real LoRA SFT run (``fairseq2 lm instruction_finetune``
on CPU)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.nn import Module

import qwen35_fs2.cli.export_hf as export_cli
from export_testing import INPUT_IDS, fairseq2_logits, run_short_sft
from fairseq2.checkpoint import StandardCheckpointManager, StandardModelMetadataDumper
from fairseq2.device import CPU
from fairseq2.gang import create_fake_gangs
from fairseq2.nn.data_parallel import get_data_parallel_facade
from fairseq2.runtime.dependency import get_dependency_resolver, wire_object
from fairseq2.utils.structured import ValueConverter
from hf_reference import HfReferenceBatch, TinyQwen35Spec, read_safetensors_dir
from hf_reference.fixtures import TinyModelCache
from qwen35_fs2 import load_hf_model
from qwen35_fs2.cli.export_hf import main
from qwen35_fs2.hf.config import load_hf_config, qwen35_config_from_hf
from qwen35_fs2.lora import LORA_TARGET_MODULES, PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME, LoraConfig, apply_lora
from qwen35_fs2.lora.checkpoint import LoraCheckpointFacade, describe_lora_base, save_lora_base

pytestmark = pytest.mark.slow

# bf16, so that the default merged export rounds the float32 merge once; two
# key heads with two value heads each (the key-head grouping of
# `in_proj_qkv` rows is not the identity); both mixers; GQA.
_BASE = TinyQwen35Spec(
    layout="text",
    dtype="bfloat16",
    layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    seed=21,
    initializer_range=0.02,
)

_WIDE_BASE = TinyQwen35Spec(layout="text", dtype="bfloat16", hidden_size=96, seed=22)
"""Like ``_BASE`` but 96 wide: a base of another architecture."""

_LORA = LoraConfig(target_modules=list(LORA_TARGET_MODULES), r=4, alpha=8.0, rslora=True)

# The PEFT keys of the transformers model's projections.
_PEFT_PREFIX = "base_model.model."


@pytest.fixture(autouse=True)
def keep_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    # `main` configures the process's logging, which would drop caplog's handler.
    monkeypatch.setattr(export_cli, "configure_logging", lambda no_rich: None)


_VLM_BASE = TinyQwen35Spec(layout="vlm", seed=24)
"""A base in the released (vision-language) layout."""


@pytest.fixture(scope="module")
def bases(hf_tiny_models: TinyModelCache) -> dict[str, Path]:
    base, wide, vlm = hf_tiny_models.get_many([_BASE, _WIDE_BASE, _VLM_BASE])

    return {"base": base, "wide": wide, "vlm": vlm}


@pytest.fixture(scope="module")
def lora_run(bases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Module]:
    """A LoRA run of the base; returns its output directory and model."""
    run_dir = tmp_path_factory.mktemp("lora_run")

    return run_dir, _write_lora_run(bases["base"], run_dir, "qwen35")


def _write_lora_run(base_dir: Path, run_dir: Path, family: str) -> Module:
    """Writes the output directory of a LoRA run of ``base_dir`` as the recipe
    leaves it (a checkpoint of the float32 adapters on every target, saved by
    fairseq2's checkpoint manager through the facade the recipe sets, the
    record of the base and the adapters, and ``config.yaml`` with
    ``model.path`` and a ``lora`` section with another scale than the
    recorded one), its adapters random (B too, which training moves from
    zero); returns the model."""
    resolver = get_dependency_resolver()

    config = qwen35_config_from_hf(load_hf_config(base_dir))

    model = load_hf_model(base_dir, dtype=torch.float32)

    generator = torch.Generator().manual_seed(1)

    with torch.no_grad():
        for adapter in apply_lora(model, _LORA, config).values():
            for proj in (adapter.a_proj, adapter.b_proj):
                proj.weight.copy_(0.1 * torch.randn(proj.weight.shape, generator=generator))

    manager = wire_object(resolver, StandardCheckpointManager, output_dir=run_dir, gangs=create_fake_gangs(CPU))

    manager.save_model_only(3, LoraCheckpointFacade(get_data_parallel_facade(model)), blocking=True)

    wire_object(resolver, StandardModelMetadataDumper).dump(run_dir / "checkpoints", family, config)

    save_lora_base(run_dir / "checkpoints", describe_lora_base(base_dir, _LORA))

    # As after a resumption refused for other adapters: fairseq2 rewrote
    # config.yaml with them. The export must scale as the run trained (by
    # 8 / sqrt(4) = 4, not 24 / 4 = 6).
    lora = resolver.resolve(ValueConverter).unstructure(replace(_LORA, alpha=3.0 * _LORA.alpha, rslora=False))  # type: ignore[type-abstract]

    run_config = {"model": {"name": None, "path": str(base_dir), "family": family, "dtype": "float32"}, "lora": lora}

    (run_dir / "config.yaml").write_text(yaml.safe_dump(run_config))

    return model


@pytest.fixture(scope="module")
def adapter_dir(lora_run: tuple[Path, Module], tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir, _ = lora_run

    out_dir = tmp_path_factory.mktemp("exports") / "adapter"

    assert main([str(run_dir), str(out_dir), "--adapter"]) == 0

    return out_dir


def test_adapter_names_the_base_and_gives_our_logits_in_peft(bases: dict[str, Path], lora_run: tuple[Path, Module], adapter_dir: Path) -> None:
    _, model = lora_run

    peft_config = json.loads((adapter_dir / PEFT_CONFIG_NAME).read_text())

    assert peft_config["base_model_name_or_path"] == str(bases["base"])

    batch = HfReferenceBatch()

    expected = batch.logits(bases["base"], INPUT_IDS, adapter_dir=adapter_dir)

    base = batch.logits(bases["base"], INPUT_IDS)

    batch.run()

    assert (fairseq2_logits(model) - expected.result()).abs().max().item() <= 2e-5

    # The adapters change the logits far beyond the tolerance.
    assert (expected.result() - base.result()).abs().max().item() > 1e-2


def test_merge_is_the_float32_merge_cast_to_the_base_dtype_and_gives_our_logits(bases: dict[str, Path], lora_run: tuple[Path, Module], adapter_dir: Path, tmp_path: Path) -> None:
    run_dir, model = lora_run

    assert main([str(run_dir), str(tmp_path / "bf16"), "--merge"]) == 0
    assert main([str(run_dir), str(tmp_path / "fp32"), "--merge", "--dtype", "float32"]) == 0

    base = read_safetensors_dir(bases["base"])

    merged = read_safetensors_dir(tmp_path / "bf16")

    assert merged.keys() == base.keys()

    # Merged independently of the export: the base's weights and the PEFT
    # adapter's A and B (in the Hugging Face row order, which PEFT checks
    # above), in float32, as PEFT scales them.
    peft_tensors = load_file(adapter_dir / PEFT_WEIGHTS_NAME)

    scaling = _LORA.alpha / _LORA.r**0.5

    num_merged = 0

    for key, tensor in base.items():
        a = peft_tensors.get(_PEFT_PREFIX + key.removesuffix("weight") + "lora_A.weight")

        if a is None:
            expected = tensor
        else:
            b = peft_tensors[_PEFT_PREFIX + key.removesuffix("weight") + "lora_B.weight"]

            expected = (tensor.float() + (b.float() @ a.float()) * scaling).to(torch.bfloat16)

            num_merged += 1

        assert merged[key].dtype == torch.bfloat16
        assert torch.equal(merged[key], expected), key

    assert num_merged == len(peft_tensors) // 2 == 2 * (5 + 3) + 2 * (4 + 3)

    batch = HfReferenceBatch()

    logits = batch.logits(tmp_path / "fp32", INPUT_IDS)

    batch.run()

    assert (fairseq2_logits(model) - logits.result()).abs().max().item() <= 2e-5


def test_adapter_of_a_vision_language_base_warns_that_vllm_does_not_apply_it(bases: dict[str, Path], lora_run: tuple[Path, Module], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # vLLM serves such a base as its vision-language class, onto which it
    # loads the adapter's `model.layers.N` keys without applying them.
    vlm_run = tmp_path / "vlm_run"

    _write_lora_run(bases["vlm"], vlm_run, "qwen35")

    text_run, _ = lora_run

    with caplog.at_level(logging.WARNING, logger="fairseq2"):
        assert main([str(text_run), str(tmp_path / "text_adapter"), "--adapter"]) == 0

        assert "vllm-project/vllm#48019" not in caplog.text

        assert main([str(vlm_run), str(tmp_path / "vlm_adapter"), "--adapter"]) == 0

    assert f"{bases['vlm']} is a vision-language repository, which vLLM serves as `Qwen3_5ForConditionalGeneration`: vLLM loads this adapter onto it without applying it (vllm-project/vllm#48019)" in caplog.text


@pytest.mark.parametrize("flag", ["--adapter", "--merge"])
def test_fails_for_a_base_of_another_architecture_and_leaves_nothing(bases: dict[str, Path], lora_run: tuple[Path, Module], tmp_path: Path, caplog: pytest.LogCaptureFixture, flag: str) -> None:
    run_dir, _ = lora_run

    assert main([str(run_dir), str(tmp_path / "out"), flag, "--base", str(bases["wide"])]) == 1

    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

    assert len(errors) == 1
    assert "must have the architecture of the exported model" in errors[0]
    assert "hidden_size (base: 96, model: 64)" in errors[0]

    assert list(tmp_path.iterdir()) == []


def test_adapter_of_a_run_on_a_qwen3_next_base_is_refused_and_leaves_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # transformers' Qwen3-Next has other Gated DeltaNet projections, and PEFT
    # puts the shared expert's adapters on its routed experts: PEFT would
    # load part of the adapter and drop the rest without an error.
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    base_dir, run_dir = tmp_path / "qwen3_next", tmp_path / "run"

    next_config = Qwen3NextConfig(  # type: ignore[no-untyped-call]
        vocab_size=256, hidden_size=64, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True,
    )  # fmt: skip

    Qwen3NextForCausalLM(next_config).save_pretrained(base_dir)  # type: ignore[no-untyped-call]

    run_dir.mkdir()

    _write_lora_run(base_dir, run_dir, "qwen35_moe")

    # For the run's base (the default), and without a base: the run's base
    # is still Qwen3-Next.
    for options in ([], ["--no-base"]):
        caplog.clear()

        out_dir = tmp_path / "out"

        assert main([str(run_dir), str(out_dir), "--adapter", *options]) == 1

        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

        assert len(errors) == 1
        assert f"but {base_dir.resolve()} has `model_type` 'qwen3_next' instead" in errors[0]
        assert "Export the model with the adapters merged (`--merge`) instead." in errors[0]

        assert not out_dir.exists()


# The `qwen35_demo` arch (the real vocabulary, 128 wide, tied), text-only
# and fp32, as transformers 5.24 writes it.
_RUN_BASE = TinyQwen35Spec(
    layout="text",
    tie_word_embeddings=True,
    vocab_size=248_320,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    intermediate_size=384,
    seed=23,
)


def test_adapter_of_a_real_lora_sft_run_gives_its_logits_in_peft(hf_tiny_models: TinyModelCache, tmp_path: Path) -> None:
    base_dir = hf_tiny_models.get(_RUN_BASE)

    lora = {"target_modules": list(LORA_TARGET_MODULES), "r": 4, "alpha": 8.0}

    # Two fp32 steps, at a learning rate that moves B well away from zero.
    run_dir = run_short_sft(base_dir, tmp_path, lr=1e-2, num_steps=2, lora=lora)

    assert main([str(run_dir), str(tmp_path / "adapter"), "--adapter"]) == 0

    assert json.loads((tmp_path / "adapter" / PEFT_CONFIG_NAME).read_text())["base_model_name_or_path"] == str(base_dir)

    # Our LoRA model: the base, with the adapters as the run saved them, read
    # from its checkpoint file without the export's loader.
    (checkpoint_dir,) = run_dir.glob("*/checkpoints")

    saved = torch.load(checkpoint_dir / "step_2" / "model" / "pp_00" / "tp_00" / "sdp_00.pt", map_location="cpu", weights_only=True)

    model = load_hf_model(base_dir, dtype=torch.float32)

    apply_lora(model, LoraConfig(**lora), qwen35_config_from_hf(load_hf_config(base_dir)))

    # The adapters alone: three Gated DeltaNet layers (5 targets) and an
    # attention layer (4), each with an MLP (3).
    assert all(".lora." in key for key in saved)
    assert len(saved) == 2 * (3 * (5 + 3) + (4 + 3))
    assert all(tensor.abs().max() > 0.0 for key, tensor in saved.items())

    model.load_state_dict(saved, strict=False)

    batch = HfReferenceBatch()

    expected = batch.logits(base_dir, INPUT_IDS, adapter_dir=tmp_path / "adapter")

    base = batch.logits(base_dir, INPUT_IDS)

    batch.run()

    assert (fairseq2_logits(model) - expected.result()).abs().max().item() <= 2e-5

    # Two steps of training moved the logits beyond the tolerance.
    assert (expected.result() - base.result()).abs().max().item() > 1e-3
