"""Gradient clipping by the norm of the whole model's gradient when its
parameters are split over ranks: tensor-parallel shards, FSDP2 shards (of
one mesh or, under expert parallelism, of two), DDP replicas, or any mix.

fairseq2 0.8.1 clips with PyTorch's ``clip_grad_norm_`` on each rank's own
parameters. Under tensor parallelism that is the norm of the rank's shards
and of the replicated parameters, a different number on each rank: every
rank then scales its gradients by another factor, none of them the
unsharded model's, and the copies of the replicated parameters (norms,
routers, LoRA's replicated halves) drift apart step after step. Under
expert parallelism PyTorch cannot stack the norms of DTensors of two meshes
at all. :class:`ShardedGradClipFacade` replaces the clipping of the
data-parallel facade with :func:`clip_grad_norm_over_ranks`.
"""

from __future__ import annotations

from collections.abc import Set
from typing import final

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module
from typing_extensions import override

from fairseq2.error import NotSupportedError
from fairseq2.gang import Gangs, ReduceOperation
from fairseq2.nn.data_parallel import DataParallelFacade
from fairseq2.nn.sharded import Sharded

from qwen35_fs2.parallel.facade import DelegatingFacade


def tensor_parallel_shards(module: Module) -> frozenset[int]:
    """Returns the ids of the parameters of ``module`` that its sharded
    modules split over the tensor-parallel ranks (fairseq2's
    :class:`~fairseq2.nn.sharded.Sharded`, as checkpoints reshard them);
    every other parameter is replicated on them."""
    return frozenset(id(param) for m in module.modules() if isinstance(m, Sharded) for param, _ in m.get_shard_dims())


def clip_grad_norm_over_ranks(
    module: Module, max_norm: float | None, gangs: Gangs, tp_shards: Set[int]
) -> Tensor:
    """Clips the gradients of ``module`` to a total 2-norm of ``max_norm``
    (``None`` for no clipping), the norm of the gradient of the whole
    model over all ranks of ``gangs.root``, and returns that norm before
    clipping; every rank scales by the same factor.

    Each rank sums the squares of the gradients it holds, each divided by the
    number of ranks that hold the same values: the data-parallel ranks for a
    plain (DDP) tensor, the replicated dimensions of an FSDP2 shard's mesh,
    and the tensor-parallel ranks for a parameter not in ``tp_shards`` (see
    :func:`tensor_parallel_shards`). The root gang sums those.

    :raises NotSupportedError: under pipeline parallelism.
    """
    if gangs.pp.size > 1:
        raise NotSupportedError("Gradient clipping over ranks does not support pipeline parallelism.")

    grads = []

    squares = []

    for param in module.parameters():
        grad = param.grad

        if grad is None:
            continue

        if isinstance(grad, DTensor):
            local = grad.to_local()

            copies = 1

            for dim, placement in enumerate(grad.placements):
                if placement.is_replicate():
                    copies *= grad.device_mesh.size(dim)
        else:
            local = grad

            copies = gangs.dp.size

        if id(param) not in tp_shards:
            copies *= gangs.tp.size

        grads.append(local)

        squares.append(torch.linalg.vector_norm(local, dtype=torch.float32).square() / copies)

    if squares:
        total = torch.stack(squares).sum()
    else:
        total = torch.zeros((), device=gangs.root.device)

    gangs.root.all_reduce(total, ReduceOperation.SUM)

    total_norm = total.sqrt()

    if max_norm is not None and grads:
        # As PyTorch's `clip_grad_norm_`: never scaled up.
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)

        torch._foreach_mul_(grads, coef)

    return total_norm


@final
class ShardedGradClipFacade(DelegatingFacade):
    """``facade``, the data-parallel facade of ``module``, except that it
    clips gradients with :func:`clip_grad_norm_over_ranks`."""

    def __init__(self, facade: DataParallelFacade, module: Module, gangs: Gangs) -> None:
        super().__init__(facade)

        self._module = module
        self._gangs = gangs
        self._tp_shards = tensor_parallel_shards(module)

    @override
    def clip_grad_norm(self, max_norm: float | None) -> Tensor:
        return clip_grad_norm_over_ranks(self._module, max_norm, self._gangs, self._tp_shards)
