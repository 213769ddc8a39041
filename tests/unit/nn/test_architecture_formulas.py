"""The three formulas by which Qwen3.5's full-attention layers differ from a
standard transformer, checked against the forward math of the transformers
reference (``Qwen3_5RMSNorm`` and ``Qwen3_5Attention``), written out here
from the module's weights:

- the RMS norm gain is ``1 + weight`` (the weights are stored zero-centred);
- RoPE rotates only the first quarter of each head's dimensions;
- the attention output is gated per channel by ``sigmoid(gate)``, the gate of
  each head taken from the ``q_proj`` rows that follow its query rows.

The modules are those the model factory builds for the tiny configuration,
with random norm weights so that a missing ``1 +`` shows. The slow
Hugging Face parity tests check the same against transformers itself.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from fairseq2.models.transformer import AttentionBiasCache
from fairseq2.nn import BatchLayout

from qwen35_fs2.models.qwen35 import create_qwen35_model
from qwen35_fs2.nn.attention import Qwen35Attention
from qwen35_fs2.models.qwen35.config import Qwen35Config, tiny_qwen35_config
from qwen35_fs2.nn.decoder_layer import Qwen35DecoderLayer
from qwen35_fs2.nn.normalization import ZeroCenteredRMSNorm

# Qwen3.5 rotates 64 of the 256 dimensions of its attention heads.
ROTARY_FRACTION = 4


def _full_attention_layer(config: Qwen35Config) -> Qwen35DecoderLayer:
    torch.manual_seed(0)

    model = create_qwen35_model(config).eval()

    layer_idx = config.get_layer_types().index("full_attention")

    layer = model.decoder.layers[layer_idx]

    assert isinstance(layer, Qwen35DecoderLayer)

    # Released checkpoints have norm weights far from their zero init.
    with torch.no_grad():
        for module in layer.modules():
            if isinstance(module, ZeroCenteredRMSNorm):
                module.weight.normal_(std=0.5)

    return layer


def _attention(config: Qwen35Config) -> Qwen35Attention:
    attn = _full_attention_layer(config).self_attn

    assert isinstance(attn, Qwen35Attention)

    return attn


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``Qwen3_5RMSNorm``: normalizes in fp32 and scales by ``1 + weight``."""
    fp32_x = x.float()

    normed = fp32_x / torch.sqrt(fp32_x.square().mean(dim=-1, keepdim=True) + eps)

    return (normed * (1.0 + weight.float())).to(x.dtype)


def _rotate(x: Tensor, rotary_dim: int, theta: float) -> Tensor:
    """Rotates the pairs of dimensions ``(i, i + rotary_dim / 2)``, ``i <
    rotary_dim / 2``, of each head at position ``t`` by the angle ``t *
    theta^(-2i / rotary_dim)`` (NeoX layout); leaves the other dimensions as
    they are. *Shape:* :math:`(N,S,H,K)`."""
    half = rotary_dim // 2

    out = x.clone()

    for t in range(x.size(1)):
        for i in range(half):
            angle = t * theta ** (-2 * i / rotary_dim)

            cos, sin = math.cos(angle), math.sin(angle)

            a, b = x[:, t, :, i], x[:, t, :, i + half]

            out[:, t, :, i] = a * cos - b * sin
            out[:, t, :, i + half] = b * cos + a * sin

    return out


def _gated_attention(attn: Qwen35Attention, x: Tensor, config: Qwen35Config) -> Tensor:
    """``Qwen3_5Attention`` on ``x`` with the weights of ``attn``, causal, from
    position 0. *Shape:* :math:`(N,S,M)`."""
    batch_size, seq_len, _ = x.shape

    num_heads, num_kv_heads, head_dim = config.num_attn_heads, config.num_key_value_heads, config.head_dim

    rotary_dim = head_dim // ROTARY_FRACTION

    # The `q_proj` rows of head `h` are its query rows, then its gate rows.
    q_weight, gate_weight = attn.q_proj.weight.view(num_heads, 2, head_dim, -1).unbind(1)

    q = torch.einsum("nsm,hkm->nshk", x, q_weight)
    gate = torch.einsum("nsm,hkm->nshk", x, gate_weight)

    k = (x @ attn.k_proj.weight.T).view(batch_size, seq_len, num_kv_heads, head_dim)
    v = (x @ attn.v_proj.weight.T).view(batch_size, seq_len, num_kv_heads, head_dim)

    q = _rotate(_rms_norm(q, attn.q_norm.weight, config.rms_norm_eps), rotary_dim, config.rope_theta)
    k = _rotate(_rms_norm(k, attn.k_norm.weight, config.rms_norm_eps), rotary_dim, config.rope_theta)

    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()

    heads = []

    for h in range(num_heads):
        # Grouped-query attention: consecutive query heads share a key/value head.
        kv = h // (num_heads // num_kv_heads)

        scores = q[:, :, h] @ k[:, :, kv].transpose(1, 2) / math.sqrt(head_dim)

        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)

        heads.append((probs @ v[:, :, kv]) * torch.sigmoid(gate[:, :, h]))

    return torch.cat(heads, dim=-1) @ attn.output_proj.weight.T


class TestZeroCenteredRMSNorm:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_scales_the_normalized_input_by_one_plus_the_weight(self, dtype: torch.dtype) -> None:
        config = tiny_qwen35_config()

        norm = _full_attention_layer(config).self_attn_layer_norm

        x = torch.randn(2, 5, config.model_dim).to(dtype)

        expected = _rms_norm(x, norm.weight, config.rms_norm_eps)

        torch.testing.assert_close(norm(x), expected)


class TestPartialRotaryEncoder:
    def test_rotates_the_first_quarter_of_each_head_and_keeps_the_rest(self) -> None:
        config = tiny_qwen35_config()

        pos_encoder = _attention(config).pos_encoder

        x = torch.randn(2, 9, config.num_attn_heads, config.head_dim)

        y = pos_encoder(x, BatchLayout.of(x))

        rotary_dim = config.head_dim // ROTARY_FRACTION

        torch.testing.assert_close(y, _rotate(x, rotary_dim, config.rope_theta))

        assert torch.equal(y[..., rotary_dim:], x[..., rotary_dim:])

    def test_keeps_its_frequencies_when_the_model_is_cast_to_bf16_and_back(self) -> None:
        config = tiny_qwen35_config()

        pos_encoder = _attention(config).pos_encoder.bfloat16().float()

        rotary_dim = config.head_dim // ROTARY_FRACTION

        half = rotary_dim // 2

        # Far positions, where rounded frequencies turn by radians.
        x = torch.randn(1, 4096, 1, config.head_dim)

        y = pos_encoder(x, BatchLayout.of(x))

        angles = torch.arange(4096, dtype=torch.float64)[:, None] * config.rope_theta ** (-2 * torch.arange(half, dtype=torch.float64) / rotary_dim)

        cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]

        first, second = x[..., :half].double(), x[..., half:rotary_dim].double()

        expected = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

        torch.testing.assert_close(y[..., :rotary_dim].double(), expected, atol=2e-3, rtol=0)


class TestGatedAttention:
    def test_output_is_the_gated_attention_of_normed_partially_rotated_heads(self) -> None:
        config = tiny_qwen35_config()

        attn = _attention(config)

        x = torch.randn(2, 7, config.model_dim)

        seqs_layout = BatchLayout.of(x)

        with torch.no_grad():
            y = attn(x, seqs_layout, keys=x, keys_layout=seqs_layout, values=x, bias_cache=AttentionBiasCache())

            expected = _gated_attention(attn, x, config)

        torch.testing.assert_close(y, expected)
