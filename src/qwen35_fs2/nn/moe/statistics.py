"""The routing statistics of the Qwen3.5-MoE blocks: what one block routed
in one forward pass, the recorder that holds them for one forward pass of a
model, and the load-balancing loss of a whole model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, final

import torch
from torch import Tensor
from torch.nn import Module


class MoeRoutingStatistics(NamedTuple):
    """What one forward pass of a :class:`Qwen35MoeBlock` routed, counting only
    real (non-pad) tokens.

    A named tuple, not a dataclass: a compiled, activation-checkpointed
    decoder layer returns it with its output, and dynamo traces a named
    tuple out of a checkpoint, where it fails on a dataclass (torch 2.9,
    ``tests/unit/nn/test_compile_fullgraph.py``)."""

    tokens_per_expert: Tensor
    """(token, slot) assignments to each expert. *Shape:* :math:`(E,)`, fp32."""

    router_prob_sums: Tensor
    """
    The summed router probability of each expert; differentiable, so the
    load-balancing loss trains the router. *Shape:* :math:`(E,)`, fp32.
    """

    num_tokens: Tensor
    """The number of real tokens. *Shape:* :math:`()`, fp32."""

    top_k: int
    """The number of experts each token went to."""

    rows_per_ep_rank: Tensor | None = None
    """
    Under expert parallelism, the (token, slot) rows that each rank of the
    block's expert-parallel group computed, all ranks' tokens together (the
    same on every rank of the group); ``None`` without. *Shape:*
    :math:`(ep,)`.
    """


@final
@dataclass(frozen=True)
class MoeStatistics:
    """The routing of one forward pass of a model, over all its MoE layers."""

    load_balancing_loss: Tensor
    """
    The Switch Transformer auxiliary loss exactly as transformers'
    ``load_balancing_loss_func`` computes it: all layers' real tokens are
    pooled, so with :math:`N` = layers × tokens, :math:`C_e` the top-k
    assignments and :math:`P_e` the summed router probabilities of expert
    :math:`e`, it is :math:`E \\sum_e (C_e / N) (P_e / N)` (1 when perfectly
    balanced with ``top_k`` 1). Unscaled; differentiable. *Shape:* :math:`()`.

    The probabilities are the softmax of the router logits, as in
    transformers 5.24; in 5.2.0 the Qwen3.5-MoE router handed its
    probabilities to the loss as logits, which applied the softmax twice.
    """

    tokens_per_expert: Tensor
    """
    The (token, slot) assignments of real tokens to each expert of each MoE
    layer. *Shape:* :math:`(L,E)`, fp32.
    """

    num_tokens: Tensor
    """The number of real tokens each layer routed. *Shape:* :math:`()`."""

    top_k: int
    """The number of experts each token went to."""

    rows_per_ep_rank: Tensor | None = None
    """
    Under expert parallelism, the (token, slot) rows that each rank of the
    expert-parallel group computed in each MoE layer; ``None`` without.
    *Shape:* :math:`(L,ep)`.
    """

    @property
    def ep_imbalance(self) -> Tensor:
        """The rows of the busiest rank of the expert-parallel group over the
        mean rows of its ranks, in the worst layer: the slowdown of the
        experts' compute that unbalanced routing causes (1 when balanced, and
        without expert parallelism)."""
        if self.rows_per_ep_rank is None:
            return torch.ones((), device=self.num_tokens.device)

        rows = self.rows_per_ep_rank.float()

        return (rows.max(dim=1).values / rows.mean(dim=1).clamp(min=1.0)).max()

    @property
    def max_tokens_per_expert(self) -> Tensor:
        """The heaviest load of any expert in any layer."""
        return self.tokens_per_expert.max()

    @property
    def min_tokens_per_expert(self) -> Tensor:
        """The lightest load of any expert in any layer."""
        return self.tokens_per_expert.min()

    @property
    def num_dropped_assignments(self) -> Tensor:
        """The (token, slot) assignments that no expert computed; 0, as the
        experts have no capacity limit."""
        num_layers = self.tokens_per_expert.size(0)

        return self.num_tokens * self.top_k * num_layers - self.tokens_per_expert.sum()


@final
class MoeStatisticsRecorder:
    """Holds the :class:`MoeRoutingStatistics` that the MoE blocks record in
    one forward pass of a model.

    :class:`~qwen35_fs2.nn.Qwen35Decoder` makes one for each forward pass,
    records there what its layers return, and closes it when the pass ends.
    A block given the recorder itself (``Qwen35MoeBlock.forward(...,
    statistics=recorder)``) records into it; activation checkpointing reruns
    such a forward pass during the backward pass with the arguments of the
    original pass, so the rerun finds this recorder closed and records
    nothing: every block counts once, whichever applier wraps the layers,
    and no autograd internals tell a rerun apart.

    The statistics carry the autograd graph of the load-balancing loss; only
    the recorder holds them, and :meth:`collect` lets go of them.
    """

    def __init__(self) -> None:
        self._records: list[tuple[Module, MoeRoutingStatistics]] = []

        self._closed = False

    def record(self, block: Module, statistics: MoeRoutingStatistics) -> None:
        """Records what ``block`` routed, unless the forward pass has ended
        (then ``block`` is being recomputed)."""
        if not self._closed:
            self._records.append((block, statistics))

    def close(self) -> None:
        """Ends the forward pass: later records are recomputations."""
        self._closed = True

    def collect(self, blocks: Sequence[Module]) -> MoeStatistics:
        """Combines what ``blocks``, the MoE blocks of a model in layer order,
        recorded into the statistics of the model, and forgets them.

        :raises RuntimeError: if a block of ``blocks`` recorded nothing or more
            than once.
        """
        if not blocks:
            raise ValueError("`blocks` must contain at least one MoE block, but is empty.")

        records, self._records = self._records, []

        self._closed = True

        statistics = []

        missing = []

        for idx, block in enumerate(blocks):
            block_statistics = [s for b, s in records if b is block]

            if not block_statistics:
                missing.append(idx)

                continue

            if len(block_statistics) > 1:
                raise RuntimeError(
                    f"MoE layer {idx} recorded its routing statistics {len(block_statistics)} times in one forward pass, but must record them once."
                )

            statistics.append(block_statistics[0])

        if missing:
            raise RuntimeError(
                f"MoE layers {missing} have no routing statistics. Run a forward pass of the model before collecting them, and collect them once per forward pass."
            )

        return _combine_layer_statistics(statistics)


def _combine_layer_statistics(statistics: Sequence[MoeRoutingStatistics]) -> MoeStatistics:
    top_k = statistics[0].top_k

    if any(s.top_k != top_k for s in statistics):
        raise ValueError(
            "The MoE layers must route each token to the same number of experts to combine their statistics, but do not."
        )

    tokens_per_expert = torch.stack([s.tokens_per_expert for s in statistics])

    router_prob_sums = torch.stack([s.router_prob_sums for s in statistics]).sum(dim=0)

    num_tokens = statistics[0].num_tokens

    # N = layers × tokens, clamped so that a batch of pads gives 0, not NaN.
    total = (num_tokens * len(statistics)).clamp(min=1.0)

    num_experts = tokens_per_expert.size(1)

    load_balancing_loss = num_experts * torch.sum(
        (tokens_per_expert.sum(dim=0) / total) * (router_prob_sums / total)
    )

    ep_rows = [s.rows_per_ep_rank for s in statistics if s.rows_per_ep_rank is not None]

    rows_per_ep_rank = torch.stack(ep_rows) if ep_rows else None

    return MoeStatistics(load_balancing_loss, tokens_per_expert, num_tokens, top_k, rows_per_ep_rank)
