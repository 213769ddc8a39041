"""Builds dense Qwen3.5 models as fairseq2 :class:`TransformerLM` instances."""

from __future__ import annotations

import torch

from fairseq2.models.transformer import (
    CausalAttentionBias,
    FeedForwardNetwork,
    GLUFeedForwardNetwork,
    MultiheadAttention,
    TransformerEmbeddingFrontend,
    TransformerFrontend,
    create_default_sdpa,
)
from fairseq2.models.transformer_lm import TransformerLM, TransformerLMDecoder
from fairseq2.nn import (
    ColumnShardedLinear,
    Embedding,
    LayerNorm,
    Linear,
    PositionEncoder,
    Projection,
    StandardEmbedding,
    TiedProjection,
    VocabShardedEmbedding,
)

from qwen35_fs2.nn.attention import Qwen35Attention
from qwen35_fs2.models.qwen35.config import Qwen35Config, check_config
from qwen35_fs2.nn.decoder import Qwen35Decoder
from qwen35_fs2.nn.decoder_layer import Qwen35DecoderLayer
from qwen35_fs2.nn.gated_deltanet import GatedDeltaNet
from qwen35_fs2.nn.mtp import Qwen35MultiTokenPredictor
from qwen35_fs2.nn.normalization import ZeroCenteredRMSNorm
from qwen35_fs2.nn.rotary import PartialRotaryEncoder
from qwen35_fs2.nn.tp import TiedVocabShardedProjection


def create_qwen35_model(config: Qwen35Config) -> TransformerLM:
    return Qwen35Factory(config).create_model()


