"""Builds Qwen3.5-MoE models: the dense factory with MoE feed-forward blocks."""

from __future__ import annotations

import torch
from torch.nn import Parameter
from typing_extensions import override

from fairseq2.models.transformer import FeedForwardNetwork, GLUFeedForwardNetwork
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import Linear

from qwen35_fs2.models.qwen35.factory import Qwen35Factory
from qwen35_fs2.nn.moe.block import Qwen35MoeBlock
from qwen35_fs2.nn.moe.experts import RoutedExperts
from qwen35_fs2.nn.moe.router import TopKRouter
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig


def create_qwen35_moe_model(config: Qwen35MoeConfig) -> TransformerLM:
    return Qwen35MoeFactory(config).create_model()


class Qwen35MoeFactory(Qwen35Factory):
    """Assembles a Qwen3.5-MoE model; the decoder is the dense one, and
    :meth:`create_ffn` returns an MoE block for every MoE layer."""

    def __init__(self, config: Qwen35MoeConfig) -> None:
        super().__init__(config)

        self._moe_config = config

    @override
    def create_ffn(self, layer_idx: int) -> FeedForwardNetwork:
        if not self._moe_config.is_moe_layer(layer_idx):
            return super().create_ffn(layer_idx)

        return self.create_moe_block(layer_idx)

    def create_moe_block(self, layer_idx: int) -> Qwen35MoeBlock:
        config = self._moe_config

        experts_config = config.experts

        router = TopKRouter(
            config.model_dim,
            experts_config.num_experts,
            experts_config.top_k,
            normalize_top_k=experts_config.normalize_top_k,
            precision=experts_config.router_precision,
            init_fn=self._init_expert_parameter,
        )

        experts = RoutedExperts(
            experts_config.num_experts,
            config.model_dim,
            experts_config.inner_dim,
            dispatch=experts_config.dispatch,
            init_fn=self._init_expert_parameter,
        )

        shared_expert = GLUFeedForwardNetwork(
            config.model_dim,
            experts_config.shared_expert_inner_dim,
            bias=False,
            inner_dim_scale=1.0,
            proj_init_fn=self._init_projection,
        )

        shared_expert_gate = Linear(
            config.model_dim, 1, bias=False, init_fn=self._init_projection
        )

        return Qwen35MoeBlock(router, experts, shared_expert, shared_expert_gate)

    def _init_expert_parameter(self, param: Parameter) -> None:
        torch.nn.init.normal_(param, std=self._moe_config.init_std)
