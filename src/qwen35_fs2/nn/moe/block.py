"""The sparse Mixture-of-Experts block of Qwen3.5-MoE (and Qwen3-Next)."""

from __future__ import annotations

from typing import Any, Literal, final, overload

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from fairseq2.device import Device
from fairseq2.gang import Gangs, get_current_gangs
from fairseq2.models.transformer import FeedForwardNetwork
from fairseq2.nn import BatchLayout
from fairseq2.ops.tensor_parallel import reduce, reduce_on_backward

from qwen35_fs2.nn.moe.experts import RoutedExperts
from qwen35_fs2.nn.moe.expert_parallel import ExpertParallelism
from qwen35_fs2.nn.moe.router import TopKRouter
from qwen35_fs2.nn.moe.rows import GatherRows
from qwen35_fs2.nn.moe.statistics import MoeRoutingStatistics, MoeStatisticsRecorder
from qwen35_fs2.nn.tp import sum_gradient_over_tp

@final
class Qwen35MoeBlock(FeedForwardNetwork):
    """The sparse MoE feed-forward block of Qwen3.5-MoE::

        y = Σ_k w_k · expert_{e_k}(x)  +  sigmoid(shared_expert_gate(x)) · shared_expert(x)

    where :class:`TopKRouter` picks ``e_1..e_K`` and their weights ``w``.

    Tokens are dispatched by sorting their (token, slot) pairs by expert, so
    each expert computes only the tokens routed to it (never all experts on
    all tokens). Given a :class:`MoeStatisticsRecorder`, a forward pass
    records its :class:`MoeRoutingStatistics` there, from which
    :func:`~qwen35_fs2.nn.collect_moe_statistics` forms the load-balancing
    loss; the block itself keeps nothing between forward passes.

    Differences from fairseq2's Llama 4 ``MoE``: softmax (not sigmoid)
    routing with renormalised top-k weights applied to the expert outputs
    (not the inputs), sparse dispatch, and a sigmoid-gated shared expert.

    Under tensor parallelism the router and the shared expert gate are
    replicated, the shared expert is column/row sharded, and each rank runs
    its :class:`RoutedExperts` shard on the tokens routed to it; the ranks'
    shares of the routed output are summed. Every rank then records the same
    statistics.

    Under expert parallelism (:attr:`expert_parallel`) the rank holds some of
    those experts, and its tokens' rows are sorted by the place of their
    expert and exchanged with the ranks that hold them
    (:mod:`~qwen35_fs2.nn.moe.expert_parallel`).
    """

    def __init__(
        self,
        router: TopKRouter,
        experts: RoutedExperts,
        shared_expert: FeedForwardNetwork,
        shared_expert_gate: Module,
        *,
        gangs: Gangs | None = None,
        device: Device | None = None,
    ) -> None:
        super().__init__()

        if router.num_experts != experts.num_experts:
            raise ValueError(
                f"`router.num_experts` and `experts.num_experts` must be equal, but are {router.num_experts} and {experts.num_experts} instead."
            )

        if gangs is None:
            gangs = get_current_gangs(device)

        self.tp_gang = gangs.tp

        self.router = router
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

        self.expert_parallel: ExpertParallelism | None = None
        """Where the routed experts run under expert parallelism (set by
        :func:`~qwen35_fs2.parallel.expert_parallel.apply_expert_parallelism`,
        which also keeps only this rank's experts); ``None`` to run them all
        here."""

    @overload  # type: ignore[override]
    def forward(
        self,
        seqs: Tensor,
        seqs_layout: BatchLayout | None = None,
        *,
        statistics: MoeStatisticsRecorder | None = None,
        return_statistics: Literal[False] = False,
    ) -> Tensor: ...

    @overload
    def forward(
        self,
        seqs: Tensor,
        seqs_layout: BatchLayout | None = None,
        *,
        statistics: None = None,
        return_statistics: Literal[True],
    ) -> tuple[Tensor, MoeRoutingStatistics]: ...

    @override
    def forward(
        self,
        seqs: Tensor,
        seqs_layout: BatchLayout | None = None,
        *,
        statistics: MoeStatisticsRecorder | None = None,
        return_statistics: bool = False,
    ) -> Tensor | tuple[Tensor, MoeRoutingStatistics]:
        """
        :param seqs: *Shape:* :math:`(N,S,M)`, or :math:`(T,M)` if packed.
        :param seqs_layout: The layout of ``seqs``, whose pads the statistics
            leave out; ``None`` if every position holds a token.
        :param statistics: The recorder of the forward pass, which receives
            the routing statistics of this block; ``None`` to record none.
        :param return_statistics: If ``True``, the routing statistics are
            returned with the output instead of recorded: for callers traced
            where Python state must not change, such as a compiled,
            activation-checkpointed decoder layer
            (:class:`~qwen35_fs2.nn.Qwen35DecoderLayer`).

        :returns: *Shape:* Same as ``seqs``; with ``return_statistics``, the
            statistics too.
        """
        if return_statistics and statistics is not None:
            raise ValueError("`statistics` must be `None` when `return_statistics` is set, but is not.")

        output, routing = self._forward(seqs, seqs_layout, statistics is not None or return_statistics)

        if return_statistics:
            assert routing is not None

            return output, routing

        # An activation-checkpoint rerun of the forward pass computes them as
        # well, as it must save the same tensors for the backward pass as the
        # original pass; the closed recorder ignores them.
        if statistics is not None:
            assert routing is not None

            statistics.record(self, routing)

        return output

    def _forward(
        self, seqs: Tensor, seqs_layout: BatchLayout | None, with_statistics: bool
    ) -> tuple[Tensor, MoeRoutingStatistics | None]:
        token_mask = _token_mask(seqs, seqs_layout)

        # (N, S, M) -> (T, M)
        x = seqs.reshape(-1, seqs.size(-1))

        num_tokens = x.size(0)

        top_k = self.router.top_k

        probs, top_weights, top_indices = self.router(x)

        # Sort the (token, slot) pairs by expert, or under expert parallelism
        # by the place of their expert; the stable sort keeps tokens in order
        # within each expert.
        # (T, K) -> (T x K)
        slot_experts = top_indices.flatten()

        ep = self.expert_parallel

        slot_places = slot_experts if ep is None else ep.places(slot_experts)

        sorted_slots = slot_places.argsort(stable=True)

        # The position of each slot in the sorted order.
        slot_positions = sorted_slots.argsort()

        tokens_per_place = _count_per_expert(slot_places, self.experts.num_experts)

        # Under tensor parallelism each rank computes its experts' share of
        # `routed`, so its gradients of `x` and of the routing weights are
        # shares too, summed over the ranks. The router runs on every rank
        # alike.
        expert_x = reduce_on_backward(x, self.tp_gang) if self.tp_gang.size > 1 else x

        # (T, M) -> (T x K, M), sorted by expert
        sorted_seqs = GatherRows.apply(expert_x, sorted_slots // top_k, slot_positions, top_k)  # type: ignore[no-untyped-call]

        expert_outputs, rows_per_ep_rank = self._run_local_experts(sorted_seqs, tokens_per_place)

        # Back to (token, slot) order.
        expert_outputs = GatherRows.apply(expert_outputs, slot_positions, sorted_slots, 1)  # type: ignore[no-untyped-call]

        top_weights = sum_gradient_over_tp(top_weights, self.tp_gang)

        # (T, 1, K) @ (T, K, M) -> (T, M)
        routed = torch.bmm(
            top_weights.to(expert_outputs.dtype).unsqueeze(1),
            expert_outputs.view(num_tokens, top_k, expert_outputs.size(-1)),
        ).squeeze(1)

        if self.tp_gang.size > 1:
            routed = reduce(routed, self.tp_gang)

        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

        routing = None

        if with_statistics:
            routing = self._routing_statistics(probs, slot_experts, token_mask, rows_per_ep_rank)

        return (routed + shared).view(seqs.shape), routing

    def _run_local_experts(self, sorted_seqs: Tensor, tokens_per_place: Tensor) -> tuple[Tensor, Tensor | None]:
        """Runs the rank's experts on their rows of ``sorted_seqs``; the rows
        of the other tensor-parallel ranks' experts are zero. Also returns
        the rows of each expert-parallel rank (``None`` without)."""
        experts = self.experts

        if experts.num_local_experts == experts.num_experts:
            return self._run_experts(sorted_seqs, tokens_per_place)

        group_sizes = tokens_per_place.tolist()

        # Places permute experts within a tensor-parallel rank's range only.
        first, last = experts.first_local_expert, experts.first_local_expert + experts.num_local_experts

        start = sum(group_sizes[:first])
        end = start + sum(group_sizes[first:last])

        local_output, rows_per_ep_rank = self._run_experts(sorted_seqs[start:end], tokens_per_place[first:last])

        # (T_l, M) -> (T x K, M)
        return F.pad(local_output, (0, 0, start, sorted_seqs.size(0) - end)), rows_per_ep_rank

    def _run_experts(self, rows: Tensor, tokens_per_place: Tensor) -> tuple[Tensor, Tensor | None]:
        """Runs the experts of the rank's tensor-parallel shard on ``rows``,
        here or, under expert parallelism, where they are."""
        if self.expert_parallel is None:
            output: Tensor = self.experts(rows, tokens_per_place)

            return output, None

        return self.expert_parallel.run(self.experts, rows, tokens_per_place)

    def _routing_statistics(
        self, probs: Tensor, slot_experts: Tensor, token_mask: Tensor | None, rows_per_ep_rank: Tensor | None
    ) -> MoeRoutingStatistics:
        top_k = self.router.top_k

        num_experts = self.experts.num_experts

        if token_mask is None:
            router_prob_sums = probs.sum(dim=0)

            with torch.no_grad():
                tokens_per_expert = _count_per_expert(slot_experts, num_experts).float()

                num_tokens = probs.new_tensor(float(probs.size(0)))
        else:
            token_weights = token_mask.to(probs.dtype)

            router_prob_sums = (probs * token_weights.unsqueeze(-1)).sum(dim=0)

            with torch.no_grad():
                tokens_per_expert = probs.new_zeros((num_experts,)).index_add_(
                    0, slot_experts, token_weights.repeat_interleave(top_k)
                )

                num_tokens = token_weights.sum()

        return MoeRoutingStatistics(tokens_per_expert, router_prob_sums, num_tokens, top_k, rows_per_ep_rank)


def _token_mask(seqs: Tensor, seqs_layout: BatchLayout | None) -> Tensor | None:
    """Returns which rows of ``seqs`` flattened to :math:`(T,M)` hold tokens,
    or ``None`` if all do."""
    if seqs_layout is None or not seqs_layout.padded:
        return None

    positions = seqs_layout.position_indices

    if positions.shape != seqs.shape[:-1]:
        raise ValueError(
            f"`seqs_layout` must match `seqs`, but its positions have a shape of {tuple(positions.shape)} and `seqs` a shape of {tuple(seqs.shape)} instead."
        )

    # (N, S) -> (T)
    return (positions >= 0).flatten()


def _count_per_expert(slot_experts: Tensor, num_experts: int) -> Tensor:
    """Counts the slots of each expert, ``(E,)``.

    A scatter-add, not ``torch.bincount``: the output size of ``bincount``
    depends on the largest index, which breaks a ``torch.compile`` graph.
    """
    counts = slot_experts.new_zeros((num_experts,))

    return counts.scatter_add_(0, slot_experts, torch.ones_like(slot_experts))
