"""Expert parallelism: the routed experts of a MoE block spread over an
expert-parallel (EP) group of data-parallel ranks, tokens sent to their
experts' ranks and back by all-to-all exchanges.

Without expert parallelism every rank runs all experts of its
tensor-parallel shard, which FSDP2 gathers in full for every forward and
backward pass. With an EP group of ``ep`` ranks each rank runs ``E_l / ep``
of its ``E_l`` experts (``E_l = E / tp``) on the tokens of all ``ep`` ranks
that are routed to them:

1. the rows of the (token, slot) pairs, sorted by the *place* of their
   expert (:attr:`ExpertParallelism.order`: EP rank 0's experts first), go
   to the experts' ranks in one ``all_to_all_single``, after every rank has
   learned how many rows each other rank sends to each of its experts (an
   all-gather of the per-expert counts);
2. the rank runs its experts on the rows it received, grouped by expert;
3. the outputs go back to where their rows came from in a second
   ``all_to_all_single``.

The backward pass makes the same two exchanges in reverse, so an expert's
weight gradient sums the contributions of the tokens of every rank of the
group. Routing, the shared expert and the load-balancing statistics stay
local, and no row is ever dropped.

Which experts an EP rank runs is chosen by :func:`expert_parallel_order` so
that, once FSDP2 shards each rank's experts over the ``D / ep`` ranks that
run the same experts, data-parallel rank ``d`` stores exactly the experts it
stores under FSDP2 alone: checkpoints are the same files at every EP size.
"""

from __future__ import annotations

from typing import Any, final

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from qwen35_fs2.nn.moe.rows import GatherRows
from qwen35_fs2.ops.autocast import autocast_free


def expert_parallel_order(num_experts: int, ep_size: int, dp_size: int) -> list[int]:
    """Returns the experts (of ``num_experts``, the experts of one
    tensor-parallel rank) in the order of their places: EP rank ``r`` runs
    ``order[r * E / ep : (r + 1) * E / ep]``.

    Data-parallel rank ``d = g * ep + r`` is the ``g``-th of the ``R = D / ep``
    ranks that run EP rank ``r``'s experts, so FSDP2 gives it the ``g``-th
    block of them. Giving EP rank ``r`` the blocks ``r, ep + r, 2 ep + r, …``
    of the expert range, each ``E / D`` experts long, makes that block
    experts ``[d E / D, (d + 1) E / D)``: what FSDP2 alone gives rank ``d``.
    """
    check_expert_parallel_sizes(num_experts, ep_size, dp_size)

    num_replicas = dp_size // ep_size

    if num_replicas == 1:
        return list(range(num_experts))

    block_size = num_experts // dp_size

    order = []

    for ep_rank in range(ep_size):
        for replica in range(num_replicas):
            block = replica * ep_size + ep_rank

            order.extend(range(block * block_size, (block + 1) * block_size))

    return order


def check_expert_parallel_sizes(num_experts: int, ep_size: int, dp_size: int) -> None:
    """Raises a :class:`ValueError` naming the numbers if ``num_experts``
    experts cannot be spread over EP groups of ``ep_size`` of ``dp_size``
    data-parallel ranks."""
    if ep_size < 1:
        raise ValueError(f"The expert parallel size must be at least 1, but is {ep_size} instead.")

    if dp_size % ep_size != 0:
        raise ValueError(
            f"The expert parallel size must divide the data parallel size ({dp_size}), but is {ep_size} instead."
        )

    if num_experts % ep_size != 0:
        raise ValueError(
            f"The expert parallel size must divide the number of experts of each tensor parallel rank ({num_experts}), but is {ep_size} instead."
        )

    # FSDP2 shards each EP rank's experts over the other `D / ep` ranks; the
    # shards are whole experts, as without EP, only if `D` divides `E`.
    if dp_size > ep_size and num_experts % dp_size != 0:
        raise ValueError(
            f"The number of experts of each tensor parallel rank ({num_experts}) must be a multiple of the data parallel size ({dp_size}) when the expert parallel size ({ep_size}) is smaller than it, but is not."
        )


