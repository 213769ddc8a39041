"""Workaround: no checkpoints at the end of data epochs (fairseq2 0.8.1).

fairseq2 0.8.1's ``Trainer._handle_end_of_data_epoch`` runs the post-step
actions, which save the checkpoint of ``regime.checkpoint_every_n_data_epochs``,
before it counts the epoch as done: the checkpoint holds the data reader
already reset for the next epoch and the trainer still in the one that
ended. A run resumed from it reads one data epoch more than
``regime.num_data_epochs`` allows, and numbers every later epoch one behind
(its ``data_epoch`` metric, ``validate_every_n_data_epochs``). Checkpoints
by steps do not meet it: one saved after the last batch of an epoch holds
the reader before its reset, and the resumed run then counts the epoch.

The recipes refuse the setting (:func:`validate_epoch_checkpoints`) rather
than patch the trainer's private state machine.
``tests/unit/compat/test_epoch_checkpoints.py`` fails once fairseq2 counts the
epoch first; the check can then go.
"""

from __future__ import annotations

from fairseq2.recipe.config import RegimeSection
from fairseq2.utils.validation import ValidationResult


def validate_epoch_checkpoints(regime: RegimeSection) -> ValidationResult:
    """Checks that ``regime`` saves no checkpoint at the end of data epochs."""
    result = ValidationResult()

    if regime.checkpoint_every_n_data_epochs is not None:
        result.add_error(
            f"`regime.checkpoint_every_n_data_epochs` must be `None`, but is {regime.checkpoint_every_n_data_epochs} instead: "
            "fairseq2 0.8.1 saves that checkpoint before it counts the epoch as done, so a run resumed from it trains one data epoch more than `regime.num_data_epochs`. "
            "Save checkpoints by steps (`regime.checkpoint_every_n_steps`)."
        )

    return result
