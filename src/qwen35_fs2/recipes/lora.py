"""LoRA in the training recipes (the ``lora`` section): adapters on the
model before it is sharded, the base frozen, checkpoints of the adapters
alone.

The adapters go on the model while it is still on the meta device, before
:func:`~qwen35_fs2.hf.sharded_loading.finish_sharded_checkpoint_loading`
shards it: FSDP2 then shards the adapters with the projections they belong
to, and reduces their gradients as any other parameter's. The base is read
from its Hugging Face checkpoint, the adapters start as new ones.

fairseq2's AdamW gets every parameter of the model, but PyTorch's AdamW
keeps state only for parameters that have a gradient: the frozen base gets
none, so only the adapters have optimizer state.

The run's checkpoints hold the adapters and not the base
(:func:`save_adapters_only`, :mod:`qwen35_fs2.lora.checkpoint`), and record
the base in the checkpoint directory when the run starts. A resumed run reads
its base again from the Hugging Face checkpoint of its ``model`` section,
which must be the recorded one, into its shards as a new run does; fairseq2
then restores the adapters, the optimizer, the learning rate and the data
reader from the last checkpoint.
"""

from __future__ import annotations

from torch.nn import Module

from fairseq2.logging import log
from fairseq2.nn.data_parallel import get_data_parallel_facade, set_data_parallel_facade
from fairseq2.recipe.base import RecipeContext
from fairseq2.recipe.config import ModelSection
from fairseq2.recipe.error import ModelCheckpointNotFoundError, RecipeError

from qwen35_fs2.hf.sharded_loading import DeferredCheckpoint, ShardedCheckpointLoading
from qwen35_fs2.lora import LoraConfig, apply_lora
from qwen35_fs2.lora.checkpoint import (
    LoraBaseError,
    LoraCheckpointFacade,
    check_lora_base,
    check_lora_config,
    describe_lora_base,
    load_lora_base,
    save_lora_base,
)
from qwen35_fs2.recipes.checkpoint_dir import get_checkpoint_dir

_NO_BASE_MESSAGE = (
    "With `lora`, the model must start from a Hugging Face checkpoint (`model.name` of a Qwen3.5 card or `model.path` of a Hugging Face directory), but it does not. "
    "A new model has no base to adapt: export a checkpoint with `fairseq2 lm export_hf` first."
)


def setup_lora(context: RecipeContext, model: Module, config: LoraConfig) -> None:
    """Freezes ``model`` and puts the adapters of ``config`` on it; call it
    in ``Recipe.setup_model`` before the model is sharded.

    A new run records its base and ``config`` in the checkpoint directory.
    In a resumed run fairseq2 creates the model without its base; its base
    is then read again from the Hugging Face checkpoint of the ``model``
    section, by
    :func:`~qwen35_fs2.hf.sharded_loading.finish_sharded_checkpoint_loading`
    as in a new run.

    :raises RecipeError: if the model does not start from a Hugging Face
        checkpoint (a new model), or a resumed run's base or adapters are not
        the ones its checkpoints recorded.
    """
    loading = context.resolver.maybe_resolve(ShardedCheckpointLoading)

    if loading is None:
        raise RecipeError(_NO_BASE_MESSAGE)

    checkpoint_dir = get_checkpoint_dir(context)

    checkpoint = loading.get(model)

    if checkpoint is not None:
        if context.gangs.root.rank == 0:
            save_lora_base(checkpoint_dir, describe_lora_base(checkpoint.path, config))
    else:
        if not context.get_checkpoint_manager().has_checkpoint(exclude_model_only=True):
            raise RecipeError(_NO_BASE_MESSAGE)

        checkpoint = _find_base(context, loading, model)

        try:
            recorded = load_lora_base(checkpoint_dir)

            check_lora_base(recorded, checkpoint.path)

            check_lora_config(recorded, config)
        except LoraBaseError as ex:
            raise RecipeError(str(ex)) from None

        loading.defer(model, checkpoint)

        log.info("Resuming a LoRA run: its base is read again from {}, its adapters from its last checkpoint.", checkpoint.path)  # fmt: skip

    adapters = apply_lora(model, config, checkpoint.config)

    log.info("Put LoRA adapters (r={}) on {} projections; the other parameters are frozen.", config.r, len(adapters))


def _find_base(context: RecipeContext, loading: ShardedCheckpointLoading, model: Module) -> DeferredCheckpoint:
    """Returns the Hugging Face checkpoint of the ``model`` section, found as
    in a new run, for ``model``, which fairseq2 created without weights to
    resume a run.

    The family of ``model`` is asked to load the checkpoint with the
    configuration of ``model`` and, sharded loading being on, returns
    another model on the meta device and defers its loading: the deferred
    checkpoint is taken from that model, which is dropped. fairseq2 0.8.1
    keeps the model it created whatever ``Recipe.setup_model`` returns, so
    that model is the one to load into.
    """
    origin = loading.get_origin(model)

    section = context.resolver.resolve(ModelSection)

    gangs = context.gangs

    if origin is None:
        stand_in = None
    elif section.path is not None:
        # As fairseq2 loads it: `model.path` takes precedence over `model.name`.
        try:
            stand_in = origin.family.load_custom_model(
                section.path, origin.config, gangs, section.dtype, load_rank0_only=True, mmap=section.mmap, restrict=None
            )
        except FileNotFoundError as ex:
            raise ModelCheckpointNotFoundError(section.path) from ex
    elif section.name is not None:
        card = context.asset_store.retrieve_card(section.name)

        stand_in = origin.family.load_model(card, gangs, section.dtype, origin.config, load_rank0_only=True, mmap=section.mmap)
    else:
        stand_in = None

    checkpoint = None if stand_in is None else loading.take(stand_in)

    if checkpoint is None:
        raise RecipeError(_NO_BASE_MESSAGE)

    return checkpoint


def save_adapters_only(dp_model: Module) -> None:
    """Makes fairseq2's checkpoints of ``dp_model``, the data-parallel model
    of a LoRA run, hold its adapters alone, and their restoring leave its
    base as it is; call it before the trainer is created."""
    set_data_parallel_facade(dp_model, LoraCheckpointFacade(get_data_parallel_facade(dp_model)))
