"""The MTP head's forward pass against a straightforward implementation of
its published definition written here in plain torch (vLLM's
``Qwen3_5MultiTokenPredictor`` with transformers' Qwen3.5 decoder layer),
reading the Hugging Face checkpoint's own tensors: dense and MoE, fp32,
padded and packed batches. No reference implementation of the head runs here
(transformers has none), so this is the check of the head's math and of its
key mapping (a swapped norm or projection gives other logits).

The trunk's hidden states come from our model, which the transformers parity
tests check; the head takes them and the embeddings of the next tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq2.nn import BatchLayout

from hf_reference import TinyQwen35Spec, read_safetensors_dir
from hf_reference.fixtures import TinyModelCache
from mtp_testing import with_mtp_config
from qwen35_fs2 import load_hf_model

pytestmark = pytest.mark.slow

_SPECS = {
    "dense": TinyQwen35Spec(layout="vlm", add_mtp=True),
    "moe": TinyQwen35Spec(layout="vlm", moe=True, add_mtp=True, seed=3),
}

_EPS = 1e-6


def _rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    """Zero-centred RMS norm: the checkpoint stores ``w`` of ``(1 + w)``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _EPS) * (1.0 + weight)


def _swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _rope(x: Tensor, positions: Tensor, rotary_dim: int, theta: float) -> Tensor:
    """NeoX (split-half) rotation of the first ``rotary_dim`` dimensions of
    each head. ``x``: (T, heads, head_dim); ``positions``: (T,)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)

    angles = positions.double()[:, None] * inv_freq[None, :]

    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).float()[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).float()[:, None, :]

    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]

    half = rotary_dim // 2

    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)

    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def _reference_mtp_document(
    hidden: Tensor, next_embeds: Tensor, w: dict[str, Tensor], text: dict[str, object]
) -> Tensor:
    """The head's output for one document: ``hidden`` and ``next_embeds``
    (T, H), positions 0 to T - 1."""
    num_heads = int(text["num_attention_heads"])  # type: ignore[call-overload]
    num_kv_heads = int(text["num_key_value_heads"])  # type: ignore[call-overload]
    head_dim = int(text["head_dim"])  # type: ignore[call-overload]

    rope = text.get("rope_parameters") or {}

    theta = float(rope.get("rope_theta", text.get("rope_theta", 1e7)))  # type: ignore[union-attr]
    rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))))  # type: ignore[union-attr]

    seq_len = hidden.size(0)

    # The embedding first.
    x = torch.cat([_rms_norm(next_embeds, w["mtp.pre_fc_norm_embedding.weight"]), _rms_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"])], dim=-1)

    x = x @ w["mtp.fc.weight"].T

    p = "mtp.layers.0."

    # Gated full attention.
    h = _rms_norm(x, w[p + "input_layernorm.weight"])

    q_gate = (h @ w[p + "self_attn.q_proj.weight"].T).view(seq_len, num_heads, 2 * head_dim)

    q, gate = q_gate[..., :head_dim], q_gate[..., head_dim:]

    k = (h @ w[p + "self_attn.k_proj.weight"].T).view(seq_len, num_kv_heads, head_dim)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).view(seq_len, num_kv_heads, head_dim)

    q = _rms_norm(q, w[p + "self_attn.q_norm.weight"])
    k = _rms_norm(k, w[p + "self_attn.k_norm.weight"])

    positions = torch.arange(seq_len)

    q = _rope(q, positions, rotary_dim, theta)
    k = _rope(k, positions, rotary_dim, theta)

    group = num_heads // num_kv_heads

    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)

    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)

    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()

    scores = scores.masked_fill(~causal, float("-inf"))

    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)

    attn = (attn * torch.sigmoid(gate)).reshape(seq_len, num_heads * head_dim)

    x = x + attn @ w[p + "self_attn.o_proj.weight"].T

    # The dense MLP or the MoE block.
    h = _rms_norm(x, w[p + "post_attention_layernorm.weight"])

    if p + "mlp.gate.weight" in w:
        top_k = int(text["num_experts_per_tok"])  # type: ignore[call-overload]

        probs = (h @ w[p + "mlp.gate.weight"].T).softmax(-1)

        top_w, top_idx = probs.topk(top_k, dim=-1)

        top_w = top_w / top_w.sum(-1, keepdim=True)

        gate_up, down = w[p + "mlp.experts.gate_up_proj"], w[p + "mlp.experts.down_proj"]

        inner_dim = gate_up.size(1) // 2

        y = torch.zeros_like(h)

        for t in range(seq_len):
            for j in range(top_k):
                e = int(top_idx[t, j])

                y[t] += top_w[t, j] * _swiglu(h[t : t + 1], gate_up[e, :inner_dim], gate_up[e, inner_dim:], down[e])[0]

        shared = _swiglu(h, w[p + "mlp.shared_expert.gate_proj.weight"], w[p + "mlp.shared_expert.up_proj.weight"], w[p + "mlp.shared_expert.down_proj.weight"])

        y = y + torch.sigmoid(h @ w[p + "mlp.shared_expert_gate.weight"].T) * shared
    else:
        y = _swiglu(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])

    x = x + y

    return _rms_norm(x, w["mtp.norm.weight"])


@pytest.fixture(scope="module")
def checkpoints(hf_tiny_models: TinyModelCache, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = hf_tiny_models.get_many(list(_SPECS.values()))

    return {name: with_mtp_config(d, tmp_path_factory.mktemp(name) / "ckpt") for name, d in zip(_SPECS, dirs, strict=True)}


@pytest.mark.parametrize("name", _SPECS)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_mtp_forward_matches_the_definition(name: str, packed: bool, checkpoints: dict[str, Path]) -> None:
    checkpoint = checkpoints[name]

    config = json.loads((checkpoint / "config.json").read_text())

    text = config.get("text_config", config)

    # In the text-only layout.
    tensors = {k.replace("model.language_model.", "model.", 1): v.float() for k, v in read_safetensors_dir(checkpoint).items()}

    model = load_hf_model(checkpoint, dtype=torch.float32).eval()

    vocab_size = int(text["vocab_size"])

    generator = torch.Generator().manual_seed(0)

    seq_lens = [9, 5]

    if packed:
        seqs = torch.randint(1, vocab_size, (sum(seq_lens),), generator=generator)

        layout = BatchLayout((sum(seq_lens),), seq_lens, packed=True)
    else:
        seqs = torch.randint(1, vocab_size, (2, max(seq_lens)), generator=generator)

        layout = BatchLayout((2, max(seq_lens)), seq_lens)

    # Any next tokens will do: the head is defined for any of them.
    next_seqs = torch.randint(1, vocab_size, seqs.shape, generator=generator)

    with torch.no_grad():
        embeds, embeds_layout = model.decoder_frontend(seqs, layout)

        hidden = model.decoder(embeds, embeds_layout)

        next_embeds = model.decoder_frontend.embed(next_seqs)

        logits = model.final_proj(model.mtp(hidden, next_embeds, layout))

        lm_head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])

        embed_table = tensors["model.embed_tokens.weight"]

        # The documents, each as (T, H), and where they are in the batch.
        if packed:
            begins = [0, seq_lens[0]]

            docs = [(hidden[b : b + n], next_seqs[b : b + n], logits[b : b + n]) for b, n in zip(begins, seq_lens)]
        else:
            docs = [(hidden[i, :n], next_seqs[i, :n], logits[i, :n]) for i, n in enumerate(seq_lens)]

        for doc_hidden, doc_next, doc_logits in docs:
            expected = _reference_mtp_document(doc_hidden, embed_table[doc_next], tensors, text) @ lm_head.T

            torch.testing.assert_close(doc_logits, expected, rtol=1e-4, atol=1e-4)
