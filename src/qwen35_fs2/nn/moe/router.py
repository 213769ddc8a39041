"""The router of the Qwen3.5-MoE block: which experts each token goes to,
with which weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, final

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module, Parameter
from typing_extensions import override

from fairseq2.data_type import DataType
from fairseq2.device import Device

ParameterInitializer = Callable[[Parameter], None]
"""Initializes a parameter of the router or of the experts in place."""

RouterPrecision = Literal["activation", "fp32"]
"""
Where :class:`TopKRouter` computes its logits ``x Wᵀ``:

- ``activation``: as the surrounding computation would, in the autocast dtype
  under autocast, otherwise in the dtype of the activations and the weight;
  what transformers (``F.linear(hidden_states, weight)``) and vLLM (the gate
  is a linear layer of the model dtype) do, so a model trained in bf16 routes
  near-tied tokens in training as it will in serving;
- ``fp32``: in fp32 with autocast disabled, so that near-tied experts are
  ranked, and the load-balancing loss differentiated, at full precision, at
  the price of routing some near-tied tokens differently from serving.

The softmax over the logits is fp32 in both.
"""


@final
class TopKRouter(Module):
    """Routes each token to its ``top_k`` most probable experts.

    ``softmax(x Wᵀ)`` over all experts, the ``top_k`` largest probabilities,
    renormalised to sum to 1 (``normalize_top_k``; Qwen3.5 always does,
    Qwen3-Next configs choose). The softmax is fp32; where the logits are
    computed is ``precision`` (see :data:`RouterPrecision`): by default as
    transformers and vLLM compute them, so that a token whose experts nearly
    tie goes in training to the experts it goes to in serving.
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        top_k: int,
        *,
        normalize_top_k: bool = True,
        precision: RouterPrecision = "activation",
        init_fn: ParameterInitializer | None = None,
        device: Device | None = None,
        dtype: DataType | None = None,
    ) -> None:
        super().__init__()

        if precision not in ("activation", "fp32"):
            raise ValueError(
                f"`precision` must be 'activation' or 'fp32', but is '{precision}' instead."
            )

        if num_experts < 1:
            raise ValueError(
                f"`num_experts` must be greater than or equal to 1, but is {num_experts} instead."
            )

        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"`top_k` must be between 1 and `num_experts` ({num_experts}), but is {top_k} instead."
            )

        self.model_dim = model_dim
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.precision = precision
        self.init_fn = init_fn

        self.weight = Parameter(
            torch.empty((num_experts, model_dim), device=device, dtype=dtype)
        )

        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.init_fn is not None:
            self.init_fn(self.weight)
        else:
            init_uniform(self.weight, fan_in=self.model_dim)

    def forward(self, seqs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """
        :param seqs: *Shape:* :math:`(T,M)`.

        :returns:
            - The router probabilities of every expert. *Shape:* :math:`(T,E)`,
              fp32.
            - The weights of the selected experts. *Shape:* :math:`(T,K)`, fp32.
            - The indices of the selected experts, by decreasing probability.
              *Shape:* :math:`(T,K)`.
        """
        if self.precision == "fp32":
            # Under FSDP2 mixed precision the weight arrives in the parameter
            # dtype and is upcast.
            with torch.autocast(seqs.device.type, enabled=False):
                logits = F.linear(seqs.float(), self.weight.float())
        else:
            logits = F.linear(seqs, self.weight)

        probs = logits.softmax(dim=-1, dtype=torch.float32)

        top_weights, top_indices = probs.topk(self.top_k, dim=-1)

        if self.normalize_top_k:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)

        return probs, top_weights, top_indices

    @override
    def extra_repr(self) -> str:
        return (
            f"model_dim={self.model_dim}, "
            f"num_experts={self.num_experts}, "
            f"top_k={self.top_k}, "
            f"normalize_top_k={self.normalize_top_k}, "
            f"precision={self.precision}"
        )


def init_uniform(weight: Tensor, *, fan_in: int) -> None:
    """Initializes ``weight`` as :class:`torch.nn.Linear` does its weight; the
    default of the router and of the experts."""
    bound = fan_in**-0.5

    torch.nn.init.uniform_(weight, -bound, bound)
