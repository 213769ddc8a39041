"""Loading through an asset card takes the architecture, the tie flag first,
from the checkpoint's own ``config.json``, and a trained output projection is
never dropped: under a tied configuration one that differs from the
embedding table is an error.

The checkpoints are tiny random ones that transformers 5.24 writes (weights
and ``config.json``); the cards are fairseq2 ``AssetCard`` objects of a local
directory (a path or a ``file://`` URI) or of ``hg://``, served offline from a
Hugging Face Hub cache laid out in the test, as ``huggingface_hub`` lays it
out on download.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fairseq2.assets import AssetCard, AssetCardError
from fairseq2.error import StateDictError

from hf_reference import TinyQwen35Spec
from hf_reference.fixtures import TinyModelCache
from offline_hub import add_hub_snapshot, use_offline_hub_cache
from qwen35_fs2 import load_hf_model
from qwen35_fs2.models.qwen35 import get_qwen35_model_hub
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config

# Two untied checkpoints of `test_hf_parity.py`, so that a session builds
# them once. They differ from the `qwen35_tiny` preset (tied, 1,024 entries,
# 4 query heads of 32 dimensions, FFN 128, initializer range 0.02) in the tie
# flag and more.
_UNTIED = TinyQwen35Spec(
    layout="text",
    num_attention_heads=6,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    seed=2,
    initializer_range=0.02,
)

_UNTIED_VLM = TinyQwen35Spec(
    layout="vlm",
    num_hidden_layers=5,
    layer_types=("full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"),
    num_attention_heads=4,
    num_key_value_heads=2,
    linear_num_key_heads=1,
    linear_num_value_heads=3,
    linear_key_head_dim=32,
    linear_value_head_dim=8,
    seed=3,
    initializer_range=0.02,
)

_PRESET = "qwen35_tiny"

def _card(checkpoint: str) -> AssetCard:
    metadata = {"name": "tiny_card", "model_family": "qwen35", "model_arch": _PRESET, "checkpoint": checkpoint}

    return AssetCard("tiny_card", metadata)


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)

    return target


def _hub_checkpoint(model_dir: Path, hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Puts ``model_dir`` into an offline Hub cache as ``test-org/tiny`` at
    ``main`` and returns its ``hg://`` URI."""
    add_hub_snapshot(hub_cache, "test-org/tiny", model_dir)

    use_offline_hub_cache(monkeypatch, hub_cache)

    return "hg://test-org/tiny"


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["path", "file", "hg"])
def test_a_card_takes_the_tie_flag_and_the_architecture_from_the_checkpoint(
    scheme: str, hf_tiny_models: TinyModelCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = hf_tiny_models.get(_UNTIED)

    if scheme == "hg":
        checkpoint = _hub_checkpoint(model_dir, tmp_path / "hub", monkeypatch)
    else:
        checkpoint = f"file://{model_dir}" if scheme == "file" else str(model_dir)

    card = _card(checkpoint)

    hub = get_qwen35_model_hub()

    assert hub.get_arch_config(_PRESET).tied_embeddings

    with caplog.at_level(logging.WARNING, logger="fairseq2"):
        config = hub.get_model_config(card)

    assert not config.tied_embeddings

    assert (config.vocab_size, config.num_attn_heads, config.head_dim, config.ffn_inner_dim) == (256, 6, 16, 96)

    assert "the checkpoint's values are used: " in caplog.text
    assert "`tied_embeddings` True -> False" in caplog.text
    assert "`num_attn_heads` 4 -> 6" in caplog.text
    assert "`ffn_inner_dim` 128 -> 96" in caplog.text

    model = hub.load_model(card, device=torch.device("cpu"), dtype=torch.float32)

    tensors = load_file(model_dir / "model.safetensors")

    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])

    assert torch.equal(model.final_proj.weight, tensors["lm_head.weight"])  # type: ignore[arg-type]
    assert torch.equal(model.decoder_frontend.embed.weight, tensors["model.embed_tokens.weight"])  # type: ignore[union-attr, arg-type]


