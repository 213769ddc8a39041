"""``lm instruction_finetune``: supervised fine-tuning on instruction examples
(GSM8K by default) rendered with the Qwen3.5 chat template; only the response
tokens are targets."""

from __future__ import annotations

from typing import final

from typing_extensions import override

from fairseq2.assets import get_asset_download_manager
from fairseq2.datasets import SyncMode
from fairseq2.logging import log
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.recipe.base import RecipeContext
from fairseq2.task import Task

from qwen35_fs2.recipes.common import (
    LMTrainingRecipe,
    check_sft_vocabulary,
    check_valid_files_apart,
    get_sft_pad_idx,
)
from qwen35_fs2.recipes.idle_batches import IdleBatchReader
from qwen35_fs2.recipes.instruction import (
    ChatEncoder,
    InstructionExample,
    hold_out_examples,
    list_instruction_files,
    read_instruction_examples,
    warn_of_shared_prompts,
)
from qwen35_fs2.recipes.sft.config import InstructionFinetuneConfig
from qwen35_fs2.recipes.sft.dataset import SFTBatching, create_sft_reader


@final
class InstructionFinetuneRecipe(LMTrainingRecipe):
    @override
    def create_task(self, context: RecipeContext) -> Task:
        config = context.get_config_as(InstructionFinetuneConfig)

        section = config.dataset

        # Read the data first: a bad file or split stops the run before the
        # model is built.
        download_manager = get_asset_download_manager()

        train_files = list_instruction_files(section.train, download_manager)

        train_examples = read_instruction_examples(train_files)

        valid_examples: list[InstructionExample] | None

        if section.num_held_out_examples > 0:
            train_examples, valid_examples = hold_out_examples(
                train_examples, section.num_held_out_examples
            )

            log.info("Held out {} of the {} training examples for validation.", len(valid_examples), len(train_examples) + len(valid_examples))  # fmt: skip
        elif section.valid:
            valid_files = list_instruction_files(section.valid, download_manager)

            check_valid_files_apart(
                train_files,
                valid_files,
                hint="Give `valid` other paths or patterns, or validate on training examples held out of training (`num_held_out_examples`).",
            )

            valid_examples = read_instruction_examples(valid_files)
        else:
            valid_examples = None

        if valid_examples is not None:
            valid_examples = valid_examples[: section.max_num_valid_examples]

            warn_of_shared_prompts(train_examples, valid_examples)

        tokenizer = context.get_tokenizer()

        pad_idx = get_sft_pad_idx(tokenizer)

        encoder = ChatEncoder(tokenizer)

        batching = SFTBatching(
            max_seq_len=section.max_seq_len,
            max_num_tokens=section.max_num_tokens,
            batch_size=section.batch_size,
            packing=section.packing,
        )

        train_reader = create_sft_reader(
            train_examples,
            encoder,
            context.gangs,
            batching,
            pad_idx=pad_idx,
            split_name="train",
            shuffle_window=section.example_shuffle_window,
            seed=config.common.seed,
            num_accumulate=config.trainer.grad_accumulation.num_batches,
            prefetch=section.prefetch,
        )

        if valid_examples is None:
            valid_reader = None
        else:
            # Every rank evaluates all of its examples, and runs idle batches
            # while other ranks evaluate theirs.
            valid_reader = IdleBatchReader(
                create_sft_reader(
                    valid_examples,
                    encoder,
                    context.gangs,
                    batching,
                    pad_idx=pad_idx,
                    split_name="valid",
                    shuffle_window=None,
                    seed=config.common.seed,
                    prefetch=section.prefetch,
                    sync_mode=SyncMode.UNTIL_LAST,
                ),
                pad_idx,
            )

        check_sft_vocabulary(context.get_model_as(TransformerLM), tokenizer)

        return self.create_lm_trainer(context, train_reader, valid_reader)

    @property
    @override
    def config_kls(self) -> type[object]:
        return InstructionFinetuneConfig
