"""Workaround: a stop request (SIGUSR1) stops a training run that has a step
budget (fairseq2 0.8.1).

SLURM warns a job before its time limit with a signal (our launch scripts ask
for ``--signal=B:USR1@...``), and fairseq2's recipe runner turns SIGUSR1 into
:meth:`Trainer.request_stop`. But fairseq2 0.8.1's ``Trainer._run_post_step``
looks at the request only when ``regime.num_steps`` is unset (the check hangs
off the wrong ``if``), so a run with a step budget ignores it and is killed
at the limit without a checkpoint. fairseq2 offers no public hook between two
steps that could stop the trainer instead: its checkpoint, validation and
metric hooks run only at their intervals, and a train unit cannot end a step
early. So :func:`stop_on_signal` replaces ``_run_post_step`` on one trainer
instance (not on the class: other trainers in the process are left alone).
``tests/unit/compat/test_stop_on_signal.py`` fails once fairseq2 honours the
request itself; this module can then go.

The ranks must also stop at the same step: the signal reaches each rank at a
slightly different moment, and a rank that stops while the others start the
next step deadlocks their collectives. A rank cannot tell the others without
a collective, and a collective only when a rank was signalled would meet the
others' gradient collectives of the next step, so the ranks sum their stop
flags after every step: one all-reduce of a single number, read on the host
(``benchmarks/stop_agreement.py`` measures it). On GPUs the host then waits
for the step's kernels before the next step starts, as the loss check of our
train unit (a host read of the loss after each forward pass) already makes it
wait once per batch.

A signal can also miss the ranks: ``srun`` drops one that comes before it has
started them, and a rank cannot take one before fairseq2 has set its handler
(the SLURM launcher has them ignore it until then; by default it would kill
them). So the launcher also leaves the request in a file, named to the ranks
by the environment variable ``QWEN35_STOP_FILE``, and a rank counts that file
as a request, like the signal. A request made before the first step (while
the ranks start, load or restore) stops them before it, without a
checkpoint: one step more would save one, and a job that the launcher then
requeued would start again from it and be stopped again in the same place.
So besides ``_run_post_step``, :func:`stop_on_signal` replaces the trainer's
``_maybe_restore_state``, the last thing ``Trainer.run`` does before its first
step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import final

import torch

from fairseq2.gang import ReduceOperation
from fairseq2.logging import log
from fairseq2.recipe.error import RecipeError
from fairseq2.recipe.trainer import Trainer
from fairseq2.trainer import _TrainerState

STOP_FILE_ENV = "QWEN35_STOP_FILE"
"""The environment variable by which the SLURM launcher names its stop file."""


def stop_file_from_env(env: Mapping[str, str] = os.environ) -> Path | None:
    """The stop file that ``env`` names in ``QWEN35_STOP_FILE``, if any."""
    value = env.get(STOP_FILE_ENV)

    if value is None:
        return None

    path = Path(value)

    if not path.is_absolute():
        raise RecipeError(f"`{STOP_FILE_ENV}` must be an absolute file path, but is '{value}' instead.")

    return path


def stop_on_signal(trainer: Trainer, *, stop_file: Path | None = None) -> None:
    """Makes every rank of ``trainer`` stop at the first step after which any
    rank was asked to stop (by SIGUSR1 or, if given, by the existence of
    ``stop_file``), with a checkpoint, whether or not the run has a step
    budget; asked before the first step, before it, without one."""
    agreement = _StopAgreement(trainer, stop_file)

    # Instance attributes: `Trainer` calls `self._maybe_restore_state()` and
    # `self._run_post_step()`.
    trainer._maybe_restore_state = _StopBeforeFirstStep(agreement, trainer._maybe_restore_state)  # type: ignore[method-assign]

    trainer._run_post_step = _AgreedStopPostStep(trainer, agreement, trainer._run_post_step)  # type: ignore[method-assign]


@final
class _StopAgreement:
    """Whether any rank of one trainer was asked to stop."""

    def __init__(self, trainer: Trainer, stop_file: Path | None) -> None:
        self._trainer = trainer
        self._stop_file = stop_file

    def any_rank_asked_to_stop(self) -> bool:
        """Returns ``True`` on every rank if any rank was asked to stop."""
        trainer = self._trainer

        asked = trainer._stop_requested or (self._stop_file is not None and self._stop_file.exists())

        gang = trainer._gangs.root

        flag = torch.tensor([1.0 if asked else 0.0], device=gang.device)

        # SUM rather than MAX: fairseq2's single-process gang supports only SUM.
        gang.all_reduce(flag, ReduceOperation.SUM)

        stop = flag.item() > 0

        # `Trainer.run` raises `TaskStopException` on every rank that stops.
        trainer._stop_requested = stop

        return stop


@final
class _StopBeforeFirstStep:
    """fairseq2's ``_maybe_restore_state`` of one trainer, followed by the
    stop that the ranks agree on if one was asked for already."""

    def __init__(self, agreement: _StopAgreement, maybe_restore_state: Callable[[], _TrainerState]) -> None:
        self._agreement = agreement
        self._maybe_restore_state = maybe_restore_state

    def __call__(self) -> _TrainerState:
        state = self._maybe_restore_state()

        if state == _TrainerState.STOPPED:
            return state

        if self._agreement.any_rank_asked_to_stop():
            log.info("A stop was requested before the first step: stopping without training and without a checkpoint.")

            # `Trainer._do_run` then runs no step.
            return _TrainerState.STOPPED

        return state


@final
class _AgreedStopPostStep:
    """fairseq2's ``_run_post_step`` of one trainer, ended by a stop request
    that the ranks agree on."""

    def __init__(
        self, trainer: Trainer, agreement: _StopAgreement, run_post_step: Callable[[], _TrainerState]
    ) -> None:
        self._trainer = trainer
        self._agreement = agreement
        self._run_post_step = run_post_step

    def __call__(self) -> _TrainerState:
        trainer = self._trainer

        at_end = trainer._max_num_steps is not None and trainer._step_nr >= trainer._max_num_steps

        if not at_end and self._agreement.any_rank_asked_to_stop():
            return _TrainerState.STOP_REQUESTED

        return self._run_post_step()
