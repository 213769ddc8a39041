"""``lm train``: continued pretraining on parquet text shards (FineWeb-Edu by
default), packed to ``max_seq_len`` with document boundaries and resumable
exactly."""

from __future__ import annotations

from typing import final

from torch.nn import Module
from typing_extensions import override

from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.recipe.base import Recipe, RecipeContext
from fairseq2.runtime.dependency import DependencyContainer
from fairseq2.task import Task
from fairseq2.utils.uri import Uri

from qwen35_fs2.datasets.pretraining import PretrainingDataset, PretrainingReader
from qwen35_fs2.models.sharded_family import (
    enable_sharded_checkpoint_loading,
    finish_sharded_checkpoint_loading,
)
from qwen35_fs2.recipes.common import (
    LMLossComputer,
    LMLossEvalUnit,
    LMTrainUnit,
    check_pretraining_vocabulary,
    create_aux_loss_fn,
    has_moe_layers,
    register_lm_recipe_extras,
    setup_lm_loss,
)
from qwen35_fs2.recipes.synthetic import SYNTHETIC_SCHEME, materialize_synthetic_dataset
from qwen35_fs2.recipes.train.config import ParquetTextSource, PretrainConfig


@final
class PretrainRecipe(Recipe):
    def __init__(self) -> None:
        self._has_moe = False

    @override
    def register(self, container: DependencyContainer) -> None:
        register_lm_recipe_extras(container)

        # Hugging Face checkpoints load straight into each rank's shards.
        enable_sharded_checkpoint_loading(container)

    @override
    def setup_model(
        self, context: RecipeContext, model: Module, newly_initialized: bool
    ) -> Module:
        config = context.get_config_as(PretrainConfig)

        model = finish_sharded_checkpoint_loading(context, model)

        self._has_moe = has_moe_layers(model)

        return setup_lm_loss(model, config.loss)

    @override
    def has_static_autograd_graph(self, context: RecipeContext) -> bool:
        # Experts that no token of a batch is routed to get no gradient.
        return not self._has_moe

    @override
    def create_task(self, context: RecipeContext) -> Task:
        config = context.get_config_as(PretrainConfig)

        section = config.dataset

        tokenizer = context.get_tokenizer()

        # Index the data first: a bad file stops the run before the model is
        # built.
        train_reader = self._create_reader(
            context,
            section.train,
            num_accumulate=config.trainer.grad_accumulation.num_batches,
            shuffle=True,
            drop_remainder=True,
        )

        if section.valid is None:
            valid_reader = None
        else:
            valid_reader = self._create_reader(
                context, section.valid, num_accumulate=1, shuffle=False, drop_remainder=False
            )

        check_pretraining_vocabulary(context.get_model_as(TransformerLM), tokenizer)

        dp_model = context.get_data_parallel_model()

        aux_loss_fn = create_aux_loss_fn(dp_model)

        loss_computer = LMLossComputer(dp_model, aux_loss_fn, config.loss.aux_loss_weight)

        unit = LMTrainUnit(loss_computer)

        if valid_reader is None:
            return context.create_trainer(unit, train_reader)

        valid_unit = LMLossEvalUnit(loss_computer)

        return context.create_trainer(unit, train_reader, [valid_unit], [valid_reader])

    @staticmethod
    def _create_reader(
        context: RecipeContext,
        source: ParquetTextSource,
        *,
        num_accumulate: int,
        shuffle: bool,
        drop_remainder: bool,
    ) -> PretrainingReader:
        config = context.get_config_as(PretrainConfig)

        section = config.dataset

        dataset = PretrainingDataset(
            [_resolve_synthetic(path) for path in source.paths],
            hf_allow_patterns=source.hf_allow_patterns,
            text_column=section.text_column,
        )

        return dataset.create_reader(
            context.get_tokenizer(),
            context.gangs,
            max_seq_len=section.max_seq_len,
            max_num_tokens=section.max_num_tokens,
            num_accumulate=num_accumulate,
            seed=config.common.seed,
            shuffle=shuffle,
            drop_remainder=drop_remainder,
            prefetch=section.prefetch,
        )

    @property
    @override
    def config_kls(self) -> type[object]:
        return PretrainConfig


def _resolve_synthetic(path: str) -> str:
    uri = Uri.maybe_parse(path)

    if uri is None or uri.scheme != SYNTHETIC_SCHEME:
        return path

    return str(materialize_synthetic_dataset(uri))

