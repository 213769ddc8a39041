"""Layerwise activation checkpointing of Qwen3.5 models (the families'
applier)."""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.nn import Module

from fairseq2.models.transformer_lm import TransformerLM, apply_ac_to_transformer_lm


def apply_ac_to_qwen35(model: TransformerLM, every_nth_layer: int) -> Module:
    """fairseq2's layerwise activation checkpointing, except that it leaves
    a model whose layers it already wraps as it is (as
    :func:`~qwen35_fs2.hf.sharded_loading.finish_sharded_checkpoint_loading`
    leaves it before fairseq2 applies it again)."""
    if any(isinstance(layer, CheckpointWrapper) for layer in model.decoder.layers):
        return model

    return apply_ac_to_transformer_lm(model, every_nth_layer)
