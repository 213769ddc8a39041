"""``lm generate``: chat responses to the prompts of parquet or JSONL files,
written to ``OUTPUT_DIR/generations/rank_<r>.jsonl``."""

from __future__ import annotations

from typing import final

from typing_extensions import override

from fairseq2.assets import get_asset_download_manager
from fairseq2.metrics import MetricBag
from fairseq2.recipe.base import Recipe, RecipeContext
from fairseq2.runtime.dependency import DependencyContainer
from fairseq2.task import Task

from qwen35_fs2.recipes.common import register_lm_recipe_extras
from qwen35_fs2.recipes.generate.config import GenerateConfig
from qwen35_fs2.recipes.generation import ResponseUnit, create_prompt_reader, open_output_stream
from qwen35_fs2.recipes.instruction import read_instruction_examples


@final
class GenerateRecipe(Recipe):
    @override
    def register(self, container: DependencyContainer) -> None:
        register_lm_recipe_extras(container)

    @override
    def create_task(self, context: RecipeContext) -> Task:
        config = context.get_config_as(GenerateConfig)

        section = config.dataset

        download_manager = get_asset_download_manager()

        examples = read_instruction_examples(
            section.sources, download_manager, require_response=False
        )

        if section.max_num_examples is not None:
            examples = examples[: section.max_num_examples]

        tokenizer = context.get_tokenizer()

        reader = create_prompt_reader(
            examples,
            tokenizer,
            context.gangs,
            batch_size=section.batch_size,
            prefetch=section.prefetch,
        )

        unit = GenerateUnit(
            context.get_seq_generator(), tokenizer, open_output_stream(context, "generations")
        )

        return context.create_generator(unit, reader)

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
