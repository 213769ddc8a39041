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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import final

import torch

from fairseq2.gang import ReduceOperation
from fairseq2.recipe.trainer import Trainer
from fairseq2.trainer import _TrainerState


def stop_on_signal(trainer: Trainer) -> None:
    """Makes every rank of ``trainer`` stop, with a checkpoint, at the first
    step after which any rank was asked to stop, whether or not the run has a
    step budget."""
    post_step = _AgreedStopPostStep(trainer, trainer._run_post_step)

    # An instance attribute: `Trainer` calls `self._run_post_step()`.
    trainer._run_post_step = post_step  # type: ignore[method-assign]


@final
class _AgreedStopPostStep:
    """fairseq2's ``_run_post_step`` of one trainer, ended by a stop request
    that the ranks agree on."""

    def __init__(self, trainer: Trainer, run_post_step: Callable[[], _TrainerState]) -> None:
        self._trainer = trainer
        self._run_post_step = run_post_step

    def __call__(self) -> _TrainerState:
        trainer = self._trainer

        at_end = trainer._max_num_steps is not None and trainer._step_nr >= trainer._max_num_steps

        if not at_end and self._any_rank_asked_to_stop():
            return _TrainerState.STOP_REQUESTED

        return self._run_post_step()

    def _any_rank_asked_to_stop(self) -> bool:
        """Returns ``True`` on every rank if any rank was asked to stop."""
        trainer = self._trainer

        gang = trainer._gangs.root

        flag = torch.tensor([1.0 if trainer._stop_requested else 0.0], device=gang.device)

        # SUM rather than MAX: fairseq2's single-process gang supports only SUM.
        gang.all_reduce(flag, ReduceOperation.SUM)

        stop = flag.item() > 0

        # `Trainer.run` raises `TaskStopException` on every rank that stops.
        trainer._stop_requested = stop

        return stop
