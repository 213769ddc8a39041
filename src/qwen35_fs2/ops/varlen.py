"""The document offsets of a packed batch, made once per batch and handed to
every Gated DeltaNet layer.

A packed batch runs every Gated DeltaNet layer over the same documents. The
kernels need their offsets on the device (``cu_seqlens``) and on the host (to
size their chunk layouts without reading the device), and derive index
tensors from them. :class:`VarlenMetadata` holds both copies and the derived
tensors, so that a forward pass makes them once: the model's decoder builds
it from the batch layout and passes it down, and no layer reads offsets back
from the device (a host synchronization per layer on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar, final

import torch
from torch import Tensor

from fairseq2.nn import BatchLayout

_T = TypeVar("_T")


@final
class VarlenMetadata:
    """The offsets of the documents of a packed batch, on the device and on
    the host, with a cache of what the kernels derive from them.

    Not a dataclass on purpose: FSDP and DDP rebuild dataclass arguments of
    ``forward`` (to cast their tensors), which would drop the cache and give
    every layer new offsets tensors.
    """

    __slots__ = ("cu_seqlens", "cu_seqlens_cpu", "lengths", "_derived")

    cu_seqlens: Tensor
    """``[N + 1]``: the document offsets on the device, int64. Never modified:
    fla caches the helpers it derives by the identity of this tensor."""

    cu_seqlens_cpu: Tensor
    """``[N + 1]``: the same offsets on the host, int64."""

    lengths: tuple[int, ...]
    """The length of every document."""

    def __init__(self, cu_seqlens: Sequence[int], device: torch.device) -> None:
        """
        :param cu_seqlens: The document offsets, from 0 to the number of
            tokens.
        """
        offsets = [int(offset) for offset in cu_seqlens]

        if len(offsets) < 2 or offsets[0] != 0:
            raise ValueError(
                f"`cu_seqlens` must start at 0 and have at least 2 offsets, but is {offsets} instead."
            )

        lengths = tuple(end - begin for begin, end in zip(offsets[:-1], offsets[1:]))

        if min(lengths) < 0:
            raise ValueError(f"`cu_seqlens` must be non-decreasing, but is {offsets} instead.")

        self.cu_seqlens_cpu = torch.tensor(offsets, dtype=torch.int64)

        self.cu_seqlens = self.cu_seqlens_cpu.to(device)

        self.lengths = lengths

        self._derived: dict[Hashable, object] = {}

    @staticmethod
    def of(cu_seqlens: Tensor | VarlenMetadata) -> VarlenMetadata:
        """Returns ``cu_seqlens`` if it is already metadata; otherwise reads
        the offsets tensor on the host (one synchronization)."""
        if isinstance(cu_seqlens, VarlenMetadata):
            return cu_seqlens

        if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
            raise ValueError(
                f"`cu_seqlens` must be a 1-D tensor of at least 2 offsets, but has shape {tuple(cu_seqlens.shape)} instead."
            )

        if cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise ValueError(
                f"`cu_seqlens` must be an integer tensor, but is of type {cu_seqlens.dtype} instead."
            )

        return VarlenMetadata(cu_seqlens.tolist(), cu_seqlens.device)

    @staticmethod
    def from_batch_layout(seqs_layout: BatchLayout, device: torch.device) -> VarlenMetadata:
        """Returns the documents of a packed batch; the padded tail, if any,
        is a document of its own (it neither reads nor feeds the real ones).
        Uses only host data of the layout."""
        if not seqs_layout.packed:
            raise ValueError("`seqs_layout` must be packed, but is not.")

        offsets = list(seqs_layout.seq_begin_indices)

        if offsets[-1] != seqs_layout.width:
            offsets.append(seqs_layout.width)

        return VarlenMetadata(offsets, device)

    @property
    def num_seqs(self) -> int:
        # A size, not `len(self.lengths)`: under `torch.compile` a size can be
        # dynamic, while the lengths would specialize the graph.
        return self.cu_seqlens_cpu.size(0) - 1

    @property
    def num_tokens(self) -> int:
        # From the host integers: under `torch.compile`, reading a tensor
        # element would break the graph.
        return sum(self.lengths)

    def derived(self, key: Hashable, make: Callable[[], _T]) -> _T:
        """Returns what ``make`` derives from these offsets, made on the first
        call for ``key`` only (e.g. a kernel's chunk layout for its chunk
        size)."""
        try:
            return self._derived[key]  # type: ignore[return-value]
        except KeyError:
            value = make()

            self._derived[key] = value

            return value

    def __repr__(self) -> str:
        return f"VarlenMetadata(lengths={list(self.lengths)}, device={self.cu_seqlens.device})"