@pytest.mark.slow
def test_a_card_whose_configuration_agrees_with_the_checkpoint_logs_nothing(
    hf_tiny_models: TinyModelCache, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = hf_tiny_models.get(_UNTIED)

    card = AssetCard(
        "tiny_card",
        {
            "name": "tiny_card",
            "model_family": "qwen35",
            "model_arch": _PRESET,
            "model_config": {
                "vocab_size": 256,
                "pad_idx": None,
                "tied_embeddings": False,
                "num_attn_heads": 6,
                "num_key_value_heads": 1,
                "head_dim": 16,
                "ffn_inner_dim": 96,
                "max_seq_len": 32_768,
            },
            "checkpoint": str(model_dir),
        },
    )

    with caplog.at_level(logging.WARNING, logger="fairseq2"):
        config = get_qwen35_model_hub().get_model_config(card)

    assert caplog.text == ""

    # The preset's own settings and its way of listing the layers stay.
    assert config.layer_types is None and config.gdn_backend == "auto"


def test_a_card_without_a_config_json_keeps_its_configuration(tmp_path: Path) -> None:
    # A native fairseq2 checkpoint directory has no config.json.
    (tmp_path / "model.pt").write_bytes(b"")

    config = get_qwen35_model_hub().get_model_config(_card(str(tmp_path / "model.pt")))

    assert config == tiny_qwen35_config()


def test_a_config_json_of_the_moe_family_is_an_error_in_a_dense_card(tmp_path: Path) -> None:
    # A tiny Qwen3.5-MoE text config, as transformers 5.x writes one.
    hg_config = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 2048,
        "vocab_size": 256,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    }

    (tmp_path / "config.json").write_text(json.dumps(hg_config))

    with pytest.raises(AssetCardError, match=r"config\.json, the config\.json of the checkpoint of the tiny_card asset card, must describe a model of the qwen35 family, but describes a `Qwen35MoeConfig` instead\."):
        get_qwen35_model_hub().get_model_config(_card(str(tmp_path)))


def test_a_config_json_of_another_model_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))

    with pytest.raises(AssetCardError, match=r"config\.json, the config\.json of the checkpoint of the tiny_card asset card, must describe a Qwen3\.5 model, but does not: The Hugging Face configuration must have `model_type` 'qwen3_5' or 'qwen3_5_text', but has 'llama' instead\."):
        get_qwen35_model_hub().get_model_config(_card(str(tmp_path)))


@pytest.mark.slow
@pytest.mark.parametrize("spec", [_UNTIED, _UNTIED_VLM], ids=["text", "vlm"])
def test_a_tied_config_json_with_a_trained_head_is_an_error(spec: TinyQwen35Spec, hf_tiny_models: TinyModelCache, tmp_path: Path) -> None:
    """A checkpoint that says it is tied but carries its own head: loading it
    tied would drop the head, through a card and through `load_hf_model`."""
    model_dir = _copy(hf_tiny_models.get(spec), tmp_path / "ckpt")

    config_file = model_dir / "config.json"

    hg_config = json.loads(config_file.read_text())

    hg_config["tie_word_embeddings"] = True

    config_file.write_text(json.dumps(hg_config))

    embed_key = "model.language_model.embed_tokens.weight" if spec.layout == "vlm" else "model.embed_tokens.weight"

    message = re.escape(f"`lm_head.weight` must equal `{embed_key}` for a model with tied embeddings (`tied_embeddings: true`), but differs from it instead.") + ".*set `tied_embeddings: false`"

    with pytest.raises(StateDictError, match=message):
        get_qwen35_model_hub().load_model(_card(str(model_dir)), device=torch.device("cpu"), dtype=torch.float32)

    with pytest.raises(StateDictError, match=message):
        load_hf_model(model_dir, dtype=torch.float32)
