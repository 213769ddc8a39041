"""Tensor-parallel building blocks of the Qwen3.5 modules.

A Qwen3.5 module under tensor parallelism (``gangs.tp.size > 1``) splits its
heads (or experts, or vocabulary rows) across the ranks of ``gangs.tp``, as
Megatron does: every rank sees the whole batch, column-sharded projections
produce the rank's heads, and row-sharded projections sum the ranks' partial
outputs. Two kinds of parameters then need more than fairseq2's sharded
projections give:

- a parameter replicated on every rank but applied to the rank's own heads
  only (the per-head norms, replicated key/value projections) receives a
  partial gradient on each rank: :func:`sum_gradient_over_tp` sums it;
- a tied output projection over a vocabulary-sharded embedding:
  :class:`TiedVocabShardedProjection`.

A sharded parameter is initialized as its part of the whole parameter
(:func:`init_shard`), as fairseq2's sharded projections are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import final

import torch
from torch import Tensor
from torch.func import functional_call
from torch.nn import Module, Parameter
from torch.nn.functional import linear
from typing_extensions import override

from fairseq2.gang import Gang
from fairseq2.nn import Projection
from fairseq2.nn.sharded import Sharded
from fairseq2.ops.tensor_parallel import gather, reduce_on_backward


def check_tp_divisible(name: str, value: int, tp_gang: Gang) -> None:
    """Raises a :class:`ValueError` naming ``name`` if ``value`` cannot be
    split evenly across the ranks of ``tp_gang``."""
    if value % tp_gang.size != 0:
        raise ValueError(
            f"`{name}` must be a multiple of the tensor parallel size ({tp_gang.size}), but is {value} instead."
        )


def init_shard(
    param: Tensor, init: Callable[[Tensor], object], *, num_shards: int, shard_idx: int, dim: int = 0
) -> None:
    """Initializes ``param``, shard ``shard_idx`` of ``num_shards`` equal
    shards along ``dim``, as its part of the whole tensor drawn by ``init``.

    fairseq2 seeds every tensor-parallel rank alike: drawing only the rank's
    part would give every rank the same values (expert ``e`` a copy of
    expert ``e + E / tp_size``) and a model that depends on the number of
    ranks. Drawn whole, the shards are those of the unsharded model of the
    same seed, as fairseq2's sharded projections draw theirs.
    """
    shape = list(param.shape)

    shape[dim] *= num_shards

    whole = torch.empty(shape, device=param.device, dtype=param.dtype)

    with torch.no_grad():
        init(whole)

        param.copy_(whole.chunk(num_shards, dim)[shard_idx])


def sum_gradient_over_tp(param: Tensor, tp_gang: Gang) -> Tensor:
    """Returns ``param`` unchanged, with its gradient summed over the ranks
    of ``tp_gang`` in the backward pass.

    For a parameter that every rank holds in full but applies only to its own
    heads: each rank's gradient is the contribution of its heads, and the sum
    is the gradient of the unsharded model. The sum is part of the autograd
    graph, so it holds under FSDP, activation checkpointing and gradient
    accumulation alike.
    """
    if tp_gang.size == 1:
        return param

    return reduce_on_backward(param, tp_gang)


def call_with_tp_summed_gradients(module: Module, tp_gang: Gang, *args: Tensor) -> Tensor:
    """Calls ``module(*args)`` so that the gradients of its parameters are
    summed over the ranks of ``tp_gang`` (see :func:`sum_gradient_over_tp`).

    Used for the norms that each rank applies to its own heads; their state
    dict keys stay those of the unsharded model.
    """
    if tp_gang.size == 1:
        output: Tensor = module(*args)

        return output

    params = {
        name: sum_gradient_over_tp(param, tp_gang)
        for name, param in module.named_parameters(recurse=False)
    }

    output = functional_call(module, params, args)

    return output


@final
class TiedVocabShardedProjection(Projection, Sharded):
    """The output projection tied to a
    :class:`~fairseq2.nn.VocabShardedEmbedding`: each rank computes the logits
    of its vocabulary rows, and the logits of all ranks are gathered.

    fairseq2's :class:`~fairseq2.nn.TiedProjection` would return only the
    rank's rows, which is why fairseq2 refuses tied embeddings under tensor
    parallelism.
    """

    def __init__(self, weight: Parameter, num_embeddings: int, tp_gang: Gang) -> None:
        """
        :param weight: The embedding's shard of ``num_embeddings / tp_gang.size``
            rows.
        """
        if weight.size(0) * tp_gang.size != num_embeddings:
            raise ValueError(
                f"`weight` must have {num_embeddings // tp_gang.size} rows ({num_embeddings} embeddings over {tp_gang.size} ranks), but has {weight.size(0)} instead."
            )

        super().__init__(input_dim=weight.size(1), output_dim=num_embeddings)

        self.weight = weight

        self.tp_gang = tp_gang

    @override
    def forward(self, x: Tensor) -> Tensor:
        # Every rank's logits depend on `x`: the gradients are summed.
        x = reduce_on_backward(x, self.tp_gang)

        logits = linear(x, self.weight)

        return gather(logits, self.tp_gang, dim=-1)

    @override
    def get_shard_dims(self) -> list[tuple[Parameter, int]]:
        return [(self.weight, 0)]

    @override
    def extra_repr(self) -> str:
        return (
            f"tp_rank={self.tp_gang.rank}, "
            f"tp_size={self.tp_gang.size}, "
            f"input_dim={self.input_dim}, "
            f"output_dim={self.output_dim}"
        )
