"""A base for data readers that change one thing about the reader they wrap
(the batches a rank without data gets, the state a checkpoint holds) and
leave the rest to it."""

from __future__ import annotations

from typing import Generic, TypeVar

from typing_extensions import Self, override

from fairseq2.datasets import DataReader

BatchT = TypeVar("BatchT")


class DelegatingReader(DataReader[BatchT], Generic[BatchT]):
    """``reader``, method for method; subclasses override what they change."""

    def __init__(self, reader: DataReader[BatchT]) -> None:
        self._reader = reader

    @override
    def __iter__(self) -> Self:
        return self

    @override
    def __next__(self) -> list[BatchT]:
        return next(self._reader)

    @override
    def reset(self) -> None:
        self._reader.reset()

    @override
    def state_dict(self) -> dict[str, object]:
        return self._reader.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        self._reader.load_state_dict(state_dict)

    @property
    @override
    def num_accumulate(self) -> int:
        return self._reader.num_accumulate
