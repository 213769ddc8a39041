"""Workaround: the attention mask of a packed or padded batch made before the
layers run, so that compiled attention layers do not break their graphs.

fairseq2 0.8.1's :class:`~fairseq2.models.transformer.TorchSDPA` (the
``torch`` choice of ``common.torch.default_sdpa``, the default) makes the
mask of a packed or padded batch in ``_get_attention_bias_tensor``, which is
marked ``torch.compiler.disable``: every compiled attention layer breaks its
graph there, even when the mask is already in the batch's
``AttentionBiasCache``. Under activation checkpointing a graph break inside
a checkpointed layer makes dynamo run the whole layer eagerly, so packed
training with ``trainer.activation_checkpointing`` and ``model.compile``
left every attention layer uncompiled.

:func:`make_attention_bias_cache` makes the mask once per forward pass,
outside the compiled layers: the tensor that fairseq2's public
``materialize_attention_bias`` makes (and ``TorchSDPA`` with it), but from
the layout's position tensor rather than its host lists of lengths, so that
it compiles too (in the MTP head's compiled loss, or a whole compiled
model) without a graph break or a recompilation per batch. :func:`run_sdpa`
runs what ``TorchSDPA.forward`` runs with it. Every other
SDPA (``flash2``, ``flash3``, ``naive``) and every call without a
precomputed mask goes to the SDPA module unchanged.
``tests/unit/compat/test_attention_mask.py`` fails if ``TorchSDPA`` stops
breaking the graph (then this module can go) or if the two paths or the two
masks differ.
"""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.functional import scaled_dot_product_attention

from fairseq2.models.transformer import (
    SDPA,
    AttentionBiasCache,
    CausalAttentionBias,
    TorchSDPA,
)
from fairseq2.nn import BatchLayout


@final
class PrecomputedMaskCache(AttentionBiasCache):
    """The bias cache of one forward pass, holding the materialized causal
    mask of its packed or padded batch."""

    def __init__(self, causal_mask: Tensor) -> None:
        super().__init__()

        self.causal_mask = causal_mask


def make_attention_bias_cache(
    layers: Module, seqs: Tensor, seqs_layout: BatchLayout, *, incremental: bool
) -> AttentionBiasCache:
    """Returns the bias cache for one forward pass of ``layers`` over
    ``seqs``: a :class:`PrecomputedMaskCache` if the batch is packed or
    padded and an attention layer among ``layers`` runs ``TorchSDPA`` with a
    causal bias, else fairseq2's own. The mask takes the device of ``seqs``
    and their dtype (autocast's under autocast), as the queries do.

    :param incremental: If ``True`` (decoding with a key/value cache), the
        keys' layout is not the queries', and fairseq2 makes the mask as
        usual.
    """
    if incremental:
        return AttentionBiasCache()

    # As `TorchSDPA` decides: a full batch runs `is_causal`, a padded one of
    # one token needs no mask.
    if not seqs_layout.packed and (not seqs_layout.padded or seqs_layout.max_seq_len == 1):
        return AttentionBiasCache()

    if not any(_takes_precomputed_mask(m) for m in layers.modules()):
        return AttentionBiasCache()

    # The dtype of the queries, which `TorchSDPA` makes the mask in: that of
    # the projections' output.
    if torch.is_autocast_enabled(seqs.device.type):
        dtype = torch.get_autocast_dtype(seqs.device.type)
    else:
        dtype = seqs.dtype

    mask = _materialize(seqs_layout, seqs.device, dtype)

    return PrecomputedMaskCache(mask)


def _materialize(seqs_layout: BatchLayout, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Returns what ``materialize_attention_bias(CausalAttentionBias(), ...)``
    returns for the packed or padded batch of ``seqs_layout``, bit for bit,
    from its ``position_indices`` (a tensor) instead of its host lists of
    lengths: so that a compiled function (the MTP head's loss, a whole
    compiled model) traces it without a graph break and without
    specializing on the lengths.

    Position ``i`` may attend to ``j`` if both are in the same document and
    ``j`` is not after ``i``; a pad may attend to every pad, as in fairseq2
    (a row without any allowed key would give NaN). The positions restart at
    0 in each document and are -1 at pads, so a position's document is the
    number of zeros up to it (0 at pads), and "``j`` not after ``i``" is
    "position ``j`` ≤ position ``i``", which holds between two pads.

    Run eagerly, it takes 1.5 times the bf16 mask's memory at its peak (the
    mask and a boolean temporary), against about 1 for fairseq2's (measured
    with 12,288 packed tokens in 1 and in 8 documents).

    *Shape:* :math:`(S,S)` if packed, :math:`(N,1,S,S)` if padded.
    """
    positions = seqs_layout.position_indices.to(device)

    documents = torch.cumsum(positions == 0, dim=-1) * (positions >= 0)

    allowed = documents.unsqueeze(-1) == documents.unsqueeze(-2)

    allowed &= positions.unsqueeze(-2) <= positions.unsqueeze(-1)

    zero, minus_inf = (torch.full((), value, device=device, dtype=dtype) for value in (0.0, -torch.inf))

    mask = torch.where(allowed, zero, minus_inf)

    # Padded: one mask for all heads of each sequence.
    return mask if seqs_layout.packed else mask.unsqueeze(1)


def _takes_precomputed_mask(module: Module) -> bool:
    if not isinstance(module, TorchSDPA):
        return False

    bias = module.bias

    return isinstance(bias, CausalAttentionBias) and bias.attn_window_len is None


def run_sdpa(
    sdpa: SDPA,
    q: Tensor,
    q_layout: BatchLayout,
    k: Tensor,
    k_layout: BatchLayout,
    v: Tensor,
    bias_cache: AttentionBiasCache,
) -> Tensor:
    """Returns ``sdpa(q, q_layout, k, k_layout, v, bias_cache)``'s attention;
    with the precomputed mask of ``bias_cache`` where ``sdpa`` would make
    that mask itself.

    *Shapes:* ``q`` :math:`(N,S,H,K)`, ``k`` and ``v`` :math:`(N,S,H,K)`;
    the output :math:`(N,S,H,V)`.
    """
    if isinstance(bias_cache, PrecomputedMaskCache) and _takes_precomputed_mask(sdpa) and q_layout is k_layout:
        assert isinstance(sdpa, TorchSDPA)

        return _torch_sdpa_with_mask(sdpa, q, k, v, bias_cache.causal_mask)

    attns, _ = sdpa(q, q_layout, k, k_layout, v, bias_cache)

    return attns


def _torch_sdpa_with_mask(sdpa: TorchSDPA, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """What ``TorchSDPA.forward`` computes for a batch whose mask is ``mask``."""
    dropout_p = sdpa.dropout_p if sdpa.training else 0.0

    # (N, S, H, K) -> (N, H, S, K)
    q, k, v = q.transpose(-2, -3), k.transpose(-2, -3), v.transpose(-2, -3)

    if sdpa.scale is not None:
        # `TorchSDPA` scales the queries: SDPA divides by `sqrt(K)` itself.
        q = q * (sdpa.scale * q.size(-1) ** 0.5)

    # `TorchSDPA` makes the mask in the queries' dtype; a no-op unless
    # autocast or the parameters give the queries another dtype than the
    # decoder predicted.
    attns = scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), dropout_p=dropout_p)

    # (N, H, S, V) -> (N, S, H, V)
    return attns.transpose(-2, -3)
