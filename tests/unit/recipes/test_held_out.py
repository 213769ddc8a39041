"""Validation of `lm instruction_finetune` apart from training: on training
examples held out of training, so that GSM8K's test split is scored by
`lm eval_gsm8k` only, or on files that are not training files."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from qwen35_fs2.datasets.synthetic import generate_synthetic_gsm8k
from qwen35_fs2.recipes.instruction import InstructionDataError, InstructionExample, hold_out_examples, warn_of_shared_prompts

from recipes_testing import RECIPES_DIR, read_recipe_file, run_fairseq2

# The configs of `recipes/` by recipe.
SFT_FILES = ("qwen35_0.8b_gsm8k.yaml", "qwen35_tiny_gsm8k_cpu.yaml")
EVAL_FILES = ("qwen35_0.8b_gsm8k_eval.yaml", "qwen35_tiny_gsm8k_eval_cpu.yaml")


def _examples(num_examples: int) -> list[InstructionExample]:
    return [
        {"id": f"train.parquet:{idx}", "prompt": e.question, "response": e.answer}
        for idx, e in enumerate(generate_synthetic_gsm8k(num_examples, seed=4))
    ]


class TestHoldOutExamples:
    def test_holds_out_the_examples_with_the_smallest_prompt_digests(self) -> None:
        examples = _examples(50)

        train, valid = hold_out_examples(examples, 8)

        digests = sorted(hashlib.sha256(e["prompt"].encode()).hexdigest() for e in examples)

        assert sorted(hashlib.sha256(e["prompt"].encode()).hexdigest() for e in valid) == digests[:8]

        # Both splits keep the original order, and together are the examples.
        assert valid == [e for e in examples if e in valid]
        assert train == [e for e in examples if e not in valid]

        assert len(train) == 42

    def test_the_held_out_examples_do_not_depend_on_the_order(self) -> None:
        examples = _examples(50)

        shuffled = list(examples)

        random.Random(1).shuffle(shuffled)

        _, valid = hold_out_examples(examples, 8)

        _, shuffled_valid = hold_out_examples(shuffled, 8)

        assert sorted(e["id"] for e in shuffled_valid) == sorted(e["id"] for e in valid)

    @pytest.mark.parametrize("num_held_out", [10, 11])
    def test_raises_error_when_nothing_is_left_to_train_on(self, num_held_out: int) -> None:
        message = rf"`num_held_out_examples` must be less than the number of training examples \(10\), but is {num_held_out} instead\."

        with pytest.raises(InstructionDataError, match=message):
            hold_out_examples(_examples(10), num_held_out)


class TestGSM8KConfigs:
    @pytest.mark.parametrize("name", SFT_FILES)
    def test_fine_tuning_validates_on_held_out_training_problems(self, name: str) -> None:
        dataset = read_recipe_file(name)["dataset"]

        assert dataset.get("valid", []) == []

        assert dataset["num_held_out_examples"] > 0

        assert [source["pattern"] for source in dataset["train"]] == ["main/train-*.parquet"]

    def test_the_gsm8k_fine_tuning_holds_out_256_problems(self) -> None:
        assert read_recipe_file("qwen35_0.8b_gsm8k.yaml")["dataset"]["num_held_out_examples"] == 256

    @pytest.mark.parametrize("name", EVAL_FILES)
    def test_evaluation_scores_the_test_split(self, name: str) -> None:
        sources = read_recipe_file(name)["dataset"]["sources"]

        assert [source["pattern"] for source in sources] == ["main/test-*.parquet"]


class TestHeldOutConfigErrors:
    @pytest.mark.parametrize(
        ("override", "message"),
        [
            (
                "dataset.valid=[{path: 'synthetic://gsm8k', pattern: main/test-*.parquet}]",
                "`valid` must be empty when `num_held_out_examples` is greater than 0, but has 1 source(s).",
            ),
            (
                "dataset.num_held_out_examples=-1",
                "`num_held_out_examples` must be greater than or equal to 0, but is -1 instead.",
            ),
            (
                "dataset.max_num_valid_examples=1",
                "`max_num_valid_examples` must be greater than or equal to `num_held_out_examples` (2), but is 1 instead. Hold out fewer examples.",
            ),
        ],
        ids=["with_valid", "negative", "capped_below_held_out"],
    )
    def test_is_a_clear_error(self, capfd: pytest.CaptureFixture[str], tmp_path: Path, override: str, message: str) -> None:
        config = RECIPES_DIR / "qwen35_tiny_gsm8k_cpu.yaml"

        # Should the configuration pass, a step and two held-out validation
        # examples end the run soon.
        bounds = ("regime.num_steps=1", "dataset.num_held_out_examples=2")

        returncode, output = run_fairseq2(capfd, "lm", "instruction_finetune", str(tmp_path / "out"), "--config", str(config), "--no-rich", "--set", *bounds, override)

        assert returncode == 2, output

        last_line = output.strip().splitlines()[-1]

        assert message in last_line, last_line


def _run_tiny_sft(capfd: pytest.CaptureFixture[str], tmp_path: Path, *overrides: str) -> tuple[int, str]:
    config = RECIPES_DIR / "qwen35_tiny_gsm8k_cpu.yaml"

    # Should the configuration pass, a step and two held-out validation
    # examples end the run soon.
    bounds = ("regime.num_steps=1", "dataset.num_held_out_examples=2")

    return run_fairseq2(capfd, "lm", "instruction_finetune", str(tmp_path / "out"), "--config", str(config), "--no-rich", "--set", *bounds, *overrides)


class TestValidationApartFromTraining:
    def test_validation_on_training_files_is_a_clear_error(self, capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        data_dir = tmp_path / "data"

        data_dir.mkdir()

        rows = [{"question": e["prompt"], "answer": e["response"]} for e in _examples(8)]

        data_dir.joinpath("sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")

        # The same file named once as the directory and once by a path with
        # a `..` in it.
        overrides = (
            f"dataset.train=[{{path: {data_dir}}}]",
            f"dataset.valid=[{{path: {data_dir / '..' / 'data' / 'sft.jsonl'}}}]",
            "dataset.num_held_out_examples=0",
        )

        returncode, output = _run_tiny_sft(capfd, tmp_path, *overrides)

        assert returncode != 0, output

        message = f"`dataset.valid` must read other files than `dataset.train`, but reads 1 of its files ({data_dir / '..' / 'data' / 'sft.jsonl'}) instead. Give `valid` other paths or patterns, or validate on training examples held out of training (`num_held_out_examples`)."

        assert message in output, output

        assert not (tmp_path / "out" / "checkpoints").exists()

    def test_a_gsm8k_source_without_a_pattern_is_a_clear_error(self, capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        # Read whole, the GSM8K layout would train on its test split.
        returncode, output = _run_tiny_sft(capfd, tmp_path, "dataset.train=[{path: 'synthetic://gsm8k'}]")

        assert returncode != 0, output

        assert "`pattern` must select the files of one split of synthetic://gsm8k, but is None and its files hold test (main/test-00000-of-00001.parquet), train (main/train-00000-of-00001.parquet) instead." in output, output

    def test_validation_examples_with_training_prompts_are_named_in_a_warning(self, caplog: pytest.LogCaptureFixture) -> None:
        examples = _examples(6)

        train, valid = examples[:4], [*examples[3:], *examples[1:3]]

        warn_of_shared_prompts(train, valid)

        ids = ", ".join(e["id"] for e in (examples[3], examples[1], examples[2]))

        assert f"3 of the 5 validation examples have the prompt of a training example ({ids}): the validation loss is partly a training loss." in caplog.text

        caplog.clear()

        warn_of_shared_prompts(examples[:4], examples[4:])

        assert "validation examples have the prompt" not in caplog.text