class Qwen35Factory:
    """Assembles a Qwen3.5 model; override a ``create_*`` method to change
    one part."""

    def __init__(self, config: Qwen35Config) -> None:
        check_config(config)

        self._config = config

    def create_model(self) -> TransformerLM:
        config = self._config

        embed = self.create_embedding()

        decoder_frontend = self.create_decoder_frontend(embed)

        decoder = self.create_decoder()

        final_proj = self.create_final_projection(embed)

        model = TransformerLM(
            config.model_dim,
            decoder_frontend,
            decoder,
            final_proj,
            config.pad_idx,
            config.max_seq_len,
        )

        if config.mtp_num_layers > 0:
            # `TransformerLM` is final and its forward pass is the trunk's:
            # the head is a submodule that the LM path never calls, so its
            # state-dict keys are `mtp.*`, as in the released checkpoints.
            model.mtp = self.create_mtp()

        return model

    def create_embedding(self) -> Embedding:
        config = self._config

        return VocabShardedEmbedding(
            config.vocab_size,
            config.model_dim,
            config.pad_idx,
            init_fn=self._init_embedding,
        )

    def create_decoder_frontend(self, embed: Embedding) -> TransformerFrontend:
        config = self._config

        return TransformerEmbeddingFrontend(
            config.model_dim, embed, pos_encoder=None, no_scale=True
        )

    def create_decoder(self) -> TransformerLMDecoder:
        config = self._config

        pos_encoder = self.create_position_encoder()

        layers = [
            self.create_decoder_layer(idx, pos_encoder) for idx in range(config.num_layers)
        ]

        layer_norm = self.create_layer_norm()

        return Qwen35Decoder(layers, layer_norm)

    def create_position_encoder(self) -> PositionEncoder:
        config = self._config

        return PartialRotaryEncoder(
            config.head_dim, config.rotary_dim, theta=config.rope_theta
        )

    def create_decoder_layer(
        self, layer_idx: int, pos_encoder: PositionEncoder
    ) -> Qwen35DecoderLayer:
        config = self._config

        # The layers of the MTP head are numbered after the trunk's, as in
        # vLLM, and are full-attention layers.
        if layer_idx < config.num_layers:
            layer_type = config.get_layer_types()[layer_idx]
        else:
            layer_type = "full_attention"

        mixer: MultiheadAttention | GatedDeltaNet

        if layer_type == "full_attention":
            mixer = self.create_self_attention(layer_idx, pos_encoder)
        else:
            mixer = self.create_gated_delta_net(layer_idx)

        self_attn_layer_norm = self.create_layer_norm()

        ffn = self.create_ffn(layer_idx)

        ffn_layer_norm = self.create_layer_norm()

        return Qwen35DecoderLayer(mixer, self_attn_layer_norm, ffn, ffn_layer_norm)

    def create_self_attention(
        self, layer_idx: int, pos_encoder: PositionEncoder
    ) -> MultiheadAttention:
        config = self._config

        sdpa = create_default_sdpa(CausalAttentionBias())

        return Qwen35Attention(
            config.model_dim,
            config.num_attn_heads,
            config.num_key_value_heads,
            config.head_dim,
            sdpa,
            pos_encoder,
            q_norm=self.create_layer_norm(config.head_dim),
            k_norm=self.create_layer_norm(config.head_dim),
            proj_init_fn=self._init_projection,
        )

    def create_gated_delta_net(self, layer_idx: int) -> GatedDeltaNet:
        config = self._config

        return GatedDeltaNet(
            config.model_dim,
            config.num_linear_key_heads,
            config.num_linear_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            config.linear_conv_kernel_size,
            norm_eps=config.rms_norm_eps,
            backend=config.gdn_backend,
            proj_init_fn=self._init_projection,
        )

    def create_ffn(self, layer_idx: int) -> FeedForwardNetwork:
        config = self._config

        return GLUFeedForwardNetwork(
            config.model_dim,
            config.ffn_inner_dim,
            bias=False,
            inner_dim_scale=1.0,
            proj_init_fn=self._init_projection,
        )

    def create_mtp(self) -> Qwen35MultiTokenPredictor:
        """Creates the multi-token-prediction head: its decoder layers are
        :meth:`create_decoder_layer` of the indices after the trunk's."""
        config = self._config

        fc = Linear(
            2 * config.model_dim,
            config.model_dim,
            bias=False,
            init_fn=self._init_projection,
        )

        pos_encoder = self.create_position_encoder()

        layers = [
            self.create_decoder_layer(config.num_layers + idx, pos_encoder)
            for idx in range(config.mtp_num_layers)
        ]

        return Qwen35MultiTokenPredictor(
            fc,
            pre_fc_norm_embedding=self.create_layer_norm(),
            pre_fc_norm_hidden=self.create_layer_norm(),
            layers=layers,
            layer_norm=self.create_layer_norm(),
        )

    def create_final_projection(self, embed: Embedding) -> Projection:
        config = self._config

        if config.tied_embeddings:
            if not isinstance(embed, StandardEmbedding | VocabShardedEmbedding):
                raise TypeError(
                    f"`embed` must be of type `{StandardEmbedding}` or `{VocabShardedEmbedding}` when `config.tied_embeddings` is `True`, but is of type `{type(embed)}` instead."
                )

            if isinstance(embed, VocabShardedEmbedding) and embed.tp_gang.size > 1:
                return TiedVocabShardedProjection(embed.weight, config.vocab_size, embed.tp_gang)

            return TiedProjection(embed.weight, bias=None)

        return ColumnShardedLinear(
            config.model_dim,
            config.vocab_size,
            bias=False,
            init_fn=self._init_projection,
        )

    def create_layer_norm(self, dim: int | None = None) -> LayerNorm:
        config = self._config

        if dim is None:
            dim = config.model_dim

        return ZeroCenteredRMSNorm(dim, eps=config.rms_norm_eps)

    def _init_projection(self, proj: Linear) -> None:
        torch.nn.init.normal_(proj.weight, std=self._config.init_std)

        if proj.bias is not None:
            torch.nn.init.zeros_(proj.bias)

    def _init_embedding(self, embed: StandardEmbedding) -> None:
        torch.nn.init.normal_(embed.weight, std=self._config.init_std)
