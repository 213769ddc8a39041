"""``lm generate``: chat responses to the prompts of parquet or JSONL files,
written to ``OUTPUT_DIR/generations/rank_<r>.jsonl``."""

from __future__ import annotations

from typing import final

from typing_extensions import override

from fairseq2.metrics import MetricBag
from fairseq2.recipe.base import Recipe, RecipeContext
from fairseq2.runtime.dependency import DependencyContainer
from fairseq2.task import Task

from qwen35_fs2.recipes.common import register_lm_recipe_extras
from qwen35_fs2.recipes.generate.config import GenerateConfig
from qwen35_fs2.recipes.generation import (
    ResponseUnit,
    create_response_task,
    read_prompt_examples,
)


@final
class GenerateRecipe(Recipe):
    @override
    def register(self, container: DependencyContainer) -> None:
        register_lm_recipe_extras(container)

    @override
    def create_task(self, context: RecipeContext) -> Task:
        config = context.get_config_as(GenerateConfig)

        section = config.dataset

        examples = read_prompt_examples(section, require_response=False)

        return create_response_task(
            context,
            section,
            examples,
            GenerateUnit, "generations",
            seq_generator=config.seq_generator,
            speculative=config.speculative_decoding,
        )

    @property
    @override
    def config_kls(self) -> type[object]:
        return GenerateConfig


@final
class GenerateUnit(ResponseUnit):
    @override
    def make_records(
        self, examples: list[dict[str, str]], responses: list[str], metric_bag: MetricBag
    ) -> list[dict[str, object]]:
        return [
            {"id": example["id"], "prompt": example["prompt"], "response": response}
            for example, response in zip(examples, responses)
        ]
