"""The refusal of end-of-epoch checkpoints
(:mod:`qwen35_fs2.compat.epoch_checkpoints`): the fairseq2 0.8.1 behaviour it
relies on, and the recipes' error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fairseq2.recipe.config import RegimeSection
from fairseq2.trainer import Trainer, _TrainerState

from qwen35_fs2.compat.epoch_checkpoints import validate_epoch_checkpoints
from qwen35_fs2.recipes.sft.config import InstructionFinetuneConfig
from qwen35_fs2.recipes.train.config import PretrainConfig


class TestFairseq2Trainer:
    def test_saves_the_end_of_epoch_checkpoint_before_it_counts_the_epoch(self) -> None:
        # The state `Trainer._handle_end_of_data_epoch` reads; its post-step
        # actions (where the checkpoint is saved) record the epoch number
        # they would save.
        saved_epochs: list[int] = []

        trainer = SimpleNamespace(_data_epoch_nr=1, _step_nr=3, _max_num_data_epochs=2, _unit=SimpleNamespace(set_data_epoch_nr=lambda nr: None))

        def run_post_step() -> _TrainerState:
            saved_epochs.append(trainer._data_epoch_nr)

            return _TrainerState.DATA_LOAD

        trainer._run_post_step = run_post_step

        assert Trainer._handle_end_of_data_epoch(trainer) == _TrainerState.DATA_LOAD  # type: ignore[arg-type]

        assert trainer._data_epoch_nr == 2

        assert saved_epochs == [1], (
            "fairseq2's trainer now counts a data epoch before it saves the checkpoint at its end: "
            "remove `qwen35_fs2.compat.epoch_checkpoints` (and its use in the recipes' configs)."
        )


class TestValidateEpochCheckpoints:
    def test_refuses_checkpoints_every_n_data_epochs(self) -> None:
        result = validate_epoch_checkpoints(RegimeSection(num_data_epochs=2, checkpoint_every_n_data_epochs=1))

        assert result.errors == [
            "`regime.checkpoint_every_n_data_epochs` must be `None`, but is 1 instead: "
            "fairseq2 0.8.1 saves that checkpoint before it counts the epoch as done, so a run resumed from it trains one data epoch more than `regime.num_data_epochs`. "
            "Save checkpoints by steps (`regime.checkpoint_every_n_steps`)."
        ]

    @pytest.mark.parametrize("config_kls", [InstructionFinetuneConfig, PretrainConfig])
    def test_the_recipes_refuse_it(self, config_kls: type[InstructionFinetuneConfig] | type[PretrainConfig]) -> None:
        config = config_kls()

        assert not config.validate().has_error()

        config.regime.checkpoint_every_n_data_epochs = 1

        assert any("`regime.checkpoint_every_n_data_epochs` must be `None`" in error for error in config.validate().errors)
