"""LoRA in the training recipes (the ``lora`` section): adapters on the
model before it is sharded, the base frozen.

The adapters go on the model while it is still on the meta device, before
:func:`~qwen35_fs2.hf.sharded_loading.finish_sharded_checkpoint_loading`
shards it: FSDP2 then shards the adapters with the projections they belong
to, and reduces their gradients as any other parameter's. The base is read
from its Hugging Face checkpoint, the adapters start as new ones.

fairseq2's AdamW gets every parameter of the model, but PyTorch's AdamW
keeps state only for parameters that have a gradient: the frozen base gets
none, so only the adapters have optimizer state.
"""

from __future__ import annotations

from torch.nn import Module

from fairseq2.logging import log
from fairseq2.recipe.base import RecipeContext
from fairseq2.recipe.error import RecipeError

from qwen35_fs2.hf.sharded_loading import ShardedCheckpointLoading
from qwen35_fs2.lora import LoraConfig, apply_lora


def setup_lora(context: RecipeContext, model: Module, config: LoraConfig) -> None:
    """Freezes ``model`` and puts the adapters of ``config`` on it; call it
    in ``Recipe.setup_model`` before the model is sharded.

    :raises RecipeError: if the model does not start from a Hugging Face
        checkpoint, which it does not when a run resumes from its own
        checkpoints (not supported yet) or trains a new model.
    """
    loading = context.resolver.maybe_resolve(ShardedCheckpointLoading)

    checkpoint = None if loading is None else loading.get(model)

    if checkpoint is None:
        raise RecipeError(
            "With `lora`, the model must start from a Hugging Face checkpoint (`model.name` of a Qwen3.5 card or `model.path` of a Hugging Face directory), but it does not. "
            "Resuming a LoRA run from its checkpoints is not supported yet, and a new model has no base to adapt: export a checkpoint with `fairseq2 lm export_hf` first."
        )

    adapters = apply_lora(model, config, checkpoint.config)

    log.info("Put LoRA adapters (r={}) on {} projections; the other parameters are frozen.", config.r, len(adapters))
