"""Which experts each expert-parallel rank runs, and the errors for sizes
that cannot be split (:mod:`qwen35_fs2.nn.moe.expert_parallel`)."""

from __future__ import annotations

import pytest

from qwen35_fs2.nn.moe.expert_parallel import expert_parallel_order


@pytest.mark.parametrize(("num_experts", "ep_size", "dp_size"), [(8, 2, 2), (8, 2, 4), (8, 4, 4), (8, 2, 8), (16, 4, 8), (256, 8, 64)])
def test_each_rank_stores_what_fsdp2_alone_gives_it(num_experts: int, ep_size: int, dp_size: int) -> None:
    order = expert_parallel_order(num_experts, ep_size, dp_size)

    assert sorted(order) == list(range(num_experts))

    num_rank_experts = num_experts // ep_size
    num_replicas = dp_size // ep_size

    for dp_rank in range(dp_size):
        # Data-parallel rank `d = g * ep + r` is the g-th replica of EP rank
        # r, and FSDP2 gives it the g-th of r's equal row blocks.
        replica, ep_rank = divmod(dp_rank, ep_size)

        rank_experts = order[ep_rank * num_rank_experts : (ep_rank + 1) * num_rank_experts]

        block = num_rank_experts // num_replicas

        stored = rank_experts[replica * block : (replica + 1) * block]

        # FSDP2 alone over all ranks: rows [d E / D, (d + 1) E / D).
        per_rank = num_experts // dp_size

        assert stored == list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))


@pytest.mark.parametrize(
    ("num_experts", "ep_size", "dp_size", "message"),
    [
        (8, 3, 6, "must divide the number of experts of each tensor parallel rank \\(8\\), but is 3"),
        (8, 4, 6, "must divide the data parallel size \\(6\\), but is 4"),
        (6, 2, 4, "number of experts of each tensor parallel rank \\(6\\) must be a multiple of the data parallel size \\(4\\)"),
        (8, 0, 4, "must be at least 1, but is 0"),
    ],
)
def test_sizes_that_cannot_be_split_are_named(num_experts: int, ep_size: int, dp_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expert_parallel_order(num_experts, ep_size, dp_size)