@final
class ExpertParallelism:
    """The expert-parallel group of a rank and where the experts of its
    tensor-parallel shard run (see the module docstring)."""

    def __init__(self, group: ProcessGroup, order: list[int], *, replicas: ProcessGroup) -> None:
        """
        :param group: The EP group: ``ep`` data-parallel ranks of one
            tensor-parallel rank.
        :param order: The rank's experts in place order, from
            :func:`expert_parallel_order`.
        :param replicas: The data-parallel ranks that run the same experts,
            over which FSDP2 shards them.
        """
        self.group = group
        self.replicas = replicas
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)

        num_experts = len(order)

        if sorted(order) != list(range(num_experts)):
            raise ValueError(f"`order` must be a permutation of 0..{num_experts - 1}, but is {order} instead.")

        if num_experts % self.ep_size != 0:
            raise ValueError(
                f"The expert parallel size must divide the number of experts ({num_experts}), but is {self.ep_size} instead."
            )

        self.order = order

        self.num_experts = num_experts

        self.num_rank_experts = num_experts // self.ep_size

        places = [0] * num_experts

        for place, expert in enumerate(order):
            places[expert] = place

        self._places = torch.tensor(places)

        self.received_weights: dict[str, Tensor] | None = None
        """The rank's expert weights as data-parallel rank 0 sent them, kept
        until the experts, still on the meta device, are allocated."""

    @property
    def rank_experts(self) -> list[int]:
        """The experts this rank runs, in the order of its parameter rows."""
        start = self.ep_rank * self.num_rank_experts

        return self.order[start : start + self.num_rank_experts]

    def places(self, experts: Tensor) -> Tensor:
        """Returns the place of each expert index in ``experts`` (indices of
        one tensor-parallel rank's experts, or of all ``tp_size`` ranks': the
        places repeat for each)."""
        places = self._places.to(experts.device)

        return places[experts % self.num_experts] + experts - experts % self.num_experts

    def run(self, experts: Any, rows: Tensor, rows_per_place: Tensor) -> tuple[Tensor, Tensor]:
        """Runs ``experts`` (the rank's, a
        :class:`~qwen35_fs2.nn.moe.experts.RoutedExperts`) on the rows of all
        ranks of the group that are routed to them.

        :param rows: This rank's rows, sorted by the place of their expert.
            *Shape:* :math:`(T_r,M)`.
        :param rows_per_place: The rows of each place. *Shape:* :math:`(E_l,)`.

        :returns: The experts' outputs for ``rows`` (*Shape:* Same as
            ``rows``), and the rows that each rank of the group computes
            (*Shape:* :math:`(ep,)`).
        """
        ep_size, num_rank_experts = self.ep_size, self.num_rank_experts

        # (ep, E_l): the rows every rank of the group sends to every place.
        # Gloo gathers into a flat tensor only.
        all_rows_per_place = rows_per_place.new_empty((ep_size * self.num_experts,))

        dist.all_gather_into_tensor(all_rows_per_place, rows_per_place.contiguous(), group=self.group)

        all_rows_per_place = all_rows_per_place.view(ep_size, self.num_experts)

        # (ep, E_l / ep): what each rank sends to this rank's experts.
        start = self.ep_rank * num_rank_experts

        received_per_expert = all_rows_per_place[:, start : start + num_rank_experts]

        # Host integers: the split sizes of the exchanges.
        send_sizes = rows_per_place.view(ep_size, num_rank_experts).sum(dim=1).tolist()
        recv_sizes = received_per_expert.sum(dim=1).tolist()

        received = _AllToAll.apply(rows, recv_sizes, send_sizes, self.group)  # type: ignore[no-untyped-call]

        # The received rows come by source rank, then by expert; the experts
        # need them by expert.
        # (ep x E_l / ep) -> (T_e)
        row_experts = torch.arange(num_rank_experts, device=rows.device).repeat(ep_size)

        row_experts = row_experts.repeat_interleave(received_per_expert.flatten())

        by_expert = row_experts.argsort(stable=True)

        by_source = by_expert.argsort()

        expert_rows = GatherRows.apply(received, by_expert, by_source, 1)  # type: ignore[no-untyped-call]

        outputs = experts(expert_rows, received_per_expert.sum(dim=0))

        outputs = GatherRows.apply(outputs, by_source, by_expert, 1)  # type: ignore[no-untyped-call]

        output: Tensor = _AllToAll.apply(outputs, send_sizes, recv_sizes, self.group)  # type: ignore[no-untyped-call]

        # (ep, ep, E_l / ep) -> (ep)
        rows_per_rank = all_rows_per_place.view(ep_size, ep_size, num_rank_experts).sum(dim=(0, 2))

        return output, rows_per_rank


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward pass is the reverse exchange."""

    @staticmethod
    @autocast_free
    def forward(
        ctx: Any, x: Tensor, output_sizes: list[int], input_sizes: list[int], group: ProcessGroup
    ) -> Tensor:
        ctx.sizes, ctx.group = (output_sizes, input_sizes), group

        return _all_to_all(x, output_sizes, input_sizes, group)

    @staticmethod
    @autocast_free
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None, None]:
        output_sizes, input_sizes = ctx.sizes

        return _all_to_all(grad_output, input_sizes, output_sizes, ctx.group), None, None, None


def _all_to_all(x: Tensor, output_sizes: list[int], input_sizes: list[int], group: ProcessGroup) -> Tensor:
    output = x.new_empty((sum(output_sizes), *x.shape[1:]))

    dist.all_to_all_single(output, x.contiguous(), output_sizes, input_sizes, group=group)

    return output
