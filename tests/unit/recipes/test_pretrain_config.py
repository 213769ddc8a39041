"""The pretraining configuration: bounded validation, and the FineWeb-Edu
config's claims about its data."""

from __future__ import annotations

import re
from fnmatch import fnmatch
from pathlib import Path

import pytest

from qwen35_fs2.recipes.train.config import PretrainConfig

from recipes_testing import RECIPES_DIR, dump_config, run_fairseq2

FINEWEB_CONFIG = RECIPES_DIR / "qwen35_0.8b_fineweb_edu.yaml"

FINEWEB_SLURM_SCRIPT = RECIPES_DIR.parent / "slurm" / "run_qwen35_fineweb_edu.sh"

# FineWeb-Edu `sample/10BT`: 14 shards, about 10B tokens as GPT-2 counts them
# (the dataset card), about 0.7B per shard.
SAMPLE_10BT_SHARDS = [f"sample/10BT/{idx:03d}_00000.parquet" for idx in range(14)]
SAMPLE_10BT_GPT2_TOKENS = 10e9


def _num_gpus() -> int:
    """The GPUs of the config's SLURM script: nodes x GPUs per node."""
    script = FINEWEB_SLURM_SCRIPT.read_text()

    def directive(name: str) -> int:
        match = re.search(rf"^#SBATCH --{name}=(\d+)$", script, re.MULTILINE)

        assert match, name

        return int(match.group(1))

    return directive("nodes") * directive("gpus-per-node")


class TestFineWebEduConfig:
    def test_trains_on_13_shards_and_validates_on_the_14th(self, capfd: pytest.CaptureFixture[str]) -> None:
        dataset = dump_config(capfd, "train", "--config", str(FINEWEB_CONFIG))["dataset"]

        def shards(patterns: list[str]) -> list[str]:
            return [s for s in SAMPLE_10BT_SHARDS if any(fnmatch(s, p) for p in patterns)]

        assert shards(dataset["train"]["hf_allow_patterns"]) == SAMPLE_10BT_SHARDS[:13]

        assert shards(dataset["valid"]["hf_allow_patterns"]) == SAMPLE_10BT_SHARDS[13:]

    def test_the_steps_read_at_most_one_pass_over_the_training_shards(self, capfd: pytest.CaptureFixture[str]) -> None:
        config = dump_config(capfd, "train", "--config", str(FINEWEB_CONFIG))

        num_tokens = config["regime"]["num_steps"] * _num_gpus() * config["dataset"]["max_num_tokens"]

        assert num_tokens <= SAMPLE_10BT_GPT2_TOKENS * 13 / 14

        # And not much less: about one pass.
        assert num_tokens >= 0.9 * SAMPLE_10BT_GPT2_TOKENS * 13 / 14

    def test_validation_reads_a_bounded_part_of_the_held_out_shard(self, capfd: pytest.CaptureFixture[str]) -> None:
        config = dump_config(capfd, "train", "--config", str(FINEWEB_CONFIG))

        dataset, regime = config["dataset"], config["regime"]

        max_num_batches = dataset["max_num_valid_batches"]

        assert isinstance(max_num_batches, int)

        num_valid_tokens = max_num_batches * _num_gpus() * dataset["max_num_tokens"]

        # At most 5% of the shard, and 10% of the tokens trained on between
        # two validations (forward passes only, against forward and backward).
        assert num_valid_tokens <= 0.05 * SAMPLE_10BT_GPT2_TOKENS / 14

        assert num_valid_tokens <= 0.1 * regime["validate_every_n_steps"] * _num_gpus() * dataset["max_num_tokens"]


class TestValidationCap:
    def test_the_default_is_a_cap(self) -> None:
        assert PretrainConfig().dataset.max_num_valid_batches == 64

    def test_a_cap_below_1_is_a_clear_error(self, capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        config = RECIPES_DIR / "qwen35_tiny_pretrain_cpu.yaml"

        # Should the configuration pass, one step ends the run soon.
        returncode, output = run_fairseq2(capfd, "lm", "train", str(tmp_path / "out"), "--config", str(config), "--no-rich", "--set", "regime.num_steps=1", "dataset.max_num_valid_batches=0")

        assert returncode == 2, output

        last_line = output.strip().splitlines()[-1]

        assert "`max_num_valid_batches` must be greater than or equal to 1, but is 0 instead." in last_line, last_line
