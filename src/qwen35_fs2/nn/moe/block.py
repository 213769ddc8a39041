"""The sparse Mixture-of-Experts block of Qwen3.5-MoE (and Qwen3-Next)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, final

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn import Module
from typing_extensions import override

from fairseq2.device import Device
from fairseq2.gang import Gangs, get_current_gangs
from fairseq2.models.transformer import FeedForwardNetwork
from fairseq2.nn import BatchLayout
from fairseq2.ops.tensor_parallel import reduce, reduce_on_backward

from qwen35_fs2.nn.moe.experts import RoutedExperts
from qwen35_fs2.nn.moe.router import TopKRouter
from qwen35_fs2.nn.moe.statistics import MoeRoutingStatistics, MoeStatistics
from qwen35_fs2.nn.tp import sum_gradient_over_tp
from qwen35_fs2.ops.autocast import autocast_free

class _GatherRows(torch.autograd.Function):
    """``x[index]`` where each row of ``x`` is gathered ``repeats`` times and
    ``grad_index`` inverts ``index`` (``index[grad_index]`` lists each row
    ``repeats`` times in a row).

    The backward pass is then a gather and a sum too; autograd's own, an
    index-add, is serial on CPU and not deterministic on GPU.
    """

    @staticmethod
    @autocast_free
    def forward(
        ctx: Any, x: Tensor, index: Tensor, grad_index: Tensor, repeats: int
    ) -> Tensor:
        ctx.save_for_backward(grad_index)

        ctx.repeats = repeats

        return x.index_select(0, index)

    @staticmethod
    @autocast_free
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None, None]:
        (grad_index,) = ctx.saved_tensors

        grad = grad_output.index_select(0, grad_index)

        if ctx.repeats > 1:
            # (T x K, M) -> (T, K, M) -> (T, M)
            grad = grad.view(-1, ctx.repeats, grad.size(-1)).sum(dim=1)

        return grad, None, None, None


@final
class Qwen35MoeBlock(FeedForwardNetwork):
    """The sparse MoE feed-forward block of Qwen3.5-MoE::

        y = Σ_k w_k · expert_{e_k}(x)  +  sigmoid(shared_expert_gate(x)) · shared_expert(x)

    where :class:`TopKRouter` picks ``e_1..e_K`` and their weights ``w``.

    Tokens are dispatched by sorting their (token, slot) pairs by expert, so
    each expert computes only the tokens routed to it (never all experts on
    all tokens). Every forward pass outside activation-checkpoint
    recomputation records a :class:`MoeRoutingStatistics`, from which
    :func:`collect_moe_statistics` forms the load-balancing loss.

    Differences from fairseq2's Llama 4 ``MoE``: softmax (not sigmoid)
    routing with renormalised top-k weights applied to the expert outputs
    (not the inputs), sparse dispatch, and a sigmoid-gated shared expert.

    Under tensor parallelism the router and the shared expert gate are
    replicated, the shared expert is column/row sharded, and each rank runs
    its :class:`RoutedExperts` shard on the tokens routed to it; the ranks'
    shares of the routed output are summed. Every rank then records the same
    statistics.
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

        self._batch_layout: BatchLayout | None = None
        self._statistics: MoeRoutingStatistics | None = None

    @override
    def forward(self, seqs: Tensor) -> Tensor:
        """
        :param seqs: *Shape:* :math:`(N,S,M)`, or :math:`(T,M)` if packed.

        :returns: *Shape:* Same as ``seqs``.
        """
        token_mask = self._take_token_mask(seqs)

        # (N, S, M) -> (T, M)
        x = seqs.reshape(-1, seqs.size(-1))

        num_tokens = x.size(0)

        top_k = self.router.top_k

        probs, top_weights, top_indices = self.router(x)

        # Sort the (token, slot) pairs by expert; the stable sort keeps tokens
        # in order within each expert.
        # (T, K) -> (T x K)
        slot_experts = top_indices.flatten()

        sorted_slots = slot_experts.argsort(stable=True)

        # The position of each slot in the sorted order.
        slot_positions = sorted_slots.argsort()

        tokens_per_expert = torch.bincount(slot_experts, minlength=self.experts.num_experts)

        # Under tensor parallelism each rank computes its experts' share of
        # `routed`, so its gradients of `x` and of the routing weights are
        # shares too, summed over the ranks. The router runs on every rank
        # alike.
        expert_x = reduce_on_backward(x, self.tp_gang) if self.tp_gang.size > 1 else x

        # (T, M) -> (T x K, M), sorted by expert
        sorted_seqs = _GatherRows.apply(expert_x, sorted_slots // top_k, slot_positions, top_k)  # type: ignore[no-untyped-call]

        expert_outputs = self._run_local_experts(sorted_seqs, tokens_per_expert)

        # Back to (token, slot) order.
        expert_outputs = _GatherRows.apply(expert_outputs, slot_positions, sorted_slots, 1)  # type: ignore[no-untyped-call]

        top_weights = sum_gradient_over_tp(top_weights, self.tp_gang)

        # (T, 1, K) @ (T, K, M) -> (T, M)
        routed = torch.bmm(
            top_weights.to(expert_outputs.dtype).unsqueeze(1),
            expert_outputs.view(num_tokens, top_k, -1),
        ).squeeze(1)

        if self.tp_gang.size > 1:
            routed = reduce(routed, self.tp_gang)

        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

        statistics = self._routing_statistics(probs, slot_experts, token_mask)

        # Activation checkpointing reruns the forward pass during the backward
        # pass; the statistics of the original pass stand. They are computed
        # anyway, as the rerun must save the same tensors for the backward pass.
        if not _is_recomputing():
            self._statistics = statistics

        return (routed + shared).view(seqs.shape)

    def _run_local_experts(self, sorted_seqs: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """Runs the rank's experts on their rows of ``sorted_seqs``; the rows
        of the other ranks' experts are zero."""
        experts = self.experts

        if experts.num_local_experts == experts.num_experts:
            output: Tensor = experts(sorted_seqs, tokens_per_expert)

            return output

        group_sizes = tokens_per_expert.tolist()

        first, last = experts.first_local_expert, experts.first_local_expert + experts.num_local_experts

        start = sum(group_sizes[:first])
        end = start + sum(group_sizes[first:last])

        local_output: Tensor = experts(sorted_seqs[start:end], tokens_per_expert[first:last])

        # (T_l, M) -> (T x K, M)
        return F.pad(local_output, (0, 0, start, sorted_seqs.size(0) - end))

    def set_batch_layout(self, seqs_layout: BatchLayout) -> None:
        """Tells the block the layout of the batch its next forward pass
        sees, so that pad positions do not count in its statistics.

        The decoder layer passes only ``seqs`` to its feed-forward network;
        :func:`pass_batch_layout_to_ffn` calls this before each layer.
        """
        self._batch_layout = seqs_layout

    def _take_token_mask(self, seqs: Tensor) -> Tensor | None:
        seqs_layout, self._batch_layout = self._batch_layout, None

        if seqs_layout is None or not seqs_layout.padded:
            return None

        positions = seqs_layout.position_indices

        if positions.shape != seqs.shape[:-1]:
            raise ValueError(
                f"The batch layout must match `seqs`, but its positions have a shape of {tuple(positions.shape)} and `seqs` a shape of {tuple(seqs.shape)}."
            )

        # (N, S) -> (T)
        return (positions >= 0).flatten()

    def _routing_statistics(
        self, probs: Tensor, slot_experts: Tensor, token_mask: Tensor | None
    ) -> MoeRoutingStatistics:
        top_k = self.router.top_k

        num_experts = self.experts.num_experts

        if token_mask is None:
            router_prob_sums = probs.sum(dim=0)

            with torch.no_grad():
                tokens_per_expert = torch.bincount(slot_experts, minlength=num_experts).float()

                num_tokens = probs.new_tensor(float(probs.size(0)))
        else:
            token_weights = token_mask.to(probs.dtype)

            router_prob_sums = (probs * token_weights.unsqueeze(-1)).sum(dim=0)

            with torch.no_grad():
                tokens_per_expert = probs.new_zeros((num_experts,)).index_add_(
                    0, slot_experts, token_weights.repeat_interleave(top_k)
                )

                num_tokens = token_weights.sum()

        return MoeRoutingStatistics(tokens_per_expert, router_prob_sums, num_tokens, top_k)

    def pop_statistics(self) -> MoeRoutingStatistics | None:
        """Returns the statistics of the last forward pass and forgets them,
        or ``None`` if there was no forward pass since the last call."""
        statistics, self._statistics = self._statistics, None

        return statistics


def pass_batch_layout_to_ffn(
    layer: Module, args: tuple[object, ...], kwargs: Mapping[str, object]
) -> None:
    """A forward pre-hook for decoder layers whose ``ffn`` is a
    :class:`Qwen35MoeBlock`: hands the block the layer's batch layout.

    A module-level function, not a closure, so that copies of the model
    (``deepcopy``, pickling) keep working hooks.
    """
    seqs_layout = args[1] if len(args) > 1 else kwargs.get("seqs_layout")

    if not isinstance(seqs_layout, BatchLayout):
        raise TypeError(
            f"The second argument of the decoder layer must be a `BatchLayout`, but is of type `{type(seqs_layout).__name__}` instead."
        )

    ffn = layer.ffn

    if not isinstance(ffn, Qwen35MoeBlock):
        raise TypeError(
            f"`layer.ffn` must be a `Qwen35MoeBlock`, but is of type `{type(ffn).__name__}` instead."
        )

    ffn.set_batch_layout(seqs_layout)


def collect_moe_statistics(model: Module) -> MoeStatistics | None:
    """Combines and clears the statistics that the MoE blocks of ``model``
    recorded in its last forward pass.

    Works through activation-checkpoint, FSDP, DDP, and ``torch.compile``
    wrappers. Call it after every forward pass whose load-balancing loss
    counts (every gradient-accumulation step), before the backward pass.

    :returns: ``None`` if ``model`` has no MoE layers.

    :raises RuntimeError: if an MoE layer has no statistics, that is, no
        forward pass ran since the last call.
    """
    blocks = [m for m in model.modules() if isinstance(m, Qwen35MoeBlock)]

    if not blocks:
        return None

    layer_statistics = [block.pop_statistics() for block in blocks]

    missing = [idx for idx, s in enumerate(layer_statistics) if s is None]

    if missing:
        raise RuntimeError(
            f"MoE layers {missing} have no routing statistics. Run a forward pass of the model before collecting them, and collect them once per forward pass."
        )

    statistics = [s for s in layer_statistics if s is not None]

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

    return MoeStatistics(load_balancing_loss, tokens_per_expert, num_tokens, top_k)


def _is_recomputing() -> bool:
    """Returns ``True`` inside the autograd engine, where activation
    checkpointing recomputes forward passes."""
    return torch._C._current_graph_task_id() != -1
