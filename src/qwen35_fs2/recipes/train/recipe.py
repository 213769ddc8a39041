"""``lm train``: continued pretraining on parquet text shards (FineWeb-Edu by
default), packed to ``max_seq_len`` with document boundaries and resumable
exactly."""

from __future__ import annotations

from typing import final

from typing_extensions import override

from fairseq2.datasets import DataReader, SequenceBatch, SyncMode
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.recipe.base import RecipeContext
from fairseq2.task import Task
from fairseq2.utils.uri import Uri

from qwen35_fs2.datasets.pretraining import PretrainingDataset, PretrainingReader
from qwen35_fs2.recipes.common import (
    LMTrainingRecipe,
    check_pretraining_vocabulary,
    check_valid_files_apart,
)
from qwen35_fs2.recipes.idle_batches import IdleBatchReader
from qwen35_fs2.recipes.synthetic import SYNTHETIC_SCHEME, materialize_synthetic_dataset
from qwen35_fs2.recipes.train.config import ParquetTextSource, PretrainConfig


@final
class PretrainRecipe(LMTrainingRecipe):
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
            max_num_batches=None,
        )

        valid_reader: DataReader[SequenceBatch] | None

        if section.valid is None:
            valid_reader = None
        else:
            # Every rank evaluates all of its batches (up to the cap), and runs
            # idle batches while other ranks evaluate theirs.
            valid_batches = self._create_reader(
                context,
                section.valid,
                num_accumulate=1,
                shuffle=False,
                drop_remainder=False,
                max_num_batches=section.max_num_valid_batches,
                sync_mode=SyncMode.UNTIL_LAST,
            )

            # A `valid` source of the same Hugging Face dataset as `train`
            # takes the same default `hf_allow_patterns`.
            check_valid_files_apart(
                train_reader.files,
                valid_batches.files,
                hint="Give `valid` other paths, or other `hf_allow_patterns`.",
            )

            # Idle batches have no target: any token will do (pretraining has
            # no pad token).
            valid_reader = IdleBatchReader(valid_batches, 0)

        check_pretraining_vocabulary(context.get_model_as(TransformerLM), tokenizer)

        return self.create_lm_trainer(context, train_reader, valid_reader)

    @staticmethod
    def _create_reader(
        context: RecipeContext,
        source: ParquetTextSource,
        *,
        num_accumulate: int,
        shuffle: bool,
        drop_remainder: bool,
        max_num_batches: int | None,
        sync_mode: SyncMode = SyncMode.UNTIL_FIRST,
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
            max_num_batches=max_num_batches,
            prefetch=section.prefetch,
            sync_mode=sync_mode,
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

