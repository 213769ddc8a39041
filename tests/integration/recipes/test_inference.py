from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipe_runner import TINY_MODEL_OVERRIDES, read_metric_records, run_recipe

SFT_OVERRIDES = (
    TINY_MODEL_OVERRIDES,
    "dataset.max_seq_len=256",
    "dataset.max_num_tokens=256",
    "dataset.num_held_out_examples=0",
    "regime.num_steps=2",
    "regime.checkpoint_every_n_steps=2",
    "regime.validate_every_n_steps=null",
)


@pytest.mark.slow
class TestInferenceRecipesCPU:
    def test_eval_gsm8k_and_generate_use_a_fine_tuned_checkpoint(self, tmp_path: Path) -> None:
        sft_dir = tmp_path / "sft"

        run_recipe("instruction_finetune", sft_dir, "qwen35_tiny_gsm8k_cpu.yaml", SFT_OVERRIDES)

        checkpoint_overrides = [
            "model.name=last_checkpoint",
            f"common.assets.prev_checkpoint_dir={sft_dir / 'checkpoints'}",
            "common.no_sweep_dir=true",
            "seq_generator.config.max_gen_len=12",
        ]

        eval_dir = tmp_path / "eval"

        process = run_recipe(
            "eval_gsm8k",
            eval_dir,
            "qwen35_0.8b_gsm8k_eval.yaml",
            [
                *checkpoint_overrides,
                "model.dtype=float32",
                "dataset.sources=[{path: 'synthetic://gsm8k', pattern: main/test-*.parquet}]",
                "dataset.max_num_examples=3",
                "dataset.batch_size=2",
            ],
        )

        assert "Accuracy:" in process.stdout

        records = [json.loads(line) for line in eval_dir.joinpath("gsm8k", "rank_0.jsonl").read_text().splitlines()]

        assert len(records) == 3

        for record in records:
            assert set(record) == {"id", "question", "reference", "generation", "reference_answer", "answer", "correct", "truncated"}

            assert record["correct"] == (record["answer"] == record["reference_answer"])

        [values] = read_metric_records(eval_dir, "generation")

        assert values["Accuracy"] == pytest.approx(sum(r["correct"] for r in records) / 3)

        assert values["Number of Truncated Responses"] == sum(r["truncated"] for r in records)

        prompts = tmp_path / "prompts.jsonl"

        prompts.write_text('{"src": "What is 2 + 2?", "id": "p1"}\n{"src": "Name a prime."}\n', encoding="utf-8")

        generate_dir = tmp_path / "generate"

        # The recipe's defaults: top-p sampling.
        run_recipe("generate", generate_dir, None, [*checkpoint_overrides, f"dataset.sources=[{{path: {prompts}}}]"])

        generations = [json.loads(line) for line in generate_dir.joinpath("generations", "rank_0.jsonl").read_text().splitlines()]

        assert [g["id"] for g in generations] == ["p1", "prompts.jsonl:2"]

        assert all(isinstance(g["response"], str) for g in generations)
