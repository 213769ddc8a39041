"""``lm eval_gsm8k``: greedy answers to GSM8K questions with incremental
decoding, their final numbers, and the exact-match accuracy against the
references. Writes every generation to ``OUTPUT_DIR/gsm8k/rank_<r>.jsonl``."""

from __future__ import annotations

from typing import final

from typing_extensions import override

from fairseq2.metrics import Mean, MetricBag, Sum
from fairseq2.recipe.base import Recipe, RecipeContext
from fairseq2.runtime.dependency import DependencyContainer
from fairseq2.task import Task

from qwen35_fs2.datasets.gsm8k import extract_gsm8k_answer
from qwen35_fs2.recipes.common import register_lm_recipe_extras
from qwen35_fs2.recipes.eval_gsm8k.config import EvalGsm8kConfig
from qwen35_fs2.recipes.generation import (
    ResponseUnit,
    create_response_task,
    read_prompt_examples,
)
from qwen35_fs2.recipes.instruction import InstructionDataError


@final
class EvalGsm8kRecipe(Recipe):
    @override
    def register(self, container: DependencyContainer) -> None:
        register_lm_recipe_extras(container)

    @override
    def create_task(self, context: RecipeContext) -> Task:
        config = context.get_config_as(EvalGsm8kConfig)

        section = config.dataset

        examples = read_prompt_examples(section, require_response=True)

        # A reference without a final answer would count as a wrong answer.
        for example in examples:
            if extract_gsm8k_answer(example["response"]) is None:
                raise InstructionDataError(
                    f"The reference answer of example {example['id']} must end with a number (`#### <number>`), but has none."
                )

        return create_response_task(
            context,
            section,
            examples,
            Gsm8kEvalUnit, "gsm8k",
            seq_generator=config.seq_generator,
            speculative=config.speculative_decoding,
        )

    @property
    @override
    def config_kls(self) -> type[object]:
        return EvalGsm8kConfig


@final
class Gsm8kEvalUnit(ResponseUnit):
    @override
    def prepare_metric_bag(self, metric_bag: MetricBag) -> None:
        super().prepare_metric_bag(metric_bag)

        metric_bag.add("accuracy", Mean())
        metric_bag.add("num_correct", Sum())

    @override
    def make_records(
        self, examples: list[dict[str, str]], responses: list[str], metric_bag: MetricBag
    ) -> list[dict[str, object]]:
        records: list[dict[str, object]] = []

        num_correct = 0

        for example, response in zip(examples, responses):
            answer = extract_gsm8k_answer(response)

            reference = extract_gsm8k_answer(example["response"])

            correct = answer is not None and answer == reference

            num_correct += int(correct)

            records.append(
                {
                    "id": example["id"],
                    "question": example["prompt"],
                    "reference": example["response"],
                    "generation": response,
                    "reference_answer": reference,
                    "answer": answer,
                    "correct": correct,
                }
            )

        metric_bag.get("accuracy", Mean).update(num_correct / len(examples), weight=len(examples))
        metric_bag.get("num_correct", Sum).update(num_correct)

        return records
