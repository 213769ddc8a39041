"""The stop-on-signal workaround (:mod:`qwen35_fs2.compat.stop_on_signal`):
what it relies on in fairseq2 0.8.1, and what it does. The full protocol (a
signalled two-rank run checkpoints, requeues and resumes with the same
losses) is ``tests/slurm/test_slurm_training.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fairseq2.device import CPU
from fairseq2.gang import FakeGang
from fairseq2.recipe.trainer import Trainer
from fairseq2.trainer import _TrainerState

from qwen35_fs2.compat.stop_on_signal import stop_on_signal


def _stand_in_trainer(*, max_num_steps: int | None, step_nr: int, stop_requested: bool) -> SimpleNamespace:
    """The state ``Trainer._run_post_step`` reads, and the post-step actions
    it calls, which do nothing here."""
    calls: list[str] = []

    return SimpleNamespace(
        _max_num_steps=max_num_steps,
        _step_nr=step_nr,
        _stop_requested=stop_requested,
        _gangs=SimpleNamespace(root=FakeGang(CPU)),
        _maybe_save_checkpoint=lambda blocking: calls.append("checkpoint"),
        _maybe_publish_metrics=lambda: calls.append("metrics"),
        _maybe_validate=lambda: None,
        calls=calls,
    )


class TestFairseq2Trainer:
    def test_ignores_a_stop_request_under_a_step_budget(self) -> None:
        trainer = _stand_in_trainer(max_num_steps=10, step_nr=3, stop_requested=True)

        state = Trainer._run_post_step(trainer)  # type: ignore[arg-type]

        assert state == _TrainerState.DATA_LOAD, (
            "fairseq2's `Trainer._run_post_step` now stops on a request under a step budget: "
            "remove `qwen35_fs2.compat.stop_on_signal` (and its use in `LMTrainingRecipe.create_lm_trainer`)."
        )

    def test_stops_on_a_request_without_a_step_budget(self) -> None:
        trainer = _stand_in_trainer(max_num_steps=None, step_nr=3, stop_requested=True)

        assert Trainer._run_post_step(trainer) == _TrainerState.STOP_REQUESTED  # type: ignore[arg-type]


class TestStopOnSignal:
    def _install(self, trainer: SimpleNamespace) -> list[str]:
        post_steps: list[str] = []

        def run_post_step() -> _TrainerState:
            post_steps.append("fairseq2")

            return _TrainerState.DATA_LOAD

        trainer._run_post_step = run_post_step

        stop_on_signal(trainer)  # type: ignore[arg-type]

        return post_steps

    def test_stops_on_a_request_under_a_step_budget(self) -> None:
        trainer = _stand_in_trainer(max_num_steps=10, step_nr=3, stop_requested=True)

        post_steps = self._install(trainer)

        assert trainer._run_post_step() == _TrainerState.STOP_REQUESTED

        # `Trainer.run` then raises `TaskStopException`.
        assert trainer._stop_requested is True

        assert post_steps == []

    @pytest.mark.parametrize(("step_nr", "stop_requested"), [(3, False), (10, True)], ids=["no-request", "last-step"])
    def test_leaves_the_step_to_fairseq2_otherwise(self, step_nr: int, stop_requested: bool) -> None:
        trainer = _stand_in_trainer(max_num_steps=10, step_nr=step_nr, stop_requested=stop_requested)

        post_steps = self._install(trainer)

        assert trainer._run_post_step() == _TrainerState.DATA_LOAD

        assert post_steps == ["fairseq2"]

    def test_leaves_other_trainers_alone(self) -> None:
        trainer = _stand_in_trainer(max_num_steps=10, step_nr=3, stop_requested=True)

        self._install(trainer)

        assert vars(Trainer)["_run_post_step"].__module__ == "fairseq2.trainer"
