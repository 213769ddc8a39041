from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qwen35_fs2.datasets.synthetic import write_synthetic_fineweb
from qwen35_fs2.recipes.resume import RESTORED_CONFIG_FILE
from recipe_runner import TINY_MODEL_OVERRIDES, read_metrics, run_recipe

CONFIG = "qwen35_tiny_pretrain_cpu.yaml"

# 6 steps of 128-token packed batches, a constant learning rate (so that the
# schedule does not depend on `num_steps`).
OVERRIDES = (
    # The pretraining config has its own overrides (no pad index); keep them.
    TINY_MODEL_OVERRIDES.replace("{", "{pad_idx: null, "),
    "dataset.max_seq_len=64",
    "dataset.max_num_tokens=128",
    "lr_scheduler.config={num_warmup_steps: 0, cycle_len: 100, final_lr_scale: 1.0}",
    "regime.num_steps=6",
    "regime.checkpoint_every_n_steps=3",
    "regime.keep_last_n_checkpoints=null",
)


@pytest.mark.slow
class TestPretrainCPU:
    # On two processes (FSDP2), the SLURM test resumes a run stopped by a
    # signal and compares it with an uninterrupted one step for step
    # (tests/slurm/test_slurm_training.py).
    def test_loss_decreases_and_a_resumed_run_matches_an_uninterrupted_one(self, tmp_path: Path) -> None:
        full_dir = tmp_path / "full"

        run_recipe("train", full_dir, CONFIG, OVERRIDES)

        full = read_metrics(full_dir)

        losses = [full[step]["NLL Loss"] for step in range(1, 7)]

        assert losses[-1] < losses[0] - 0.5, losses

        # A packed batch of 129 tokens per step; the first token of each
        # document segment is no target.
        assert full[1]["Number of Elements"] == 128

        # The run's checkpoint of step 3 (model, optimizer, data reader), as
        # a run stopped then would find it, resumed in another directory to
        # step 6: the data reader continues where it stopped.
        resumed_dir = tmp_path / "resumed"

        shutil.copytree(full_dir / "checkpoints" / "step_3", resumed_dir / "checkpoints" / "step_3")

        shutil.copy(full_dir / "checkpoints" / RESTORED_CONFIG_FILE, resumed_dir / "checkpoints")

        process = run_recipe("train", resumed_dir, CONFIG, OVERRIDES)

        assert "Resuming from step 3." in process.stdout

        resumed = read_metrics(resumed_dir)

        assert sorted(resumed) == [4, 5, 6]

        for step in range(4, 7):
            assert resumed[step]["NLL Loss"] == pytest.approx(full[step]["NLL Loss"], abs=1e-6), step

    def test_validation_reads_the_same_first_batches_at_every_validation(self, tmp_path: Path) -> None:
        output_dir = tmp_path / "out"

        # A corpus of its own: the training corpus is refused (below).
        (valid_file,) = write_synthetic_fineweb(tmp_path / "valid", num_shards=1, docs_per_shard=64, seed=9)

        overrides = [
            *OVERRIDES,
            f"dataset.valid={{paths: ['{valid_file}']}}",
            "dataset.max_num_valid_batches=2",
            "regime.num_steps=2",
            "regime.validate_every_n_steps=1",
        ]

        process = run_recipe("train", output_dir, CONFIG, overrides)

        valid = read_metrics(output_dir, "valid")

        # Two batches of 129 tokens, of a corpus of thousands.
        assert {step: record["Number of Elements"] for step, record in valid.items()} == {1: 256, 2: 256}

        assert process.stdout.count("Data epoch 1 ended after 2 batch(es) on this rank; epoch 2 reads the same") == 1
        assert process.stdout.count("Data epoch 2 ended after 2 batch(es) on this rank; epoch 3 reads the same") == 1

    def test_validation_on_training_files_is_a_clear_error(self, tmp_path: Path) -> None:
        output_dir = tmp_path / "out"

        # The training corpus of the config, as a `valid` source of the same
        # dataset with the default patterns would read it.
        overrides = [*OVERRIDES, "dataset.valid={paths: ['synthetic://fineweb_edu']}"]

        process = run_recipe("train", output_dir, CONFIG, overrides, expected_returncode=2)

        assert "`dataset.valid` must read other files than `dataset.train`, but reads 4 of its files (" in process.stdout
        assert "Give `valid` other paths, or other `hf_allow_patterns`." in process.stdout

        # Stopped before training.
        assert not (output_dir / "metrics").exists()
