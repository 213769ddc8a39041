"""The configuration of ``lm instruction_finetune``; the defaults fine-tune
Qwen3.5-0.8B-Base on GSM8K."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fairseq2.recipe.config import (
    COSINE_ANNEALING_LR,
    CommonSection,
    CosineAnnealingLRConfig,
    LRSchedulerSection,
    ModelSection,
    OptimizerSection,
    RegimeSection,
    TokenizerSection,
    TrainerSection,
)
from fairseq2.utils.validation import ValidationResult

from qwen35_fs2.models.qwen35.tokenizer import QWEN35_TOKENIZER_ASSET
from qwen35_fs2.lora import LoraConfig
from qwen35_fs2.compat.epoch_checkpoints import validate_epoch_checkpoints
from qwen35_fs2.lora.config import validate_lora_tensor_parallelism
from qwen35_fs2.recipes.gang import Qwen35GangSection
from qwen35_fs2.recipes.common import LMLossSection
from qwen35_fs2.recipes.instruction import InstructionSource
from qwen35_fs2.recipes.optim import create_adamw_section, validate_cosine_schedule


@dataclass(kw_only=True)
class SFTDatasetSection:
    train: list[InstructionSource] = field(
        default_factory=lambda: [
            InstructionSource(path="hg://openai/gsm8k", pattern="main/train-*.parquet")
        ]
    )
    """The training examples."""

    valid: list[InstructionSource] = field(default_factory=list)
    """
    The validation examples. If empty and ``num_held_out_examples`` is 0, the
    recipe does not validate.
    """

    num_held_out_examples: int = 0
    """
    If greater than 0, the number of ``train`` examples held out of training
    and validated on, instead of ``valid``: those whose prompts have the
    smallest SHA-256 digests, the same whatever the seed, the order of the
    files or the number of ranks (for data without a validation split, such as
    GSM8K, whose test split is for ``lm eval_gsm8k``).
    """

    max_num_valid_examples: int | None = None
    """If not ``None``, only the first validation examples are used; not fewer
    than ``num_held_out_examples``, which are taken out of training."""

    max_seq_len: int = 2048
    """The maximum number of tokens of an example; longer ones are skipped."""

    max_num_tokens: int = 8192
    """
    The maximum number of tokens of a batch on each rank, padding included; a
    multiple of ``max_seq_len`` for padded batches.
    """

    batch_size: int | None = None
    """If not ``None``, the number of examples of a padded batch, which then
    ignores ``max_num_tokens``."""

    packing: bool = False
    """
    If ``True``, lays the examples of a batch end to end instead of padding
    them; attention and Gated DeltaNet keep the examples apart.
    """

    example_shuffle_window: int = 0
    """The size of the buffer training examples are shuffled in; 0 shuffles
    all of them."""

    prefetch: int = 4
    """The number of batches prepared in the background."""

    def validate(self) -> ValidationResult:
        result = ValidationResult()

        if not self.train:
            result.add_error("`train` must have at least one source, but has none.")

        if self.max_seq_len < 2:
            result.add_error(
                f"`max_seq_len` must be greater than or equal to 2, but is {self.max_seq_len} instead."
            )

        if self.max_num_tokens < self.max_seq_len:
            result.add_error(
                f"`max_num_tokens` must be greater than or equal to `max_seq_len` ({self.max_seq_len}), but is {self.max_num_tokens} instead."
            )
        elif not self.packing and self.batch_size is None:
            if self.max_num_tokens % self.max_seq_len != 0:
                result.add_error(
                    f"`max_num_tokens` must be a multiple of `max_seq_len` ({self.max_seq_len}) when padded batches are sized by it, but is {self.max_num_tokens} instead."
                )

        if self.batch_size is not None:
            if self.batch_size < 1:
                result.add_error(
                    f"`batch_size` must be greater than or equal to 1, but is {self.batch_size} instead."
                )

            if self.packing:
                result.add_error(
                    "`batch_size` must be `None` when `packing` is `True`, since packed batches are sized by `max_num_tokens`."
                )

        if self.num_held_out_examples < 0:
            result.add_error(
                f"`num_held_out_examples` must be greater than or equal to 0, but is {self.num_held_out_examples} instead."
            )
        elif self.num_held_out_examples > 0 and self.valid:
            result.add_error(
                f"`valid` must be empty when `num_held_out_examples` is greater than 0, but has {len(self.valid)} source(s). Validate on held-out training examples or on `valid`, not both."
            )

        if self.max_num_valid_examples is not None:
            if self.max_num_valid_examples < 1:
                result.add_error(
                    f"`max_num_valid_examples` must be greater than or equal to 1, but is {self.max_num_valid_examples} instead."
                )
            elif self.max_num_valid_examples < self.num_held_out_examples:
                # The held-out examples beyond the cap would be neither
                # trained on nor validated on.
                result.add_error(
                    f"`max_num_valid_examples` must be greater than or equal to `num_held_out_examples` ({self.num_held_out_examples}), but is {self.max_num_valid_examples} instead. Hold out fewer examples."
                )

        if self.example_shuffle_window < 0:
            result.add_error(
                f"`example_shuffle_window` must be greater than or equal to 0, but is {self.example_shuffle_window} instead."
            )

        if self.prefetch < 0:
            result.add_error(
                f"`prefetch` must be greater than or equal to 0, but is {self.prefetch} instead."
            )

        return result


@dataclass(kw_only=True)
class InstructionFinetuneConfig:
    output_dir: Path | None = None
    """
    Where the run writes its logs, metrics and checkpoints, if the command line
    names none. If ``None``, ``outputs/instruction_finetune``.
    """

    model: ModelSection = field(
        default_factory=lambda: ModelSection(name="qwen35_0.8b_base")
    )

    dataset: SFTDatasetSection = field(default_factory=lambda: SFTDatasetSection())

    tokenizer: TokenizerSection = field(
        default_factory=lambda: TokenizerSection(name=QWEN35_TOKENIZER_ASSET)
    )

    gang: Qwen35GangSection = field(default_factory=lambda: Qwen35GangSection())

    trainer: TrainerSection = field(
        default_factory=lambda: TrainerSection(data_parallelism="fsdp", max_grad_norm=1.0)
    )

    optimizer: OptimizerSection = field(
        default_factory=lambda: create_adamw_section(lr=1e-5, weight_decay=0.1)
    )
    """
    AdamW; no weight decay for the parameters of
    :data:`~qwen35_fs2.recipes.optim.NO_WEIGHT_DECAY_PARAMS` (the group in
    ``config.groups``, kept when a configuration file sets other keys).
    """

    lr_scheduler: LRSchedulerSection | None = field(
        default_factory=lambda: LRSchedulerSection(
            name=COSINE_ANNEALING_LR,
            config=CosineAnnealingLRConfig(num_warmup_steps=10, final_lr_scale=0.1),
        )
    )

    regime: RegimeSection = field(
        default_factory=lambda: RegimeSection(
            num_steps=200,
            validate_every_n_steps=50,
            checkpoint_every_n_steps=50,
            keep_last_n_checkpoints=2,
            publish_metrics_every_n_steps=1,
        )
    )

    common: CommonSection = field(default_factory=lambda: CommonSection())

    loss: LMLossSection = field(default_factory=lambda: LMLossSection())

    lora: LoraConfig | None = None
    """
    If not ``None``, trains LoRA adapters on the projections it names and
    freezes the rest of the model, which must start from a Hugging Face
    checkpoint (see docs/recipes.md).
    """

    def validate(self) -> ValidationResult:
        result = validate_lora_tensor_parallelism(self.lora, self.gang.tensor_parallel_size)

        for error in validate_epoch_checkpoints(self.regime).errors + validate_cosine_schedule(self.lr_scheduler, self.regime).errors:
            result.add_error(error)

        return result
