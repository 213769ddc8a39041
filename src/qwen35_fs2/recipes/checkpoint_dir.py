"""The checkpoint directory of a recipe's run."""

from __future__ import annotations

from pathlib import Path

from fairseq2.checkpoint import CheckpointDir
from fairseq2.recipe.base import RecipeContext


def get_checkpoint_dir(context: RecipeContext) -> Path:
    """Returns the directory where fairseq2's checkpoint manager keeps the
    run's checkpoints: the one the recipe's container sets, else
    ``<output_dir>/checkpoints``."""
    checkpoint_dir = context.resolver.resolve(CheckpointDir).path

    if checkpoint_dir is None:
        checkpoint_dir = context.output_dir / "checkpoints"

    return checkpoint_dir
