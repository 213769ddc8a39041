"""A base for data-parallel facades that change one of fairseq2's facade
methods and leave the rest to the facade they wrap.

fairseq2 0.8.1 reaches a data-parallel model through the facade set on it
(:func:`~fairseq2.nn.data_parallel.set_data_parallel_facade`): its trainer
clips gradients and skips their synchronization through it, its checkpoint
manager saves and restores the model through it. Our recipes replace one of
these behaviours at a time (the checkpoints of LoRA runs, the clipping of
sharded gradients), and may replace both on the same model.
"""

from __future__ import annotations

from typing import ContextManager

from torch import Tensor
from typing_extensions import override

from fairseq2.nn.data_parallel import DataParallelFacade


class DelegatingFacade(DataParallelFacade):
    """``facade``, method for method; subclasses override what they change."""

    def __init__(self, facade: DataParallelFacade) -> None:
        self._facade = facade

    @override
    def state_dict(self) -> dict[str, object]:
        return self._facade.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        self._facade.load_state_dict(state_dict)

    @override
    def no_sync(self) -> ContextManager[None]:
        return self._facade.no_sync()

    @override
    def clip_grad_norm(self, max_norm: float | None) -> Tensor:
        return self._facade.clip_grad_norm(max_norm)

    @override
    def summon_full_parameters(self) -> ContextManager[None]:
        return self._facade.summon_full_parameters()
