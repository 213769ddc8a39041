"""The routing statistics of the Qwen3.5-MoE blocks: what one block routed
in one forward pass, and the load-balancing loss of a whole model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from torch import Tensor

@final
@dataclass(frozen=True)
class MoeRoutingStatistics:
    """What one forward pass of a :class:`Qwen35MoeBlock` routed, counting only
    real (non-pad) tokens."""

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
