"""``lm instruction_finetune`` with LoRA (``recipes/qwen35_tiny_gsm8k_lora_cpu.yaml``)
from a Hugging Face checkpoint of a random tiny Qwen3.5, on CPU: the loss
falls, the checkpoints hold the adapters and their optimizer state alone,
and a run resumed from one of them (its base read again from the Hugging
Face checkpoint) trains as the uninterrupted run did, bit for bit; resuming
with another base or other adapters is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fairseq2.gang import create_fake_gangs, set_gangs

from qwen35_fs2.hf.export import build_hf_config
from qwen35_fs2.hf.export.tensors import to_hg_state_dict
from qwen35_fs2.models.qwen35 import convert_qwen35_state_dict, create_qwen35_model, get_qwen35_model_hub

from recipe_runner import TINY_MODEL_OVERRIDES, read_metrics, run_recipe

CONFIG = "qwen35_tiny_gsm8k_lora_cpu.yaml"

# The sizes of TINY_MODEL_OVERRIDES.
_TINY_SIZES = {"num_layers": 2, "full_attention_interval": 2, "model_dim": 64, "ffn_inner_dim": 128}

# 6 steps of one or two packed examples at a constant learning rate, no
# validation.
OVERRIDES = (
    TINY_MODEL_OVERRIDES,
    "dataset.max_seq_len=256",
    "dataset.max_num_tokens=256",
    "dataset.num_held_out_examples=0",
    "lr_scheduler.config={num_warmup_steps: 0, cycle_len: 100, final_lr_scale: 1.0}",
    "optimizer.config.lr=1.0e-2",
    "regime.num_steps=6",
    "regime.checkpoint_every_n_steps=3",
    "regime.keep_last_n_checkpoints=null",
    "regime.validate_every_n_steps=null",
)


def _save_random_hf_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Saves a random model of the tiny configuration as a Hugging Face
    checkpoint with its config.json; returns its tensors under our names."""
    config = get_qwen35_model_hub().get_arch_config("qwen35_demo")

    for name, size in _TINY_SIZES.items():
        setattr(config, name, size)

    torch.manual_seed(1)

    with set_gangs(create_fake_gangs(torch.device("cpu"))):
        model = create_qwen35_model(config)

    hg = {key: tensor.contiguous() for key, tensor in to_hg_state_dict(model.state_dict(), config).items() if isinstance(tensor, torch.Tensor)}

    path.mkdir()

    save_file(hg, str(path / "model.safetensors"))

    # As an export writes it: `model.path` is checked against it.
    hf_config = build_hf_config(config, base=None, text_only=True, dtype=torch.float32, num_mtp_layers=0)

    (path / "config.json").write_text(json.dumps(hf_config))

    # Read back, independently of the model.
    return {key: tensor for key, tensor in convert_qwen35_state_dict(load_file(path / "model.safetensors"), config).items() if isinstance(tensor, torch.Tensor)}


