"""After a tiny CPU SFT run (``fairseq2 lm instruction_finetune`` with
``regime.export_hugging_face: true``), ``fairseq2 lm export_hf`` exports the
fine-tuned weights, and transformers generates what fairseq2 generates."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from torch import Tensor

from fairseq2.assets import AssetCard
from fairseq2.data.tokenizers import load_tokenizer
from fairseq2.generation.sampling import SamplingSequenceGenerator, TopKSampler
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout

from export_testing import read_config, run_fairseq2, run_short_sft
from hf_reference import TinyQwen35Spec, hf_greedy_generate, read_safetensors_dir
from hf_reference.fixtures import TinyModelCache
from qwen35_fs2.models.qwen35 import get_qwen35_model_hub
from qwen35_fs2.hf.export.tensors import to_hg_state_dict
from scratch import scratch_dir

pytestmark = pytest.mark.slow

# The `qwen35_demo` arch (the real vocabulary, 128 wide) in the released
# layout, with an MTP head, tied, bf16, as transformers 5.24 writes it.
_BASE = TinyQwen35Spec(
    layout="vlm",
    add_mtp=True,
    tie_word_embeddings=True,
    dtype="bfloat16",
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
    seed=11,
)

_NUM_STEPS = 2

_MAX_NEW_TOKENS = 32

_PROMPTS = (
    "<|im_start|>user\nNatalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWeng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?<|im_end|>\n<|im_start|>assistant\n",
)


@pytest.fixture(scope="module")
def sft_run(hf_tiny_models: TinyModelCache, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """Fine-tunes the base for a few steps on CPU; returns the base and the
    run's output directory."""
    base_dir = hf_tiny_models.get(_BASE)

    with scratch_dir(tmp_path_factory, "sft") as tmp_dir:
        run_dir = run_short_sft(base_dir, tmp_dir, lr=1e-3, num_steps=_NUM_STEPS, export_hugging_face=True)

        yield base_dir, run_dir


@pytest.fixture(scope="module")
def exports(sft_run: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    _, run_dir = sft_run

    with scratch_dir(tmp_path_factory, "exports") as out_dir:
        run_fairseq2("lm", "export_hf", str(run_dir), str(out_dir / "default"))
        run_fairseq2("lm", "export_hf", str(run_dir), str(out_dir / "fp32"), "--dtype", "float32")

        yield {"default": out_dir / "default", "fp32": out_dir / "fp32"}


def _checkpoint_dir(run_dir: Path) -> Path:
    # The recipe writes into a sweep directory of its output directory.
    (checkpoint_dir,) = run_dir.glob("*/checkpoints")

    return checkpoint_dir


def _fine_tuned_card(run_dir: Path) -> AssetCard:
    """The card of the last checkpoint, as fairseq2 makes it."""
    checkpoint_dir = _checkpoint_dir(run_dir)

    metadata = yaml.safe_load((checkpoint_dir / "model.yaml").read_text())

    return AssetCard(
        "fine_tuned",
        {
            "name": "fine_tuned",
            "model_family": "qwen35",
            "model_config": metadata["model_config"],
            "checkpoint": str(checkpoint_dir / f"step_{_NUM_STEPS}" / "model"),
        },
    )


def _load_fine_tuned_model(run_dir: Path) -> TransformerLM:
    card = _fine_tuned_card(run_dir)

    return get_qwen35_model_hub().load_model(card, device=torch.device("cpu"), dtype=torch.float32).eval()


def test_exports_the_fine_tuned_weights_in_the_base_layout(sft_run: tuple[Path, Path], exports: dict[str, Path]) -> None:
    base_dir, run_dir = sft_run

    model = _load_fine_tuned_model(run_dir)

    base = read_safetensors_dir(base_dir)

    for name, out_dir in exports.items():
        exported = read_safetensors_dir(out_dir)

        assert exported.keys() == base.keys(), name

        dtype = torch.bfloat16 if name == "default" else torch.float32

        trained = to_hg_state_dict(model.state_dict(), get_qwen35_model_hub().get_model_config(_fine_tuned_card(run_dir)))

        num_changed = 0

        for key, tensor in exported.items():
            if key.startswith(("model.visual.", "mtp.")):
                assert torch.equal(tensor.float(), base[key].float()), key

                continue

            trained_tensor = trained[key.replace("model.language_model.", "model.")]

            assert isinstance(trained_tensor, Tensor)

            assert tensor.dtype == dtype
            assert torch.equal(tensor, trained_tensor.to(dtype)), key

            num_changed += not torch.equal(tensor.float(), base[key].float())

        # SFT moved every tensor away from the base's; a bf16 cast hides
        # some of the smallest updates.
        if name == "fp32":
            assert num_changed == sum(not k.startswith(("model.visual.", "mtp.")) for k in base)

    assert read_config(exports["default"])["dtype"] == "bfloat16"
    assert read_config(exports["default"])["vision_config"] == read_config(base_dir)["vision_config"]


def test_training_time_export_equals_the_command(sft_run: tuple[Path, Path], exports: dict[str, Path]) -> None:
    _, run_dir = sft_run

    hg_dir = _checkpoint_dir(run_dir) / f"step_{_NUM_STEPS}" / "hg"

    names = sorted(p.name for p in exports["default"].iterdir())

    assert sorted(p.name for p in hg_dir.iterdir()) == names

    for name in names:
        assert (hg_dir / name).read_bytes() == (exports["default"] / name).read_bytes(), name

    # The recipe's exporter wrote it, not fairseq2's.
    assert "-m qwen35_fs2.cli.export_hf" in (hg_dir.parent / "hg.run").read_text()


def test_transformers_greedy_generation_equals_fairseq2(sft_run: tuple[Path, Path], exports: dict[str, Path]) -> None:
    _, run_dir = sft_run

    tokenizer = load_tokenizer("qwen35_tokenizer")

    encoder = tokenizer.create_raw_encoder()

    eos_idx = tokenizer.vocab_info.eos_idx

    prompts = [encoder(prompt) for prompt in _PROMPTS]

    # fp32 on both sides: the very same weights.
    hf_tokens = hf_greedy_generate(exports["fp32"], [p.tolist() for p in prompts], _MAX_NEW_TOKENS, eos_token_id=eos_idx, model_class="conditional_generation")

    model = _load_fine_tuned_model(run_dir)

    # The generator counts the EOS it ends every hypothesis with.
    generator = SamplingSequenceGenerator(model, tokenizer.vocab_info, TopKSampler(k=1), max_gen_len=_MAX_NEW_TOKENS + 1, temperature=1.0)

    for prompt, expected in zip(prompts, hf_tokens, strict=True):
        seqs = prompt.unsqueeze(0)

        output = generator(seqs, BatchLayout.of(seqs))

        tokens = output.hypotheses[0][0].seq.tolist()

        if eos_idx in tokens:
            tokens = tokens[: tokens.index(eos_idx) + 1]

        assert tokens[:_MAX_NEW_TOKENS] == expected

        assert len(expected) == _MAX_NEW_TOKENS or expected[-1] == eos_idx
