"""The hybrid decoder layer of Qwen3.5."""

from __future__ import annotations

from typing import Literal, final, overload

from torch import Tensor
from typing_extensions import override

from fairseq2.models.transformer import (
    AttentionBiasCache,
    FeedForwardNetwork,
    MultiheadAttention,
)
from fairseq2.models.transformer_lm import TransformerLMDecoderLayer
from fairseq2.nn import BatchLayout, IncrementalStateBag, LayerNorm

from qwen35_fs2.nn.gated_deltanet import GatedDeltaNet
from qwen35_fs2.nn.moe.block import Qwen35MoeBlock
from qwen35_fs2.nn.moe.statistics import MoeRoutingStatistics
from qwen35_fs2.ops.varlen import VarlenMetadata


@final
class Qwen35DecoderLayer(TransformerLMDecoderLayer):
    """A pre-norm decoder layer whose token mixer is either gated full
    attention (``self_attn``) or Gated DeltaNet (``linear_attn``)::

        h = x + mixer(self_attn_layer_norm(x))
        y = h + ffn(ffn_layer_norm(h))

    Exactly one of ``self_attn`` and ``linear_attn`` is set, so the state-dict
    keys name the mixer a layer has, as in the released checkpoints.

    The ``ffn`` is fairseq2's dense feed-forward network or a
    :class:`Qwen35MoeBlock`; the layer hands an MoE block its batch layout,
    so that pads stay out of the routing statistics, and returns the
    block's statistics to the decoder, which records them.
    """

    self_attn: MultiheadAttention | None
    linear_attn: GatedDeltaNet | None

    def __init__(
        self,
        mixer: MultiheadAttention | GatedDeltaNet,
        self_attn_layer_norm: LayerNorm,
        ffn: FeedForwardNetwork,
        ffn_layer_norm: LayerNorm,
    ) -> None:
        super().__init__()

        self.self_attn_layer_norm = self_attn_layer_norm

        if isinstance(mixer, GatedDeltaNet):
            self.register_module("self_attn", None)

            self.linear_attn = mixer
        else:
            self.self_attn = mixer

            self.register_module("linear_attn", None)

        self.ffn_layer_norm = ffn_layer_norm

        self.ffn = ffn

        # Decided once: fairseq2's feed-forward networks take `seqs` alone.
        self._ffn_is_moe = isinstance(ffn, Qwen35MoeBlock)

    @overload  # type: ignore[override]
    def forward(
        self,
        seqs: Tensor,
        seqs_layout: BatchLayout,
        attn_bias_cache: AttentionBiasCache,
        *,
        state_bag: IncrementalStateBag | None = None,
        varlen: VarlenMetadata | None = None,
        return_moe_statistics: Literal[False] = False,
    ) -> Tensor: ...

    @overload
    def forward(
        self,
        seqs: Tensor,
        seqs_layout: BatchLayout,
        attn_bias_cache: AttentionBiasCache,
        *,
        state_bag: IncrementalStateBag | None = None,
        varlen: VarlenMetadata | None = None,
        return_moe_statistics: Literal[True],
    ) -> tuple[Tensor, MoeRoutingStatistics | None]: ...

    @override
    def forward(
        self,
        seqs: Tensor,
        seqs_layout: BatchLayout,
        attn_bias_cache: AttentionBiasCache,
        *,
        state_bag: IncrementalStateBag | None = None,
        varlen: VarlenMetadata | None = None,
        return_moe_statistics: bool = False,
    ) -> Tensor | tuple[Tensor, MoeRoutingStatistics | None]:
        """
        :param varlen: The documents of a packed batch, made once per batch
            by the decoder; made from ``seqs_layout`` if ``None``.
        :param return_moe_statistics: If ``True``, returns the routing
            statistics of an MoE ``ffn`` (``None`` for a dense one) with the
            output. Returned rather than recorded: under activation
            checkpointing and ``torch.compile``, a layer that changed Python
            state (appended to a recorder) would break its graph, which makes
            dynamo run the whole checkpointed layer eagerly; and a
            checkpoint's recomputation discards what it returns, so the
            statistics of a pass are the original pass's only.
        """
        residual = seqs

        seqs = self.self_attn_layer_norm(seqs)

        if self.linear_attn is not None:
            seqs = self.linear_attn(seqs, seqs_layout, state_bag=state_bag, varlen=varlen)
        else:
            assert self.self_attn is not None

            seqs = self.self_attn(
                seqs,
                seqs_layout,
                keys=seqs,
                keys_layout=seqs_layout,
                values=seqs,
                bias_cache=attn_bias_cache,
                state_bag=state_bag,
            )

        seqs = seqs + residual

        residual = seqs

        seqs = self.ffn_layer_norm(seqs)

        routing = None

        if not self._ffn_is_moe:
            seqs = self.ffn(seqs)
        elif return_moe_statistics:
            seqs, routing = self.ffn(seqs, seqs_layout, return_statistics=True)
        else:
            seqs = self.ffn(seqs, seqs_layout)

        seqs = seqs + residual

        if return_moe_statistics:
            return seqs, routing

        return seqs