@pytest.mark.slow
class TestLoraInstructionFinetuneCPU:
    @pytest.mark.parametrize("nproc", [1, 2], ids=["1-process", "2-processes-fsdp2"])
    def test_loss_decreases_only_the_adapters_train_and_a_resumed_run_matches_an_uninterrupted_one(self, nproc: int, tmp_path: Path) -> None:
        base_dir = tmp_path / "base"

        base = _save_random_hf_checkpoint(base_dir)

        output_dir = tmp_path / "out"

        process = run_recipe("instruction_finetune", output_dir, CONFIG, [*OVERRIDES, f"model.path={base_dir}"], nproc=nproc)

        assert f"Every rank read its shards of {base_dir}." in process.stdout

        metrics = read_metrics(output_dir)

        losses = [metrics[step]["NLL Loss"] for step in range(1, 7)]

        # The random base predicts about uniformly (ln 248320 = 12.42, from
        # batch to batch within a few hundredths); the frozen embeddings and
        # the clipped gradients leave the adapters a slower descent than full
        # fine-tuning's.
        assert losses[-1] < losses[0] - 0.15, losses

        checkpoint_dir = output_dir / "checkpoints"

        saved = _read_model_checkpoint(checkpoint_dir / "step_6", nproc)

        # The adapters alone: the base is read from its own checkpoint.
        # A Gated DeltaNet layer (5 targets) and an attention layer (4), each
        # with an MLP (3): 15 adapters of two weights.
        assert len(saved) == 2 * (5 + 3 + 4 + 3)

        assert all(".lora." in key for key in saved)

        # Whole adapters of rank 8, the rows of the ranks' shards together
        # (adapters that FSDP2 does not shard would be saved whole by each
        # rank, and trained apart); B starts at zero.
        for key, tensor in saved.items():
            proj_weight = base[key.rsplit(".lora.", 1)[0] + ".weight"]

            if key.endswith(".a_proj.weight"):
                assert tensor.shape == (8, proj_weight.size(1)), key
            else:
                assert tensor.shape == (proj_weight.size(0), 8), key

                assert tensor.abs().max() > 0.0, key

        # fairseq2 pickles the optimizer state with objects that `weights_only`
        # rejects; the file is the test's own.
        for rank in range(nproc):
            optimizer = torch.load(checkpoint_dir / "step_6" / "optimizer" / "pp_00" / "tp_00" / f"sdp_{rank:02d}.pt", map_location="cpu", weights_only=False)

            assert len(optimizer["state"]) == len(saved)

        # Stopped after step 3: the run's checkpoint directory as it was
        # then, in another output directory, resumed to step 6.
        resumed_dir = tmp_path / "resumed"

        shutil.copytree(checkpoint_dir, resumed_dir / "checkpoints", ignore=shutil.ignore_patterns("step_6"))

        if nproc == 1:
            # A copy of the base elsewhere is another base: refused before
            # training, naming both (the rule itself: tests/unit/lora).
            other_base_dir = tmp_path / "other_base"

            shutil.copytree(base_dir, other_base_dir)

            process = run_recipe("instruction_finetune", resumed_dir, CONFIG, [*OVERRIDES, f"model.path={other_base_dir}"], expected_returncode=2)

            assert f"trained on, {base_dir.resolve()}, but is {other_base_dir.resolve()} instead." in process.stdout

            # The adapters scaled otherwise: refused too (fairseq2 has
            # rewritten config.yaml by then; exports take the record's).
            process = run_recipe("instruction_finetune", resumed_dir, CONFIG, [*OVERRIDES, f"model.path={base_dir}", "lora.rslora=true"], expected_returncode=2)

            assert "`lora.rslora` must be the one the LoRA adapters of the checkpoints were trained with, False, but is True instead." in process.stdout

            assert not (resumed_dir / "metrics" / "train.jsonl").exists()

        process = run_recipe("instruction_finetune", resumed_dir, CONFIG, [*OVERRIDES, f"model.path={base_dir}"], nproc=nproc)

        assert "Resuming from step 3." in process.stdout

        assert f"Every rank read its shards of {base_dir}." in process.stdout

        resumed = read_metrics(resumed_dir)

        assert sorted(resumed) == [4, 5, 6]

        for step in range(4, 7):
            assert resumed[step]["NLL Loss"] == metrics[step]["NLL Loss"], step

        resumed_saved = _read_model_checkpoint(resumed_dir / "checkpoints" / "step_6", nproc)

        assert resumed_saved.keys() == saved.keys()

        for key, tensor in saved.items():
            assert torch.equal(resumed_saved[key], tensor), key


def _read_model_checkpoint(step_dir: Path, nproc: int) -> dict[str, torch.Tensor]:
    """Returns the model state of a checkpoint, the ranks' rows together
    (FSDP2 saves each rank's rows of every tensor)."""
    shards = [torch.load(step_dir / "model" / "pp_00" / "tp_00" / f"sdp_{rank:02d}.pt", map_location="cpu", weights_only=True) for rank in range(nproc)]

    return {key: torch.cat([shard[key] for shard in shards]) for key in shards[0]}
