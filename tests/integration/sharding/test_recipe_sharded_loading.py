"""``lm instruction_finetune`` from a Hugging Face checkpoint in two CPU
processes, with FSDP2 (and layerwise activation checkpointing) or 2-way
tensor parallelism: the families defer the loading and the recipe reads each
rank's shards. With a learning rate of 0 the checkpoint the run saves is the
Hugging Face checkpoint, bit for bit.

The FSDP2 run names the checkpoint by path, with the arch and overrides that
describe it. The tensor-parallel run names it by an asset card whose preset
(``qwen35_demo``) is tied and larger: the family takes the architecture from
the checkpoint's ``config.json``, so the untied head is loaded and saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from sharding_testing import create_reference_model, save_hf_checkpoint

from qwen35_fs2.models.qwen35 import convert_qwen35_state_dict, get_qwen35_model_hub
from qwen35_fs2.hf.export.config import build_hf_config

pytestmark = pytest.mark.slow

_REPO_DIR = Path(__file__).resolve().parents[3]

_CONFIG_OVERRIDES = {"num_layers": 2, "full_attention_interval": 2, "model_dim": 64, "ffn_inner_dim": 128}


@pytest.mark.parametrize(
    ("parallelism", "through_card"),
    [(["trainer.activation_checkpointing={mode: layerwise}"], False), (["gang.tensor_parallel_size=2"], True)],
    ids=["fsdp2-path", "tp2-card"],
)
def test_sft_loads_a_hf_checkpoint_into_the_shards_of_each_rank(parallelism: list[str], through_card: bool, tmp_path: Path) -> None:
    hub = get_qwen35_model_hub()

    config = hub.get_arch_config("qwen35_demo")

    for name, size in _CONFIG_OVERRIDES.items():
        setattr(config, name, size)

    checkpoint = tmp_path / "hf"

    if through_card:
        config.tied_embeddings = False

    save_hf_checkpoint(create_reference_model(config), config, checkpoint)

    output_dir = tmp_path / "out"

    env = dict(os.environ, FAIRSEQ2_DEVICE="cpu", FAIRSEQ2_EXTENSION_TRACE="1", OMP_NUM_THREADS="1")

    if through_card:
        hg_config = build_hf_config(config, base=None, text_only=True, dtype=torch.float32, num_mtp_layers=0)

        (checkpoint / "config.json").write_text(json.dumps(hg_config))

        card_dir = tmp_path / "cards"

        card_dir.mkdir()

        (card_dir / "tiny.yaml").write_text(f"name: tiny_untied\nmodel_family: qwen35\nmodel_arch: qwen35_demo\ncheckpoint: {checkpoint}\n")

        env["FAIRSEQ2_USER_ASSET_DIR"] = str(card_dir)

        model_overrides = ["model.name=tiny_untied", "model.family=null", "model.arch=null"]
    else:
        model_overrides = [
            "model.name=null",
            f"model.path={checkpoint}",
            "model.family=qwen35",
            "model.arch=qwen35_demo",
            "model.config_overrides={" + ", ".join(f"{k}: {n}" for k, n in _CONFIG_OVERRIDES.items()) + "}",
        ]

    overrides = [
        *model_overrides,
        *parallelism,
        "optimizer.config.lr=0.0",
        "dataset.max_seq_len=256",
        "dataset.max_num_tokens=256",
        "dataset.valid=[]",
        "regime.num_steps=1",
        "regime.checkpoint_every_n_steps=1",
        "regime.validate_every_n_steps=null",
    ]

    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "qwen35_fs2.recipes.sft",
        str(output_dir), "--no-rich", "--config", str(_REPO_DIR / "recipes" / "qwen35_tiny_gsm8k_cpu.yaml"), "--set", *overrides,
    ]  # fmt: skip

    process = subprocess.run(command, cwd=_REPO_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=2400)

    assert process.returncode == 0, process.stdout[-8000:]

    assert f"Every rank read its shards of {checkpoint}." in process.stdout

    if through_card:
        assert "`tied_embeddings` True -> False" in process.stdout

        # Not by each rank's shards alone (fairseq2's clipping).
        assert "Gradients are clipped by their norm over all 2 ranks (tensor parallel size 2)." in process.stdout

        # What a resumed run or a card of the fine-tuned model will build.
        metadata = yaml.safe_load((output_dir / "checkpoints" / "model.yaml").read_text())

        assert metadata["model_config"]["tied_embeddings"] is False

    saved = hub.load_custom_model(output_dir / "checkpoints" / "step_1" / "model", config, device=torch.device("cpu"))

    hg: dict[str, object] = {}

    for file in checkpoint.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            hg.update({key: f.get_tensor(key) for key in f.keys()})

    expected = convert_qwen35_state_dict(hg, config)

    state_dict = saved.state_dict()

    assert state_dict.keys() == expected.keys()

    for key, tensor in expected.items():
        assert isinstance(tensor, torch.Tensor) and torch.equal(state_dict[key], tensor), key
