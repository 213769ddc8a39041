"""The stop-on-signal workaround (:mod:`qwen35_fs2.compat.stop_on_signal`):
what it relies on in fairseq2 0.8.1, and what it does. The full protocol (a
signalled two-rank run checkpoints, requeues and resumes with the same
losses; a stop while the ranks start ends the job) is in ``tests/slurm``; a
recipe run that finds the stop file at its start is in
``tests/integration/recipes/test_sft.py``."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest

from fairseq2.device import CPU
from fairseq2.gang import FakeGang
from fairseq2.recipe.error import RecipeError
from fairseq2.recipe.trainer import Trainer
from fairseq2.task import TaskStopException
from fairseq2.trainer import _TrainerState

from qwen35_fs2.compat.stop_on_signal import STOP_FILE_ENV, stop_file_from_env, stop_on_signal


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


def _stand_in_trainer_to_run(*, stop_requested: bool) -> SimpleNamespace:
    """A stand-in with what ``Trainer.run`` and ``Trainer._do_run`` read,
    whose restore stops the run, and which fails the test if it reads a
    batch (what a step starts with)."""
    trainer = _stand_in_trainer(max_num_steps=10, step_nr=0, stop_requested=stop_requested)

    progress_reporter = nullcontext()

    progress_reporter.create_task = lambda name, total, completed: nullcontext()  # type: ignore[attr-defined]

    trainer.__dict__.update(
        _state=_TrainerState.NOT_STARTED,
        _gangs=SimpleNamespace(root=FakeGang(CPU), close=lambda: None),
        _seed=2,
        _data_epoch_nr=1,
        _progress_reporter=progress_reporter,
        _rng_bag=SimpleNamespace(temporary_manual_seed=lambda seed: nullcontext()),
        _profiler=nullcontext(),
        _garbage_collector=nullcontext(),
        _lapse_watch=nullcontext(),
        _model=SimpleNamespace(train=lambda: None),
        _unit=SimpleNamespace(set_data_epoch_nr=lambda nr: None),
        _device_stat_tracker=SimpleNamespace(reset=lambda: None),
        _maybe_restore_state=lambda: _TrainerState.STOPPED,
        _read_next_batches=lambda: pytest.fail("the trainer started a step"),
        _do_run=lambda: Trainer._do_run(trainer),  # type: ignore[arg-type]
    )

    return trainer


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

    @pytest.mark.parametrize("stop_requested", [False, True], ids=["no-request", "request"])
    def test_a_run_stopped_by_its_restore_runs_no_step(self, stop_requested: bool) -> None:
        """What a stop before the first step relies on: `Trainer.run` takes
        its first state from `self._maybe_restore_state()`, runs no step (and
        saves nothing) from `STOPPED`, and raises `TaskStopException` if a
        stop was requested."""
        trainer = _stand_in_trainer_to_run(stop_requested=stop_requested)

        with pytest.raises(TaskStopException) if stop_requested else nullcontext():
            Trainer.run(trainer)  # type: ignore[arg-type]

        assert trainer._state == _TrainerState.STOPPED

        assert trainer.calls == []


class TestStopOnSignal:
    def _install(self, trainer: SimpleNamespace, stop_file: Path | None = None) -> list[str]:
        """Installs the workaround over stand-ins of fairseq2's restore and
        post step, and returns the list of the stand-ins' calls."""
        calls: list[str] = []

        def maybe_restore_state() -> _TrainerState:
            calls.append("restore")

            return _TrainerState.DATA_LOAD

        def run_post_step() -> _TrainerState:
            calls.append("post-step")

            return _TrainerState.DATA_LOAD

        trainer._maybe_restore_state = maybe_restore_state
        trainer._run_post_step = run_post_step

        stop_on_signal(trainer, stop_file=stop_file)  # type: ignore[arg-type]

        return calls

    def test_stops_on_a_request_under_a_step_budget(self) -> None:
        trainer = _stand_in_trainer(max_num_steps=10, step_nr=3, stop_requested=True)

        calls = self._install(trainer)

        assert trainer._run_post_step() == _TrainerState.STOP_REQUESTED

        # `Trainer.run` then raises `TaskStopException`.
        assert trainer._stop_requested is True

        assert calls == []

    @pytest.mark.parametrize(("step_nr", "stop_requested"), [(3, False), (10, True)], ids=["no-request", "last-step"])
    def test_leaves_the_step_to_fairseq2_otherwise(self, step_nr: int, stop_requested: bool) -> None:
        trainer = _stand_in_trainer(max_num_steps=10, step_nr=step_nr, stop_requested=stop_requested)

        calls = self._install(trainer)

        assert trainer._run_post_step() == _TrainerState.DATA_LOAD

        assert calls == ["post-step"]

    def test_stops_when_the_stop_file_appears(self, tmp_path: Path) -> None:
        trainer = _stand_in_trainer(max_num_steps=10, step_nr=3, stop_requested=False)

        stop_file = tmp_path / "stop"

        calls = self._install(trainer, stop_file)

        assert trainer._run_post_step() == _TrainerState.DATA_LOAD

        stop_file.touch()

        assert trainer._run_post_step() == _TrainerState.STOP_REQUESTED

        assert trainer._stop_requested is True

        assert calls == ["post-step"]

    @pytest.mark.parametrize("by", ["signal", "file"])
    def test_a_request_before_the_first_step_stops_the_run_after_its_restore(self, tmp_path: Path, by: str) -> None:
        trainer = _stand_in_trainer(max_num_steps=10, step_nr=0, stop_requested=by == "signal")

        stop_file = tmp_path / "stop"

        if by == "file":
            stop_file.touch()

        calls = self._install(trainer, stop_file)

        assert trainer._maybe_restore_state() == _TrainerState.STOPPED

        # `Trainer.run` then raises `TaskStopException`.
        assert trainer._stop_requested is True

        assert calls == ["restore"]

    def test_leaves_the_start_to_fairseq2_without_a_request(self, tmp_path: Path) -> None:
        trainer = _stand_in_trainer(max_num_steps=10, step_nr=0, stop_requested=False)

        calls = self._install(trainer, tmp_path / "stop")

        assert trainer._maybe_restore_state() == _TrainerState.DATA_LOAD

        assert trainer._stop_requested is False

        assert calls == ["restore"]

    def test_leaves_other_trainers_alone(self) -> None:
        trainer = _stand_in_trainer(max_num_steps=10, step_nr=3, stop_requested=True)

        self._install(trainer)

        assert vars(Trainer)["_run_post_step"].__module__ == "fairseq2.trainer"

        assert vars(Trainer)["_maybe_restore_state"].__module__ == "fairseq2.trainer"


class TestStopFileFromEnv:
    def test_reads_the_path(self, tmp_path: Path) -> None:
        assert stop_file_from_env({STOP_FILE_ENV: str(tmp_path / "stop")}) == tmp_path / "stop"

    def test_is_none_when_unset(self) -> None:
        assert stop_file_from_env({}) is None

    @pytest.mark.parametrize("value", ["", "out/stop"])
    def test_rejects_a_relative_path(self, value: str) -> None:
        with pytest.raises(RecipeError, match=rf"^`QWEN35_STOP_FILE` must be an absolute file path, but is '{value}' instead\.$"):
            stop_file_from_env({STOP_FILE_ENV: value})
