from __future__ import annotations

import re
from pathlib import Path

import pytest

from recipes_testing import RECIPES_DIR, run_fairseq2

# The recipe of each shipped config.
CONFIGS = {
    "qwen35_0.8b_gsm8k.yaml": "instruction_finetune",
    "qwen35_0.8b_gsm8k_eval.yaml": "eval_gsm8k",
    "qwen35_0.8b_fineweb_edu.yaml": "train",
    "qwen35_9b_gsm8k_lora.yaml": "instruction_finetune",
    "qwen35_tiny_gsm8k_cpu.yaml": "instruction_finetune",
    "qwen35_tiny_gsm8k_lora_cpu.yaml": "instruction_finetune",
    "qwen35_tiny_gsm8k_eval_cpu.yaml": "eval_gsm8k",
    "qwen35_tiny_pretrain_cpu.yaml": "train",
}


class TestShippedConfigs:
    def test_every_config_in_recipes_is_listed(self) -> None:
        assert sorted(p.name for p in RECIPES_DIR.glob("*.yaml")) == sorted(CONFIGS)

    @pytest.mark.parametrize("config", sorted(CONFIGS))
    def test_config_validates(self, capfd: pytest.CaptureFixture[str], config: str) -> None:
        returncode, output = run_fairseq2(capfd, "lm", CONFIGS[config], "--config", str(RECIPES_DIR / config), "--dump-config")

        assert returncode == 0, output

        # The merged configuration, ready to be saved and reused.
        assert re.search(r"^output_dir: outputs/", output, re.MULTILINE), output


class TestBadConfigs:
    """A bad configuration stops the run before any model is built, with a
    last line that names the problem."""

    @pytest.mark.parametrize(
        ("override", "message"),
        [
            ("dataset.trian=[]", r"the configuration is invalid at `dataset`: .* contains extra key\(s\) trian\."),
            ("regime.num_steps=many", r"the configuration is invalid at `regime.num_steps`: .*invalid literal for int\(\)"),
            ("dataset.train=[{path: /no/such/gsm8k.jsonl}]", r"`dataset.train\[0\]` is not valid: `path` must be an existing file or directory, or a URI, but /no/such/gsm8k.jsonl does not exist\."),
            ("dataset.max_num_tokens=100", r"`max_num_tokens` must be greater than or equal to `max_seq_len` \(512\), but is 100 instead\."),
            ("loss.chunk_size=0", r"`chunk_size` must be greater than or equal to 1, but is 0 instead\."),
            ("lora={r: 0}", r"`r` must be greater than 0, but is 0 instead\."),
            ("lora={target_modules: [qkv_proj]}", r"`target_modules` must hold Hugging Face projection names \(.*\), but holds `qkv_proj` instead\."),
            ("gang.expert_parallel_size=0", r"`expert_parallel_size` must be greater than or equal to 1, but is 0 instead\."),
            # fairseq2 divided by zero at the last step.
            ("regime.num_steps=3", r"`regime.num_steps` must differ from `lr_scheduler.config.num_warmup_steps` \(3\), since the cosine cycle, the steps after the warmup, would have none, but is 3\."),
        ],
        ids=["unknown_key", "wrong_type", "missing_dataset_path", "invalid_value", "invalid_loss", "lora_rank", "lora_target", "expert_parallel_size", "cosine_without_cycle"],
    )
    def test_is_a_clear_error(self, capfd: pytest.CaptureFixture[str], tmp_path: Path, override: str, message: str) -> None:
        output_dir = tmp_path / "out"

        config = RECIPES_DIR / "qwen35_tiny_gsm8k_cpu.yaml"

        returncode, output = run_fairseq2(capfd, "lm", "instruction_finetune", str(output_dir), "--config", str(config), "--no-rich", "--set", override)

        assert returncode == 2, output

        last_line = output.strip().splitlines()[-1]

        assert re.search(message, last_line), last_line

        # Neither model nor data was touched.
        assert not output_dir.exists()

    def test_a_missing_pretraining_shard_directory_is_a_clear_error(self, capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        config = RECIPES_DIR / "qwen35_tiny_pretrain_cpu.yaml"

        returncode, output = run_fairseq2(capfd, "lm", "train", str(tmp_path / "out"), "--config", str(config), "--no-rich", "--set", "dataset.train.paths=[/no/such/shards]")

        assert returncode == 2, output

        assert "`paths` must hold existing files or directories, or URIs, but /no/such/shards does not exist." in output

    @pytest.mark.parametrize(("recipe", "config"), [("eval_gsm8k", "qwen35_tiny_gsm8k_eval_cpu.yaml"), ("generate", None)])
    @pytest.mark.parametrize(
        ("override", "error"),
        [
            # With the prompt echoed, records and scores would read the chat
            # prompt as part of the response.
            ("seq_generator.config.echo_prompt=true", "`seq_generator` is not valid: `config.echo_prompt` must be `False`, since the responses are recorded and scored without their prompt, but is `True` instead."),
            # Incremental decoding fails under torch.compile (pinned in
            # tests/unit/models/qwen35/test_generation.py).
            ("model.compile=true", "`model` is not valid: `compile` must be `False`, since incremental decoding does not run under `torch.compile` (torch 2.9), but is `True` instead."),
        ],
    )
    def test_a_response_recipe_refuses_a_setting_it_cannot_honour_with_a_clear_error(self, capfd: pytest.CaptureFixture[str], tmp_path: Path, recipe: str, config: str | None, override: str, error: str) -> None:
        config_args = [] if config is None else ["--config", str(RECIPES_DIR / config)]

        returncode, output = run_fairseq2(capfd, "lm", recipe, str(tmp_path / "out"), *config_args, "--no-rich", "--set", override)

        assert returncode == 2, output

        last_line = output.strip().splitlines()[-1]

        assert error in last_line, last_line

        assert not (tmp_path / "out").exists()

    @pytest.mark.parametrize("recipe", ["instruction_finetune", "train"])
    def test_lora_dropout_under_tensor_parallelism_is_a_clear_error(self, capfd: pytest.CaptureFixture[str], tmp_path: Path, recipe: str) -> None:
        # fairseq2 seeds each rank apart: the tensor-parallel ranks would drop
        # different entries of the input they share.
        config = RECIPES_DIR / ("qwen35_tiny_gsm8k_lora_cpu.yaml" if recipe == "instruction_finetune" else "qwen35_tiny_pretrain_cpu.yaml")

        overrides = ["gang.tensor_parallel_size=2", "lora={dropout_p: 0.05}" if recipe == "train" else "lora.dropout_p=0.05"]

        returncode, output = run_fairseq2(capfd, "lm", recipe, str(tmp_path / "out"), "--config", str(config), "--no-rich", "--set", *overrides)

        assert returncode == 2, output

        last_line = output.strip().splitlines()[-1]

        assert "`lora.dropout_p` must be 0 under tensor parallelism (`gang.tensor_parallel_size` 2), since the ranks would drop different entries of the input they share, but is 0.05 instead." in last_line, last_line

        assert not (tmp_path / "out").exists()
