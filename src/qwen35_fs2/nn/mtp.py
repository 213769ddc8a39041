"""The multi-token-prediction (MTP) head of Qwen3.5.

Every released Qwen3.5 checkpoint ships one (``mtp.*``); vLLM and SGLang
draft tokens with it for speculative decoding. At position ``t`` it combines
the embedding of token ``t+1`` with the trunk's hidden state at ``t`` and
predicts token ``t+2`` through the model's own output projection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import torch
from torch import Tensor
from torch.nn import Module, ModuleList

from fairseq2.models.transformer import AttentionBiasCache
from fairseq2.nn import BatchLayout, LayerNorm, Projection

from qwen35_fs2.nn.decoder_layer import Qwen35DecoderLayer


@final
class Qwen35MultiTokenPredictor(Module):
    """The MTP head, as vLLM's ``Qwen3_5MultiTokenPredictor`` defines it::

        x = fc(cat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)))
        y = layer_norm(layers(x))

    ``h_t`` is the trunk's output at ``t`` after its final norm, the input of
    the output projection (what vLLM's target model hands its drafter), and
    ``y`` goes through that same output projection. The embedding and the
    output projection are the model's, so the head owns neither.

    ``layers`` are full-attention decoder layers (one in Qwen3.5) attending
    within the documents of ``seqs_layout``, as the trunk's do.
    """

    fc: Projection
    pre_fc_norm_embedding: LayerNorm
    pre_fc_norm_hidden: LayerNorm
    layer_norm: LayerNorm

    def __init__(
        self,
        fc: Projection,
        pre_fc_norm_embedding: LayerNorm,
        pre_fc_norm_hidden: LayerNorm,
        layers: Sequence[Qwen35DecoderLayer],
        layer_norm: LayerNorm,
    ) -> None:
        super().__init__()

        if fc.input_dim != 2 * fc.output_dim:
            raise ValueError(
                f"`fc.input_dim` must be twice `fc.output_dim` ({2 * fc.output_dim}), but is {fc.input_dim} instead."
            )

        self.fc = fc

        self.pre_fc_norm_embedding = pre_fc_norm_embedding

        self.pre_fc_norm_hidden = pre_fc_norm_hidden

        self.layers = ModuleList(layers)

        self.layer_norm = layer_norm

    def forward(self, hidden: Tensor, next_embeds: Tensor, seqs_layout: BatchLayout) -> Tensor:
        """
        :param hidden: The trunk's output at each position (after its final
            norm). *Shape:* :math:`(N,S,M)`, or :math:`(S,M)` if packed.
        :param next_embeds: The embedding of the token that follows each
            position. *Shape:* Same as ``hidden``.
        :param seqs_layout: The layout of the trunk's input.

        :returns: The head's output at each position, to be projected to the
            logits of the token after the next one. *Shape:* Same as
            ``hidden``.
        """
        if next_embeds.shape != hidden.shape:
            raise ValueError(
                f"`next_embeds` must be of shape {tuple(hidden.shape)} to match `hidden`, but is of shape {tuple(next_embeds.shape)} instead."
            )

        # The embedding first, as in the released checkpoints' `fc`.
        seqs = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)

        seqs = self.fc(seqs)

        attn_bias_cache = AttentionBiasCache()

        for layer in self.layers:
            seqs = layer(seqs, seqs_layout, attn_bias_cache)

        return self.layer_norm(seqs)  # type: ignore[no-any-return]
