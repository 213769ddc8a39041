"""Makes SIGUSR1 stop a training run with a step budget (fairseq2 0.8.1).

SLURM warns a job before its time limit with a signal (our launch scripts ask
for ``--signal=B:USR1@...``); fairseq2's recipe CLI turns SIGUSR1 into
:meth:`Trainer.request_stop`. But fairseq2 0.8.1's ``Trainer._run_post_step``
looks at the request only when ``regime.num_steps`` is unset (the check hangs
off the wrong ``if``), so a run with a step budget ignores it and is killed at
the limit without a checkpoint.

The ranks must also stop at the same step: the signal reaches each rank at a
slightly different moment, and a rank that stops while the others start the
next step deadlocks their collectives. So the stop flags are summed over the
ranks after every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import torch

from fairseq2.gang import ReduceOperation
from fairseq2.trainer import Trainer, _TrainerState

_FAIRSEQ2_RUN_POST_STEP: Final[Callable[[Trainer], _TrainerState]] = Trainer._run_post_step


def install_stop_on_signal_fix() -> None:
    """Makes every rank stop (with a checkpoint) at the first step after any
    rank was asked to. Idempotent."""
    Trainer._run_post_step = _run_post_step  # type: ignore[method-assign]


def _run_post_step(self: Trainer) -> _TrainerState:
    at_end = self._max_num_steps is not None and self._step_nr >= self._max_num_steps

    if not at_end and _agree_on_stop(self):
        return _TrainerState.STOP_REQUESTED

    return _FAIRSEQ2_RUN_POST_STEP(self)


def _agree_on_stop(trainer: Trainer) -> bool:
    """Returns ``True`` on every rank if any rank was asked to stop."""
    gang = trainer._gangs.root

    flag = torch.tensor([1.0 if trainer._stop_requested else 0.0], device=gang.device)

    # SUM rather than MAX: fairseq2's single-process gang supports only SUM.
    gang.all_reduce(flag, ReduceOperation.SUM)

    stop = flag.item() > 0

    # `Trainer.run` raises `TaskStopException` on every rank that stops.
    trainer._stop_requested = stop

    return stop
