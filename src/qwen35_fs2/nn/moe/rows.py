"""Row gathers of the MoE dispatch whose backward pass is a gather too."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from qwen35_fs2.ops.autocast import autocast_free


class GatherRows(torch.autograd.Function):
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
