"""Checks that the harness drives the real transformers reference as documented.

Every test here runs its own batch of the reference; a module's batches
share one reference subprocess.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from hf_reference import (
    HF_REFERENCE_VERSION,
    HfReferenceBatch,
    HfReferenceError,
    TinyQwen35Spec,
    hf_greedy_generate,
    hf_logits,
)
from hf_reference import runner
from hf_reference.fixtures import TinyModelCache

pytestmark = pytest.mark.slow

DENSE_TEXT = TinyQwen35Spec(layout="text")
DENSE_VLM = TinyQwen35Spec(layout="vlm")
MOE_FUSED_VLM_WITH_MTP = TinyQwen35Spec(layout="vlm", moe=True, add_mtp=True)
MOE_PER_EXPERT_TEXT = TinyQwen35Spec(layout="text", moe=True, expert_layout="per_expert")
TIED_BF16_TEXT_WITH_MTP = TinyQwen35Spec(layout="text", tie_word_embeddings=True, dtype="bfloat16", add_mtp=True)
TIED_BF16_VLM = TinyQwen35Spec(layout="vlm", tie_word_embeddings=True, dtype="bfloat16")

ALL_SPECS = (DENSE_TEXT, DENSE_VLM, MOE_FUSED_VLM_WITH_MTP, MOE_PER_EXPERT_TEXT, TIED_BF16_TEXT_WITH_MTP, TIED_BF16_VLM)

INPUT_IDS = torch.tensor([[5, 9, 17, 3, 200, 11, 7, 42, 99], [1, 2, 3, 4, 5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def model_dirs(hf_tiny_models: TinyModelCache) -> dict[TinyQwen35Spec, Path]:
    # One subprocess builds every checkpoint of this module.
    return dict(zip(ALL_SPECS, hf_tiny_models.get_many(ALL_SPECS), strict=True))


def load_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def load_config(model_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())

    return config


class TestMakeTinyHfModel:
    def test_text_layout_saves_causal_lm_keys(self, model_dirs: dict[TinyQwen35Spec, Path]) -> None:
        model_dir = model_dirs[DENSE_TEXT]

        keys = load_tensors(model_dir).keys()

        assert all(k.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")) for k in keys)

        assert "lm_head.weight" in keys

        for idx, layer_type in enumerate(DENSE_TEXT.resolved_layer_types()):
            mixer = "linear_attn" if layer_type == "linear_attention" else "self_attn"

            assert {k.split(".")[3] for k in keys if k.startswith(f"model.layers.{idx}.")} == {
                mixer, "mlp", "input_layernorm", "post_attention_layernorm"
            }  # fmt: skip

        config = load_config(model_dir)

        assert config["architectures"] == ["Qwen3_5ForCausalLM"]
        assert config["transformers_version"] == HF_REFERENCE_VERSION
        assert config["layer_types"] == list(DENSE_TEXT.resolved_layer_types())

    def test_vlm_layout_saves_language_model_visual_and_lm_head_keys(
        self, model_dirs: dict[TinyQwen35Spec, Path]
    ) -> None:
        model_dir = model_dirs[DENSE_VLM]

        keys = load_tensors(model_dir).keys()

        prefixes = {
            next(p for p in ("model.language_model.", "model.visual.", "lm_head.") if k.startswith(p)) for k in keys
        }

        assert prefixes == {"model.language_model.", "model.visual.", "lm_head."}

        text_keys = {k.removeprefix("model.language_model.") for k in keys if k.startswith("model.language_model.")}

        assert text_keys == {
            k.removeprefix("model.") for k in load_tensors(model_dirs[DENSE_TEXT]) if k.startswith("model.")
        }

        config = load_config(model_dir)

        assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
        assert config["text_config"]["model_type"] == "qwen3_5_text"

    def test_constant_initialised_parameters_are_randomized(self, model_dirs: dict[TinyQwen35Spec, Path]) -> None:
        tensors = load_tensors(model_dirs[DENSE_TEXT])

        zero_centred_norms = [
            v
            for k, v in tensors.items()
            if k.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or k == "model.norm.weight"
        ]

        # 4 layers x 2 layer norms, one q_norm and k_norm, the final norm.
        assert len(zero_centred_norms) == 11

        for weight in zero_centred_norms:
            assert weight.abs().mean() < 0.2 and weight.std() > 0.05

        gated_norms = [v for k, v in tensors.items() if k.endswith("linear_attn.norm.weight")]

        assert len(gated_norms) == 3

        for weight in gated_norms:
            assert (weight.mean() - 1.0).abs() < 0.1 and weight.std() > 0.02

        for key, value in tensors.items():
            if key.endswith("linear_attn.A_log"):
                assert value.exp().min() >= 0.0099 and value.exp().max() <= 16.001 and value.std() > 0
            elif key.endswith("linear_attn.dt_bias"):
                time_steps = torch.nn.functional.softplus(value)

                assert time_steps.min() >= 0.99e-3 and time_steps.max() <= 1.01e-1 and value.std() > 0

    def test_expert_layouts_hold_the_same_experts(self, model_dirs: dict[TinyQwen35Spec, Path]) -> None:
        fused = load_tensors(model_dirs[MOE_FUSED_VLM_WITH_MTP])
        per_expert = load_tensors(model_dirs[MOE_PER_EXPERT_TEXT])

        spec = MOE_PER_EXPERT_TEXT

        num_experts, inner_dim, model_dim = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size

        assert not any(".experts." in k and k.split(".experts.")[1][0].isdigit() for k in fused)
        assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in per_expert)

        for layer_idx in range(spec.num_hidden_layers):
            fused_prefix = f"model.language_model.layers.{layer_idx}.mlp.experts."

            gate_up = fused[fused_prefix + "gate_up_proj"]
            down = fused[fused_prefix + "down_proj"]

            assert gate_up.shape == (num_experts, 2 * inner_dim, model_dim)
            assert down.shape == (num_experts, model_dim, inner_dim)

            for expert_idx in range(num_experts):
                prefix = f"model.layers.{layer_idx}.mlp.experts.{expert_idx}."

                assert torch.equal(gate_up[expert_idx, :inner_dim], per_expert[prefix + "gate_proj.weight"])
                assert torch.equal(gate_up[expert_idx, inner_dim:], per_expert[prefix + "up_proj.weight"])
                assert torch.equal(down[expert_idx], per_expert[prefix + "down_proj.weight"])

    def test_mtp_tensors_have_the_released_names_and_shapes(self, model_dirs: dict[TinyQwen35Spec, Path]) -> None:
        spec = MOE_FUSED_VLM_WITH_MTP

        model_dim = spec.hidden_size

        mtp = {k: v.shape for k, v in load_tensors(model_dirs[spec]).items() if k.startswith("mtp.")}

        assert mtp["mtp.fc.weight"] == (model_dim, 2 * model_dim)

        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            assert mtp[f"mtp.{name}.weight"] == (model_dim,)

        assert mtp["mtp.layers.0.self_attn.q_proj.weight"] == (2 * spec.num_attention_heads * spec.head_dim, model_dim)
        assert mtp["mtp.layers.0.mlp.experts.gate_up_proj"] == (
            spec.num_experts, 2 * spec.moe_intermediate_size, model_dim
        )  # fmt: skip

        assert not any(".linear_attn." in k for k in mtp)

        dense_mtp = {k for k in load_tensors(model_dirs[TIED_BF16_TEXT_WITH_MTP]) if k.startswith("mtp.layers.0.mlp.")}

        assert dense_mtp == {f"mtp.layers.0.mlp.{name}_proj.weight" for name in ("gate", "up", "down")}

    @pytest.mark.parametrize("spec", [TIED_BF16_TEXT_WITH_MTP, TIED_BF16_VLM])
    def test_tied_bfloat16_checkpoint_has_no_lm_head_and_bfloat16_tensors(
        self, model_dirs: dict[TinyQwen35Spec, Path], spec: TinyQwen35Spec
    ) -> None:
        model_dir = model_dirs[spec]

        tensors = load_tensors(model_dir)

        assert "lm_head.weight" not in tensors

        assert {v.dtype for v in tensors.values()} == {torch.bfloat16}

        config = load_config(model_dir)

        assert config["tie_word_embeddings"] is True
        assert config["dtype"] == "bfloat16"


class TestHfLogits:
    def test_layouts_expert_layouts_and_mtp_do_not_change_the_logits(
        self, model_dirs: dict[TinyQwen35Spec, Path]
    ) -> None:
        batch = HfReferenceBatch()

        dense_text = batch.logits(model_dirs[DENSE_TEXT], INPUT_IDS)
        dense_vlm = batch.logits(model_dirs[DENSE_VLM], INPUT_IDS)
        dense_vlm_full = batch.logits(model_dirs[DENSE_VLM], INPUT_IDS, model_class="conditional_generation")
        moe_fused_vlm = batch.logits(model_dirs[MOE_FUSED_VLM_WITH_MTP], INPUT_IDS)
        moe_per_expert_text = batch.logits(model_dirs[MOE_PER_EXPERT_TEXT], INPUT_IDS)
        tied_text = batch.logits(model_dirs[TIED_BF16_TEXT_WITH_MTP], INPUT_IDS)
        tied_vlm = batch.logits(model_dirs[TIED_BF16_VLM], INPUT_IDS)

        batch.run()

        assert dense_text.result().shape == (*INPUT_IDS.shape, DENSE_TEXT.vocab_size)
        assert dense_text.result().dtype == torch.float32

        assert_close(dense_vlm.result(), dense_text.result())
        assert_close(dense_vlm_full.result(), dense_text.result())
        assert_close(moe_fused_vlm.result(), moe_per_expert_text.result())
        assert_close(tied_vlm.result(), tied_text.result())

        # The comparisons above are not vacuous: different models differ.
        assert (moe_fused_vlm.result() - dense_text.result()).abs().max() > 0.1

    def test_attention_mask_reaches_the_model(self, model_dirs: dict[TinyQwen35Spec, Path]) -> None:
        model_dir = model_dirs[MOE_FUSED_VLM_WITH_MTP]

        row, pad = [5, 9, 17, 3, 200, 11, 7], [0, 0, 0]

        batch = HfReferenceBatch()

        alone = batch.logits(model_dir, [row])

        right_padded = batch.logits(
            model_dir, [row + pad, pad + row], attention_mask=[[1] * 7 + [0] * 3, [0] * 3 + [1] * 7]
        )

        left_padded_unmasked = batch.logits(model_dir, [pad + row])

        batch.run()

        expected = alone.result()[0]

        assert_close(right_padded.result()[0, :7], expected, rtol=0, atol=1e-5)

        # Left padding is exact in Qwen3.5 (RoPE is relative, GDN zeroes
        # masked inputs), so it shows that the mask is applied ...
        assert_close(right_padded.result()[1, 3:], expected, rtol=0, atol=1e-5)

        # ... whereas without it the pad tokens change the logits.
        assert (left_padded_unmasked.result()[0, 3:] - expected).abs().max() > 0.1

    def test_failure_raises_error_with_the_worker_stderr(self, tmp_path: Path) -> None:
        with pytest.raises(HfReferenceError, match=r"(?s)exit code 1.*Traceback.*missing_model"):
            hf_logits(tmp_path / "missing_model", INPUT_IDS)


class TestReferenceSubprocess:
    """The batches of a test process share one reference subprocess
    (``runner._server``, private to the harness)."""

    def test_batches_share_the_subprocess_but_not_its_models(self, tmp_path: Path) -> None:
        model_dir = tmp_path / "model"

        first = HfReferenceBatch()

        first.make_tiny_model(model_dir, TinyQwen35Spec(layout="text", seed=1))

        before = first.logits(model_dir, INPUT_IDS)

        first.run()

        assert runner._server is not None

        pid = runner._server.pid

        # Other weights written here, behind the subprocess's back, then read
        # by another batch: a model kept from the first would give its logits again.
        tensors = load_tensors(model_dir)

        tensors["lm_head.weight"] = -tensors["lm_head.weight"]

        save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})

        after = hf_logits(model_dir, INPUT_IDS)

        assert runner._server.pid == pid

        assert (after - before.result()).abs().max() > 0.1

    def test_a_failed_batch_ends_its_subprocess_and_the_next_batch_starts_one(
        self, model_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path
    ) -> None:
        expected = hf_logits(model_dirs[DENSE_TEXT], INPUT_IDS)

        assert runner._server is not None

        pid = runner._server.pid

        with pytest.raises(HfReferenceError, match="missing_model"):
            hf_logits(tmp_path / "missing_model", INPUT_IDS)

        assert_close(hf_logits(model_dirs[DENSE_TEXT], INPUT_IDS), expected, rtol=0, atol=0)

        assert runner._server.pid != pid


PROMPTS = [[5, 9, 17], [1, 2, 3, 4, 5, 6]]

MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def generated(model_dirs: dict[TinyQwen35Spec, Path]) -> list[list[int]]:
    return hf_greedy_generate(model_dirs[MOE_FUSED_VLM_WITH_MTP], PROMPTS, MAX_NEW_TOKENS)


class TestHfGreedyGenerate:
    def test_tokens_are_the_argmax_of_the_full_forward_logits(
        self, model_dirs: dict[TinyQwen35Spec, Path], generated: list[list[int]]
    ) -> None:
        assert [len(tokens) for tokens in generated] == [MAX_NEW_TOKENS] * len(PROMPTS)

        batch = HfReferenceBatch()

        # Teacher-forced on its own output, the full forward pass must pick the
        # same tokens as the cached, step-by-step decoding.
        logits = [
            batch.logits(model_dirs[MOE_FUSED_VLM_WITH_MTP], [prompt + tokens])
            for prompt, tokens in zip(PROMPTS, generated, strict=True)
        ]

        batch.run()

        for prompt, tokens, pending in zip(PROMPTS, generated, logits, strict=True):
            argmax = pending.result()[0, len(prompt) - 1 : -1].argmax(dim=-1)

            assert argmax.tolist() == tokens

    def test_eos_token_stops_generation(
        self, model_dirs: dict[TinyQwen35Spec, Path], generated: list[list[int]]
    ) -> None:
        tokens = generated[0]

        eos_idx = 2

        eos_token_id = tokens[eos_idx]

        stopped = hf_greedy_generate(
            model_dirs[MOE_FUSED_VLM_WITH_MTP], [PROMPTS[0]], MAX_NEW_TOKENS, eos_token_id=eos_token_id
        )

        assert stopped == [tokens[: tokens.index(eos_token_id) + 1]]
